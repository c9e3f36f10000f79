// k_small.cu: RMSNorm, RoPE, act_quant, fp4 quantize-dequantize (SPEC §2, §4).
// Memory-bound: each thread moves 16-byte vectors (8 bf16) where the shape allows.
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

extern "C" int v41g_rmsnorm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int dim,
                            float eps, v41g_stream s)
{
    if (rows <= 0) return 0;
    int th = dim >= 4096 ? 256 : 128;
    g_rmsnorm_kernel<<<rows, th, 0, G_STREAM(s)>>>(x, w, y, dim, eps);
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

extern "C" int v41g_rope(uint16_t *x, const int32_t *pos, const float *freqs, int rows, int heads,
                         int d, int r, int inverse, v41g_stream s)
{
    size_t n = (size_t)rows * heads * (r / 2);
    if (n == 0) return 0;
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
    amax = fmaxf(amax, 1e-4f);
    int ex = g_ceil_log2(amax * (1.0f / 448.0f));
    float sc = g_pow2(ex), inv = g_pow2(-ex);
    uint64_t qq = 0;
    uint4 o;
    uint16_t *oe = (uint16_t *)&o;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float t = fminf(fmaxf(f[k] * inv, -448.0f), 448.0f);
        uint8_t c = g_f2e4m3(t);
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
__global__ void g_fp4_qdq_kernel(const uint16_t *__restrict__ x, uint16_t *y, size_t nvec, int lanes, int e4m3)
{
    size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    bool live = v < nvec;
    uint4 in = live ? *(const uint4 *)(x + v * 8) : make_uint4(0, 0, 0, 0);
    const uint16_t *e = (const uint16_t *)&in;
    float f[8], amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) { f[k] = g_bf2f(e[k]); amax = fmaxf(amax, fabsf(f[k])); }
    for (int o = 1; o < lanes; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!live) return;
    float sc;
    if (e4m3) sc = g_e4m32f(g_f2e4m3(fmaxf(amax, 6.0f * 0.001953125f) / 6.0f));
    else sc = g_pow2(g_ceil_log2(fmaxf(amax, 6.0f * 1.1754943508222875e-38f) * (1.0f / 6.0f)));
    uint4 o;
    uint16_t *oe = (uint16_t *)&o;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float m = g_fp4_mag(fabsf(f[k] / sc));
        oe[k] = g_f2bf(copysignf(m * sc, f[k]));
    }
    *(uint4 *)(y + v * 8) = o;
}

extern "C" int v41g_fp4_qdq(const uint16_t *x, uint16_t *y, int rows, int n, int g, int scale_e4m3,
                            v41g_stream s)
{
    int lanes = g / 8;
    if (g % 8 || n % g || lanes > 32 || (lanes & (lanes - 1))) return (int)cudaErrorInvalidValue;
    size_t nvec = (size_t)rows * n / 8;
    if (nvec == 0) return 0;
    g_fp4_qdq_kernel<<<(unsigned)((nvec + 255) / 256), 256, 0, G_STREAM(s)>>>(x, y, nvec, lanes, scale_e4m3);
    G_LAUNCHED();
    return 0;
}
