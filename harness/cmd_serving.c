/* cmd_serving.c: the serving-semantics commands (SPEC §7, §8).
 *
 *   v41 replay-study  bounded replay on vs off over the same prompts
 *   v41 serve-trace   a request trace through an engine with continuous
 *                     batching, prefix caching (with encoder-side replay)
 *                     and optional DSpark speculation; the measured ground
 *                     truth the simulator is checked against.
 */
#include "config.h"
#include "v41_cli.h"
#include "v41_runner.h"
#include "v41_sim.h"
#include "v41_quant.h"
#include <cjson/cJSON.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int write_json_file(const char *path, cJSON *j, v41_err *err)
{
    char *txt = cJSON_Print(j);
    if (!txt) return v41_err_set(err, V41_ENOMEM, "cannot serialise JSON");
    if (!strcmp(path, "-")) {
        fputs(txt, stdout);
        fputc('\n', stdout);
        free(txt);
        return V41_OK;
    }
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) { free(txt); return v41_err_set(err, V41_EIO, "%s: cannot write", tmp); }
    int ok = fputs(txt, f) >= 0 && fputc('\n', f) != EOF;
    ok = (fclose(f) == 0) && ok;
    free(txt);
    if (!ok || rename(tmp, path) != 0) { remove(tmp); return v41_err_set(err, V41_EIO, "%s: write failed", path); }
    return V41_OK;
}

static int argmax_row(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i; /* first index on ties */
    return b;
}

/* ===================================================================== replay-study */

/* Captures, during the prefill forward, the last row of every request of
 * every "layer.{l}.stream.out" tap. */
typedef struct cap_ctx {
    bool active;
    int n_layers, n_req, width;   /* width = hc * D */
    const int *row_end;           /* cumulative rows per request in the prefill forward */
    float *last;                  /* [n_req][n_layers][width] */
    bool *seen;                   /* [n_layers] */
} cap_ctx;

static int cap_emit(void *vctx, const v41_tap *t)
{
    cap_ctx *c = vctx;
    if (!c->active || t->layer < 0 || t->layer >= c->n_layers || (t->kind != V41_TAP_BF16 && t->kind != V41_TAP_F32))
        return 0;
    char want[64];
    snprintf(want, sizeof want, "layer.%d.stream.out", t->layer);
    if (strcmp(t->name, want)) return 0;
    int64_t w = 1;
    for (int d = 1; d < t->ndim; d++) w *= t->shape[d];
    if (w != c->width) return 0;
    const float *x = t->data;
    for (int r = 0; r < c->n_req; r++) {
        int64_t row = c->row_end[r] - 1;
        if (row >= t->shape[0]) return 0;
        memcpy(c->last + ((size_t)r * c->n_layers + t->layer) * c->width, x + row * w, sizeof(float) * (size_t)w);
    }
    c->seen[t->layer] = true;
    return 0;
}

typedef struct arm {
    v41_engine *e;
    cap_ctx cap;
    v41_tap_sink sink;
    float *logits;      /* [n_req][V] last prefill position */
    int32_t *gen;       /* [n_req][steps+1] greedy tokens (column 0 from the prefill) */
    double prefill_s;
} arm;

/* One untimed warm-up in a spare slot, released after, so that one-time costs (first touch
 * of the mmap'd weights, the GPU engine's weight upload, cuBLAS handles) stay out of what the
 * caller times: a prefill of tok[0..n), then with decode one decode step of tok[n], then with
 * draft a DSpark draft after it. */
static int warm_up(v41_engine *e, int slot, const int32_t *tok, int n, bool decode, bool draft, v41_err *err)
{
    v41_req wr = {.id = slot, .start_pos = 0, .n_tokens = n, .tokens = tok};
    v41_batch wb = {1, &wr};
    v41_out wo;
    memset(&wo, 0, sizeof wo);
    int rc = v41_engine_forward(e, &wb, &wo, err);
    if (!rc && decode) {
        wr.start_pos = n;
        wr.n_tokens = 1;
        wr.tokens = tok + n;
        rc = v41_engine_forward(e, &wb, &wo, err);
    }
    if (!rc && draft && e->model->cfg.dspark_block_size <= V41_ACC_MAXLEN) {
        int32_t ids[V41_ACC_MAXLEN + 2];
        float conf[V41_ACC_MAXLEN + 2];
        rc = e->vt->dspark_draft(e, slot, n, tok[0], ids, conf, err);
    }
    if (!rc && e->vt->release) e->vt->release(e, slot);
    return rc;
}

static int arm_run(arm *a, const v41_run_inputs *in, int steps, int vocab, v41_err *err)
{
    int n = in->n_req;
    v41_req *rq = calloc((size_t)n, sizeof *rq);
    if (!rq) return v41_err_set(err, V41_ENOMEM, "out of memory");
    for (int r = 0; r < n; r++) {
        rq[r].id = r;
        rq[r].start_pos = 0;
        rq[r].n_tokens = in->len[r];
        rq[r].tokens = in->ids[r];
    }
    v41_batch b = {n, rq};
    v41_out out;
    memset(&out, 0, sizeof out);
    /* both arms are timed warm: a warm-up prefill in the spare slot n first */
    int wrc = warm_up(a->e, n, in->ids[0], in->len[0], false, false, err);
    if (wrc) { free(rq); return wrc; }
    a->cap.active = true;
    double t0 = now_s();
    int rc = v41_engine_forward(a->e, &b, &out, err);
    a->prefill_s = now_s() - t0;
    a->cap.active = false;
    if (rc) { free(rq); return rc; }
    for (int r = 0; r < n; r++) {
        const float *lg = out.logits + (size_t)out.row_offset[r] * vocab;
        memcpy(a->logits + (size_t)r * vocab, lg, sizeof(float) * (size_t)vocab);
        a->gen[(size_t)r * (steps + 1)] = argmax_row(lg, vocab);
    }
    int32_t *tok = calloc((size_t)n, sizeof *tok);
    for (int s = 1; s <= steps && !rc; s++) {
        for (int r = 0; r < n; r++) {
            tok[r] = a->gen[(size_t)r * (steps + 1) + s - 1];
            rq[r].start_pos = in->len[r] + s - 1;
            rq[r].n_tokens = 1;
            rq[r].tokens = &tok[r];
        }
        rc = v41_engine_forward(a->e, &b, &out, err);
        for (int r = 0; r < n && !rc; r++)
            a->gen[(size_t)r * (steps + 1) + s] = argmax_row(out.logits + (size_t)out.row_offset[r] * vocab, vocab);
    }
    free(tok);
    free(rq);
    return rc;
}

static void replay_study_usage(FILE *f)
{
    fprintf(f,
            "usage: v41 replay-study [MODEL] [--engine ref|gpu[:PREC]] [--prompt-ids FILE | --random-prompts N:LEN]\n"
            "                        [--seed S] [--steps K] [--threads N] [--json OUT|-]\n\n"
            "Runs the same prompts with bounded replay on (decoder-side trimming, SPEC §7) and off, and reports:\n"
            "  per layer   relative RMS difference of the block output stream at each request's last prompt row\n"
            "  logits      KL(off || on) of the last-position distribution, top-1 agreement\n"
            "  greedy      agreement of the K greedy tokens generated after the prompt (each arm on its own tokens)\n"
            "  savings     fraction of prefill layer-rows and FLOPs that trimming skips (FLOPs: the simulator's\n"
            "              exact cost model of the same batch)\n"
            "MODEL: tiny (default) or a checkpoint directory. Defaults: --random-prompts 4:48 --seed 1 --steps 8.\n"
            "Exit status: 0 ok, 2 error.\n");
}

int v41_cmd_replay_study(int argc, char **argv)
{
    static const struct option lo[] = {
        {"engine", 1, 0, 'e'}, {"prompt-ids", 1, 0, 'p'}, {"random-prompts", 1, 0, 'r'}, {"seed", 1, 0, 's'},
        {"steps", 1, 0, 'k'}, {"threads", 1, 0, 't'}, {"json", 1, 0, 'j'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    const char *eng = "ref", *pfile = NULL, *rnd = "4:48", *json = NULL;
    uint64_t seed = 1;
    int steps = 8, threads = 0, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'e': eng = optarg; break;
        case 'p': pfile = optarg; break;
        case 'r': rnd = optarg; break;
        case 's': seed = strtoull(optarg, NULL, 0); break;
        case 'k': steps = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'j': json = optarg; break;
        case 'h': replay_study_usage(stdout); return 0;
        default: replay_study_usage(stderr); return 2;
        }
    }
    const char *spec = optind < argc ? argv[optind] : "tiny";
    if (optind + 1 < argc) { fprintf(stderr, "v41 replay-study: unexpected argument '%s'\n", argv[optind + 1]); return 2; }
    if (steps < 0) { fprintf(stderr, "v41 replay-study: --steps must be >= 0\n"); return 2; }

    v41_err err = {0};
    v41_model *m = NULL;
    v41_run_inputs in = {0};
    arm arms[2];
    memset(arms, 0, sizeof arms);
    int rc = v41_model_load(spec, &m, &err);
    if (rc) goto fail;
    const v41_config *cfg = &m->cfg;
    int V = cfg->vocab_size, NL = cfg->n_layers, W = cfg->window_size;
    if (pfile) rc = v41_run_inputs_load(pfile, V, &in, &err);
    else {
        int n, len;
        if (v41_parse_nlen(rnd, &n, &len)) { rc = v41_err_set(&err, V41_EINVAL, "--random-prompts %s: expected N:LEN", rnd); goto fail; }
        rc = v41_run_inputs_random(n, len, seed, V, &in, &err);
    }
    if (rc) goto fail;
    int n = in.n_req;
    int *row_end = calloc((size_t)n, sizeof *row_end);
    for (int r = 0, acc = 0; r < n; r++) row_end[r] = (acc += in.len[r]);

    for (int k = 0; k < 2; k++) {
        v41_run_opts ro;
        v41_run_opts_default(&ro);
        if ((rc = v41_side_parse(eng, &ro.side, &err))) goto fail;
        ro.threads = threads;
        ro.replay = (k == 0);
        ro.max_requests = n + 1;   /* the prompts + the warm-up slot */
        if ((rc = v41_run_engine_create(m, &ro, &arms[k].e, &err))) goto fail;
        cap_ctx *cc = &arms[k].cap;
        cc->n_layers = NL;
        cc->n_req = n;
        cc->width = cfg->hc_mult * cfg->dim;
        cc->row_end = row_end;
        cc->last = calloc((size_t)n * NL * cc->width, sizeof(float));
        cc->seen = calloc((size_t)NL, sizeof(bool));
        arms[k].sink.emit = cap_emit;
        arms[k].sink.ctx = cc;
        arms[k].sink.pattern = "layer.*.stream.out";
        v41_engine_set_sink(arms[k].e, &arms[k].sink);
        arms[k].logits = calloc((size_t)n * V, sizeof(float));
        arms[k].gen = calloc((size_t)n * (steps + 1), sizeof(int32_t));
        if ((rc = arm_run(&arms[k], &in, steps, V, &err))) goto fail;
    }

    /* per-layer divergence at the last prompt row */
    double *lay = calloc((size_t)NL, sizeof(double));
    for (int l = 0; l < NL; l++) {
        double num = 0, den = 0;
        for (int r = 0; r < n; r++) {
            const float *a = arms[1].cap.last + ((size_t)r * NL + l) * arms[1].cap.width;
            const float *b = arms[0].cap.last + ((size_t)r * NL + l) * arms[0].cap.width;
            for (int i = 0; i < arms[0].cap.width; i++) {
                double d = (double)a[i] - b[i];
                num += d * d;
                den += (double)a[i] * a[i];
            }
        }
        lay[l] = (arms[0].cap.seen[l] && arms[1].cap.seen[l]) ? (den > 0 ? sqrt(num / den) : sqrt(num)) : NAN;
    }
    /* logits: KL(off || on), top-1 agreement */
    double kl_sum = 0, kl_max = 0;
    int top1 = 0;
    for (int r = 0; r < n; r++) {
        const float *p = arms[1].logits + (size_t)r * V, *q = arms[0].logits + (size_t)r * V;
        double mp = -INFINITY, mq = -INFINITY, sp = 0, sq = 0, kl = 0;
        for (int i = 0; i < V; i++) { mp = fmax(mp, p[i]); mq = fmax(mq, q[i]); }
        for (int i = 0; i < V; i++) { sp += exp(p[i] - mp); sq += exp(q[i] - mq); }
        for (int i = 0; i < V; i++) {
            double lp = p[i] - mp - log(sp), lq = q[i] - mq - log(sq);
            kl += exp(lp) * (lp - lq);
        }
        kl_sum += kl;
        kl_max = fmax(kl_max, kl);
        top1 += argmax_row(p, V) == argmax_row(q, V);
    }
    /* greedy agreement */
    int agree = 0, prefix_sum = 0;
    for (int r = 0; r < n; r++) {
        int pre = 0;
        bool same = true;
        for (int s = 0; s <= steps; s++) {
            int eq = arms[0].gen[(size_t)r * (steps + 1) + s] == arms[1].gen[(size_t)r * (steps + 1) + s];
            agree += eq;
            if (same && eq) pre++; else same = false;
        }
        prefix_sum += pre;
    }
    /* savings: layer-rows and FLOPs (the simulator's cost model of the same prefill batch) */
    int cut = v41_last_kv_source(cfg);
    int64_t rows_all = 0, rows_saved = 0;
    v41_sim_item *items = calloc((size_t)n, sizeof *items);
    for (int r = 0; r < n; r++) {
        int L = in.len[r];
        rows_all += (int64_t)L * NL;
        if (cut >= 0) rows_saved += (int64_t)(L - (L < W ? L : W)) * (NL - cut - 1);
        items[r] = (v41_sim_item){.kind = V41_ITEM_PREFILL, .start = 0, .end = L, .floor = 0, .new_from = 0,
                                  .trim = true, .logits = true};
    }
    double flops_on = 0, flops_off = 0;
    {
        v41_hw hw;
        v41_hw_h200(&hw);
        v41_cost_model *cm = NULL;
        if (v41_cost_create(cfg, &hw, NULL, &cm, &err) == V41_OK) {
            v41_step_cost sc;
            v41_cost_step(cm, items, n, 0, &sc);
            flops_on = sc.flops;
            for (int r = 0; r < n; r++) items[r].trim = false;
            v41_cost_step(cm, items, n, 0, &sc);
            flops_off = sc.flops;
            v41_cost_destroy(cm);
        }
    }
    free(items);

    printf("replay-study: model %s, %d prompts (lengths %d..), window W=%d, last kv source (cut) = layer %d, %d greedy steps\n",
           m->source, n, in.len[0], W, cut, steps);
    printf("%-8s %-22s\n", "layer", "rel-RMS(on vs off) at last prompt row");
    for (int l = 0; l < NL; l++) printf("%-8d %.3e%s\n", l, lay[l], l > cut ? "   (trimmed layer)" : "");
    printf("logits   KL(off||on) mean %.3e max %.3e   top-1 agreement %d/%d\n", kl_sum / n, kl_max, top1, n);
    printf("greedy   %d/%d tokens agree, mean common prefix %.2f of %d\n", agree, n * (steps + 1),
           (double)prefix_sum / n, steps + 1);
    printf("savings  prefill layer-rows %.1f%% (%lld of %lld), FLOPs %.1f%% (%.3g of %.3g)\n",
           rows_all ? 100.0 * rows_saved / rows_all : 0.0, (long long)rows_saved, (long long)rows_all,
           flops_off > 0 ? 100.0 * (flops_off - flops_on) / flops_off : 0.0, flops_off - flops_on, flops_off);
    printf("time     prefill replay-on %.3f s, replay-off %.3f s\n", arms[0].prefill_s, arms[1].prefill_s);

    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "schema", "v41-replay-study/1");
        cJSON_AddStringToObject(j, "model", m->source);
        cJSON_AddStringToObject(j, "engine", eng);
        cJSON_AddNumberToObject(j, "window", W);
        cJSON_AddNumberToObject(j, "cut_layer", cut);
        cJSON_AddNumberToObject(j, "steps", steps);
        cJSON *pl = cJSON_AddArrayToObject(j, "prompt_lengths");
        for (int r = 0; r < n; r++) cJSON_AddItemToArray(pl, cJSON_CreateNumber(in.len[r]));
        cJSON *lj = cJSON_AddArrayToObject(j, "layer_rel_rms");
        for (int l = 0; l < NL; l++) cJSON_AddItemToArray(lj, isnan(lay[l]) ? cJSON_CreateNull() : cJSON_CreateNumber(lay[l]));
        cJSON_AddNumberToObject(j, "kl_mean", kl_sum / n);
        cJSON_AddNumberToObject(j, "kl_max", kl_max);
        cJSON_AddNumberToObject(j, "top1_agree", top1);
        cJSON_AddNumberToObject(j, "n_requests", n);
        cJSON_AddNumberToObject(j, "greedy_agree", agree);
        cJSON_AddNumberToObject(j, "greedy_total", n * (steps + 1));
        cJSON_AddNumberToObject(j, "greedy_mean_common_prefix", (double)prefix_sum / n);
        cJSON_AddNumberToObject(j, "layer_rows_total", (double)rows_all);
        cJSON_AddNumberToObject(j, "layer_rows_saved", (double)rows_saved);
        cJSON_AddNumberToObject(j, "flops_replay_off", flops_off);
        cJSON_AddNumberToObject(j, "flops_replay_on", flops_on);
        cJSON_AddNumberToObject(j, "prefill_s_on", arms[0].prefill_s);
        cJSON_AddNumberToObject(j, "prefill_s_off", arms[1].prefill_s);
        rc = write_json_file(json, j, &err);
        cJSON_Delete(j);
    }
    free(lay);
    free(row_end);
fail:
    for (int k = 0; k < 2; k++) {
        v41_engine_destroy(arms[k].e);
        free(arms[k].cap.last);
        free(arms[k].cap.seen);
        free(arms[k].logits);
        free(arms[k].gen);
    }
    v41_run_inputs_free(&in);
    v41_model_free(m);
    if (rc) {
        fprintf(stderr, "v41 replay-study: %s\n", err.msg);
        return 2;
    }
    return 0;
}

/* ===================================================================== serve-trace */

typedef enum { RS_WAIT = 0, RS_PREFILL, RS_DECODE, RS_DONE } rstate;

typedef struct sreq {
    int id;                 /* engine request id */
    int64_t line;
    double t_arrive;
    int in_len, out_len;
    int32_t *tok;           /* [in_len + out_len + block + 2] prompt then generated */
    int n_hash;
    uint64_t *hash;         /* prefix block ids (scaled trace) */
    rstate st;
    int pos;                /* next position to compute (prefill: next prompt row) */
    int replay_floor;       /* SPEC §7 replay_start, 0 = none */
    int hit;                /* prefix tokens taken from the cache */
    int n_gen;              /* generated tokens so far */
    int32_t next;           /* token to feed next (decode) */
    int32_t draft[V41_ACC_MAXLEN + 2];
    int n_draft;
    double t_first, t_done;
    int64_t accepted, drafted, verify_steps;
} sreq;

typedef struct cache_ent {
    int id;                 /* engine request whose caches hold the prefix */
    int n_hash;
    uint64_t *hash;
    int len;                /* tokens cached */
    uint64_t lru;
    bool live;              /* its request is still running: not evictable */
} cache_ent;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void serve_usage(FILE *f)
{
    fprintf(f,
            "usage: v41 serve-trace [MODEL] (--trace FILE [--format mooncake|azure|auto] | --synth SPEC)\n"
            "                       [--engine ref|gpu[:PREC]] [--limit N] [--len-scale F] [--max-len L]\n"
            "                       [--block B | --trace-block T] [--token-budget N] [--max-seqs N] [--dspark] [--no-replay]\n"
            "                       [--cache-reqs N] [--threads N] [--lenient] [--json OUT|-]\n\n"
            "Runs a request trace through an engine with continuous batching: each step takes every running\n"
            "request's decode row (or DSpark verification block) first, then prompt chunks FIFO up to the token\n"
            "budget. Prefix caching: requests whose leading prefix blocks (trace hash_ids) match a cached request\n"
            "fork its caches; with bounded replay (default) rows from H-W are recomputed with the window floored\n"
            "there, hits <= W are not used (SPEC §7). --no-replay turns replay off, and with it prefix reuse\n"
            "(window KV is not prefix-cacheable), so every prompt is a full prefill.\n"
            "Trace lengths are multiplied by --len-scale (default: fit the model's max_seq_len) and clipped so\n"
            "prompt + output fit --max-len. Token ids are synthetic and deterministic per prefix block, so equal\n"
            "hash ids give equal tokens. --dspark drafts dspark_block_size tokens after every step and verifies\n"
            "them as one multi-token step (greedy, lossless).\n"
            "Output: per-step batch shapes and measured seconds, per-request TTFT/TPOT, acceptance histogram\n"
            "(\"accepted_hist\", readable by `v41 sim --accept file:OUT`).\n"
            "--trace-block T: tokens per hash id in the trace (default 512, Mooncake); a hash block becomes\n"
            "B = round(T * len-scale) tokens here unless --block B is given.\n"
            "Defaults: --limit 24 --token-budget 64 --max-seqs 8 --cache-reqs 16. Exit: 0 ok, 2 error.\n");
}

typedef struct srv {
    v41_engine *e;
    const v41_config *cfg;
    sreq *rq;
    int n;
    cache_ent *cache;
    int n_cache, cap_cache;
    uint64_t lru_clock;
    bool replay, dspark;
    int block;
} srv;

/* longest cached prefix of q's blocks; returns entry index or -1, *blocks = matched blocks */
static int cache_lookup(srv *s, const sreq *q, int *blocks)
{
    int best = -1, bb = 0;
    for (int i = 0; i < s->n_cache; i++) {
        const cache_ent *c = &s->cache[i];
        int k = 0;
        while (k < c->n_hash && k < q->n_hash && c->hash[k] == q->hash[k] && (k + 1) * s->block <= c->len) k++;
        if (k > bb) { bb = k; best = i; }
    }
    *blocks = bb;
    return best;
}

static void cache_evict(srv *s, int keep)
{
    while (s->n_cache > keep) {
        int v = -1;
        for (int i = 0; i < s->n_cache; i++)
            if (!s->cache[i].live && (v < 0 || s->cache[i].lru < s->cache[v].lru)) v = i;
        if (v < 0) return;
        s->e->vt->release(s->e, s->cache[v].id);
        free(s->cache[v].hash);
        s->cache[v] = s->cache[--s->n_cache];
    }
}

int v41_cmd_serve_trace(int argc, char **argv)
{
    static const struct option lo[] = {
        {"trace", 1, 0, 'T'},        {"format", 1, 0, 'F'},   {"synth", 1, 0, 'S'},     {"engine", 1, 0, 'e'},
        {"limit", 1, 0, 'n'},        {"len-scale", 1, 0, 'L'}, {"max-len", 1, 0, 'M'},  {"block", 1, 0, 'B'}, {"trace-block", 1, 0, 'K'},
        {"token-budget", 1, 0, 'b'}, {"max-seqs", 1, 0, 'q'}, {"dspark", 0, 0, 'd'},    {"no-replay", 0, 0, 'R'},
        {"cache-reqs", 1, 0, 'c'},   {"threads", 1, 0, 't'},  {"lenient", 0, 0, 'l'},   {"json", 1, 0, 'j'},
        {"help", 0, 0, 'h'},         {0, 0, 0, 0}};
    const char *trace = NULL, *fmt = "auto", *synth = NULL, *eng = "ref", *json = NULL;
    int limit = 24, max_len = 0, block = 0, trace_block = 512, budget = 64, max_seqs = 8, cache_reqs = 16, threads = 0, c;
    double scale = 0;
    bool dspark = false, replay = true, lenient = false;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'T': trace = optarg; break;
        case 'F': fmt = optarg; break;
        case 'S': synth = optarg; break;
        case 'e': eng = optarg; break;
        case 'n': limit = atoi(optarg); break;
        case 'L': scale = atof(optarg); break;
        case 'M': max_len = atoi(optarg); break;
        case 'B': block = atoi(optarg); if (block < 1) block = -1; break;
        case 'K': trace_block = atoi(optarg); break;
        case 'b': budget = atoi(optarg); break;
        case 'q': max_seqs = atoi(optarg); break;
        case 'd': dspark = true; break;
        case 'R': replay = false; break;
        case 'c': cache_reqs = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'l': lenient = true; break;
        case 'j': json = optarg; break;
        case 'h': serve_usage(stdout); return 0;
        default: serve_usage(stderr); return 2;
        }
    }
    const char *spec = optind < argc ? argv[optind] : "tiny";
    if (!trace == !synth) { fprintf(stderr, "v41 serve-trace: give exactly one of --trace FILE or --synth SPEC\n"); return 2; }
    if (limit < 1 || block < 0 || trace_block < 1 || budget < 1 || max_seqs < 1 || cache_reqs < 0 || scale < 0) {
        fprintf(stderr, "v41 serve-trace: --limit, --block, --trace-block, --token-budget, --max-seqs must be >= 1, --len-scale >= 0\n");
        return 2;
    }

    v41_err err = {0};
    v41_model *m = NULL;
    v41_trace *tr = NULL;
    srv s;
    memset(&s, 0, sizeof s);
    cJSON *steps_j = cJSON_CreateArray();
    v41_req *br = NULL;
    int *bq = NULL;
    int rc = v41_model_load(spec, &m, &err);
    if (rc) goto fail;
    const v41_config *cfg = &m->cfg;
    s.cfg = cfg;
    s.replay = replay;
    s.dspark = dspark;
    int V = cfg->vocab_size, W = cfg->window_size, BS = cfg->dspark_block_size;
    if (dspark && (cfg->n_mtp_layers < 1 || BS < 1 || BS > V41_ACC_MAXLEN)) {
        rc = v41_err_set(&err, V41_EINVAL, "--dspark: model %s has no DSpark stages", m->source);
        goto fail;
    }
    if (max_len <= 0) max_len = cfg->max_seq_len;
    /* room for a verification block whether or not --dspark is given, so both runs see the same lengths */
    int room = max_len - (cfg->n_mtp_layers > 0 ? BS + 1 : 0);
    if (room < 2) { rc = v41_err_set(&err, V41_EINVAL, "--max-len %d too small", max_len); goto fail; }

    /* read the trace */
    rc = trace ? v41_trace_open(trace, fmt, lenient, &tr, &err) : v41_trace_open_synth(synth, &tr, &err);
    if (rc) goto fail;
    s.rq = calloc((size_t)limit, sizeof *s.rq);
    double maxin = 1;
    for (;;) {
        if (s.n >= limit) break;
        v41_trace_rec rec;
        bool eof;
        if ((rc = v41_trace_next(tr, &rec, &eof, &err))) goto fail;
        if (eof) break;
        sreq *q = &s.rq[s.n];
        q->line = rec.line;
        q->t_arrive = rec.t_arrive;
        q->in_len = (int)rec.in_len;
        q->out_len = (int)rec.out_len;
        q->n_hash = rec.n_hash;
        q->hash = calloc((size_t)(rec.n_hash + 1), sizeof *q->hash);
        for (int k = 0; k < rec.n_hash; k++) q->hash[k] = (uint64_t)rec.hash[k];
        if (rec.in_len + rec.out_len > maxin) maxin = (double)(rec.in_len + rec.out_len);
        s.n++;
    }
    if (s.n == 0) { rc = v41_err_set(&err, V41_EINVAL, "trace has no requests"); goto fail; }
    if (scale == 0) scale = (double)room / maxin;
    /* one hash block of the trace (trace_block tokens) becomes `block` tokens here */
    if (block == 0) block = (int)lround(trace_block * scale);
    if (block < 1) block = 1;
    s.block = block;
    for (int i = 0; i < s.n; i++) {
        sreq *q = &s.rq[i];
        int in = (int)lround(q->in_len * scale), out = (int)lround(q->out_len * scale);
        if (in < 1) in = 1;
        if (out < 1) out = 1;
        if (in > room - 1) in = room - 1;
        if (in + out > room) out = room - in;
        q->in_len = in;
        q->out_len = out;
        q->id = i;
        q->tok = calloc((size_t)(in + out + BS + 2), sizeof *q->tok);
        /* block b of the prompt: tokens from the block's hash id (shared prefixes -> equal tokens);
         * blocks past the trace's hash ids come from the request's own seed */
        for (int p = 0; p < in; p++) {
            int b = p / block;
            uint64_t st = (b < q->n_hash ? q->hash[b] * 1000003ULL + 17 : (uint64_t)(i + 1) * 0x51ED27ULL + (uint64_t)b * 7919) +
                          (uint64_t)(p % block) * 0x9E37ULL;
            q->tok[p] = (int32_t)(splitmix(&st) % (uint64_t)V);
        }
        /* the trace's blocks are 512 tokens; after scaling, one trace block is `block` tokens here */
        if (q->n_hash > (in + block - 1) / block) q->n_hash = (in + block - 1) / block;
    }

    v41_run_opts ro;
    v41_run_opts_default(&ro);
    if ((rc = v41_side_parse(eng, &ro.side, &err))) goto fail;
    ro.threads = threads;
    ro.replay = replay;
    /* running + cached prefixes (+1: eviction happens after insert) + the warm-up slot */
    ro.max_requests = max_seqs + cache_reqs + 2;
    if ((rc = v41_run_engine_create(m, &ro, &s.e, &err))) goto fail;
    if (dspark && !s.e->vt->dspark_draft) { rc = v41_err_set(&err, V41_EUNSUPPORTED, "engine has no DSpark drafter"); goto fail; }
    {
        /* one untimed warm-up (prefill + decode, + a draft with --dspark) in a slot no request uses */
        int wid = ro.max_requests - 1, wn = W + 2 < m->cfg.max_seq_len - 1 ? W + 2 : m->cfg.max_seq_len - 1;
        int32_t wt[64];
        if (wn > 63) wn = 63;
        for (int i = 0; i <= wn; i++) wt[i] = (int32_t)(i * 7 + 1) % m->cfg.vocab_size;
        if ((rc = warm_up(s.e, wid, wt, wn, true, dspark, &err))) goto fail;
    }
    s.cap_cache = s.n + 1;
    s.cache = calloc((size_t)s.cap_cache, sizeof *s.cache);

    /* ---- the scheduling loop */
    br = calloc((size_t)s.n, sizeof *br);
    bq = calloc((size_t)s.n, sizeof *bq);
    int64_t hist[V41_ACC_MAXLEN + 1] = {0};
    double clock = 0, busy = 0;
    int done = 0, nstep = 0, next_arrival = 0;
    int64_t rows_total = 0, hit_total = 0, replay_rows = 0, trimmed_rows = 0;
    bool tty = v41_isatty_stderr();
    while (done < s.n) {
        /* admit arrivals (virtual clock = sum of measured step times; idle: jump to the next arrival) */
        int running = 0;
        for (int i = 0; i < s.n; i++) running += s.rq[i].st == RS_PREFILL || s.rq[i].st == RS_DECODE;
        if (running == 0 && next_arrival < s.n && s.rq[next_arrival].t_arrive > clock) clock = s.rq[next_arrival].t_arrive;
        while (next_arrival < s.n && s.rq[next_arrival].t_arrive <= clock && running < max_seqs) {
            sreq *q = &s.rq[next_arrival++];
            q->st = RS_PREFILL;
            running++;
            if (replay) {
                int blocks, ci = cache_lookup(&s, q, &blocks);
                int H = blocks * block;
                if (H >= q->in_len) H = ((q->in_len - 1) / block) * block; /* keep at least one new row */
                if (ci >= 0 && H > W) {  /* hits <= W are not used (SPEC §7) */
                    if ((rc = s.e->vt->fork(s.e, s.cache[ci].id, q->id, H, &err))) goto fail;
                    s.cache[ci].lru = ++s.lru_clock;
                    q->hit = H;
                    q->pos = H - W;
                    q->replay_floor = H - W;
                    hit_total += H;
                    replay_rows += W;
                }
            }
        }
        /* build the step: decode / verification rows first, then prompt chunks FIFO */
        int nb = 0, rows = 0;
        for (int i = 0; i < s.n; i++) {
            sreq *q = &s.rq[i];
            if (q->st != RS_DECODE) continue;
            v41_req *r = &br[nb];
            memset(r, 0, sizeof *r);
            r->id = q->id;
            r->start_pos = q->pos;
            r->replay_floor = q->replay_floor;
            if (dspark && q->n_draft > 0) {
                r->n_tokens = q->n_draft + 1;   /* [next, d1..dB] */
                r->tokens = q->draft;
                r->verify = true;
                r->all_logits = true;
            } else {
                r->n_tokens = 1;
                r->tokens = &q->next;
            }
            rows += r->n_tokens;
            bq[nb++] = i;
        }
        for (int i = 0; i < s.n && rows < budget; i++) {
            sreq *q = &s.rq[i];
            if (q->st != RS_PREFILL) continue;
            int chunk = q->in_len - q->pos;
            if (chunk > budget - rows) chunk = budget - rows;
            v41_req *r = &br[nb];
            memset(r, 0, sizeof *r);
            r->id = q->id;
            r->start_pos = q->pos;
            r->n_tokens = chunk;
            r->tokens = q->tok + q->pos;
            r->replay_floor = q->replay_floor;
            rows += chunk;
            bq[nb++] = i;
        }
        if (nb == 0) {
            if (next_arrival < s.n) { clock = fmax(clock, s.rq[next_arrival].t_arrive); continue; }
            rc = v41_err_set(&err, V41_EINTERNAL, "scheduler stalled with %d of %d requests done", done, s.n);
            goto fail;
        }
        v41_batch b = {nb, br};
        v41_out out;
        memset(&out, 0, sizeof out);
        double t0 = now_s();
        if ((rc = v41_engine_forward(s.e, &b, &out, &err))) goto fail;
        double dt = now_s() - t0;
        /* step record (before the scheduler's state changes) */
        cJSON *sj = cJSON_CreateObject();
        cJSON_AddNumberToObject(sj, "step", nstep);
        cJSON_AddNumberToObject(sj, "seconds", dt);
        cJSON_AddNumberToObject(sj, "rows", rows);
        cJSON *items = cJSON_AddArrayToObject(sj, "items");
        for (int k = 0; k < nb; k++) {
            const sreq *q = &s.rq[bq[k]];
            cJSON *it = cJSON_CreateObject();
            cJSON_AddStringToObject(it, "kind", br[k].verify ? "verify" : q->st == RS_DECODE ? "decode" : "prefill");
            cJSON_AddNumberToObject(it, "req", q->id);
            cJSON_AddNumberToObject(it, "start", br[k].start_pos);
            cJSON_AddNumberToObject(it, "end", br[k].start_pos + br[k].n_tokens);
            cJSON_AddNumberToObject(it, "floor", br[k].replay_floor);
            cJSON_AddNumberToObject(it, "new_from", q->hit > br[k].start_pos ? q->hit : br[k].start_pos);
            cJSON_AddBoolToObject(it, "trim", replay && q->st == RS_PREFILL);
            cJSON_AddItemToArray(items, it);
            /* decoder-side trimming (SPEC §7): rows of a prompt chunk beyond its last W skip the layers after the cut */
            if (replay && q->st == RS_PREFILL && br[k].n_tokens > W) trimmed_rows += br[k].n_tokens - W;
        }
        cJSON_AddItemToArray(steps_j, sj);
        clock += dt;
        busy += dt;
        rows_total += rows;
        /* advance requests */
        for (int k = 0; k < nb; k++) {
            sreq *q = &s.rq[bq[k]];
            const float *lg = out.logits + (size_t)out.row_offset[k] * V;
            int nrows = out.row_offset[k + 1] - out.row_offset[k];
            if (q->st == RS_PREFILL) {
                q->pos += br[k].n_tokens;
                if (q->pos < q->in_len) continue;
                int32_t t = argmax_row(lg + (size_t)(nrows - 1) * V, V);
                q->tok[q->in_len] = t;
                q->n_gen = 1;
                q->next = t;
                q->t_first = clock;
                q->st = RS_DECODE;
                if (replay && cache_reqs > 0) {
                    /* its prompt is cached from now on: later requests may fork it while it decodes */
                    cache_ent *ce = &s.cache[s.n_cache++];
                    ce->id = q->id;
                    ce->n_hash = q->n_hash;
                    ce->hash = q->hash;
                    q->hash = NULL;
                    ce->len = q->in_len;
                    ce->lru = ++s.lru_clock;
                    ce->live = true;
                }
            } else if (br[k].verify) {
                /* rows: next, d1..dB at q->pos..; target greedy g_i from row i */
                int B = q->n_draft, a = 0;
                while (a < B && argmax_row(lg + (size_t)a * V, V) == q->draft[a + 1]) a++;
                int32_t bonus = argmax_row(lg + (size_t)a * V, V);
                hist[a]++;
                q->accepted += a;
                q->drafted += B;
                q->verify_steps++;
                for (int i = 1; i <= a && q->n_gen < q->out_len; i++) q->tok[q->in_len + q->n_gen++] = q->draft[i];
                if (q->n_gen < q->out_len) q->tok[q->in_len + q->n_gen++] = bonus;
                int kept = a + 1;       /* rows next, d1..da are now part of the sequence */
                q->pos += kept;
                if ((rc = s.e->vt->truncate(s.e, q->id, q->pos, &err))) goto fail;
                q->next = bonus;
            } else {
                q->pos += 1;
                int32_t t = argmax_row(lg + (size_t)(nrows - 1) * V, V);
                q->tok[q->in_len + q->n_gen++] = t;
                q->next = t;
            }
            q->n_draft = 0;
            if (q->n_gen >= q->out_len) {
                q->st = RS_DONE;
                q->t_done = clock;
                done++;
                /* a finished request's caches stay as a prefix-cache entry until evicted (LRU) */
                bool cached = false;
                for (int ci = 0; ci < s.n_cache; ci++)
                    if (s.cache[ci].id == q->id) { s.cache[ci].live = false; cached = true; }
                if (cached) cache_evict(&s, cache_reqs);
                else s.e->vt->release(s.e, q->id);
            } else if (dspark) {
                /* draft after the verified step: the target produced position q->pos - 1 */
                int32_t ids[V41_ACC_MAXLEN + 2];
                int B = BS; /* ids = [first, d1..dB] */
                if (s.e->vt->dspark_draft_batch) {
                    int p = q->pos - 1;
                    if ((rc = s.e->vt->dspark_draft_batch(s.e, 1, &q->id, &p, &q->next, ids, NULL, &err))) goto fail;
                } else {
                    /* the single-request call returns block_size ids: first, d1..d(B-1) */
                    if ((rc = s.e->vt->dspark_draft(s.e, q->id, q->pos - 1, q->next, ids, NULL, &err))) goto fail;
                    B = BS - 1;
                }
                if (q->pos + B + 1 > max_len) B = max_len - q->pos - 1;
                if (B > 0) {
                    q->draft[0] = q->next;
                    for (int i = 1; i <= B; i++) q->draft[i] = ids[i];
                    q->n_draft = B;
                }
            }
        }
        nstep++;
        if (tty) fprintf(stderr, "\rserve-trace: step %d, %d/%d requests done", nstep, done, s.n);
    }
    if (tty) fputc('\n', stderr);

    /* ---- report */
    double ttft_sum = 0, tpot_sum = 0;
    int tpot_n = 0;
    int64_t acc = 0, drafted = 0, ver = 0;
    for (int i = 0; i < s.n; i++) {
        sreq *q = &s.rq[i];
        ttft_sum += q->t_first - q->t_arrive;
        if (q->n_gen > 1) { tpot_sum += (q->t_done - q->t_first) / (q->n_gen - 1); tpot_n++; }
        acc += q->accepted;
        drafted += q->drafted;
        ver += q->verify_steps;
    }
    printf("serve-trace: model %s, engine %s, %d requests, %d steps, %lld rows, %.3f s busy\n", m->source, eng, s.n,
           nstep, (long long)rows_total, busy);
    printf("  prefix cache: %lld tokens hit, %lld replayed rows (replay %s); %lld prompt rows trimmed after the cut\n",
           (long long)hit_total, (long long)replay_rows, replay ? "on" : "off", (long long)trimmed_rows);
    printf("  mean TTFT %.4f s, mean TPOT %.4f s\n", ttft_sum / s.n, tpot_n ? tpot_sum / tpot_n : 0.0);
    if (dspark)
        printf("  DSpark: %lld verify steps, %lld drafted, %lld accepted (mean acceptance length %.3f incl. bonus)\n",
               (long long)ver, (long long)drafted, (long long)acc, ver ? 1.0 + (double)acc / ver : 0.0);
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "schema", "v41-serve-trace/1");
        cJSON_AddStringToObject(j, "model", m->source);
        cJSON_AddStringToObject(j, "engine", eng);
        cJSON_AddStringToObject(j, "trace", trace ? trace : synth);
        cJSON_AddBoolToObject(j, "replay", replay);
        cJSON_AddBoolToObject(j, "dspark", dspark);
        cJSON_AddNumberToObject(j, "len_scale", scale);
        cJSON_AddNumberToObject(j, "block", block);
        cJSON_AddNumberToObject(j, "token_budget", budget);
        cJSON_AddNumberToObject(j, "busy_s", busy);
        cJSON_AddNumberToObject(j, "rows", (double)rows_total);
        cJSON_AddNumberToObject(j, "hit_tokens", (double)hit_total);
        cJSON_AddNumberToObject(j, "replay_rows", (double)replay_rows);
        cJSON_AddNumberToObject(j, "trimmed_rows", (double)trimmed_rows);
        cJSON *h = cJSON_AddArrayToObject(j, "accepted_hist");
        if (dspark)
            for (int k = 0; k <= BS; k++) cJSON_AddItemToArray(h, cJSON_CreateNumber((double)hist[k]));
        cJSON *rj = cJSON_AddArrayToObject(j, "requests");
        for (int i = 0; i < s.n; i++) {
            sreq *q = &s.rq[i];
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "id", q->id);
            cJSON_AddNumberToObject(o, "line", (double)q->line);
            cJSON_AddNumberToObject(o, "in_len", q->in_len);
            cJSON_AddNumberToObject(o, "out_len", q->out_len);
            cJSON_AddNumberToObject(o, "hit", q->hit);
            cJSON_AddNumberToObject(o, "ttft_s", q->t_first - q->t_arrive);
            cJSON_AddNumberToObject(o, "e2e_s", q->t_done - q->t_arrive);
            cJSON_AddNumberToObject(o, "verify_steps", (double)q->verify_steps);
            cJSON_AddNumberToObject(o, "drafted", (double)q->drafted);
            cJSON_AddNumberToObject(o, "n_accepted", (double)q->accepted);
            cJSON *tk = cJSON_AddArrayToObject(o, "output_ids");
            for (int t = 0; t < q->n_gen; t++) cJSON_AddItemToArray(tk, cJSON_CreateNumber(q->tok[q->in_len + t]));
            cJSON_AddItemToArray(rj, o);
        }
        cJSON_AddItemToObject(j, "steps", steps_j);
        steps_j = NULL;
        rc = write_json_file(json, j, &err);
        cJSON_Delete(j);
    }
fail:
    free(br);
    free(bq);
    cJSON_Delete(steps_j);
    for (int i = 0; i < s.n_cache; i++) free(s.cache[i].hash);
    free(s.cache);
    if (s.rq)
        for (int i = 0; i < s.n; i++) { free(s.rq[i].tok); free(s.rq[i].hash); }
    free(s.rq);
    v41_engine_destroy(s.e);
    v41_trace_close(tr);
    v41_model_free(m);
    if (rc) {
        fprintf(stderr, "v41 serve-trace: %s\n", err.msg);
        return 2;
    }
    return 0;
}
