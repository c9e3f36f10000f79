// k_indexer.cu: lightning indexer scores and top-k selection (SPEC §6).
//
// Scores (fast path, nI <= 32, dI in {32,64,96,128}): I = bf16(sum_h
// bf16(bf16(w_h) * relu(bf16(q_h.k_s)))), each head's term rounded to bf16 and
// the terms summed in head order in fp32 (SPEC §6, the ref engine's rounding points). One block of 8 warps
// per (query row, 256*G keys); Q sits in shared memory (loaded once per
// block), keys go straight from global memory into mma.sync B fragments: the
// dI dimension is permuted identically in Q and K so that each thread's four
// 16-byte loads of a key row are exactly its B-fragment registers (thread c
// of a key's quad holds dims 8c+32u..8c+32u+7, u < dI/32). A warp handles 32
// keys at a time (4 n-tiles of 8 keys, all 16 loads in flight, 2 m-tiles of
// 16 heads), then transposes relu(bf16(S)) (exact in bf16) through a per-warp
// shared buffer so that lane L sums key L's heads in order. Keys past the
// row's visible count are not read. Other shapes use the generic wmma kernel.
//
// Top-k: one cluster of CL blocks per row (CL = 1, 2, 4 or 8: the fewest that keep a
// block's share <= 8K positions; CL = 1 is a plain block, no cluster), each block owning 1/CL of the row
// (keys cached in its shared memory). Radix select on the 16-bit
// order-preserving key of the bf16 score: two 8-bit histogram passes
// (lane-replicated shared histograms, so no same-address atomics; per-block
// histograms merged through distributed shared memory) find the k-th largest
// value and how many of its ties are needed, then an ordered compaction: the
// blocks' (greater, equal) counts are scanned over the cluster in position
// order (ties go to the lowest positions), then over the warps of a block
// (each warp owns a contiguous range; ballots rank within 32 positions), so
// the chosen positions come out ascending. No sort.
#include "g_internal.cuh"
#include <mma.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
using namespace nvcuda;

#define IX_KT 128     /* keys per block */
#define IX_THREADS 256

__global__ void __launch_bounds__(IX_THREADS)
g_indexer_generic(const uint16_t *__restrict__ q, const float *__restrict__ w, const uint16_t *__restrict__ k,
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
        for (int h = 0; h < nI; h++) acc += g_rbf(Ws[h] * fmaxf(g_rbf(Ss[h * lds + c]), 0.0f));
        Irow[s] = s < vis ? g_rbf(acc) : -INFINITY;
    }
}


// ------------------------------------------------------------------ scores, fast path
#define IXF_THREADS 256
#define IXF_EST 80    /* bytes per key row of the epilogue transpose buffer (32 heads bf16 + 16 pad) */

__device__ __forceinline__ uint4 ixf_ld_stream(const uint16_t *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void ixf_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Keys key0 + 8j (j < 4) of a group: this thread's dims 8c+32u .. +7 (u < KU; kb already offset by 8c),
// zero past the visible count.
template <int KU>
__device__ __forceinline__ void ixf_load_keys(uint4 (&kv)[4][KU], const uint16_t *kb, int key0, int vis)
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int key = key0 + 8 * j;
#pragma unroll
        for (int u = 0; u < KU; u++)
            kv[j][u] = key < vis ? ixf_ld_stream(kb + (size_t)key * (32 * KU) + 32 * u) : make_uint4(0, 0, 0, 0);
    }
}

// MT m-tiles of 16 heads (nI <= 16*MT), KU = dI/32. Block: query row t = blockIdx.x / nchunk,
// keys [s0, s0 + 256*G); warp w takes the 32-key groups w, w+8, ...
template <int MT, int KU>
__global__ void __launch_bounds__(IXF_THREADS, 2)
g_indexer_fast(const uint16_t *__restrict__ q, const float *__restrict__ w, const uint16_t *__restrict__ k,
               const int64_t *__restrict__ kbase, const int32_t *__restrict__ visible, int nI, int S, int nchunk,
               int G, float *__restrict__ I)
{
    constexpr int DI = 32 * KU, NH = 16 * MT;
    constexpr int QST = ((KU * 64 + 127) / 128) * 128 + 64;   // Q row stride in bytes (= 64 mod 128: no conflicts)
    __shared__ __align__(16) unsigned char Qs[NH * QST];
    __shared__ __align__(16) float Ws[NH];
    __shared__ __align__(16) unsigned char Es[IXF_THREADS / 32][32 * IXF_EST];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int t = blockIdx.x / nchunk, ch = blockIdx.x - t * nchunk;
    const int s0 = ch * 256 * G, s1 = min(S, s0 + 256 * G);
    const int vis = max(0, min(visible[t], S));
    float *Irow = I + (size_t)t * S;
    if (s0 >= vis) {   // whole range invisible: -inf, nothing to read
        for (int s = s0 + tid; s < s1; s += IXF_THREADS) Irow[s] = -INFINITY;
        return;
    }
    const uint16_t *kb = k + (size_t)kbase[t] * DI + 8 * c;
    // first group's keys in flight before the Q fill (loads nothing past the visible count)
    uint4 kv[4][KU];
    const int lim = min(vis, s1);   // keys read: [s0, lim)
    int gs = s0 + warp * 32;        // this warp's groups: gs, gs + 256, ...
    ixf_load_keys<KU>(kv, kb, gs + g, lim);
    for (int i = tid; i < NH * (DI / 8); i += IXF_THREADS) {
        int r = i / (DI / 8), cc = i % (DI / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nI) v = __ldg((const uint4 *)(q + ((size_t)t * nI + r) * DI + cc * 8));
        *(uint4 *)(Qs + r * QST + cc * 16) = v;
    }
    if (tid < NH) Ws[tid] = tid < nI ? g_rbf(w[(size_t)t * nI + tid]) : 0.0f;
    __syncthreads();
    unsigned char *E = Es[warp];
    for (; gs < lim; gs += IXF_THREADS) {   // groups with visible keys (kv holds this group's keys)
        float acc[4][MT][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[j][m][r] = 0.0f;
#pragma unroll
        for (int u = 0; u < KU; u++) {
#pragma unroll
            for (int m = 0; m < MT; m++) {
                // heads 16m+g and 16m+8+g, dims 8c+32u .. +7
                const uint4 a0 = *(const uint4 *)(Qs + (16 * m + g) * QST + 16 * c + 64 * u);
                const uint4 a1 = *(const uint4 *)(Qs + (16 * m + 8 + g) * QST + 16 * c + 64 * u);
                // k-step (u, v): logical k 2c+{0,1} = dims 8c+32u+4v+{0,1} (word 2v), 2c+8+{0,1} = +{2,3} (2v+1)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    ixf_mma(acc[j][m], a0.x, a1.x, a0.y, a1.y, kv[j][u].x, kv[j][u].y);
                    ixf_mma(acc[j][m], a0.z, a1.z, a0.w, a1.w, kv[j][u].z, kv[j][u].w);
                }
            }
        }
        // the next group's keys fly during the epilogue
        ixf_load_keys<KU>(kv, kb, gs + IXF_THREADS + g, lim);
        // transpose relu(bf16(S)) (bf16-exact) to E[key][head]: acc[j][m][r] = head 16m+g+8(r>>1), key 8j+2c+(r&1)
        __syncwarp();   // the previous group's reads of E are done
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int key = 8 * j + 2 * c + (r & 1), head = 16 * m + g + 8 * (r >> 1);
                    *(uint16_t *)(E + key * IXF_EST + head * 2) = g_f2bf(fmaxf(g_rbf(acc[j][m][r]), 0.0f));
                }
        __syncwarp();
        // lane L: key gs + L, heads summed in order (pad heads: w = 0, value 0, exact no-ops at the end)
        float a = 0.0f;
#pragma unroll
        for (int h8 = 0; h8 < NH / 8; h8++) {
            const uint4 e = *(const uint4 *)(E + lane * IXF_EST + h8 * 16);
            const uint32_t ew[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // the head's term bf16(w * relu(bf16(S))) is rounded before the fp32 sum (SPEC §6, as ref)
                a += g_rbf(Ws[h8 * 8 + 2 * i] * __uint_as_float(ew[i] << 16));
                a += g_rbf(Ws[h8 * 8 + 2 * i + 1] * __uint_as_float(ew[i] & 0xffff0000u));
            }
        }
        const int s = gs + lane;
        if (s < s1) Irow[s] = s < vis ? g_rbf(a) : -INFINITY;
    }
    for (; gs < s1; gs += IXF_THREADS)   // groups past the visible count
        if (gs + lane < s1) Irow[gs + lane] = -INFINITY;
}

template <int MT, int KU>
static int ixf_launch(const uint16_t *q, const float *w, const uint16_t *k, const int64_t *kbase,
                      const int32_t *visible, int T, int nI, int S, float *I, cudaStream_t st)
{
    const int nsm = g_num_sms();
    // Keys per block 256*G (32-key groups per warp). Many waves of work (long rows or a big batch): G = 4, as
    // tuned at 64K. A few waves: each block is a Q fill and a first round of loads with nothing to overlap them,
    // and each wave ends in a drain, so take fewer, longer blocks (more groups per warp, the next group's loads
    // in flight during the epilogue): G <= 8 minimising waves * (groups per warp + 1), slots = 2 blocks per SM.
    const long long slots = 2LL * nsm;
    const long long want = (long long)T * S / (256LL * 8 * nsm);
    const int nunit = (S + 255) / 256;   // 256-key units in a row
    int G = 4;
    if (want < 4) {
        long long best = -1;
        for (int g = 1; g <= 8; g++) {
            const long long nb = (long long)T * ((nunit + g - 1) / g);
            const long long cost = (nb + slots - 1) / slots * (min(g, nunit) + 1);
            if (best < 0 || cost < best) { best = cost; G = g; }   // ties: the smaller G
        }
    }
    int nchunk = (S + 256 * G - 1) / (256 * G);
    long long nb = (long long)nchunk * T;
    if (nb > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
    g_indexer_fast<MT, KU><<<(unsigned)nb, IXF_THREADS, 0, st>>>(q, w, k, kbase, visible, nI, S, nchunk, G, I);
    G_LAUNCHED();
    return 0;
}

extern "C" int v41g_indexer_scores(const uint16_t *q, const float *w, const uint16_t *k, const int64_t *kbase,
                                   const int32_t *visible, int T, int nI, int dI, int S, float *I, v41g_stream s)
{
    if (T <= 0 || S <= 0) return 0;
    if (dI % 16) return (int)cudaErrorInvalidValue;
    if (nI >= 1 && nI <= 32 && dI % 32 == 0 && dI <= 128) {
        const int MT = nI <= 16 ? 1 : 2;
        cudaStream_t st = G_STREAM(s);
        switch (MT * 8 + dI / 32) {
        case 9:  return ixf_launch<1, 1>(q, w, k, kbase, visible, T, nI, S, I, st);
        case 10: return ixf_launch<1, 2>(q, w, k, kbase, visible, T, nI, S, I, st);
        case 11: return ixf_launch<1, 3>(q, w, k, kbase, visible, T, nI, S, I, st);
        case 12: return ixf_launch<1, 4>(q, w, k, kbase, visible, T, nI, S, I, st);
        case 17: return ixf_launch<2, 1>(q, w, k, kbase, visible, T, nI, S, I, st);
        case 18: return ixf_launch<2, 2>(q, w, k, kbase, visible, T, nI, S, I, st);
        case 19: return ixf_launch<2, 3>(q, w, k, kbase, visible, T, nI, S, I, st);
        default: return ixf_launch<2, 4>(q, w, k, kbase, visible, T, nI, S, I, st);
        }
    }
    int nIp = (nI + 15) & ~15;
    size_t sm = (size_t)(nIp + IX_KT) * (dI + 8) * 2 + (size_t)nIp * (IX_KT + 4) * 4 + nIp * 4;
    G_CHECK(cudaFuncSetAttribute(g_indexer_generic, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    g_indexer_generic<<<dim3((S + IX_KT - 1) / IX_KT, T), IX_THREADS, sm, G_STREAM(s)>>>(q, w, k, kbase, visible,
                                                                                       nI, dI, S, I);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ top-k
#define TK_CL 8                  /* most blocks (one cluster) per row */
#define TK_SHARE 8192            /* positions a block takes before the row is split over a cluster */
#define TK_THREADS 512
#define TK_W (TK_THREADS / 32)
#define TK_UNROLL 16
#define TK_CACHE_MAX (128 * 1024) /* keys of a block's share cached in shared memory up to 64K positions */

// Order-preserving 16-bit key of a bf16-valued fp32 score (larger key = larger score).
__device__ __forceinline__ uint32_t g_score_key(float f)
{
    uint32_t b = __float_as_uint(f) >> 16;
    return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// Threads 0..255 hold hv = count of bin tid (others 0); every thread calls. Finds the bin b with
// base + #(bins >= b) >= kk > base + #(bins > b) and writes res = {b, base + #(> b), base + #(>= b)}.
// Requires base < kk <= base + #(all bins).
__device__ __forceinline__ void tk_select(int hv, int base, int kk, int *wtot /*[8]*/, int *res /*[3]*/)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int x = hv;   // inclusive suffix sum within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_down_sync(0xffffffffu, x, o);
        if (lane + o < 32) x += n;
    }
    if (warp < 8 && lane == 0) wtot[warp] = x;
    __syncthreads();
    if (tid < 256) {
        int after = 0;
        for (int w = warp + 1; w < 8; w++) after += wtot[w];
        const int suf = base + x + after, sufn = suf - hv;
        if (suf >= kk && sufn < kk) { res[0] = tid; res[1] = sufn; res[2] = suf; }
    }
    __syncthreads();
}

// Sum of the lane-replicated histogram rep[bin*32 + lane] for bin = tid (< 256); rotated reads, no conflicts.
__device__ __forceinline__ int tk_rep_sum(const uint32_t *rep, int tid)
{
    int sum = 0;
#pragma unroll 8
    for (int l = 0; l < 32; l++) sum += (int)rep[tid * 32 + ((l + tid) & 31)];
    return sum;
}

// Thread-block clusters exist from compute 9.0 on. A build for an older architecture (configure
// --with-cuda-arch=sm_80) compiles the CL > 1 kernels without them and never launches them: the host
// runs one block per row there (v41g_topk).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define TK_HAVE_CLUSTER 1
#else
#define TK_HAVE_CLUSTER 0
#endif
__device__ __forceinline__ void tk_cluster_arrive()
{
#if TK_HAVE_CLUSTER
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void tk_cluster_wait()
{
#if TK_HAVE_CLUSTER
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Grid: CL * T blocks; cluster (CL > 1; CL == 1: the block alone, no cluster) = the CL blocks of row
// t = blockIdx.x / CL; block rank r owns positions [r*chunk, (r+1)*chunk) of the row.
template <int CL>
__device__ __forceinline__ void tk_csync()
{
    if constexpr (CL == 1) __syncthreads();
    else {
#if TK_HAVE_CLUSTER
        cg::this_cluster().sync();
#else
        __trap();   // (never launched without clusters)
#endif
    }
}
template <int CL>
__device__ __forceinline__ int tk_remote(int *p, int r)   // p in block rank r of the cluster
{
    if constexpr (CL == 1) return *p;
    else {
#if TK_HAVE_CLUSTER
        return *cg::this_cluster().map_shared_rank(p, r);
#else
        (void)r;
        __trap();   // (never launched without clusters)
        return 0;
#endif
    }
}

template <int CL>
__global__ void __launch_bounds__(TK_THREADS, CL == 1 ? 1 : 0)
g_topk_kernel(const float *__restrict__ I, const int32_t *__restrict__ visible, int S, int k, int chunk, int cache,
              int32_t *__restrict__ out, uint8_t *tie_cut)
{
    extern __shared__ __align__(16) unsigned char tk_smem[];
    uint32_t *rep = (uint32_t *)tk_smem;               // [256][32] lane-replicated histogram
    uint16_t *keys = (uint16_t *)(rep + 256 * 32);     // [chunk] when cache
    __shared__ int h1[256], h2[256], cnt[2];           // this block's histograms and counts (read by the cluster)
    __shared__ int wtot[8], res[3], wc[2][TK_W], wq[2][TK_W];
    int rank = 0;
#if TK_HAVE_CLUSTER
    if constexpr (CL > 1) rank = (int)cg::this_cluster().block_rank();
#endif
    const int t = blockIdx.x / CL;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *row = I + (size_t)t * S;
    const int c0 = min(S, rank * chunk), len = min(S, c0 + chunk) - c0;
    const int kk = min(k, S);
    auto key_at = [&](int i) -> uint32_t { return cache ? (uint32_t)keys[i] : g_score_key(row[c0 + i]); };

    // pass 1: read the share once (16 loads in flight per thread), cache the keys, histogram the high byte
    for (int i = tid; i < 256 * 32 / 4; i += TK_THREADS) ((uint4 *)rep)[i] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    for (int base = 0; base < len; base += TK_THREADS * TK_UNROLL) {
        uint32_t kv[TK_UNROLL];
#pragma unroll
        for (int u = 0; u < TK_UNROLL; u++) {
            int i = base + u * TK_THREADS + tid;
            kv[u] = i < len ? g_score_key(row[c0 + i]) : 0u;
        }
#pragma unroll
        for (int u = 0; u < TK_UNROLL; u++) {
            int i = base + u * TK_THREADS + tid;
            if (i < len) {
                if (cache) keys[i] = (uint16_t)kv[u];
                atomicAdd(&rep[(kv[u] >> 8) * 32 + lane], 1u);
            }
        }
    }
    __syncthreads();
    if (tid < 256) h1[tid] = tk_rep_sum(rep, tid);
    tk_csync<CL>();
    int hv = 0;
    if (tid < 256)
#pragma unroll
        for (int r = 0; r < CL; r++) hv += tk_remote<CL>(&h1[tid], r);
    for (int i = tid; i < 256 * 32 / 4; i += TK_THREADS)   // (its reads all preceded the sync)
        ((uint4 *)rep)[i] = make_uint4(0, 0, 0, 0);
    tk_select(hv, 0, kk, wtot, res);
    const uint32_t hi = (uint32_t)res[0];
    const int above_hi = res[1];
    // pass 2: low byte among keys with that high byte
    for (int i = tid; i < len; i += TK_THREADS) {
        uint32_t key = key_at(i);
        if ((key >> 8) == hi) atomicAdd(&rep[(key & 255) * 32 + lane], 1u);
    }
    __syncthreads();
    if (tid < 256) h2[tid] = tk_rep_sum(rep, tid);
    tk_csync<CL>();
    hv = 0;
    if (tid < 256)
#pragma unroll
        for (int r = 0; r < CL; r++) hv += tk_remote<CL>(&h2[tid], r);
    tk_select(hv, above_hi, kk, wtot, res);
    const uint32_t thr = (hi << 8) | (uint32_t)res[0];
    const int above = res[1];   // scores above thr in the row
    // a tie straddles the cut when some equal keys are left out (and they are real scores)
    if (tie_cut && rank == 0 && tid == 0) tie_cut[t] = (uint8_t)(res[2] > kk && thr != g_score_key(-INFINITY));
    const int need = kk - above;   // how many keys equal to thr are taken (lowest positions)
    const int vis = visible[t];
    // ordered compaction: warp w owns a contiguous range of the share, walked 32 positions at a time
    const int per_w = ((len + 32 * TK_W - 1) / (32 * TK_W)) * 32;
    const int ws0 = min(len, warp * per_w), ws1 = min(len, ws0 + per_w);
    const unsigned lt = (1u << lane) - 1u;
    int n_gt = 0, n_eq = 0;
    for (int b0 = ws0; b0 < ws1; b0 += 32) {
        int i = b0 + lane;
        uint32_t key = i < ws1 ? key_at(i) : 0;
        n_gt += __popc(__ballot_sync(0xffffffffu, i < ws1 && key > thr));
        n_eq += __popc(__ballot_sync(0xffffffffu, i < ws1 && key == thr));
    }
    if (lane == 0) { wc[0][warp] = n_eq; wc[1][warp] = n_gt; }
    __syncthreads();
    int bquota, boff;   // (warp 0) this block's quota of ties and output offset
    if constexpr (CL == 1) {
        bquota = need;
        boff = 0;
    } else {
        if (warp == 0) {   // this block's totals, for the cluster
            int e = lane < TK_W ? wc[0][lane] : 0, gt = lane < TK_W ? wc[1][lane] : 0;
            e = g_warp_scan_incl(e, lane);
            gt = g_warp_scan_incl(gt, lane);
            if (lane == 31) { cnt[0] = e; cnt[1] = gt; }
        }
        tk_csync<CL>();
        if (warp == 0) {
            // over the cluster's blocks in position order: ties before this block, its quota and output offset
            int e = 0, gt = 0;
            if (lane < CL) { e = tk_remote<CL>(&cnt[0], lane); gt = tk_remote<CL>(&cnt[1], lane); }
            int ei = g_warp_scan_incl(e, lane);
            int quota = max(0, min(e, need - (ei - e)));
            int sc = gt + quota, si = g_warp_scan_incl(sc, lane);
            bquota = __shfl_sync(0xffffffffu, quota, rank);
            boff = __shfl_sync(0xffffffffu, si - sc, rank);
        }
    }
    if (warp == 0) {   // then over this block's warps
        int e = lane < TK_W ? wc[0][lane] : 0, gt = lane < TK_W ? wc[1][lane] : 0;
        int ei = g_warp_scan_incl(e, lane);
        int quota = max(0, min(e, bquota - (ei - e)));
        int sc = gt + quota, si = g_warp_scan_incl(sc, lane);
        if (lane < TK_W) { wq[0][lane] = quota; wq[1][lane] = boff + si - sc; }
    }
    if constexpr (CL > 1) tk_cluster_arrive();   // this block's remote reads are done (the others may exit after the wait)
    __syncthreads();
    int32_t *orow = out + (size_t)t * k;
    int quota = wq[0][warp], posb = wq[1][warp], eq_seen = 0;
    for (int b0 = ws0; b0 < ws1; b0 += 32) {
        int i = b0 + lane, s = c0 + i;
        uint32_t key = i < ws1 ? key_at(i) : 0;
        bool eq = i < ws1 && key == thr;
        unsigned beq = __ballot_sync(0xffffffffu, eq);
        bool sel = (i < ws1 && key > thr) || (eq && eq_seen + __popc(beq & lt) < quota);
        unsigned bsel = __ballot_sync(0xffffffffu, sel);
        if (sel) orow[posb + __popc(bsel & lt)] = s < vis ? s : -1;
        posb += __popc(bsel);
        eq_seen += __popc(beq);
    }
    if (rank == 0)
        for (int j = kk + tid; j < k; j += TK_THREADS) orow[j] = -1;
    if constexpr (CL > 1) tk_cluster_wait();
}

// Blocks per row: the fewest (a power of two, at most TK_CL) that keep a block's share <= TK_SHARE positions.
// Below that a cluster is mostly synchronisation (three cluster barriers and remote reads for ~1K keys a
// block) and a batch of rows needs many co-resident clusters; one block per row needs neither.
template <int CL>
static int tk_launch(const float *I, const int32_t *visible, int T, int S, int k, int32_t *out, uint8_t *tie_cut,
                     cudaStream_t st)
{
    if ((long long)T * CL > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
    int chunk = (S + CL - 1) / CL;
    int cache = (size_t)chunk * 2 <= TK_CACHE_MAX;
    size_t sm = 256 * 32 * 4 + (cache ? ((size_t)chunk * 2 + 15) / 16 * 16 : 0);
    G_CHECK(cudaFuncSetAttribute(g_topk_kernel<CL>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    if constexpr (CL == 1) {
        g_topk_kernel<1><<<T, TK_THREADS, sm, st>>>(I, visible, S, k, chunk, cache, out, tie_cut);
    } else {
        const cudaLaunchAttribute cl = g_attr_cluster(dim3(CL, 1, 1));
        G_CHECK(g_launch_ex(g_topk_kernel<CL>, dim3((unsigned)(T * CL)), dim3(TK_THREADS), sm, st, &cl, I, visible, S, k,
                            chunk, cache, out, tie_cut));
    }
    G_LAUNCHED();
    return 0;
}

// clusters usable: a compute 9.0+ device (queried once per device), unless V41_TOPK_NO_CLUSTER is set
static bool tk_clusters() { return g_cc_major() >= 9 && !g_env_flag("V41_TOPK_NO_CLUSTER"); }

extern "C" int v41g_topk(const float *I, const int32_t *visible, int T, int S, int k, int32_t *out,
                         uint8_t *tie_cut, v41g_stream s)
{
    if (T <= 0 || k <= 0) return 0;
    cudaStream_t st = G_STREAM(s);
    if (S <= 0) {   // nothing to choose
        G_CHECK(cudaMemsetAsync(out, 0xff, (size_t)T * k * 4, st));
        if (tie_cut) G_CHECK(cudaMemsetAsync(tie_cut, 0, (size_t)T, st));
        return 0;
    }
    // one block per row: short rows, devices without clusters (compute < 9.0) and V41_TOPK_NO_CLUSTER
    // (read at every call; the tests run every case both ways)
    if (S <= TK_SHARE || !tk_clusters()) return tk_launch<1>(I, visible, T, S, k, out, tie_cut, st);
    if (S <= 2 * TK_SHARE) return tk_launch<2>(I, visible, T, S, k, out, tie_cut, st);
    if (S <= 4 * TK_SHARE) return tk_launch<4>(I, visible, T, S, k, out, tie_cut, st);
    return tk_launch<TK_CL>(I, visible, T, S, k, out, tie_cut, st);
}
