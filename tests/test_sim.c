/* test_sim.c: Check suite of the serving simulator (sim/, README.md, section 'Simulator').
 * Every expected value below is derived independently of the code under
 * test: by hand from a hand-made trace, from SPEC §4-§7 written as naive
 * per-row loops, or from a conservation law. */
#include "v41_sim.h"
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[256];

/* The build tree: $V41_BUILDDIR, else the nearest parent of this executable holding harness/v41
 * (the serial test driver does not export AM_TESTS_ENVIRONMENT). */
static const char *builddir(void)
{
    static char dir[1024];
    const char *e = getenv("V41_BUILDDIR");
    if (e && *e) return e;
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n <= 0) return NULL;
    dir[n] = 0;
    for (char *s; (s = strrchr(dir, '/')) && s != dir;) {
        *s = 0;
        char p[1100];
        snprintf(p, sizeof p, "%s/harness/v41", dir);
        if (access(p, X_OK) == 0) return dir;
    }
    return NULL;
}

static void mk_tmp(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/v41_test_sim_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static const char *write_file(const char *name, const char *text)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* collects per-request outputs */
#define MAXR 4096
typedef struct coll {
    int n;
    v41_sim_req_out r[MAXR];
    int seen[MAXR];
} coll;
static int on_req(void *ud, const v41_sim_req_out *r)
{
    coll *c = ud;
    if (r->id >= 0 && r->id < MAXR) c->seen[r->id]++;
    if (c->n < MAXR) c->r[c->n++] = *r;
    return 0;
}

static void tiny_opts(v41_sim_opts *o)
{
    v41_sim_opts_default(o);
    v41_config_tiny(&o->cfg);
    snprintf(o->model_name, sizeof o->model_name, "tiny");
    o->hw.gpus = 1;
}

static int run_trace(v41_sim_opts *o, const char *path, coll *c, v41_sim_result *res)
{
    v41_err err = {0};
    v41_trace *t;
    int rc = v41_trace_open(path, "auto", false, &t, &err);
    ck_assert_msg(rc == 0, "%s", err.msg);
    memset(c, 0, sizeof *c);
    v41_sim_sinks s = {c, on_req, NULL};
    rc = v41_sim_run(o, t, &s, res, &err);
    ck_assert_msg(rc == 0, "%s", err.msg);
    v41_trace_close(t);
    return rc;
}

static const v41_sim_req_out *by_id(const coll *c, int64_t id)
{
    for (int i = 0; i < c->n; i++)
        if (c->r[i].id == id) return &c->r[i];
    ck_abort_msg("request %lld not reported", (long long)id);
    return NULL;
}

/* ------------------------------------------------------------------ conservation */

START_TEST(test_conservation)
{
    /* A loaded synthetic workload (queueing, prefix groups, DSpark, 3 replicas), then the same
     * with a KV capacity too small for the largest requests (some are rejected): every request
     * is reported exactly once, finished + rejected = requests, output tokens add up. */
    static v41_sim_result res;
    static coll c;
    for (int pass = 0; pass < 2; pass++) {
        v41_sim_opts o;
        tiny_opts(&o);
        o.replicas = 3;
        o.router = pass ? V41_ROUTE_RR : V41_ROUTE_LEAST;
        o.draft_len = 3;
        o.accept.kind = V41_ACC_GEOM;
        o.accept.p = 0.6;
        o.token_budget = 512;
        o.max_seqs = 16;
        o.block_tokens = 64;
        v41_kv_bytes kb;
        v41_cost_model *m;
        v41_err err;
        ck_assert_int_eq(v41_cost_create(&o.cfg, &o.hw, NULL, &m, &err), 0);
        v41_cost_kv_bytes(m, &kb);
        v41_cost_destroy(m);
        /* pass 1: room for ~3000 tokens of compressed+index KV: requests above that are rejected */
        if (pass) o.kv_capacity = 3000 * (kb.comp_tok + kb.index_tok) + 8 * kb.window_row + kb.state_req;
        v41_trace *t;
        ck_assert_int_eq(v41_trace_open_synth("n=600,rate=400,arrival=gamma,cv=2,in=lognormal:1500:1,out=exp:40,"
                                              "groups=4,prefix=256,block=64,seed=7", &t, &err), 0);
        memset(&c, 0, sizeof c);
        v41_sim_sinks s = {&c, on_req, NULL};
        ck_assert_int_eq(v41_sim_run(&o, t, &s, &res, &err), 0);
        v41_trace_close(t);
        ck_assert_int_eq(res.n_requests, 600);
        ck_assert_int_eq(c.n, 600);
        for (int i = 0; i < 600; i++) ck_assert_int_eq(c.seen[i], 1);
        ck_assert_int_eq(res.n_finished + res.n_rejected, 600);
        int64_t out = 0, fin = 0;
        for (int i = 0; i < c.n; i++)
            if (c.r[i].status == 0) {
                out += c.r[i].out_len;
                fin++;
                ck_assert(c.r[i].t_first >= c.r[i].t_arrive && c.r[i].t_finish >= c.r[i].t_first);
            }
        ck_assert_int_eq(fin, res.n_finished);
        ck_assert_int_eq(out, res.out_tokens);
        if (pass == 0) ck_assert_int_eq(res.n_rejected, 0);
        else ck_assert_int_gt(res.n_rejected, 0);
        ck_assert_int_gt(res.accepted, 0);
    }
}
END_TEST

/* ------------------------------------------------------------------ analytic latency */

START_TEST(test_single_request_latency)
{
    /* One request alone: TTFT is exactly the sum of its prefill chunks' step costs, every later
     * step is one decode row, so E2E - TTFT is the sum of the decode steps' costs. */
    mk_tmp();
    const char *p = write_file("one.jsonl", "{\"timestamp\": 0, \"input_length\": 3000, \"output_length\": 5, \"hash_ids\": []}\n");
    v41_sim_opts o;
    tiny_opts(&o);
    o.token_budget = 1024;
    static coll c;
    static v41_sim_result res;
    run_trace(&o, p, &c, &res);
    ck_assert_int_eq(c.n, 1);
    v41_cost_model *m;
    v41_err err;
    ck_assert_int_eq(v41_cost_create(&o.cfg, &o.hw, NULL, &m, &err), 0);
    double ttft = 0, dec = 0;
    for (int64_t a = 0; a < 3000; a += 1024) {
        int64_t b = a + 1024 < 3000 ? a + 1024 : 3000;
        v41_sim_item it = {V41_ITEM_PREFILL, a, b, 0, 0, true, b == 3000};
        v41_step_cost sc;
        v41_cost_step(m, &it, 1, 0, &sc);
        ttft += sc.time_s;
    }
    for (int64_t pos = 3000; pos < 3004; pos++) {
        v41_sim_item it = {V41_ITEM_DECODE, pos, pos + 1, 0, 0, false, true};
        v41_step_cost sc;
        v41_cost_step(m, &it, 1, 0, &sc);
        dec += sc.time_s;
    }
    v41_cost_destroy(m);
    /* same additions in the same order: equal up to the rounding of t_arrive = 0 + sums (1 ulp) */
    ck_assert_double_eq_tol(c.r[0].ttft, ttft, 1e-15 * ttft * 8);
    ck_assert_double_eq_tol(c.r[0].e2e - c.r[0].ttft, dec, 1e-12 * (ttft + dec));
    ck_assert_double_eq_tol(c.r[0].tpot, dec / 4, 1e-12 * (ttft + dec));
    ck_assert_int_eq(c.r[0].computed_rows, 3000);
    ck_assert_int_eq(res.steps, 3 + 4);
}
END_TEST

/* ------------------------------------------------------------------ replay FLOPs */

/* FLOPs of one row of backbone layer l, written from SPEC §3-§8 shapes (query part: from the
 * attention query on; pre part: mHC mixes, Engram and window K). */
static double row_pre(const v41_config *c, int l)
{
    double D = c->dim, h = c->hc_mult;
    double f = 2 * h * D * (2 + h) * h + 2 * D * c->head_dim;
    for (int i = 0; i < c->n_engram_layers; i++)
        if (c->engram_layer_ids[i] == l)
            f += 2.0 * (c->engram_max_ngram_size - 1) * c->engram_n_heads * c->engram_head_dim * (h + 1) * D;
    return f;
}
static bool listed(const int *v, int n, int x)
{
    for (int i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}
static double row_query(const v41_config *c, int l, int64_t t, int64_t floor)
{
    double D = c->dim, h = c->hc_mult, H = c->n_heads, d = c->head_dim, I = c->moe_inter_dim;
    int64_t W = c->window_size, m = c->compress_ratios[l];
    int64_t wk = t - floor + 1 < W ? t - floor + 1 : W;
    int64_t vis = m > 0 ? (t + 1) / m : 0;
    int64_t ck = vis < c->index_topk ? vis : c->index_topk;
    double f = 2 * D * c->q_lora_rank + 2.0 * c->q_lora_rank * H * d;
    if (m > 0 && listed(c->index_source_layers, c->n_index_sources, l)) {
        int64_t C = (int64_t)c->candidate_topk_blocks * c->candidate_block_size;
        int64_t scored = c->candidate_source_layer >= 0 && l > c->candidate_source_layer && vis > C ? C : vis;
        f += 2.0 * c->q_lora_rank * c->index_n_heads * c->index_head_dim + 2 * D * c->index_n_heads +
             2.0 * c->index_n_heads * c->index_head_dim * (double)scored;
    }
    f += 4 * H * d * (double)(wk + ck);
    f += 2 * H * d * c->o_lora_rank + 2.0 * c->o_groups * c->o_lora_rank * D;
    f += 2 * h * D * (2 + h) * h + 2 * D * c->n_routed_experts;
    f += 2.0 * c->n_activated_experts * 3 * D * I + c->n_shared_experts * (2 * D * 2 * I + 2 * I * D);
    return f;
}

START_TEST(test_replay_trim_flops)
{
    /* Decoder-side replay (SPEC §7): from the cut layer's query on, only the last W rows of a
     * prefill run, floored at end-W. The FLOP difference on vs off must equal the naive sum
     * over the rows/layers that are skipped (and the changed key counts of the kept rows). */
    v41_config cfg;
    v41_config_tiny(&cfg);
    v41_hw hw;
    v41_hw_h200(&hw);
    hw.gpus = 1;
    v41_cost_model *m;
    v41_err err;
    ck_assert_int_eq(v41_cost_create(&cfg, &hw, NULL, &m, &err), 0);
    int cut = -1;
    for (int i = 0; i < cfg.n_kv_sources; i++) cut = cfg.kv_source_layers[i] > cut ? cfg.kv_source_layers[i] : cut;
    const int64_t W = cfg.window_size;
    const int64_t cases[][2] = {{0, 50}, {0, 300}, {16, 90}, {0, 5}};  /* [start, end) of a chunk */
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int64_t a = cases[k][0], b = cases[k][1];
        v41_sim_item on = {V41_ITEM_PREFILL, a, b, 0, 0, true, true}, off = on;
        off.trim = false;
        v41_step_cost con, coff;
        v41_cost_step(m, &on, 1, 0, &con);
        v41_cost_step(m, &off, 1, 0, &coff);
        double naive = 0;
        if (b - a > W) {
            int64_t ka = b - W;
            for (int l = cut; l < cfg.n_layers; l++) {
                for (int64_t t = a; t < b; t++) naive += row_query(&cfg, l, t, 0);
                for (int64_t t = ka; t < b; t++) naive -= row_query(&cfg, l, t, ka);
                if (l > cut) naive += (double)(ka - a) * row_pre(&cfg, l);
            }
        }
        double diff = coff.flops - con.flops;
        /* integer-valued FLOP counts far below 2^53: exact up to summation order */
        ck_assert_msg(fabs(diff - naive) <= 1e-12 * coff.flops, "case %zu: on/off diff %.17g, naive %.17g", k, diff,
                      naive);
        ck_assert_double_eq_tol(con.trimmed_flops, naive, 1e-12 * coff.flops);
        int64_t layer_rows = b - a > W ? (cfg.n_layers - cut) * (b - a - W) : 0;
        ck_assert_int_eq(con.trimmed_layer_rows, layer_rows);
        if (b - a <= W) ck_assert(diff == 0);
    }
    v41_cost_destroy(m);

    /* the same through the simulator: one request, replay on vs off */
    mk_tmp();
    const char *p = write_file("r.jsonl", "{\"timestamp\": 0, \"input_length\": 300, \"output_length\": 3}\n");
    static coll c;
    static v41_sim_result ron, roff;
    v41_sim_opts o;
    tiny_opts(&o);
    run_trace(&o, p, &c, &ron);
    ck_assert_int_eq(c.r[0].trimmed_rows, 300 - W);
    o.replay_enc = o.replay_dec = false;
    run_trace(&o, p, &c, &roff);
    ck_assert_double_eq_tol(roff.flops - ron.flops, ron.trimmed_flops, 1e-12 * roff.flops);
    ck_assert(ron.trimmed_flops > 0);
}
END_TEST

/* ------------------------------------------------------------------ prefix cache */

START_TEST(test_cache_hits)
{
    /* Hand-made hash_ids, 16-token blocks, tiny model (W = 8, ratios 1 and 2, so hits are
     * rounded down to even lengths). Requests are 10 s apart so each finishes before the next. */
    mk_tmp();
    const char *p = write_file("h.jsonl",
        "{\"timestamp\": 0,     \"input_length\": 64, \"output_length\": 2, \"hash_ids\": [1, 2, 3, 4]}\n"
        "{\"timestamp\": 10000, \"input_length\": 64, \"output_length\": 2, \"hash_ids\": [1, 2, 9, 10]}\n"
        "{\"timestamp\": 20000, \"input_length\": 40, \"output_length\": 2, \"hash_ids\": [1, 2, 3]}\n"
        "{\"timestamp\": 30000, \"input_length\": 20, \"output_length\": 2, \"hash_ids\": [5, 6]}\n"
        "{\"timestamp\": 40000, \"input_length\": 17, \"output_length\": 2, \"hash_ids\": [1, 2]}\n"
        "{\"timestamp\": 50000, \"input_length\": 16, \"output_length\": 2, \"hash_ids\": [1]}\n");
    v41_sim_opts o;
    tiny_opts(&o);
    o.block_tokens = 16;
    static coll c;
    static v41_sim_result res;
    /* replay on: hit H > W replays rows [H-W, H) */
    const int64_t hit_on[] = {0, 32, 32, 0, 16, 14}, rows_on[] = {64, 40, 16, 20, 9, 10};
    run_trace(&o, p, &c, &res);
    for (int i = 0; i < 6; i++) {
        const v41_sim_req_out *r = by_id(&c, i);
        ck_assert_int_eq(r->hit_tokens, hit_on[i]);
        ck_assert_int_eq(r->computed_rows, rows_on[i]);
        ck_assert_int_eq(r->replay_rows, hit_on[i] ? 8 : 0);
    }
    ck_assert_int_eq(res.cache_lookups_blocks, 4 + 4 + 2 + 1 + 1 + 1);
    ck_assert_int_eq(res.cache_hit_blocks, 2 + 2 + 0 + 1 + 1);
    ck_assert_int_eq(res.hit_tokens, 32 + 32 + 16 + 14);
    /* replay off: the cache holds window KV too, the whole hit is used */
    o.replay_enc = o.replay_dec = false;
    const int64_t rows_off[] = {64, 32, 8, 20, 1, 2};
    run_trace(&o, p, &c, &res);
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(by_id(&c, i)->hit_tokens, hit_on[i]);
        ck_assert_int_eq(by_id(&c, i)->computed_rows, rows_off[i]);
    }

    /* hits <= W are not used under replay (4-token blocks: a 2-block hit is 8 = W tokens) */
    p = write_file("w.jsonl", "{\"timestamp\": 0, \"input_length\": 20, \"output_length\": 2, \"hash_ids\": [1,2,3,4,5]}\n"
                              "{\"timestamp\": 10000, \"input_length\": 20, \"output_length\": 2, \"hash_ids\": [1,2,7,8,9]}\n");
    o.block_tokens = 4;
    o.replay_enc = o.replay_dec = true;
    run_trace(&o, p, &c, &res);
    ck_assert_int_eq(by_id(&c, 1)->hit_tokens, 0);
    ck_assert_int_eq(by_id(&c, 1)->computed_rows, 20);
    ck_assert_int_eq(res.cache_hit_blocks, 0);
    o.replay_enc = o.replay_dec = false;
    run_trace(&o, p, &c, &res);
    ck_assert_int_eq(by_id(&c, 1)->hit_tokens, 8);
    ck_assert_int_eq(by_id(&c, 1)->computed_rows, 12);
}
END_TEST

START_TEST(test_cache_lru_eviction)
{
    /* Capacity = one request's private KV + 3.5 blocks. r0 caches blocks 1-4; r1 must evict one
     * (the least recently used: block 1, so the chain 1,2,3,4 is broken) and caches 11-14; r2
     * (1,2,3,4 again) finds no chain start and evicts 4 more. With ample capacity r2 hits. */
    mk_tmp();
    const char *p = write_file("e.jsonl",
        "{\"timestamp\": 0,     \"input_length\": 64, \"output_length\": 1, \"hash_ids\": [1, 2, 3, 4]}\n"
        "{\"timestamp\": 10000, \"input_length\": 64, \"output_length\": 1, \"hash_ids\": [11, 12, 13, 14]}\n"
        "{\"timestamp\": 20000, \"input_length\": 64, \"output_length\": 1, \"hash_ids\": [1, 2, 3, 4]}\n");
    v41_sim_opts o;
    tiny_opts(&o);
    o.block_tokens = 16;
    v41_cost_model *m;
    v41_err err;
    v41_kv_bytes kb;
    ck_assert_int_eq(v41_cost_create(&o.cfg, &o.hw, NULL, &m, &err), 0);
    v41_cost_kv_bytes(m, &kb);
    v41_cost_destroy(m);
    int64_t W = o.cfg.window_size;
    double need = (double)W * kb.window_row + 65 * (kb.comp_tok + kb.index_tok) + kb.state_req;
    double blk = 16 * (kb.comp_tok + kb.index_tok);
    o.kv_capacity = need + 3.5 * blk;
    static coll c;
    static v41_sim_result res;
    run_trace(&o, p, &c, &res);
    ck_assert_int_eq(res.evictions, 5);
    ck_assert_int_eq(by_id(&c, 2)->hit_tokens, 0);
    ck_assert_int_eq(res.n_finished, 3);
    o.kv_capacity = 0;  /* auto: plenty */
    run_trace(&o, p, &c, &res);
    ck_assert_int_eq(res.evictions, 0);
    ck_assert_int_eq(by_id(&c, 2)->hit_tokens, 62);  /* min(64, 63) rounded to a multiple of 2 */
}
END_TEST

/* ------------------------------------------------------------------ malformed traces */

static const char bad_jsonl[] =
    "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [0]}\n"
    "{\"timestamp\": 10, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [0]}\n"
    "{\"timestamp\": 20, \"input_length\": \"x\", \"output_length\": 5}\n"
    "{\"timestamp\": 30, \"input_length\": 100, \"output_length\": 5}\n"
    "not json at all\n"
    "\n"
    "{\"timestamp\": 5, \"input_length\": 100, \"output_length\": 5}\n"
    "{\"timestamp\": 40, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [1, -2]}\n"
    "{\"timestamp\": 50, \"input_length\": 100, \"output_length\": 5}\n";

static int count_records(const char *path, const char *fmt, bool lenient, int64_t *skipped, v41_err *err)
{
    v41_trace *t;
    int rc = v41_trace_open(path, fmt, lenient, &t, err);
    if (rc) return -rc;
    v41_trace_rec r;
    bool eof = false;
    int n = 0;
    while (!(rc = v41_trace_next(t, &r, &eof, err)) && !eof) n++;
    *skipped = v41_trace_skipped(t);
    v41_trace_close(t);
    return rc ? -rc : n;
}

START_TEST(test_malformed_rows)
{
    mk_tmp();
    const char *p = write_file("bad.jsonl", bad_jsonl);
    char path[512];
    snprintf(path, sizeof path, "%s", p);
    v41_err err = {0};
    int64_t sk = 0;
    ck_assert_int_eq(count_records(path, "auto", false, &sk, &err), -V41_EINVAL);
    char want[600];
    snprintf(want, sizeof want, "%s:3:", path);
    ck_assert_msg(strstr(err.msg, want) && strstr(err.msg, "input_length"), "message: %s", err.msg);
    /* lenient: lines 3 (bad field), 5 (not JSON), 7 (earlier timestamp), 8 (negative hash) skipped */
    ck_assert_int_eq(count_records(path, "auto", true, &sk, &err), 4);
    ck_assert_int_eq(sk, 4);

    const char *pa = write_file("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                           "2023-11-16 18:15:46.6805900,374,44\n"
                                           "2023-11-16 18:15:50.9951690,396,109\n"
                                           "2023-11-16 18:61:51.2224670,879,55\n"
                                           "2023-11-16 18:15:52.0000000,879\n"
                                           "2023-11-16 18:15:53.0000000,0,5\n"
                                           "2023-11-16 18:15:54.5000000,10,5\n");
    snprintf(path, sizeof path, "%s", pa);
    ck_assert_int_eq(count_records(path, "azure", false, &sk, &err), -V41_EINVAL);
    snprintf(want, sizeof want, "%s:4:", path);
    ck_assert_msg(strstr(err.msg, want) && strstr(err.msg, "TIMESTAMP"), "message: %s", err.msg);
    ck_assert_int_eq(count_records(path, "azure", true, &sk, &err), 3);
    ck_assert_int_eq(sk, 3);
    /* arrival times relative to the first row */
    v41_trace *t;
    ck_assert_int_eq(v41_trace_open(path, "azure", true, &t, &err), 0);
    v41_trace_rec r;
    bool eof;
    double ts[3];
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(v41_trace_next(t, &r, &eof, &err), 0);
        ts[i] = r.t_arrive;
    }
    v41_trace_close(t);
    ck_assert_double_eq_tol(ts[0], 0, 1e-9);
    ck_assert_double_eq_tol(ts[1], 4.314579, 1e-6);
    ck_assert_double_eq_tol(ts[2], 7.8194100, 1e-6);

    /* CLI: exit status 2 and the file:line on stderr, no output directory contents */
    const char *bd = builddir();
    ck_assert_msg(bd != NULL, "cannot find the build tree (harness/v41)");
    char cmd[2048], buf[4096] = {0};
    snprintf(cmd, sizeof cmd, "%s/harness/v41 sim --model tiny --trace %s/bad.jsonl --out %s/o --no-progress 2>&1",
             bd, tmpdir, tmpdir);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    int st = pclose(f);
    ck_assert_int_eq(WEXITSTATUS(st), 2);
    ck_assert_msg(strstr(buf, "bad.jsonl:3:"), "stderr: %s", buf);
    snprintf(cmd, sizeof cmd, "%s/o/summary.json", tmpdir);
    ck_assert_int_ne(access(cmd, F_OK), 0);
    snprintf(cmd, sizeof cmd, "%s/harness/v41 sim --model tiny --trace %s/bad.jsonl --lenient --json --no-progress",
             bd, tmpdir);
    f = popen(cmd, "r");
    n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    ck_assert_int_eq(WEXITSTATUS(pclose(f)), 0);
    cJSON *j = cJSON_Parse(buf);
    ck_assert_ptr_nonnull(j);
    ck_assert_int_eq(cJSON_GetObjectItem(j, "skipped_rows")->valueint, 4);
    ck_assert_int_eq(cJSON_GetObjectItem(j, "requests")->valueint, 4);
    cJSON_Delete(j);
}
END_TEST

/* Values that parse but cannot be simulated (found by tests/fuzz/fuzz_trace.c and fuzz_simjson.c):
 * each must be rejected with a message naming the field, not turned into inf/NaN arrival times
 * or an out-of-range integer conversion. */
START_TEST(test_out_of_range_inputs)
{
    mk_tmp();
    v41_err err;
    int64_t sk;
    char path[512];
    /* 1e999 ms parses as inf; a length over the 1e9-token bound */
    snprintf(path, sizeof path, "%s", write_file("inf.jsonl",
             "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5}\n"
             "{\"timestamp\": 1e999, \"input_length\": 10, \"output_length\": 5}\n"
             "{\"timestamp\": 2, \"input_length\": 2e9, \"output_length\": 5}\n"
             "{\"timestamp\": 3, \"input_length\": 10, \"output_length\": 5}\n"));
    ck_assert_int_eq(count_records(path, "mooncake", false, &sk, &err), -V41_EINVAL);
    ck_assert_msg(strstr(err.msg, ":2:") && strstr(err.msg, "timestamp"), "message: %s", err.msg);
    ck_assert_int_eq(count_records(path, "mooncake", true, &sk, &err), 2);
    ck_assert_int_eq(sk, 2);
    /* strtod reads "nan" seconds */
    snprintf(path, sizeof path, "%s", write_file("nan.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                                 "2023-11-16 18:15:46.5,374,44\n"
                                                 "2023-11-16 18:15:nan,374,44\n"
                                                 "2023-11-16 18:15:47.5,374,3000000000\n"));
    ck_assert_int_eq(count_records(path, "azure", false, &sk, &err), -V41_EINVAL);
    ck_assert_msg(strstr(err.msg, ":3:") && strstr(err.msg, "TIMESTAMP"), "message: %s", err.msg);  /* the header is line 1 */
    ck_assert_int_eq(count_records(path, "azure", true, &sk, &err), 1);
    ck_assert_int_eq(sk, 2);
    /* synthetic spec: counts must be whole numbers in range, rates and CVs finite */
    const char *bad[] = {"n=1e300", "n=2.5", "seed=-1", "rate=1e999", "cv=1e-200", "groups=1e20",
                         "prefix=5e9", "block=0", "in=fixed:1e12", "out=lognormal:100:50", "rate=nan"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v41_trace *t = NULL;
        err.msg[0] = 0;
        ck_assert_msg(v41_trace_open_synth(bad[i], &t, &err) == V41_EINVAL && !t, "%s accepted", bad[i]);
        ck_assert_msg(strstr(err.msg, bad[i]) != NULL, "%s: message %s", bad[i], err.msg);
    }
    /* a request needing more than 2^26 prefix blocks */
    v41_trace *t;
    ck_assert_int_eq(v41_trace_open_synth("n=2,in=fixed:100000000,block=1", &t, &err), 0);
    v41_trace_rec r;
    bool eof;
    ck_assert_int_eq(v41_trace_next(t, &r, &eof, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "raise block") != NULL, "message: %s", err.msg);
    v41_trace_close(t);
    /* profile: an infinite ceiling, an infinite median, bytes that underflow the roofline time */
    static v41_profile prof;
    const char *pbad[] = {
        "{\"schema\":\"v41-profile/1\",\"ceilings\":{\"copy_GBps\":1e999,\"bf16_gemm_TFLOPs\":800},\"ops\":[]}",
        "{\"schema\":\"v41-profile/1\",\"ceilings\":{\"copy_GBps\":4000,\"bf16_gemm_TFLOPs\":800},\"ops\":"
        "[{\"op\":\"gemm\",\"flops\":1e12,\"bytes\":1e6,\"median_s\":1e999}]}",
        "{\"schema\":\"v41-profile/1\",\"ceilings\":{\"copy_GBps\":4000,\"bf16_gemm_TFLOPs\":800},\"ops\":"
        "[{\"op\":\"small\",\"flops\":0,\"bytes\":1e-320,\"median_s\":1e-6}]}",
        "{\"schema\":\"v41-profile/1\",\"ceilings\":{\"copy_GBps\":4000,\"bf16_gemm_TFLOPs\":800},"
        "\"launch_us\":\"2\",\"ops\":[]}"};
    const char *pwant[] = {"ceilings", "ops[0]", "ops[0]", "launch_us"};
    for (int i = 0; i < 4; i++) {
        err.msg[0] = 0;
        ck_assert_int_eq(v41_profile_load(write_file("p.json", pbad[i]), &prof, &err), V41_EINVAL);
        ck_assert_msg(strstr(err.msg, pwant[i]) != NULL, "profile %d: message %s", i, err.msg);
    }
    /* acceptance: counts past the draft-length bound or infinite are not counts */
    char spec[600];
    snprintf(spec, sizeof spec, "file:%s", write_file("acc.json", "{\"accepted\": [1e300, -1], \"accepted_hist\": [1e999]}"));
    v41_accept a;
    ck_assert_int_eq(v41_accept_parse(spec, &a, &err), V41_EINVAL);
    snprintf(spec, sizeof spec, "file:%s", write_file("acc.json", "{\"accepted\": [1e300, 2, 2.5, 0]}"));
    ck_assert_int_eq(v41_accept_parse(spec, &a, &err), 0);
    ck_assert_int_eq(a.pmf_len, 3);
    ck_assert_double_eq_tol(a.pmf[2], 2.0 / 3, 1e-15);
    ck_assert_double_eq_tol(a.pmf[0], 1.0 / 3, 1e-15);
}
END_TEST

/* ------------------------------------------------------------------ speculation */

START_TEST(test_acceptance_models)
{
    mk_tmp();
    char p[512];
    snprintf(p, sizeof p, "%s", write_file("s.jsonl", "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 20000}\n"));
    v41_sim_opts o;
    tiny_opts(&o);
    o.draft_len = 3;
    static coll c;
    static v41_sim_result res;
    /* fixed:0.5 carries the fraction: accepted = floor(0.5 * drafted) for the one request */
    ck_assert_int_eq(v41_accept_parse("fixed:0.5", &o.accept, NULL), 0);
    run_trace(&o, p, &c, &res);
    ck_assert_int_eq(res.accepted, res.drafted / 2);
    /* every step produces accepted + 1 tokens: 1 (prefill) + decode steps + accepted = out_len,
     * except that the last step may be cut at out_len */
    ck_assert_int_eq(c.r[0].out_len, 20000);
    ck_assert(1 + (res.steps - 1) + res.accepted >= 20000);
    /* geom:0.6, 3 drafts: E[accepted] = .6 + .36 + .216 = 1.176 per full verify step; with
     * ~9000 steps and per-step sd < 1.2 the mean has sd < 0.013; tolerance 5 sd */
    ck_assert_int_eq(v41_accept_parse("geom:0.6", &o.accept, NULL), 0);
    run_trace(&o, p, &c, &res);
    double mean = (double)res.accepted / (double)res.verify_steps;
    ck_assert_msg(fabs(mean - 1.176) < 0.065, "mean accepted %g", mean);
    /* empirical from a serve-trace JSON: always 2 accepted */
    char js[512];
    snprintf(js, sizeof js, "file:%s", write_file("st.json", "{\"steps\": [{\"accepted\": 2}, {\"accepted\": 2}]}"));
    v41_err err;
    ck_assert_int_eq(v41_accept_parse(js, &o.accept, &err), 0);
    run_trace(&o, p, &c, &res);
    /* every full verify step (3 drafts) accepts exactly 2; only the last steps may have fewer drafts */
    ck_assert(res.accepted <= 2 * res.verify_steps && res.accepted >= 2 * (res.verify_steps - 2));
    ck_assert_int_ne(v41_accept_parse("geom:1.5", &o.accept, &err), 0);
    ck_assert_int_ne(v41_accept_parse("file:/nonexistent.json", &o.accept, &err), 0);
}
END_TEST

/* ------------------------------------------------------------------ profile, histogram */

START_TEST(test_profile_interpolation)
{
    /* at every measured point the interpolated time is the measured median */
    const char *src = getenv("V41_SRCDIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/sim/profile_sample.json", src ? src : V41_TESTDATA);
    static v41_profile prof;
    v41_err err;
    ck_assert_msg(v41_profile_load(path, &prof, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(prof.n_ignored, 1);   /* the "layer" entry */
    v41_config cfg;
    v41_config_tiny(&cfg);
    v41_hw hw;
    v41_hw_h200(&hw);
    hw.gpus = 1;
    v41_cost_model *m;
    ck_assert_int_eq(v41_cost_create(&cfg, &hw, &prof, &m, &err), 0);
    FILE *f = fopen(path, "r");
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    fclose(f);
    cJSON *j = cJSON_ParseWithLength(buf, n);
    free(buf);
    int checked = 0;
    for (cJSON *o = cJSON_GetObjectItem(j, "ops")->child; o; o = o->next) {
        const char *op = cJSON_GetObjectItem(o, "op")->valuestring;
        int c = -1;
        for (int k = 0; k < V41_OP_NCLASS; k++)
            if (!strcmp(op, v41_op_class_name(k))) c = k;
        if (c < 0) continue;
        double F = cJSON_GetObjectItem(o, "flops")->valuedouble, B = cJSON_GetObjectItem(o, "bytes")->valuedouble;
        double t = cJSON_GetObjectItem(o, "median_s")->valuedouble;
        /* log/exp round trip: a few ulps */
        ck_assert_double_eq_tol(v41_cost_kernel_time(m, c, F, B), t, 1e-12 * t);
        checked++;
    }
    ck_assert_int_ge(checked, 20);
    cJSON_Delete(j);
    v41_cost_destroy(m);
    mk_tmp();
    ck_assert_int_ne(v41_profile_load(write_file("p.json", "{\"schema\": \"other\"}"), &prof, &err), 0);
    ck_assert(strstr(err.msg, "schema") != NULL);
}
END_TEST

START_TEST(test_histogram)
{
    /* quantiles of 1..10000 ms: bins are 0.23% wide, so within 0.3% of the exact order statistic */
    static v41_hist h;
    v41_hist_init(&h);
    for (int i = 1; i <= 10000; i++) v41_hist_add(&h, i * 1e-3);
    const double q[] = {0.5, 0.9, 0.99};
    for (int k = 0; k < 3; k++) {
        double exact = (1 + q[k] * 9999) * 1e-3;
        ck_assert_double_eq_tol(v41_hist_quantile(&h, q[k]), exact, 0.003 * exact);
    }
    ck_assert_double_eq_tol(h.sum / h.n, 5.0005, 1e-9);
}
END_TEST

/* ------------------------------------------------------------------ sweep + merge */

START_TEST(test_sweep_merge)
{
    const char *bd = builddir();
    ck_assert_msg(bd != NULL, "cannot find the build tree (harness/v41)");
    mk_tmp();
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "%s/harness/v41 sim --model tiny --synth n=30,rate=20,seed=3 --no-progress --json "
             "--sweep 'replay=on,off;dspark=off,2' --sweep-index all --out %s/sw > /dev/null", bd, tmpdir);
    ck_assert_int_eq(WEXITSTATUS(system(cmd)), 0);
    snprintf(cmd, sizeof cmd, "%s/harness/v41 sim --merge %s/sw --merge-out %s/m.csv", bd, tmpdir, tmpdir);
    ck_assert_int_eq(WEXITSTATUS(system(cmd)), 0);
    snprintf(cmd, sizeof cmd, "%s/m.csv", tmpdir);
    FILE *f = fopen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    char line[8192];
    int nl = 0;
    bool found = false;
    while (fgets(line, sizeof line, f)) {
        if (nl == 0) ck_assert(strstr(line, "params.replay") && strstr(line, "params.dspark") && strstr(line, "ttft_p50_s"));
        if (strstr(line, "run-0003") && strstr(line, ",off,2,")) found = true;
        nl++;
    }
    fclose(f);
    ck_assert_int_eq(nl, 5);
    ck_assert_msg(found, "run-0003 must be replay=off, dspark=2");
    /* a bad index is an error */
    snprintf(cmd, sizeof cmd, "%s/harness/v41 sim --model tiny --synth n=3 --sweep 'replay=on,off' --sweep-index 2 "
             "--out %s/x 2>/dev/null", bd, tmpdir);
    ck_assert_int_eq(WEXITSTATUS(system(cmd)), 2);
}
END_TEST

/* ------------------------------------------------------------------ generator, outputs */

START_TEST(test_synthetic_generator)
{
    /* Poisson at 5 req/s: mean gap 0.2 s, sd of the mean over 3999 gaps 0.2/sqrt(3999) = 0.0032;
     * tolerance 5 sd. Gamma cv=2: sample CV within 15% (its sd is ~5% at this n for shape 1/4).
     * Groups: the prefix's full blocks carry the group's ids, and the prompt extends past it. */
    v41_err err;
    for (int g = 0; g < 2; g++) {
        v41_trace *t;
        ck_assert_int_eq(v41_trace_open_synth(g ? "n=4000,rate=5,arrival=gamma,cv=2,seed=5"
                                                : "n=4000,rate=5,groups=3,prefix=1100,block=512,seed=5", &t, &err), 0);
        v41_trace_rec r;
        bool eof;
        double last = 0, s1 = 0, s2 = 0;
        int n = 0;
        int64_t first_ids[3][2];
        int seen[3] = {0};
        while (!v41_trace_next(t, &r, &eof, &err) && !eof) {
            if (n > 0) {
                double gap = r.t_arrive - last;
                ck_assert(gap >= 0);
                s1 += gap;
                s2 += gap * gap;
            }
            last = r.t_arrive;
            ck_assert_int_eq(r.n_hash, (int)((r.in_len + 511) / 512));
            if (!g) {
                ck_assert_int_gt(r.in_len, 1100);
                int grp = (int)(r.hash[0] / 4);   /* ids of group k: k*(ceil(1100/512)+1) + i */
                ck_assert(grp >= 0 && grp < 3);
                if (seen[grp]) {
                    ck_assert(r.hash[0] == first_ids[grp][0] && r.hash[1] == first_ids[grp][1]);
                } else {
                    first_ids[grp][0] = r.hash[0];
                    first_ids[grp][1] = r.hash[1];
                    seen[grp] = 1;
                }
            }
            n++;
        }
        v41_trace_close(t);
        ck_assert_int_eq(n, 4000);
        double mean = s1 / (n - 1), cv = sqrt(s2 / (n - 1) - mean * mean) / mean;
        ck_assert_msg(fabs(mean - 0.2) < 0.016 * (g ? 2 : 1), "mean gap %g", mean);
        if (g) ck_assert_msg(fabs(cv - 2) < 0.3, "cv %g", cv);
        else ck_assert_msg(fabs(cv - 1) < 0.15, "cv %g", cv);
        if (!g) ck_assert(seen[0] && seen[1] && seen[2]);
    }
    ck_assert_int_ne(v41_trace_open_synth("n=10,bogus=3", &(v41_trace *){0}, &err), 0);
}
END_TEST

START_TEST(test_output_files)
{
    /* --out: one CSV row and one HDF5 element per request, summary.json agrees, no temp files */
    mk_tmp();
    char dir[600];
    snprintf(dir, sizeof dir, "%s/out", tmpdir);
    v41_sim_opts o;
    tiny_opts(&o);
    o.sample_dt = 0;
    v41_err err;
    v41_trace *t;
    ck_assert_int_eq(v41_trace_open_synth("n=123,rate=50,seed=9", &t, &err), 0);
    v41_sim_out *out;
    ck_assert_int_eq(v41_sim_out_open(dir, &out, &err), 0);
    v41_sim_sinks s;
    v41_sim_out_sinks(out, &s);
    static v41_sim_result res;
    ck_assert_int_eq(v41_sim_run(&o, t, &s, &res, &err), 0);
    v41_trace_close(t);
    ck_assert_int_eq(v41_sim_out_close(out, &o, &res, "{\"k\":\"v\"}", &err), 0);
    char p[700], line[4096];
    snprintf(p, sizeof p, "%s/requests.csv", dir);
    FILE *f = fopen(p, "r");
    ck_assert_ptr_nonnull(f);
    int n = 0;
    while (fgets(line, sizeof line, f)) n++;
    fclose(f);
    ck_assert_int_eq(n, 1 + 123);
    snprintf(p, sizeof p, "%s/kv.csv", dir);
    f = fopen(p, "r");
    n = 0;
    while (fgets(line, sizeof line, f)) n++;
    fclose(f);
    ck_assert_int_eq(n, 1 + res.steps);   /* sample_dt 0: one sample per step */
    snprintf(p, sizeof p, "%s/summary.json", dir);
    f = fopen(p, "r");
    char *buf = calloc(1, 1 << 16);
    size_t len = fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    cJSON *j = cJSON_ParseWithLength(buf, len);
    free(buf);
    ck_assert_ptr_nonnull(j);
    ck_assert_int_eq(cJSON_GetObjectItem(j, "finished")->valueint, 123);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "params"), "k")->valuestring, "v");
    cJSON_Delete(j);
    snprintf(p, sizeof p, "%s/sim.h5", dir);
    ck_assert_int_eq(access(p, R_OK), 0);
    snprintf(p, sizeof p, "ls -A %s | grep -c tmp", dir);
    f = popen(p, "r");
    ck_assert_int_eq(fscanf(f, "%d", &n), 1);
    pclose(f);
    ck_assert_int_eq(n, 0);
}
END_TEST

static Suite *sim_suite(void)
{
    Suite *s = suite_create("sim");
    TCase *t = tcase_create("core");
    tcase_set_timeout(t, 60);
    tcase_add_test(t, test_conservation);
    tcase_add_test(t, test_single_request_latency);
    tcase_add_test(t, test_replay_trim_flops);
    tcase_add_test(t, test_cache_hits);
    tcase_add_test(t, test_cache_lru_eviction);
    tcase_add_test(t, test_acceptance_models);
    suite_add_tcase(s, t);
    TCase *io = tcase_create("io");
    tcase_set_timeout(io, 60);
    tcase_add_test(io, test_malformed_rows);
    tcase_add_test(io, test_out_of_range_inputs);
    tcase_add_test(io, test_profile_interpolation);
    tcase_add_test(io, test_histogram);
    tcase_add_test(io, test_sweep_merge);
    tcase_add_test(io, test_synthetic_generator);
    tcase_add_test(io, test_output_files);
    suite_add_tcase(s, io);
    return s;
}

int main(void)
{
    SRunner *r = srunner_create(sim_suite());
    srunner_run_all(r, CK_NORMAL);
    int nf = srunner_ntests_failed(r);
    srunner_free(r);
    return nf ? 1 : 0;
}
