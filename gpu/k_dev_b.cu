// k_dev_b.cu: small kernels of the device-resident decode step (gpu/v41_gpu_dev.h):
// mHC statistics (RMS factor, Sinkhorn split), the DSpark main-hidden mean, the
// Engram gate, the argmax head, and the MoE pieces (GEMM pointer tables, SwiGLU,
// the combine of the expert rows).
//
// Exactness. Every kernel reproduces ref's arithmetic (ref/ops.c, ref/engine.c):
// the same fp32 operations in the same order, each product and sum rounded
// separately (__fmul_rn / __fadd_rn / __fdiv_rn / __fsub_rn, which nvcc never
// contracts into an FMA, whatever -fmad says), double accumulation where ref
// accumulates in double. Known, accepted differences:
//  - ref sums in double sequentially; here the double sums are block reductions
//    (another association). The fp32 terms are the same, so the sums differ by a
//    few double roundings (~1e-16 relative) and the float cast of the result
//    agrees except within ~2^-29 of an fp32 rounding boundary.
//  - exp is g_expf_ref (g_internal.cuh: double exp rounded once, glibc's value but in rare
//    double-rounding cases; CUDA's expf can be 2 ulp off): sigmoid, the
//    Sinkhorn softmax and SwiGLU may differ by a few fp32 ulps.
// sqrtf and '/' are IEEE here (no fast-math; the intrinsics are the _rn ones).
// No kernel allocates, synchronises or copies to the host: all are CUDA-graph
// capturable; per-row values are read from device memory.
#include "g_internal.cuh"
#include "v41_gpu_dev.h"
#include <math.h>

#define DB_THREADS 256   // threads of the one-block-per-row kernels (multiple of 32)

// v41_rms_rsqrt from a double sum s of the fp32 squares of n elements:
// 1 / sqrtf((float)(s / n) + eps).
__device__ __forceinline__ float db_rsqrt_stat(double s, int n, float eps)
{
    float mean = (float)(s / (double)n);
    return __fdiv_rn(1.0f, sqrtf(__fadd_rn(mean, eps)));
}

// ------------------------------------------------------------------ rms_scale
// One block per row t (up to 1024 threads, by n): s = sum (double) of fp32 squares of X[t, 0..n),
// then mixes[t, i] = mixes[t, i] * r (ref hc_mixes). The row is read in 16-byte loads (8 bf16; a
// head of < 8 elements up to the first 16-byte boundary, a tail of < 8 after the last), RS_U loads
// in flight per thread. Each thread sums its elements in a fixed order and the block reduction
// (g_block_sum) has a fixed shape: the result is the same bits at every run (for one pointer and n).
#define RS_MAXT 1024
#define RS_U 4
__device__ __forceinline__ double db_sq8(uint4 v)
{   // the squares of the 8 bf16 of v, summed in double in element order
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float lo = __uint_as_float(w[k] << 16), hi = __uint_as_float(w[k] & 0xffff0000u);
        s += (double)__fmul_rn(lo, lo);
        s += (double)__fmul_rn(hi, hi);
    }
    return s;
}
__global__ void __launch_bounds__(RS_MAXT) db_rms_scale_kernel(const uint16_t *__restrict__ X, int n, float eps,
                                                               float *mixes, int mix)
{
    __shared__ double sh[32];
    const int t = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const uint16_t *x = X + (size_t)t * n;
    // elements before the first 16-byte boundary (x is 2-byte aligned)
    int head = (int)(((16u - (uint32_t)(reinterpret_cast<uintptr_t>(x) & 15u)) & 15u) >> 1);
    if (head > n) head = n;
    const int nv = (n - head) >> 3;
    const uint4 *x4 = reinterpret_cast<const uint4 *>(x + head);
    double s = 0.0;
    for (int q = tid; q < nv; q += nt * RS_U) {
        uint4 v[RS_U];
#pragma unroll
        for (int u = 0; u < RS_U; u++) v[u] = q + u * nt < nv ? __ldg(x4 + q + u * nt) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < RS_U; u++) s += db_sq8(v[u]);   // zero padding adds +0
    }
    if (tid < head) {
        const float f = g_bf2f(x[tid]);
        s += (double)__fmul_rn(f, f);
    }
    for (int i = head + nv * 8 + tid; i < n; i += nt) {
        const float f = g_bf2f(x[i]);
        s += (double)__fmul_rn(f, f);
    }
    s = g_block_sum(s, sh);
    const float r = db_rsqrt_stat(s, n, eps);
    float *m = mixes + (size_t)t * mix;
    for (int i = tid; i < mix; i += nt) m[i] = __fmul_rn(m[i], r);
}

extern "C" int v41g_rms_scale(const uint16_t *X, int T, int n, float eps, float *mixes, int mix, v41g_stream s)
{
    if (T <= 0 || mix <= 0) return 0;
    // about 2 16-byte loads a thread, 64..1024 threads
    int th = (int)(((int64_t)(n > 0 ? n : 0) + 15) / 16);
    th = (th + 31) / 32 * 32;
    th = th < 64 ? 64 : th > RS_MAXT ? RS_MAXT : th;
    db_rms_scale_kernel<<<(unsigned)T, th, 0, G_STREAM(s)>>>(X, n, eps, mixes, mix);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ sinkhorn
// H * H lanes per token, the arithmetic of g_sinkhorn_token (g_internal.cuh: v41_hc_split_sinkhorn
// operation for operation). Lanes past T compute on row T - 1 and write nothing (all lanes take
// part in the shuffles).
#define SK_THREADS 128
template <int H>
__global__ void __launch_bounds__(SK_THREADS) db_sinkhorn_kernel(const float *__restrict__ mixes,
                                                                 const float *__restrict__ sc,
                                                                 const float *__restrict__ base, int T, int iters,
                                                                 float eps, float *pre, float *post, float *comb)
{
    constexpr int HH = H * H, NM = (2 + H) * H;
    const int gt = blockIdx.x * blockDim.x + threadIdx.x;
    const int tk = gt / HH, e = gt % HH;
    const bool live = tk < T;
    const int t = live ? tk : T - 1;
    const float *m = mixes + (size_t)t * NM;
    g_sinkhorn_token<H>([&](int i) { return m[i]; }, e, live, t, sc, base, iters, eps, pre, post, comb);
}

extern "C" int v41g_sinkhorn(const float *mixes, const float *scale3, const float *base, int T, int h, int iters,
                             float eps, float *pre, float *post, float *comb, v41g_stream s)
{
    if (T <= 0) return 0;
    if (h != 1 && h != 2 && h != 4) return (int)cudaErrorInvalidValue;
    const unsigned g = (unsigned)(((int64_t)T * h * h + SK_THREADS - 1) / SK_THREADS);
    cudaStream_t st = G_STREAM(s);
    switch (h) {
    case 1: db_sinkhorn_kernel<1><<<g, SK_THREADS, 0, st>>>(mixes, scale3, base, T, iters, eps, pre, post, comb); break;
    case 2: db_sinkhorn_kernel<2><<<g, SK_THREADS, 0, st>>>(mixes, scale3, base, T, iters, eps, pre, post, comb); break;
    default:
        db_sinkhorn_kernel<4><<<g, SK_THREADS, 0, st>>>(mixes, scale3, base, T, iters, eps, pre, post, comb);
        break;
    }
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ hc_mean
// One thread per (t, k): s = 0; s += X[t, j, k] for j = 0..h-1; y = bf16(s / h)
// (ref_forward: s starts at +0, so a lone -0 gives +0 as in ref).
__global__ void db_hc_mean_kernel(const uint16_t *__restrict__ X, int T, int h, int D, uint16_t *__restrict__ y,
                                  int64_t ld_y)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * D) return;
    const size_t t = i / (size_t)D, k = i % (size_t)D;
    const uint16_t *x = X + t * (size_t)h * D + k;
    float s = 0.0f;
    for (int j = 0; j < h; j++) s = __fadd_rn(s, g_bf2f(x[(size_t)j * D]));
    s = __fdiv_rn(s, (float)h);
    y[(int64_t)t * ld_y + (int64_t)k] = g_f2bf(s);
}

extern "C" int v41g_hc_mean(const uint16_t *X, int T, int h, int D, uint16_t *y, int64_t ld_y, v41g_stream s)
{
    const size_t n = (size_t)(T > 0 ? T : 0) * (size_t)(D > 0 ? D : 0);
    if (!n) return 0;
    db_hc_mean_kernel<<<(unsigned)((n + 255) / 256), 256, 0, G_STREAM(s)>>>(X, T, h, D, y, ld_y);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ engram gate
// One block per (t, j) (blockIdx.x = t * h + j). The three double sums of ref
// engram() (squares of X[t,j], squares of key_j, the products (x * wq) * key) in one
// pass; then every thread updates the elements it read (X is in place: the reads of
// the row all precede the block reductions' barriers, the writes follow them).
__global__ void __launch_bounds__(DB_THREADS) db_engram_kernel(const uint16_t *__restrict__ kv,
                                                               const float *__restrict__ wq, int h, int D, float eps,
                                                               float isd, uint16_t *X)
{
    __shared__ double sh[32];
    const int b = blockIdx.x, t = b / h, j = b % h;
    uint16_t *x = X + (size_t)b * D;   // X[t, j, :] (row t * h + j)
    const uint16_t *kt = kv + (size_t)t * (size_t)(h + 1) * D;
    const uint16_t *key = kt + (size_t)j * D, *val = kt + (size_t)h * D;
    const float *w = wq + (size_t)j * D;
    double sx = 0.0, sk = 0.0, sd = 0.0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float xv = g_bf2f(x[i]), kv_ = g_bf2f(key[i]);
        sx += (double)__fmul_rn(xv, xv);
        sk += (double)__fmul_rn(kv_, kv_);
        sd += (double)__fmul_rn(__fmul_rn(xv, w[i]), kv_);
    }
    sx = g_block_sum(sx, sh);
    sk = g_block_sum(sk, sh);
    sd = g_block_sum(sd, sh);
    const float rstd = __fmul_rn(db_rsqrt_stat(sx, D, eps), db_rsqrt_stat(sk, D, eps));
    const float dot = __fmul_rn(__fmul_rn((float)sd, rstd), isd);
    float a = fabsf(dot);
    if (a < 1e-6f) a = 1e-6f;
    const float g = g_sigmoid_ref(copysignf(sqrtf(a), dot));
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        x[i] = g_f2bf(__fadd_rn(g_bf2f(x[i]), __fmul_rn(g, g_bf2f(val[i]))));
}

extern "C" int v41g_engram_gate(const uint16_t *kv, const float *wq, int T, int h, int D, float eps, uint16_t *X,
                                v41g_stream s)
{
    if (T <= 0 || h <= 0 || D <= 0) return 0;
    const float isd = (float)pow((double)D, -0.5);   // ref: (float)pow(D, -0.5), on the host as there
    db_engram_kernel<<<(unsigned)((size_t)T * h), DB_THREADS, 0, G_STREAM(s)>>>(kv, wq, h, D, eps, isd, X);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ argmax
// ref argmax_f: b = 0; for i = 1..n-1: if (x[i] > x[b]) b = i. With NaNs that is:
// 0 when x[0] is NaN (nothing compares greater than NaN), otherwise the first index
// of the largest non-NaN value (a NaN x[i] never wins).
//
// Each row is split over `splits` CTAs (chunks of a multiple of 4 elements, so float4 loads when
// the rows are 16-byte aligned, AM_U of them in flight per thread). Each thread keeps its first
// best non-NaN (value, index) (it visits its indices in increasing order), the CTA reduces them by
// (value desc, index asc) and writes its candidate (index -1: none) to a scratch pair; a second
// kernel reduces a row's candidates the same way and applies the x[0] rule. With one split the
// first kernel writes the result itself.
#define AM_THREADS 256
#define AM_U 4
#define AM_MIN_CHUNK 2048   // elements per CTA at least
__device__ __forceinline__ bool db_better(float v, int i, float bv, int bi)
{   // candidate (v, i) beats (bv, bi); i < 0 / bi < 0: no candidate
    if (i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}
__device__ __forceinline__ void db_take(float v, int i, float &bv, int &bi)
{   // i is larger than every index seen before
    if (!isnan(v) && (bi < 0 || v > bv)) { bv = v; bi = i; }
}
__device__ __forceinline__ void db_warp_best(float &bv, int &bi)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (db_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
}
__global__ void __launch_bounds__(AM_THREADS) db_argmax_kernel(const float *__restrict__ X, int V, int splits,
                                                               int chunk, int vec, float *__restrict__ pv,
                                                               int *__restrict__ pi, int32_t *__restrict__ out)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    const int t = blockIdx.x / splits, sp = blockIdx.x % splits, tid = threadIdx.x;
    const float *x = X + (size_t)t * V;
    const int c0 = sp * chunk, c1 = (int)min((int64_t)c0 + chunk, (int64_t)V);
    float bv = -INFINITY;
    int bi = -1;
    if (vec) {   // V % 4 == 0 and chunk % 4 == 0: [c0, c1) is whole float4s
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
        const int q0 = c0 >> 2, q1 = c1 >> 2;
        for (int q = q0 + tid; q < q1; q += AM_THREADS * AM_U) {
            float4 v[AM_U];
#pragma unroll
            for (int u = 0; u < AM_U; u++)
                v[u] = q + u * AM_THREADS < q1 ? __ldg(x4 + q + u * AM_THREADS) : make_float4(NAN, NAN, NAN, NAN);
#pragma unroll
            for (int u = 0; u < AM_U; u++) {
                const int i = 4 * (q + u * AM_THREADS);
                db_take(v[u].x, i, bv, bi);
                db_take(v[u].y, i + 1, bv, bi);
                db_take(v[u].z, i + 2, bv, bi);
                db_take(v[u].w, i + 3, bv, bi);
            }
        }
    } else {
        for (int i = c0 + tid; i < c1; i += AM_THREADS) db_take(x[i], i, bv, bi);
    }
    db_warp_best(bv, bi);
    const int lane = tid & 31, w = tid >> 5;
    if (lane == 0) { sv[w] = bv; si[w] = bi; }
    __syncthreads();
    if (w == 0) {
        bv = lane < AM_THREADS / 32 ? sv[lane] : -INFINITY;
        bi = lane < AM_THREADS / 32 ? si[lane] : -1;
        db_warp_best(bv, bi);
        if (lane == 0) {
            if (out) out[t] = (isnan(x[0]) || bi < 0) ? 0 : bi;
            else { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
        }
    }
}
// one warp per row: the best of its splits candidates
__global__ void db_argmax_fin_kernel(const float *__restrict__ X, int T, int V, int splits,
                                     const float *__restrict__ pv, const int *__restrict__ pi,
                                     int32_t *__restrict__ out)
{
    const int t = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;   // (whole warps)
    float bv = -INFINITY;
    int bi = -1;
    for (int j = lane; j < splits; j += 32) {
        const float v = pv[(size_t)t * splits + j];
        const int i = pi[(size_t)t * splits + j];
        if (db_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    db_warp_best(bv, bi);
    if (lane == 0) out[t] = (isnan(X[(size_t)t * V]) || bi < 0) ? 0 : bi;
}

extern "C" int v41g_argmax_rows(const float *x, int T, int V, int32_t *out, v41g_stream s)
{
    if (T <= 0) return 0;
    cudaStream_t st = G_STREAM(s);
    if (V <= 0) {   // ref argmax_f(x, 0) = 0
        G_CHECK(cudaMemsetAsync(out, 0, sizeof(int32_t) * (size_t)T, st));
        return 0;
    }
    // about 4 CTAs per SM over all rows, at least AM_MIN_CHUNK elements each
    const int nsm = g_num_sms();
    int splits = (int)((4 * (int64_t)nsm + T - 1) / T);
    int64_t chunk = ((int64_t)V + splits - 1) / splits;
    if (chunk < AM_MIN_CHUNK) chunk = AM_MIN_CHUNK;
    chunk = (chunk + 3) / 4 * 4;
    splits = (int)(((int64_t)V + chunk - 1) / chunk);   // every split non-empty
    const int vec = V % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    const unsigned grid = (unsigned)((int64_t)T * splits);
    if (splits == 1) {
        db_argmax_kernel<<<grid, AM_THREADS, 0, st>>>(x, V, 1, (int)chunk, vec, NULL, NULL, out);
        G_LAUNCHED();
        return 0;
    }
    void *scratch = NULL;
    G_CHECK(g_tmp_alloc(&scratch, (sizeof(float) + sizeof(int)) * (size_t)T * splits, st));
    float *pv = (float *)scratch;
    int *pi = (int *)(pv + (size_t)T * splits);
    db_argmax_kernel<<<grid, AM_THREADS, 0, st>>>(x, V, splits, (int)chunk, vec, pv, pi, NULL);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        db_argmax_fin_kernel<<<(unsigned)(((int64_t)T * 32 + 255) / 256), 256, 0, st>>>(x, T, V, splits, pv, pi, out);
        e = cudaGetLastError();
    }
    cudaError_t f = cudaFreeAsync(scratch, st);
    G_CHECK(e);
    G_CHECK(f);
    return 0;
}

// ------------------------------------------------------------------ MoE pointer tables
// One thread per (token, choice) a = t * k + j; 64-bit offsets (e * 2I * D exceeds
// 2^31 for the full model).
__global__ void db_moe_ptrs_kernel(const int32_t *__restrict__ idx, int n, int k, int D, int I,
                                   const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *h13,
                                   const uint16_t *h, const uint16_t *y, const void **xp, const void **w13p,
                                   const void **w2p, void **h13p, const void **hp, void **yp)
{
    const int a = blockIdx.x * blockDim.x + threadIdx.x;
    if (a >= n) return;
    const size_t t = (size_t)(a / k), e = (size_t)(int64_t)idx[a], sD = (size_t)D, sI = (size_t)I;
    xp[a] = x + t * sD;
    w13p[a] = w13 + e * 2 * sI * sD;
    w2p[a] = w2 + e * sD * sI;
    hp[a] = h + (size_t)a * sI;
    h13p[a] = (void *)(h13 + (size_t)a * 2 * sI);
    yp[a] = (void *)(y + (size_t)a * sD);
}

extern "C" int v41g_moe_ptrs(const int32_t *idx, int T, int k, int D, int I, const uint16_t *x, const uint16_t *w13,
                             const uint16_t *w2, const uint16_t *h13, const uint16_t *h, const uint16_t *y,
                             const void **xp, const void **w13p, const void **w2p, void **h13p, const void **hp,
                             void **yp, v41g_stream s)
{
    if (T <= 0 || k <= 0) return 0;
    const int n = T * k;
    db_moe_ptrs_kernel<<<(unsigned)((n + 127) / 128), 128, 0, G_STREAM(s)>>>(idx, n, k, D, I, x, w13, w2, h13, h, y,
                                                                          xp, w13p, w2p, h13p, hp, yp);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ SwiGLU
// One thread per (r, i), ref expert_fwd's loop body: clamps by comparison (a NaN
// stays NaN, as there), h = (g / (1 + expf(-g))) * u, then wts[r] * h, bf16.
__global__ void db_swiglu_kernel(const uint16_t *__restrict__ h13, int n, int I, float L,
                                 const float *__restrict__ wts, uint16_t *out)
{
    const size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (q >= (size_t)n * I) return;
    const size_t r = q / (size_t)I, i = q % (size_t)I;
    const uint16_t *row = h13 + r * 2 * (size_t)I;
    float gv = g_bf2f(row[i]), uv = g_bf2f(row[(size_t)I + i]);
    if (L > 0) {
        if (uv < -L) uv = -L;
        if (uv > L) uv = L;
        if (gv > L) gv = L;
    }
    float hv = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, g_expf_ref(-gv))), uv);
    if (wts) hv = __fmul_rn(wts[r], hv);
    out[q] = g_f2bf(hv);
}

extern "C" int v41g_swiglu(const uint16_t *h13, int n, int I, float L, const float *wts, uint16_t *out,
                           v41g_stream s)
{
    const size_t nn = (size_t)(n > 0 ? n : 0) * (size_t)(I > 0 ? I : 0);
    if (!nn) return 0;
    db_swiglu_kernel<<<(unsigned)((nn + 255) / 256), 256, 0, G_STREAM(s)>>>(h13, n, I, L, wts, out);
    G_LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------ MoE combine
// Grid: (column chunks of MC_THREADS threads) x tokens. The choice order of ref moe(): a stable
// ascending sort of idx[t, 0..k) (insertion sort there); here each choice j's place is its rank
// #{j' : idx[j'] < idx[j] or (idx[j'] == idx[j] and j' < j)}, the same permutation (each CTA forms
// it for its token). Then per element: acc = 0; acc += ye[t*k + ord[r]] for r = 0..k-1; out =
// bf16(acc + sh) (sh = shared or 0). Where D % 8 == 0 and the rows are 16-byte aligned, each
// thread does 8 consecutive elements with 16-byte loads (4 expert rows in flight), otherwise one
// element. out may alias shared (each element is read before it is written by the same thread).
#define DB_COMBINE_KMAX 4096
#define MC_THREADS 128
__device__ __forceinline__ void db_add8(float (&acc)[8], uint4 v)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        acc[2 * q] = __fadd_rn(acc[2 * q], __uint_as_float(w[q] << 16));
        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __uint_as_float(w[q] & 0xffff0000u));
    }
}
__global__ void __launch_bounds__(MC_THREADS) db_moe_combine_kernel(const uint16_t *__restrict__ ye,
                                                                    const int32_t *__restrict__ idx,
                                                                    const uint16_t *shared, int k, int D, int nch,
                                                                    int vec, uint16_t *out)
{
    extern __shared__ int ord[];   // [k rounded up to a multiple of 4]
    const int t = blockIdx.x / nch, ch = blockIdx.x % nch;
    const int32_t *ix = idx + (size_t)t * k;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int32_t e = ix[j];
        int r = 0;
        for (int jj = 0; jj < k; jj++) {
            const int32_t f = ix[jj];
            r += (f < e || (f == e && jj < j)) ? 1 : 0;
        }
        ord[r] = j;
    }
    __syncthreads();
    const uint16_t *yt = ye + (size_t)t * k * D;
    if (vec) {
        const int d0 = (ch * MC_THREADS + threadIdx.x) * 8;
        if (d0 >= D) return;
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; q++) acc[q] = 0.0f;
        for (int r0 = 0; r0 < k; r0 += 4) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (r0 + u < k) v[u] = __ldg(reinterpret_cast<const uint4 *>(yt + (size_t)ord[r0 + u] * D + d0));
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (r0 + u < k) db_add8(acc, v[u]);
        }
        uint4 sv = make_uint4(0u, 0u, 0u, 0u);   // +0: acc + 0 as ref's acc + 0.0f
        if (shared) sv = *reinterpret_cast<const uint4 *>(shared + (size_t)t * D + d0);
        const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w};
        uint32_t ow[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint32_t lo = g_f2bf(__fadd_rn(acc[2 * q], __uint_as_float(sw[q] << 16)));
            const uint32_t hi = g_f2bf(__fadd_rn(acc[2 * q + 1], __uint_as_float(sw[q] & 0xffff0000u)));
            ow[q] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4 *>(out + (size_t)t * D + d0) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    } else {
        const int d = ch * MC_THREADS + threadIdx.x;
        if (d >= D) return;
        float acc = 0.0f;
        for (int r = 0; r < k; r++) acc = __fadd_rn(acc, g_bf2f(yt[(size_t)ord[r] * D + d]));
        const float sh = shared ? g_bf2f(shared[(size_t)t * D + d]) : 0.0f;
        out[(size_t)t * D + d] = g_f2bf(__fadd_rn(acc, sh));
    }
}

extern "C" int v41g_moe_combine(const uint16_t *ye, const int32_t *idx, const uint16_t *shared, int T, int k, int D,
                                uint16_t *out, v41g_stream s)
{
    if (T <= 0 || D <= 0) return 0;
    if (k < 0 || k > DB_COMBINE_KMAX) return (int)cudaErrorInvalidValue;
    // ord[] rounded up to 16 bytes: nvcc reads the tail of the r loop with one 16-byte
    // shared load (compute-sanitizer flags the bytes past k otherwise)
    const size_t smem = sizeof(int) * (((size_t)k + 3) & ~(size_t)3);
    const int vec = D % 8 == 0 && (reinterpret_cast<uintptr_t>(ye) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(out) & 15) == 0 && (reinterpret_cast<uintptr_t>(shared) & 15) == 0;
    const int per = vec ? 8 * MC_THREADS : MC_THREADS;
    const int nch = (D + per - 1) / per;
    db_moe_combine_kernel<<<(unsigned)((int64_t)T * nch), MC_THREADS, smem, G_STREAM(s)>>>(ye, idx, shared, k, D, nch,
                                                                                          vec, out);
    G_LAUNCHED();
    return 0;
}
