// engine.cu: v41_gpu_engine_create (the v41_engine interface on CUDA): the hybrid path,
// and the owner of the device weights that the device-resident decode step
// (engine_dev.cu) shares.
//
// What runs where in the hybrid path (README.md, section 'GPU kernels', "GPU engine"):
//  - every Linear of the forward pass (q/kv/o projections, grouped wo_a, compressor
//    and indexer projections, hc mixes, gate, routed + shared experts, Engram wkv,
//    final head, DSpark main_proj / Markov head / confidence) runs on the device,
//    weights uploaded once per engine (first use). Emulate-mode fp8/fp4 Linears keep
//    their storage format (codes tiled for v41g_wq, e8m0 scales) when it fits the
//    kernels and run v41g_act_quant then v41g_wq_gemm (from 256 rows on: the weight
//    dequantized to a bf16 scratch and a cuBLAS GEMM); other weights are dequantized
//    to bf16 (exact for fp8/fp4/bf16 checkpoints) for a cuBLAS bf16 GEMM with fp32
//    accumulation; fp32 Linears (and fp32 precision mode) a cuBLAS fp32 SGEMM (no
//    TF32); outputs rounded to bf16 where ref rounds.
//  - the orchestration (caches, window/compressed lists, compressor state,
//    indexer scores and top-k, candidate blocks, sparse attention, mHC Sinkhorn,
//    routing, Engram, DSpark control, replay/trimming, taps, teacher forcing) is
//    the reference code compiled a second time (gpu/engine_hyb.c) and runs on the
//    host between the device calls.
//
// The Linear hook finds its engine through a thread-local pointer that the
// engine's own vtable entries set for the duration of a call (and restore), so
// two engines never share state; a Linear called from any other thread (none in
// the current orchestration) falls back to the CPU v41_linear_ld.
#define restrict __restrict__
#include "g_internal.cuh"
#include "v41_engine.h"
#include "v41_ops.h"
#include "v41_quant.h"
#include "engine_gpu.h"
#include <cublas_v2.h>
#include <map>
#include <tuple>
#include <vector>
#include <string.h>
#include <stdlib.h>
#include <math.h>

extern "C" int v41gh_ref_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out,
                                       v41_err *err);
extern "C" int v41gh_linear(const v41_lin *L, const float *x, int64_t M, float *y, bool emu, v41_err *err);
extern "C" void v41gh_sparse_attn_row(const float *q, int H, int d, const float *const *kp, int n, const float *sink,
                                      float scale, float *out, bool emu);
extern "C" void v41gh_rmsnorm(const float *x, const float *w, int64_t n, double eps, float *y, bool emu);
extern "C" void v41gh_indexer_scores_rows(const float *q, const float *w, int n, int nI, int dI, const float *keys,
                                          int cap, int Lc, const int *Lt, bool relu, bool emu, float *scores,
                                          int64_t ld);
extern "C" void v41gh_indexer_topk_rows(const float *scores, int64_t ld, int n, int L, int k, const int *Lt,
                                        int32_t *out, int64_t ldo, int width, uint8_t *amb);
extern "C" void v41gh_rope_apply(const v41_rope *rp, float *x, int64_t pos, bool inverse, bool interleaved, bool emu);
extern "C" void v41gh_hc_pre(const float *X, const float *pre, int hc, int64_t D, float *y, bool emu);
extern "C" void v41gh_hc_post(const float *y, const float *X, const float *post, const float *comb, int hc, int64_t D,
                              float *Xout, bool emu);
extern "C" int v41gh_omp_single(void);
extern "C" void v41gh_omp_restore(int n);
extern "C" void v41gh_set_threads(v41_engine *e, int n);
extern "C" int v41gh_linear_ld(const v41_lin *L, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                               bool emu, v41_err *err);

namespace {

struct gh_w {
    void *d = nullptr;
    bool bf = false;   // bf16 bits (else fp32)
    v41g_wq q = {};    // q.w != NULL: packed in the storage format (d is NULL; bf true: the values are bf16)
};

// (tensor, row0, N, K, mode): mode 0 fp32, 1 bf16, 2 packed when the format allows (else bf16)
typedef std::tuple<const void *, int64_t, int64_t, int64_t, int> gh_key;

struct gh_ctx {
    cublasHandle_t h = nullptr;
    std::map<gh_key, gh_w> w;
    size_t wbytes = 0;
    long n_packed = 0;   // weights kept in their storage format
    void *dx = nullptr, *dq = nullptr, *dy = nullptr;
    size_t cx = 0, cq = 0, cy = 0;
    void *dws = nullptr;   // packed Linears' workspace (v41g_wq_linear): split-K partials, or the bf16 copy for large M
    size_t cws = 0;
    std::vector<float> a, yb;
    std::vector<uint16_t> ab;
    long n_gpu = 0, n_cpu = 0;
    // sparse attention rows
    void *aq = nullptr, *akv = nullptr, *aidx = nullptr, *asink = nullptr, *ao = nullptr;
    size_t caq = 0, cakv = 0, caidx = 0, casink = 0, cao = 0;
    std::vector<uint16_t> hq, hkv, ho;
    std::vector<int32_t> hidx;
    long n_attn_gpu = 0, n_attn_cpu = 0;
    // small ops (RMSNorm, RoPE, hc_pre, hc_post): device scratch slots
    void *sp[6] = {};
    size_t sc[6] = {};
    std::vector<uint16_t> hb0, hb1;
    long n_small_gpu = 0, n_small_cpu = 0;
    // indexer scores (one call per request and index layer): device scratch q, w, keys, kbase, visible, I
    void *ip[6] = {};
    size_t ic[6] = {};
    std::vector<uint16_t> hiq, hik;
    std::vector<float> hiI;
    std::vector<int64_t> hikb;
    long n_idx_gpu = 0, n_idx_cpu = 0;
    // indexer top-k: device scratch scores, visible, out, tie flags
    void *tp[4] = {};
    size_t tc[4] = {};
    std::vector<float> htI;
    std::vector<int32_t> hto;
    std::vector<uint8_t> htt;
    long n_topk_gpu = 0, n_topk_cpu = 0;
    const v41_engine_vtbl *ref = nullptr;
    v41_engine_vtbl vt;
    gd_ctx *dev = nullptr;   // the device-resident decode path (engine_dev.cu), NULL when off
};

thread_local gh_ctx *tl_ctx = nullptr;

struct gh_scope {   // sets the thread's engine (and one OpenMP thread) for one vtable call
    gh_ctx *prev;
    int nthr;
    explicit gh_scope(gh_ctx *g) : prev(tl_ctx), nthr(v41gh_omp_single()) { tl_ctx = g; }
    ~gh_scope() { tl_ctx = prev; v41gh_omp_restore(nthr); }
};

inline gh_ctx *ctx_of(v41_engine *e) { return (gh_ctx *)e->impl; }


int grow(void **p, size_t *cap, size_t n, v41_err *err)
{
    if (n <= *cap) return V41_OK;
    if (*p) cudaFree(*p);
    *p = nullptr;
    *cap = 0;
    cudaError_t ce = cudaMalloc(p, n);
    if (ce != cudaSuccess)
        return v41_err_set(err, V41_ENOMEM, "gpu engine: cudaMalloc(%zu): %s", n, cudaGetErrorString(ce));
    *cap = n;
    return V41_OK;
}

int cuda_err(cudaError_t ce, const char *what, v41_err *err)
{
    if (ce == cudaSuccess) return V41_OK;
    return v41_err_set(err, V41_EINTERNAL, "gpu engine: %s: %s", what, cudaGetErrorString(ce));
}

// y[M, N] = x[M, K] . deq(q)^T for a packed Linear (x bf16 on the device). From M = 256 rows on
// (V41G_WQ_DEQUANT_ROWS),
// the weight is dequantized into a bf16 scratch and the GEMM goes to cuBLAS (the tensor-core
// rate of a large GEMM is cuBLAS's; the dequantization costs 3 bytes per weight element, small
// next to 2*M flops per element); below, v41g_wq_gemm reads the packed codes directly.
// Returns 0 or a CUDA error code.
int gh_wq_linear(const v41g_wq *q, const uint16_t *x, int M, void *y, bool f32, gh_ctx *g, v41g_stream st)
{
    v41_err e = {};
    const size_t need = v41g_wq_linear_ws_bytes(q, M);
    if (need && grow(&g->dws, &g->cws, need, &e)) return (int)cudaErrorMemoryAllocation;
    return v41g_wq_linear(q, x, M, y, f32 ? 1 : 0, g->dws, g->cws, st);
}

// Weight of a Linear on the device: uploaded on first use, kept until destroy. want_pack: an
// fp8/fp4 Linear whose format fits v41g_wq stays packed (W->q).
int get_weight(gh_ctx *g, const v41_lin *L, bool want_bf, bool want_pack, gh_w **out, v41_err *err)
{
    want_pack = want_pack && want_bf && L->kind == V41_LIN_Q;
    gh_key k(L->w, L->row0, L->N, L->K, want_pack ? 2 : want_bf ? 1 : 0);
    auto it = g->w.find(k);
    if (it != g->w.end()) { *out = &it->second; return V41_OK; }
    const int64_t N = L->N, K = L->K;
    gh_wq_host P;
    if (want_pack && gh_pack_host(L, &P)) {
        gh_w W;
        uint8_t *dc = nullptr;
        void *ds = nullptr;
        size_t tstride = 0;
        cudaError_t ce = (cudaError_t)gh_upload_tiled(P.fmt, (int)N, (int)K, 1, P.codes.data(), P.codes.size(), &dc,
                                                      &tstride);
        if (ce == cudaSuccess) ce = cudaMalloc(&ds, P.scales.size());
        if (ce == cudaSuccess) ce = cudaMemcpy(ds, P.scales.data(), P.scales.size(), cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) {
            cudaFree(dc);
            cudaFree(ds);
            cudaGetLastError();
            return v41_err_set(err, V41_ENOMEM, "gpu engine: weight %s (packed): %s", L->w->name ? L->w->name : "?",
                               cudaGetErrorString(ce));
        }
        W.bf = true;
        W.q.fmt = P.fmt;
        W.q.N = (int)N;
        W.q.K = (int)K;
        W.q.r0 = P.r0;
        W.q.w = (const uint8_t *)dc;
        W.q.s = (const uint8_t *)ds;
        g->wbytes += tstride + P.scales.size();
        g->n_packed++;
        auto ins = g->w.emplace(k, W);
        *out = &ins.first->second;
        return V41_OK;
    }
    std::vector<float> t((size_t)(N * K));
    int rc = v41_dequant_rows(L->w, L->s, L->row0, N, t.data(), err);
    if (rc) return rc;
    gh_w W;
    bool bf = want_bf;
    if (bf)
        for (size_t i = 0; i < t.size() && bf; i++) bf = bf_exact(t[i]);
    size_t nb = t.size() * (bf ? 2 : 4);
    cudaError_t ce = cudaMalloc(&W.d, nb);
    if (ce != cudaSuccess)
        return v41_err_set(err, V41_ENOMEM, "gpu engine: weight %s: cudaMalloc(%zu): %s",
                           L->w->name ? L->w->name : "?", nb, cudaGetErrorString(ce));
    if (bf) {
        std::vector<uint16_t> b(t.size());
        for (size_t i = 0; i < t.size(); i++) b[i] = bf_bits(t[i]);
        ce = cudaMemcpy(W.d, b.data(), nb, cudaMemcpyHostToDevice);
    } else ce = cudaMemcpy(W.d, t.data(), nb, cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) { cudaFree(W.d); return cuda_err(ce, "weight upload", err); }
    W.bf = bf;
    g->wbytes += nb;
    auto ins = g->w.emplace(k, W);
    *out = &ins.first->second;
    return V41_OK;
}

int gh_forward(v41_engine *e, const v41_batch *b, v41_out *out, v41_err *err)
{
    gh_scope s(ctx_of(e));
    gh_ctx *g = ctx_of(e);
    int r = gd_forward(g->dev, e, b, out, err);   // a decode batch on the device
    if (r > 0) return V41_OK;
    if (r < 0) return err && err->code ? err->code : V41_EINTERNAL;
    int rc = gd_to_host(g->dev, e, err);           // the host orchestration needs every row
    if (rc) return rc;
    rc = g->ref->forward(e, b, out, err);
    gd_host_wrote(g->dev, e, b);
    return rc;
}
int gh_draft(v41_engine *e, int req_id, int p, int32_t first, int32_t *ids, float *conf, v41_err *err)
{
    gh_scope s(ctx_of(e));
    int rc = gd_to_host(ctx_of(e)->dev, e, err);
    return rc ? rc : ctx_of(e)->ref->dspark_draft(e, req_id, p, first, ids, conf, err);
}
int gh_draft_batch(v41_engine *e, int n, const int *req_ids, const int *ps, const int32_t *firsts, int32_t *ids,
                   float *conf, v41_err *err)
{
    gh_scope s(ctx_of(e));
    int rc = gd_to_host(ctx_of(e)->dev, e, err);
    return rc ? rc : ctx_of(e)->ref->dspark_draft_batch(e, n, req_ids, ps, firsts, ids, conf, err);
}
int gh_truncate(v41_engine *e, int req_id, int pos, v41_err *err)
{
    gh_scope s(ctx_of(e));
    int rc = gd_to_host(ctx_of(e)->dev, e, err);
    if (!rc) rc = ctx_of(e)->ref->truncate(e, req_id, pos, err);
    if (!rc) gd_host_truncated(ctx_of(e)->dev, e, req_id, pos);
    return rc;
}
int gh_fork(v41_engine *e, int src, int dst, int n, v41_err *err)
{
    gh_scope s(ctx_of(e));
    int rc = gd_to_host(ctx_of(e)->dev, e, err);
    if (!rc) rc = ctx_of(e)->ref->fork(e, src, dst, n, err);
    if (!rc) gd_host_truncated(ctx_of(e)->dev, e, dst, 0);   // the new request's rows are host rows
    return rc;
}
void gh_release(v41_engine *e, int req_id)
{
    gd_host_truncated(ctx_of(e)->dev, e, req_id, 0);   // a later request in this slot starts from the host
    ctx_of(e)->ref->release(e, req_id);
}
void gh_destroy(v41_engine *e)
{
    if (!e) return;
    gh_ctx *g = ctx_of(e);
    gd_destroy(g->dev);   // before the ref engine: it reads the slots' state
    g->dev = nullptr;
    e->impl = nullptr;
    const v41_engine_vtbl *ref = g->ref;
    e->vt = ref;
    ref->destroy(e);
    if (g_env_flag("V41_GPU_VERBOSE"))
        fprintf(stderr, "gpu engine: %ld Linears on the device, %ld on the host, %.1f MiB of weights uploaded "
                "(%ld kept fp8/fp4); "
                "%ld attention rows on the device, %ld on the host; %ld small ops on the device, %ld on the host; "
                "%ld indexer score blocks on the device, %ld on the host; %ld top-k blocks on the device, %ld on the host\n",
                g->n_gpu, g->n_cpu, (double)g->wbytes / 1048576.0, g->n_packed, g->n_attn_gpu, g->n_attn_cpu, g->n_small_gpu,
                g->n_small_cpu, g->n_idx_gpu, g->n_idx_cpu, g->n_topk_gpu, g->n_topk_cpu);
    for (auto &kv : g->w) {
        cudaFree(kv.second.d);
        cudaFree((void *)kv.second.q.w);
        cudaFree((void *)kv.second.q.s);
    }
    if (g->dws) cudaFree(g->dws);
    if (g->dx) cudaFree(g->dx);
    if (g->dq) cudaFree(g->dq);
    if (g->dy) cudaFree(g->dy);
    for (void *p : {g->aq, g->akv, g->aidx, g->asink, g->ao})
        if (p) cudaFree(p);
    for (void *p : g->sp)
        if (p) cudaFree(p);
    for (void *p : g->ip)
        if (p) cudaFree(p);
    for (void *p : g->tp)
        if (p) cudaFree(p);
    if (g->h) cublasDestroy(g->h);
    delete g;
}

}  // namespace

int gh_dev_weight(v41_engine *e, const v41_lin *L, bool want_bf, const void **d, bool *is_bf, v41g_wq *q,
                  v41_err *err)
{
    gh_w *W;
    int rc = get_weight(ctx_of(e), L, want_bf, q != nullptr, &W, err);
    if (rc) return rc;
    *d = W->d;
    *is_bf = W->bf;
    if (q) *q = W->q;
    return V41_OK;
}

// e8m0 byte of a scale value that is a normal power of two (-1 otherwise)
static int e8m0_of(const v41_tensor *s, int64_t i)
{
    if (s->dtype == V41_DT_F8_E8M0) return ((const uint8_t *)s->data)[i];
    float f;
    if (s->dtype == V41_DT_F32) memcpy(&f, (const uint8_t *)s->data + 4 * i, 4);
    else if (s->dtype == V41_DT_BF16) {
        uint16_t b;
        memcpy(&b, (const uint8_t *)s->data + 2 * i, 2);
        f = bf_val(b);
    } else
        return -1;
    uint32_t u;
    memcpy(&u, &f, 4);
    const int e = (int)(u >> 23);   // sign must be 0 and the mantissa 0
    return (u & 0x807fffffu) || e == 0 || e == 255 ? -1 : e;
}

int gh_upload_tiled(int fmt, int N, int K, int groups, const uint8_t *codes, size_t group_bytes, uint8_t **out,
                    size_t *stride)
{
    *out = nullptr;
    const size_t tb = v41g_wq_tiled_bytes(fmt, N, K);
    if (!tb || groups <= 0) return (int)cudaErrorInvalidValue;
    uint8_t *tmp = nullptr, *d = nullptr;
    cudaError_t ce = cudaMalloc(&tmp, group_bytes * groups);
    if (ce == cudaSuccess) ce = cudaMalloc(&d, tb * groups);
    if (ce == cudaSuccess) ce = cudaMemcpy(tmp, codes, group_bytes * groups, cudaMemcpyHostToDevice);
    int rc = (int)ce;
    for (int gi = 0; gi < groups && !rc; gi++) rc = v41g_wq_tile(fmt, N, K, tmp + gi * group_bytes, d + gi * tb, NULL);
    if (!rc) rc = (int)cudaDeviceSynchronize();
    cudaFree(tmp);
    if (rc) {
        cudaFree(d);
        cudaGetLastError();
        return rc;
    }
    *out = d;
    *stride = tb;
    return 0;
}

bool gh_pack_host(const v41_lin *L, gh_wq_host *out)
{
    const v41_tensor *w = L->w, *s = L->s;
    if (!w || !s || w->ndim != 2 || s->ndim < 1 || s->ndim > 2 || L->kind != V41_LIN_Q) return false;
    const int64_t Nf = w->shape[0], K = w->shape[1], N = L->N, r0 = L->row0;
    if (K != L->K || K % 32 || r0 < 0 || r0 + N > Nf || K > INT32_MAX || N > INT32_MAX) return false;
    const int64_t sr = s->ndim == 2 ? s->shape[0] : 1, sc = s->shape[s->ndim - 1], nbk = K / 32;
    const uint8_t *d = (const uint8_t *)w->data;
    gh_wq_host P;
    if (w->dtype == V41_DT_F8_E4M3) {
        if (sr != (Nf + 31) / 32 || sc != nbk) return false;   // 32x32 blocks only (not row-wise scales)
        const int64_t b0 = r0 / 32, b1 = (r0 + N + 31) / 32;
        P.fmt = V41G_WQ_FP8;
        P.r0 = (int)(r0 % 32);
        P.codes.assign(d + r0 * K, d + (r0 + N) * K);
        P.scales.resize((size_t)((b1 - b0) * nbk));
        for (int64_t i = 0; i < (b1 - b0) * nbk; i++) {
            const int e = e8m0_of(s, b0 * nbk + i);
            if (e < 10 || e > 134) return false;
            P.scales[(size_t)i] = (uint8_t)e;
        }
        for (uint8_t c : P.codes)
            if ((c & 0x7f) == 0x7f) return false;   // e4m3 NaN
    } else if (w->dtype == V41_DT_F4) {
        if (sr != Nf || sc != nbk) return false;
        P.fmt = V41G_WQ_FP4;
        P.codes.assign(d + r0 * K / 2, d + (r0 + N) * K / 2);
        P.scales.resize((size_t)(N * nbk));
        for (int64_t i = 0; i < N * nbk; i++) {
            const int e = e8m0_of(s, r0 * nbk + i);
            if (e < 2 || e > 254) return false;
            P.scales[(size_t)i] = (uint8_t)e;
        }
    } else
        return false;
    *out = std::move(P);
    return true;
}

extern "C" int v41gh_linear(const v41_lin *L, const float *x, int64_t M, float *y, bool emu, v41_err *err)
{
    return v41gh_linear_ld(L, x, L->K, M, y, L->N, emu, err);
}

// The Linear of SPEC §2 on the device (same contract as ref's v41_linear_ld).
extern "C" int v41gh_linear_ld(const v41_lin *L, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                               bool emu, v41_err *err)
{
    gh_ctx *g = tl_ctx;
    const int64_t N = L->N, K = L->K;
    if (M <= 0 || N <= 0) return V41_OK;
    if (!g) return v41_linear_ld(L, x, ldx, M, y, ldy, emu, err);
    const bool quant = emu && L->kind == V41_LIN_Q;
    const bool round_out = emu && L->kind != V41_LIN_F32;
    const bool want_bf = emu && L->kind != V41_LIN_F32;
    if (quant && K % 32)
        return v41_err_set(err, V41_EINVAL, "%s: fp8/fp4 Linear needs K %% 32 == 0 (K = %lld)",
                           L->w->name ? L->w->name : "?", (long long)K);
    gh_w *W;
    int rc = get_weight(g, L, want_bf, quant, &W, err);
    if (rc) return rc;
    const size_t MK = (size_t)(M * K);
    g->a.resize(MK);
    bool exact = true, host_q = false;
    for (int64_t r = 0; r < M; r++) {
        memcpy(g->a.data() + r * K, x + r * ldx, sizeof(float) * (size_t)K);
        if (W->bf)
            for (int64_t i = 0; i < K && exact; i++) exact = bf_exact(g->a[(size_t)(r * K + i)]);
    }
    if (quant && (!W->bf || !exact)) {
        // input not bf16 (or weight kept fp32): act_quant on the host (its output is bf16-exact)
        for (int64_t r = 0; r < M; r++) v41_act_quant(g->a.data() + r * K, (size_t)K, 32, NULL);
        host_q = true;
        exact = true;
    }
    if (W->bf && !exact) {   // a bf16 Linear fed non-bf16 activations: keep ref's fp32 product
        g->n_cpu++;
        return v41_linear_ld(L, x, ldx, M, y, ldy, emu, err);
    }
    rc = grow(&g->dy, &g->cy, sizeof(float) * (size_t)(M * N), err);
    if (rc) return rc;
    if (W->bf) {
        g->ab.resize(MK);
        for (size_t i = 0; i < MK; i++) g->ab[i] = bf_bits(g->a[i]);
        if ((rc = grow(&g->dx, &g->cx, 2 * MK, err))) return rc;
        if ((rc = cuda_err(cudaMemcpy(g->dx, g->ab.data(), 2 * MK, cudaMemcpyHostToDevice), "h2d", err))) return rc;
        const uint16_t *xin = (const uint16_t *)g->dx;
        if (quant && !host_q) {
            if ((rc = grow(&g->dq, &g->cq, 2 * MK, err))) return rc;
            int kr = v41g_act_quant((const uint16_t *)g->dx, NULL, NULL, (uint16_t *)g->dq, (int)M, (int)K, NULL);
            if (kr) return v41_err_set(err, V41_EINTERNAL, "gpu engine: act_quant: %s", v41g_error_string(kr));
            xin = (const uint16_t *)g->dq;
        }
        int kr = W->q.w ? gh_wq_linear(&W->q, xin, (int)M, g->dy, true, g, NULL)
                        : v41g_gemm_bf16(xin, (const uint16_t *)W->d, g->dy, (int)M, (int)N, (int)K, 1, 1, 0, 0, 0, NULL);
        if (kr) return v41_err_set(err, V41_EINTERNAL, "gpu engine: %s GEMM %s: %s", W->q.w ? "storage-format" : "bf16",
                                   L->w->name ? L->w->name : "?", v41g_error_string(kr));
    } else {
        if ((rc = grow(&g->dx, &g->cx, 4 * MK, err))) return rc;
        if ((rc = cuda_err(cudaMemcpy(g->dx, g->a.data(), 4 * MK, cudaMemcpyHostToDevice), "h2d", err))) return rc;
        const float one = 1.0f, zero = 0.0f;
        // row-major y[M,N] = x[M,K] . W[N,K]^T  ==  column-major y^T[N,M] = W^T(op T) . x^T
        cublasStatus_t st = cublasSgemm(g->h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one,
                                        (const float *)W->d, (int)K, (const float *)g->dx, (int)K, &zero,
                                        (float *)g->dy, (int)N);
        if (st != CUBLAS_STATUS_SUCCESS)
            return v41_err_set(err, V41_EINTERNAL, "gpu engine: fp32 GEMM %s: cuBLAS status %d",
                               L->w->name ? L->w->name : "?", (int)st);
    }
    g->yb.resize((size_t)(M * N));
    if ((rc = cuda_err(cudaMemcpy(g->yb.data(), g->dy, sizeof(float) * (size_t)(M * N), cudaMemcpyDeviceToHost),
                       "d2h", err)))
        return rc;
    for (int64_t r = 0; r < M; r++) {
        float *dst = y + r * ldy;
        const float *src = g->yb.data() + r * N;
        if (round_out)
            for (int64_t j = 0; j < N; j++) dst[j] = v41_bf16r(src[j]);
        else
            memcpy(dst, src, sizeof(float) * (size_t)N);
    }
    g->n_gpu++;
    return V41_OK;
}

// One query row of sparse attention with sink (SPEC §4.4) on the device: the row's
// keys (K = V) are packed in list order into a bf16 buffer, -1 entries (kp NULL)
// become -1 in the index list, then v41g_sparse_attn (T = 1). Emulate mode only
// (the kernel implements its rounding points); inputs that are not bf16 values,
// fp32 mode, head dims the kernel does not take, or any device error fall back to
// the CPU row (counted; the hook cannot return an error).
namespace {
bool attn_dev(gh_ctx *g, const float *q, int H, int d, const float *const *kp, int n, const float *sink,
              float scale, float *out)
{
    if (n <= 0 || d % 16 || d > 512) return false;
    const size_t Hd = (size_t)H * d;
    g->hq.resize(Hd);
    for (size_t i = 0; i < Hd; i++) {
        if (!bf_exact(q[i])) return false;
        g->hq[i] = bf_bits(q[i]);
    }
    g->hkv.assign((size_t)n * d, 0);
    g->hidx.resize((size_t)n);
    for (int j = 0; j < n; j++) {
        g->hidx[j] = kp[j] ? j : -1;
        if (!kp[j]) continue;
        for (int i = 0; i < d; i++) {
            if (!bf_exact(kp[j][i])) return false;
            g->hkv[(size_t)j * d + i] = bf_bits(kp[j][i]);
        }
    }
    v41_err e2 = {};
    if (grow(&g->aq, &g->caq, 2 * Hd, &e2) || grow(&g->ao, &g->cao, 2 * Hd, &e2) ||
        grow(&g->akv, &g->cakv, 2 * (size_t)n * d, &e2) || grow(&g->aidx, &g->caidx, 4 * (size_t)n, &e2) ||
        (sink && grow(&g->asink, &g->casink, 4 * (size_t)H, &e2)))
        return false;
    if (cudaMemcpy(g->aq, g->hq.data(), 2 * Hd, cudaMemcpyHostToDevice) != cudaSuccess) return false;
    if (cudaMemcpy(g->akv, g->hkv.data(), 2 * (size_t)n * d, cudaMemcpyHostToDevice) != cudaSuccess) return false;
    if (cudaMemcpy(g->aidx, g->hidx.data(), 4 * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess) return false;
    if (sink && cudaMemcpy(g->asink, sink, 4 * (size_t)H, cudaMemcpyHostToDevice) != cudaSuccess) return false;
    int kr = v41g_sparse_attn((const uint16_t *)g->aq, (const uint16_t *)g->akv, (const uint16_t *)g->akv,
                              (const int32_t *)g->aidx, n, n, sink ? (const float *)g->asink : NULL, scale, 1, H, d,
                              (uint16_t *)g->ao, NULL);
    if (kr) {
        fprintf(stderr, "gpu engine: sparse attention: %s (row done on the host)\n", v41g_error_string(kr));
        return false;
    }
    g->ho.resize(Hd);
    if (cudaMemcpy(g->ho.data(), g->ao, 2 * Hd, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
    for (size_t i = 0; i < Hd; i++) {
        uint32_t u = (uint32_t)g->ho[i] << 16;
        memcpy(&out[i], &u, 4);
    }
    return true;
}
}  // namespace

extern "C" void v41gh_sparse_attn_row(const float *q, int H, int d, const float *const *kp, int n, const float *sink,
                                      float scale, float *out, bool emu)
{
    gh_ctx *g = tl_ctx;
    if (g && emu && attn_dev(g, q, H, d, kp, n, sink, scale, out)) {
        g->n_attn_gpu++;
        return;
    }
    if (g) g->n_attn_cpu++;
    v41_sparse_attn_row(q, H, d, kp, n, sink, scale, out, emu);
}

// ---- small ops, one row per call (the orchestration calls them per row): host
// values -> bf16 on the device -> kernel -> back. Emulate mode and bf16-exact inputs
// only; anything else (or a device error) runs the CPU op (counted).
namespace {
void *slot(gh_ctx *g, int i, size_t n)
{
    v41_err e2 = {};
    return grow(&g->sp[i], &g->sc[i], n, &e2) ? nullptr : g->sp[i];
}
bool to_bf(const float *x, size_t n, std::vector<uint16_t> &b)
{
    b.resize(n);
    for (size_t i = 0; i < n; i++) {
        if (!bf_exact(x[i])) return false;
        b[i] = bf_bits(x[i]);
    }
    return true;
}
bool up(void *d, const void *h, size_t n) { return cudaMemcpy(d, h, n, cudaMemcpyHostToDevice) == cudaSuccess; }
bool down_bf(float *y, const void *d, size_t n, std::vector<uint16_t> &b)
{
    b.resize(n);
    if (cudaMemcpy(b.data(), d, 2 * n, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)b[i] << 16;
        memcpy(&y[i], &u, 4);
    }
    return true;
}

bool rms_dev(gh_ctx *g, const float *x, const float *w, int64_t n, double eps, float *y)
{
    if (n <= 0 || n % 8) return false;
    if (!to_bf(x, (size_t)n, g->hb0) || !to_bf(w, (size_t)n, g->hb1)) return false;
    void *dx = slot(g, 0, 2 * (size_t)n), *dw = slot(g, 1, 2 * (size_t)n), *dy = slot(g, 2, 2 * (size_t)n);
    if (!dx || !dw || !dy || !up(dx, g->hb0.data(), 2 * (size_t)n) || !up(dw, g->hb1.data(), 2 * (size_t)n)) return false;
    if (v41g_rmsnorm((const uint16_t *)dx, (const uint16_t *)dw, (uint16_t *)dy, 1, (int)n, (float)eps, NULL)) return false;
    return down_bf(y, dy, (size_t)n, g->hb0);
}

bool rope_dev(gh_ctx *g, const v41_rope *rp, float *x, int64_t pos, bool inverse)
{
    const int r = rp->r;
    if (r <= 0 || r % 2) return false;
    if (!to_bf(x, (size_t)r, g->hb0)) return false;
    void *dx = slot(g, 0, 2 * (size_t)r), *df = slot(g, 1, 4 * (size_t)(r / 2)), *dp = slot(g, 2, 4);
    int32_t p32 = (int32_t)pos;
    if (!dx || !df || !dp || !up(dx, g->hb0.data(), 2 * (size_t)r) || !up(df, rp->freq, 4 * (size_t)(r / 2)) ||
        !up(dp, &p32, 4))
        return false;
    if (v41g_rope((uint16_t *)dx, (const int32_t *)dp, (const float *)df, 1, 1, r, r, inverse ? 1 : 0, NULL)) return false;
    return down_bf(x, dx, (size_t)r, g->hb0);
}

bool hcpre_dev(gh_ctx *g, const float *X, const float *pre, int hc, int64_t D, float *y)
{
    const size_t n = (size_t)hc * D;
    if (D % 8 || !to_bf(X, n, g->hb0)) return false;
    void *dX = slot(g, 0, 2 * n), *dp = slot(g, 1, 4 * (size_t)hc), *dy = slot(g, 2, 2 * (size_t)D);
    if (!dX || !dp || !dy || !up(dX, g->hb0.data(), 2 * n) || !up(dp, pre, 4 * (size_t)hc)) return false;
    if (v41g_hc_pre((const uint16_t *)dX, (const float *)dp, (uint16_t *)dy, 1, hc, (int)D, NULL)) return false;
    return down_bf(y, dy, (size_t)D, g->hb0);
}

bool hcpost_dev(gh_ctx *g, const float *y, const float *X, const float *post, const float *comb, int hc, int64_t D,
                float *Xout)
{
    const size_t n = (size_t)hc * D;
    if (D % 8 || !to_bf(X, n, g->hb0) || !to_bf(y, (size_t)D, g->hb1)) return false;
    void *dX = slot(g, 0, 2 * n), *dy = slot(g, 1, 2 * (size_t)D), *dpo = slot(g, 2, 4 * (size_t)hc),
         *dc = slot(g, 3, 4 * (size_t)hc * hc), *dO = slot(g, 4, 2 * n);
    if (!dX || !dy || !dpo || !dc || !dO || !up(dX, g->hb0.data(), 2 * n) || !up(dy, g->hb1.data(), 2 * (size_t)D) ||
        !up(dpo, post, 4 * (size_t)hc) || !up(dc, comb, 4 * (size_t)hc * hc))
        return false;
    if (v41g_hc_post((const uint16_t *)dy, (const uint16_t *)dX, (const float *)dpo, (const float *)dc, (uint16_t *)dO,
                     1, hc, (int)D, NULL))
        return false;
    return down_bf(Xout, dO, n, g->hb0);
}
}  // namespace

// One request's indexer scores (SPEC §6) on the device: its rows' queries (bf16), head
// weights, and keys [0, min(Lc, cap)) (bf16; zero rows up to Lc, as ref's "no key" gives a
// zero dot) go up, v41g_indexer_scores computes [n, Lc] (-inf past each row's Lt), the
// rows come back into the host score matrix. Emulate mode with the ReLU only (the kernel
// implements those rounding points); inputs that are not bf16 values or a device error
// fall back to the CPU rows (counted).
namespace {
bool idx_dev(gh_ctx *g, const float *q, const float *w, int n, int nI, int dI, const float *keys, int cap, int Lc,
             const int *Lt, float *scores, int64_t ld)
{
    const size_t nq = (size_t)n * nI * dI, nk = (size_t)Lc * dI;
    const int kr = cap < Lc ? (cap > 0 ? cap : 0) : Lc;   /* key rows that exist */
    g->hiq.resize(nq);
    for (size_t i = 0; i < nq; i++) {
        if (!bf_exact(q[i])) return false;
        g->hiq[i] = bf_bits(q[i]);
    }
    for (size_t i = 0; i < (size_t)n * nI; i++)
        if (!bf_exact(w[i])) return false;
    g->hik.assign(nk, 0);
    for (size_t i = 0; i < (size_t)kr * dI; i++) {
        if (!bf_exact(keys[i])) return false;
        g->hik[i] = bf_bits(keys[i]);
    }
    g->hikb.assign((size_t)n, 0);
    v41_err e2 = {};
    if (grow(&g->ip[0], &g->ic[0], 2 * nq, &e2) || grow(&g->ip[1], &g->ic[1], 4 * (size_t)n * nI, &e2) ||
        grow(&g->ip[2], &g->ic[2], 2 * nk, &e2) || grow(&g->ip[3], &g->ic[3], 8 * (size_t)n, &e2) ||
        grow(&g->ip[4], &g->ic[4], 4 * (size_t)n, &e2) || grow(&g->ip[5], &g->ic[5], 4 * (size_t)n * Lc, &e2))
        return false;
    if (cudaMemcpy(g->ip[0], g->hiq.data(), 2 * nq, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->ip[1], w, 4 * (size_t)n * nI, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->ip[2], g->hik.data(), 2 * nk, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->ip[3], g->hikb.data(), 8 * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->ip[4], Lt, 4 * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess)
        return false;
    if (v41g_indexer_scores((const uint16_t *)g->ip[0], (const float *)g->ip[1], (const uint16_t *)g->ip[2],
                            (const int64_t *)g->ip[3], (const int32_t *)g->ip[4], n, nI, dI, Lc, (float *)g->ip[5],
                            NULL))
        return false;
    g->hiI.resize((size_t)n * Lc);
    if (cudaMemcpy(g->hiI.data(), g->ip[5], 4 * (size_t)n * Lc, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
    for (int i = 0; i < n; i++) memcpy(scores + (size_t)i * ld, g->hiI.data() + (size_t)i * Lc, 4 * (size_t)Lc);
    return true;
}
}  // namespace

extern "C" void v41gh_indexer_scores_rows(const float *q, const float *w, int n, int nI, int dI, const float *keys,
                                          int cap, int Lc, const int *Lt, bool relu, bool emu, float *scores,
                                          int64_t ld)
{
    gh_ctx *g = tl_ctx;
    if (n <= 0 || Lc <= 0) return;
    if (g && emu && relu && dI % 16 == 0 && idx_dev(g, q, w, n, nI, dI, keys, cap, Lc, Lt, scores, ld)) {
        g->n_idx_gpu++;
        return;
    }
    if (g) {
        cudaGetLastError();   // a failed device attempt must not poison the next call
        g->n_idx_cpu++;
    }
    v41_indexer_scores_rows(q, w, n, nI, dI, keys, cap, Lc, Lt, relu, emu, scores, ld);
}

// One request's indexer top-k (SPEC §6) on the device: its rows' scores [n, L] (bf16
// values or -inf) go up, v41g_topk selects (ties to the lower position, ascending, -1 at
// and past each row's Lt, tie flag for finite ties at the cut: the contract of ref's
// v41_indexer_topk_rows), the lists come back, padded with -1 to the buffer width.
// Scores that are not bf16 values (fp32 mode) or a device error: the CPU rows (counted).
namespace {
bool topk_dev(gh_ctx *g, const float *scores, int64_t ld, int n, int L, int k, const int *Lt, int32_t *out,
              int64_t ldo, int width, uint8_t *amb)
{
    if (k <= 0 || k > L || k > width) return false;
    const size_t nL = (size_t)n * L;
    g->htI.resize(nL);
    for (int i = 0; i < n; i++)
        for (int s = 0; s < L; s++) {
            float v = scores[(size_t)i * ld + s];
            if (!(v == -INFINITY || (isfinite(v) && bf_exact(v)))) return false;
            g->htI[(size_t)i * L + s] = v;
        }
    v41_err e2 = {};
    if (grow(&g->tp[0], &g->tc[0], 4 * nL, &e2) || grow(&g->tp[1], &g->tc[1], 4 * (size_t)n, &e2) ||
        grow(&g->tp[2], &g->tc[2], 4 * (size_t)n * k, &e2) || grow(&g->tp[3], &g->tc[3], (size_t)n, &e2))
        return false;
    if (cudaMemcpy(g->tp[0], g->htI.data(), 4 * nL, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->tp[1], Lt, 4 * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess)
        return false;
    if (v41g_topk((const float *)g->tp[0], (const int32_t *)g->tp[1], n, L, k, (int32_t *)g->tp[2],
                  (uint8_t *)g->tp[3], NULL))
        return false;
    g->hto.resize((size_t)n * k);
    g->htt.resize((size_t)n);
    if (cudaMemcpy(g->hto.data(), g->tp[2], 4 * (size_t)n * k, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(g->htt.data(), g->tp[3], (size_t)n, cudaMemcpyDeviceToHost) != cudaSuccess)
        return false;
    for (int i = 0; i < n; i++) {
        int32_t *o = out + (size_t)i * ldo;
        memcpy(o, g->hto.data() + (size_t)i * k, 4 * (size_t)k);
        for (int a = k; a < width; a++) o[a] = -1;
        amb[i] = g->htt[i];
    }
    return true;
}
}  // namespace

extern "C" void v41gh_indexer_topk_rows(const float *scores, int64_t ld, int n, int L, int k, const int *Lt,
                                        int32_t *out, int64_t ldo, int width, uint8_t *amb)
{
    gh_ctx *g = tl_ctx;
    if (n <= 0) return;
    if (g && topk_dev(g, scores, ld, n, L, k, Lt, out, ldo, width, amb)) {
        g->n_topk_gpu++;
        return;
    }
    if (g) {
        cudaGetLastError();
        g->n_topk_cpu++;
    }
    v41_indexer_topk_rows(scores, ld, n, L, k, Lt, out, ldo, width, amb);
}

extern "C" void v41gh_rmsnorm(const float *x, const float *w, int64_t n, double eps, float *y, bool emu)
{
    gh_ctx *g = tl_ctx;
    if (g && emu && rms_dev(g, x, w, n, eps, y)) { g->n_small_gpu++; return; }
    if (g) g->n_small_cpu++;
    v41_rmsnorm(x, w, n, eps, y, emu);
}
extern "C" void v41gh_rope_apply(const v41_rope *rp, float *x, int64_t pos, bool inverse, bool interleaved, bool emu)
{
    gh_ctx *g = tl_ctx;
    if (g && emu && interleaved && rope_dev(g, rp, x, pos, inverse)) { g->n_small_gpu++; return; }
    if (g) g->n_small_cpu++;
    v41_rope_apply(rp, x, pos, inverse, interleaved, emu);
}
extern "C" void v41gh_hc_pre(const float *X, const float *pre, int hc, int64_t D, float *y, bool emu)
{
    gh_ctx *g = tl_ctx;
    if (g && emu && hcpre_dev(g, X, pre, hc, D, y)) { g->n_small_gpu++; return; }
    if (g) g->n_small_cpu++;
    v41_hc_pre(X, pre, hc, D, y, emu);
}
extern "C" void v41gh_hc_post(const float *y, const float *X, const float *post, const float *comb, int hc, int64_t D,
                              float *Xout, bool emu)
{
    gh_ctx *g = tl_ctx;
    if (g && emu && hcpost_dev(g, y, X, post, comb, hc, D, Xout)) { g->n_small_gpu++; return; }
    if (g) g->n_small_cpu++;
    v41_hc_post(y, X, post, comb, hc, D, Xout, emu);
}

extern "C" long v41_gpu_engine_resident_steps(const v41_engine *e)
{
    if (!e || !e->vt || e->vt->forward != gh_forward || !e->impl) return 0;
    return gd_steps(((const gh_ctx *)e->impl)->dev);
}

extern "C" int v41_gpu_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out,
                                     v41_err *err)
{
    if (out) *out = NULL;
    if (!m || !out) return v41_err_set(err, V41_EINVAL, "gpu engine: NULL model");
    if (v41g_device_count() <= 0)
        return v41_err_set(err, V41_EUNSUPPORTED, "gpu engine: no CUDA device is visible to this process");
    gh_ctx *g = new (std::nothrow) gh_ctx;
    if (!g) return v41_err_set(err, V41_ENOMEM, "out of memory");
    if (cublasCreate(&g->h) != CUBLAS_STATUS_SUCCESS) {
        delete g;
        return v41_err_set(err, V41_EINTERNAL, "gpu engine: cublasCreate failed");
    }
    cublasSetMathMode(g->h, CUBLAS_PEDANTIC_MATH);   // fp32 Linears: true fp32, no TF32
    v41_engine *e = NULL;
    int rc = v41gh_ref_engine_create(m, o, &e, err);
    if (rc) {
        cublasDestroy(g->h);
        delete g;
        return rc;
    }
    g->ref = e->vt;
    g->vt = *e->vt;
    g->vt.name = "gpu";
    g->vt.forward = gh_forward;
    g->vt.dspark_draft = gh_draft;
    g->vt.dspark_draft_batch = g->ref->dspark_draft_batch ? gh_draft_batch : NULL;
    g->vt.truncate = gh_truncate;
    g->vt.fork = gh_fork;
    g->vt.release = gh_release;
    g->vt.destroy = gh_destroy;
    v41gh_set_threads(e, 1);   // the orchestration's loops run on the calling thread (device hooks)
    e->impl = g;
    e->vt = &g->vt;
    const char *why = nullptr;
    rc = gd_create(e, &g->dev, &why, err);
    if (rc) {
        gh_destroy(e);
        return rc;
    }
    if (!g->dev && why && g_env_flag("V41_GPU_VERBOSE"))
        fprintf(stderr, "gpu engine: device-resident decode off: %s\n", why);
    *out = e;
    return V41_OK;
}
