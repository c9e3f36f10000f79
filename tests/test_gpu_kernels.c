/* test_gpu_kernels: every CUDA kernel of gpu/ against a CPU computation written
 * from SPEC.md (tests/gpu_cpu_ref.c), random inputs drawn fresh per case,
 * outputs poisoned (NaN bits) before each launch so an unwritten element fails.
 * Exit 77 (skip) when the build has no CUDA or the machine has no device; CUDA
 * is initialised only inside the forked tests (a probe child decides the skip).
 *
 * Tolerances. bf16 has 8 significant bits: one rounding is within 2^-9
 * relative, and two computations that agree before the final rounding to
 * within a few fp32 ulps can still round to adjacent bf16 values, i.e. differ
 * by one bf16 ulp = 2^-7 relative (2^-8 at the top of a binade). Where the GPU
 * and CPU differ only in fp32 summation order or FMA contraction before one
 * bf16 rounding, the bound is therefore 2^-7 |ref| plus a small absolute term
 * for values near zero (cancellation: n * 2^-24 * sum|terms|). Exact ops
 * (act_quant, fp4_qdq, top-k on given scores, padding/constant cases) are
 * compared bit for bit. */
#include "config.h"
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef HAVE_CUDA
int main(void)
{
    printf("test_gpu_kernels: built without CUDA: skipped\n");
    return 77;
}
#else
#include "v41_gpu.h"
#include "test_gpu_probe.h"
#include "test_gpu_util.h"
#include "gpu_cpu_ref.h"

static uint16_t *rand_bf16(size_t n, float amp)
{
    uint16_t *x = malloc(2 * n);
    for (size_t i = 0; i < n; i++) x[i] = cr_f2bf(amp * rng_unit());
    return x;
}

static void check_bf16(const char *what, const uint16_t *got, const uint16_t *exp, size_t n, double atol, double rtol)
{
    float *g = malloc(4 * n), *e = malloc(4 * n);
    for (size_t i = 0; i < n; i++) { g[i] = cr_bf2f(got[i]); e[i] = cr_bf2f(exp[i]); }
    check_f32(what, g, e, n, atol, rtol);
    free(g); free(e);
}
static const double BF_ULP = 1.0 / 128;   /* one bf16 ulp, relative (2^-7) */

/* ------------------------------------------------------------ RMSNorm */
static const int rms_shapes[][2] = {{1, 128}, {7, 5120}, {33, 100}, {2, 8}};
START_TEST(test_rmsnorm)
{
    int rows = rms_shapes[_i][0], dim = rms_shapes[_i][1];
    rng_seed(100 + _i);
    uint16_t *x = rand_bf16((size_t)rows * dim, 3.0f), *w = rand_bf16(dim, 1.0f), *y = malloc(2 * (size_t)rows * dim);
    cr_rmsnorm(x, w, y, rows, dim, 1e-6f);
    uint16_t *dx = up(x, 2 * (size_t)rows * dim), *dw = up(w, 2 * dim), *dy = dpoison(2 * (size_t)rows * dim);
    ck_assert_int_eq(v41g_rmsnorm(dx, dw, dy, rows, dim, 1e-6f, NULL), 0);
    uint16_t *g = down(dy, 2 * (size_t)rows * dim);
    /* fp32 sums in another order: rsqrt differs by a few ulps -> at most one bf16 ulp */
    check_bf16("rmsnorm", g, y, (size_t)rows * dim, 1e-30, BF_ULP);
    v41g_free(dx); v41g_free(dw); v41g_free(dy);
    free(x); free(w); free(y); free(g);
}
END_TEST

/* ------------------------------------------------------------ RoPE */
START_TEST(test_rope)
{
    int rows = 5, heads = 3, d = 64, r = 16;
    rng_seed(200);
    float fr[8];
    cr_rope_freqs(r, 40000.0, 32, 4.0, 32, 1, fr);
    float gf[8];
    v41g_rope_freqs(r, 40000.0, 32, 4.0, 32, 1, gf);
    ck_assert_mem_eq(fr, gf, sizeof fr);   /* same host formula */
    int32_t pos[5] = {0, 1, 37, 4095, 100000};
    size_t n = (size_t)rows * heads * d;
    for (int inv = 0; inv < 2; inv++) {
        uint16_t *x = rand_bf16(n, 2.0f), *y = malloc(2 * n);
        memcpy(y, x, 2 * n);
        cr_rope(y, pos, fr, rows, heads, d, r, inv);
        uint16_t *dx = up(x, 2 * n);
        int32_t *dp = up(pos, sizeof pos);
        float *df = up(fr, sizeof fr);
        ck_assert_int_eq(v41g_rope(dx, dp, df, rows, heads, d, r, inv, NULL), 0);
        uint16_t *g = down(dx, 2 * n);
        /* device cosf/sinf are within 2 fp32 ulps of glibc's: one bf16 ulp, plus
         * 2^-21 * (|a|+|b|) <= 2^-20 absolute for outputs near zero after cancellation */
        check_bf16(inv ? "rope inverse" : "rope", g, y, n, 4.0 * 9.6e-7, BF_ULP);
        /* first d-r dims untouched */
        for (int rr = 0; rr < rows * heads; rr++)
            ck_assert_mem_eq(g + (size_t)rr * d, x + (size_t)rr * d, 2 * (d - r));
        v41g_free(dx); v41g_free(dp); v41g_free(df);
        free(x); free(y); free(g);
    }
    /* The vectorized kernel at several rows a block with the last block partial (1001 x 3 heads,
     * r = 16: 32 rows a block; 37 x 1 head: 8 rows a block) and at the model's q shape (one row a
     * block): against the CPU as above, and bit for bit against the one-pair-a-thread kernel, which
     * v41g_rope takes for x only 8-byte aligned (the same buffer 4 elements in). */
    static const int shp[][4] = {{1001, 3, 64, 16}, {531, 64, 512, 64}, {37, 1, 512, 64}};
    for (int c = 0; c < 3; c++) {
        int R = shp[c][0], Hh = shp[c][1], D = shp[c][2], Rr = shp[c][3];
        float fq[32];
        cr_rope_freqs(Rr, 160000.0, 65536, 16.0, 32, 1, fq);
        int32_t *ps = malloc(4 * (size_t)R);
        for (int i = 0; i < R; i++) ps[i] = i == 0 ? 0 : i == 1 ? 200000 : rng_int(70000);   /* 200000: sinf's slow path */
        size_t N = (size_t)R * Hh * D;
        int32_t *dp = up(ps, 4 * (size_t)R);
        float *df = up(fq, 4 * (size_t)(Rr / 2));
        for (int inv = 0; inv < 2; inv++) {
            uint16_t *x = rand_bf16(N, 2.0f), *y = malloc(2 * N), *xo = malloc(2 * (N + 4));
            memcpy(y, x, 2 * N);
            memcpy(xo + 4, x, 2 * N);
            memset(xo, 0, 8);
            cr_rope(y, ps, fq, R, Hh, D, Rr, inv);
            uint16_t *dx = up(x, 2 * N), *dxo = up(xo, 2 * (N + 4));
            ck_assert_int_eq(v41g_rope(dx, dp, df, R, Hh, D, Rr, inv, NULL), 0);
            ck_assert_int_eq(v41g_rope(dxo + 4, dp, df, R, Hh, D, Rr, inv, NULL), 0);
            uint16_t *g = down(dx, 2 * N), *go = down(dxo, 2 * (N + 4));
            check_bf16(inv ? "rope inverse (rows a block)" : "rope (rows a block)", g, y, N, 4.0 * 9.6e-7, BF_ULP);
            size_t e = 0;   /* vectorized == generic, bit for bit */
            while (e < N && g[e] == go[4 + e]) e++;
            ck_assert_msg(e == N, "rope shape %d inv %d: vectorized %04x != generic %04x at %zu", c, inv,
                          e < N ? g[e] : 0, e < N ? go[4 + e] : 0, e);
            for (size_t rr = 0; rr < (size_t)R * Hh; rr++)   /* first d-r dims untouched */
                ck_assert_msg(!memcmp(g + rr * D, x + rr * D, 2 * (size_t)(D - Rr)), "rope shape %d: head %zu", c, rr);
            v41g_free(dx); v41g_free(dxo);
            free(x); free(y); free(xo); free(g); free(go);
        }
        v41g_free(dp); v41g_free(df);
        free(ps);
    }
}
END_TEST

/* ------------------------------------------------------------ act_quant */
START_TEST(test_act_quant)
{
    int rows = 9, n = 256;
    rng_seed(300);
    size_t N = (size_t)rows * n;
    uint16_t *x = rand_bf16(N, 1.0f);
    for (int i = 0; i < 32; i++) x[i] = 0;                            /* amax clamps to 1e-4 */
    for (int i = 32; i < 64; i++) x[i] = cr_f2bf(1e-6f * rng_unit());  /* below the clamp */
    for (int i = 64; i < 96; i++) x[i] = cr_f2bf(3e4f * rng_unit());   /* large */
    x[96] = cr_f2bf(448.0f); x[97] = cr_f2bf(-449.0f);
    uint8_t *q = malloc(N), *gq;
    float *sc = malloc(4 * N / 32), *gs;
    uint16_t *deq = malloc(2 * N), *gd;
    cr_act_quant(x, q, sc, deq, rows, n);
    uint16_t *dx = up(x, 2 * N), *dd = dpoison(2 * N);
    uint8_t *dq = dpoison(N);
    float *ds = dpoison(4 * N / 32);
    ck_assert_int_eq(v41g_act_quant(dx, dq, ds, dd, rows, n, NULL), 0);
    gq = down(dq, N); gs = down(ds, 4 * N / 32); gd = down(dd, 2 * N);
    ck_assert_mem_eq(gs, sc, 4 * N / 32);   /* exact: powers of two */
    ck_assert_mem_eq(gq, q, N);             /* exact: one RNE rounding of an exact quotient */
    ck_assert_mem_eq(gd, deq, 2 * N);       /* q*scale is exact in bf16 */
    v41g_free(dx); v41g_free(dq); v41g_free(ds); v41g_free(dd);
    free(x); free(q); free(sc); free(deq); free(gq); free(gs); free(gd);
}
END_TEST

/* ------------------------------------------------------------ fp4 qdq */
static const int fp4_cases[][2] = {{16, 1}, {32, 0}, {16, 0}, {32, 1}};
START_TEST(test_fp4_qdq)
{
    int g = fp4_cases[_i][0], e4 = fp4_cases[_i][1], rows = 7, n = 128;
    rng_seed(400 + _i);
    size_t N = (size_t)rows * n;
    uint16_t *x = rand_bf16(N, 4.0f), *y = malloc(2 * N);
    for (int i = 0; i < g; i++) x[i] = 0;                                   /* zero group */
    for (int i = g; i < 2 * g; i++) x[i] = cr_f2bf(0.25f * (i % 7));        /* exact ties */
    for (int i = 2 * g; i < 3 * g; i++) x[i] = cr_f2bf(1e-30f * rng_unit()); /* tiny: scale floor */
    cr_fp4_qdq(x, y, rows, n, g, e4);
    uint16_t *dx = up(x, 2 * N), *dy = dpoison(2 * N);
    ck_assert_int_eq(v41g_fp4_qdq(dx, dy, rows, n, g, e4, NULL), 0);
    uint16_t *gy = down(dy, 2 * N);
    check_bf16("fp4_qdq", gy, y, N, 0, 0);   /* exact (+0 == -0) */
    v41g_free(dx); v41g_free(dy);
    free(x); free(y); free(gy);
}
END_TEST

/* ------------------------------------------------------------ mHC */
/* {T, h, D}: the first four are the original cases (hD = 1024); then the decode shape (T = 64,
 * hD = 20480: a small T split over K into many slices), T >= 512 (the 128-row tiles and the packed
 * tail: T = 600 at hD = 20480, T = 4096 at hD = 1024, 32 tiles x 4 K slices), and h = 1, 2 with hD
 * not a multiple of the pipeline block (a zero-filled tail block) nor T of the row tile, below and
 * above 512 rows. */
static const int hc_cases[][3] = {{1, 4, 256},    {5, 4, 256},    {37, 4, 256}, {300, 4, 256},
                                  {64, 4, 5120},  {600, 4, 5120}, {4096, 4, 256}, {33, 2, 200},
                                  {70, 1, 136},   {777, 2, 2056}, {530, 1, 136}};
START_TEST(test_hc)
{
    int T = hc_cases[_i][0], h = hc_cases[_i][1], D = hc_cases[_i][2], NM = (2 + h) * h, hD = h * D;
    rng_seed(500 + _i);
    uint16_t *X = rand_bf16((size_t)T * hD, 2.0f), *y = rand_bf16((size_t)T * D, 2.0f);
    /* fn amplitude 0.05 * sqrt(1024 / hD): the dots have the size they have at hD = 1024 (the
     * tolerance derivation below), whatever hD */
    float *fn = rand_f32((size_t)NM * hD, 0.05f * sqrtf(1024.0f / (float)hD)), *base = rand_f32(NM, 0.5f),
          s3[3] = {0.7f, 1.3f, 0.9f};
    float *pre = malloc(4 * T * h), *post = malloc(4 * T * h), *comb = malloc(4 * (size_t)T * h * h);
    cr_hc_mixes(X, fn, base, s3, T, h, D, 1e-20f, 1e-6f, 20, pre, post, comb);
    uint16_t *dX = up(X, 2 * (size_t)T * hD), *dy = up(y, 2 * (size_t)T * D);
    float *dfn = up(fn, 4 * (size_t)NM * hD), *db = up(base, 4 * NM), *ds = up(s3, sizeof s3);
    float *dpre = dpoison(4 * T * h), *dpost = dpoison(4 * T * h), *dcomb = dpoison(4 * (size_t)T * h * h);
    ck_assert_int_eq(v41g_hc_mixes(dX, dfn, db, ds, T, h, D, 1e-20f, 1e-6f, 20, dpre, dpost, dcomb, NULL), 0);
    float *gpre = down(dpre, 4 * T * h), *gpost = down(dpost, 4 * T * h), *gcomb = down(dcomb, 4 * (size_t)T * h * h);
    /* mixes: dots of 1024 terms of |x*fn| <= 0.1 summed in another order: |dm| <= 1024 * 2^-24 * 100 ~ 6e-3 worst
     * case, ~1e-5 typical; sigmoid' <= 1/4 and Sinkhorn is a contraction, so 1e-4 absolute on outputs of O(1).
     * Other hD: the scaled fn keeps |m| as at hD = 1024, and the typical order difference, a random walk of
     * hD roundings of 2^-24 |partial sum| (the CPU's sequential sum; the GPU's chains are shorter), grows as
     * sqrt(hD): at most sqrt(20) ~ 4.5 times the hD = 1024 one, ~5e-5, still under 1e-4 */
    check_f32("hc pre", gpre, pre, (size_t)T * h, 1e-4, 1e-4);
    check_f32("hc post", gpost, post, (size_t)T * h, 1e-4, 1e-4);
    check_f32("hc comb", gcomb, comb, (size_t)T * h * h, 1e-4, 1e-4);
    /* fn split once (as at weight upload) + v41g_hc_mixes2: the same bits as v41g_hc_mixes (which runs
     * the same two steps), at every run (fixed reduction order) */
    {
        uint16_t *dfn2 = dpoison(2 * 2 * (size_t)NM * hD);
        ck_assert_int_eq(v41g_hc_split_fn(dfn, h, D, dfn2, NULL), 0);
        /* rep 0: the allocating call; rep 1: caller scratch of exactly v41g_hc_mixes2_ws_size bytes
         * (poisoned: every partial the finish reads must have been written by this call) */
        const size_t wsn = v41g_hc_mixes2_ws_size(T, h, D);
        ck_assert_uint_gt(wsn, 0);
        void *dws = dpoison(wsn);
        ck_assert_int_ne(v41g_hc_mixes2_ws(dX, dfn2, db, ds, T, h, D, 1e-20f, 1e-6f, 20, dpre, dpost, dcomb, dws,
                                           wsn - 4, NULL), 0);   /* too small: refused, nothing launched */
        ck_assert_uint_eq(v41g_hc_mixes2_ws_size(T, 3, D), 0);    /* h = 3: bad shape */
        for (int rep = 0; rep < 2; rep++) {
            float *dpre2 = dpoison(4 * T * h), *dpost2 = dpoison(4 * T * h), *dcomb2 = dpoison(4 * (size_t)T * h * h);
            ck_assert_int_eq(rep == 0 ? v41g_hc_mixes2(dX, dfn2, db, ds, T, h, D, 1e-20f, 1e-6f, 20, dpre2, dpost2,
                                                       dcomb2, NULL)
                                      : v41g_hc_mixes2_ws(dX, dfn2, db, ds, T, h, D, 1e-20f, 1e-6f, 20, dpre2, dpost2,
                                                          dcomb2, dws, wsn, NULL),
                             0);
            float *p2 = down(dpre2, 4 * T * h), *q2 = down(dpost2, 4 * T * h);
            float *c2 = down(dcomb2, 4 * (size_t)T * h * h);
            ck_assert_mem_eq(p2, gpre, 4 * (size_t)T * h);
            ck_assert_mem_eq(q2, gpost, 4 * (size_t)T * h);
            ck_assert_mem_eq(c2, gcomb, 4 * (size_t)T * h * h);
            v41g_free(dpre2); v41g_free(dpost2); v41g_free(dcomb2);
            free(p2); free(q2); free(c2);
        }
        v41g_free(dfn2);
        v41g_free(dws);
    }
    /* doubly stochastic after Sinkhorn: column sums ~1 */
    for (int t = 0; t < T; t++)
        for (int j = 0; j < h; j++) {
            float s = 0;
            for (int i = 0; i < h; i++) s += gcomb[(size_t)t * h * h + i * h + j];
            ck_assert_msg(fabsf(s - 1.0f) < 1e-3f, "comb column sum %g", s);
        }
    /* hc_pre / hc_post on the CPU's mixes (isolates those kernels) */
    uint16_t *ypre = malloc(2 * (size_t)T * D), *Xo = malloc(2 * (size_t)T * hD);
    cr_hc_pre(X, pre, ypre, T, h, D);
    cr_hc_post(y, X, post, comb, Xo, T, h, D);
    float *cpre = up(pre, 4 * T * h), *cpost = up(post, 4 * T * h), *ccomb = up(comb, 4 * (size_t)T * h * h);
    uint16_t *dyp = dpoison(2 * (size_t)T * D), *dXo = dpoison(2 * (size_t)T * hD);
    ck_assert_int_eq(v41g_hc_pre(dX, cpre, dyp, T, h, D, NULL), 0);
    ck_assert_int_eq(v41g_hc_post(dy, dX, cpost, ccomb, dXo, T, h, D, NULL), 0);
    uint16_t *gyp = down(dyp, 2 * (size_t)T * D), *gXo = down(dXo, 2 * (size_t)T * hD);
    /* <= 5 fp32 terms with FMA contraction on the GPU: one bf16 ulp + 5 * 2^-24 * sum|terms| (<= 20) */
    check_bf16("hc_pre", gyp, ypre, (size_t)T * D, 6e-6, BF_ULP);
    check_bf16("hc_post", gXo, Xo, (size_t)T * hD, 6e-6, BF_ULP);
    /* in place (Xout == X) gives the same */
    ck_assert_int_eq(v41g_hc_post(dy, dX, cpost, ccomb, dX, T, h, D, NULL), 0);
    uint16_t *gXi = down(dX, 2 * (size_t)T * hD);
    ck_assert_mem_eq(gXi, gXo, 2 * (size_t)T * hD);
    v41g_free(dX); v41g_free(dy); v41g_free(dfn); v41g_free(db); v41g_free(ds); v41g_free(dpre); v41g_free(dpost);
    v41g_free(dcomb); v41g_free(cpre); v41g_free(cpost); v41g_free(ccomb); v41g_free(dyp); v41g_free(dXo);
    free(X); free(y); free(fn); free(base); free(pre); free(post); free(comb); free(gpre); free(gpost); free(gcomb);
    free(ypre); free(Xo); free(gyp); free(gXo); free(gXi);
}
END_TEST

/* ------------------------------------------------------------ sparse attention */
/* Key list per row: a window part of W entries into pool A (decode ring order,
 * -1s at the FRONT while the window is not full) and a compressed part of C
 * entries into pool B (ascending, -1s at the end). */
typedef struct { int T, H, d, W, C, nA, nB, filled_w, filled_c, with_sink; } attn_case;
static const attn_case attn_cases[] = {
    {1, 64, 512, 128, 512, 128, 4096, 128, 512, 1},   /* V4.1-Flash decode row, split-list path */
    {3, 64, 512, 128, 512, 384, 2048, 100, 37, 1},   /* window not yet full, few compressed */
    {300, 4, 64, 8, 6, 16, 64, 5, 6, 1},             /* tiny model shapes, many rows (no split) */
    {2, 4, 64, 8, 6, 8, 8, 1, 0, 1},                 /* all -1 but one key */
    {2, 20, 128, 8, 200, 8, 400, 8, 150, 0},         /* H not a multiple of 16, no sink */
    {40, 64, 512, 128, 200, 5120, 4096, 128, 150, 1}, /* 64-head tiles, list split across CTAs */
    {33, 40, 512, 128, 512, 4096, 8192, 128, 512, 1}, /* 4 splits (sm_90a: a cluster of 4 CTAs), 24 empty heads */
    {140, 16, 512, 128, 192, 2048, 8192, 77, 150, 1}, /* more rows than SMs: no split */
};
static int32_t *make_list(const attn_case *c, int L)
{
    int32_t *idx = malloc(4 * (size_t)c->T * L);
    for (int t = 0; t < c->T; t++) {
        int32_t *r = idx + (size_t)t * L;
        for (int j = 0; j < c->W; j++) r[j] = j < c->W - c->filled_w ? -1 : (int32_t)(rng_u32() % c->nA);
        int n = 0;
        for (int j = 0; j < c->C; j++) r[c->W + j] = -1;
        while (n < c->filled_c) {            /* ascending distinct positions */
            int p = (int)(rng_u32() % c->nB), dup = 0;
            for (int q = 0; q < n; q++) dup |= r[c->W + q] == p;
            if (!dup) r[c->W + n++] = p;
        }
        for (int a = 1; a < n; a++)
            for (int b = a; b > 0 && r[c->W + b] < r[c->W + b - 1]; b--) {
                int32_t tmp = r[c->W + b]; r[c->W + b] = r[c->W + b - 1]; r[c->W + b - 1] = tmp;
            }
    }
    return idx;
}
/* One attention problem of case c: its random inputs (drawn in this order) and their device copies */
typedef struct {
    int L;
    size_t nq;
    float scale;
    uint16_t *q, *ka, *kb, *dq, *dka, *dkb;
    float *sink, *dsink;
    int32_t *idx, *didx;
} attn_data;
static attn_data attn_make(const attn_case *c)
{
    attn_data a;
    a.L = c->W + c->C;
    a.nq = (size_t)c->T * c->H * c->d;
    a.q = rand_bf16(a.nq, 1.0f);
    a.ka = rand_bf16((size_t)c->nA * c->d, 1.0f);
    a.kb = rand_bf16((size_t)c->nB * c->d, 1.0f);
    a.sink = rand_f32(c->H, 2.0f);
    a.idx = make_list(c, a.L);
    a.scale = 1.0f / sqrtf((float)c->d) * 4.0f;   /* sharper than d^-1/2 so the max matters */
    a.dq = up(a.q, 2 * a.nq);
    a.dka = up(a.ka, 2 * (size_t)c->nA * c->d);
    a.dkb = up(a.kb, 2 * (size_t)c->nB * c->d);
    a.didx = up(a.idx, 4 * (size_t)c->T * a.L);
    a.dsink = up(a.sink, 4 * c->H);
    return a;
}
static void attn_free(attn_data *a)
{
    v41g_free(a->dq); v41g_free(a->dka); v41g_free(a->dkb); v41g_free(a->didx); v41g_free(a->dsink);
    free(a->q); free(a->ka); free(a->kb); free(a->sink); free(a->idx);
}
START_TEST(test_attn_random)
{
    const attn_case *c = &attn_cases[_i];
    rng_seed(600 + _i);
    attn_data a = attn_make(c);
    const size_t nq = a.nq;
    uint16_t *o = malloc(2 * nq);
    cr_sparse_attn(a.q, a.ka, a.kb, a.idx, a.L, c->W, c->with_sink ? a.sink : NULL, a.scale, c->T, c->H, c->d, o);
    uint16_t *dout = dpoison(2 * nq);
    ck_assert_int_eq(v41g_sparse_attn(a.dq, a.dka, a.dkb, a.didx, a.L, c->W, c->with_sink ? a.dsink : NULL, a.scale, c->T,
                                      c->H, c->d, dout, NULL), 0);
    uint16_t *g = down(dout, 2 * nq);
    /* Scores differ by fp32 summation order (tensor cores): |ds| <= d * 2^-24 * scale * sum|q k| ~ 1e-5;
     * exp() moves that into p, and bf16(p) can then flip by one ulp (2^-8 relative) for a few keys. The
     * output is a convex combination of values in [-1, 1] (up to the sink), so such flips move it by at
     * most 2^-8 * max|v| summed over the flipped fraction: 4e-3 absolute plus one bf16 ulp. */
    check_bf16("sparse_attn", g, o, nq, 4e-3, BF_ULP);
    v41g_free(dout);
    attn_free(&a);
    free(o); free(g);
}
END_TEST

/* Flash-shaped decode batches of different sizes, one after another in one process (the other
 * cases run each in a fresh process): the split count, and on sm_90a the cluster size, changes
 * from call to call (1 and 8 rows: the mma.sync kernel with list splits; 33 rows: 4 splits; 40:
 * 3; 64: 2), as in an engine whose decode batch grows and shrinks. Each call against the CPU
 * (tolerance as above), and a repeated size bitwise equal to its first run. */
START_TEST(test_attn_sequence)
{
    static const int Ts[] = {1, 8, 33, 64, 40, 1, 64, 33, 8};
    enum { NSEQ = sizeof Ts / sizeof Ts[0], TMAX = 64 };
    const attn_case base = {TMAX, 64, 512, 128, 512, 4096, 8192, 128, 512, 1};
    rng_seed(650);
    attn_data a = attn_make(&base);
    const int L = a.L, H = base.H, d = base.d;
    uint16_t *first[TMAX + 1] = {NULL};
    for (int i = 0; i < NSEQ; i++) {
        const int T = Ts[i];
        const size_t n = (size_t)T * H * d;
        uint16_t *dout = dpoison(2 * n);
        ck_assert_int_eq(v41g_sparse_attn(a.dq, a.dka, a.dkb, a.didx, L, base.W, a.dsink, a.scale, T, H, d, dout, NULL), 0);
        uint16_t *g = down(dout, 2 * n);   /* (synchronises: a launch failure shows here) */
        v41g_free(dout);
        if (first[T]) {
            ck_assert_msg(!memcmp(first[T], g, 2 * n), "sparse_attn T=%d (call %d): not bitwise equal to its first run", T, i);
            free(g);
            continue;
        }
        uint16_t *o = malloc(2 * n);
        cr_sparse_attn(a.q, a.ka, a.kb, a.idx, L, base.W, a.sink, a.scale, T, H, d, o);
        char what[64];
        snprintf(what, sizeof what, "sparse_attn sequence T=%d (call %d)", T, i);
        check_bf16(what, g, o, n, 4e-3, BF_ULP);
        free(o);
        first[T] = g;
    }
    for (int t = 0; t <= TMAX; t++) free(first[t]);
    attn_free(&a);
}
END_TEST

/* 64 rows split in two (on sm_90a: clusters of 2, merged by column halves, aw_epilogue_2): the same
 * bits as the general merge (V41_ATTN_MERGE_PULL=1, read at every call), and against the CPU; 64 heads
 * with a sink, and 40 heads without (a partial head tile: rows past H are not stored). */
START_TEST(test_attn_merge2)
{
    for (int c = 0; c < 2; c++) {
        const attn_case base = {64, c ? 40 : 64, 512, 128, 512, 4096, 8192, 128, c ? 300 : 512, !c};
        rng_seed(660 + c);
        attn_data a = attn_make(&base);
        const int T = base.T, H = base.H, d = base.d;
        const size_t n = a.nq;
        uint16_t *got[2];
        for (int pull = 0; pull < 2; pull++) {
            if (pull) setenv("V41_ATTN_MERGE_PULL", "1", 1);
            uint16_t *dout = dpoison(2 * n);
            ck_assert_int_eq(v41g_sparse_attn(a.dq, a.dka, a.dkb, a.didx, a.L, base.W, base.with_sink ? a.dsink : NULL,
                                              a.scale, T, H, d, dout, NULL), 0);
            got[pull] = down(dout, 2 * n);
            v41g_free(dout);
            if (pull) unsetenv("V41_ATTN_MERGE_PULL");
        }
        ck_assert_msg(!memcmp(got[0], got[1], 2 * n), "H=%d: the two merges differ", H);
        uint16_t *o = malloc(2 * n);
        cr_sparse_attn(a.q, a.ka, a.kb, a.idx, a.L, base.W, base.with_sink ? a.sink : NULL, a.scale, T, H, d, o);
        check_bf16("sparse_attn merge2", got[0], o, n, 4e-3, BF_ULP);   /* tolerance as in test_attn_random */
        free(o); free(got[0]); free(got[1]);
        attn_free(&a);
    }
}
END_TEST

/* The wgmma attention's two gather schedules (V41_ATTN_DEPTH=1: one chunk in flight, the default
 * for grids of more than two waves; 2: two chunks, each warpgroup gathering its own column half)
 * run the same operations in the same order: the same bits, and both against the CPU. Cases: a
 * list split in two (64 rows, the cluster merge), one in four with 40 heads and no sink, and an
 * unsplit list over 136 rows (more CTAs than SMs). Elsewhere than sm_90a the variable is ignored
 * and both runs take the mma.sync kernel. */
START_TEST(test_attn_depth)
{
    static const attn_case cs[] = {
        {64, 64, 512, 128, 512, 4096, 8192, 128, 512, 1},
        {33, 40, 512, 128, 512, 4096, 8192, 100, 300, 0},
        {136, 64, 512, 128, 128, 4096, 4096, 128, 128, 1},
    };
    for (int c = 0; c < 3; c++) {
        const attn_case *base = &cs[c];
        rng_seed(670 + c);
        attn_data a = attn_make(base);
        const size_t n = a.nq;
        uint16_t *got[2];
        for (int deep = 0; deep < 2; deep++) {
            setenv("V41_ATTN_DEPTH", deep ? "2" : "1", 1);
            uint16_t *dout = dpoison(2 * n);
            ck_assert_int_eq(v41g_sparse_attn(a.dq, a.dka, a.dkb, a.didx, a.L, base->W, base->with_sink ? a.dsink : NULL,
                                              a.scale, base->T, base->H, base->d, dout, NULL), 0);
            got[deep] = down(dout, 2 * n);
            v41g_free(dout);
        }
        unsetenv("V41_ATTN_DEPTH");
        ck_assert_msg(!memcmp(got[0], got[1], 2 * n), "case %d: the two gather depths differ", c);
        uint16_t *o = malloc(2 * n);
        cr_sparse_attn(a.q, a.ka, a.kb, a.idx, a.L, base->W, base->with_sink ? a.sink : NULL, a.scale, base->T, base->H,
                       base->d, o);
        check_bf16("sparse_attn depth", got[0], o, n, 4e-3, BF_ULP);   /* tolerance as in test_attn_random */
        free(o); free(got[0]); free(got[1]);
        attn_free(&a);
    }
}
END_TEST

/* Constant K=V with padding: DSpark lists (W + B = 133 real keys padded to 256)
 * and a decode list with -1s at the front: the output must be exactly the
 * constant (padding has zero weight, all p = 1 exactly). Also: a row whose
 * list is all -1 returns zeros (no NaN), with or without a sink. */
START_TEST(test_attn_constant)
{
    int T = 40, H = 64, d = 512, L = 256, real = 133;   /* T >= 32: 64-head tiles; rows 3.. see nothing */
    rng_seed(700);
    size_t nq = (size_t)T * H * d;
    uint16_t *q = rand_bf16(nq, 1.0f);
    uint16_t *kv = malloc(2 * (size_t)L * d);
    uint16_t cval = cr_f2bf(0.8125f);
    for (size_t i = 0; i < (size_t)L * d; i++) kv[i] = cval;
    int32_t *idx = malloc(4 * (size_t)T * L);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < L; j++) {
            int32_t v;
            if (t == 0) v = j < real ? j : -1;                   /* DSpark: ring then block keys, pad at end */
            else if (t == 1) v = j < L - real ? -1 : j;          /* decode: -1 at the front */
            else if (t == 2) v = (j % 3 == 0) ? j : -1;          /* scattered padding */
            else v = -1;                                          /* rows 3..: nothing visible */
            idx[(size_t)t * L + j] = v;
        }
    uint16_t *dq = up(q, 2 * nq), *dkv = up(kv, 2 * (size_t)L * d), *dout = dpoison(2 * nq);
    int32_t *didx = up(idx, 4 * (size_t)T * L);
    float sinkv[64];
    for (int h = 0; h < H; h++) sinkv[h] = 0.5f;
    float *dsink = up(sinkv, sizeof sinkv);
    for (int split_a = 0; split_a < 2; split_a++) {   /* n_a = W-like split point, or all pool A */
        int n_a = split_a ? 128 : L;
        ck_assert_int_eq(v41g_sparse_attn(dq, dkv, dkv, didx, L, n_a, NULL, 0.04f, T, H, d, dout, NULL), 0);
        uint16_t *g = down(dout, 2 * nq);
        for (int t = 0; t < T; t++)
            for (size_t i = 0; i < (size_t)H * d; i++) {
                uint16_t want = t < 3 ? cval : 0;
                ck_assert_msg(g[(size_t)t * H * d + i] == want, "row %d elem %zu: got %g want %g", t, i,
                              cr_bf2f(g[(size_t)t * H * d + i]), cr_bf2f(want));
            }
        free(g);
    }
    /* with a sink, an all -1 row is still 0 (not NaN) */
    ck_assert_int_eq(v41g_sparse_attn(dq, dkv, dkv, didx, L, L, dsink, 0.04f, T, H, d, dout, NULL), 0);
    uint16_t *g = down(dout, 2 * nq);
    for (size_t i = 3 * (size_t)H * d; i < nq; i++) ck_assert_int_eq(g[i] & 0x7fff, 0);
    /* and a single visible key with a sink: o = k * 1/(1 + e^(sink - s)) per head, vs the CPU */
    uint16_t *o = malloc(2 * nq);
    cr_sparse_attn(q, kv, kv, idx, L, L, sinkv, 0.04f, T, H, d, o);
    check_bf16("sink rows", g, o, nq, 1e-6, BF_ULP);
    v41g_free(dq); v41g_free(dkv); v41g_free(dout); v41g_free(didx); v41g_free(dsink);
    free(q); free(kv); free(idx); free(g); free(o);
}
END_TEST

/* ------------------------------------------------------------ indexer */
static const int ix_cases[][4] = {{4, 8, 32, 300}, {3, 32, 128, 1000}};   /* T, nI, dI, S */
START_TEST(test_indexer)
{
    int T = ix_cases[_i][0], nI = ix_cases[_i][1], dI = ix_cases[_i][2], S = ix_cases[_i][3];
    rng_seed(800 + _i);
    uint16_t *q = rand_bf16((size_t)T * nI * dI, 1.0f), *k = rand_bf16((size_t)T * S * dI, 1.0f);
    float *w = rand_f32((size_t)T * nI, 0.2f), *I = malloc(4 * (size_t)T * S);
    int32_t vis[4] = {0, 1, S / 2 + 3, S};
    int64_t kb[4];
    for (int t = 0; t < T; t++) kb[t] = (int64_t)t * S;
    if (T == 3) { vis[0] = 1; vis[1] = S / 3; vis[2] = S; }
    cr_indexer_scores(q, w, k, kb, vis, T, nI, dI, S, I);
    uint16_t *dq = up(q, 2 * (size_t)T * nI * dI), *dk = up(k, 2 * (size_t)T * S * dI);
    float *dw = up(w, 4 * (size_t)T * nI), *dI_ = dpoison(4 * (size_t)T * S);
    int32_t *dv = up(vis, sizeof vis);
    int64_t *dkb = up(kb, sizeof kb);
    ck_assert_int_eq(v41g_indexer_scores(dq, dw, dk, dkb, dv, T, nI, dI, S, dI_, NULL), 0);
    float *g = down(dI_, 4 * (size_t)T * S);
    /* per-head bf16(q.k) can flip by one ulp (2^-8 |s|, |s| <= ~3 sqrt(dI)/... ) when the fp32 sums differ in
     * order: |dI| <= sum_h |w_h| 2^-8 |s_h| + one bf16 ulp of I; bound sum_h |w_h||s_h| by 0.2*nI*max|s| */
    double atol = 0.2 * nI * 2.0 * sqrt((double)dI) / 256.0;
    check_f32("indexer scores", g, I, (size_t)T * S, atol, BF_ULP);
    for (int t = 0; t < T; t++)
        for (int s = vis[t]; s < S; s++) ck_assert_msg(isinf(g[(size_t)t * S + s]) && g[(size_t)t * S + s] < 0, "mask");
    v41g_free(dq); v41g_free(dk); v41g_free(dw); v41g_free(dI_); v41g_free(dv); v41g_free(dkb);
    free(q); free(k); free(w); free(I); free(g);
}
END_TEST

/* ------------------------------------------------------------ top-k */
/* T, S, k; S picks 1, 2, 4 or 8 CTAs per row (<= 8K, 16K, 32K, more) */
static const int tk_cases[][3] = {{6, 1000, 6}, {6, 1000, 512}, {4, 70000, 512}, {3, 40, 64}, {3, 12000, 64}, {4, 20000, 512}, {5, 8192, 512}};
START_TEST(test_topk)
{
    int T = tk_cases[_i][0], S = tk_cases[_i][1], k = tk_cases[_i][2];
    rng_seed(900 + _i);
    float *I = calloc((size_t)T * S, 4);
    int32_t *vis = calloc(T, 4);
    for (int t = 0; t < T; t++) {
        vis[t] = t == 0 ? 0 : t == 1 ? 3 : t == 2 ? S / 2 : S;       /* 0, fewer than k, half, all */
        for (int s = 0; s < S; s++) {
            float v;
            if (t % 2 == 0) v = cr_rbf((float)(rng_u32() % 9) * 0.25f - 1.0f);   /* heavy ties */
            else v = cr_rbf(rng_unit() * 5.0f);
            I[(size_t)t * S + s] = s < vis[t] ? v : -INFINITY;
        }
    }
    int32_t *want = malloc(4 * (size_t)T * k);
    cr_topk(I, vis, T, S, k, want);
    float *dI = up(I, 4 * (size_t)T * S);
    int32_t *dv = up(vis, 4 * T);
    /* pass 0: the default (rows over 8K positions split over a cluster of 2-8 blocks); pass 1: one block
     * per row whatever S (V41_TOPK_NO_CLUSTER, read at every call: what a device without clusters runs;
     * S = 70000 also takes its uncached path, the row's keys read from global memory) */
    for (int pass = 0; pass < 2; pass++) {
        if (pass) setenv("V41_TOPK_NO_CLUSTER", "1", 1);
        int32_t *dout = dpoison(4 * (size_t)T * k);
        uint8_t *dtie = dpoison(T);
        ck_assert_int_eq(v41g_topk(dI, dv, T, S, k, dout, dtie, NULL), 0);
        int32_t *got = down(dout, 4 * (size_t)T * k);
        uint8_t *tie = down(dtie, T);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                ck_assert_msg(got[(size_t)t * k + j] == want[(size_t)t * k + j], "pass %d row %d slot %d: got %d want %d",
                              pass, t, j, got[(size_t)t * k + j], want[(size_t)t * k + j]);
        /* ties of the heavy-tie rows with more visible keys than k straddle the cut */
        for (int t = 0; t < T; t++) {
            ck_assert_int_le(tie[t], 1);
            if (t % 2 == 0 && vis[t] > 4 * k) ck_assert_int_eq(tie[t], 1);
            if (vis[t] <= k && vis[t] < S) ck_assert_int_eq(tie[t], 0);
        }
        if (pass) unsetenv("V41_TOPK_NO_CLUSTER");
        v41g_free(dout); v41g_free(dtie);
        free(got); free(tie);
    }
    v41g_free(dI); v41g_free(dv);
    free(I); free(vis); free(want);
}
END_TEST

/* ------------------------------------------------------------ MoE */
/* v41g_moe_route against the CPU for the three score functions: the same expert ids, weights within
 * expf/log1pf ulps. idx/wts: the CPU's result (of the last score function on return). */
static void route_check(const char *what, const float *logits, const float *bias, int T, int E, int k, float temp,
                        float scale, int32_t *idx, float *wts)
{
    for (int sf = 0; sf < 3; sf++) {
        cr_moe_route(logits, bias, T, E, k, sf, temp, 1, scale, idx, wts);
        float *dl = up(logits, 4 * (size_t)T * E), *db = up(bias, 4 * (size_t)E), *dw = dpoison(4 * (size_t)T * k);
        int32_t *di = dpoison(4 * (size_t)T * k);
        ck_assert_int_eq(v41g_moe_route(dl, db, T, E, k, sf, temp, 1, scale, di, dw, NULL), 0);
        int32_t *gi = down(di, 4 * (size_t)T * k);
        float *gw = down(dw, 4 * (size_t)T * k);
        ck_assert_mem_eq(gi, idx, 4 * (size_t)T * k);
        check_f32(what, gw, wts, (size_t)T * k, 1e-6, 1e-5);   /* expf/log1pf ulps */
        v41g_free(dl); v41g_free(db); v41g_free(dw); v41g_free(di);
        free(gi); free(gw);
    }
}
START_TEST(test_moe)
{
    int T = 37, D = 128, I = 64, E = 8, k = 2;
    rng_seed(1000);
    float *logits = rand_f32((size_t)T * E, 3.0f), *bias = rand_f32(E, 0.1f);
    int32_t *idx = malloc(4 * T * k);
    float *wts = malloc(4 * T * k);
    /* V4.1-Flash routing (384 experts, top 6: several experts per thread of the block), logits on a
     * coarse grid so that many values tie (ties go to the lower expert id) */
    {
        enum { TF = 20, EF = 384, KF = 6 };
        float *lf = rand_f32((size_t)TF * EF, 3.0f), *bf = rand_f32(EF, 0.1f);
        for (size_t i = 0; i < (size_t)TF * EF; i++) lf[i] = roundf(lf[i] * 2.0f) / 2.0f;
        for (int e = 0; e < EF; e++) bf[e] = e % 3 ? 0.0f : 0.25f;
        int32_t *fi = malloc(4 * TF * KF);
        float *fw = malloc(4 * TF * KF);
        route_check("route weights (384 experts)", lf, bf, TF, EF, KF, 1.0f, 2.5f, fi, fw);
        free(lf); free(bf); free(fi); free(fw);
    }
    route_check("route weights", logits, bias, T, E, k, 1.25f, 1.5f, idx, wts);   /* idx, wts: the FFN's input */
    uint16_t *w13 = rand_bf16((size_t)E * 2 * I * D, 0.1f), *w2 = rand_bf16((size_t)E * D * I, 0.1f);
    uint16_t *w13s = rand_bf16((size_t)2 * I * D, 0.1f), *w2s = rand_bf16((size_t)D * I, 0.1f);
    uint16_t *x = rand_bf16((size_t)T * D, 2.0f), *out = malloc(2 * (size_t)T * D);
    cr_moe_ffn(T, D, I, E, k, 1.0f, w13, w2, w13s, w2s, x, idx, wts, out);
    v41g_moe m = {T, D, I, E, k, 1.0f, up(w13, 2 * (size_t)E * 2 * I * D), up(w2, 2 * (size_t)E * D * I),
                  up(w13s, 2 * (size_t)2 * I * D), up(w2s, 2 * (size_t)D * I), NULL, NULL, NULL, NULL};
    uint16_t *dx = up(x, 2 * (size_t)T * D), *dout = dpoison(2 * (size_t)T * D);
    int32_t *di = up(idx, 4 * T * k);
    float *dw = up(wts, 4 * T * k);
    void *ws = v41g_malloc(v41g_moe_ws_size(&m));
    ck_assert_ptr_nonnull(ws);
    ck_assert_int_eq(v41g_moe_ffn(&m, dx, di, dw, ws, dout, NULL), 0);
    uint16_t *g = down(dout, 2 * (size_t)T * D);
    /* The GEMMs sum in another order: w1/w3 outputs can flip one bf16 ulp, which passes through swiglu and
     * may flip an fp8 code of h (one e4m3 step = 2^-3 relative on that element); each expert output of
     * ~I terms moves by ~2^-3 * |h w| for a few elements: 2e-2 absolute on outputs of O(0.5), plus 2 ulps. */
    check_bf16("moe ffn", g, out, (size_t)T * D, 2e-2, 2 * BF_ULP);
    v41g_free(dx); v41g_free(dout); v41g_free(di); v41g_free(dw); v41g_free(ws);
    v41g_free((void *)m.w13); v41g_free((void *)m.w2); v41g_free((void *)m.w13s); v41g_free((void *)m.w2s);
    free(logits); free(bias); free(idx); free(wts); free(w13); free(w2); free(w13s); free(w2s); free(x); free(out);
    free(g);
}
END_TEST

static Suite *gpu_suite(void)
{
    Suite *s = suite_create("gpu_kernels");
    TCase *tc = tcase_create("small");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_rmsnorm, 0, 4);
    tcase_add_test(tc, test_rope);
    tcase_add_test(tc, test_act_quant);
    tcase_add_loop_test(tc, test_fp4_qdq, 0, 4);
    tcase_add_loop_test(tc, test_hc, 0, (int)(sizeof hc_cases / sizeof hc_cases[0]));
    suite_add_tcase(s, tc);
    tc = tcase_create("attention");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_attn_random, 0, (int)(sizeof attn_cases / sizeof attn_cases[0]));
    tcase_add_test(tc, test_attn_constant);
    tcase_add_test(tc, test_attn_sequence);
    tcase_add_test(tc, test_attn_merge2);
    tcase_add_test(tc, test_attn_depth);
    suite_add_tcase(s, tc);
    tc = tcase_create("indexer");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_indexer, 0, 2);
    tcase_add_loop_test(tc, test_topk, 0, (int)(sizeof tk_cases / sizeof tk_cases[0]));
    suite_add_tcase(s, tc);
    tc = tcase_create("moe");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_moe);
    suite_add_tcase(s, tc);
    return s;
}


int main(void)
{
    if (!gpu_present()) {
        printf("test_gpu_kernels: no CUDA device: skipped\n");
        return 77;
    }
    SRunner *sr = srunner_create(gpu_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
#endif
