/* test_serving_ref.c: serving semantics of the ref engine (SPEC §7, §8) on the
 * tiny model (W = 8, cut = last kv source):
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
 *  - the replay faults change results only where replay applies. */
#include "config.h"
#include "v41_engine.h"
#include "v41_ops.h"
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static v41_model *M;
static int V, W, NL, CUT, BS;
enum { NP = 40 };
static int32_t P[NP], Q[NP];

static void setup_model(void)
{
    if (M) return;
    v41_err err = {0};
    const char *dir = getenv("V41_ORACLE_DIR");
    char p[4096];
    FILE *f = NULL;
    if (dir) {
        snprintf(p, sizeof p, "%s/config.json", dir);
        f = fopen(p, "r");
    }
    if (f) fclose(f);
    ck_assert_msg(v41_model_load(f ? dir : "tiny", &M, &err) == 0, "model: %s", err.msg);
    V = M->cfg.vocab_size;
    W = M->cfg.window_size;
    NL = M->cfg.n_layers;
    CUT = v41_last_kv_source(&M->cfg);
    BS = M->cfg.dspark_block_size;
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
    ck_assert_msg(v41_ref_engine_create(M, &o, &e, &err) == 0, "engine: %s", err.msg);
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
    for (size_t i = 0; i < rb; i++) if (p[i]) return false;
    return true;
}
static bool row_eq(const rec_tap *a, const rec_tap *b, int row)
{
    size_t rb = a->nb / (size_t)a->shape[0];
    return a->nb == b->nb && !memcmp((const char *)a->data + rb * row, (const char *)b->data + rb * row, rb);
}

/* ------------------------------------------------------------------ replay off == plain */
START_TEST(test_replay_off_plain)
{
    setup_model();
    const int L = 30;
    v41_engine *a = mk(false, NULL), *b = mk(false, NULL), *c = mk(true, NULL);
    float *one = fw(a, rq(1, 0, L, P), NULL);
    /* chunked prefill with replay off == one-shot */
    float *c1 = fw(b, rq(1, 0, 11, P), NULL);
    float *c2 = fw(b, rq(1, 11, 12, P + 11), NULL);
    float *c3 = fw(b, rq(1, 23, L - 23, P + 23), NULL);
    ck_assert_msg(!memcmp(one, c3, sizeof(float) * V), "chunked prefill (replay off) != one-shot");
    /* replay on but prompt logprobs asked for: never trimmed, the same full prefill */
    v41_req r = rq(1, 0, L, P);
    r.prompt_logprobs = true;
    float *pl = fw(c, r, NULL);
    ck_assert_msg(!memcmp(one, pl, sizeof(float) * V), "prompt_logprobs request trimmed");
    /* and decode after both: same bits */
    int32_t t = amax(one);
    float *da = fw(a, rq(1, L, 1, &t), NULL), *db = fw(b, rq(1, L, 1, &t), NULL);
    ck_assert(!memcmp(da, db, sizeof(float) * V));
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
    /* ragged batch of W-row and shorter prompts, then a decode step */
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
            for (size_t k = 0; k < rb.t[i].nb; k++) ck_assert(((uint8_t *)rb.t[i].data)[k] == 1);
            continue;
        }
        ck_assert_int_lt(j, ra.n);
        ck_assert_str_eq(ra.t[j].name, rb.t[i].name);
        ck_assert_msg(ra.t[j].nb == rb.t[i].nb && !memcmp(ra.t[j].data, rb.t[i].data, ra.t[j].nb), "tap %s differs",
                      ra.t[j].name);
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
    ck_assert_msg(differ, "trimming changed nothing for a prompt of %d > W rows", L);
    const rec_tap *k = rec_find(&rb, "replay.kept", 0);
    ck_assert(k && k->shape[0] == L);
    for (int t = 0; t < L; t++) ck_assert_int_eq(((uint8_t *)k->data)[t], t >= L - W);
    char nm[96];
    for (int l = 0; l < NL; l++) {
        /* before the cut's query: identical to replay off, every row */
        snprintf(nm, sizeof nm, "layer.%d.stream.in", l);
        const rec_tap *x = rec_find(&rb, nm, 0), *y = rec_find(&ra, nm, 0);
        ck_assert(x && y && x->shape[0] == L);
        for (int t = 0; t < L; t++) {
            if (l <= CUT) ck_assert_msg(row_eq(x, y, t), "%s row %d changed", nm, t);
            else if (t < L - W) ck_assert_msg(row_zero(x, t), "%s trimmed row %d not zero", nm, t);
            else ck_assert_msg(!row_zero(x, t), "%s kept row %d zero", nm, t);
        }
    }
    /* the cut's KV side ran on all rows, its queries on the kept rows only */
    snprintf(nm, sizeof nm, "layer.%d.attn.window_kv", CUT);
    const rec_tap *kv = rec_find(&rb, nm, 0), *kv0 = rec_find(&ra, nm, 0);
    ck_assert(kv && kv0 && kv->nb == kv0->nb && !memcmp(kv->data, kv0->data, kv->nb));
    snprintf(nm, sizeof nm, "layer.%d.attn.q", CUT);
    const rec_tap *q = rec_find(&rb, nm, 0);
    ck_assert(q && row_zero(q, 0) && row_zero(q, L - W - 1) && !row_zero(q, L - W));
    /* DSpark context KV of the kept rows only: main_x rows of trimmed rows are zero */
    const rec_tap *mx = rec_find(&rb, "dspark.main_x", 0);
    if (mx) { ck_assert(row_zero(mx, 0) && !row_zero(mx, L - 1)); }
    /* decode after a trimmed prefill */
    int32_t t = amax(lb);
    float *d = fw(b, rq(1, L, 1, &t), NULL);
    for (int i = 0; i < V; i++) ck_assert(isfinite(d[i]));
    /* the replay faults act only where replay applies */
    const char *faults[] = {"swa-not-floored", "replay-rows-misaligned"};
    for (int f = 0; f < 2; f++) {
        v41_engine *e = mk(true, faults[f]), *e0 = mk(false, faults[f]);
        float *x = fw(e, rq(1, 0, L, P), NULL), *x0 = fw(e0, rq(1, 0, L, P), NULL);
        ck_assert_msg(memcmp(x, lb, sizeof(float) * V) != 0, "%s changed nothing", faults[f]);
        ck_assert_msg(!memcmp(x0, la, sizeof(float) * V), "%s changed replay-off results", faults[f]);
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
     * replay from H - W. cold: request 12 computes P[0:H) itself, then the same replay. */
    v41_err err = {0};
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
    ck_assert_msg(!memcmp(hit, cold, sizeof(float) * V), "H=%d: prefix hit with replay != cold with floor H-W", H);
    int32_t t = amax(hit);
    float *d1 = fw(e, rq(11, L, 1, &t), NULL), *d2 = fw(c, rq(12, L, 1, &t), NULL);
    ck_assert_msg(!memcmp(d1, d2, sizeof(float) * V), "H=%d: next decode step differs", H);
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
    /* together (2 threads: the split never changes a row's bits) */
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
    float *tog = malloc(sizeof(float) * (size_t)nrow * V);
    memcpy(tog, o.logits, sizeof(float) * (size_t)nrow * V);
    /* alone */
    v41_engine *s = mk(true, NULL);
    mixed_setup(s);
    for (int q = 0; q < 4; q++) {
        int n;
        float *x = fw(s, r[q], &n);
        ck_assert_int_eq(n, o.row_offset[q + 1] - o.row_offset[q]);
        ck_assert_msg(!memcmp(x, tog + (size_t)o.row_offset[q] * V, sizeof(float) * (size_t)n * V),
                      "request %d: batched != alone", r[q].id);
        free(x);
    }
    /* the next step of every request (caches written identically) */
    int32_t nx[4] = {3, 4, 5, 6};
    v41_req d[4] = {rq(1, 20, 1, nx), rq(2, 26, 1, nx + 1), rq(3, 13, 1, nx + 2), rq(4, 15 + BS + 1, 1, nx + 3)};
    b.req = d;
    ck_assert(v41_engine_forward(a, &b, &o, &err) == 0);
    memcpy(tog, o.logits, sizeof(float) * 4 * V);
    ck_assert(v41_engine_forward(s, &b, &o, &err) == 0);
    ck_assert(!memcmp(tog, o.logits, sizeof(float) * 4 * V));
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
    /* B: draft, verify as one multi-token step, accept greedily, roll back the rest */
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
    ck_assert_msg(rejected > 0, "no rejection exercised");
    ck_assert_msg(!memcmp(ga, gb, sizeof(int32_t) * GEN), "speculation changed the greedy output");
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
    ck_assert_msg(!memcmp(xa, xb, sizeof(float) * V), "logits after rollback differ");
    int cmp = 0;
    for (int i = 0; i < ra.n; i++) {
        if (!cache_tap(ra.t[i].name)) continue;
        const rec_tap *y = rec_find(&rb, ra.t[i].name, rb.n ? rb.t[0].step : 0);
        ck_assert_msg(y && y->nb == ra.t[i].nb && !memcmp(y->data, ra.t[i].data, y->nb), "cache %s differs", ra.t[i].name);
        cmp++;
    }
    ck_assert_int_gt(cmp, NL);
    /* and the next draft (DSpark stage rings rolled back) */
    int32_t ia[16], ib[16], p = LA, id = 1, f0 = amax(xa);
    float ca[16], cb[16];
    ck_assert(a->vt->dspark_draft_batch(a, 1, &id, &p, &f0, ia, ca, &err) == 0);
    ck_assert(b->vt->dspark_draft_batch(b, 1, &id, &p, &f0, ib, cb, &err) == 0);
    ck_assert(!memcmp(ia, ib, sizeof(int32_t) * (BS + 1)) && !memcmp(ca, cb, sizeof(float) * BS));
    free(xa); free(xb);
    rec_free(&ra); rec_free(&rb);
    v41_engine_destroy(a); v41_engine_destroy(b);
}
END_TEST

/* ------------------------------------------------------------------ DSpark padding (op level) */
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

int main(void)
{
    Suite *s = suite_create("serving");
    TCase *tc = tcase_create("serving");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_dspark_padding_op);
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
