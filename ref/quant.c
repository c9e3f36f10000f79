/* quant.c: numeric formats of SPEC.md §2 (bf16, f16, fp8 e4m3fn, e8m0,
 * fp4 e2m1), activation quantization (act_quant, fp4 quantize-dequantize),
 * weight dequantization and the weight quantizers of the official format.
 *
 * Every conversion is written from the format definitions; the rounding
 * points follow DeepSeek's kernels as documented in SPEC §2:
 *  - power-of-two (UE8M0) scales: 2^ceil(log2(amax * fp32(1/max))) where the
 *    ceil is taken on the fp32 bits of the product (exponent, +1 when the
 *    mantissa is non-zero);
 *  - x / scale is an fp32 division, clamped to the format maximum, then
 *    rounded to nearest even (fp8 saturates, never produces NaN from finite);
 *  - fp4 codes: nearest of {0,.5,1,1.5,2,3,4,6}, ties to the even code. */
#include "v41_quant.h"
#include <math.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---------------------------------------------------------------- bf16 / f16 */

float v41_bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }

uint16_t v41_f32_to_bf16(float f)
{
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign, force quiet bit */
        return (uint16_t)((u >> 16) | 0x0040u);
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb; /* RNE; overflow of the largest finite values gives inf, as IEEE does */
    return (uint16_t)(u >> 16);
}

float v41_round_bf16(float f) { return v41_bf16_to_f32(v41_f32_to_bf16(f)); }

void v41_round_bf16_n(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = v41_round_bf16(x[i]);
}

float v41_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);                 /* zero / subnormal: m * 2^-24 */
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexpf((float)(m | 0x400u), (int)e - 25);     /* (1024+m) * 2^(e-15-10) */
    return u2f(f2u(v) | sign);
}

/* ---------------------------------------------------------------- fp8 e4m3fn */

/* e4m3fn: s eeee mmm, bias 7, no inf, 0x7f / 0xff = NaN, max 448 (0x7e). */
float v41_e4m3_to_f32(uint8_t q)
{
    uint32_t e = (q >> 3) & 0xf, m = q & 7u;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, -9);            /* subnormal: m/8 * 2^-6 */
    else v = ldexpf((float)(8u + m), (int)e - 10);        /* (1 + m/8) * 2^(e-7) */
    return (q & 0x80) ? -v : v;
}

uint8_t v41_f32_to_e4m3(float f)
{
    uint8_t sign = signbit(f) ? 0x80 : 0;
    if (isnan(f)) return (uint8_t)(sign | 0x7f);
    float a = fabsf(f);
    if (a >= 448.0f) return (uint8_t)(sign | 0x7e);       /* saturate (inf too) */
    if (a < 0x1p-6f) {
        /* subnormal range: multiples of 2^-9; a * 2^9 is exact, rintf is RNE.
         * A result of 8 is the smallest normal (code 0x08), which the
         * code arithmetic gives naturally. */
        int m = (int)rintf(a * 512.0f);
        return (uint8_t)(sign | m);
    }
    int e;
    float fr = frexpf(a, &e);                 /* a = fr * 2^e, fr in [0.5, 1) */
    int E = e - 1;                            /* a = (2 fr) * 2^E, 2fr in [1,2) */
    /* (2fr - 1) * 8 is exact in fp32 (a has a 24-bit mantissa) */
    int m = (int)rintf((2.0f * fr - 1.0f) * 8.0f);
    if (m == 8) { m = 0; E++; }
    int code = ((E + 7) << 3) | m;
    if (code > 0x7e) code = 0x7e;
    return (uint8_t)(sign | code);
}

/* ---------------------------------------------------------------- e8m0 */

float v41_e8m0_to_f32(uint8_t e)
{
    if (e == 0xff) return NAN;
    return ldexpf(1.0f, (int)e - 127);
}

/* 2^ceil(log2(x)) on the fp32 bits of x (DeepSeek's fast_round_scale):
 * exponent field, +1 when the mantissa is non-zero. Returns the e8m0 byte
 * (= biased exponent of the result). x must be finite and >= 0. */
static inline uint32_t ue8m0_bits(float x)
{
    uint32_t b = f2u(x);
    uint32_t e = (b >> 23) & 0xffu, man = b & 0x7fffffu;
    uint32_t r = e + (man != 0);
    if (r > 254) r = 254; /* not reachable for finite amax below FLT_MAX/448 */
    return r;
}
static inline float ue8m0_scale(float x) { return u2f(ue8m0_bits(x) << 23); }

/* ---------------------------------------------------------------- fp4 e2m1 */

static const float fp4_grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
/* midpoints between consecutive grid values; at an exact tie the code goes
 * up only when the upper code is even (0.75 -> 1.0 (code 2), 1.75 -> 2.0
 * (code 4), 3.5 -> 4.0 (code 6)). */
static const float fp4_mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

float v41_fp4_to_f32(uint8_t code)
{
    float v = fp4_grid[code & 7];
    return (code & 8) ? -v : v;
}

static inline uint8_t fp4_mag_code(float a) /* a >= 0 (or NaN -> 0) */
{
    uint8_t c = 0;
    for (int i = 0; i < 7; i++) {
        if (a > fp4_mid[i]) c++;
        else if (a == fp4_mid[i] && (i & 1)) c++; /* tie, upper code i+1 even */
    }
    return c;
}

uint8_t v41_f32_to_fp4(float f)
{
    float a = fabsf(f);
    if (a > 6.0f) a = 6.0f;
    return (uint8_t)(fp4_mag_code(a) | (signbit(f) ? 8 : 0));
}

/* ---------------------------------------------------------------- activations */

static const float FP8_MAX = 448.0f;
static const float FP4_MAX = 6.0f;

void v41_act_quant(float *x, size_t n, int block, float *scales)
{
    const float inv = (float)(1.0 / 448.0); /* the kernels multiply by fp32(1/448) */
    size_t nb = n / (size_t)block;
    for (size_t b = 0; b < nb; b++) {
        float *v = x + b * (size_t)block;
        float amax = 0.0f;
        for (int i = 0; i < block; i++) {
            float a = fabsf(v[i]);
            if (a > amax || isnan(a)) amax = a;
        }
        if (amax < 1e-4f) amax = 1e-4f;
        float s = ue8m0_scale(amax * inv);
        for (int i = 0; i < block; i++) {
            float t = v[i] / s;
            if (t > FP8_MAX) t = FP8_MAX;
            if (t < -FP8_MAX) t = -FP8_MAX;
            v[i] = v41_e4m3_to_f32(v41_f32_to_e4m3(t)) * s;
        }
        if (scales) scales[b] = s;
    }
}

static void fp4_qdq_group(float *v, int g, float s)
{
    for (int i = 0; i < g; i++) {
        float t = v[i] / s;
        if (t > FP4_MAX) t = FP4_MAX;
        if (t < -FP4_MAX) t = -FP4_MAX;
        v[i] = v41_fp4_to_f32(v41_f32_to_fp4(t)) * s;
    }
}

static float group_amax(const float *v, int g)
{
    float amax = 0.0f;
    for (int i = 0; i < g; i++) {
        float a = fabsf(v[i]);
        if (a > amax) amax = a;
    }
    return amax;
}

void v41_fp4_qdq_e8m0(float *x, size_t n, int g)
{
    const float inv = (float)(1.0 / 6.0);
    for (size_t b = 0; b < n / (size_t)g; b++) {
        float *v = x + b * (size_t)g;
        float amax = group_amax(v, g);
        if (amax < 6.0f * 0x1p-126f) amax = 6.0f * 0x1p-126f;
        fp4_qdq_group(v, g, ue8m0_scale(amax * inv));
    }
}

void v41_fp4_qdq_e4m3(float *x, size_t n, int g)
{
    for (size_t b = 0; b < n / (size_t)g; b++) {
        float *v = x + b * (size_t)g;
        float amax = group_amax(v, g);
        if (amax < 6.0f * 0x1p-9f) amax = 6.0f * 0x1p-9f;
        float s = v41_e4m3_to_f32(v41_f32_to_e4m3(amax / FP4_MAX)); /* fp32 division, then RNE to e4m3 */
        fp4_qdq_group(v, g, s);
    }
}

/* ---------------------------------------------------------------- dequantization */

static float scale_at(const v41_tensor *s, int64_t idx)
{
    if (s->dtype == V41_DT_F8_E8M0) return v41_e8m0_to_f32(((const uint8_t *)s->data)[idx]);
    if (s->dtype == V41_DT_F32) { float f; memcpy(&f, (const uint8_t *)s->data + 4 * idx, 4); return f; }
    if (s->dtype == V41_DT_BF16) { uint16_t b; memcpy(&b, (const uint8_t *)s->data + 2 * idx, 2); return v41_bf16_to_f32(b); }
    return NAN;
}

int v41_dequant_rows(const v41_tensor *w, const v41_tensor *scale,
                     int64_t r0, int64_t nr, float *out, v41_err *err)
{
    const char *wn = w && w->name ? w->name : "(tensor)";
    if (!w || !out) return v41_err_set(err, V41_EINVAL, "dequant: NULL argument");
    if (w->ndim < 1 || w->ndim > 2)
        return v41_err_set(err, V41_EINVAL, "%s: dequant needs a 1-D or 2-D tensor, got %d dims", wn, w->ndim);
    int64_t N = w->ndim == 2 ? w->shape[0] : 1;
    int64_t K = w->shape[w->ndim - 1];
    if (r0 < 0 || nr < 0 || r0 + nr > N)
        return v41_err_set(err, V41_EINVAL, "%s: rows [%lld, %lld) out of range (%lld rows)", wn,
                           (long long)r0, (long long)(r0 + nr), (long long)N);
    /* a block-scale tensor is 1-D or 2-D, like its weight (a 0-D one was found by fuzzing) */
    if (scale && (scale->ndim < 1 || scale->ndim > 2))
        return v41_err_set(err, V41_EINVAL, "%s: scale tensor '%s' has %d dims, expected 1 or 2", wn,
                           scale->name ? scale->name : "(scale)", scale->ndim);
    const uint8_t *d = (const uint8_t *)w->data;
    switch (w->dtype) {
    case V41_DT_BF16:
    case V41_DT_F16:
    case V41_DT_F32:
        if (scale) return v41_err_set(err, V41_EINVAL, "%s: %s weight takes no scale", wn, v41_dtype_name(w->dtype));
        for (int64_t r = r0; r < r0 + nr; r++)
            for (int64_t k = 0; k < K; k++) {
                int64_t i = r * K + k;
                float *o = out + (r - r0) * K + k;
                if (w->dtype == V41_DT_F32) memcpy(o, d + 4 * i, 4);
                else {
                    uint16_t h;
                    memcpy(&h, d + 2 * i, 2);
                    *o = w->dtype == V41_DT_BF16 ? v41_bf16_to_f32(h) : v41_f16_to_f32(h);
                }
            }
        return V41_OK;
    case V41_DT_F8_E4M3: {
        if (!scale) return v41_err_set(err, V41_EINVAL, "%s: F8_E4M3 weight needs a scale tensor", wn);
        if (scale->dtype != V41_DT_F8_E8M0 && scale->dtype != V41_DT_F32 && scale->dtype != V41_DT_BF16)
            return v41_err_set(err, V41_EINVAL, "%s: scale dtype %s not supported", wn, v41_dtype_name(scale->dtype));
        int64_t nbk = (K + 31) / 32, nbn = (N + 31) / 32;
        int64_t sr = scale->ndim == 2 ? scale->shape[0] : 1, sc = scale->shape[scale->ndim - 1];
        bool rowwise;
        if (sr == nbn && sc == nbk) rowwise = false;     /* 32x32 blocks */
        else if (sr == N && sc == nbk) rowwise = true;   /* per row, 32 columns (engram tables) */
        else
            return v41_err_set(err, V41_EINVAL,
                               "%s: scale shape [%lld, %lld] fits neither [ceil(N/32), ceil(K/32)] = [%lld, %lld] "
                               "nor [N, ceil(K/32)] = [%lld, %lld]",
                               wn, (long long)sr, (long long)sc, (long long)nbn, (long long)nbk, (long long)N,
                               (long long)nbk);
        for (int64_t r = r0; r < r0 + nr; r++) {
            int64_t srow = rowwise ? r : r / 32;
            for (int64_t k = 0; k < K; k++)
                out[(r - r0) * K + k] = v41_e4m3_to_f32(d[r * K + k]) * scale_at(scale, srow * nbk + k / 32);
        }
        return V41_OK;
    }
    case V41_DT_F4: {
        if (!scale) return v41_err_set(err, V41_EINVAL, "%s: F4 weight needs a scale tensor", wn);
        if (scale->dtype != V41_DT_F8_E8M0 && scale->dtype != V41_DT_F32 && scale->dtype != V41_DT_BF16)
            return v41_err_set(err, V41_EINVAL, "%s: scale dtype %s not supported", wn, v41_dtype_name(scale->dtype));
        if (K % 32)
            return v41_err_set(err, V41_EINVAL, "%s: F4 weight needs K %% 32 == 0, got K = %lld", wn, (long long)K);
        int64_t sr = scale->ndim == 2 ? scale->shape[0] : 1, sc = scale->shape[scale->ndim - 1];
        if (sr != N || sc != K / 32)
            return v41_err_set(err, V41_EINVAL, "%s: scale shape [%lld, %lld], expected [N, K/32] = [%lld, %lld]", wn,
                               (long long)sr, (long long)sc, (long long)N, (long long)(K / 32));
        for (int64_t r = r0; r < r0 + nr; r++)
            for (int64_t k = 0; k < K; k++) {
                int64_t i = r * K + k;
                uint8_t byte = d[i / 2];
                uint8_t code = (i & 1) ? (byte >> 4) : (byte & 0xf);
                out[(r - r0) * K + k] = v41_fp4_to_f32(code) * scale_at(scale, r * (K / 32) + k / 32);
            }
        return V41_OK;
    }
    default:
        return v41_err_set(err, V41_EUNSUPPORTED, "%s: cannot dequantize dtype %s", wn, v41_dtype_name(w->dtype));
    }
}

/* ---------------------------------------------------------------- weight quantizers */

void v41_quant_fp8_weight(const float *w, int64_t N, int64_t K, uint8_t *q, uint8_t *scale)
{
    const float inv = (float)(1.0 / 448.0);
    int64_t nbn = (N + 31) / 32, nbk = (K + 31) / 32;
    for (int64_t bn = 0; bn < nbn; bn++)
        for (int64_t bk = 0; bk < nbk; bk++) {
            int64_t n1 = bn * 32 + 32 < N ? bn * 32 + 32 : N, k1 = bk * 32 + 32 < K ? bk * 32 + 32 : K;
            float amax = 0.0f; /* rows past N are zero padding: they do not raise amax */
            for (int64_t n = bn * 32; n < n1; n++)
                for (int64_t k = bk * 32; k < k1; k++) {
                    float a = fabsf(w[n * K + k]);
                    if (a > amax) amax = a;
                }
            if (amax < 1e-4f) amax = 1e-4f;
            uint32_t e = ue8m0_bits(amax * inv);
            float s = u2f(e << 23);
            scale[bn * nbk + bk] = (uint8_t)e;
            for (int64_t n = bn * 32; n < n1; n++)
                for (int64_t k = bk * 32; k < k1; k++) {
                    float t = w[n * K + k] / s;
                    if (t > FP8_MAX) t = FP8_MAX;
                    if (t < -FP8_MAX) t = -FP8_MAX;
                    q[n * K + k] = v41_f32_to_e4m3(t);
                }
        }
}

void v41_quant_fp4_weight(const float *w, int64_t N, int64_t K, uint8_t *q, uint8_t *scale)
{
    const float inv = (float)(1.0 / 6.0);
    int64_t nbk = K / 32;
    memset(q, 0, (size_t)((N * K + 1) / 2));
    for (int64_t n = 0; n < N; n++)
        for (int64_t bk = 0; bk < nbk; bk++) {
            const float *v = w + n * K + bk * 32;
            float amax = group_amax(v, 32);
            if (amax < 6.0f * 0x1p-126f) amax = 6.0f * 0x1p-126f;
            uint32_t e = ue8m0_bits(amax * inv);
            float s = u2f(e << 23);
            scale[n * nbk + bk] = (uint8_t)e;
            for (int i = 0; i < 32; i++) {
                float t = v[i] / s;
                if (t > FP4_MAX) t = FP4_MAX;
                if (t < -FP4_MAX) t = -FP4_MAX;
                uint8_t c = v41_f32_to_fp4(t);
                int64_t idx = n * K + bk * 32 + i;
                q[idx / 2] |= (uint8_t)((idx & 1) ? (c << 4) : c);
            }
        }
}
