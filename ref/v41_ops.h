/* v41_ops.h: the op kernels of the CPU reference engine (SPEC.md §2-§8).
 *
 * Conventions: activations are fp32 arrays; in emulate mode every tensor the
 * official code keeps in bf16 holds bf16-representable values (rounded with
 * v41_bf16r at the official rounding points). `emu` selects emulate (true) or
 * fp32 (false) arithmetic. Row-major everywhere. Every kernel is per-row
 * deterministic: a row's result never depends on how many other rows share the
 * call or on the thread count (GEMMs run on fixed row tiles, see v41_linear). */
#ifndef V41_OPS_H
#define V41_OPS_H

#include <string.h>
#include <math.h>
#include "v41_weights.h"
#include "v41_quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* bf16 round-to-nearest-even (same bits as v41_round_bf16; inline for speed). */
static inline float v41_bf16r(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static inline void v41_bf16r_n(float *x, size_t n, bool emu)
{
    if (emu)
        for (size_t i = 0; i < n; i++) x[i] = v41_bf16r(x[i]);
}

/* Dot product in a fixed order: 8 interleaved fp32 partial sums (lane j takes
 * i = j mod 8), combined pairwise, then the tail. Vectorizable without
 * reassociation; the same order for every call, so deterministic. */
static inline float v41_dot(const float *restrict a, const float *restrict b, int n)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[h] = v41_dot(Q + h*ldq, k, n) for h < nq, bitwise (AVX2 when it reproduces v41_dot). */
void v41_dot_rows(const float *Q, int nq, int64_t ldq, const float *k, int n, float *out);

/* Lightning-indexer scores of one request's rows (SPEC §6). Row i < n: query q[i, nI, dI],
 * head weights w[i, nI] (already scaled, bf16-rounded in emulate mode); key s of the request
 * is keys + s*dI for s < cap (a zero key beyond). scores[i*ld + s] for s < Lc:
 * -inf when s >= Lt[i], else the sum over heads in order of round(relu(round(q_h.k_s)) * w_h),
 * rounded (round = bf16 in emulate mode, identity in fp32; relu = false drops the ReLU,
 * the `indexer-relu-dropped` fault). The GPU engine replaces it with one kernel call. */
void v41_indexer_scores_rows(const float *q, const float *w, int n, int nI, int dI, const float *keys, int cap,
                             int Lc, const int *Lt, bool relu, bool emu, float *scores, int64_t ld);

/* The indexer's top-k of n rows (SPEC §6): row i of scores (row stride ld, L positions): the k
 * best (v41_topk_desc: ties to the lower position), sorted ascending, positions >= Lt[i] set
 * to -1, slots k..width-1 set to -1; amb[i] = 1 when a finite tie straddles the cut.
 * out rows are ldo apart. The GPU engine replaces it with one kernel call. */
void v41_indexer_topk_rows(const float *scores, int64_t ld, int n, int L, int k, const int *Lt, int32_t *out,
                           int64_t ldo, int width, uint8_t *amb);

/* ---- GEMM ---------------------------------------------------------------- */

/* How a Linear computes (SPEC §2):
 *  Q    fp8 / fp4 weight: act_quant(x, 32) then per-32-K-block fp32 accumulation, bf16 out.
 *  BF16 bf16 GEMM (no act_quant), fp32 accumulation, bf16 out.
 *  F32  fp32 GEMM, fp32 out (weights upcast exactly). */
typedef enum { V41_LIN_Q = 0, V41_LIN_BF16, V41_LIN_F32 } v41_lin_kind;

typedef struct v41_lin {
    const v41_tensor *w, *s;  /* weight [N, K] (F4: K fp4 elements), scale or NULL */
    int64_t N, K;
    v41_lin_kind kind;
    int64_t row0;             /* first weight row used (grouped views, e.g. wo_a groups) */
} v41_lin;

/* Row tile of every GEMM: sgemm is always called with M = V41_GEMM_MT (the last tile
 * padded with zero rows), so the per-row reduction order never depends on M. */
#define V41_GEMM_MT 16
/* Output-column chunk: the weight is dequantized V41_GEMM_NC rows at a time (bounded scratch). */
#define V41_GEMM_NC 128

/* y[M, N] = x[M, K] . W^T. emu=false: fp32 mode (no activation quantization,
 * one fp32 GEMM over all of K, fp32 output). Threaded over column chunks. */
int v41_linear(const v41_lin *L, const float *x, int64_t M, float *y, bool emu, v41_err *err);
/* Columns per sgemm call: V41_GEMM_MT when the BLAS passed the column-invariance
 * probe (run once per process), else 1. */
int v41_gemm_tile_cols(void);
/* Column-tile mode chosen by the probe: 1 = V41_GEMM_MT columns per sgemm call, 0 = one column per call. */
int v41_gemm_tile_mode(void);
/* OpenBLAS: one thread per sgemm call (the engine threads over chunks with OpenMP). */
void v41_blas_single_thread(void);
/* Same with an explicit input row stride and output row stride. */
int v41_linear_ld(const v41_lin *L, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                  bool emu, v41_err *err);
/* Bare fixed-tile sgemm: C[M,N] = A[M,K] . B[N,K]^T (+ C when accumulate). Used by tests/bench. */
void v41_sgemm_tiled(const float *A, int64_t lda, int64_t M, const float *B, int64_t ldb, int64_t N,
                     int64_t K, float *C, int64_t ldc, bool accumulate);
/* Benchmark counters (off unless enabled; kept per calling thread): thread-seconds
 * inside sgemm, executed GEMM flops (padded tiles included), wall seconds inside
 * v41_linear (dequantization + GEMM + output rounding). */
double v41_gemm_seconds(bool reset);
void v41_gemm_count_enable(bool on);
void v41_gemm_stats(double *sgemm_thread_s, double *flops, double *linear_wall_s, bool reset);
/* Thread-seconds spent dequantizing weight chunks inside v41_linear (same counters' switch). */
void v41_gemm_dequant_stats(double *dequant_thread_s, bool reset);

/* ---- norms, RoPE ---------------------------------------------------------- */

/* RMSNorm over n: y = bf16((x * rsqrt(mean(x^2) + eps)) * w). x may alias y. */
void v41_rmsnorm(const float *x, const float *w, int64_t n, double eps, float *y, bool emu);
/* rsqrt(mean(x^2) + eps) in fp32 (squares rounded to fp32, summed in double). */
float v41_rms_rsqrt(const float *x, int64_t n, double eps);
/* The Engram gate of one stream row (SPEC §8): rstd = rms_rsqrt(h) * rms_rsqrt(key);
 * dot = (float)(sum in double of (h_i * w_i) * key_i) * rstd * D^-0.5;
 * g = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)). The row then becomes h + g * value. */
float v41_engram_gate(const float *h, const float *key, const float *w, int64_t D, double eps);

typedef struct v41_rope {
    int r;          /* rope dims (even) */
    float *freq;    /* [r/2] fp32 frequencies */
} v41_rope;
/* SPEC §4 table: base theta, YaRN when original_seq_len > 0. */
int v41_rope_init(v41_rope *rp, int r, double theta, int original_seq_len, double factor,
                  double beta_fast, double beta_slow);
void v41_rope_free(v41_rope *rp);
/* Rotate the r dims at x (interleaved pairs) at position pos; inverse uses -sin.
 * interleaved=false rotates halves (fault injection). Rounds to bf16 when emu. */
void v41_rope_apply(const v41_rope *rp, float *x, int64_t pos, bool inverse, bool interleaved, bool emu);

/* ---- sparse attention with sink (SPEC §4.4) ------------------------------- */

/* One query row, all heads. q [H, d]; kp[j] = the key row (d floats, K = V) of list
 * entry j, NULL for a -1 entry (skipped: enters neither sum). sink [H] (NULL = no sink).
 * scale = fp32(d^-1/2).
 * emu: chunks of 64 from index 0, running max from -1e30, fp32 denominator,
 * bf16 probabilities in the numerator, sink with the final max, bf16 out. */
void v41_sparse_attn_row(const float *q, int H, int d, const float *const *kp, int n,
                         const float *sink, float scale, float *out, bool emu);

/* ---- hyper-connections (SPEC §3) ------------------------------------------ */

/* pre[h], post[h], comb[h*h] from mixes[(2+h)*h]. rows_last: fault injection. */
void v41_hc_split_sinkhorn(const float *mixes, const float *scale3, const float *base, int hc, int iters,
                           float eps, float *pre, float *post, float *comb, bool rows_last);
/* y[D] = bf16(sum_i pre[i] * X[i][D]) */
void v41_hc_pre(const float *X, const float *pre, int hc, int64_t D, float *y, bool emu);
/* Xout[j][D] = bf16(post[j]*y + sum_i comb[i][j] X[i]) ; Xout may not alias X */
void v41_hc_post(const float *y, const float *X, const float *post, const float *comb, int hc, int64_t D,
                 float *Xout, bool emu);

/* ---- top-k ----------------------------------------------------------------- */

/* Indices of the k largest of s[0..n) (descending value; ties: lower index first).
 * Returns 1 when the k-th value ties with an unselected value of the same value
 * that is finite (ambiguous cut), else 0. k <= n. */
int v41_topk_desc(const float *s, int n, int k, int32_t *out);

/* ---- activations ------------------------------------------------------------ */
static inline float v41_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
float v41_softplusf(float x); /* torch: x > 20 ? x : log1p(exp(x)) */

#ifdef __cplusplus
}
#endif
#endif
