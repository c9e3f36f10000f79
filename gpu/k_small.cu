// k_small.cu: RMSNorm, RoPE, act_quant, fp4 quantize-dequantize (SPEC §2, §4).
// Memory-bound: each thread moves 16-byte vectors (8 bf16) where the shape allows; the
// vectorized variants keep the exact fp32 operation order of the plain ones (bit-identical).
#include "g_internal.cuh"

// ---------------------------------------------------------------- RMSNorm
// One block per row; fp32 sum of squares, y = bf16((x*r)*w) with r = 1/sqrt(mean+eps).
__global__ void g_rmsnorm_kernel(const uint16_t *__restrict__ x, const uint16_t *__restrict__ w,
                                 uint16_t *__restrict__ y, int dim, float eps)
{
    __shared__ float sh[32];
    const uint16_t *xr = x + (size_t)blockIdx.x * dim;
    uint16_t *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    if ((dim & 7) == 0) {
        for (int i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
            uint4 v = *(const uint4 *)(xr + i);
            const uint16_t *e = (const uint16_t *)&v;
#pragma unroll
            for (int k = 0; k < 8; k++) { float f = g_bf2f(e[k]); ss += f * f; }
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) { float f = g_bf2f(xr[i]); ss += f * f; }
    }
    ss = g_block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    if ((dim & 7) == 0) {
        for (int i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
            uint4 v = *(const uint4 *)(xr + i), wv = *(const uint4 *)(w + i), o;
            const uint16_t *e = (const uint16_t *)&v, *we = (const uint16_t *)&wv;
            uint16_t *oe = (uint16_t *)&o;
#pragma unroll
            for (int k = 0; k < 8; k++) oe[k] = g_f2bf((g_bf2f(e[k]) * r) * g_bf2f(we[k]));
            *(uint4 *)(yr + i) = o;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            yr[i] = g_f2bf((g_bf2f(xr[i]) * r) * g_bf2f(w[i]));
    }
}

// Same arithmetic, same element->thread assignment, same per-thread order and the same
// block_sum tree as g_rmsnorm_kernel (so bit-identical), with the thread's part of the row held in
// registers: all of a thread's 16-byte loads of x are issued up front and x is read from
// memory once (w, L2-resident, is read after the reduction to keep 8 blocks of 256 per SM).
// Needs dim % 8 == 0, 16-byte aligned pointers and dim <= NV * 8 * blockDim.x.
// y may alias x (in-place): each thread reads its vectors before writing them.
template <int NV>
__global__ void g_rmsnorm_reg_kernel(const uint16_t *x, const uint16_t *__restrict__ w, uint16_t *y, int dim,
                                     float eps)
{
    __shared__ float sh[32];
    const uint16_t *xr = x + (size_t)blockIdx.x * dim;
    uint16_t *yr = y + (size_t)blockIdx.x * dim;
    const int i0 = threadIdx.x * 8, step = blockDim.x * 8;
    uint4 xv[NV];
#pragma unroll
    for (int k = 0; k < NV; k++)
        if (i0 + k * step < dim) xv[k] = *(const uint4 *)(xr + i0 + k * step);
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; k++)
        if (i0 + k * step < dim) {
            const uint16_t *e = (const uint16_t *)&xv[k];
#pragma unroll
            for (int q = 0; q < 8; q++) { float f = g_bf2f(e[q]); ss = __fmaf_rn(f, f, ss); }
        }
    ss = g_block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < NV; k++)
        if (i0 + k * step < dim) {
            uint4 o, wk = __ldg((const uint4 *)(w + i0 + k * step));
            const uint16_t *e = (const uint16_t *)&xv[k], *we = (const uint16_t *)&wk;
            uint16_t *oe = (uint16_t *)&o;
#pragma unroll
            for (int q = 0; q < 8; q++) oe[q] = g_f2bf(__fmul_rn(__fmul_rn(g_bf2f(e[q]), r), g_bf2f(we[q])));
            *(uint4 *)(yr + i0 + k * step) = o;
        }
}

extern "C" int v41g_rmsnorm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int dim,
                            float eps, v41g_stream s)
{
    if (rows <= 0) return 0;
    int th = dim >= 4096 ? 256 : 128;
    int nv = (dim + 8 * th - 1) / (8 * th);   // 16-byte vectors per thread
    bool vec = (dim & 7) == 0 && (((uintptr_t)x | (uintptr_t)w | (uintptr_t)y) & 15) == 0;
    if (vec && nv == 1) g_rmsnorm_reg_kernel<1><<<rows, th, 0, G_STREAM(s)>>>(x, w, y, dim, eps);
    else if (vec && nv == 2) g_rmsnorm_reg_kernel<2><<<rows, th, 0, G_STREAM(s)>>>(x, w, y, dim, eps);
    else if (vec && nv == 3) g_rmsnorm_reg_kernel<3><<<rows, th, 0, G_STREAM(s)>>>(x, w, y, dim, eps);
    else if (vec && nv == 4) g_rmsnorm_reg_kernel<4><<<rows, th, 0, G_STREAM(s)>>>(x, w, y, dim, eps);
    else g_rmsnorm_kernel<<<rows, th, 0, G_STREAM(s)>>>(x, w, y, dim, eps);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- RoPE
// One thread per rotated pair; angle fp32(float(p)*f_j), precise cosf/sinf.
__global__ void g_rope_kernel(uint16_t *x, const int32_t *pos, const float *freqs, int rows, int heads,
                              int d, int r, int inverse)
{
    int half = r / 2;
    size_t n = (size_t)rows * heads * half;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int j = (int)(i % half);
        size_t rh = i / half;
        int row = (int)(rh / heads);
        float phi = (float)pos[row] * freqs[j];
        float c = cosf(phi), sn = sinf(phi);
        if (inverse) sn = -sn;
        uint16_t *p = x + rh * d + (d - r) + 2 * j;
        uint32_t both = *(uint32_t *)p;
        float a = g_bf2f((uint16_t)(both & 0xffff)), b = g_bf2f((uint16_t)(both >> 16));
        uint32_t o = (uint32_t)g_f2bf(a * c - b * sn) | ((uint32_t)g_f2bf(a * sn + b * c) << 16);
        *(uint32_t *)p = o;
    }
}

// Vectorized RoPE: a block of 256 threads takes rpb whole rows, VPT 16-byte vectors (4 pairs)
// per thread at most; the per-row cos/sin table (r/2 entries, the same cosf/sinf of the same
// fp32 angle as above) is computed once per row into shared memory (dynamic, 2*rpb*r/2 floats)
// while the rows' rotated parts are in flight. VPT is the smallest of 2/4/8 that holds a row,
// so at the model's q shape (64 heads x 64 rotated dims: 512 vectors a row) a block is one row,
// 2 vectors a thread, 36 registers, 6 blocks of 256 resident per SM, 4096 short-lived blocks
// (no wave tail, load and store phases of different blocks overlap), vs 2 blocks of 8 vectors
// a thread (89 registers) and 4 waves of 264 blocks before.
// The pair arithmetic is pinned to what ptxas makes of the expressions above:
// a' = fma(a, c, -(b*s)), b' = fma(b, c, a*s) (bit-identical to g_rope_kernel).
// Needs r % 8 == 0, d % 8 == 0, x 16-byte aligned, rpb * heads * r/8 <= VPT * 256,
// rpb * r/2 <= ROPE_TAB and rpb * heads * d < 2^31; other shapes use g_rope_kernel.
#define ROPE_TAB 2048
template <int VPT>
__global__ void __launch_bounds__(256, VPT == 2 ? 6 : VPT == 4 ? 4 : 1)
    g_rope_vec_kernel(uint16_t *x, const int32_t *__restrict__ pos, const float *__restrict__ freqs, int rows,
                      int heads, int d, int r, int inverse, int rpb)
{
    extern __shared__ __align__(16) float g_rope_tab[];   // [rpb*half] cos, then [rpb*half] sin
    const int half = r >> 1, vph = r >> 3, nvr = heads * vph;
    const int row0 = blockIdx.x * rpb;
    const int nrow = min(rpb, rows - row0), nv = nrow * nvr, ntab = nrow * half;
    float *tc = g_rope_tab, *ts = g_rope_tab + rpb * half;   // rpb*half % 4 == 0: ts 16-byte aligned
    uint16_t *xb = x + (size_t)row0 * heads * d + (d - r);
    uint4 v[VPT];
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        int i = threadIdx.x + k * 256;
        if (i < nv) {
            int rh = i / vph, jv = i - rh * vph;          // rh: (row, head) within the block
            v[k] = *(const uint4 *)(xb + rh * d + jv * 8);
        }
    }
    for (int t = threadIdx.x; t < ntab; t += 256) {
        int rl = t / half, j = t - rl * half;
        float phi = (float)pos[row0 + rl] * freqs[j];
        float c = cosf(phi), sn = sinf(phi);
        if (inverse) sn = -sn;
        tc[t] = c;
        ts[t] = sn;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        int i = threadIdx.x + k * 256;
        if (i < nv) {
            int rh = i / vph, jv = i - rh * vph, rl = rh / heads;
            int ti = rl * half + jv * 4;
            float4 c4 = *(const float4 *)&tc[ti], s4 = *(const float4 *)&ts[ti];
            const float cc[4] = {c4.x, c4.y, c4.z, c4.w}, ss[4] = {s4.x, s4.y, s4.z, s4.w};
            const uint16_t *e = (const uint16_t *)&v[k];
            uint4 o;
            uint16_t *oe = (uint16_t *)&o;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float a = g_bf2f(e[2 * q]), b = g_bf2f(e[2 * q + 1]);
                oe[2 * q] = g_f2bf(__fmaf_rn(a, cc[q], -__fmul_rn(b, ss[q])));
                oe[2 * q + 1] = g_f2bf(__fmaf_rn(b, cc[q], __fmul_rn(a, ss[q])));
            }
            *(uint4 *)(xb + rh * d + jv * 8) = o;
        }
    }
}

extern "C" int v41g_rope(uint16_t *x, const int32_t *pos, const float *freqs, int rows, int heads,
                         int d, int r, int inverse, v41g_stream s)
{
    size_t n = (size_t)rows * heads * (r / 2);
    if (n == 0) return 0;
    int nvr = heads * (r / 8), half = r / 2;   // 16-byte vectors per row, table entries per row
    // vectors per thread: the fewest (2, 4 or 8) that hold one row
    int vpt = nvr <= 2 * 256 ? 2 : nvr <= 4 * 256 ? 4 : 8;
    // rows per block: <= vpt vectors per thread, and at most one table entry per thread
    // where r/2 <= 256 (few heads: spread the cos/sin work over more blocks)
    int rpb = nvr > 0 ? vpt * 256 / nvr : 0, cap = half <= 256 ? 256 / half : (half <= ROPE_TAB ? 1 : 0);
    if (rpb > cap) rpb = cap;
    if (rpb > rows) rpb = rows;
    if (r % 8 == 0 && d % 8 == 0 && ((uintptr_t)x & 15) == 0 && rpb >= 1 && (size_t)rpb * heads * d < (1u << 31)) {
        unsigned nb = (unsigned)((rows + rpb - 1) / rpb);
        size_t sm = 2 * sizeof(float) * (size_t)rpb * half;   // <= 2 * ROPE_TAB floats = 16 KiB
        cudaStream_t st = G_STREAM(s);
        if (vpt == 2) g_rope_vec_kernel<2><<<nb, 256, sm, st>>>(x, pos, freqs, rows, heads, d, r, inverse, rpb);
        else if (vpt == 4) g_rope_vec_kernel<4><<<nb, 256, sm, st>>>(x, pos, freqs, rows, heads, d, r, inverse, rpb);
        else g_rope_vec_kernel<8><<<nb, 256, sm, st>>>(x, pos, freqs, rows, heads, d, r, inverse, rpb);
        G_LAUNCHED();
        return 0;
    }
    int blocks = (int)((n + 255) / 256);
    if (blocks > 65536) blocks = 65536;
    g_rope_kernel<<<blocks, 256, 0, G_STREAM(s)>>>(x, pos, freqs, rows, heads, d, r, inverse);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- act_quant(x, 32)
// 4 threads per block of 32 (8 elements each); amax = max(|x|, 1e-4),
// scale = 2^ceil(log2(amax * fp32(1/448))), q = e4m3_rne(clamp(x/scale, +-448)).
__global__ void g_act_quant_kernel(const uint16_t *__restrict__ x, uint8_t *q, float *scale, uint16_t *deq,
                                   size_t nvec /* total 8-element vectors */)
{
    size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    bool live = v < nvec;
    uint4 in = live ? *(const uint4 *)(x + v * 8) : make_uint4(0, 0, 0, 0);
    const uint16_t *e = (const uint16_t *)&in;
    float f[8], amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) { f[k] = g_bf2f(e[k]); amax = fmaxf(amax, fabsf(f[k])); }
    // the 4 lanes of one 32-block are consecutive lanes 4m..4m+3
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (!live) return;
    int ex = g_aq_exp(amax);
    float sc = g_pow2(ex), inv = g_pow2(-ex);
    uint64_t qq = 0;
    uint4 o;
    uint16_t *oe = (uint16_t *)&o;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        uint8_t c = g_aq_code(f[k], inv);
        qq |= (uint64_t)c << (8 * k);
        oe[k] = g_f2bf(g_e4m32f(c) * sc);
    }
    if (q) *(uint64_t *)(q + v * 8) = qq;
    if (deq) *(uint4 *)(deq + v * 8) = o;
    if (scale && (v & 3) == 0) scale[v >> 2] = sc;
}

extern "C" int v41g_act_quant(const uint16_t *x, uint8_t *q, float *scale, uint16_t *deq, int rows, int n,
                              v41g_stream s)
{
    if (n % 32) return (int)cudaErrorInvalidValue;
    size_t nvec = (size_t)rows * n / 8;
    if (nvec == 0) return 0;
    g_act_quant_kernel<<<(unsigned)((nvec + 255) / 256), 256, 0, G_STREAM(s)>>>(x, q, scale, deq, nvec);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- fp4_qdq(x, g, scale)
// g/8 consecutive lanes per group. e8m0: scale = 2^ceil(log2(max(amax, 6*2^-126)*fp32(1/6)));
// e4m3: scale = e4m3_rne(max(amax, 6*2^-9)/6). code = nearest fp4 of |x/scale|.
// LANES (= g/8) and the scale kind are template parameters. For e8m0, sc = 2^e is a power of
// two, so x/sc == x*2^-e exactly (both are the correctly rounded x*2^-e; no FTZ in this
// build) whenever 2^-e is a normal fp32 (e <= 126); e = 127/128 (amax inf) keeps the division.

// g_fp4_mag without branches (its chain of compares compiles to branches that diverge on
// every element of random data: the kernel was issue-bound). The fp4 grid {0,.5,1,1.5,2,3,4,6}
// is spacing s = 0.5 below 2, 1 in [2,4), 2 from 4: mag = min(rint(v/s)*s, 6), rint ties to
// even = the even code at the ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (v*(1/s) and *s are
// exact: powers of two, no overflow/underflow on those sides). NaN gives s = 2 and
// fminf(NaN, 6) = 6, as g_fp4_mag. Checked equal to g_fp4_mag for all 2^31 fp32 v >= 0 and
// every NaN (CPU, exhaustive).
__device__ __forceinline__ float g_fp4_mag_nb(float v)
{
    const bool lo = v < 2.0f, mid = v < 4.0f;
    const float s = lo ? 0.5f : (mid ? 1.0f : 2.0f), is = lo ? 2.0f : (mid ? 1.0f : 0.5f);
    return fminf(__fmul_rn(rintf(__fmul_rn(v, is)), s), 6.0f);
}

// Each thread takes U vectors 256 apart (a group's LANES lanes stay consecutive lanes of one
// warp, 256 % LANES == 0; nvec % LANES == 0 so a group is all live or all dead); all U loads
// are issued before any arithmetic.
template <int LANES, int E4M3, int U>
__global__ void __launch_bounds__(256) g_fp4_qdq_kernel(const uint16_t *__restrict__ x, uint16_t *y, size_t nvec)
{
    const size_t v0 = blockIdx.x * (size_t)(256 * U) + threadIdx.x;
    uint4 in[U];
#pragma unroll
    for (int u = 0; u < U; u++)
        in[u] = v0 + u * 256 < nvec ? *(const uint4 *)(x + (v0 + u * 256) * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; u++) {
        const size_t v = v0 + u * 256;
        const uint16_t *e = (const uint16_t *)&in[u];
        float f[8], amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) { f[k] = g_bf2f(e[k]); amax = fmaxf(amax, fabsf(f[k])); }
#pragma unroll
        for (int o = 1; o < LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (v >= nvec) continue;
        float sc, t[8];
        if (E4M3) {
            sc = g_e4m32f(g_f2e4m3(fmaxf(amax, 6.0f * 0.001953125f) / 6.0f));
#pragma unroll
            for (int k = 0; k < 8; k++) t[k] = f[k] / sc;
        } else {
            int ex = g_ceil_log2(fmaxf(amax, 6.0f * 1.1754943508222875e-38f) * (1.0f / 6.0f));
            sc = g_pow2(ex);
            if (ex <= 126) {
                float inv = g_pow2(-ex);
#pragma unroll
                for (int k = 0; k < 8; k++) t[k] = __fmul_rn(f[k], inv);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) t[k] = f[k] / sc;
            }
        }
        uint4 o;
        uint16_t *oe = (uint16_t *)&o;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float m = g_fp4_mag_nb(fabsf(t[k]));
            oe[k] = g_f2bf(copysignf(m * sc, f[k]));
        }
        *(uint4 *)(y + v * 8) = o;
    }
}

#define FP4_U 2   // vectors per thread
template <int E4M3>
static void g_fp4_qdq_launch(const uint16_t *x, uint16_t *y, size_t nvec, int lanes, cudaStream_t st)
{
    unsigned nb = (unsigned)((nvec + 256 * FP4_U - 1) / (256 * FP4_U));
    switch (lanes) {
    case 1: g_fp4_qdq_kernel<1, E4M3, FP4_U><<<nb, 256, 0, st>>>(x, y, nvec); break;
    case 2: g_fp4_qdq_kernel<2, E4M3, FP4_U><<<nb, 256, 0, st>>>(x, y, nvec); break;
    case 4: g_fp4_qdq_kernel<4, E4M3, FP4_U><<<nb, 256, 0, st>>>(x, y, nvec); break;
    case 8: g_fp4_qdq_kernel<8, E4M3, FP4_U><<<nb, 256, 0, st>>>(x, y, nvec); break;
    case 16: g_fp4_qdq_kernel<16, E4M3, FP4_U><<<nb, 256, 0, st>>>(x, y, nvec); break;
    default: g_fp4_qdq_kernel<32, E4M3, FP4_U><<<nb, 256, 0, st>>>(x, y, nvec); break;
    }
}

extern "C" int v41g_fp4_qdq(const uint16_t *x, uint16_t *y, int rows, int n, int g, int scale_e4m3,
                            v41g_stream s)
{
    int lanes = g / 8;
    if (g % 8 || n % g || lanes > 32 || (lanes & (lanes - 1))) return (int)cudaErrorInvalidValue;
    size_t nvec = (size_t)rows * n / 8;
    if (nvec == 0) return 0;
    if (scale_e4m3) g_fp4_qdq_launch<1>(x, y, nvec, lanes, G_STREAM(s));
    else g_fp4_qdq_launch<0>(x, y, nvec, lanes, G_STREAM(s));
    G_LAUNCHED();
    return 0;
}
