// k_wq.cu: Linears whose weights stay in their storage formats on the device (SPEC §2):
// fp8 e4m3 codes with one e8m0 scale per 32x32 block, or fp4 e2m1 codes (two per byte) with one
// e8m0 scale per row and 32 columns. The weight is dequantized in registers, inside the GEMM.
//
// y[M,N] = x[M,K] . deq(W)^T on tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulate).
// The dequantized operand is exact in bf16 (a 4-significant-bit e4m3 or 2-bit e2m1 code times a
// power of two), and x is bf16 (act_quant'ed by the caller for emulate-mode Linears, whose values
// q*scale are bf16-exact too), so every product is exact in fp32 and the result differs from
// ref's fp32 sum only by the fp32 summation order.
//
// Tiled codes: the device copy of the codes is cut into tiles of 128 rows x 64 columns, each tile
// one contiguous block (8 KB fp8, 4 KB fp4), the k tiles of one 128-row band consecutive,
// zero-padded past N and K (v41g_wq_tile). A CTA then streams contiguous blocks; in the
// checkpoint's row-major layout it would read 64 (fp8) or 32 (fp4) bytes from each of 128 rows
// a K row apart per tile, which DRAM serves at a fraction of its streaming rate.
//
// Roles: the weight rows are the mma's M dimension (A, dequantized into registers) and the
// activation rows (tokens) its N dimension (B): a decode batch of 1..8 rows then wastes no
// tensor work on padding rows of 16. A CTA (4 warps) computes 128 weight rows (32 per warp, two
// m16 tiles) x BM = 8*NT activation rows, over 64-wide k tiles staged in shared memory by a
// 4-stage cp.async pipeline (weight codes raw, activations bf16 in rows padded to 144 bytes).
//
// K-slot permutation. The sum over k does not care in which mma slot a k lands, as long as A and
// B agree. Thread (g = lane/4, c = lane%4) of a warp gives mma k-step s (s = 0..3 of a 64-k tile)
// the k values 16c + 4s + {0,1} in its slots {2c, 2c+1} and 16c + 4s + {2,3} in {2c+8, 2c+9}, for
// both operands. So each thread reads, per weight row, the contiguous codes of k = 16c..16c+15 (16
// bytes fp8 / 8 bytes fp4: one vector load from shared memory, conflict-free: a quarter warp
// covers 128 contiguous bytes) and per activation row 32 contiguous bytes, and its 16 k values all
// fall in one 32-wide scale block (number 2*kt + c/2).
//
// Dequantization in registers:
//  - fp8: a byte permute puts each code in the high byte of a 16-bit lane (sign at bit 15) and its
//    7 magnitude bits shift down to bf16 bits 4..10: the bf16 number code * 2^-120 exactly, subnormal
//    codes included (as bf16 subnormals); one bf16x2 multiply by 2^(e-7) gives code * 2^(e-127)
//    exactly (a normal bf16 for e in [10, 134]). About 2.5 instructions per element.
//  - fp4: a byte-permute lookup gives the bf16 bits of the 8 magnitudes {0,.5,1,1.5,2,3,4,6}, the
//    sign bit is or-ed in, and one bf16x2 multiply by 2^(e-127) (a normal bf16 for e >= 1) scales
//    them exactly.
// Small M: the k range is split over CTAs (gridDim.z) when there are too few CTAs for the SMs;
// each split writes fp32 partials and a second kernel sums them in split order (deterministic).
// Grouped calls (MoE): CTA (n tile, group) walks its group's rows in BM-row tiles; the group
// offsets are read on the device, so a call never waits for the host.
#include "g_internal.cuh"
#include <algorithm>

#define WQ_THREADS 128
#define WQ_BN 128      /* weight rows per CTA (4 warps x 32) */
#define WQ_TK 64       /* columns per k tile */
#define WQ_XS 144      /* activation row stride in shared memory (bytes): 128 + 16 (conflict-free) */

struct wq_args {
    const uint8_t *w, *s;
    long long w_stride, s_stride;
    int N, K, r0;
    const uint16_t *x;
    const int32_t *xrow, *off;   /* off NULL: dense (rows blockIdx.y*BM..), else grouped */
    int M;                       /* dense: rows; grouped: M_total */
    void *y;
    int out_f32;
    float *part;                 /* split-K partials [gridDim.z][M][N], or NULL */
    int kt_per_split;
};

__host__ __device__ constexpr int wq_wrow(int fmt) { return fmt == V41G_WQ_FP8 ? 64 : 32; }   /* code bytes per row per k tile */
__host__ __device__ constexpr int wq_stage(int fmt, int nt) { return WQ_BN * wq_wrow(fmt) + 8 * nt * WQ_XS; }
// pipeline depth: small activation tiles (decode) leave room for more weight tiles in flight
__host__ __device__ constexpr int wq_stages(int nt) { return nt <= 2 ? 6 : 4; }

// 4 e4m3 codes (byte j = element j) times the bf16x2 scale mul = 2^(e-7): bf16x2 of elements 0,1
// and 2,3. Each byte goes to the high byte of a 16-bit lane (sign at bit 15), its 7 magnitude bits
// shift down by 4 to bf16 bits 4..10: the bf16 number code * 2^-120 exactly (a subnormal code
// becomes a bf16 subnormal); the bf16x2 multiply then gives code * 2^(e-127) exactly.
__device__ __forceinline__ void wq_cvt_fp8(uint32_t u, uint32_t mul, uint32_t &p01, uint32_t &p23)
{
    const uint32_t x01 = __byte_perm(u, 0u, 0x1404), x23 = __byte_perm(u, 0u, 0x3424);   /* [0,b0,0,b1], [0,b2,0,b3] */
    uint32_t a = ((x01 & 0x7F007F00u) >> 4) | (x01 & 0x80008000u);
    uint32_t b = ((x23 & 0x7F007F00u) >> 4) | (x23 & 0x80008000u);
    __nv_bfloat162 m = *(__nv_bfloat162 *)&mul;
    __nv_bfloat162 ra = __hmul2(*(__nv_bfloat162 *)&a, m), rb = __hmul2(*(__nv_bfloat162 *)&b, m);
    p01 = *(uint32_t *)&ra;
    p23 = *(uint32_t *)&rb;
}
// 4 e2m1 codes (nibble j of v = element j) times the bf16x2 scale mul: bf16x2 of elements 0,1 and 2,3.
__device__ __forceinline__ void wq_cvt_fp4(uint32_t v, uint32_t mul, uint32_t &p01, uint32_t &p23)
{
    const uint32_t sel = v & 0x7777u;
    const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel);   /* high bytes of the magnitudes' bf16 */
    const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);   /* low bytes */
    // sign bits 3, 7 (11, 15) of v to bits 15, 31: one multiply places both (other products masked)
    const uint32_t t = v & 0x8888u;
    uint32_t a = __byte_perm(lo, hi, 0x5140) | ((t * 0x01001000u) & 0x80008000u);
    uint32_t b = __byte_perm(lo, hi, 0x7362) | ((t * 0x00010010u) & 0x80008000u);
    __nv_bfloat162 m = *(__nv_bfloat162 *)&mul;
    __nv_bfloat162 ra = __hmul2(*(__nv_bfloat162 *)&a, m), rb = __hmul2(*(__nv_bfloat162 *)&b, m);
    p01 = *(uint32_t *)&ra;
    p23 = *(uint32_t *)&rb;
}
// Multiplier of an e8m0 scale byte: fp8 path (bf16x2 2^(e-7); e in [10, 134], clamped), fp4 path
// (bf16x2 2^(e-127)).
__device__ __forceinline__ uint32_t wq_mul_fp8(uint32_t e)
{
    const uint32_t b = (min(e, 134u) + 120u) << 7;
    return b | (b << 16);
}
__device__ __forceinline__ uint32_t wq_mul_fp4(uint32_t e)
{
    const uint32_t b = e ? (e << 7) : 0x0040u;   /* 2^-127 is a bf16 subnormal */
    return b | (b << 16);
}

template <int FMT, int NT>
__global__ void __launch_bounds__(WQ_THREADS) g_wq_gemm_kernel(wq_args a)
{
    constexpr int WROW = wq_wrow(FMT), BM = 8 * NT, WT = WQ_BN * WROW, STAGE = wq_stage(FMT, NT);
    constexpr int WQ_STAGES = wq_stages(NT);
    extern __shared__ __align__(16) unsigned char wq_sm[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(wq_sm);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int n0 = blockIdx.x * WQ_BN;
    int grp = 0, mbeg, mend;
    if (a.off) { grp = blockIdx.y; mbeg = a.off[grp]; mend = a.off[grp + 1]; }
    else { mbeg = blockIdx.y * BM; mend = min(a.M, mbeg + BM); }
    if (mbeg >= mend) return;
    const uint8_t *W = a.w + (size_t)grp * a.w_stride, *S = a.s + (size_t)grp * a.s_stride;
    const int KT = (a.K + 63) / 64, ldsK = a.K / 32;
    const uint8_t *Wb = W + (size_t)blockIdx.x * KT * WT;   /* this CTA's band of tiles */
    const int kt0 = blockIdx.z * a.kt_per_split, kt1 = min(KT, kt0 + a.kt_per_split);
    // this thread's weight rows (i = 2*mt + half: row 16mt + 8half + g of the warp) and their scale rows
    const uint8_t *srow[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int n = min(n0 + warp * 32 + 8 * i + g, a.N - 1);
        srow[i] = S + (size_t)(FMT == V41G_WQ_FP8 ? (a.r0 + n) >> 5 : n) * ldsK;
    }
    auto scale_bytes = [&](int kt, uint32_t (&e)[4]) {
        const int kb = 2 * kt + (c >> 1);
#pragma unroll
        for (int i = 0; i < 4; i++) e[i] = kb < ldsK ? (uint32_t)__ldg(srow[i] + kb) : 127u;
    };

    for (int m0 = mbeg; m0 < mend; m0 += BM) {
        const int mrows = min(BM, mend - m0);
        // this thread's activation chunks: column chunk ch of rows xr0 + 16j (the row pointers,
        // gathered through xrow, are resolved once per m tile, not per k tile)
        constexpr int NXR = BM * 8 >= WQ_THREADS ? BM * 8 / WQ_THREADS : 1;
        const int ch = tid & 7, xr0 = tid >> 3;
        const uint16_t *xp[NXR];
        bool xok[NXR];
#pragma unroll
        for (int j = 0; j < NXR; j++) {
            const int r = xr0 + 16 * j;
            xok[j] = r < BM && r < mrows;
            xp[j] = xok[j] ? a.x + (size_t)(a.xrow ? a.xrow[m0 + r] : m0 + r) * a.K + ch * 8 : a.x;
        }
        auto load = [&](int kt, int st) {
            const uint32_t sw = sbase + st * STAGE, sx = sw + WT;
            const uint8_t *tile = Wb + (size_t)kt * WT;   /* contiguous, zero-padded */
#pragma unroll
            for (int j = 0; j < WT / 16 / WQ_THREADS; j++) {
                const int i = tid + j * WQ_THREADS;
                g_cp_async16(sw + i * 16, tile + i * 16, 16);
            }
            const bool kin = kt * 64 + ch * 8 < a.K;
#pragma unroll
            for (int j = 0; j < NXR; j++) {
                const int r = xr0 + 16 * j;
                if (r < BM) {
                    const bool ok = xok[j] && kin;
                    g_cp_async16(sx + r * WQ_XS + ch * 16, ok ? xp[j] + kt * 64 : a.x, ok ? 16 : 0);
                }
            }
        };
        float acc[2][NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
        __syncthreads();   // every warp is done with the previous m tile's stages
#pragma unroll
        for (int st = 0; st < WQ_STAGES - 1; st++) {
            if (kt0 + st < kt1) load(kt0 + st, st);
            g_cp_commit();
        }
        uint32_t ecur[4], enxt[4];
        scale_bytes(kt0, ecur);
        for (int kt = kt0; kt < kt1; kt++) {
            const int st = (kt - kt0) % WQ_STAGES;
            g_cp_wait<WQ_STAGES - 2>();
            __syncthreads();   // tile kt landed for all threads; every warp is done with tile kt-1's stage
            {
                const int kn = kt + WQ_STAGES - 1;
                if (kn < kt1) load(kn, (kn - kt0) % WQ_STAGES);
                g_cp_commit();
            }
            if (kt + 1 < kt1) scale_bytes(kt + 1, enxt);
            const unsigned char *Ws = wq_sm + st * STAGE, *Xs = Ws + WT;
            // raw codes of this thread's 4 rows, k = 16c..16c+15 of the tile
            uint32_t raw[4][WROW / 16];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const unsigned char *p = Ws + (warp * 32 + 8 * i + g) * WROW + (WROW / 4) * c;
                if constexpr (FMT == V41G_WQ_FP8) {
                    const uint4 v = *(const uint4 *)p;
                    raw[i][0] = v.x; raw[i][1] = v.y; raw[i][2] = v.z; raw[i][3] = v.w;
                } else {
                    const uint2 v = *(const uint2 *)p;
                    raw[i][0] = v.x; raw[i][1] = v.y;
                }
            }
            uint32_t m8[4], m4[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if constexpr (FMT == V41G_WQ_FP8) m8[i] = wq_mul_fp8(ecur[i]);
                else m4[i] = wq_mul_fp4(ecur[i]);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {   /* k steps 2h, 2h+1: activation elements 16c + 8h .. +7 */
                uint4 xb[NT];
#pragma unroll
                for (int j = 0; j < NT; j++) xb[j] = *(const uint4 *)(Xs + (8 * j + g) * WQ_XS + 32 * c + 16 * h);
#pragma unroll
                for (int ss = 0; ss < 2; ss++) {
                    const int s = 2 * h + ss;
                    uint32_t af[4][2];   /* row i: (elements 4s, 4s+1), (4s+2, 4s+3) */
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        if constexpr (FMT == V41G_WQ_FP8) wq_cvt_fp8(raw[i][s], m8[i], af[i][0], af[i][1]);
                        else wq_cvt_fp4(raw[i][s >> 1] >> (16 * (s & 1)), m4[i], af[i][0], af[i][1]);
                    }
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        const uint32_t b0 = ss ? xb[j].z : xb[j].x, b1 = ss ? xb[j].w : xb[j].y;
#pragma unroll
                        for (int mt = 0; mt < 2; mt++)
                            g_mma_bf16(acc[mt][j], af[2 * mt][0], af[2 * mt + 1][0], af[2 * mt][1], af[2 * mt + 1][1], b0,
                                       b1);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) ecur[i] = enxt[i];
        }
        g_cp_wait<0>();
        // epilogue: acc[mt][j][e] = (weight row 16mt + g (+8 for e >= 2), activation row 8j + 2c (+1 for odd e))
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = n0 + warp * 32 + 16 * mt + g + (e >> 1) * 8, r = 8 * j + 2 * c + (e & 1);
                    if (n >= a.N || r >= mrows) continue;
                    const size_t o = (size_t)(m0 + r) * a.N + n;
                    if (a.part) a.part[(size_t)blockIdx.z * a.M * a.N + o] = acc[mt][j][e];
                    else if (a.out_f32) ((float *)a.y)[o] = acc[mt][j][e];
                    else ((uint16_t *)a.y)[o] = g_f2bf(acc[mt][j][e]);
                }
    }
}

// y = sum over splits (in split order) of the partials
__global__ void g_wq_reduce_kernel(const float *__restrict__ part, int splits, size_t MN, void *y, int out_f32)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float v = part[i];
    for (int z = 1; z < splits; z++) v += part[(size_t)z * MN + i];
    if (out_f32) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = g_f2bf(v);
}

// bf16 copy of group g: thread i -> row n, elements 8j..8j+7
__global__ void g_wq_dequant_kernel(v41g_wq W, int g, uint16_t *__restrict__ out)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, per = (size_t)W.K / 8;
    if (i >= (size_t)W.N * per) return;
    const int n = (int)(i / per), j = (int)(i % per), kb = (8 * j) / 32, ldsK = W.K / 32;
    const uint8_t *sc = W.s + (size_t)g * W.s_stride;
    const int KT = (W.K + 63) / 64, kt = (8 * j) / 64, kc = (8 * j) % 64;   /* tile column */
    const uint8_t *tile = W.w + (size_t)g * W.w_stride + ((size_t)(n / WQ_BN) * KT + kt) * WQ_BN * wq_wrow(W.fmt) +
                          (size_t)(n % WQ_BN) * wq_wrow(W.fmt);
    uint4 o;
    if (W.fmt == V41G_WQ_FP8) {
        const uint32_t e = sc[(size_t)((W.r0 + n) >> 5) * ldsK + kb];
        const uint2 u = *(const uint2 *)(tile + kc);
        wq_cvt_fp8(u.x, wq_mul_fp8(e), o.x, o.y);
        wq_cvt_fp8(u.y, wq_mul_fp8(e), o.z, o.w);
    } else {
        const uint32_t e = sc[(size_t)n * ldsK + kb];
        const uint32_t u = *(const uint32_t *)(tile + kc / 2);
        wq_cvt_fp4(u, wq_mul_fp4(e), o.x, o.y);
        wq_cvt_fp4(u >> 16, wq_mul_fp4(e), o.z, o.w);
    }
    *(uint4 *)(out + (size_t)n * W.K + 8 * j) = o;
}

// Tiled copy of checkpoint-layout codes: thread i -> 16-byte chunk i of the tiled buffer.
__global__ void g_wq_tile_kernel(int fmt, int N, int K, const uint8_t *__restrict__ codes, uint8_t *__restrict__ tiled,
                                 size_t chunks)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const int WROW = wq_wrow(fmt), WT = WQ_BN * WROW, KT = (K + 63) / 64;
    const size_t byte = i * 16, t = byte / WT;
    const int in = (int)(byte % WT), r = in / WROW, cb = in % WROW;
    const int n = (int)(t / KT) * WQ_BN + r, kt = (int)(t % KT);
    const size_t rowb = fmt == V41G_WQ_FP8 ? (size_t)K : (size_t)K / 2, kb = (size_t)kt * WROW + cb;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (n < N && kb < rowb) v = *(const uint4 *)(codes + (size_t)n * rowb + kb);
    *(uint4 *)(tiled + byte) = v;
}

namespace {

bool wq_valid(const v41g_wq *W)
{
    if (!W || !W->w || !W->s || W->N <= 0 || W->K <= 0 || W->K % 32 || W->r0 < 0) return false;
    if (W->fmt != V41G_WQ_FP8 && W->fmt != V41G_WQ_FP4) return false;
    if (W->fmt == V41G_WQ_FP4 && W->r0 != 0) return false;
    // cp.async moves 16-byte chunks: code rows and groups must start 16-byte aligned
    return ((uintptr_t)W->w | (uintptr_t)W->w_stride) % 16 == 0;
}

int num_sms()
{
    static int n = 0;
    if (!n) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            n <= 0)
            n = 132;
    }
    return n;
}

int nt_for(int rows) { return rows <= 8 ? 1 : rows <= 16 ? 2 : rows <= 32 ? 4 : 8; }

// split count of a dense call: enough CTAs for four per SM, at least 4 k tiles per split, within ws
int split_for(const v41g_wq *W, int M, size_t ws_bytes, int *kps)
{
    const int BM = 8 * nt_for(M), KT = (W->K + 63) / 64;
    const long ctas = (long)((W->N + WQ_BN - 1) / WQ_BN) * ((M + BM - 1) / BM);
    int sp = 1;
    const long want = 4L * num_sms();   /* measured: 2 CTAs (8 warps) per SM leave the schedulers idle */
    if (ctas < want) sp = (int)((want + ctas - 1) / ctas);
    sp = std::min(sp, std::max(1, KT / 4));
    const size_t per = sizeof(float) * (size_t)M * W->N;
    if (sp > 1 && per * sp > ws_bytes) sp = std::max(1, (int)(ws_bytes / per));
    *kps = (KT + sp - 1) / sp;
    return (KT + *kps - 1) / *kps;
}

template <int FMT, int NT>
int launch_t(dim3 grid, const wq_args &a, cudaStream_t st)
{
    const int sm = wq_stages(NT) * wq_stage(FMT, NT);
    static bool attr = false;   // one attribute call per instantiation (idempotent anyway)
    if (!attr) {
        G_CHECK(cudaFuncSetAttribute(g_wq_gemm_kernel<FMT, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
        attr = true;
    }
    g_wq_gemm_kernel<FMT, NT><<<grid, WQ_THREADS, sm, st>>>(a);
    G_LAUNCHED();
    return 0;
}

int launch(int fmt, int nt, dim3 grid, const wq_args &a, cudaStream_t st)
{
#define WQ_L(F) (nt == 1 ? launch_t<F, 1>(grid, a, st) : nt == 2 ? launch_t<F, 2>(grid, a, st) \
                 : nt == 4 ? launch_t<F, 4>(grid, a, st) : launch_t<F, 8>(grid, a, st))
    return fmt == V41G_WQ_FP8 ? WQ_L(V41G_WQ_FP8) : WQ_L(V41G_WQ_FP4);
#undef WQ_L
}

wq_args args_of(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32)
{
    wq_args a;
    a.w = W->w; a.s = W->s; a.w_stride = W->w_stride; a.s_stride = W->s_stride;
    a.N = W->N; a.K = W->K; a.r0 = W->r0;
    a.x = x; a.xrow = NULL; a.off = NULL; a.M = M;
    a.y = y; a.out_f32 = out_f32; a.part = NULL;
    a.kt_per_split = (W->K + 63) / 64;
    return a;
}

}  // namespace

extern "C" size_t v41g_wq_tiled_bytes(int fmt, int N, int K)
{
    if ((fmt != V41G_WQ_FP8 && fmt != V41G_WQ_FP4) || N <= 0 || K <= 0 || K % 32) return 0;
    return (size_t)((N + WQ_BN - 1) / WQ_BN) * ((K + 63) / 64) * WQ_BN * wq_wrow(fmt);
}

extern "C" int v41g_wq_tile(int fmt, int N, int K, const uint8_t *codes, uint8_t *tiled, v41g_stream s)
{
    const size_t bytes = v41g_wq_tiled_bytes(fmt, N, K);
    if (!bytes || !codes || !tiled || ((uintptr_t)codes | (uintptr_t)tiled) % 16) return (int)cudaErrorInvalidValue;
    const size_t chunks = bytes / 16;
    g_wq_tile_kernel<<<(unsigned)((chunks + 255) / 256), 256, 0, G_STREAM(s)>>>(fmt, N, K, codes, tiled, chunks);
    G_LAUNCHED();
    return 0;
}

extern "C" size_t v41g_wq_ws_bytes(const v41g_wq *W, int M)
{
    if (!wq_valid(W) || M <= 0) return 0;
    int kps, sp = split_for(W, M, (size_t)-1, &kps);
    return sp > 1 ? sizeof(float) * (size_t)sp * M * W->N : 0;
}

extern "C" int v41g_wq_gemm(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32, void *ws,
                            size_t ws_bytes, v41g_stream s)
{
    if (!wq_valid(W) || M < 0 || ((uintptr_t)x % 16)) return (int)cudaErrorInvalidValue;
    if (M == 0) return 0;
    cudaStream_t st = G_STREAM(s);
    const int nt = nt_for(M), BM = 8 * nt;
    wq_args a = args_of(W, x, M, y, out_f32);
    const int sp = split_for(W, M, ws ? ws_bytes : 0, &a.kt_per_split);
    if (sp > 1) a.part = (float *)ws;
    const dim3 grid((W->N + WQ_BN - 1) / WQ_BN, (M + BM - 1) / BM, sp);
    int rc = launch(W->fmt, nt, grid, a, st);
    if (rc || sp == 1) return rc;
    const size_t MN = (size_t)M * W->N;
    g_wq_reduce_kernel<<<(unsigned)((MN + 255) / 256), 256, 0, st>>>(a.part, sp, MN, y, out_f32);
    G_LAUNCHED();
    return 0;
}

extern "C" int v41g_wq_gemm_grouped(const v41g_wq *W, int G, const int32_t *off, const int32_t *xrow,
                                    const uint16_t *x, int M_total, void *y, int out_f32, v41g_stream s)
{
    if (!wq_valid(W) || G <= 0 || !off || M_total < 0 || ((uintptr_t)x % 16)) return (int)cudaErrorInvalidValue;
    if (M_total == 0) return 0;
    // rows per m tile from the mean rows per group (the counts themselves stay on the device)
    const int nt = nt_for((M_total + G - 1) / G);
    wq_args a = args_of(W, x, M_total, y, out_f32);
    a.off = off;
    a.xrow = xrow;
    return launch(W->fmt, nt, dim3((W->N + WQ_BN - 1) / WQ_BN, G, 1), a, G_STREAM(s));
}

extern "C" int v41g_wq_dequant(const v41g_wq *W, int g, uint16_t *out, v41g_stream s)
{
    if (!wq_valid(W) || g < 0) return (int)cudaErrorInvalidValue;
    const size_t n = (size_t)W->N * (W->K / 8);
    g_wq_dequant_kernel<<<(unsigned)((n + 255) / 256), 256, 0, G_STREAM(s)>>>(*W, g, out);
    G_LAUNCHED();
    return 0;
}
