// g_internal.cuh: helpers shared by the kernel files (not installed).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <utility>
#include "v41_gpu.h"
#include "v41_env.h"

// A switch read from the environment (at every call; ref/v41_env.h lists them): 1 on, 0, unset or
// empty off; any other value is reported and exits with status 2.
static inline bool g_env_flag(const char *name) { return v41_env_flag(name, 0) != 0; }

// Return the CUDA error of the last launch (or call) from an entry point.
#define G_CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "v41 gpu: %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
    return (int)e_; } } while (0)
#define G_LAUNCHED() G_CHECK(cudaGetLastError())
#define G_STREAM(s) ((cudaStream_t)(s))

// Attributes of the current device, queried once per device (g_common.cu): the SM count (132 when
// it cannot be read), the compute capability's major number (0 when it cannot be read) and the
// opt-in shared memory per block (48 KiB when it cannot be read).
int g_num_sms(void);
int g_cc_major(void);
int g_smem_optin(void);

// Programmatic dependent launch (compute 9.0+). A kernel launched with g_launch_pdl may start while
// the kernel before it in the stream is still running (from the moment every CTA of that kernel has
// run g_pdl_trigger or exited); g_pdl_wait then blocks until that kernel has completed and its
// memory is visible, so everything after the wait sees the earlier kernel's results. Without the
// launch attribute (older devices, or a plain launch) the wait returns at once and the trigger does
// nothing. This hides the launch and ramp of a short second kernel (a reduction of partials)
// behind the end of the first.
__device__ __forceinline__ void g_pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void g_pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n");   /* a scheduling hint: orders no memory */
#endif
}
bool g_pdl_ok(void);   /* compute 9.0+ and V41_NO_PDL unset (g_common.cu) */

// A launch through cudaLaunchKernelEx with one launch attribute, or none (at == NULL: a plain launch).
template <typename... KA, typename... A>
static inline cudaError_t g_launch_ex(void (*kern)(KA...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                      const cudaLaunchAttribute *at, A &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = const_cast<cudaLaunchAttribute *>(at);
    cfg.numAttrs = at ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, std::forward<A>(args)...);
}
// the attribute of a thread-block cluster launch of shape dim (compute 9.0+)
static inline cudaLaunchAttribute g_attr_cluster(dim3 dim)
{
    cudaLaunchAttribute a = {};
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = dim.x;
    a.val.clusterDim.y = dim.y;
    a.val.clusterDim.z = dim.z;
    return a;
}
// a programmatic dependent launch where g_pdl_ok(), else a plain one
template <typename... KA, typename... A>
static inline cudaError_t g_launch_pdl(void (*kern)(KA...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                       A &&...args)
{
    cudaLaunchAttribute a = {};
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
    return g_launch_ex(kern, grid, block, smem, st, g_pdl_ok() ? &a : NULL, std::forward<A>(args)...);
}

// Concurrent GEMMs (k_gemm.cu): y[M,N] = x[M,K].w[N,K]^T, bf16 out, on stream s with
// side handle `side` (0..G_SIDE_STREAMS-1; -1 = the thread's main handle).
#define G_SIDE_STREAMS 4
int g_gemm_bf16_side(int side, const uint16_t *x, const uint16_t *w, void *y, int M, int N, int K, cudaStream_t s);

// Side streams of the calling host thread (created on first use, then reused): work forked from
// the caller's stream with fork() runs on them concurrently and is joined back with join(), both
// by events, so it stays ordered with the caller's stream (also inside a stream capture, where a
// fork left open would invalidate the capture: join even after a failed launch). n <= G_SIDE_STREAMS;
// ok() is false when they could not be created (the caller then runs the work on its own stream).
struct g_side {
    int n;
    cudaStream_t s[G_SIDE_STREAMS] = {};
    cudaEvent_t ev[G_SIDE_STREAMS + 1] = {};   /* ev[i]: join of s[i]; ev[n]: the fork */
    explicit g_side(int n_) : n(n_ < G_SIDE_STREAMS ? n_ : G_SIDE_STREAMS) {
        static thread_local cudaStream_t ts[G_SIDE_STREAMS] = {};
        static thread_local cudaEvent_t te[G_SIDE_STREAMS + 1] = {};
        for (int i = 0; i < n; i++) {
            if (!ts[i]) cudaStreamCreateWithFlags(&ts[i], cudaStreamNonBlocking);
            s[i] = ts[i];
        }
        for (int i = 0; i <= G_SIDE_STREAMS; i++) {
            if (!te[i]) cudaEventCreateWithFlags(&te[i], cudaEventDisableTiming);
        }
        for (int i = 0; i < n; i++) ev[i] = te[i];
        ev[n] = te[G_SIDE_STREAMS];
        cudaGetLastError();   // a failed creation leaves NULL: ok() says so
    }
    bool ok() const {
        for (int i = 0; i < n; i++) if (!s[i] || !ev[i]) return false;
        return ev[n] != NULL;
    }
    cudaError_t fork(cudaStream_t st) {
        cudaError_t e = cudaEventRecord(ev[n], st);
        for (int i = 0; i < n && e == cudaSuccess; i++) e = cudaStreamWaitEvent(s[i], ev[n], 0);
        return e;
    }
    cudaError_t join(cudaStream_t st) {
        cudaError_t e = cudaSuccess;
        for (int i = 0; i < n; i++) {
            cudaError_t a = cudaEventRecord(ev[i], s[i]);
            if (a == cudaSuccess) a = cudaStreamWaitEvent(st, ev[i], 0);
            if (e == cudaSuccess) e = a;
        }
        return e;
    }
};

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
// act_quant(x, 32) (SPEC §2) of one 32-column block: the UE8M0 scale's exponent from the block's
// amax (scale = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))), and an element's e4m3 code given
// inv = 2^-exponent (e4m3_rne(clamp(x / scale, +-448)); x * 2^-e is x / 2^e exactly). Shared by
// v41g_act_quant (k_small.cu) and v41g_act_quant_f8 (k_wq_f8.cu), so their codes and scales agree.
__device__ __forceinline__ int g_aq_exp(float amax) { return g_ceil_log2(fmaxf(amax, 1e-4f) * (1.0f / 448.0f)); }
__device__ __forceinline__ uint8_t g_aq_code(float x, float inv) { return g_f2e4m3(fminf(fmaxf(x * inv, -448.0f), 448.0f)); }
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

// ---- tensor-core and async-copy primitives (k_attn.cu, k_wq.cu)
// 16-byte global -> shared copy that bypasses registers (cp.async, L2 only);
// src_bytes = 0 zero-fills the destination (padding rows).
__device__ __forceinline__ void g_cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void g_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void g_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// pure register op: not volatile, so the compiler may schedule it freely
__device__ __forceinline__ void g_mma_bf16(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// exp and log1p of the CPU reference's libm (glibc's expf/log1pf are within ~0.5 ulp):
// evaluated in double and rounded once, they equal glibc's result but in rare double-rounding
// cases, where CUDA's expf may be 2 ulp away. Used where a decision (routing, Sinkhorn
// weights, gates) must follow the reference as closely as fp32 allows.
__device__ __forceinline__ float g_expf_ref(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float g_log1pf_ref(float x) { return (float)log1p((double)x); }

// ref's sigmoid: 1 / (1 + expf(-x)) (v41_sigmoidf)
__device__ __forceinline__ float g_sigmoid_ref(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, g_expf_ref(-x))); }

// One token's mHC split + Sinkhorn (SPEC section 3; ref v41_hc_split_sinkhorn with rows_last = false),
// operation for operation: pre = sigmoid(m*s0 + b) + eps, post = 2 sigmoid(m*s1 + b), then the comb
// softmax per row (max by '>' from -inf, expf, sum in j order, c / sum + eps), one column
// normalisation, then iters - 1 times (rows, columns) (with iters <= 0 the single column
// normalisation, as in ref). Each sum runs sequentially in index order from +0 and every element is
// divided by (sum + eps).
// Called by the H*H lanes e = 0..H*H-1 of a shuffle segment of width H*H (all 32 lanes of the warp
// call it: the shuffles use the full mask); lane e = i*H + j holds c[i][j], and every lane of row i
// (column j) forms the row (column) sum itself from the shuffled entries in the same order, so every
// entry sees the same bits as a sequential loop. m(i) returns the token's mix i (0 <= i < (2+H)H);
// pre / post are written by lanes e < 2H (H = 1: the one lane does both); nothing is written by a
// lane with live == false (it still takes part in the shuffles).
template <int H, typename MF>
__device__ __forceinline__ void g_sinkhorn_token(MF m, int e, bool live, int t, const float *__restrict__ sc,
                                                 const float *__restrict__ base, int iters, float eps, float *pre,
                                                 float *post, float *comb)
{
    constexpr int HH = H * H;
    const int i = e / H, j = e % H;
    const float s0 = sc[0], s1 = sc[1], s2 = sc[2];
    for (int q = e; q < 2 * H; q += HH) {
        if (q < H) {
            const float v = __fadd_rn(g_sigmoid_ref(__fadd_rn(__fmul_rn(m(q), s0), base[q])), eps);
            if (live) pre[(size_t)t * H + q] = v;
        } else {
            const int k = q - H;
            const float v = __fmul_rn(2.0f, g_sigmoid_ref(__fadd_rn(__fmul_rn(m(H + k), s1), base[H + k])));
            if (live) post[(size_t)t * H + k] = v;
        }
    }
    float c = __fadd_rn(__fmul_rn(m(2 * H + e), s2), base[2 * H + e]);
    // row softmax
    float mx = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < H; jj++) {
        const float v = __shfl_sync(0xffffffffu, c, i * H + jj, HH);
        mx = v > mx ? v : mx;
    }
    c = g_expf_ref(__fsub_rn(c, mx));
    float sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < H; jj++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, i * H + jj, HH));
    c = __fadd_rn(__fdiv_rn(c, sum), eps);
    // column normalisation, then iters - 1 times (rows, columns)
    sum = 0.0f;
#pragma unroll
    for (int ii = 0; ii < H; ii++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, ii * H + j, HH));
    c = __fdiv_rn(c, __fadd_rn(sum, eps));
    for (int it = 0; it < iters - 1; it++) {
        sum = 0.0f;
#pragma unroll
        for (int jj = 0; jj < H; jj++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, i * H + jj, HH));
        c = __fdiv_rn(c, __fadd_rn(sum, eps));
        sum = 0.0f;
#pragma unroll
        for (int ii = 0; ii < H; ii++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, ii * H + j, HH));
        c = __fdiv_rn(c, __fadd_rn(sum, eps));
    }
    if (live) comb[(size_t)t * HH + e] = c;
}

// Warp-wide sum by xor butterfly (float, or double where a statistic is summed in double).
template <typename T> __device__ __forceinline__ T g_warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Rows from which the GPU engine runs an fp8/fp4 Linear as dequantize-to-bf16 + cuBLAS instead of
// v41g_wq_gemm (gh_wq_linear in engine.cu; the benchmark times the same path).
#define V41G_WQ_DEQUANT_ROWS 256
// Inclusive prefix sum over the warp's lanes (lane i gets v_0 + ... + v_i; integer types: exact).
template <typename T> __device__ __forceinline__ T g_warp_scan_incl(T v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
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

// Column of position p (0..63) of an fp8 weight tile row in k_wq.cu's tiled layout (the mma
// A-fragment order: p = 16c + 4s + j holds column 16s + 2c + (j & 1) + 8 (j >> 1)). k_wq_f8.cu
// orders each activation block the same way.
__host__ __device__ constexpr int wq_col_of(int p) { return 16 * ((p >> 2) & 3) + 2 * (p >> 4) + (p & 1) + 8 * ((p >> 1) & 1); }
