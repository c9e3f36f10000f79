/* gpu_cpu_ref.h: plain CPU versions of the GPU kernels, written from
 * ../shared/SPEC.md for tests/test_gpu_kernels.c (independent of ref/ so the
 * GPU tests do not depend on the reference engine's internals). */
#ifndef GPU_CPU_REF_H
#define GPU_CPU_REF_H
#include <stdint.h>
#include <stddef.h>

float cr_bf2f(uint16_t b);
uint16_t cr_f2bf(float f);
float cr_rbf(float f);
uint8_t cr_f2e4m3(float f);         /* RNE, saturating to +-448 */
float cr_e4m32f(uint8_t q);
float cr_fp4_mag(float v);          /* nearest of {0,.5,1,1.5,2,3,4,6}, ties to the even code */

void cr_rmsnorm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int dim, float eps);
void cr_rope_freqs(int r, double theta, int orig, double factor, double bf, double bs, float *out);
void cr_rope(uint16_t *x, const int32_t *pos, const float *freqs, int rows, int heads, int d, int r, int inverse);
void cr_act_quant(const uint16_t *x, uint8_t *q, float *scale, uint16_t *deq, int rows, int n);
void cr_fp4_qdq(const uint16_t *x, uint16_t *y, int rows, int n, int g, int e4m3);
void cr_hc_mixes(const uint16_t *X, const float *fn, const float *base, const float *s3, int T, int h, int D,
                 float norm_eps, float hc_eps, int iters, float *pre, float *post, float *comb);
void cr_hc_pre(const uint16_t *X, const float *p, uint16_t *y, int T, int h, int D);
void cr_hc_post(const uint16_t *y, const uint16_t *X, const float *post, const float *comb, uint16_t *Xout,
                int T, int h, int D);
void cr_sparse_attn(const uint16_t *q, const uint16_t *kv_a, const uint16_t *kv_b, const int32_t *idx, int L,
                    int n_a, const float *sink, float scale, int T, int H, int d, uint16_t *o);
void cr_indexer_scores(const uint16_t *q, const float *w, const uint16_t *k, const int64_t *kbase,
                       const int32_t *visible, int T, int nI, int dI, int S, float *I);
void cr_topk(const float *I, const int32_t *visible, int T, int S, int k, int32_t *out);
void cr_moe_route(const float *logits, const float *bias, int T, int E, int k, int score_func, float temp,
                  int norm, float route_scale, int32_t *idx, float *wts);
void cr_moe_ffn(int T, int D, int I, int E, int k, float limit, const uint16_t *w13, const uint16_t *w2,
                const uint16_t *w13s, const uint16_t *w2s, const uint16_t *x, const int32_t *idx,
                const float *wts, uint16_t *out);
#endif
