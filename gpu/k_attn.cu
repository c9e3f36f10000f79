// k_attn.cu: sparse attention with sink over an index list (SPEC §4.4), also
// used for DSpark's non-causal window attention (SPEC §8).
//
// One block per (query row, tile of 32 heads, split of the list). K = V is one
// shared head (MQA), so a tile of heads is the M dimension of two tensor-core
// GEMMs per chunk of 64 list entries: S = Q.K^T [32 x 64] and O += P.V
// [32 x d] (wmma bf16, fp32 accumulate). The online softmax follows the
// official rounding points: chunks of 64 entries from index 0 of the list,
// running max from -1e30, fp32 denominator, probabilities rounded to bf16 in
// the numerator, sink added once with the final max. -1 entries are skipped in
// both sums (they never touch the normalisation), so padding has zero weight.
// When the list is split across blocks (small batches), per-split partials are
// merged by a second kernel (exactly the same result when all maxima agree).
#include "g_internal.cuh"
#include <mma.h>
using namespace nvcuda;

#define AT_MT 32      /* heads per block */
#define AT_CK 64      /* list entries per chunk (official chunk width) */
#define AT_THREADS 256
#define AT_NEG (-1e30f)

struct at_smem {
    int dq, dp, ds, dO;   /* leading dims */
    size_t offQ, offK, offS, offP, offO, offV, total;
};
__host__ __device__ static inline at_smem at_layout(int d)
{
    at_smem L;
    L.dq = d + 8; L.dp = AT_CK + 8; L.ds = AT_CK + 4; L.dO = d + 4;
    L.offQ = 0;
    L.offK = L.offQ + (size_t)AT_MT * L.dq * 2;
    L.offS = L.offK + (size_t)AT_CK * L.dq * 2;
    L.offP = L.offS + (size_t)AT_MT * L.ds * 4;
    L.offO = L.offP + (size_t)AT_MT * L.dp * 2;
    L.offV = L.offO + (size_t)AT_MT * L.dO * 4;           /* m, l, corr [AT_MT] each + valid[AT_CK] */
    L.total = L.offV + (size_t)(3 * AT_MT + AT_CK) * 4;
    return L;
}

__global__ void __launch_bounds__(AT_THREADS)
g_sparse_attn_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv_a,
                     const uint16_t *__restrict__ kv_b, const int32_t *__restrict__ idx, int L, int n_a,
                     const float *__restrict__ sink, float scale, int H, int d, int chunks_per_split,
                     uint16_t *__restrict__ o, float *__restrict__ part /* NS>1: [T,tiles,NS,MT,(d+2)] */)
{
    extern __shared__ __align__(128) unsigned char smem[];
    const at_smem Ly = at_layout(d);
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)(smem + Ly.offQ);
    __nv_bfloat16 *Ks = (__nv_bfloat16 *)(smem + Ly.offK);
    float *Ss = (float *)(smem + Ly.offS);
    __nv_bfloat16 *Ps = (__nv_bfloat16 *)(smem + Ly.offP);
    float *Os = (float *)(smem + Ly.offO);
    float *Ms = (float *)(smem + Ly.offV), *Ls = Ms + AT_MT, *Cs = Ls + AT_MT;
    int *Vs = (int *)(Cs + AT_MT);

    const int t = blockIdx.x, tile = blockIdx.y, split = blockIdx.z, NS = gridDim.z;
    const int h0 = tile * AT_MT;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int nv = d / 8;   /* 16-byte vectors per row */

    // Q tile (rows past H are zero), O = 0, m = -1e30, l = 0
    for (int i = tid; i < AT_MT * nv; i += AT_THREADS) {
        int r = i / nv, c = i % nv;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (h0 + r < H) v = *(const uint4 *)(q + ((size_t)t * H + h0 + r) * d + c * 8);
        *(uint4 *)(Qs + r * Ly.dq + c * 8) = v;
    }
    for (int i = tid; i < AT_MT * d; i += AT_THREADS) Os[(i / d) * Ly.dO + i % d] = 0.0f;
    if (tid < AT_MT) { Ms[tid] = AT_NEG; Ls[tid] = 0.0f; }

    const int nchunks = (L + AT_CK - 1) / AT_CK;
    const int c0 = split * chunks_per_split, c1 = min(nchunks, c0 + chunks_per_split);
    const int32_t *row_idx = idx + (size_t)t * L;

    for (int c = c0; c < c1; c++) {
        __syncthreads();   // previous chunk's readers of Ks / Ps are done
        if (tid < AT_CK) {
            int gj = c * AT_CK + tid;
            Vs[tid] = gj < L ? row_idx[gj] : -1;
        }
        __syncthreads();
        // gather the chunk's keys (invalid rows -> zeros); 8 loads in flight per thread
        for (int base = tid; base < AT_CK * nv; base += AT_THREADS * 8) {
            uint4 buf[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int i = base + u * AT_THREADS;
                buf[u] = make_uint4(0, 0, 0, 0);
                if (i < AT_CK * nv) {
                    int j = i / nv, cc = i % nv, id = Vs[j];
                    if (id >= 0) {
                        const uint16_t *pool = (c * AT_CK + j) < n_a ? kv_a : kv_b;
                        buf[u] = __ldg((const uint4 *)(pool + (size_t)id * d + cc * 8));
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int i = base + u * AT_THREADS;
                if (i < AT_CK * nv) *(uint4 *)(Ks + (i / nv) * Ly.dq + (i % nv) * 8) = buf[u];
            }
        }
        __syncthreads();
        // S = Q . K^T : 2 x 4 tiles of 16x16, one per warp
        {
            int rt = warp >> 2, ct = warp & 3;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int k = 0; k < d; k += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
                wmma::load_matrix_sync(fa, Qs + rt * 16 * Ly.dq + k, Ly.dq);
                wmma::load_matrix_sync(fb, Ks + ct * 16 * Ly.dq + k, Ly.dq);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(Ss + rt * 16 * Ly.ds + ct * 16, acc, Ly.ds, wmma::mem_row_major);
        }
        __syncthreads();
        // online softmax over the chunk: warp w owns rows 4w..4w+3, lane owns columns lane, lane+32
        for (int rr = 0; rr < AT_MT / 8; rr++) {
            int r = warp * (AT_MT / 8) + rr;
            bool v0 = Vs[lane] >= 0, v1 = Vs[lane + 32] >= 0;
            float s0 = v0 ? Ss[r * Ly.ds + lane] * scale : -INFINITY;
            float s1 = v1 ? Ss[r * Ly.ds + lane + 32] * scale : -INFINITY;
            float cmax = g_warp_max(fmaxf(s0, s1));
            float mold = Ms[r];
            float mnew = fmaxf(mold, cmax);
            float p0 = v0 ? expf(s0 - mnew) : 0.0f, p1 = v1 ? expf(s1 - mnew) : 0.0f;
            float psum = g_warp_sum(p0 + p1);
            Ps[r * Ly.dp + lane] = __float2bfloat16_rn(p0);
            Ps[r * Ly.dp + lane + 32] = __float2bfloat16_rn(p1);
            if (lane == 0) {
                float corr = expf(mold - mnew);
                Cs[r] = corr;
                Ls[r] = Ls[r] * corr + psum;
                Ms[r] = mnew;
            }
        }
        __syncthreads();
        // O = O*corr + P.V : 2 x d/16 tiles, accumulators round-trip through shared memory
        for (int tIdx = warp; tIdx < 2 * (d / 16); tIdx += AT_THREADS / 32) {
            int rt = tIdx & 1, ct = tIdx >> 1;
            float *op = Os + rt * 16 * Ly.dO + ct * 16;
            // rescale this tile's rows (16 rows x 16 cols, 8 elements per lane)
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int e = lane * 8 + u, rr = e >> 4, cc = e & 15;
                op[rr * Ly.dO + cc] *= Cs[rt * 16 + rr];
            }
            __syncwarp();
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, op, Ly.dO, wmma::mem_row_major);
#pragma unroll
            for (int k = 0; k < AT_CK; k += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
                wmma::load_matrix_sync(fa, Ps + rt * 16 * Ly.dp + k, Ly.dp);
                wmma::load_matrix_sync(fb, Ks + k * Ly.dq + ct * 16, Ly.dq);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(op, acc, Ly.dO, wmma::mem_row_major);
        }
    }
    __syncthreads();
    if (NS == 1) {
        for (int i = tid; i < AT_MT * nv; i += AT_THREADS) {
            int r = i / nv, cc = i % nv;
            if (h0 + r >= H) continue;
            float m = Ms[r], l = Ls[r];
            if (sink) l += expf(sink[h0 + r] - m);
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            uint4 out;
            uint16_t *oe = (uint16_t *)&out;
#pragma unroll
            for (int u = 0; u < 8; u++) oe[u] = g_f2bf(Os[r * Ly.dO + cc * 8 + u] * inv);
            *(uint4 *)(o + ((size_t)t * H + h0 + r) * d + cc * 8) = out;
        }
    } else {
        float *pp = part + (((size_t)t * gridDim.y + tile) * NS + split) * AT_MT * (d + 2);
        for (int i = tid; i < AT_MT * d; i += AT_THREADS) pp[(i / d) * (d + 2) + i % d] = Os[(i / d) * Ly.dO + i % d];
        if (tid < AT_MT) { pp[tid * (d + 2) + d] = Ms[tid]; pp[tid * (d + 2) + d + 1] = Ls[tid]; }
    }
}

// Merge per-split partials: M = max m_s, l = sum l_s e^{m_s-M} (+ sink), o = sum O_s e^{m_s-M} / l.
__global__ void g_attn_merge_kernel(const float *__restrict__ part, const float *__restrict__ sink, int H, int d,
                                    int tiles, int NS, uint16_t *__restrict__ o)
{
    int t = blockIdx.x, h = blockIdx.y;
    int tile = h / AT_MT, r = h % AT_MT;
    const float *pp = part + (((size_t)t * tiles + tile) * NS) * AT_MT * (d + 2) + (size_t)r * (d + 2);
    size_t sstride = (size_t)AT_MT * (d + 2);
    float M = AT_NEG;
    for (int s = 0; s < NS; s++) M = fmaxf(M, pp[s * sstride + d]);
    float l = 0.0f;
    for (int s = 0; s < NS; s++) l += pp[s * sstride + d + 1] * expf(pp[s * sstride + d] - M);
    if (sink) l += expf(sink[h] - M);
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < NS; s++) a += pp[s * sstride + c] * expf(pp[s * sstride + d] - M);
        o[((size_t)t * H + h) * d + c] = g_f2bf(a * inv);
    }
}

extern "C" int v41g_sparse_attn(const uint16_t *q, const uint16_t *kv_a, const uint16_t *kv_b,
                                const int32_t *idx, int L, int n_a, const float *sink, float scale,
                                int T, int H, int d, uint16_t *o, v41g_stream s)
{
    if (T <= 0) return 0;
    if (d % 16 || d > 512 || L <= 0) return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    at_smem Ly = at_layout(d);
    static_assert(AT_MT == 32, "softmax row split assumes 32 rows / 8 warps");
    G_CHECK(cudaFuncSetAttribute(g_sparse_attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)Ly.total));
    int tiles = (H + AT_MT - 1) / AT_MT;
    int nchunks = (L + AT_CK - 1) / AT_CK;
    // split the list only when the grid would leave most of the 132 SMs idle
    int NS = 1;
    while ((size_t)T * tiles * NS < 132 && NS * 2 <= nchunks) NS *= 2;
    int cps = (nchunks + NS - 1) / NS;
    NS = (nchunks + cps - 1) / cps;
    float *part = NULL;
    if (NS > 1) G_CHECK(cudaMallocAsync((void **)&part, sizeof(float) * (size_t)T * tiles * NS * AT_MT * (d + 2), st));
    g_sparse_attn_kernel<<<dim3(T, tiles, NS), AT_THREADS, Ly.total, st>>>(q, kv_a, kv_b, idx, L, n_a, sink, scale,
                                                                           H, d, cps, o, part);
    G_LAUNCHED();
    if (NS > 1) {
        g_attn_merge_kernel<<<dim3(T, H), 128, 0, st>>>(part, sink, H, d, tiles, NS, o);
        G_LAUNCHED();
        G_CHECK(cudaFreeAsync(part, st));
    }
    return 0;
}
