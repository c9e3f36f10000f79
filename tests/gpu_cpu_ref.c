/* gpu_cpu_ref.c: CPU versions of the GPU kernels, straight from SPEC.md.
 * Sequential fp32 loops; rounding points as SPEC §2-§8 state them. */
#include "gpu_cpu_ref.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

float cr_bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
uint16_t cr_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* RNE */
    return (uint16_t)(u >> 16);
}
float cr_rbf(float f) { return cr_bf2f(cr_f2bf(f)); }

float cr_e4m32f(uint8_t q)
{
    int s = q >> 7, e = (q >> 3) & 15, m = q & 7;
    float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return s ? -v : v;
}
/* nearest e4m3 by search over the 127 finite magnitudes; ties to the even code */
uint8_t cr_f2e4m3(float f)
{
    float a = fabsf(f);
    if (a > 448.0f) a = 448.0f;
    int best = 0;
    float bd = INFINITY;
    for (int c = 0; c < 127; c++) {
        float d = fabsf(cr_e4m32f((uint8_t)c) - a);
        if (d < bd || (d == bd && (c & 1) == 0)) { bd = d; best = c; }
    }
    return (uint8_t)(best | (f < 0 ? 0x80 : 0));
}
float cr_fp4_mag(float v)
{
    static const float vals[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    if (v > 6.0f) v = 6.0f;
    int best = 0;
    float bd = INFINITY;
    for (int c = 0; c < 8; c++) {
        float d = fabsf(vals[c] - v);
        if (d < bd || (d == bd && (c & 1) == 0)) { bd = d; best = c; }
    }
    return vals[best];
}

static int ceil_log2f(float t)
{
    uint32_t b;
    memcpy(&b, &t, 4);
    return (int)((b >> 23) & 0xff) - 127 + ((b & 0x7fffff) ? 1 : 0);
}

void cr_rmsnorm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int dim, float eps)
{
    for (int r = 0; r < rows; r++) {
        float ss = 0;
        for (int i = 0; i < dim; i++) { float f = cr_bf2f(x[(size_t)r * dim + i]); ss += f * f; }
        float rs = 1.0f / sqrtf(ss / dim + eps);
        for (int i = 0; i < dim; i++)
            y[(size_t)r * dim + i] = cr_f2bf((cr_bf2f(x[(size_t)r * dim + i]) * rs) * cr_bf2f(w[i]));
    }
}

void cr_rope_freqs(int r, double theta, int orig, double factor, double bf, double bs, float *out)
{
    for (int j = 0; j < r / 2; j++) out[j] = 1.0f / powf((float)theta, (float)(2 * j) / (float)r);
    if (orig <= 0) return;
    double cf = r * log(orig / (2 * M_PI * bf)) / (2 * log(theta));
    double cs = r * log(orig / (2 * M_PI * bs)) / (2 * log(theta));
    double lo = fmax(floor(cf), 0), hi = fmin(ceil(cs), r - 1);
    for (int j = 0; j < r / 2; j++) {
        float ramp = (float)((j - lo) / fmax(hi - lo, 1e-3));
        ramp = fminf(fmaxf(ramp, 0), 1);
        float smooth = 1 - ramp;
        out[j] = (out[j] / (float)factor) * (1 - smooth) + out[j] * smooth;
    }
}

void cr_rope(uint16_t *x, const int32_t *pos, const float *freqs, int rows, int heads, int d, int r, int inverse)
{
    for (int row = 0; row < rows; row++)
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < r / 2; j++) {
                float phi = (float)pos[row] * freqs[j];
                float c = cosf(phi), s = sinf(phi);
                if (inverse) s = -s;
                uint16_t *p = x + ((size_t)row * heads + h) * d + d - r + 2 * j;
                float a = cr_bf2f(p[0]), b = cr_bf2f(p[1]);
                p[0] = cr_f2bf(a * c - b * s);
                p[1] = cr_f2bf(a * s + b * c);
            }
}

void cr_act_quant(const uint16_t *x, uint8_t *q, float *scale, uint16_t *deq, int rows, int n)
{
    for (size_t b = 0; b < (size_t)rows * n / 32; b++) {
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(cr_bf2f(x[b * 32 + i])));
        amax = fmaxf(amax, 1e-4f);
        float sc = ldexpf(1.0f, ceil_log2f(amax * (1.0f / 448.0f)));
        if (scale) scale[b] = sc;
        for (int i = 0; i < 32; i++) {
            float v = cr_bf2f(x[b * 32 + i]) / sc;
            v = fminf(fmaxf(v, -448), 448);
            uint8_t c = cr_f2e4m3(v);
            if (q) q[b * 32 + i] = c;
            if (deq) deq[b * 32 + i] = cr_f2bf(cr_e4m32f(c) * sc);
        }
    }
}

void cr_fp4_qdq(const uint16_t *x, uint16_t *y, int rows, int n, int g, int e4m3)
{
    for (size_t b = 0; b < (size_t)rows * n / g; b++) {
        float amax = 0;
        for (int i = 0; i < g; i++) amax = fmaxf(amax, fabsf(cr_bf2f(x[b * g + i])));
        float sc = e4m3 ? cr_e4m32f(cr_f2e4m3(fmaxf(amax, 6.0f * ldexpf(1, -9)) / 6.0f))
                        : ldexpf(1.0f, ceil_log2f(fmaxf(amax, 6.0f * ldexpf(1, -126)) * (1.0f / 6.0f)));
        for (int i = 0; i < g; i++) {
            float v = cr_bf2f(x[b * g + i]);
            float m = cr_fp4_mag(fabsf(v / sc));
            y[b * g + i] = cr_f2bf(v < 0 ? -m * sc : m * sc);
        }
    }
}

static float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

void cr_hc_mixes(const uint16_t *X, const float *fn, const float *base, const float *s3, int T, int h, int D,
                 float norm_eps, float hc_eps, int iters, float *pre, float *post, float *comb)
{
    int NM = (2 + h) * h, hD = h * D;
    float *m = malloc(sizeof(float) * NM), *C = malloc(sizeof(float) * h * h);
    for (int t = 0; t < T; t++) {
        const uint16_t *x = X + (size_t)t * hD;
        float ss = 0;
        for (int k = 0; k < hD; k++) { float f = cr_bf2f(x[k]); ss += f * f; }
        float r = 1.0f / sqrtf(ss / hD + norm_eps);
        for (int i = 0; i < NM; i++) {
            float a = 0;
            for (int k = 0; k < hD; k++) a += cr_bf2f(x[k]) * fn[(size_t)i * hD + k];
            m[i] = a * r;
        }
        for (int i = 0; i < h; i++) {
            pre[t * h + i] = sigm(m[i] * s3[0] + base[i]) + hc_eps;
            post[t * h + i] = 2.0f * sigm(m[h + i] * s3[1] + base[h + i]);
        }
        for (int i = 0; i < h; i++) {
            float mx = -INFINITY, s = 0;
            for (int j = 0; j < h; j++) { C[i * h + j] = m[2 * h + i * h + j] * s3[2] + base[2 * h + i * h + j]; mx = fmaxf(mx, C[i * h + j]); }
            for (int j = 0; j < h; j++) { C[i * h + j] = expf(C[i * h + j] - mx); s += C[i * h + j]; }
            for (int j = 0; j < h; j++) C[i * h + j] = C[i * h + j] / s + hc_eps;
        }
        for (int j = 0; j < h; j++) { float s = 0; for (int i = 0; i < h; i++) s += C[i * h + j]; for (int i = 0; i < h; i++) C[i * h + j] /= s + hc_eps; }
        for (int it = 1; it < iters; it++) {
            for (int i = 0; i < h; i++) { float s = 0; for (int j = 0; j < h; j++) s += C[i * h + j]; for (int j = 0; j < h; j++) C[i * h + j] /= s + hc_eps; }
            for (int j = 0; j < h; j++) { float s = 0; for (int i = 0; i < h; i++) s += C[i * h + j]; for (int i = 0; i < h; i++) C[i * h + j] /= s + hc_eps; }
        }
        memcpy(comb + (size_t)t * h * h, C, sizeof(float) * h * h);
    }
    free(m); free(C);
}

void cr_hc_pre(const uint16_t *X, const float *p, uint16_t *y, int T, int h, int D)
{
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            float a = 0;
            for (int i = 0; i < h; i++) a += p[t * h + i] * cr_bf2f(X[((size_t)t * h + i) * D + d]);
            y[(size_t)t * D + d] = cr_f2bf(a);
        }
}

void cr_hc_post(const uint16_t *y, const uint16_t *X, const float *post, const float *comb, uint16_t *Xout,
                int T, int h, int D)
{
    for (int t = 0; t < T; t++)
        for (int j = 0; j < h; j++)
            for (int d = 0; d < D; d++) {
                float a = post[t * h + j] * cr_bf2f(y[(size_t)t * D + d]);
                for (int i = 0; i < h; i++) a += comb[(size_t)t * h * h + i * h + j] * cr_bf2f(X[((size_t)t * h + i) * D + d]);
                Xout[((size_t)t * h + j) * D + d] = cr_f2bf(a);
            }
}

/* SPEC §4.4 emulate: chunks of 64 from index 0, running max from -1e30,
 * fp32 denominator, bf16 probabilities in the numerator, sink once. */
void cr_sparse_attn(const uint16_t *q, const uint16_t *kv_a, const uint16_t *kv_b, const int32_t *idx, int L,
                    int n_a, const float *sink, float scale, int T, int H, int d, uint16_t *o)
{
    float *acc = malloc(sizeof(float) * d), *s = malloc(sizeof(float) * 64);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const uint16_t *qq = q + ((size_t)t * H + h) * d;
            float m = -1e30f, l = 0;
            memset(acc, 0, sizeof(float) * d);
            for (int c0 = 0; c0 < L; c0 += 64) {
                float cmax = -INFINITY;
                for (int j = 0; j < 64 && c0 + j < L; j++) {
                    int id = idx[(size_t)t * L + c0 + j];
                    if (id < 0) { s[j] = -INFINITY; continue; }
                    const uint16_t *kk = (c0 + j < n_a ? kv_a : kv_b) + (size_t)id * d;
                    float a = 0;
                    for (int e = 0; e < d; e++) a += cr_bf2f(qq[e]) * cr_bf2f(kk[e]);
                    s[j] = a * scale;
                    cmax = fmaxf(cmax, s[j]);
                }
                float mn = fmaxf(m, cmax), corr = expf(m - mn), ps = 0;
                for (int e = 0; e < d; e++) acc[e] *= corr;
                for (int j = 0; j < 64 && c0 + j < L; j++) {
                    int id = idx[(size_t)t * L + c0 + j];
                    if (id < 0) continue;
                    const uint16_t *kk = (c0 + j < n_a ? kv_a : kv_b) + (size_t)id * d;
                    float p = expf(s[j] - mn), pb = cr_rbf(p);
                    ps += p;
                    for (int e = 0; e < d; e++) acc[e] += pb * cr_bf2f(kk[e]);
                }
                l = l * corr + ps;
                m = mn;
            }
            if (sink) l += expf(sink[h] - m);
            float inv = l > 0 ? 1.0f / l : 0.0f;
            for (int e = 0; e < d; e++) o[((size_t)t * H + h) * d + e] = cr_f2bf(acc[e] * inv);
        }
    free(acc); free(s);
}

void cr_indexer_scores(const uint16_t *q, const float *w, const uint16_t *k, const int64_t *kbase,
                       const int32_t *visible, int T, int nI, int dI, int S, float *I)
{
    for (int t = 0; t < T; t++)
        for (int s = 0; s < S; s++) {
            if (s >= visible[t]) { I[(size_t)t * S + s] = -INFINITY; continue; }
            const uint16_t *kk = k + (size_t)(kbase[t] + s) * dI;
            float acc = 0;
            for (int h = 0; h < nI; h++) {
                float a = 0;
                for (int e = 0; e < dI; e++) a += cr_bf2f(q[((size_t)t * nI + h) * dI + e]) * cr_bf2f(kk[e]);
                acc += cr_rbf(cr_rbf(w[t * nI + h]) * fmaxf(cr_rbf(a), 0)); /* product rounded to bf16 (SPEC §6) */
            }
            I[(size_t)t * S + s] = cr_rbf(acc);
        }
}

/* naive top-k: repeated selection of the best remaining (ties: lower position), then ascending */
static int cmp_i32(const void *a, const void *b) { return (*(const int32_t *)a > *(const int32_t *)b) - (*(const int32_t *)a < *(const int32_t *)b); }
void cr_topk(const float *I, const int32_t *visible, int T, int S, int k, int32_t *out)
{
    char *used = malloc(S);
    for (int t = 0; t < T; t++) {
        memset(used, 0, S);
        int kk = k < S ? k : S;
        int32_t *o = out + (size_t)t * k;
        for (int j = 0; j < kk; j++) {
            int best = -1;
            for (int s = 0; s < S; s++)
                if (!used[s] && (best < 0 || I[(size_t)t * S + s] > I[(size_t)t * S + best])) best = s;
            used[best] = 1;
            o[j] = best;
        }
        qsort(o, kk, sizeof(int32_t), cmp_i32);
        for (int j = 0; j < kk; j++) if (o[j] >= visible[t]) o[j] = -1;
        for (int j = kk; j < k; j++) o[j] = -1;
    }
    free(used);
}

void cr_moe_route(const float *logits, const float *bias, int T, int E, int k, int score_func, float temp,
                  int norm, float route_scale, int32_t *idx, float *wts)
{
    float *s = malloc(sizeof(float) * E);
    char *used = malloc(E);
    for (int t = 0; t < T; t++) {
        const float *l = logits + (size_t)t * E;
        float mx = -INFINITY, den = 0;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, l[e] / temp);
        for (int e = 0; e < E; e++) den += expf(l[e] / temp - mx);
        for (int e = 0; e < E; e++) {
            float z = l[e] / temp;
            s[e] = score_func == 0 ? sqrtf(z > 20 ? z : log1pf(expf(z))) : score_func == 1 ? expf(z - mx) / den : sigm(z);
        }
        memset(used, 0, E);
        float sum = 0, sc[16];
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (used[e]) continue;
                float v = s[e] + (bias ? bias[e] : 0), bv = best < 0 ? 0 : s[best] + (bias ? bias[best] : 0);
                if (best < 0 || v > bv) best = e;
            }
            used[best] = 1;
            idx[t * k + j] = best;
            sc[j] = s[best];
            sum += sc[j];
        }
        for (int j = 0; j < k; j++) wts[t * k + j] = (norm && k > 1 ? sc[j] / (sum + 1e-20f) : sc[j]) * route_scale;
    }
    free(s); free(used);
}

/* one expert (bf16 weights): act_quant(x) -> w13 -> bf16 -> swiglu*wt -> bf16 -> act_quant -> w2 -> bf16 */
static void cr_expert(const uint16_t *xq, int D, int I, float limit, const uint16_t *w13, const uint16_t *w2, float wt,
                      float *y /* [D], bf16 values */)
{
    float *h = malloc(sizeof(float) * I);
    uint16_t *hb = malloc(2 * I), *hq = malloc(2 * I);
    for (int i = 0; i < I; i++) {
        float g = 0, u = 0;
        for (int e = 0; e < D; e++) {
            g += cr_bf2f(xq[e]) * cr_bf2f(w13[(size_t)i * D + e]);
            u += cr_bf2f(xq[e]) * cr_bf2f(w13[(size_t)(I + i) * D + e]);
        }
        g = cr_rbf(g); u = cr_rbf(u);
        if (limit > 0) { g = fminf(g, limit); u = fminf(fmaxf(u, -limit), limit); }
        hb[i] = cr_f2bf(g / (1 + expf(-g)) * u * wt);
    }
    cr_act_quant(hb, NULL, NULL, hq, 1, I);
    for (int e = 0; e < D; e++) {
        float a = 0;
        for (int i = 0; i < I; i++) a += cr_bf2f(hq[i]) * cr_bf2f(w2[(size_t)e * I + i]);
        y[e] = cr_rbf(a);
    }
    free(h); free(hb); free(hq);
}

void cr_moe_ffn(int T, int D, int I, int E, int k, float limit, const uint16_t *w13, const uint16_t *w2,
                const uint16_t *w13s, const uint16_t *w2s, const uint16_t *x, const int32_t *idx,
                const float *wts, uint16_t *out)
{
    (void)E;
    uint16_t *xq = malloc(2 * (size_t)D);
    float *acc = malloc(sizeof(float) * D), *y = malloc(sizeof(float) * D);
    for (int t = 0; t < T; t++) {
        cr_act_quant(x + (size_t)t * D, NULL, NULL, xq, 1, D);
        memset(acc, 0, sizeof(float) * D);
        for (int e = 0; e < E; e++)          /* expert-id order */
            for (int j = 0; j < k; j++) {
                if (idx[t * k + j] != e) continue;
                cr_expert(xq, D, I, limit, w13 + (size_t)e * 2 * I * D, w2 + (size_t)e * D * I, wts[t * k + j], y);
                for (int d = 0; d < D; d++) acc[d] += y[d];
            }
        if (w13s) {
            cr_expert(xq, D, I, limit, w13s, w2s, 1.0f, y);
            for (int d = 0; d < D; d++) acc[d] += y[d];
        }
        for (int d = 0; d < D; d++) out[(size_t)t * D + d] = cr_f2bf(acc[d]);
    }
    free(xq); free(acc); free(y);
}
