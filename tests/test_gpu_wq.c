/* test_gpu_wq: the Linears over weights in their storage formats (gpu/v41_gpu.h, v41g_wq: fp8
 * e4m3 codes with one e8m0 scale per 32x32 block, fp4 e2m1 codes with one e8m0 scale per row and
 * 32 columns) against a CPU computation that dequantizes with ref's own conversions
 * (v41_e4m3_to_f32, v41_fp4_to_f32, v41_e8m0_to_f32) and sums in double:
 *   - v41g_wq_gemm: fp8 and fp4 at M = 1..130, K = 32..2048 (K % 64 != 0 too), N = 1..300
 *     (N % 8 != 0 too); every workspace size (NULL, too small, v41g_wq_ws_bytes); fp32 and bf16
 *     out; fp8 row slices (r0 > 0); bitwise repeatability;
 *   - v41g_wq_gemm_grouped: MoE-like sorted rows (an empty group, a gather list with repeats,
 *     groups at strides larger than a group, NaN bytes in the gaps); groups of 65, 80 and 144 rows
 *     with 64-row m tiles, through the wgmma kernel's tail rows (V41_WQ_TAIL unset, 16, 8 and 0);
 *   - v41g_wq_dequant: bit for bit;
 *   - v41g_moe_ffn with q13/q2 (fp4 experts) and q13s/q2s (fp8 shared expert) against the same
 *     FFN over the dequantized bf16 copies (w13/w2/w13s/w2s), at 5 tokens and at 300 (the shared
 *     expert as dequantize + cuBLAS);
 *   - bad arguments: an error, nothing written;
 *   - the split-K sum four outputs a thread (outputs of at least 1024 x SMs elements) against the
 *     one-output kernel (V41_WQ_REDUCE1=1), bit for bit;
 *   - V41_WQ_SPLITS=n (1, 2, 3, 7; tiled and decode kernels): the workspace size follows n, results
 *     within the bound;
 *   - the decode kernel's splits summed in a thread-block cluster (compute 9.0+) against the
 *     second kernel's sum (V41_WQ_NO_CLUSTER=1), bit for bit, and where the cluster is not used;
 *   - the fp8 MMA path (gpu/k_wq_f8.cu, case "f8"): v41g_act_quant_f8 against ref's act_quant,
 *     v41g_wq_gemm_f8 exact where every block sum fits 9 bits and within a derived bound of
 *     Hopper's fp8 accumulation otherwise (its derivation at f8_run), refusals, and the V41_WQ_F8MMA switch;
 *   - the GEMM shapes again with V41_WQ_NO_WGMMA=1 (the mma.sync kernel; on an sm_90a build the
 *     wgmma kernel runs by default) and with V41_WQ_NO_GEMV=1 (M <= 8 and grouped calls of at
 *     most 8 rows a group on average take the decode kernel g_wq_gemv_kernel by default when
 *     K % 64 == 0; grouped cases with 2 and 3 rows a group on average cover it there).
 * The codes go to the device in the checkpoint layout and are tiled there by v41g_wq_tile (each
 * group into NaN-poisoned memory, so a tile byte it failed to write or pad breaks a result).
 * Inputs: bf16-exact x (uniform, act_quant'ed as the fp8/fp4 Linears' inputs are, and
 * log-uniform magnitudes 2^-12..2^5); random codes (fp8: every byte but the NaNs 0x7F/0xFF, so
 * zeros of both signs and subnormals (exponent field 0) too; fp4: all 16 nibbles, 0x1 = 0.5 and
 * 0x9 = -0.5 among them); e8m0 scales 107..131 (2^-20..2^4). Device outputs are poisoned (NaN
 * bits) before each launch so an unwritten element fails.
 *
 * Tolerance of an fp32 output (out_f32 = 1). Every dequantized weight is exact (an e4m3 or
 * e2m1 code times a power of two fits bf16) and so is every product x_k * w_nk in fp32 (8 + 4
 * significant bits; magnitudes 2^-60..2^16 here, far from fp32 underflow and overflow). The
 * only error is therefore in the K - 1 fp32 additions, in whatever order or tree the kernel
 * uses (split-K partials summed by a second kernel included): |fl(sum) - sum| <= gamma_{K-1} *
 * sum_k |x_k w_nk|, gamma_n = n u / (1 - n u). With round-to-nearest u = 2^-24; tensor cores
 * may align and truncate instead of rounding (u = 2^-23), and gamma_{K-1} <= K 2^-23 while
 * K^2 2^-23 <= 1 (K <= 2048). Hence
 *     |got - sum| <= 2 K 2^-24 sum_k |x_k w_nk|    (+ FLT_MIN: an all-zero row sums to 0 exactly)
 * with `sum` the double-precision result (its own error, <= K 2^-53 sum|..|, is negligible).
 * Tolerance of a bf16 output (out_f32 = 0). The kernel rounds its fp32 sum r once to bf16
 * (RNE): |bf16(r) - r| <= ulp(r)/2 <= ulp_bf16(bf16(r))/2 (rounding never lowers the binade), so
 *     |got - sum| <= 2 K 2^-24 sum_k |x_k w_nk| + ulp_bf16(got)/2,
 * i.e. within half a bf16 ulp of the exact result unless cancellation makes the accumulation
 * bound exceed that (compared with the double result directly, so no double rounding through
 * fp32). Moreover the bf16 output must be bit for bit v41_bf16r of the fp32 output of the same
 * call with the same workspace: the header fixes the summation order by the shapes and the
 * workspace size, and the output type only changes the final conversion.
 * Exit 77 (skip) when the build has no CUDA or the machine has no device; CUDA is initialised
 * only inside the forked tests (a probe child decides the skip). */
#include "config.h"
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef HAVE_CUDA
int main(void)
{
    printf("test_gpu_wq: built without CUDA: skipped\n");
    return 77;
}
#else
#include "v41_gpu.h"
#include "v41_ops.h"
#include "v41_quant.h"
#include "test_gpu_probe.h"
#include "test_gpu_util.h"

enum { CUDA_INVALID_VALUE = 1 };   /* cudaErrorInvalidValue */

/* ------------------------------------------------------------ host weights */
/* codes of one group, element i (row-major over the full tensor's rows): fp8 a byte, fp4 a nibble */
typedef uint8_t (*code_gen)(size_t i);
/* fp8: any byte but the NaNs; the first ones of a group are the edge codes (zeros of both signs,
 * the smallest and largest subnormals, the smallest normal, +-448) */
static const uint8_t fp8_edge[] = {0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x7E, 0xFE};
static uint8_t gen_fp8_any(size_t i)
{
    if (i < sizeof fp8_edge) return fp8_edge[i];
    uint8_t c;
    do c = (uint8_t)rng_u32(); while ((c & 0x7f) == 0x7f);
    return c;
}
/* fp4: any nibble; the first ones are +-0.5, the zeros and +-6 */
static const uint8_t fp4_edge[] = {0x1, 0x9, 0x0, 0x8, 0x7, 0xF};
static uint8_t gen_fp4_any(size_t i) { return i < sizeof fp4_edge ? fp4_edge[i] : (uint8_t)(rng_u32() & 15); }

typedef struct {
    int fmt, G, N, K, r0;   /* r0: rows of the full tensor before the slice (fp8) */
    size_t wn, sn;          /* bytes of one group's codes and scales (the full tensor: r0 + N rows) */
    size_t wst, sst;        /* group strides, >= wn, sn (the gaps hold NaN codes and scales) */
    uint8_t *w, *s;         /* host: G groups */
    float *deq;             /* host: [G][N][K] dequantized values of the slice */
    uint8_t *dw, *ds;       /* device copies of w, s */
    uint8_t *dt;            /* device: the slice's codes tiled (v41g_wq_tile), group stride tst */
    size_t tst;
} qw;

/* G groups of a [r0 + N, K] weight (row slice r0.. used), codes from gen, scales uniform in
 * [slo, shi]; pad > 0: strides rounded up past the group size (256 bytes for codes, 16 for
 * scales) with 0xFF (NaN) bytes in between */
static qw qw_make(int fmt, int G, int N, int K, int r0, int pad, code_gen gen, int slo, int shi)
{
    qw q = {fmt, G, N, K, r0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, 0};
    const int R = r0 + N, KB = K / 32;
    q.wn = fmt == V41G_WQ_FP8 ? (size_t)R * K : (size_t)R * (K / 2);
    q.sn = fmt == V41G_WQ_FP8 ? (size_t)((R + 31) / 32) * KB : (size_t)R * KB;
    q.wst = pad ? (q.wn + 100 + 255) / 256 * 256 : q.wn;
    q.sst = pad ? (q.sn + 10 + 15) / 16 * 16 : q.sn;
    q.w = malloc(q.wst * G);
    q.s = malloc(q.sst * G);
    memset(q.w, 0xff, q.wst * G);
    memset(q.s, 0xff, q.sst * G);
    q.deq = malloc(sizeof(float) * G * (size_t)N * K + 4);
    for (int g = 0; g < G; g++) {
        uint8_t *w = q.w + g * q.wst, *s = q.s + g * q.sst;
        if (fmt == V41G_WQ_FP8)
            for (size_t i = 0; i < q.wn; i++) w[i] = gen(i);
        else
            for (size_t i = 0; i < q.wn; i++) {
                uint8_t lo = gen(2 * i), hi = gen(2 * i + 1);   /* element 2j in the low nibble */
                w[i] = (uint8_t)(lo | hi << 4);
            }
        for (size_t i = 0; i < q.sn; i++) s[i] = (uint8_t)(slo + rng_int(shi - slo + 1));
        float *d = q.deq + (size_t)g * N * K;
        for (int n = 0; n < N; n++) {
            const int r = r0 + n;
            for (int k = 0; k < K; k++) {
                float c, sc;
                if (fmt == V41G_WQ_FP8) {
                    c = v41_e4m3_to_f32(w[(size_t)r * K + k]);
                    sc = v41_e8m0_to_f32(s[(size_t)(r / 32) * KB + k / 32]);
                } else {
                    uint8_t b = w[(size_t)r * (K / 2) + k / 2];
                    c = v41_fp4_to_f32(k & 1 ? b >> 4 : b & 15);
                    sc = v41_e8m0_to_f32(s[(size_t)r * KB + k / 32]);
                }
                d[(size_t)n * K + k] = c * sc;   /* exact */
            }
        }
    }
    q.dw = up(q.w, q.wst * G);
    q.ds = up(q.s, q.sst * G);
    /* the kernels read tiled codes: tile each group's slice (rows r0..); pad > 0: NaN bytes
     * between the groups' tiled blocks, as between the checkpoint copies */
    const size_t tb = v41g_wq_tiled_bytes(fmt, N, K);
    ck_assert_uint_gt(tb, 0);
    q.tst = pad ? (tb + 100 + 255) / 256 * 256 : tb;
    q.dt = dpoison(q.tst * G);
    for (int g = 0; g < G; g++) {
        const uint8_t *src = q.dw + g * q.wst + (fmt == V41G_WQ_FP8 ? (size_t)r0 * K : 0);
        ck_assert_int_eq(v41g_wq_tile(fmt, N, K, src, q.dt + g * q.tst, NULL), 0);
    }
    return q;
}
/* the v41g_wq of the slice: codes from row r0, scales from the full tensor's first scale row
 * (row n uses scale row (r0 + n) / 32); rebase: the same weight described from scale row r0 / 32
 * with r0 % 32 (both must give the same result) */
static v41g_wq qw_desc(const qw *q, int rebase)
{
    v41g_wq W = {q->fmt, q->N, q->K, q->r0, q->dt, q->ds, (long long)q->tst, (long long)q->sst};
    if (rebase) { W.s = q->ds + (size_t)(q->r0 / 32) * (q->K / 32); W.r0 = q->r0 % 32; }
    return W;
}
static void qw_free(qw *q)
{
    v41g_free(q->dw); v41g_free(q->ds); v41g_free(q->dt);
    free(q->w); free(q->s); free(q->deq);
}

/* x[M,K] bf16: rows cycle through uniform in [-4,4), act_quant'ed (what an fp8 Linear is fed:
 * e4m3 codes times a power of two, small elements subnormal codes) and log-uniform magnitudes
 * 2^-12..2^5 of random sign; row 2 (M > 2) all zeros */
static uint16_t *rand_x(int M, int K)
{
    uint16_t *x = malloc(2 * (size_t)M * K);
    float *r = malloc(sizeof(float) * K);
    for (int m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) {
            if (m % 3 == 2) r[k] = ldexpf(1.0f + 0.5f * (rng_unit() + 1.0f), rng_int(17) - 12) * (rng_u32() & 1 ? -1 : 1);
            else r[k] = 4.0f * rng_unit();
        }
        if (m % 3 == 1) v41_act_quant(r, (size_t)K, 32, NULL);
        if (m == 2) memset(r, 0, sizeof(float) * K);
        for (int k = 0; k < K; k++) x[(size_t)m * K + k] = v41_f32_to_bf16(r[k]);
    }
    free(r);
    return x;
}

/* y[p, n] = x[xrow ? xrow[p] : p] . w[n]^T in double, and the sum of |terms| (the tolerance) */
static void ref_rows(const uint16_t *x, const int32_t *xrow, int p0, int p1, const float *w, int N, int K,
                     double *y, double *mag)
{
    for (int p = p0; p < p1; p++) {
        const uint16_t *xr = x + (size_t)(xrow ? xrow[p] : p) * K;
        for (int n = 0; n < N; n++) {
            double s = 0, a = 0;
            for (int k = 0; k < K; k++) {
                double t = (double)v41_bf16_to_f32(xr[k]) * w[(size_t)n * K + k];
                s += t;
                a += fabs(t);
            }
            y[(size_t)p * N + n] = s;
            mag[(size_t)p * N + n] = a;
        }
    }
}

/* one bf16 ulp at |v| (8 significant bits) */
static double ulp_bf16(double v)
{
    if (v == 0 || !isfinite(v)) return 0;
    int e;
    frexp(v, &e);   /* |v| in [2^(e-1), 2^e) */
    return ldexp(1.0, e - 8);
}

/* got (fp32 or bf16 bits, n = rows*N) against the double result; see the header for the bounds */
static void check_out(const char *what, const void *got, int out_f32, const double *exp, const double *mag, size_t n,
                      int K)
{
    size_t bad = 0, worst = 0;
    double wd = -1;
    for (size_t i = 0; i < n; i++) {
        double g = out_f32 ? ((const float *)got)[i] : v41_bf16_to_f32(((const uint16_t *)got)[i]);
        double tol = 2.0 * K * 0x1p-24 * mag[i] + FLT_MIN + (out_f32 ? 0 : ulp_bf16(g) / 2);
        double d = fabs(g - exp[i]);
        if (!(d <= tol)) {   /* NaN (unwritten) fails */
            if (!bad++ || d - tol > wd || isnan(d)) { wd = isnan(d) ? INFINITY : d - tol; worst = i; }
        }
    }
    if (bad) {
        double g = out_f32 ? ((const float *)got)[worst] : v41_bf16_to_f32(((const uint16_t *)got)[worst]);
        ck_abort_msg("%s (%s out): %zu of %zu outside tolerance; worst at %zu: got %.9g want %.9g (sum|terms| %.3g, K %d)",
                     what, out_f32 ? "fp32" : "bf16", bad, n, worst, g, exp[worst], mag[worst], K);
    }
}

/* bf16 bits = v41_bf16r of the fp32 values, element by element */
static void check_bf16_of_f32(const char *what, const uint16_t *b, const float *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != v41_f32_to_bf16(f[i]))
            ck_abort_msg("%s: bf16 out element %zu is 0x%04x, bf16 of the fp32 out %.9g is 0x%04x", what, i, b[i],
                         (double)f[i], v41_f32_to_bf16(f[i]));
}
static void check_same(const char *what, const void *a, const void *b, size_t bytes)
{
    const unsigned char *p = a, *q = b;
    for (size_t i = 0; i < bytes; i++)
        if (p[i] != q[i]) ck_abort_msg("%s: not bitwise repeatable (byte %zu of %zu)", what, i, bytes);
}

/* ------------------------------------------------------------ v41g_wq_gemm */
typedef struct { int M, N, K; } gm_shape;
/* M = 1 and M > 64; K = 32, 96 (K % 64 != 0), up to 2048; N = 1, 31, 129, 300 (not multiples of
 * 8, 16 or 128) and 128. M = 12 and 40: partial 16- and 64-row m tiles of the tiled kernels */
static const gm_shape gm_shapes[] = {{1, 128, 512}, {3, 31, 96},   {8, 129, 64},  {17, 300, 2048}, {64, 1, 32},
                                     {130, 129, 96}, {1, 300, 2048}, {64, 128, 512}, {130, 31, 2048}, {17, 1, 512},
                                     {3, 300, 32},   {1, 31, 64},  {12, 129, 256}, {40, 300, 1024}};
#define N_GM ((int)(sizeof gm_shapes / sizeof gm_shapes[0]))

/* every workspace size (NULL, 1 KB, the full split), fp32 and bf16 out, each twice */
static void run_gemm(const qw *q, const v41g_wq *W, int M, uint64_t seed, const char *tag)
{
    const int N = W->N, K = W->K;
    const size_t ny = (size_t)M * N;
    rng_seed(seed);
    uint16_t *x = rand_x(M, K);
    double *exp = malloc(sizeof(double) * ny), *mag = malloc(sizeof(double) * ny);
    ref_rows(x, NULL, 0, M, q->deq, N, K, exp, mag);
    uint16_t *dx = up(x, 2 * (size_t)M * K);
    const size_t full = v41g_wq_ws_bytes(W, M);
    const size_t wss[3] = {0, 1024, full};
    for (int v = 0; v < 3; v++) {
        char what[160];
        snprintf(what, sizeof what, "%s %s M%d N%d K%d r0 %d, ws %zu of %zu", tag,
                 W->fmt == V41G_WQ_FP8 ? "fp8" : "fp4", M, N, K, W->r0, wss[v], full);
        void *ws = wss[v] ? dpoison(wss[v]) : NULL;   /* stale partials must not matter */
        float *dy = dpoison(4 * ny), *dy2 = dpoison(4 * ny);
        uint16_t *db = dpoison(2 * ny);
        ck_assert_int_eq(v41g_wq_gemm(W, dx, M, dy, 1, ws, wss[v], NULL), 0);
        ck_assert_int_eq(v41g_wq_gemm(W, dx, M, dy2, 1, ws, wss[v], NULL), 0);
        ck_assert_int_eq(v41g_wq_gemm(W, dx, M, db, 0, ws, wss[v], NULL), 0);
        float *y = down(dy, 4 * ny), *y2 = down(dy2, 4 * ny);
        uint16_t *b = down(db, 2 * ny);
        check_out(what, y, 1, exp, mag, ny, K);
        check_same(what, y, y2, 4 * ny);
        check_out(what, b, 0, exp, mag, ny, K);
        check_bf16_of_f32(what, b, y, ny);
        v41g_free(ws); v41g_free(dy); v41g_free(dy2); v41g_free(db);
        free(y); free(y2); free(b);
    }
    v41g_free(dx);
    free(x); free(exp); free(mag);
}

static void gemm_case(int fmt, int i)
{
    const gm_shape c = gm_shapes[i];
    rng_seed(100 + 37 * i + fmt);
    qw q = qw_make(fmt, 1, c.N, c.K, 0, 0, fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, 107, 131);
    v41g_wq W = qw_desc(&q, 0);
    run_gemm(&q, &W, c.M, 200 + 37 * i + fmt, "gemm");
    qw_free(&q);
}
START_TEST(test_gemm_fp8) { gemm_case(V41G_WQ_FP8, _i); }
END_TEST
START_TEST(test_gemm_fp4) { gemm_case(V41G_WQ_FP4, _i); }
END_TEST
/* the same shapes through the mma.sync kernel (on an sm_90a build the wgmma kernel runs by default;
 * V41_WQ_NO_WGMMA, read at every call, selects the other one) */
START_TEST(test_gemm_mma_fallback)
{
    setenv("V41_WQ_NO_WGMMA", "1", 1);
    gemm_case(_i % 2 ? V41G_WQ_FP4 : V41G_WQ_FP8, _i / 2);
    unsetenv("V41_WQ_NO_WGMMA");
}
END_TEST

/* the same shapes with the decode kernel off (V41_WQ_NO_GEMV, read at every call): M <= 8 through
 * the tiled kernels */
START_TEST(test_gemm_no_gemv)
{
    setenv("V41_WQ_NO_GEMV", "1", 1);
    gemm_case(_i % 2 ? V41G_WQ_FP4 : V41G_WQ_FP8, _i / 2);
    unsetenv("V41_WQ_NO_GEMV");
}
END_TEST

/* v41g_wq_gemm of x [M][K] two ways, fp32 and bf16 out: first as the environment stands, with
 * workspace wsa (na bytes), then with environment variable var set to "1", with wsb (nb bytes).
 * The two must agree bit for bit (what: the two sums) and be within the bound of run_gemm. */
static void gemm_two_ways(const qw *q, const v41g_wq *W, const uint16_t *x, int M, void *wsa, size_t na,
                          const char *var, void *wsb, size_t nb, const char *what)
{
    const int N = W->N, K = W->K;
    const size_t ny = (size_t)M * N;
    uint16_t *dx = up(x, 2 * (size_t)M * K);
    float *da = dpoison(4 * ny), *db = dpoison(4 * ny);
    uint16_t *ba = dpoison(2 * ny), *bb = dpoison(2 * ny);
    ck_assert_int_eq(v41g_wq_gemm(W, dx, M, da, 1, wsa, na, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm(W, dx, M, ba, 0, wsa, na, NULL), 0);
    setenv(var, "1", 1);
    ck_assert_int_eq(v41g_wq_gemm(W, dx, M, db, 1, wsb, nb, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm(W, dx, M, bb, 0, wsb, nb, NULL), 0);
    unsetenv(var);
    float *ya = down(da, 4 * ny), *yb = down(db, 4 * ny);
    uint16_t *ca = down(ba, 2 * ny), *cb = down(bb, 2 * ny);
    char msg[160];
    snprintf(msg, sizeof msg, "%s (fp32 out)", what);
    check_same(msg, ya, yb, 4 * ny);
    snprintf(msg, sizeof msg, "%s (bf16 out)", what);
    check_same(msg, ca, cb, 2 * ny);
    double *exp = malloc(sizeof(double) * ny), *mag = malloc(sizeof(double) * ny);
    ref_rows(x, NULL, 0, M, q->deq, N, K, exp, mag);
    check_out(what, ya, 1, exp, mag, ny, K);
    check_out(what, ca, 0, exp, mag, ny, K);
    v41g_free(dx); v41g_free(da); v41g_free(db); v41g_free(ba); v41g_free(bb);
    free(ya); free(yb); free(ca); free(cb); free(exp); free(mag);
}

/* compute capability major of the device, from v41g_device_name ("NVIDIA H200 (sm_90, 132 SMs)") */
static int cc_major(void)
{
    char name[256];
    ck_assert_int_eq(v41g_device_name(name, sizeof name), 0);
    const char *p = strstr(name, "(sm_");
    ck_assert_msg(p != NULL, "device name without (sm_..): %s", name);
    return atoi(p + 4) / 10;
}

/* V41_WQ_SPLITS=n (read at every call) replaces the split rule of dense calls: the workspace size
 * follows n, and every workspace size and output type of run_gemm stays within its bound. N 300,
 * K 2048 (32 k tiles); n = 1, 2, 3, 7. M = 17 (the tiled kernels: whole k tiles a split, so 1, 2,
 * 3, 7 splits of 32, 16, 11, 5 tiles) and M = 1 (the decode kernel: whole groups of 4 tiles a
 * split, so 1, 2, 3, 4 splits of 32, 16, 12, 8 tiles). On compute 9.0+ the decode kernel's splits
 * here (3 bands x at most 8 splits: one wave) sum in a thread-block cluster and need no workspace;
 * _i 16..23 repeat the M = 1 cases with V41_WQ_NO_CLUSTER=1 (the partials in the workspace, summed
 * by the second kernel). _i: fp8 / fp4 x n x M (x cluster). */
START_TEST(test_gemm_splits)
{
    static const int ns[4] = {1, 2, 3, 7}, tiled[4] = {1, 2, 3, 7}, decode[4] = {1, 2, 3, 4};
    const int fmt = _i % 2 ? V41G_WQ_FP4 : V41G_WQ_FP8, j = (_i / 2) % 4, M = _i < 8 ? 17 : 1, n = ns[j];
    const int sp = M == 1 ? decode[j] : tiled[j], nocl = _i >= 16, cl = M == 1 && sp > 1 && !nocl && cc_major() >= 9;
    enum { N = 300, K = 2048 };
    rng_seed(1300 + _i);
    qw q = qw_make(fmt, 1, N, K, 0, 0, fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, 107, 131);
    v41g_wq W = qw_desc(&q, 0);
    char v[8];
    snprintf(v, sizeof v, "%d", n);
    setenv("V41_WQ_SPLITS", v, 1);
    if (nocl) setenv("V41_WQ_NO_CLUSTER", "1", 1);
    ck_assert_uint_eq(v41g_wq_ws_bytes(&W, M), sp > 1 && !cl ? sizeof(float) * (size_t)sp * M * N : 0);
    char tag[64];
    snprintf(tag, sizeof tag, "V41_WQ_SPLITS=%d (%d splits%s)", n, sp, cl ? ", cluster sum" : nocl ? ", no cluster" : "");
    run_gemm(&q, &W, M, 1310 + _i, tag);
    unsetenv("V41_WQ_SPLITS");
    unsetenv("V41_WQ_NO_CLUSTER");
    qw_free(&q);
}
END_TEST

/* The decode kernel's cluster sum (compute 9.0+; skipped below) against the second kernel's
 * (V41_WQ_NO_CLUSTER=1, the partials in the workspace): the same additions in the same order, so
 * bit for bit, fp32 and bf16 out; and within the bound of run_gemm. N 300 (3 bands), K 2048 (32 k
 * tiles), M = 1, 5, 8 rows; the split rule (8 splits of 4 tiles: the largest cluster) and
 * V41_WQ_SPLITS=3 (12, 12 and 8 tiles: a shorter last rank). And where the rule asks for more
 * than 8 splits (K 4096: 16) or more than one wave of CTAs (N 128 x 200 bands, 3 splits), no
 * cluster: the workspace size says so. _i: fp8 / fp4 x M x splits. */
START_TEST(test_gemm_cluster)
{
    static const int Ms[3] = {1, 5, 8};
    const int fmt = _i % 2 ? V41G_WQ_FP4 : V41G_WQ_FP8, M = Ms[(_i / 2) % 3], three = _i >= 6;
    if (cc_major() < 9) return;   /* (no clusters: test_gemm_splits covers the workspace sums) */
    enum { N = 300, K = 2048 };
    rng_seed(1400 + _i);
    qw q = qw_make(fmt, 1, N, K, 0, 0, fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, 107, 131);
    v41g_wq W = qw_desc(&q, 0);
    if (three) setenv("V41_WQ_SPLITS", "3", 1);
    const size_t ny = (size_t)M * N;
    ck_assert_uint_eq(v41g_wq_ws_bytes(&W, M), 0);   /* the splits sum in a cluster */
    setenv("V41_WQ_NO_CLUSTER", "1", 1);
    const size_t wsb = v41g_wq_ws_bytes(&W, M);
    unsetenv("V41_WQ_NO_CLUSTER");
    ck_assert_uint_eq(wsb, sizeof(float) * (size_t)(three ? 3 : 8) * ny);
    uint16_t *x = rand_x(M, K);
    void *ws = dpoison(wsb);
    gemm_two_ways(&q, &W, x, M, NULL, 0, "V41_WQ_NO_CLUSTER", ws, wsb, "cluster sum against the second kernel");
    unsetenv("V41_WQ_SPLITS");
    v41g_free(ws);
    free(x);
    qw_free(&q);
    if (_i > 1) return;
    /* no cluster: 16 splits (K 4096, 3 bands), or 3 splits of 200 bands (600 CTAs) */
    const int shp[2][2] = {{300, 4096}, {128 * 200, 2048}}, nsp[2] = {16, 3};
    for (int c = 0; c < 2; c++) {
        qw r = qw_make(fmt, 1, shp[c][0], shp[c][1], 0, 0, fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, 107, 131);
        v41g_wq R = qw_desc(&r, 0);
        ck_assert_uint_eq(v41g_wq_ws_bytes(&R, 1), sizeof(float) * (size_t)nsp[c] * shp[c][0]);
        qw_free(&r);
    }
}
END_TEST

/* The split-K sum of large outputs (M N >= 1024 per SM: g_wq_reduce4_kernel, four outputs a
 * thread) against the one-output kernel (V41_WQ_REDUCE1=1): the same sums in the same order, so
 * bit for bit, fp32 and bf16 out; and within the bound of run_gemm. M = 64, N = 2176 (17 bands:
 * fewer CTAs than SMs, so K is split), 139264 outputs. */
START_TEST(test_gemm_reduce4)
{
    enum { M = 64, N = 2176, K = 512 };
    rng_seed(1200 + _i);
    const int fmt = _i ? V41G_WQ_FP4 : V41G_WQ_FP8;
    qw q = qw_make(fmt, 1, N, K, 0, 0, fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, 107, 131);
    v41g_wq W = qw_desc(&q, 0);
    const size_t wsb = v41g_wq_ws_bytes(&W, M);
    ck_assert_uint_gt(wsb, 0);   /* the call splits */
    uint16_t *x = rand_x(M, K);
    void *ws = dpoison(wsb);
    gemm_two_ways(&q, &W, x, M, ws, wsb, "V41_WQ_REDUCE1", ws, wsb, "split-K sum, four outputs a thread against one");
    v41g_free(ws);
    free(x);
    qw_free(&q);
}
END_TEST

/* fp8 row slices of a checkpoint tensor: rows r0..r0+N of a [r0 + N, K] weight, the scales of the
 * full tensor (rebase: the same slice described from scale row r0 / 32 with r0 % 32) */
typedef struct { int r0, rebase, M, N, K; } sl_case;
static const sl_case sl_cases[] = {{5, 0, 5, 70, 96}, {40, 0, 5, 70, 96}, {40, 1, 5, 70, 96}, {37, 0, 130, 59, 512},
                                   {64, 1, 1, 33, 64}};
START_TEST(test_gemm_slice)
{
    const sl_case c = sl_cases[_i];
    rng_seed(300 + _i);
    qw q = qw_make(V41G_WQ_FP8, 1, c.N, c.K, c.r0, 0, gen_fp8_any, 107, 131);
    v41g_wq W = qw_desc(&q, c.rebase);
    run_gemm(&q, &W, c.M, 400 + _i, c.rebase ? "slice (rebased scales)" : "slice");
    qw_free(&q);
}
END_TEST

/* ------------------------------------------------------------ v41g_wq_gemm_grouped */
/* row-count sets: 0: 81 rows (17 a group on average: the tiled kernels); 1: 15 rows (3 on average:
 * the decode kernel, 8-row m tiles, the 9-row group in two); 2: 8 rows (2 on average: 4-row m
 * tiles, the 5-row group in two); 4: 40 rows (8 on average: the decode kernel with 16 rows a pass,
 * so the 16-row group in one pass of two row tiles, the 1- and 6-row groups with one, the 17-row
 * group in two passes; K 5120 stages the rows in two or more chunks of k tiles; tail -2:
 * V41_WQ_GEMV16=0, 8 rows a pass; scales up to 128: that instance's fp4 scale folded into the
 * decode, which scales up to 131 send to the per-block path for nearly every group); 3: 312 rows (62 on average: 64-row m tiles, and on the wgmma
 * kernel their tail rows: the 65-row group in one pass (a tail of 1), the 80-row group too (a tail
 * of 16 = TL), the 144-row group as 64 rows and then 64 + 16; with TL = 8 the 80-row group in two
 * passes). The decode kernel needs K % 64 == 0 (else the tiled kernels). tail: V41_WQ_TAIL for
 * the case (-1: unset, the default). */
typedef struct { int fmt, N, K, gather, set, tail, shi; } gr_case;   /* shi: largest scale byte (0: 131) */
static const gr_case gr_cases[] = {{V41G_WQ_FP4, 96, 160, 1, 0, -1, 0}, {V41G_WQ_FP4, 33, 64, 0, 0, -1, 0},
                                   {V41G_WQ_FP8, 40, 96, 1, 0, -1, 0},  {V41G_WQ_FP8, 129, 512, 0, 0, -1, 0},
                                   {V41G_WQ_FP4, 300, 512, 1, 1, -1, 0}, {V41G_WQ_FP8, 129, 512, 1, 2, -1, 0},
                                   {V41G_WQ_FP4, 96, 128, 0, 2, -1, 0}, {V41G_WQ_FP8, 70, 2048, 0, 1, -1, 0},
                                   {V41G_WQ_FP4, 40, 96, 1, 1, -1, 0},  {V41G_WQ_FP4, 129, 256, 1, 2, -1, 0},
                                   {V41G_WQ_FP4, 96, 160, 1, 3, -1, 0}, {V41G_WQ_FP4, 96, 160, 1, 3, 8, 0},
                                   {V41G_WQ_FP4, 96, 160, 1, 3, 0, 0},  {V41G_WQ_FP8, 129, 512, 0, 3, -1, 0},
                                   {V41G_WQ_FP8, 129, 512, 1, 3, 8, 0}, {V41G_WQ_FP4, 300, 256, 0, 3, 16, 0},
                                   {V41G_WQ_FP4, 96, 160, 1, 3, -1, 128}, {V41G_WQ_FP4, 300, 256, 0, 3, 16, 128},
                                   {V41G_WQ_FP4, 300, 5120, 1, 4, -1, 0},  {V41G_WQ_FP8, 129, 5120, 0, 4, -1, 0},
                                   {V41G_WQ_FP4, 96, 512, 1, 4, -1, 0},    {V41G_WQ_FP8, 70, 256, 1, 4, -1, 0},
                                   {V41G_WQ_FP4, 129, 2304, 0, 4, -2, 0},  {V41G_WQ_FP4, 300, 5120, 1, 4, -1, 128}};
static void grouped_case(int i)
{
    const gr_case c = gr_cases[i];
    enum { G = 5 };
    static const int sets[5][G] = {{0, 1, 7, 70, 3}, {0, 1, 2, 9, 3}, {0, 1, 2, 5, 0}, {65, 0, 80, 144, 23}, {0, 17, 16, 1, 6}};
    static const int tka[5][2] = {{27, 3}, {5, 3}, {4, 2}, {104, 3}, {20, 2}};   /* gather: T tokens with KA assignments each, T * KA rows */
    char tv[8];
    snprintf(tv, sizeof tv, "%d", c.tail);
    if (c.tail >= 0) setenv("V41_WQ_TAIL", tv, 1);
    else unsetenv("V41_WQ_TAIL");
    if (c.tail == -2) setenv("V41_WQ_GEMV16", "0", 1);
    else unsetenv("V41_WQ_GEMV16");
    const int *counts = sets[c.set], T = tka[c.set][0], KA = tka[c.set][1];
    int32_t off[G + 1] = {0};
    for (int g = 0; g < G; g++) off[g + 1] = off[g] + counts[g];
    const int MT = off[G], N = c.N, K = c.K;
    rng_seed(500 + i);
    qw q = qw_make(c.fmt, G, N, K, 0, 1, c.fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, 107, c.shi ? c.shi : 131);
    v41g_wq W = qw_desc(&q, 0);
    /* the sorted problem of a MoE: row p is assignment perm[p] (a random order), i.e. token perm[p] / KA */
    int32_t *xrow = NULL;
    if (c.gather) {
        int32_t perm[104 * 3];
        for (int i = 0; i < MT; i++) perm[i] = i;
        for (int i = MT - 1; i > 0; i--) { int j = rng_int(i + 1), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
        xrow = malloc(sizeof(int32_t) * MT);
        for (int p = 0; p < MT; p++) xrow[p] = perm[p] / KA;
    }
    const int XR = c.gather ? T : MT;
    uint16_t *x = rand_x(XR, K);
    const size_t ny = (size_t)MT * N;
    double *exp = malloc(sizeof(double) * ny), *mag = malloc(sizeof(double) * ny);
    for (int g = 0; g < G; g++) ref_rows(x, xrow, off[g], off[g + 1], q.deq + (size_t)g * N * K, N, K, exp, mag);
    uint16_t *dx = up(x, 2 * (size_t)XR * K);
    int32_t *doff = up(off, sizeof off), *dxrow = xrow ? up(xrow, sizeof(int32_t) * MT) : NULL;
    float *dy = dpoison(4 * ny), *dy2 = dpoison(4 * ny);
    uint16_t *db = dpoison(2 * ny);
    ck_assert_int_eq(v41g_wq_gemm_grouped(&W, G, doff, dxrow, dx, MT, dy, 1, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm_grouped(&W, G, doff, dxrow, dx, MT, dy2, 1, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm_grouped(&W, G, doff, dxrow, dx, MT, db, 0, NULL), 0);
    float *y = down(dy, 4 * ny), *y2 = down(dy2, 4 * ny);
    uint16_t *b = down(db, 2 * ny);
    char what[128];
    snprintf(what, sizeof what, "grouped %s N%d K%d %s, rows %d, tail %d, scales 107..%d", c.fmt == V41G_WQ_FP8 ? "fp8" : "fp4",
             N, K, c.gather ? "gathered" : "identity", MT, c.tail, c.shi ? c.shi : 131);
    check_out(what, y, 1, exp, mag, ny, K);
    check_same(what, y, y2, 4 * ny);
    check_out(what, b, 0, exp, mag, ny, K);
    check_bf16_of_f32(what, b, y, ny);
    unsetenv("V41_WQ_GEMV16");
    v41g_free(dx); v41g_free(doff); v41g_free(dxrow); v41g_free(dy); v41g_free(dy2); v41g_free(db);
    free(y); free(y2); free(b); free(x); free(xrow); free(exp); free(mag);
    qw_free(&q);
    unsetenv("V41_WQ_TAIL");
}
START_TEST(test_grouped) { grouped_case(_i); }
END_TEST

/* ------------------------------------------------------------ v41g_wq_dequant */
/* group 2 of three (strided), and an fp8 row slice: bf16 bits of the exact values, -0 included;
 * the last two span several 128-row bands and 64-column k tiles, the last one partial in both
 * (N % 128 != 0, K % 64 = 32); the last fp4 case takes scale bytes over all of 0..254 (fp4's
 * multiply by 2^(e-1), and the second multiply above 128: bf16 subnormals at e = 0, 1, infinities
 * from 6 * 2^(e-127) >= 2^128 at e >= 253, as ref's fp32 product rounded to bf16) */
typedef struct { int fmt, G, g, N, K, r0, slo, shi; } dq_case;
static const dq_case dq_cases[] = {{V41G_WQ_FP8, 3, 2, 70, 96, 0, 107, 131}, {V41G_WQ_FP4, 3, 2, 33, 64, 0, 107, 131},
                                   {V41G_WQ_FP8, 1, 0, 45, 64, 40, 107, 131}, {V41G_WQ_FP8, 2, 1, 300, 224, 8, 107, 131},
                                   {V41G_WQ_FP4, 2, 1, 270, 160, 0, 107, 131}, {V41G_WQ_FP4, 1, 0, 200, 1024, 0, 0, 254}};
START_TEST(test_dequant)
{
    const dq_case c = dq_cases[_i];
    rng_seed(600 + _i);
    /* fp8 edge codes on every group's first row; the rest random (1/16 subnormal, 1/128 each zero) */
    qw q = qw_make(c.fmt, c.G, c.N, c.K, c.r0, c.G > 1, c.fmt == V41G_WQ_FP8 ? gen_fp8_any : gen_fp4_any, c.slo, c.shi);
    v41g_wq W = qw_desc(&q, 0);
    const size_t n = (size_t)c.N * c.K;
    uint16_t *want = malloc(2 * n);
    const float *d = q.deq + (size_t)c.g * n;
    for (size_t i = 0; i < n; i++) want[i] = v41_f32_to_bf16(d[i]);
    /* the edge codes lead row 0 (fp8: +0, -0, subnormals; fp4: +-0.5, +0, -0) */
    if (!c.r0) {
        const int z = c.fmt == V41G_WQ_FP8 ? 0 : 2;
        ck_assert_uint_eq(want[z], 0x0000);
        ck_assert_uint_eq(want[z + 1], 0x8000);
        if (c.fmt == V41G_WQ_FP4) ck_assert_uint_eq(want[1], want[0] ^ 0x8000);
    }
    uint16_t *dout = dpoison(2 * n);
    ck_assert_int_eq(v41g_wq_dequant(&W, c.g, dout, NULL), 0);
    uint16_t *got = down(dout, 2 * n);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(got[i] == want[i], "dequant %s group %d: element %zu (row %zu col %zu) is 0x%04x, want 0x%04x (%g)",
                      c.fmt == V41G_WQ_FP8 ? "fp8" : "fp4", c.g, i, i / c.K, i % c.K, got[i], want[i],
                      (double)d[i]);
    v41g_free(dout);
    free(want); free(got);
    qw_free(&q);
}
END_TEST

/* ------------------------------------------------------------ MoE over fp4/fp8 experts */
/* Case 0 ("exact") picks values for which every fp32 sum of both paths is exact, so the summation
 * order cannot matter and the outputs must be equal bit for bit:
 *   x = k 2^-4, |k| <= 15: act_quant leaves it unchanged (checked below; scale 2^ceil(log2(amax/448))
 *     <= 2^-8, so x/scale = k 2^(4..8) has 4 significant bits and is <= 448);
 *   w13 fp4, any code, scales 2^-2..2^0: products are multiples of 2^-7 below 6, a sum of D = 64
 *     stays below 360 = 46080 * 2^-7 < 2^24 units;
 *   w13s fp8, codes of exponent field 4..9 (2^-3..2^2) and zeros, scales 2^-2..2^0: multiples of
 *     2^-12 below 7.1, 64 of them below 2^20.8 units;
 *   h = act_quant(swiglu) is c 2^-9 s_h, |c 2^-9| <= 448; w2 (fp4) and w2s (fp8) take values
 *     0, +-0.5, +-1 times one scale per output row (K = I = 32 is one scale block): products are
 *     multiples of 2^-10 s_h s_w and 32 of them sum below 32 * 448 = 2^23.81 units < 2^24.
 * So h13, h, each expert output and the combined sum are the same numbers in both paths; any
 * difference is a different rounding point (not a summation order).
 * Case 1 ("random") uses random codes of every kind. There an fp32 summation order can flip the
 * bf16 rounding of a w1/w3 output (h13); that passes through swiglu and act_quant, where it can
 * move an fp8 code of h by one step (<= 2^-3 of the element) or, when the row's amax crosses a
 * power of two, every element of the row by at most one step; each expert output then moves by up
 * to ~2^-3 sum_i |h_i w_ni|, so neither "1 bf16 ulp" nor a share of bitwise-equal elements is a
 * sound assertion for arbitrary data (one flip changes a whole token's row). The bound checked is
 * the sound one (derivation at moe_tol), against the bf16-weight path and a CPU mirror of the
 * FFN; the share of bitwise-equal elements is printed. */
static const uint8_t fp8_small[] = {0x00, 0x80, 0x30, 0xB0, 0x38, 0xB8};   /* 0, -0, +-0.5, +-1 */
static const uint8_t fp4_small[] = {0x0, 0x8, 0x1, 0x9, 0x2, 0xA};         /* 0, -0, +-0.5, +-1 */
static uint8_t gen_fp8_mid(size_t i)   /* zero or exponent field 4..9 */
{
    (void)i;
    if (rng_int(16) == 0) return rng_u32() & 1 ? 0x80 : 0x00;
    return (uint8_t)((rng_u32() & 1 ? 0x80 : 0) | (4 + rng_int(6)) << 3 | rng_int(8));
}
static uint8_t gen_fp8_small(size_t i) { (void)i; return fp8_small[rng_int(6)]; }
static uint8_t gen_fp4_small(size_t i) { (void)i; return fp4_small[rng_int(6)]; }

/* CPU mirror of v41g_moe_ffn (k_moe.cu, SPEC §8) on dequantized weights: xq = act_quant(x);
 * per (token, expert) h13 = bf16(xq . w13^T), h = bf16(silu(min(g,L)) * clamp(u,+-L) * wt),
 * act_quant(h), ye = bf16(h . w2^T); out = bf16(sum of ye in expert-id order, then the shared
 * expert's (wt 1)). Also returns, per output, A = sum over the token's experts of
 * sum_i |h_i w2_ni| and B = sum over them of amax(h) sum_i |w2_ni|, and the largest |g|. */
static void moe_mirror(int T, int D, int I, int E, int k, float L, const uint16_t *x, const int32_t *idx,
                       const float *wts, const float *w13, const float *w2, const float *w13s, const float *w2s,
                       float *out, double *A, double *B, double *gmax)
{
    float *xq = malloc(sizeof(float) * D), *h13 = malloc(sizeof(float) * 2 * I), *h = malloc(sizeof(float) * I);
    float *acc = malloc(sizeof(float) * D);
    *gmax = 0;
    for (int t = 0; t < T; t++) {
        for (int d = 0; d < D; d++) xq[d] = v41_bf16_to_f32(x[(size_t)t * D + d]);
        v41_act_quant(xq, (size_t)D, 32, NULL);
        for (int d = 0; d < D; d++) { acc[d] = 0; A[(size_t)t * D + d] = 0; B[(size_t)t * D + d] = 0; }
        for (int e = 0; e <= E; e++)   /* e == E: the shared expert */
            for (int j = 0; j < (e < E ? k : 1); j++) {
                if (e < E && idx[t * k + j] != e) continue;
                const float *a = e < E ? w13 + (size_t)e * 2 * I * D : w13s, *b = e < E ? w2 + (size_t)e * D * I : w2s;
                const float wt = e < E ? wts[t * k + j] : 1.0f;
                for (int i = 0; i < 2 * I; i++) {
                    double s = 0;
                    for (int d = 0; d < D; d++) s += (double)xq[d] * a[(size_t)i * D + d];
                    h13[i] = v41_bf16r((float)s);
                }
                float amax = 0;
                for (int i = 0; i < I; i++) {
                    float g = h13[i], u = h13[I + i];
                    if (fabs(g) > *gmax) *gmax = fabs(g);
                    if (L > 0) { g = fminf(g, L); u = fminf(fmaxf(u, -L), L); }
                    h[i] = v41_bf16r(g / (1.0f + expf(-g)) * u * wt);
                }
                v41_act_quant(h, (size_t)I, 32, NULL);
                for (int i = 0; i < I; i++) amax = fmaxf(amax, fabsf(h[i]));
                for (int d = 0; d < D; d++) {
                    double s = 0, m = 0, wa = 0;
                    for (int i = 0; i < I; i++) {
                        double p = (double)h[i] * b[(size_t)d * I + i];
                        s += p; m += fabs(p); wa += fabs(b[(size_t)d * I + i]);
                    }
                    acc[d] += v41_bf16r((float)s);
                    A[(size_t)t * D + d] += m;
                    B[(size_t)t * D + d] += amax * wa;
                }
            }
        for (int d = 0; d < D; d++) out[(size_t)t * D + d] = v41_bf16r(acc[d]);
    }
    free(xq); free(h13); free(h); free(acc);
}

/* Bound on the difference of two evaluations of the same FFN that differ in fp32 summation order
 * (and expf ulps). Per expert and element i: a flipped bf16 rounding of g moves silu(g) by
 * 2^-7 relative times |g silu'(g) / silu(g)| = |1 + g (1 - sigmoid(g))| <= 1 + |g|, one of u by
 * 2^-7: the fp32 h_i by (|g| + 2) 2^-7 relative; the two bf16 roundings of h_i differ by that plus
 * one ulp (2^-7): (|g| + 3) 2^-7 |h_i|. act_quant adds at most one e4m3 step: <= 2^-3 |h_i| for
 * a normal code (the step of a value does not depend on the scale, so this holds also when the
 * row's amax crosses a power of two and the scale doubles), 2^-9 s_h <= 2^-9 amax(h) / 224 * 2
 * < 2^-15 amax(h) for a subnormal one. The fp32 sum over I = 32 differs by <= 2 I 2^-23
 * sum|h w| = 2^-17 sum|h w|, and the two bf16 roundings of ye by one ulp <= 2^-7 sum|h w|. So
 *   |d ye_n| <= (2^-3 + (|g|max + 4) 2^-7 + 2^-16) sum_i |h_i w_ni| + 2^-15 amax(h) sum_i |w_ni|,
 * summed over the token's experts (A, B); the combine (fp32, <= 3 terms: 2^-16 A covers it) and
 * its bf16 rounding add one ulp of the larger output (<= 2^-7 |out|). */
static double moe_tol(double out, double A, double B, double gmax)
{
    return (0x1p-3 + (gmax + 4) * 0x1p-7 + 0x1p-16) * A + 0x1p-15 * B + 0x1p-7 * fabs(out) + FLT_MIN;
}

/* _i = 0: exact, 1: random, 2: random with 300 tokens (from V41G_WQ_DEQUANT_ROWS = 256 tokens on
 * the shared expert runs as dequantize + cuBLAS: its bf16 weights then take the workspace) */
START_TEST(test_moe)
{
    const int exact = _i == 0;
    enum { TM = 300, D = 64, I = 32, E = 4, KA = 2 };
    const int T = _i == 2 ? TM : 5;
    const float L = 1.0f;
    rng_seed(700 + _i);
    /* routed experts fp4 (q13: N = 2I, K = D; q2: N = D, K = I), shared expert fp8 */
    qw q13 = exact ? qw_make(V41G_WQ_FP4, E, 2 * I, D, 0, 0, gen_fp4_any, 125, 127)
                   : qw_make(V41G_WQ_FP4, E, 2 * I, D, 0, 0, gen_fp4_any, 117, 121);
    qw q2 = exact ? qw_make(V41G_WQ_FP4, E, D, I, 0, 0, gen_fp4_small, 118, 124)
                  : qw_make(V41G_WQ_FP4, E, D, I, 0, 0, gen_fp4_any, 117, 121);
    qw q13s = exact ? qw_make(V41G_WQ_FP8, 1, 2 * I, D, 0, 0, gen_fp8_mid, 125, 127)
                    : qw_make(V41G_WQ_FP8, 1, 2 * I, D, 0, 0, gen_fp8_any, 113, 115);
    qw q2s = exact ? qw_make(V41G_WQ_FP8, 1, D, I, 0, 0, gen_fp8_small, 118, 124)
                   : qw_make(V41G_WQ_FP8, 1, D, I, 0, 0, gen_fp8_any, 113, 115);
    v41g_wq W13 = qw_desc(&q13, 0), W2 = qw_desc(&q2, 0), W13s = qw_desc(&q13s, 0), W2s = qw_desc(&q2s, 0);
    /* the same weights as bf16 (exact) for the w13/w2/w13s/w2s path */
    const qw *all[4] = {&q13, &q2, &q13s, &q2s};
    uint16_t *dbf[4];
    for (int j = 0; j < 4; j++) {
        size_t n = (size_t)all[j]->G * all[j]->N * all[j]->K;
        uint16_t *h = malloc(2 * n);
        for (size_t i = 0; i < n; i++) h[i] = v41_f32_to_bf16(all[j]->deq[i]);
        dbf[j] = up(h, 2 * n);
        free(h);
    }
    /* tokens: two distinct experts of {0, 1, 3} each (expert 2 gets none), random weights */
    static uint16_t x[TM * D];
    static int32_t idx[TM * KA];
    static float wts[TM * KA];
    static const int pairs[6][2] = {{0, 1}, {1, 0}, {0, 3}, {3, 0}, {1, 3}, {3, 1}};
    for (int t = 0; t < T; t++) {
        const int *pr = pairs[t == 0 ? 4 : rng_int(6)];   /* token 0: experts 1 and 3 */
        for (int j = 0; j < KA; j++) { idx[t * KA + j] = pr[j]; wts[t * KA + j] = 0.25f + 0.5f * (rng_unit() + 1.0f); }
        for (int d = 0; d < D; d++) {
            float v = exact ? (float)(rng_int(31) - 15) * 0x1p-4f : 2.0f * rng_unit();
            x[t * D + d] = v41_f32_to_bf16(v);
        }
    }
    if (exact) {   /* act_quant leaves x unchanged (the premise of the exact case) */
        float r[D];
        for (int t = 0; t < T; t++) {
            for (int d = 0; d < D; d++) r[d] = v41_bf16_to_f32(x[t * D + d]);
            v41_act_quant(r, D, 32, NULL);
            for (int d = 0; d < D; d++) ck_assert_float_eq(r[d], v41_bf16_to_f32(x[t * D + d]));
        }
    }
    uint16_t *dx = up(x, sizeof(uint16_t) * T * D);
    int32_t *di = up(idx, sizeof(int32_t) * T * KA);
    float *dw = up(wts, sizeof(float) * T * KA);
    /* bf16 path; the q path with the bf16 pointers NULL (ignored when q13 / q13s are set) */
    v41g_moe mb = {.T = T, .D = D, .I = I, .E = E, .k = KA, .limit = L,
                   .w13 = dbf[0], .w2 = dbf[1], .w13s = dbf[2], .w2s = dbf[3]};
    v41g_moe mq = {.T = T, .D = D, .I = I, .E = E, .k = KA, .limit = L,
                   .q13 = &W13, .q2 = &W2, .q13s = &W13s, .q2s = &W2s};
    void *wsb = dpoison(v41g_moe_ws_size(&mb)), *wsq = dpoison(v41g_moe_ws_size(&mq));
    if (T >= 256) {   /* the shared expert's part of the workspace holds its dequantized w1||w3 (2I x D bf16) */
        v41g_moe mn = mq;
        mn.q13s = mn.q2s = NULL;
        ck_assert_uint_ge(v41g_moe_ws_size(&mq), v41g_moe_ws_size(&mn) + (size_t)2 * 2 * I * D);
    }
    uint16_t *dob = dpoison(2 * T * D), *doq = dpoison(2 * T * D), *doq2 = dpoison(2 * T * D);
    ck_assert_int_eq(v41g_moe_ffn(&mb, dx, di, dw, wsb, dob, NULL), 0);
    ck_assert_int_eq(v41g_moe_ffn(&mq, dx, di, dw, wsq, doq, NULL), 0);
    ck_assert_int_eq(v41g_moe_ffn(&mq, dx, di, dw, wsq, doq2, NULL), 0);
    uint16_t *ob = down(dob, 2 * T * D), *oq = down(doq, 2 * T * D), *oq2 = down(doq2, 2 * T * D);
    check_same("moe (fp4/fp8 weights)", oq, oq2, 2 * T * D);
    int same = 0;
    for (int i = 0; i < T * D; i++) same += ob[i] == oq[i];
    printf("test_gpu_wq: moe %s: %d of %d outputs bitwise equal to the bf16-weight path\n", exact ? "exact" : "random",
           same, T * D);
    if (exact) {
        for (int i = 0; i < T * D; i++)
            ck_assert_msg(ob[i] == oq[i], "moe exact: out[%d][%d] = 0x%04x with fp4/fp8 weights, 0x%04x with bf16 weights "
                          "(every sum is exact: a different rounding point)", i / D, i % D, oq[i], ob[i]);
    } else {
        static float ref[TM * D];
        static double A[TM * D], B[TM * D];
        double gmax;
        moe_mirror(T, D, I, E, KA, L, x, idx, wts, q13.deq, q2.deq, q13s.deq, q2s.deq, ref, A, B, &gmax);
        ck_assert_msg(gmax < 8, "moe random: |g| up to %g (the bound assumes moderate gates)", gmax);
        for (int i = 0; i < T * D; i++) {
            double g = v41_bf16_to_f32(oq[i]), b = v41_bf16_to_f32(ob[i]), r = ref[i];
            double tb = moe_tol(fmax(fabs(g), fabs(b)), A[i], B[i], gmax), tr = moe_tol(fmax(fabs(g), fabs(r)), A[i], B[i], gmax);
            ck_assert_msg(fabs(g - b) <= tb, "moe random: out[%d][%d] = %.9g with fp4/fp8 weights, %.9g with bf16 weights "
                          "(bound %.3g, sum|h w| %.3g)", i / D, i % D, g, b, tb, A[i]);
            ck_assert_msg(fabs(g - r) <= tr, "moe random: out[%d][%d] = %.9g with fp4/fp8 weights, CPU mirror %.9g "
                          "(bound %.3g, sum|h w| %.3g)", i / D, i % D, g, r, tr, A[i]);
        }
    }
    v41g_free(dx); v41g_free(di); v41g_free(dw); v41g_free(wsb); v41g_free(wsq);
    v41g_free(dob); v41g_free(doq); v41g_free(doq2);
    for (int j = 0; j < 4; j++) v41g_free(dbf[j]);
    free(ob); free(oq); free(oq2);
    qw_free(&q13); qw_free(&q2); qw_free(&q13s); qw_free(&q2s);
}
END_TEST

/* ------------------------------------------------------------ fp8 MMA path (v41g_wq_gemm_f8) */
/* column of block byte l in the GEMM's order (gpu/k_wq_f8.cu): l = 8c + 4s + j */
static int f8_sigma(int l) { return 16 * ((l >> 2) & 1) + 2 * (l >> 3) + (l & 1) + 8 * ((l >> 1) & 1); }
static int f8_ldm(int M) { return (M + 3) / 4 * 4; }
/* the act_quant'ed x as ref computes it (v41_act_quant on the fp32 row) */
static float *f8_xq(const uint16_t *x, int M, int K)
{
    float *q = malloc(sizeof(float) * (size_t)M * K + 4);
    for (size_t i = 0; i < (size_t)M * K; i++) q[i] = v41_bf16_to_f32(x[i]);
    for (int m = 0; m < M; m++) v41_act_quant(q + (size_t)m * K, (size_t)K, 32, NULL);
    return q;
}
/* quantize x on the device (v41g_act_quant_f8) into new buffers */
static void f8_quant(const uint16_t *dx, int M, int K, uint8_t **dx8, float **dxs)
{
    *dx8 = dpoison((size_t)M * K + 16);
    *dxs = dpoison(sizeof(float) * (size_t)f8_ldm(M) * (K / 32) + 16);
    ck_assert_int_eq(v41g_act_quant_f8(dx, M, K, *dx8, *dxs, f8_ldm(M), NULL), 0);
}

/* v41g_act_quant_f8: code(l) * scale == ref's act_quant of column sigma(l), bit for bit, for every
 * block of rand_x's rows (uniform, already quantized, log-uniform, all zero); padding rows' scales 0 */
START_TEST(test_f8_quant)
{
    enum { M = 37, K = 256, KB = K / 32 };
    rng_seed(900);
    uint16_t *x = rand_x(M, K);
    float *xq = f8_xq(x, M, K);
    uint16_t *dx = up(x, 2 * (size_t)M * K);
    uint8_t *dx8;
    float *dxs;
    f8_quant(dx, M, K, &dx8, &dxs);
    const int ldm = f8_ldm(M);
    uint8_t *x8 = down(dx8, (size_t)M * K);
    float *xs = down(dxs, sizeof(float) * (size_t)ldm * KB);
    for (int kb = 0; kb < KB; kb++) {
        for (int m = M; m < ldm; m++) ck_assert_msg(xs[(size_t)kb * ldm + m] == 0.0f, "pad row %d scale", m);
        for (int m = 0; m < M; m++)
            for (int l = 0; l < 32; l++) {
                const float got = v41_e4m3_to_f32(x8[(size_t)m * K + 32 * kb + l]) * xs[(size_t)kb * ldm + m];
                const float want = xq[(size_t)m * K + 32 * kb + f8_sigma(l)];
                ck_assert_msg(memcmp(&got, &want, 4) == 0, "row %d block %d byte %d: %.9g, act_quant %.9g", m, kb, l,
                              (double)got, (double)want);
            }
    }
    v41g_free(dx); v41g_free(dx8); v41g_free(dxs);
    free(x); free(xq); free(x8); free(xs);
}
END_TEST

/* Exactness: x in {0, +-0.5, +-1, +-1.5, +-2}, weight codes {0, +-0.5, +-1} (and zeros of both
 * signs), scales 2^-2..2^2. Every block sum of code products is a multiple of 32 below 2^13 (9
 * significant bits: exact in the fp8 MMA's accumulator at any precision of 9 bits or more), and
 * y, a multiple of 2^-4 below 2^14, is exact in fp32: the fp32 output must equal the exact sum
 * and the bf16 output its bf16 rounding, bit for bit. A misplaced column, block or scale breaks
 * that. M = 1, 130 (partial m tiles), 259; N = 2, 298 (partial bands), 384; K = 64..2048; a row
 * slice (r0 = 32). */
typedef struct { int M, N, K, r0; } f8_case;
static const f8_case f8_cases[] = {{1, 128, 64, 0},    {130, 298, 1024, 0}, {259, 384, 2048, 0},
                                   {64, 2, 128, 0},   {200, 160, 512, 32}, {128, 128, 64, 0}};
#define N_F8 ((int)(sizeof f8_cases / sizeof f8_cases[0]))
static void f8_run(const f8_case *c, int exact, uint64_t seed)
{
    rng_seed(seed);
    qw q = qw_make(V41G_WQ_FP8, 1, c->N, c->K, c->r0, 0, exact ? gen_fp8_small : gen_fp8_any, exact ? 125 : 107,
                   exact ? 129 : 131);
    v41g_wq W = qw_desc(&q, 0);
    ck_assert_msg(v41g_wq_f8_ok(&W), "v41g_wq_f8_ok refused N %d K %d r0 %d", c->N, c->K, c->r0);
    const int M = c->M, N = c->N, K = c->K, KB = K / 32;
    uint16_t *x;
    if (exact) {
        static const float xv[] = {0.0f, 0.5f, -0.5f, 1.0f, -1.0f, 1.5f, -1.5f, 2.0f, -2.0f};
        x = malloc(2 * (size_t)M * K);
        for (size_t i = 0; i < (size_t)M * K; i++) x[i] = v41_f32_to_bf16(xv[rng_int(9)]);
    } else
        x = rand_x(M, K);
    float *xq = f8_xq(x, M, K);
    const size_t ny = (size_t)M * N;
    double *exp = malloc(sizeof(double) * ny), *mag = malloc(sizeof(double) * ny);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double sum = 0, a = 0;
            for (int kb = 0; kb < KB; kb++) {
                double bs = 0;   /* one block's sum, as the MMA forms it, then added (all exact in double) */
                for (int k = 32 * kb; k < 32 * kb + 32; k++) {
                    const double t = (double)xq[(size_t)m * K + k] * q.deq[(size_t)n * K + k];
                    bs += t;
                    a += fabs(t);
                }
                sum += bs;
            }
            exp[(size_t)m * N + n] = sum;
            mag[(size_t)m * N + n] = a;
        }
    uint16_t *dx = up(x, 2 * (size_t)M * K);
    uint8_t *dx8;
    float *dxs;
    f8_quant(dx, M, K, &dx8, &dxs);
    float *dy = dpoison(4 * ny), *dy2 = dpoison(4 * ny);
    uint16_t *db = dpoison(2 * ny);
    ck_assert_int_eq(v41g_wq_gemm_f8(&W, dx8, dxs, f8_ldm(M), M, dy, 1, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm_f8(&W, dx8, dxs, f8_ldm(M), M, dy2, 1, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm_f8(&W, dx8, dxs, f8_ldm(M), M, db, 0, NULL), 0);
    float *y = down(dy, 4 * ny), *y2 = down(dy2, 4 * ny);
    uint16_t *b = down(db, 2 * ny);
    char what[120];
    snprintf(what, sizeof what, "f8 %s M%d N%d K%d r0 %d", exact ? "exact" : "random", M, N, K, c->r0);
    check_same(what, y, y2, 4 * ny);
    check_bf16_of_f32(what, b, y, ny);
    double worst = 0;   /* largest |error| / sum|terms| seen (reported: the tensor cores' accumulation) */
    for (size_t i = 0; i < ny; i++) {
        const double g = y[i], d = fabs(g - exp[i]);
        if (exact) {
            ck_assert_msg((float)exp[i] == y[i], "%s: element %zu: %.9g, exact %.9g", what, i, g, exp[i]);
            continue;
        }
        /* the fp8 MMA's block sums: at most 31 truncating additions, each losing less than 2^-12
         * of sum|terms| (13 fraction bits kept relative to the larger operand's binade); the fp32
         * promotion of KB blocks: KB roundings of at most 2^-24 sum|terms| each */
        const double tol = (0x1p-7 + KB * 0x1p-24) * mag[i] + FLT_MIN;
        ck_assert_msg(d <= tol, "%s: element %zu: got %.9g want %.9g (sum|terms| %.3g, bound %.3g)", what, i, g, exp[i],
                      mag[i], tol);
        if (mag[i] > 0 && d / mag[i] > worst) worst = d / mag[i];
    }
    if (!exact) printf("%s: largest |error| / sum|terms| = %.3g (2^%.1f)\n", what, worst, worst > 0 ? log2(worst) : -INFINITY);
    v41g_free(dx); v41g_free(dx8); v41g_free(dxs); v41g_free(dy); v41g_free(dy2); v41g_free(db);
    free(x); free(xq); free(exp); free(mag); free(y); free(y2); free(b);
    qw_free(&q);
}
START_TEST(test_f8_exact) { f8_run(&f8_cases[_i], 1, 950 + _i); }
END_TEST
START_TEST(test_f8_random) { f8_run(&f8_cases[_i], 0, 970 + _i); }
END_TEST
/* V41_WQ_F8MMA=1: v41g_wq_gemm of an act_quant'ed input, given v41g_wq_ws_bytes of workspace, is
 * bit for bit v41g_wq_gemm_f8 of v41g_act_quant_f8 of the raw input (quantizing the quantized
 * input again gives the same products); with no workspace it is the bf16 kernels' result, bit for
 * bit; an fp4 weight is not active. The engines rely on this switch. */
START_TEST(test_f8_mode)
{
    enum { M = 130, N = 298, K = 1024 };
    rng_seed(995);
    qw q = qw_make(V41G_WQ_FP8, 1, N, K, 0, 0, gen_fp8_any, 107, 131);
    v41g_wq W = qw_desc(&q, 0);
    uint16_t *x = rand_x(M, K);
    float *xq = f8_xq(x, M, K);
    uint16_t *xb = malloc(2 * (size_t)M * K);
    for (size_t i = 0; i < (size_t)M * K; i++) xb[i] = v41_f32_to_bf16(xq[i]);   /* exact: act_quant values */
    uint16_t *dx = up(x, 2 * (size_t)M * K), *dxb = up(xb, 2 * (size_t)M * K);
    const size_t ny = (size_t)M * N;
    unsetenv("V41_WQ_F8MMA");
    ck_assert(!v41g_wq_f8_active(&W));
    const size_t ws0 = v41g_wq_ws_bytes(&W, M);
    float *dref = dpoison(4 * ny), *dexact = dpoison(4 * ny), *dmode = dpoison(4 * ny), *dnows = dpoison(4 * ny);
    void *wsx = ws0 ? dpoison(ws0) : NULL;
    ck_assert_int_eq(v41g_wq_gemm(&W, dxb, M, dexact, 1, wsx, ws0, NULL), 0);
    uint8_t *dx8;
    float *dxs;
    f8_quant(dx, M, K, &dx8, &dxs);
    ck_assert_int_eq(v41g_wq_gemm_f8(&W, dx8, dxs, f8_ldm(M), M, dref, 1, NULL), 0);
    setenv("V41_WQ_F8MMA", "1", 1);
    ck_assert(v41g_wq_f8_active(&W));
    const size_t ws1 = v41g_wq_ws_bytes(&W, M);
    ck_assert_uint_ge(ws1, (size_t)M * K + 4 * (size_t)f8_ldm(M) * (K / 32));
    void *ws = dpoison(ws1);
    ck_assert_int_eq(v41g_wq_gemm(&W, dxb, M, dmode, 1, ws, ws1, NULL), 0);
    ck_assert_int_eq(v41g_wq_gemm(&W, dxb, M, dnows, 1, NULL, 0, NULL), 0);
    qw q4 = qw_make(V41G_WQ_FP4, 1, 64, 128, 0, 0, gen_fp4_any, 120, 124);
    v41g_wq W4 = qw_desc(&q4, 0);
    ck_assert(!v41g_wq_f8_active(&W4));
    unsetenv("V41_WQ_F8MMA");
    float *ref = down(dref, 4 * ny), *mode = down(dmode, 4 * ny), *exact = down(dexact, 4 * ny), *nows = down(dnows, 4 * ny);
    check_same("V41_WQ_F8MMA=1 against v41g_wq_gemm_f8", mode, ref, 4 * ny);
    /* no workspace: the bf16 kernels (no split), within their bound of the exact sum */
    double *exp = malloc(sizeof(double) * ny), *mag = malloc(sizeof(double) * ny);
    ref_rows(xb, NULL, 0, M, q.deq, N, K, exp, mag);
    check_out("V41_WQ_F8MMA=1 with no workspace", nows, 1, exp, mag, ny, K);
    check_out("bf16 kernels", exact, 1, exp, mag, ny, K);
    size_t diff = 0;
    for (size_t i = 0; i < ny; i++) diff += mode[i] != exact[i];
    ck_assert_msg(diff > 0, "the fp8 MMA path gave the bf16 kernels' result bit for bit on all %zu outputs", ny);
    free(exp); free(mag);
    v41g_free(dx); v41g_free(dxb); v41g_free(dx8); v41g_free(dxs); v41g_free(dref); v41g_free(dexact);
    v41g_free(dmode); v41g_free(dnows); v41g_free(ws); v41g_free(wsx);
    free(x); free(xq); free(xb); free(ref); free(mode); free(exact); free(nows);
    qw_free(&q); qw_free(&q4);
}
END_TEST

/* what the path refuses: fp4, K % 64 != 0, r0 % 32 != 0, odd N; nothing written */
START_TEST(test_f8_refuse)
{
    enum { N = 64, K = 128, M = 4 };
    rng_seed(990);
    qw q = qw_make(V41G_WQ_FP8, 1, N, K, 0, 0, gen_fp8_any, 120, 124);
    uint8_t *dx8 = dfill((size_t)M * K, 0);
    float *dxs = dfill(sizeof(float) * 4 * (K / 32), 0);
    void *dy = dfill(4 * M * N, 0x5a);
    v41g_wq bad[4];
    for (int j = 0; j < 4; j++) bad[j] = qw_desc(&q, 0);
    bad[0].fmt = V41G_WQ_FP4;
    bad[1].K = 96;
    bad[2].r0 = 16;
    bad[3].N = 63;
    for (int j = 0; j < 4; j++) {
        ck_assert_msg(!v41g_wq_f8_ok(&bad[j]), "v41g_wq_f8_ok accepted case %d", j);
        ck_assert_int_eq(v41g_wq_gemm_f8(&bad[j], dx8, dxs, 4, M, dy, 1, NULL), CUDA_INVALID_VALUE);
    }
    ck_assert_int_eq(v41g_act_quant_f8((const uint16_t *)dx8, M, 48, dx8, dxs, 4, NULL), CUDA_INVALID_VALUE); /* K % 32 */
    ck_assert_int_eq(v41g_act_quant_f8((const uint16_t *)dx8, M, K, dx8, dxs, 6, NULL), CUDA_INVALID_VALUE);  /* ldm % 4 */
    unsigned char *y = down(dy, 4 * M * N);
    for (int i = 0; i < 4 * M * N; i++) ck_assert_msg(y[i] == 0x5a, "output byte %d written", i);
    free(y);
    v41g_free(dx8); v41g_free(dxs); v41g_free(dy);
    qw_free(&q);
}
END_TEST

/* ------------------------------------------------------------ bad arguments */
/* an invalid format, K % 32 != 0, fp4 with r0 != 0 ("r0 must be 0"): cudaErrorInvalidValue from
 * all three entry points, and the output untouched */
START_TEST(test_bad_args)
{
    enum { N = 64, K = 64, M = 4 };
    rng_seed(800);
    qw q = qw_make(V41G_WQ_FP8, 1, N, K, 0, 0, gen_fp8_any, 120, 124);
    uint16_t *x = rand_x(M, K);
    uint16_t *dx = up(x, sizeof(uint16_t) * M * K);
    int32_t off[2] = {0, M}, *doff = up(off, sizeof off);
    enum { YB = 16384 };   /* more than any of the calls below could write (dequant of 80 x 48 bf16...) */
    void *dy = dfill(YB, 0x5a), *ws = dfill(1 << 16, 0);
    v41g_wq bad[4];
    for (int j = 0; j < 4; j++) bad[j] = qw_desc(&q, 0);
    bad[0].fmt = 0;
    bad[1].fmt = 3;
    bad[2].K = 48; bad[2].N = 80;          /* the same bytes read as [80, 48] */
    bad[3].fmt = V41G_WQ_FP4; bad[3].r0 = 32;
    static const char *nm[4] = {"fmt 0", "fmt 3", "K 48", "fp4 r0 32"};
    for (int j = 0; j < 4; j++) {
        ck_assert_msg(v41g_wq_gemm(&bad[j], dx, M, dy, 1, ws, 1 << 16, NULL) == CUDA_INVALID_VALUE,
                      "v41g_wq_gemm accepted %s", nm[j]);
        ck_assert_msg(v41g_wq_gemm(&bad[j], dx, M, dy, 0, NULL, 0, NULL) == CUDA_INVALID_VALUE,
                      "v41g_wq_gemm (bf16 out, no ws) accepted %s", nm[j]);
        ck_assert_msg(v41g_wq_gemm_grouped(&bad[j], 1, doff, NULL, dx, M, dy, 1, NULL) == CUDA_INVALID_VALUE,
                      "v41g_wq_gemm_grouped accepted %s", nm[j]);
        ck_assert_msg(v41g_wq_dequant(&bad[j], 0, dy, NULL) == CUDA_INVALID_VALUE, "v41g_wq_dequant accepted %s", nm[j]);
        ck_assert_msg(v41g_wq_linear(&bad[j], dx, M, dy, 1, ws, 1 << 16, NULL) == CUDA_INVALID_VALUE,
                      "v41g_wq_linear accepted %s", nm[j]);
        ck_assert_msg(v41g_wq_linear_ws_bytes(&bad[j], M) == 0, "v41g_wq_linear_ws_bytes sized %s", nm[j]);
        unsigned char *y = down(dy, YB);   /* (down also checks that no error is pending) */
        for (int i = 0; i < YB; i++)
            ck_assert_msg(y[i] == 0x5a, "%s: output byte %d written (0x%02x)", nm[j], i, y[i]);
        free(y);
    }
    /* from 256 rows the dequantize + cuBLAS path: it wants the bf16 weight (2 N K bytes) and refuses
     * less, writing nothing (the rows are never read: the call stops before any launch) */
    v41g_wq W = qw_desc(&q, 0);
    ck_assert_uint_eq(v41g_wq_linear_ws_bytes(&W, 256), (size_t)2 * N * K);
    ck_assert_int_eq(v41g_wq_linear(&W, dx, 256, dy, 1, ws, 2 * N * K - 1, NULL), CUDA_INVALID_VALUE);
    ck_assert_int_eq(v41g_wq_linear(&W, dx, 256, dy, 1, NULL, 0, NULL), CUDA_INVALID_VALUE);
    unsigned char *y = down(dy, YB);
    for (int i = 0; i < YB; i++) ck_assert_msg(y[i] == 0x5a, "v41g_wq_linear short ws: output byte %d written", i);
    free(y);
    v41g_free(dx); v41g_free(doff); v41g_free(dy); v41g_free(ws);
    free(x);
    qw_free(&q);
}
END_TEST

static Suite *wq_suite(void)
{
    Suite *s = suite_create("gpu_wq");
    TCase *tc = tcase_create("gemm");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_gemm_fp8, 0, N_GM);
    tcase_add_loop_test(tc, test_gemm_fp4, 0, N_GM);
    tcase_add_loop_test(tc, test_gemm_slice, 0, (int)(sizeof sl_cases / sizeof sl_cases[0]));
    tcase_add_loop_test(tc, test_gemm_mma_fallback, 0, 2 * N_GM);
    tcase_add_loop_test(tc, test_gemm_no_gemv, 0, 2 * N_GM);
    tcase_add_loop_test(tc, test_gemm_reduce4, 0, 2);
    tcase_add_loop_test(tc, test_gemm_splits, 0, 24);
    tcase_add_loop_test(tc, test_gemm_cluster, 0, 12);
    suite_add_tcase(s, tc);
    tc = tcase_create("grouped");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_grouped, 0, (int)(sizeof gr_cases / sizeof gr_cases[0]));
    tcase_add_loop_test(tc, test_dequant, 0, (int)(sizeof dq_cases / sizeof dq_cases[0]));
    suite_add_tcase(s, tc);
    tc = tcase_create("moe");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_moe, 0, 3);
    suite_add_tcase(s, tc);
    tc = tcase_create("f8");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_f8_quant);
    tcase_add_loop_test(tc, test_f8_exact, 0, N_F8);
    tcase_add_loop_test(tc, test_f8_random, 0, N_F8);
    tcase_add_test(tc, test_f8_refuse);
    tcase_add_test(tc, test_f8_mode);
    suite_add_tcase(s, tc);
    tc = tcase_create("args");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_bad_args);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    if (!gpu_present()) {
        printf("test_gpu_wq: no CUDA device: skipped\n");
        return 77;
    }
    SRunner *sr = srunner_create(wq_suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
#endif
