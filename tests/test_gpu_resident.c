/* test_gpu_resident: the device-resident decode step of the GPU engine
 * (gpu/engine_dev.cu) against the CPU reference and against the GPU engine's
 * hybrid path, on a serving script that moves the caches between the two copies:
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
 *  - against ref and against the hybrid GPU path: logits within the bound of
 *    tests/test_serving_ref.c's header, TOL = 4 * n_path * 2^-8 * max|ref row|
 *    (n_path = n_layers for logits: one bf16 ulp flip per rounded GEMM, two
 *    sublayers a layer), cache taps within the same bound with n_path = l + 1;
 *    greedy tokens equal unless the reference's top two logits are within 2 TOL
 *    (a near tie: reported, not failed).
 * Exit 77 (skip) without CUDA or without a device (a probe child decides). */
#include "config.h"
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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
#include "test_gpu_probe.h"
#include "test_model.h"

#define TOL_PER_LAYER 4
#define EPS_BF16 0x1p-8
enum { NSTEP = 25, MAXR = 4 };

static v41_model *M;

/* one run of the script: logits [NSTEP][MAXR][V] (NAN where a request had no row),
 * argmax, the final cache taps */
typedef struct ctap {
    char name[96];
    int layer;
    size_t n;
    float *v;
} ctap;
typedef struct run_out {
    float *logits;
    int32_t am[NSTEP][MAXR];
    ctap taps[256];
    int ntaps;
    long resident;
} run_out;

static int collect(void *ctx, const v41_tap *t)
{
    run_out *r = ctx;
    if (!strstr(t->name, ".cache.") || r->ntaps >= 256) return 0;
    if (t->kind != V41_TAP_F32 && t->kind != V41_TAP_BF16) return 0;
    ctap *c = &r->taps[r->ntaps++];
    snprintf(c->name, sizeof c->name, "%s", t->name);
    c->layer = t->layer;
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    c->n = n;
    c->v = malloc(sizeof(float) * n);
    memcpy(c->v, t->data, sizeof(float) * n);
    return 0;
}

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

static void run_script(v41_engine *e, run_out *r)
{
    const int V = M->cfg.vocab_size;
    v41_err err = {0};
    memset(r, 0, sizeof *r);
    r->logits = malloc(sizeof(float) * NSTEP * MAXR * V);
    for (size_t i = 0; i < (size_t)NSTEP * MAXR * V; i++) r->logits[i] = NAN;
    int len[MAXR] = {0, 0, 0, 0};
    const int plen[3] = {5, 11, 19};
    int nlive = 3;
    int32_t toks[MAXR][64];
    for (int s = 0; s < NSTEP; s++) {
        if (s == 12) { /* rollback of request 2 */
            ck_assert_msg(e->vt->truncate(e, 2, len[2] - 2, &err) == 0, "truncate: %s", err.msg);
            len[2] -= 2;
        }
        if (s == 15) { /* prefix hit: request 3 forks request 0 */
            ck_assert_msg(e->vt->fork(e, 0, 3, len[0] - 1, &err) == 0, "fork: %s", err.msg);
            len[3] = len[0] - 1;
            nlive = 4;
        }
        v41_req rq[MAXR];
        for (int q = 0; q < nlive; q++) {
            int n = s == 0 ? plen[q] : (s == 8 && q == 1 ? 3 : 1);
            for (int i = 0; i < n; i++) toks[q][i] = tok_of(q == 3 ? 0 : q, len[q] + i);
            memset(&rq[q], 0, sizeof rq[q]);
            rq[q].id = q;
            rq[q].start_pos = len[q];
            rq[q].n_tokens = n;
            rq[q].tokens = toks[q];
        }
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
    v41_tap_sink sink = {collect, r, NULL};
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
    for (int i = 0; i < r->ntaps; i++) free(r->taps[i].v);
}

static int nlive_at(int s) { return s >= 15 ? 4 : 3; }

/* b against a: bitwise (tol_scale 0) or within the derived bound */
static void compare(const run_out *a, const run_out *b, int tol_scale, const char *what)
{
    const int V = M->cfg.vocab_size, NL = M->cfg.n_layers;
    int near = 0;
    for (int s = 0; s < NSTEP; s++)
        for (int q = 0; q < nlive_at(s); q++) {
            const float *x = a->logits + ((size_t)s * MAXR + q) * V, *y = b->logits + ((size_t)s * MAXR + q) * V;
            float mx = 0, md = 0;
            int at = 0;
            for (int i = 0; i < V; i++) {
                mx = fmaxf(mx, fabsf(x[i]));
                float dd = fabsf(x[i] - y[i]);
                if (!(dd <= md)) { md = dd; at = i; }
            }
            if (!tol_scale) {
                ck_assert_msg(!memcmp(x, y, sizeof(float) * V), "%s: step %d request %d: logits differ (max %g at %d)",
                              what, s, q, md, at);
                ck_assert_int_eq(a->am[s][q], b->am[s][q]);
                continue;
            }
            const float tol = (float)(TOL_PER_LAYER * NL * EPS_BF16) * mx;
            ck_assert_msg(md <= tol, "%s: step %d request %d: logit %d differs by %g > %g (|max| %g)", what, s, q, at,
                          md, tol, mx);
            if (a->am[s][q] != b->am[s][q]) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int i = 0; i < V; i++) {
                    if (x[i] > b1) { b2 = b1; b1 = x[i]; }
                    else if (x[i] > b2) b2 = x[i];
                }
                ck_assert_msg(b1 - b2 <= 2 * tol, "%s: step %d request %d: greedy token %d vs %d, margin %g > 2 TOL %g",
                              what, s, q, a->am[s][q], b->am[s][q], b1 - b2, 2 * tol);
                printf("%s: step %d request %d: near tie (margin %g <= 2 TOL %g): %d vs %d\n", what, s, q, b1 - b2,
                       2 * tol, a->am[s][q], b->am[s][q]);
                near++;
            }
        }
    ck_assert_int_eq(a->ntaps, b->ntaps);
    ck_assert_msg(a->ntaps >= M->cfg.n_layers, "%s: only %d cache taps", what, a->ntaps);
    for (int i = 0; i < a->ntaps; i++) {
        const ctap *x = &a->taps[i], *y = &b->taps[i];
        ck_assert_str_eq(x->name, y->name);
        ck_assert_uint_eq(x->n, y->n);
        float mx = 0, md = 0;
        size_t at = 0;
        for (size_t k = 0; k < x->n; k++) {
            if (isfinite(x->v[k])) mx = fmaxf(mx, fabsf(x->v[k]));
            float dd = (isinf(x->v[k]) && x->v[k] == y->v[k]) ? 0 : fabsf(x->v[k] - y->v[k]);
            if (!(dd <= md)) { md = dd; at = k; }
        }
        const float tol = tol_scale ? (float)(TOL_PER_LAYER * (x->layer + 1) * EPS_BF16) * mx : 0.0f;
        ck_assert_msg(md <= tol, "%s: %s differs by %g > %g at element %zu (|max| %g)", what, x->name, md, tol, at, mx);
    }
    if (near) printf("%s: %d near ties\n", what, near);
}

static run_out R_ref, R_gpu;
static int have_ref, have_gpu;

static void need_runs(void)
{
    if (!M) M = test_model_load();
    if (!have_ref) {
        v41_engine *e = mk(0, "1", "1");
        run_script(e, &R_ref);
        v41_engine_destroy(e);
        have_ref = 1;
    }
    if (!have_gpu) {
        v41_engine *e = mk(1, "1", "1");
        run_script(e, &R_gpu);
        v41_engine_destroy(e);
        have_gpu = 1;
    }
}

START_TEST(test_resident_ran)
{
    need_runs();
    /* every step but the prefill (0) and the chunk (8) is a decode batch */
    ck_assert_msg(R_gpu.resident == NSTEP - 2, "resident steps %ld, expected %d", R_gpu.resident, NSTEP - 2);
    ck_assert_int_eq(R_ref.resident, 0);
}
END_TEST

START_TEST(test_resident_vs_ref)
{
    need_runs();
    compare(&R_ref, &R_gpu, 1, "resident vs ref");
}
END_TEST

START_TEST(test_resident_vs_hybrid)
{
    need_runs();
    run_out h;
    v41_engine *e = mk(1, "0", "1");
    run_script(e, &h);
    v41_engine_destroy(e);
    ck_assert_int_eq(h.resident, 0);
    compare(&h, &R_gpu, 1, "resident vs hybrid");
    free_run(&h);
}
END_TEST

START_TEST(test_graph_equals_direct)
{
    need_runs();
    run_out d;
    v41_engine *e = mk(1, "1", "0");
    run_script(e, &d);
    v41_engine_destroy(e);
    ck_assert_int_eq(d.resident, NSTEP - 2);
    compare(&d, &R_gpu, 0, "graph vs direct");
    free_run(&d);
}
END_TEST

START_TEST(test_resident_repeat)
{
    need_runs();
    run_out d;
    v41_engine *e = mk(1, "1", "1");
    run_script(e, &d);
    v41_engine_destroy(e);
    compare(&d, &R_gpu, 0, "repeat");
    free_run(&d);
}
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
    tcase_add_test(tc, test_resident_vs_ref);
    tcase_add_test(tc, test_resident_vs_hybrid);
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
