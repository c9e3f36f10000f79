/* config.c: config.json (DeepSeek ModelArgs keys or the Hugging Face form),
 * validation of SPEC §1, layer-schedule helpers, serialisation. */
#include "v41_config.h"
#include "v41_loader_internal.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------ key table */

typedef enum { K_INT, K_I64, K_DBL, K_BOOL, K_STR, K_INTLIST, K_I64LIST, K_SCORE } ktype;

typedef struct {
    const char *name;    /* ModelArgs key */
    const char *hf;      /* Hugging Face key when different (NULL = same name) */
    ktype type;
    bool required;
    size_t off;          /* offset of the value in v41_config */
    size_t count_off;    /* lists: offset of the int count (or (size_t)-1) */
    int max;             /* lists: capacity */
    double def;          /* default when optional (numbers/bools) */
    const char *sdef;    /* default for strings */
} keydef;

#define OFF(f) offsetof(v41_config, f)
#define NOCOUNT ((size_t)-1)

static const keydef keys[] = {
    {"max_batch_size", NULL, K_INT, false, OFF(max_batch_size), 0, 0, 4, NULL},
    {"max_seq_len", "max_position_embeddings", K_INT, false, OFF(max_seq_len), 0, 0, 4096, NULL},
    {"dtype", NULL, K_STR, false, OFF(dtype), 0, 0, 0, "fp8"},
    {"expert_dtype", NULL, K_STR, false, OFF(expert_dtype), 0, 0, 0, "fp4"},
    {"vocab_size", NULL, K_INT, true, OFF(vocab_size), 0, 0, 0, NULL},
    {"dim", "hidden_size", K_INT, true, OFF(dim), 0, 0, 0, NULL},
    {"moe_inter_dim", "moe_intermediate_size", K_INT, true, OFF(moe_inter_dim), 0, 0, 0, NULL},
    {"n_layers", "num_hidden_layers", K_INT, true, OFF(n_layers), 0, 0, 0, NULL},
    {"n_mtp_layers", "num_nextn_predict_layers", K_INT, false, OFF(n_mtp_layers), 0, 0, -1, NULL},
    {"n_heads", "num_attention_heads", K_INT, true, OFF(n_heads), 0, 0, 0, NULL},
    {"n_routed_experts", NULL, K_INT, true, OFF(n_routed_experts), 0, 0, 0, NULL},
    {"n_shared_experts", NULL, K_INT, false, OFF(n_shared_experts), 0, 0, 1, NULL},
    {"n_activated_experts", "num_experts_per_tok", K_INT, true, OFF(n_activated_experts), 0, 0, 0, NULL},
    {"score_func", "scoring_func", K_SCORE, false, OFF(score_func), 0, 0, 0, "sqrtsoftplus"},
    {"gate_temp", NULL, K_DBL, false, OFF(gate_temp), 0, 0, 1.0, NULL},
    {"norm_topk_prob", NULL, K_BOOL, false, OFF(norm_topk_prob), 0, 0, 1, NULL},
    {"route_scale", "routed_scaling_factor", K_DBL, false, OFF(route_scale), 0, 0, 1.0, NULL},
    {"swiglu_limit", NULL, K_DBL, false, OFF(swiglu_limit), 0, 0, 0.0, NULL},
    {"q_lora_rank", NULL, K_INT, true, OFF(q_lora_rank), 0, 0, 0, NULL},
    {"head_dim", NULL, K_INT, true, OFF(head_dim), 0, 0, 0, NULL},
    {"rope_head_dim", "qk_rope_head_dim", K_INT, true, OFF(rope_head_dim), 0, 0, 0, NULL},
    {"norm_eps", "rms_norm_eps", K_DBL, false, OFF(norm_eps), 0, 0, 1e-20, NULL},
    {"o_groups", NULL, K_INT, true, OFF(o_groups), 0, 0, 0, NULL},
    {"o_lora_rank", NULL, K_INT, true, OFF(o_lora_rank), 0, 0, 0, NULL},
    {"window_size", "sliding_window", K_INT, true, OFF(window_size), 0, 0, 0, NULL},
    {"compress_ratios", NULL, K_INTLIST, true, OFF(compress_ratios), NOCOUNT, V41_MAX_LAYERS, 0, NULL},
    {"kv_source_layers", "kv_source_layer_ids", K_INTLIST, true, OFF(kv_source_layers), OFF(n_kv_sources), V41_MAX_LIST, 0, NULL},
    {"index_source_layers", "index_source_layer_ids", K_INTLIST, true, OFF(index_source_layers), OFF(n_index_sources), V41_MAX_LIST, 0, NULL},
    {"compress_rope_theta", NULL, K_DBL, false, OFF(compress_rope_theta), 0, 0, 40000.0, NULL},
    {"original_seq_len", NULL, K_INT, false, OFF(original_seq_len), 0, 0, 0, NULL},
    {"rope_theta", NULL, K_DBL, false, OFF(rope_theta), 0, 0, 10000.0, NULL},
    {"rope_factor", NULL, K_DBL, false, OFF(rope_factor), 0, 0, 40.0, NULL},
    {"beta_fast", NULL, K_DBL, false, OFF(beta_fast), 0, 0, 32.0, NULL},
    {"beta_slow", NULL, K_DBL, false, OFF(beta_slow), 0, 0, 1.0, NULL},
    {"index_n_heads", NULL, K_INT, true, OFF(index_n_heads), 0, 0, 0, NULL},
    {"index_head_dim", NULL, K_INT, true, OFF(index_head_dim), 0, 0, 0, NULL},
    {"index_topk", NULL, K_INT, true, OFF(index_topk), 0, 0, 0, NULL},
    {"candidate_source_layer", "candidate_source_layer_id", K_INT, false, OFF(candidate_source_layer), 0, 0, -1, NULL},
    {"candidate_topk_blocks", NULL, K_INT, false, OFF(candidate_topk_blocks), 0, 0, 0, NULL},
    {"candidate_block_size", NULL, K_INT, false, OFF(candidate_block_size), 0, 0, 0, NULL},
    {"hc_mult", NULL, K_INT, false, OFF(hc_mult), 0, 0, 4, NULL},
    {"hc_sinkhorn_iters", NULL, K_INT, false, OFF(hc_sinkhorn_iters), 0, 0, 20, NULL},
    {"hc_eps", NULL, K_DBL, false, OFF(hc_eps), 0, 0, 1e-6, NULL},
    {"engram_layer_ids", NULL, K_INTLIST, false, OFF(engram_layer_ids), OFF(n_engram_layers), V41_MAX_LIST, 0, NULL},
    {"engram_num_embeddings", NULL, K_I64LIST, false, OFF(engram_num_embeddings), NOCOUNT, V41_MAX_LIST, 0, NULL},
    {"engram_max_ngram_size", NULL, K_INT, false, OFF(engram_max_ngram_size), 0, 0, 1, NULL},
    {"engram_vocab_size", NULL, K_I64, false, OFF(engram_vocab_size), 0, 0, 0, NULL},
    {"engram_n_heads", NULL, K_INT, false, OFF(engram_n_heads), 0, 0, 0, NULL},
    {"engram_head_dim", NULL, K_INT, false, OFF(engram_head_dim), 0, 0, 0, NULL},
    {"engram_pad_id", "engram_pad_token_id", K_INT, false, OFF(engram_pad_id), 0, 0, 2, NULL},
    {"engram_compressed_vocab_size", NULL, K_INT, false, OFF(engram_compressed_vocab_size), 0, 0, 0, NULL},
    {"dspark_block_size", NULL, K_INT, false, OFF(dspark_block_size), 0, 0, 0, NULL},
    {"dspark_noise_token_id", NULL, K_INT, false, OFF(dspark_noise_token_id), 0, 0, 0, NULL},
    {"dspark_target_layer_ids", NULL, K_INTLIST, false, OFF(dspark_target_layer_ids), OFF(n_dspark_targets), V41_MAX_LIST, 0, NULL},
    {"dspark_markov_rank", NULL, K_INT, false, OFF(dspark_markov_rank), 0, 0, 256, NULL},
    {"dspark_n_routed_experts", NULL, K_INT, false, OFF(dspark_n_routed_experts), 0, 0, 0, NULL},
    {"dspark_n_activated_experts", "dspark_num_experts_per_tok", K_INT, false, OFF(dspark_n_activated_experts), 0, 0, 0, NULL},
};
#define NKEYS (sizeof keys / sizeof keys[0])

static const char *score_names[] = {"sqrtsoftplus", "softmax", "sigmoid"};

/* ------------------------------------------------------------------ JSON helpers */

static const char *jtype(const cJSON *j)
{
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsArray(j)) return "a list";
    if (cJSON_IsObject(j)) return "an object";
    return "an invalid value";
}

static int get_int64(const cJSON *j, const char *key, int64_t lo, int64_t hi, int64_t *out, v41_err *err)
{
    if (!cJSON_IsNumber(j))
        return v41_err_set(err, V41_EINVAL, "config key '%s': expected an integer, got %s", key, jtype(j));
    double v = j->valuedouble;
    if (!isfinite(v) || v != floor(v))
        return v41_err_set(err, V41_EINVAL, "config key '%s': expected an integer, got %g", key, v);
    if (v < (double)lo || v > (double)hi)
        return v41_err_set(err, V41_EINVAL, "config key '%s': %.0f out of range [%lld, %lld]", key, v,
                           (long long)lo, (long long)hi);
    *out = (int64_t)v;
    return V41_OK;
}

/* Case-sensitive lookup that reports duplicate keys (cJSON keeps both); shared with the
 * safetensors header parser (v41_loader_internal.h). */
const cJSON *v41_json_get_unique(const cJSON *obj, const char *key, int *dup)
{
    const cJSON *found = NULL, *it;
    *dup = 0;
    cJSON_ArrayForEach(it, obj) {
        if (it->string && !strcmp(it->string, key)) {
            if (found) *dup = 1;
            else found = it;
        }
    }
    return found;
}

static int read_key(const keydef *k, const cJSON *j, const char *kname, v41_config *cfg, v41_err *err)
{
    char *base = (char *)cfg;
    int64_t v;
    int rc;
    switch (k->type) {
    case K_INT:
        if ((rc = get_int64(j, kname, INT_MIN, INT_MAX, &v, err))) return rc;
        *(int *)(base + k->off) = (int)v;
        return V41_OK;
    case K_I64:
        if ((rc = get_int64(j, kname, INT64_MIN / 2, INT64_MAX / 2, &v, err))) return rc;
        *(int64_t *)(base + k->off) = v;
        return V41_OK;
    case K_DBL:
        if (!cJSON_IsNumber(j))
            return v41_err_set(err, V41_EINVAL, "config key '%s': expected a number, got %s", kname, jtype(j));
        if (!isfinite(j->valuedouble))
            return v41_err_set(err, V41_EINVAL, "config key '%s': not finite", kname);
        *(double *)(base + k->off) = j->valuedouble;
        return V41_OK;
    case K_BOOL:
        if (!cJSON_IsBool(j))
            return v41_err_set(err, V41_EINVAL, "config key '%s': expected true/false, got %s", kname, jtype(j));
        *(bool *)(base + k->off) = cJSON_IsTrue(j);
        return V41_OK;
    case K_STR: {
        char *dst = base + k->off;
        if (cJSON_IsNull(j)) { /* expert_dtype: null = same as dtype */
            if (!strcmp(k->name, "expert_dtype")) { dst[0] = 0; return V41_OK; }
        }
        if (!cJSON_IsString(j))
            return v41_err_set(err, V41_EINVAL, "config key '%s': expected a string, got %s", kname, jtype(j));
        const char *s = j->valuestring;
        if (strcmp(s, "fp8") && strcmp(s, "fp4") && strcmp(s, "bf16"))
            return v41_err_set(err, V41_EINVAL, "config key '%s': '%.40s' is not one of fp8, fp4, bf16", kname, s);
        if (!strcmp(k->name, "dtype") && !strcmp(s, "fp4"))
            return v41_err_set(err, V41_EINVAL, "config key '%s': fp4 is only an expert dtype", kname);
        snprintf(dst, 16, "%s", s);
        return V41_OK;
    }
    case K_SCORE: {
        if (!cJSON_IsString(j))
            return v41_err_set(err, V41_EINVAL, "config key '%s': expected a string, got %s", kname, jtype(j));
        for (int i = 0; i < 3; i++)
            if (!strcmp(j->valuestring, score_names[i])) {
                *(v41_score_func *)(base + k->off) = (v41_score_func)i;
                return V41_OK;
            }
        return v41_err_set(err, V41_EINVAL, "config key '%s': '%.40s' is not one of sqrtsoftplus, softmax, sigmoid",
                           kname, j->valuestring);
    }
    case K_INTLIST:
    case K_I64LIST: {
        if (!cJSON_IsArray(j))
            return v41_err_set(err, V41_EINVAL, "config key '%s': expected a list, got %s", kname, jtype(j));
        int n = cJSON_GetArraySize(j);
        if (n > k->max)
            return v41_err_set(err, V41_EINVAL, "config key '%s': %d entries, at most %d supported", kname, n, k->max);
        int i = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, j) {
            char sub[160];
            snprintf(sub, sizeof sub, "%s[%d]", kname, i);
            if (k->type == K_INTLIST) {
                if ((rc = get_int64(it, sub, INT_MIN, INT_MAX, &v, err))) return rc;
                ((int *)(base + k->off))[i] = (int)v;
            } else {
                if ((rc = get_int64(it, sub, 0, INT64_MAX / 2, &v, err))) return rc;
                ((int64_t *)(base + k->off))[i] = v;
            }
            i++;
        }
        if (k->count_off != NOCOUNT) *(int *)(base + k->count_off) = n;
        return V41_OK;
    }
    }
    return V41_EINTERNAL;
}

static void set_default(const keydef *k, v41_config *cfg)
{
    char *base = (char *)cfg;
    switch (k->type) {
    case K_INT: *(int *)(base + k->off) = (int)k->def; break;
    case K_I64: *(int64_t *)(base + k->off) = (int64_t)k->def; break;
    case K_DBL: *(double *)(base + k->off) = k->def; break;
    case K_BOOL: *(bool *)(base + k->off) = k->def != 0; break;
    case K_STR: snprintf(base + k->off, 16, "%s", k->sdef); break;
    case K_SCORE: *(v41_score_func *)(base + k->off) = V41_SCORE_SQRTSOFTPLUS; break;
    case K_INTLIST:
    case K_I64LIST:
        if (k->count_off != NOCOUNT) *(int *)(base + k->count_off) = 0;
        break;
    }
}

/* ------------------------------------------------------------------ parse */

static int parse_rope_scaling(const cJSON *rs, v41_config *cfg, bool *seen, v41_err *err)
{
    if (cJSON_IsNull(rs)) return V41_OK;
    if (!cJSON_IsObject(rs))
        return v41_err_set(err, V41_EINVAL, "config key 'rope_scaling': expected an object, got %s", jtype(rs));
    int dup;
    const cJSON *t = v41_json_get_unique(rs, "type", &dup);
    if (!t) t = v41_json_get_unique(rs, "rope_type", &dup);
    if (t && (!cJSON_IsString(t) || strcmp(t->valuestring, "yarn")))
        return v41_err_set(err, V41_EINVAL, "config key 'rope_scaling.type': only \"yarn\" is supported");
    static const struct { const char *k; size_t off; bool isint; } f[] = {
        {"factor", OFF(rope_factor), false},
        {"beta_fast", OFF(beta_fast), false},
        {"beta_slow", OFF(beta_slow), false},
        {"original_max_position_embeddings", OFF(original_seq_len), true},
    };
    for (size_t i = 0; i < 4; i++) {
        const cJSON *j = v41_json_get_unique(rs, f[i].k, &dup);
        char name[96];
        snprintf(name, sizeof name, "rope_scaling.%s", f[i].k);
        if (dup) return v41_err_set(err, V41_EINVAL, "config key '%s': duplicate key", name);
        if (!j) continue;
        if (f[i].isint) {
            int64_t v;
            int rc = get_int64(j, name, 0, INT_MAX, &v, err);
            if (rc) return rc;
            *(int *)((char *)cfg + f[i].off) = (int)v;
        } else {
            if (!cJSON_IsNumber(j))
                return v41_err_set(err, V41_EINVAL, "config key '%s': expected a number, got %s", name, jtype(j));
            *(double *)((char *)cfg + f[i].off) = j->valuedouble;
        }
        *seen = true;
    }
    return V41_OK;
}

static int parse_quant_config(const cJSON *qc, v41_err *err)
{
    if (cJSON_IsNull(qc)) return V41_OK;
    if (!cJSON_IsObject(qc))
        return v41_err_set(err, V41_EINVAL, "config key 'quantization_config': expected an object, got %s", jtype(qc));
    int dup;
    const cJSON *bs = v41_json_get_unique(qc, "weight_block_size", &dup);
    if (!bs) return V41_OK;
    if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2 || !cJSON_IsNumber(cJSON_GetArrayItem(bs, 0)) ||
        !cJSON_IsNumber(cJSON_GetArrayItem(bs, 1)) || cJSON_GetArrayItem(bs, 0)->valuedouble != 32 ||
        cJSON_GetArrayItem(bs, 1)->valuedouble != 32)
        return v41_err_set(err, V41_EINVAL,
                           "config key 'quantization_config.weight_block_size': must be [32, 32] (V4.1 fp8 blocks)");
    return V41_OK;
}

int v41_config_parse(const char *json_text, size_t len, v41_config *cfg, v41_err *err)
{
    if (!json_text || !cfg) return v41_err_set(err, V41_EINVAL, "config: NULL argument");
    memset(cfg, 0, sizeof *cfg);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json_text, len, &end, 0);
    if (!root) {
        size_t off = end && end >= json_text ? (size_t)(end - json_text) : 0;
        return v41_err_set(err, V41_EINVAL, "config: not valid JSON (error near byte %zu)", off);
    }
    int rc = V41_OK;
    if (!cJSON_IsObject(root)) {
        rc = v41_err_set(err, V41_EINVAL, "config: top level must be a JSON object, got %s", jtype(root));
        goto out;
    }
    int dup;
    const cJSON *obj = root;
    const cJSON *tc = v41_json_get_unique(root, "text_config", &dup);
    bool hf = false;
    if (tc) {
        if (!cJSON_IsObject(tc)) {
            rc = v41_err_set(err, V41_EINVAL, "config key 'text_config': expected an object, got %s", jtype(tc));
            goto out;
        }
        obj = tc;
        hf = true;
    }
    if (v41_json_get_unique(obj, "hidden_size", &dup) || v41_json_get_unique(obj, "num_hidden_layers", &dup) || v41_json_get_unique(obj, "model_type", &dup))
        hf = true;
    snprintf(cfg->source_form, sizeof cfg->source_form, "%s", hf ? "hf" : "modelargs");

    for (size_t i = 0; i < NKEYS; i++) {
        const keydef *k = &keys[i];
        const cJSON *j = NULL;
        const char *kname = k->name;
        if (hf && k->hf) {
            j = v41_json_get_unique(obj, k->hf, &dup);
            kname = k->hf;
            if (!j) { j = v41_json_get_unique(obj, k->name, &dup); kname = k->name; }
        } else {
            j = v41_json_get_unique(obj, k->name, &dup);
        }
        if (dup) { rc = v41_err_set(err, V41_EINVAL, "config key '%s': duplicate key", kname); goto out; }
        if (!j) {
            if (k->required) {
                rc = v41_err_set(err, V41_ENOTFOUND, "config key '%s': missing (required)", kname);
                goto out;
            }
            set_default(k, cfg);
            continue;
        }
        if (cJSON_IsNull(j) && k->type != K_STR) {
            if (k->required) {
                rc = v41_err_set(err, V41_EINVAL, "config key '%s': null is not allowed", kname);
                goto out;
            }
            set_default(k, cfg);
            continue;
        }
        if ((rc = read_key(k, j, kname, cfg, err))) goto out;
    }
    if (!cfg->expert_dtype[0]) snprintf(cfg->expert_dtype, sizeof cfg->expert_dtype, "%s", cfg->dtype);

    /* compress_ratios count: n_layers + n_mtp_layers entries */
    {
        const cJSON *cr = v41_json_get_unique(obj, "compress_ratios", &dup);
        int n = cJSON_GetArraySize(cr);
        if (cfg->n_mtp_layers < 0) cfg->n_mtp_layers = n - cfg->n_layers; /* absent: inferred */
        if (cfg->n_layers < 1) {
            rc = v41_err_set(err, V41_EINVAL, "config key '%s': must be >= 1", hf ? "num_hidden_layers" : "n_layers");
            goto out;
        }
        if (cfg->n_mtp_layers < 0) {
            rc = v41_err_set(err, V41_EINVAL, "config key 'compress_ratios': %d entries, fewer than n_layers = %d", n,
                             cfg->n_layers);
            goto out;
        }
        if (n != cfg->n_layers + cfg->n_mtp_layers) {
            rc = v41_err_set(err, V41_EINVAL,
                             "config key 'compress_ratios': %d entries, expected n_layers + n_mtp_layers = %d", n,
                             cfg->n_layers + cfg->n_mtp_layers);
            goto out;
        }
    }
    {
        const cJSON *ne = v41_json_get_unique(obj, "engram_num_embeddings", &dup);
        int n = ne ? cJSON_GetArraySize(ne) : 0;
        if (n != cfg->n_engram_layers) {
            rc = v41_err_set(err, V41_EINVAL,
                             "config key 'engram_num_embeddings': %d entries, expected one per engram_layer_ids entry (%d)",
                             n, cfg->n_engram_layers);
            goto out;
        }
    }
    if (hf) {
        bool seen = false;
        const cJSON *rs = v41_json_get_unique(obj, "rope_scaling", &dup);
        if (rs && (rc = parse_rope_scaling(rs, cfg, &seen, err))) goto out;
        const cJSON *qc = v41_json_get_unique(obj, "quantization_config", &dup);
        if (!qc && obj != root) qc = v41_json_get_unique(root, "quantization_config", &dup);
        if (qc && (rc = parse_quant_config(qc, err))) goto out;
    }
    rc = v41_config_validate(cfg, err);
out:
    cJSON_Delete(root);
    return rc;
}

int v41_config_load(const char *path, v41_config *cfg, v41_err *err)
{
    char buf[4200];
    struct stat st;
    const char *p = path;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(buf, sizeof buf, "%s/config.json", path);
        p = buf;
    }
    FILE *f = fopen(p, "rb");
    if (!f) return v41_err_set(err, V41_EIO, "%s: cannot open: %s", p, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return v41_err_set(err, V41_EIO, "%s: cannot seek", p); }
    long n = ftell(f);
    if (n < 0 || n > (64L << 20)) {
        fclose(f);
        return v41_err_set(err, V41_EINVAL, "%s: not a config file (size %ld)", p, n);
    }
    rewind(f);
    char *text = malloc((size_t)n + 1);
    if (!text) { fclose(f); return v41_err_set(err, V41_ENOMEM, "%s: out of memory", p); }
    size_t got = fread(text, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) { free(text); return v41_err_set(err, V41_EIO, "%s: short read", p); }
    text[n] = 0;
    int rc = v41_config_parse(text, (size_t)n, cfg, err);
    free(text);
    if (rc) v41_err_prefix(err, "%s", p);
    return rc;
}

/* ------------------------------------------------------------------ validation */

static int check_list(const char *key, const int *v, int n, int lo, int hi, bool ascending, v41_err *err)
{
    for (int i = 0; i < n; i++) {
        if (v[i] < lo || v[i] >= hi)
            return v41_err_set(err, V41_EINVAL, "config key '%s': entry %d = %d outside [%d, %d)", key, i, v[i], lo, hi);
        if (ascending && i > 0 && v[i] <= v[i - 1])
            return v41_err_set(err, V41_EINVAL, "config key '%s': entries must be strictly ascending (%d after %d)",
                               key, v[i], v[i - 1]);
    }
    return V41_OK;
}

static bool in_list(const int *v, int n, int x)
{
    for (int i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}

#define POS(field)                                                                                           \
    do {                                                                                                     \
        if (c->field <= 0) return v41_err_set(err, V41_EINVAL, "config key '" #field "': must be > 0, got %d", \
                                              (int)c->field);                                               \
    } while (0)
#define MUL(field, b, why)                                                                                    \
    do {                                                                                                      \
        if (c->field % (b))                                                                                   \
            return v41_err_set(err, V41_EINVAL, "config key '" #field "': %d is not a multiple of %d (%s)",     \
                               (int)c->field, (int)(b), why);                                                 \
    } while (0)

int v41_config_validate(const v41_config *c, v41_err *err)
{
    int L = c->n_layers, T = c->n_layers + c->n_mtp_layers;
    POS(vocab_size); POS(dim); POS(n_layers); POS(n_heads); POS(head_dim); POS(rope_head_dim);
    POS(q_lora_rank); POS(o_groups); POS(o_lora_rank); POS(window_size); POS(moe_inter_dim);
    POS(n_routed_experts); POS(n_activated_experts); POS(hc_mult); POS(hc_sinkhorn_iters);
    if (c->max_batch_size <= 0) return v41_err_set(err, V41_EINVAL, "config key 'max_batch_size': must be > 0");
    if (c->max_seq_len <= 0) return v41_err_set(err, V41_EINVAL, "config key 'max_seq_len': must be > 0");
    if (c->n_mtp_layers < 0) return v41_err_set(err, V41_EINVAL, "config key 'n_mtp_layers': must be >= 0");
    if (T > V41_MAX_LAYERS)
        return v41_err_set(err, V41_EINVAL, "config key 'n_layers': n_layers + n_mtp_layers = %d exceeds %d", T,
                           V41_MAX_LAYERS);
    if (c->rope_head_dim > c->head_dim || c->rope_head_dim % 2)
        return v41_err_set(err, V41_EINVAL, "config key 'rope_head_dim': %d must be even and <= head_dim (%d)",
                           c->rope_head_dim, c->head_dim);
    if (c->n_activated_experts > c->n_routed_experts)
        return v41_err_set(err, V41_EINVAL, "config key 'n_activated_experts': %d > n_routed_experts (%d)",
                           c->n_activated_experts, c->n_routed_experts);
    if (c->n_shared_experts < 0) return v41_err_set(err, V41_EINVAL, "config key 'n_shared_experts': must be >= 0");
    if ((int64_t)c->n_heads * c->head_dim % c->o_groups)
        return v41_err_set(err, V41_EINVAL, "config key 'o_groups': %d does not divide n_heads * head_dim = %d",
                           c->o_groups, c->n_heads * c->head_dim);
    if (c->n_heads % c->o_groups)
        return v41_err_set(err, V41_EINVAL, "config key 'o_groups': %d does not divide n_heads = %d", c->o_groups,
                           c->n_heads);
    if (!(c->rope_theta > 0)) return v41_err_set(err, V41_EINVAL, "config key 'rope_theta': must be > 0");
    if (!(c->compress_rope_theta > 0)) return v41_err_set(err, V41_EINVAL, "config key 'compress_rope_theta': must be > 0");
    if (c->original_seq_len < 0) return v41_err_set(err, V41_EINVAL, "config key 'original_seq_len': must be >= 0");
    if (c->original_seq_len > 0 && !(c->rope_factor > 0))
        return v41_err_set(err, V41_EINVAL, "config key 'rope_factor': must be > 0 when YaRN is on");
    if (!(c->gate_temp > 0)) return v41_err_set(err, V41_EINVAL, "config key 'gate_temp': must be > 0");
    if (c->swiglu_limit < 0) return v41_err_set(err, V41_EINVAL, "config key 'swiglu_limit': must be >= 0");
    if (!(c->norm_eps >= 0)) return v41_err_set(err, V41_EINVAL, "config key 'norm_eps': must be >= 0");
    if (!(c->hc_eps >= 0)) return v41_err_set(err, V41_EINVAL, "config key 'hc_eps': must be >= 0");
    if (strcmp(c->dtype, "fp8") && strcmp(c->dtype, "bf16"))
        return v41_err_set(err, V41_EINVAL, "config key 'dtype': '%s' is not fp8 or bf16", c->dtype);
    if (strcmp(c->expert_dtype, "fp4") && strcmp(c->expert_dtype, "fp8") && strcmp(c->expert_dtype, "bf16"))
        return v41_err_set(err, V41_EINVAL, "config key 'expert_dtype': '%s' is not fp4, fp8 or bf16", c->expert_dtype);

    /* compress ratios */
    bool any_compressed = false;
    for (int i = 0; i < T; i++) {
        int m = c->compress_ratios[i];
        if (m < 0)
            return v41_err_set(err, V41_EINVAL, "config key 'compress_ratios': entry %d = %d is negative", i, m);
        if (i >= L && m != 0)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'compress_ratios': entry %d = %d, but DSpark stage %d must have ratio 0", i,
                               m, i - L);
        if (m > 0) any_compressed = true;
    }
    int rc;
    if ((rc = check_list("kv_source_layers", c->kv_source_layers, c->n_kv_sources, 0, L, true, err))) return rc;
    if ((rc = check_list("index_source_layers", c->index_source_layers, c->n_index_sources, 0, L, true, err))) return rc;
    for (int i = 0; i < c->n_kv_sources; i++) {
        int l = c->kv_source_layers[i];
        if (c->compress_ratios[l] <= 0)
            return v41_err_set(err, V41_EINVAL, "config key 'kv_source_layers': layer %d has compress ratio 0", l);
        if (!in_list(c->index_source_layers, c->n_index_sources, l))
            return v41_err_set(err, V41_EINVAL,
                               "config key 'index_source_layers': kv source layer %d must also be an index source", l);
    }
    for (int i = 0; i < c->n_index_sources; i++) {
        int l = c->index_source_layers[i];
        if (c->compress_ratios[l] <= 0)
            return v41_err_set(err, V41_EINVAL, "config key 'index_source_layers': layer %d has compress ratio 0", l);
    }
    for (int i = 0; i < L; i++) {
        int m = c->compress_ratios[i];
        if (m <= 0) continue;
        int kv = v41_kv_source_of(c, i), ix = v41_index_source_of(c, i);
        if (kv < 0)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'kv_source_layers': layer %d has compress ratio %d but no kv source <= %d", i,
                               m, i);
        if (c->compress_ratios[kv] != m)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'kv_source_layers': layer %d has ratio %d but its newest kv source (layer %d) "
                               "has ratio %d",
                               i, m, kv, c->compress_ratios[kv]);
        if (ix < 0)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'index_source_layers': layer %d has compress ratio %d but no index source <= %d",
                               i, m, i);
        if (c->compress_ratios[ix] != m)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'index_source_layers': layer %d has ratio %d but its newest index source "
                               "(layer %d) has ratio %d",
                               i, m, ix, c->compress_ratios[ix]);
    }
    if (any_compressed) {
        POS(index_n_heads); POS(index_head_dim); POS(index_topk);
        if (c->index_head_dim < c->rope_head_dim)
            return v41_err_set(err, V41_EINVAL, "config key 'index_head_dim': %d < rope_head_dim (%d)",
                               c->index_head_dim, c->rope_head_dim);
    }
    if (c->candidate_source_layer >= 0) {
        int cs = c->candidate_source_layer;
        if (cs >= L || !in_list(c->index_source_layers, c->n_index_sources, cs))
            return v41_err_set(err, V41_EINVAL, "config key 'candidate_source_layer': layer %d is not an index source", cs);
        for (int i = 0; i < c->n_index_sources; i++) {
            int l = c->index_source_layers[i];
            if (l > cs && c->compress_ratios[l] != c->compress_ratios[cs])
                return v41_err_set(err, V41_EINVAL,
                                   "config key 'candidate_source_layer': later index source %d has ratio %d, the "
                                   "candidate source (layer %d) has ratio %d",
                                   l, c->compress_ratios[l], cs, c->compress_ratios[cs]);
        }
        POS(candidate_block_size);
        POS(candidate_topk_blocks);
        if ((int64_t)c->candidate_topk_blocks * c->candidate_block_size < c->index_topk)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'candidate_topk_blocks': candidate_topk_blocks * candidate_block_size = %lld < "
                               "index_topk = %d",
                               (long long)c->candidate_topk_blocks * c->candidate_block_size, c->index_topk);
    }
    /* quantized dims: act_quant blocks of 32 along every fp8/fp4 Linear's input,
     * fp8 window K over head_dim, fp4_qdq(32) of index keys/queries, 16 of latents */
    if (!strcmp(c->dtype, "fp8") || !strcmp(c->expert_dtype, "fp4") || !strcmp(c->expert_dtype, "fp8")) {
        MUL(dim, 32, "input of quantized Linears");
        MUL(moe_inter_dim, 32, "input of w2");
    }
    if (!strcmp(c->dtype, "fp8")) {
        MUL(q_lora_rank, 32, "input of wq_b");
        MUL(head_dim, 32, "window K act_quant");
        if ((int64_t)c->o_groups * c->o_lora_rank % 32)
            return v41_err_set(err, V41_EINVAL,
                               "config key 'o_lora_rank': o_groups * o_lora_rank = %d is not a multiple of 32 (input of wo_b)",
                               c->o_groups * c->o_lora_rank);
    }
    if (any_compressed) {
        MUL(index_head_dim, 32, "fp4 quantization of index keys");
        MUL(head_dim, 16, "fp4 quantization of compressed latents");
    }
    /* engram */
    if ((rc = check_list("engram_layer_ids", c->engram_layer_ids, c->n_engram_layers, 0, L, true, err))) return rc;
    if (c->n_engram_layers > 0) {
        if (c->engram_max_ngram_size < 2)
            return v41_err_set(err, V41_EINVAL, "config key 'engram_max_ngram_size': must be >= 2 with engram layers");
        POS(engram_n_heads); POS(engram_head_dim); POS(engram_compressed_vocab_size);
        MUL(engram_head_dim, 32, "fp8 engram table rows");
        if (c->engram_vocab_size <= 1)
            return v41_err_set(err, V41_EINVAL, "config key 'engram_vocab_size': must be > 1 with engram layers");
        if (c->engram_pad_id < 0 || c->engram_pad_id >= c->vocab_size)
            return v41_err_set(err, V41_EINVAL, "config key 'engram_pad_id': %d outside [0, vocab_size)", c->engram_pad_id);
        for (int i = 0; i < c->n_engram_layers; i++)
            if (c->engram_num_embeddings[i] <= 0)
                return v41_err_set(err, V41_EINVAL, "config key 'engram_num_embeddings': entry %d must be > 0", i);
    }
    /* DSpark */
    if ((rc = check_list("dspark_target_layer_ids", c->dspark_target_layer_ids, c->n_dspark_targets, 0, L, true, err)))
        return rc;
    if (c->n_mtp_layers > 0) {
        POS(dspark_block_size);
        if (c->n_dspark_targets < 1)
            return v41_err_set(err, V41_EINVAL, "config key 'dspark_target_layer_ids': empty with n_mtp_layers = %d",
                               c->n_mtp_layers);
        POS(dspark_markov_rank);
        if (c->dspark_noise_token_id < 0 || c->dspark_noise_token_id >= c->vocab_size)
            return v41_err_set(err, V41_EINVAL, "config key 'dspark_noise_token_id': %d outside [0, vocab_size)",
                               c->dspark_noise_token_id);
        if (c->dspark_n_routed_experts < 0 || c->dspark_n_activated_experts < 0)
            return v41_err_set(err, V41_EINVAL, "config key 'dspark_n_routed_experts': must be >= 0");
        int ne = c->dspark_n_routed_experts ? c->dspark_n_routed_experts : c->n_routed_experts;
        int na = c->dspark_n_activated_experts ? c->dspark_n_activated_experts : c->n_activated_experts;
        if (na > ne)
            return v41_err_set(err, V41_EINVAL, "config key 'dspark_n_activated_experts': %d > the stages' expert count %d",
                               na, ne);
    }
    return V41_OK;
}

/* ------------------------------------------------------------------ schedule */

bool v41_is_kv_source(const v41_config *c, int l) { return in_list(c->kv_source_layers, c->n_kv_sources, l); }
bool v41_is_index_source(const v41_config *c, int l) { return in_list(c->index_source_layers, c->n_index_sources, l); }
bool v41_is_engram_layer(const v41_config *c, int l) { return in_list(c->engram_layer_ids, c->n_engram_layers, l); }
bool v41_is_dspark_target(const v41_config *c, int l)
{
    return in_list(c->dspark_target_layer_ids, c->n_dspark_targets, l);
}

static int newest_le(const int *v, int n, int l)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (v[i] <= l && v[i] > best) best = v[i];
    return best;
}

int v41_kv_source_of(const v41_config *c, int l) { return newest_le(c->kv_source_layers, c->n_kv_sources, l); }
int v41_index_source_of(const v41_config *c, int l)
{
    return newest_le(c->index_source_layers, c->n_index_sources, l);
}
int v41_engram_index(const v41_config *c, int l)
{
    for (int i = 0; i < c->n_engram_layers; i++)
        if (c->engram_layer_ids[i] == l) return i;
    return -1;
}
int v41_last_kv_source(const v41_config *c)
{
    int best = -1;
    for (int i = 0; i < c->n_kv_sources; i++)
        if (c->kv_source_layers[i] > best) best = c->kv_source_layers[i];
    return best;
}
int v41_layer_n_experts(const v41_config *c, int l)
{
    if (l >= c->n_layers && c->dspark_n_routed_experts > 0) return c->dspark_n_routed_experts;
    return c->n_routed_experts;
}
int v41_layer_n_active(const v41_config *c, int l)
{
    if (l >= c->n_layers && c->dspark_n_activated_experts > 0) return c->dspark_n_activated_experts;
    return c->n_activated_experts;
}

/* ------------------------------------------------------------------ to JSON */

/* A number that reads back as the same double. cJSON prints 15 significant digits whenever they
 * come within a relative epsilon of the value, which loses the last bit of about one double in
 * eight (Debian 12's cJSON 1.7.15; found by fuzz_config: compress_rope_theta 4.8888888888888889e47
 * came back as ...97e47). The shortest of 15..17 digits that strtod maps back to v is written
 * raw. v is finite (the parser rejects the rest). */
static cJSON *exact_number(double v)
{
    char buf[32];
    for (int p = 15; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    return cJSON_CreateRaw(buf);
}

char *v41_config_to_json(const v41_config *c)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    const char *base = (const char *)c;
    for (size_t i = 0; i < NKEYS; i++) {
        const keydef *k = &keys[i];
        switch (k->type) {
        case K_INT: cJSON_AddItemToObject(o, k->name, exact_number(*(const int *)(base + k->off))); break;
        case K_I64: cJSON_AddItemToObject(o, k->name, exact_number((double)*(const int64_t *)(base + k->off))); break;
        case K_DBL: cJSON_AddItemToObject(o, k->name, exact_number(*(const double *)(base + k->off))); break;
        case K_BOOL: cJSON_AddBoolToObject(o, k->name, *(const bool *)(base + k->off)); break;
        case K_STR: cJSON_AddStringToObject(o, k->name, base + k->off); break;
        case K_SCORE: cJSON_AddStringToObject(o, k->name, score_names[c->score_func]); break;
        case K_INTLIST:
        case K_I64LIST: {
            int n;
            if (!strcmp(k->name, "compress_ratios")) n = c->n_layers + c->n_mtp_layers;
            else if (!strcmp(k->name, "engram_num_embeddings")) n = c->n_engram_layers;
            else n = *(const int *)(base + k->count_off);
            cJSON *a = cJSON_AddArrayToObject(o, k->name);
            for (int j = 0; j < n; j++)
                cJSON_AddItemToArray(a, exact_number(k->type == K_INTLIST ? (double)((const int *)(base + k->off))[j]
                                                                          : (double)((const int64_t *)(base + k->off))[j]));
            break;
        }
        }
    }
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}

/* ------------------------------------------------------------------ tiny */

/* Exactly the ModelArgs of ../shared/oracle/v41-tiny/config.json (vision keys
 * omitted: text only). */
static const char tiny_json[] =
    "{\"max_batch_size\":2,\"max_seq_len\":64,\"temperature\":0.0,\"dtype\":\"fp8\",\"expert_dtype\":\"fp4\","
    "\"vocab_size\":512,\"dim\":128,\"moe_inter_dim\":64,\"n_layers\":7,\"n_mtp_layers\":2,\"n_heads\":4,"
    "\"n_routed_experts\":8,\"n_shared_experts\":1,\"n_activated_experts\":2,\"score_func\":\"sqrtsoftplus\","
    "\"gate_temp\":1.25,\"norm_topk_prob\":true,\"route_scale\":1.5,\"swiglu_limit\":1.0,\"q_lora_rank\":64,"
    "\"head_dim\":64,\"rope_head_dim\":16,\"norm_eps\":1e-20,\"o_groups\":2,\"o_lora_rank\":32,\"window_size\":8,"
    "\"compress_ratios\":[0,2,2,2,1,1,1,0,0],\"kv_source_layers\":[1,3,4],\"index_source_layers\":[1,3,4,5],"
    "\"compress_rope_theta\":40000.0,\"original_seq_len\":32,\"rope_theta\":10000.0,\"rope_factor\":4.0,"
    "\"beta_fast\":32,\"beta_slow\":1,\"index_n_heads\":8,\"index_head_dim\":32,\"index_topk\":6,"
    "\"candidate_source_layer\":4,\"candidate_topk_blocks\":3,\"candidate_block_size\":4,\"hc_mult\":4,"
    "\"hc_sinkhorn_iters\":20,\"hc_eps\":1e-06,\"engram_layer_ids\":[2,4],\"engram_num_embeddings\":[240,306],"
    "\"engram_max_ngram_size\":3,\"engram_vocab_size\":53,\"engram_n_heads\":2,\"engram_head_dim\":32,"
    "\"engram_pad_id\":2,\"engram_compressed_vocab_size\":300,\"dspark_block_size\":4,\"dspark_noise_token_id\":7,"
    "\"dspark_target_layer_ids\":[4,5,6],\"dspark_markov_rank\":32,\"dspark_n_routed_experts\":6,"
    "\"dspark_n_activated_experts\":3}";

void v41_config_tiny(v41_config *cfg)
{
    v41_err e;
    if (v41_config_parse(tiny_json, sizeof tiny_json - 1, cfg, &e) != V41_OK) {
        fprintf(stderr, "v41: internal error: built-in tiny config: %s\n", e.msg);
        abort();
    }
}
