/* test_gpu_dev_a: the kernels of gpu/k_dev_a.cu (gpu/v41_gpu_dev.h: conversions, row
 * scatter/gather, decode key lists, the compressor's decode step, candidate blocks) against a CPU
 * computation: ref's own function where it has one (v41_f32_to_bf16, v41_bf16_to_f32, v41_bf16r,
 * v41_topk_desc), otherwise the loop of ref/engine.c written out here (attention()'s decode key
 * list, compressor()'s pooling, indexer()'s candidate blocks). Random inputs drawn per case,
 * device outputs poisoned before each launch so an unwritten element fails. Everything is
 * compared bit for bit except compress_dec's latent (see test_compress_dec: exp may differ by an
 * fp32 ulp between glibc and the device). Exit 77 (skip) when the build has no CUDA or the machine
 * has no device; CUDA is initialised only inside the forked tests (a probe child decides the
 * skip). */
#include "config.h"
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef HAVE_CUDA
int main(void)
{
    printf("test_gpu_dev_a: built without CUDA: skipped\n");
    return 77;
}
#else
#include "v41_gpu.h"
#include "v41_gpu_dev.h"
#include "v41_ops.h"
#include "v41_quant.h"
#include "test_gpu_probe.h"
#include "test_gpu_util.h"

static float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t u_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* byte-exact comparison of n elements of size es, reporting the first difference */
static void check_bits(const char *what, const void *got, const void *want, size_t n, size_t es)
{
    const unsigned char *g = got, *w = want;
    for (size_t i = 0; i < n; i++)
        if (memcmp(g + i * es, w + i * es, es)) {
            uint64_t gv = 0, wv = 0;
            memcpy(&gv, g + i * es, es < 8 ? es : 8);
            memcpy(&wv, w + i * es, es < 8 ? es : 8);
            ck_abort_msg("%s: element %zu of %zu: got 0x%llx want 0x%llx", what, i, n, (unsigned long long)gv,
                         (unsigned long long)wv);
        }
}

/* ------------------------------------------------------------ conversions */
/* fp32 values that exercise every branch of the rounding: specials, NaN payloads (quiet and
 * signalling, both signs), exact ties to even both ways, overflow to inf, subnormals */
static const uint32_t f32_special[] = {
    0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u,
    0x7fc00001u, 0x7fbfffffu, 0xffffffffu, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x7f7fffffu,
    0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x00008000u, 0x00018000u, 0x0000ffffu, 0x00000001u, 0x807fffffu,
    0x3f800000u, 0xbf800000u, 0x3effffffu, 0x33800000u};
#define N_SPECIAL (sizeof f32_special / sizeof f32_special[0])
static const size_t cv_n[] = {1, 1000, 300001};
START_TEST(test_convert)
{
    size_t n = cv_n[_i];
    rng_seed(10 + _i);
    float *x = calloc(n, 4);
    for (size_t i = 0; i < n; i++) {
        if (i < N_SPECIAL) x[i] = f_of(f32_special[i]);
        else if (i % 2) x[i] = f_of(rng_u32() ^ (rng_u32() << 16));   /* any bits: NaN, inf, subnormal */
        else x[i] = 4.0f * rng_unit();
    }
    /* fp32 -> bf16: v41_f32_to_bf16 (RNE, NaN keeps sign and top payload bits, quiet bit set) */
    uint16_t *want = malloc(2 * n);
    for (size_t i = 0; i < n; i++) want[i] = v41_f32_to_bf16(x[i]);
    float *dx = up(x, 4 * n);
    uint16_t *dy = dpoison(2 * n);
    ck_assert_int_eq(v41g_f32_to_bf16(dx, dy, n, NULL), 0);
    uint16_t *got = down(dy, 2 * n);
    check_bits("f32_to_bf16", got, want, n, 2);
    /* bf16 -> fp32: every bf16 pattern (first 65536 elements), then random ones; bits kept */
    uint16_t *b = malloc(2 * n);
    for (size_t i = 0; i < n; i++) b[i] = i < 65536 ? (uint16_t)i : (uint16_t)rng_u32();
    float *wf = malloc(4 * n);
    for (size_t i = 0; i < n; i++) wf[i] = v41_bf16_to_f32(b[i]);
    uint16_t *db = up(b, 2 * n);
    float *df = dfill(4 * n, 0x5a);   /* (0xff would pass for the NaN patterns of b) */
    ck_assert_int_eq(v41g_bf16_to_f32(db, df, n, NULL), 0);
    float *gf = down(df, 4 * n);
    check_bits("bf16_to_f32", gf, wf, n, 4);
    /* y = v41_bf16r(x * scale) (ref indexer(): the head weights); one fp32 product, so exact;
     * NaN only as NaN (NaN payloads of arithmetic differ between CPUs and GPUs) */
    const float scales[2] = {0.0110485434f, 3.0e-39f};   /* 64^-0.5 * 128^-0.5 ish; a subnormal scale */
    for (int k = 0; k < 2; k++) {
        float *ws = malloc(4 * n);
        for (size_t i = 0; i < n; i++) ws[i] = v41_bf16r(x[i] * scales[k]);
        float *dz = dfill(4 * n, 0x5a);
        ck_assert_int_eq(v41g_scale_bf16r(dx, scales[k], dz, n, NULL), 0);
        float *gz = down(dz, 4 * n);
        for (size_t i = 0; i < n; i++) {
            if (isnan(ws[i])) ck_assert_msg(isnan(gz[i]), "scale_bf16r %zu: got %g want NaN", i, (double)gz[i]);
            else
                ck_assert_msg(u_of(gz[i]) == u_of(ws[i]), "scale_bf16r %zu (x=%a, s=%a): got %a want %a", i,
                              (double)x[i], (double)scales[k], (double)gz[i], (double)ws[i]);
        }
        v41g_free(dz);
        free(ws); free(gz);
    }
    v41g_free(dx); v41g_free(dy); v41g_free(db); v41g_free(df);
    free(x); free(want); free(got); free(b); free(wf); free(gf);
}
END_TEST

/* ------------------------------------------------------------ row movement */
typedef struct { int n, width, ld_src, ld_dst, P; } rows_case;   /* P: rows of the pool */
static const rows_case rows_cases[] = {{37, 70, 80, 96, 100}, {1, 512, 512, 512, 4}, {300, 3, 3, 5, 1000},
                                       {5, 1000, 1001, 1003, 9}};
START_TEST(test_rows)
{
    const rows_case c = rows_cases[_i];
    rng_seed(20 + _i);
    /* scatter: distinct targets (a shuffled prefix of 0..P-1), some skipped (< 0) */
    int64_t *rows = malloc(8 * (size_t)c.n);
    int *perm = malloc(sizeof(int) * (size_t)c.P);
    for (int i = 0; i < c.P; i++) perm[i] = i;
    for (int i = c.P - 1; i > 0; i--) { int j = rng_int(i + 1), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    for (int i = 0; i < c.n; i++) rows[i] = (i % 5 == 3) ? -1 : (i % 7 == 6) ? -123456789012ll : perm[i % c.P];
    if (c.n == 1) rows[0] = c.P - 1;
    size_t ns = (size_t)c.n * c.ld_src, nd = (size_t)c.P * c.ld_dst;
    for (int es = 2; es <= 4; es += 2) {
        unsigned char *src = malloc(es * ns), *dst0 = malloc(es * nd), *want = malloc(es * nd);
        for (size_t i = 0; i < es * ns; i++) src[i] = (unsigned char)rng_u32();
        for (size_t i = 0; i < es * nd; i++) dst0[i] = (unsigned char)rng_u32();
        memcpy(want, dst0, es * nd);
        for (int i = 0; i < c.n; i++)
            if (rows[i] >= 0)
                memcpy(want + es * (size_t)rows[i] * c.ld_dst, src + es * (size_t)i * c.ld_src, es * (size_t)c.width);
        void *dsrc = up(src, es * ns), *ddst = up(dst0, es * nd);
        int64_t *drows = up(rows, 8 * (size_t)c.n);
        if (es == 2)
            ck_assert_int_eq(v41g_scatter_rows16(dsrc, c.ld_src, drows, c.n, c.width, ddst, c.ld_dst, NULL), 0);
        else
            ck_assert_int_eq(v41g_scatter_rows32(dsrc, c.ld_src, drows, c.n, c.width, ddst, c.ld_dst, NULL), 0);
        unsigned char *got = down(ddst, es * nd);
        check_bits(es == 2 ? "scatter_rows16" : "scatter_rows32", got, want, nd, es);
        v41g_free(dsrc); v41g_free(ddst); v41g_free(drows);
        free(src); free(dst0); free(want); free(got);
    }
    /* gather: any rows of the pool (repeats allowed); the columns past width stay poisoned */
    for (int i = 0; i < c.n; i++) rows[i] = rng_int(c.P);
    size_t np = (size_t)c.P * c.ld_src, ng = (size_t)c.n * c.ld_dst;
    uint16_t *pool = malloc(2 * np), *want = malloc(2 * ng);
    for (size_t i = 0; i < np; i++) pool[i] = (uint16_t)rng_u32();
    memset(want, 0xff, 2 * ng);
    for (int i = 0; i < c.n; i++)
        memcpy(want + (size_t)i * c.ld_dst, pool + (size_t)rows[i] * c.ld_src, 2 * (size_t)c.width);
    uint16_t *dpool = up(pool, 2 * np), *dg = dpoison(2 * ng);
    int64_t *drows = up(rows, 8 * (size_t)c.n);
    ck_assert_int_eq(v41g_gather_rows16(dpool, c.ld_src, drows, c.n, c.width, dg, c.ld_dst, NULL), 0);
    uint16_t *got = down(dg, 2 * ng);
    check_bits("gather_rows16", got, want, ng, 2);
    v41g_free(dpool); v41g_free(dg); v41g_free(drows);
    free(pool); free(want); free(got); free(rows); free(perm);
}
END_TEST

/* ------------------------------------------------------------ decode key lists */
/* ref/engine.c attention(), decode rows (is_decode), with win[] rows at win_row0 and the
 * compressed rows at ckv_row0 (the engine's pools) */
static void cpu_dec_lists(const int32_t *pos, const int32_t *fl, const int64_t *w0, const int64_t *c0,
                          const int32_t *topk, int T, int Wn, int k, int32_t *idx)
{
    for (int t = 0; t < T; t++) {
        int32_t *ls = idx + (size_t)t * (Wn + k);
        const int p = pos[t], flo = fl[t];
        for (int j = 0; j < Wn; j++) {
            int slot = (p + 1 + j) % Wn;
            int ps = p - ((p - slot) % Wn + Wn) % Wn;
            ls[j] = (ps >= 0 && ps >= flo) ? (int32_t)(w0[t] + ps) : -1;
        }
        for (int j = 0; j < k; j++) {
            int32_t s = topk[(size_t)t * k + j];
            ls[Wn + j] = s >= 0 ? (int32_t)(c0[t] + s) : -1;
        }
    }
}
typedef struct { int W, k; } dl_case;   /* k = 0: topk NULL */
static const dl_case dl_cases[] = {{8, 6}, {8, 0}, {128, 512}, {128, 0}, {3, 2}, {1, 1}};
/* (position, floor) of the rows; the window-size dependent ones are added per case */
static const int32_t dl_rows[][2] = {
    {0, 0}, {1, 0}, {3, 0}, {5, 3}, {100, 0}, {100, 97}, {100, 100}, {100, 101}, {12345, 0}, {12345, 12340},
    {77, 0}, {2, 1}};
#define DL_FIXED ((int)(sizeof dl_rows / sizeof dl_rows[0]))
START_TEST(test_dec_lists)
{
    const int W = dl_cases[_i].W, k = dl_cases[_i].k, T = DL_FIXED + 6;
    rng_seed(30 + _i);
    int32_t pos[DL_FIXED + 6], fl[DL_FIXED + 6];
    int64_t w0[DL_FIXED + 6], c0[DL_FIXED + 6];
    for (int t = 0; t < DL_FIXED; t++) { pos[t] = dl_rows[t][0]; fl[t] = dl_rows[t][1]; }
    /* window just full / one short / one past; floor cutting the window; random */
    pos[DL_FIXED + 0] = W - 1; fl[DL_FIXED + 0] = 0;
    pos[DL_FIXED + 1] = W - 2 >= 0 ? W - 2 : 0; fl[DL_FIXED + 1] = 0;
    pos[DL_FIXED + 2] = W; fl[DL_FIXED + 2] = 0;
    pos[DL_FIXED + 3] = 3 * W + 1; fl[DL_FIXED + 3] = 2 * W + 2 + W / 2;
    pos[DL_FIXED + 4] = rng_int(5000); fl[DL_FIXED + 4] = pos[DL_FIXED + 4] - rng_int(W + 2);
    pos[DL_FIXED + 5] = rng_int(50000); fl[DL_FIXED + 5] = 0;
    for (int t = 0; t < T; t++) {
        w0[t] = (int64_t)t * 65536 + 17 + rng_int(100);   /* the request slot's first window row */
        c0[t] = (int64_t)(T - t) * 4099 + 3;
    }
    int32_t *topk = NULL;
    if (k > 0) {
        topk = malloc(4 * (size_t)T * k);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++) {
                int32_t v = rng_int(4000);
                if (t == 0) v = -1;                                  /* no compressed key at all */
                else if (t % 3 == 1 && j >= k / 2) v = -1;           /* trailing -1s */
                else if (t % 3 == 2 && rng_int(4) == 0) v = -1;      /* scattered -1s */
                topk[(size_t)t * k + j] = v;
            }
    }
    const size_t L = (size_t)W + k;
    int32_t *want = malloc(4 * T * L);
    cpu_dec_lists(pos, fl, w0, c0, topk, T, W, k, want);
    int32_t *dpos = up(pos, sizeof pos), *dfl = up(fl, sizeof fl), *dtk = k > 0 ? up(topk, 4 * (size_t)T * k) : NULL;
    int64_t *dw0 = up(w0, sizeof w0), *dc0 = up(c0, sizeof c0);
    int32_t *didx = dfill(4 * T * L, 0x7b);   /* (0xff bytes would be -1, a valid entry) */
    ck_assert_int_eq(v41g_dec_lists(dpos, dfl, dw0, dc0, dtk, T, W, k, didx, NULL), 0);
    int32_t *got = down(didx, 4 * T * L);
    check_bits("dec_lists", got, want, T * L, 4);
    /* and what the list means (independent of the transcription of ref's loop): the window part holds
     * exactly the positions max(0, floor, p-W+1) .. p, position ps at the entry of its ring slot */
    for (int t = 0; t < T; t++) {
        const int p = pos[t];
        int lo = p - W + 1;
        if (lo < 0) lo = 0;
        if (lo < fl[t]) lo = fl[t];
        int seen = 0;
        for (int j = 0; j < W; j++) {
            int32_t e = got[(size_t)t * L + j];
            if (e < 0) { ck_assert_int_eq(e, -1); continue; }
            int64_t ps = e - w0[t];
            ck_assert_msg(ps >= lo && ps <= p && ps % W == (p + 1 + j) % W, "row %d entry %d: position %lld", t, j,
                          (long long)ps);
            seen++;
        }
        ck_assert_int_eq(seen, p >= lo ? p - lo + 1 : 0);
        if (p >= W && fl[t] == 0) ck_assert_int_eq(seen, W);   /* a full window */
    }
    v41g_free(dpos); v41g_free(dfl); v41g_free(dtk); v41g_free(dw0); v41g_free(dc0); v41g_free(didx);
    free(topk); free(want); free(got);
}
END_TEST

/* ------------------------------------------------------------ compressor decode step */
/* ref/engine.c compressor(), ratio m > 1: the history rows, then per complete group the softmax
 * pooling per channel in fp32 (C11: no contraction), o = v41_bf16r(acc). Rows are all written
 * before any group is pooled (the device does the same in two launches; ref, one row at a time
 * in position order, gives the same for the rows of one request). a_abs[t, ch] = sum |kv_k| w_k
 * (the scale of the rounding differences, for the tolerance). */
static void cpu_compress_dec(const float *kv, const float *sc, const int32_t *pos, const int64_t *hrow0, int T,
                             int d, int m, float *kvh, float *sch, uint16_t *latent, uint8_t *emit, double *a_abs)
{
    for (int t = 0; t < T; t++) {
        memcpy(kvh + (size_t)(hrow0[t] + pos[t]) * d, kv + (size_t)t * d, sizeof(float) * d);
        memcpy(sch + (size_t)(hrow0[t] + pos[t]) * d, sc + (size_t)t * d, sizeof(float) * d);
    }
    for (int t = 0; t < T; t++) {
        const int p = pos[t], g0 = p / m * m;
        const float *kh = kvh + (size_t)hrow0[t] * d, *sh = sch + (size_t)hrow0[t] * d;
        emit[t] = (p + 1) % m == 0;
        for (int ch = 0; ch < d; ch++) {
            latent[(size_t)t * d + ch] = 0;
            a_abs[(size_t)t * d + ch] = 0;
        }
        if (!emit[t]) continue;
        for (int ch = 0; ch < d; ch++) {
            float mx = -INFINITY, sum = 0, acc = 0;
            for (int k = 0; k < m; k++) {
                float s = sh[(size_t)(g0 + k) * d + ch];
                mx = s > mx ? s : mx;
            }
            float e_[64];
            for (int k = 0; k < m; k++) {
                e_[k] = expf(sh[(size_t)(g0 + k) * d + ch] - mx);
                sum += e_[k];
            }
            double aa = 0;
            for (int k = 0; k < m; k++) {
                acc += kh[(size_t)(g0 + k) * d + ch] * (e_[k] / sum);
                aa += fabs((double)kh[(size_t)(g0 + k) * d + ch]) * (e_[k] / sum);
            }
            latent[(size_t)t * d + ch] = v41_f32_to_bf16(v41_bf16r(acc));
            a_abs[(size_t)t * d + ch] = aa;
        }
    }
}
typedef struct { int m, d, same_req; } cd_case;
static const cd_case cd_cases[] = {{2, 72, 0}, {4, 512, 0}, {4, 64, 1}, {2, 300, 1}, {8, 33, 0}};
START_TEST(test_compress_dec)
{
    const int m = cd_cases[_i].m, d = cd_cases[_i].d, same = cd_cases[_i].same_req, S = 64;
    rng_seed(40 + _i);
    /* rows: positions in the first group (incomplete, then completing it), completing and
     * incomplete later groups, the last position of the slot */
    int32_t pos[16];
    int T = 0;
    pos[T++] = 0;
    pos[T++] = m - 1;                  /* completes the first group */
    pos[T++] = m > 2 ? m - 2 : 2;      /* first group, incomplete (m = 2: the second group's first row) */
    pos[T++] = 3 * m - 1;
    pos[T++] = 5 * m + 1;
    pos[T++] = S - 1;                  /* S % m == 0: completes */
    pos[T++] = m * (1 + rng_int(S / m - 2)) + rng_int(m);
    pos[T++] = m * (1 + rng_int(S / m - 2)) + m - 1;
    int64_t hrow0[16];
    int nslot = T;
    for (int t = 0; t < T; t++) hrow0[t] = (int64_t)(T - 1 - t) * S;   /* slot order != row order */
    if (same) {
        /* m more rows of the request of row 3, in reverse order (a batch with several rows of one
         * request: beyond the decode contract, which has one row a request): they are the whole
         * next group, completed by pos[3] + m, whose pooling must see the others' history rows */
        for (int q = m; q >= 1; q--) { pos[T] = pos[3] + q; hrow0[T] = hrow0[3]; T++; }
    }
    const size_t np = (size_t)nslot * S * d;
    /* history: the rows before each request's position are earlier steps' (random), the rest NaN
     * (a read of an unwritten row makes the latent NaN) */
    float *kvh = malloc(4 * np), *sch = malloc(4 * np);
    memset(kvh, 0xff, 4 * np);
    memset(sch, 0xff, 4 * np);
    for (int t = 0; t < T; t++) {
        int lo = pos[t];
        for (int u = 0; u < T; u++)
            if (hrow0[u] == hrow0[t] && pos[u] < lo) lo = pos[u];   /* rows of this launch stay NaN */
        for (int q = 0; q < lo; q++)
            for (int ch = 0; ch < d; ch++) {
                kvh[(size_t)(hrow0[t] + q) * d + ch] = 2.0f * rng_unit();
                sch[(size_t)(hrow0[t] + q) * d + ch] = (ch % 7 == 0 ? 40.0f : 3.0f) * rng_unit();
            }
    }
    float *kv = malloc(4 * (size_t)T * d), *sc = malloc(4 * (size_t)T * d);
    for (size_t i = 0; i < (size_t)T * d; i++) {
        kv[i] = 2.0f * rng_unit();
        sc[i] = (i % 7 == 0 ? 40.0f : 3.0f) * rng_unit();
    }
    sc[(size_t)1 * d] = 100.0f;   /* row 1 completes the first group: one weight ~1, the others ~0 */
    float *dkvh = up(kvh, 4 * np), *dsch = up(sch, 4 * np), *dkv = up(kv, 4 * (size_t)T * d),
          *dsc = up(sc, 4 * (size_t)T * d);
    int32_t *dpos = up(pos, 4 * (size_t)T);
    int64_t *dh = up(hrow0, 8 * (size_t)T);
    uint16_t *dlat = dpoison(2 * (size_t)T * d);
    uint8_t *demit = dfill((size_t)T, 0x7b);
    uint16_t *lat = malloc(2 * (size_t)T * d);
    uint8_t emit[16];
    double *a_abs = malloc(sizeof(double) * (size_t)T * d);
    cpu_compress_dec(kv, sc, pos, hrow0, T, d, m, kvh, sch, lat, emit, a_abs);
    ck_assert_int_eq(v41g_compress_dec(dkv, dsc, dpos, dh, T, d, m, dkvh, dsch, dlat, demit, NULL), 0);
    float *gkvh = down(dkvh, 4 * np), *gsch = down(dsch, 4 * np);
    uint16_t *glat = down(dlat, 2 * (size_t)T * d);
    uint8_t *gemit = down(demit, (size_t)T);
    check_bits("compress_dec kvh", gkvh, kvh, np, 4);   /* copies: exact, untouched rows included */
    check_bits("compress_dec sch", gsch, sch, np, 4);
    check_bits("compress_dec emit", gemit, emit, (size_t)T, 1);
    int emitted = 0;
    for (int t = 0; t < T; t++) emitted += emit[t];
    ck_assert_int_ge(emitted, 4);   /* the case list does complete groups */
    /* Latent. Same operations in the same order on both sides, but exp is glibc's expf on the CPU
     * and the device's (within 2 fp32 ulps of the true value; k_dev_a.cu rounds a double exp, which
     * agrees with glibc but for ~1e-4 of the arguments). Allowing 2 ulps (2^-22 relative) on each
     * e_k: sum and weights e_k/sum move by <= 2^-22 + 2^-22 plus at most (m + 2) roundings that can
     * now fall differently (2^-24 each), so each term kv_k w_k by <= (8 + m + 3) 2^-24 |kv_k| w_k,
     * and acc, whose m additions can also round differently (2^-24 of a partial sum <= a_abs each),
     * by delta <= (8 + 2m + 3) 2^-24 a_abs, a_abs = sum |kv_k| w_k (<= 32 2^-24 a_abs for m <= 8).
     * Two fp32 values delta apart round to bf16 values at most one bf16 ulp (<= 2^-7 |want|, also
     * when one of them crosses into the next binade) plus delta apart. Rows without a complete
     * group are exactly 0. */
    for (int t = 0; t < T; t++)
        for (int ch = 0; ch < d; ch++) {
            size_t i = (size_t)t * d + ch;
            if (!emit[t]) {
                ck_assert_msg(glat[i] == 0, "row %d ch %d: latent 0x%04x of an incomplete group", t, ch, glat[i]);
                continue;
            }
            double g = v41_bf16_to_f32(glat[i]), w = v41_bf16_to_f32(lat[i]);
            double tol = ldexp(fabs(w), -7) + 32.0 * ldexp(a_abs[i], -24);
            ck_assert_msg(!isnan(g) && fabs(g - w) <= tol, "row %d (p %d) ch %d: got %.9g want %.9g (tol %.3g)", t,
                          pos[t], ch, g, w, tol);
        }
    v41g_free(dkvh); v41g_free(dsch); v41g_free(dkv); v41g_free(dsc); v41g_free(dpos); v41g_free(dh);
    v41g_free(dlat); v41g_free(demit);
    free(kvh); free(sch); free(kv); free(sc); free(lat); free(a_abs); free(gkvh); free(gsch); free(glat);
    free(gemit);
}
END_TEST

/* ------------------------------------------------------------ candidate blocks */
/* ref/engine.c indexer(), candidate-source rows (W->cand_src), with v41_topk_desc */
static void cpu_cand_mask(const float *I, const int32_t *Lc_, const int32_t *pos, int T, int S, int m, int B,
                          int kb_max, uint8_t *mask)
{
    for (int t = 0; t < T; t++) {
        const float *It = I + (size_t)t * S;
        uint8_t *mk = mask + (size_t)t * S;
        memset(mk, 0, (size_t)S);
        const int Lc = Lc_[t], p = pos[t];
        int nb = (Lc + B - 1) / B;
        float *bs = malloc(sizeof(float) * (size_t)(nb + 1));
        for (int b = 0; b < nb; b++) {
            float mx = -INFINITY;
            for (int s = b * B; s < (b + 1) * B && s < Lc; s++) mx = It[s] > mx ? It[s] : mx;
            bs[b] = mx;
        }
        int Lraw = (p + 1) / m;
        if (Lraw > 0) {
            int last = (Lraw - 1) / B;
            if (last < nb) bs[last] = INFINITY;
        }
        int kb = kb_max < nb ? kb_max : nb;
        int32_t *sel = malloc(sizeof(int32_t) * (size_t)(kb > 0 ? kb : 1));
        v41_topk_desc(bs, nb, kb, sel);
        for (int j = 0; j < kb; j++)
            if (bs[sel[j]] > -INFINITY)
                for (int s = sel[j] * B; s < (sel[j] + 1) * B && s < Lc; s++) mk[s] = 1;
        free(sel);
        free(bs);
    }
}
typedef struct { int T, S, m, B, kb_max; } cm_case;
static const cm_case cm_cases[] = {
    {24, 40, 4, 4, 3},      /* tiny config shapes */
    {24, 300, 2, 8, 5},
    {24, 37, 4, 5, 1000},   /* kb_max > nb everywhere */
    {12, 20, 4, 4, 0},      /* no block kept */
    {12, 5000, 4, 3, 100},  /* many blocks, many kept */
    {6, 12000, 4, 1, 16},   /* 12000 keys: more than 48 KiB of shared memory (opt-in limit) */
    {6, 70000, 4, 64, 8},
    {30, 9, 1, 16, 2},      /* Lc < B for every row, m = 1 */
    {12, 65536, 1, 8, 2048},  /* the V4.1-Flash shape: 8192 blocks, radix select; ties (kind 1) */
    {4, 70000, 4, 1, 300},    /* 70000 blocks: more keys than shared memory holds (keys recomputed) */
    {8, 4096, 4, 128, 7},     /* 32 lanes per block (float4 path) */
    {8, 4100, 2, 16, 40},     /* 4 lanes per block; mask rows not all 16-byte aligned */
    {8, 8190, 2, 8, 100},     /* S % 4 != 0: one thread per block; misaligned mask rows */
    {8, 3000, 2, 12, 50},     /* B % 4 == 0 but B / 4 not a power of two */
};
/* Row t: Lc by t % 8 (0, < B, S, not a multiple of B, ...), position by t % 3 (decode-consistent
 * L_raw = Lc, any L_raw <= Lc including 0, L_raw past the last block: no pin), values by (t/3) % 4
 * (continuous; heavy ties between block maxima; NaN and -inf sprinkled; all -inf). Entries at
 * s >= Lc are large finite values that would win if read. */
static void cm_rows(const cm_case *c, int32_t *Lc, int32_t *pos, float *I)
{
    for (int t = 0; t < c->T; t++) {
        int S = c->S, B = c->B, m = c->m, L;
        switch (t % 8) {
        case 0: L = 0; break;
        case 1: L = B > 1 ? B - 1 : 1; break;
        case 2: L = S; break;
        case 3: L = S > 3 ? S - 3 : S; break;
        case 4: L = 3 * B + 1; break;
        default: L = 1 + rng_int(S); break;
        }
        if (L > S) L = S;
        Lc[t] = L;
        int p;
        switch (t % 3) {
        case 0: p = L * m - 1 + rng_int(m); break;
        case 1: p = rng_int(L * m + 1); break;
        default: p = (L + 2 * B) * m + rng_int(5); break;
        }
        pos[t] = p < 0 ? 0 : p;
        int kind = (t / 3) % 4;
        for (int s = 0; s < S; s++) {
            float v;
            if (s >= L) v = 1000.0f + rng_int(100);
            else if (kind == 0) v = 5.0f * rng_unit();
            else if (kind == 1) v = 0.5f * (float)rng_int(4) - 1.0f;
            else if (kind == 2) { int r = rng_int(20); v = r == 0 ? NAN : r < 5 ? -INFINITY : 5.0f * rng_unit(); }
            else v = -INFINITY;
            I[(size_t)t * S + s] = v;
        }
    }
}
START_TEST(test_cand_mask)
{
    const cm_case c = cm_cases[_i];
    rng_seed(50 + _i);
    int32_t *Lc = calloc((size_t)c.T, 4), *pos = calloc((size_t)c.T, 4);
    float *I = calloc((size_t)c.T * c.S, 4);
    cm_rows(&c, Lc, pos, I);
    uint8_t *want = malloc((size_t)c.T * c.S);
    cpu_cand_mask(I, Lc, pos, c.T, c.S, c.m, c.B, c.kb_max, want);
    float *dI = up(I, 4 * (size_t)c.T * c.S);
    int32_t *dLc = up(Lc, 4 * (size_t)c.T), *dpos = up(pos, 4 * (size_t)c.T);
    uint8_t *dmask = dpoison((size_t)c.T * c.S);
    ck_assert_int_eq(v41g_cand_mask(dI, dLc, dpos, c.T, c.S, c.m, c.B, c.kb_max, dmask, NULL), 0);
    uint8_t *got = down(dmask, (size_t)c.T * c.S);
    for (int t = 0; t < c.T; t++)
        for (int s = 0; s < c.S; s++)
            ck_assert_msg(got[(size_t)t * c.S + s] == want[(size_t)t * c.S + s],
                          "row %d (Lc %d, p %d) s %d (block %d): got %d want %d", t, Lc[t], pos[t], s, s / c.B,
                          got[(size_t)t * c.S + s], want[(size_t)t * c.S + s]);
    /* the CPU side keeps at most kb_max blocks (guards the transcription) */
    for (int t = 0; t < c.T; t++) {
        int nblk = 0;
        for (int s = 0; s < Lc[t]; s++) nblk += want[(size_t)t * c.S + s] && (s % c.B == 0);
        ck_assert_int_le(nblk, c.kb_max);
    }
    v41g_free(dI); v41g_free(dLc); v41g_free(dpos); v41g_free(dmask);
    free(Lc); free(pos); free(I); free(want); free(got);
}
END_TEST

/* exact ties between block maxima: the lower block id wins, including among +inf pins and -inf */
START_TEST(test_cand_mask_ties)
{
    enum { T = 4, S = 24, B = 4 };   /* 6 blocks */
    const int m = 4;
    float I[T * S];
    int32_t Lc[T] = {24, 24, 22, 24}, pos[T] = {3, 95, 87, 0};
    /* row 0: maxima 1,2,2,2,1,0 (pin block 0): kb 3 keeps 0, 1, 2 */
    /* row 1: all blocks tie at 0.5, the pin on the last block (Lraw 24 -> block 5): keeps 5, 0, 1 */
    /* row 2: maxima -inf, 7, -inf, 7, 7, 7 (Lc 22: block 5 has 2 entries; Lraw 22 -> pin block 5): keeps 5, 1, 3 */
    /* row 3: all -inf and Lraw = 0: nothing */
    const float mx0[6] = {1, 2, 2, 2, 1, 0}, mx2[6] = {-INFINITY, 7, -INFINITY, 7, 7, 7};
    for (int t = 0; t < T; t++)
        for (int s = 0; s < S; s++) {
            int b = s / B;
            float v;
            if (t == 0) v = s % B == 1 ? mx0[b] : mx0[b] - 3.0f;
            else if (t == 1) v = s % B == 2 ? 0.5f : -1.0f;
            else if (t == 2) v = s % B == 0 ? mx2[b] : -INFINITY;
            else v = -INFINITY;
            I[t * S + s] = v;
        }
    uint8_t want[T * S], *got;
    cpu_cand_mask(I, Lc, pos, T, S, m, B, 3, want);
    static const int keep[T][6] = {{1, 1, 1, 0, 0, 0}, {1, 1, 0, 0, 0, 1}, {0, 1, 0, 1, 0, 1}, {0}};
    for (int t = 0; t < T; t++)
        for (int s = 0; s < S; s++)
            ck_assert_int_eq(want[t * S + s], s < Lc[t] && keep[t][s / B]);   /* the CPU side itself */
    float *dI = up(I, sizeof I);
    int32_t *dLc = up(Lc, sizeof Lc), *dpos = up(pos, sizeof pos);
    uint8_t *dmask = dpoison(sizeof want);
    ck_assert_int_eq(v41g_cand_mask(dI, dLc, dpos, T, S, m, B, 3, dmask, NULL), 0);
    got = down(dmask, sizeof want);
    check_bits("cand_mask ties", got, want, sizeof want, 1);
    v41g_free(dI); v41g_free(dLc); v41g_free(dpos); v41g_free(dmask);
    free(got);
}
END_TEST

/* The V4.1-Flash shape (S = 65536, B = 8: 8192 blocks, kb = 2048) with crafted rows: ties spanning
 * the threshold, all -inf, kb >= the finite blocks, a pin among ties, -0 / +0 ties, +inf values
 * tied with the pin, negative ties, a partial last block. Each row is also checked against what it
 * must keep (independent of the CPU transcription). */
START_TEST(test_cand_mask_radix)
{
    enum { T = 9, S = 65536, B = 8, NB = S / B, KB = 2048 };
    const int m = 1;
    rng_seed(70);
    float *I = malloc(sizeof(float) * (size_t)T * S);
    int32_t Lc[T], pos[T];
    for (int t = 0; t < T; t++) { Lc[t] = S; pos[t] = 3 * S; }   /* Lraw = 3S + 1 > Lc: no pin */
    for (int t = 0; t < T; t++)
        for (int s = 0; s < S; s++) {
            const int b = s / B, r = s % B;
            float v;
            switch (t) {
            case 0: /* block maxima in {1, 2, 3} (about 2730 threes): the threshold falls inside the threes */
                v = r == 3 ? (float)(1 + (b * 7919 % 3)) : -5.0f;
                break;
            case 1: v = -INFINITY; break;   /* nothing */
            case 2: /* 1000 finite blocks (ids 7 * j), the others -inf: all 1000 kept */
                v = (b % 7 == 0 && b / 7 < 1000) ? (r == 0 ? 0.5f * (float)rng_unit() : -3.0f) : -INFINITY;
                break;
            case 3: /* every block 0.25, pin on block 5000: keeps 5000 and ids 0..2046 */
                v = r == 5 ? 0.25f : -1.0f;
                break;
            case 4: /* block maxima +0 or -0 (ties: they compare equal): ids 0..2047 */
                v = r == 2 ? ((b * 31 + s) % 3 ? -0.0f : 0.0f) : -2.0f;
                break;
            case 5: /* +inf in 1500 blocks (ids 3 j), the pin on block 4001 (+inf too), ties among
                     * 1.0 for the rest: keeps the 1500 +inf blocks, then the pin, then 547 of the 1.0s */
                v = (b % 3 == 0 && b / 3 < 1500 && r == 7) ? INFINITY : r == 1 ? 1.0f : -7.0f;
                break;
            case 6: /* negative ties: block maxima -(b % 5) - 1 (1639 blocks at -1): threshold at -2 */
                v = r == 4 ? -(float)(b % 5) - 1.0f : -100.0f;
                break;
            case 7: /* continuous values with NaN and -inf; Lc not a multiple of B or 16 */
            {
                const int q = rng_int(20);
                v = q == 0 ? NAN : q == 1 ? -INFINITY : 4.0f * rng_unit();
                break;
            }
            default: /* denormals and zeros of both signs: ties at tiny magnitudes */
            {
                const int q = rng_int(4);
                v = q == 0 ? 1e-45f : q == 1 ? -1e-45f : q == 2 ? 3e-45f : -0.0f;   /* 1 and 2 ulps */
                break;
            }
            }
            I[(size_t)t * S + s] = v;
        }
    pos[3] = 5000 * B;              /* Lraw = 5000 B + 1: block 5000 */
    pos[5] = 4001 * B + 3;          /* block 4001 */
    Lc[7] = S - 13;
    pos[7] = (S - 13) * m - 1;      /* decode-consistent: the pin on the last (partial) block */
    uint8_t *want = malloc((size_t)T * S);
    cpu_cand_mask(I, Lc, pos, T, S, m, B, KB, want);
    /* what the rows must keep */
    for (int t = 0; t < T; t++) {
        const uint8_t *w = want + (size_t)t * S;
        int n = 0;
        for (int b = 0; b < NB; b++) n += w[b * B];
        switch (t) {
        case 0: {
            int n3 = 0;
            for (int b = 0; b < NB; b++) {
                const int three = b * 7919 % 3 == 2;
                ck_assert_int_eq(w[b * B], three && n3 < KB);
                n3 += three;
            }
            ck_assert_int_gt(n3, KB);
            break;
        }
        case 1: ck_assert_int_eq(n, 0); break;
        case 2: ck_assert_int_eq(n, 1000); break;
        case 3:
            for (int b = 0; b < NB; b++) ck_assert_int_eq(w[b * B], b == 5000 || b < KB - 1);
            break;
        case 4:
            for (int b = 0; b < NB; b++) ck_assert_int_eq(w[b * B], b < KB);
            break;
        case 5: {
            int ones = 0;
            for (int b = 0; b < NB; b++) {
                const int inf = (b % 3 == 0 && b / 3 < 1500) || b == 4001;
                if (inf) ck_assert_int_eq(w[b * B], 1);
                else { ck_assert_int_eq(w[b * B], ones < KB - 1501); ones++; }
            }
            break;
        }
        case 6: {
            int n2 = 0;
            for (int b = 0; b < NB; b++) {
                if (b % 5 == 0) ck_assert_int_eq(w[b * B], 1);
                else if (b % 5 == 1) { ck_assert_int_eq(w[b * B], n2 < KB - 1639); n2++; }
                else ck_assert_int_eq(w[b * B], 0);
            }
            break;
        }
        default: ck_assert_int_eq(n, KB); break;
        }
    }
    float *dI = up(I, sizeof(float) * (size_t)T * S);
    int32_t *dLc = up(Lc, sizeof Lc), *dpos = up(pos, sizeof pos);
    uint8_t *dmask = dpoison((size_t)T * S);
    ck_assert_int_eq(v41g_cand_mask(dI, dLc, dpos, T, S, m, B, KB, dmask, NULL), 0);
    uint8_t *got = down(dmask, (size_t)T * S);
    for (int t = 0; t < T; t++)
        for (int s = 0; s < S; s++)
            ck_assert_msg(got[(size_t)t * S + s] == want[(size_t)t * S + s],
                          "row %d (Lc %d, p %d) s %d (block %d): got %d want %d", t, Lc[t], pos[t], s, s / B,
                          got[(size_t)t * S + s], want[(size_t)t * S + s]);
    /* again on the same inputs, kb = 1 and kb = nb - 1 (the extremes of the radix select) */
    const int kbs[2] = {1, NB - 1};
    for (int q = 0; q < 2; q++) {
        cpu_cand_mask(I, Lc, pos, T, S, m, B, kbs[q], want);
        ck_assert_int_eq(v41g_memset(dmask, 0xff, (size_t)T * S), 0);
        ck_assert_int_eq(v41g_cand_mask(dI, dLc, dpos, T, S, m, B, kbs[q], dmask, NULL), 0);
        uint8_t *g2 = down(dmask, (size_t)T * S);
        for (int t = 0; t < T; t++)
            for (int s = 0; s < S; s++)
                ck_assert_msg(g2[(size_t)t * S + s] == want[(size_t)t * S + s],
                              "kb %d row %d s %d (block %d): got %d want %d", kbs[q], t, s, s / B,
                              g2[(size_t)t * S + s], want[(size_t)t * S + s]);
        free(g2);
    }
    v41g_free(dI); v41g_free(dLc); v41g_free(dpos); v41g_free(dmask);
    free(I); free(want); free(got);
}
END_TEST

/* ------------------------------------------------------------ candidate apply */
typedef struct { int T, S, ld_mask, cmax; } ca_case;
static const ca_case ca_cases[] = {{5, 100, 60, 60},   /* cmax (= the mask width) < S */
                                   {5, 100, 130, 100}, {5, 100, 130, 150}, {5, 100, 100, 0}, {3, 70000, 65000, 65000},
                                   {300, 33, 33, 33}};
START_TEST(test_cand_apply)
{
    const ca_case c = ca_cases[_i];
    rng_seed(60 + _i);
    size_t nI = (size_t)c.T * c.S, nm = (size_t)c.T * c.ld_mask;
    float *I = malloc(4 * nI), *want = malloc(4 * nI);
    for (size_t i = 0; i < nI; i++) {
        int r = rng_int(50);
        I[i] = r == 0 ? NAN : r == 1 ? -INFINITY : 4.0f * rng_unit();
        if (r == 2) I[i] = f_of(0x7fa5a5a5u);   /* a NaN payload an untouched element keeps */
    }
    uint8_t *mask = malloc(nm);
    for (size_t i = 0; i < nm; i++) mask[i] = rng_int(3) == 0 ? 0 : (uint8_t)(1 + rng_int(2) * 6);   /* 0, 1, 7 */
    memcpy(want, I, 4 * nI);
    const int lim = c.cmax < c.S ? c.cmax : c.S;
    for (int t = 0; t < c.T; t++)
        for (int s = 0; s < lim; s++)
            if (!mask[(size_t)t * c.ld_mask + s]) want[(size_t)t * c.S + s] = -INFINITY;
    float *dI = up(I, 4 * nI);
    uint8_t *dm = up(mask, nm);
    int32_t *dc = up(&c.cmax, 4);
    ck_assert_int_eq(v41g_cand_apply(dI, c.S, dm, c.ld_mask, dc, c.T, NULL), 0);
    float *got = down(dI, 4 * nI);
    check_bits("cand_apply", got, want, nI, 4);
    v41g_free(dI); v41g_free(dm); v41g_free(dc);
    free(I); free(want); free(mask); free(got);
}
END_TEST

/* ------------------------------------------------------------ empty calls */
START_TEST(test_empty)
{
    /* n == 0 / T == 0: nothing launched, nothing read (NULL pointers), 0 returned */
    ck_assert_int_eq(v41g_f32_to_bf16(NULL, NULL, 0, NULL), 0);
    ck_assert_int_eq(v41g_bf16_to_f32(NULL, NULL, 0, NULL), 0);
    ck_assert_int_eq(v41g_scale_bf16r(NULL, 2.0f, NULL, 0, NULL), 0);
    ck_assert_int_eq(v41g_scatter_rows16(NULL, 8, NULL, 0, 8, NULL, 8, NULL), 0);
    ck_assert_int_eq(v41g_scatter_rows32(NULL, 8, NULL, 0, 8, NULL, 8, NULL), 0);
    ck_assert_int_eq(v41g_gather_rows16(NULL, 8, NULL, 0, 8, NULL, 8, NULL), 0);
    ck_assert_int_eq(v41g_dec_lists(NULL, NULL, NULL, NULL, NULL, 0, 128, 0, NULL, NULL), 0);
    ck_assert_int_eq(v41g_dec_lists(NULL, NULL, NULL, NULL, NULL, 0, 128, 512, NULL, NULL), 0);
    ck_assert_int_eq(v41g_compress_dec(NULL, NULL, NULL, NULL, 0, 64, 4, NULL, NULL, NULL, NULL, NULL), 0);
    ck_assert_int_eq(v41g_cand_mask(NULL, NULL, NULL, 0, 40, 4, 4, 3, NULL, NULL), 0);
    ck_assert_int_eq(v41g_cand_mask(NULL, NULL, NULL, 3, 0, 4, 4, 3, NULL, NULL), 0);
    ck_assert_int_eq(v41g_cand_apply(NULL, 40, NULL, 40, NULL, 0, NULL), 0);
    ck_assert_int_eq(v41g_sync(), 0);
}
END_TEST

static Suite *dev_a_suite(void)
{
    Suite *s = suite_create("gpu_dev_a");
    TCase *tc = tcase_create("elementwise");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_convert, 0, (int)(sizeof cv_n / sizeof cv_n[0]));
    tcase_add_loop_test(tc, test_rows, 0, (int)(sizeof rows_cases / sizeof rows_cases[0]));
    tcase_add_test(tc, test_empty);
    suite_add_tcase(s, tc);
    tc = tcase_create("decode");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_dec_lists, 0, (int)(sizeof dl_cases / sizeof dl_cases[0]));
    tcase_add_loop_test(tc, test_compress_dec, 0, (int)(sizeof cd_cases / sizeof cd_cases[0]));
    suite_add_tcase(s, tc);
    tc = tcase_create("candidates");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_cand_mask, 0, (int)(sizeof cm_cases / sizeof cm_cases[0]));
    tcase_add_test(tc, test_cand_mask_ties);
    tcase_add_test(tc, test_cand_mask_radix);
    tcase_add_loop_test(tc, test_cand_apply, 0, (int)(sizeof ca_cases / sizeof ca_cases[0]));
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    if (!gpu_present()) {
        printf("test_gpu_dev_a: no CUDA device: skipped\n");
        return 77;
    }
    SRunner *sr = srunner_create(dev_a_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
#endif
