/* test_gpu_resident: the device-resident decode step of the GPU engine
 * (gpu/engine_dev.cu) against the GPU engine's hybrid path (itself in parity with the
 * CPU reference: v41 parity, tests/test_parity.sh), on a serving script that moves the
 * caches between the two copies:
 *
 *   step 0      three requests prefill 5, 11 and 19 tokens (hybrid: not a decode batch);
 *   steps 1-24  all live requests decode one token each (device-resident), except
 *   step 8      request 1 takes a 3-token chunk (the batch goes hybrid: every row the
 *               device wrote must come back to the host first, and the chunk's rows
 *               must go up before the next device step);
 *   step 12     request 2 is truncated by 2 positions and re-fed (rollback);
 *   step 15     request 3 forks request 0's cached prefix (n = len - 1) and joins;
 *   end         a 2-token hybrid forward with a tap sink: every cache tap (window,
 *               compressed KV, index keys, compressor state, DSpark windows) then holds
 *               rows the device wrote, read back through gd_to_host.
 * Positions run past the window (8), through complete and partial compressor groups
 * (ratio 2), past index_topk (6) compressed positions and across candidate blocks.
 *
 * Checks:
 *  - the resident path really ran (v41_gpu_engine_resident_steps counts every
 *    decode step of the script);
 *  - CUDA-graph replay and direct launches give the same bits (same kernels, same
 *    order, same shapes), and two runs give the same bits (determinism);
 *  - step by step from the same caches (test_resident_step): every decode step runs
 *    first through the hybrid path (a tap sink makes a batch ineligible for the device
 *    path) collecting the logits and every cache tap, then each request is truncated
 *    back and the same step runs on the device. The two logits must agree, and the next
 *    step's hybrid cache taps -- which hold the rows the device wrote, copied back by
 *    gd_to_host, and the compressor state rebuilt from them -- must agree with this
 *    step's hybrid cache taps on every element neither step overwrote. Whole-script
 *    comparisons against another engine would compare accumulated drift (cached rows of
 *    earlier steps differ by bf16 flips, so later steps start from different caches);
 *    from the same caches, the differences are one step's.
 *    Bound: TOL = 4 * n_path * 2^-8 * max|a| (tests/test_serving_ref.c's header: one
 *    bf16 ulp flip per rounded GEMM whose shape differs, two sublayers a layer;
 *    n_path = n_layers for logits, l + 1 for a cache tap of layer l), or else the
 *    quantizer-flip allowance of v41 oracle-check (README, "oracle-check"): a one-ulp
 *    difference can move one fp8/fp4 code by a step (2^-3 relative at the block's
 *    largest magnitude) which stays local, so a row or tap also passes when its error
 *    RMS is within TOL's RMS counterpart (4 * n_path * 2^-8 * rms|a|) and no element is
 *    off by more than 2^-3 * max|a|. Greedy tokens must be equal unless the hybrid
 *    step's top two logits are within 2 TOL (a near tie: reported, not failed).
 * Exit 77 (skip) without CUDA or without a device (a probe child decides). */
#include "config.h"
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>

#ifndef HAVE_CUDA
int main(void)
{
    printf("test_gpu_resident: built without CUDA: skipped\n");
    return 77;
}
#else
#include "v41_gpu.h"
#include "v41_engine.h"
#include "v41_config.h"
#include "test_gpu_probe.h"
#include "test_model.h"

#define TOL_PER_LAYER 4
#define EPS_BF16 0x1p-8
enum { NSTEP = 25, MAXR = 4 };

static v41_model *M;

/* one cache tap's values */
typedef struct ctap {
    char name[96];
    int layer;
    size_t n;
    float *v;
} ctap;

/* The cache taps of a forward (and, per row, how close its decisions came to a tie). */
typedef struct tapset {
    ctap t[256];
    int n;
    float tie[MAXR];          /* per row: the smallest decision margin / its tolerance */
    char tie_at[MAXR][96];
} tapset;

/* margin between the k-th and (k+1)-th largest of x[0..n) (NaN/-inf excluded; +inf
 * entries are pinned choices), over the tolerance of a value of this row; FLT_MAX when
 * the cut is not contested */
static float cut_ratio(const float *x, int n, int k, double n_path)
{
    float mx = 0;
    int nf = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(x[i])) { mx = fmaxf(mx, fabsf(x[i])); nf++; }
    int pinned = 0;
    for (int i = 0; i < n; i++) pinned += x[i] == INFINITY;
    k -= pinned;
    if (k <= 0 || nf <= k) return 3.4e38f;
    float *v = malloc(sizeof(float) * (size_t)nf);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(x[i])) v[m++] = x[i];
    for (int a = 0; a <= k; a++) /* partial selection sort: the k+1 largest */
        for (int b2 = a + 1; b2 < m; b2++)
            if (v[b2] > v[a]) { float t = v[a]; v[a] = v[b2]; v[b2] = t; }
    float margin = v[k - 1] - v[k];
    free(v);
    const float tol = (float)(TOL_PER_LAYER * n_path * EPS_BF16) * mx;
    return tol > 0 ? margin / tol : (margin > 0 ? 3.4e38f : 0.0f);
}

static int collect_set(void *ctx, const v41_tap *t)
{
    tapset *r = ctx;
    const v41_config *cfg = &M->cfg;
    int k = 0;
    if (strstr(t->name, ".ffn.gate.scores")) k = v41_layer_n_active(cfg, t->layer);
    else if (strstr(t->name, ".indexer.scores")) k = cfg->index_topk;
    else if (strstr(t->name, ".candidate.scores")) k = cfg->candidate_topk_blocks;
    if (k > 0 && t->ndim == 2) { /* a decision of this step: how close is its cut? */
        for (int q = 0; q < t->shape[0] && q < MAXR; q++) {
            float ratio = cut_ratio((const float *)t->data + (size_t)q * t->shape[1], (int)t->shape[1], k, t->layer + 1);
            if (ratio < r->tie[q]) {
                r->tie[q] = ratio;
                snprintf(r->tie_at[q], sizeof r->tie_at[q], "%s", t->name);
            }
        }
        return 0;
    }
    if (!strstr(t->name, ".cache.") || r->n >= 256) return 0;
    if (t->kind != V41_TAP_F32 && t->kind != V41_TAP_BF16) return 0;
    ctap *c = &r->t[r->n++];
    snprintf(c->name, sizeof c->name, "%s", t->name);
    c->layer = t->layer;
    c->n = 1;
    for (int i = 0; i < t->ndim; i++) c->n *= (size_t)t->shape[i];
    c->v = malloc(sizeof(float) * c->n);
    memcpy(c->v, t->data, sizeof(float) * c->n);
    return 0;
}
static void free_set(tapset *r)
{
    for (int i = 0; i < r->n; i++) free(r->t[i].v);
    r->n = 0;
}

/* one run of the script: logits [NSTEP][MAXR][V] (NAN where a request had no row),
 * argmax, the final cache taps */
typedef struct run_out {
    float *logits;
    int32_t am[NSTEP][MAXR];
    tapset taps;
    long resident;
} run_out;

static int32_t tok_of(int req, int pos) { return (int32_t)((1103515245u * (unsigned)(req * 131 + pos) + 12345u) >> 9) % M->cfg.vocab_size; }

static v41_engine *mk(int gpu, const char *resident, const char *graph)
{
    setenv("V41_GPU_RESIDENT", resident, 1);
    setenv("V41_GPU_GRAPH", graph, 1);
    v41_engine_opts o;
    v41_engine_opts_default(&o);
    o.max_seq_len = 64;
    o.max_requests = 8;
    v41_engine *e = NULL;
    v41_err err = {0};
    int rc = gpu ? v41_gpu_engine_create(M, &o, &e, &err) : v41_ref_engine_create(M, &o, &e, &err);
    ck_assert_msg(rc == 0, "engine: %s", err.msg);
    unsetenv("V41_GPU_RESIDENT");
    unsetenv("V41_GPU_GRAPH");
    return e;
}

/* The script's state and its step s (see the header): the events before the step (rollback of
 * request 2 at step 12, request 3 forking request 0's prefix at step 15), then the batch of
 * the step in rq (tokens in toks). Returns whether the batch is a decode batch. */
typedef struct script {
    int len[MAXR], nlive;
    int32_t toks[MAXR][64];
    v41_req rq[MAXR];
} script;

static bool script_step(v41_engine *e, script *S, int s, bool *events)
{
    static const int plen[3] = {5, 11, 19};
    v41_err err = {0};
    if (s == 0) {
        memset(S, 0, sizeof *S);
        S->nlive = 3;
    }
    *events = false;
    if (s == 12) { /* rollback of request 2 */
        ck_assert_msg(e->vt->truncate(e, 2, S->len[2] - 2, &err) == 0, "truncate: %s", err.msg);
        S->len[2] -= 2;
        *events = true;
    }
    if (s == 15) { /* prefix hit: request 3 forks request 0 */
        ck_assert_msg(e->vt->fork(e, 0, 3, S->len[0] - 1, &err) == 0, "fork: %s", err.msg);
        S->len[3] = S->len[0] - 1;
        S->nlive = 4;
        *events = true;
    }
    bool decode = true;
    for (int q = 0; q < S->nlive; q++) {
        int n = s == 0 ? plen[q] : (s == 8 && q == 1 ? 3 : 1);
        decode = decode && n == 1;
        for (int i = 0; i < n; i++) S->toks[q][i] = tok_of(q == 3 ? 0 : q, S->len[q] + i);
        memset(&S->rq[q], 0, sizeof S->rq[q]);
        S->rq[q].id = q;
        S->rq[q].start_pos = S->len[q];
        S->rq[q].n_tokens = n;
        S->rq[q].tokens = S->toks[q];
    }
    return decode;
}

static void run_script(v41_engine *e, run_out *r)
{
    const int V = M->cfg.vocab_size;
    v41_err err = {0};
    memset(r, 0, sizeof *r);
    r->logits = malloc(sizeof(float) * NSTEP * MAXR * V);
    for (size_t i = 0; i < (size_t)NSTEP * MAXR * V; i++) r->logits[i] = NAN;
    script S;
    int *len = S.len;
    for (int s = 0; s < NSTEP; s++) {
        bool ev;
        script_step(e, &S, s, &ev);
        v41_req *rq = S.rq;
        const int nlive = S.nlive;
        v41_batch b = {nlive, rq};
        v41_out out;
        ck_assert_msg(e->vt->forward(e, &b, &out, &err) == 0, "step %d: %s", s, err.msg);
        for (int q = 0; q < nlive; q++) {
            int row = out.row_offset[q + 1] - 1; /* the last row of each request */
            memcpy(r->logits + ((size_t)s * MAXR + q) * V, out.logits + (size_t)row * V, sizeof(float) * V);
            r->am[s][q] = out.argmax[row];
            len[q] += rq[q].n_tokens;
        }
    }
    r->resident = v41_gpu_engine_resident_steps(e);
    /* a hybrid forward with the sink: cache taps after the device steps */
    v41_tap_sink sink = {collect_set, &r->taps, NULL};
    v41_engine_set_sink(e, &sink);
    int32_t t2[2] = {tok_of(0, len[0]), tok_of(0, len[0] + 1)};
    v41_req rq = {0};
    rq.id = 0;
    rq.start_pos = len[0];
    rq.n_tokens = 2;
    rq.tokens = t2;
    v41_batch b = {1, &rq};
    v41_out out;
    ck_assert_msg(e->vt->forward(e, &b, &out, &err) == 0, "final: %s", err.msg);
    v41_engine_set_sink(e, NULL);
}

static void free_run(run_out *r)
{
    free(r->logits);
    free_set(&r->taps);
}

static int nlive_at(int s) { return s >= 15 ? 4 : 3; }

/* Within TOL, or (allow) under the quantizer-flip allowance; see the header. */
static bool within(const float *x, const float *y, size_t n, double n_path, bool allow, float *md_out, size_t *at_out,
                   float *tol_out)
{
    double ss = 0, sd = 0;
    float mx = 0, md = 0;
    size_t at = 0, nf = 0;
    for (size_t k = 0; k < n; k++) {
        if (!isfinite(x[k])) {
            if (!(x[k] == y[k])) { md = INFINITY; at = k; }
            continue;
        }
        mx = fmaxf(mx, fabsf(x[k]));
        ss += (double)x[k] * x[k];
        float dd = fabsf(x[k] - y[k]);
        sd += (double)dd * dd;
        nf++;
        if (!(dd <= md)) { md = dd; at = k; }
    }
    const float tol = (float)(TOL_PER_LAYER * n_path * EPS_BF16) * mx;
    *md_out = md;
    *at_out = at;
    *tol_out = tol;
    if (md <= tol) return true;
    if (!allow || !nf || !isfinite(md)) return false;
    const double rms = sqrt(ss / nf), erms = sqrt(sd / nf);
    return erms <= TOL_PER_LAYER * n_path * EPS_BF16 * rms && md <= 0x1p-3 * mx;
}

/* b against a, bit for bit: every logits row, greedy token and final cache tap */
static void same_bits(const run_out *a, const run_out *b, const char *what)
{
    const int V = M->cfg.vocab_size;
    for (int s = 0; s < NSTEP; s++)
        for (int q = 0; q < nlive_at(s); q++) {
            const float *x = a->logits + ((size_t)s * MAXR + q) * V, *y = b->logits + ((size_t)s * MAXR + q) * V;
            float md = 0;
            int at = 0;
            for (int i = 0; i < V; i++) {
                float dd = fabsf(x[i] - y[i]);
                if (!(dd <= md)) { md = dd; at = i; }
            }
            ck_assert_msg(!memcmp(x, y, sizeof(float) * V), "%s: step %d request %d: logits differ (max %g at %d)",
                          what, s, q, md, at);
            ck_assert_int_eq(a->am[s][q], b->am[s][q]);
        }
    ck_assert_int_eq(a->taps.n, b->taps.n);
    ck_assert_msg(a->taps.n >= M->cfg.n_layers, "%s: only %d cache taps", what, a->taps.n);
    for (int i = 0; i < a->taps.n; i++) {
        const ctap *x = &a->taps.t[i], *y = &b->taps.t[i];
        ck_assert_str_eq(x->name, y->name);
        ck_assert_uint_eq(x->n, y->n);
        ck_assert_msg(!memcmp(x->v, y->v, sizeof(float) * x->n), "%s: %s differs", what, x->name);
    }
}

static run_out R_gpu;
static int have_gpu;

static void need_run(void)
{
    if (!M) M = test_model_load();
    if (!have_gpu) {
        v41_engine *e = mk(1, "1", "1");
        run_script(e, &R_gpu);
        v41_engine_destroy(e);
        have_gpu = 1;
    }
}

START_TEST(test_resident_ran)
{
    need_run();
    /* every step but the prefill (0) and the chunk (8) is a decode batch */
    ck_assert_msg(R_gpu.resident == NSTEP - 2, "resident steps %ld, expected %d", R_gpu.resident, NSTEP - 2);
    v41_engine *e = mk(0, "1", "1");   /* any other engine counts none */
    ck_assert_int_eq(v41_gpu_engine_resident_steps(e), 0);
    v41_engine_destroy(e);
}
END_TEST

/* ---- step by step from the same caches (see the header) */
/* The elements of cache tap x (after a step at positions pos_prev[q]) that the next step
 * (positions pos_prev[q] + 1, tap y) does not overwrite, gathered into a and b. */
static size_t cache_common(const ctap *x, const ctap *y, int nr, const int *pos_prev, float *a, float *b)
{
    const v41_config *c = &M->cfg;
    const int W = c->window_size, d = c->head_dim, dI = c->index_head_dim;
    const int m = c->compress_ratios[x->layer];
    size_t n = 0;
    for (int q = 0; q < nr; q++) {
        const int pn = pos_prev[q] + 1; /* the next step's position */
        if (strstr(x->name, ".cache.window")) {
            for (int sl = 0; sl < W; sl++) {
                if (sl == pn % W) continue;
                for (int k = 0; k < d; k++) {
                    size_t i = ((size_t)q * W + sl) * d + k;
                    a[n] = x->v[i]; b[n] = y->v[i]; n++;
                }
            }
        } else if (strstr(x->name, "_state")) {
            for (int sl = 0; sl < m; sl++) {
                if (sl == pn % m) continue;
                for (int k = 0; k < d; k++) {
                    size_t i = ((size_t)q * m + sl) * d + k;
                    a[n] = x->v[i]; b[n] = y->v[i]; n++;
                }
            }
        } else { /* compressed / index_k: [nr, L, w], rows j < pn / m exist after the step */
            const int w = strstr(x->name, "index_k") ? dI : d;
            const size_t Lx = x->n / ((size_t)nr * w), Ly = y->n / ((size_t)nr * w);
            for (int j = 0; j < pn / m; j++)
                for (int k = 0; k < w; k++) {
                    a[n] = x->v[((size_t)q * Lx + j) * w + k];
                    b[n] = y->v[((size_t)q * Ly + j) * w + k];
                    n++;
                }
        }
    }
    return n;
}

START_TEST(test_resident_step)
{
    if (!M) M = test_model_load();
    const int V = M->cfg.vocab_size, NL = M->cfg.n_layers;
    v41_engine *e = mk(1, "1", "1");
    v41_err err = {0};
    script S;
    int *len = S.len, ncmp = 0, ntap = 0, near = 0;
    tapset prev = {0}, cur = {0};
    int prev_pos[MAXR], prev_nr = 0; /* the previous step ran on the device at these positions */
    float *LB = malloc(sizeof(float) * MAXR * V);
    float *ba = malloc(sizeof(float) * 65536), *bb = malloc(sizeof(float) * 65536);
    for (int s = 0; s < NSTEP; s++) {
        bool ev;
        const bool decode = script_step(e, &S, s, &ev);
        if (ev) prev_nr = 0; /* the batch changed: no previous device step to read back */
        v41_req *rq = S.rq;
        const int nlive = S.nlive;
        v41_batch b = {nlive, rq};
        v41_out out;
        /* the hybrid step (a sink attached: not eligible for the device path) */
        long r0 = v41_gpu_engine_resident_steps(e);
        for (int q = 0; q < MAXR; q++) cur.tie[q] = 3.4e38f;
        v41_tap_sink sink = {collect_set, &cur, NULL};
        v41_engine_set_sink(e, &sink);
        ck_assert_msg(e->vt->forward(e, &b, &out, &err) == 0, "step %d: %s", s, err.msg);
        v41_engine_set_sink(e, NULL);
        ck_assert_int_eq(v41_gpu_engine_resident_steps(e), r0);
        for (int q = 0; q < nlive; q++)
            memcpy(LB + (size_t)q * V, out.logits + (size_t)(out.row_offset[q + 1] - 1) * V, sizeof(float) * V);
        /* the rows the device wrote at the previous step, read back through this step's taps */
        if (prev_nr == nlive && decode) {
            ck_assert_int_eq(prev.n, cur.n);
            for (int i = 0; i < cur.n; i++) {
                ck_assert_str_eq(prev.t[i].name, cur.t[i].name);
                size_t n = cache_common(&prev.t[i], &cur.t[i], nlive, prev_pos, ba, bb);
                ck_assert(n <= 65536);
                float md, tol;
                size_t at;
                ck_assert_msg(within(ba, bb, n, prev.t[i].layer + 1, true, &md, &at, &tol),
                              "step %d: %s (rows the device wrote at step %d) differs by %g > %g at %zu", s,
                              cur.t[i].name, s - 1, md, tol, at);
                ntap++;
            }
        }
        float tie[MAXR];
        char tie_at[MAXR][96];
        memcpy(tie, cur.tie, sizeof tie);
        memcpy(tie_at, cur.tie_at, sizeof tie_at);
        free_set(&prev);
        prev = cur;
        cur.n = 0;
        prev_nr = 0;
        if (decode) { /* roll back and run the same step on the device */
            for (int q = 0; q < nlive; q++)
                ck_assert_msg(e->vt->truncate(e, q, len[q], &err) == 0, "truncate: %s", err.msg);
            ck_assert_msg(e->vt->forward(e, &b, &out, &err) == 0, "device step %d: %s", s, err.msg);
            ck_assert_int_eq(v41_gpu_engine_resident_steps(e), r0 + 1);
            for (int q = 0; q < nlive; q++) {
                const float *x = LB + (size_t)q * V, *y = out.logits + (size_t)(out.row_offset[q + 1] - 1) * V;
                float md, tol;
                size_t at;
                if (!within(x, y, (size_t)V, NL, true, &md, &at, &tol)) {
                    /* beyond the bound: only a decision taken at a near tie inside the step explains it */
                    ck_assert_msg(tie[q] <= 1.0f,
                                  "step %d request %d: device logit %zu differs from the hybrid step by %g > %g, and no "
                                  "decision of the step was near a tie (closest: %s at %.3g x its tolerance)",
                                  s, q, at, md, tol, tie_at[q], tie[q]);
                    printf("step %d request %d: logits differ by %g > %g after a near tie (%s: margin %.3g x its "
                           "tolerance)\n", s, q, md, tol, tie_at[q], tie[q]);
                    near++;
                    prev_pos[q] = len[q];
                    ncmp++;
                    continue;
                }
                int ax = 0;
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int i = 0; i < V; i++) {
                    if (x[i] > b1) { b2 = b1; b1 = x[i]; ax = i; }
                    else if (x[i] > b2) b2 = x[i];
                }
                if (ax != out.argmax[out.row_offset[q + 1] - 1]) {
                    ck_assert_msg(b1 - b2 <= 2 * tol || tie[q] <= 1.0f,
                                  "step %d request %d: greedy %d vs %d, margin %g > 2 TOL %g", s, q, ax,
                                  out.argmax[out.row_offset[q + 1] - 1], b1 - b2, 2 * tol);
                    near++;
                }
                prev_pos[q] = len[q];
                ncmp++;
            }
            prev_nr = nlive;
        }
        for (int q = 0; q < nlive; q++) len[q] += rq[q].n_tokens;
    }
    printf("resident step: %d device rows compared with the hybrid step, %d cache taps checked, %d near ties\n", ncmp,
           ntap, near);
    ck_assert_int_ge(ncmp, 60);
    ck_assert_int_ge(ntap, 100);
    free_set(&prev);
    free(LB); free(ba); free(bb);
    v41_engine_destroy(e);
}
END_TEST

/* the script again in a new engine (graph "0": kernels launched directly) gives R_gpu's bits */
static void rerun_same_bits(const char *graph, const char *what)
{
    need_run();
    run_out d;
    v41_engine *e = mk(1, "1", graph);
    run_script(e, &d);
    v41_engine_destroy(e);
    ck_assert_int_eq(d.resident, NSTEP - 2);
    same_bits(&d, &R_gpu, what);
    free_run(&d);
}

START_TEST(test_graph_equals_direct) { rerun_same_bits("0", "graph vs direct"); }
END_TEST

START_TEST(test_resident_repeat) { rerun_same_bits("1", "repeat"); }
END_TEST

int main(void)
{
    if (!gpu_present()) {
        printf("test_gpu_resident: no CUDA device: skipped\n");
        return 77;
    }
    Suite *s = suite_create("gpu_resident");
    TCase *tc = tcase_create("resident");
    tcase_set_timeout(tc, 600);
    /* one process for the suite: the runs are shared between the tests */
    tcase_add_test(tc, test_resident_ran);
    tcase_add_test(tc, test_resident_step);
    tcase_add_test(tc, test_graph_equals_direct);
    tcase_add_test(tc, test_resident_repeat);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
#endif
