#!/usr/bin/env python3
"""PyTorch eager implementation of one DeepSeek-V4.1-Flash layer, written from
../shared/SPEC.md (sections 2-4, 6, 8), for the speed comparison with the CUDA
kernels of gpu/ (`v41 bench gpu` times the same layer: layer_decode_b64_ctx8K).

Same shapes and the same simplifications as the CUDA layer benchmark: a
ratio-1 layer that runs its indexer, bf16 weights (experts dequantized), keys
already in the caches (context `--ctx` per request, one row per request on
decode). Activation quantization points are kept (act_quant through
float8_e4m3fn with power-of-two scales per 32, fp4 quantize-dequantize of the
indexer query). Eager means one PyTorch op at a time, no torch.compile, no
CUDA graphs: the way a straightforward port runs.

usage: python3 gpu/bench/torch_layer.py [--batch 64] [--ctx 8192] [--json OUT]
"""
import argparse
import json
import math
import statistics
import sys

import torch

D, H, HD, R, QL, G, OL, W = 5120, 64, 512, 64, 1280, 8, 1024, 128
NI, DI, TOPK, E, KA, IM, HC = 32, 128, 512, 384, 6, 2304, 4
EPS, HC_EPS, NORM_EPS, ITERS, LIMIT = 1e-6, 1e-6, 1e-20, 20, 10.0
dev = "cuda"
bf16 = torch.bfloat16


def rms_norm(x, w, eps=EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(bf16)


def act_quant(x):
    """SPEC §2 act_quant(x, 32): UE8M0 scale per 32, e4m3 codes; returns q*scale (bf16)."""
    s = x.shape
    xf = x.float().reshape(-1, 32)
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / 448.0))))
    q = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(bf16).reshape(s)


FP4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device=dev)


def fp4_qdq_e8m0(x, g=32):
    s = x.shape
    xf = x.float().reshape(-1, g)
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    scale = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / 6.0))))
    v = (xf / scale).abs().clamp(max=6)
    code = (v.unsqueeze(-1) - FP4).abs().argmin(-1)   # nearest (ties: lower code; close enough for timing)
    return (FP4[code] * scale * xf.sign()).to(bf16).reshape(s)


def rope(x, pos, freqs, inverse=False):
    """interleaved pairs of the last R dims (SPEC §4)"""
    phi = pos.float()[:, None] * freqs[None, :]                  # [T, R/2]
    c, s = torch.cos(phi), torch.sin(phi)
    if inverse:
        s = -s
    shape = x.shape
    xr = x[..., -R:].float().reshape(shape[0], -1, R // 2, 2)
    c = c[:, None, :]
    s = s[:, None, :]
    a, b = xr[..., 0], xr[..., 1]
    out = torch.stack((a * c - b * s, a * s + b * c), -1).reshape(*shape[:-1], R).to(bf16)
    return torch.cat((x[..., :-R], out), -1)


def hc_mixes(X, fn, base, scale):
    T = X.shape[0]
    xf = X.reshape(T, -1).float()
    m = (xf @ fn.t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    pre = torch.sigmoid(m[:, :HC] * scale[0] + base[:HC]) + HC_EPS
    post = 2 * torch.sigmoid(m[:, HC:2 * HC] * scale[1] + base[HC:2 * HC])
    C = (m[:, 2 * HC:] * scale[2] + base[2 * HC:]).reshape(T, HC, HC)
    C = torch.softmax(C, -1) + HC_EPS
    C = C / (C.sum(-2, keepdim=True) + HC_EPS)
    for _ in range(ITERS - 1):
        C = C / (C.sum(-1, keepdim=True) + HC_EPS)
        C = C / (C.sum(-2, keepdim=True) + HC_EPS)
    return pre, post, C


def hc_pre(X, p):
    return (p[:, :, None] * X.float()).sum(1).to(bf16)


def hc_post(y, X, post, C):
    return (post[:, :, None] * y.float()[:, None, :] + torch.einsum("tij,tid->tjd", C, X.float())).to(bf16)


def sparse_attn(q, kv_win, kv_cmp, idx, sink, n_a):
    """q [T,H,d]; idx [T,L] rows into window pool (first n_a entries) / compressed pool; -1 = padding"""
    T, L = idx.shape
    valid = idx >= 0
    safe = idx.clamp_min(0)
    k = torch.cat((kv_win[safe[:, :n_a]], kv_cmp[safe[:, n_a:]]), 1)       # [T, L, d] gather
    s = torch.einsum("thd,tld->thl", q.float(), k.float()) / math.sqrt(HD)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1, keepdim=True), sink[None, :, None])
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
    o = torch.einsum("thl,tld->thd", p.to(bf16).float(), k.float()) / den
    return o.to(bf16)


def moe(x, gate_w, w13, w2, w13s, w2s):
    T = x.shape[0]
    logits = x.float() @ gate_w.float().t()
    s = torch.sqrt(torch.nn.functional.softplus(logits))
    wts, idx = torch.topk(s, KA, -1)
    wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * 1.5
    xq = act_quant(x)
    out = torch.zeros(T, D, device=dev)
    for e in torch.unique(idx).tolist():          # eager per-expert loop, as reference ports do
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        h = xq[rows] @ w13[e].t()
        g, u = h[:, :IM].float().clamp(max=LIMIT), h[:, IM:].float().clamp(-LIMIT, LIMIT)
        hh = act_quant((torch.nn.functional.silu(g) * u * wts[rows, slot, None]).to(bf16))
        out.index_add_(0, rows, (hh @ w2[e].t()).float())
    h = xq @ w13s.t()
    g, u = h[:, :IM].float().clamp(max=LIMIT), h[:, IM:].float().clamp(-LIMIT, LIMIT)
    out += (act_quant((torch.nn.functional.silu(g) * u).to(bf16)) @ w2s.t()).float()
    return out.to(bf16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--flush", choices=["clean", "dirty"], default="clean",
                    help="L2 flush before each run, as v41 bench gpu --flush: clean = a 256 MiB read (default), "
                         "dirty = a 256 MiB memset (leaves the L2 full of dirty lines)")
    a = ap.parse_args()
    T, S = a.batch, a.ctx
    torch.manual_seed(0)
    r = lambda *s, amp=0.02: (torch.rand(*s, device=dev) * 2 - 1).mul_(amp).to(bf16)
    NM = (2 + HC) * HC
    wq_a, wq_b, wkv = r(QL, D), r(H * HD, QL), r(HD, D)
    wo_a, wo_b = r(G, OL, H * HD // G), r(D, G * OL)
    iwq, iwp, gate = r(NI * DI, QL), r(NI, D), r(E, D)
    nw, qn, kvn = r(D, amp=1), r(QL, amp=1), r(HD, amp=1)
    fna, fnf = torch.rand(NM, HC * D, device=dev) * 0.01, torch.rand(NM, HC * D, device=dev) * 0.01
    base, scale, sink = torch.rand(NM, device=dev) * 0.1, torch.ones(3, device=dev), torch.rand(H, device=dev)
    w13, w2 = r(E, 2 * IM, D), r(E, D, IM)
    w13s, w2s = r(2 * IM, D), r(D, IM)
    freqs = 1.0 / (160000.0 ** (torch.arange(0, R, 2, device=dev).float() / R))
    X = r(T, HC, D, amp=1)
    kv_win, kv_cmp, ikeys = r(T * W, HD, amp=1), r(T * S, HD, amp=1), r(T * S, DI, amp=1)
    pos = torch.full((T,), S - 1, device=dev, dtype=torch.int64)
    win_idx = (torch.arange(T, device=dev)[:, None] * W + torch.arange(W, device=dev)[None, :])

    def attn_half(X):
        pre, post, C = hc_mixes(X, fna, base, scale)
        x = rms_norm(hc_pre(X, pre), nw)
        xq = act_quant(x)
        qr = rms_norm(xq @ wq_a.t(), qn)
        qrq = act_quant(qr)
        q = rope((qrq @ wq_b.t()).view(T, H, HD), pos, freqs)
        kv = act_quant(rope(rms_norm(xq @ wkv.t(), kvn).view(T, 1, HD), pos, freqs).view(T, HD))
        kv_win[win_idx[:, -1]] = kv
        iq = fp4_qdq_e8m0(rope((qrq @ iwq.t()).view(T, NI, DI), pos, freqs))
        iw = (x.float() @ iwp.float().t()) * (DI ** -0.5 * NI ** -0.5)
        sc = torch.einsum("thd,tsd->ths", iq.float(), ikeys.view(T, S, DI).float()).to(bf16).float().relu()
        I = (sc * iw.to(bf16).float()[:, :, None]).sum(1).to(bf16)
        top = torch.topk(I.float(), TOPK, -1).indices.sort(-1).values
        top = top + torch.arange(T, device=dev)[:, None] * S
        idx = torch.cat((win_idx, top), 1)
        o = sparse_attn(q, kv_win, kv_cmp, idx, sink, W)
        o = rope(o, pos, freqs, inverse=True).view(T, G, H * HD // G)
        u = act_quant(torch.einsum("tgk,gnk->tgn", o, wo_a).reshape(T, G * OL))
        y = u @ wo_b.t()
        return hc_post(y, X, post, C)

    def ffn_half(X):
        pre, post, C = hc_mixes(X, fnf, base, scale)
        x = rms_norm(hc_pre(X, pre), nw)
        return hc_post(moe(x, gate, w13, w2, w13s, w2s), X, post, C)

    def timeit(fn):
        for _ in range(2):
            fn(X)
        torch.cuda.synchronize()
        flush = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        flush32 = flush.view(torch.int32)
        ts = []
        for _ in range(a.reps):
            if a.flush == "dirty":
                flush.zero_()
            else:
                flush32.max()   # reads every line; writes one scalar
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn(X)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e-3)
        return statistics.median(ts)

    with torch.no_grad():
        ta = timeit(attn_half)
        tf = timeit(ffn_half)
    name = f"layer_decode_b{T}_ctx{S // 1024}K"
    res = {"schema": "v41-torch/1", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "l2_flush": a.flush,
           "ops": [{"name": name + "_attn_half", "median_s": ta}, {"name": name + "_ffn_half", "median_s": tf},
                   {"name": name, "median_s": ta + tf}]}
    for o in res["ops"]:
        print(f"torch eager  {o['name']:<40} {o['median_s'] * 1e6:10.1f} us")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        import os
        os.replace(a.json + ".tmp", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
