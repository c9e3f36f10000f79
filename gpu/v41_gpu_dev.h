/* v41_gpu_dev.h: the kernels of the device-resident decode step of the GPU
 * engine (gpu/engine_dev.cu; README.md, section 'GPU kernels', "Device-resident
 * decode"). Same conventions as v41_gpu.h: every pointer is a DEVICE pointer,
 * bf16 tensors are uint16_t bits, row-major; each entry point enqueues on
 * `stream` and returns 0 or a CUDA error code. Every kernel reads its per-step
 * values (positions, slots, lengths) from device memory, never from launch
 * arguments, so one CUDA graph captured for a batch size replays for every
 * decode step of that batch size.
 *
 * Cache layout (one pool per cache kind, all layers and request slots):
 *   window KV  win[l][slot][pos][d]   bf16, pos < S (the whole history; the ring of
 *                                     SPEC §4 is a view of it: slot = pos mod W)
 *   compressed ckv[..][slot][j][d]    bf16, j < S/m + 1
 *   index keys ik[..][slot][j][dI]    bf16, j < S/m + 1
 *   history    kvh/sch[..][slot][pos][d]  fp32 (compress ratio m > 1 only)
 * A row of a pool is addressed by its int64 row number (base offset of the layer
 * + slot * rows per slot + position). */
#ifndef V41_GPU_DEV_H
#define V41_GPU_DEV_H

#include <stddef.h>
#include <stdint.h>
#include "v41_gpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element-wise conversions ---- */
/* y[n] = bf16 bits of x[n] (round to nearest even) */
int v41g_f32_to_bf16(const float *x, uint16_t *y, size_t n, v41g_stream s);
/* y[n] = x[n] as fp32 */
int v41g_bf16_to_f32(const uint16_t *x, float *y, size_t n, v41g_stream s);

/* y[n] = fp32 value of bf16(x[n] * scale) (x fp32; the indexer head weights). */
int v41g_scale_bf16r(const float *x, float scale, float *y, size_t n, v41g_stream s);

/* ---- row movement ---- */
/* dst[rows[i], :] = src[i, :] for i < n with rows[i] >= 0 (rows[i] < 0: skipped);
 * width elements per row, src rows ld_src apart, dst rows ld_dst apart. 16-bit
 * elements (bf16) / 32-bit elements (fp32). */
int v41g_scatter_rows16(const uint16_t *src, int64_t ld_src, const int64_t *rows, int n, int width,
                        uint16_t *dst, int64_t ld_dst, v41g_stream s);
int v41g_scatter_rows32(const float *src, int64_t ld_src, const int64_t *rows, int n, int width, float *dst,
                        int64_t ld_dst, v41g_stream s);
/* dst[i, :] = src[rows[i], :] (16-bit elements), rows[i] >= 0 for every i < n. */
int v41g_gather_rows16(const uint16_t *src, int64_t ld_src, const int64_t *rows, int n, int width,
                       uint16_t *dst, int64_t ld_dst, v41g_stream s);

/* ---- decode key lists (SPEC §4.4, the layout of ref/engine.c attention()) ----
 * For decode row t (query position p = pos[t], request floor fl = floor_[t]):
 *   idx[t, j] for j < W (window part, slot order): slot = (p + 1 + j) mod W,
 *     ps = p - ((p - slot) mod W) (non-negative mod); the entry is
 *     win_row0[t] + ps when ps >= 0 and ps >= fl, else -1.
 *   idx[t, W + j] for j < k (compressed part): s = topk[t, j] (k = topk row
 *     width; topk may be NULL: k must then be 0); the entry is ckv_row0[t] + s
 *     when s >= 0, else -1.
 * idx rows are W + k int32 entries (the attention's pool A is the window pool,
 * pool B the compressed pool: v41g_sparse_attn with n_a = W). Row numbers must
 * fit int32. */
int v41g_dec_lists(const int32_t *pos, const int32_t *floor_, const int64_t *win_row0, const int64_t *ckv_row0,
                   const int32_t *topk, int T, int W, int k, int32_t *idx, v41g_stream s);

/* ---- compressor, decode step of a ratio m > 1 kv-source layer (SPEC §5) ----
 * Row t (position p = pos[t], history row base hrow0[t]: the rows of its
 * request's kvh / sch pools, position-indexed) writes kv[t,:] and sc[t,:] (fp32,
 * the two fp32 Linears' outputs) at history row hrow0[t] + p. When (p + 1) % m
 * == 0 its group g0 = p + 1 - m .. p is complete: per channel ch < d, softmax
 * of sch[g0..p][ch] (fp32: max from -inf, e = expf(s - max), sum in order, each
 * weight e/sum), acc = sum_k kvh[g0+k][ch] * (e_k / sum) in order k = 0..m-1,
 * latent[t, ch] = bf16(acc); emit[t] = 1. Otherwise latent[t,:] = 0 and
 * emit[t] = 0. m <= 64. kvh and sch hold d floats per row. */
int v41g_compress_dec(const float *kv, const float *sc, const int32_t *pos, const int64_t *hrow0, int T, int d,
                      int m, float *kvh, float *sch, uint16_t *latent, uint8_t *emit, v41g_stream s);

/* ---- candidate blocks (SPEC §6, ref/engine.c indexer()) ----
 * Row t of the candidate-source layer, scores I[t, 0..S) (fp32, -inf where not
 * visible), Lc = Lc_[t] compressed positions of its request, q position p =
 * pos[t], ratio m, block size B, kb_max blocks kept:
 *   nb = ceil(Lc / B); bs[b] = max_{s in block b, s < Lc} I[t,s] (-inf if empty);
 *   Lraw = (p + 1) / m; if Lraw > 0: the block (Lraw - 1) / B (if < nb) gets +inf;
 *   kb = min(kb_max, nb); the kb best blocks by bs descending, ties to the lower
 *   block id (NaN sorts as -inf); mask[t, s] = 1 for s < Lc in every chosen
 *   block whose bs > -inf; all other mask[t, 0..S) = 0.
 * mask is [T, S] u8. */
int v41g_cand_mask(const float *I, const int32_t *Lc_, const int32_t *pos, int T, int S, int m, int B, int kb_max,
                   uint8_t *mask, v41g_stream s);
/* A candidate-using layer: I[t, s] = -inf where s < min(S, *cmax) and
 * mask[t, s] == 0 (mask rows ld_mask apart; *cmax read from device memory: the
 * batch's largest candidate-source length, as ref masks the first cmax). */
int v41g_cand_apply(float *I, int S, const uint8_t *mask, int ld_mask, const int32_t *cmax, int T,
                    v41g_stream s);

/* ---- mHC statistics (SPEC §3, ref/engine.c hc_mixes()) ----
 * mixes[t, 0..mix) *= r_t where r_t = 1/sqrtf(mean + eps), mean = (float)(sum in
 * double of the fp32 squares of X[t, 0..n) / n) (v41_rms_rsqrt). X bf16. */
int v41g_rms_scale(const uint16_t *X, int T, int n, float eps, float *mixes, int mix, v41g_stream s);
/* Sinkhorn split of the scaled mixes (v41_hc_split_sinkhorn, rows_last = 0):
 * pre[t, h], post[t, h], comb[t, h, h] fp32 from mixes[t, (2+h)h], scale3[3],
 * base[(2+h)h] (device), iters, eps. h in {1, 2, 4}. */
int v41g_sinkhorn(const float *mixes, const float *scale3, const float *base, int T, int h, int iters, float eps,
                  float *pre, float *post, float *comb, v41g_stream s);
/* DSpark main hidden (ref/engine.c ref_forward): y[t, k] = bf16((sum_{j<h} X[t,j,k]
 * summed in order j = 0..h-1 in fp32) / h); y rows ld_y apart. */
int v41g_hc_mean(const uint16_t *X, int T, int h, int D, uint16_t *y, int64_t ld_y, v41g_stream s);

/* ---- Engram gate (SPEC §8, ref/engine.c engram()) ----
 * kv[t, 0..(h+1)D) bf16 (h keys then the value), X[t, h, D] bf16 in place,
 * wq[h, D] fp32 (q_weight * k_weight):
 *   rstd = rsqrt_stat(X[t,j]) * rsqrt_stat(key_j) (v41_rms_rsqrt, eps);
 *   dot = (float)(sum in double of the fp32 products (X[t,j,i] * wq[j,i]) * key_j[i]) * rstd * D^-0.5;
 *   a = max(|dot|, 1e-6); g = sigmoid(copysign(sqrt(a), dot));
 *   X[t,j,i] = bf16(X[t,j,i] + g * value[i]). */
int v41g_engram_gate(const uint16_t *kv, const float *wq, int T, int h, int D, float eps, uint16_t *X,
                     v41g_stream s);

/* ---- head ---- */
/* out[t] = the first index of the largest x[t, 0..V) (ties to the lower index). */
int v41g_argmax_rows(const float *x, int T, int V, int32_t *out, v41g_stream s);

/* ---- MoE pieces for the captured decode step (SPEC §8, ref/engine.c moe()) ----
 * One (token, choice) pair a = t*k + j per batched GEMM entry (T*k entries).
 * Pointer tables for cublasGemmBatchedEx: xp[a] = x + t*D (bf16 row of the FFN
 * input, already act_quant'ed), w13p[a] = w13 + e*2I*D, w2p[a] = w2 + e*D*I with
 * e = idx[a]; hp[a] = h + a*I, h13p[a] = h13 + a*2I, yp[a] = y + a*D (outputs). */
int v41g_moe_ptrs(const int32_t *idx, int T, int k, int D, int I, const uint16_t *x, const uint16_t *w13,
                  const uint16_t *w2, const uint16_t *h13, const uint16_t *h, const uint16_t *y, const void **xp,
                  const void **w13p, const void **w2p, void **h13p, const void **hp, void **yp, v41g_stream s);
/* SwiGLU of rows: g = h13[r, 0..I), u = h13[r, I..2I) (bf16 values, fp32 math),
 * when L > 0: u = clamp(u, -L, L), g = min(g, L); h = (g / (1 + expf(-g))) * u;
 * when wts != NULL: h = wts[r] * h; out[r, i] = bf16(h). rows = n. */
int v41g_swiglu(const uint16_t *h13, int n, int I, float L, const float *wts, uint16_t *out, v41g_stream s);
/* out[t, :] = bf16(acc + shared[t, :]) where acc (fp32, from 0) adds the T*k
 * expert rows ye[t*k + j, :] (bf16) in ascending order of idx[t, j] (the
 * choice order breaks equal ids); shared may be NULL (adds 0). */
int v41g_moe_combine(const uint16_t *ye, const int32_t *idx, const uint16_t *shared, int T, int k, int D,
                     uint16_t *out, v41g_stream s);

#ifdef __cplusplus
}
#endif
#endif
