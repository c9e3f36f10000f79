/* engine.c: the CPU reference engine of the DeepSeek-V4.1 forward pass
 * (SPEC.md §2-§8) behind the v41_engine interface.
 *
 * One forward runs a ragged batch: rows are the requests' tokens concatenated
 * in batch order. Every op works row by row (or on fixed row tiles, see
 * ops.c), so a row's bits never depend on the other rows of the forward:
 * chunked prefill == one-shot prefill and decode at p == prefill to p+1.
 * Per-request caches (window KV history, compressor state, compressed KV,
 * index keys, engram token history, DSpark window KV) live in req_state. */
#include "config.h"
#include "engine_impl.h"
#include "engine_serving.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CK(x)                    \
    do {                         \
        int rc_ = (x);           \
        if (rc_) return rc_;     \
    } while (0)

void v41_engine_opts_default(v41_engine_opts *o)
{
    memset(o, 0, sizeof *o);
    o->precision = V41_PREC_EMULATE;
    o->compat = V41_COMPAT_FIXED;
    o->replay = true;
}

/* ------------------------------------------------------------------ weights */

static const v41_tensor *find_t(const ref_engine *E, const char *name)
{
    return v41_weights_find(E->e.model->w, name);
}

static int get_t(const ref_engine *E, const char *name, const v41_tensor **t, v41_err *err)
{
    *t = find_t(E, name);
    if (!*t) return v41_err_set(err, V41_ENOTFOUND, "missing tensor %s", name);
    return V41_OK;
}

/* Small vectors (norm weights, biases, sinks) are copied to fp32 once. */
static int load_vec(const ref_engine *E, const char *name, int64_t n, float **out, v41_err *err)
{
    const v41_tensor *t;
    CK(get_t(E, name, &t, err));
    int64_t cnt = 1;
    for (int i = 0; i < t->ndim; i++) cnt *= t->shape[i];
    if (cnt != n) return v41_err_set(err, V41_EINVAL, "%s: expected %lld elements, got %lld", name, (long long)n, (long long)cnt);
    v41_tensor flat = *t;
    flat.ndim = 1;
    flat.shape[0] = n;
    *out = malloc(sizeof(float) * (size_t)n);
    if (!*out) return v41_err_set(err, V41_ENOMEM, "out of memory");
    return v41_dequant_rows(&flat, NULL, 0, 1, *out, err);
}

static int load_lin(const ref_engine *E, const char *base, int64_t N, int64_t K, v41_lin_kind kind, v41_lin *L,
                    v41_err *err)
{
    char nm[256];
    snprintf(nm, sizeof nm, "%s.weight", base);
    memset(L, 0, sizeof *L);
    if (!find_t(E, nm) && find_t(E, base)) snprintf(nm, sizeof nm, "%s", base); /* e.g. hc_attn_fn */
    CK(get_t(E, nm, &L->w, err));
    if (L->w->ndim != 2 || L->w->shape[0] != N || L->w->shape[1] != K)
        return v41_err_set(err, V41_EINVAL, "%s: expected shape [%lld, %lld], got [%lld, %lld]", nm, (long long)N,
                           (long long)K, (long long)(L->w->ndim > 0 ? L->w->shape[0] : -1),
                           (long long)(L->w->ndim > 1 ? L->w->shape[1] : -1));
    if (L->w->dtype == V41_DT_F8_E4M3 || L->w->dtype == V41_DT_F4) {
        snprintf(nm, sizeof nm, "%s.scale", base);
        CK(get_t(E, nm, &L->s, err));
    }
    if (kind == V41_LIN_Q && L->w->dtype != V41_DT_F8_E4M3 && L->w->dtype != V41_DT_F4) kind = V41_LIN_BF16;
    L->N = N;
    L->K = K;
    L->kind = kind;
    return V41_OK;
}

static int load_layer(ref_engine *E, int l, v41_err *err)
{
    const v41_config *c = E->cfg;
    layer_w *W = &E->L[l];
    char p[64], nm[256];
    const int D = c->dim, hc = c->hc_mult, d = c->head_dim, H = c->n_heads;
    memset(W, 0, sizeof *W);
    W->id = l;
    W->stage = l >= c->n_layers ? l - c->n_layers : -1;
    if (W->stage >= 0) snprintf(p, sizeof p, "mtp.%d", W->stage);
    else snprintf(p, sizeof p, "layers.%d", l);
    W->ratio = c->compress_ratios[l];
    bool bb = W->stage < 0;
    W->kv_src = bb && v41_is_kv_source(c, l);
    W->idx_src = bb && v41_is_index_source(c, l);
    W->ks = W->ratio > 0 ? v41_kv_source_of(c, l) : -1;
    W->is = W->ratio > 0 ? v41_index_source_of(c, l) : -1;
    W->cand_src = W->idx_src && l == c->candidate_source_layer;
    W->cand_use = W->idx_src && c->candidate_source_layer >= 0 && c->candidate_source_layer < l;
    W->eidx = bb ? v41_engram_index(c, l) : -1;
    W->n_exp = v41_layer_n_experts(c, l);
    W->n_act = v41_layer_n_active(c, l);
    int mix = (2 + hc) * hc;
#define SUB(s) (snprintf(nm, sizeof nm, "%s.%s", p, s), nm)
    CK(load_lin(E, SUB("hc_attn_fn"), mix, (int64_t)hc * D, V41_LIN_F32, &W->hc_attn_fn, err));
    CK(load_lin(E, SUB("hc_ffn_fn"), mix, (int64_t)hc * D, V41_LIN_F32, &W->hc_ffn_fn, err));
    CK(load_vec(E, SUB("hc_attn_base"), mix, &W->hc_attn_base, err));
    CK(load_vec(E, SUB("hc_ffn_base"), mix, &W->hc_ffn_base, err));
    float *tmp;
    CK(load_vec(E, SUB("hc_attn_scale"), 3, &tmp, err));
    memcpy(W->hc_attn_scale, tmp, sizeof W->hc_attn_scale);
    free(tmp);
    CK(load_vec(E, SUB("hc_ffn_scale"), 3, &tmp, err));
    memcpy(W->hc_ffn_scale, tmp, sizeof W->hc_ffn_scale);
    free(tmp);
    CK(load_vec(E, SUB("attn_norm.weight"), D, &W->attn_norm, err));
    CK(load_vec(E, SUB("ffn_norm.weight"), D, &W->ffn_norm, err));
    CK(load_vec(E, SUB("attn.q_norm.weight"), c->q_lora_rank, &W->q_norm, err));
    CK(load_vec(E, SUB("attn.kv_norm.weight"), d, &W->kv_norm, err));
    CK(load_vec(E, SUB("attn.attn_sink"), H, &W->sink, err));
    CK(load_lin(E, SUB("attn.wq_a"), c->q_lora_rank, D, V41_LIN_Q, &W->wq_a, err));
    CK(load_lin(E, SUB("attn.wq_b"), (int64_t)H * d, c->q_lora_rank, V41_LIN_Q, &W->wq_b, err));
    CK(load_lin(E, SUB("attn.wkv"), d, D, V41_LIN_Q, &W->wkv, err));
    CK(load_lin(E, SUB("attn.wo_a"), (int64_t)c->o_groups * c->o_lora_rank, (int64_t)H * d / c->o_groups,
                V41_LIN_BF16, &W->wo_a, err));
    W->wo_a.kind = V41_LIN_BF16;
    CK(load_lin(E, SUB("attn.wo_b"), D, (int64_t)c->o_groups * c->o_lora_rank, V41_LIN_Q, &W->wo_b, err));
    if (W->kv_src) {
        CK(load_vec(E, SUB("attn.compressor.norm.weight"), d, &W->c_norm, err));
        if (W->ratio > 1) {
            CK(load_lin(E, SUB("attn.compressor.wkv"), d, D, V41_LIN_F32, &W->c_wkv, err));
            CK(load_lin(E, SUB("attn.compressor.wgate"), d, D, V41_LIN_F32, &W->c_wgate, err));
            W->c_wkv.kind = W->c_wgate.kind = V41_LIN_F32;
        } else {
            CK(load_lin(E, SUB("attn.compressor.wkv"), d, D, V41_LIN_BF16, &W->c_wkv, err));
            W->c_wkv.kind = V41_LIN_BF16;
        }
        CK(load_lin(E, SUB("attn.indexer.wk"), c->index_head_dim, d, V41_LIN_BF16, &W->i_wk, err));
        W->i_wk.kind = V41_LIN_BF16;
        CK(load_vec(E, SUB("attn.indexer.k_norm.weight"), c->index_head_dim, &W->i_knorm, err));
    }
    if (W->idx_src) {
        CK(load_lin(E, SUB("attn.indexer.wq_b"), (int64_t)c->index_n_heads * c->index_head_dim, c->q_lora_rank,
                    V41_LIN_Q, &W->i_wq_b, err));
        CK(load_lin(E, SUB("attn.indexer.weights_proj"), c->index_n_heads, D, V41_LIN_BF16, &W->i_wproj, err));
        W->i_wproj.kind = V41_LIN_BF16;
    }
    CK(load_lin(E, SUB("ffn.gate"), W->n_exp, D, V41_LIN_F32, &W->gate, err));
    W->gate.kind = V41_LIN_F32;
    CK(load_vec(E, SUB("ffn.gate.bias"), W->n_exp, &W->gate_bias, err));
    W->ex = calloc((size_t)W->n_exp, sizeof(expert_w));
    if (!W->ex) return v41_err_set(err, V41_ENOMEM, "out of memory");
    const int I = c->moe_inter_dim;
    for (int x = 0; x < W->n_exp; x++) {
        char b2[128];
        snprintf(b2, sizeof b2, "ffn.experts.%d.w1", x);
        CK(load_lin(E, SUB(b2), I, D, V41_LIN_Q, &W->ex[x].w1, err));
        snprintf(b2, sizeof b2, "ffn.experts.%d.w2", x);
        CK(load_lin(E, SUB(b2), D, I, V41_LIN_Q, &W->ex[x].w2, err));
        snprintf(b2, sizeof b2, "ffn.experts.%d.w3", x);
        CK(load_lin(E, SUB(b2), I, D, V41_LIN_Q, &W->ex[x].w3, err));
    }
    CK(load_lin(E, SUB("ffn.shared_experts.w1"), I, D, V41_LIN_Q, &W->sh.w1, err));
    CK(load_lin(E, SUB("ffn.shared_experts.w2"), D, I, V41_LIN_Q, &W->sh.w2, err));
    CK(load_lin(E, SUB("ffn.shared_experts.w3"), I, D, V41_LIN_Q, &W->sh.w3, err));
    if (W->eidx >= 0) {
        int width = (c->engram_max_ngram_size - 1) * c->engram_n_heads;
        CK(get_t(E, SUB("engram.embed.weight"), &W->eg_emb, err));
        CK(get_t(E, SUB("engram.embed.scale"), &W->eg_sc, err));
        CK(load_lin(E, SUB("engram.wkv"), (int64_t)(hc + 1) * D, (int64_t)width * c->engram_head_dim, V41_LIN_Q,
                    &W->eg_wkv, err));
        float *qw, *kw;
        CK(load_vec(E, SUB("engram.q_weight"), (int64_t)hc * D, &qw, err));
        CK(load_vec(E, SUB("engram.k_weight"), (int64_t)hc * D, &kw, err));
        for (int64_t i = 0; i < (int64_t)hc * D; i++) qw[i] = qw[i] * kw[i];
        free(kw);
        W->eg_w = qw;
    }
    if (W->stage == 0) {
        CK(load_lin(E, SUB("main_proj"), D, (int64_t)D * c->n_dspark_targets, V41_LIN_Q, &W->main_proj, err));
        CK(load_vec(E, SUB("main_norm.weight"), D, &W->main_norm, err));
    }
    if (W->stage >= 0 && W->stage == c->n_mtp_layers - 1) {
        CK(load_vec(E, SUB("norm.weight"), D, &W->fnorm, err));
        CK(get_t(E, SUB("markov_head.embed.weight"), &W->mk_embed, err));
        CK(load_lin(E, SUB("markov_head.head"), c->vocab_size, c->dspark_markov_rank, V41_LIN_F32, &W->mk_head, err));
        W->mk_head.kind = V41_LIN_F32;
        CK(load_lin(E, SUB("confidence_head.proj"), 1, D + c->dspark_markov_rank, V41_LIN_F32, &W->conf, err));
        W->conf.kind = V41_LIN_F32;
    }
#undef SUB
    bool yarn = W->ratio > 0;
    if (v41_rope_init(&W->rope, c->rope_head_dim, yarn ? c->compress_rope_theta : c->rope_theta,
                      yarn ? c->original_seq_len : 0, c->rope_factor, c->beta_fast, c->beta_slow))
        return v41_err_set(err, V41_ENOMEM, "out of memory");
    return V41_OK;
}

static void free_layer(layer_w *W)
{
    free(W->hc_attn_base); free(W->hc_ffn_base); free(W->attn_norm); free(W->ffn_norm);
    free(W->q_norm); free(W->kv_norm); free(W->sink); free(W->c_norm); free(W->i_knorm);
    free(W->gate_bias); free(W->ex); free(W->eg_w); free(W->main_norm); free(W->fnorm);
    v41_rope_free(&W->rope);
}

/* ------------------------------------------------------------------ injection */

static const char *inj_names[INJ_COUNT] = {
    "sink-dropped", "rope-not-interleaved", "sinkhorn-rows-last", "compressed-visible-one-group-early",
    "indexer-relu-dropped", "router-bias-in-weights", "swa-not-floored", "replay-rows-misaligned",
    "dspark-padding-counted",
};

static int parse_inject(ref_engine *E, const char *spec, v41_err *err)
{
    memset(E->inj, 0, sizeof E->inj);
    if (!spec || !*spec) return V41_OK;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        if (!*tok) continue;
        int layer = -1;
        char *at = strchr(tok, '@');
        if (at) {
            *at = 0;
            char *end;
            long v = strtol(at + 1, &end, 10);
            if (*end || v < 0 || v >= V41_MAX_LAYERS)
                return v41_err_set(err, V41_EINVAL, "inject: bad layer in '%s@%s'", tok, at + 1);
            layer = (int)v;
        }
        int f = -1;
        for (int i = 0; i < INJ_COUNT; i++)
            if (!strcmp(tok, inj_names[i])) f = i;
        if (f < 0) {
            char all[512] = "";
            for (int i = 0; i < INJ_COUNT; i++) {
                strcat(all, i ? ", " : "");
                strcat(all, inj_names[i]);
            }
            return v41_err_set(err, V41_EINVAL, "inject: unknown fault '%s' (known: %s)", tok, all);
        }
        if (layer < 0) memset(E->inj[f], 1, sizeof E->inj[f]);
        else E->inj[f][layer] = E->inj[f][V41_MAX_LAYERS] = 1;
    }
    return V41_OK;
}

static inline bool inj(const ref_engine *E, int f, int layer)
{
    return E->inj[f][V41_MAX_LAYERS] && (layer < 0 ? true : E->inj[f][layer]);
}

/* ------------------------------------------------------------------ taps and forcing */

static void lname(const ref_engine *E, char *buf, size_t n, int l, const char *sub)
{
    if (l >= E->cfg->n_layers) snprintf(buf, n, "dspark.%d.%s", l - E->cfg->n_layers, sub);
    else snprintf(buf, n, "layer.%d.%s", l, sub);
}

static int tap_emit(ref_engine *E, const char *name, int layer, v41_tap_kind kind, const void *data, int ndim,
                    int64_t d0, int64_t d1, int64_t d2, int64_t d3, v41_err *err)
{
    v41_tap_sink *s = E->e.sink;
    if (!s) return V41_OK;
    if (s->pattern && !v41_tap_match(s->pattern, name)) return V41_OK;
    if (kind == V41_TAP_BF16 && !E->emu) kind = V41_TAP_F32;
    v41_tap t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.step = E->tap_step;
    t.layer = layer;
    t.kind = kind;
    t.ndim = ndim;
    int64_t dd[4] = {d0, d1, d2, d3};
    for (int i = 0; i < ndim; i++) t.shape[i] = dd[i];
    t.data = data;
    t.order = E->tap_order++;
    void *sbuf = NULL; /* compacted view (SPEC §7 trimming): row taps scattered to the full rows */
    if (E->srv_map && v41_srv_tap_scatter(E, &t, &sbuf)) return v41_err_set(err, V41_ENOMEM, "out of memory");
    int rc = s->emit(s->ctx, &t);
    free(sbuf);
    if (rc) return v41_err_set(err, V41_EINTERNAL, "tap sink aborted at %s (%d)", name, rc);
    return V41_OK;
}

/* Taps and forcing points stop the function on a sink or source error (a dump that cannot be
 * written, a forcing dump of the wrong shape) by `rc = ...; goto done`: every function that uses
 * them has an int rc and a done: label that frees its buffers and returns rc. (They used to
 * return directly, which leaked the forward's buffers: found by tests/test_hostile_h5.sh under
 * ASan, session 26.) */
#define TAP_CK(x)                 \
    do {                          \
        int rc_ = (x);            \
        if (rc_) {                \
            rc = rc_;             \
            goto done;            \
        }                         \
    } while (0)
/* layer tap: name built only when a sink is attached */
#define LTAP(E, l, sub, kind, data, ndim, d0, d1, d2, d3)                                      \
    do {                                                                                       \
        if ((E)->e.sink) {                                                                     \
            char nm_[128];                                                                     \
            lname((E), nm_, sizeof nm_, (l), (sub));                                           \
            TAP_CK(tap_emit((E), nm_, (l), (kind), (data), (ndim), (d0), (d1), (d2), (d3), err)); \
        }                                                                                      \
    } while (0)
#define GTAP(E, name, kind, data, ndim, d0, d1, d2, d3)                                        \
    do {                                                                                       \
        if ((E)->e.sink) TAP_CK(tap_emit((E), (name), -1, (kind), (data), (ndim), (d0), (d1), (d2), (d3), err)); \
    } while (0)

/* Forcing point: asks e->force for the tensor; dst holds the engine's own value on
 * entry and is overwritten when the source answers 1. Returns <0 on error. */
static int force_pt(ref_engine *E, const char *name, v41_tap_kind kind, void *dst, int ndim, int64_t d0, int64_t d1,
                    int64_t d2, v41_err *err)
{
    v41_tap_source *f = E->e.force;
    if (!f) return 0;
    if (f->pattern && !v41_tap_match(f->pattern, name)) return 0;
    int64_t shape[3] = {d0, d1, d2};
    int r = E->srv_map ? v41_srv_force_fetch(E, f, name, kind, ndim, shape, dst)
                       : f->fetch(f->ctx, name, E->tap_step, kind, ndim, shape, dst);
    if (r < 0) {
        v41_err_set(err, V41_EINTERNAL, "teacher forcing: source failed at %s", name);
        return -1;
    }
    return r;
}
#define LFORCE(E, l, sub, kind, dst, ndim, d0, d1, d2)                                         \
    do {                                                                                       \
        if ((E)->e.force) {                                                                    \
            char nm_[128];                                                                     \
            lname((E), nm_, sizeof nm_, (l), (sub));                                           \
            if (force_pt((E), nm_, (kind), (dst), (ndim), (d0), (d1), (d2), err) < 0) TAP_CK(err->code); \
        }                                                                                      \
    } while (0)

/* ------------------------------------------------------------------ request state */

static req_state *find_req(ref_engine *E, int id)
{
    for (int i = 0; i < E->nslots; i++)
        if (E->rs[i].used && E->rs[i].id == id) return &E->rs[i];
    return NULL;
}

static void free_req(ref_engine *E, req_state *r)
{
    if (!r->win) return;
    for (int l = 0; l < E->nL; l++) {
        free(r->win[l]);
        if (r->ckv) free(r->ckv[l]);
        if (r->ik) free(r->ik[l]);
        if (r->kvh) free(r->kvh[l]);
        if (r->sch) free(r->sch[l]);
        if (r->kvst) free(r->kvst[l]);
        if (r->scst) free(r->scst[l]);
    }
    free(r->win); free(r->ckv); free(r->ik); free(r->kvh); free(r->sch); free(r->kvst); free(r->scst);
    free(r->etok);
    memset(r, 0, sizeof *r);
}

static req_state *new_req(ref_engine *E, int id, v41_err *err)
{
    req_state *r = NULL;
    for (int i = 0; i < E->nslots; i++)
        if (!E->rs[i].used) { r = &E->rs[i]; break; }
    if (!r) {
        v41_err_set(err, V41_EINVAL, "too many live requests (%d slots; release finished requests)", E->nslots);
        return NULL;
    }
    const v41_config *c = E->cfg;
    int S = E->max_seq, d = c->head_dim, dI = c->index_head_dim, nL = E->nL;
    memset(r, 0, sizeof *r);
    r->id = id;
    r->used = true;
    r->ik_owner = -1;
    r->etok = calloc((size_t)S, sizeof(int64_t));
    r->win = calloc((size_t)nL, sizeof(float *));
    r->ckv = calloc((size_t)nL, sizeof(float *));
    r->ik = calloc((size_t)nL, sizeof(float *));
    r->kvh = calloc((size_t)nL, sizeof(float *));
    r->sch = calloc((size_t)nL, sizeof(float *));
    r->kvst = calloc((size_t)nL, sizeof(float *));
    r->scst = calloc((size_t)nL, sizeof(float *));
    bool ok = r->etok && r->win && r->ckv && r->ik && r->kvh && r->sch && r->kvst && r->scst;
    for (int l = 0; ok && l < nL; l++) {
        const layer_w *W = &E->L[l];
        r->win[l] = calloc((size_t)S * d, sizeof(float));
        ok = ok && r->win[l];
        if (W->kv_src) {
            int m = W->ratio;
            r->ckv[l] = calloc((size_t)(S / m + 1) * d, sizeof(float));
            r->ik[l] = calloc((size_t)(S / m + 1) * dI, sizeof(float));
            ok = ok && r->ckv[l] && r->ik[l];
            if (m > 1) {
                r->kvh[l] = calloc((size_t)S * d, sizeof(float));
                r->sch[l] = calloc((size_t)S * d, sizeof(float));
                r->kvst[l] = calloc((size_t)m * d, sizeof(float));
                r->scst[l] = malloc(sizeof(float) * (size_t)m * d);
                ok = ok && r->kvh[l] && r->sch[l] && r->kvst[l] && r->scst[l];
                if (ok)
                    for (int i = 0; i < m * d; i++) r->scst[l][i] = -INFINITY;
            }
        }
    }
    if (!ok) {
        free_req(E, r);
        v41_err_set(err, V41_ENOMEM, "out of memory for the caches of request %d", id);
        return NULL;
    }
    return r;
}

/* ------------------------------------------------------------------ forward context */

/* fwd_req / fwd: engine_impl.h (shared with engine_serving.c) */

static inline bool is_decode(const fwd_req *q) { return q->n == 1 && q->start > 0; }

/* ------------------------------------------------------------------ hyper-connection mixes */

static int hc_mixes(ref_engine *E, const fwd *F, const float *X, const v41_lin *fn, const float *scale3,
                    const float *base, int l, float *mixes, float *pre, float *post, float *comb, v41_err *err)
{
    const v41_config *c = E->cfg;
    const int hc = c->hc_mult, T = F->T, mix = (2 + hc) * hc;
    const int64_t hD = (int64_t)hc * c->dim;
    CK(v41_linear(fn, X, T, mixes, E->emu, err));
    bool rows_last = inj(E, INJ_SINKHORN_ROWS_LAST, l);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        float r = v41_rms_rsqrt(X + t * hD, hD, c->norm_eps);
        for (int i = 0; i < mix; i++) mixes[t * mix + i] = mixes[t * mix + i] * r;
        v41_hc_split_sinkhorn(mixes + t * mix, scale3, base, hc, c->hc_sinkhorn_iters, (float)c->hc_eps,
                              pre + t * hc, post + t * hc, comb + t * hc * hc, rows_last);
    }
    return V41_OK;
}

/* ------------------------------------------------------------------ MoE (SPEC §8) */

static int expert_fwd(ref_engine *E, const expert_w *X, const float *x, int n, const float *wts, float *out,
                      v41_err *err)
{
    const v41_config *c = E->cfg;
    const int I = c->moe_inter_dim;
    const float L = (float)c->swiglu_limit;
    float *g = malloc(sizeof(float) * (size_t)n * I), *u = malloc(sizeof(float) * (size_t)n * I);
    if (!g || !u) { free(g); free(u); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    int rc = v41_linear(&X->w1, x, n, g, E->emu, err);
    if (!rc) rc = v41_linear(&X->w3, x, n, u, E->emu, err);
    if (!rc) {
        for (int t = 0; t < n; t++)
            for (int i = 0; i < I; i++) {
                float gv = g[(size_t)t * I + i], uv = u[(size_t)t * I + i];
                if (L > 0) {
                    if (uv < -L) uv = -L;
                    if (uv > L) uv = L;
                    if (gv > L) gv = L;
                }
                float h = (gv / (1.0f + expf(-gv))) * uv;
                if (wts) h = wts[t] * h;
                g[(size_t)t * I + i] = E->emu ? v41_bf16r(h) : h;
            }
        rc = v41_linear(&X->w2, g, n, out, E->emu, err);
    }
    free(g);
    free(u);
    return rc;
}

static int moe(ref_engine *E, const fwd *F, int l, const float *x, float *y, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int T = F->T, D = c->dim, NE = W->n_exp, K = W->n_act;
    float *sc = malloc(sizeof(float) * (size_t)T * NE), *bs = malloc(sizeof(float) * (size_t)T * NE);
    float *wt = malloc(sizeof(float) * (size_t)T * K);
    int32_t *ix = malloc(sizeof(int32_t) * (size_t)T * K);
    float *acc = calloc((size_t)T * D, sizeof(float));
    float *xg = malloc(sizeof(float) * (size_t)T * D), *og = malloc(sizeof(float) * (size_t)T * D);
    float *wg = malloc(sizeof(float) * (size_t)T);
    int *rows = malloc(sizeof(int) * (size_t)T);
    int rc = V41_OK;
    if (!sc || !bs || !wt || !ix || !acc || !xg || !og || !wg || !rows) {
        rc = v41_err_set(err, V41_ENOMEM, "out of memory");
        goto done;
    }
    rc = v41_linear(&W->gate, x, T, sc, E->emu, err);
    if (rc) goto done;
    bool bias_in_w = inj(E, INJ_ROUTER_BIAS_IN_WEIGHTS, l);
    for (int t = 0; t < T; t++) {
        float *s = sc + (size_t)t * NE;
        if (c->score_func == V41_SCORE_SOFTMAX) {
            float mx = -INFINITY, sum = 0;
            for (int i = 0; i < NE; i++) { s[i] = s[i] / (float)c->gate_temp; mx = s[i] > mx ? s[i] : mx; }
            for (int i = 0; i < NE; i++) { s[i] = expf(s[i] - mx); sum += s[i]; }
            for (int i = 0; i < NE; i++) s[i] = s[i] / sum;
        } else if (c->score_func == V41_SCORE_SIGMOID) {
            for (int i = 0; i < NE; i++) s[i] = v41_sigmoidf(s[i] / (float)c->gate_temp);
        } else {
            for (int i = 0; i < NE; i++) s[i] = sqrtf(v41_softplusf(s[i] / (float)c->gate_temp));
        }
        for (int i = 0; i < NE; i++) bs[(size_t)t * NE + i] = s[i] + W->gate_bias[i];
        v41_topk_desc(bs + (size_t)t * NE, NE, K, ix + (size_t)t * K);
        float sum = 0;
        for (int j = 0; j < K; j++) {
            int e = ix[(size_t)t * K + j];
            wt[(size_t)t * K + j] = bias_in_w ? bs[(size_t)t * NE + e] : s[e];
            sum += wt[(size_t)t * K + j];
        }
        for (int j = 0; j < K; j++) {
            if (c->norm_topk_prob && K > 1) wt[(size_t)t * K + j] /= (sum + 1e-20f);
            wt[(size_t)t * K + j] *= (float)c->route_scale;
        }
    }
    LTAP(E, l, "ffn.gate.scores", V41_TAP_F32, bs, 2, T, NE, 0, 0);
    LTAP(E, l, "ffn.gate.weights", V41_TAP_F32, wt, 2, T, K, 0, 0);
    LTAP(E, l, "ffn.gate.indices", V41_TAP_I32, ix, 2, T, K, 0, 0);
    /* Routed experts run in parallel, one expert per thread at a time (its Linears run
     * single-threaded inside the region, on the same fixed row tiles), rows grouped by
     * expert in token order. Each (token, choice) output lands in its own slot; then every
     * token sums its experts in ascending expert id starting from 0, the order of a
     * sequential expert loop, so the bits do not depend on the thread count. */
    if (K > 64) {
        rc = v41_err_set(err, V41_EINVAL, "layer %d: more than 64 activated experts (%d)", l, K);
        goto done;
    }
    {
        float *slot = malloc(sizeof(float) * (size_t)T * K * D);
        int *cnt = calloc((size_t)NE + 1, sizeof(int)), *lst = malloc(sizeof(int) * (size_t)T * K);
        int *fill = malloc(sizeof(int) * (size_t)NE);
        if (!slot || !cnt || !lst || !fill) {
            free(slot); free(cnt); free(lst); free(fill);
            rc = v41_err_set(err, V41_ENOMEM, "out of memory");
            goto done;
        }
        for (size_t a = 0; a < (size_t)T * K; a++) cnt[ix[a] + 1]++;
        for (int e = 0; e < NE; e++) { cnt[e + 1] += cnt[e]; fill[e] = cnt[e]; }
        for (size_t a = 0; a < (size_t)T * K; a++) lst[fill[ix[a]]++] = (int)a;
        int erc = V41_OK;
        v41_err eerr = {0};
#pragma omp parallel for schedule(dynamic, 1)
        for (int e = 0; e < NE; e++) {
            const int n = cnt[e + 1] - cnt[e];
            if (!n || erc) continue;
            const int *ls = lst + cnt[e];
            float *xe = malloc(sizeof(float) * (size_t)n * D), *oe = malloc(sizeof(float) * (size_t)n * D);
            float *we = malloc(sizeof(float) * (size_t)n);
            v41_err e2 = {0};
            int r2 = (!xe || !oe || !we) ? v41_err_set(&e2, V41_ENOMEM, "out of memory") : V41_OK;
            if (!r2) {
                for (int i = 0; i < n; i++) {
                    memcpy(xe + (size_t)i * D, x + (size_t)(ls[i] / K) * D, sizeof(float) * D);
                    we[i] = wt[ls[i]];
                }
                r2 = expert_fwd(E, &W->ex[e], xe, n, we, oe, &e2);
            }
            if (r2) {
#pragma omp critical
                { erc = r2; eerr = e2; }
            } else
                for (int i = 0; i < n; i++) memcpy(slot + (size_t)ls[i] * D, oe + (size_t)i * D, sizeof(float) * D);
            free(xe); free(oe); free(we);
        }
        if (!erc) {
#pragma omp parallel for schedule(static)
            for (int t = 0; t < T; t++) {
                int ord[64], nk = K < 64 ? K : 64;
                for (int j = 0; j < nk; j++) { /* choices by ascending expert id */
                    int b2 = j - 1;
                    while (b2 >= 0 && ix[(size_t)t * K + ord[b2]] > ix[(size_t)t * K + j]) { ord[b2 + 1] = ord[b2]; b2--; }
                    ord[b2 + 1] = j;
                }
                float *at = acc + (size_t)t * D;
                for (int j = 0; j < nk; j++) {
                    const float *sl = slot + ((size_t)t * K + ord[j]) * D;
                    for (int k = 0; k < D; k++) at[k] += sl[k];
                }
            }
        }
        free(slot); free(cnt); free(lst); free(fill);
        if (erc) {
            if (err) *err = eerr;
            rc = erc;
            goto done;
        }
    }
    rc = expert_fwd(E, &W->sh, x, T, NULL, og, err);
    if (rc) goto done;
    for (size_t i = 0; i < (size_t)T * D; i++) {
        float v = acc[i] + og[i];
        y[i] = E->emu ? v41_bf16r(v) : v;
    }
done:
    free(sc); free(bs); free(wt); free(ix); free(acc); free(xg); free(og); free(wg); free(rows);
    return rc;
}

/* ------------------------------------------------------------------ compressor + index keys (SPEC §5, §6) */

static int compressor(ref_engine *E, fwd *F, int l, const float *x, int *emitted, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int T = F->T, d = c->head_dim, dI = c->index_head_dim, r = c->rope_head_dim, m = W->ratio;
    const int D = c->dim;
    float *kv = malloc(sizeof(float) * (size_t)T * d), *sc = NULL;
    float *lat = malloc(sizeof(float) * (size_t)(T + F->nr) * d);
    int *lat_req = malloc(sizeof(int) * (size_t)(T + F->nr)), *lat_j = malloc(sizeof(int) * (size_t)(T + F->nr));
    int nl = 0, rc = V41_OK;
    if (!kv || !lat || !lat_req || !lat_j) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    (void)D;
    if (m == 1) {
        rc = v41_linear(&W->c_wkv, x, T, kv, E->emu, err);
        if (rc) goto done;
        for (int q = 0; q < F->nr; q++) {
            const fwd_req *R = &F->R[q];
            emitted[q] = 0;
            for (int i = 0; i < R->n; i++) {
                int pos = R->start + i;
                if (pos < R->hit) continue; /* replayed rows (cached prefix, SPEC §7): writes suppressed */
                v41_rmsnorm(kv + (size_t)(R->r0 + i) * d, W->c_norm, d, c->norm_eps, lat + (size_t)nl * d, E->emu);
                lat_req[nl] = q;
                lat_j[nl] = pos;
                nl++;
                emitted[q]++;
            }
        }
    } else {
        sc = malloc(sizeof(float) * (size_t)T * d);
        if (!sc) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        /* fp32 Linears on the bf16 input upcast (no act_quant) */
        rc = v41_linear(&W->c_wkv, x, T, kv, E->emu, err);
        if (!rc) rc = v41_linear(&W->c_wgate, x, T, sc, E->emu, err);
        if (rc) goto done;
        for (int q = 0; q < F->nr; q++) {
            const fwd_req *R = &F->R[q];
            req_state *st = R->st;
            emitted[q] = 0;
            for (int i = 0; i < R->n; i++) {
                int pos = R->start + i;
                if (pos < R->hit) continue; /* replayed rows: the cached history and state stay */
                memcpy(st->kvh[l] + (size_t)pos * d, kv + (size_t)(R->r0 + i) * d, sizeof(float) * d);
                memcpy(st->sch[l] + (size_t)pos * d, sc + (size_t)(R->r0 + i) * d, sizeof(float) * d);
                int g0 = pos / m * m;
                /* official state layout: a row is written into slot pos % m when its group is still
                 * incomplete at the end of this forward or started in an earlier one */
                if (g0 + m > R->E || g0 < R->hit) {
                    memcpy(st->kvst[l] + (size_t)(pos % m) * d, kv + (size_t)(R->r0 + i) * d, sizeof(float) * d);
                    memcpy(st->scst[l] + (size_t)(pos % m) * d, sc + (size_t)(R->r0 + i) * d, sizeof(float) * d);
                }
                if ((pos + 1) % m) continue;
                /* group complete: softmax over the m tokens per channel, fp32 */
                float *o = lat + (size_t)nl * d;
                for (int ch = 0; ch < d; ch++) {
                    float mx = -INFINITY, sum = 0, acc = 0;
                    for (int k = 0; k < m; k++) {
                        float s = st->sch[l][(size_t)(g0 + k) * d + ch];
                        mx = s > mx ? s : mx;
                    }
                    float e_[64];
                    for (int k = 0; k < m; k++) {
                        e_[k] = expf(st->sch[l][(size_t)(g0 + k) * d + ch] - mx);
                        sum += e_[k];
                    }
                    for (int k = 0; k < m; k++) acc += st->kvh[l][(size_t)(g0 + k) * d + ch] * (e_[k] / sum);
                    o[ch] = E->emu ? v41_bf16r(acc) : acc;
                }
                v41_rmsnorm(o, W->c_norm, d, c->norm_eps, o, E->emu);
                lat_req[nl] = q;
                lat_j[nl] = pos / m;
                nl++;
                emitted[q]++;
            }
        }
    }
    LTAP(E, l, "compressor.latent", V41_TAP_BF16, lat, 2, nl, d, 0, 0);
    /* index keys from the latent before RoPE (SPEC §6), then RoPE + fp4 into the caches */
    if (nl > 0) {
        float *k = malloc(sizeof(float) * (size_t)nl * dI);
        if (!k) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        rc = v41_linear(&W->i_wk, lat, nl, k, E->emu, err);
        if (rc) { free(k); goto done; }
        bool il = !inj(E, INJ_ROPE_HALVES, l);
        for (int i = 0; i < nl; i++) {
            req_state *st = F->R[lat_req[i]].st;
            int j = lat_j[i];
            float *ki = k + (size_t)i * dI;
            v41_rmsnorm(ki, W->i_knorm, dI, c->norm_eps, ki, E->emu);
            v41_rope_apply(&W->rope, ki + dI - r, (int64_t)j * m, false, il, E->emu);
            if (E->emu) v41_fp4_qdq_e8m0(ki, (size_t)dI, 32);
            memcpy(st->ik[l] + (size_t)j * dI, ki, sizeof(float) * dI);
            float *li = lat + (size_t)i * d;
            v41_rope_apply(&W->rope, li + d - r, (int64_t)j * m, false, il, E->emu);
            if (E->emu) v41_fp4_qdq_e4m3(li, (size_t)d, 16);
            memcpy(st->ckv[l] + (size_t)j * d, li, sizeof(float) * d);
        }
        free(k);
    }
    /* forcing points: the compressed KV and index-key rows other layers will read */
    if (!rc && E->e.force) {
        int Lm = 0;
        for (int q = 0; q < F->nr; q++) Lm = F->R[q].E / m > Lm ? F->R[q].E / m : Lm;
        for (int which = 0; which < 2 && !rc && Lm > 0; which++) {
            const int w = which ? dI : d;
            float *buf = calloc((size_t)F->nr * Lm * w, sizeof(float));
            if (!buf) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); break; }
            for (int q = 0; q < F->nr; q++)
                memcpy(buf + (size_t)q * Lm * w, which ? F->R[q].st->ik[l] : F->R[q].st->ckv[l],
                       sizeof(float) * (size_t)(F->R[q].E / m) * w);
            char nm[128];
            lname(E, nm, sizeof nm, l, which ? "cache.index_k" : "cache.compressed");
            int fr = force_pt(E, nm, V41_TAP_BF16, buf, 3, F->nr, Lm, w, err);
            if (fr < 0) rc = err->code;
            else if (fr == 1)
                for (int q = 0; q < F->nr; q++)
                    memcpy(which ? F->R[q].st->ik[l] : F->R[q].st->ckv[l], buf + (size_t)q * Lm * w,
                           sizeof(float) * (size_t)(F->R[q].E / m) * w);
            free(buf);
        }
    }
done:
    free(kv); free(sc); free(lat); free(lat_req); free(lat_j);
    return rc;
}

/* index scores of one request's rows against its keys, SPEC §6 */
static int indexer(ref_engine *E, fwd *F, int l, const float *x, const float *qr, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int T = F->T, nI = c->index_n_heads, dI = c->index_head_dim, r = c->rope_head_dim, m = W->ratio;
    const bool emu = E->emu;
    int rc = V41_OK;
    float *q = malloc(sizeof(float) * (size_t)T * nI * dI), *w = malloc(sizeof(float) * (size_t)T * nI);
    int Lmax = 0, kmax = 0;
    for (int i = 0; i < F->nr; i++) {
        int Lc = F->R[i].E / m;
        Lmax = Lc > Lmax ? Lc : Lmax;
        int k = Lc < c->index_topk ? Lc : c->index_topk;
        kmax = k > kmax ? k : kmax;
    }
    const int B = c->candidate_block_size > 0 ? c->candidate_block_size : 1;
    const int nbmax = (Lmax + B - 1) / B;
    float *I = malloc(sizeof(float) * (size_t)T * (Lmax ? Lmax : 1));
    uint8_t *amb = calloc((size_t)T, 1), *camb = calloc((size_t)T, 1);
    float *bsc = W->cand_src ? malloc(sizeof(float) * (size_t)T * (nbmax ? nbmax : 1)) : NULL;
    if (!q || !w || !I || !amb || !camb || (W->cand_src && !bsc)) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    rc = v41_linear(&W->i_wq_b, qr, T, q, emu, err);
    if (!rc) rc = v41_linear(&W->i_wproj, x, T, w, emu, err);
    if (rc) goto done;
    bool il = !inj(E, INJ_ROPE_HALVES, l);
    const float wscale = (float)(pow(dI, -0.5) * pow(nI, -0.5));
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < nI; h++) {
            float *qh = q + ((size_t)t * nI + h) * dI;
            v41_rope_apply(&W->rope, qh + dI - r, F->row_pos[t], false, il, emu);
            float wv = w[(size_t)t * nI + h] * wscale;
            w[(size_t)t * nI + h] = emu ? v41_bf16r(wv) : wv;
        }
        if (emu) v41_fp4_qdq_e8m0(q + (size_t)t * nI * dI, (size_t)nI * dI, 32);
    }
    /* shared top-k buffer of this forward (reused by the following compressed layers) */
    free(F->topk);
    F->topk = malloc(sizeof(int32_t) * (size_t)T * (kmax ? kmax : 1));
    if (!F->topk) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    F->kmax = kmax;
    if (W->cand_src) {
        free(F->cand);
        F->cand = calloc((size_t)T * (Lmax ? Lmax : 1), 1);
        if (!F->cand) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        F->cmax = Lmax;
        F->cand_valid = true;
    }
    for (int i = 0; i < T * Lmax; i++) I[i] = -INFINITY;
    if (bsc)
        for (int i = 0; i < T * nbmax; i++) bsc[i] = -INFINITY;
    bool relu = !inj(E, INJ_INDEXER_RELU_DROPPED, l);
    bool early = inj(E, INJ_COMPRESSED_EARLY, l);
    for (int qi = 0; qi < F->nr; qi++) {
        fwd_req *R = &F->R[qi];
        req_state *st = R->st;
        const int Lc = R->E / m;
        const int k = Lc < c->index_topk ? Lc : c->index_topk;
        F->topk_k[qi] = k;
        /* which index keys: own kv source (fixed) or the last published (official compat) */
        int src = W->ks;
        if (E->e.opts.compat == V41_COMPAT_OFFICIAL && st->ik_owner >= 0) src = st->ik_owner;
        const float *keys = st->ik[src];
        const int srcm = E->L[src].ratio;
        const int cap = E->max_seq / srcm + 1;
        /* the scores of this request's rows (one call: the GPU engine runs it as one kernel) */
        int *Lts = malloc(sizeof(int) * (size_t)(R->n > 0 ? R->n : 1));
        if (!Lts) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        for (int i = 0; i < R->n; i++) {
            int Lt = (R->start + i + 1) / m + (early ? 1 : 0);
            Lts[i] = Lt > Lc ? Lc : Lt;
        }
        v41_indexer_scores_rows(q + (size_t)R->r0 * nI * dI, w + (size_t)R->r0 * nI, R->n, nI, dI, keys, cap, Lc,
                                Lts, relu, emu, I + (size_t)R->r0 * Lmax, Lmax);
        free(Lts);
#pragma omp parallel for schedule(static)
        for (int i = 0; i < R->n; i++) {
            int t = R->r0 + i;
            int pos = R->start + i;
            float *It = I + (size_t)t * Lmax;
            if (W->cand_src) {
                int nb = (Lc + B - 1) / B;
                float *bs = bsc + (size_t)t * nbmax;
                for (int b = 0; b < nb; b++) {
                    float mx = -INFINITY;
                    for (int s = b * B; s < (b + 1) * B && s < Lc; s++) mx = It[s] > mx ? It[s] : mx;
                    bs[b] = mx;
                }
                int Lraw = (pos + 1) / m;
                if (Lraw > 0) { /* floor division: none pinned when L_t = 0 */
                    int last = (Lraw - 1) / B;
                    if (last < nb) bs[last] = INFINITY;
                }
                int kb = c->candidate_topk_blocks < nb ? c->candidate_topk_blocks : nb;
                int32_t *sel = malloc(sizeof(int32_t) * (size_t)(kb > 0 ? kb : 1));
                camb[t] = (uint8_t)v41_topk_desc(bs, nb, kb, sel);
                uint8_t *mk = F->cand + (size_t)t * Lmax;
                for (int j = 0; j < kb; j++)
                    if (bs[sel[j]] > -INFINITY)
                        for (int s = sel[j] * B; s < (sel[j] + 1) * B && s < Lc; s++) mk[s] = 1;
                free(sel);
            }
        }
    }
    if (W->cand_src) {
        LTAP(E, l, "candidate.scores", V41_TAP_BF16, bsc, 2, T, nbmax, 0, 0);
        LTAP(E, l, "candidate.ambiguous", V41_TAP_U8, camb, 1, T, 0, 0, 0);
        LFORCE(E, l, "candidate.mask", V41_TAP_U8, F->cand, 2, T, Lmax, 0);
        LTAP(E, l, "candidate.mask", V41_TAP_U8, F->cand, 2, T, Lmax, 0, 0);
    }
    if (W->cand_use && F->cand_valid) {
        for (int t = 0; t < T; t++)
            for (int s = 0; s < Lmax && s < F->cmax; s++)
                if (!F->cand[(size_t)t * F->cmax + s]) I[(size_t)t * Lmax + s] = -INFINITY;
    }
    LTAP(E, l, "indexer.scores", V41_TAP_BF16, I, 2, T, Lmax, 0, 0);
    for (int qi = 0; qi < F->nr; qi++) {
        fwd_req *R = &F->R[qi];
        const int Lc = R->E / m, k = F->topk_k[qi];
        int *Lts = malloc(sizeof(int) * (size_t)(R->n > 0 ? R->n : 1));
        if (!Lts) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        for (int i = 0; i < R->n; i++) {
            int Lt = (R->start + i + 1) / m + (early ? 1 : 0);
            Lts[i] = Lt > Lc ? Lc : Lt;
        }
        v41_indexer_topk_rows(I + (size_t)R->r0 * Lmax, Lmax, R->n, Lc, k, Lts, F->topk + (size_t)R->r0 * kmax, kmax,
                              kmax, amb + R->r0);
        free(Lts);
    }
    LTAP(E, l, "indexer.ambiguous", V41_TAP_U8, amb, 1, T, 0, 0, 0);
    LFORCE(E, l, "indexer.topk", V41_TAP_I32, F->topk, 2, T, kmax, 0);
    LTAP(E, l, "indexer.topk", V41_TAP_I32, F->topk, 2, T, kmax, 0, 0);
done:
    free(q); free(w); free(I); free(amb); free(camb); free(bsc);
    return rc;
}

/* ------------------------------------------------------------------ attention (SPEC §4) */

/* Output projection: inverse RoPE on o, grouped wo_a (bf16), wo_b (fp8). */
static int attn_out_proj(ref_engine *E, int l, float *o, int T, const int *pos, float *y, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int H = c->n_heads, d = c->head_dim, r = c->rope_head_dim, G = c->o_groups, R = c->o_lora_rank;
    bool il = !inj(E, INJ_ROPE_HALVES, l);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++)
            v41_rope_apply(&W->rope, o + ((size_t)t * H + h) * d + d - r, pos[t], true, il, E->emu);
    float *u = malloc(sizeof(float) * (size_t)T * G * R);
    if (!u) return v41_err_set(err, V41_ENOMEM, "out of memory");
    const int64_t gd = (int64_t)H * d / G;
    int rc = V41_OK;
    for (int g = 0; g < G && !rc; g++) {
        v41_lin Lg = W->wo_a;
        Lg.row0 = (int64_t)g * R;
        Lg.N = R;
        Lg.K = gd;
        rc = v41_linear_ld(&Lg, o + g * gd, (int64_t)H * d, T, u + (size_t)g * R, (int64_t)G * R, E->emu, err);
    }
    if (!rc) rc = v41_linear(&W->wo_b, u, T, y, E->emu, err);
    free(u);
    return rc;
}

/* Shared end of the backbone and DSpark attentions: the key-list and core taps, then the
 * grouped output projection (SPEC §4 step 6) and its tap. o: [T, H, d], lists: [T, LW]. */
static int attn_finish(ref_engine *E, int l, int T, const int32_t *lists, int LW, float *o, const int *pos, float *y,
                       v41_err *err)
{
    const int H = E->cfg->n_heads, d = E->cfg->head_dim;
    int rc = V41_OK;
    LTAP(E, l, "attn.topk", V41_TAP_I32, lists, 2, T, LW, 0, 0);
    LTAP(E, l, "attn.core", V41_TAP_BF16, o, 3, T, H, d, 0);
    TAP_CK(attn_out_proj(E, l, o, T, pos, y, err));
    LTAP(E, l, "attn.out", V41_TAP_BF16, y, 2, T, E->cfg->dim, 0, 0);
done:
    return rc;
}

static int attention(ref_engine *E, fwd *F, int l, const float *x, float *y, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    int T = F->T; /* becomes the kept rows at the cut (SPEC §7 trimming) */
    const int H = c->n_heads, d = c->head_dim, r = c->rope_head_dim, Wn = c->window_size;
    const int QL = c->q_lora_rank;
    const bool emu = E->emu;
    int rc = V41_OK;
    float *qr = malloc(sizeof(float) * (size_t)T * QL), *q = malloc(sizeof(float) * (size_t)T * H * d);
    float *kv = malloc(sizeof(float) * (size_t)T * d), *o = malloc(sizeof(float) * (size_t)T * H * d);
    int *emitted = calloc((size_t)F->nr, sizeof(int));
    int32_t *lists = NULL;
    if (!qr || !q || !kv || !o || !emitted) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    bool il = !inj(E, INJ_ROPE_HALVES, l);
    rc = v41_linear(&W->wq_a, x, T, qr, emu, err);
    if (rc) goto done;
    for (int t = 0; t < T; t++) v41_rmsnorm(qr + (size_t)t * QL, W->q_norm, QL, c->norm_eps, qr + (size_t)t * QL, emu);
    LTAP(E, l, "attn.qr", V41_TAP_BF16, qr, 2, T, QL, 0, 0);
    rc = v41_linear(&W->wkv, x, T, kv, emu, err);
    if (rc) goto done;
    for (int t = 0; t < T; t++) {
        float *k = kv + (size_t)t * d;
        v41_rmsnorm(k, W->kv_norm, d, c->norm_eps, k, emu);
        v41_rope_apply(&W->rope, k + d - r, F->row_pos[t], false, il, emu);
        if (emu) v41_act_quant(k, (size_t)d, 32, NULL);
    }
    LTAP(E, l, "attn.window_kv", V41_TAP_BF16, kv, 2, T, d, 0, 0);
    /* window KV history (the ring is a view of it: slot = pos mod W) */
    for (int t = 0; t < T; t++) {
        req_state *st = F->R[F->row_req[t]].st;
        memcpy(st->win[l] + (size_t)F->row_pos[t] * d, kv + (size_t)t * d, sizeof(float) * d);
    }
    const int m = W->ratio;
    if (m > 0) {
        if (W->kv_src) {
            rc = compressor(E, F, l, x, emitted, err);
            if (rc) goto done;
            if (E->e.opts.compat == V41_COMPAT_OFFICIAL)
                for (int q2 = 0; q2 < F->nr; q2++)
                    if (emitted[q2] > 0) F->R[q2].st->ik_owner = l;
        }
        if (W->idx_src) {
            bool any = false;
            for (int q2 = 0; q2 < F->nr; q2++) any = any || F->R[q2].E / m > 0;
            if (any) {
                rc = indexer(E, F, l, x, qr, err);
                if (rc) goto done;
            } else {
                free(F->topk);
                F->topk = NULL;
                F->kmax = 0;
                for (int q2 = 0; q2 < F->nr; q2++) F->topk_k[q2] = 0;
            }
        }
    }
    if (F->kept && F->cut == l) { /* SPEC §7 decoder side: from the query on, only the kept rows */
        rc = v41_srv_compact(E, F, l, qr, QL, err);
        if (rc) goto done;
        T = F->T;
    }
    /* queries (after the KV side: at the cut only the kept rows' queries are computed) */
    rc = v41_linear(&W->wq_b, qr, T, q, emu, err);
    if (rc) goto done;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) v41_rope_apply(&W->rope, q + ((size_t)t * H + h) * d + d - r, F->row_pos[t], false, il, emu);
    LTAP(E, l, "attn.q", V41_TAP_BF16, q, 3, T, H, d, 0);
    /* key lists: [window part | compressed part] per row (SPEC §4.4 layout) */
    int wmax = 0;
    for (int q2 = 0; q2 < F->nr; q2++) {
        const fwd_req *R = &F->R[q2];
        int wl = is_decode(R) ? Wn : (R->E < Wn ? R->E : Wn);
        wmax = wl > wmax ? wl : wmax;
    }
    const int kc = m > 0 ? F->kmax : 0;
    const int LW = wmax + kc;
    lists = malloc(sizeof(int32_t) * (size_t)T * (LW ? LW : 1));
    if (!lists) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    const bool floored = !inj(E, INJ_SWA_NOT_FLOORED, l);
    bool nosink = inj(E, INJ_SINK_DROPPED, l);
    const float scale = (float)pow(d, -0.5);
    for (int q2 = 0; q2 < F->nr; q2++) {
        const fwd_req *R = &F->R[q2];
        req_state *st = R->st;
        const int wl = is_decode(R) ? Wn : (R->E < Wn ? R->E : Wn);
        const int ks = W->ks;
        const int k = m > 0 ? F->topk_k[q2] : 0;
        const int flo = floored ? (R->trim && l > F->cut ? R->kv_start : R->floor_) : 0;
#pragma omp parallel for schedule(static)
        for (int i = 0; i < R->n; i++) {
            const int t = R->r0 + i, p = R->start + i;
            int32_t *ls = lists + (size_t)t * LW;
            const float **kp = malloc(sizeof(float *) * (size_t)(wl + k + 1));
            int n = 0;
            if (is_decode(R)) {
                for (int j = 0; j < Wn; j++) {
                    int slot = (p + 1 + j) % Wn;
                    int ps = p - ((p - slot) % Wn + Wn) % Wn;
                    ls[n] = (ps >= 0 && ps >= flo) ? ps : -1;
                    n++;
                }
            } else {
                int b0 = p - Wn + 1 > 0 ? p - Wn + 1 : 0;
                for (int j = 0; j < wl; j++) {
                    int ps = b0 + j;
                    ls[n] = (ps <= p && ps >= flo) ? ps : -1;
                    n++;
                }
            }
            for (int j = n; j < wmax; j++) ls[j] = -1;
            for (int j = 0; j < wl; j++) kp[j] = ls[j] >= 0 ? st->win[l] + (size_t)ls[j] * d : NULL;
            for (int j = 0; j < k; j++) {
                int32_t s = F->topk[(size_t)t * F->kmax + j];
                ls[wmax + j] = s;
                kp[wl + j] = s >= 0 ? st->ckv[ks] + (size_t)s * d : NULL;
            }
            for (int j = k; j < kc; j++) ls[wmax + j] = -1;
            v41_sparse_attn_row(q + (size_t)t * H * d, H, d, kp, wl + k, nosink ? NULL : W->sink, scale,
                                o + (size_t)t * H * d, emu);
            free(kp);
        }
    }
    rc = attn_finish(E, l, T, lists, LW, o, F->row_pos, y, err);
done:
    free(qr); free(q); free(kv); free(o); free(emitted); free(lists);
    return rc;
}

/* ------------------------------------------------------------------ engram (SPEC §8) */

static int engram(ref_engine *E, fwd *F, int l, const int32_t *hash_ids, int width, float *X, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int T = F->T, D = c->dim, hc = c->hc_mult, hd = c->engram_head_dim, ne = c->n_engram_layers;
    const int64_t Kin = (int64_t)width * hd, N = (int64_t)(hc + 1) * D;
    float *rows = malloc(sizeof(float) * (size_t)T * Kin), *kv = malloc(sizeof(float) * (size_t)T * N);
    int rc = V41_OK;
    if (!rows || !kv) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    for (int t = 0; t < T && !rc; t++)
        for (int j = 0; j < width && !rc; j++) {
            int64_t id = hash_ids[((size_t)(F->full_row ? F->full_row[t] : t) * ne + W->eidx) * width + j];
            rc = v41_dequant_rows(W->eg_emb, W->eg_sc, id, 1, rows + (size_t)t * Kin + (size_t)j * hd, err);
        }
    if (rc) goto done;
    v41_bf16r_n(rows, (size_t)T * Kin, E->emu);
    rc = v41_linear(&W->eg_wkv, rows, T, kv, E->emu, err);
    if (rc) goto done;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *kt = kv + (size_t)t * N, *val = kt + (size_t)hc * D;
        for (int j = 0; j < hc; j++) {
            float *h = X + ((size_t)t * hc + j) * D;
            float g = v41_engram_gate(h, kt + (size_t)j * D, W->eg_w + (size_t)j * D, D, c->norm_eps);
            for (int i = 0; i < D; i++) {
                float v = h[i] + g * val[i];
                h[i] = E->emu ? v41_bf16r(v) : v;
            }
        }
    }
done:
    free(rows);
    free(kv);
    return rc;
}

/* ------------------------------------------------------------------ block (SPEC §3) */

/* The second half of a block, shared by the backbone and the DSpark stages:
 * the attention's hc_post into the mid stream, then the FFN half (SPEC §3: its
 * own mixes, the attention's pre-mix) and the FFN's hc_post back into X.
 * ya holds the attention output on entry; the other buffers are scratch owned by
 * the caller (so an early return from a forcing point or a tap leaks nothing). */
static int block_rest(ref_engine *E, fwd *F, int l, float *X, float *premix, float *ya, float *xa, float *Xm,
                      float *mixes, float *aPre, float *aPost, float *aC, float *fPost, float *fC, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int T = F->T, hc = c->hc_mult, D = c->dim, mix = (2 + hc) * hc;
    const int64_t hD = (int64_t)hc * D;
    const bool emu = E->emu;
    int rc = V41_OK;
    for (int t = 0; t < T; t++)
        v41_hc_post(ya + (size_t)t * D, X + t * hD, aPost + t * hc, aC + t * hc * hc, hc, D, Xm + t * hD, emu);
    LFORCE(E, l, "stream.mid", V41_TAP_BF16, Xm, 3, T, hc, D);
    LFORCE(E, l, "hc.attn.pre", V41_TAP_F32, aPre, 2, T, hc, 0);
    LTAP(E, l, "stream.mid", V41_TAP_BF16, Xm, 3, T, hc, D, 0);
    /* FFN half: its own mixes; the pre-mix used is the attention's */
    rc = hc_mixes(E, F, Xm, &W->hc_ffn_fn, W->hc_ffn_scale, W->hc_ffn_base, l, mixes, premix, fPost, fC, err);
    if (rc) goto done;
    LTAP(E, l, "hc.ffn.mixes", V41_TAP_F32, mixes, 2, T, mix, 0, 0);
    LTAP(E, l, "hc.ffn.pre", V41_TAP_F32, premix, 2, T, hc, 0, 0);
    LTAP(E, l, "hc.ffn.post", V41_TAP_F32, fPost, 2, T, hc, 0, 0);
    LTAP(E, l, "hc.ffn.comb", V41_TAP_F32, fC, 3, T, hc, hc, 0);
    for (int t = 0; t < T; t++) {
        v41_hc_pre(Xm + t * hD, aPre + t * hc, hc, D, xa + (size_t)t * D, emu);
        v41_rmsnorm(xa + (size_t)t * D, W->ffn_norm, D, c->norm_eps, xa + (size_t)t * D, emu);
    }
    LTAP(E, l, "ffn.norm", V41_TAP_BF16, xa, 2, T, D, 0, 0);
    rc = moe(E, F, l, xa, ya, err);
    if (rc) goto done;
    LTAP(E, l, "ffn.out", V41_TAP_BF16, ya, 2, T, D, 0, 0);
    for (int t = 0; t < T; t++)
        v41_hc_post(ya + (size_t)t * D, Xm + t * hD, fPost + t * hc, fC + t * hc * hc, hc, D, X + t * hD, emu);
    LTAP(E, l, "stream.out", V41_TAP_BF16, X, 3, T, hc, D, 0);
    LTAP(E, l, "premix.out", V41_TAP_F32, premix, 2, T, hc, 0, 0);
done:
    return rc;
}

static int dspark_attention(ref_engine *E, fwd *F, int l, const float *x, float *y, v41_err *err);

/* One block (SPEC §3), backbone layer or DSpark stage (stage: the drafter's non-causal window
 * attention, SPEC §8, instead of the backbone attention). */
static int block(ref_engine *E, fwd *F, int l, float *X, float *premix, bool stage, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    int T = F->T;
    const int hc = c->hc_mult, D = c->dim, mix = (2 + hc) * hc;
    const int64_t hD = (int64_t)hc * D;
    const bool emu = E->emu;
    int rc = V41_OK;
    float *mixes = malloc(sizeof(float) * (size_t)T * mix);
    float *aPre = malloc(sizeof(float) * (size_t)T * hc), *aPost = malloc(sizeof(float) * (size_t)T * hc);
    float *aC = malloc(sizeof(float) * (size_t)T * hc * hc);
    float *fPost = malloc(sizeof(float) * (size_t)T * hc), *fC = malloc(sizeof(float) * (size_t)T * hc * hc);
    float *xa = malloc(sizeof(float) * (size_t)T * D), *ya = malloc(sizeof(float) * (size_t)T * D);
    float *Xm = malloc(sizeof(float) * (size_t)T * hD);
    if (!mixes || !aPre || !aPost || !aC || !fPost || !fC || !xa || !ya || !Xm) {
        rc = v41_err_set(err, V41_ENOMEM, "out of memory");
        goto done;
    }
    LTAP(E, l, "stream.in", V41_TAP_BF16, X, 3, T, hc, D, 0);
    LTAP(E, l, "premix.in", V41_TAP_F32, premix, 2, T, hc, 0, 0);
    rc = hc_mixes(E, F, X, &W->hc_attn_fn, W->hc_attn_scale, W->hc_attn_base, l, mixes, aPre, aPost, aC, err);
    if (rc) goto done;
    LTAP(E, l, "hc.attn.mixes", V41_TAP_F32, mixes, 2, T, mix, 0, 0);
    LTAP(E, l, "hc.attn.pre", V41_TAP_F32, aPre, 2, T, hc, 0, 0);
    LTAP(E, l, "hc.attn.post", V41_TAP_F32, aPost, 2, T, hc, 0, 0);
    LTAP(E, l, "hc.attn.comb", V41_TAP_F32, aC, 3, T, hc, hc, 0);
    for (int t = 0; t < T; t++) {
        v41_hc_pre(X + t * hD, premix + t * hc, hc, D, xa + (size_t)t * D, emu);
        v41_rmsnorm(xa + (size_t)t * D, W->attn_norm, D, c->norm_eps, xa + (size_t)t * D, emu);
    }
    LTAP(E, l, "attn.norm", V41_TAP_BF16, xa, 2, T, D, 0, 0);
    rc = stage ? dspark_attention(E, F, l, xa, ya, err) : attention(E, F, l, xa, ya, err);
    if (rc) goto done;
    if (F->just_cut) { /* the cut's query started the compacted view (SPEC §7): gather this block's rows */
        F->just_cut = false;
        v41_srv_gather(F, X, hD);
        v41_srv_gather(F, aPre, hc);
        v41_srv_gather(F, aPost, hc);
        v41_srv_gather(F, aC, (int64_t)hc * hc);
        T = F->T;
    }
    rc = block_rest(E, F, l, X, premix, ya, xa, Xm, mixes, aPre, aPost, aC, fPost, fC, err);
done:
    free(mixes); free(aPre); free(aPost); free(aC); free(fPost); free(fC); free(xa); free(ya); free(Xm);
    return rc;
}

/* ------------------------------------------------------------------ cache taps */

static int cache_taps(ref_engine *E, fwd *F, int l, v41_err *err)
{
    if (!E->e.sink) return V41_OK;
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int d = c->head_dim, dI = c->index_head_dim, Wn = c->window_size, nr = F->nr;
    char nm[128];
    lname(E, nm, sizeof nm, l, "cache.window");
    if (!E->e.sink->pattern || v41_tap_match(E->e.sink->pattern, nm)) {
        float *b = calloc((size_t)nr * Wn * d, sizeof(float));
        if (!b) return v41_err_set(err, V41_ENOMEM, "out of memory");
        for (int q = 0; q < nr; q++) {
            int len = F->R[q].E;
            for (int p = len - Wn > 0 ? len - Wn : 0; p < len; p++)
                memcpy(b + ((size_t)q * Wn + p % Wn) * d, F->R[q].st->win[l] + (size_t)p * d, sizeof(float) * d);
        }
        int rc = tap_emit(E, nm, l, V41_TAP_BF16, b, 3, nr, Wn, d, 0, err);
        free(b);
        CK(rc);
    }
    if (!W->kv_src) return V41_OK;
    const int m = W->ratio;
    int Lmax = 0;
    for (int q = 0; q < nr; q++) Lmax = F->R[q].E / m > Lmax ? F->R[q].E / m : Lmax;
    float *b = calloc((size_t)nr * (Lmax ? Lmax : 1) * (d > dI ? d : dI), sizeof(float));
    if (!b) return v41_err_set(err, V41_ENOMEM, "out of memory");
    for (int q = 0; q < nr; q++)
        memcpy(b + (size_t)q * Lmax * d, F->R[q].st->ckv[l], sizeof(float) * (size_t)(F->R[q].E / m) * d);
    lname(E, nm, sizeof nm, l, "cache.compressed");
    int rc = tap_emit(E, nm, l, V41_TAP_BF16, b, 3, nr, Lmax, d, 0, err);
    if (!rc) {
        for (int q = 0; q < nr; q++)
            memcpy(b + (size_t)q * Lmax * dI, F->R[q].st->ik[l], sizeof(float) * (size_t)(F->R[q].E / m) * dI);
        lname(E, nm, sizeof nm, l, "cache.index_k");
        rc = tap_emit(E, nm, l, V41_TAP_BF16, b, 3, nr, Lmax, dI, 0, err);
    }
    if (!rc && m > 1) {
        for (int q = 0; q < nr; q++) memcpy(b + (size_t)q * m * d, F->R[q].st->kvst[l], sizeof(float) * m * d);
        lname(E, nm, sizeof nm, l, "cache.comp_kv_state");
        rc = tap_emit(E, nm, l, V41_TAP_F32, b, 3, nr, m, d, 0, err);
        if (!rc) {
            for (int q = 0; q < nr; q++) memcpy(b + (size_t)q * m * d, F->R[q].st->scst[l], sizeof(float) * m * d);
            lname(E, nm, sizeof nm, l, "cache.comp_score_state");
            rc = tap_emit(E, nm, l, V41_TAP_F32, b, 3, nr, m, d, 0, err);
        }
    }
    free(b);
    return rc;
}

/* ------------------------------------------------------------------ DSpark (SPEC §8) */

/* Writes kv_norm(wkv(main_x)) of every row into each stage's window KV history. */
static int dspark_seed(ref_engine *E, fwd *F, const float *main_x, v41_err *err)
{
    const v41_config *c = E->cfg;
    const int T = F->T, d = c->head_dim, r = c->rope_head_dim;
    float *kv = malloc(sizeof(float) * (size_t)T * d);
    if (!kv) return v41_err_set(err, V41_ENOMEM, "out of memory");
    int rc = V41_OK;
    for (int s = 0; s < c->n_mtp_layers && !rc; s++) {
        int l = c->n_layers + s;
        const layer_w *W = &E->L[l];
        bool il = !inj(E, INJ_ROPE_HALVES, l);
        rc = v41_linear(&W->wkv, main_x, T, kv, E->emu, err);
        if (rc) break;
        for (int t = 0; t < T; t++) {
            if (F->kept && !F->kept[t]) continue; /* SPEC §7: context KV of the kept rows only */
            float *k = kv + (size_t)t * d;
            v41_rmsnorm(k, W->kv_norm, d, c->norm_eps, k, E->emu);
            v41_rope_apply(&W->rope, k + d - r, F->row_pos[t], false, il, E->emu);
            if (E->emu) v41_act_quant(k, (size_t)d, 32, NULL);
            memcpy(F->R[F->row_req[t]].st->win[l] + (size_t)F->row_pos[t] * d, k, sizeof(float) * d);
        }
        rc = cache_taps(E, F, l, err);
    }
    free(kv);
    return rc;
}

/* DSpark stage attention: block queries attend non-causally to the ring slots
 * 0..min(W,p+1)-1 (slot order) and the B block keys. */
static int dspark_attention(ref_engine *E, fwd *F, int l, const float *x, float *y, v41_err *err)
{
    const v41_config *c = E->cfg;
    const layer_w *W = &E->L[l];
    const int T = F->T, H = c->n_heads, d = c->head_dim, r = c->rope_head_dim, Wn = c->window_size;
    const int QL = c->q_lora_rank, B = c->dspark_block_size;
    const bool emu = E->emu;
    int rc = V41_OK;
    float *qr = malloc(sizeof(float) * (size_t)T * QL), *q = malloc(sizeof(float) * (size_t)T * H * d);
    float *kv = malloc(sizeof(float) * (size_t)T * d), *o = malloc(sizeof(float) * (size_t)T * H * d);
    /* optional padding of the list to a multiple of opts.dspark_align (as padded kernels do):
     * padding entries are -1 and get zero weight; fault injection dspark-padding-counted
     * makes them count in the softmax denominator (score 0, zero value) */
    const int align = E->e.opts.dspark_align > 0 ? E->e.opts.dspark_align : 1;
    int LW = (Wn + B + align - 1) / align * align;
    const bool pad_counted = inj(E, INJ_DSPARK_PADDING_COUNTED, l);
    float *zero = calloc((size_t)d, sizeof(float));
    int32_t *lists = malloc(sizeof(int32_t) * (size_t)T * LW);
    if (!qr || !q || !kv || !o || !lists || !zero) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    bool il = !inj(E, INJ_ROPE_HALVES, l);
    rc = v41_linear(&W->wq_a, x, T, qr, emu, err);
    if (rc) goto done;
    for (int t = 0; t < T; t++) v41_rmsnorm(qr + (size_t)t * QL, W->q_norm, QL, c->norm_eps, qr + (size_t)t * QL, emu);
    LTAP(E, l, "attn.qr", V41_TAP_BF16, qr, 2, T, QL, 0, 0);
    rc = v41_linear(&W->wq_b, qr, T, q, emu, err);
    if (rc) goto done;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) v41_rope_apply(&W->rope, q + ((size_t)t * H + h) * d + d - r, F->row_pos[t], false, il, emu);
    LTAP(E, l, "attn.q", V41_TAP_BF16, q, 3, T, H, d, 0);
    rc = v41_linear(&W->wkv, x, T, kv, emu, err);
    if (rc) goto done;
    for (int t = 0; t < T; t++) {
        float *k = kv + (size_t)t * d;
        v41_rmsnorm(k, W->kv_norm, d, c->norm_eps, k, emu);
        v41_rope_apply(&W->rope, k + d - r, F->row_pos[t], false, il, emu);
        if (emu) v41_act_quant(k, (size_t)d, 32, NULL);
    }
    LTAP(E, l, "attn.window_kv", V41_TAP_BF16, kv, 2, T, d, 0, 0);
    bool nosink = inj(E, INJ_SINK_DROPPED, l);
    const float scale = (float)pow(d, -0.5);
    for (int qi = 0; qi < F->nr; qi++) {
        const fwd_req *R = &F->R[qi];
        const int p = R->start - 1; /* the target position the draft follows */
        const int nw = p + 1 < Wn ? p + 1 : Wn;
        for (int i = 0; i < R->n; i++) {
            const int t = R->r0 + i;
            int32_t *ls = lists + (size_t)t * LW;
            const float **kp = malloc(sizeof(float *) * (size_t)LW);
            int n = 0;
            for (int j = 0; j < nw; j++) {
                int ps = p - ((p - j) % Wn + Wn) % Wn; /* position held by ring slot j */
                ls[n] = ps;
                kp[n++] = R->st->win[l] + (size_t)ps * d;
            }
            for (int j = 0; j < B; j++) {
                ls[n] = R->start + j; /* block keys, by position */
                kp[n++] = kv + (size_t)(R->r0 + j) * d;
            }
            for (int j = n; j < LW; j++) {
                ls[j] = -1;
                kp[j] = pad_counted ? zero : NULL;
            }
            v41_sparse_attn_row(q + (size_t)t * H * d, H, d, kp, LW, nosink ? NULL : W->sink, scale,
                                o + (size_t)t * H * d, emu);
            free(kp);
        }
    }
    rc = attn_finish(E, l, T, lists, LW, o, F->row_pos, y, err);
done:
    free(qr); free(q); free(kv); free(o); free(lists); free(zero);
    return rc;
}

static int stage_block(ref_engine *E, fwd *F, int l, float *X, float *premix, v41_err *err)
{
    /* the stages' inputs are forcing points of their own (the backbone's are set in the layer loop) */
    const int T = F->T, hc = E->cfg->hc_mult, D = E->cfg->dim;
    int rc = V41_OK;
    LFORCE(E, l, "stream.in", V41_TAP_BF16, X, 3, T, hc, D);
    LFORCE(E, l, "premix.in", V41_TAP_F32, premix, 2, T, hc, 0);
    rc = block(E, F, l, X, premix, true, err);
done:
    return rc;
}

static int embed_rows(ref_engine *E, const int32_t *ids, int T, float *out, v41_err *err)
{
    const int D = E->cfg->dim;
    for (int t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= E->cfg->vocab_size)
            return v41_err_set(err, V41_EINVAL, "token id %d out of range [0, %d)", ids[t], E->cfg->vocab_size);
        CK(v41_dequant_rows(E->embed, NULL, ids[t], 1, out + (size_t)t * D, err));
    }
    return V41_OK;
}

static int argmax_f(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

int v41_ref_dspark_draft_batch(v41_engine *e, int n, const int *req_ids, const int *ps, const int32_t *firsts,
                               int32_t *ids_out, float *conf_out, v41_err *err)
{
    ref_engine *E = (ref_engine *)e;
    const v41_config *c = E->cfg;
    const int B = c->dspark_block_size, D = c->dim, hc = c->hc_mult, V = c->vocab_size, RK = c->dspark_markov_rank;
    if (B <= 0 || c->n_mtp_layers <= 0) return v41_err_set(err, V41_EUNSUPPORTED, "model has no DSpark stages");
    fwd F;
    memset(&F, 0, sizeof F);
    F.nr = n;
    F.T = n * B;
    F.R = calloc((size_t)n, sizeof(fwd_req));
    F.row_req = malloc(sizeof(int) * (size_t)F.T);
    F.row_pos = malloc(sizeof(int) * (size_t)F.T);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)F.T);
    int32_t *outids = malloc(sizeof(int32_t) * (size_t)n * (B + 1));
    const int T = F.T;
    const int64_t hD = (int64_t)hc * D;
    float *x = malloc(sizeof(float) * (size_t)T * D), *X = malloc(sizeof(float) * (size_t)T * hD);
    float *premix = calloc((size_t)T * hc, sizeof(float));
    float *nx = malloc(sizeof(float) * (size_t)T * D), *logits = malloc(sizeof(float) * (size_t)T * V);
    float *hl = malloc(sizeof(float) * (size_t)T * V), *bias = malloc(sizeof(float) * (size_t)T * V);
    float *me = malloc(sizeof(float) * (size_t)T * RK), *cat = malloc(sizeof(float) * (size_t)T * (D + RK));
    float *conf = malloc(sizeof(float) * (size_t)T);
    int rc = V41_OK;
    E->tap_step = e->step > 0 ? e->step - 1 : 0;
    if (!F.R || !F.row_req || !F.row_pos || !ids || !outids || !x || !X || !premix || !nx || !logits || !hl ||
        !bias || !me || !cat || !conf) {
        rc = v41_err_set(err, V41_ENOMEM, "out of memory");
        goto done;
    }
    for (int q = 0; q < n; q++) {
        req_state *st = find_req(E, req_ids[q]);
        if (!st) { rc = v41_err_set(err, V41_EINVAL, "dspark: unknown request %d", req_ids[q]); goto done; }
        if (ps[q] < 0 || ps[q] >= st->len) {
            rc = v41_err_set(err, V41_EINVAL, "dspark: request %d has no target position %d (cached %d)", req_ids[q],
                             ps[q], st->len);
            goto done;
        }
        if (ps[q] + 1 + B > E->max_seq) {
            rc = v41_err_set(err, V41_EINVAL, "dspark: positions up to %d exceed max_seq_len %d", ps[q] + B, E->max_seq);
            goto done;
        }
        F.R[q].st = st;
        F.R[q].r0 = q * B;
        F.R[q].n = B;
        F.R[q].start = ps[q] + 1;
        F.R[q].E = ps[q] + 1 + B;
        for (int i = 0; i < B; i++) {
            F.row_req[q * B + i] = q;
            F.row_pos[q * B + i] = ps[q] + 1 + i;
            ids[q * B + i] = i == 0 ? firsts[q] : c->dspark_noise_token_id;
        }
    }
    rc = embed_rows(E, ids, T, x, err);
    if (rc) goto done;
    GTAP(E, "dspark.embed", V41_TAP_BF16, x, 2, T, D, 0, 0);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < hc; j++) memcpy(X + t * hD + (int64_t)j * D, x + (size_t)t * D, sizeof(float) * D);
        premix[t * hc] = 1.0f;
    }
    for (int s = 0; s < c->n_mtp_layers; s++) {
        rc = stage_block(E, &F, c->n_layers + s, X, premix, err);
        if (rc) goto done;
    }
    const layer_w *LW = &E->L[c->n_layers + c->n_mtp_layers - 1];
    for (int t = 0; t < T; t++) {
        v41_hc_pre(X + t * hD, premix + t * hc, hc, D, x + (size_t)t * D, E->emu);
        v41_rmsnorm(x + (size_t)t * D, LW->fnorm, D, c->norm_eps, nx + (size_t)t * D, E->emu);
    }
    GTAP(E, "dspark.hc", V41_TAP_BF16, x, 2, T, D, 0, 0);
    GTAP(E, "dspark.norm", V41_TAP_BF16, nx, 2, T, D, 0, 0);
    rc = v41_linear(&E->head, nx, T, logits, E->emu, err);
    if (rc) goto done;
    memcpy(hl, logits, sizeof(float) * (size_t)T * V);
    GTAP(E, "dspark.head_logits", V41_TAP_F32, hl, 2, T, V, 0, 0);
    for (int q = 0; q < n; q++) {
        int32_t *o = outids + (size_t)q * (B + 1);
        o[0] = firsts[q];
        for (int i = 0; i < B; i++) {
            int t = q * B + i;
            if (o[i] < 0 || o[i] >= V) { rc = v41_err_set(err, V41_EINVAL, "dspark: token %d out of range", o[i]); goto done; }
            rc = v41_dequant_rows(LW->mk_embed, NULL, o[i], 1, me + (size_t)t * RK, err);
            if (rc) goto done;
            rc = v41_linear(&LW->mk_head, me + (size_t)t * RK, 1, bias + (size_t)t * V, E->emu, err);
            if (rc) goto done;
            for (int v = 0; v < V; v++) logits[(size_t)t * V + v] += bias[(size_t)t * V + v];
            o[i + 1] = argmax_f(logits + (size_t)t * V, V);
        }
    }
    GTAP(E, "dspark.markov_bias", V41_TAP_F32, bias, 2, T, V, 0, 0);
    GTAP(E, "dspark.markov_embed", V41_TAP_BF16, me, 2, T, RK, 0, 0);
    GTAP(E, "dspark.logits", V41_TAP_F32, logits, 2, T, V, 0, 0);
    for (int t = 0; t < T; t++) {
        memcpy(cat + (size_t)t * (D + RK), x + (size_t)t * D, sizeof(float) * D);
        memcpy(cat + (size_t)t * (D + RK) + D, me + (size_t)t * RK, sizeof(float) * RK);
    }
    rc = v41_linear(&LW->conf, cat, T, conf, E->emu, err);
    if (rc) goto done;
    GTAP(E, "dspark.confidence", V41_TAP_F32, conf, 1, T, 0, 0, 0);
    GTAP(E, "dspark.tokens", V41_TAP_I32, outids, 2, n, B + 1, 0, 0);
    if (ids_out) memcpy(ids_out, outids, sizeof(int32_t) * (size_t)n * (B + 1));
    if (conf_out) memcpy(conf_out, conf, sizeof(float) * (size_t)T);
done:
    free(F.R); free(F.row_req); free(F.row_pos); free(F.topk); free(F.topk_k); free(F.cand);
    free(ids); free(outids); free(x); free(X); free(premix); free(nx); free(logits); free(hl); free(bias);
    free(me); free(cat); free(conf);
    return rc;
}

static int ref_dspark_draft(v41_engine *e, int req_id, int p, int32_t first, int32_t *ids, float *confidence,
                            v41_err *err)
{
    const int B = e->model->cfg.dspark_block_size;
    int32_t *o = malloc(sizeof(int32_t) * (size_t)(B + 1));
    if (!o) return v41_err_set(err, V41_ENOMEM, "out of memory");
    int rc = v41_ref_dspark_draft_batch(e, 1, &req_id, &p, &first, o, confidence, err);
    if (!rc && ids) memcpy(ids, o, sizeof(int32_t) * (size_t)B);
    free(o);
    return rc;
}

/* ------------------------------------------------------------------ forward */

static int ref_forward(v41_engine *e, const v41_batch *b, v41_out *out, v41_err *err)
{
    ref_engine *E = (ref_engine *)e;
    const v41_config *c = E->cfg;
    const int D = c->dim, hc = c->hc_mult, V = c->vocab_size;
    const int64_t hD = (int64_t)hc * D;
    int rc = V41_OK;
#ifdef _OPENMP
    if (E->threads > 0) omp_set_num_threads(E->threads);
#endif
    if (!b || b->n_req <= 0) return v41_err_set(err, V41_EINVAL, "forward: empty batch");
    fwd F;
    memset(&F, 0, sizeof F);
    F.nr = b->n_req;
    F.R = calloc((size_t)F.nr, sizeof(fwd_req));
    F.topk_k = calloc((size_t)F.nr, sizeof(int));
    if (!F.R || !F.topk_k) { free(F.R); free(F.topk_k); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    E->tap_step = e->step;
    E->tap_order = 0;
    int T = 0;
    for (int q = 0; q < F.nr; q++) {
        const v41_req *rq = &b->req[q];
        for (int q2 = 0; q2 < q; q2++)
            if (b->req[q2].id == rq->id) { rc = v41_err_set(err, V41_EINVAL, "forward: request %d twice in one batch", rq->id); goto fail; }
        if (rq->n_tokens <= 0 || !rq->tokens) { rc = v41_err_set(err, V41_EINVAL, "forward: request %d has no tokens", rq->id); goto fail; }
        if (rq->start_pos < 0 || rq->start_pos + rq->n_tokens > E->max_seq) {
            rc = v41_err_set(err, V41_EINVAL, "forward: request %d positions [%d, %d) exceed max_seq_len %d", rq->id,
                             rq->start_pos, rq->start_pos + rq->n_tokens, E->max_seq);
            goto fail;
        }
        req_state *st = find_req(E, rq->id);
        if (!st) {
            if (rq->start_pos != 0) {
                rc = v41_err_set(err, V41_EINVAL, "forward: request %d is new but starts at position %d", rq->id, rq->start_pos);
                goto fail;
            }
            st = new_req(E, rq->id, err);
            if (!st) { rc = err->code; goto fail; }
        } else if (rq->start_pos != st->len && (rc = v41_srv_check_start(E, st, rq, err))) {
            goto fail; /* not the cached length and not a replay of the cached prefix (SPEC §7) */
        }
        F.R[q].st = st;
        F.R[q].q = rq;
        F.R[q].r0 = T;
        F.R[q].n = rq->n_tokens;
        F.R[q].start = rq->start_pos;
        F.R[q].E = rq->start_pos + rq->n_tokens;
        F.R[q].floor_ = rq->replay_floor > 0 ? rq->replay_floor : 0;
        F.R[q].hit = rq->start_pos < st->len ? st->len : rq->start_pos; /* replayed rows: [start, hit) */
        T += rq->n_tokens;
    }
    F.T = T;
    F.row_req = malloc(sizeof(int) * (size_t)T);
    F.row_pos = malloc(sizeof(int) * (size_t)T);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
    float *x = malloc(sizeof(float) * (size_t)T * D), *X = malloc(sizeof(float) * (size_t)T * hD);
    float *premix = calloc((size_t)T * hc, sizeof(float));
    const int nt = c->n_dspark_targets;
    const bool dspark = c->dspark_block_size > 0 && c->n_mtp_layers > 0 && nt > 0;
    float *mh = dspark ? calloc((size_t)T * nt * D, sizeof(float)) : NULL; /* trimmed rows stay 0 */
    const int ew = E->eh ? v41_engram_hash_width(E->eh) : 0;
    const int ne = c->n_engram_layers;
    int32_t *hid = ew ? malloc(sizeof(int32_t) * (size_t)T * ne * ew) : NULL;
    if (!F.row_req || !F.row_pos || !tok || !x || !X || !premix || (dspark && !mh) || (ew && !hid)) {
        rc = v41_err_set(err, V41_ENOMEM, "out of memory");
        goto done;
    }
    for (int q = 0; q < F.nr; q++)
        for (int i = 0; i < F.R[q].n; i++) {
            int t = F.R[q].r0 + i;
            F.row_req[t] = q;
            F.row_pos[t] = F.R[q].start + i;
            tok[t] = F.R[q].q->tokens[i];
            if (tok[t] < 0 || tok[t] >= V) {
                rc = v41_err_set(err, V41_EINVAL, "forward: request %d token %d out of range [0, %d)", F.R[q].q->id, tok[t], V);
                goto done;
            }
        }
    GTAP(E, "tokens.in", V41_TAP_I32, tok, 1, T, 0, 0, 0);
    rc = v41_srv_plan(E, &F, err); /* SPEC §7 decoder side: which rows run after the cut */
    if (rc) goto done;
    if (F.kept) GTAP(E, "replay.kept", V41_TAP_U8, F.kept, 1, T, 0, 0, 0);
    /* Engram hash ids of every row (token history per request) */
    if (ew) {
        const int64_t *map = e->model->engram_token_map;
        const int64_t pad = map ? map[c->engram_pad_id] : c->engram_pad_id;
        int N = c->engram_max_ngram_size;
        for (int t = 0; t < T; t++) {
            req_state *st = F.R[F.row_req[t]].st;
            st->etok[F.row_pos[t]] = map ? map[tok[t]] : tok[t];
        }
        for (int t = 0; t < T; t++) {
            req_state *st = F.R[F.row_req[t]].st;
            int p = F.row_pos[t];
            int64_t back[V41_ENGRAM_MAX_NGRAM], o64[256];
            for (int i = 0; i < N; i++) back[i] = p - i >= 0 ? st->etok[p - i] : pad;
            for (int k = 0; k < ne; k++) {
                v41_engram_hash_row(E->eh, k, back, o64);
                for (int j = 0; j < ew; j++) hid[((size_t)t * ne + k) * ew + j] = (int32_t)o64[j];
            }
        }
        GTAP(E, "engram.hash_ids", V41_TAP_I32, hid, 3, T, ne, ew, 0);
    }
    rc = embed_rows(E, tok, T, x, err);
    if (rc) goto done;
    GTAP(E, "embed", V41_TAP_BF16, x, 2, T, D, 0, 0);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < hc; j++) memcpy(X + t * hD + (int64_t)j * D, x + (size_t)t * D, sizeof(float) * D);
        premix[t * hc] = 1.0f;
    }
    int ti = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const layer_w *W = &E->L[l];
        if (W->eidx >= 0) {
            rc = engram(E, &F, l, hid, ew, X, err);
            if (rc) goto done;
            LTAP(E, l, "engram.out", V41_TAP_BF16, X, 3, F.T, hc, D, 0);
        }
        /* F.T: the kept rows after the cut (SPEC §7 trimming), else T */
        LFORCE(E, l, "stream.in", V41_TAP_BF16, X, 3, F.T, hc, D);
        LFORCE(E, l, "premix.in", V41_TAP_F32, premix, 2, F.T, hc, 0);
        if (dspark && v41_is_dspark_target(c, l)) {
            for (int t = 0; t < F.T; t++)
                for (int k = 0; k < D; k++) {
                    if (!F.full_row && F.kept && !F.kept[t]) break; /* trimmed row: no drafter context (SPEC §7) */
                    float s = 0;
                    for (int j = 0; j < hc; j++) s += X[t * hD + (int64_t)j * D + k];
                    s = s / (float)hc;
                    mh[((size_t)(F.full_row ? F.full_row[t] : t) * nt + ti) * D + k] = E->emu ? v41_bf16r(s) : s;
                }
            ti++;
        }
        rc = block(E, &F, l, X, premix, false, err);
        if (rc) goto done;
        rc = cache_taps(E, &F, l, err);
        if (rc) goto done;
    }
    if (F.full_row) { /* SPEC §7: scatter the kept rows back (trimmed rows: zeros) */
        rc = v41_srv_expand(E, &F, X, premix, err);
        if (rc) goto done;
    }
    /* final collapse, norm, head */
    for (int t = 0; t < T; t++) v41_hc_pre(X + t * hD, premix + t * hc, hc, D, x + (size_t)t * D, E->emu);
    GTAP(E, "final.hc", V41_TAP_BF16, x, 2, T, D, 0, 0);
    for (int t = 0; t < T; t++) v41_rmsnorm(x + (size_t)t * D, E->norm, D, c->norm_eps, x + (size_t)t * D, E->emu);
    GTAP(E, "final.norm", V41_TAP_BF16, x, 2, T, D, 0, 0);
    {
        int nout = 0;
        free(E->out_rowoff);
        E->out_rowoff = malloc(sizeof(int) * (size_t)(F.nr + 1));
        if (!E->out_rowoff) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        for (int q = 0; q < F.nr; q++) {
            E->out_rowoff[q] = nout;
            nout += F.R[q].q->all_logits ? F.R[q].n : 1;
        }
        E->out_rowoff[F.nr] = nout;
        float *xo = malloc(sizeof(float) * (size_t)nout * D);
        free(E->out_logits);
        free(E->out_argmax);
        E->out_logits = malloc(sizeof(float) * (size_t)nout * V);
        E->out_argmax = malloc(sizeof(int32_t) * (size_t)nout);
        if (!xo || !E->out_logits || !E->out_argmax) { free(xo); rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        int k = 0;
        for (int q = 0; q < F.nr; q++) {
            int i0 = F.R[q].q->all_logits ? 0 : F.R[q].n - 1;
            for (int i = i0; i < F.R[q].n; i++)
                memcpy(xo + (size_t)k++ * D, x + (size_t)(F.R[q].r0 + i) * D, sizeof(float) * D);
        }
        rc = v41_linear(&E->head, xo, nout, E->out_logits, E->emu, err);
        free(xo);
        if (rc) goto done;
        for (int i = 0; i < nout; i++) E->out_argmax[i] = argmax_f(E->out_logits + (size_t)i * V, V);
        GTAP(E, "logits", V41_TAP_F32, E->out_logits, 2, nout, V, 0, 0);
        GTAP(E, "tokens", V41_TAP_I32, E->out_argmax, 1, nout, 0, 0, 0);
        if (out) {
            out->logits = E->out_logits;
            out->argmax = E->out_argmax;
            out->row_offset = E->out_rowoff;
        }
    }
    /* DSpark: main_hidden -> main_x, seed every stage's window KV at these positions */
    if (dspark) {
        const layer_w *S0 = &E->L[c->n_layers];
        GTAP(E, "dspark.main_hidden", V41_TAP_BF16, mh, 2, T, (int64_t)nt * D, 0, 0);
        rc = v41_linear(&S0->main_proj, mh, T, x, E->emu, err);
        if (rc) goto done;
        for (int t = 0; t < T; t++) v41_rmsnorm(x + (size_t)t * D, S0->main_norm, D, c->norm_eps, x + (size_t)t * D, E->emu);
        if (E->e.force && force_pt(E, "dspark.main_x", V41_TAP_BF16, x, 2, T, D, 0, err) < 0) { rc = err->code; goto done; }
        GTAP(E, "dspark.main_x", V41_TAP_BF16, x, 2, T, D, 0, 0);
        rc = dspark_seed(E, &F, x, err);
        if (rc) goto done;
    }
    for (int q = 0; q < F.nr; q++)
        if (F.R[q].E > F.R[q].st->len) F.R[q].st->len = F.R[q].E; /* a replay ending inside the hit keeps it */
    e->step++;
done:
    free(tok); free(x); free(X); free(premix); free(mh); free(hid);
fail:
    v41_srv_free(E, &F);
    free(F.R); free(F.row_req); free(F.row_pos); free(F.topk); free(F.topk_k); free(F.cand);
    return rc;
}

/* ------------------------------------------------------------------ cache management */

static int ref_truncate(v41_engine *e, int req_id, int pos, v41_err *err)
{
    ref_engine *E = (ref_engine *)e;
    req_state *st = find_req(E, req_id);
    if (!st) return v41_err_set(err, V41_EINVAL, "truncate: unknown request %d", req_id);
    if (pos < 0 || pos > st->len) return v41_err_set(err, V41_EINVAL, "truncate: position %d outside [0, %d]", pos, st->len);
    /* window KV, compressed KV and index keys are kept per position: shortening the
     * length drops them. The partial-group state is rebuilt from the per-position
     * history (slots of positions in [floor(pos/m)*m, pos)). */
    const int d = E->cfg->head_dim;
    for (int l = 0; l < E->nL; l++) {
        const layer_w *W = &E->L[l];
        if (!W->kv_src || W->ratio <= 1) continue;
        int m = W->ratio, g0 = pos / m * m;
        for (int p = g0; p < pos; p++) {
            memcpy(st->kvst[l] + (size_t)(p % m) * d, st->kvh[l] + (size_t)p * d, sizeof(float) * d);
            memcpy(st->scst[l] + (size_t)(p % m) * d, st->sch[l] + (size_t)p * d, sizeof(float) * d);
        }
    }
    st->len = pos;
    if (pos == 0) st->ik_owner = -1;
    return V41_OK;
}

static int ref_fork(v41_engine *e, int src_id, int dst_id, int n, v41_err *err)
{
    ref_engine *E = (ref_engine *)e;
    req_state *s = find_req(E, src_id);
    if (!s) return v41_err_set(err, V41_EINVAL, "fork: unknown request %d", src_id);
    if (n < 0 || n > s->len) return v41_err_set(err, V41_EINVAL, "fork: prefix %d outside [0, %d]", n, s->len);
    if (find_req(E, dst_id)) return v41_err_set(err, V41_EINVAL, "fork: request %d exists", dst_id);
    req_state *d = new_req(E, dst_id, err);
    if (!d) return err->code;
    s = find_req(E, src_id); /* slot array is stable; re-find for clarity */
    const v41_config *c = E->cfg;
    const int hd = c->head_dim, dI = c->index_head_dim;
    memcpy(d->etok, s->etok, sizeof(int64_t) * (size_t)n);
    for (int l = 0; l < E->nL; l++) {
        const layer_w *W = &E->L[l];
        memcpy(d->win[l], s->win[l], sizeof(float) * (size_t)n * hd);
        if (W->kv_src) {
            int m = W->ratio;
            memcpy(d->ckv[l], s->ckv[l], sizeof(float) * (size_t)(n / m) * hd);
            memcpy(d->ik[l], s->ik[l], sizeof(float) * (size_t)(n / m) * dI);
            if (m > 1) {
                memcpy(d->kvh[l], s->kvh[l], sizeof(float) * (size_t)n * hd);
                memcpy(d->sch[l], s->sch[l], sizeof(float) * (size_t)n * hd);
            }
        }
    }
    d->len = s->len;
    d->ik_owner = s->ik_owner;
    return ref_truncate(e, dst_id, n, err);
}

static void ref_release(v41_engine *e, int req_id)
{
    ref_engine *E = (ref_engine *)e;
    req_state *st = find_req(E, req_id);
    if (st) free_req(E, st);
}

static void ref_destroy(v41_engine *e)
{
    ref_engine *E = (ref_engine *)e;
    if (!E) return;
    for (int i = 0; i < E->nslots; i++) free_req(E, &E->rs[i]);
    free(E->rs);
    if (E->L)
        for (int l = 0; l < E->nL; l++) free_layer(&E->L[l]);
    free(E->L);
    free(E->norm);
    if (E->eh) v41_engram_hash_free(E->eh);
    free(E->out_logits);
    free(E->out_argmax);
    free(E->out_rowoff);
    free(E);
}

static const v41_engine_vtbl ref_vt = {
    .name = "ref",
    .forward = ref_forward,
    .dspark_draft = ref_dspark_draft,
    .dspark_draft_batch = v41_ref_dspark_draft_batch,
    .truncate = ref_truncate,
    .fork = ref_fork,
    .release = ref_release,
    .destroy = ref_destroy,
};

int v41_ref_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out, v41_err *err)
{
    if (!m || !out) return v41_err_set(err, V41_EINVAL, "engine: NULL model");
    ref_engine *E = calloc(1, sizeof *E);
    if (!E) return v41_err_set(err, V41_ENOMEM, "out of memory");
    E->e.vt = &ref_vt;
    E->e.model = m;
    if (o) E->e.opts = *o;
    else v41_engine_opts_default(&E->e.opts);
    E->cfg = &m->cfg;
    const v41_config *c = E->cfg;
    E->emu = E->e.opts.precision == V41_PREC_EMULATE;
    /* the engine threads over weight chunks itself (OpenMP); each sgemm runs on one thread */
    v41_blas_single_thread();
    E->threads = E->e.opts.threads;
    E->max_seq = E->e.opts.max_seq_len > 0 ? E->e.opts.max_seq_len : c->max_seq_len;
    if (E->max_seq <= 0) E->max_seq = 4096;
    E->nslots = E->e.opts.max_requests > 0 ? E->e.opts.max_requests : (c->max_batch_size > 0 ? c->max_batch_size : 4) * 4;
    E->rs = calloc((size_t)E->nslots, sizeof(req_state));
    E->nL = v41_n_total_layers(c);
    E->L = calloc((size_t)E->nL, sizeof(layer_w));
    int rc = V41_OK;
    if (!E->rs || !E->L) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto fail; }
    const char *inject = E->e.opts.inject;
    if (!inject) inject = getenv("V41_INJECT");
    rc = parse_inject(E, inject, err);
    if (rc) goto fail;
    if (E->e.opts.dspark_align <= 0) E->e.opts.dspark_align = v41_srv_default_align(E);
    rc = get_t(E, "embed.weight", &E->embed, err);
    if (!rc) rc = load_lin(E, "head", c->vocab_size, c->dim, V41_LIN_F32, &E->head, err);
    if (rc) goto fail;
    E->head.kind = V41_LIN_F32;
    rc = load_vec(E, "norm.weight", c->dim, &E->norm, err);
    if (rc) goto fail;
    for (int l = 0; l < E->nL; l++) {
        rc = load_layer(E, l, err);
        if (rc) { v41_err_prefix(err, "engine: layer %d", l); goto fail; }
    }
    if (c->n_engram_layers > 0) {
        rc = v41_engram_hash_init(c, &E->eh, err);
        if (rc) goto fail;
    }
    *out = &E->e;
    return V41_OK;
fail:
    ref_destroy(&E->e);
    return rc;
}
