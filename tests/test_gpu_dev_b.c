/* test_gpu_dev_b: the kernels of gpu/k_dev_b.cu (gpu/v41_gpu_dev.h: rms_scale,
 * sinkhorn, hc_mean, engram_gate, argmax_rows, moe_ptrs, swiglu, moe_combine)
 * against ref's own functions where they exist (v41_rms_rsqrt,
 * v41_hc_split_sinkhorn, v41_bf16r) and otherwise against the loops of
 * ref/engine.c copied verbatim (hc_mixes, ref_forward's DSpark mean, engram,
 * argmax_f, expert_fwd, moe). Outputs are poisoned (0xFF bytes: NaN / -1)
 * before each launch, and in-place outputs start from values the kernel must
 * change, so a kernel that writes nothing fails. Exit 77 (skip) when the build
 * has no CUDA or the machine has no device; CUDA is initialised only inside the
 * forked Check tests (a probe child decides the skip).
 *
 * Tolerances (the kernels reproduce ref's fp32 operation order without FMA
 * contraction, so the only sources of difference are):
 *  - double sums in another association (block reductions vs ref's sequential
 *    loop): ~1e-16 relative, visible after the float cast only when the double
 *    lies within ~2^-29 of an fp32 rounding boundary: at most 1 fp32 ulp in the
 *    mean, hence a couple of ulps in 1/sqrtf(mean + eps) and its products;
 *  - CUDA's expf (<= 2 ulp) vs glibc's (< 1 ulp): a few fp32 ulps in a sigmoid
 *    or a softmax entry; Sinkhorn normalisations are non-expansive (Hilbert
 *    metric), so the difference stays at a few ulps plus the roundings of each
 *    iteration acting on slightly different values;
 *  - a bf16 output computed from fp32 values that differ by a few ulps may round
 *    to the adjacent bf16 value: one bf16 ulp, <= 2^-7 relative.
 * hc_mean, argmax, moe_ptrs and moe_combine involve none of these: compared bit
 * for bit. */
#include "config.h"
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef HAVE_CUDA
int main(void)
{
    printf("test_gpu_dev_b: built without CUDA: skipped\n");
    return 77;
}
#else
#include "v41_gpu.h"
#include "v41_gpu_dev.h"
#include "v41_ops.h"
#include "v41_quant.h"
#include "test_gpu_probe.h"
#include "test_gpu_util.h"

static uint16_t *rand_bf16(size_t n, float amp)
{
    uint16_t *x = malloc(2 * n + 2);
    for (size_t i = 0; i < n; i++) x[i] = v41_f32_to_bf16(amp * rng_unit());
    return x;
}
static float *bf_to_f(const uint16_t *b, size_t n)
{
    float *f = malloc(4 * n + 4);
    for (size_t i = 0; i < n; i++) f[i] = v41_bf16_to_f32(b[i]);
    return f;
}

/* bit-for-bit equality of n 16-bit values */
static void check_u16_eq(const char *what, const uint16_t *got, const uint16_t *exp, size_t n)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i] != exp[i]) { if (!bad++) first = i; }
    ck_assert_msg(bad == 0, "%s: %zu of %zu differ; first at %zu: got 0x%04x want 0x%04x", what, bad, n, first,
                  bad ? got[first] : 0, bad ? exp[first] : 0);
}
/* bf16 outputs: each within tol[i] (absolute) of the expected value, and at most
 * max_diff elements not bit-identical (a rounding straddle is rare: the fp32 values
 * differ by a few ulps in 2^16). */
static void check_bf16_near(const char *what, const uint16_t *got, const uint16_t *exp, const double *tol, size_t n,
                            size_t max_diff)
{
    size_t bad = 0, worst = 0, diff = 0;
    double wd = -1;
    for (size_t i = 0; i < n; i++) {
        if (got[i] == exp[i]) continue;
        diff++;
        double g = v41_bf16_to_f32(got[i]), e = v41_bf16_to_f32(exp[i]);
        double d = (isnan(g) || isnan(e) || isinf(g) || isinf(e)) ? INFINITY : fabs(g - e);
        if (d > tol[i]) { bad++; if (d - tol[i] > wd) { wd = d - tol[i]; worst = i; } }
    }
    ck_assert_msg(bad == 0, "%s: %zu of %zu outside tolerance; worst at %zu: got %.9g want %.9g", what, bad, n, worst,
                  (double)v41_bf16_to_f32(got[worst]), (double)v41_bf16_to_f32(exp[worst]));
    ck_assert_msg(diff <= max_diff, "%s: %zu of %zu not bit-identical (more than %zu)", what, diff, n, max_diff);
}
static const double BF_ULP = 1.0 / 128;        /* one bf16 ulp, relative bound (2^-7) */
static const double F_ULP = 1.0 / 8388608.0;   /* one fp32 ulp, relative bound (2^-23) */

/* ------------------------------------------------------------ rms_scale */
/* {T, h, D}: n = h * D, mix = (2 + h) h */
/* {64, 4, 5120}: the V4.1-Flash decode shape (n = 20480); n odd / not a multiple of 8: rows start
 * at other 16-byte offsets (head, vector body and tail of the row) */
static const int rs_cases[][3] = {{3, 1, 64},   {5, 2, 100},  {4, 4, 1024}, {2, 4, 7168}, {1, 1, 1},
                                  {64, 4, 5120}, {5, 1, 20481}, {7, 1, 13},  {6, 2, 8193}, {9, 1, 7}};
START_TEST(test_rms_scale)
{
    const int T = rs_cases[_i][0], h = rs_cases[_i][1], D = rs_cases[_i][2];
    const int n = h * D, mix = (2 + h) * h;
    const float eps = 1e-6f;
    rng_seed(1000 + _i);
    /* amplitude 3: r ~ 1/sqrt(3), so an unscaled mixes row fails */
    uint16_t *X = rand_bf16((size_t)T * n, 3.0f);
    if (T > 1)
        for (int i = 0; i < n; i++) X[(size_t)n + i] = 0;   /* a zero row: r = 1/sqrtf(eps) */
    const size_t nm = (size_t)T * mix, pad = 8;
    float *m = rand_f32(nm + pad, 2.0f), *exp = malloc(4 * (nm + pad));
    float *xf = bf_to_f(X, (size_t)T * n);
    memcpy(exp, m, 4 * (nm + pad));
    for (int t = 0; t < T; t++) { /* ref hc_mixes */
        float r = v41_rms_rsqrt(xf + (size_t)t * n, n, (double)eps);
        for (int i = 0; i < mix; i++) exp[(size_t)t * mix + i] = exp[(size_t)t * mix + i] * r;
    }
    uint16_t *dX = up(X, 2 * (size_t)T * n);
    float *dm = up(m, 4 * (nm + pad));
    ck_assert_int_eq(v41g_rms_scale(dX, T, n, eps, dm, mix, NULL), 0);
    float *g = down(dm, 4 * (nm + pad));
    /* the mean may differ by 1 ulp (double association) -> r by ~1 ulp -> the product by ~2 */
    check_f32("rms_scale", g, exp, nm, 0, 4 * F_ULP);
    ck_assert_mem_eq(g + nm, m + nm, 4 * pad);   /* nothing past T rows */
    /* a fixed reduction order: the same bits at every run */
    for (int rep = 0; rep < 2; rep++) {
        float *dm2 = up(m, 4 * (nm + pad));
        ck_assert_int_eq(v41g_rms_scale(dX, T, n, eps, dm2, mix, NULL), 0);
        float *g2 = down(dm2, 4 * (nm + pad));
        ck_assert_mem_eq(g2, g, 4 * (nm + pad));
        v41g_free(dm2);
        free(g2);
    }
    v41g_free(dX); v41g_free(dm);
    free(X); free(m); free(exp); free(xf); free(g);
}
END_TEST

/* ------------------------------------------------------------ sinkhorn */
/* {h, iters, T} (h * h lanes a token: T = 37 leaves part of the last block past T) */
static const int sk_cases[][3] = {{1, 20, 37}, {2, 20, 37}, {4, 20, 37}, {4, 1, 37}, {2, 3, 37}, {4, 0, 37},
                                  {4, 20, 64}, {4, 20, 1},  {1, 20, 300}, {2, 20, 33}};
START_TEST(test_sinkhorn)
{
    const int h = sk_cases[_i][0], iters = sk_cases[_i][1], T = sk_cases[_i][2], mix = (2 + h) * h;
    const float eps = 1e-6f;
    rng_seed(2000 + _i);
    float *m = rand_f32((size_t)T * mix, 2.0f), *base = rand_f32(mix, 1.0f), sc3[3];
    for (int i = 0; i < 3; i++) sc3[i] = 1.0f + 0.5f * rng_unit();
    float *pre = malloc(4 * (size_t)T * h), *post = malloc(4 * (size_t)T * h), *comb = malloc(4 * (size_t)T * h * h);
    for (int t = 0; t < T; t++)
        v41_hc_split_sinkhorn(m + (size_t)t * mix, sc3, base, h, iters, eps, pre + (size_t)t * h,
                              post + (size_t)t * h, comb + (size_t)t * h * h, false);
    float *dm = up(m, 4 * (size_t)T * mix), *db = up(base, 4 * (size_t)mix), *ds = up(sc3, sizeof sc3);
    float *dpre = dpoison(4 * (size_t)T * h), *dpost = dpoison(4 * (size_t)T * h);
    float *dcomb = dpoison(4 * (size_t)T * h * h);
    ck_assert_int_eq(v41g_sinkhorn(dm, ds, db, T, h, iters, eps, dpre, dpost, dcomb, NULL), 0);
    float *gpre = down(dpre, 4 * (size_t)T * h), *gpost = down(dpost, 4 * (size_t)T * h);
    float *gcomb = down(dcomb, 4 * (size_t)T * h * h);
    /* sigmoid: expf within 2 ulp (3 with glibc's own error), 1 + e and the division
     * add <= 1 ulp each: 8 ulps */
    check_f32("sinkhorn pre", gpre, pre, (size_t)T * h, 0, 8 * F_ULP);
    check_f32("sinkhorn post", gpost, post, (size_t)T * h, 0, 8 * F_ULP);
    /* softmax entries within a few ulps; each of the <= 2 iters normalisations adds
     * ~2 ulps of rounding on slightly different operands: 4 + 4 * 20 < 128 ulps */
    check_f32("sinkhorn comb", gcomb, comb, (size_t)T * h * h, 0, 128 * F_ULP);
    ck_assert_int_ne(v41g_sinkhorn(dm, ds, db, T, 3, iters, eps, dpre, dpost, dcomb, NULL), 0);   /* h = 3 */
    v41g_free(dm); v41g_free(db); v41g_free(ds); v41g_free(dpre); v41g_free(dpost); v41g_free(dcomb);
    free(m); free(base); free(pre); free(post); free(comb); free(gpre); free(gpost); free(gcomb);
}
END_TEST

/* ------------------------------------------------------------ hc_mean */
/* {T, h, D, ld_y} */
static const int hm_cases[][4] = {{3, 1, 64, 64}, {4, 2, 100, 130}, {5, 4, 512, 512}, {2, 4, 7, 9}, {1, 2, 1, 1}};
START_TEST(test_hc_mean)
{
    const int T = hm_cases[_i][0], h = hm_cases[_i][1], D = hm_cases[_i][2], ld = hm_cases[_i][3];
    rng_seed(3000 + _i);
    const size_t nx = (size_t)T * h * D, ny = (size_t)(T - 1) * ld + D;
    uint16_t *X = rand_bf16(nx, 4.0f);
    for (size_t i = 0; i < nx; i += 5) X[i] = 0x8000;   /* -0: ref's s = 0 + (-0) is +0 */
    float *xf = bf_to_f(X, nx);
    uint16_t *exp = malloc(2 * ny);
    memset(exp, 0xff, 2 * ny);   /* the gaps between rows stay poisoned */
    for (int t = 0; t < T; t++) /* ref_forward, DSpark main hidden */
        for (int k = 0; k < D; k++) {
            float s = 0;
            for (int j = 0; j < h; j++) s += xf[(size_t)t * h * D + (size_t)j * D + k];
            s = s / (float)h;
            exp[(size_t)t * ld + k] = v41_f32_to_bf16(v41_bf16r(s));
        }
    uint16_t *dX = up(X, 2 * nx), *dy = dpoison(2 * ny);
    ck_assert_int_eq(v41g_hc_mean(dX, T, h, D, dy, ld, NULL), 0);
    uint16_t *g = down(dy, 2 * ny);
    check_u16_eq("hc_mean", g, exp, ny);   /* same fp32 operations: exact */
    v41g_free(dX); v41g_free(dy);
    free(X); free(xf); free(exp); free(g);
}
END_TEST

/* ------------------------------------------------------------ engram gate */
/* {T, h, D} */
static const int eg_cases[][3] = {{3, 1, 64}, {2, 2, 256}, {4, 4, 1000}, {1, 4, 4096}, {2, 2, 33}};
START_TEST(test_engram_gate)
{
    const int T = eg_cases[_i][0], h = eg_cases[_i][1], D = eg_cases[_i][2];
    const float eps = 1e-6f;
    rng_seed(4000 + _i);
    const size_t nx = (size_t)T * h * D, nkv = (size_t)T * (h + 1) * D, pad = 16;
    uint16_t *X = rand_bf16(nx + pad, 2.0f), *kv = rand_bf16(nkv, 2.0f);
    float *wq = rand_f32((size_t)h * D, 1.0f);
    for (int i = 0; i < D; i++) X[i] = 0;   /* row (0, 0) zero: dot = 0, the 1e-6 floor */
    float *xf = bf_to_f(X, nx), *kvf = bf_to_f(kv, nkv);
    uint16_t *exp = malloc(2 * (nx + pad));
    double *tol = malloc(sizeof(double) * nx);
    memcpy(exp, X, 2 * (nx + pad));
    const int N = (h + 1) * D;
    for (int t = 0; t < T; t++) { /* ref engram(), emu: the gate is ref's own function */
        const float *kt = kvf + (size_t)t * N, *val = kt + (size_t)h * D;
        for (int j = 0; j < h; j++) {
            const float *hr = xf + ((size_t)t * h + j) * D;
            float g = v41_engram_gate(hr, kt + (size_t)j * D, wq + (size_t)j * D, D, (double)eps);
            /* tolerance: g within a few ulps (expf; the double sum's association, which
             * under cancellation is relative to sum |terms|, moves dot by ~D 2^-53 of
             * that, negligible); h + g*v then within a few ulps of max(|h|, |g v|)
             * before the bf16 rounding: one bf16 ulp of the result plus 2^-20 of
             * (|h| + |v|) for results near zero */
            for (int i = 0; i < D; i++) {
                float v = hr[i] + g * val[i];
                size_t q = ((size_t)t * h + j) * D + i;
                exp[q] = v41_f32_to_bf16(v41_bf16r(v));
                tol[q] = BF_ULP * fabs(v) + (fabs(hr[i]) + fabs(val[i])) / 1048576.0;
            }
        }
    }
    uint16_t *dX = up(X, 2 * (nx + pad)), *dkv = up(kv, 2 * nkv);
    float *dw = up(wq, 4 * (size_t)h * D);
    ck_assert_int_eq(v41g_engram_gate(dkv, dw, T, h, D, eps, dX, NULL), 0);
    uint16_t *g = down(dX, 2 * (nx + pad));
    check_bf16_near("engram_gate", g, exp, tol, nx, nx / 64 + 1);
    check_u16_eq("engram_gate past the rows", g + nx, X + nx, pad);
    v41g_free(dX); v41g_free(dkv); v41g_free(dw);
    free(X); free(kv); free(wq); free(xf); free(kvf); free(exp); free(tol); free(g);
}
END_TEST

/* ------------------------------------------------------------ argmax */
static int argmax_f(const float *x, int n) /* ref/engine.c */
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}
/* Crafted rows for the vocabulary-sized cases (the row is split over several CTAs; the split is
 * device dependent, so maxima are placed around many candidate boundaries), kind = t % 12. */
static void am_craft(float *r, int V, int kind)
{
    const float nan = NAN, inf = INFINITY;
    switch (kind) {
    case 0: r[V - 1] = 10.0f; break;                                 /* the very last index */
    case 1: r[0] = r[V / 2] = r[V - 1] = 10.0f; break;               /* index 0 */
    case 2: /* duplicated maxima on both sides of multiples of 2048, 4096, 14368 (T = 64 on 132 SMs) */
        for (int j = 1; 2048 * j + 1 < V; j++) r[2048 * j - 1] = r[2048 * j] = r[2048 * j + 1] = 9.0f;
        for (int j = 1; 14368 * j + 1 < V; j++) r[14368 * j - 1] = r[14368 * j + 1] = 9.0f;
        break;
    case 3: /* ties at random places in the second half, the first one anywhere there */
        for (int q = 0; q < 40; q++) r[V / 2 + rng_int(V - V / 2)] = 8.0f;
        break;
    case 4: for (int i = 0; i < V; i++) r[i] = 0.5f; break;         /* all equal -> 0 */
    case 5: r[0] = nan; r[V - 2] = 100.0f; break;                    /* NaN at 0 -> 0 */
    case 6: /* NaN everywhere but x[0] = -inf and two equal values (a NaN x[0] would pin 0) */
        for (int i = 0; i < V; i++) r[i] = nan;
        r[0] = -inf;
        r[V - 1] = r[V - 29280] = 3.0f;
        break;
    case 7: for (int i = 0; i < V; i++) r[i] = nan; break;          /* -> 0 */
    case 8: /* -inf and NaN: x[0] = -inf is the (first) largest non-NaN */
        for (int i = 0; i < V; i++) r[i] = (i % 5 == 2) ? nan : -inf;
        break;
    case 9: r[77777] = r[77778] = r[V - 1] = r[100003] = inf; r[66666] = nan; break;   /* -> 77777 */
    case 10: /* -0 == +0: the first one */
        for (int i = 0; i < V; i++) r[i] = -1.0f;
        r[1] = -0.0f; r[3] = 0.0f; r[V - 1] = 0.0f;
        break;
    default: break;   /* random */
    }
}
/* {T, V, offset of the first row from an aligned allocation (floats)} */
static const int am_cases[][3] = {{4, 1000, 0},   {3, 1, 0},      {9, 777, 0},    {8, 1000, 0}, {2, 129280, 0},
                                  {5, 256, 0},    {64, 129280, 0}, {24, 129279, 0}, {12, 129280, 1}, {1, 129280, 0},
                                  {300, 20000, 0}};
START_TEST(test_argmax)
{
    const int T = am_cases[_i][0], V = am_cases[_i][1], off = am_cases[_i][2];
    rng_seed(5000 + _i);
    float *x = rand_f32((size_t)T * V + off, 5.0f) + off;
    const float nan = NAN, inf = INFINITY;
    if (_i == 2) { /* ties: the first index must win, across threads, warps and strides */
        float *r;
        r = x + 0 * V; r[100] = r[500] = r[776] = 9.0f;
        r = x + 1 * V; for (int i = 0; i < V; i++) r[i] = 0.0f;   /* all equal -> 0 */
        r = x + 2 * V; r[3] = r[259] = r[515] = 7.0f;             /* same thread (stride 256) */
        r = x + 3 * V; r[35] = r[2] = r[33] = 7.0f;               /* same warp, other lanes */
        r = x + 4 * V; r[700] = r[68] = 6.5f; r[300] = 6.5f;      /* other warps */
        r = x + 5 * V; r[0] = 8.0f; r[256] = 8.0f;                /* index 0 */
        r = x + 6 * V; r[776] = 8.0f;                             /* last index, V % 256 != 0 */
        r = x + 7 * V; for (int i = 0; i < V; i++) r[i] = -inf;   /* all -inf -> 0 */
        r = x + 8 * V; r[1] = 0.0f; r[2] = -0.0f; for (int i = 3; i < V; i++) r[i] = -1.0f; r[0] = -0.0f;
    }
    if (_i == 3) { /* NaN: argmax_f never moves off a NaN x[0], never lands on a NaN */
        float *r;
        r = x + 0 * V; r[0] = nan; r[10] = 100.0f;                /* -> 0 */
        r = x + 1 * V; r[5] = nan; r[6] = 50.0f; r[999] = nan;   /* -> 6 */
        r = x + 2 * V; for (int i = 0; i < V; i++) r[i] = nan;    /* -> 0 */
        r = x + 3 * V; for (int i = 0; i < V; i++) r[i] = nan; r[0] = -inf;  /* -> 0 */
        r = x + 4 * V; for (int i = 0; i < V; i++) r[i] = nan; r[0] = -5.0f; r[700] = -1.0f; r[3] = -2.0f;  /* -> 700 */
        r = x + 5 * V; r[999] = inf; r[998] = inf;                /* -> 998 */
        r = x + 6 * V; r[0] = -inf; for (int i = 1; i < V; i++) r[i] = (i % 2) ? nan : -inf;  /* -> 0 */
        r = x + 7 * V; for (int i = 0; i < V; i++) r[i] = (i % 3) ? nan : 1.0f; r[999] = 2.0f;  /* 999 */
    }
    if (_i == 4) x[V + 129279] = 10.0f;   /* the last element of row 1 */
    if (_i >= 6 && V >= 100004)
        for (int t = 0; t < T; t++) am_craft(x + (size_t)t * V, V, t % 12);
    int32_t *exp = malloc(4 * (size_t)T);
    for (int t = 0; t < T; t++) exp[t] = argmax_f(x + (size_t)t * V, V);
    if (_i >= 6 && V >= 100004) { /* the crafted rows themselves */
        static const int32_t want[11] = {-1, 0, 2047, -2, 0, 0, -3, 0, 0, 77777, 1};
        for (int t = 0; t < T && t < 11; t++) {
            if (want[t] >= 0) ck_assert_int_eq(exp[t], want[t]);
            if (want[t] == -1) ck_assert_int_eq(exp[t], V - 1);
            if (want[t] == -2) ck_assert_int_ge(exp[t], V / 2);
            if (want[t] == -3) ck_assert_int_eq(exp[t], V - 29280);
        }
    }
    float *dx0 = up(x - off, 4 * ((size_t)T * V + off)), *dx = dx0 + off;
    int32_t *dout = dpoison(4 * (size_t)T);
    ck_assert_int_eq(v41g_argmax_rows(dx, T, V, dout, NULL), 0);
    int32_t *g = down(dout, 4 * (size_t)T);
    for (int t = 0; t < T; t++) ck_assert_msg(g[t] == exp[t], "argmax row %d: got %d want %d", t, g[t], exp[t]);
    /* again into the same output (the scratch of the split rows is per call) */
    ck_assert_int_eq(v41g_memset(dout, 0xff, 4 * (size_t)T), 0);
    ck_assert_int_eq(v41g_argmax_rows(dx, T, V, dout, NULL), 0);
    int32_t *g2 = down(dout, 4 * (size_t)T);
    ck_assert_mem_eq(g2, exp, 4 * (size_t)T);
    v41g_free(dx0); v41g_free(dout);
    free(x - off); free(exp); free(g); free(g2);
}
END_TEST

/* ------------------------------------------------------------ moe_ptrs */
/* distinct random ids in [0, ne) per row */
static void rand_ids(int32_t *ix, int T, int k, int ne)
{
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int32_t e;
            int dup;
            do {
                e = (int32_t)(rng_u32() % (uint32_t)ne);
                dup = 0;
                for (int jj = 0; jj < j; jj++) dup |= ix[(size_t)t * k + jj] == e;
            } while (dup);
            ix[(size_t)t * k + j] = e;
        }
}
static const int mp_k[] = {1, 2, 6};
START_TEST(test_moe_ptrs)
{
    /* the full model's sizes: e * 2I * D elements reach 1.5e10 bytes (64-bit offsets).
     * The bases are fake addresses (the kernel only computes pointers): each table
     * has its own, so a mixed-up table is caught too. */
    const int T = 5, k = mp_k[_i], D = 7168, I = 2048, ne = 256, n = T * k;
    rng_seed(6000 + _i);
    int32_t *ix = malloc(4 * (size_t)n);
    rand_ids(ix, T, k, ne);
    ix[0] = ne - 1;
    const uintptr_t bx = 0x10000000000ull, bw13 = 0x20000000000ull, bw2 = 0x40000000000ull,
                    bh13 = 0x60000000000ull, bh = 0x70000000000ull, by = 0x78000000000ull;
    const uint16_t *x = (const uint16_t *)bx, *w13 = (const uint16_t *)bw13, *w2 = (const uint16_t *)bw2,
                   *h13 = (const uint16_t *)bh13, *h = (const uint16_t *)bh, *y = (const uint16_t *)by;
    int32_t *dix = up(ix, 4 * (size_t)n);
    void *tab[6];
    for (int q = 0; q < 6; q++) tab[q] = dpoison(sizeof(void *) * (size_t)n);
    ck_assert_int_eq(v41g_moe_ptrs(dix, T, k, D, I, x, w13, w2, h13, h, y, (const void **)tab[0],
                                   (const void **)tab[1], (const void **)tab[2], (void **)tab[3],
                                   (const void **)tab[4], (void **)tab[5], NULL), 0);
    uint64_t *g[6];
    for (int q = 0; q < 6; q++) g[q] = down(tab[q], sizeof(void *) * (size_t)n);
    for (int a = 0; a < n; a++) {
        const uint64_t t = (uint64_t)(a / k), e = (uint64_t)ix[a], sD = (uint64_t)D, sI = (uint64_t)I;
        const uint64_t want[6] = {bx + 2 * t * sD, bw13 + 2 * e * 2 * sI * sD, bw2 + 2 * e * sD * sI,
                                  bh13 + 2 * (uint64_t)a * 2 * sI, bh + 2 * (uint64_t)a * sI,
                                  by + 2 * (uint64_t)a * sD};
        static const char *nm[6] = {"xp", "w13p", "w2p", "h13p", "hp", "yp"};
        for (int q = 0; q < 6; q++)
            ck_assert_msg(g[q][a] == want[q], "moe_ptrs %s[%d]: got 0x%llx want 0x%llx", nm[q], a,
                          (unsigned long long)g[q][a], (unsigned long long)want[q]);
    }
    v41g_free(dix);
    for (int q = 0; q < 6; q++) { v41g_free(tab[q]); free(g[q]); }
    free(ix);
}
END_TEST

/* ------------------------------------------------------------ swiglu */
/* {n, I, L (0: no clamp), wts} */
static const struct { int n, I; float L; int wts; } sw_cases[] = {
    {5, 64, 0.0f, 0}, {7, 300, 7.0f, 1}, {3, 2048, 10.0f, 0}, {4, 129, 0.0f, 1}, {1, 1, 7.0f, 1}};
START_TEST(test_swiglu)
{
    const int n = sw_cases[_i].n, I = sw_cases[_i].I, hw = sw_cases[_i].wts;
    const float L = sw_cases[_i].L;
    rng_seed(7000 + _i);
    const size_t nh = (size_t)n * 2 * I, no = (size_t)n * I;
    uint16_t *h13 = rand_bf16(nh, 12.0f);   /* beyond L = 7 and 10: the clamps act */
    float *wts = rand_f32(n, 1.0f), *hf = bf_to_f(h13, nh);
    uint16_t *exp = malloc(2 * no);
    double *tol = malloc(sizeof(double) * no);
    for (int t = 0; t < n; t++) /* ref expert_fwd, emu */
        for (int i = 0; i < I; i++) {
            float gv = hf[(size_t)t * 2 * I + i], uv = hf[(size_t)t * 2 * I + I + i];
            if (L > 0) {
                if (uv < -L) uv = -L;
                if (uv > L) uv = L;
                if (gv > L) gv = L;
            }
            float hh = (gv / (1.0f + expf(-gv))) * uv;
            if (hw) hh = wts[t] * hh;
            exp[(size_t)t * I + i] = v41_f32_to_bf16(v41_bf16r(hh));
            /* a product chain (no cancellation): a few fp32 ulps from expf, then at most
             * one bf16 ulp of the result */
            tol[(size_t)t * I + i] = BF_ULP * fabs(hh);
        }
    uint16_t *dh = up(h13, 2 * nh), *dout = dpoison(2 * no);
    float *dw = up(wts, 4 * (size_t)n);
    ck_assert_int_eq(v41g_swiglu(dh, n, I, L, hw ? dw : NULL, dout, NULL), 0);
    uint16_t *g = down(dout, 2 * no);
    check_bf16_near("swiglu", g, exp, tol, no, no / 64 + 1);
    v41g_free(dh); v41g_free(dout); v41g_free(dw);
    free(h13); free(wts); free(hf); free(exp); free(tol); free(g);
}
END_TEST

/* ------------------------------------------------------------ moe_combine */
/* {k, shared, repeated ids, D, T}: D % 8 == 0 takes the 16-byte path (5120 x 64 x 6: the V4.1-Flash
 * decode shape), D = 300 the one-element path */
static const int mc_cases[][5] = {{1, 1, 0, 300, 4}, {1, 0, 0, 300, 4}, {2, 1, 0, 300, 4},   {2, 0, 0, 300, 4},
                                  {6, 1, 0, 300, 4}, {6, 0, 0, 300, 4}, {6, 1, 1, 300, 4},   {6, 1, 0, 5120, 64},
                                  {6, 0, 1, 5120, 64}, {6, 1, 1, 1032, 5}, {9, 1, 1, 2056, 3}, {3, 0, 0, 8, 7},
                                  {5, 1, 0, 1028, 2}};
START_TEST(test_moe_combine)
{
    const int k = mc_cases[_i][0], hs = mc_cases[_i][1], rep = mc_cases[_i][2], D = mc_cases[_i][3],
              T = mc_cases[_i][4];
    rng_seed(8000 + _i);
    int32_t *ix = malloc(4 * (size_t)T * k);
    rand_ids(ix, T, k, 64);
    for (int j = 0; j < k; j++) /* row 0 in descending id order: its sorted order is reversed */
        for (int jj = j + 1; jj < k; jj++)
            if (ix[jj] > ix[j]) { int32_t e = ix[j]; ix[j] = ix[jj]; ix[jj] = e; }
    if (rep) { /* equal ids: the choice order breaks them */
        ix[0] = ix[3] = ix[5] = 9;
        ix[k + 1] = ix[k + 2] = 1;
    }
    /* the order must show through the bf16 rounding of the result: half the expert
     * values are +-2^24 (exact in bf16; fp32's ulp there is 2), the others in +-[1, 2).
     * 2^24 + 1.5 - 2^24 = 2 but -2^24 + 2^24 + 1.5 = 1.5: another order gives another
     * bf16 result wherever big terms cancel around small ones. */
    const size_t ny = (size_t)T * k * D, no = (size_t)T * D;
    uint16_t *ye = malloc(2 * ny), *sh = rand_bf16(no, 3.0f);
    for (size_t q = 0; q < ny; q++) {
        float v = (rng_u32() & 1) ? 16777216.0f : 1.0f + (float)(rng_u32() % 128) / 128.0f;
        ye[q] = v41_f32_to_bf16((rng_u32() & 1) ? -v : v);
    }
    float *yf = bf_to_f(ye, ny), *sf = bf_to_f(sh, no);
    uint16_t *exp = malloc(2 * no);
    size_t n_order = 0;
    for (int t = 0; t < T; t++) { /* ref moe(): choices by ascending expert id, acc from 0 */
        int ord[64];
        for (int j = 0; j < k; j++) {
            int b2 = j - 1;
            while (b2 >= 0 && ix[(size_t)t * k + ord[b2]] > ix[(size_t)t * k + j]) { ord[b2 + 1] = ord[b2]; b2--; }
            ord[b2 + 1] = j;
        }
        for (int d = 0; d < D; d++) {
            float acc = 0;
            for (int j = 0; j < k; j++) acc += yf[((size_t)t * k + ord[j]) * D + d];
            float v = acc + (hs ? sf[(size_t)t * D + d] : 0.0f);
            exp[(size_t)t * D + d] = v41_f32_to_bf16(v41_bf16r(v));
            float a2 = 0; /* the same sum in choice order: the data must tell the orders apart */
            for (int j = 0; j < k; j++) a2 += yf[((size_t)t * k + j) * D + d];
            float v2 = a2 + (hs ? sf[(size_t)t * D + d] : 0.0f);
            n_order += v41_f32_to_bf16(v41_bf16r(v2)) != exp[(size_t)t * D + d];
        }
    }
    /* (k <= 2: 0 + a + b = 0 + b + a, fp32 addition commutes: any order is right) */
    if (k > 2) ck_assert_msg(n_order > 0, "moe_combine: the test data does not depend on the order");
    uint16_t *dye = up(ye, 2 * ny), *dsh = up(sh, 2 * no), *dout = dpoison(2 * no);
    int32_t *dix = up(ix, 4 * (size_t)T * k);
    ck_assert_int_eq(v41g_moe_combine(dye, dix, hs ? dsh : NULL, T, k, D, dout, NULL), 0);
    uint16_t *g = down(dout, 2 * no);
    check_u16_eq("moe_combine", g, exp, no);   /* same additions in the same order: exact */
    if (hs) { /* in place: out = shared */
        ck_assert_int_eq(v41g_moe_combine(dye, dix, dsh, T, k, D, dsh, NULL), 0);
        uint16_t *g2 = down(dsh, 2 * no);
        check_u16_eq("moe_combine in place", g2, exp, no);
        free(g2);
    }
    v41g_free(dye); v41g_free(dsh); v41g_free(dout); v41g_free(dix);
    free(ix); free(ye); free(sh); free(yf); free(sf); free(exp); free(g);
}
END_TEST

/* ------------------------------------------------------------ empty calls */
START_TEST(test_empty)
{ /* T == 0 / n == 0: no launch, no access (NULL pointers), 0 */
    ck_assert_int_eq(v41g_rms_scale(NULL, 0, 64, 1e-6f, NULL, 6, NULL), 0);
    ck_assert_int_eq(v41g_sinkhorn(NULL, NULL, NULL, 0, 4, 20, 1e-6f, NULL, NULL, NULL, NULL), 0);
    ck_assert_int_eq(v41g_hc_mean(NULL, 0, 4, 64, NULL, 64, NULL), 0);
    ck_assert_int_eq(v41g_engram_gate(NULL, NULL, 0, 4, 64, 1e-6f, NULL, NULL), 0);
    ck_assert_int_eq(v41g_argmax_rows(NULL, 0, 100, NULL, NULL), 0);
    ck_assert_int_eq(v41g_moe_ptrs(NULL, 0, 6, 64, 32, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                   NULL, NULL, NULL), 0);
    ck_assert_int_eq(v41g_swiglu(NULL, 0, 32, 0.0f, NULL, NULL, NULL), 0);
    ck_assert_int_eq(v41g_moe_combine(NULL, NULL, NULL, 0, 6, 64, NULL, NULL), 0);
    ck_assert_int_eq(v41g_sync(), 0);
}
END_TEST

static Suite *dev_b_suite(void)
{
    Suite *s = suite_create("gpu_dev_b");
    TCase *tc = tcase_create("hc");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_rms_scale, 0, (int)(sizeof rs_cases / sizeof rs_cases[0]));
    tcase_add_loop_test(tc, test_sinkhorn, 0, (int)(sizeof sk_cases / sizeof sk_cases[0]));
    tcase_add_loop_test(tc, test_hc_mean, 0, (int)(sizeof hm_cases / sizeof hm_cases[0]));
    tcase_add_loop_test(tc, test_engram_gate, 0, (int)(sizeof eg_cases / sizeof eg_cases[0]));
    suite_add_tcase(s, tc);
    tc = tcase_create("head_moe");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_argmax, 0, (int)(sizeof am_cases / sizeof am_cases[0]));
    tcase_add_loop_test(tc, test_moe_ptrs, 0, (int)(sizeof mp_k / sizeof mp_k[0]));
    tcase_add_loop_test(tc, test_swiglu, 0, (int)(sizeof sw_cases / sizeof sw_cases[0]));
    tcase_add_loop_test(tc, test_moe_combine, 0, (int)(sizeof mc_cases / sizeof mc_cases[0]));
    tcase_add_test(tc, test_empty);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    if (!gpu_present()) {
        printf("test_gpu_dev_b: no CUDA device: skipped\n");
        return 77;
    }
    SRunner *sr = srunner_create(dev_b_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
#endif
