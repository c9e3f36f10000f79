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
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------ GEMM */

/* benchmark counters of the calling thread (v41 bench ref); off unless enabled */
static _Thread_local double gemm_secs, gemm_flops, lin_secs;
static _Thread_local bool gemm_count;

double v41_gemm_seconds(bool reset)
{
    double s = gemm_secs;
    if (reset) gemm_secs = 0;
    return s;
}
void v41_gemm_count_enable(bool on) { gemm_count = on; }
void v41_gemm_stats(double *sgemm_thread_s, double *flops, double *linear_wall_s, bool reset)
{
    if (sgemm_thread_s) *sgemm_thread_s = gemm_secs;
    if (flops) *flops = gemm_flops;
    if (linear_wall_s) *linear_wall_s = lin_secs;
    if (reset) gemm_secs = gemm_flops = lin_secs = 0;
}

/* ------------------------------------------------------------------ fast dequantization */

/* Same values as v41_dequant_rows (exact products of a code and a power-of-two
 * scale), through lookup tables. Falls back to quant.c for other layouts. */
static float e4m3_lut[256], fp4_lut[16];
static void init_luts(void)
{
    for (int i = 0; i < 256; i++) e4m3_lut[i] = v41_e4m3_to_f32((uint8_t)i);
    for (int i = 0; i < 16; i++) fp4_lut[i] = v41_fp4_to_f32((uint8_t)i);
}
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static int dequant_fast(const v41_tensor *w, const v41_tensor *sc, int64_t r0, int64_t nr, float *out, v41_err *err)
{
    if (w->ndim != 2) return v41_dequant_rows(w, sc, r0, nr, out, err);
    const int64_t N = w->shape[0], K = w->shape[1];
    const uint8_t *d = w->data;
    if (r0 < 0 || r0 + nr > N) return v41_dequant_rows(w, sc, r0, nr, out, err);
    if (w->dtype == V41_DT_BF16 && !sc) {
        const uint8_t *b = d + (size_t)r0 * K * 2;
        for (int64_t i = 0; i < nr * K; i++) {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            uint32_t u = (uint32_t)h << 16;
            memcpy(out + i, &u, 4);
        }
        return V41_OK;
    }
    if (w->dtype == V41_DT_F32 && !sc) {
        memcpy(out, d + (size_t)r0 * K * 4, sizeof(float) * (size_t)(nr * K));
        return V41_OK;
    }
    if (!sc || sc->dtype != V41_DT_F8_E8M0 || sc->ndim != 2 || K % 32) return v41_dequant_rows(w, sc, r0, nr, out, err);
    pthread_once(&lut_once, init_luts);
    const uint8_t *s = sc->data;
    const int64_t nbk = K / 32;
    if (w->dtype == V41_DT_F8_E4M3 && sc->shape[0] == (N + 31) / 32 && sc->shape[1] == nbk && N > 32) {
        for (int64_t r = r0; r < r0 + nr; r++) {
            const uint8_t *q = d + r * K, *sr = s + (r / 32) * nbk;
            float *o = out + (r - r0) * K;
            for (int64_t b = 0; b < nbk; b++) {
                float f = v41_e8m0_to_f32(sr[b]);
                for (int i = 0; i < 32; i++) o[b * 32 + i] = e4m3_lut[q[b * 32 + i]] * f;
            }
        }
        return V41_OK;
    }
    if (w->dtype == V41_DT_F4 && sc->shape[0] == N && sc->shape[1] == nbk) {
        for (int64_t r = r0; r < r0 + nr; r++) {
            const uint8_t *q = d + r * (K / 2), *sr = s + r * nbk;
            float *o = out + (r - r0) * K;
            for (int64_t b = 0; b < nbk; b++) {
                float f = v41_e8m0_to_f32(sr[b]);
                for (int i = 0; i < 16; i++) {
                    uint8_t byte = q[b * 16 + i];
                    o[b * 32 + 2 * i] = fp4_lut[byte & 15] * f;
                    o[b * 32 + 2 * i + 1] = fp4_lut[byte >> 4] * f;
                }
            }
        }
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

/* Column invariance probe: the tiled GEMM relies on every column of a
 * (nc x V41_GEMM_MT x K) call getting the same arithmetic. That holds for
 * OpenBLAS's Haswell/Zen kernels (measured) but is not a BLAS guarantee, so it
 * is checked once per process on representative shapes; when it fails, every
 * row gets its own 1-column call (slower, still batch-invariant). */
static int tile_cols = V41_GEMM_MT;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static void probe_tiles(void)
{
    const int MT = V41_GEMM_MT;
    const char *ev = getenv("V41_GEMM_ONE_COLUMN"); /* force the fallback (testing) */
    if (ev && *ev && strcmp(ev, "0")) { tile_cols = 1; return; }
    const int ncs[] = {7, 24, 64, 256}, Ks[] = {32, 64, 512, 1280};
    uint32_t seed = 1;
    for (size_t a = 0; a < sizeof ncs / sizeof ncs[0]; a++)
        for (size_t b = 0; b < sizeof Ks / sizeof Ks[0]; b++) {
            int nc = ncs[a], K = Ks[b];
            float *W = malloc(sizeof(float) * (size_t)nc * K), *A = malloc(sizeof(float) * (size_t)MT * K);
            float *C = malloc(sizeof(float) * (size_t)nc * MT);
            if (!W || !A || !C) { free(W); free(A); free(C); tile_cols = 1; return; }
            for (int i = 0; i < nc * K; i++) { seed = seed * 1664525u + 1013904223u; W[i] = (float)(seed >> 8) * 0x1p-24f - 0.5f; }
            for (int k = 0; k < K; k++) {
                seed = seed * 1664525u + 1013904223u;
                float v = (float)(seed >> 8) * 0x1p-24f - 0.5f;
                for (int m = 0; m < MT; m++) A[m * K + k] = v;
            }
            for (int mode = 0; mode < 2; mode++) {
                if (mode == 0) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nc, MT, K, 1.0f, W, K, A, K, 0.0f, C, MT);
                else
                    for (int kb = 0; kb < K / 32; kb++)
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nc, MT, 32, 1.0f, W + kb * 32, K, A + kb * 32, K,
                                    kb ? 1.0f : 0.0f, C, MT);
                for (int n = 0; n < nc; n++)
                    for (int m = 1; m < MT; m++)
                        if (memcmp(&C[n * MT], &C[n * MT + m], 4)) tile_cols = 1;
            }
            free(W); free(A); free(C);
        }
}
int v41_gemm_tile_cols(void)
{
    pthread_once(&probe_once, probe_tiles);
    return tile_cols;
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

int v41_linear_ld(const v41_lin *L, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                  bool emu, v41_err *err)
{
    const int64_t N = L->N, K = L->K;
    const int MT = V41_GEMM_MT, NC = V41_GEMM_NC;
    if (M <= 0 || N <= 0) return V41_OK;
    const bool quant = emu && L->kind == V41_LIN_Q;
    const bool round_out = emu && L->kind != V41_LIN_F32;
    if (quant && K % 32)
        return v41_err_set(err, V41_EINVAL, "%s: fp8/fp4 Linear needs K %% 32 == 0 (K = %lld)",
                           L->w->name ? L->w->name : "?", (long long)K);
    const int64_t Mp = (M + MT - 1) / MT * MT;
    float *A = malloc(sizeof(float) * (size_t)(Mp * K));
    if (!A) return v41_err_set(err, V41_ENOMEM, "linear: out of memory (%lld x %lld)", (long long)Mp, (long long)K);
    for (int64_t m = 0; m < Mp; m++) {
        if (m < M) memcpy(A + m * K, x + m * ldx, sizeof(float) * K);
        else memset(A + m * K, 0, sizeof(float) * K);
    }
    if (quant) {
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; m++) v41_act_quant(A + m * K, (size_t)K, 32, NULL);
    }
    const int64_t nch = (N + NC - 1) / NC;
    const int tc = v41_gemm_tile_cols();
    int rc = V41_OK;
    v41_err lerr = {0};
    const bool count = gemm_count;
    double gsec = 0, gfl = 0, tl0 = count ? now_s() : 0;
#pragma omp parallel reduction(+ : gsec, gfl)
    {
        float *W = malloc(sizeof(float) * (size_t)(NC * K));
        float *Ct = malloc(sizeof(float) * (size_t)(MT * NC));
        v41_err e2 = {0};
        if (!W || !Ct) {
#pragma omp critical
            rc = v41_err_set(&lerr, V41_ENOMEM, "linear: out of memory (scratch)");
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nch; c++) {
            if (!W || !Ct) continue;
            int64_t n0 = c * NC, nc = N - n0 < NC ? N - n0 : NC;
            int r2 = dequant_fast(L->w, L->s, L->row0 + n0, nc, W, &e2);
            if (r2) {
#pragma omp critical
                { rc = r2; lerr = e2; }
                continue;
            }
            for (int64_t m0 = 0; m0 < Mp; m0 += MT) {
                double t0 = count ? now_s() : 0;
                /* transposed tile: Ct[nc, MT] = W[nc, K] . A[MT, K]^T, in calls of tc columns */
                int64_t mlim = M - m0 < MT ? M - m0 : MT;
                for (int64_t c0 = 0; c0 < (tc == MT ? MT : mlim); c0 += tc) {
                    if (quant) {
                        for (int64_t kb = 0; kb < K / 32; kb++)
                            sgemm_nt((int)nc, tc, 32, W + kb * 32, (int)K, A + (m0 + c0) * K + kb * 32, (int)K,
                                     kb ? 1.0f : 0.0f, Ct + c0, MT);
                    } else {
                        sgemm_nt((int)nc, tc, (int)K, W, (int)K, A + (m0 + c0) * K, (int)K, 0.0f, Ct + c0, MT);
                    }
                }
                if (count) {
                    gsec += now_s() - t0;
                    gfl += 2.0 * MT * (double)nc * (double)K;
                }
                int64_t mt = M - m0 < MT ? M - m0 : MT;
                for (int64_t i = 0; i < mt; i++) {
                    float *dst = y + (m0 + i) * ldy + n0;
                    if (round_out)
                        for (int64_t j = 0; j < nc; j++) dst[j] = v41_bf16r(Ct[j * MT + i]);
                    else
                        for (int64_t j = 0; j < nc; j++) dst[j] = Ct[j * MT + i];
                }
            }
        }
        free(W);
        free(Ct);
    }
    if (count) {
        gemm_secs += gsec;
        gemm_flops += gfl;
        lin_secs += now_s() - tl0;
    }
    free(A);
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

void v41_sparse_attn_row(const float *q, int H, int d, const float *const *kp, int n,
                         const float *sink, float scale, float *out, bool emu)
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

float v41_softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
