// k_hc.cu: mHC (SPEC §3): mixes + Sinkhorn per token, hc_pre, hc_post.
//
// Mixes are (2+h)h dot products of length hD per token. fn is genuine fp32;
// it is split once into two bf16 matrices hi = bf16(fn), lo = bf16(fn - hi)
// (|fn - hi - lo| <= 2^-16 |fn|), so the dots run as ONE tensor-core GEMM
// X . [hi; lo]^T with fp32 accumulation (X is bf16, products are exact in
// fp32): the result matches fp32 dots to ~1e-5 relative, the size of fp32
// summation-order error over 20480 terms. A second kernel, one warp per token,
// adds the hi and lo parts, computes the RMS statistic and runs the Sinkhorn
// normalisation (fp32, every division adds hc_eps). hc_mult 1, 2 or 4.
#include "g_internal.cuh"

__device__ __forceinline__ float g_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int H>
__device__ __forceinline__ void g_sinkhorn(const float *m, const float *sc, const float *base, float hc_eps,
                                           int iters, float (&C)[H][H])
{
    constexpr int NM = (2 + H) * H;
    (void)NM;
#pragma unroll
    for (int i = 0; i < H; i++) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < H; j++) { C[i][j] = m[2 * H + i * H + j] * sc[2] + base[2 * H + i * H + j]; mx = fmaxf(mx, C[i][j]); }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < H; j++) { C[i][j] = expf(C[i][j] - mx); s += C[i][j]; }
#pragma unroll
        for (int j = 0; j < H; j++) C[i][j] = C[i][j] / s + hc_eps;
    }
    // C /= colsum + eps; then (iters-1) x (rows, cols)
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
#pragma unroll
            for (int i = 0; i < H; i++) {
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < H; j++) s += C[i][j];
#pragma unroll
                for (int j = 0; j < H; j++) C[i][j] /= s + hc_eps;
            }
        }
#pragma unroll
        for (int j = 0; j < H; j++) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < H; i++) s += C[i][j];
#pragma unroll
            for (int i = 0; i < H; i++) C[i][j] /= s + hc_eps;
        }
    }
}

__global__ void g_hc_split_kernel(const float *__restrict__ fn, size_t n, uint16_t *__restrict__ hi,
                                  uint16_t *__restrict__ lo)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint16_t h = g_f2bf(fn[i]);
        hi[i] = h;
        lo[i] = g_f2bf(fn[i] - g_bf2f(h));
    }
}

extern "C" int v41g_hc_split_fn(const float *fn, int h, int D, uint16_t *fn2, v41g_stream s)
{
    size_t n = (size_t)(2 + h) * h * h * D;
    g_hc_split_kernel<<<1024, 256, 0, G_STREAM(s)>>>(fn, n, fn2, fn2 + n);
    G_LAUNCHED();
    return 0;
}

// Per-token RMS factor r[t] = 1/sqrt(mean X^2 + eps), one warp per token, exactly the order
// g_hc_finish_kernel used when it computed it itself: lane L accumulates ss = fma(f, f, ss)
// over its elements L*8 + 256*i + j in increasing i then j, then the xor butterfly of
// g_warp_sum, lane 0's value. The lane's 16-byte loads are issued HC_RB at a time (they were
// 4 at a time: ~20 dependent round trips per token at 20480 elements, and one token a warp
// is only ~31 warps an SM): 10 round trips, ~4 KiB in flight per warp. n % 256 == 0.
#define HC_RB 8
__global__ void __launch_bounds__(128, 8) g_hc_rms_kernel(const uint16_t *__restrict__ X, int T, int n, float norm_eps,
                                                       float *__restrict__ rr)
{
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    const uint16_t *x = X + (size_t)t * n + lane * 8;
    const int nv = n >> 8;   // 16-byte vectors per lane
    float ss = 0.0f;
    int i = 0;
    for (; i + HC_RB <= nv; i += HC_RB) {
        uint4 v[HC_RB];
#pragma unroll
        for (int u = 0; u < HC_RB; u++) v[u] = __ldg((const uint4 *)(x + (size_t)(i + u) * 256));
#pragma unroll
        for (int u = 0; u < HC_RB; u++)
#pragma unroll
            for (int j = 0; j < 8; j++) { float f = g_bf2f(((const uint16_t *)&v[u])[j]); ss = __fmaf_rn(f, f, ss); }
    }
    for (; i < nv; i++) {
        uint4 v = __ldg((const uint4 *)(x + (size_t)i * 256));
#pragma unroll
        for (int j = 0; j < 8; j++) { float f = g_bf2f(((const uint16_t *)&v)[j]); ss = __fmaf_rn(f, f, ss); }
    }
    ss = g_warp_sum(ss);
    if (lane == 0) rr[t] = 1.0f / sqrtf(ss / (float)n + norm_eps);
}

// One thread per token: mixes m = (hi + lo parts) * r, then pre/post/comb (the arithmetic of the
// former one-warp-per-token kernel's lane 0, unchanged).
template <int H>
__global__ void g_hc_finish_kernel(const float *__restrict__ m2 /*[T, 2NM]*/, const float *__restrict__ rr, int T,
                                   const float *__restrict__ base, const float *__restrict__ sc, float hc_eps,
                                   int iters, float *pre, float *post, float *comb)
{
    constexpr int NM = (2 + H) * H;
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    float r = rr[t];
    float m[NM];
    const float *mr = m2 + (size_t)t * 2 * NM;
#pragma unroll
    for (int i = 0; i < NM; i++) m[i] = (mr[i] + mr[NM + i]) * r;
#pragma unroll
    for (int i = 0; i < H; i++) {
        pre[(size_t)t * H + i] = g_sigmoid(m[i] * sc[0] + base[i]) + hc_eps;
        post[(size_t)t * H + i] = 2.0f * g_sigmoid(m[H + i] * sc[1] + base[H + i]);
    }
    float C[H][H];
    g_sinkhorn<H>(m, sc, base, hc_eps, iters, C);
#pragma unroll
    for (int i = 0; i < H; i++)
#pragma unroll
        for (int j = 0; j < H; j++) comb[(size_t)t * H * H + i * H + j] = C[i][j];
}

// The RMS factors need a second full pass over X (T x hD bf16: 168 MB at T = 4096); it runs on
// a side stream (g_side), concurrently with the cuBLAS GEMM's pass, or on the caller's stream
// where no side stream could be created.
extern "C" int v41g_hc_mixes2(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3,
                              int T, int h, int D, float norm_eps, float hc_eps, int iters,
                              float *pre, float *post, float *comb, v41g_stream s)
{
    if (T <= 0) return 0;
    if ((h * D) % 256) return (int)cudaErrorInvalidValue;
    if (h != 1 && h != 2 && h != 4) return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    int NM = (2 + h) * h;
    float *m2 = NULL;
    G_CHECK(g_tmp_alloc((void **)&m2, sizeof(float) * ((size_t)T * 2 * NM + T), st));
    float *rr = m2 + (size_t)T * 2 * NM;   // [T] RMS factors
    unsigned gr = (unsigned)((T + 3) / 4);
    g_side side(1);
    if (side.ok()) {
        G_CHECK(side.fork(st));
        g_hc_rms_kernel<<<gr, 128, 0, side.s[0]>>>(X, T, h * D, norm_eps, rr);
        cudaError_t e = cudaGetLastError();
        G_CHECK(side.join(st));
        G_CHECK(e);
    }
    // m2[T, 2NM] = X[T, hD] . fn2[2NM, hD]^T (bf16 x bf16, fp32 accumulate and out)
    int rc = v41g_gemm_bf16(X, fn2, m2, T, 2 * NM, h * D, 1, 1, 0, 0, 0, s);
    if (rc) return rc;
    if (!side.ok()) {
        g_hc_rms_kernel<<<gr, 128, 0, st>>>(X, T, h * D, norm_eps, rr);
        G_LAUNCHED();
    }
    unsigned g = (unsigned)((T + 63) / 64);
    switch (h) {
    case 1: g_hc_finish_kernel<1><<<g, 64, 0, st>>>(m2, rr, T, base, scale3, hc_eps, iters, pre, post, comb); break;
    case 2: g_hc_finish_kernel<2><<<g, 64, 0, st>>>(m2, rr, T, base, scale3, hc_eps, iters, pre, post, comb); break;
    default: g_hc_finish_kernel<4><<<g, 64, 0, st>>>(m2, rr, T, base, scale3, hc_eps, iters, pre, post, comb); break;
    }
    G_LAUNCHED();
    G_CHECK(cudaFreeAsync(m2, st));
    return 0;
}

extern "C" int v41g_hc_mixes(const uint16_t *X, const float *fn, const float *base, const float *scale3,
                             int T, int h, int D, float norm_eps, float hc_eps, int iters,
                             float *pre, float *post, float *comb, v41g_stream s)
{
    if (T <= 0) return 0;
    if (h != 1 && h != 2 && h != 4) return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    uint16_t *fn2 = NULL;   // the hi/lo split, here per call (an engine does it once at upload)
    size_t n = (size_t)(2 + h) * h * h * D;
    G_CHECK(g_tmp_alloc((void **)&fn2, 2 * n * sizeof(uint16_t), st));
    int rc = v41g_hc_split_fn(fn, h, D, fn2, s);
    if (!rc) rc = v41g_hc_mixes2(X, fn2, base, scale3, T, h, D, norm_eps, hc_eps, iters, pre, post, comb, s);
    if (rc) return rc;
    G_CHECK(cudaFreeAsync(fn2, st));
    return 0;
}

// y[t,:] = bf16(sum_i p[t,i] X[t,i,:]); one thread per 8-vector of D.
__global__ void g_hc_pre_kernel(const uint16_t *__restrict__ X, const float *__restrict__ p, uint16_t *y,
                                int T, int h, int D)
{
    int nv = D / 8;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * nv) return;
    int t = (int)(i / nv), v = (int)(i % nv);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int s = 0; s < h; s++) {
        float w = p[(size_t)t * h + s];
        uint4 x = *(const uint4 *)(X + ((size_t)t * h + s) * D + v * 8);
        const uint16_t *e = (const uint16_t *)&x;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] += w * g_bf2f(e[k]);
    }
    uint4 o;
    uint16_t *oe = (uint16_t *)&o;
#pragma unroll
    for (int k = 0; k < 8; k++) oe[k] = g_f2bf(acc[k]);
    *(uint4 *)(y + (size_t)t * D + v * 8) = o;
}

extern "C" int v41g_hc_pre(const uint16_t *X, const float *p, uint16_t *y, int T, int h, int D, v41g_stream s)
{
    if (D % 8) return (int)cudaErrorInvalidValue;
    size_t n = (size_t)T * (D / 8);
    if (!n) return 0;
    g_hc_pre_kernel<<<(unsigned)((n + 255) / 256), 256, 0, G_STREAM(s)>>>(X, p, y, T, h, D);
    G_LAUNCHED();
    return 0;
}

// Xout[t,j,:] = bf16(post_j*y + sum_i C[i][j]*X_i); all h inputs are read before
// any output is written, so Xout may alias X.
template <int H>
__global__ void g_hc_post_kernel(const uint16_t *__restrict__ y, const uint16_t *X, const float *__restrict__ post,
                                 const float *__restrict__ comb, uint16_t *Xout, int T, int D)
{
    int nv = D / 8;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * nv) return;
    int t = (int)(i / nv), v = (int)(i % nv);
    float xs[H][8], yv[8];
    uint4 yy = *(const uint4 *)(y + (size_t)t * D + v * 8);
#pragma unroll
    for (int k = 0; k < 8; k++) yv[k] = g_bf2f(((const uint16_t *)&yy)[k]);
#pragma unroll
    for (int s = 0; s < H; s++) {
        uint4 x = *(const uint4 *)(X + ((size_t)t * H + s) * D + v * 8);
#pragma unroll
        for (int k = 0; k < 8; k++) xs[s][k] = g_bf2f(((const uint16_t *)&x)[k]);
    }
    const float *C = comb + (size_t)t * H * H;
#pragma unroll
    for (int j = 0; j < H; j++) {
        float pj = post[(size_t)t * H + j];
        uint4 o;
        uint16_t *oe = (uint16_t *)&o;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float a = pj * yv[k];
#pragma unroll
            for (int s = 0; s < H; s++) a += C[s * H + j] * xs[s][k];
            oe[k] = g_f2bf(a);
        }
        *(uint4 *)(Xout + ((size_t)t * H + j) * D + v * 8) = o;
    }
}

extern "C" int v41g_hc_post(const uint16_t *y, const uint16_t *X, const float *post, const float *comb,
                            uint16_t *Xout, int T, int h, int D, v41g_stream s)
{
    if (D % 8) return (int)cudaErrorInvalidValue;
    size_t n = (size_t)T * (D / 8);
    if (!n) return 0;
    unsigned g = (unsigned)((n + 127) / 128);
    cudaStream_t st = G_STREAM(s);
    switch (h) {
    case 1: g_hc_post_kernel<1><<<g, 128, 0, st>>>(y, X, post, comb, Xout, T, D); break;
    case 2: g_hc_post_kernel<2><<<g, 128, 0, st>>>(y, X, post, comb, Xout, T, D); break;
    case 4: g_hc_post_kernel<4><<<g, 128, 0, st>>>(y, X, post, comb, Xout, T, D); break;
    default: return (int)cudaErrorInvalidValue;
    }
    G_LAUNCHED();
    return 0;
}
