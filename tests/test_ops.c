/* test_ops.c: the ref engine's op kernels (ref/ops.c) against naive formulas
 * written from SPEC.md (double precision, no shared code with ops.c), plus
 * exactness properties.
 *
 * Tolerances: an fp32 kernel vs a double reference differs by the fp32
 * rounding of its reduction: |err| <= n * 2^-24 * sum|terms| (n terms); a
 * bf16 output adds one half-ulp: 2^-8 * |value|. Each check states which. */
#include "config.h"
#include "v41_ops.h"
#include <check.h>
#include <math.h>
#include <stdlib.h>

static uint64_t rs = 88172645463325252ull;
static double urand(void) /* xorshift, [0,1) */
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (double)(rs >> 11) / 9007199254740992.0;
}
static float nrand(void) { return (float)((urand() + urand() + urand() - 1.5) * 2.0); }
static float bfr(float x) { return v41_round_bf16(x); }

START_TEST(test_bf16_inline)
{
    /* the inline rounding must agree with quant.c's for every pattern class */
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)(urand() * 4294967296.0);
        float f;
        memcpy(&f, &u, 4);
        if (isnan(f)) continue;
        float a = v41_bf16r(f), b = v41_round_bf16(f);
        ck_assert_msg(memcmp(&a, &b, 4) == 0, "bits %08x", u);
    }
}
END_TEST

START_TEST(test_rmsnorm)
{
    /* SPEC §2: (x * rsqrt(mean(x^2) + eps)) * w, one bf16 rounding at the end */
    enum { n = 384 };
    float x[n], w[n], y[n];
    for (int i = 0; i < n; i++) { x[i] = bfr(nrand()); w[i] = bfr(1 + 0.2f * nrand()); }
    v41_rmsnorm(x, w, n, 1e-6, y, true);
    double ms = 0;
    for (int i = 0; i < n; i++) ms += (double)x[i] * x[i];
    double r = 1.0 / sqrt(ms / n + 1e-6);
    for (int i = 0; i < n; i++) {
        double ref = x[i] * r * w[i];
        ck_assert(y[i] == bfr(y[i]));
        /* one bf16 half-ulp plus fp32 noise in the statistic (~1e-6 relative) */
        ck_assert_msg(fabs(y[i] - ref) <= ldexp(fabs(ref), -8) * 1.01 + 1e-30, "i=%d %g vs %g", i, y[i], ref);
    }
    float y2[n];
    v41_rmsnorm(x, w, n, 1e-6, y2, false);
    for (int i = 0; i < n; i++) ck_assert(fabs(y2[i] - x[i] * r * w[i]) <= 1e-5 * fabs(x[i] * r * w[i]) + 1e-30);
}
END_TEST

START_TEST(test_rope)
{
    /* SPEC §4: f_j = 1/theta^(2j/r), YaRN ramp, interleaved pairs, inverse = -sin */
    const int r = 64;
    const double theta = 160000, factor = 16, bf = 32, bs = 1;
    const int osl = 65536;
    v41_rope rp;
    ck_assert_int_eq(v41_rope_init(&rp, r, theta, osl, factor, bf, bs), 0);
    double cf = r * log(osl / (bf * 2 * M_PI)) / (2 * log(theta));
    double cs = r * log(osl / (bs * 2 * M_PI)) / (2 * log(theta));
    double low = fmax(floor(cf), 0), high = fmin(ceil(cs), r - 1);
    for (int j = 0; j < r / 2; j++) {
        double f = 1.0 / pow(theta, 2.0 * j / r);
        double ramp = fmin(fmax((j - low) / fmax(high - low, 1e-3), 0), 1);
        double smooth = 1 - ramp;
        double fy = f / factor * (1 - smooth) + f * smooth;
        ck_assert_msg(fabs(rp.freq[j] - fy) <= 4e-7 * fy, "j=%d %g vs %g", j, rp.freq[j], fy);
    }
    float x[64], y[64];
    for (int i = 0; i < r; i++) x[i] = bfr(nrand());
    memcpy(y, x, sizeof x);
    const int64_t pos = 1234;
    v41_rope_apply(&rp, y, pos, false, true, false);
    for (int j = 0; j < r / 2; j++) {
        double phi = (double)(float)((float)pos * rp.freq[j]);
        double c = cos(phi), s = sin(phi);
        double a = x[2 * j] * c - x[2 * j + 1] * s, b = x[2 * j] * s + x[2 * j + 1] * c;
        ck_assert(fabs(y[2 * j] - a) < 1e-5 && fabs(y[2 * j + 1] - b) < 1e-5);
    }
    /* inverse undoes the rotation (fp32, up to rounding) */
    v41_rope_apply(&rp, y, pos, true, true, false);
    for (int i = 0; i < r; i++) ck_assert(fabs(y[i] - x[i]) < 1e-5);
    /* no YaRN: plain frequencies */
    v41_rope_free(&rp);
    ck_assert_int_eq(v41_rope_init(&rp, 16, 10000, 0, 4, 32, 1), 0);
    for (int j = 0; j < 8; j++) ck_assert(fabs(rp.freq[j] - 1.0 / pow(10000, 2.0 * j / 16)) <= 4e-7 / pow(10000, 2.0 * j / 16));
    v41_rope_free(&rp);
}
END_TEST

/* fp8 Linear (SPEC §2): y[n] = sum_kb (sum a_q w_q) * sa * sw, bf16 out */
START_TEST(test_linear_fp8)
{
    enum { M = 37, N = 96, K = 128 };
    float *w = malloc(sizeof(float) * N * K), *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
    uint8_t *q = malloc(N * K), *sc = malloc((N / 32) * (K / 32));
    for (int i = 0; i < N * K; i++) w[i] = nrand() * 0.1f;
    for (int i = 0; i < M * K; i++) x[i] = bfr(nrand() * (i % 7 == 0 ? 4.0f : 1.0f));
    v41_quant_fp8_weight(w, N, K, q, sc);
    v41_tensor tw = {.name = "w", .dtype = V41_DT_F8_E4M3, .ndim = 2, .shape = {N, K}, .data = q, .nbytes = N * K};
    v41_tensor ts = {.name = "w.scale", .dtype = V41_DT_F8_E8M0, .ndim = 2, .shape = {N / 32, K / 32}, .data = sc,
                     .nbytes = (N / 32) * (K / 32)};
    v41_lin L = {.w = &tw, .s = &ts, .N = N, .K = K, .kind = V41_LIN_Q};
    v41_err err;
    ck_assert_int_eq(v41_linear(&L, x, M, y, true, &err), 0);
    for (int m = 0; m < M; m++) {
        /* naive act_quant: amax, UE8M0 scale, e4m3 RNE of x/scale */
        float aq[K], sa[K / 32];
        for (int b = 0; b < K / 32; b++) {
            double amax = 1e-4;
            for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(x[m * K + b * 32 + i]));
            float t = (float)amax * (float)(1.0 / 448.0);
            int e;
            frexpf(t, &e);
            float s = ldexpf(1.0f, e - 1);
            if (s < t) s *= 2; /* 2^ceil(log2 t) */
            sa[b] = s;
            for (int i = 0; i < 32; i++) aq[b * 32 + i] = v41_e4m3_to_f32(v41_f32_to_e4m3(x[m * K + b * 32 + i] / s));
        }
        for (int n = 0; n < N; n++) {
            double acc = 0, mag = 0;
            for (int b = 0; b < K / 32; b++) {
                double part = 0;
                float sw = v41_e8m0_to_f32(sc[(n / 32) * (K / 32) + b]);
                for (int i = 0; i < 32; i++) {
                    part += (double)aq[b * 32 + i] * v41_e4m3_to_f32(q[n * K + b * 32 + i]);
                    mag += fabs((double)aq[b * 32 + i] * v41_e4m3_to_f32(q[n * K + b * 32 + i])) * sa[b] * sw;
                }
                acc += part * sa[b] * sw;
            }
            /* bf16 half-ulp of the result + fp32 accumulation (K terms, 2^-24 each) */
            double tol = ldexp(fabs(acc), -8) + K * ldexp(mag, -24) * 2;
            ck_assert_msg(fabs(y[m * N + n] - acc) <= tol, "m=%d n=%d %g vs %g", m, n, y[m * N + n], acc);
            ck_assert(y[m * N + n] == bfr(y[m * N + n]));
        }
    }
    /* batch invariance of the tiled GEMM: row 5 alone == row 5 of the 37-row call, bitwise */
    float y1[N];
    ck_assert_int_eq(v41_linear(&L, x + 5 * K, 1, y1, true, &err), 0);
    ck_assert(memcmp(y1, y + 5 * N, sizeof y1) == 0);
    /* fp32 mode: no activation quantization; compare with double GEMM on dequantized weights */
    float *wd = malloc(sizeof(float) * N * K);
    ck_assert_int_eq(v41_dequant_rows(&tw, &ts, 0, N, wd, &err), 0);
    ck_assert_int_eq(v41_linear(&L, x, M, y, false, &err), 0);
    double maxd = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double acc = 0, mag = 0;
            for (int k = 0; k < K; k++) { acc += (double)x[m * K + k] * wd[n * K + k]; mag += fabs((double)x[m * K + k] * wd[n * K + k]); }
            ck_assert(fabs(y[m * N + n] - acc) <= K * ldexp(mag, -24) + 1e-30);
            maxd = fmax(maxd, fabs(acc));
        }
    ck_assert(maxd > 0);
    free(w); free(x); free(y); free(q); free(sc); free(wd);
}
END_TEST

START_TEST(test_sparse_attn)
{
    /* SPEC §4.4 against a two-pass softmax in double, emulate within bf16 rounding */
    enum { H = 3, d = 64, n = 150 };
    float q[H * d], kv[n * d], o[H * d], sink[H] = {0.5f, -1.0f, 2.0f};
    const float *kp[n + 50];
    for (int i = 0; i < H * d; i++) q[i] = bfr(nrand() * 0.3f);
    for (int i = 0; i < n * d; i++) kv[i] = bfr(nrand());
    int nl = 0;
    for (int j = 0; j < n; j++) {
        kp[nl++] = (j % 5 == 3) ? NULL : kv + j * d; /* -1 entries interleaved */
    }
    for (int j = 0; j < 50; j++) kp[nl++] = NULL;   /* padding at the end */
    float scale = (float)pow(d, -0.5);
    for (int emu = 0; emu < 2; emu++) {
        v41_sparse_attn_row(q, H, d, kp, nl, sink, scale, o, emu);
        for (int h = 0; h < H; h++) {
            double mx = -1e300, s[n];
            for (int j = 0; j < n; j++) {
                if (!kp[j]) continue;
                double dot = 0;
                for (int i = 0; i < d; i++) dot += (double)q[h * d + i] * kp[j][i];
                s[j] = dot * scale;
                mx = fmax(mx, s[j]);
            }
            double den = exp(sink[h] - mx), num[d];
            for (int i = 0; i < d; i++) num[i] = 0;
            for (int j = 0; j < n; j++) {
                if (!kp[j]) continue;
                double p = exp(s[j] - mx);
                den += p;
                for (int i = 0; i < d; i++) num[i] += p * kp[j][i];
            }
            for (int i = 0; i < d; i++) {
                double ref = num[i] / den;
                /* emulate: bf16 probabilities (2^-8 relative each) and a bf16 output;
                 * bound by 2^-7 of the largest |value| the output averages */
                double tol = emu ? ldexp(4.0, -8) : 1e-5;
                ck_assert_msg(fabs(o[h * d + i] - ref) <= tol, "emu=%d h=%d i=%d %g vs %g", emu, h, i, o[h * d + i], ref);
            }
        }
    }
    /* constant KV: exactly the constant, whatever the -1 padding (no sink) */
    float c[d];
    for (int i = 0; i < d; i++) c[i] = bfr(0.375f * (i % 3 - 1) + 0.0625f * i);
    const float *kc[256];
    for (int j = 0; j < 256; j++) kc[j] = j < 133 ? c : NULL;
    for (int emu = 0; emu < 2; emu++) {
        v41_sparse_attn_row(q, H, d, kc, 256, NULL, scale, o, emu);
        for (int h = 0; h < H; h++)
            for (int i = 0; i < d; i++) ck_assert_msg(o[h * d + i] == c[i], "emu=%d %g vs %g", emu, o[h * d + i], c[i]);
    }
    /* all entries -1: zeros */
    const float *kn[10] = {0};
    v41_sparse_attn_row(q, H, d, kn, 10, sink, scale, o, true);
    for (int i = 0; i < H * d; i++) ck_assert(o[i] == 0.0f);
}
END_TEST

START_TEST(test_sinkhorn)
{
    enum { hc = 4, mix = (2 + hc) * hc };
    float m[mix], base[mix], s3[3] = {0.8f, 1.2f, 0.9f}, pre[hc], post[hc], comb[hc * hc];
    for (int i = 0; i < mix; i++) { m[i] = nrand(); base[i] = 0.5f * nrand(); }
    const float eps = 1e-6f;
    v41_hc_split_sinkhorn(m, s3, base, hc, 20, eps, pre, post, comb, false);
    /* naive SPEC §3 in double */
    double C[hc][hc];
    for (int i = 0; i < hc; i++) {
        double p = 1 / (1 + exp(-(m[i] * s3[0] + base[i]))) + eps;
        double q = 2 / (1 + exp(-(m[hc + i] * s3[1] + base[hc + i])));
        ck_assert(fabs(pre[i] - p) < 1e-6 && fabs(post[i] - q) < 2e-6);
        double mx = -1e300, sum = 0;
        for (int j = 0; j < hc; j++) { C[i][j] = m[2 * hc + i * hc + j] * s3[2] + base[2 * hc + i * hc + j]; mx = fmax(mx, C[i][j]); }
        for (int j = 0; j < hc; j++) { C[i][j] = exp(C[i][j] - mx); sum += C[i][j]; }
        for (int j = 0; j < hc; j++) C[i][j] = C[i][j] / sum + eps;
    }
    for (int it = 0; it < 20; it++) {
        if (it > 0)
            for (int i = 0; i < hc; i++) {
                double s = 0;
                for (int j = 0; j < hc; j++) s += C[i][j];
                for (int j = 0; j < hc; j++) C[i][j] /= s + eps;
            }
        for (int j = 0; j < hc; j++) {
            double s = 0;
            for (int i = 0; i < hc; i++) s += C[i][j];
            for (int i = 0; i < hc; i++) C[i][j] /= s + eps;
        }
    }
    for (int i = 0; i < hc; i++)
        for (int j = 0; j < hc; j++) ck_assert_msg(fabs(comb[i * hc + j] - C[i][j]) < 1e-5, "%d %d", i, j);
    /* doubly stochastic to ~eps */
    for (int j = 0; j < hc; j++) {
        double s = 0;
        for (int i = 0; i < hc; i++) s += comb[i * hc + j];
        ck_assert(fabs(s - 1) < 1e-4);
    }
    /* fault injection changes the result */
    float comb2[hc * hc];
    v41_hc_split_sinkhorn(m, s3, base, hc, 20, eps, pre, post, comb2, true);
    ck_assert(memcmp(comb, comb2, sizeof comb) != 0);
}
END_TEST

START_TEST(test_hc_pre_post)
{
    enum { hc = 4, D = 50 };
    float X[hc * D], y[D], pre[hc], post[hc], C[hc * hc], out[hc * D], z[D];
    for (int i = 0; i < hc * D; i++) X[i] = bfr(nrand());
    for (int i = 0; i < D; i++) y[i] = bfr(nrand());
    for (int i = 0; i < hc; i++) { pre[i] = (float)urand(); post[i] = 2 * (float)urand(); }
    for (int i = 0; i < hc * hc; i++) C[i] = (float)urand();
    v41_hc_pre(X, pre, hc, D, z, true);
    v41_hc_post(y, X, post, C, hc, D, out, true);
    for (int k = 0; k < D; k++) {
        double s = 0;
        for (int i = 0; i < hc; i++) s += (double)pre[i] * X[i * D + k];
        ck_assert(fabs(z[k] - s) <= ldexp(fabs(s), -8) + 1e-6);
        for (int j = 0; j < hc; j++) {
            double v = (double)post[j] * y[k];
            for (int i = 0; i < hc; i++) v += (double)C[i * hc + j] * X[i * D + k]; /* sum over the FIRST index */
            ck_assert(fabs(out[j * D + k] - v) <= ldexp(fabs(v), -8) + 1e-6);
        }
    }
}
END_TEST

START_TEST(test_topk)
{
    float s[10] = {1, 5, 3, 5, 2, -INFINITY, 5, 0, 3, 4};
    int32_t o[10];
    /* k=2 among three 5s: lower positions win, cut is ambiguous */
    ck_assert_int_eq(v41_topk_desc(s, 10, 2, o), 1);
    ck_assert(o[0] == 1 && o[1] == 3);
    ck_assert_int_eq(v41_topk_desc(s, 10, 3, o), 0);
    ck_assert(o[2] == 6);
    ck_assert_int_eq(v41_topk_desc(s, 10, 5, o), 1); /* the two 3s straddle the cut */
    ck_assert(o[3] == 9 && o[4] == 2);
    /* ties among -inf are not ambiguous */
    float t[4] = {-INFINITY, -INFINITY, 1, -INFINITY};
    ck_assert_int_eq(v41_topk_desc(t, 4, 2, o), 0);
    ck_assert(o[0] == 2 && o[1] == 0);
}
END_TEST

START_TEST(test_softplus)
{
    for (float x = -30; x < 30; x += 0.37f) {
        double ref = x > 20 ? x : log1p(exp((double)x));
        ck_assert(fabs(v41_softplusf(x) - ref) <= 2e-7 * fmax(1, fabs(ref)));
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("ops");
    TCase *tc = tcase_create("ops");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_bf16_inline);
    tcase_add_test(tc, test_rmsnorm);
    tcase_add_test(tc, test_rope);
    tcase_add_test(tc, test_linear_fp8);
    tcase_add_test(tc, test_sparse_attn);
    tcase_add_test(tc, test_sinkhorn);
    tcase_add_test(tc, test_hc_pre_post);
    tcase_add_test(tc, test_topk);
    tcase_add_test(tc, test_softplus);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
