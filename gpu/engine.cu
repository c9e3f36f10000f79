// engine.cu: v41_gpu_engine_create (the v41_engine interface on CUDA), first stage.
//
// What runs where (docs/gpu.md, "GPU engine"):
//  - every Linear of the forward pass (q/kv/o projections, grouped wo_a, compressor
//    and indexer projections, hc mixes, gate, routed + shared experts, Engram wkv,
//    final head, DSpark main_proj / Markov head / confidence) runs on the device:
//    weights uploaded once per engine (first use), dequantized to bf16 (exact for
//    fp8/fp4/bf16 checkpoints); emulate-mode fp8/fp4 Linears run v41g_act_quant on
//    the device then a cuBLAS bf16 GEMM with fp32 accumulation (v41g_gemm_bf16);
//    bf16 Linears the same GEMM without act_quant; fp32 Linears (and fp32 precision
//    mode) a cuBLAS fp32 SGEMM (no TF32); outputs rounded to bf16 where ref rounds.
//  - the orchestration (caches, window/compressed lists, compressor state,
//    indexer scores and top-k, candidate blocks, sparse attention, mHC Sinkhorn,
//    routing, Engram, DSpark control, replay/trimming, taps, teacher forcing) is
//    the reference code compiled a second time (gpu/engine_hyb.c) and runs on the
//    host between the GEMMs. NOT yet the device-resident engine of issue 5.
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
#include <cublas_v2.h>
#include <map>
#include <tuple>
#include <vector>
#include <string.h>
#include <stdlib.h>

extern "C" int v41gh_ref_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out,
                                       v41_err *err);
extern "C" int v41gh_linear(const v41_lin *L, const float *x, int64_t M, float *y, bool emu, v41_err *err);
extern "C" int v41gh_linear_ld(const v41_lin *L, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                               bool emu, v41_err *err);

namespace {

struct gh_w {
    void *d = nullptr;
    bool bf = false;   // bf16 bits (else fp32)
};

typedef std::tuple<const void *, int64_t, int64_t, int64_t, bool> gh_key;

struct gh_ctx {
    cublasHandle_t h = nullptr;
    std::map<gh_key, gh_w> w;
    size_t wbytes = 0;
    void *dx = nullptr, *dq = nullptr, *dy = nullptr;
    size_t cx = 0, cq = 0, cy = 0;
    std::vector<float> a, yb;
    std::vector<uint16_t> ab;
    long n_gpu = 0, n_cpu = 0;
    const v41_engine_vtbl *ref = nullptr;
    v41_engine_vtbl vt;
};

thread_local gh_ctx *tl_ctx = nullptr;

struct gh_scope {   // sets the thread's engine for one vtable call
    gh_ctx *prev;
    explicit gh_scope(gh_ctx *g) : prev(tl_ctx) { tl_ctx = g; }
    ~gh_scope() { tl_ctx = prev; }
};

inline gh_ctx *ctx_of(v41_engine *e) { return (gh_ctx *)e->impl; }

inline bool bf_exact(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0xffffu) == 0;
}
inline uint16_t bf_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

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

// Weight of a Linear on the device: uploaded on first use, kept until destroy.
int get_weight(gh_ctx *g, const v41_lin *L, bool want_bf, gh_w **out, v41_err *err)
{
    gh_key k(L->w, L->row0, L->N, L->K, want_bf);
    auto it = g->w.find(k);
    if (it != g->w.end()) { *out = &it->second; return V41_OK; }
    const int64_t N = L->N, K = L->K;
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
    return ctx_of(e)->ref->forward(e, b, out, err);
}
int gh_draft(v41_engine *e, int req_id, int p, int32_t first, int32_t *ids, float *conf, v41_err *err)
{
    gh_scope s(ctx_of(e));
    return ctx_of(e)->ref->dspark_draft(e, req_id, p, first, ids, conf, err);
}
int gh_draft_batch(v41_engine *e, int n, const int *req_ids, const int *ps, const int32_t *firsts, int32_t *ids,
                   float *conf, v41_err *err)
{
    gh_scope s(ctx_of(e));
    return ctx_of(e)->ref->dspark_draft_batch(e, n, req_ids, ps, firsts, ids, conf, err);
}
int gh_truncate(v41_engine *e, int req_id, int pos, v41_err *err)
{
    gh_scope s(ctx_of(e));
    return ctx_of(e)->ref->truncate(e, req_id, pos, err);
}
int gh_fork(v41_engine *e, int src, int dst, int n, v41_err *err)
{
    gh_scope s(ctx_of(e));
    return ctx_of(e)->ref->fork(e, src, dst, n, err);
}
void gh_release(v41_engine *e, int req_id) { ctx_of(e)->ref->release(e, req_id); }
void gh_destroy(v41_engine *e)
{
    if (!e) return;
    gh_ctx *g = ctx_of(e);
    e->impl = nullptr;
    const v41_engine_vtbl *ref = g->ref;
    e->vt = ref;
    ref->destroy(e);
    if (getenv("V41_GPU_VERBOSE"))
        fprintf(stderr, "gpu engine: %ld Linears on the device, %ld on the host, %.1f MiB of weights uploaded\n",
                g->n_gpu, g->n_cpu, (double)g->wbytes / 1048576.0);
    for (auto &kv : g->w) cudaFree(kv.second.d);
    if (g->dx) cudaFree(g->dx);
    if (g->dq) cudaFree(g->dq);
    if (g->dy) cudaFree(g->dy);
    if (g->h) cublasDestroy(g->h);
    delete g;
}

}  // namespace

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
    int rc = get_weight(g, L, want_bf, &W, err);
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
    cudaError_t ce;
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
        int kr = v41g_gemm_bf16(xin, (const uint16_t *)W->d, g->dy, (int)M, (int)N, (int)K, 1, 1, 0, 0, 0, NULL);
        if (kr) return v41_err_set(err, V41_EINTERNAL, "gpu engine: bf16 GEMM %s: %s", L->w->name ? L->w->name : "?",
                                   v41g_error_string(kr));
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
    e->impl = g;
    e->vt = &g->vt;
    *out = e;
    return V41_OK;
}
