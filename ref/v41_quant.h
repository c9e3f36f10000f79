/* v41_quant.h: numeric formats of SPEC.md §2 (bf16, e4m3, e8m0, e2m1),
 * activation quantization and weight dequantization. All functions are
 * pure and deterministic; rounding is round-to-nearest-even unless noted. */
#ifndef V41_QUANT_H
#define V41_QUANT_H

#include "v41_weights.h"

#ifdef __cplusplus
extern "C" {
#endif

/* bf16 */
float v41_bf16_to_f32(uint16_t b);
uint16_t v41_f32_to_bf16(float f);          /* RNE, NaN stays NaN */
float v41_round_bf16(float f);              /* f32 -> bf16 -> f32 */
void v41_round_bf16_n(float *x, size_t n);  /* in place */
float v41_f16_to_f32(uint16_t h);

/* fp8 e4m3 (fn: no inf, max 448) */
float v41_e4m3_to_f32(uint8_t q);
uint8_t v41_f32_to_e4m3(float f);           /* RNE, saturates to +-448 */
/* e8m0 scale: 2^(e-127); 0xFF = NaN */
float v41_e8m0_to_f32(uint8_t e);
/* fp4 e2m1 code (4 bits, bit 3 = sign) */
float v41_fp4_to_f32(uint8_t code);
uint8_t v41_f32_to_fp4(float f);            /* nearest of {0,.5,1,1.5,2,3,4,6}, ties to even code, clamp 6 */

/* act_quant(x, 32) in place along n (n % block == 0): SPEC §2.
 * Replaces x by q*scale; if scales != NULL writes n/block scales. */
void v41_act_quant(float *x, size_t n, int block, float *scales);
/* fp4 quantize-dequantize over groups of g: e8m0 (power-of-two) or e4m3 scales. */
void v41_fp4_qdq_e8m0(float *x, size_t n, int g);
void v41_fp4_qdq_e4m3(float *x, size_t n, int g);

/* Dequantize rows [r0, r0+nr) of a weight [N, K] to fp32 (row-major, K floats
 * per row). w: BF16/F16/F32 (scale NULL), F8_E4M3 with e8m0 scale
 * [ceil(N/32), ceil(K/32)], or F4 with e8m0 scale [N, K/32]. */
int v41_dequant_rows(const v41_tensor *w, const v41_tensor *scale,
                     int64_t r0, int64_t nr, float *out, v41_err *err);
/* Quantize an fp32 [N,K] matrix into the official storage formats
 * (used by the tiny model generator and tests). out buffers sized by caller. */
void v41_quant_fp8_weight(const float *w, int64_t N, int64_t K, uint8_t *q, uint8_t *scale);
void v41_quant_fp4_weight(const float *w, int64_t N, int64_t K, uint8_t *q, uint8_t *scale);

#ifdef __cplusplus
}
#endif
#endif
