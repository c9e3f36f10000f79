// g_internal.cuh: helpers shared by the kernel files (not installed).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <stdio.h>
#include "v41_gpu.h"

// Return the CUDA error of the last launch (or call) from an entry point.
#define G_CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "v41 gpu: %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
    return (int)e_; } } while (0)
#define G_LAUNCHED() G_CHECK(cudaGetLastError())
#define G_STREAM(s) ((cudaStream_t)(s))

// Concurrent GEMMs (k_gemm.cu): y[M,N] = x[M,K].w[N,K]^T, bf16 out, on stream s with
// side handle `side` (0..G_SIDE_STREAMS-1; -1 = the thread's main handle).
#define G_SIDE_STREAMS 4
int g_gemm_bf16_side(int side, const uint16_t *x, const uint16_t *w, void *y, int M, int N, int K, cudaStream_t s);

__device__ __forceinline__ float g_bf2f(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
// fp32 -> bf16 round to nearest even; NaN stays NaN (SPEC §2).
__device__ __forceinline__ uint16_t g_f2bf(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ float g_rbf(float f) { return g_bf2f(g_f2bf(f)); }

// 2^e as fp32 for e in [-126, 127]
__device__ __forceinline__ float g_pow2(int e) { return __uint_as_float((uint32_t)(e + 127) << 23); }
// UE8M0 exponent of t > 0 normal: ceil(log2 t) (fp32 exponent, +1 if mantissa != 0).
__device__ __forceinline__ int g_ceil_log2(float t) {
    uint32_t b = __float_as_uint(t);
    int e = (int)((b >> 23) & 0xff) - 127;
    return e + ((b & 0x7fffff) ? 1 : 0);
}
// e4m3 (fn) round to nearest even, saturating to +-448.
__device__ __forceinline__ uint8_t g_f2e4m3(float f) {
    return (uint8_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float g_e4m32f(uint8_t q) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, __NV_E4M3);
    return __half2float(__half(h));
}
// Nearest fp4 (e2m1) magnitude of v >= 0, clamped to 6, ties to the even code.
__device__ __forceinline__ float g_fp4_mag(float v) {
    if (v <= 0.25f) return 0.0f;
    if (v < 0.75f) return 0.5f;
    if (v <= 1.25f) return 1.0f;
    if (v < 1.75f) return 1.5f;
    if (v <= 2.5f) return 2.0f;
    if (v < 3.5f) return 3.0f;
    if (v <= 5.0f) return 4.0f;
    return 6.0f;
}

// exp and log1p of the CPU reference's libm (glibc's expf/log1pf are within ~0.5 ulp):
// evaluated in double and rounded once, they equal glibc's result but in rare double-rounding
// cases, where CUDA's expf may be 2 ulp away. Used where a decision (routing, Sinkhorn
// weights, gates) must follow the reference as closely as fp32 allows.
__device__ __forceinline__ float g_expf_ref(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float g_log1pf_ref(float x) { return (float)log1p((double)x); }

// Warp-wide sum by xor butterfly (float, or double where a statistic is summed in double).
template <typename T> __device__ __forceinline__ T g_warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float g_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide sum (blockDim.x multiple of 32, <= 1024); every thread gets the result. The
// leading __syncthreads makes consecutive calls on the same sh safe.
template <typename T> __device__ __forceinline__ T g_block_sum(T v, T *sh /*[32]*/) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = g_warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    T r = lane < nw ? sh[lane] : T(0);
    return g_warp_sum(r);
}

// Stream-ordered scratch allocation. The device's default pool keeps freed
// memory (release threshold = max) so repeated calls do not re-map memory at
// every synchronisation (that would cost tens of microseconds per call).
static inline cudaError_t g_tmp_alloc(void **p, size_t n, cudaStream_t st)
{
    cudaMemPool_t pool;
    int dev = 0;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(st, &cs);
    // (pool attributes may not be changed while a graph is being captured)
    if (cs == cudaStreamCaptureStatusNone && cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
        uint64_t thr = UINT64_MAX;
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
    }
    return cudaMallocAsync(p, n, st);
}
