// k_wq_f8.cu: the fp8 Linears (SPEC §2) as fp8 x fp8 tensor-core GEMMs (sm_90a): the accumulation
// of the fp8 GEMMs that serve V4-class models in production, selectable with V41_WQ_F8MMA=1.
//
// y[m, n] = sum_kb (sum_{k in kb} a_q[m, k] w_q[n, k]) * sa[m, kb] * sw[n / 32, kb]: the act_quant'ed
// input's e4m3 codes a_q times the weight's e4m3 codes w_q, one 32-column scale block kb at a
// time, in fp32 block after block. The kernel runs that sum as written: one
// wgmma.m64n128k32.e4m3.e4m3 per block (its K is exactly one scale block) into a zeroed fp32
// partial, then the partial times sa * sw added to the fp32 accumulator (the "promotion", an FFMA
// per element and block).
//
// Numerics. Every product a_q w_q is exact (4 x 4 significant bits), and so is each promotion's
// product by the power of two sa * sw; the fp32 accumulation over blocks is the SPEC's order. The
// one difference from an exact fp32 sum: inside one fp8 MMA Hopper's tensor cores add the 32
// products with a reduced-precision accumulator (DeepSeek-V3's report: about 14 bits retained;
// the format is not documented). tests/test_gpu_wq.c bounds it as 13 fraction bits kept relative
// to the larger operand's binade, truncated at each of the 31 additions: |error of a block sum|
// < 31 * 2^-12 * sum |products| < 2^-7 sum |products| (measured on the H200: at most 2^-10.7),
// and checks exactness where every block sum fits 9 bits. DeepGEMM promotes every 128 columns;
// the SPEC's 32-column scales need a promotion per 32. The bf16 kernels of k_wq.cu and the
// dequantize + cuBLAS path are exact up to fp32 summation order; the engines take this path only
// when asked (V41_WQ_F8MMA=1, v41g_wq_f8_active).
//
// Speed (H200, session 20): slower than the engine's dequantize + cuBLAS path at every M. Each
// block's partial must be complete before its promotion reads it, so a warpgroup has one MMA in
// flight at a time, and its latency is exposed (a variant without the promotion was still 0.75x
// cuBLAS at 4096 rows; see gpu/bench/results/HISTORY.md, results of session 20).
//
// Layouts.
//  - Weights: k_wq.cu's tiled codes (128 rows x 64 columns a tile, 8 KB contiguous), columns
//    permuted inside a tile row: position p = 16c + 4s + j holds column 16s + 2c + (j & 1) +
//    8 (j >> 1). Scale block b (columns 32b..32b+31) is bytes 8b..8b+7 of each 16-byte chunk c,
//    so 8-byte copies gather a row's block as 32 contiguous bytes; byte l = 8c + 4s' + j of that
//    32 then holds block column sigma(l) = 16s' + 2c + (j & 1) + 8 (j >> 1).
//  - Activations: v41g_act_quant_f8 writes the codes [M][K] with each 32-column block in the same
//    order (byte l holds column sigma(l)), so the MMA pairs equal columns, and the scales as fp32
//    [K/32][ldm] (ldm = rows rounded up to 4; padding rows 0): a stage's 128 row scales of a block
//    are 512 contiguous bytes.
//  - Shared memory, per stage of F8_NB = 4 blocks (128 columns): activations 4 x [128 rows x 32 B],
//    weights 4 x [128 rows x 32 B], each with the 32-byte swizzle (16-byte chunk h of row r at
//    chunk h ^ ((r >> 2) & 1); the no-swizzle core-matrix layout took 9-26 % longer), then
//    the activation scales 4 x 128 fp32. The weight scales of the CTA's 4 row groups are copied
//    to shared memory once.
// A CTA computes 128 activation rows (two warpgroups of 64, the MMA's M) x 128 weight rows (the
// MMA's N) over all of K, with a cp.async pipeline of F8_STAGES stages, F8_STAGES - 2 in flight:
// the stage being refilled is the one of two stages back, which every warpgroup has finished
// before the stage barrier.
#include "g_internal.cuh"
#include "k_attn_wgmma.cuh"

#define F8_STAGES 5                   /* 3 stages in flight */
#define F8_BLK 4096                   /* one block of one operand: 128 rows x 32 bytes */
#define F8_NB 4                       /* scale blocks (32 columns) per stage */
#define F8_STAGE (2 * F8_NB * F8_BLK + F8_NB * 512)   /* activations, weights, activation scales */

struct f8_args {
    const uint8_t *w, *s;   /* tiled codes, scales (v41g_wq) */
    int N, K, r0;
    const uint8_t *x8;      /* [M][K] codes, blocks in sigma order */
    const float *xs;        /* [K/32][ldm] */
    int ldm, M;
    void *y;
    int out_f32;
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D[64 x 128] = (scale_d ? D : 0) + A[64 x 32] . B[128 x 32]^T, e4m3 operands K-major in shared
// memory (descriptors), fp32 accumulate.
__device__ __forceinline__ void f8_mma_n128(float (&d)[64], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(scale_d));
}

#endif

namespace {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// 8-byte global -> shared copy (cp.async.ca: the 16-byte .cg form has no 8-byte size)
__device__ __forceinline__ void f8_cp8(uint32_t dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
// K-major descriptor, 32-byte swizzle: rows of 32 bytes (one scale block), 8-row atoms of 256
// bytes (SBO), 16-byte chunk h of row r at chunk h ^ ((r >> 2) & 1); LBO unused (the MMA's K is
// the swizzle width)
__device__ __forceinline__ uint64_t f8_desc(uint32_t saddr)
{
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(256 >> 4) << 32) | (3ull << 62);
}
__device__ __forceinline__ uint32_t f8_off(int r, int h) { return (uint32_t)(r * 32 + ((h ^ ((r >> 2) & 1)) << 4)); }
// 2^(e-127) of an e8m0 byte (e in [1, 254]: the weights' scales are checked at upload)
__device__ __forceinline__ float f8_e8m0(uint32_t e) { return __uint_as_float(e << 23); }

// keep v in a register from here on (the compiler would otherwise recompute hoisted offsets
// inside the loop)
__device__ __forceinline__ uint32_t f8_pin(uint32_t v)
{
    asm volatile("" : "+r"(v));
    return v;
}

// acc += P * (sa[row half] * sw[column group]): acc[4j + e] is row 8 (e >> 1) + (the thread's row)
// and column 8j + 2c + (e & 1), in column group j / 4
__device__ __forceinline__ void f8_promote(float (&acc)[64], const float (&P)[64], const float (&sa)[2], const float (&sw)[4])
{
    float sc[2][4];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int q = 0; q < 4; q++) sc[h][q] = sa[h] * sw[q];
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[4 * j + e] = __fmaf_rn(P[4 * j + e], sc[e >> 1][j >> 2], acc[4 * j + e]);
}

#endif

__global__ void __launch_bounds__(256, 1) g_wq_f8_kernel(f8_args a)
{
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char f8_sm[];
    const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(f8_sm);
    const uint32_t sbase = (sraw + 127u) & ~127u;
    const unsigned char *gbase = f8_sm + (sbase - sraw);
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int m0 = blockIdx.x * 128, n0 = blockIdx.y * 128, KB = a.K / 32, NS = (KB + F8_NB - 1) / F8_NB;
    const uint8_t *Wb = a.w + (size_t)blockIdx.y * (a.K / 64) * 8192;
    // Copies of one stage (F8_NB blocks = 2 weight tiles), per thread:
    //  - activations: 16-byte chunks, rows xr + 32j (j < 4), block xb, half xh; shared offset xo + 1024j
    //  - weights: 8-byte pieces, rows wr + 16j (j < 8), block wb, piece wq; global wg0 + 1024j,
    //    shared wo + 512j (tile wb / 2 of the stage's two, bytes 16 wq + 8 (wb & 1) of the row)
    //  - activation scales (threads < 128): block tid / 32, rows 4 (tid % 32)..
    const int xr = tid >> 3, xb = (tid >> 1) & 3, xh = tid & 1;
    const uint32_t xo = f8_pin(xb * F8_BLK + f8_off(xr, xh));
    const int wr = tid >> 4, wb = (tid >> 2) & 3, wq = tid & 3;
    const uint32_t wo = f8_pin(F8_NB * F8_BLK + wb * F8_BLK + f8_off(wr, wq >> 1) + (wq & 1) * 8);
    const uint32_t wg0 = f8_pin((wb >> 1) * 8192 + wr * 64 + 16 * wq + 8 * (wb & 1));
    const uint8_t *xp = a.x8 + (size_t)(m0 + xr) * a.K + 32 * xb + 16 * xh;
    uint32_t xok = 0;   /* bit j: row xr + 32j exists */
#pragma unroll
    for (int j = 0; j < 4; j++) xok |= (m0 + xr + 32 * j < a.M ? 1u : 0u) << j;
    const int sb = tid >> 5, sr = 4 * (tid & 31);
    const bool sok = m0 + sr < a.ldm;
    auto load = [&](int ks, int st) {
        const uint32_t s0 = sbase + st * F8_STAGE;
        const int k0 = ks * (32 * F8_NB);
        const bool full = k0 + 32 * F8_NB <= a.K;   /* else the last stage: blocks past K not loaded */
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool ok = (xok >> j & 1) && (full || 32 * xb < a.K - k0);
            g_cp_async16(s0 + xo + 1024 * j, ok ? xp + (size_t)32 * j * a.K + k0 : a.x8, ok ? 16 : 0);
        }
        if (full || 32 * wb < a.K - k0) {
            const uint8_t *t = Wb + (size_t)ks * 16384 + wg0;
#pragma unroll
            for (int j = 0; j < 8; j++) f8_cp8(s0 + wo + 512 * j, t + 1024 * j);
        }
        if (tid < 32 * F8_NB) {
            const bool ok = sok && (full || 32 * sb < a.K - k0);
            g_cp_async16(s0 + 2 * F8_NB * F8_BLK + sb * 512 + sr * 4,
                         ok ? a.xs + (size_t)(k0 / 32 + sb) * a.ldm + m0 + sr : a.xs, ok ? 16 : 0);
        }
    };
    // the weight scale bytes of the CTA's 4 column groups (rows n0 + 32q, clamped into the matrix;
    // r0 % 32 == 0, so a group is one scale row), copied once into shared memory behind the stages
    // as [block][group] (one 32-bit load a block; visible after the loop's first barrier): loaded in
    // the loop, a global load puts its latency into every stage
    unsigned char *sws = (unsigned char *)gbase + F8_STAGES * F8_STAGE;
    for (int i = tid; i < 4 * KB; i += 256) {
        const int q = i & 3, kb = i >> 2;
        sws[i] = __ldg(a.s + (size_t)((a.r0 + min(n0 + 32 * q, a.N - 1)) >> 5) * KB + kb);
    }
    const int rw = 64 * wg + 16 * w4 + g;   /* this thread's first activation row of the CTA's 128 */
    const uint32_t aoff = wg * 2048;        /* the warpgroup's 64 rows: 8 core-matrix rows of 256 bytes */

    float acc[64], P[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = P[i] = 0.0f;
#pragma unroll
    for (int st = 0; st < F8_STAGES - 2; st++) {
        if (st < NS) load(st, st);
        g_cp_commit();
    }
    for (int ks = 0; ks < NS; ks++) {
        const int st = ks % F8_STAGES;
        g_cp_wait<F8_STAGES - 3>();
        aw_fence_proxy_async();   // this thread's copies become visible to the MMAs
        __syncthreads();          // stage ks landed for all; every warpgroup is done with stage ks - 2
        {
            const int kn = ks + F8_STAGES - 2;
            if (kn < NS) load(kn, kn % F8_STAGES);
            g_cp_commit();
        }
        const uint32_t s0 = sbase + st * F8_STAGE;
        const unsigned char *sp = gbase + st * F8_STAGE;
        const int nb = min(F8_NB, KB - ks * F8_NB);
        // every block's scales up front (shared loads may not cross the MMAs' asm)
        float sa[F8_NB][2];
        uint32_t se[F8_NB];
#pragma unroll
        for (int b = 0; b < F8_NB; b++) {
            const float *sab = (const float *)(sp + 2 * F8_NB * F8_BLK + b * 512);
            sa[b][0] = sab[rw];
            sa[b][1] = sab[rw + 8];
            se[b] = *(const uint32_t *)(sws + 4 * min(ks * F8_NB + b, KB - 1));
        }
#pragma unroll
        for (int b = 0; b < F8_NB; b++) {
            if (b < nb) {
                // MMA, wait, promote: the other warpgroup's MMAs keep the tensor cores busy meanwhile
                aw_fence_regs(P);
                aw_wgmma_fence();
                f8_mma_n128(P, f8_desc(s0 + b * F8_BLK + aoff), f8_desc(s0 + (F8_NB + b) * F8_BLK), 0);
                aw_wgmma_commit();
                aw_wgmma_wait<0>();
                aw_fence_regs(P);
                const float sw[4] = {f8_e8m0(se[b] & 0xFF), f8_e8m0((se[b] >> 8) & 0xFF), f8_e8m0((se[b] >> 16) & 0xFF),
                                     f8_e8m0(se[b] >> 24)};
                f8_promote(acc, P, sa[b], sw);
            }
        }
    }
    g_cp_wait<0>();
    // acc[4j + e]: activation row m0 + rw + 8 (e >> 1), weight row n0 + 8j + 2c + (e & 1); pairs of
    // adjacent outputs (N is even)
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int m = m0 + rw + 8 * h;
        if (m >= a.M) continue;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int n = n0 + 8 * j + 2 * c;
            if (n >= a.N) continue;
            const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            const size_t o = (size_t)m * a.N + n;
            if (a.out_f32) *(float2 *)((float *)a.y + o) = make_float2(v0, v1);
            else *(uint32_t *)((uint16_t *)a.y + o) = (uint32_t)g_f2bf(v0) | (uint32_t)g_f2bf(v1) << 16;
        }
    }
#endif
}

// act_quant(x, 32) (SPEC §2; g_aq_exp and g_aq_code, as v41g_act_quant) into the GEMM's layout: one
// thread per 32-column block; byte l of the block's codes holds column sigma(l), the column of tile
// position 16 (l / 8) + l % 8 (wq_col_of), the scale goes to xs[kb][row]; threads of padding rows
// (rows..ldm-1) write scale 0.
__global__ void g_act_quant_f8_kernel(const uint16_t *__restrict__ x, int rows, int K, int ldm, uint8_t *x8, float *xs)
{
    const int KB = K / 32;
    const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= (long)ldm * KB) return;
    const int m = (int)(i / KB), kb = (int)(i % KB);
    if (m >= rows) {
        xs[(size_t)kb * ldm + m] = 0.0f;
        return;
    }
    const uint16_t *p = x + (size_t)m * K + 32 * kb;
    uint4 in[4];
#pragma unroll
    for (int v = 0; v < 4; v++) in[v] = *(const uint4 *)(p + 8 * v);
    const uint16_t *e = (const uint16_t *)in;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(g_bf2f(e[k])));
    const int ex = g_aq_exp(amax);
    const float inv = g_pow2(-ex);
    uint32_t o[8];
#pragma unroll
    for (int w = 0; w < 8; w++) {
        uint32_t v = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int l = 4 * w + j;   /* byte l = 8c + 4s + j of the block: tile position 16c + 4s + j */
            v |= (uint32_t)g_aq_code(g_bf2f(e[wq_col_of(16 * (l >> 3) + (l & 7))]), inv) << (8 * j);
        }
        o[w] = v;
    }
    uint4 *q = (uint4 *)(x8 + (size_t)m * K + 32 * kb);
    q[0] = make_uint4(o[0], o[1], o[2], o[3]);
    q[1] = make_uint4(o[4], o[5], o[6], o[7]);
    xs[(size_t)kb * ldm + m] = g_pow2(ex);
}

bool f8_built()
{
    static int ok = -1;
    if (ok < 0) {
        cudaFuncAttributes fa;
        ok = g_cc_major() == 9 && cudaFuncGetAttributes(&fa, g_wq_f8_kernel) == cudaSuccess && fa.numRegs >= 32;
        cudaGetLastError();
    }
    return ok == 1;
}

}  // namespace

extern "C" int v41g_wq_f8_ok(const v41g_wq *W)
{
    return W && W->fmt == V41G_WQ_FP8 && W->w && W->s && W->N > 0 && W->N % 2 == 0 && W->K > 0 && W->K % 64 == 0 &&
           W->r0 >= 0 && W->r0 % 32 == 0 && (uintptr_t)W->w % 16 == 0 && (uintptr_t)W->s % 2 == 0 && f8_built();
}

extern "C" int v41g_act_quant_f8(const uint16_t *x, int rows, int K, uint8_t *x8, float *xs, int ldm, v41g_stream s)
{
    if (!x || !x8 || !xs || rows < 0 || K <= 0 || K % 32 || ldm < rows || ldm % 4 || (uintptr_t)x % 16 ||
        (uintptr_t)x8 % 16 || (uintptr_t)xs % 16)
        return (int)cudaErrorInvalidValue;
    const long n = (long)ldm * (K / 32);
    if (n == 0) return 0;
    g_act_quant_f8_kernel<<<(unsigned)((n + 255) / 256), 256, 0, G_STREAM(s)>>>(x, rows, K, ldm, x8, xs);
    G_LAUNCHED();
    return 0;
}

extern "C" int v41g_wq_gemm_f8(const v41g_wq *W, const uint8_t *x8, const float *xs, int ldm, int M, void *y,
                               int out_f32, v41g_stream s)
{
    if (!v41g_wq_f8_ok(W) || !x8 || !xs || !y || M < 0 || ldm < M || ldm % 4 || (uintptr_t)x8 % 16 ||
        (uintptr_t)xs % 16 || (uintptr_t)y % (out_f32 ? 8 : 4))
        return (int)cudaErrorInvalidValue;
    if (M == 0) return 0;
    f8_args a = {W->w, W->s, W->N, W->K, W->r0, x8, xs, ldm, M, y, out_f32};
    const int sm = F8_STAGES * F8_STAGE + 128 + (4 * (W->K / 32) + 15) / 16 * 16;   /* stages, alignment, weight scales */
    if (sm > g_smem_optin()) return (int)cudaErrorInvalidValue;
    G_CHECK(cudaFuncSetAttribute(g_wq_f8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
    g_wq_f8_kernel<<<dim3((M + 127) / 128, (W->N + 127) / 128), 256, sm, G_STREAM(s)>>>(a);
    G_LAUNCHED();
    return 0;
}
