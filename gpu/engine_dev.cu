// engine_dev.cu: the device-resident decode step of the GPU engine (README.md,
// section 'GPU kernels', "Device-resident decode").
//
// A decode batch (every request one new token at its cached length, emulate
// precision, no tap sink, no forcing source, no fault injection) runs wholly on
// the device: the caches of every request live in device pools (window KV,
// compressed KV, index keys, the compressor's fp32 history; gpu/v41_gpu_dev.h
// gives the layout), the whole forward (embedding, Engram, mHC mixes and
// Sinkhorn, attention with the compressor, indexer, candidate blocks and top-k,
// the grouped output projection, MoE routing and experts, the head, the DSpark
// stages' KV seed) is a fixed sequence of kernel launches and cuBLAS calls on one
// stream, driven by one host-to-device copy of the step's integers (positions,
// cache rows, Engram hash rows). That sequence is captured once per batch size
// into a CUDA graph and replayed (V41_GPU_GRAPH=0: launched directly).
//
// Everything else (prefill chunks, replay, taps, forcing, DSpark drafts,
// truncate, fork) runs the hybrid engine of engine.cu on the host copy of the
// caches. The two copies are kept coherent per request slot: `dlen` rows are
// valid on the device, `hlen` on the host; a device step leaves the host behind
// (gd_to_host copies the missing rows back before any host use), a host forward
// leaves the device behind (the missing rows go up before the next device step).
// The compressor's partial-group state (kvst/scst) is not kept on the device: it
// is rebuilt on the host from the history, slot p % m <- row p for every row the
// device produced, which is what the reference writes for decode rows.
#define restrict __restrict__
#include "g_internal.cuh"
#include "v41_gpu_dev.h"
#include "engine_gpu.h"
extern "C" {
#include "engine_impl.h"
#include "v41_quant.h"
}
#include <cublas_v2.h>
#include <algorithm>
#include <map>
#include <vector>
#include <string.h>
#include <stdlib.h>
#include <math.h>

namespace {

struct dlin {
    const void *w = nullptr;   // device weight: bf16 bits (kind Q/BF16) or fp32 (kind F32)
    v41g_wq q = {};            // or (kind Q, q.w set) fp8/fp4 codes + e8m0 scales in the storage format
    int64_t N = 0, K = 0;
    v41_lin_kind kind = V41_LIN_Q;
};

struct dlayer {
    int ratio = 0, ks = -1;
    bool kv_src = false, idx_src = false, cand_src = false, cand_use = false;
    int eidx = -1, n_exp = 0, n_act = 0;
    dlin hc_attn_fn, hc_ffn_fn, wq_a, wq_b, wkv, wo_a, wo_b, c_wkv, c_wgate, i_wk, i_wq_b, i_wproj, gate, eg_wkv,
        main_proj;
    uint16_t *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *kv_norm = nullptr, *c_norm = nullptr,
             *i_knorm = nullptr, *main_norm = nullptr;
    float *attn_base = nullptr, *ffn_base = nullptr, *attn_scale = nullptr, *ffn_scale = nullptr;
    float *sink = nullptr, *freq = nullptr, *gate_bias = nullptr, *eg_w = nullptr;
    uint16_t *w13 = nullptr, *w2 = nullptr, *w13s = nullptr, *w2s = nullptr, *eg_tab = nullptr;
    v41g_wq q13 = {}, q2 = {}, q13s = {}, q2s = {};   // experts in their storage format (q13.w set), else w13..
    int64_t win_off = 0, c_off = -1, h_off = -1, c_cap = 0;   // pool row offsets (layer base), rows per slot
};

// The Linears of a layer, in the order gd_create pairs them with layer_w's.
#define DLAYER_LINS(Y) {&(Y).hc_attn_fn, &(Y).hc_ffn_fn, &(Y).wq_a, &(Y).wq_b, &(Y).wkv, &(Y).wo_a, &(Y).wo_b, \
                        &(Y).c_wkv, &(Y).c_wgate, &(Y).i_wk, &(Y).i_wq_b, &(Y).i_wproj, &(Y).gate, &(Y).eg_wkv, \
                        &(Y).main_proj}

// Per-step integer inputs, one block copied host -> device per step.
struct step_layout {
    size_t pos, floor_, emb_rows, win_row0, win_wr, hrow0, c_wr, cpos, ckv_row0, kbase, vis, cmax, erows, total;
};

struct slot_sync {
    int id = -1;     // request id the counts below belong to
    int dlen = 0;    // rows valid on the device
    int hlen = 0;    // rows valid on the host
};

}  // namespace

struct gd_ctx {
    ref_engine *E = nullptr;
    const v41_config *c = nullptr;
    int nL = 0, S = 0, slots = 0;
    std::vector<dlayer> L;
    std::vector<void *> allocs;
    uint16_t *embed = nullptr;
    float *final_norm_f = nullptr;
    uint16_t *final_norm = nullptr;
    dlin head;
    // pools
    uint16_t *win = nullptr, *ckv = nullptr, *ik = nullptr;
    float *kvh = nullptr, *sch = nullptr;
    std::vector<slot_sync> sync;
    cudaStream_t st = nullptr;
    cublasHandle_t blas = nullptr;
    void *blas_ws = nullptr;
    void *wq_ws = nullptr, *moe_ws = nullptr;   // split-K partials of packed Linears; v41g_moe_ffn workspace
    size_t wq_ws_bytes = 0, moe_ws_bytes = 0;
    // activations, sized for Bcap rows
    int Bcap = 0;
    char *act = nullptr;
    size_t act_bytes = 0;
    std::map<int, cudaGraphExec_t> graphs;   // one instantiated graph per batch size
    bool use_graph = true, graph_broken = false;
    // step buffer
    step_layout lay;
    char *h_step = nullptr, *d_step = nullptr;
    size_t step_cap = 0;
    float *h_logits = nullptr;
    int32_t *h_am = nullptr;
    size_t h_cap = 0;
    float *premix0 = nullptr;
    // activation pointers (set by carve())
    uint16_t *X, *Xm, *xh, *xa, *ya, *qr, *qrn, *kv, *kvn, *kvq, *q, *o, *u, *lat, *latn, *kI, *kIn, *qI, *wI, *xq, *h13,
        *h, *hq, *ye, *h13s, *hs, *hsq, *ys, *erows, *ekv, *mh, *xm, *tq;
    float *Xf, *mixes, *aPre, *aPost, *aC, *fPost, *fC, *premix, *kvf, *scf, *wIf, *wIs, *I, *glog, *rwts, *logits,
        *tf;
    int32_t *lists, *topk, *ridx, *am;
    uint8_t *emit, *mask;
    const void **p_x, **p_w13, **p_w2, **p_h;
    void **p_h13, **p_y;
    int Smax = 0, Ktop = 0, ew = 0, ne = 0, nt = 0;
    size_t tq_elems = 0, tf_elems = 0;
    bool dspark = false;
    size_t graph_nodes = 0;
    long n_steps = 0, n_graph_launch = 0, n_graph_capture = 0, n_rows_up = 0, n_rows_down = 0, n_fallback = 0;
};

namespace {

int cerr(cudaError_t ce, const char *what, v41_err *err)
{
    if (ce == cudaSuccess) return V41_OK;
    return v41_err_set(err, V41_EINTERNAL, "gpu engine (device path): %s: %s", what, cudaGetErrorString(ce));
}
#define DCK(call, what) do { int rc_ = cerr((call), (what), err); if (rc_) return rc_; } while (0)
#define KCK(call, what) do { int kr_ = (call); if (kr_) return v41_err_set(err, V41_EINTERNAL, \
    "gpu engine (device path): %s: %s", (what), v41g_error_string(kr_)); } while (0)


void *dalloc(gd_ctx *g, size_t n, v41_err *err)
{
    void *p = nullptr;
    if (cudaMalloc(&p, n ? n : 16) != cudaSuccess) {
        cudaGetLastError();
        v41_err_set(err, V41_ENOMEM, "gpu engine (device path): cudaMalloc(%zu) failed", n);
        return nullptr;
    }
    g->allocs.push_back(p);
    return p;
}

// A host fp32 vector as bf16 on the device (NULL when some value is not a bf16 value).
uint16_t *up_bf(gd_ctx *g, const float *x, size_t n, bool *ok, v41_err *err)
{
    if (!x) return nullptr;
    std::vector<uint16_t> b(n);
    for (size_t i = 0; i < n; i++) {
        if (!bf_exact(x[i])) { *ok = false; return nullptr; }
        b[i] = bf_bits(x[i]);
    }
    uint16_t *d = (uint16_t *)dalloc(g, 2 * n, err);
    if (!d || cudaMemcpy(d, b.data(), 2 * n, cudaMemcpyHostToDevice) != cudaSuccess) { *ok = false; return nullptr; }
    return d;
}
float *up_f(gd_ctx *g, const float *x, size_t n, bool *ok, v41_err *err)
{
    if (!x) return nullptr;
    float *d = (float *)dalloc(g, 4 * n, err);
    if (!d || cudaMemcpy(d, x, 4 * n, cudaMemcpyHostToDevice) != cudaSuccess) { *ok = false; return nullptr; }
    return d;
}

int get_lin(v41_engine *e, const v41_lin *L, dlin *out, const char **why, v41_err *err)
{
    if (!L->w) return V41_OK;
    const bool want_bf = L->kind != V41_LIN_F32;
    bool bf = false;
    int rc = gh_dev_weight(e, L, want_bf, &out->w, &bf, L->kind == V41_LIN_Q ? &out->q : nullptr, err);
    if (rc) return rc;
    if (want_bf && !bf) { *why = "a fp8/fp4/bf16 weight that is not a bf16 value after dequantization"; out->w = nullptr; }
    out->N = L->N;
    out->K = L->K;
    out->kind = L->kind;
    if (L->kind == V41_LIN_Q && L->K % 32) *why = "an fp8/fp4 Linear whose K is not a multiple of 32";
    return V41_OK;
}

// Routed experts [E, 2I, D] (w1 rows then w3 rows) and [E, D, I], bf16 (dequantized fp4/fp8: exact).
int up_experts(gd_ctx *g, const expert_w *X, int n, int I, int D, uint16_t **w13, uint16_t **w2, bool *ok,
               v41_err *err)
{
    std::vector<float> t((size_t)I * D);
    std::vector<uint16_t> b13((size_t)n * 2 * I * D), b2((size_t)n * D * I);
    for (int x = 0; x < n; x++) {
        const v41_lin *parts[3] = {&X[x].w1, &X[x].w3, &X[x].w2};
        for (int p = 0; p < 3; p++) {
            int rc = v41_dequant_rows(parts[p]->w, parts[p]->s, parts[p]->row0, parts[p]->N, t.data(), err);
            if (rc) return rc;
            uint16_t *dst = p < 2 ? b13.data() + ((size_t)x * 2 * I + (size_t)p * I) * D : b2.data() + (size_t)x * D * I;
            for (size_t i = 0; i < t.size(); i++) {
                if (!bf_exact(t[i])) { *ok = false; return V41_OK; }
                dst[i] = bf_bits(t[i]);
            }
        }
    }
    *w13 = (uint16_t *)dalloc(g, 2 * b13.size(), err);
    *w2 = (uint16_t *)dalloc(g, 2 * b2.size(), err);
    if (!*w13 || !*w2) return err->code;
    DCK(cudaMemcpy(*w13, b13.data(), 2 * b13.size(), cudaMemcpyHostToDevice), "expert upload");
    DCK(cudaMemcpy(*w2, b2.data(), 2 * b2.size(), cudaMemcpyHostToDevice), "expert upload");
    return V41_OK;
}

// The same experts kept in their storage format: group x of q13 = w1 rows then w3 rows, of q2 =
// w2. False (nothing allocated) when some expert's format does not fit v41g_wq or the experts
// differ in format.
bool up_experts_q(gd_ctx *g, const expert_w *X, int n, v41g_wq *q13, v41g_wq *q2, v41_err *err)
{
    std::vector<uint8_t> c13, s13, c2, s2;
    int fmt = 0;
    for (int x = 0; x < n; x++) {
        gh_wq_host P[3];
        const v41_lin *parts[3] = {&X[x].w1, &X[x].w3, &X[x].w2};
        for (int p = 0; p < 3; p++) {
            if (!gh_pack_host(parts[p], &P[p]) || P[p].r0 != 0) return false;
            if (!fmt) fmt = P[p].fmt;
            if (P[p].fmt != fmt) return false;
        }
        for (int p = 0; p < 2; p++) {
            c13.insert(c13.end(), P[p].codes.begin(), P[p].codes.end());
            s13.insert(s13.end(), P[p].scales.begin(), P[p].scales.end());
        }
        c2.insert(c2.end(), P[2].codes.begin(), P[2].codes.end());
        s2.insert(s2.end(), P[2].scales.begin(), P[2].scales.end());
    }
    const v41_lin &a = X[0].w1, &b = X[0].w2;
    if (fmt == V41G_WQ_FP8 && n > 1) return false;   // 32-row scale blocks: one group (the shared expert)
    if (fmt == V41G_WQ_FP8 && a.N % 32) return false; // w3's blocks must start a block after w1's
    // codes tiled for v41g_wq (one tiled block per expert), scales as they are
    uint8_t *t13 = nullptr, *t2 = nullptr;
    size_t st13 = 0, st2 = 0;
    if (gh_upload_tiled(fmt, (int)(2 * a.N), (int)a.K, n, c13.data(), c13.size() / n, &t13, &st13)) return false;
    g->allocs.push_back(t13);
    if (gh_upload_tiled(fmt, (int)b.N, (int)b.K, n, c2.data(), c2.size() / n, &t2, &st2)) return false;
    g->allocs.push_back(t2);
    uint8_t *ds13 = (uint8_t *)dalloc(g, s13.size(), err), *ds2 = (uint8_t *)dalloc(g, s2.size(), err);
    if (!ds13 || !ds2 || cudaMemcpy(ds13, s13.data(), s13.size(), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(ds2, s2.data(), s2.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    *q13 = v41g_wq{fmt, (int)(2 * a.N), (int)a.K, 0, t13, ds13, (long long)st13, (long long)(s13.size() / n)};
    *q2 = v41g_wq{fmt, (int)b.N, (int)b.K, 0, t2, ds2, (long long)st2, (long long)(s2.size() / n)};
    return true;
}

// The v41g_moe of a layer whose experts are in their storage format, for a batch of B rows.
v41g_moe moe_q_of(const gd_ctx *g, const dlayer &l, int B)
{
    v41g_moe m = {};
    m.T = B;
    m.D = g->c->dim;
    m.I = g->c->moe_inter_dim;
    m.E = l.n_exp;
    m.k = l.n_act;
    m.limit = (float)g->c->swiglu_limit;
    m.q13 = &l.q13;
    m.q2 = &l.q2;
    if (l.q13s.w) { m.q13s = &l.q13s; m.q2s = &l.q2s; }
    return m;
}

// ---- activation arena (Bcap rows); graphs are captured on these addresses
size_t al(size_t n) { return (n + 255) & ~(size_t)255; }

int carve(gd_ctx *g, int B, v41_err *err)
{
    const v41_config *c = g->c;
    const size_t D = c->dim, hc = c->hc_mult, mix = (2 + hc) * hc, H = c->n_heads, d = c->head_dim,
                 QL = c->q_lora_rank, GR = (size_t)c->o_groups * c->o_lora_rank, nI = c->index_n_heads,
                 dI = c->index_head_dim, I = c->moe_inter_dim, V = c->vocab_size, W = c->window_size,
                 K = g->Ktop, Sm = g->Smax, nt = g->nt > 0 ? g->nt : 1, ew = g->ew, hd = c->engram_head_dim;
    int kmaxe = 1;
    for (auto &l : g->L) kmaxe = l.n_act > kmaxe ? l.n_act : kmaxe;
    int NEmax = 1;
    for (auto &l : g->L) NEmax = l.n_exp > NEmax ? l.n_exp : NEmax;
    const size_t Bk = (size_t)B * kmaxe;
    size_t o = 0;
    char *base = g->act;
    // two passes: sizes, then pointers
    for (int pass = 0; pass < 2; pass++) {
        o = 0;
#define T16(p, n) do { g->p = (uint16_t *)(base ? base + o : nullptr); o += al(2 * (size_t)(n)); } while (0)
#define T32(p, n) do { g->p = (float *)(base ? base + o : nullptr); o += al(4 * (size_t)(n)); } while (0)
#define TI(p, n) do { g->p = (int32_t *)(base ? base + o : nullptr); o += al(4 * (size_t)(n)); } while (0)
#define T8(p, n) do { g->p = (uint8_t *)(base ? base + o : nullptr); o += al((size_t)(n)); } while (0)
#define TP(p, ty, n) do { g->p = (ty)(base ? base + o : nullptr); o += al(sizeof(void *) * (size_t)(n)); } while (0)
        T16(X, B * hc * D); T16(Xm, B * hc * D); T16(xh, B * D); T16(xa, B * D); T16(ya, B * D);
        T16(qr, B * QL); T16(qrn, B * QL); T16(kv, B * d); T16(kvn, B * d); T16(kvq, B * d);
        T16(q, B * H * d); T16(o, B * H * d); T16(u, B * GR);
        T16(lat, B * d); T16(latn, B * d); T16(kI, B * dI); T16(kIn, B * dI); T16(qI, B * nI * dI); T16(wI, B * nI);
        T16(xq, B * D); T16(h13, Bk * 2 * I); T16(h, Bk * I); T16(hq, Bk * I); T16(ye, Bk * D);
        T16(h13s, B * 2 * I); T16(hs, B * I); T16(hsq, B * I); T16(ys, B * D);
        T16(erows, B * (ew ? ew : 1) * hd); T16(ekv, B * (hc + 1) * D); T16(mh, B * nt * D); T16(xm, B * D);
        T16(tq, (size_t)B * g->tq_elems);
        T32(Xf, B * hc * D); T32(mixes, B * mix); T32(aPre, B * hc); T32(aPost, B * hc); T32(aC, B * hc * hc);
        T32(fPost, B * hc); T32(fC, B * hc * hc); T32(premix, B * hc); T32(kvf, B * d); T32(scf, B * d);
        T32(wIf, B * nI); T32(wIs, B * nI); T32(I, (size_t)B * Sm); T32(glog, (size_t)B * NEmax); T32(rwts, Bk);
        T32(logits, (size_t)B * V); T32(tf, (size_t)B * g->tf_elems);
        TI(lists, (size_t)B * (W + K)); TI(topk, (size_t)B * K); TI(ridx, Bk); TI(am, B);
        T8(emit, B); T8(mask, (size_t)B * Sm);
        TP(p_x, const void **, Bk); TP(p_w13, const void **, Bk); TP(p_w2, const void **, Bk);
        TP(p_h, const void **, Bk); TP(p_h13, void **, Bk); TP(p_y, void **, Bk);
#undef T16
#undef T32
#undef TI
#undef T8
#undef TP
        if (pass == 0) {
            if (g->act) cudaFree(g->act);
            g->act = nullptr;
            if (cudaMalloc((void **)&g->act, o) != cudaSuccess) {
                cudaGetLastError();
                g->Bcap = 0;
                return v41_err_set(err, V41_ENOMEM, "gpu engine (device path): activations for %d rows (%zu bytes)", B, o);
            }
            base = g->act;
            g->act_bytes = o;
        }
    }
    // workspaces of the storage-format GEMMs (split-K partials, up to B rows) and of the MoE
    size_t wqb = 0, moeb = 0;
    auto wq_need = [&](const v41g_wq &q) {
        if (!q.w) return;
        for (int m = 1; m <= B; m++) wqb = std::max(wqb, v41g_wq_ws_bytes(&q, m));
    };
    for (auto &l : g->L) {
        for (const dlin *L : DLAYER_LINS(l)) wq_need(L->q);
        if (l.q13.w) {
            // every batch size up to B: the shared expert's part is not monotone in the rows (split-K
            // partials below V41G_WQ_DEQUANT_ROWS, its dequantized weights from there on), and
            // v41g_moe_ffn lays its workspace out for the call's own T
            v41g_moe m = moe_q_of(g, l, B);
            for (int t = 1; t <= B; t++) {
                m.T = t;
                moeb = std::max(moeb, v41g_moe_ws_size(&m));
            }
        }
    }
    wq_need(g->head.q);
    for (void **p : {&g->wq_ws, &g->moe_ws})
        if (*p) { cudaFree(*p); *p = nullptr; }
    g->wq_ws_bytes = g->moe_ws_bytes = 0;
    if ((wqb && cudaMalloc(&g->wq_ws, wqb) != cudaSuccess) || (moeb && cudaMalloc(&g->moe_ws, moeb) != cudaSuccess)) {
        cudaGetLastError();
        g->Bcap = 0;
        return v41_err_set(err, V41_ENOMEM, "gpu engine (device path): GEMM workspaces for %d rows", B);
    }
    g->wq_ws_bytes = wqb;
    g->moe_ws_bytes = moeb;
    g->Bcap = B;
    return V41_OK;
}

void drop_graphs(gd_ctx *g)
{
    for (auto &kv : g->graphs)
        if (kv.second) cudaGraphExecDestroy(kv.second);
    g->graphs.clear();
}

// ---- the step's integer block
void plan_layout(gd_ctx *g, int B)
{
    step_layout &y = g->lay;
    const size_t nL = g->nL, hc = g->c->hc_mult;
    size_t o = 0;
    auto take = [&](size_t bytes) { size_t r = o; o += al(bytes); return r; };
    y.pos = take(4 * (size_t)B);
    y.floor_ = take(4 * (size_t)B);
    y.emb_rows = take(8 * (size_t)B * hc);
    y.win_row0 = take(8 * nL * B);
    y.win_wr = take(8 * nL * B);
    y.hrow0 = take(8 * nL * B);
    y.c_wr = take(8 * nL * B);
    y.cpos = take(4 * nL * B);
    y.ckv_row0 = take(8 * nL * B);
    y.kbase = take(8 * nL * B);
    y.vis = take(4 * nL * B);
    y.cmax = take(4);
    y.erows = take(8 * (size_t)(g->ne ? g->ne : 1) * B * (g->ew ? g->ew : 1));
    y.total = o;
}
template <typename T> T *HS(gd_ctx *g, size_t off) { return (T *)(g->h_step + off); }
template <typename T> T *DS(gd_ctx *g, size_t off) { return (T *)(g->d_step + off); }

// y[M, N] = x[M, K] . w[N, K]^T on the engine's handle: bf16 in, fp32 accumulate, bf16 (or
// fp32) out; batch > 1: strided batches (the grouped wo_a). Row-major through cuBLAS's
// column-major view, as k_gemm.cu.
int gemm16(gd_ctx *g, const uint16_t *x, int ldx, const void *w, void *y, int ldy, int M, int N, int K, bool f32out,
           int batch, long long sx, long long sw, long long sy, v41_err *err)
{
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s;
    cudaDataType_t ct = f32out ? CUDA_R_32F : CUDA_R_16BF;
    if (batch <= 1)
        s = cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x, CUDA_R_16BF, ldx,
                         &zero, y, ct, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    else
        s = cublasGemmStridedBatchedEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, sw, x,
                                       CUDA_R_16BF, ldx, sx, &zero, y, ct, ldy, sy, batch, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return v41_err_set(err, V41_EINTERNAL, "gpu engine (device path): cuBLAS GEMM %dx%dx%d: status %d", M, N, K,
                           (int)s);
    return V41_OK;
}

// fp32 Linear of an fp32 input already on the device (the mHC mixes read X upcast).
int lin_f32in(gd_ctx *g, const dlin &L, const float *x, int M, float *y, v41_err *err)
{
    const int N = (int)L.N, K = (int)L.K;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s = cublasSgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, (const float *)L.w, K, x, K,
                                   &zero, y, N);
    if (s != CUBLAS_STATUS_SUCCESS)
        return v41_err_set(err, V41_EINTERNAL, "gpu engine (device path): cuBLAS SGEMM %dx%dx%d: status %d", M, N, K,
                           (int)s);
    return V41_OK;
}

// ---- Linear on the device (the contract of ref's v41_linear in emulate mode): x bf16
// [M, K] contiguous; kind Q: act_quant then bf16 GEMM, bf16 out; BF16: bf16 GEMM, bf16 out;
// F32: fp32 GEMM of the upcast input (cuBLAS pedantic fp32, no TF32), fp32 out.
int lin(gd_ctx *g, const dlin &L, const uint16_t *x, int M, void *y, v41_err *err)
{
    const int N = (int)L.N, K = (int)L.K;
    if (L.kind == V41_LIN_F32) {
        KCK(v41g_bf16_to_f32(x, g->tf, (size_t)M * K, g->st), "bf16 -> fp32");
        return lin_f32in(g, L, g->tf, M, (float *)y, err);
    }
    const uint16_t *xin = x;
    if (L.kind == V41_LIN_Q) {
        KCK(v41g_act_quant(x, nullptr, nullptr, g->tq, M, K, g->st), "act_quant");
        xin = g->tq;
    }
    if (L.q.w) {
        KCK(v41g_wq_gemm(&L.q, xin, M, y, 0, g->wq_ws, g->wq_ws_bytes, g->st), "storage-format GEMM");
        return V41_OK;
    }
    return gemm16(g, xin, K, L.w, y, N, M, N, K, false, 1, 0, 0, 0, err);
}

// ---- one decode step, enqueued on g->st (captured into a graph or run directly)
int mixes_of(gd_ctx *g, const dlin &fn, const float *scale3, const float *base, const uint16_t *Xin, int B,
             float *pre, float *post, float *comb, v41_err *err)
{
    const v41_config *c = g->c;
    const int hc = c->hc_mult, D = c->dim, mix = (2 + hc) * hc;
    KCK(v41g_bf16_to_f32(Xin, g->Xf, (size_t)B * hc * D, g->st), "bf16 -> fp32");
    int rc = lin_f32in(g, fn, g->Xf, B, g->mixes, err);
    if (rc) return rc;
    KCK(v41g_rms_scale(Xin, B, hc * D, (float)c->norm_eps, g->mixes, mix, g->st), "mixes rms");
    KCK(v41g_sinkhorn(g->mixes, scale3, base, B, hc, c->hc_sinkhorn_iters, (float)c->hc_eps, pre, post, comb, g->st),
        "sinkhorn");
    return V41_OK;
}

// The window KV row of every query row (attention step 1, and the DSpark stages' seed):
// kv_norm(wkv(x)), RoPE at the row's position, act_quant, written into layer l's window pool.
int window_kv_dev(gd_ctx *g, int l, const uint16_t *x, int B, v41_err *err)
{
    const v41_config *c = g->c;
    const dlayer &W = g->L[l];
    const int d = c->head_dim;
    int rc;
    if ((rc = lin(g, W.wkv, x, B, g->kv, err))) return rc;
    KCK(v41g_rmsnorm(g->kv, W.kv_norm, g->kvn, B, d, (float)c->norm_eps, g->st), "kv norm");
    KCK(v41g_rope(g->kvn, DS<int32_t>(g, g->lay.pos), W.freq, B, 1, d, c->rope_head_dim, 0, g->st), "kv rope");
    KCK(v41g_act_quant(g->kvn, nullptr, nullptr, g->kvq, B, d, g->st), "kv act_quant");
    KCK(v41g_scatter_rows16(g->kvq, d, DS<int64_t>(g, g->lay.win_wr) + (size_t)l * B, B, d, g->win, d, g->st),
        "window write");
    return V41_OK;
}

int compressor_dev(gd_ctx *g, int l, int B, v41_err *err)
{
    const v41_config *c = g->c;
    const dlayer &W = g->L[l];
    const int d = c->head_dim, dI = c->index_head_dim, r = c->rope_head_dim, m = W.ratio;
    const step_layout &y = g->lay;
    const int64_t *wr = DS<int64_t>(g, y.c_wr) + (size_t)l * B;
    const int32_t *cpos = DS<int32_t>(g, y.cpos) + (size_t)l * B;
    int rc;
    if (m == 1) {
        if ((rc = lin(g, W.c_wkv, g->xa, B, g->lat, err))) return rc;
    } else {
        if ((rc = lin(g, W.c_wkv, g->xa, B, g->kvf, err))) return rc;
        if ((rc = lin(g, W.c_wgate, g->xa, B, g->scf, err))) return rc;
        KCK(v41g_compress_dec(g->kvf, g->scf, DS<int32_t>(g, y.pos), DS<int64_t>(g, y.hrow0) + (size_t)l * B, B, d, m,
                              g->kvh, g->sch, g->lat, g->emit, g->st),
            "compressor");
    }
    KCK(v41g_rmsnorm(g->lat, W.c_norm, g->latn, B, d, (float)c->norm_eps, g->st), "compressor norm");
    // index keys from the latent before RoPE, then RoPE + fp4 into the caches
    if ((rc = lin(g, W.i_wk, g->latn, B, g->kI, err))) return rc;
    KCK(v41g_rmsnorm(g->kI, W.i_knorm, g->kIn, B, dI, (float)c->norm_eps, g->st), "index key norm");
    KCK(v41g_rope(g->kIn, cpos, W.freq, B, 1, dI, r, 0, g->st), "index key rope");
    KCK(v41g_fp4_qdq(g->kIn, g->kIn, B, dI, 32, 0, g->st), "index key fp4");
    KCK(v41g_scatter_rows16(g->kIn, dI, wr, B, dI, g->ik, dI, g->st), "index key write");
    KCK(v41g_rope(g->latn, cpos, W.freq, B, 1, d, r, 0, g->st), "compressed rope");
    KCK(v41g_fp4_qdq(g->latn, g->latn, B, d, 16, 1, g->st), "compressed fp4");
    KCK(v41g_scatter_rows16(g->latn, d, wr, B, d, g->ckv, d, g->st), "compressed write");
    return V41_OK;
}

int indexer_dev(gd_ctx *g, int l, int B, bool *cand_valid, int *cand_ld, v41_err *err)
{
    const v41_config *c = g->c;
    const dlayer &W = g->L[l];
    const int nI = c->index_n_heads, dI = c->index_head_dim, r = c->rope_head_dim, m = W.ratio;
    const int S = g->S / m + 1;
    const step_layout &y = g->lay;
    int rc;
    if ((rc = lin(g, W.i_wq_b, g->qrn, B, g->qI, err))) return rc;
    KCK(v41g_rope(g->qI, DS<int32_t>(g, y.pos), W.freq, B, nI, dI, r, 0, g->st), "indexer q rope");
    if ((rc = lin(g, W.i_wproj, g->xa, B, g->wI, err))) return rc;
    KCK(v41g_bf16_to_f32(g->wI, g->wIf, (size_t)B * nI, g->st), "bf16 -> fp32");
    const float wscale = (float)(pow(dI, -0.5) * pow(nI, -0.5));
    KCK(v41g_scale_bf16r(g->wIf, wscale, g->wIs, (size_t)B * nI, g->st), "indexer weights");
    KCK(v41g_fp4_qdq(g->qI, g->qI, B, nI * dI, 32, 0, g->st), "indexer q fp4");
    const int32_t *vis = DS<int32_t>(g, y.vis) + (size_t)l * B;
    KCK(v41g_indexer_scores(g->qI, g->wIs, g->ik, DS<int64_t>(g, y.kbase) + (size_t)l * B, vis, B, nI, dI, S, g->I,
                            g->st),
        "indexer scores");
    if (W.cand_src) {
        KCK(v41g_cand_mask(g->I, vis, DS<int32_t>(g, y.pos), B, S, m, c->candidate_block_size > 0 ? c->candidate_block_size : 1,
                           c->candidate_topk_blocks, g->mask, g->st),
            "candidate blocks");
        *cand_valid = true;
        *cand_ld = S;
    }
    if (W.cand_use && *cand_valid)
        KCK(v41g_cand_apply(g->I, S, g->mask, *cand_ld, DS<int32_t>(g, y.cmax), B, g->st), "candidate mask");
    KCK(v41g_topk(g->I, vis, B, S, g->Ktop, g->topk, nullptr, g->st), "indexer top-k");
    return V41_OK;
}

int attention_dev(gd_ctx *g, int l, int B, bool *have_topk, bool *cand_valid, int *cand_ld, v41_err *err)
{
    const v41_config *c = g->c;
    const dlayer &W = g->L[l];
    const int H = c->n_heads, d = c->head_dim, r = c->rope_head_dim, Wn = c->window_size, QL = c->q_lora_rank;
    const int G = c->o_groups, R = c->o_lora_rank, gd = H * d / G;
    const step_layout &y = g->lay;
    const int32_t *pos = DS<int32_t>(g, y.pos);
    int rc;
    if ((rc = lin(g, W.wq_a, g->xa, B, g->qr, err))) return rc;
    KCK(v41g_rmsnorm(g->qr, W.q_norm, g->qrn, B, QL, (float)c->norm_eps, g->st), "q norm");
    if ((rc = window_kv_dev(g, l, g->xa, B, err))) return rc;
    const int m = W.ratio;
    if (m > 0) {
        if (W.kv_src && (rc = compressor_dev(g, l, B, err))) return rc;
        if (W.idx_src) {
            if ((rc = indexer_dev(g, l, B, cand_valid, cand_ld, err))) return rc;
            *have_topk = true;
        }
    }
    if ((rc = lin(g, W.wq_b, g->qrn, B, g->q, err))) return rc;
    KCK(v41g_rope(g->q, pos, W.freq, B, H, d, r, 0, g->st), "q rope");
    const int k = m > 0 && *have_topk ? g->Ktop : 0;
    KCK(v41g_dec_lists(pos, DS<int32_t>(g, y.floor_), DS<int64_t>(g, y.win_row0) + (size_t)l * B,
                       DS<int64_t>(g, y.ckv_row0) + (size_t)l * B, k ? g->topk : nullptr, B, Wn, k, g->lists, g->st),
        "key lists");
    KCK(v41g_sparse_attn(g->q, g->win, g->ckv, g->lists, Wn + k, Wn, W.sink, (float)pow(d, -0.5), B, H, d, g->o,
                         g->st),
        "sparse attention");
    // output projection: inverse RoPE, grouped wo_a (bf16), wo_b (fp8)
    KCK(v41g_rope(g->o, pos, W.freq, B, H, d, r, 1, g->st), "inverse rope");
    if ((rc = gemm16(g, g->o, H * d, W.wo_a.w, g->u, G * R, B, R, gd, false, G, gd, (long long)R * gd, R, err)))
        return rc;
    return lin(g, W.wo_b, g->u, B, g->ya, err);
}

int moe_dev(gd_ctx *g, int l, int B, v41_err *err)
{
    const v41_config *c = g->c;
    const dlayer &W = g->L[l];
    const int D = c->dim, I = c->moe_inter_dim, NE = W.n_exp, K = W.n_act;
    const float Lim = (float)c->swiglu_limit;
    int rc;
    if ((rc = lin(g, W.gate, g->xa, B, g->glog, err))) return rc;
    KCK(v41g_moe_route(g->glog, W.gate_bias, B, NE, K, (int)c->score_func, (float)c->gate_temp,
                       c->norm_topk_prob ? 1 : 0, (float)c->route_scale, g->ridx, g->rwts, g->st),
        "routing");
    if (W.q13.w) {   // storage-format experts: grouped GEMMs over the (expert, token)-sorted rows
        const v41g_moe m = moe_q_of(g, W, B);
        KCK(v41g_moe_ffn(&m, g->xa, g->ridx, g->rwts, g->moe_ws, g->ya, g->st), "experts (storage format)");
        return V41_OK;
    }
    KCK(v41g_act_quant(g->xa, nullptr, nullptr, g->xq, B, D, g->st), "expert act_quant");
    KCK(v41g_moe_ptrs(g->ridx, B, K, D, I, g->xq, W.w13, W.w2, g->h13, g->hq, g->ye, g->p_x, g->p_w13, g->p_w2,
                      g->p_h13, g->p_h, g->p_y, g->st),
        "expert pointers");
    const int BK = B * K;
    const float one = 1.0f, zero = 0.0f;
    // per (token, choice): h13[a] = xq[t] . w13[e]^T  (column-major: [2I x 1] = W^T(op T) . x)
    cublasStatus_t s = cublasGemmBatchedEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, 1, D, &one,
                                           (const void *const *)g->p_w13, CUDA_R_16BF, D,
                                           (const void *const *)g->p_x, CUDA_R_16BF, D, &zero, g->p_h13, CUDA_R_16BF,
                                           2 * I, BK, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return v41_err_set(err, V41_EINTERNAL, "gpu engine (device path): expert w1|w3 batched GEMM: status %d", (int)s);
    KCK(v41g_swiglu(g->h13, BK, I, Lim, g->rwts, g->h, g->st), "swiglu");
    KCK(v41g_act_quant(g->h, nullptr, nullptr, g->hq, BK, I, g->st), "expert act_quant");
    s = cublasGemmBatchedEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, D, 1, I, &one, (const void *const *)g->p_w2,
                            CUDA_R_16BF, I, (const void *const *)g->p_h, CUDA_R_16BF, I, &zero, g->p_y, CUDA_R_16BF, D,
                            BK, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return v41_err_set(err, V41_EINTERNAL, "gpu engine (device path): expert w2 batched GEMM: status %d", (int)s);
    const uint16_t *shared = nullptr;
    if (W.w13s) {
        if ((rc = gemm16(g, g->xq, D, W.w13s, g->h13s, 2 * I, B, 2 * I, D, false, 1, 0, 0, 0, err))) return rc;
        KCK(v41g_swiglu(g->h13s, B, I, Lim, nullptr, g->hs, g->st), "shared swiglu");
        KCK(v41g_act_quant(g->hs, nullptr, nullptr, g->hsq, B, I, g->st), "shared act_quant");
        if ((rc = gemm16(g, g->hsq, I, W.w2s, g->ys, D, B, D, I, false, 1, 0, 0, 0, err))) return rc;
        shared = g->ys;
    }
    KCK(v41g_moe_combine(g->ye, g->ridx, shared, B, K, D, g->ya, g->st), "expert combine");
    return V41_OK;
}

int engram_dev(gd_ctx *g, int l, int B, v41_err *err)
{
    const v41_config *c = g->c;
    const dlayer &W = g->L[l];
    const int hd = c->engram_head_dim, hc = c->hc_mult, D = c->dim, ew = g->ew;
    const int64_t *rows = DS<int64_t>(g, g->lay.erows) + (size_t)W.eidx * B * ew;
    KCK(v41g_gather_rows16(W.eg_tab, hd, rows, B * ew, hd, g->erows, hd, g->st), "engram rows");
    int rc = lin(g, W.eg_wkv, g->erows, B, g->ekv, err);
    if (rc) return rc;
    KCK(v41g_engram_gate(g->ekv, W.eg_w, B, hc, D, (float)c->norm_eps, g->X, g->st), "engram gate");
    return V41_OK;
}

int enqueue_step(gd_ctx *g, int B, v41_err *err)
{
    const v41_config *c = g->c;
    const int D = c->dim, hc = c->hc_mult;
    const step_layout &y = g->lay;
    int rc;
    KCK(v41g_gather_rows16(g->embed, D, DS<int64_t>(g, y.emb_rows), B * hc, D, g->X, D, g->st), "embedding");
    DCK(cudaMemcpyAsync(g->premix, g->premix0, sizeof(float) * (size_t)B * hc, cudaMemcpyDeviceToDevice, g->st),
        "premix");
    bool have_topk = false, cand_valid = false;
    int cand_ld = 0, ti = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const dlayer &W = g->L[l];
        if (W.eidx >= 0 && (rc = engram_dev(g, l, B, err))) return rc;
        if (g->dspark && v41_is_dspark_target(c, l)) {
            KCK(v41g_hc_mean(g->X, B, hc, D, g->mh + (size_t)ti * D, (int64_t)g->nt * D, g->st), "dspark hidden");
            ti++;
        }
        // attention half
        if ((rc = mixes_of(g, W.hc_attn_fn, W.attn_scale, W.attn_base, g->X, B, g->aPre, g->aPost, g->aC, err)))
            return rc;
        KCK(v41g_hc_pre(g->X, g->premix, g->xh, B, hc, D, g->st), "hc_pre");
        KCK(v41g_rmsnorm(g->xh, W.attn_norm, g->xa, B, D, (float)c->norm_eps, g->st), "attn norm");
        if ((rc = attention_dev(g, l, B, &have_topk, &cand_valid, &cand_ld, err))) return rc;
        KCK(v41g_hc_post(g->ya, g->X, g->aPost, g->aC, g->Xm, B, hc, D, g->st), "hc_post");
        // FFN half: its own mixes (their pre-mix becomes the next premix), the attention's pre-mix
        if ((rc = mixes_of(g, W.hc_ffn_fn, W.ffn_scale, W.ffn_base, g->Xm, B, g->premix, g->fPost, g->fC, err)))
            return rc;
        KCK(v41g_hc_pre(g->Xm, g->aPre, g->xh, B, hc, D, g->st), "hc_pre");
        KCK(v41g_rmsnorm(g->xh, W.ffn_norm, g->xa, B, D, (float)c->norm_eps, g->st), "ffn norm");
        if ((rc = moe_dev(g, l, B, err))) return rc;
        KCK(v41g_hc_post(g->ya, g->Xm, g->fPost, g->fC, g->X, B, hc, D, g->st), "hc_post");
    }
    KCK(v41g_hc_pre(g->X, g->premix, g->xh, B, hc, D, g->st), "final hc_pre");
    KCK(v41g_rmsnorm(g->xh, g->final_norm, g->xa, B, D, (float)c->norm_eps, g->st), "final norm");
    if ((rc = lin(g, g->head, g->xa, B, g->logits, err))) return rc;
    KCK(v41g_argmax_rows(g->logits, B, c->vocab_size, g->am, g->st), "argmax");
    if (g->dspark) {   // main_hidden -> main_x, seed every stage's window KV at these positions
        const dlayer &S0 = g->L[c->n_layers];
        if ((rc = lin(g, S0.main_proj, g->mh, B, g->xh, err))) return rc;
        KCK(v41g_rmsnorm(g->xh, S0.main_norm, g->xm, B, D, (float)c->norm_eps, g->st), "dspark main norm");
        for (int s = 0; s < c->n_mtp_layers; s++)
            if ((rc = window_kv_dev(g, c->n_layers + s, g->xm, B, err))) return rc;
    }
    return V41_OK;
}

// ---- cache coherence
slot_sync &sync_of(gd_ctx *g, int slot)
{
    req_state *st = &g->E->rs[slot];
    slot_sync &s = g->sync[slot];
    if (!st->used || st->id != s.id) {   // a new (or released) request in this slot: the host holds it all
        s.id = st->used ? st->id : -1;
        s.dlen = 0;
        s.hlen = st->used ? st->len : 0;
    }
    return s;
}

// Rows [a, b) of request slot between host and device (up = host -> device).
int move_rows(gd_ctx *g, int slot, int a, int b, bool up, v41_err *err)
{
    if (a >= b) return V41_OK;
    req_state *st = &g->E->rs[slot];
    const v41_config *c = g->c;
    const int d = c->head_dim, dI = c->index_head_dim, S = g->S;
    std::vector<uint16_t> hb;
    auto mv16 = [&](float *host, uint16_t *dev, int64_t row0, int n, int w) -> int {
        if (n <= 0) return V41_OK;
        hb.resize((size_t)n * w);
        if (up) {
            for (size_t i = 0; i < hb.size(); i++) hb[i] = bf_bits(host[i]);
            return cerr(cudaMemcpy(dev + row0 * w, hb.data(), 2 * hb.size(), cudaMemcpyHostToDevice), "cache upload", err);
        }
        int rc = cerr(cudaMemcpy(hb.data(), dev + row0 * w, 2 * hb.size(), cudaMemcpyDeviceToHost), "cache download", err);
        if (!rc)
            for (size_t i = 0; i < hb.size(); i++) host[i] = bf_val(hb[i]);
        return rc;
    };
    auto mv32 = [&](float *host, float *dev, int64_t row0, int n, int w) -> int {
        if (n <= 0) return V41_OK;
        size_t nb = sizeof(float) * (size_t)n * w;
        return up ? cerr(cudaMemcpy(dev + row0 * w, host, nb, cudaMemcpyHostToDevice), "cache upload", err)
                  : cerr(cudaMemcpy(host, dev + row0 * w, nb, cudaMemcpyDeviceToHost), "cache download", err);
    };
    int rc;
    for (int l = 0; l < g->nL; l++) {
        const dlayer &W = g->L[l];
        if ((rc = mv16(st->win[l] + (size_t)a * d, g->win, W.win_off + (int64_t)slot * S + a, b - a, d))) return rc;
        if (!W.kv_src) continue;
        const int m = W.ratio, j0 = a / m, j1 = b / m;
        const int64_t cr = W.c_off + (int64_t)slot * W.c_cap;
        if ((rc = mv16(st->ckv[l] + (size_t)j0 * d, g->ckv, cr + j0, j1 - j0, d))) return rc;
        if ((rc = mv16(st->ik[l] + (size_t)j0 * dI, g->ik, cr + j0, j1 - j0, dI))) return rc;
        if (m > 1) {
            const int64_t hr = W.h_off + (int64_t)slot * S + a;
            if ((rc = mv32(st->kvh[l] + (size_t)a * d, g->kvh, hr, b - a, d))) return rc;
            if ((rc = mv32(st->sch[l] + (size_t)a * d, g->sch, hr, b - a, d))) return rc;
            if (!up)   // the partial-group state the reference writes for decode rows
                for (int p = a; p < b; p++) {
                    memcpy(st->kvst[l] + (size_t)(p % m) * d, st->kvh[l] + (size_t)p * d, sizeof(float) * d);
                    memcpy(st->scst[l] + (size_t)(p % m) * d, st->sch[l] + (size_t)p * d, sizeof(float) * d);
                }
        }
    }
    if (up) g->n_rows_up += b - a;
    else g->n_rows_down += b - a;
    return V41_OK;
}

// A decode batch the device path serves: every request one valid token at its cached
// length (> 0), each request once. Fills the requests' cache slots.
bool eligible(gd_ctx *g, const v41_batch *b, int *slot)
{
    const ref_engine *E = g->E;
    const int B = b->n_req;
    for (int q = 0; q < B; q++) {
        const v41_req *rq = &b->req[q];
        if (rq->n_tokens != 1 || !rq->tokens || rq->tokens[0] < 0 || rq->tokens[0] >= g->c->vocab_size) return false;
        for (int q2 = 0; q2 < q; q2++)
            if (b->req[q2].id == rq->id) return false;
        slot[q] = -1;
        for (int s = 0; s < g->slots; s++)
            if (E->rs[s].used && E->rs[s].id == rq->id) slot[q] = s;
        if (slot[q] < 0) return false;
        const req_state *st = &E->rs[slot[q]];
        if (rq->start_pos <= 0 || rq->start_pos != st->len || rq->start_pos + 1 > g->S) return false;
    }
    return true;
}

}  // namespace

int gd_to_host(gd_ctx *g, v41_engine *e, v41_err *err)
{
    (void)e;
    if (!g) return V41_OK;
    for (int s = 0; s < g->slots; s++) {
        slot_sync &y = sync_of(g, s);
        req_state *st = &g->E->rs[s];
        if (!st->used || y.hlen >= st->len) continue;
        int rc = move_rows(g, s, y.hlen, st->len, false, err);
        if (rc) return rc;
        y.hlen = st->len;
    }
    return V41_OK;
}

void gd_host_wrote(gd_ctx *g, v41_engine *e, const v41_batch *b)
{
    (void)e;
    if (!g || !b) return;
    for (int s = 0; s < g->slots; s++) {
        slot_sync &y = sync_of(g, s);
        req_state *st = &g->E->rs[s];
        if (!st->used) continue;
        for (int q = 0; q < b->n_req; q++)
            if (b->req[q].id == st->id) {
                int from = b->req[q].start_pos;
                if (from < y.dlen) y.dlen = from < 0 ? 0 : from;
            }
        y.hlen = st->len;
    }
}

void gd_host_truncated(gd_ctx *g, v41_engine *e, int req_id, int pos)
{
    (void)e;
    if (!g) return;
    for (int s = 0; s < g->slots; s++) {
        slot_sync &y = sync_of(g, s);
        req_state *st = &g->E->rs[s];
        if (!st->used || st->id != req_id) continue;
        if (pos < y.dlen) y.dlen = pos;
        y.hlen = st->len;
    }
}

long gd_steps(const gd_ctx *g) { return g ? g->n_steps : 0; }

void gd_report(const gd_ctx *g)
{
    if (!g) return;
    int moe_q = 0, moe_n = 0;
    for (auto &l : g->L) {
        moe_n += l.q13.w || l.w13;
        moe_q += l.q13.w != nullptr;
    }
    fprintf(stderr, "gpu engine (device path): %ld decode steps on the device (%ld graph launches, %ld captures, "
            "at most %zu nodes a graph), %ld batches not eligible; cache rows %ld up, %ld down; experts of %d of %d "
            "MoE layers kept in their storage format\n", g->n_steps, g->n_graph_launch, g->n_graph_capture,
            g->graph_nodes, g->n_fallback, g->n_rows_up, g->n_rows_down, moe_q, moe_n);
}

void gd_destroy(gd_ctx *g)
{
    if (!g) return;
    if (g_env_flag("V41_GPU_VERBOSE")) gd_report(g);
    drop_graphs(g);
    if (g->act) cudaFree(g->act);
    if (g->d_step) cudaFree(g->d_step);
    if (g->h_step) cudaFreeHost(g->h_step);
    if (g->h_logits) cudaFreeHost(g->h_logits);
    if (g->h_am) cudaFreeHost(g->h_am);
    for (void *p : g->allocs) cudaFree(p);
    if (g->blas) cublasDestroy(g->blas);
    if (g->blas_ws) cudaFree(g->blas_ws);
    if (g->wq_ws) cudaFree(g->wq_ws);
    if (g->moe_ws) cudaFree(g->moe_ws);
    if (g->st) cudaStreamDestroy(g->st);
    delete g;
}

int gd_create(v41_engine *e, gd_ctx **out, const char **why, v41_err *err)
{
    *out = nullptr;
    *why = nullptr;
    if (!v41_env_flag("V41_GPU_RESIDENT", 1)) { *why = "V41_GPU_RESIDENT=0"; return V41_OK; }
    ref_engine *E = (ref_engine *)e;
    const v41_config *c = E->cfg;
    if (!E->emu) { *why = "fp32 precision (the device path implements emulate mode)"; return V41_OK; }
    if (e->opts.compat == V41_COMPAT_OFFICIAL) {
        /* the published index-key bug reads another layer's keys, whose capacity may differ */
        *why = "--compat official (the hybrid path reproduces it)";
        return V41_OK;
    }
    /* act_quant blocks of 32 (kv rows, expert hidden rows), fp4 groups of 32 (index keys and
     * queries), the attention kernel's head dims, hc_pre/post's 8-column vectors */
    if (c->head_dim % 32 || c->head_dim > 512 || c->index_head_dim % 32 || c->dim % 32 || c->moe_inter_dim % 32 ||
        (c->hc_mult != 1 && c->hc_mult != 2 && c->hc_mult != 4) || c->index_topk <= 0) {
        *why = "model shapes the device kernels do not take";
        return V41_OK;
    }
    gd_ctx *g = new (std::nothrow) gd_ctx;
    if (!g) return v41_err_set(err, V41_ENOMEM, "out of memory");
    g->E = E;
    g->c = c;
    g->nL = E->nL;
    g->S = E->max_seq;
    g->slots = E->nslots;
    g->sync.assign((size_t)g->slots, slot_sync());
    g->use_graph = v41_env_flag("V41_GPU_GRAPH", 1) != 0;
    g->Ktop = c->index_topk;
    g->ew = E->eh ? v41_engram_hash_width(E->eh) : 0;
    g->ne = c->n_engram_layers;
    g->nt = c->n_dspark_targets;
    g->dspark = c->dspark_block_size > 0 && c->n_mtp_layers > 0 && g->nt > 0;
    const int D = c->dim, hc = c->hc_mult, d = c->head_dim, dI = c->index_head_dim, I = c->moe_inter_dim;
    int rc = V41_OK;
    bool ok = true;
    auto fail = [&](int r2) { gd_destroy(g); return r2; };
    if (cudaStreamCreateWithFlags(&g->st, cudaStreamNonBlocking) != cudaSuccess ||
        cublasCreate(&g->blas) != CUBLAS_STATUS_SUCCESS)
        return fail(v41_err_set(err, V41_EINTERNAL, "gpu engine (device path): stream / cuBLAS handle"));
    cublasSetStream(g->blas, g->st);
    cublasSetMathMode(g->blas, CUBLAS_PEDANTIC_MATH);   // fp32 GEMMs: true fp32, no TF32
    const size_t wsb = 32u << 20;                       // a fixed workspace: graph capture allocates nothing
    if (cudaMalloc(&g->blas_ws, wsb) != cudaSuccess || cublasSetWorkspace(g->blas, g->blas_ws, wsb) != CUBLAS_STATUS_SUCCESS)
        return fail(v41_err_set(err, V41_ENOMEM, "gpu engine (device path): cuBLAS workspace"));
    // layers and pools
    g->L.assign((size_t)g->nL, dlayer());
    int64_t c_rows = 0, h_rows = 0;
    size_t tq = 1, tf = 1;
    auto need = [&](const dlin &L) {
        if (L.kind == V41_LIN_Q) tq = (size_t)L.K > tq ? (size_t)L.K : tq;
        if (L.kind == V41_LIN_F32) tf = (size_t)L.K > tf ? (size_t)L.K : tf;
    };
    int Smax = 1;
    for (int l = 0; l < g->nL && ok && !*why; l++) {
        const layer_w *W = &E->L[l];
        dlayer &Y = g->L[l];
        Y.ratio = W->ratio;
        Y.ks = W->ks;
        Y.kv_src = W->kv_src;
        Y.idx_src = W->idx_src;
        Y.cand_src = W->cand_src;
        Y.cand_use = W->cand_use;
        Y.eidx = W->eidx;
        Y.n_exp = W->n_exp;
        Y.n_act = W->n_act;
        Y.win_off = (int64_t)l * g->slots * g->S;
        const v41_lin *ls[] = {&W->hc_attn_fn, &W->hc_ffn_fn, &W->wq_a, &W->wq_b, &W->wkv, &W->wo_a, &W->wo_b,
                               &W->c_wkv, &W->c_wgate, &W->i_wk, &W->i_wq_b, &W->i_wproj, &W->gate, &W->eg_wkv,
                               &W->main_proj};
        dlin *ys[] = DLAYER_LINS(Y);
        static_assert(sizeof ls / sizeof ls[0] == sizeof ys / sizeof ys[0], "one dlin per layer_w Linear");
        for (size_t i = 0; i < sizeof ls / sizeof ls[0] && !*why; i++) {
            if ((rc = get_lin(e, ls[i], ys[i], why, err))) return fail(rc);
            need(*ys[i]);
        }
        if (*why) break;
        if (Y.wo_a.w && Y.wo_a.kind != V41_LIN_BF16) { *why = "wo_a is not a bf16 Linear"; break; }
        Y.attn_norm = up_bf(g, W->attn_norm, D, &ok, err);
        Y.ffn_norm = up_bf(g, W->ffn_norm, D, &ok, err);
        Y.q_norm = up_bf(g, W->q_norm, c->q_lora_rank, &ok, err);
        Y.kv_norm = up_bf(g, W->kv_norm, d, &ok, err);
        Y.c_norm = up_bf(g, W->c_norm, d, &ok, err);
        Y.i_knorm = up_bf(g, W->i_knorm, dI, &ok, err);
        Y.main_norm = up_bf(g, W->main_norm, D, &ok, err);
        const int mix = (2 + hc) * hc;
        Y.attn_base = up_f(g, W->hc_attn_base, mix, &ok, err);
        Y.ffn_base = up_f(g, W->hc_ffn_base, mix, &ok, err);
        Y.attn_scale = up_f(g, W->hc_attn_scale, 3, &ok, err);
        Y.ffn_scale = up_f(g, W->hc_ffn_scale, 3, &ok, err);
        Y.sink = up_f(g, W->sink, c->n_heads, &ok, err);
        Y.freq = up_f(g, W->rope.freq, (size_t)W->rope.r / 2, &ok, err);
        if (W->rope.r != c->rope_head_dim) { *why = "a layer whose RoPE width is not rope_head_dim"; break; }
        Y.gate_bias = up_f(g, W->gate_bias, (size_t)W->n_exp, &ok, err);
        if (W->eidx >= 0) {
            Y.eg_w = up_f(g, W->eg_w, (size_t)hc * D, &ok, err);
            const int64_t nrow = W->eg_emb->shape[0], hd = c->engram_head_dim;
            std::vector<float> t((size_t)(nrow * hd));
            if ((rc = v41_dequant_rows(W->eg_emb, W->eg_sc, 0, nrow, t.data(), err))) return fail(rc);
            v41_bf16r_n(t.data(), t.size(), true);
            Y.eg_tab = up_bf(g, t.data(), t.size(), &ok, err);
        }
        if (W->n_exp > 0 && W->ex && ok && l < c->n_layers) {
            if (W->n_act > 16) { *why = "more than 16 activated experts"; break; }
            // storage format when the routed experts and the shared expert (if any) all fit v41g_wq
            v41_err e3 = {};
            if (!(up_experts_q(g, W->ex, W->n_exp, &Y.q13, &Y.q2, &e3) &&
                  (!W->sh.w1.w || up_experts_q(g, &W->sh, 1, &Y.q13s, &Y.q2s, &e3)))) {
                Y.q13 = Y.q2 = Y.q13s = Y.q2s = v41g_wq{};
                if ((rc = up_experts(g, W->ex, W->n_exp, I, D, &Y.w13, &Y.w2, &ok, err))) return fail(rc);
                if (W->sh.w1.w && (rc = up_experts(g, &W->sh, 1, I, D, &Y.w13s, &Y.w2s, &ok, err))) return fail(rc);
            }
        }
        if (W->kv_src && W->ratio > 0) {
            Y.c_cap = g->S / W->ratio + 1;
            Y.c_off = c_rows;
            c_rows += (int64_t)g->slots * Y.c_cap;
            if (W->ratio > 1) {
                if (W->ratio > 64) { *why = "a compress ratio above 64"; break; }
                Y.h_off = h_rows;
                h_rows += (int64_t)g->slots * g->S;
            }
        }
        if (W->ratio > 0) Smax = g->S / W->ratio + 1 > Smax ? g->S / W->ratio + 1 : Smax;
    }
    if (!*why && !ok) *why = "a norm weight or table that is not a bf16 value";
    if (!*why && (int64_t)g->nL * g->slots * g->S > INT32_MAX) *why = "cache pools too large for int32 key rows";
    if (!*why && Smax < g->Ktop) *why = "index_topk larger than the compressed capacity";
    if (*why) { gd_destroy(g); return V41_OK; }
    g->Smax = Smax;
    g->tq_elems = tq > (size_t)I * 2 ? tq : (size_t)I * 2;
    g->tf_elems = tf > (size_t)hc * D ? tf : (size_t)hc * D;
    // embedding, final norm, head
    {
        const int64_t V = c->vocab_size;
        std::vector<float> t((size_t)(V * D));
        if ((rc = v41_dequant_rows(E->embed, NULL, 0, V, t.data(), err))) return fail(rc);
        g->embed = up_bf(g, t.data(), t.size(), &ok, err);
        g->final_norm = up_bf(g, E->norm, D, &ok, err);
        if ((rc = get_lin(e, &E->head, &g->head, why, err))) return fail(rc);
        if (!ok || !g->embed) { gd_destroy(g); *why = "an embedding that is not bf16 values"; return V41_OK; }
    }
    // the cache pools hold every slot's whole history: when they do not fit the device, the
    // engine stays usable without the device path (the hybrid path keeps its caches on the host)
    v41_err e2 = {};
    g->win = (uint16_t *)dalloc(g, 2 * (size_t)g->nL * g->slots * g->S * d, &e2);
    g->ckv = (uint16_t *)dalloc(g, 2 * (size_t)(c_rows ? c_rows : 1) * d, &e2);
    g->ik = (uint16_t *)dalloc(g, 2 * (size_t)(c_rows ? c_rows : 1) * dI, &e2);
    g->kvh = (float *)dalloc(g, 4 * (size_t)(h_rows ? h_rows : 1) * d, &e2);
    g->sch = (float *)dalloc(g, 4 * (size_t)(h_rows ? h_rows : 1) * d, &e2);
    if (!g->win || !g->ckv || !g->ik || !g->kvh || !g->sch) {
        gd_destroy(g);
        *why = "the device cache pools (every slot's history) do not fit device memory: lower --max-len or the "
               "number of request slots";
        return V41_OK;
    }
    *out = g;
    return V41_OK;
}

namespace {
int run_step(gd_ctx *g, v41_engine *e, const v41_batch *b, const int *slot, v41_out *out, v41_err *err);
}

int gd_forward(gd_ctx *g, v41_engine *e, const v41_batch *b, v41_out *out, v41_err *err)
{
    if (!g || !b || b->n_req <= 0) return 0;
    ref_engine *E = g->E;
    if (e->sink || e->force || E->srv_map) return 0;
    for (int f = 0; f < INJ_COUNT; f++)
        if (E->inj[f][V41_MAX_LAYERS]) return 0;
    const int B = b->n_req;
    std::vector<int> slot((size_t)B);
    if (!eligible(g, b, slot.data())) {
        g->n_fallback++;
        return 0;
    }
    return run_step(g, e, b, slot.data(), out, err) ? -1 : 1;
}

namespace {
// The decode step of an eligible batch (slot[q]: request q's cache slot). V41_OK or an error.
int run_step(gd_ctx *g, v41_engine *e, const v41_batch *b, const int *slot, v41_out *out, v41_err *err)
{
    ref_engine *E = g->E;
    const v41_config *c = g->c;
    const int B = b->n_req;
    int rc;
    // bring the device caches up to date
    for (int q = 0; q < B; q++) {
        slot_sync &y = sync_of(g, slot[q]);
        const req_state *st = &E->rs[slot[q]];
        if (y.dlen < st->len) {
            if ((rc = move_rows(g, slot[q], y.dlen, st->len, true, err))) return rc;
            y.dlen = st->len;
        }
    }
    if (B > g->Bcap) {
        drop_graphs(g);
        int nb = g->Bcap ? g->Bcap : 1;
        while (nb < B) nb *= 2;
        if ((rc = carve(g, nb, err))) return rc;
        std::vector<float> p0((size_t)nb * c->hc_mult, 0.0f);
        for (int t = 0; t < nb; t++) p0[(size_t)t * c->hc_mult] = 1.0f;
        if (g->premix0) cudaFree(g->premix0);
        g->premix0 = nullptr;
        if (cudaMalloc((void **)&g->premix0, 4 * p0.size()) != cudaSuccess ||
            cudaMemcpy(g->premix0, p0.data(), 4 * p0.size(), cudaMemcpyHostToDevice) != cudaSuccess)
            return v41_err_set(err, V41_ENOMEM, "gpu engine (device path): premix");
    }
    plan_layout(g, B);
    if (g->lay.total > g->step_cap || (size_t)B * c->vocab_size > g->h_cap) {
        drop_graphs(g);
        if (g->d_step) cudaFree(g->d_step);
        if (g->h_step) cudaFreeHost(g->h_step);
        if (g->h_logits) cudaFreeHost(g->h_logits);
        if (g->h_am) cudaFreeHost(g->h_am);
        g->d_step = g->h_step = nullptr;
        g->h_logits = nullptr;
        g->h_am = nullptr;
        size_t cap = g->lay.total * 2, hcap = (size_t)g->Bcap * c->vocab_size;
        if (cudaMalloc((void **)&g->d_step, cap) != cudaSuccess || cudaMallocHost((void **)&g->h_step, cap) != cudaSuccess ||
            cudaMallocHost((void **)&g->h_logits, 4 * hcap) != cudaSuccess ||
            cudaMallocHost((void **)&g->h_am, 4 * (size_t)g->Bcap) != cudaSuccess) {
            g->step_cap = g->h_cap = 0;
            return v41_err_set(err, V41_ENOMEM, "gpu engine (device path): step buffers");
        }
        g->step_cap = cap;
        g->h_cap = hcap;
    }
    // ---- the step's integers (host)
    {
        const step_layout &y = g->lay;
        memset(g->h_step, 0, y.total);
        const int hc = c->hc_mult, S = g->S;
        int32_t *pos = HS<int32_t>(g, y.pos), *fl = HS<int32_t>(g, y.floor_), *cpos = HS<int32_t>(g, y.cpos),
                *vis = HS<int32_t>(g, y.vis);
        int64_t *emb = HS<int64_t>(g, y.emb_rows), *wr0 = HS<int64_t>(g, y.win_row0), *wwr = HS<int64_t>(g, y.win_wr),
                *hr0 = HS<int64_t>(g, y.hrow0), *cwr = HS<int64_t>(g, y.c_wr), *cr0 = HS<int64_t>(g, y.ckv_row0),
                *kb = HS<int64_t>(g, y.kbase);
        int cmax = 0;
        for (int q = 0; q < B; q++) {
            const v41_req *rq = &b->req[q];
            req_state *st = &E->rs[slot[q]];
            const int p = rq->start_pos, s = slot[q];
            pos[q] = p;
            fl[q] = rq->replay_floor > 0 ? rq->replay_floor : 0;
            for (int j = 0; j < hc; j++) emb[(size_t)q * hc + j] = rq->tokens[0];
            int owner = st->ik_owner;
            for (int l = 0; l < g->nL; l++) {
                const dlayer &W = g->L[l];
                const size_t ix = (size_t)l * B + q;
                wr0[ix] = W.win_off + (int64_t)s * S;
                wwr[ix] = wr0[ix] + p;
                const int m = W.ratio;
                if (l >= c->n_layers || m <= 0) continue;
                if (W.kv_src) {
                    const bool em = (p + 1) % m == 0;
                    const int j = (p + 1) / m - 1;
                    cwr[ix] = em ? W.c_off + (int64_t)s * W.c_cap + j : -1;
                    cpos[ix] = em ? j * m : 0;
                    if (m > 1) hr0[ix] = W.h_off + (int64_t)s * S;
                    if (em && E->e.opts.compat == V41_COMPAT_OFFICIAL) owner = l;
                }
                if (W.ks >= 0) cr0[ix] = g->L[W.ks].c_off + (int64_t)s * g->L[W.ks].c_cap;
                if (W.idx_src) {
                    int src = W.ks;
                    if (E->e.opts.compat == V41_COMPAT_OFFICIAL && owner >= 0) src = owner;
                    kb[ix] = g->L[src].c_off + (int64_t)s * g->L[src].c_cap;
                    vis[ix] = (p + 1) / m;
                    if (W.cand_src) cmax = vis[ix] > cmax ? vis[ix] : cmax;
                }
            }
            if (E->e.opts.compat == V41_COMPAT_OFFICIAL) st->ik_owner = owner;
        }
        *HS<int32_t>(g, y.cmax) = cmax;
        // Engram: token history and hash rows (as ref_forward)
        if (g->ew) {
            const int64_t *map = e->model->engram_token_map;
            const int64_t pad = map ? map[c->engram_pad_id] : c->engram_pad_id;
            const int N = c->engram_max_ngram_size, ew = g->ew, ne = g->ne;
            int64_t *er = HS<int64_t>(g, y.erows);
            for (int q = 0; q < B; q++) {
                req_state *st = &E->rs[slot[q]];
                const int p = b->req[q].start_pos, tk = b->req[q].tokens[0];
                st->etok[p] = map ? map[tk] : tk;
                int64_t back[V41_ENGRAM_MAX_NGRAM], o64[256];
                for (int i = 0; i < N; i++) back[i] = p - i >= 0 ? st->etok[p - i] : pad;
                for (int k = 0; k < ne; k++) {
                    v41_engram_hash_row(E->eh, k, back, o64);
                    for (int j = 0; j < ew; j++) er[((size_t)k * B + q) * ew + j] = (int32_t)o64[j];
                }
            }
        }
    }
    DCK(cudaMemcpyAsync(g->d_step, g->h_step, g->lay.total, cudaMemcpyHostToDevice, g->st), "step upload");
    // ---- run: replay the graph of this batch size, or capture it, or launch directly
    bool done = false;
    if (g->use_graph && !g->graph_broken) {
        auto it = g->graphs.find(B);
        if (it == g->graphs.end()) {
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            v41_err e2 = {};
            bool good = cudaStreamBeginCapture(g->st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
            int r2 = good ? enqueue_step(g, B, &e2) : V41_EINTERNAL;
            cudaError_t ce = cudaStreamEndCapture(g->st, &graph);
            good = good && !r2 && ce == cudaSuccess && graph &&
                   cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
            size_t nn = 0;
            if (good && cudaGraphGetNodes(graph, nullptr, &nn) == cudaSuccess && nn > g->graph_nodes)
                g->graph_nodes = nn;
            if (graph) cudaGraphDestroy(graph);
            if (!good) {
                cudaGetLastError();
                if (exec) cudaGraphExecDestroy(exec);
                g->graph_broken = true;
                if (g_env_flag("V41_GPU_VERBOSE"))
                    fprintf(stderr, "gpu engine (device path): graph capture failed (%s); launching directly\n",
                            r2 ? e2.msg : cudaGetErrorString(ce));
            } else {
                g->graphs[B] = exec;
                g->n_graph_capture++;
                it = g->graphs.find(B);
            }
        }
        if (!g->graph_broken) {
            DCK(cudaGraphLaunch(it->second, g->st), "graph launch");
            g->n_graph_launch++;
            done = true;
        }
    }
    if (!done && (rc = enqueue_step(g, B, err))) return rc;
    DCK(cudaMemcpyAsync(g->h_logits, g->logits, sizeof(float) * (size_t)B * c->vocab_size, cudaMemcpyDeviceToHost,
                        g->st), "logits download");
    DCK(cudaMemcpyAsync(g->h_am, g->am, sizeof(int32_t) * (size_t)B, cudaMemcpyDeviceToHost, g->st), "argmax download");
    DCK(cudaStreamSynchronize(g->st), "decode step");
    // ---- outputs and host bookkeeping, as ref_forward leaves them
    free(E->out_rowoff);
    free(E->out_logits);
    free(E->out_argmax);
    E->out_rowoff = (int *)malloc(sizeof(int) * (size_t)(B + 1));
    E->out_logits = (float *)malloc(sizeof(float) * (size_t)B * c->vocab_size);
    E->out_argmax = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
    if (!E->out_rowoff || !E->out_logits || !E->out_argmax) return v41_err_set(err, V41_ENOMEM, "out of memory");
    for (int q = 0; q <= B; q++) E->out_rowoff[q] = q;
    memcpy(E->out_logits, g->h_logits, sizeof(float) * (size_t)B * c->vocab_size);
    memcpy(E->out_argmax, g->h_am, sizeof(int32_t) * (size_t)B);
    if (out) {
        out->logits = E->out_logits;
        out->argmax = E->out_argmax;
        out->row_offset = E->out_rowoff;
    }
    for (int q = 0; q < B; q++) {
        req_state *st = &E->rs[slot[q]];
        slot_sync &y = sync_of(g, slot[q]);
        st->len = b->req[q].start_pos + 1;
        y.dlen = st->len;   // the host rows stay at hlen until gd_to_host
    }
    E->tap_step = e->step;
    e->step++;
    g->n_steps++;
    return V41_OK;
}
}  // namespace
