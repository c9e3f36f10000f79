/* test_quant.c: numeric formats of SPEC §2 against naive formulas written
 * from the format definitions, and bit-exact dequantization of the oracle's
 * own checkpoint tensors. */
#include "v41_loader_internal.h"
#include "v41_quant.h"
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static uint64_t rs = 0x12345678abcdefull;
static uint64_t rnd(void)
{
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return rs;
}

/* ---------------------------------------------------------------- bf16 */

/* naive RNE to bf16: the two neighbours in bf16, pick the nearer in double,
 * ties to the even (mantissa LSB 0) one */
static uint16_t naive_bf16(float f)
{
    uint32_t u = f2u(f);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double dl = fabs((double)f - (double)u2f((uint32_t)lo << 16));
    double dh = fabs((double)u2f((uint32_t)hi << 16) - (double)f);
    if ((u & 0xffff) == 0) return lo;
    if (isinf(u2f((uint32_t)hi << 16))) { /* above the largest bf16: overflow rule of RNE */
        dh = ldexp(1.0, 128) - fabs((double)f);
    }
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo & 1) ? hi : lo;
}

START_TEST(test_bf16)
{
    ck_assert_uint_eq(v41_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(v41_f32_to_bf16(1.00390625f), 0x3f80);  /* 1 + 2^-8: tie -> even 1.0 */
    ck_assert_uint_eq(v41_f32_to_bf16(1.01171875f), 0x3f82);  /* 1 + 3*2^-8: tie -> even 1 + 2^-6 */
    ck_assert_uint_eq(v41_f32_to_bf16(nextafterf(1.00390625f, 2.0f)), 0x3f81); /* just above the tie */
    ck_assert(isnan(v41_bf16_to_f32(v41_f32_to_bf16(NAN))));
    ck_assert(isinf(v41_round_bf16(INFINITY)));
    ck_assert_float_eq(v41_round_bf16(-2.5f), -2.5f);
    for (int i = 0; i < 200000; i++) {
        float f = u2f((uint32_t)rnd());
        if (isnan(f)) continue;
        ck_assert_msg(v41_f32_to_bf16(f) == naive_bf16(f), "bf16(%a): got %04x want %04x", f, v41_f32_to_bf16(f),
                      naive_bf16(f));
    }
    float v[3] = {1.00390625f, 3.0f, -1.01171875f};
    v41_round_bf16_n(v, 3);
    ck_assert_float_eq(v[0], 1.0f);
    ck_assert_float_eq(v[1], 3.0f);
    ck_assert_float_eq(v[2], -1.015625f);
    /* f16 */
    ck_assert_float_eq(v41_f16_to_f32(0x3c00), 1.0f);
    ck_assert_float_eq(v41_f16_to_f32(0xc000), -2.0f);
    ck_assert_float_eq(v41_f16_to_f32(0x0001), ldexpf(1.0f, -24));
    ck_assert_float_eq(v41_f16_to_f32(0x7bff), 65504.0f);
    ck_assert(isinf(v41_f16_to_f32(0x7c00)));
}
END_TEST

/* ---------------------------------------------------------------- e4m3 */

/* e4m3fn value of a code from the definition: bias 7, 3 mantissa bits */
static double naive_e4m3_val(int c)
{
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v = e == 0 ? m / 8.0 * pow(2, -6) : (1 + m / 8.0) * pow(2, e - 7);
    return s ? -v : v;
}

/* nearest finite code (|v| <= 448), ties to even mantissa; saturating */
static int naive_e4m3(float f)
{
    double x = f;
    if (x > 448) x = 448;
    if (x < -448) x = -448;
    int best = -1;
    double bd = 1e300;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue;           /* NaN */
        if ((c & 0x80) != (signbit(f) ? 0x80 : 0)) continue;
        double d = fabs(naive_e4m3_val(c) - x);
        if (d < bd || (d == bd && (c & 1) == 0)) { bd = d; best = c; }
    }
    return best;
}

START_TEST(test_e4m3)
{
    for (int c = 0; c < 256; c++) {
        float v = v41_e4m3_to_f32((uint8_t)c);
        if ((c & 0x7f) == 0x7f) { ck_assert(isnan(v)); continue; }
        ck_assert_msg((double)v == naive_e4m3_val(c), "decode %02x", c);
        ck_assert_msg(v41_f32_to_e4m3(v) == c, "roundtrip %02x -> %02x", c, v41_f32_to_e4m3(v));
    }
    ck_assert_float_eq(v41_e4m3_to_f32(0x7e), 448.0f);
    ck_assert_uint_eq(v41_f32_to_e4m3(1e9f), 0x7e);
    ck_assert_uint_eq(v41_f32_to_e4m3(-INFINITY), 0xfe);
    ck_assert_uint_eq(v41_f32_to_e4m3(464.0f), 0x7e); /* saturates, never NaN */
    ck_assert_uint_eq(v41_f32_to_e4m3(1.0625f), 0x38); /* 1 + 1/16: tie -> even mantissa 0 */
    ck_assert_uint_eq(v41_f32_to_e4m3(1.1875f), 0x3a); /* 1 + 3/16: tie -> even mantissa 2 */
    ck_assert_uint_eq(v41_f32_to_e4m3(ldexpf(1.0f, -10)), 0x00); /* half the smallest subnormal: tie -> 0 */
    ck_assert_uint_eq(v41_f32_to_e4m3(ldexpf(3.0f, -10)), 0x02); /* 1.5 subnormal ulps: tie -> even 2 */
    for (int i = 0; i < 100000; i++) {
        /* magnitudes over the whole e4m3 range and beyond */
        float f = ldexpf((float)(rnd() % 1000000) / 1000000.0f, (int)(rnd() % 24) - 14);
        if (rnd() & 1) f = -f;
        ck_assert_msg(v41_f32_to_e4m3(f) == naive_e4m3(f), "e4m3(%a): got %02x want %02x", f, v41_f32_to_e4m3(f),
                      naive_e4m3(f));
    }
}
END_TEST

START_TEST(test_e8m0_fp4)
{
    ck_assert_float_eq(v41_e8m0_to_f32(127), 1.0f);
    ck_assert_float_eq(v41_e8m0_to_f32(120), 1.0f / 128);
    ck_assert_float_eq(v41_e8m0_to_f32(130), 8.0f);
    ck_assert(v41_e8m0_to_f32(0) == ldexpf(1.0f, -127));
    ck_assert(isnan(v41_e8m0_to_f32(255)));
    static const float grid[8] = {0, .5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 16; c++) ck_assert_float_eq(v41_fp4_to_f32((uint8_t)c), (c & 8 ? -1 : 1) * grid[c & 7]);
    /* naive: nearest grid value, ties to the even code, clamp 6 */
    for (int k = -7 * 64; k <= 7 * 64; k++) {
        float x = k / 64.0f, a = fminf(fabsf(x), 6.0f);
        int best = 0;
        float bd = 1e30f;
        for (int c = 0; c < 8; c++) {
            float d = fabsf(grid[c] - a);
            if (d < bd || (d == bd && !(c & 1))) { bd = d; best = c; }
        }
        int want = best | (signbit(x) ? 8 : 0);
        ck_assert_msg(v41_f32_to_fp4(x) == want, "fp4(%g): got %d want %d", x, v41_f32_to_fp4(x), want);
    }
    ck_assert_uint_eq(v41_f32_to_fp4(0.75f), 2);  /* tie 0.5|1 -> code 2 (1.0) */
    ck_assert_uint_eq(v41_f32_to_fp4(2.5f), 4);   /* tie 2|3 -> code 4 (2.0) */
    ck_assert_uint_eq(v41_f32_to_fp4(5.0f), 6);   /* tie 4|6 -> code 6 (4.0) */
    ck_assert_uint_eq(v41_f32_to_fp4(-0.1f), 8);  /* -0 keeps its sign */
}
END_TEST

/* ---------------------------------------------------------------- act_quant, fp4_qdq */

/* SPEC §2 written directly: scale = 2^ceil(log2(amax * fp32(1/448))) with
 * log2/ceil in double on the fp32 product, amax clamped to 1e-4 */
static void naive_act_quant(float *x, int n, int block, float *scales)
{
    for (int b = 0; b < n / block; b++) {
        double amax = 0;
        for (int i = 0; i < block; i++) amax = fmax(amax, fabs(x[b * block + i]));
        float am = (float)fmax(amax, (double)1e-4f);
        float prod = am * (float)(1.0 / 448.0);
        float s = (float)ldexp(1.0, (int)ceil(log2((double)prod)));
        for (int i = 0; i < block; i++) {
            float t = x[b * block + i] / s;
            t = fminf(fmaxf(t, -448.0f), 448.0f);
            x[b * block + i] = (float)naive_e4m3_val(naive_e4m3(t)) * s;
        }
        scales[b] = s;
    }
}

START_TEST(test_act_quant)
{
    enum { N = 32 * 64 };
    float x[N], y[N], sx[64], sy[64];
    for (int i = 0; i < N; i++) {
        int blk = i / 32;
        /* block magnitudes from 1e-6 to 1e3, incl. blocks whose amax*fp32(1/448) is an exact power of two */
        double mag = pow(10.0, (blk % 10) - 6);
        x[i] = (float)(((double)(rnd() % 2000001) / 1000000.0 - 1.0) * mag);
        x[i] = v41_round_bf16(x[i]); /* act_quant inputs are bf16 */
    }
    x[5 * 32 + 7] = 448.0f;  /* amax 448: product 448*fp32(1/448) = 1.0000000x? exercised either way */
    x[6 * 32 + 3] = 896.0f;
    for (int i = 7 * 32; i < 8 * 32; i++) x[i] = 0.0f; /* all-zero block: amax clamps to 1e-4 */
    memcpy(y, x, sizeof x);
    v41_act_quant(x, N, 32, sx);
    naive_act_quant(y, N, 32, sy);
    for (int b = 0; b < 64; b++) ck_assert_msg(sx[b] == sy[b], "scale %d: %a vs %a", b, sx[b], sy[b]);
    for (int i = 0; i < N; i++) ck_assert_msg(f2u(x[i]) == f2u(y[i]), "x[%d]: %a vs %a", i, x[i], y[i]);
    /* the all-zero block stays zero, and its scale is 2^ceil(log2(1e-4/448)) = 2^-22 */
    ck_assert_float_eq(sx[7], ldexpf(1.0f, -22));
    ck_assert_float_eq(x[7 * 32], 0.0f);
    /* idempotent: quantized values re-quantize to themselves */
    memcpy(y, x, sizeof x);
    v41_act_quant(y, N, 32, NULL);
    ck_assert(!memcmp(x, y, sizeof x));
}
END_TEST

static void naive_fp4(float *x, int n, int g, bool e8m0)
{
    static const float grid[8] = {0, .5f, 1, 1.5f, 2, 3, 4, 6};
    for (int b = 0; b < n / g; b++) {
        float amax = 0;
        for (int i = 0; i < g; i++) amax = fmaxf(amax, fabsf(x[b * g + i]));
        float s;
        if (e8m0) {
            amax = fmaxf(amax, 6.0f * ldexpf(1.0f, -126));
            s = (float)ldexp(1.0, (int)ceil(log2((double)(amax * (float)(1.0 / 6.0)))));
        } else {
            amax = fmaxf(amax, 6.0f * ldexpf(1.0f, -9));
            s = (float)naive_e4m3_val(naive_e4m3(amax / 6.0f));
        }
        for (int i = 0; i < g; i++) {
            float t = fminf(fmaxf(x[b * g + i] / s, -6.0f), 6.0f), a = fabsf(t);
            int best = 0;
            float bd = 1e30f;
            for (int c = 0; c < 8; c++) {
                float d = fabsf(grid[c] - a);
                if (d < bd || (d == bd && !(c & 1))) { bd = d; best = c; }
            }
            x[b * g + i] = (signbit(t) ? -grid[best] : grid[best]) * s;
        }
    }
}

START_TEST(test_fp4_qdq)
{
    enum { N = 32 * 40 };
    float x[N], y[N];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < N; i++) {
            double mag = pow(10.0, (i / 32) % 8 - 4);
            x[i] = v41_round_bf16((float)(((double)(rnd() % 2000001) / 1000000.0 - 1.0) * mag));
        }
        for (int i = 32; i < 48; i++) x[i] = 0.0f; /* an all-zero group of 16 */
        memcpy(y, x, sizeof x);
        if (pass == 0) { v41_fp4_qdq_e8m0(x, N, 32); naive_fp4(y, N, 32, true); }
        else { v41_fp4_qdq_e4m3(x, N, 16); naive_fp4(y, N, 16, false); }
        for (int i = 0; i < N; i++)
            ck_assert_msg(f2u(x[i]) == f2u(y[i]), "pass %d x[%d]: %a vs %a", pass, i, x[i], y[i]);
    }
    /* a group of 16 with amax 6: e4m3 scale 1, values on the fp4 grid stay */
    float z[16] = {6, -4, 3, 2, 1.5f, 1, .5f, 0, 0.75f, 1.75f, 5, -5, 2.5f, -0.25f, 0.2f, 3.5f};
    float want[16] = {6, -4, 3, 2, 1.5f, 1, .5f, 0, 1, 2, 4, -4, 2, -0.0f, 0, 4};
    v41_fp4_qdq_e4m3(z, 16, 16);
    for (int i = 0; i < 16; i++) ck_assert_msg(z[i] == want[i], "z[%d] = %g want %g", i, z[i], want[i]);
}
END_TEST

/* ---------------------------------------------------------------- weights */

START_TEST(test_weight_quant_roundtrip)
{
    /* quantize -> dequantize -> quantize again gives the same dequantized
     * values (requantizing a quantized block may halve the scale when its
     * largest code is 224 / 3, but the values are then exactly representable) */
    enum { N = 70, K = 96 };
    static float w[N * K], d1[N * K], d2[N * K];
    for (int i = 0; i < N * K; i++) w[i] = (float)(((double)(rnd() % 2000001) / 1000000.0 - 1.0) * ((i / K) % 5 + 1));
    uint8_t q[N * K], s[3 * 3], q2[N * K], s2[3 * 3];
    v41_quant_fp8_weight(w, N, K, q, s);
    v41_tensor tw = {"w", V41_DT_F8_E4M3, 2, {N, K}, q, N * K}, ts = {"w.scale", V41_DT_F8_E8M0, 2, {3, 3}, s, 9};
    v41_err err;
    ck_assert_int_eq(v41_dequant_rows(&tw, &ts, 0, N, d1, &err), V41_OK);
    for (int i = 0; i < N * K; i++) { /* |w - deq| <= half an e4m3 ulp: 2^-4 relative (3 mantissa bits) + subnormal floor */
        double sc = v41_e8m0_to_f32(s[(i / K / 32) * 3 + (i % K) / 32]);
        ck_assert(fabs((double)w[i] - d1[i]) <= fabs((double)w[i]) * 0.0625 + sc * ldexp(1, -10));
    }
    v41_quant_fp8_weight(d1, N, K, q2, s2);
    tw.data = q2; ts.data = s2;
    ck_assert_int_eq(v41_dequant_rows(&tw, &ts, 0, N, d2, &err), V41_OK);
    ck_assert(!memcmp(d1, d2, sizeof d1));
    /* fp4 */
    uint8_t p[N * K / 2], ps[N * 3], p2[N * K / 2], ps2[N * 3];
    v41_quant_fp4_weight(w, N, K, p, ps);
    v41_tensor fw = {"e", V41_DT_F4, 2, {N, K}, p, N * K / 2}, fs = {"e.scale", V41_DT_F8_E8M0, 2, {N, 3}, ps, N * 3};
    ck_assert_int_eq(v41_dequant_rows(&fw, &fs, 0, N, d1, &err), V41_OK);
    v41_quant_fp4_weight(d1, N, K, p2, ps2);
    fw.data = p2; fs.data = ps2;
    ck_assert_int_eq(v41_dequant_rows(&fw, &fs, 0, N, d2, &err), V41_OK);
    ck_assert(!memcmp(d1, d2, sizeof d1));
    /* a row slice equals the same rows of the full dequantization */
    float part[3 * K];
    ck_assert_int_eq(v41_dequant_rows(&fw, &fs, 33, 3, part, &err), V41_OK);
    ck_assert(!memcmp(part, d2 + 33 * K, sizeof part));
    /* errors name the tensor */
    ck_assert_int_eq(v41_dequant_rows(&fw, &fs, 69, 2, part, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "'e'") ? strstr(err.msg, "'e'") : strstr(err.msg, "e:"));
    ck_assert_int_eq(v41_dequant_rows(&fw, NULL, 0, 1, part, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "e: F4 weight needs a scale"));
    v41_tensor bad = {"e.scale", V41_DT_F8_E8M0, 2, {N, 2}, ps, N * 2};
    ck_assert_int_eq(v41_dequant_rows(&fw, &bad, 0, 1, part, &err), V41_EINVAL);
}
END_TEST

/* Expected values of the oracle tensors below were derived at development time
 * by a numpy script (/usr/bin/python3) reading model.safetensors' raw bytes and
 * decoding them with its own e4m3 / e8m0 / e2m1 tables (value = code x 2^(e-127)
 * per 32x32 block, per row x 32, or per 32 of a row). Every value is a dyadic
 * rational with few significant bits, so the double sums are exact. */
static const char *oracle_dir(void)
{
    const char *d = getenv("V41_ORACLE_DIR");
    return d && *d ? d : V41_TESTDATA "/../shared/oracle/v41-tiny";
}

static void deq_all(const v41_weights *w, const char *name, int64_t *N, int64_t *K, float **out)
{
    char sn[256];
    const v41_tensor *t = v41_weights_find(w, name), *s;
    ck_assert_ptr_nonnull(t);
    size_t nl = strlen(name);
    ck_assert(nl > 7 && nl < 240);
    memcpy(sn, name, nl - 7);
    memcpy(sn + nl - 7, ".scale", 7);
    s = strstr(name, ".weight") && (t->dtype == V41_DT_F8_E4M3 || t->dtype == V41_DT_F4) ? v41_weights_find(w, sn) : NULL;
    *N = t->ndim == 2 ? t->shape[0] : 1;
    *K = t->shape[t->ndim - 1];
    *out = malloc((size_t)(*N * *K) * sizeof(float));
    v41_err err;
    ck_assert_msg(v41_dequant_rows(t, s, 0, *N, *out, &err) == V41_OK, "%s", err.msg);
}

static void check_sums(const float *v, int64_t n, double sum, double asum)
{
    double s = 0, a = 0;
    for (int64_t i = 0; i < n; i++) { s += v[i]; a += fabs(v[i]); }
    ck_assert_msg(s == sum && a == asum, "sum %.17g (want %.17g), abs %.17g (want %.17g)", s, sum, a, asum);
}

START_TEST(test_oracle_dequant)
{
    v41_weights *w;
    v41_err err;
    char p[4096];
    snprintf(p, sizeof p, "%s/model.safetensors", oracle_dir());
    ck_assert_msg(v41_weights_open(p, &w, &err) == V41_OK, "%s", err.msg);
    int64_t N, K;
    float *v;
    /* fp8 e4m3 + e8m0 32x32 blocks */
    deq_all(w, "layers.1.attn.wq_a.weight", &N, &K, &v);
    ck_assert(N == 64 && K == 128);
    check_sums(v, N * K, -6.067854881286621, 514.7304735183716);
    static const float r37[8] = {-0.002197265625f, 0.02734375f, 0.05859375f, -0.015625f, -0.09375f, 0.01953125f,
                                 -0.00244140625f, 0.15625f};
    for (int i = 0; i < 8; i++) ck_assert_msg(v[37 * K + 60 + i] == r37[i], "wq_a[37][%d]", 60 + i);
    free(v);
    /* packed fp4 + e8m0 per 32 */
    deq_all(w, "layers.1.ffn.experts.0.w1.weight", &N, &K, &v);
    ck_assert(N == 64 && K == 128);
    check_sums(v, N * K, -8.6015625, 501.6171875);
    static const float r5[8] = {-0.125f, -0.25f, 0.03125f, -0.0625f, -0.03125f, 0.125f, -0.0f, -0.0f};
    for (int i = 0; i < 8; i++) ck_assert_msg(v[5 * K + 30 + i] == r5[i], "w1[5][%d]", 30 + i);
    ck_assert(signbit(v[5 * K + 36])); /* code 8 = -0 */
    free(v);
    /* engram table: e4m3 + e8m0 per row x 32 */
    deq_all(w, "layers.2.engram.embed.weight", &N, &K, &v);
    ck_assert(N == 240 && K == 32);
    check_sums(v, N * K, -41.45733642578125, 5471.3404541015625);
    static const float r100[8] = {0.9375f, -0.5f, -0.5625f, -1.375f, 2.75f, -0.9375f, 2.0f, 0.0126953125f};
    for (int i = 0; i < 8; i++) ck_assert_msg(v[100 * K + i] == r100[i], "engram[100][%d]", i);
    free(v);
    /* bf16 and f32 */
    deq_all(w, "layers.1.attn_norm.weight", &N, &K, &v);
    ck_assert(N == 1 && K == 128);
    double s = 0;
    for (int i = 0; i < K; i++) s += v[i];
    ck_assert(s == 131.23828125);
    ck_assert(v[0] == 0.9453125f && v[1] == 1.109375f && v[3] == 1.265625f);
    free(v);
    deq_all(w, "layers.1.attn.compressor.wkv.weight", &N, &K, &v);
    s = 0;
    for (int i = 0; i < N * K; i++) s += v[i];
    ck_assert_msg(s == -6.484776139259338, "%.17g", s);
    ck_assert(v[3 * K] == 0.0625f && v[3 * K + 1] == 0.03955078125f && v[3 * K + 3] == 0.1533203125f);
    free(v);
    v41_weights_close(w);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = tcase_create("formats");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_bf16);
    tcase_add_test(tc, test_e4m3);
    tcase_add_test(tc, test_e8m0_fp4);
    tcase_add_test(tc, test_act_quant);
    tcase_add_test(tc, test_fp4_qdq);
    tcase_add_test(tc, test_weight_quant_roundtrip);
    tcase_add_test(tc, test_oracle_dequant);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
