/* test_serving_ref.c: serving semantics (SPEC §7, §8) on the tiny model (W = 8,
 * cut = last kv source), against the ref engine; the same source built with
 * -DV41_TEST_ENGINE_GPU is tests/test_serving_gpu and runs every property
 * against the GPU engine (v41_gpu_engine_create):
 *  - replay off == plain full prefill (one-shot == chunked == prompt-logprobs rows);
 *  - prompts <= W: trimming changes nothing (every tap but replay.kept bitwise);
 *  - prompts > W, replay on: rows before the cut's query unchanged, trimmed rows
 *    zero in the stream taps, replay.kept marks the last W rows, last-row logits
 *    finite and different from replay off; DSpark context KV of kept rows only;
 *  - a ragged batch mixing cold prefill, prefix-hit replay, decode and verify
 *    (2 threads) == each request alone (1 thread), bitwise logits and the next step;
 *  - prefix hit with encoder-side replay == the same request cold with the
 *    replay floor at H - W (its own prefix, then the same replay), bitwise,
 *    for H a multiple of every ratio and not;
 *  - DSpark verification with rollback (a rejected block truncated) leaves
 *    caches identical to never having drafted (cache taps, next logits and the
 *    next draft bitwise), and greedy acceptance is lossless;
 *  - DSpark padding, op level: a constant KV returns the constant exactly when
 *    padding has zero weight, 133/256 of it when padding is counted (W=128, B=5);
 *  - the replay faults change results only where replay applies;
 *  - determinism: the same request twice in one engine, and in two engines,
 *    gives the same bits in every tap (what every "bitwise" below rests on).
 *
 * GPU build (tests/test_serving_gpu). Exit 77 (skip) when the build has no CUDA
 * or the machine has no device: a probe child decides, so the CUDA runtime is
 * initialised only inside the forked Check tests, never in the parent.
 * What stays exact. The GPU engine is ref's orchestration with the Linears as
 * cuBLAS GEMMs over all M rows of a forward, and attention rows, RMSNorm, RoPE
 * and hc_pre/hc_post as device kernels called one row at a time (T = 1). cuBLAS
 * is deterministic for a fixed shape, so two runs whose every GEMM has the same
 * (M, N, K) and the same inputs give the same bits; the per-row kernels make
 * a row's result independent of the other rows. Hence bitwise in both engines:
 *  - replay on with prompt_logprobs vs replay off (nothing trimmed: same shapes);
 *  - prompts <= W, replay on vs off (nothing trimmed, cut = -1: same calls, same
 *    shapes; only the replay.kept tap is extra), every tap;
 *  - prompts > W: layers up to the cut's KV side run on all rows in both, so the
 *    stream rows of layers <= cut and the cut's window KV are bitwise; trimmed rows
 *    are scattered back as zeros (exact zeros; compared by value on the GPU, a
 *    zero row of main_x passes through a GEMM and RMSNorm whose sign of zero is
 *    the kernel's business);
 *  - a replay fault with replay off (the fault has nothing to act on: same shapes);
 *  - the padding op: positions past L are -1 inside v41g_sparse_attn, and an
 *    all-padding chunk (split) adds exact zeros, so padded == unpadded bitwise.
 * What is not: a row's GEMM result can depend on M (cuBLAS picks the kernel, tile
 * and split-K from the shape), so chunked vs one-shot prefill, a batch vs its
 * requests alone, a prefix cached by a 30-row prefill vs an H-row one, and a
 * (BS+1)-row verification vs 1-row decodes differ by summation order. There:
 *  - discrete results must be identical: greedy tokens (argmax of each compared
 *    logits row), DSpark draft ids, accepted tokens, replay.kept, zero rows;
 *  - continuous values within TOL(x) = TOL_PER_LAYER * n_path * eps * max|a|
 *    (max over the compared row / cache tap), eps = 2^-8. Derivation: the same
 *    fp32 dot product summed in another order differs by a few fp32 ulps, which
 *    moves the bf16-rounded GEMM output by at most one bf16 ulp, <= 2 eps of its
 *    magnitude (ulp/|y| lies in (2^-8, 2^-7]). Between GEMMs everything is
 *    row-local and repeatable, so the difference of two runs is the propagation
 *    of such flips. Each layer adds two sublayer outputs (attention, FFN), each
 *    ending in one rounded GEMM of magnitude <= the stream's: <= 2 x 2 eps of the
 *    stream magnitude per layer (TOL_PER_LAYER = 4); the mHC residual keeps the
 *    stream's scale (hc_post: combination of the streams plus post * f(x), f behind
 *    RMSNorm), so carried errors stay at their size relative to it and the bound
 *    adds up along the path: n_path = the layers the value went through (l + 1
 *    for a cache tap of layer l -- DSpark stages are layers n_layers.. --, n_layers
 *    for logits, n_layers + stages for draft confidences; logits of the tiny
 *    model: 4 * 7 * 2^-8 * max|a|, about 11% of the largest logit). The head
 *    (fp32 SGEMM, no TF32) and the draft heads add fp32-level error only. Not
 *    covered by this bound: a flipped discrete decision inside the model (an
 *    e4m3/e2m1 code of act_quant, an MoE expert choice or an indexer top-k entry
 *    at a near tie) -- a failure then names the row, the value and the margin so a
 *    near tie is recognisable (v41 bisect --a gpu --b gpu shows where). */
#include "config.h"
#include "v41_engine.h"
#include "v41_ops.h"
#include <check.h>
#include "test_model.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef V41_TEST_ENGINE_GPU
#ifndef HAVE_CUDA
int main(void)
{
    printf("test_serving_gpu: built without CUDA: skipped\n");
    return 77;
}
#define V41_TEST_SKIP_ALL 1
#else
#include "v41_gpu.h"
#include "test_gpu_probe.h"
#endif
#define ENGINE "gpu"
#define SHAPE_EXACT 0 /* results of runs with different GEMM shapes: within TOL (header) */
#else
#define ENGINE "ref"
#define SHAPE_EXACT 1 /* ref: bitwise whatever the batch shape */
#endif

#ifndef V41_TEST_SKIP_ALL
#define TOL_PER_LAYER 4 /* GPU tolerance: see the header */
#define EPS_BF16 0x1p-8

static v41_model *M;
static int V, W, NL, CUT, BS, NMTP;
enum { NP = 40 };
static int32_t P[NP], Q[NP];

static void setup_model(void)
{
    if (M) return;
    M = test_model_load();
    V = M->cfg.vocab_size;
    W = M->cfg.window_size;
    NL = M->cfg.n_layers;
    CUT = v41_last_kv_source(&M->cfg);
    BS = M->cfg.dspark_block_size;
    NMTP = M->cfg.n_mtp_layers > 0 ? M->cfg.n_mtp_layers : 0;
    ck_assert(W == 8 && CUT >= 0 && CUT < NL - 1);
    uint32_t s = 777;
    for (int i = 0; i < NP; i++) {
        s = s * 1103515245u + 12345u;
        P[i] = (int32_t)((s >> 8) % (uint32_t)V);
        s = s * 1103515245u + 12345u;
        Q[i] = i < 16 ? P[i] : (int32_t)((s >> 8) % (uint32_t)V); /* shares P's first 16 tokens */
    }
}

static int g_threads = 1;
static v41_engine *mk(bool replay, const char *inject)
{
    v41_engine_opts o;
    v41_engine_opts_default(&o);
    o.replay = replay;
    o.inject = inject;
    o.threads = g_threads;
    o.max_seq_len = 64;
    v41_engine *e = NULL;
    v41_err err = {0};
#ifdef V41_TEST_ENGINE_GPU
    int rc = v41_gpu_engine_create(M, &o, &e, &err);
#else
    int rc = v41_ref_engine_create(M, &o, &e, &err);
#endif
    ck_assert_msg(rc == 0, ENGINE " engine: %s", err.msg);
    return e;
}

/* one request; returns a copy of its returned logits rows (n_out rows) */
static float *fw(v41_engine *e, v41_req r, int *n_out)
{
    v41_batch b = {1, &r};
    v41_out o;
    v41_err err = {0};
    ck_assert_msg(v41_engine_forward(e, &b, &o, &err) == 0, "forward: %s", err.msg);
    int n = o.row_offset[1];
    float *x = malloc(sizeof(float) * (size_t)n * V);
    memcpy(x, o.logits, sizeof(float) * (size_t)n * V);
    if (n_out) *n_out = n;
    return x;
}
static v41_req rq(int id, int start, int n, const int32_t *t) { return (v41_req){.id = id, .start_pos = start, .n_tokens = n, .tokens = t}; }

static int amax(const float *x) { int b = 0; for (int i = 1; i < V; i++) if (x[i] > x[b]) b = i; return b; }

/* ---- comparisons (messages name the property, the engine, row, element, values, tolerance) */
static double gpu_tol(int n_path, double maxabs) { return TOL_PER_LAYER * n_path * EPS_BF16 * maxabs; }

/* same GEMM shapes (or ref): bitwise in both engines */
static void same_bits(const char *prop, const float *a, const float *b, size_t n)
{
    if (!memcmp(a, b, sizeof(float) * n)) return;
    size_t i = 0;
    while (i < n && !memcmp(a + i, b + i, sizeof(float))) i++;
    ck_abort_msg("%s [" ENGINE ", same shapes: bitwise]: element %zu (row %zu col %zu of %d): %.9g vs %.9g", prop, i,
                 i / (size_t)V, i % (size_t)V, V, (double)a[i], (double)b[i]);
}

/* logits rows of two runs whose GEMM shapes differ: ref bitwise; gpu: the same greedy
 * token per row and |a - b| <= TOL(n_path = n_layers, max|a| of the row) */
static void same_rows(const char *prop, const float *a, const float *b, int nrows)
{
    if (SHAPE_EXACT) { same_bits(prop, a, b, (size_t)nrows * V); return; }
    for (int r = 0; r < nrows; r++) {
        const float *x = a + (size_t)r * V, *y = b + (size_t)r * V;
        double mx = 0, worst = -1;
        int wi = 0;
        for (int i = 0; i < V; i++) {
            ck_assert_msg(isfinite(x[i]) && isfinite(y[i]), "%s [" ENGINE "]: row %d col %d not finite: %g vs %g", prop, r,
                          i, (double)x[i], (double)y[i]);
            mx = fmax(mx, fabs(x[i]));
        }
        for (int i = 0; i < V; i++) {
            double d = fabs((double)x[i] - y[i]);
            if (d > worst) { worst = d; wi = i; }
        }
        double tol = gpu_tol(NL, mx);
        int ia = amax(x), ib = amax(y);
        double second = -INFINITY;
        for (int i = 0; i < V; i++) if (i != ia && x[i] > second) second = x[i];
        ck_assert_msg(ia == ib,
                      "%s [" ENGINE "]: row %d greedy token %d vs %d (a[%d]=%.7g a[%d]=%.7g, top-2 margin of a %.4g; "
                      "max|a-b| %.4g at col %d, TOL %.4g = %d*%d*2^-8*max|a| %.5g)",
                      prop, r, ia, ib, ia, (double)x[ia], ib, (double)x[ib], (double)x[ia] - second, worst, wi, tol,
                      TOL_PER_LAYER, NL, mx);
        ck_assert_msg(worst <= tol,
                      "%s [" ENGINE "]: row %d col %d: %.7g vs %.7g, |a-b| %.4g > TOL %.4g = %d*%d*2^-8*max|a| %.5g "
                      "(greedy token %d in both, top-2 margin %.4g)",
                      prop, r, wi, (double)x[wi], (double)y[wi], worst, tol, TOL_PER_LAYER, NL, mx, ia,
                      (double)x[ia] - second);
    }
}

/* ---- tap recorder: every tap (name, step, bytes), copies kept */
typedef struct rec_tap { char name[96]; int step, ndim; int64_t shape[6]; v41_tap_kind kind; size_t nb; void *data; } rec_tap;
typedef struct rec { rec_tap *t; int n, cap; } rec;
static int rec_emit(void *ctx, const v41_tap *t)
{
    rec *r = ctx;
    if (r->n == r->cap) { r->cap = r->cap ? 2 * r->cap : 256; r->t = realloc(r->t, sizeof(rec_tap) * (size_t)r->cap); }
    rec_tap *x = &r->t[r->n++];
    snprintf(x->name, sizeof x->name, "%s", t->name);
    x->step = t->step;
    x->ndim = t->ndim;
    x->kind = t->kind;
    size_t n = t->kind == V41_TAP_U8 ? 1 : 4;
    for (int i = 0; i < t->ndim; i++) { x->shape[i] = t->shape[i]; n *= (size_t)t->shape[i]; }
    x->nb = n;
    x->data = malloc(n + 1);
    memcpy(x->data, t->data, n);
    return 0;
}
static void rec_free(rec *r) { for (int i = 0; i < r->n; i++) free(r->t[i].data); free(r->t); memset(r, 0, sizeof *r); }
static const rec_tap *rec_find(const rec *r, const char *name, int step)
{
    for (int i = 0; i < r->n; i++) if (!strcmp(r->t[i].name, name) && r->t[i].step == step) return &r->t[i];
    return NULL;
}
static bool row_zero(const rec_tap *t, int row)
{
    size_t rb = t->nb / (size_t)t->shape[0];
    const unsigned char *p = (const unsigned char *)t->data + rb * (size_t)row;
#ifdef V41_TEST_ENGINE_GPU
    if (t->kind == V41_TAP_F32 || t->kind == V41_TAP_BF16) { /* value zero (either sign: see the header) */
        for (size_t i = 0; i < rb / 4; i++) if (((const float *)p)[i] != 0.0f) return false;
        return true;
    }
#endif
    for (size_t i = 0; i < rb; i++) if (p[i]) return false;
    return true;
}
static bool row_eq(const rec_tap *a, const rec_tap *b, int row)
{
    size_t rb = a->nb / (size_t)a->shape[0];
    return a->nb == b->nb && !memcmp((const char *)a->data + rb * row, (const char *)b->data + rb * row, rb);
}
/* a cache tap of two runs whose GEMM shapes differ: ref (and discrete kinds) bitwise;
 * gpu continuous taps within TOL(n_path = l + 1 for "layer.l.*", max|a| of the tap) */
static void same_tap(const char *prop, const rec_tap *a, const rec_tap *b)
{
    ck_assert_msg(b != NULL, "%s [" ENGINE "]: tap %s missing in the second run", prop, a->name);
    ck_assert_msg(a->nb == b->nb && a->kind == b->kind, "%s [" ENGINE "]: tap %s: %zu vs %zu bytes", prop, a->name,
                  a->nb, b->nb);
    bool cont = a->kind == V41_TAP_F32 || a->kind == V41_TAP_BF16;
    if (SHAPE_EXACT || !cont) {
        if (!memcmp(a->data, b->data, a->nb)) return;
        size_t es = a->kind == V41_TAP_U8 ? 1 : 4, i = 0;
        while (i < a->nb / es && !memcmp((char *)a->data + i * es, (char *)b->data + i * es, es)) i++;
        if (a->kind == V41_TAP_U8)
            ck_abort_msg("%s [" ENGINE ", bitwise]: tap %s element %zu: %d vs %d", prop, a->name, i,
                         ((uint8_t *)a->data)[i], ((uint8_t *)b->data)[i]);
        else if (a->kind == V41_TAP_I32)
            ck_abort_msg("%s [" ENGINE ", bitwise]: tap %s element %zu: %d vs %d", prop, a->name, i,
                         (int)((int32_t *)a->data)[i], (int)((int32_t *)b->data)[i]);
        else
            ck_abort_msg("%s [" ENGINE ", bitwise]: tap %s element %zu: %.9g vs %.9g", prop, a->name, i,
                         (double)((float *)a->data)[i], (double)((float *)b->data)[i]);
    }
    const float *x = a->data, *y = b->data;
    size_t n = a->nb / 4, wi = 0;
    double mx = 0, worst = -1;
    for (size_t i = 0; i < n; i++) {
        ck_assert_msg(isfinite(x[i]) == isfinite(y[i]), "%s [" ENGINE "]: tap %s element %zu: %g vs %g", prop, a->name,
                      i, (double)x[i], (double)y[i]);
        if (isfinite(x[i])) mx = fmax(mx, fabs(x[i]));
    }
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) continue;
        double d = fabs((double)x[i] - y[i]);
        if (d > worst) { worst = d; wi = i; }
    }
    int l = -1, np = NL + NMTP;
    if (sscanf(a->name, "layer.%d.", &l) == 1 && l >= 0 && l + 1 < np) np = l + 1;
    double tol = gpu_tol(np, mx);
    ck_assert_msg(worst <= tol, "%s [" ENGINE "]: tap %s element %zu: %.7g vs %.7g, |a-b| %.4g > TOL %.4g = %d*%d*2^-8*max|a| %.5g",
                  prop, a->name, wi, (double)x[wi], (double)y[wi], worst, tol, TOL_PER_LAYER, np, mx);
}

/* ------------------------------------------------------------------ determinism (the anchor of every "bitwise") */
/* The same request twice in one engine (another id, same tokens: the same calls with the same
 * shapes) and once in a second engine: every tap of the forward and the next decode step bitwise.
 * Every "same shapes: bitwise" assertion below rests on this (gpu: cuBLAS deterministic for a
 * fixed shape, per-row kernels without atomics). */
START_TEST(test_repeat_bitwise)
{
    setup_model();
    const int L = 20; /* > W: trimmed, so the compacted path is covered too */
    rec ra = {0}, rb = {0};
    v41_tap_sink sa = {rec_emit, &ra, NULL}, sb = {rec_emit, &rb, NULL};
    v41_engine *a = mk(true, NULL), *b = mk(true, NULL);
    v41_engine_set_sink(a, &sa);
    float *x1 = fw(a, rq(1, 0, L, P), NULL);
    int n1 = ra.n;
    float *x2 = fw(a, rq(2, 0, L, P), NULL);
    ck_assert_int_eq(ra.n, 2 * n1);
    for (int i = 0; i < n1; i++) {
        const rec_tap *u = &ra.t[i], *w = &ra.t[n1 + i];
        ck_assert_str_eq(u->name, w->name);
        ck_assert_msg(u->nb == w->nb && !memcmp(u->data, w->data, u->nb),
                      "determinism [" ENGINE "]: tap %s of the same request differs between two forwards of one engine",
                      u->name);
    }
    v41_engine_set_sink(b, &sb);
    float *x3 = fw(b, rq(7, 0, L, P), NULL);
    ck_assert_int_eq(rb.n, n1);
    for (int i = 0; i < n1; i++)
        ck_assert_msg(ra.t[i].nb == rb.t[i].nb && !memcmp(ra.t[i].data, rb.t[i].data, ra.t[i].nb),
                      "determinism [" ENGINE "]: tap %s of the same request differs between two engines", ra.t[i].name);
    same_bits("determinism: same request twice in one engine", x1, x2, (size_t)V);
    same_bits("determinism: same request in two engines", x1, x3, (size_t)V);
    int32_t t = amax(x1);
    float *d1 = fw(a, rq(1, L, 1, &t), NULL), *d2 = fw(a, rq(2, L, 1, &t), NULL), *d3 = fw(b, rq(7, L, 1, &t), NULL);
    same_bits("determinism: next decode step, two requests of one engine", d1, d2, (size_t)V);
    same_bits("determinism: next decode step, two engines", d1, d3, (size_t)V);
    free(x1); free(x2); free(x3); free(d1); free(d2); free(d3);
    v41_engine_destroy(a); v41_engine_destroy(b);
    rec_free(&ra); rec_free(&rb);
}
END_TEST

/* ------------------------------------------------------------------ replay off == plain */
START_TEST(test_replay_off_plain)
{
    setup_model();
    const int L = 30;
    v41_engine *a = mk(false, NULL), *b = mk(false, NULL), *c = mk(true, NULL);
    float *one = fw(a, rq(1, 0, L, P), NULL);
    /* chunked prefill with replay off == one-shot (gpu: other GEMM shapes, TOL) */
    float *c1 = fw(b, rq(1, 0, 11, P), NULL);
    float *c2 = fw(b, rq(1, 11, 12, P + 11), NULL);
    float *c3 = fw(b, rq(1, 23, L - 23, P + 23), NULL);
    same_rows("chunked prefill (replay off) == one-shot", one, c3, 1);
    /* replay on but prompt logprobs asked for: never trimmed, the same full prefill (same shapes: bitwise) */
    v41_req r = rq(1, 0, L, P);
    r.prompt_logprobs = true;
    float *pl = fw(c, r, NULL);
    same_bits("prompt_logprobs request (replay on) == replay off: not trimmed", one, pl, (size_t)V);
    /* and decode after both: same bits (gpu: caches written with other shapes, TOL) */
    int32_t t = amax(one);
    float *da = fw(a, rq(1, L, 1, &t), NULL), *db = fw(b, rq(1, L, 1, &t), NULL);
    same_rows("decode after chunked prefill == after one-shot", da, db, 1);
    free(one); free(c1); free(c2); free(c3); free(pl); free(da); free(db);
    v41_engine_destroy(a); v41_engine_destroy(b); v41_engine_destroy(c);
}
END_TEST

/* ------------------------------------------------------------------ prompts <= W */
START_TEST(test_short_prompts_unchanged)
{
    setup_model();
    rec ra = {0}, rb = {0};
    v41_tap_sink sa = {rec_emit, &ra, NULL}, sb = {rec_emit, &rb, NULL};
    v41_engine *a = mk(false, NULL), *b = mk(true, NULL);
    v41_engine_set_sink(a, &sa);
    v41_engine_set_sink(b, &sb);
    /* ragged batch of W-row and shorter prompts, then a decode step (same shapes: bitwise in both engines) */
    v41_req r[2] = {rq(1, 0, W, P), rq(2, 0, 5, Q + 3)};
    v41_batch bt = {2, r};
    v41_out o;
    v41_err err = {0};
    ck_assert(v41_engine_forward(a, &bt, &o, &err) == 0);
    ck_assert(v41_engine_forward(b, &bt, &o, &err) == 0);
    int32_t t1 = 5, t2 = 9;
    v41_req d[2] = {rq(1, W, 1, &t1), rq(2, 5, 1, &t2)};
    bt.req = d;
    ck_assert(v41_engine_forward(a, &bt, &o, &err) == 0);
    ck_assert(v41_engine_forward(b, &bt, &o, &err) == 0);
    int j = 0, kept = 0;
    for (int i = 0; i < rb.n; i++) {
        if (!strcmp(rb.t[i].name, "replay.kept")) {
            kept++;
            for (size_t k = 0; k < rb.t[i].nb; k++)
                ck_assert_msg(((uint8_t *)rb.t[i].data)[k] == 1, "prompts <= W [" ENGINE "]: replay.kept[%zu] = 0", k);
            continue;
        }
        ck_assert_int_lt(j, ra.n);
        ck_assert_str_eq(ra.t[j].name, rb.t[i].name);
        ck_assert_msg(ra.t[j].nb == rb.t[i].nb && !memcmp(ra.t[j].data, rb.t[i].data, ra.t[j].nb),
                      "prompts <= W [" ENGINE ", same shapes: bitwise]: tap %s (step %d) differs with replay on",
                      ra.t[j].name, ra.t[j].step);
        j++;
    }
    ck_assert_int_eq(j, ra.n);
    ck_assert_int_eq(kept, 2);
    ck_assert(rec_find(&ra, "replay.kept", 0) == NULL); /* replay off: no such tap */
    v41_engine_destroy(a); v41_engine_destroy(b);
    rec_free(&ra); rec_free(&rb);
}
END_TEST

/* ------------------------------------------------------------------ trimming, prompts > W */
START_TEST(test_trim_long)
{
    setup_model();
    const int L = 20;
    rec ra = {0}, rb = {0};
    v41_tap_sink sa = {rec_emit, &ra, NULL}, sb = {rec_emit, &rb, NULL};
    v41_engine *a = mk(false, NULL), *b = mk(true, NULL);
    v41_engine_set_sink(a, &sa);
    v41_engine_set_sink(b, &sb);
    float *la = fw(a, rq(1, 0, L, P), NULL), *lb = fw(b, rq(1, 0, L, P), NULL);
    bool differ = false;
    for (int i = 0; i < V; i++) {
        ck_assert(isfinite(lb[i]));
        differ = differ || la[i] != lb[i];
    }
    ck_assert_msg(differ, "trimming changed nothing for a prompt of %d > W rows [" ENGINE "]", L);
    const rec_tap *k = rec_find(&rb, "replay.kept", 0);
    ck_assert(k && k->shape[0] == L);
    for (int t = 0; t < L; t++)
        ck_assert_msg(((uint8_t *)k->data)[t] == (t >= L - W), "replay.kept [" ENGINE "] row %d = %d", t,
                      ((uint8_t *)k->data)[t]);
    char nm[96];
    for (int l = 0; l < NL; l++) {
        /* before the cut's query: identical to replay off, every row (same shapes: bitwise in both engines) */
        snprintf(nm, sizeof nm, "layer.%d.stream.in", l);
        const rec_tap *x = rec_find(&rb, nm, 0), *y = rec_find(&ra, nm, 0);
        ck_assert(x && y && x->shape[0] == L);
        for (int t = 0; t < L; t++) {
            if (l <= CUT) ck_assert_msg(row_eq(x, y, t), "%s row %d changed [" ENGINE ", layer <= cut: bitwise]", nm, t);
            else if (t < L - W) ck_assert_msg(row_zero(x, t), "%s trimmed row %d not zero [" ENGINE "]", nm, t);
            else ck_assert_msg(!row_zero(x, t), "%s kept row %d zero [" ENGINE "]", nm, t);
        }
    }
    /* the cut's KV side ran on all rows, its queries on the kept rows only */
    snprintf(nm, sizeof nm, "layer.%d.attn.window_kv", CUT);
    const rec_tap *kv = rec_find(&rb, nm, 0), *kv0 = rec_find(&ra, nm, 0);
    ck_assert_msg(kv && kv0 && kv->nb == kv0->nb && !memcmp(kv->data, kv0->data, kv->nb),
                  "%s: the cut's KV side changed by trimming [" ENGINE ", same shapes: bitwise]", nm);
    snprintf(nm, sizeof nm, "layer.%d.attn.q", CUT);
    const rec_tap *q = rec_find(&rb, nm, 0);
    ck_assert_msg(q && row_zero(q, 0) && row_zero(q, L - W - 1) && !row_zero(q, L - W),
                  "%s: queries of trimmed rows computed (or of kept rows not) [" ENGINE "]", nm);
    /* DSpark context KV of the kept rows only: main_x rows of trimmed rows are zero */
    const rec_tap *mx = rec_find(&rb, "dspark.main_x", 0);
    if (mx) { ck_assert_msg(row_zero(mx, 0) && !row_zero(mx, L - 1), "dspark.main_x: trimmed row 0 not zero or last row zero [" ENGINE "]"); }
    /* decode after a trimmed prefill */
    int32_t t = amax(lb);
    float *d = fw(b, rq(1, L, 1, &t), NULL);
    for (int i = 0; i < V; i++) ck_assert(isfinite(d[i]));
    /* the replay faults act only where replay applies (with the fault: same shapes as lb, a real difference;
     * replay off: nothing to act on, same shapes as la: bitwise in both engines) */
    const char *faults[] = {"swa-not-floored", "replay-rows-misaligned"};
    for (int f = 0; f < 2; f++) {
        v41_engine *e = mk(true, faults[f]), *e0 = mk(false, faults[f]);
        float *x = fw(e, rq(1, 0, L, P), NULL), *x0 = fw(e0, rq(1, 0, L, P), NULL);
        ck_assert_msg(memcmp(x, lb, sizeof(float) * V) != 0, "%s changed nothing [" ENGINE "]", faults[f]);
        ck_assert_msg(!memcmp(x0, la, sizeof(float) * V), "%s changed replay-off results [" ENGINE "]", faults[f]);
        free(x); free(x0);
        v41_engine_destroy(e); v41_engine_destroy(e0);
    }
    free(la); free(lb); free(d);
    v41_engine_destroy(a); v41_engine_destroy(b);
    rec_free(&ra); rec_free(&rb);
}
END_TEST

/* ------------------------------------------------------------------ prefix hit + encoder-side replay */
static void prefix_hit_case(int H, int L)
{
    /* hit: request 10 (prompt Q, sharing P[0:16)) cached, fork its first H into 11,
     * replay from H - W. cold: request 12 computes P[0:H) itself, then the same replay.
     * gpu: the cached prefix comes from a 30-row vs an H-row prefill (other GEMM shapes): TOL */
    v41_err err = {0};
    char what[128];
    v41_engine *e = mk(true, NULL), *c = mk(true, NULL);
    float *x = fw(e, rq(10, 0, 30, Q), NULL);
    free(x);
    ck_assert_msg(e->vt->fork(e, 10, 11, H, &err) == 0, "%s", err.msg);
    v41_req r = rq(11, H - W, L - (H - W), P + H - W);
    r.replay_floor = H - W;
    float *hit = fw(e, r, NULL);
    x = fw(c, rq(12, 0, H, P), NULL);
    free(x);
    r.id = 12;
    float *cold = fw(c, r, NULL);
    snprintf(what, sizeof what, "H=%d L=%d: prefix hit with replay == cold with floor H-W", H, L);
    same_rows(what, hit, cold, 1);
    int32_t t = amax(hit);
    float *d1 = fw(e, rq(11, L, 1, &t), NULL), *d2 = fw(c, rq(12, L, 1, &t), NULL);
    snprintf(what, sizeof what, "H=%d L=%d: next decode step after hit == after cold", H, L);
    same_rows(what, d1, d2, 1);
    /* a start inside the cached prefix without a replay floor is an error; replay off too */
    r = rq(11, 3, 2, P + 3);
    v41_batch b = {1, &r};
    v41_out o;
    ck_assert_int_eq(v41_engine_forward(e, &b, &o, &err), V41_EINVAL);
    /* replayed tokens must be the cached ones */
    ck_assert(e->vt->fork(e, 10, 13, H, &err) == 0);
    r = rq(13, H - W, W + 2, Q + H - W);
    int32_t bad[16];
    memcpy(bad, P + H - W, sizeof(int32_t) * (W + 2));
    for (int i = 0; i < W; i++) bad[i] = (bad[i] + 1 + i) % V; /* some differ after the engram token map */
    r.tokens = bad;
    r.replay_floor = H - W;
    ck_assert_int_eq(v41_engine_forward(e, &b, &o, &err), V41_EINVAL);
    v41_engine *off = mk(false, NULL);
    x = fw(off, rq(10, 0, 30, Q), NULL);
    free(x);
    ck_assert(off->vt->fork(off, 10, 11, H, &err) == 0);
    r = rq(11, H - W, L - (H - W), P + H - W);
    r.replay_floor = H - W;
    ck_assert_int_eq(v41_engine_forward(off, &b, &o, &err), V41_EINVAL);
    free(hit); free(cold); free(d1); free(d2);
    v41_engine_destroy(e); v41_engine_destroy(c); v41_engine_destroy(off);
}

START_TEST(test_prefix_hit_replay)
{
    setup_model();
    prefix_hit_case(16, 34); /* H multiple of every ratio; replay rows > W: trimmed as well */
    prefix_hit_case(15, 20); /* H odd: the ratio-2 group [14,16) straddles H (cached state restored) */
    prefix_hit_case(12, 14); /* query of W + 2 rows */
}
END_TEST

/* ------------------------------------------------------------------ mixed ragged batch */
/* prepares requests 1..4 in e: 2 = a fork of 9's first 16 positions, 3 = 12 cached, 4 = 15 cached */
static void mixed_setup(v41_engine *e)
{
    v41_err err = {0};
    free(fw(e, rq(9, 0, 24, Q), NULL));
    ck_assert(e->vt->fork(e, 9, 2, 16, &err) == 0);
    free(fw(e, rq(3, 0, 12, P + 1), NULL));
    free(fw(e, rq(4, 0, 15, P + 2), NULL));
}

START_TEST(test_mixed_batch)
{
    setup_model();
    int32_t dec = 17, ver[8];
    for (int i = 0; i < BS + 1; i++) ver[i] = (int32_t)((i * 37 + 5) % V);
    v41_req r[4] = {rq(1, 0, 20, P + 4), rq(2, 8, 18, P + 8), rq(3, 12, 1, &dec), rq(4, 15, BS + 1, ver)};
    r[1].replay_floor = 8;
    r[3].verify = r[3].all_logits = true;
    /* together (2 threads: the split never changes a row's bits; the gpu engine runs 1 host thread) */
    g_threads = 2;
    v41_engine *a = mk(true, NULL);
    g_threads = 1;
    mixed_setup(a);
    v41_batch b = {4, r};
    v41_out o;
    v41_err err = {0};
    ck_assert_msg(v41_engine_forward(a, &b, &o, &err) == 0, "%s", err.msg);
    int nrow = o.row_offset[4];
    ck_assert_int_eq(nrow, 3 + BS + 1);
    int off[5];
    memcpy(off, o.row_offset, sizeof off);
    float *tog = malloc(sizeof(float) * (size_t)nrow * V);
    memcpy(tog, o.logits, sizeof(float) * (size_t)nrow * V);
    /* alone (gpu: every GEMM of the batch has M = 45 rows, alone M = 20, 18, 1, 5: TOL) */
    v41_engine *s = mk(true, NULL);
    mixed_setup(s);
    char what[96];
    for (int q = 0; q < 4; q++) {
        int n;
        float *x = fw(s, r[q], &n);
        ck_assert_int_eq(n, off[q + 1] - off[q]);
        snprintf(what, sizeof what, "mixed batch: request %d batched == alone", r[q].id);
        same_rows(what, tog + (size_t)off[q] * V, x, n);
        free(x);
    }
    /* the next step of every request (caches written identically) */
    int32_t nx[4] = {3, 4, 5, 6};
    v41_req d[4] = {rq(1, 20, 1, nx), rq(2, 26, 1, nx + 1), rq(3, 13, 1, nx + 2), rq(4, 15 + BS + 1, 1, nx + 3)};
    b.req = d;
    ck_assert(v41_engine_forward(a, &b, &o, &err) == 0);
    memcpy(tog, o.logits, sizeof(float) * 4 * V);
    ck_assert(v41_engine_forward(s, &b, &o, &err) == 0);
    same_rows("mixed batch: next decode step (4 requests) after batched == after alone", tog, o.logits, 4);
    free(tog);
    v41_engine_destroy(a); v41_engine_destroy(s);
}
END_TEST

/* ------------------------------------------------------------------ DSpark verify + rollback */
static bool cache_tap(const char *n) { return strstr(n, ".cache.") != NULL && !strstr(n, "comp_"); }

START_TEST(test_dspark_rollback)
{
    setup_model();
    if (BS <= 0 || M->cfg.n_mtp_layers <= 0) return;
    const int L0 = 18, GEN = 12;
    v41_err err = {0};
    /* A: plain greedy decode */
    v41_engine *a = mk(true, NULL);
    int32_t ga[64];
    float *x = fw(a, rq(1, 0, L0, P), NULL);
    ga[0] = amax(x);
    free(x);
    for (int i = 1; i < GEN; i++) {
        x = fw(a, rq(1, L0 + i - 1, 1, &ga[i - 1]), NULL);
        ga[i] = amax(x);
        free(x);
    }
    /* B: draft, verify as one multi-token step, accept greedily, roll back the rest
     * (gpu: verification rows come from (BS+1)-row GEMMs, A's from 1-row ones) */
    v41_engine *b = mk(true, NULL);
    int32_t gb[64];
    x = fw(b, rq(1, 0, L0, P), NULL);
    gb[0] = amax(x);
    free(x);
    int n = 1, pos = L0, rejected = 0, steps = 0;
    while (n < GEN) {
        int32_t ids[16], p = pos - 1, id = 1;
        ck_assert(b->vt->dspark_draft_batch(b, 1, &id, &p, &gb[n - 1], ids, NULL, &err) == 0);
        if (steps == 1) ids[1] = (ga[n] + 1) % V; /* force a rejection of the whole block */
        int nb = BS;
        if (pos + nb + 1 > 60) nb = 60 - pos - 1;
        v41_req r = rq(1, pos, nb + 1, ids);
        r.verify = r.all_logits = true;
        int no;
        float *lg = fw(b, r, &no);
        ck_assert_int_eq(no, nb + 1);
        int acc = 0;
        while (acc < nb && amax(lg + (size_t)acc * V) == ids[acc + 1]) acc++;
        int32_t bonus = amax(lg + (size_t)acc * V);
        free(lg);
        if (acc < nb) rejected++;
        for (int i = 1; i <= acc && n < GEN; i++) gb[n++] = ids[i];
        if (n < GEN) gb[n++] = bonus;
        pos += acc + 1;
        ck_assert(b->vt->truncate(b, 1, pos, &err) == 0);
        steps++;
    }
    ck_assert_msg(rejected > 0, "no rejection exercised [" ENGINE "]");
    for (int i = 0; i < GEN; i++)
        ck_assert_msg(ga[i] == gb[i], "speculation changed the greedy output [" ENGINE "]: token %d (position %d): %d plain, %d with DSpark",
                      i, L0 + i, ga[i], gb[i]);
    /* bring both to the same length: B may have accepted past GEN */
    int LA = L0 + GEN - 1;
    ck_assert_int_ge(pos, LA);
    ck_assert(b->vt->truncate(b, 1, LA, &err) == 0);
    /* next step: logits and caches (window rings incl. DSpark stages, compressed KV, index keys) */
    rec ra = {0}, rb = {0};
    v41_tap_sink sa = {rec_emit, &ra, "*.cache.*"}, sb = {rec_emit, &rb, "*.cache.*"};
    v41_engine_set_sink(a, &sa);
    v41_engine_set_sink(b, &sb);
    float *xa = fw(a, rq(1, LA, 1, &ga[GEN - 1]), NULL), *xb = fw(b, rq(1, LA, 1, &ga[GEN - 1]), NULL);
    same_rows("DSpark rollback: logits after rollback == never drafted", xa, xb, 1);
    int cmp = 0;
    for (int i = 0; i < ra.n; i++) {
        if (!cache_tap(ra.t[i].name)) continue;
        const rec_tap *y = rec_find(&rb, ra.t[i].name, rb.n ? rb.t[0].step : 0);
        same_tap("DSpark rollback: cache after rollback == never drafted", &ra.t[i], y);
        cmp++;
    }
    ck_assert_int_gt(cmp, NL);
    /* and the next draft (DSpark stage rings rolled back): ids identical, confidences bitwise (gpu: TOL) */
    int32_t ia[16], ib[16], p = LA, id = 1, f0 = amax(xa);
    float ca[16], cb[16];
    ck_assert(a->vt->dspark_draft_batch(a, 1, &id, &p, &f0, ia, ca, &err) == 0);
    ck_assert(b->vt->dspark_draft_batch(b, 1, &id, &p, &f0, ib, cb, &err) == 0);
    for (int i = 0; i <= BS; i++)
        ck_assert_msg(ia[i] == ib[i], "DSpark rollback: next draft id %d [" ENGINE "]: %d never drafted, %d after rollback", i,
                      ia[i], ib[i]);
    double cmax = 0, cworst = 0;
    int ci = 0;
    for (int i = 0; i < BS; i++) cmax = fmax(cmax, fabs(ca[i]));
    for (int i = 0; i < BS; i++)
        if (fabs((double)ca[i] - cb[i]) > cworst) { cworst = fabs((double)ca[i] - cb[i]); ci = i; }
    if (SHAPE_EXACT)
        ck_assert_msg(!memcmp(ca, cb, sizeof(float) * BS), "DSpark rollback: next draft confidence %d [" ENGINE ", bitwise]: %.9g vs %.9g",
                      ci, (double)ca[ci], (double)cb[ci]);
    else
        ck_assert_msg(cworst <= gpu_tol(NL + NMTP, cmax),
                      "DSpark rollback: next draft confidence %d [" ENGINE "]: %.7g vs %.7g, |a-b| %.4g > TOL %.4g = %d*%d*2^-8*max|a| %.5g",
                      ci, (double)ca[ci], (double)cb[ci], cworst, gpu_tol(NL + NMTP, cmax), TOL_PER_LAYER, NL + NMTP, cmax);
    free(xa); free(xb);
    rec_free(&ra); rec_free(&rb);
    v41_engine_destroy(a); v41_engine_destroy(b);
}
END_TEST

/* ------------------------------------------------------------------ DSpark padding (op level) */
#ifndef V41_TEST_ENGINE_GPU
START_TEST(test_dspark_padding_op)
{
    /* W = 128, B = 5: 133 valid keys, padded to ceil(133/128)*128 = 256 entries.
     * Query 0 (all scores equal) and no sink: each valid key has weight 1/133. Padding with
     * zero weight (-1 -> NULL) returns the constant exactly; padding counted (the bug: a
     * padded entry read as a zero key/value with score 0) returns 133/256 of it, exact in
     * bf16 (133/256 = 0.51953125 has 8 significant bits). */
    enum { d = 64, nv = 133, nw = 256 };
    static float kc[d], zero[d], q[d], out[d];
    for (int i = 0; i < d; i++) kc[i] = 1.0f;
    const float *kp[nw];
    for (int emu = 0; emu < 2; emu++) {
        for (int j = 0; j < nw; j++) kp[j] = j < nv ? kc : NULL;
        v41_sparse_attn_row(q, 1, d, kp, nw, NULL, 0.125f, out, emu);
        for (int i = 0; i < d; i++) ck_assert_msg(out[i] == 1.0f, "padding with zero weight: %g", out[i]);
        for (int j = nv; j < nw; j++) kp[j] = zero;
        v41_sparse_attn_row(q, 1, d, kp, nw, NULL, 0.125f, out, emu);
        for (int i = 0; i < d; i++) ck_assert_msg(out[i] == 0.51953125f, "padding counted: %g", out[i]);
    }
    /* a random query: padded with -1 == unpadded, bitwise (chunks start at list index 0) */
    static float kr[nv][d], o1[4 * d], o2[4 * d], q4[4 * d], sink[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    uint32_t s = 99;
    for (int j = 0; j < nv; j++)
        for (int i = 0; i < d; i++) { s = s * 1103515245u + 12345u; kr[j][i] = v41_bf16r(((int)(s >> 9) % 2001 - 1000) / 700.0f); }
    for (int i = 0; i < 4 * d; i++) { s = s * 1103515245u + 12345u; q4[i] = v41_bf16r(((int)(s >> 9) % 2001 - 1000) / 300.0f); }
    for (int j = 0; j < nw; j++) kp[j] = j < nv ? kr[j] : NULL;
    v41_sparse_attn_row(q4, 4, d, kp, nv, sink, 0.125f, o1, true);
    v41_sparse_attn_row(q4, 4, d, kp, nw, sink, 0.125f, o2, true);
    ck_assert(!memcmp(o1, o2, sizeof o1));
}
END_TEST
#else
/* The same op on the device: the GPU engine runs every DSpark (and backbone) attention row
 * as v41g_sparse_attn with T = 1, the row's keys packed in list order and -1 for an absent
 * entry (gpu/engine.cu attn_dev); "padding counted" = a padded entry that is a zero key
 * (pool B) with score 0. Exact for the same reasons as in ref: all probabilities are
 * exp(0) = 1, numerator 133 (or 133 * 1.0 / 133, rounded to bf16: 1), 133/256 exact. */
static uint16_t f2bf_exact(float f) { uint32_t u; memcpy(&u, &f, 4); ck_assert((u & 0xffff) == 0); return (uint16_t)(u >> 16); }
static float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static void *dup_dev(const void *h, size_t n)
{
    void *p = v41g_malloc(n);
    ck_assert_msg(p != NULL, "v41g_malloc(%zu)", n);
    ck_assert_int_eq(v41g_h2d(p, h, n), 0);
    return p;
}
static void dev_attn(const uint16_t *q, int H, int d, const uint16_t *kva, const uint16_t *kvb, int na, int nb,
                     const int32_t *idx, int L, int n_a, const float *sink, uint16_t *o)
{
    void *dq = dup_dev(q, 2 * (size_t)H * d), *da = dup_dev(kva, 2 * (size_t)na * d), *db = dup_dev(kvb, 2 * (size_t)nb * d);
    void *di = dup_dev(idx, 4 * (size_t)L), *ds = sink ? dup_dev(sink, 4 * (size_t)H) : NULL;
    void *dout = v41g_malloc(2 * (size_t)H * d);
    ck_assert(dout != NULL);
    ck_assert_int_eq(v41g_memset(dout, 0xff, 2 * (size_t)H * d), 0); /* NaN: an unwritten element fails */
    int rc = v41g_sparse_attn(dq, da, db, di, L, n_a, ds, 0.125f, 1, H, d, dout, NULL);
    ck_assert_msg(rc == 0, "v41g_sparse_attn: %s", v41g_error_string(rc));
    ck_assert_int_eq(v41g_sync(), 0);
    ck_assert_int_eq(v41g_d2h(o, dout, 2 * (size_t)H * d), 0);
    v41g_free(dq); v41g_free(da); v41g_free(db); v41g_free(di); v41g_free(dout);
    if (ds) v41g_free(ds);
}
START_TEST(test_dspark_padding_op)
{
    enum { d = 64, nv = 133, nw = 256 };
    static uint16_t kc[nv * d], zero[d], q[d], out[d];
    static int32_t idx[nw];
    for (int i = 0; i < nv * d; i++) kc[i] = f2bf_exact(1.0f);
    /* zero weight: entries >= 133 are -1 */
    for (int j = 0; j < nw; j++) idx[j] = j < nv ? j : -1;
    dev_attn(q, 1, d, kc, zero, nv, 1, idx, nw, nv, NULL, out);
    for (int i = 0; i < d; i++) ck_assert_msg(bf2f(out[i]) == 1.0f, "[gpu] padding with zero weight: element %d = %.9g", i, (double)bf2f(out[i]));
    /* counted: entries >= 133 read the zero row of pool B */
    for (int j = nv; j < nw; j++) idx[j] = 0;
    dev_attn(q, 1, d, kc, zero, nv, 1, idx, nw, nv, NULL, out);
    for (int i = 0; i < d; i++)
        ck_assert_msg(bf2f(out[i]) == 0.51953125f, "[gpu] padding counted: element %d = %.9g, want 133/256", i, (double)bf2f(out[i]));
    /* a random query (4 heads, sink): padded with -1 == unpadded, bitwise */
    static uint16_t kr[nv * d], q4[4 * d], o1[4 * d], o2[4 * d];
    float sink[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    uint32_t s = 99;
    for (int i = 0; i < nv * d; i++) { s = s * 1103515245u + 12345u; kr[i] = f2bf_exact(v41_bf16r(((int)(s >> 9) % 2001 - 1000) / 700.0f)); }
    for (int i = 0; i < 4 * d; i++) { s = s * 1103515245u + 12345u; q4[i] = f2bf_exact(v41_bf16r(((int)(s >> 9) % 2001 - 1000) / 300.0f)); }
    for (int j = 0; j < nw; j++) idx[j] = j < nv ? j : -1;
    dev_attn(q4, 4, d, kr, zero, nv, 1, idx, nv, nv, sink, o1);
    dev_attn(q4, 4, d, kr, zero, nv, 1, idx, nw, nv, sink, o2);
    for (int i = 0; i < 4 * d; i++)
        ck_assert_msg(o1[i] == o2[i], "[gpu] padded (-1) != unpadded at head %d element %d: %.9g vs %.9g", i / d, i % d,
                      (double)bf2f(o1[i]), (double)bf2f(o2[i]));
}
END_TEST

#endif

int main(void)
{
#ifdef V41_TEST_ENGINE_GPU
    if (!gpu_present()) {
        printf("test_serving_gpu: no CUDA device: skipped\n");
        return 77;
    }
#endif
    Suite *s = suite_create("serving_" ENGINE);
    TCase *tc = tcase_create("serving");
    tcase_set_timeout(tc, SHAPE_EXACT ? 300 : 900); /* gpu: per-row host<->device round trips */
    tcase_add_test(tc, test_dspark_padding_op);
    tcase_add_test(tc, test_repeat_bitwise);
    tcase_add_test(tc, test_replay_off_plain);
    tcase_add_test(tc, test_short_prompts_unchanged);
    tcase_add_test(tc, test_trim_long);
    tcase_add_test(tc, test_prefix_hit_replay);
    tcase_add_test(tc, test_mixed_batch);
    tcase_add_test(tc, test_dspark_rollback);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
#endif /* !V41_TEST_SKIP_ALL */
