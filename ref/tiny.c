/* tiny.c: the built-in tiny model. Same configuration, tensor names, dtypes
 * and shapes as ../shared/oracle/v41-tiny, with deterministic synthetic
 * values (NOT the oracle's values: the oracle's come from torch's RNG).
 *
 * Values, per tensor from its own stream (seed = f(TINY_SEED, name), so a
 * tensor does not depend on which others exist): normal draws scaled
 * 1/sqrt(fan_in) for projections (quantized ones with per-32-block x{0.5,1,2}
 * multipliers, then stored fp8 e4m3 + e8m0 32x32 scales or fp4 e2m1 + e8m0
 * per 32), norms 1 + 0.2 N, attn_sink 0.8 N, gate bias 0.3 N, hc base 0.5 N,
 * hc scale U(0.5, 1.5). fp32 tensors that are bf16 in the real checkpoint get
 * bf16-representable values. PRNG: splitmix64, Box-Muller normals. */
#include "v41_loader_internal.h"
#include "v41_quant.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TINY_SEED 0x7641746e79ull /* "vAtny" */

typedef struct {
    uint64_t s;
    bool have;
    double spare;
} rng;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static rng rng_for(const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = name; *p; p++) { h ^= (uint8_t)*p; h *= 0x100000001b3ull; }
    rng r = {h ^ TINY_SEED, false, 0};
    splitmix(&r.s);
    return r;
}

static double unif(rng *r) { return (double)(splitmix(&r->s) >> 11) * 0x1p-53; } /* [0, 1) */

static double normal(rng *r)
{
    if (r->have) { r->have = false; return r->spare; }
    double u1 = unif(r), u2 = unif(r);
    if (u1 < 1e-300) u1 = 1e-300;
    double rad = sqrt(-2.0 * log(u1)), th = 2.0 * M_PI * u2;
    r->spare = rad * sin(th);
    r->have = true;
    return rad * cos(th);
}

typedef struct {
    v41_weights *w;
    v41_err *err;
    int rc;
} gen;

static float *draw(const char *name, int64_t n, double std, bool blockmul, int64_t K)
{
    float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    if (!v) return NULL;
    rng r = rng_for(name);
    for (int64_t i = 0; i < n; i++) v[i] = (float)(normal(&r) * std);
    if (blockmul) { /* x{0.5, 1, 2} per 32x32 block (per 32 in a row for K-blocks) */
        rng rb = rng_for(name);
        rb.s ^= 0x5bd1e995ull;
        int64_t N = n / K, nbk = (K + 31) / 32;
        int64_t nbn = (N + 31) / 32;
        float *mul = malloc((size_t)(nbn * nbk) * sizeof *mul);
        if (!mul) { free(v); return NULL; }
        for (int64_t i = 0; i < nbn * nbk; i++) mul[i] = (float[]){0.5f, 1.0f, 2.0f}[splitmix(&rb.s) % 3];
        for (int64_t i = 0; i < n; i++) v[i] *= mul[(i / K / 32) * nbk + (i % K) / 32];
        free(mul);
    }
    return v;
}

static void add(gen *g, const char *name, v41_dtype dt, int ndim, int64_t n0, int64_t n1, void *data, size_t nbytes)
{
    if (g->rc) { free(data); return; }
    if (!data) { g->rc = v41_err_set(g->err, V41_ENOMEM, "out of memory"); return; }
    int64_t sh[2] = {n0, n1};
    g->rc = v41w_add(g->w, name, dt, ndim, sh, data, nbytes, g->err);
}

/* fp32 values -> stored dtype (BF16 / F32), consumes v */
static void store_plain(gen *g, const char *name, v41_dtype dt, int ndim, int64_t n0, int64_t n1, float *v)
{
    if (!v) { add(g, name, dt, ndim, n0, n1, NULL, 0); return; }
    int64_t n = ndim == 1 ? n0 : n0 * n1;
    if (dt == V41_DT_BF16) {
        uint16_t *b = malloc((size_t)(n ? n : 1) * 2);
        if (b)
            for (int64_t i = 0; i < n; i++) b[i] = v41_f32_to_bf16(v[i]);
        free(v);
        add(g, name, dt, ndim, n0, n1, b, (size_t)n * 2);
    } else {
        add(g, name, dt, ndim, n0, n1, v, (size_t)n * 4);
    }
}

static void vec(gen *g, const char *name, int64_t n, v41_dtype dt, double mean, double std)
{
    float *v = draw(name, n, std, false, 1);
    if (v)
        for (int64_t i = 0; i < n; i++) v[i] += (float)mean;
    store_plain(g, name, dt, 1, n, 0, v);
}

static void unif_vec(gen *g, const char *name, int64_t n, double lo, double hi)
{
    float *v = malloc((size_t)n * sizeof *v);
    if (v) {
        rng r = rng_for(name);
        for (int64_t i = 0; i < n; i++) v[i] = (float)(lo + (hi - lo) * unif(&r));
    }
    store_plain(g, name, V41_DT_F32, 1, n, 0, v);
}

typedef enum { S_FP8, S_FP4, S_BF16, S_F32 } skind;

/* Linear "<p>.weight" [N, K] in storage kind s (+ "<p>.scale"). */
static void lin(gen *g, const char *p, skind s, int64_t N, int64_t K)
{
    char wn[256], sn[256];
    snprintf(wn, sizeof wn, "%s.weight", p);
    snprintf(sn, sizeof sn, "%s.scale", p);
    float *v = draw(wn, N * K, 1.0 / sqrt((double)K), s == S_FP8 || s == S_FP4, K);
    if (!v) { add(g, wn, V41_DT_F32, 2, N, K, NULL, 0); return; }
    if (s == S_FP8) {
        int64_t nbn = (N + 31) / 32, nbk = (K + 31) / 32;
        uint8_t *q = malloc((size_t)(N * K)), *sc = malloc((size_t)(nbn * nbk));
        if (q && sc) v41_quant_fp8_weight(v, N, K, q, sc);
        free(v);
        add(g, wn, V41_DT_F8_E4M3, 2, N, K, q, (size_t)(N * K));
        add(g, sn, V41_DT_F8_E8M0, 2, nbn, nbk, sc, (size_t)(nbn * nbk));
    } else if (s == S_FP4) {
        uint8_t *q = malloc((size_t)(N * K / 2)), *sc = malloc((size_t)(N * (K / 32)));
        if (q && sc) v41_quant_fp4_weight(v, N, K, q, sc);
        free(v);
        add(g, wn, V41_DT_F4, 2, N, K, q, (size_t)(N * K / 2));
        add(g, sn, V41_DT_F8_E8M0, 2, N, K / 32, sc, (size_t)(N * (K / 32)));
    } else if (s == S_BF16) {
        store_plain(g, wn, V41_DT_BF16, 2, N, K, v);
    } else { /* fp32 storage with bf16-representable values */
        v41_round_bf16_n(v, (size_t)(N * K));
        store_plain(g, wn, V41_DT_F32, 2, N, K, v);
    }
}

static void block(gen *g, const v41_config *c, int l)
{
    char p[64], n[256];
    int L = c->n_layers;
    if (l < L) snprintf(p, sizeof p, "layers.%d", l);
    else snprintf(p, sizeof p, "mtp.%d", l - L);
    const int64_t D = c->dim, h = c->hc_mult, d = c->head_dim, H = c->n_heads, G = c->o_groups;
    const int64_t mix = (2 + h) * h;
#define Q(fmt, ...) (snprintf(n, sizeof n, "%s." fmt, p, ##__VA_ARGS__), n)
    vec(g, Q("attn_norm.weight"), D, V41_DT_BF16, 1.0, 0.2);
    vec(g, Q("ffn_norm.weight"), D, V41_DT_BF16, 1.0, 0.2);
    static const char *const sub[2] = {"attn", "ffn"};
    for (int s = 0; s < 2; s++) {
        float *fn = draw(Q("hc_%s_fn", sub[s]), mix * h * D, 1.0 / sqrt((double)(h * D)), false, 1);
        store_plain(g, n, V41_DT_F32, 2, mix, h * D, fn);
        vec(g, Q("hc_%s_base", sub[s]), mix, V41_DT_F32, 0.0, 0.5);
        unif_vec(g, Q("hc_%s_scale", sub[s]), 3, 0.5, 1.5);
    }
    lin(g, Q("attn.wq_a"), S_FP8, c->q_lora_rank, D);
    vec(g, Q("attn.q_norm.weight"), c->q_lora_rank, V41_DT_BF16, 1.0, 0.2);
    lin(g, Q("attn.wq_b"), S_FP8, H * d, c->q_lora_rank);
    lin(g, Q("attn.wkv"), S_FP8, d, D);
    vec(g, Q("attn.kv_norm.weight"), d, V41_DT_BF16, 1.0, 0.2);
    lin(g, Q("attn.wo_a"), S_BF16, G * c->o_lora_rank, H * d / G);
    lin(g, Q("attn.wo_b"), S_FP8, D, G * c->o_lora_rank);
    vec(g, Q("attn.attn_sink"), H, V41_DT_F32, 0.0, 0.8);
    if (l < L && v41_is_kv_source(c, l)) {
        if (c->compress_ratios[l] > 1) {
            lin(g, Q("attn.compressor.wkv"), S_F32, d, D);
            lin(g, Q("attn.compressor.wgate"), S_F32, d, D);
        } else {
            lin(g, Q("attn.compressor.wkv"), S_BF16, d, D);
        }
        vec(g, Q("attn.compressor.norm.weight"), d, V41_DT_BF16, 1.0, 0.2);
        lin(g, Q("attn.indexer.wk"), S_BF16, c->index_head_dim, d);
        vec(g, Q("attn.indexer.k_norm.weight"), c->index_head_dim, V41_DT_BF16, 1.0, 0.2);
    }
    if (l < L && v41_is_index_source(c, l)) {
        lin(g, Q("attn.indexer.wq_b"), S_FP8, (int64_t)c->index_n_heads * c->index_head_dim, c->q_lora_rank);
        lin(g, Q("attn.indexer.weights_proj"), S_BF16, c->index_n_heads, D);
    }
    int64_t E = v41_layer_n_experts(c, l), I = c->moe_inter_dim;
    lin(g, Q("ffn.gate"), S_BF16, E, D);
    vec(g, Q("ffn.gate.bias"), E, V41_DT_F32, 0.0, 0.3);
    skind ek = !strcmp(c->expert_dtype, "fp4") ? S_FP4 : !strcmp(c->expert_dtype, "fp8") ? S_FP8 : S_BF16;
    skind lk = !strcmp(c->dtype, "fp8") ? S_FP8 : S_BF16;
    for (int64_t e = 0; e < E; e++) {
        lin(g, Q("ffn.experts.%lld.w1", (long long)e), ek, I, D);
        lin(g, Q("ffn.experts.%lld.w2", (long long)e), ek, D, I);
        lin(g, Q("ffn.experts.%lld.w3", (long long)e), ek, I, D);
    }
    if (c->n_shared_experts > 0) {
        int64_t S = (int64_t)c->n_shared_experts * I;
        lin(g, Q("ffn.shared_experts.w1"), lk, S, D);
        lin(g, Q("ffn.shared_experts.w2"), lk, D, S);
        lin(g, Q("ffn.shared_experts.w3"), lk, S, D);
    }
    int ei = l < L ? v41_engram_index(c, l) : -1;
    if (ei >= 0) {
        int64_t rows = c->engram_num_embeddings[ei], hd = c->engram_head_dim, nbk = (hd + 31) / 32;
        float *t = draw(Q("engram.embed.weight"), rows * hd, 1.0, false, 1);
        uint8_t *q = malloc((size_t)(rows * hd)), *sc = malloc((size_t)(rows * nbk));
        if (t && q && sc) /* one e8m0 scale per 32 columns of each row */
            for (int64_t r = 0; r < rows; r++) v41_quant_fp8_weight(t + r * hd, 1, hd, q + r * hd, sc + r * nbk);
        free(t);
        add(g, n, V41_DT_F8_E4M3, 2, rows, hd, q, (size_t)(rows * hd));
        add(g, Q("engram.embed.scale"), V41_DT_F8_E8M0, 2, rows, nbk, sc, (size_t)(rows * nbk));
        vec(g, Q("engram.q_weight"), h * D, V41_DT_BF16, 1.0, 0.2);
        vec(g, Q("engram.k_weight"), h * D, V41_DT_BF16, 1.0, 0.2);
        lin(g, Q("engram.wkv"), lk, (h + 1) * D, (int64_t)(c->engram_max_ngram_size - 1) * c->engram_n_heads * hd);
    }
    if (l == L) {
        lin(g, Q("main_proj"), lk, D, (int64_t)c->n_dspark_targets * D);
        vec(g, Q("main_norm.weight"), D, V41_DT_BF16, 1.0, 0.2);
    }
    if (l >= L && l == L + c->n_mtp_layers - 1) {
        int64_t V = c->vocab_size, R = c->dspark_markov_rank;
        vec(g, Q("norm.weight"), D, V41_DT_BF16, 1.0, 0.2);
        lin(g, Q("markov_head.embed"), S_BF16, V, R);
        lin(g, Q("markov_head.head"), S_F32, V, R);
        lin(g, Q("confidence_head.proj"), S_F32, 1, D + R);
    }
#undef Q
}

/* engram q_weight / k_weight are [hc, D]: vec() stores them 1-D; fix the shape */
static void reshape_2d(v41_weights *w, const char *name, int64_t n0, int64_t n1)
{
    v41_tensor *t = (v41_tensor *)v41_weights_find(w, name);
    if (t && t->ndim == 1 && t->shape[0] == n0 * n1) {
        t->ndim = 2;
        t->shape[0] = n0;
        t->shape[1] = n1;
    }
}

int v41_model_tiny(v41_model **out, v41_err *err)
{
    *out = NULL;
    v41_model *m = calloc(1, sizeof *m);
    if (!m) return v41_err_set(err, V41_ENOMEM, "out of memory");
    snprintf(m->source, sizeof m->source, "tiny");
    v41_config_tiny(&m->cfg);
    const v41_config *c = &m->cfg;
    gen g = {v41w_new_mem(), err, V41_OK};
    if (!g.w) { free(m); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    m->w = g.w;
    {
        const int64_t V = c->vocab_size, D = c->dim;
        float *e = draw("embed.weight", V * D, 1.0 / sqrt((double)D), false, 1);
        store_plain(&g, "embed.weight", V41_DT_BF16, 2, V, D, e);
        vec(&g, "norm.weight", D, V41_DT_BF16, 1.0, 0.2);
        lin(&g, "head", S_F32, V, D);
    }
    for (int l = 0; l < v41_n_total_layers(c) && !g.rc; l++) block(&g, c, l);
    for (int j = 0; j < c->n_mtp_layers && !g.rc; j++) {
        char a[64];
        snprintf(a, sizeof a, "mtp.%d.embed.weight", j);
        if (!g.rc) g.rc = v41w_add_alias(g.w, a, "embed.weight", err);
        snprintf(a, sizeof a, "mtp.%d.head.weight", j);
        if (!g.rc) g.rc = v41w_add_alias(g.w, a, "head.weight", err);
    }
    if (!g.rc) g.rc = v41w_set_meta(g.w, "format", "pt", err);
    if (!g.rc) g.rc = v41w_set_meta(g.w, "generator", "v41 built-in tiny model (ref/tiny.c)", err);
    if (!g.rc)
        g.rc = v41w_set_meta(g.w, "fp4_packing",
                             "float4_e2m1fn_x2: byte j of a row holds element 2j (low nibble) and 2j+1 (high nibble); "
                             "bit 3 = sign",
                             err);
    if (!g.rc) g.rc = v41w_finish(g.w, err);
    if (!g.rc)
        for (int i = 0; i < c->n_engram_layers; i++) {
            char a[96];
            snprintf(a, sizeof a, "layers.%d.engram.q_weight", c->engram_layer_ids[i]);
            reshape_2d(g.w, a, c->hc_mult, c->dim);
            snprintf(a, sizeof a, "layers.%d.engram.k_weight", c->engram_layer_ids[i]);
            reshape_2d(g.w, a, c->hc_mult, c->dim);
        }
    /* engram token map: a seeded surjection of the vocab onto the compressed ids */
    if (!g.rc && c->n_engram_layers > 0) {
        int V = c->vocab_size, C = c->engram_compressed_vocab_size;
        m->engram_token_map = malloc((size_t)V * sizeof(int64_t));
        if (!m->engram_token_map) g.rc = v41_err_set(err, V41_ENOMEM, "out of memory");
        else {
            rng r = rng_for("engram_token_map");
            int64_t *perm = malloc((size_t)C * sizeof *perm);
            if (!perm) g.rc = v41_err_set(err, V41_ENOMEM, "out of memory");
            else {
                for (int i = 0; i < C; i++) perm[i] = i;
                for (int i = C - 1; i > 0; i--) { /* Fisher-Yates */
                    int j = (int)(splitmix(&r.s) % (uint64_t)(i + 1));
                    int64_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
                }
                for (int i = 0; i < V; i++)
                    m->engram_token_map[i] = i < C ? perm[i] : (int64_t)(splitmix(&r.s) % (uint64_t)C);
                /* shuffle token order so the identity block is not at the start */
                for (int i = V - 1; i > 0; i--) {
                    int j = (int)(splitmix(&r.s) % (uint64_t)(i + 1));
                    int64_t t = m->engram_token_map[i];
                    m->engram_token_map[i] = m->engram_token_map[j];
                    m->engram_token_map[j] = t;
                }
                free(perm);
            }
        }
    }
    if (!g.rc) g.rc = v41_weights_check_config(g.w, c, err);
    if (g.rc) {
        if (err) v41_err_prefix(err, "built-in tiny model");
        v41_model_free(m);
        return g.rc;
    }
    *out = m;
    return V41_OK;
}
