/* ops.c: op kernels of the CPU reference engine (see v41_ops.h, SPEC.md §2-§8).
 *
 * Determinism: every GEMM goes through sgemm on fixed row tiles of
 * V41_GEMM_MT rows and fixed column chunks of V41_GEMM_NC weight rows, so the
 * call shapes (hence OpenBLAS's kernel and reduction order) never depend on
 * the number of rows of the forward. The tile is computed transposed,
 * C^T[nc, MT] = W[nc, K] . A[MT, K]^T: OpenBLAS (0.3.21, Haswell/Zen kernels)
 * gives every column of such a call the same arithmetic, while the rows of a
 * row-major C = A . W^T call are computed by different edge kernels depending
 * on their position in the tile (measured; tests/test_engine.c checks it).
 * OpenMP threads split column chunks only; no reduction is ever split. */
#include "config.h"
#include "v41_ops.h"
#include "v41_env.h"
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------ GEMM */

/* benchmark counters (v41 bench ref); off unless enabled. Process-wide, because
 * Linears also run inside parallel regions (routed experts): updated atomically. */
static double gemm_secs, gemm_flops, lin_secs, dq_secs;
static bool gemm_count;

double v41_gemm_seconds(bool reset)
{
    double s;
#pragma omp atomic read
    s = gemm_secs;
    if (reset) {
#pragma omp atomic write
        gemm_secs = 0;
    }
    return s;
}
void v41_gemm_count_enable(bool on) { gemm_count = on; }
void v41_gemm_dequant_stats(double *dequant_thread_s, bool reset)
{
    if (dequant_thread_s) *dequant_thread_s = dq_secs;
    if (reset) dq_secs = 0;
}
void v41_gemm_stats(double *sgemm_thread_s, double *flops, double *linear_wall_s, bool reset)
{
    if (sgemm_thread_s) *sgemm_thread_s = gemm_secs;
    if (flops) *flops = gemm_flops;
    if (linear_wall_s) *linear_wall_s = lin_secs;
    if (reset) gemm_secs = gemm_flops = lin_secs = 0;
}

/* ------------------------------------------------------------------ fast dequantization */

/* Same values as v41_dequant_rows (exact products of a code and a power-of-two
 * scale), but the codes are decoded arithmetically (bit assembly, no table
 * lookups) so the loops vectorize. Every step is exact, so the values are
 * bitwise those of quant.c; this is verified once per process on every code
 * (dq_check), and a mismatch falls back to quant.c. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define V41_VEC __attribute__((target_clones("avx2", "default"), optimize("tree-vectorize")))
#else
#define V41_VEC
#endif

static inline float bits_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* e4m3 magnitude bits of a code: normal 2^(e-7)(1+m/8) = fp32 ((e+120) << 23 | m << 20),
 * subnormal (e = 0) m * 2^-9, NaN (e = 15, m = 7); sign ORed in. */
static inline uint32_t e4m3_bits(uint32_t b)
{
    uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float sub = (float)m * 0x1p-9f;
    uint32_t su;
    memcpy(&su, &sub, 4);
    uint32_t u = e ? (((e + 120u) << 23) | (m << 20)) : su;
    u = (b & 0x7fu) == 0x7fu ? 0x7fc00000u : u;
    return u | ((b & 0x80u) << 24);
}
/* fp4 (e2m1) code -> fp32 bits: 0, 0.5, then 2^(i/2-1) * (1 + (i&1)/2) for i >= 2; bit 3 = sign */
static inline uint32_t fp4_bits(uint32_t c)
{
    uint32_t i = c & 7u;
    uint32_t u = i >= 2 ? (((126u + (i >> 1)) << 23) | ((i & 1u) << 22)) : (i ? 0x3f000000u : 0u);
    return u | ((c & 8u) << 28);
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define V41_HAVE_AVX2_DQ 1
/* AVX2 versions (the same exact bit assembly; selected at run time, dq_check
 * compares them with quant.c on every code and scale). */
__attribute__((target("avx2"))) static void dq_e4m3_row_avx2(const uint8_t *q, const uint8_t *sr, int64_t nbk, float *o)
{
    const __m256i c7f = _mm256_set1_epi32(0x7f), c78 = _mm256_set1_epi32(0x78), c80 = _mm256_set1_epi32(0x80);
    const __m256i c7 = _mm256_set1_epi32(7), bias = _mm256_set1_epi32(120 << 23), nan = _mm256_set1_epi32(0x7fc00000);
    const __m256i zero = _mm256_setzero_si256();
    const __m256 s9 = _mm256_set1_ps(0x1p-9f);
    for (int64_t b = 0; b < nbk; b++) {
        const __m256 f = _mm256_set1_ps(v41_e8m0_to_f32(sr[b]));
        for (int g = 0; g < 4; g++) {
            __m128i by = _mm_loadl_epi64((const __m128i *)(q + b * 32 + g * 8));
            __m256i v = _mm256_cvtepu8_epi32(by);
            __m256i mag = _mm256_and_si256(v, c7f);
            __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias);
            __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, c7)), s9));
            __m256i isz = _mm256_cmpeq_epi32(_mm256_and_si256(v, c78), zero);
            __m256i u = _mm256_blendv_epi8(nrm, sub, isz);
            u = _mm256_blendv_epi8(u, nan, _mm256_cmpeq_epi32(mag, c7f));
            u = _mm256_or_si256(u, _mm256_slli_epi32(_mm256_and_si256(v, c80), 24));
            _mm256_storeu_ps(o + b * 32 + g * 8, _mm256_mul_ps(_mm256_castsi256_ps(u), f));
        }
    }
}
__attribute__((target("avx2"))) static void dq_fp4_row_avx2(const uint8_t *q, const uint8_t *sr, int64_t nbk, float *o)
{
    /* bf16 bits of the 16 codes: high and low bytes, looked up with pshufb */
    const __m128i th = _mm_setr_epi8(0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xbf, (char)0xbf,
                                     (char)0xbf, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0);
    const __m128i tl = _mm_setr_epi8(0x00, 0x00, (char)0x80, (char)0xc0, 0x00, 0x40, (char)0x80, (char)0xc0, 0x00, 0x00,
                                     (char)0x80, (char)0xc0, 0x00, 0x40, (char)0x80, (char)0xc0);
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nbk; b++) {
        const __m256 f = _mm256_set1_ps(v41_e8m0_to_f32(sr[b]));
        __m128i v = _mm_loadu_si128((const __m128i *)(q + b * 16));
        __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        __m128i cs[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)}; /* codes 0..15, 16..31 */
        for (int h = 0; h < 2; h++) {
            __m128i hb = _mm_shuffle_epi8(th, cs[h]), lb = _mm_shuffle_epi8(tl, cs[h]);
            __m128i w0 = _mm_unpacklo_epi8(lb, hb), w1 = _mm_unpackhi_epi8(lb, hb);
            __m256i f0 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(w0), 16);
            __m256i f1 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(w1), 16);
            _mm256_storeu_ps(o + b * 32 + h * 16, _mm256_mul_ps(_mm256_castsi256_ps(f0), f));
            _mm256_storeu_ps(o + b * 32 + h * 16 + 8, _mm256_mul_ps(_mm256_castsi256_ps(f1), f));
        }
    }
}
#endif

V41_VEC static void dq_e4m3_row(const uint8_t *restrict q, const uint8_t *restrict sr, int64_t nbk, float *restrict o)
{
    for (int64_t b = 0; b < nbk; b++) {
        const float f = v41_e8m0_to_f32(sr[b]);
        const uint8_t *restrict qb = q + b * 32;
        float *restrict ob = o + b * 32;
        for (int i = 0; i < 32; i++) ob[i] = bits_f(e4m3_bits(qb[i])) * f;
    }
}

V41_VEC static void dq_fp4_row(const uint8_t *restrict q, const uint8_t *restrict sr, int64_t nbk, float *restrict o)
{
    for (int64_t b = 0; b < nbk; b++) {
        const float f = v41_e8m0_to_f32(sr[b]);
        const uint8_t *restrict qb = q + b * 16;
        float *restrict ob = o + b * 32;
        for (int i = 0; i < 16; i++) {
            uint32_t byte = qb[i];
            ob[2 * i] = bits_f(fp4_bits(byte & 15u)) * f;
            ob[2 * i + 1] = bits_f(fp4_bits(byte >> 4)) * f;
        }
    }
}

V41_VEC static void dq_bf16(const uint8_t *restrict b, int64_t n, float *restrict out)
{
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, b + 2 * i, 2);
        out[i] = bits_f((uint32_t)h << 16);
    }
}

/* every code decodes to the bits of quant.c's v41_e4m3_to_f32 / v41_fp4_to_f32 */
static bool dq_ok;
typedef void (*dq_row_fn)(const uint8_t *, const uint8_t *, int64_t, float *);
static dq_row_fn dq_e4m3_fn = dq_e4m3_row, dq_fp4_fn = dq_fp4_row;
/* every code x a few scales, through fn, against quant.c */
static bool dq_fns_ok(dq_row_fn e4, dq_row_fn f4)
{
    uint8_t q[256], s[8] = {127, 1, 200, 120, 127 - 9, 130, 0, 254};
    float o[256];
    for (int i = 0; i < 256; i++) q[i] = (uint8_t)i;
    e4(q, s, 8, o);
    for (int i = 0; i < 256; i++) {
        float r = v41_e4m3_to_f32(q[i]) * v41_e8m0_to_f32(s[i / 32]);
        if (memcmp(&r, &o[i], 4) && !(isnan(r) && isnan(o[i]))) return false;
    }
    f4(q, s, 8, o);
    for (int i = 0; i < 256; i++) {
        float r = v41_fp4_to_f32((uint8_t)((q[i / 2] >> (4 * (i & 1))) & 15)) * v41_e8m0_to_f32(s[i / 32]);
        if (memcmp(&r, &o[i], 4)) return false;
    }
    return true;
}
static pthread_once_t dq_once = PTHREAD_ONCE_INIT;
static void dq_check(void)
{
    bool ok = true;
    for (uint32_t c = 0; c < 256; c++) {
        float r = v41_e4m3_to_f32((uint8_t)c);
        uint32_t ru;
        memcpy(&ru, &r, 4);
        if (ru != e4m3_bits(c)) ok = false;
    }
    for (uint32_t c = 0; c < 16; c++) {
        float r = v41_fp4_to_f32((uint8_t)c);
        uint32_t ru;
        memcpy(&ru, &r, 4);
        if (ru != fp4_bits(c)) ok = false;
    }
    ok = ok && dq_fns_ok(dq_e4m3_row, dq_fp4_row);
#ifdef V41_HAVE_AVX2_DQ
    __builtin_cpu_init();
    if (ok && __builtin_cpu_supports("avx2") && dq_fns_ok(dq_e4m3_row_avx2, dq_fp4_row_avx2)) {
        dq_e4m3_fn = dq_e4m3_row_avx2;
        dq_fp4_fn = dq_fp4_row_avx2;
    }
#endif
    dq_ok = ok;
}

static int dequant_fast(const v41_tensor *w, const v41_tensor *sc, int64_t r0, int64_t nr, float *out, v41_err *err)
{
    if (w->ndim != 2) return v41_dequant_rows(w, sc, r0, nr, out, err);
    const int64_t N = w->shape[0], K = w->shape[1];
    const uint8_t *d = w->data;
    if (r0 < 0 || r0 + nr > N) return v41_dequant_rows(w, sc, r0, nr, out, err);
    if (w->dtype == V41_DT_BF16 && !sc) {
        dq_bf16(d + (size_t)r0 * K * 2, nr * K, out);
        return V41_OK;
    }
    if (w->dtype == V41_DT_F32 && !sc) {
        memcpy(out, d + (size_t)r0 * K * 4, sizeof(float) * (size_t)(nr * K));
        return V41_OK;
    }
    pthread_once(&dq_once, dq_check);
    if (!dq_ok || !sc || sc->dtype != V41_DT_F8_E8M0 || sc->ndim != 2 || K % 32)
        return v41_dequant_rows(w, sc, r0, nr, out, err);
    const uint8_t *s = sc->data;
    const int64_t nbk = K / 32;
    if (w->dtype == V41_DT_F8_E4M3 && sc->shape[0] == (N + 31) / 32 && sc->shape[1] == nbk && N > 32) {
        for (int64_t r = r0; r < r0 + nr; r++) dq_e4m3_fn(d + r * K, s + (r / 32) * nbk, nbk, out + (r - r0) * K);
        return V41_OK;
    }
    if (w->dtype == V41_DT_F4 && sc->shape[0] == N && sc->shape[1] == nbk) {
        for (int64_t r = r0; r < r0 + nr; r++) dq_fp4_fn(d + r * (K / 2), s + r * nbk, nbk, out + (r - r0) * K);
        return V41_OK;
    }
    return v41_dequant_rows(w, sc, r0, nr, out, err);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One fixed-shape call. */
static inline void sgemm_nt(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float beta,
                            float *C, int ldc)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

void v41_sgemm_tiled(const float *A, int64_t lda, int64_t M, const float *B, int64_t ldb, int64_t N,
                     int64_t K, float *C, int64_t ldc, bool accumulate)
{
    const int MT = V41_GEMM_MT;
    float *At = malloc(sizeof(float) * MT * (size_t)K);
    float *Ct = malloc(sizeof(float) * MT * (size_t)N);
    if (!At || !Ct) { free(At); free(Ct); abort(); }
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        int64_t mt = M - m0 < MT ? M - m0 : MT;
        for (int64_t i = 0; i < MT; i++) {
            if (i < mt) memcpy(At + i * K, A + (m0 + i) * lda, sizeof(float) * K);
            else memset(At + i * K, 0, sizeof(float) * K);
            for (int64_t j = 0; j < N; j++) Ct[j * MT + i] = (accumulate && i < mt) ? C[(m0 + i) * ldc + j] : 0.0f;
        }
        sgemm_nt((int)N, MT, (int)K, B, (int)ldb, At, (int)K, accumulate ? 1.0f : 0.0f, Ct, MT);
        for (int64_t i = 0; i < mt; i++)
            for (int64_t j = 0; j < N; j++) C[(m0 + i) * ldc + j] = Ct[j * MT + i];
    }
    free(At);
    free(Ct);
}

/* Column tiles. A Linear's rows are cut into column tiles of the transposed call
 * C^T[nc, w] = W[nc, K] . A[w, K]^T, the last tile zero-padded:
 *   mode 1: w = V41_GEMM_MT = 16; needs every column of a call to get the same
 *           arithmetic (then a row's bits depend neither on its place in a tile nor
 *           on M);
 *   mode 0: one 1-column call per row (no BLAS property needed; slow).
 * The width itself must stay fixed: OpenBLAS 0.3.21 (Haswell kernels) gives a column
 * different bits in calls of 1, 2, 4, 8, 12, 20, 32, 48, 64 or 128 columns than in a
 * 16-column call (measured), so the padding of a 1-row decode step cannot be cut.
 * Column invariance is a property of the BLAS build, so it is probed once per
 * process on representative shapes (fallback: mode 0). V41_GEMM_ONE_COLUMN=1 forces
 * mode 0 (testing). */
static const int mode_widths[2] = {1, V41_GEMM_MT};
static int tile_mode = 1;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;

static void probe_tiles(void)
{
    if (v41_env_flag("V41_GEMM_ONE_COLUMN", 0)) { tile_mode = 0; return; }
    const int MT = V41_GEMM_MT;
    const int ncs[] = {7, 24, 64, 256}, Ks[] = {32, 64, 512, 1280, 2304, 5120};
    uint32_t seed = 1;
    for (size_t a = 0; a < sizeof ncs / sizeof ncs[0] && tile_mode; a++)
        for (size_t b = 0; b < sizeof Ks / sizeof Ks[0] && tile_mode; b++) {
            int nc = ncs[a], K = Ks[b];
            float *W = malloc(sizeof(float) * (size_t)nc * K), *A = malloc(sizeof(float) * (size_t)MT * K);
            float *C = malloc(sizeof(float) * (size_t)nc * MT);
            if (!W || !A || !C) { free(W); free(A); free(C); tile_mode = 0; break; }
            for (int i = 0; i < nc * K; i++) { seed = seed * 1664525u + 1013904223u; W[i] = (float)(seed >> 8) * 0x1p-24f - 0.5f; }
            for (int k = 0; k < K; k++) {
                seed = seed * 1664525u + 1013904223u;
                float v = (float)(seed >> 8) * 0x1p-24f - 0.5f;
                for (int m = 0; m < MT; m++) A[m * K + k] = v;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nc, MT, K, 1.0f, W, K, A, K, 0.0f, C, MT);
            for (int n = 0; n < nc; n++)
                for (int m = 1; m < MT; m++)
                    if (memcmp(&C[n * MT], &C[n * MT + m], 4)) tile_mode = 0;
            free(W); free(A); free(C);
        }
}
int v41_gemm_tile_cols(void)
{
    pthread_once(&probe_once, probe_tiles);
    return mode_widths[tile_mode];
}

int v41_gemm_tile_mode(void)
{
    pthread_once(&probe_once, probe_tiles);
    return tile_mode;
}

void v41_blas_single_thread(void)
{
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1);
#endif
}

int v41_linear(const v41_lin *L, const float *x, int64_t M, float *y, bool emu, v41_err *err)
{
    return v41_linear_ld(L, x, L->K, M, y, L->N, emu, err);
}

/* Per-thread scratch (dequantized weight chunk + output tile; the input copy of a
 * Linear), kept across calls (grow-only) so that Linears allocate and page-fault
 * nothing in steady state. A cache only: its contents never outlive one call. */
static _Thread_local float *tl_buf, *tl_abuf;
static _Thread_local size_t tl_cap, tl_acap;
static float *tl_grow(float **buf, size_t *cap, size_t n)
{
    if (n > *cap) {
        free(*buf);
        *buf = malloc(sizeof(float) * n);
        *cap = *buf ? n : 0;
    }
    return *buf;
}
static float *tl_scratch(size_t n) { return tl_grow(&tl_buf, &tl_cap, n); }
/* the calling thread's padded, act_quant'ed copy of the input rows (Mp x K) */
static float *tl_input(size_t n) { return tl_grow(&tl_abuf, &tl_acap, n); }

/* Emulate-mode fp8/fp4 Linears: the official y[n] = sum_kb (sum_{k in kb} a_q w_q) sa[kb] sw[kb]
 * accumulates block after block in fp32. Both scales are powers of two, so they are folded
 * exactly into the operands (act_quant'ed activations and dequantized weights carry them), and
 * the whole K is ONE sgemm: the result differs from the block-wise sum only in fp32 summation
 * order (OpenBLAS sums K sequentially within its own K panels, a function of K alone), which is
 * inside the oracle tolerance (README.md, section 'CPU reference engine', numerics). The order never depends on M: fixed
 * column tiles (above). */
int v41_linear_ld(const v41_lin *L, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                  bool emu, v41_err *err)
{
    const int64_t N = L->N, K = L->K;
    const int NC = V41_GEMM_NC;
    if (M <= 0 || N <= 0) return V41_OK;
    const bool quant = emu && L->kind == V41_LIN_Q;
    const bool round_out = emu && L->kind != V41_LIN_F32;
    if (quant && K % 32)
        return v41_err_set(err, V41_EINVAL, "%s: fp8/fp4 Linear needs K %% 32 == 0 (K = %lld)",
                           L->w->name ? L->w->name : "?", (long long)K);
    pthread_once(&probe_once, probe_tiles);
    const int64_t tw = mode_widths[tile_mode];
    const int64_t nt = (M + tw - 1) / tw, Mp = nt * tw;
    float *A = tl_input((size_t)(Mp * K));
    if (!A) {
        return v41_err_set(err, V41_ENOMEM, "linear: out of memory (%lld x %lld)", (long long)Mp, (long long)K);
    }
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t r = 0; r < Mp; r++) {
        if (r < M) {
            memcpy(A + r * K, x + r * ldx, sizeof(float) * K);
            if (quant) v41_act_quant(A + r * K, (size_t)K, 32, NULL);
        } else memset(A + r * K, 0, sizeof(float) * K);
    }
    const int64_t nch = (N + NC - 1) / NC;
    int rc = V41_OK;
    v41_err lerr = {0};
    const bool count = gemm_count;
    double gsec = 0, gfl = 0, dsec = 0, tl0 = count ? now_s() : 0;
    /* fp32 weights are used in place (no scratch copy) */
    const bool direct = L->w->dtype == V41_DT_F32 && !L->s && L->w->ndim == 2 && L->w->shape[1] == K &&
                        L->row0 >= 0 && L->row0 + N <= L->w->shape[0];
    /* work items: (weight chunk, group of row tiles). With few chunks (hc mixes, small
     * N) the tiles are split into G groups so that every thread has work; each item
     * dequantizes its chunk itself. Items only partition the (chunk, tile) calls, whose
     * shapes are fixed: the bits do not depend on G or on the thread count. */
    int nthr = 1;
#ifdef _OPENMP
    if (!omp_in_parallel()) nthr = omp_get_max_threads();
#endif
    int64_t G = 1;
    if (nch < 2 * nthr && nt > 1) {
        G = (2 * nthr + nch - 1) / nch;
        if (G > nt) G = nt;
    }
    const int64_t nitem = nch * G;
#pragma omp parallel reduction(+ : gsec, gfl, dsec) if (nitem > 1)
    {
        float *W = tl_scratch((direct ? 0 : (size_t)NC * K) + (size_t)NC * V41_GEMM_MT);
        float *Ct = W ? W + (direct ? 0 : (size_t)NC * K) : NULL;
        v41_err e2 = {0};
        if (!W) {
#pragma omp critical
            rc = v41_err_set(&lerr, V41_ENOMEM, "linear: out of memory (scratch)");
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitem; it++) {
            if (!W) continue;
            const int64_t c = it / G, g = it % G;
            int64_t n0 = c * NC, nc = N - n0 < NC ? N - n0 : NC;
            const float *Wc = W;
            if (direct) Wc = (const float *)L->w->data + (size_t)(L->row0 + n0) * K;
            else {
                double td = count ? now_s() : 0;
                int r2 = dequant_fast(L->w, L->s, L->row0 + n0, nc, W, &e2);
                if (count) dsec += now_s() - td;
                if (r2) {
#pragma omp critical
                    { rc = r2; lerr = e2; }
                    continue;
                }
            }
            for (int64_t t = g * nt / G; t < (g + 1) * nt / G; t++) {
                const int64_t m0 = t * tw, w = tw;
                double t0 = count ? now_s() : 0;
                /* transposed tile: Ct[nc, w] = W[nc, K] . A[w, K]^T, full K in one call */
                sgemm_nt((int)nc, (int)w, (int)K, Wc, (int)K, A + m0 * K, (int)K, 0.0f, Ct, (int)w);
                if (count) {
                    gsec += now_s() - t0;
                    gfl += 2.0 * (double)w * (double)nc * (double)K;
                }
                int64_t mt = M - m0 < w ? M - m0 : w;
                for (int64_t i = 0; i < mt; i++) {
                    float *dst = y + (m0 + i) * ldy + n0;
                    if (round_out)
                        for (int64_t j = 0; j < nc; j++) dst[j] = v41_bf16r(Ct[j * w + i]);
                    else
                        for (int64_t j = 0; j < nc; j++) dst[j] = Ct[j * w + i];
                }
            }
        }
    }
    if (count) {
        /* wall seconds of this Linear; a call made inside a parallel region (routed
         * experts) counts its share 1/team of the wall time */
        double lw = now_s() - tl0;
#ifdef _OPENMP
        if (omp_in_parallel()) lw /= omp_get_num_threads();
#endif
#pragma omp atomic
        gemm_secs += gsec;
#pragma omp atomic
        gemm_flops += gfl;
#pragma omp atomic
        dq_secs += dsec;
#pragma omp atomic
        lin_secs += lw;
    }
    if (rc) {
        if (err) *err = lerr;
        return rc;
    }
    return V41_OK;
}

/* ------------------------------------------------------------------ norms */

float v41_rms_rsqrt(const float *x, int64_t n, double eps)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        float q = x[i] * x[i];
        s += q;
    }
    float mean = (float)(s / (double)n);
    return 1.0f / sqrtf(mean + (float)eps);
}

float v41_engram_gate(const float *h, const float *key, const float *w, int64_t D, double eps)
{
    float rstd = v41_rms_rsqrt(h, D, eps) * v41_rms_rsqrt(key, D, eps);
    double dd = 0;
    for (int64_t i = 0; i < D; i++) dd += (h[i] * w[i]) * key[i];
    float dot = (float)dd * rstd * (float)pow((double)D, -0.5);
    float a = fabsf(dot);
    if (a < 1e-6f) a = 1e-6f;
    return v41_sigmoidf(copysignf(sqrtf(a), dot));
}

void v41_rmsnorm(const float *x, const float *w, int64_t n, double eps, float *y, bool emu)
{
    float r = v41_rms_rsqrt(x, n, eps);
    for (int64_t i = 0; i < n; i++) {
        float v = (x[i] * r) * w[i];
        y[i] = emu ? v41_bf16r(v) : v;
    }
}

/* ------------------------------------------------------------------ RoPE */

int v41_rope_init(v41_rope *rp, int r, double theta, int original_seq_len, double factor,
                  double beta_fast, double beta_slow)
{
    rp->r = r;
    rp->freq = malloc(sizeof(float) * (size_t)(r / 2 > 0 ? r / 2 : 1));
    if (!rp->freq) return V41_ENOMEM;
    for (int j = 0; j < r / 2; j++) {
        float e = (float)(2 * j) / (float)r;
        rp->freq[j] = 1.0f / powf((float)theta, e);
    }
    if (original_seq_len > 0) {
        double cf = r * log(original_seq_len / (beta_fast * 2 * M_PI)) / (2 * log(theta));
        double cs = r * log(original_seq_len / (beta_slow * 2 * M_PI)) / (2 * log(theta));
        double low = floor(cf);
        if (low < 0) low = 0;
        double high = ceil(cs);
        if (high > r - 1) high = r - 1;
        double den = high - low;
        if (den < 1e-3) den = 1e-3;
        for (int j = 0; j < r / 2; j++) {
            float ramp = ((float)j - (float)low) / (float)den;
            if (ramp < 0) ramp = 0;
            if (ramp > 1) ramp = 1;
            float smooth = 1.0f - ramp;
            float f = rp->freq[j];
            rp->freq[j] = f / (float)factor * (1.0f - smooth) + f * smooth;
        }
    }
    return V41_OK;
}

void v41_rope_free(v41_rope *rp)
{
    free(rp->freq);
    rp->freq = NULL;
}

void v41_rope_apply(const v41_rope *rp, float *x, int64_t pos, bool inverse, bool interleaved, bool emu)
{
    int h = rp->r / 2;
    for (int j = 0; j < h; j++) {
        float phi = (float)pos * rp->freq[j];
        float c = cosf(phi), s = sinf(phi);
        if (inverse) s = -s;
        float *a = interleaved ? &x[2 * j] : &x[j];
        float *b = interleaved ? &x[2 * j + 1] : &x[j + h];
        float x0 = *a, x1 = *b;
        float p0 = x0 * c, p1 = x1 * s, p2 = x0 * s, p3 = x1 * c;
        float re = p0 - p1, im = p2 + p3;
        *a = emu ? v41_bf16r(re) : re;
        *b = emu ? v41_bf16r(im) : im;
    }
}

/* ------------------------------------------------------------------ sparse attention */

#define ATTN_CHUNK 64

static void sparse_attn_row_c(const float *q, int H, int d, const float *const *kp, int n, const float *sink,
                              float scale, float *out, bool emu)
{
    float s[ATTN_CHUNK], p[ATTN_CHUNK];
    float *acc = malloc(sizeof(float) * (size_t)d);
    float *pv = malloc(sizeof(float) * (size_t)d);
    if (!acc || !pv) abort();
    for (int h = 0; h < H; h++) {
        const float *qh = q + (size_t)h * d;
        float m = -1e30f, sum = 0.0f;
        for (int i = 0; i < d; i++) acc[i] = 0.0f;
        for (int c0 = 0; c0 < n; c0 += ATTN_CHUNK) {
            int cn = n - c0 < ATTN_CHUNK ? n - c0 : ATTN_CHUNK;
            float cmax = -INFINITY;
            for (int j = 0; j < cn; j++) {
                const float *k = kp[c0 + j];
                if (!k) { s[j] = -INFINITY; continue; }
                s[j] = v41_dot(qh, k, d) * scale;
                if (s[j] > cmax) cmax = s[j];
            }
            float mnew = m > cmax ? m : cmax;
            float sc = expf(m - mnew);
            float psum = 0.0f;
            for (int j = 0; j < cn; j++) {
                p[j] = kp[c0 + j] ? expf(s[j] - mnew) : 0.0f;
                psum += p[j];
            }
            sum = sum * sc + psum;
            for (int i = 0; i < d; i++) pv[i] = 0.0f;
            for (int j = 0; j < cn; j++) {
                const float *restrict k = kp[c0 + j];
                if (!k) continue;
                float pj = emu ? v41_bf16r(p[j]) : p[j];
                if (pj == 0.0f) continue;
                float *restrict pvr = pv;
                for (int i = 0; i < d; i++) pvr[i] += pj * k[i];
            }
            for (int i = 0; i < d; i++) acc[i] = acc[i] * sc + pv[i];
            m = mnew;
        }
        if (sink) sum = sum + expf(sink[h] - m);
        float *oh = out + (size_t)h * d;
        for (int i = 0; i < d; i++) {
            float v = acc[i] / sum;
            if (!(sum > 0)) v = 0.0f;
            oh[i] = emu ? v41_bf16r(v) : v;
        }
    }
    free(acc);
    free(pv);
}

#ifdef V41_HAVE_AVX2_DQ
/* AVX2 version of sparse_attn_row_c with the SAME arithmetic, bit for bit:
 * - scores: v41_dot's 8 lanes are one ymm register (lane j sums i = j mod 8 with
 *   separate mul and add, never an FMA), reduced in v41_dot's pairwise order, then
 *   the scalar tail; 4 keys are interleaved only for instruction-level parallelism;
 * - p.v: pv[i] += p_j k_j[i] over j in list order for every i (blocks of 64 dims are
 *   kept in registers; the per-element order of additions is unchanged);
 * - acc = acc * sc + pv: mul then add.
 * Checked against sparse_attn_row_c once per process (attn_check). */
__attribute__((target("avx2"))) static inline float hsum8(__m256 v, const float *a, const float *b, int i0, int n)
{
    float l[8];
    _mm256_storeu_ps(l, v);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (int i = i0; i < n; i++) s += a[i] * b[i];
    return s;
}
__attribute__((target("avx2"))) static void sparse_attn_row_avx2(const float *q, int H, int d, const float *const *kp,
                                                                  int n, const float *sink, float scale, float *out,
                                                                  bool emu)
{
    /* chunk-outer, head-inner (a 64-entry chunk of keys stays in cache for all heads);
     * each head's state (running max, denominator, numerator kept in out) evolves
     * exactly as in the head-outer C version */
    float s[ATTN_CHUNK], p[ATTN_CHUNK], pr[ATTN_CHUNK];
    int idx[ATTN_CHUNK];
    float *mh = malloc(sizeof(float) * (size_t)H * 2), *pv = malloc(sizeof(float) * (size_t)d);
    if (!mh || !pv) abort();
    float *sh = mh + H;
    const int d8 = d / 8 * 8;
    for (int h = 0; h < H; h++) { mh[h] = -1e30f; sh[h] = 0.0f; }
    for (size_t i = 0; i < (size_t)H * d; i++) out[i] = 0.0f;
    for (int c0 = 0; c0 < n; c0 += ATTN_CHUNK) {
        const int cn = n - c0 < ATTN_CHUNK ? n - c0 : ATTN_CHUNK;
        for (int h = 0; h < H; h++) {
            const float *qh = q + (size_t)h * d;
            float *acc = out + (size_t)h * d;
            const float m = mh[h];
            float cmax = -INFINITY;
            int j = 0;
            for (; j + 4 <= cn; j += 4) {
                const float *k0 = kp[c0 + j], *k1 = kp[c0 + j + 1], *k2 = kp[c0 + j + 2], *k3 = kp[c0 + j + 3];
                const float *z = qh; /* stand-in for a NULL key (result discarded) */
                const float *b0 = k0 ? k0 : z, *b1 = k1 ? k1 : z, *b2 = k2 ? k2 : z, *b3 = k3 ? k3 : z;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int i = 0; i < d8; i += 8) {
                    __m256 qv = _mm256_loadu_ps(qh + i);
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, _mm256_loadu_ps(b0 + i)));
                    a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, _mm256_loadu_ps(b1 + i)));
                    a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, _mm256_loadu_ps(b2 + i)));
                    a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, _mm256_loadu_ps(b3 + i)));
                }
                s[j] = k0 ? hsum8(a0, qh, b0, d8, d) * scale : -INFINITY;
                s[j + 1] = k1 ? hsum8(a1, qh, b1, d8, d) * scale : -INFINITY;
                s[j + 2] = k2 ? hsum8(a2, qh, b2, d8, d) * scale : -INFINITY;
                s[j + 3] = k3 ? hsum8(a3, qh, b3, d8, d) * scale : -INFINITY;
            }
            for (; j < cn; j++) {
                const float *k = kp[c0 + j];
                if (!k) { s[j] = -INFINITY; continue; }
                __m256 a0 = _mm256_setzero_ps();
                for (int i = 0; i < d8; i += 8)
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i)));
                s[j] = hsum8(a0, qh, k, d8, d) * scale;
            }
            for (j = 0; j < cn; j++)
                if (kp[c0 + j] && s[j] > cmax) cmax = s[j];
            float mnew = m > cmax ? m : cmax;
            float sc = expf(m - mnew);
            float psum = 0.0f;
            for (j = 0; j < cn; j++) {
                p[j] = kp[c0 + j] ? expf(s[j] - mnew) : 0.0f;
                psum += p[j];
            }
            sh[h] = sh[h] * sc + psum;
            /* rounded probabilities; entries that add nothing are skipped as in the C version */
            int np = 0;
            for (j = 0; j < cn; j++) {
                if (!kp[c0 + j]) continue;
                float pj = emu ? v41_bf16r(p[j]) : p[j];
                if (pj == 0.0f) continue;
                idx[np] = c0 + j;
                pr[np++] = pj;
            }
            int i = 0;
            for (; i + 64 <= d8; i += 64) {
                __m256 v0 = _mm256_setzero_ps(), v1 = v0, v2 = v0, v3 = v0, v4 = v0, v5 = v0, v6 = v0, v7 = v0;
                for (int t = 0; t < np; t++) {
                    const float *k = kp[idx[t]] + i;
                    __m256 pj = _mm256_set1_ps(pr[t]);
                    v0 = _mm256_add_ps(v0, _mm256_mul_ps(pj, _mm256_loadu_ps(k)));
                    v1 = _mm256_add_ps(v1, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 8)));
                    v2 = _mm256_add_ps(v2, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 16)));
                    v3 = _mm256_add_ps(v3, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 24)));
                    v4 = _mm256_add_ps(v4, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 32)));
                    v5 = _mm256_add_ps(v5, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 40)));
                    v6 = _mm256_add_ps(v6, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 48)));
                    v7 = _mm256_add_ps(v7, _mm256_mul_ps(pj, _mm256_loadu_ps(k + 56)));
                }
                _mm256_storeu_ps(pv + i, v0); _mm256_storeu_ps(pv + i + 8, v1);
                _mm256_storeu_ps(pv + i + 16, v2); _mm256_storeu_ps(pv + i + 24, v3);
                _mm256_storeu_ps(pv + i + 32, v4); _mm256_storeu_ps(pv + i + 40, v5);
                _mm256_storeu_ps(pv + i + 48, v6); _mm256_storeu_ps(pv + i + 56, v7);
            }
            for (; i < d; i++) {
                float v = 0.0f;
                for (int t = 0; t < np; t++) v += pr[t] * kp[idx[t]][i];
                pv[i] = v;
            }
            const __m256 scv = _mm256_set1_ps(sc);
            for (i = 0; i < d8; i += 8)
                _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(acc + i), scv), _mm256_loadu_ps(pv + i)));
            for (; i < d; i++) acc[i] = acc[i] * sc + pv[i];
            mh[h] = mnew;
        }
    }
    for (int h = 0; h < H; h++) {
        float sum = sh[h];
        if (sink) sum = sum + expf(sink[h] - mh[h]);
        float *oh = out + (size_t)h * d;
        for (int i = 0; i < d; i++) {
            float v = oh[i] / sum;
            if (!(sum > 0)) v = 0.0f;
            oh[i] = emu ? v41_bf16r(v) : v;
        }
    }
    free(mh);
    free(pv);
}
__attribute__((target("avx2"))) static void dot_rows_avx2(const float *Q, int nq, int64_t ldq, const float *k, int n,
                                                           float *out)
{
    const int n8 = n / 8 * 8;
    int h = 0;
    for (; h + 4 <= nq; h += 4) {
        const float *q0 = Q + h * ldq, *q1 = q0 + ldq, *q2 = q1 + ldq, *q3 = q2 + ldq;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < n8; i += 8) {
            __m256 kv = _mm256_loadu_ps(k + i);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(q0 + i), kv));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(q1 + i), kv));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(q2 + i), kv));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(q3 + i), kv));
        }
        out[h] = hsum8(a0, q0, k, n8, n);
        out[h + 1] = hsum8(a1, q1, k, n8, n);
        out[h + 2] = hsum8(a2, q2, k, n8, n);
        out[h + 3] = hsum8(a3, q3, k, n8, n);
    }
    for (; h < nq; h++) out[h] = v41_dot(Q + h * ldq, k, n);
}
#endif

static void dot_rows_c(const float *Q, int nq, int64_t ldq, const float *k, int n, float *out)
{
    for (int h = 0; h < nq; h++) out[h] = v41_dot(Q + h * ldq, k, n);
}

typedef void (*attn_fn)(const float *, int, int, const float *const *, int, const float *, float, float *, bool);
static attn_fn attn_impl = sparse_attn_row_c;
typedef void (*dots_fn)(const float *, int, int64_t, const float *, int, float *);
static dots_fn dots_impl = dot_rows_c;
static pthread_once_t attn_once = PTHREAD_ONCE_INIT;
/* The AVX2 kernel is used only when it reproduces the C kernel bit for bit on a
 * probe with -1 entries, a partial chunk, a d that is not a multiple of 64 or 8,
 * tiny and large scores (V41_ATTN_C=1 forces the C kernel). */
static void attn_check(void)
{
#ifdef V41_HAVE_AVX2_DQ
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || v41_env_flag("V41_ATTN_C", 0)) return;
    const int H = 3, n = 150, ds[] = {512, 75, 8};
    bool ok = true;
    uint32_t seed = 7;
    for (int di = 0; di < 3 && ok; di++) {
        int d = ds[di];
        float *q = malloc(sizeof(float) * (size_t)H * d), *kv = malloc(sizeof(float) * (size_t)n * d);
        float *o1 = malloc(sizeof(float) * (size_t)H * d), *o2 = malloc(sizeof(float) * (size_t)H * d);
        const float **kp = malloc(sizeof(float *) * n);
        float sink[3] = {0.5f, -2.0f, 8.0f};
        if (!q || !kv || !o1 || !o2 || !kp) ok = false;
        for (int i = 0; ok && i < H * d; i++) { seed = seed * 1664525u + 1013904223u; q[i] = ((float)(seed >> 8) * 0x1p-24f - 0.5f) * 4; }
        for (int i = 0; ok && i < n * d; i++) { seed = seed * 1664525u + 1013904223u; kv[i] = v41_bf16r((float)(seed >> 8) * 0x1p-24f - 0.5f); }
        for (int j = 0; ok && j < n; j++) kp[j] = (j % 7 == 3 || j > 140) ? NULL : kv + (size_t)j * d;
        for (int e = 0; ok && e < 2; e++) {
            sparse_attn_row_c(q, H, d, kp, n, e ? NULL : sink, 1.0f / sqrtf((float)d), o1, e == 0);
            sparse_attn_row_avx2(q, H, d, kp, n, e ? NULL : sink, 1.0f / sqrtf((float)d), o2, e == 0);
            if (memcmp(o1, o2, sizeof(float) * (size_t)H * d)) ok = false;
        }
        free(q); free(kv); free(o1); free(o2); free(kp);
    }
    if (ok) attn_impl = sparse_attn_row_avx2;
    /* v41_dot_rows: odd row count, n with a tail */
    {
        const int nq = 7, ns[] = {128, 75};
        float Q[7 * 128], k[128], o1[7], o2[7];
        bool ok2 = true;
        for (int a = 0; a < 2; a++) {
            for (int i = 0; i < nq * 128; i++) { seed = seed * 1664525u + 1013904223u; Q[i] = (float)(seed >> 8) * 0x1p-24f - 0.5f; }
            for (int i = 0; i < 128; i++) { seed = seed * 1664525u + 1013904223u; k[i] = (float)(seed >> 8) * 0x1p-24f - 0.5f; }
            dot_rows_c(Q, nq, 128, k, ns[a], o1);
            dot_rows_avx2(Q, nq, 128, k, ns[a], o2);
            if (memcmp(o1, o2, sizeof o1)) ok2 = false;
        }
        if (ok2) dots_impl = dot_rows_avx2;
    }
#endif
}

void v41_dot_rows(const float *Q, int nq, int64_t ldq, const float *k, int n, float *out)
{
    pthread_once(&attn_once, attn_check);
    dots_impl(Q, nq, ldq, k, n, out);
}

void v41_indexer_scores_rows(const float *q, const float *w, int n, int nI, int dI, const float *keys, int cap,
                             int Lc, const int *Lt, bool relu, bool emu, float *scores, int64_t ld)
{
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        float *It = scores + (size_t)i * ld;
        const float *qi = q + (size_t)i * nI * dI, *wi = w + (size_t)i * nI;
        for (int s = 0; s < Lc; s++) {
            if (s >= Lt[i]) { It[s] = -INFINITY; continue; }
            const float *ks = s < cap ? keys + (size_t)s * dI : NULL;
            float tot = 0.0f, dots[nI]; /* dots[h] = v41_dot(q_h, ks, dI), same bits */
            if (ks) v41_dot_rows(qi, nI, dI, ks, dI, dots);
            for (int h = 0; h < nI; h++) {
                float dot = ks ? dots[h] : 0.0f;
                if (emu) dot = v41_bf16r(dot);
                if (relu && dot < 0) dot = 0.0f;
                float pr = dot * wi[h];
                if (emu) pr = v41_bf16r(pr);
                tot += pr;
            }
            It[s] = emu ? v41_bf16r(tot) : tot;
        }
    }
}

void v41_sparse_attn_row(const float *q, int H, int d, const float *const *kp, int n,
                         const float *sink, float scale, float *out, bool emu)
{
    pthread_once(&attn_once, attn_check);
    attn_impl(q, H, d, kp, n, sink, scale, out, emu);
}

/* ------------------------------------------------------------------ hyper-connections */

void v41_hc_split_sinkhorn(const float *mixes, const float *scale3, const float *base, int hc, int iters,
                           float eps, float *pre, float *post, float *comb, bool rows_last)
{
    for (int i = 0; i < hc; i++) {
        pre[i] = v41_sigmoidf(mixes[i] * scale3[0] + base[i]) + eps;
        post[i] = 2.0f * v41_sigmoidf(mixes[hc + i] * scale3[1] + base[hc + i]);
    }
    float *c = comb;
    for (int i = 0; i < hc * hc; i++) c[i] = mixes[2 * hc + i] * scale3[2] + base[2 * hc + i];
    for (int i = 0; i < hc; i++) {
        float mx = -INFINITY;
        for (int j = 0; j < hc; j++) mx = c[i * hc + j] > mx ? c[i * hc + j] : mx;
        float sum = 0.0f;
        for (int j = 0; j < hc; j++) {
            c[i * hc + j] = expf(c[i * hc + j] - mx);
            sum += c[i * hc + j];
        }
        for (int j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / sum + eps;
    }
#define COLNORM()                                                                   \
    for (int j = 0; j < hc; j++) {                                                  \
        float sum = 0.0f;                                                           \
        for (int i = 0; i < hc; i++) sum += c[i * hc + j];                          \
        for (int i = 0; i < hc; i++) c[i * hc + j] = c[i * hc + j] / (sum + eps);  \
    }
#define ROWNORM()                                                                   \
    for (int i = 0; i < hc; i++) {                                                  \
        float sum = 0.0f;                                                           \
        for (int j = 0; j < hc; j++) sum += c[i * hc + j];                          \
        for (int j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / (sum + eps);  \
    }
    COLNORM();
    for (int it = 0; it < iters - 1; it++) {
        if (rows_last) { COLNORM(); ROWNORM(); }
        else { ROWNORM(); COLNORM(); }
    }
#undef COLNORM
#undef ROWNORM
}

void v41_hc_pre(const float *X, const float *pre, int hc, int64_t D, float *y, bool emu)
{
    for (int64_t k = 0; k < D; k++) {
        float s = pre[0] * X[k];
        for (int i = 1; i < hc; i++) s += pre[i] * X[(int64_t)i * D + k];
        y[k] = emu ? v41_bf16r(s) : s;
    }
}

void v41_hc_post(const float *y, const float *X, const float *post, const float *comb, int hc, int64_t D,
                 float *Xout, bool emu)
{
    for (int j = 0; j < hc; j++)
        for (int64_t k = 0; k < D; k++) {
            float r = comb[0 * hc + j] * X[k];
            for (int i = 1; i < hc; i++) r += comb[i * hc + j] * X[(int64_t)i * D + k];
            float v = post[j] * y[k] + r;
            Xout[(int64_t)j * D + k] = emu ? v41_bf16r(v) : v;
        }
}

/* ------------------------------------------------------------------ top-k */

typedef struct { float v; int32_t i; } vi_t;

static int cmp_vi(const void *a, const void *b)
{
    const vi_t *x = a, *y = b;
    if (x->v > y->v) return -1;
    if (x->v < y->v) return 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

int v41_topk_desc(const float *s, int n, int k, int32_t *out)
{
    if (k <= 0) return 0;
    vi_t *a = malloc(sizeof(vi_t) * (size_t)n);
    if (!a) abort();
    for (int i = 0; i < n; i++) {
        a[i].v = isnan(s[i]) ? -INFINITY : s[i];
        a[i].i = i;
    }
    qsort(a, (size_t)n, sizeof(vi_t), cmp_vi);
    for (int j = 0; j < k; j++) out[j] = a[j].i;
    int amb = 0;
    if (k < n && isfinite(a[k - 1].v) && a[k].v == a[k - 1].v) amb = 1;
    free(a);
    return amb;
}

void v41_indexer_topk_rows(const float *scores, int64_t ld, int n, int L, int k, const int *Lt, int32_t *out,
                           int64_t ldo, int width, uint8_t *amb)
{
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        int32_t *o = out + (size_t)i * ldo;
        amb[i] = (uint8_t)v41_topk_desc(scores + (size_t)i * ld, L, k, o);
        /* ascending positions, unreachable -> -1 (they sort last) */
        for (int a = 1; a < k; a++) {
            int32_t v = o[a];
            int b = a - 1;
            while (b >= 0 && o[b] > v) { o[b + 1] = o[b]; b--; }
            o[b + 1] = v;
        }
        for (int a = 0; a < k; a++)
            if (o[a] >= Lt[i]) o[a] = -1;
        for (int a = k > 0 ? k : 0; a < width; a++) o[a] = -1;
    }
}

float v41_softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
