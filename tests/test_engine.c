/* test_engine.c: properties of the ref engine on the oracle's tiny model
 * (V41_ORACLE_DIR; the built-in tiny model when absent):
 *  - bitwise determinism, 1 vs 2 threads;
 *  - batch invariance: a row computed in a 45-row prefill, in a ragged batch with
 *    other requests, in a chunk, or as a 1-row decode step gets the same bits;
 *  - chunked prefill == one-shot; decode at p == prefill to p+1 (bitwise);
 *  - truncate + re-decode and fork reproduce the same bits;
 *  - fp32 vs emulate difference measured (must be non-zero and bounded);
 *  - taps: every emitted name is declared in the tap table, patterns select;
 *  - fault injection changes results, unknown names are errors;
 *  - teacher forcing with the engine's own values is the identity. */
#include "config.h"
#include "v41_engine.h"
#include <check.h>
#include "test_model.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static v41_model *M;
enum { NT = 45, P0 = 37 };
static int32_t toks[NT], toks2[NT];

static void setup_model(void)
{
    if (M) return;
    M = test_model_load();
    uint32_t s = 12345;
    for (int i = 0; i < NT; i++) {
        s = s * 1103515245u + 12345u;
        toks[i] = (int32_t)((s >> 8) % (uint32_t)M->cfg.vocab_size);
        s = s * 1103515245u + 12345u;
        toks2[i] = (int32_t)((s >> 8) % (uint32_t)M->cfg.vocab_size);
    }
}

static v41_engine *mk(v41_precision prec, int threads, const char *inject)
{
    v41_engine_opts o;
    v41_engine_opts_default(&o);
    o.precision = prec;
    o.threads = threads;
    o.inject = inject;
    o.max_seq_len = 64;
    v41_engine *e = NULL;
    v41_err err = {0};
    int rc = v41_ref_engine_create(M, &o, &e, &err);
    ck_assert_msg(rc == 0, "engine: %s", err.msg);
    return e;
}

/* forward one request; copies all rows' logits into out (rows n) */
static void fwd1(v41_engine *e, int id, int start, int n, const int32_t *t, float *out)
{
    v41_req r = {.id = id, .start_pos = start, .n_tokens = n, .tokens = t, .all_logits = true};
    v41_batch b = {1, &r};
    v41_out o;
    v41_err err = {0};
    int rc = v41_engine_forward(e, &b, &o, &err);
    ck_assert_msg(rc == 0, "forward: %s", err.msg);
    if (out) memcpy(out, o.logits, sizeof(float) * (size_t)n * M->cfg.vocab_size);
}

static float *oneshot(v41_precision prec, int threads)
{
    const int V = M->cfg.vocab_size;
    float *P = malloc(sizeof(float) * NT * V);
    v41_engine *e = mk(prec, threads, NULL);
    fwd1(e, 0, 0, NT, toks, P);
    v41_engine_destroy(e);
    return P;
}

START_TEST(test_determinism_threads)
{
    setup_model();
    const int V = M->cfg.vocab_size;
    float *a = oneshot(V41_PREC_EMULATE, 1), *b = oneshot(V41_PREC_EMULATE, 1), *c = oneshot(V41_PREC_EMULATE, 2);
    ck_assert(memcmp(a, b, sizeof(float) * NT * V) == 0);
    ck_assert_msg(memcmp(a, c, sizeof(float) * NT * V) == 0, "1 vs 2 threads differ");
    free(a); free(b); free(c);
}
END_TEST

START_TEST(test_decode_chunk_equal_prefill)
{
    setup_model();
    const int V = M->cfg.vocab_size;
    float *P = oneshot(V41_PREC_EMULATE, 1);
    float *A = malloc(sizeof(float) * NT * V);
    /* prefill 37 + 8 single-token decode steps */
    v41_engine *e = mk(V41_PREC_EMULATE, 1, NULL);
    fwd1(e, 3, 0, P0, toks, A);
    for (int p = P0; p < NT; p++) fwd1(e, 3, p, 1, toks + p, A + (size_t)p * V);
    for (int p = 0; p < NT; p++)
        ck_assert_msg(memcmp(A + (size_t)p * V, P + (size_t)p * V, sizeof(float) * V) == 0, "row %d differs", p);
    /* truncate to 40 and re-decode: same bits (rollback) */
    v41_err err = {0};
    ck_assert_int_eq(e->vt->truncate(e, 3, 40, &err), 0);
    float *R = malloc(sizeof(float) * V);
    for (int p = 40; p < NT; p++) {
        fwd1(e, 3, p, 1, toks + p, R);
        ck_assert_msg(memcmp(R, P + (size_t)p * V, sizeof(float) * V) == 0, "after truncate row %d differs", p);
    }
    /* fork the first 39 positions into request 4 and continue with a chunk */
    ck_assert_int_eq(e->vt->fork(e, 3, 4, 39, &err), 0);
    fwd1(e, 4, 39, NT - 39, toks + 39, A);
    ck_assert(memcmp(A, P + (size_t)39 * V, sizeof(float) * (NT - 39) * V) == 0);
    v41_engine_destroy(e);
    /* chunked prefill: 0..15, 16..36, 37..44 */
    e = mk(V41_PREC_EMULATE, 1, NULL);
    fwd1(e, 1, 0, 16, toks, A);
    fwd1(e, 1, 16, P0 - 16, toks + 16, A + (size_t)16 * V);
    fwd1(e, 1, P0, NT - P0, toks + P0, A + (size_t)P0 * V);
    for (int p = 0; p < NT; p++)
        ck_assert_msg(memcmp(A + (size_t)p * V, P + (size_t)p * V, sizeof(float) * V) == 0, "chunked row %d differs", p);
    v41_engine_destroy(e);
    free(P); free(A); free(R);
}
END_TEST

START_TEST(test_batch_invariance)
{
    setup_model();
    const int V = M->cfg.vocab_size;
    float *P = oneshot(V41_PREC_EMULATE, 1);
    float *Q = malloc(sizeof(float) * 20 * V);
    v41_engine *e = mk(V41_PREC_EMULATE, 1, NULL);
    fwd1(e, 0, 0, 20, toks2, Q);
    v41_engine_destroy(e);
    /* ragged batch: 45 + 20 + 3 rows */
    e = mk(V41_PREC_EMULATE, 2, NULL);
    v41_req r[3] = {{.id = 7, .start_pos = 0, .n_tokens = NT, .tokens = toks, .all_logits = true},
                    {.id = 8, .start_pos = 0, .n_tokens = 20, .tokens = toks2, .all_logits = true},
                    {.id = 9, .start_pos = 0, .n_tokens = 3, .tokens = toks2 + 5, .all_logits = false}};
    v41_batch b = {3, r};
    v41_out o;
    v41_err err = {0};
    ck_assert_msg(v41_engine_forward(e, &b, &o, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(o.row_offset[1], NT);
    ck_assert_int_eq(o.row_offset[2], NT + 20);
    ck_assert_int_eq(o.row_offset[3], NT + 21);
    ck_assert(memcmp(o.logits, P, sizeof(float) * NT * V) == 0);
    ck_assert(memcmp(o.logits + (size_t)NT * V, Q, sizeof(float) * 20 * V) == 0);
    /* decode of two requests in one batch == alone */
    int32_t t1 = toks[10], t2 = toks2[20];
    v41_req d[2] = {{.id = 8, .start_pos = 20, .n_tokens = 1, .tokens = &t2}, {.id = 9, .start_pos = 3, .n_tokens = 1, .tokens = &t1}};
    v41_batch bd = {2, d};
    ck_assert(v41_engine_forward(e, &bd, &o, &err) == 0);
    float *x8 = malloc(sizeof(float) * V);
    memcpy(x8, o.logits, sizeof(float) * V);
    v41_engine_destroy(e);
    e = mk(V41_PREC_EMULATE, 1, NULL);
    fwd1(e, 8, 0, 20, toks2, NULL);
    float *y8 = malloc(sizeof(float) * V);
    fwd1(e, 8, 20, 1, &t2, y8);
    ck_assert(memcmp(x8, y8, sizeof(float) * V) == 0);
    v41_engine_destroy(e);
    free(P); free(Q); free(x8); free(y8);
}
END_TEST

START_TEST(test_fp32_vs_emulate)
{
    setup_model();
    const int V = M->cfg.vocab_size;
    float *a = oneshot(V41_PREC_EMULATE, 1), *b = oneshot(V41_PREC_FP32, 1);
    double mx = 0, gm = 0, dot = 0, na = 0, nb = 0;
    for (int i = 0; i < NT * V; i++) {
        mx = fmax(mx, fabs(a[i] - b[i]));
        gm = fmax(gm, fabs(b[i]));
        dot += (double)a[i] * b[i];
        na += (double)a[i] * a[i];
        nb += (double)b[i] * b[i];
    }
    double cs = dot / sqrt(na * nb);
    printf("fp32 vs emulate logits: max |diff| %.4g (max |fp32| %.4g), cosine %.6f\n", mx, gm, cs);
    /* quantization must show (fp8/fp4 activations differ from fp32) but not dominate */
    ck_assert(mx > 0);
    ck_assert(cs > 0.9);
    free(a); free(b);
}
END_TEST

typedef struct { int n, bad, first_dim_bad; int T; char badname[128]; } tapck;
static int tap_cb(void *ctx, const v41_tap *t)
{
    tapck *c = ctx;
    c->n++;
    if (!v41_tap_lookup(t->name)) { c->bad++; snprintf(c->badname, sizeof c->badname, "%s", t->name); }
    return 0;
}

START_TEST(test_taps)
{
    setup_model();
    v41_engine *e = mk(V41_PREC_EMULATE, 1, NULL);
    tapck c = {0};
    v41_tap_sink s = {tap_cb, &c, NULL};
    v41_engine_set_sink(e, &s);
    fwd1(e, 0, 0, P0, toks, NULL);
    int32_t ids[16];
    float conf[16];
    v41_err err = {0};
    if (M->cfg.dspark_block_size > 0 && M->cfg.n_mtp_layers > 0)
        ck_assert_msg(e->vt->dspark_draft(e, 0, P0 - 1, toks[P0], ids, conf, &err) == 0, "%s", err.msg);
    ck_assert_msg(c.bad == 0, "undeclared tap %s", c.badname);
    ck_assert(c.n > 100);
    int all = c.n;
    memset(&c, 0, sizeof c);
    s.pattern = "layer.1.attn.*,logits";
    fwd1(e, 0, P0, 1, toks + P0, NULL);
    ck_assert(c.n > 3 && c.n < all / 10);
    v41_engine_destroy(e);
    /* declared names are unique */
    size_t n;
    const v41_tap_desc *d = v41_tap_table(&n);
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++) ck_assert_msg(strcmp(d[i].pattern, d[j].pattern), "%s twice", d[i].pattern);
    ck_assert(v41_tap_lookup("dspark.1.attn.q") != NULL);
    ck_assert(v41_tap_match("layer.*.attn.q,x", "layer.12.attn.q"));
    ck_assert(!v41_tap_match("layer.?.attn.q", "layer.12.attn.q"));
}
END_TEST

START_TEST(test_inject)
{
    setup_model();
    const int V = M->cfg.vocab_size;
    float *P = oneshot(V41_PREC_EMULATE, 1), *Q = malloc(sizeof(float) * NT * V);
    const char *faults[] = {"sink-dropped", "rope-not-interleaved", "sinkhorn-rows-last", "indexer-relu-dropped",
                            "router-bias-in-weights", "compressed-visible-one-group-early", "sink-dropped@3"};
    for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) {
        v41_engine *e = mk(V41_PREC_EMULATE, 1, faults[i]);
        fwd1(e, 0, 0, NT, toks, Q);
        ck_assert_msg(memcmp(P, Q, sizeof(float) * NT * V) != 0, "%s changed nothing", faults[i]);
        v41_engine_destroy(e);
    }
    v41_engine_opts o;
    v41_engine_opts_default(&o);
    o.inject = "no-such-fault";
    v41_engine *e = NULL;
    v41_err err = {0};
    ck_assert_int_ne(v41_ref_engine_create(M, &o, &e, &err), 0);
    ck_assert(strstr(err.msg, "no-such-fault") != NULL);
    free(P); free(Q);
}
END_TEST

/* forcing source: records the engine's own values on the first run, replays them */
typedef struct { float *buf; int64_t n; int mode; int calls; } frc;
static int fetch_cb(void *ctx, const char *name, int step, v41_tap_kind kind, int ndim, const int64_t *shape, void *dst)
{
    frc *f = ctx;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    f->calls++;
    if (f->mode == 0) { f->buf = malloc(sizeof(float) * n); f->n = n; memcpy(f->buf, dst, sizeof(float) * n); return 0; }
    if (f->mode == 1) { memcpy(dst, f->buf, sizeof(float) * n); return 1; }
    memset(dst, 0, sizeof(float) * n);
    ((float *)dst)[0] = 1.0f;
    return 1;
}

START_TEST(test_force)
{
    setup_model();
    const int V = M->cfg.vocab_size;
    float *P = oneshot(V41_PREC_EMULATE, 1), *Q = malloc(sizeof(float) * NT * V);
    frc f = {0};
    v41_tap_source src = {fetch_cb, &f, "layer.3.stream.mid"};
    for (int mode = 0; mode < 3; mode++) {
        f.mode = mode;
        v41_engine *e = mk(V41_PREC_EMULATE, 1, NULL);
        e->force = &src;
        fwd1(e, 0, 0, NT, toks, Q);
        v41_engine_destroy(e);
        if (mode < 2) ck_assert_msg(memcmp(P, Q, sizeof(float) * NT * V) == 0, "mode %d", mode);
        else ck_assert(memcmp(P, Q, sizeof(float) * NT * V) != 0);
    }
    ck_assert_int_eq(f.calls, 3);
    free(f.buf); free(P); free(Q);
}
END_TEST

START_TEST(test_dspark_batch)
{
    setup_model();
    const int B = M->cfg.dspark_block_size;
    if (B <= 0 || M->cfg.n_mtp_layers <= 0) return;
    v41_engine *e = mk(V41_PREC_EMULATE, 1, NULL);
    fwd1(e, 0, 0, P0, toks, NULL);
    fwd1(e, 1, 0, 20, toks2, NULL);
    int ids[2] = {0, 1}, ps[2] = {P0 - 1, 19};
    int32_t first[2] = {toks[P0], toks2[20]}, out2[2 * 17], out1[17];
    float c2[32], c1[16];
    v41_err err = {0};
    ck_assert_msg(e->vt->dspark_draft_batch(e, 2, ids, ps, first, out2, c2, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(out2[0], first[0]);
    ck_assert(e->vt->dspark_draft_batch(e, 1, ids + 1, ps + 1, first + 1, out1, c1, &err) == 0);
    ck_assert(memcmp(out1, out2 + (B + 1), sizeof(int32_t) * (B + 1)) == 0);
    ck_assert(memcmp(c1, c2 + B, sizeof(float) * B) == 0);
    v41_engine_destroy(e);
    /* padded DSpark lists (width a multiple of 16): padding has zero weight, same bits;
     * the injected bug (padding counted in the denominator) changes them */
    for (int bug = 0; bug < 2; bug++) {
        v41_engine_opts o;
        v41_engine_opts_default(&o);
        o.max_seq_len = 64;
        o.dspark_align = 16;
        o.inject = bug ? "dspark-padding-counted" : NULL;
        ck_assert(v41_ref_engine_create(M, &o, &e, &err) == 0);
        fwd1(e, 1, 0, 20, toks2, NULL);
        int32_t outp[17];
        float cp[16];
        ck_assert(e->vt->dspark_draft_batch(e, 1, ids + 1, ps + 1, first + 1, outp, cp, &err) == 0);
        if (!bug) ck_assert(memcmp(cp, c1, sizeof(float) * B) == 0);
        else ck_assert(memcmp(cp, c1, sizeof(float) * B) != 0);
        v41_engine_destroy(e);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("engine");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_determinism_threads);
    tcase_add_test(tc, test_decode_chunk_equal_prefill);
    tcase_add_test(tc, test_batch_invariance);
    tcase_add_test(tc, test_fp32_vs_emulate);
    tcase_add_test(tc, test_taps);
    tcase_add_test(tc, test_inject);
    tcase_add_test(tc, test_force);
    tcase_add_test(tc, test_dspark_batch);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
