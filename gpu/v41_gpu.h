/* v41_gpu.h: the CUDA kernels of the V4.1 forward pass (SPEC.md §2-§8),
 * callable from C. Every pointer argument of a kernel entry point is a
 * DEVICE pointer unless its comment says host; bf16 tensors are passed as
 * uint16_t (raw bits), row-major, shapes in SPEC notation. Entry points
 * enqueue on `stream` (NULL = the legacy default stream) and return 0 or a
 * CUDA error code (v41g_error_string names it). No global mutable state
 * except the CUDA runtime's own (one device per process: device 0). */
#ifndef V41_GPU_H
#define V41_GPU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef void *v41g_stream;   /* a cudaStream_t */

/* ---- device and memory helpers (host side) ---- */
int v41g_device_count(void);                   /* 0 when no device / no driver */
int v41g_device_name(char *buf, size_t n);     /* "NVIDIA H200 (sm_90, 132 SMs)" */
const char *v41g_error_string(int code);
void *v41g_malloc(size_t nbytes);              /* NULL on failure */
void v41g_free(void *p);
int v41g_h2d(void *dst, const void *src, size_t n);
int v41g_d2h(void *dst, const void *src, size_t n);
int v41g_memset(void *dst, int byte, size_t n);
int v41g_sync(void);
/* Fill with deterministic pseudo-random values (benchmarks): bf16 in
 * [-amp, amp], fp32 likewise. */
int v41g_fill_bf16(uint16_t *x, size_t n, uint64_t seed, float amp, v41g_stream s);
int v41g_fill_f32(float *x, size_t n, uint64_t seed, float amp, v41g_stream s);

/* ---- RoPE frequency table (host, SPEC §4): r/2 fp32 frequencies;
 * YaRN applied when orig_seq_len > 0. ---- */
void v41g_rope_freqs(int r, double theta, int orig_seq_len, double factor,
                     double beta_fast, double beta_slow, float *out);

/* ---- small ops ---- */
/* y[rows,dim] = bf16((x*rsqrt(mean(x^2)+eps))*w), fp32 math (SPEC §2). */
int v41g_rmsnorm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int dim,
                 float eps, v41g_stream s);
/* In-place interleaved RoPE on the last r dims of each head of x[rows, heads, d]
 * (row stride = heads*d); pos[rows] int32; freqs[r/2]; inverse uses -sin. */
int v41g_rope(uint16_t *x, const int32_t *pos, const float *freqs, int rows, int heads,
              int d, int r, int inverse, v41g_stream s);
/* act_quant(x, 32) over rows of n (n % 32 == 0): q e4m3 codes [rows,n],
 * scale fp32 [rows,n/32] (powers of two), deq = q*scale as bf16 [rows,n].
 * Any of q/scale/deq may be NULL. */
int v41g_act_quant(const uint16_t *x, uint8_t *q, float *scale, uint16_t *deq,
                   int rows, int n, v41g_stream s);
/* fp4 quantize-dequantize per group of g over rows of n: scale_e4m3 = 0 for
 * e8m0 (power-of-two) scales, 1 for e4m3 scales. y may equal x. */
int v41g_fp4_qdq(const uint16_t *x, uint16_t *y, int rows, int n, int g, int scale_e4m3,
                 v41g_stream s);

/* ---- mHC (SPEC §3) ---- */
/* Mixes m = (X.fn^T)*rsqrt(mean X^2 + norm_eps) per token, then pre/post/comb
 * with the Sinkhorn iterations. X[T,h*D] bf16, fn[(2+h)h, hD], base[(2+h)h],
 * scale3[3] fp32; h in {1,2,4}, h*D % 8 == 0, X 16-byte aligned. Out: pre[T,h], post[T,h],
 * comb[T,h,h] fp32. fn is split into bf16 hi/lo (per call here) so the dots
 * run on tensor cores with fp32 accumulation (~1e-5 relative to fp32 dots). */
int v41g_hc_mixes(const uint16_t *X, const float *fn, const float *base, const float *scale3,
                  int T, int h, int D, float norm_eps, float hc_eps, int iters,
                  float *pre, float *post, float *comb, v41g_stream s);
/* The same with fn pre-split into bf16 hi/lo rows (fn2[2(2+h)h, hD], from
 * v41g_hc_split_fn, done once at weight upload; 16-byte aligned): one fused
 * pass over X (mma.sync dots against hi and lo, the sum of squares from the
 * same registers, K split over CTAs with fixed-order partial sums), then the
 * per-token finish. Bitwise repeatable. */
int v41g_hc_split_fn(const float *fn, int h, int D, uint16_t *fn2, v41g_stream s);
int v41g_hc_mixes2(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3,
                   int T, int h, int D, float norm_eps, float hc_eps, int iters,
                   float *pre, float *post, float *comb, v41g_stream s);
/* The same with caller-provided scratch (no stream-ordered allocation in the
 * call, so a CUDA graph of it holds no allocation nodes): ws 16-byte aligned,
 * at least v41g_hc_mixes2_ws_size(T, h, D) bytes (0: bad shape). */
size_t v41g_hc_mixes2_ws_size(int T, int h, int D);
int v41g_hc_mixes2_ws(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3,
                      int T, int h, int D, float norm_eps, float hc_eps, int iters,
                      float *pre, float *post, float *comb, void *ws, size_t ws_bytes, v41g_stream s);
/* y[T,D] = bf16(sum_i p[t,i] X[t,i,:]) */
int v41g_hc_pre(const uint16_t *X, const float *p, uint16_t *y, int T, int h, int D, v41g_stream s);
/* Xout[t,j,:] = bf16(post[t,j]*y[t,:] + sum_i comb[t,i,j]*X[t,i,:]); Xout may equal X. */
int v41g_hc_post(const uint16_t *y, const uint16_t *X, const float *post, const float *comb,
                 uint16_t *Xout, int T, int h, int D, v41g_stream s);

/* ---- sparse attention with sink (SPEC §4.4; DSpark §8) ----
 * Query row t (T rows, H heads, head dim d, d % 16 == 0, d <= 512) attends
 * to its key list idx[t, 0..L): entry j < n_a is a row of pool A (kv_a[row, d]),
 * j >= n_a a row of pool B; -1 = padding with zero weight. K = V (MQA).
 * Online softmax in chunks of 64 list entries from index 0, running max from
 * -1e30, fp32 denominator, bf16-rounded probabilities in the numerator, sink
 * added once with the final max (sink NULL = no sink). o[T,H,d] bf16. A row
 * with no valid key and no sink gets zeros. */
int v41g_sparse_attn(const uint16_t *q, const uint16_t *kv_a, const uint16_t *kv_b,
                     const int32_t *idx, int L, int n_a, const float *sink, float scale,
                     int T, int H, int d, uint16_t *o, v41g_stream s);

/* ---- lightning indexer (SPEC §6) ----
 * Scores of query row t against its request's keys k[kbase[t] + s, dI] for
 * s < S (scores padded with -inf beyond S): I[t,s] = bf16(sum_h bf16(bf16(w[t,h]) *
 * relu(bf16(q[t,h,:].k_s)))) (heads summed in order in fp32), -inf where s >= visible[t]. q[T,nI,dI] bf16,
 * w[T,nI] fp32 (already scaled), I[T,S] fp32 (bf16 values). dI % 16 == 0. */
int v41g_indexer_scores(const uint16_t *q, const float *w, const uint16_t *k, const int64_t *kbase,
                        const int32_t *visible, int T, int nI, int dI, int S, float *I,
                        v41g_stream s);
/* Top-k per row of I[T,S] by radix select (no full sort): the k best scores,
 * ties toward the lower position; chosen positions sorted ascending; chosen
 * positions >= visible[t] become -1 (so -1s sit at the end). out[T,k] int32.
 * tie_cut[T] (u8, may be NULL) = 1 when equal scores straddled the cut. */
int v41g_topk(const float *I, const int32_t *visible, int T, int S, int k, int32_t *out,
              uint8_t *tie_cut, v41g_stream s);

/* ---- Linears with weights in their storage formats (SPEC §2) ----
 * W[N,K] kept on the device in the checkpoint's format (K % 32 == 0):
 *   V41G_WQ_FP8: e4m3 codes (a byte each), e8m0 scales [ceil((r0+N)/32)][K/32]
 *                (one per 32x32 block; row n of W uses scale row (r0 + n) / 32, so a
 *                slice of a checkpoint tensor starting at row r0 > 0 keeps its blocks);
 *   V41G_WQ_FP4: e2m1 codes two per byte, element 2j in the LOW nibble, e8m0 scales
 *                [N][K/32] (one per row and 32 columns); r0 must be 0.
 * The codes are TILED: v41g_wq_tile turns the checkpoint's row-major codes ([N][K]
 * bytes fp8, [N][K/2] fp4) into tiles of 128 rows x 64 columns, each tile one
 * contiguous block (row r of a tile at r*64 bytes fp8, r*32 fp4), the tiles of a
 * 128-row band consecutive along K, zero-padded past N and K
 * (v41g_wq_tiled_bytes bytes): the GEMM then streams contiguous blocks. The scales
 * keep the checkpoint layout.
 * Value = code * 2^(e - 127), dequantized to bf16 inside the kernel (exact: an
 * e4m3 or e2m1 code times a power of two fits bf16). Codes must not be e4m3 NaN
 * (0x7F/0xFF); fp8 scales must lie in 2^-117..2^7 (e in [10, 134]) and fp4 scales in
 * 2^-125..2^127 (e in [2, 254]), where every dequantized value is a normal bf16
 * (the engine checks this at upload and keeps other weights as bf16). Grouped calls
 * (MoE experts): group g's tiled codes start at w + g*w_stride bytes and its scales
 * at s + g*s_stride. w, w_stride and x must be 16-byte aligned (cp.async). */
enum { V41G_WQ_FP8 = 1, V41G_WQ_FP4 = 2 };
size_t v41g_wq_tiled_bytes(int fmt, int N, int K);   /* 0 for a bad format or shape */
/* codes (device, row-major checkpoint layout, 16-byte aligned) -> tiled (device) */
int v41g_wq_tile(int fmt, int N, int K, const uint8_t *codes, uint8_t *tiled, v41g_stream s);
typedef struct v41g_wq {
    int fmt;                       /* V41G_WQ_FP8 or V41G_WQ_FP4 */
    int N, K, r0;
    const uint8_t *w, *s;          /* tiled codes, scales (device) */
    long long w_stride, s_stride;  /* bytes between groups (grouped calls only) */
} v41g_wq;
/* y[M,N] = x[M,K] . deq(W)^T: x bf16 (for an emulate-mode Linear the caller has
 * applied act_quant already), fp32 accumulation (order fixed by the shapes and
 * the workspace size: bitwise repeatable), y bf16 (out_f32 = 0) or fp32.
 * Tensor cores (mma.sync bf16) with the weights dequantized in registers; small
 * M splits K across CTAs into ws (fp32 partials, summed in a fixed order by a
 * second kernel). ws may be NULL or smaller than v41g_wq_ws_bytes: the call
 * then splits less (never fails for lack of it). */
size_t v41g_wq_ws_bytes(const v41g_wq *W, int M);
int v41g_wq_gemm(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32, void *ws, size_t ws_bytes,
                 v41g_stream s);
/* A packed Linear as the engines run it (the hybrid path, the MoE's shared expert, the
 * benchmark's layer): from M = 256 rows on, unless V41_WQ_F8MMA sends W to the fp8 MMA path,
 * W dequantized into ws (bf16, 2 N K bytes) and the GEMM through cuBLAS (fp32 accumulate);
 * below, v41g_wq_gemm with ws as its workspace. v41g_wq_linear_ws_bytes: the ws it wants; the
 * dequantize path refuses less (cudaErrorInvalidValue), the other splits less. */
size_t v41g_wq_linear_ws_bytes(const v41g_wq *W, int M);
int v41g_wq_linear(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32, void *ws, size_t ws_bytes,
                   v41g_stream s);
/* Grouped: rows p of the sorted problem with off[g] <= p < off[g+1] (off: device
 * int32 [G+1], off[0] = 0, off[G] = M_total; the counts may live only on the
 * device) compute y[p, :] = x[xrow[p], :] . deq(W_g)^T (xrow: device int32
 * [M_total], NULL = identity). y[M_total, N]. */
int v41g_wq_gemm_grouped(const v41g_wq *W, int G, const int32_t *off, const int32_t *xrow, const uint16_t *x,
                         int M_total, void *y, int out_f32, v41g_stream s);
/* Dequantize group g of W to bf16 out[N][K] (16-byte aligned; large-M callers then use cuBLAS). */
int v41g_wq_dequant(const v41g_wq *W, int g, uint16_t *out, v41g_stream s);
/* fp8 x fp8 tensor-core path (gpu/k_wq_f8.cu, sm_90a; any M, slower than v41g_wq_gemm and the
 * dequantize + cuBLAS path on the H200: a numerics mode, not a fast path): y[M,N] of an fp8 Linear from
 * the input's act_quant codes and scales as v41g_act_quant_f8 writes them (codes [M][K], each
 * 32-column block in the GEMM's column order; fp32 scales [K/32][ldm], ldm = rows rounded up to
 * a multiple of 4). One fp8 MMA per 32-column scale block, promoted to fp32 block after block:
 * the SPEC's sum, except that the tensor cores add the 32 products of a block with a
 * reduced-precision accumulator (see k_wq_f8.cu for the bound). v41g_wq_f8_ok: W is fp8, N even,
 * K % 64 == 0, r0 % 32 == 0, and the device runs the sm_90a build. Dense calls only. */
int v41g_wq_f8_ok(const v41g_wq *W);
/* V41_WQ_F8MMA=1 (read at every call) and v41g_wq_f8_ok(W): v41g_wq_gemm runs W's dense calls
 * through this path (v41g_wq_ws_bytes then includes room for the re-quantized input; a call
 * given less workspace runs the bf16 kernels), and the engines send every such Linear there
 * (the hybrid path too for M >= V41G_WQ_DEQUANT_ROWS, instead of dequantize + cuBLAS). */
int v41g_wq_f8_active(const v41g_wq *W);
int v41g_act_quant_f8(const uint16_t *x, int rows, int K, uint8_t *x8, float *xs, int ldm, v41g_stream s);
int v41g_wq_gemm_f8(const v41g_wq *W, const uint8_t *x8, const float *xs, int ldm, int M, void *y, int out_f32,
                    v41g_stream s);

/* ---- MoE (SPEC §8) ----
 * Gate: scores from fp32 logits[T,E]: sqrt(softplus(l/temp)) (score_func 0),
 * softmax (1) or sigmoid (2); top-k of s+bias (bias may be NULL; ties to the
 * lower expert id); weights s[chosen] (normalised when norm && k>1) * route_scale.
 * idx[T,k] int32 ascending by choice rank, wts[T,k] fp32. */
int v41g_moe_route(const float *logits, const float *bias, int T, int E, int k, int score_func,
                   float temp, int norm, float route_scale, int32_t *idx, float *wts, v41g_stream s);

/* Grouped expert FFN over bf16 weights (w13/w2: fp4 experts dequantized on upload)
 * or over weights in their storage format (q13/q2, below):
 * w13[E, 2*I, D] (w1 rows then w3 rows), w2[E, D, I]. x[T,D] bf16 is the FFN
 * input; out[T,D] bf16 = bf16(sum_j expert_{idx[t,j]}(x_t) in expert-id order)
 * where each expert output is bf16 and h = bf16(silu(min(g,L))*clamp(u,+-L)*w)
 * (L = 0: no clamp). Tokens are sorted by expert (counting sort on the device)
 * and each expert's rows run as one cuBLAS GEMM. The shared expert, if
 * w13s != NULL, is added after the routed ones. ws: workspace from
 * v41g_moe_ws_size. */
typedef struct v41g_moe {
    int T, D, I, E, k;
    float limit;
    const uint16_t *w13, *w2;      /* routed experts */
    const uint16_t *w13s, *w2s;    /* shared expert or NULL */
    /* Weights in their storage formats (v41g_wq) instead: when q13 is set the
     * routed experts run as two grouped v41g_wq_gemm_grouped calls (group =
     * expert, N = 2I then D) with no host synchronisation (graph-capturable),
     * and w13/w2 are ignored; q13s/q2s likewise replace w13s/w2s (with q13
     * set, a shared expert must be given as q13s/q2s: bf16 w13s is refused).
     * From T = V41G_WQ_DEQUANT_ROWS (256) tokens on, the shared expert's two
     * Linears run as the engines' dense ones do there: q13s/q2s dequantized
     * into the workspace (bf16, 2 N K bytes of the larger one), then cuBLAS
     * (unless V41_WQ_F8MMA sends them to the fp8 MMA path). */
    const v41g_wq *q13, *q2, *q13s, *q2s;
} v41g_moe;
size_t v41g_moe_ws_size(const v41g_moe *m);
int v41g_moe_ffn(const v41g_moe *m, const uint16_t *x, const int32_t *idx, const float *wts,
                 void *ws, uint16_t *out, v41g_stream s);

/* ---- dense GEMM through cuBLAS: y[M,N] = x[M,K] . w[N,K]^T, bf16 in, fp32
 * accumulate, bf16 out (out_f32 != 0: fp32 out). batch > 1: strided batches,
 * element strides sx, sw, sy between batches. fp8 checkpoint weights are
 * dequantized to bf16 on upload (exact: e4m3 x e8m0 fits bf16). ---- */
int v41g_gemm_bf16(const uint16_t *x, const uint16_t *w, void *y, int M, int N, int K,
                   int out_f32, int batch, long long sx, long long sw, long long sy,
                   v41g_stream s);
/* The same with row strides: x rows ldx elements apart, y rows ldy apart. */
int v41g_gemm_bf16_ld(const uint16_t *x, int ldx, const uint16_t *w, void *y, int ldy, int M, int N, int K,
                      int out_f32, int batch, long long sx, long long sw, long long sy, v41g_stream s);
/* The cuBLAS handle is per thread and created on first use. */
void v41g_gemm_release(void);

/* ---- benchmark: `v41 bench gpu [--json OUT] [--quick]` ---- */
int v41g_bench_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif
