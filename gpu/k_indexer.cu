// k_indexer.cu: lightning indexer scores and top-k selection (SPEC §6).
//
// Scores: one block per (query row, 128 keys). The nI heads are the M
// dimension of a tensor-core GEMM S = Q.K^T (bf16, fp32 accumulate); then
// per key: I = bf16(sum_h bf16(w_h) * relu(bf16(S_h))) with the heads summed in
// order in fp32. Keys past the row's visible count are not read.
//
// Top-k: one block per row, radix select on the 16-bit order-preserving key
// of the bf16 score: the row is read once (keys cached in shared memory up to
// 80K positions), two 8-bit histogram passes (warp-aggregated shared-memory
// atomics) find the k-th largest value and how many of its ties are needed,
// then an ordered compaction (each warp owns a contiguous range; a scan over
// the 32 warps gives each its tie quota and output offset; ballots rank within
// 32 positions) emits the chosen positions ascending. Ties go to the lower
// position because the quota is handed out in position order. No sort.
#include "g_internal.cuh"
#include <mma.h>
using namespace nvcuda;

#define IX_KT 128     /* keys per block */
#define IX_THREADS 256

__global__ void __launch_bounds__(IX_THREADS)
g_indexer_kernel(const uint16_t *__restrict__ q, const float *__restrict__ w, const uint16_t *__restrict__ k,
                 const int64_t *__restrict__ kbase, const int32_t *__restrict__ visible, int nI, int dI, int S,
                 float *__restrict__ I)
{
    extern __shared__ __align__(128) unsigned char smem[];
    const int t = blockIdx.y, s0 = blockIdx.x * IX_KT;
    const int nIp = (nI + 15) & ~15, ld = dI + 8, lds = IX_KT + 4;
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)smem;                 // [nIp][ld]
    __nv_bfloat16 *Ks = Qs + (size_t)nIp * ld;                  // [IX_KT][ld]
    float *Ss = (float *)(Ks + (size_t)IX_KT * ld);             // [nIp][lds]
    float *Ws = Ss + (size_t)nIp * lds;                         // [nIp]
    const int tid = threadIdx.x, warp = tid >> 5;
    const int vis = visible[t];
    const int nv = dI / 8;
    float *Irow = I + (size_t)t * S;
    if (s0 >= vis) {   // whole tile invisible: -inf, nothing to read
        for (int i = tid; i < IX_KT && s0 + i < S; i += IX_THREADS) Irow[s0 + i] = -INFINITY;
        return;
    }
    for (int i = tid; i < nIp * nv; i += IX_THREADS) {
        int r = i / nv, c = i % nv;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nI) v = *(const uint4 *)(q + ((size_t)t * nI + r) * dI + c * 8);
        *(uint4 *)(Qs + r * ld + c * 8) = v;
    }
    if (tid < nIp) Ws[tid] = tid < nI ? g_rbf(w[(size_t)t * nI + tid]) : 0.0f;
    const uint16_t *kb = k + (size_t)kbase[t] * dI;
    for (int i = tid; i < IX_KT * nv; i += IX_THREADS) {
        int r = i / nv, c = i % nv;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (s0 + r < vis) v = __ldg((const uint4 *)(kb + (size_t)(s0 + r) * dI + c * 8));
        *(uint4 *)(Ks + r * ld + c * 8) = v;
    }
    __syncthreads();
    const int ntiles = (nIp / 16) * (IX_KT / 16);
    for (int ti = warp; ti < ntiles; ti += IX_THREADS / 32) {
        int rt = ti / (IX_KT / 16), ct = ti % (IX_KT / 16);
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < dI; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
            wmma::load_matrix_sync(fa, Qs + rt * 16 * ld + kk, ld);
            wmma::load_matrix_sync(fb, Ks + ct * 16 * ld + kk, ld);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(Ss + rt * 16 * lds + ct * 16, acc, lds, wmma::mem_row_major);
    }
    __syncthreads();
    for (int c = tid; c < IX_KT; c += IX_THREADS) {
        int s = s0 + c;
        if (s >= S) break;
        float acc = 0.0f;
        for (int h = 0; h < nI; h++) acc += Ws[h] * fmaxf(g_rbf(Ss[h * lds + c]), 0.0f);
        Irow[s] = s < vis ? g_rbf(acc) : -INFINITY;
    }
}

extern "C" int v41g_indexer_scores(const uint16_t *q, const float *w, const uint16_t *k, const int64_t *kbase,
                                   const int32_t *visible, int T, int nI, int dI, int S, float *I, v41g_stream s)
{
    if (T <= 0 || S <= 0) return 0;
    if (dI % 16) return (int)cudaErrorInvalidValue;
    int nIp = (nI + 15) & ~15;
    size_t sm = (size_t)(nIp + IX_KT) * (dI + 8) * 2 + (size_t)nIp * (IX_KT + 4) * 4 + nIp * 4;
    G_CHECK(cudaFuncSetAttribute(g_indexer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    g_indexer_kernel<<<dim3((S + IX_KT - 1) / IX_KT, T), IX_THREADS, sm, G_STREAM(s)>>>(q, w, k, kbase, visible,
                                                                                      nI, dI, S, I);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ top-k
#define TK_THREADS 1024

// Order-preserving 16-bit key of a bf16-valued fp32 score (larger key = larger score).
__device__ __forceinline__ uint32_t g_score_key(float f)
{
    uint32_t b = __float_as_uint(f) >> 16;
    return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// Histogram with warp aggregation: equal bins within a warp add once (bf16
// scores crowd into few high-byte bins, so plain atomics would serialise).
__device__ __forceinline__ void g_hist_add(int *hist, int bin /* <0: none */)
{
    unsigned peers = __match_any_sync(0xffffffffu, bin);
    int leader = __ffs(peers) - 1;
    if (bin >= 0 && (int)(threadIdx.x & 31) == leader) atomicAdd(&hist[bin], __popc(peers));
}

#define TK_SMEM_MAX (160 * 1024)   /* keys cached in shared memory up to 80K positions */

__global__ void __launch_bounds__(TK_THREADS)
g_topk_kernel(const float *__restrict__ I, const int32_t *__restrict__ visible, int S, int k,
              int32_t *__restrict__ out, uint8_t *tie_cut, int cache)
{
    extern __shared__ __align__(16) unsigned char tk_smem[];
    uint16_t *keys = (uint16_t *)tk_smem;   // [S] when cache
    __shared__ int hist[256];
    __shared__ int wcnt[2][32], wpre[2][32];
    __shared__ int sel_hi, sel_lo, above_hi, above;
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *row = I + (size_t)t * S;
    int32_t *orow = out + (size_t)t * k;
    const int kk = min(k, S);
    auto key_at = [&](int s) -> uint32_t { return cache ? (uint32_t)keys[s] : g_score_key(row[s]); };
    // pass 1: read the row once (8 loads in flight per thread), cache the keys, histogram the high byte
    for (int i = tid; i < 256; i += TK_THREADS) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < S; base += TK_THREADS * 8) {
        uint32_t kv[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int s = base + u * TK_THREADS + tid;
            kv[u] = s < S ? g_score_key(row[s]) : 0xffffffffu;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int s = base + u * TK_THREADS + tid;
            if (cache && s < S) keys[s] = (uint16_t)kv[u];
            g_hist_add(hist, s < S ? (int)(kv[u] >> 8) : -1);
        }
    }
    __syncthreads();
    if (tid == 0) {
        int cum = 0, b = 255;
        for (; b > 0; b--) { if (cum + hist[b] >= kk) break; cum += hist[b]; }
        sel_hi = b; above_hi = cum;
    }
    __syncthreads();
    // pass 2: low byte among keys with that high byte
    for (int i = tid; i < 256; i += TK_THREADS) hist[i] = 0;
    __syncthreads();
    const uint32_t hi = (uint32_t)sel_hi;
    for (int base = 0; base < S; base += TK_THREADS) {
        int s = base + tid, bin = -1;
        if (s < S) { uint32_t key = key_at(s); if ((key >> 8) == hi) bin = (int)(key & 255); }
        g_hist_add(hist, bin);
    }
    __syncthreads();
    if (tid == 0) {
        int cum = above_hi, b = 255;
        for (; b > 0; b--) { if (cum + hist[b] >= kk) break; cum += hist[b]; }
        sel_lo = b; above = cum;
        if (tie_cut) {
            uint32_t thr = (hi << 8) | (uint32_t)b;
            // a tie straddles the cut when some equal keys are left out (and they are real scores)
            tie_cut[t] = (uint8_t)(cum + hist[b] > kk && thr != g_score_key(-INFINITY));
        }
    }
    __syncthreads();
    const uint32_t thr = (hi << 8) | (uint32_t)sel_lo;
    const int need = kk - above;          // how many keys equal to thr are taken (lowest positions)
    const int vis = visible[t];
    // ordered compaction: warp w owns a contiguous range, walked 32 positions at a time
    const int per_w = ((S + 32 * 32 - 1) / (32 * 32)) * 32;
    const int ws0 = min(S, warp * per_w), ws1 = min(S, ws0 + per_w);
    const unsigned lt = (1u << lane) - 1u;
    int n_gt = 0, n_eq = 0;
    for (int b0 = ws0; b0 < ws1; b0 += 32) {
        int s = b0 + lane;
        uint32_t key = s < ws1 ? key_at(s) : 0;
        n_gt += __popc(__ballot_sync(0xffffffffu, s < ws1 && key > thr));
        n_eq += __popc(__ballot_sync(0xffffffffu, s < ws1 && key == thr));
    }
    if (lane == 0) { wcnt[0][warp] = n_eq; wcnt[1][warp] = n_gt; }
    __syncthreads();
    if (warp == 0) {   // exclusive scans over the 32 warps: ties before, then output offsets
        int e = wcnt[0][lane], ei = e;
        for (int o = 1; o < 32; o <<= 1) { int n = __shfl_up_sync(0xffffffffu, ei, o); if (lane >= o) ei += n; }
        int eq_before = ei - e;
        int quota = max(0, min(e, need - eq_before));
        int sc = wcnt[1][lane] + quota, si = sc;
        for (int o = 1; o < 32; o <<= 1) { int n = __shfl_up_sync(0xffffffffu, si, o); if (lane >= o) si += n; }
        wpre[0][lane] = quota;
        wpre[1][lane] = si - sc;
    }
    __syncthreads();
    int quota = wpre[0][warp], posb = wpre[1][warp], eq_seen = 0;
    for (int b0 = ws0; b0 < ws1; b0 += 32) {
        int s = b0 + lane;
        uint32_t key = s < ws1 ? key_at(s) : 0;
        bool eq = s < ws1 && key == thr;
        unsigned beq = __ballot_sync(0xffffffffu, eq);
        bool sel = (s < ws1 && key > thr) || (eq && eq_seen + __popc(beq & lt) < quota);
        unsigned bsel = __ballot_sync(0xffffffffu, sel);
        if (sel) orow[posb + __popc(bsel & lt)] = s < vis ? s : -1;
        posb += __popc(bsel);
        eq_seen += __popc(beq);
    }
    for (int j = kk + tid; j < k; j += TK_THREADS) orow[j] = -1;
}

extern "C" int v41g_topk(const float *I, const int32_t *visible, int T, int S, int k, int32_t *out,
                         uint8_t *tie_cut, v41g_stream s)
{
    if (T <= 0 || k <= 0) return 0;
    int cache = (size_t)S * 2 <= TK_SMEM_MAX;
    size_t sm = cache ? (size_t)S * 2 : 0;
    if (cache) G_CHECK(cudaFuncSetAttribute(g_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TK_SMEM_MAX));
    g_topk_kernel<<<T, TK_THREADS, sm, G_STREAM(s)>>>(I, visible, S, k, out, tie_cut, cache);
    G_LAUNCHED();
    return 0;
}
