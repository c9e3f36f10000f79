// k_attn.cu: sparse attention with sink over an index list (SPEC §4.4), also
// used for DSpark's non-causal window attention (SPEC §8).
//
// One block (16 warps) per (query row, tile of 32 or 64 heads, split of the list). K = V is one
// shared head (MQA), so the heads are the M dimension of two tensor-core GEMMs per chunk of 64 list
// entries: S = Q.K^T [MT x 64] and O += P.V [MT x d] (mma.sync m16n8k16 bf16, fp32 accumulate; all
// operands loaded with ldmatrix, V through ldmatrix.trans; O stays in registers). Shared memory holds
// the Q tile, two key chunks (the next chunk is gathered by cp.async while this one is computed) and
// P, all unpadded rows with the 16-byte chunks XOR-swizzled by (row % 8) (conflict-free ldmatrix).
// Per chunk, three barriers: (A) the chunk has landed and every warp is done with the previous one
// (the next gather then goes into that buffer); (B) after the S phase, where warp (m-tile, key group)
// computes a 16 x 16 (or 16 x 8) tile of S in registers, masks it, and publishes per-row partial
// maxima; (C) after the same warp turns its tile into bf16 probabilities with the chunk max (written
// to P) and publishes per-row partial sums. In the P.V phase warp (32-head m-group, d slice) rescales
// its O rows and updates the row denominators (every thread recomputes the running max of its rows
// from the published partial maxima, identically), then accumulates P.V.
// The online softmax follows the official rounding points: chunks of 64 entries from index 0 of the
// list, running max from -1e30, fp32 denominator (of the unrounded probabilities), probabilities
// rounded to bf16 in the numerator, sink added once with the final max. -1 entries are skipped in
// both sums (they never touch the normalisation; their key rows are zero-filled), so padding has
// zero weight. When the list is split across blocks (small batches), per-split partials are merged
// by a second kernel (exactly the same result when all maxima agree).
// On compute 9.0 devices, d = 512 with 64-head tiles runs g_sparse_attn_wgmma_kernel instead (wgmma
// path, described where it is defined below; V41_ATTN_NO_WGMMA=1 forces this kernel).
#include "g_internal.cuh"
#include <stdlib.h>

#define AT_MT 64      /* max heads per block (all of V4.1's: the key chunk is gathered once per row);
                         small batches use 32-head tiles (twice the CTAs, each chunk gathered twice) */
#define AT_CK 64      /* list entries per chunk (official chunk width) */
#define AT_THREADS 512
#define AT_NW (AT_THREADS / 32)   /* 16 warps */
#define AT_NEG (-1e30f)

struct at_smem {
    size_t offQ, offK, offP, offM, offL, offR, offV, total;
};
// Q tile [MT][d] | K chunk [64][d] x 2 (double buffer) | P [MT][64] bf16 | partial row max, sum
// [MT][key groups] (MT * key groups = 256 floats each) | running max [2][MT] (by chunk parity) and
// denominator [MT] | the split's index list. Rows unpadded, 16-byte chunks swizzled.
__host__ __device__ static inline at_smem at_layout(int d, int cps, int MT)
{
    at_smem L;
    L.offQ = 0;
    L.offK = L.offQ + (size_t)MT * d * 2;
    L.offP = L.offK + 2 * (size_t)AT_CK * d * 2;
    L.offM = L.offP + (size_t)MT * AT_CK * 2;
    L.offL = L.offM + 256 * 4;
    L.offR = L.offL + 256 * 4;
    L.offV = L.offR + (size_t)3 * MT * 4;
    L.total = L.offV + (size_t)cps * AT_CK * 4;
    return L;
}
#define AT_MAX_CPS 16   /* index list of one split in shared memory: <= 4 KB */

// ldmatrix (shared memory reads: volatile, so they stay between the barriers that guard them)
__device__ __forceinline__ void g_ldsm_x4(uint32_t a, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void g_ldsm_x2(uint32_t a, uint32_t &r0, uint32_t &r1)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
__device__ __forceinline__ void g_ldsm_x4t(uint32_t a, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void g_ldsm_x2t(uint32_t a, uint32_t &r0, uint32_t &r1)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
// max of the published partial maxima of row r (same order everywhere: every thread that tracks
// row r gets the identical running max)
template <int KGS> __device__ __forceinline__ float at_row_max(const float *Pm, int r)
{
    float m = Pm[r * KGS];
#pragma unroll
    for (int k = 1; k < KGS; k++) m = fmaxf(m, Pm[r * KGS + k]);
    return m;
}
template <int KGS> __device__ __forceinline__ float at_row_sum(const float *Pl, int r)
{
    float s = Pl[r * KGS];
#pragma unroll
    for (int k = 1; k < KGS; k++) s += Pl[r * KGS + k];
    return s;
}

// Fragment layouts of mma.m16n8k16 (g = lane/4, c = lane%4): A regs hold (row g | g+8, cols 2c,2c+1 | +8);
// B regs hold (k = 2c,2c+1 | +8, n = g); C holds (row g | g+8, cols 2c, 2c+1). ldmatrix.x4: lanes 8i..8i+7
// give the 8 row addresses of matrix i, register i receives (row g, cols 2c, 2c+1) of matrix i (.trans:
// (rows 2c, 2c+1, col g)). Shared rows of R 16-byte chunks store logical chunk j at chunk j ^ (row % 8).
template <int DD, int MT>   /* head dim DD; MT = 32 or 64 heads per block */
__global__ void __launch_bounds__(AT_THREADS, 1)
g_sparse_attn_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv_a,
                     const uint16_t *__restrict__ kv_b, const int32_t *__restrict__ idx, int L, int n_a,
                     const float *__restrict__ sink, float scale, int H, int chunks_per_split,
                     uint16_t *__restrict__ o, float *__restrict__ part /* NS>1: [T,tiles,NS,MT,(d+2)] */)
{
    constexpr int d = DD, NV = d / 8;        /* 16-byte chunks per row */
    constexpr int RB = d * 2;                /* row bytes of Q and K */
    constexpr int MTL = MT / 16;             /* 16-head m-tiles */
    constexpr int KGS = AT_NW / MTL;         /* S phase: warp w -> m-tile w % MTL, key group w / MTL */
    constexpr int NTS = AT_CK / 8 / KGS;     /* S phase: 8-key n-tiles per warp (2 or 1) */
    constexpr int MG = MTL / 2;              /* P.V phase: warp w -> 32-head m-group w % MG, d slice w / MG */
    constexpr int DS = AT_NW / MG;           /* d slices */
    constexpr int NT = DD / (8 * DS) > 0 ? DD / (8 * DS) : 1;   /* 8-column n-tiles of O per warp */
    static_assert(MT == 32 || MT == 64, "32 or 64 heads per block");
    static_assert(DD % 64 == 0 && DD <= 512, "d in 64..512, multiple of 64");
    static_assert(KGS * MT == 256 && NTS >= 1 && (NT == 1 || NT % 2 == 0), "layout");
    extern __shared__ __align__(128) unsigned char smem[];
    const at_smem Ly = at_layout(d, chunks_per_split, MT);
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t sQ = sbase + (uint32_t)Ly.offQ, sK = sbase + (uint32_t)Ly.offK, sP = sbase + (uint32_t)Ly.offP;
    float *Pm = (float *)(smem + Ly.offM), *Pl = (float *)(smem + Ly.offL);
    float *Ms = (float *)(smem + Ly.offR), *Ls = Ms + 2 * MT;   /* Ms[parity][MT] */
    int *Vall = (int *)(smem + Ly.offV);

    const int t = blockIdx.x, tile = blockIdx.y, split = blockIdx.z, NS = gridDim.z;
    const int h0 = tile * MT;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
    const int x7 = lane & 7;   /* row % 8 of every row this lane addresses in ldmatrix */

    // Q tile by cp.async (rows past H zero-filled); waited for with the first chunk
    for (int i = tid; i < MT * NV; i += AT_THREADS) {
        int r = i / NV, cc = i % NV;
        bool ok = h0 + r < H;
        const uint16_t *src = ok ? q + ((size_t)t * H + h0 + r) * d + cc * 8 : q;
        g_cp_async16(sQ + r * RB + ((cc ^ (r & 7)) << 4), src, ok ? 16 : 0);
    }
    const int nchunks = (L + AT_CK - 1) / AT_CK;
    const int c0 = split * chunks_per_split, c1 = min(nchunks, c0 + chunks_per_split);
    const int32_t *row_idx = idx + (size_t)t * L;
    // the split's whole index list, once (positions past L are padding)
    for (int j = tid; j < (c1 - c0) * AT_CK; j += AT_THREADS) {
        int gj = c0 * AT_CK + j;
        Vall[j] = gj < L ? row_idx[gj] : -1;
    }
    if (tid < MT) { Ms[MT + tid] = AT_NEG; Ls[tid] = 0.0f; }   /* the max before the first chunk: parity 1 */
    __syncthreads();
    // issue the cp.async gather of chunk c into buffer b (invalid rows zero-filled)
    auto prefetch = [&](int c, int b) {
        const uint32_t Kd = sK + (uint32_t)b * AT_CK * RB;
        const int *Vc = Vall + (c - c0) * AT_CK;
#pragma unroll 2
        for (int k = 0; k < AT_CK * NV / AT_THREADS; k++) {
            int i = tid + k * AT_THREADS, j = i / NV, cc = i % NV, id = Vc[j];
            const uint16_t *pool = (c * AT_CK + j) < n_a ? kv_a : kv_b;
            const uint16_t *src = id >= 0 ? pool + (size_t)id * d + cc * 8 : pool;
            g_cp_async16(Kd + j * RB + ((cc ^ (j & 7)) << 4), src, id >= 0 ? 16 : 0);
        }
        g_cp_commit();
    };
    if (c0 < c1) prefetch(c0, 0);
    else g_cp_commit();

    // S phase roles
    const int mi = warp % MTL, kg = warp / MTL, kb = kg * 8 * NTS;   /* heads 16mi.., keys kb.. */
    const int rA = mi * 16 + g, rB = rA + 8;                         /* this thread's S rows */
    const uint32_t aRow = sQ + (mi * 16 + (lane & 15)) * RB;         /* A (Q) rows, chunk half lane>>4 */
    const int bRow = kb + (lane & 7) + (NTS == 2 ? ((lane >> 4) << 3) : 0);   /* B (K) rows */
    /* byte offset of logical chunk 2i + hi in a swizzled row: ((2i + hi) ^ x7) << 4 = off0 ^ (i << 5) */
    const uint32_t aOff0 = ((lane >> 4) ^ x7) << 4, bOff0 = (((lane >> 3) & 1) ^ x7) << 4;
    // P.V phase roles
    const int mg = warp % MG, dsl = warp / MG, cb = dsl * 8 * NT;   /* heads 32mg.., columns cb.. */
    const bool pv = cb < d;                                          /* warps past d have no columns */
    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.0f;

    for (int c = c0; c < c1; c++) {
        const int b = (c - c0) & 1;
        const uint32_t sKb = sK + (uint32_t)b * AT_CK * RB;
        const int *Vs = Vall + (c - c0) * AT_CK;
        const float *Mold = Ms + (b ^ 1) * MT;   /* running max before this chunk */
        float *Mnew = Ms + b * MT;               /* and after it */
        g_cp_wait<0>();
        __syncthreads();   // (A) chunk c (and Q) landed; every warp is done with chunk c-1 (buffer b^1, P, Pm, Pl, Ms[b])
        if (c + 1 < c1) prefetch(c + 1, b ^ 1);
        // S = Q . K^T for rows rA, rB x keys kb + 8nt + 2c4 (+1)
        float s[NTS][4];
#pragma unroll
        for (int nt = 0; nt < NTS; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        {
            const uint32_t bAddr = sKb + bRow * RB;
#pragma unroll
            for (int kk = 0; kk < d / 64; kk++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
                    g_ldsm_x4(aRow + kk * 128 + (aOff0 ^ (i << 5)), a0, a1, a2, a3);
                    if constexpr (NTS == 2) {
                        g_ldsm_x4(bAddr + kk * 128 + (bOff0 ^ (i << 5)), b0, b1, b2, b3);
                        g_mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
                        g_mma_bf16(s[NTS - 1], a0, a1, a2, a3, b2, b3);
                    } else {
                        g_ldsm_x2(bAddr + kk * 128 + (bOff0 ^ (i << 5)), b0, b1);
                        g_mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
                    }
                }
        }
        // scale, mask (-1 entries: -inf, never in the max), partial row maxima
        bool vk[NTS][2];
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NTS; nt++) {
            int key = kb + nt * 8 + 2 * c4;
            vk[nt][0] = Vs[key] >= 0; vk[nt][1] = Vs[key + 1] >= 0;
            s[nt][0] = vk[nt][0] ? s[nt][0] * scale : -INFINITY;
            s[nt][1] = vk[nt][1] ? s[nt][1] * scale : -INFINITY;
            s[nt][2] = vk[nt][0] ? s[nt][2] * scale : -INFINITY;
            s[nt][3] = vk[nt][1] ? s[nt][3] * scale : -INFINITY;
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        if (c4 == 0) { Pm[rA * KGS + kg] = mx0; Pm[rB * KGS + kg] = mx1; }
        __syncthreads();   // (B) partial maxima published
        {
            const float mA = fmaxf(Mold[rA], at_row_max<KGS>(Pm, rA));
            const float mB = fmaxf(Mold[rB], at_row_max<KGS>(Pm, rB));
            if (kg == 0 && c4 == 0) { Mnew[rA] = mA; Mnew[rB] = mB; }   /* one writer per row */
            float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NTS; nt++) {
                float p0 = vk[nt][0] ? expf(s[nt][0] - mA) : 0.0f, p1 = vk[nt][1] ? expf(s[nt][1] - mA) : 0.0f;
                float p2 = vk[nt][0] ? expf(s[nt][2] - mB) : 0.0f, p3 = vk[nt][1] ? expf(s[nt][3] - mB) : 0.0f;
                ps0 += p0 + p1; ps1 += p2 + p3;
                int key = kb + nt * 8 + 2 * c4;   /* rows rA, rB have row % 8 = g */
                uint32_t off = (((key >> 3) ^ g) << 4) + (key & 7) * 2;
                *(uint32_t *)(smem + Ly.offP + rA * (AT_CK * 2) + off) = (uint32_t)g_f2bf(p0) | ((uint32_t)g_f2bf(p1) << 16);
                *(uint32_t *)(smem + Ly.offP + rB * (AT_CK * 2) + off) = (uint32_t)g_f2bf(p2) | ((uint32_t)g_f2bf(p3) << 16);
            }
#pragma unroll
            for (int o2 = 1; o2 <= 2; o2 <<= 1) {
                ps0 += __shfl_xor_sync(0xffffffffu, ps0, o2);
                ps1 += __shfl_xor_sync(0xffffffffu, ps1, o2);
            }
            if (c4 == 0) { Pl[rA * KGS + kg] = ps0; Pl[rB * KGS + kg] = ps1; }
        }
        __syncthreads();   // (C) P, partial sums and the new running max published
        // O = O*corr + P.V for rows 32mg + 16mt + g (+8), columns cb + 8nt + 2c4 (+1)
        if (pv) {
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int r = mg * 32 + mt * 16 + g + 8 * hf;
                    const float corr = expf(Mold[r] - Mnew[r]);
                    if (dsl == 0 && c4 == 0) Ls[r] = Ls[r] * corr + at_row_sum<KGS>(Pl, r);   /* one owner per row */
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) { acc[mt][nt][2 * hf] *= corr; acc[mt][nt][2 * hf + 1] *= corr; }
                }
            const uint32_t pRow = sP + (mg * 32 + (lane & 15)) * (AT_CK * 2);
            const uint32_t vRow = sKb + (lane & 15) * RB;
#pragma unroll
            for (int ks = 0; ks < AT_CK / 16; ks++) {
                uint32_t a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
                    g_ldsm_x4(pRow + mt * 16 * (AT_CK * 2) + (((2 * ks + (lane >> 4)) ^ x7) << 4), a[mt][0], a[mt][1],
                              a[mt][2], a[mt][3]);
                if constexpr (NT == 1) {
                    uint32_t b0, b1;
                    g_ldsm_x2t(vRow + ks * 16 * RB + (((cb >> 3) ^ x7) << 4), b0, b1);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) g_mma_bf16(acc[mt][0], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                } else {
#pragma unroll
                    for (int np = 0; np < NT / 2; np++) {
                        uint32_t b0, b1, b2, b3;
                        g_ldsm_x4t(vRow + ks * 16 * RB + ((((cb >> 3) + 2 * np + (lane >> 4)) ^ x7) << 4), b0, b1, b2, b3);
#pragma unroll
                        for (int mt = 0; mt < 2; mt++) {
                            g_mma_bf16(acc[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                            g_mma_bf16(acc[mt][(2 * np + 1) % NT], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                        }
                    }
                }
            }
        }
    }
    g_cp_wait<0>();
    __syncthreads();   // the last denominators (Ls) are visible
    const float *Mfin = Ms + ((c1 - c0 - 1) & 1) * MT;   /* final running max (parity 1 = initial if no chunk) */
    // epilogue: this thread holds rows (32mg + 16mt + g [+8]) x columns (cb + 8nt + 2c4 [+1])
    if (!pv) return;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = mg * 32 + mt * 16 + g + 8 * hf;
            if (NS == 1) {
                if (h0 + r >= H) continue;
                float l = Ls[r];
                if (sink) l += expf(sink[h0 + r] - Mfin[r]);
                float inv = l > 0.0f ? 1.0f / l : 0.0f;
                uint16_t *orow = o + ((size_t)t * H + h0 + r) * d + cb + 2 * c4;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    *(uint32_t *)(orow + nt * 8) = (uint32_t)g_f2bf(acc[mt][nt][2 * hf] * inv) |
                                                   ((uint32_t)g_f2bf(acc[mt][nt][2 * hf + 1] * inv) << 16);
            } else {
                float *pp = part + ((((size_t)t * gridDim.y + tile) * NS + split) * MT + r) * (d + 2);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    pp[cb + nt * 8 + 2 * c4] = acc[mt][nt][2 * hf];
                    pp[cb + nt * 8 + 2 * c4 + 1] = acc[mt][nt][2 * hf + 1];
                }
                if (dsl == 0 && c4 == 0) { pp[d] = Mfin[r]; pp[d + 1] = Ls[r]; }
            }
        }
}

// Merge per-split partials: M = max m_s, l = sum l_s e^{m_s-M} (+ sink), o = sum O_s e^{m_s-M} / l.
__global__ void g_attn_merge_kernel(const float *__restrict__ part, const float *__restrict__ sink, int H, int d,
                                    int tiles, int NS, int MT, uint16_t *__restrict__ o)
{
    int t = blockIdx.x, h = blockIdx.y;
    int tile = h / MT, r = h % MT;
    const float *pp = part + (((size_t)t * tiles + tile) * NS) * MT * (d + 2) + (size_t)r * (d + 2);
    size_t sstride = (size_t)MT * (d + 2);
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

// ================================================================================================
// sm_90a path (wgmma): d = 512, 64-head tiles (MT = 64), list split across a cluster of NS <= 8 CTAs
// (merged in distributed shared memory: no partials in global memory, no second kernel). Used only
// when the device is compute 9.0 and the binary carries sm_90a code; everything else runs
// g_sparse_attn_kernel above.
//
// Block: 256 threads = 2 warpgroups (WG 0, 1), one CTA per (query row, 64-head tile, list split);
// the NS split CTAs of one (row, tile) form one cluster (cluster dims 1 x 1 x NS, rank = split).
// Shared memory (base rounded up to 1024 B so every 128-byte-swizzle atom is 1024-byte aligned):
//   Q     [64 heads x 512] bf16 at 0        (64 KB)
//   K[0]  [64 keys  x 512] bf16 at 64 KB    (64 KB)  } double buffer: chunk c lives in K[(c - c0) & 1]
//   K[1]  [64 keys  x 512] bf16 at 128 KB   (64 KB)  }
//   P     [64 heads x 64 keys] bf16 at 192 KB (8 KB, one 128-byte swizzled row per head)
//   Xmax  [2 WGs][64] fp32: each WG's row maxima of the chunk over its 32 keys
//   Mrow  [64], Lw [2][64] fp32: the final running max and each WG's denominator
//   list  the split's index entries (int32, positions past L = -1)
// After the last chunk, Q and K (192 KB) are reused for this CTA's unnormalised O [64][AW_OST] fp32.
// Q and K tiles are stored as 8 column blocks of 64 elements: block kb (columns 64kb..64kb+63) is a
// [64 rows x 128 B] tile at kb * 8192, row r at r * 128, and the 16-byte chunk j (columns
// 64kb + 8j..+7) of row r at chunk position j ^ (r % 8) (the 128-byte swizzle, Swizzle<3,4,3>).
// Every 8 rows of a block are one 1024-byte swizzle atom.
//
// GEMM 1 (WG w computes S for its 32 keys 32w..32w+31 only):
//   S_w[64 heads x 32 keys] = Q . K_w^T, 32 k-steps of wgmma.m64n32k16 (A = Q, B = K rows 32w..,
//   both K-major, SW128). k-step ks reads columns 16ks..16ks+15 = block ks/4, byte offset (ks%4)*32
//   inside the 128-byte row: descriptor start = tile + (ks/4)*8192 + (ks%4)*32 (+ 32w * 128 for B);
//   SBO = 1024 (next 8 rows); LBO unused for swizzled K-major (set to 16 B).
// Softmax across the two halves: each WG publishes its per-row maximum of the chunk (Xmax), both
//   read max(Xmax[0][r], Xmax[1][r]) in that order, so both hold the identical running max m and
//   correction; each WG keeps its own denominator Lw (the sum of its keys' p), added at the end.
//   P = bf16(p) goes to shared memory (WG w writes keys 32w.., i.e. 16-byte chunks 4w..4w+3 of each
//   swizzled 128-byte row).
// GEMM 2 (per WG w, its half of d = columns 256w..256w+255 = blocks 4w..4w+3):
//   O[64 x 256] += P[64 x 64 keys] . V[64 keys x 256], 4 k-steps of wgmma.m64n256k16, A = P (K-major,
//   SW128, start sP + 32 ks), B = the same key chunk read MN-major (imm-trans-b = 1): for N-major
//   SW128 the canonical layout is ((64 elems, n-blocks), (8 k-rows, k-groups)) : ((1, LBO),
//   (128 B, SBO)), so LBO = 8192 (next 64-column block), SBO = 1024 (next 8 keys); k-step ks (keys
//   16ks..16ks+15) starts at tile + (4w)*8192 + ks*16*128.
// Accumulator fragment of wgmma m64nN (f32): thread (warp w4 = warp % 4, lane = 4g + c) holds
// d[4i + 0/1] = (row 16 w4 + g, columns 8i + 2c + 0/1) and d[4i + 2/3] = (row 16 w4 + g + 8, same
// columns).
// Pipeline per chunk c (buffer b): cp.async.wait_group 1 (chunk c landed; chunk c+1 may still be in
// flight) + fence.proxy.async + __syncthreads (chunk c landed for every thread) -> GEMM 1 -> wait ->
// scale, mask, row max of the 32 keys -> Xmax, __syncthreads -> m, corr, p, P to shared memory,
// fence.proxy.async, __syncthreads -> O *= corr -> GEMM 2 -> wait -> the WG gathers its column half
// of chunk c+2 into buffer b. Each WG gathers the half of every key that its own GEMM 2 reads, so it
// can refill that half as soon as its GEMM 2 is done, without a barrier, and two chunks are in
// flight through the next chunk's compute. (Before session 25 the gather of chunk c+1 was issued
// after GEMM 1 of chunk c, one chunk in flight: per 64 KB chunk the copy latency was exposed
// whenever the compute of chunk c was shorter than the gather; H200, decode batch 256 77-78 us
// against 80-82 us, 61 % of copy against 58-59 %; batch 64 within the noise.)
// Epilogue: each CTA stores its O, m and l (= Lw[0] + Lw[1]) in its own shared memory; after a
// cluster barrier, rank z finalises rows z, z + NS, ... reading every rank's values through
// distributed shared memory in rank order, exactly as g_attn_merge_kernel: M = max m_s,
// l = sum l_s e^(m_s - M) (+ e^(sink - M)), o = bf16(sum O_s e^(m_s - M) / l), with 16-byte loads
// and 8-byte coalesced stores; a second cluster barrier keeps every rank's shared memory alive
// until all reads are done. NS = 2 (decode batches of 45-66 rows on 132 SMs) merges by column
// halves instead (aw_epilogue_2: the same operations, pushed instead of pulled). With NS = 1 (no
// partials) aw_epilogue_1 normalises the registers directly (e^0 = 1: the plain o = O / l, the
// same bits) and stores through a bf16 staging tile.
// The numerics are those of the kernel above: chunks of 64 entries from index 0 of the list, running
// max from -1e30, fp32 denominator of the unrounded p, bf16 P in the numerator, sink with the final
// max; only the summation order of the dot products and of the row sums differs.
// ================================================================================================
#include "k_attn_wgmma.cuh"

#define AW_THREADS 256
#define AW_MAX_NS 8                              /* portable cluster size */
#define AW_DEEP_WAVES 2                          /* grids of up to this many waves gather two chunks ahead */
#define AW_OFF_P (3u * 65536u)                   /* P tile */
#define AW_OFF_X (AW_OFF_P + 8192u)              /* Xmax [2][64] */
#define AW_OFF_S (AW_OFF_X + 512u)               /* Mrow [64], Lw [2][64] */
#define AW_OFF_LIST (AW_OFF_S + 768u)
#define AW_OST 520                               /* O row stride (floats) in the epilogue: 2-way banks */
static_assert(64u * AW_OST * 4u <= AW_OFF_P, "the epilogue's O fits in Q + K");
__host__ __device__ static inline size_t aw_smem_bytes(int cps) { return 1024 + AW_OFF_LIST + (size_t)cps * AT_CK * 4; }

// distributed shared memory (cluster) primitives
__device__ __forceinline__ uint32_t aw_mapa(uint32_t saddr, uint32_t rank)
{
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr), "r"(rank));
    return r;
}
__device__ __forceinline__ float4 aw_ld_cluster_v4(uint32_t a)
{
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ float aw_ld_cluster(uint32_t a)
{
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ void aw_cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Epilogue of an unsplit list (NS = 1), from the accumulator registers: no partials to merge, so
// with the merge's operations (M = max(-1e30, m), e = e^(m - M) = 1, l = 0 + (l_WG0 + l_WG1) e
// (+ e^(sink - M)), o = bf16((0 + O e) / l)) every output is o = bf16(O / l), bit for bit what the
// split path computes for NS = 1. The bf16 rows go through a staging tile in the Q space (row stride
// AW_SROW bytes: the 32 lanes of a warp's 4-byte writes hit 32 distinct banks) to 16-byte coalesced
// stores: half the shared-memory traffic of an fp32 O tile and no read-back of it (H200, session
// 11, same-call A/B against the fp32 round trip: decode batch 256 at 64K 85.2 -> 78.9 us, prefill
// 4096 rows 1259 -> 1167 us).
#define AW_SROW 1040u
static_assert(64u * AW_SROW <= AW_OFF_P, "the staging tile fits in Q + K");
// the staging tile's 64 rows (PIECES 16-byte pieces each, from column col0 of the output rows) to
// the output rows of token t that exist (heads h0 + r < H), one piece a thread at a time
template <int PIECES>
__device__ __forceinline__ void aw_store_staged(const unsigned char *stg, int col0, int h0, int H, int t,
                                                uint16_t *__restrict__ o)
{
    for (int it = threadIdx.x; it < 64 * PIECES; it += AW_THREADS) {
        const int rr = it / PIECES, ch = it % PIECES;
        if (h0 + rr < H)
            *(uint4 *)(o + ((size_t)t * H + h0 + rr) * 512 + col0 + ch * 8) = *(const uint4 *)(stg + (uint32_t)rr * AW_SROW + ch * 16u);
    }
}
// The merge factors of one output row (head h) over its ns <= NSMAX list splits, the same operations
// in the same order for every epilogue (so their bits agree): M = max(-1e30, m_0, .., m_ns-1),
// e_z = e^(m_z - M), l = (0 + l_0 e_0) + l_1 e_1 + .. (+ e^(sink - M)); returns 1 / l (0 when l = 0).
// m_of(z) and l_of(z) read split z's row max and denominator wherever the caller keeps them.
template <int NSMAX, typename MOF, typename LOF>
__device__ __forceinline__ float aw_row_factors(int ns, MOF m_of, LOF l_of, const float *__restrict__ sink, int h,
                                                int H, float (&e)[NSMAX])
{
    float M = AT_NEG, l = 0.0f;
#pragma unroll
    for (int z = 0; z < NSMAX; z++)
        if (z < ns) M = fmaxf(M, m_of(z));
#pragma unroll
    for (int z = 0; z < NSMAX; z++)
        if (z < ns) {
            e[z] = expf(m_of(z) - M);
            l += l_of(z) * e[z];
        }
    if (h < H && sink) l += expf(sink[h] - M);
    return l > 0.0f ? 1.0f / l : 0.0f;
}
__device__ __forceinline__ void aw_epilogue_1(const float (&oacc)[128], float m0, float m1, float l0, float l1,
                                              unsigned char *gbase, float *Lw, int h0, int H,
                                              const float *__restrict__ sink, int t, uint16_t *__restrict__ o)
{
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
    const int r0 = 16 * w4 + g, r1 = r0 + 8;
    if (c4 == 0) { Lw[wg * 64 + r0] = l0; Lw[wg * 64 + r1] = l1; }
    __syncthreads();   // both WGs' l
    float inv[2];
#pragma unroll
    for (int rs = 0; rs < 2; rs++) {
        const int r = rs ? r1 : r0;
        const float m = rs ? m1 : m0;
        float e[1];
        inv[rs] = aw_row_factors<1>(1, [&](int) { return m; }, [&](int) { return Lw[r] + Lw[64 + r]; }, sink, h0 + r, H, e);
    }
    unsigned char *stg = gbase;
#pragma unroll
    for (int i = 0; i < 32; i++)
#pragma unroll
        for (int rs = 0; rs < 2; rs++) {
            const uint32_t r = (uint32_t)(rs ? r1 : r0), col = (uint32_t)(wg * 256 + 8 * i + 2 * c4);
            *(uint32_t *)(stg + r * AW_SROW + col * 2u) = (uint32_t)g_f2bf(oacc[4 * i + 2 * rs] * inv[rs]) |
                                                          ((uint32_t)g_f2bf(oacc[4 * i + 2 * rs + 1] * inv[rs]) << 16);
        }
    __syncthreads();   // the staging tile is complete
    aw_store_staged<64>(stg, 0, h0, H, t, o);   /* 64 rows x 64 16-byte pieces */
}

// Epilogue of a list split in two (NS = 2), by column halves: WG w of either rank holds O[:, 256w ..
// 256w + 255]; rank z finalises the half z. After a cluster barrier (both ranks are done with their
// loop), WG 1 - z pushes its O half into the partner's shared memory (the partner's WG 1 - z holds
// the same fragment positions) and every WG pushes its row max and denominator to both ranks; after
// a second cluster barrier WG z of rank z has everything in registers and local shared memory.
// Same operations, in the same order, as the merge of the kernel's NS >= 2 path (the pull merge, which
// V41_ATTN_MERGE_PULL=1 selects for NS = 2 too): M = max(-1e30, m_0, m_1), e_z = e^(m_z - M),
// l = (0 + (l_0a + l_0b) e_0) + (l_1a + l_1b) e_1 (+ e^(sink - M)), o = bf16((0 + O_0 e_0 + O_1 e_1) / l),
// so the output bits are those of the pull merge (tests/test_gpu_kernels compares them). Against the
// pull merge it moves half the bytes (each rank's finalised half stays in registers) and has no
// dependent chain of remote loads: decode batch 64 on the H200, about 1.2 us less a call (session 16).
// Layout (free after the loop): pushed O [32 float4][128 threads] at 0 (64 KB) and the bf16 staging
// tile at 64 KB (64 rows x AW_SROW) in the Q + K space; m [2 ranks][64] and l [2 ranks][2 WGs][64]
// from AW_OFF_X (Xmax, Mrow, Lw and the first list chunk: space only ever written by plain stores,
// so no remote store lands where a cp.async of the partner wrote; racecheck reported one when m and
// l sat in a key buffer, session 16).
#define AE2_OFF_STG 65536u
#define AE2_OFF_M AW_OFF_X
#define AE2_OFF_L (AE2_OFF_M + 512u)
static_assert(AE2_OFF_STG + 64u * AW_SROW <= AW_OFF_P && AE2_OFF_L + 1024u <= AW_OFF_LIST + AT_CK * 4,
              "epilogue 2 layout (the list holds at least one chunk)");
__device__ __forceinline__ void aw_st_cluster_v4(uint32_t a, float4 v)
{
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
__device__ __forceinline__ void aw_st_cluster(uint32_t a, float v)
{
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ void aw_epilogue_2(const float (&oacc)[128], float m0, float m1, float l0, float l1,
                                              uint32_t sbase, unsigned char *gbase, int h0, int H,
                                              const float *__restrict__ sink, int t, int split, uint16_t *__restrict__ o)
{
    const int tid = threadIdx.x, lt = tid & 127, w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int r0 = 16 * w4 + g, r1 = r0 + 8;
    const uint32_t peer = aw_mapa(sbase, (uint32_t)(1 - split));   /* the partner's shared window */
    aw_cluster_sync();   // both ranks are done with their loop: the partner's Q + K space is free
    if (c4 == 0) {       // m (identical in both WGs; WG 0 writes it) and this WG's l, to both ranks
        const uint32_t om = AE2_OFF_M + 4u * (uint32_t)(split * 64), ol = AE2_OFF_L + 4u * (uint32_t)((split * 2 + wg) * 64);
        for (int dst = 0; dst < 2; dst++) {
            const uint32_t b = dst ? peer : sbase;
            if (wg == 0) { aw_st_cluster(b + om + 4u * r0, m0); aw_st_cluster(b + om + 4u * r1, m1); }
            aw_st_cluster(b + ol + 4u * r0, l0); aw_st_cluster(b + ol + 4u * r1, l1);
        }
    }
    if (wg != split) {   // push this WG's O half to the partner, which finalises it
#pragma unroll
        for (int k = 0; k < 32; k++)
            aw_st_cluster_v4(peer + (uint32_t)(k * 128 + lt) * 16u, make_float4(oacc[4 * k], oacc[4 * k + 1], oacc[4 * k + 2], oacc[4 * k + 3]));
    }
    aw_cluster_sync();   // every push landed (release / acquire)
    unsigned char *stg = gbase + AE2_OFF_STG;
    if (wg == split) {
        const float *Ms = (const float *)(gbase + AE2_OFF_M), *Ls = (const float *)(gbase + AE2_OFF_L);
        float e[2][2], inv[2];
#pragma unroll
        for (int rs = 0; rs < 2; rs++) {
            const int r = rs ? r1 : r0;
            inv[rs] = aw_row_factors<2>(
                2, [&](int z) { return Ms[z * 64 + r]; },
                [&](int z) { return Ls[(2 * z) * 64 + r] + Ls[(2 * z + 1) * 64 + r]; }, sink, h0 + r, H, e[rs]);
        }
        const float4 *Op = (const float4 *)gbase;
#pragma unroll
        for (int k = 0; k < 32; k++) {
            const float4 pv = Op[k * 128 + lt];
            const float pa[4] = {pv.x, pv.y, pv.z, pv.w};
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int rs = j >> 1;
                const float own = oacc[4 * k + j], oth = pa[j];
                float a = 0.0f;
                a += (split == 0 ? own : oth) * e[rs][0];
                a += (split == 0 ? oth : own) * e[rs][1];
                v[j] = a * inv[rs];
            }
            const uint32_t col = (uint32_t)(8 * k + 2 * c4);   /* within the half */
            *(uint32_t *)(stg + (uint32_t)r0 * AW_SROW + col * 2u) = (uint32_t)g_f2bf(v[0]) | ((uint32_t)g_f2bf(v[1]) << 16);
            *(uint32_t *)(stg + (uint32_t)r1 * AW_SROW + col * 2u) = (uint32_t)g_f2bf(v[2]) | ((uint32_t)g_f2bf(v[3]) << 16);
        }
    }
    __syncthreads();   // the staging tile (this rank's half of every row) is complete
    aw_store_staged<32>(stg, split * 256, h0, H, t, o);   /* 64 rows x 32 16-byte pieces of the half */
}

// DEEP (the default for grids of at most AW_DEEP_WAVES waves: decode batches): two chunks in
// flight, each WG gathering its own column half (session 25). !DEEP (many waves: prefill): one chunk
// in flight, the gather of chunk c+1 issued by all 256 threads over whole rows while GEMM 1 of chunk
// c runs, the schedule before session 25 (prefill 4096 rows measured up to 4 % slower with DEEP; with
// many CTAs resident per wave the co-scheduled CTAs hide the copy latency instead). Both compute
// the same operations in the same order: the same bits (test_attn_depth).
template <bool DEEP>
__global__ void __launch_bounds__(AW_THREADS, 1)
g_sparse_attn_wgmma_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv_a,
                           const uint16_t *__restrict__ kv_b, const int32_t *__restrict__ idx, int L, int n_a,
                           const float *__restrict__ sink, float scale, int H, int chunks_per_split,
                           uint16_t *__restrict__ o, int merge_pull)
{
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int d = 512, MT = 64;
    extern __shared__ __align__(1024) unsigned char aw_smem[];
    const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(aw_smem);
    const uint32_t sbase = (sraw + 1023u) & ~1023u;
    unsigned char *gbase = aw_smem + (sbase - sraw);
    const uint32_t sQ = sbase, sK = sbase + 65536u, sP = sbase + AW_OFF_P;
    float *Xmax = (float *)(gbase + AW_OFF_X), *Mrow = (float *)(gbase + AW_OFF_S), *Lw = Mrow + 64;
    int *Vall = (int *)(gbase + AW_OFF_LIST);

    const int t = blockIdx.x, tile = blockIdx.y, split = blockIdx.z, NS = gridDim.z;
    const int h0 = tile * MT;
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
    const int r0 = 16 * w4 + g, r1 = r0 + 8;   /* this thread's rows (heads) in both GEMMs */

    // Q tile by cp.async into the blocked swizzled layout (rows past H zero-filled)
#pragma unroll 4
    for (int k = 0; k < MT * 64 / AW_THREADS; k++) {
        const int i = tid + k * AW_THREADS, r = i >> 6, cc = i & 63;
        const bool ok = h0 + r < H;
        const uint16_t *src = ok ? q + ((size_t)t * H + h0 + r) * d + cc * 8 : q;
        g_cp_async16(sQ + (cc >> 3) * 8192 + r * 128 + (((cc & 7) ^ (r & 7)) << 4), src, ok ? 16 : 0);
    }
    const int nchunks = (L + AT_CK - 1) / AT_CK;
    const int c0 = split * chunks_per_split, c1 = min(nchunks, c0 + chunks_per_split);
    const int32_t *row_idx = idx + (size_t)t * L;
    for (int j = tid; j < (c1 - c0) * AT_CK; j += AW_THREADS) {
        const int gj = c0 * AT_CK + j;
        Vall[j] = gj < L ? row_idx[gj] : -1;
    }
    __syncthreads();   // the list is visible
    // cp.async gather of chunk c into buffer b (rows of -1 entries zero-filled). WG w copies the
    // column half w (blocks 4w..4w+3), the half only its own GEMM 2 reads: thread tid copies the
    // 16-byte column chunk cc = 32w + tid % 32 of keys j = (tid % 128) / 32 + 4k; its swizzled
    // position is (cc % 8) ^ (j % 8) = ((cc % 8) ^ j0) ^ (4 if k odd), j0 = (tid % 128) / 32.
    // (!DEEP: thread tid copies column chunk cc = tid % 64 of keys j = tid / 64 + 4k.)
    const int gcc = DEEP ? 32 * wg + (tid & 31) : tid & 63, gj0 = DEEP ? (tid >> 5) & 3 : tid >> 6;
    const uint32_t gdst = (uint32_t)(gcc >> 3) * 8192u + (uint32_t)gj0 * 128u;
    const uint32_t gsw = (uint32_t)((gcc & 7) ^ gj0);
    auto prefetch = [&](int c, int b) {
        const uint32_t Kd = sK + (uint32_t)b * 65536u + gdst;
        const int *Vc = Vall + (c - c0) * AT_CK;
        const int cbase = c * AT_CK;
#pragma unroll
        for (int k = 0; k < AT_CK / 4; k++) {
            const int j = gj0 + 4 * k, id = Vc[j];
            const uint16_t *pool = cbase + j < n_a ? kv_a : kv_b;
            const uint16_t *src = id >= 0 ? pool + (size_t)id * d + gcc * 8 : pool;
            g_cp_async16(Kd + (uint32_t)k * 512u + ((gsw ^ (uint32_t)((k & 1) << 2)) << 4), src, id >= 0 ? 16 : 0);
        }
        g_cp_commit();
    };
    // DEEP: two chunks in flight from the start (one cp.async group each, empty past the split's
    // end); else the first chunk, the next one issued inside the loop
    if (c0 < c1) prefetch(c0, 0);
    else g_cp_commit();
    if constexpr (DEEP) {
        if (c0 + 1 < c1) prefetch(c0 + 1, 1);
        else g_cp_commit();
    }

    float oacc[128];
#pragma unroll
    for (int i = 0; i < 128; i++) oacc[i] = 0.0f;
    float m0 = AT_NEG, m1 = AT_NEG, l0 = 0.0f, l1 = 0.0f;   /* rows r0, r1; l: this WG's keys only */
    const uint64_t dQ = aw_desc(sQ, 16, 1024);                                       /* K-major, SW128 */
    const uint64_t dK0 = aw_desc(sK + (uint32_t)wg * 32 * 128, 16, 1024);            /* buffer 0, this WG's keys */
    const uint64_t dV0 = aw_desc(sK + (uint32_t)wg * 4 * 8192, 8192, 1024);          /* buffer 0, N-major, this WG's half */
    const uint64_t dP = aw_desc(sP, 16, 1024);                                       /* K-major, SW128 */
    const int kw = 32 * wg;   /* this WG's first key of the chunk */

    for (int c = c0; c < c1; c++) {
        const int b = (c - c0) & 1;
        const int *Vs = Vall + (c - c0) * AT_CK + kw;
        const uint64_t boff = (uint64_t)(b * 65536) >> 4;   /* buffer offset in descriptor units */
        if constexpr (DEEP) g_cp_wait<1>();   // this thread's rows of chunk c and Q landed (chunk c+1's group may be in flight)
        else g_cp_wait<0>();                  // this thread's rows of chunk c (gathered during chunk c-1's GEMM 1) and Q landed
        aw_fence_proxy_async();
        __syncthreads();   // chunk c landed for every thread; both WGs are done with chunk c-1 (buffer b^1, P, Xmax)
        // GEMM 1: S_w = Q . K_w^T (async)
        float s[16];
#pragma unroll
        for (int i = 0; i < 16; i++) s[i] = 0.0f;
        aw_fence_regs(s);
        aw_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < d / 16; ks++) {
            const uint64_t koff = (uint64_t)((ks >> 2) * 8192 + (ks & 3) * 32) >> 4;
            aw_mma_ss_n32(s, dQ + koff, dK0 + boff + koff, ks > 0);
        }
        aw_wgmma_commit();
        if constexpr (!DEEP)   // gather chunk c+1 into the free buffer b^1 while the tensor cores run GEMM 1
            if (c + 1 < c1) prefetch(c + 1, b ^ 1);
        aw_wgmma_wait<0>();
        aw_fence_regs(s);
        // scale, mask (-1 entries: -inf, never in the max), row max over the quad (lanes 4g..4g+3)
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const bool v = Vs[8 * i + 2 * c4 + j] >= 0;
                s[4 * i + j] = v ? s[4 * i + j] * scale : -INFINITY;
                s[4 * i + 2 + j] = v ? s[4 * i + 2 + j] * scale : -INFINITY;
                mx0 = fmaxf(mx0, s[4 * i + j]);
                mx1 = fmaxf(mx1, s[4 * i + 2 + j]);
            }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        if (c4 == 0) { Xmax[wg * 64 + r0] = mx0; Xmax[wg * 64 + r1] = mx1; }
        __syncthreads();   // both halves' maxima published
        const float mn0 = fmaxf(m0, fmaxf(Xmax[r0], Xmax[64 + r0]));
        const float mn1 = fmaxf(m1, fmaxf(Xmax[r1], Xmax[64 + r1]));
        const float corr0 = expf(m0 - mn0), corr1 = expf(m1 - mn1);
        m0 = mn0; m1 = mn1;
        // probabilities (masked entries: expf(-inf) = 0 exactly), fp32 sums, bf16 P to shared memory:
        // keys kw + 8i + 2c4 (+1) = 16-byte chunk 4wg + i of the row, bytes 4c4..
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float p0 = expf(s[4 * i + 0] - mn0), p1 = expf(s[4 * i + 1] - mn0);
            const float p2 = expf(s[4 * i + 2] - mn1), p3 = expf(s[4 * i + 3] - mn1);
            ps0 += p0 + p1; ps1 += p2 + p3;
            const uint32_t ch = (uint32_t)(4 * wg + i);
            const uint32_t a0 = sP + r0 * 128 + ((ch ^ (uint32_t)(r0 & 7)) << 4) + 4 * c4;
            const uint32_t a1 = sP + r1 * 128 + ((ch ^ (uint32_t)(r1 & 7)) << 4) + 4 * c4;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0), "r"((uint32_t)g_f2bf(p0) | ((uint32_t)g_f2bf(p1) << 16)) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"((uint32_t)g_f2bf(p2) | ((uint32_t)g_f2bf(p3) << 16)) : "memory");
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            ps0 += __shfl_xor_sync(0xffffffffu, ps0, o2);
            ps1 += __shfl_xor_sync(0xffffffffu, ps1, o2);
        }
        l0 = l0 * corr0 + ps0; l1 = l1 * corr1 + ps1;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            oacc[4 * i + 0] *= corr0; oacc[4 * i + 1] *= corr0;
            oacc[4 * i + 2] *= corr1; oacc[4 * i + 3] *= corr1;
        }
        aw_fence_proxy_async();   // this thread's P entries -> the async proxy
        __syncthreads();          // all of P written
        // GEMM 2: O += P . V over this WG's 256 columns
        aw_fence_regs(oacc);
        aw_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < AT_CK / 16; ks++)
            aw_mma_ss_n256_tb(oacc, dP + (uint64_t)((ks * 32) >> 4), dV0 + boff + ((uint64_t)(ks * 16 * 128) >> 4));
        aw_wgmma_commit();
        aw_wgmma_wait<0>();
        aw_fence_regs(oacc);
        // this WG's column half of buffer b is free: both GEMM 1s of chunk c finished before the P
        // barrier, and only this WG's GEMM 2 (done) reads the half. Gather chunk c+2 into it now, so
        // that two chunks stay in flight while chunk c+1 is computed
        if constexpr (DEEP) {
            if (c + 2 < c1) prefetch(c + 2, b);
            else g_cp_commit();
        }
    }
    g_cp_wait<0>();
    __syncthreads();   // every wgmma and gather is done: Q and K are free for O
    if (NS == 1) {
        aw_epilogue_1(oacc, m0, m1, l0, l1, gbase, Lw, h0, H, sink, t, o);
        return;
    }
    if (NS == 2 && !merge_pull) {
        aw_epilogue_2(oacc, m0, m1, l0, l1, sbase, gbase, h0, H, sink, t, split, o);
        return;
    }
    // NS >= 2: this CTA's unnormalised O [64][AW_OST] fp32, its final max and both WGs' denominators
    float *Os = (float *)gbase;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        const int col = wg * 256 + 8 * i + 2 * c4;
        *(float2 *)(Os + r0 * AW_OST + col) = make_float2(oacc[4 * i + 0], oacc[4 * i + 1]);
        *(float2 *)(Os + r1 * AW_OST + col) = make_float2(oacc[4 * i + 2], oacc[4 * i + 3]);
    }
    if (c4 == 0) {
        Lw[wg * 64 + r0] = l0; Lw[wg * 64 + r1] = l1;
        if (wg == 0) { Mrow[r0] = m0; Mrow[r1] = m1; }
    }
    aw_cluster_sync();   // every rank's O, m, l are written (release / acquire)
    // Finalise the rows r = split + NS i of this rank. Per row: M = max_z m_z, the factors
    // e_z = e^(m_z - M) and 1 / l (threads 0..63, one row each, into Xmax / P: free now), then
    // o = bf16(sum_z O_z e_z / l) by every thread, 4 columns (one 16-byte load per rank) per item.
    const uint32_t sM = sbase + AW_OFF_S, sL = sM + 64 * 4;
    float *Fac = (float *)(gbase + AW_OFF_P);   /* [64][AW_MAX_NS] */
    float *Inv = Xmax;                           /* [64] */
    auto rb = [&](int z) { return aw_mapa(sbase, (uint32_t)z); };   /* rank z's shared window */
    if (tid < MT && tid % NS == split) {
        const int r = tid;
        float ms[AW_MAX_NS], e[AW_MAX_NS];
#pragma unroll
        for (int z = 0; z < AW_MAX_NS; z++)
            if (z < NS) ms[z] = aw_ld_cluster(rb(z) + (sM - sbase) + 4 * r);   /* one remote load each */
        Inv[r] = aw_row_factors<AW_MAX_NS>(
            NS, [&](int z) { return ms[z]; },
            [&](int z) { return aw_ld_cluster(rb(z) + (sL - sbase) + 4 * r) + aw_ld_cluster(rb(z) + (sL - sbase) + 256 + 4 * r); },
            sink, h0 + r, H, e);
#pragma unroll
        for (int z = 0; z < AW_MAX_NS; z++)
            if (z < NS) Fac[r * AW_MAX_NS + z] = e[z];
    }
    __syncthreads();   // Fac, Inv
    const int nrow = (MT - split + NS - 1) / NS, items = nrow * (d / 4);
    for (int it0 = tid; it0 < items; it0 += 4 * AW_THREADS) {
        float4 a[4];
        int rr[4], cl[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int it = it0 + u * AW_THREADS;
            rr[u] = it < items ? split + NS * (it / (d / 4)) : 0;
            cl[u] = 4 * (it % (d / 4));
            a[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int z = 0; z < AW_MAX_NS; z++)
            if (z < NS) {
                float4 v[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const uint32_t off = (uint32_t)(rr[u] * AW_OST + cl[u]) * 4u;
                    v[u] = aw_ld_cluster_v4(rb(z) + off);
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const float e = Fac[rr[u] * AW_MAX_NS + z];
                    a[u].x += v[u].x * e; a[u].y += v[u].y * e; a[u].z += v[u].z * e; a[u].w += v[u].w * e;
                }
            }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int it = it0 + u * AW_THREADS;
            if (it >= items || h0 + rr[u] >= H) continue;
            const float inv = Inv[rr[u]];
            uint2 pk;
            pk.x = (uint32_t)g_f2bf(a[u].x * inv) | ((uint32_t)g_f2bf(a[u].y * inv) << 16);
            pk.y = (uint32_t)g_f2bf(a[u].z * inv) | ((uint32_t)g_f2bf(a[u].w * inv) << 16);
            *(uint2 *)(o + ((size_t)t * H + h0 + rr[u]) * d + cl[u]) = pk;
        }
    }
    aw_cluster_sync();   // no rank leaves while another may still read its memory
#endif
}

template <int DD, int MT>
static int attn_launch(dim3 grid, size_t sm, cudaStream_t st, const uint16_t *q, const uint16_t *kv_a,
                       const uint16_t *kv_b, const int32_t *idx, int L, int n_a, const float *sink, float scale, int H,
                       int cps, uint16_t *o, float *part)
{
    G_CHECK(cudaFuncSetAttribute(g_sparse_attn_kernel<DD, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    G_CHECK(cudaFuncSetAttribute(g_sparse_attn_kernel<DD, MT>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    g_sparse_attn_kernel<DD, MT><<<grid, AT_THREADS, sm, st>>>(q, kv_a, kv_b, idx, L, n_a, sink, scale, H, cps, o, part);
    G_LAUNCHED();
    return 0;
}

// The wgmma path runs only on a compute 9.0 device whose loaded code for it is the sm_90a build
// (a PTX-only build compiles the kernel body away: few registers), when its shared memory fits, and
// unless V41_ATTN_NO_WGMMA is set (A/B comparisons against the mma.sync kernel).
static bool aw_usable(int cps)
{
    static int ok = -1;   /* -1 unknown, 0 no, 1 yes */
    if (ok < 0) {
        int dev = 0, maj = 0, mnr = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&maj, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&mnr, cudaDevAttrComputeCapabilityMinor, dev);
        cudaFuncAttributes fa;
        ok = maj == 9 && mnr == 0 && !g_env_flag("V41_ATTN_NO_WGMMA") &&
             cudaFuncGetAttributes(&fa, g_sparse_attn_wgmma_kernel<true>) == cudaSuccess && fa.numRegs >= 128;
        (void)cudaGetLastError();
    }
    return ok == 1 && aw_smem_bytes(cps) <= (size_t)g_smem_optin();
}

extern "C" int v41g_sparse_attn(const uint16_t *q, const uint16_t *kv_a, const uint16_t *kv_b,
                                const int32_t *idx, int L, int n_a, const float *sink, float scale,
                                int T, int H, int d, uint16_t *o, v41g_stream s)
{
    if (T <= 0) return 0;
    if (L <= 0 || (d != 64 && d != 128 && d != 256 && d != 512)) return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    static_assert(AT_MT == 64 && AT_NW == 16, "S and softmax split assume 32 or 64 rows / 16 warps");
    // few rows: 32-head tiles double the CTAs (measured faster below ~32 rows); else all 64 heads
    const int MT = T < 32 ? 32 : AT_MT;
    int tiles = (H + MT - 1) / MT;
    int nchunks = (L + AT_CK - 1) / AT_CK;
    // Split the list across CTAs only when there are fewer (row, head-tile) pairs than SMs: one CTA
    // per SM fits (shared memory), so pick the split count with the fewest sequential chunk steps
    // (waves x chunks per CTA), the fewest splits on ties (each split adds partial traffic + a merge).
    // The wgmma path merges the splits inside a cluster: at most AW_MAX_NS of them.
    const int nsm = g_num_sms();
    const bool wg_ok = d == 512 && MT == 64 && aw_usable(AT_MAX_CPS);
    int NS = 1, cps = nchunks;
    long best = -1;
    for (int ns = 1; ns <= ((long)T * tiles < nsm ? nchunks : 1); ns++) {   // enough rows: never split
        int c = (nchunks + ns - 1) / ns, nse = (nchunks + c - 1) / c;
        if (c > AT_MAX_CPS || nse != ns || (wg_ok && nse > AW_MAX_NS)) continue;
        long waves = ((long)T * tiles * nse + nsm - 1) / nsm;
        long cost = waves * c;
        if (best < 0 || cost < best) { best = cost; NS = nse; cps = c; }
    }
    at_smem Ly = at_layout(d, cps, MT);
    if (wg_ok && aw_usable(cps)) {   // sm_90a wgmma path (see above); NS > 1: one cluster of NS CTAs per (row, tile)
        const size_t sm = aw_smem_bytes(cps);
        // the gather depth (see the kernel): two chunks in flight for grids of at most AW_DEEP_WAVES
        // waves, else one; V41_ATTN_DEPTH=1 or 2 forces it (read at every call: test_attn_depth and
        // the benchmark's A/B)
        const long ctas = (long)T * tiles * NS;
        const long dv = v41_env_long("V41_ATTN_DEPTH", 0);
        const bool deep = dv ? dv == 2 : ctas <= (long)AW_DEEP_WAVES * nsm;
        auto kern = deep ? g_sparse_attn_wgmma_kernel<true> : g_sparse_attn_wgmma_kernel<false>;
        G_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
        G_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
        const cudaLaunchAttribute cl = g_attr_cluster(dim3(1, 1, (unsigned)NS));
        // NS = 2 merges by column halves (aw_epilogue_2) unless V41_ATTN_MERGE_PULL=1 (read at every call:
        // the tests compare the two merges bit for bit)
        const int pull = g_env_flag("V41_ATTN_MERGE_PULL") ? 1 : 0;
        G_CHECK(g_launch_ex(kern, dim3(T, tiles, NS), dim3(AW_THREADS), sm, st, NS > 1 ? &cl : NULL,
                            q, kv_a, kv_b, idx, L, n_a, sink, scale, H, cps, o, pull));
        return 0;
    }
    float *part = NULL;
    if (NS > 1) G_CHECK(g_tmp_alloc((void **)&part, sizeof(float) * (size_t)T * tiles * NS * MT * (d + 2), st));
    dim3 grid(T, tiles, NS);
    int rc;
#define AT_L(D_, MT_) attn_launch<D_, MT_>(grid, Ly.total, st, q, kv_a, kv_b, idx, L, n_a, sink, scale, H, cps, o, part)
    switch (d) {
    case 64: rc = MT == 32 ? AT_L(64, 32) : AT_L(64, 64); break;
    case 128: rc = MT == 32 ? AT_L(128, 32) : AT_L(128, 64); break;
    case 256: rc = MT == 32 ? AT_L(256, 32) : AT_L(256, 64); break;
    default: rc = MT == 32 ? AT_L(512, 32) : AT_L(512, 64); break;
    }
#undef AT_L
    if (rc) return rc;
    if (NS > 1) {
        g_attn_merge_kernel<<<dim3(T, H), 128, 0, st>>>(part, sink, H, d, tiles, NS, MT, o);
        G_LAUNCHED();
        G_CHECK(cudaFreeAsync(part, st));
    }
    return 0;
}
