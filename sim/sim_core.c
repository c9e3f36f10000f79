/* sim_core.c: discrete-event simulation of continuous-batching replicas
 * (README.md, section 'Simulator' "Scheduler", "Prefix cache", "Replay", "DSpark").
 *
 * Events: request arrivals (read one at a time from the trace) and step
 * completions (one per busy replica). A step is built at its start time:
 *   1. decode priority: every running request past its prefill gets its row
 *      (1 + drafts when DSpark verifies) while the token budget lasts;
 *   2. chunked prefill: running prefills in admission order, then new
 *      admissions from the FIFO queue while budget, max_seqs and KV memory
 *      allow; each gets min(remaining rows, budget left).
 * Its duration is the cost model's time for exactly that batch. Requests
 * finish at the end of the step that produces their last token. */
#include "v41_sim.h"
#include "sim_internal.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ST_WAIT = 0, ST_PREFILL, ST_DECODE };
enum { M_RING = 0, M_COMP, M_INDEX, M_STATE, M_DSPARK, M_PWIN, M_N };

typedef struct sreq {
    int64_t id, line;
    double t_arrive, t_admit, t_first;
    int64_t in_len, out_len;
    int n_hash;
    int64_t *hash;
    int64_t hit, floor, pos, gen, n_full;
    int n_pin;               /* blocks [0, n_pin) of hash are pinned in the cache */
    int state;
    bool has_draft;
    double acc_frac;         /* fixed acceptance: fractional carry */
    double priv[M_N];
    int64_t computed_rows, replay_rows, trimmed_rows, verify_steps, drafted, accepted;
    struct sreq *next;
} sreq;

/* ---------------------------------------------------------------- prefix cache */

typedef struct blk {
    int64_t key;
    int32_t ref, prev, next;  /* LRU links (only while ref == 0) */
} blk;

typedef struct pcache {
    blk *pool;
    int32_t n_pool, cap_pool, free_head;
    int32_t *map;            /* open addressing, linear probing, -1 empty */
    uint32_t map_cap, map_n;
    int32_t lru_head, lru_tail;   /* head = least recently used */
    int64_t n_blocks;
} pcache;

static uint32_t hkey(int64_t k)
{
    uint64_t x = (uint64_t)k;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33;
    return (uint32_t)x;
}

static int pc_find(const pcache *c, int64_t key)
{
    if (!c->map_cap) return -1;
    uint32_t mask = c->map_cap - 1;
    for (uint32_t i = hkey(key) & mask;; i = (i + 1) & mask) {
        int32_t b = c->map[i];
        if (b < 0) return -1;
        if (c->pool[b].key == key) return b;
    }
}

static int pc_map_insert(pcache *c, int32_t b)
{
    if ((c->map_n + 1) * 2 > c->map_cap) {
        uint32_t nc = c->map_cap ? c->map_cap * 2 : 1024;
        int32_t *nm = malloc(nc * sizeof *nm);
        if (!nm) return -1;
        memset(nm, 0xff, nc * sizeof *nm);
        for (uint32_t i = 0; i < c->map_cap; i++)
            if (c->map[i] >= 0) {
                uint32_t j = hkey(c->pool[c->map[i]].key) & (nc - 1);
                while (nm[j] >= 0) j = (j + 1) & (nc - 1);
                nm[j] = c->map[i];
            }
        free(c->map);
        c->map = nm;
        c->map_cap = nc;
    }
    uint32_t mask = c->map_cap - 1, i = hkey(c->pool[b].key) & mask;
    while (c->map[i] >= 0) i = (i + 1) & mask;
    c->map[i] = b;
    c->map_n++;
    return 0;
}

/* deletion with backward shift (no tombstones) */
static void pc_map_remove(pcache *c, int32_t b)
{
    uint32_t mask = c->map_cap - 1, i = hkey(c->pool[b].key) & mask;
    while (c->map[i] != b) i = (i + 1) & mask;
    for (uint32_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        if (c->map[j] < 0) break;
        uint32_t h = hkey(c->pool[c->map[j]].key) & mask;
        /* move j back to i when its home h is not in (i, j] (cyclically) */
        if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) {
            c->map[i] = c->map[j];
            i = j;
        }
    }
    c->map[i] = -1;
    c->map_n--;
}

static void lru_unlink(pcache *c, int32_t b)
{
    blk *x = &c->pool[b];
    if (x->prev >= 0) c->pool[x->prev].next = x->next; else c->lru_head = x->next;
    if (x->next >= 0) c->pool[x->next].prev = x->prev; else c->lru_tail = x->prev;
    x->prev = x->next = -1;
}

static void lru_push(pcache *c, int32_t b)
{
    blk *x = &c->pool[b];
    x->prev = c->lru_tail;
    x->next = -1;
    if (c->lru_tail >= 0) c->pool[c->lru_tail].next = b; else c->lru_head = b;
    c->lru_tail = b;
}

static int32_t pc_new(pcache *c, int64_t key)
{
    int32_t b;
    if (c->free_head >= 0) {
        b = c->free_head;
        c->free_head = c->pool[b].next;
    } else {
        if (c->n_pool == c->cap_pool) {
            int32_t nc = c->cap_pool ? c->cap_pool * 2 : 1024;
            blk *np = realloc(c->pool, (size_t)nc * sizeof *np);
            if (!np) return -1;
            c->pool = np;
            c->cap_pool = nc;
        }
        b = c->n_pool++;
    }
    c->pool[b] = (blk){key, 1, -1, -1};
    if (pc_map_insert(c, b)) return -1;
    c->n_blocks++;
    return b;
}

static void pc_free(pcache *c, int32_t b)
{
    pc_map_remove(c, b);
    c->pool[b].next = c->free_head;
    c->pool[b].ref = -1;
    c->free_head = b;
    c->n_blocks--;
}

/* ---------------------------------------------------------------- replicas */

typedef struct replica {
    int idx;
    sreq **run;
    int n_run;
    sreq *wq_head, *wq_tail;
    int n_wait;
    bool busy;
    double t_end;            /* end of the current step */
    /* current step */
    v41_sim_item *items;
    sreq **ireq;
    int *idraft;
    int n_items, cap_items;
    double priv[M_N];
    pcache pc;
    double last_sample;
    v41_rng rng;
} replica;

typedef struct sim {
    const v41_sim_opts *o;
    const v41_sim_sinks *sinks;
    v41_sim_result *res;
    v41_cost_model *cm;
    v41_kv_bytes kb;
    double blk_bytes[3];     /* per cached block: comp, index, window (replay enc off) */
    double cap;
    int64_t W, lcm;
    replica *rep;
    int rr;
    int64_t next_id;
} sim;

static double used_total(const sim *s, const replica *r)
{
    double u = 0;
    for (int k = 0; k < M_N; k++) u += r->priv[k];
    return u + (double)r->pc.n_blocks * (s->blk_bytes[0] + s->blk_bytes[1] + s->blk_bytes[2]);
}

static int emit_kv(sim *s, replica *r, double t)
{
    v41_sim_result *res = s->res;
    double cb = (double)r->pc.n_blocks;
    double tot = used_total(s, r);
    double cache = cb * (s->blk_bytes[0] + s->blk_bytes[1] + s->blk_bytes[2]);
#define PK(f, v) if ((v) > res->f) res->f = (v)
    PK(peak_window, r->priv[M_RING] + r->priv[M_PWIN]);
    PK(peak_comp, r->priv[M_COMP]);
    PK(peak_index, r->priv[M_INDEX]);
    PK(peak_state, r->priv[M_STATE]);
    PK(peak_dspark, r->priv[M_DSPARK]);
    PK(peak_cache, cache);
    PK(peak_total, tot);
#undef PK
    if (!s->sinks || !s->sinks->on_kv) return 0;
    if (t - r->last_sample < s->o->sample_dt && r->last_sample >= 0) return 0;
    r->last_sample = t;
    v41_sim_kv_sample k = {t, r->idx, r->n_run, r->n_wait,
                           r->priv[M_RING] + r->priv[M_PWIN], r->priv[M_COMP], r->priv[M_INDEX], r->priv[M_STATE],
                           r->priv[M_DSPARK], cb * s->blk_bytes[0], cb * s->blk_bytes[1], cb * s->blk_bytes[2], s->cap};
    return s->sinks->on_kv(s->sinks->ud, &k);
}

static int finish(sim *s, replica *r, sreq *q, double t, int status)
{
    v41_sim_result *res = s->res;
    /* release: unpin blocks, free private bytes */
    for (int i = 0; i < q->n_pin; i++) {
        int32_t b = pc_find(&r->pc, q->hash[i]);
        if (b >= 0 && --r->pc.pool[b].ref == 0) lru_push(&r->pc, b);
    }
    for (int k = 0; k < M_N; k++) r->priv[k] -= q->priv[k];
    v41_sim_req_out o = {0};
    o.id = q->id;
    o.line = q->line;
    o.replica = r->idx;
    o.status = status;
    o.t_arrive = q->t_arrive;
    o.t_admit = q->t_admit;
    o.t_first = q->t_first;
    o.t_finish = t;
    o.in_len = q->in_len;
    o.out_len = q->out_len;
    o.hit_tokens = q->hit;
    o.computed_rows = q->computed_rows;
    o.replay_rows = q->replay_rows;
    o.trimmed_rows = q->trimmed_rows;
    o.verify_steps = q->verify_steps;
    o.drafted = q->drafted;
    o.accepted = q->accepted;
    res->events++;
    if (status == 0) {
        o.ttft = q->t_first - q->t_arrive;
        o.e2e = t - q->t_arrive;
        o.tpot = q->out_len > 1 ? (t - q->t_first) / (double)(q->out_len - 1) : 0;
        v41_hist_add(&res->ttft, o.ttft);
        v41_hist_add(&res->e2e, o.e2e);
        if (q->out_len > 1) v41_hist_add(&res->tpot, o.tpot);
        res->n_finished++;
        res->out_tokens += q->out_len;
        if (t > res->sim_end_s) res->sim_end_s = t;
    } else {
        res->n_rejected++;
    }
    res->hit_tokens += q->hit;
    res->computed_rows += q->computed_rows;
    res->replay_rows += q->replay_rows;
    res->verify_steps += q->verify_steps;
    res->drafted += q->drafted;
    res->accepted += q->accepted;
    int rc = s->sinks && s->sinks->on_request ? s->sinks->on_request(s->sinks->ud, &o) : 0;
    free(q->hash);
    free(q);
    return rc;
}

/* Try to admit the head of the queue: prefix lookup, memory reservation. 1 = admitted,
 * 0 = must wait, 2 = rejected (can never fit). */
static int admit(sim *s, replica *r, sreq *q, double now)
{
    const v41_sim_opts *o = s->o;
    pcache *pc = &r->pc;
    int64_t bs = o->block_tokens;
    q->n_full = q->n_hash < q->in_len / bs ? q->n_hash : q->in_len / bs;
    int hits = 0;
    while (hits < q->n_full && pc_find(pc, q->hash[hits]) >= 0) hits++;
    s->res->cache_lookups_blocks += q->n_full;
    int64_t H = (int64_t)hits * bs;
    if (H > q->in_len - 1) H = q->in_len - 1;        /* at least one row computes the logits */
    H -= H % s->lcm;                                  /* hits at multiples of every compress ratio (SPEC §7) */
    int64_t floor = 0;
    if (o->replay_enc) {
        if (H <= s->W) H = 0;                         /* hits <= W are not used */
        else floor = H - s->W;                        /* replay the last window */
    }
    int use = H > 0 ? hits : 0;
    /* private bytes at the full length; cached blocks are shared */
    int64_t total = q->in_len + q->out_len;
    double p[M_N] = {0};
    double ring = (double)(total < s->W ? total : s->W);
    p[M_RING] = ring * s->kb.window_row;
    p[M_COMP] = (double)(total - (int64_t)use * bs) * s->kb.comp_tok;
    p[M_INDEX] = (double)(total - (int64_t)use * bs) * s->kb.index_tok;
    p[M_STATE] = s->kb.state_req;
    p[M_DSPARK] = o->draft_len > 0 ? ring * s->kb.dspark_row : 0;
    if (!o->replay_enc) p[M_PWIN] = (double)((q->n_full - use) * bs) * s->kb.window_row;
    double need = 0;
    for (int k = 0; k < M_N; k++) need += p[k];
    /* pin the hit blocks first so eviction cannot take them */
    for (int i = 0; i < use; i++) {
        int32_t b = pc_find(pc, q->hash[i]);
        if (pc->pool[b].ref++ == 0) lru_unlink(pc, b);
    }
    double used = used_total(s, r);
    double bb = s->blk_bytes[0] + s->blk_bytes[1] + s->blk_bytes[2];
    while (used + need > s->cap && pc->lru_head >= 0) {
        int32_t b = pc->lru_head;
        lru_unlink(pc, b);
        pc_free(pc, b);
        s->res->evictions++;
        used -= bb;
    }
    if (used + need > s->cap) {
        for (int i = 0; i < use; i++) {   /* unpin */
            int32_t b = pc_find(pc, q->hash[i]);
            if (--pc->pool[b].ref == 0) lru_push(pc, b);
        }
        return r->n_run == 0 ? 2 : 0;
    }
    s->res->cache_hit_blocks += use;
    q->n_pin = use;
    q->hit = H;
    q->floor = floor;
    q->pos = o->replay_enc ? floor : H;
    q->replay_rows = H - q->pos;
    for (int k = 0; k < M_N; k++) {
        q->priv[k] = p[k];
        r->priv[k] += p[k];
    }
    q->t_admit = now;
    q->state = ST_PREFILL;
    return 1;
}

/* Prefill done: full prompt blocks enter the cache (their bytes move from the request). */
static int publish_blocks(sim *s, replica *r, sreq *q)
{
    pcache *pc = &r->pc;
    int64_t bs = s->o->block_tokens;
    for (int64_t i = q->n_pin; i < q->n_full; i++) {
        int32_t b = pc_find(pc, q->hash[i]);
        if (b >= 0) {
            if (pc->pool[b].ref++ == 0) lru_unlink(pc, b);
        } else if (pc_new(pc, q->hash[i]) < 0) {
            return -1;
        }
        double mv[M_N] = {0};
        mv[M_COMP] = (double)bs * s->kb.comp_tok;
        mv[M_INDEX] = (double)bs * s->kb.index_tok;
        if (!s->o->replay_enc) mv[M_PWIN] = (double)bs * s->kb.window_row;
        for (int k = 0; k < M_N; k++) {
            q->priv[k] -= mv[k];
            r->priv[k] -= mv[k];
        }
        q->n_pin = (int)i + 1;
    }
    return 0;
}

static int accepted_drafts(sim *s, replica *r, sreq *q, int L)
{
    const v41_accept *a = &s->o->accept;
    int k = 0;
    switch (a->kind) {
    case V41_ACC_FIXED:
        q->acc_frac += a->p * L;
        k = (int)floor(q->acc_frac + 1e-9);
        q->acc_frac -= k;
        break;
    case V41_ACC_GEOM:
        while (k < L && v41_rng_unif(&r->rng) < a->p) k++;
        break;
    default: {
        double u = v41_rng_unif(&r->rng), c = 0;
        k = a->pmf_len - 1;
        for (int i = 0; i < a->pmf_len; i++) {
            c += a->pmf[i];
            if (u < c) { k = i; break; }
        }
        break;
    }
    }
    return k > L ? L : k;
}

static int push_item(replica *r, sreq *q, const v41_sim_item *it, int L)
{
    if (r->n_items == r->cap_items) {
        int nc = r->cap_items ? r->cap_items * 2 : 64;
        v41_sim_item *ni = realloc(r->items, (size_t)nc * sizeof *ni);
        if (!ni) return -1;
        r->items = ni;
        sreq **nq = realloc(r->ireq, (size_t)nc * sizeof *nq);
        if (!nq) return -1;
        r->ireq = nq;
        int *nd = realloc(r->idraft, (size_t)nc * sizeof *nd);
        if (!nd) return -1;
        r->idraft = nd;
        r->cap_items = nc;
    }
    r->items[r->n_items] = *it;
    r->ireq[r->n_items] = q;
    r->idraft[r->n_items] = L;
    r->n_items++;
    return 0;
}

/* Build and start a step at time now (replica idle). */
static int start_step(sim *s, replica *r, double now, v41_err *err)
{
    const v41_sim_opts *o = s->o;
    int64_t budget = o->token_budget;
    r->n_items = 0;
    /* 1. decode priority */
    for (int i = 0; i < r->n_run && budget > 0; i++) {
        sreq *q = r->run[i];
        if (q->state != ST_DECODE) continue;
        int L = 0;
        if (o->draft_len > 0 && q->has_draft) {
            int64_t left = q->out_len - q->gen - 1;
            L = (int)(left < o->draft_len ? left : o->draft_len);
        }
        if (1 + L > budget) continue;
        int64_t p = q->in_len + q->gen - 1;
        v41_sim_item it = {L > 0 ? V41_ITEM_VERIFY : V41_ITEM_DECODE, p, p + 1 + L, 0, 0, false, true};
        if (push_item(r, q, &it, L)) goto oom;
        budget -= 1 + L;
    }
    /* 2. running prefills, then admissions */
    for (int i = 0; i < r->n_run && budget > 0; i++) {
        sreq *q = r->run[i];
        if (q->state != ST_PREFILL) continue;
        int64_t n = q->in_len - q->pos;
        if (n > budget) n = budget;
        v41_sim_item it = {V41_ITEM_PREFILL, q->pos, q->pos + n, q->floor, q->hit, o->replay_dec,
                           q->pos + n == q->in_len};
        if (push_item(r, q, &it, 0)) goto oom;
        budget -= n;
    }
    while (budget > 0 && r->wq_head && r->n_run < o->max_seqs) {
        sreq *q = r->wq_head;
        int a = admit(s, r, q, now);
        if (a == 0) break;
        r->wq_head = q->next;
        if (!r->wq_head) r->wq_tail = NULL;
        r->n_wait--;
        if (a == 2) {
            if (finish(s, r, q, now, 1)) return v41_err_set(err, V41_EIO, "output sink failed");
            continue;
        }
        r->run[r->n_run++] = q;
        int64_t n = q->in_len - q->pos;
        if (n > budget) n = budget;
        v41_sim_item it = {V41_ITEM_PREFILL, q->pos, q->pos + n, q->floor, q->hit, o->replay_dec,
                           q->pos + n == q->in_len};
        if (push_item(r, q, &it, 0)) goto oom;
        budget -= n;
    }
    if (r->n_items == 0) {
        r->busy = false;
        return 0;
    }
    v41_step_cost c;
    v41_cost_step(s->cm, r->items, r->n_items, o->draft_len, &c);
    v41_sim_result *res = s->res;
    res->steps++;
    res->events++;
    res->flops += c.flops;
    res->bytes += c.bytes;
    res->trimmed_flops += c.trimmed_flops;
    res->trimmed_layer_rows += c.trimmed_layer_rows;
    res->draft_flops += c.draft_flops;
    res->busy_s += c.time_s;
    for (int k = 0; k < V41_OP_NCLASS; k++) {
        res->flops_c[k] += c.flops_c[k];
        res->time_c[k] += c.time_s > 0 ? c.time_c[k] : 0;
    }
    r->busy = true;
    r->t_end = now + c.time_s;
    return 0;
oom:
    return v41_err_set(err, V41_ENOMEM, "out of memory");
}

/* The step of replica r ends at r->t_end: apply its outcome. */
static int end_step(sim *s, replica *r, v41_err *err)
{
    double t = r->t_end;
    int64_t W = s->W;
    for (int i = 0; i < r->n_items; i++) {
        sreq *q = r->ireq[i];
        const v41_sim_item *it = &r->items[i];
        if (it->kind == V41_ITEM_PREFILL) {
            int64_t n = it->end - it->start;
            q->computed_rows += n;
            if (it->trim && n > W) q->trimmed_rows += n - W;
            q->pos = it->end;
            if (q->pos == q->in_len) {
                q->t_first = t;
                q->gen = 1;
                q->state = ST_DECODE;
                q->has_draft = false;
                if (publish_blocks(s, r, q)) return v41_err_set(err, V41_ENOMEM, "out of memory");
            }
        } else {
            int L = r->idraft[i];
            int a = L > 0 ? accepted_drafts(s, r, q, L) : 0;
            if (L > 0) {
                q->verify_steps++;
                q->drafted += L;
                q->accepted += a;
            }
            q->gen += a + 1;
            if (q->gen > q->out_len) q->gen = q->out_len;
            q->has_draft = true;   /* the drafter ran in this step for the next one */
        }
    }
    /* finished requests leave, keeping admission order */
    int k = 0;
    for (int i = 0; i < r->n_run; i++) {
        sreq *q = r->run[i];
        if (q->state == ST_DECODE && q->gen >= q->out_len) {
            if (finish(s, r, q, t, 0)) return v41_err_set(err, V41_EIO, "output sink failed");
        } else {
            r->run[k++] = q;
        }
    }
    r->n_run = k;
    r->busy = false;
    if (emit_kv(s, r, t)) return v41_err_set(err, V41_EIO, "output sink failed");
    return 0;
}

static int route(sim *s)
{
    const v41_sim_opts *o = s->o;
    if (o->replicas <= 1) return 0;
    if (o->router == V41_ROUTE_RR) return s->rr++ % o->replicas;
    int best = 0;
    for (int i = 1; i < o->replicas; i++)
        if (s->rep[i].n_run + s->rep[i].n_wait < s->rep[best].n_run + s->rep[best].n_wait) best = i;
    return best;
}

static int64_t gcd64(int64_t a, int64_t b) { while (b) { int64_t t = a % b; a = b; b = t; } return a; }

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void v41_sim_opts_default(v41_sim_opts *o)
{
    memset(o, 0, sizeof *o);
    v41_hw_h200(&o->hw);
    o->replay_enc = o->replay_dec = true;
    o->accept.kind = V41_ACC_GEOM;
    o->accept.p = 0.8;
    o->replicas = 1;
    o->router = V41_ROUTE_LEAST;
    o->token_budget = 8192;
    o->max_seqs = 256;
    o->kv_capacity = 0;
    o->block_tokens = 512;
    o->seed = 1;
    o->sample_dt = 1.0;
}

static void progress(const sim *s, v41_trace *tr, double now, int64_t nread, bool final)
{
    double f = v41_trace_progress(tr);
    if (f < 0) f = 0;
    if (s->o->limit > 0 && (double)nread / (double)s->o->limit > f) f = (double)nread / (double)s->o->limit;
    if (f > 1) f = 1;
    int w = 30, k = (int)(f * w + 0.5);
    char bar[64];
    for (int i = 0; i < w; i++) bar[i] = i < k ? '#' : '.';
    bar[w] = 0;
    fprintf(stderr, "\rsim [%s] %3.0f%%  t=%.0fs  done=%lld  steps=%lld%s", bar, f * 100, now,
            (long long)(s->res->n_finished + s->res->n_rejected), (long long)s->res->steps, final ? "\n" : "");
    fflush(stderr);
}

int v41_sim_run(const v41_sim_opts *o, v41_trace *tr, const v41_sim_sinks *sinks, v41_sim_result *res, v41_err *err)
{
    memset(res, 0, sizeof *res);
    v41_hist_init(&res->ttft);
    v41_hist_init(&res->tpot);
    v41_hist_init(&res->e2e);
    double w0 = wall_now();
    sim S = {0};
    sim *s = &S;
    s->o = o;
    s->sinks = sinks;
    s->res = res;
    if (o->replicas < 1 || o->token_budget < 1 || o->max_seqs < 1 || o->block_tokens < 1)
        return v41_err_set(err, V41_EINVAL, "replicas, token budget, max seqs and block size must be >= 1");
    if (o->draft_len < 0 || o->draft_len > V41_ACC_MAXLEN)
        return v41_err_set(err, V41_EINVAL, "draft length must be 0..%d", V41_ACC_MAXLEN);
    if (o->draft_len > 0 && o->cfg.n_mtp_layers < 1)
        return v41_err_set(err, V41_EINVAL, "--dspark needs a model with DSpark stages (n_mtp_layers > 0)");
    if (o->draft_len > 0 && o->cfg.dspark_block_size > 0 && o->draft_len > o->cfg.dspark_block_size)
        return v41_err_set(err, V41_EINVAL, "--dspark %d: one draft block yields at most dspark_block_size = %d drafts",
                           o->draft_len, o->cfg.dspark_block_size);
    v41_hw hw = o->hw;
    /* GPUs per replica: the weights must fit in 60% of the HBM (README.md, section 'Simulator') */
    {
        v41_cost_model *tmp;
        int rc = v41_cost_create(&o->cfg, &hw, o->profile, &tmp, err);
        if (rc) return rc;
        v41_cost_kv_bytes(tmp, &s->kb);
        v41_cost_destroy(tmp);
        if (hw.gpus <= 0) {
            hw.gpus = 1;
            while (s->kb.weights > 0.6 * hw.gpus * hw.hbm_bytes && hw.gpus < 1024) hw.gpus *= 2;
        }
    }
    res->gpus = hw.gpus;
    int rc = v41_cost_create(&o->cfg, &hw, o->profile, &s->cm, err);
    if (rc) return rc;
    v41_cost_set_calib(s->cm, o->calib);
    s->cap = o->kv_capacity > 0 ? o->kv_capacity : hw.gpus * hw.hbm_bytes * 0.9 - s->kb.weights;
    res->capacity = s->cap;
    s->W = o->cfg.window_size;
    s->lcm = 1;
    for (int l = 0; l < o->cfg.n_layers; l++) {
        int64_t m = o->cfg.compress_ratios[l];
        if (m > 0) s->lcm = s->lcm / gcd64(s->lcm, m) * m;
    }
    s->blk_bytes[0] = (double)o->block_tokens * s->kb.comp_tok;
    s->blk_bytes[1] = (double)o->block_tokens * s->kb.index_tok;
    s->blk_bytes[2] = o->replay_enc ? 0 : (double)o->block_tokens * s->kb.window_row;
    s->rep = calloc((size_t)o->replicas, sizeof *s->rep);
    if (!s->rep) { v41_cost_destroy(s->cm); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    for (int i = 0; i < o->replicas; i++) {
        replica *r = &s->rep[i];
        r->idx = i;
        r->run = calloc((size_t)o->max_seqs, sizeof *r->run);
        r->pc.free_head = r->pc.lru_head = r->pc.lru_tail = -1;
        r->last_sample = -1;
        v41_rng_seed(&r->rng, o->seed * 1000003ULL + (uint64_t)i);
        if (!r->run) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto out; }
    }
    v41_trace_rec rec;
    bool eof = false;
    int64_t nread = 0;
    if ((rc = v41_trace_next(tr, &rec, &eof, err))) goto out;
    double last_prog = w0, now = 0;
    for (;;) {
        if (!eof && o->limit > 0 && nread >= o->limit) eof = true;
        double t_arr = eof ? INFINITY : rec.t_arrive;
        int ri = -1;
        for (int i = 0; i < o->replicas; i++)
            if (s->rep[i].busy && (ri < 0 || s->rep[i].t_end < s->rep[ri].t_end)) ri = i;
        double t_step = ri >= 0 ? s->rep[ri].t_end : INFINITY;
        if (eof && ri < 0) break;
        if (t_arr <= t_step) {
            now = t_arr;
            sreq *q = calloc(1, sizeof *q);
            if (!q) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto out; }
            q->id = s->next_id++;
            q->line = rec.line;
            q->t_arrive = rec.t_arrive;
            q->in_len = rec.in_len;
            q->out_len = rec.out_len;
            q->n_hash = rec.n_hash;
            if (rec.n_hash) {
                q->hash = malloc((size_t)rec.n_hash * sizeof *q->hash);
                if (!q->hash) { free(q); rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto out; }
                memcpy(q->hash, rec.hash, (size_t)rec.n_hash * sizeof *q->hash);
            }
            res->n_requests++;
            res->in_tokens += q->in_len;
            res->events++;
            nread++;
            replica *r = &s->rep[route(s)];
            if (r->wq_tail) r->wq_tail->next = q; else r->wq_head = q;
            r->wq_tail = q;
            r->n_wait++;
            if ((rc = v41_trace_next(tr, &rec, &eof, err))) goto out;
            if (!eof && o->limit > 0 && nread >= o->limit) eof = true;
            /* start idle replicas once every arrival of this instant is queued */
            if (eof || rec.t_arrive > now)
                for (int i = 0; i < o->replicas; i++)
                    if (!s->rep[i].busy && (s->rep[i].wq_head || s->rep[i].n_run) &&
                        (rc = start_step(s, &s->rep[i], now, err)))
                        goto out;
        } else {
            now = t_step;
            replica *r = &s->rep[ri];
            if ((rc = end_step(s, r, err))) goto out;
            if ((rc = start_step(s, r, now, err))) goto out;
            /* nothing runs but requests wait: the head can never fit */
            while (!r->busy && r->wq_head && r->n_run == 0) {
                sreq *q = r->wq_head;
                r->wq_head = q->next;
                if (!r->wq_head) r->wq_tail = NULL;
                r->n_wait--;
                if (finish(s, r, q, now, 1)) { rc = v41_err_set(err, V41_EIO, "output sink failed"); goto out; }
                if ((rc = start_step(s, r, now, err))) goto out;
            }
        }
        if (o->progress && (res->events & 4095) == 0) {
            double w = wall_now();
            if (w - last_prog > 0.25) {
                progress(s, tr, now, nread, false);
                last_prog = w;
            }
        }
    }
    if (o->progress) progress(s, tr, now, nread, true);
    res->skipped_rows = v41_trace_skipped(tr);
out:
    for (int i = 0; s->rep && i < o->replicas; i++) {
        replica *r = &s->rep[i];
        for (int k = 0; k < r->n_run; k++) { free(r->run[k]->hash); free(r->run[k]); }
        for (sreq *q = r->wq_head, *nx; q; q = nx) { nx = q->next; free(q->hash); free(q); }
        free(r->run);
        free(r->items);
        free(r->ireq);
        free(r->idraft);
        free(r->pc.pool);
        free(r->pc.map);
    }
    free(s->rep);
    v41_cost_destroy(s->cm);
    res->wall_s = wall_now() - w0;
    return rc;
}

/* ---------------------------------------------------------------- acceptance */

int v41_accept_parse(const char *spec, v41_accept *a, v41_err *err)
{
    memset(a, 0, sizeof *a);
    char *e;
    if (!strncmp(spec, "fixed:", 6) || !strncmp(spec, "geom:", 5)) {
        bool fx = spec[0] == 'f';
        const char *v = spec + (fx ? 6 : 5);
        double p = strtod(v, &e);
        if (e == v || *e || !(p >= 0 && p <= 1))
            return v41_err_set(err, V41_EINVAL, "--accept %s: probability must be in [0, 1]", spec);
        a->kind = fx ? V41_ACC_FIXED : V41_ACC_GEOM;
        a->p = p;
        return V41_OK;
    }
    if (!strncmp(spec, "file:", 5)) return v41_accept_load(spec + 5, a, err);
    return v41_err_set(err, V41_EINVAL, "--accept %s: expected fixed:P, geom:P or file:SERVE_TRACE.json", spec);
}
