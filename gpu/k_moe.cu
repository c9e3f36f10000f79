// k_moe.cu: MoE routing and grouped expert FFN (SPEC §8).
//
// Routing: one block per token (E scores once, top-k by repeated block argmax with ties
// to the lower id). Expert FFN: a deterministic counting sort puts the
// assignments in (expert, token) order (one block per expert compacts its
// assignments in token order: no atomics, so the layout is reproducible), the
// rows are gathered, every expert with tokens runs two cuBLAS GEMMs (w1|w3
// fused, then w2) over its contiguous rows (spread over side streams so the
// small GEMMs run concurrently), and a combine kernel sums the
// expert outputs per token in expert-id order in fp32 (then the shared
// expert) and rounds once. Expert weights are either bf16 (w13/w2: fp4/fp8
// checkpoints dequantized on upload) or in their storage format (q13/q2:
// two grouped k_wq.cu GEMMs over the sorted rows, reading the token rows
// through a row-index list, with no host round trip); inputs of every expert
// Linear are act_quant'ed first, as the fp4/fp8 Linears do.
#include "g_internal.cuh"
#include <algorithm>
#include <vector>

#define MOE_KMAX 16

// One block per token. Every expert's score s and value v = s + bias is computed once, by the same
// formula as before (thread e % RT_THREADS), into shared memory; then each of the k picks is a block
// reduction that reproduces the sequential scan "best = the first unused expert, replaced by any
// later unused one with a larger v": the lowest-id maximum of the non-NaN values, unless the first
// unused expert's v is NaN (no later value compares larger than NaN, so the scan keeps it). The
// softmax statistics (score_func 1) keep their sequential order (one thread), so every score, pick
// and weight is the one-thread-per-token kernel's, bit for bit.
#define RT_THREADS 128
__global__ void __launch_bounds__(RT_THREADS)
g_route_kernel(const float *__restrict__ logits, const float *__restrict__ bias, int T, int E, int k,
               int score_func, float temp, int norm, float route_scale, int32_t *idx, float *wts)
{
    extern __shared__ float rt_sm[];   /* s[E], v[E], used[E] (bytes) */
    float *S = rt_sm, *V = rt_sm + E;
    unsigned char *used = (unsigned char *)(rt_sm + 2 * E);
    __shared__ float st_mx, st_den;
    __shared__ int r_best[RT_THREADS / 32], r_first[RT_THREADS / 32];
    __shared__ float r_bv[RT_THREADS / 32];
    __shared__ int chosen[MOE_KMAX];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const float *l = logits + (size_t)t * E;
    if (score_func == 1 && tid == 0) {
        float mx = -INFINITY, den = 0.0f;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, l[e] / temp);
        for (int e = 0; e < E; e++) den += g_expf_ref(l[e] / temp - mx);
        st_mx = mx; st_den = den;
    }
    __syncthreads();
    for (int e = tid; e < E; e += RT_THREADS) {
        const float z = l[e] / temp;
        float sv;
        if (score_func == 0) { float sp = z > 20.0f ? z : g_log1pf_ref(g_expf_ref(z)); sv = sqrtf(sp); }
        else if (score_func == 1) sv = g_expf_ref(z - st_mx) / st_den;
        else sv = 1.0f / (1.0f + g_expf_ref(-z));
        S[e] = sv;
        V[e] = sv + (bias ? bias[e] : 0.0f);
        used[e] = 0;
    }
    __syncthreads();
    for (int j = 0; j < k; j++) {
        int best = -1, first = E;
        float bv = -INFINITY;
        for (int e = tid; e < E; e += RT_THREADS) {   /* ascending: the first max of this thread's subset */
            if (used[e]) continue;
            first = min(first, e);
            const float v = V[e];
            if (v == v && (best < 0 || v > bv)) { best = e; bv = v; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const int ob = __shfl_xor_sync(0xffffffffu, best, o), of = __shfl_xor_sync(0xffffffffu, first, o);
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            if (ob >= 0 && (best < 0 || ov > bv || (ov == bv && ob < best))) { best = ob; bv = ov; }
            first = min(first, of);
        }
        if (lane == 0) { r_best[w] = best; r_bv[w] = bv; r_first[w] = first; }
        __syncthreads();
        if (tid == 0) {
            for (int q = 1; q < RT_THREADS / 32; q++) {
                const int ob = r_best[q];
                if (ob >= 0 && (best < 0 || r_bv[q] > bv || (r_bv[q] == bv && ob < best))) { best = ob; bv = r_bv[q]; }
                first = min(first, r_first[q]);
            }
            const int pick = (first < E && V[first] != V[first]) || best < 0 ? first : best;
            chosen[j] = pick;
            used[pick] = 1;
        }
        __syncthreads();
    }
    if (tid == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += S[chosen[j]];
        for (int j = 0; j < k; j++) {
            float wv = S[chosen[j]];
            if (norm && k > 1) wv /= (sum + 1e-20f);
            idx[(size_t)t * k + j] = chosen[j];
            wts[(size_t)t * k + j] = wv * route_scale;
        }
    }
}

extern "C" int v41g_moe_route(const float *logits, const float *bias, int T, int E, int k, int score_func,
                              float temp, int norm, float route_scale, int32_t *idx, float *wts, v41g_stream s)
{
    if (T <= 0) return 0;
    if (k > MOE_KMAX || k > E) return (int)cudaErrorInvalidValue;
    const size_t sm = (size_t)E * (2 * sizeof(float) + 1);
    if (sm > 48 * 1024) G_CHECK(cudaFuncSetAttribute(g_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    g_route_kernel<<<T, RT_THREADS, sm, G_STREAM(s)>>>(logits, bias, T, E, k, score_func, temp, norm, route_scale,
                                                      idx, wts);
    G_LAUNCHED();
    return 0;
}

// ---- workspace layout
struct moe_ws {
    int32_t *counts, *offsets, *perm, *pos_of, *xrow;
    uint16_t *xq, *xs, *h13, *h, *ye, *hs13, *hs, *ys;
    void *wsq;      /* workspace of the shared expert's storage-format Linears (v41g_wq_linear) */
    size_t wsq_bytes, total;
};
static size_t al256(size_t n) { return (n + 255) & ~(size_t)255; }
static moe_ws moe_layout(const v41g_moe *m, void *base)
{
    moe_ws w;
    size_t A = (size_t)m->T * m->k, o = 0;
    char *b = (char *)base;
#define TAKE(ptr, type, n) do { w.ptr = (type *)(b ? b + o : NULL); o += al256(sizeof(type) * (size_t)(n)); } while (0)
    TAKE(counts, int32_t, m->E);
    TAKE(offsets, int32_t, m->E + 1);
    TAKE(perm, int32_t, A);
    TAKE(pos_of, int32_t, A);
    TAKE(xq, uint16_t, (size_t)m->T * m->D);
    if (m->q13) {   // grouped storage-format GEMMs read the token rows through xrow: no gathered copy
        TAKE(xrow, int32_t, A);
        w.xs = NULL;
    } else {
        TAKE(xs, uint16_t, A * m->D);
        w.xrow = NULL;
    }
    TAKE(h13, uint16_t, A * 2 * m->I);
    TAKE(h, uint16_t, A * m->I);
    TAKE(ye, uint16_t, A * m->D);
    w.wsq_bytes = 0;
    w.wsq = NULL;
    if (m->w13s || m->q13s) {
        TAKE(hs13, uint16_t, (size_t)m->T * 2 * m->I);
        TAKE(hs, uint16_t, (size_t)m->T * m->I);
        TAKE(ys, uint16_t, (size_t)m->T * m->D);
        if (m->q13s) {
            // as the engines' dense Linears: from V41G_WQ_DEQUANT_ROWS tokens dequantize + cuBLAS (at
            // the MoE's 4096 tokens the packed kernel ran them at about a third of cuBLAS's rate)
            w.wsq_bytes = std::max(v41g_wq_linear_ws_bytes(m->q13s, m->T), v41g_wq_linear_ws_bytes(m->q2s, m->T));
            w.wsq = b ? b + o : NULL;
            o += al256(w.wsq_bytes);
        }
    } else { w.hs13 = w.hs = w.ys = NULL; }
#undef TAKE
    w.total = o;
    return w;
}

extern "C" size_t v41g_moe_ws_size(const v41g_moe *m) { return moe_layout(m, NULL).total; }

#define MS_THREADS 1024
// Block e: count assignments to expert e (pass 0), or compact them in token
// order to offsets[e].. and gather the rows (pass 1).
__global__ void __launch_bounds__(MS_THREADS)
g_moe_sort_kernel(const int32_t *__restrict__ idx, int A, int pass, int32_t *counts, const int32_t *offsets,
                  int32_t *perm, int32_t *pos_of)
{
    __shared__ int wsum[33];
    const int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int before = 0;
    for (int base = 0; base < A; base += MS_THREADS) {
        int a = base + threadIdx.x;
        int f = a < A && idx[a] == e;
        unsigned bal = __ballot_sync(0xffffffffu, f);
        int pre = __popc(bal & ((1u << lane) - 1u));
        __syncthreads();
        if (lane == 0) wsum[w] = __popc(bal);
        __syncthreads();
        if (w == 0) {
            const int v = wsum[lane], inc = g_warp_scan_incl(v, lane);
            wsum[lane] = inc - v;
            if (lane == 31) wsum[32] = inc;
        }
        __syncthreads();
        if (pass == 1 && f) {
            int pos = offsets[e] + before + wsum[w] + pre;
            perm[pos] = a;
            pos_of[a] = pos;
        }
        before += wsum[32];
    }
    if (pass == 0 && threadIdx.x == 0) counts[e] = before;
}

// offsets = exclusive prefix sum of counts (E + 1 entries), one block of 1024 threads over chunks of
// 1024 experts (integer sums: exact in any order)
__global__ void __launch_bounds__(1024) g_moe_scan_kernel(const int32_t *counts, int E, int32_t *offsets)
{
    __shared__ int wsum[32];
    __shared__ int carry;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int base = 0; base < E; base += 1024) {
        const int e = base + threadIdx.x, v = e < E ? counts[e] : 0;
        const int inc = g_warp_scan_incl(v, lane);
        if (lane == 31) wsum[w] = inc;
        __syncthreads();
        if (w == 0) {
            const int x = wsum[lane];
            wsum[lane] = g_warp_scan_incl(x, lane) - x;   /* exclusive prefix of the warp totals */
        }
        __syncthreads();
        const int c0 = carry;
        if (e < E) offsets[e] = c0 + wsum[w] + inc - v;
        __syncthreads();   // everyone has read carry and wsum
        if (threadIdx.x == 1023) carry = c0 + wsum[31] + inc;   /* + the chunk's total */
        __syncthreads();
    }
    if (threadIdx.x == 0) offsets[E] = carry;
}

// xs[pos] = xq[perm[pos] / k]
__global__ void g_moe_gather_kernel(const uint16_t *__restrict__ xq, const int32_t *__restrict__ perm, int A, int k,
                                    int D, uint16_t *__restrict__ xs)
{
    int nv = D / 8;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)A * nv) return;
    int pos = (int)(i / nv), v = (int)(i % nv);
    int t = perm[pos] / k;
    *(uint4 *)(xs + (size_t)pos * D + v * 8) = *(const uint4 *)(xq + (size_t)t * D + v * 8);
}

// xrow[pos] = the token of sorted assignment pos
__global__ void g_moe_xrow_kernel(const int32_t *__restrict__ perm, int A, int k, int32_t *__restrict__ xrow)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < A) xrow[i] = perm[i] / k;
}

// h[r, i] = bf16(silu(min(g, L)) * clamp(u, -L, L) * wt[r]); g, u = h13[r, i], h13[r, I+i].
// A thread does 8 consecutive columns (16-byte loads and store; I % 8 == 0): one element a thread,
// with 2-byte accesses and a 64-bit division for its row each, took about 4x the time of its bytes
// at the MoE's 4096 tokens (H200, session 23).
__global__ void g_swiglu_kernel(const uint16_t *__restrict__ h13, const float *__restrict__ wts,
                                const int32_t *__restrict__ perm, int R, int I, float L, uint16_t *__restrict__ h)
{
    const int nv = I / 8;
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)R * nv) return;
    const int r = (int)(i / nv), c = (int)(i % nv) * 8;
    const uint4 gv = *(const uint4 *)(h13 + (size_t)r * 2 * I + c), uv = *(const uint4 *)(h13 + (size_t)r * 2 * I + I + c);
    const float wt = wts ? wts[perm ? perm[r] : r] : 1.0f;
    uint4 o;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float g = g_bf2f(((const uint16_t *)&gv)[j]), u = g_bf2f(((const uint16_t *)&uv)[j]);
        if (L > 0.0f) { g = fminf(g, L); u = fminf(fmaxf(u, -L), L); }
        const float silu = g / (1.0f + g_expf_ref(-g));   /* glibc-equivalent exp, as ref (g_internal.cuh) */
        ((uint16_t *)&o)[j] = g_f2bf(silu * u * wt);
    }
    *(uint4 *)(h + (size_t)r * I + c) = o;
}
static void swiglu(const uint16_t *h13, const float *wts, const int32_t *perm, int R, int I, float L, uint16_t *h,
                   cudaStream_t st)
{
    g_swiglu_kernel<<<(unsigned)(((size_t)R * (I / 8) + 255) / 256), 256, 0, st>>>(h13, wts, perm, R, I, L, h);
}

// out[t] = bf16(sum over the token's experts in id order of ye[pos] (+ ys[t])), fp32 accumulate from 0.
__global__ void g_moe_combine_kernel(const uint16_t *__restrict__ ye, const uint16_t *__restrict__ ys,
                                     const int32_t *__restrict__ idx, const int32_t *__restrict__ pos_of, int T, int k,
                                     int D, uint16_t *__restrict__ out)
{
    int nv = D / 8;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * nv) return;
    int t = (int)(i / nv), v = (int)(i % nv);
    int ord[MOE_KMAX];
    for (int j = 0; j < k; j++) ord[j] = j;
    for (int a = 1; a < k; a++)       // insertion sort of the k choices by expert id
        for (int b = a; b > 0 && idx[(size_t)t * k + ord[b]] < idx[(size_t)t * k + ord[b - 1]]; b--) {
            int tmp = ord[b]; ord[b] = ord[b - 1]; ord[b - 1] = tmp;
        }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < k; j++) {
        int pos = pos_of[(size_t)t * k + ord[j]];
        uint4 y = *(const uint4 *)(ye + (size_t)pos * D + v * 8);
#pragma unroll
        for (int u = 0; u < 8; u++) acc[u] += g_bf2f(((const uint16_t *)&y)[u]);
    }
    if (ys) {
        uint4 y = *(const uint4 *)(ys + (size_t)t * D + v * 8);
#pragma unroll
        for (int u = 0; u < 8; u++) acc[u] += g_bf2f(((const uint16_t *)&y)[u]);
    }
    uint4 o;
#pragma unroll
    for (int u = 0; u < 8; u++) ((uint16_t *)&o)[u] = g_f2bf(acc[u]);
    *(uint4 *)(out + (size_t)t * D + v * 8) = o;
}

// Shared expert: w1|w3, SwiGLU (no routing weight), act_quant, w2 into w.ys; weights in their
// storage format (q13s/q2s) or bf16 (w13s/w2s).
static int moe_shared(const v41g_moe *m, const moe_ws &w, cudaStream_t st)
{
    const int T = m->T, D = m->D, I = m->I;
    int rc = m->q13s ? v41g_wq_linear(m->q13s, w.xq, T, w.hs13, 0, w.wsq, w.wsq_bytes, st)
                     : v41g_gemm_bf16(w.xq, m->w13s, w.hs13, T, 2 * I, D, 0, 1, 0, 0, 0, st);
    if (rc) return rc;
    swiglu(w.hs13, NULL, NULL, T, I, m->limit, w.hs, st);
    G_LAUNCHED();
    if ((rc = v41g_act_quant(w.hs, NULL, NULL, w.hs, T, I, st))) return rc;
    return m->q13s ? v41g_wq_linear(m->q2s, w.hs, T, w.ys, 0, w.wsq, w.wsq_bytes, st)
                   : v41g_gemm_bf16(w.hs, m->w2s, w.ys, T, D, I, 0, 1, 0, 0, 0, st);
}

// Routed experts with storage-format weights: two grouped GEMMs over the sorted assignments
// (groups = experts, offsets on the device), nothing waits for the host. Out: w.ye.
static int moe_routed_wq(const v41g_moe *m, const moe_ws &w, const float *wts, cudaStream_t st)
{
    const int A = m->T * m->k, I = m->I;
    int rc;
    g_moe_xrow_kernel<<<(A + 255) / 256, 256, 0, st>>>(w.perm, A, m->k, w.xrow);
    G_LAUNCHED();
    if ((rc = v41g_wq_gemm_grouped(m->q13, m->E, w.offsets, w.xrow, w.xq, A, w.h13, 0, st))) return rc;
    swiglu(w.h13, wts, w.perm, A, I, m->limit, w.h, st);
    G_LAUNCHED();
    if ((rc = v41g_act_quant(w.h, NULL, NULL, w.h, A, I, st))) return rc;
    return v41g_wq_gemm_grouped(m->q2, m->E, w.offsets, NULL, w.h, A, w.ye, 0, st);
}

// Routed experts with bf16 weights: the rows gathered, then one cuBLAS GEMM per expert with
// tokens. The per-expert GEMMs are small (M = a few to a few hundred rows): one at a time they
// leave most SMs idle, so they are spread round-robin over the G_SIDE_STREAMS side streams of
// g_side (each with its own cuBLAS handle). The host reads the per-expert row counts. Out: w.ye.
static int moe_routed_bf16(const v41g_moe *m, const moe_ws &w, const float *wts, cudaStream_t st)
{
    const int A = m->T * m->k, D = m->D, I = m->I;
    int rc;
    g_moe_gather_kernel<<<(unsigned)(((size_t)A * (D / 8) + 255) / 256), 256, 0, st>>>(w.xq, w.perm, A, m->k, D, w.xs);
    G_LAUNCHED();
    std::vector<int32_t> off(m->E + 1);
    G_CHECK(cudaMemcpyAsync(off.data(), w.offsets, sizeof(int32_t) * (m->E + 1), cudaMemcpyDeviceToHost, st));
    G_CHECK(cudaStreamSynchronize(st));
    const size_t w13sz = (size_t)2 * I * D, w2sz = (size_t)D * I;
    g_side sd(G_SIDE_STREAMS);
    if (!sd.ok()) return (int)cudaErrorNotReady;
    G_CHECK(sd.fork(st));
    for (int e = 0, j = 0; e < m->E; e++) {
        int n = off[e + 1] - off[e];
        if (!n) continue;
        if ((rc = g_gemm_bf16_side(j, w.xs + (size_t)off[e] * D, m->w13 + e * w13sz, w.h13 + (size_t)off[e] * 2 * I,
                                   n, 2 * I, D, sd.s[j]))) return rc;
        j = (j + 1) % G_SIDE_STREAMS;
    }
    G_CHECK(sd.join(st));
    swiglu(w.h13, wts, w.perm, A, I, m->limit, w.h, st);
    G_LAUNCHED();
    if ((rc = v41g_act_quant(w.h, NULL, NULL, w.h, A, I, st))) return rc;
    G_CHECK(sd.fork(st));
    for (int e = 0, j = 0; e < m->E; e++) {
        int n = off[e + 1] - off[e];
        if (!n) continue;
        if ((rc = g_gemm_bf16_side(j, w.h + (size_t)off[e] * I, m->w2 + e * w2sz, w.ye + (size_t)off[e] * D,
                                   n, D, I, sd.s[j]))) return rc;
        j = (j + 1) % G_SIDE_STREAMS;
    }
    G_CHECK(sd.join(st));
    return 0;
}

extern "C" int v41g_moe_ffn(const v41g_moe *m, const uint16_t *x, const int32_t *idx, const float *wts, void *ws,
                            uint16_t *out, v41g_stream s)
{
    if (m->T <= 0) return 0;
    if (m->D % 32 || m->I % 32 || m->k > MOE_KMAX) return (int)cudaErrorInvalidValue;
    if (m->q13 && (!m->q2 || m->q13->N != 2 * m->I || m->q13->K != m->D || m->q2->N != m->D || m->q2->K != m->I))
        return (int)cudaErrorInvalidValue;
    if (m->q13 && m->w13s && !m->q13s) return (int)cudaErrorInvalidValue;   /* storage-format routed, bf16 shared */
    if (m->q13s && (!m->q2s || m->q13s->N != 2 * m->I || m->q13s->K != m->D || m->q2s->N != m->D ||
                    m->q2s->K != m->I))
        return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    moe_ws w = moe_layout(m, ws);
    const int A = m->T * m->k, D = m->D;
    int rc;
    if ((rc = v41g_act_quant(x, NULL, NULL, w.xq, m->T, D, s))) return rc;
    g_moe_sort_kernel<<<m->E, MS_THREADS, 0, st>>>(idx, A, 0, w.counts, NULL, NULL, NULL);
    G_LAUNCHED();
    g_moe_scan_kernel<<<1, 1024, 0, st>>>(w.counts, m->E, w.offsets);
    G_LAUNCHED();
    g_moe_sort_kernel<<<m->E, MS_THREADS, 0, st>>>(idx, A, 1, w.counts, w.offsets, w.perm, w.pos_of);
    G_LAUNCHED();
    if ((rc = m->q13 ? moe_routed_wq(m, w, wts, st) : moe_routed_bf16(m, w, wts, st))) return rc;
    if ((m->q13s || m->w13s) && (rc = moe_shared(m, w, st))) return rc;
    // w.ys is NULL without a shared expert (moe_layout)
    g_moe_combine_kernel<<<(unsigned)(((size_t)m->T * (D / 8) + 255) / 256), 256, 0, st>>>(
        w.ye, w.ys, idx, w.pos_of, m->T, m->k, D, out);
    G_LAUNCHED();
    return 0;
}
