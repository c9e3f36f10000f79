// k_gemm.cu: dense GEMMs through cuBLAS (bf16 in, fp32 accumulate).
#include "g_internal.cuh"
#include <cublas_v2.h>

// One handle per host thread, created on first use (cuBLAS handles are not
// thread-safe to share; the engine and benchmark each run on one thread).
// Side handles (G_SIDE_STREAMS, for concurrent GEMMs on side streams: a cuBLAS
// handle's workspace must not be shared by kernels running at the same time).
static thread_local cublasHandle_t g_blas = NULL;
static thread_local cublasHandle_t g_blas_side[G_SIDE_STREAMS] = {};

cublasHandle_t v41g_blas_handle(void)
{
    if (!g_blas && cublasCreate(&g_blas) != CUBLAS_STATUS_SUCCESS) g_blas = NULL;
    return g_blas;
}

static cublasHandle_t blas_side(int i)
{
    if (!g_blas_side[i] && cublasCreate(&g_blas_side[i]) != CUBLAS_STATUS_SUCCESS) g_blas_side[i] = NULL;
    return g_blas_side[i];
}

extern "C" void v41g_gemm_release(void)
{
    if (g_blas) cublasDestroy(g_blas);
    g_blas = NULL;
    for (int i = 0; i < G_SIDE_STREAMS; i++) {
        if (g_blas_side[i]) cublasDestroy(g_blas_side[i]);
        g_blas_side[i] = NULL;
    }
}

static int gemm_on(cublasHandle_t h, const uint16_t *x, int ldx, const uint16_t *w, void *y, int ldy, int M, int N,
                   int K, int out_f32, int batch, long long sx, long long sw, long long sy, cudaStream_t s);

int g_gemm_bf16_side(int side, const uint16_t *x, const uint16_t *w, void *y, int M, int N, int K, cudaStream_t s)
{
    if (M <= 0 || N <= 0) return 0;
    cublasHandle_t h = side < 0 ? v41g_blas_handle() : blas_side(side % G_SIDE_STREAMS);
    if (!h) return (int)cudaErrorNotReady;
    return gemm_on(h, x, K, w, y, N, M, N, K, 0, 1, 0, 0, 0, s);
}

// y[M,N] (row-major) = x[M,K] . w[N,K]^T. cuBLAS is column-major, so compute
// y^T[N,M] = w . x^T: w row-major [N,K] is column-major [K,N] -> op T;
// x row-major [M,K] is column-major [K,M] -> op N; y^T column-major = y row-major.
extern "C" int v41g_gemm_bf16(const uint16_t *x, const uint16_t *w, void *y, int M, int N, int K, int out_f32,
                              int batch, long long sx, long long sw, long long sy, v41g_stream s)
{
    return v41g_gemm_bf16_ld(x, K, w, y, N, M, N, K, out_f32, batch, sx, sw, sy, s);
}

// Leading dimensions given: x rows ldx apart, y rows ldy apart (the grouped
// output projection reads o[T, G, Hd/G] group by group: ldx = H*d, sx = H*d/G).
extern "C" int v41g_gemm_bf16_ld(const uint16_t *x, int ldx, const uint16_t *w, void *y, int ldy, int M, int N,
                                 int K, int out_f32, int batch, long long sx, long long sw, long long sy,
                                 v41g_stream s)
{
    if (M <= 0 || N <= 0) return 0;
    cublasHandle_t h = v41g_blas_handle();
    if (!h) return (int)cudaErrorNotReady;
    return gemm_on(h, x, ldx, w, y, ldy, M, N, K, out_f32, batch, sx, sw, sy, G_STREAM(s));
}

static int gemm_on(cublasHandle_t h, const uint16_t *x, int ldx, const uint16_t *w, void *y, int ldy, int M, int N,
                   int K, int out_f32, int batch, long long sx, long long sw, long long sy, cudaStream_t s)
{
    cublasSetStream(h, s);
    const float alpha = 1.0f, beta = 0.0f;
    cudaDataType_t ct = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
    cublasStatus_t st;
    if (batch <= 1)
        st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, CUDA_R_16BF, K, x, CUDA_R_16BF, ldx,
                          &beta, y, ct, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    else
        st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, CUDA_R_16BF, K, sw,
                                        x, CUDA_R_16BF, ldx, sx, &beta, y, ct, ldy, sy, batch,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "v41 gpu: cublas gemm M=%d N=%d K=%d batch=%d: status %d\n", M, N, K, batch, (int)st);
        return (int)cudaErrorUnknown;
    }
    return 0;
}
