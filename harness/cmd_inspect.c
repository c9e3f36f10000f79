/* cmd_inspect.c: `v41 version`, `v41 inspect`, `v41 export-tiny`. */
#include "config.h"
#include "v41_cli.h"
#include "v41_loader_internal.h"
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define V41_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define V41_ASAN 1
#endif
#endif

static int usage_error(const char *cmd, const char *fmt, const char *arg)
{
    fprintf(stderr, "v41 %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see `v41 %s --help`)\n", cmd);
    return 2;
}

/* ------------------------------------------------------------------ version */

int v41_cmd_version(int argc, char **argv)
{
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: v41 version [--json]\n\n"
                   "Print the version and the build options: CUDA engine (yes/no, target arch), BLAS,\n"
                   "OpenMP, sanitizers. --json prints one JSON object.\n");
            return 0;
        }
        if (!strcmp(argv[i], "--json")) json = true;
        else return usage_error(argv[0], "unknown argument '%s'", argv[i]);
    }
#ifdef HAVE_CUDA
    const bool cuda = true;
#ifdef V41_CUDA_ARCH
    const char *arch = V41_CUDA_ARCH;
#else
    const char *arch = "";
#endif
#else
    const bool cuda = false;
    const char *arch = "";
#endif
#ifdef _OPENMP
    const bool omp = true;
#else
    const bool omp = false;
#endif
#ifdef V41_ASAN
    const char *san = "address";
#else
    const char *san = "none";
#endif
#ifdef V41_BLAS_NAME
    const char *blas = V41_BLAS_NAME;
#else
    const char *blas = "unknown";
#endif
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "version", PACKAGE_VERSION);
        cJSON_AddBoolToObject(o, "cuda", cuda);
        if (cuda) cJSON_AddStringToObject(o, "cuda_arch", arch);
        else cJSON_AddNullToObject(o, "cuda_arch");
        cJSON_AddStringToObject(o, "blas", blas);
        cJSON_AddBoolToObject(o, "openmp", omp);
        cJSON_AddStringToObject(o, "sanitizers", san);
        char *s = cJSON_Print(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
    } else {
        printf("v41 %s\n", PACKAGE_VERSION);
        printf("  CUDA engine: %s%s%s\n", cuda ? "yes" : "no", cuda ? ", arch " : "", arch);
        printf("  BLAS:        %s\n", blas);
        printf("  OpenMP:      %s\n", omp ? "yes" : "no");
        printf("  sanitizers:  %s\n", san);
    }
    return 0;
}

/* ------------------------------------------------------------------ inspect */

typedef struct {
    bool stage;
    int ratio, kv_from, topk_from, cand_source_of;
    bool kv_source, index_source, cand_source, cand_user, engram, target;
} lrole;

static lrole role_of(const v41_config *c, int l)
{
    lrole r = {0};
    r.stage = l >= c->n_layers;
    r.ratio = c->compress_ratios[l];
    r.kv_from = r.topk_from = r.cand_source_of = -1;
    if (r.stage) return r;
    r.kv_source = v41_is_kv_source(c, l);
    r.index_source = v41_is_index_source(c, l);
    if (r.ratio > 0) {
        r.kv_from = v41_kv_source_of(c, l);
        r.topk_from = v41_index_source_of(c, l);
        r.cand_source = c->candidate_source_layer == l;
        r.cand_user = r.index_source && c->candidate_source_layer >= 0 && l > c->candidate_source_layer;
        if (r.cand_user) r.cand_source_of = c->candidate_source_layer;
    }
    r.engram = v41_is_engram_layer(c, l);
    r.target = v41_is_dspark_target(c, l);
    return r;
}

static void role_text(const v41_config *c, int l, char *buf, size_t len)
{
    lrole r = role_of(c, l);
    size_t o = 0;
#define APP(...) (o += (size_t)snprintf(buf + o, o < len ? len - o : 0, __VA_ARGS__))
    buf[0] = 0;
    if (r.stage) {
        APP("DSpark stage %d (window-only; %d experts, %d active", l - c->n_layers, v41_layer_n_experts(c, l),
            v41_layer_n_active(c, l));
        if (l == c->n_layers) APP("; main_proj/main_norm");
        if (l == c->n_layers + c->n_mtp_layers - 1) APP("; norm, Markov and confidence heads");
        APP(")");
        return;
    }
    if (r.ratio == 0) APP("window-only");
    else {
        APP("ratio %d", r.ratio);
        if (r.kv_source) APP(": kv source");
        else APP(": reads compressed KV of layer %d", r.kv_from);
        if (r.index_source) {
            APP(", index source");
            if (!r.kv_source) APP(" (index keys of layer %d)", r.kv_from);
        } else {
            APP(", reuses top-k of layer %d", r.topk_from);
        }
        if (r.cand_source) APP(", candidate source");
        if (r.cand_user) APP(", masks with the candidates of layer %d", r.cand_source_of);
    }
    if (r.engram) APP("; Engram before the block");
    if (r.target) APP("; DSpark target");
#undef APP
}

static int64_t numel(const v41_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static bool is_scale(const v41_tensor *t)
{
    size_t n = strlen(t->name);
    return n > 6 && !strcmp(t->name + n - 6, ".scale") && (t->dtype == V41_DT_F8_E8M0 || t->dtype == V41_DT_F32);
}

static void print_list(const char *label, const int *v, int n)
{
    printf("%s[", label);
    for (int i = 0; i < n; i++) printf(i ? ", %d" : "%d", v[i]);
    printf("]");
}

static const char *score_name(v41_score_func f)
{
    return f == V41_SCORE_SOFTMAX ? "softmax" : f == V41_SCORE_SIGMOID ? "sigmoid" : "sqrtsoftplus";
}

int v41_cmd_inspect(int argc, char **argv)
{
    const char *spec = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: v41 inspect [MODEL] [--json]\n\n"
                   "MODEL: `tiny` (the built-in model, default), a checkpoint directory (config.json,\n"
                   "model.safetensors or model.safetensors.index.json, engram_token_map.json), or a\n"
                   "*.safetensors / *.index.json file (config.json beside it). --model MODEL also works.\n\n"
                   "Prints the config summary (and which key form was read), the layer schedule (per layer:\n"
                   "window-only or compress ratio, kv/index/candidate sources, whose compressed KV and top-k\n"
                   "it reuses, Engram, DSpark targets and stages), the tensor count, dtypes, parameter count\n"
                   "and bytes, and the weights fingerprint (FNV-1a over names, dtypes, shapes, bytes).\n"
                   "Every tensor the config requires is checked (dtype, shape). --json: one JSON object.\n"
                   "Exit status 0, or 2 with a message naming the file/tensor/key on bad input.\n");
            return 0;
        }
        if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "--model")) {
            if (i + 1 >= argc) return usage_error(argv[0], "%s needs a value", a);
            if (spec) return usage_error(argv[0], "more than one MODEL given ('%s')", argv[i + 1]);
            spec = argv[++i];
        } else if (!strncmp(a, "--model=", 8)) {
            if (spec) return usage_error(argv[0], "more than one MODEL given ('%s')", a + 8);
            spec = a + 8;
        } else if (a[0] == '-' && a[1]) return usage_error(argv[0], "unknown option '%s'", a);
        else {
            if (spec) return usage_error(argv[0], "more than one MODEL given ('%s')", a);
            spec = a;
        }
    }
    if (!spec) spec = "tiny";
    v41_err err = {0};
    v41_model *m = NULL;
    if (v41_model_load(spec, &m, &err) != V41_OK) {
        fprintf(stderr, "v41 inspect: %s\n", err.msg);
        return 2;
    }
    const v41_config *c = &m->cfg;
    const v41_weights *w = m->w;
    size_t nreq = 0, nunused = 0;
    char unused1[512] = "";
    if (v41w_check_config_ex(w, c, &nreq, &nunused, unused1, sizeof unused1, &err) != V41_OK) {
        fprintf(stderr, "v41 inspect: %s\n", err.msg);
        v41_model_free(m);
        return 2;
    }
    size_t nt = v41_weights_count(w);
    int64_t dt_count[V41_DT_F4 + 1] = {0}, params = 0, scales = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < nt; i++) {
        const v41_tensor *t = v41_weights_at(w, i);
        dt_count[t->dtype]++;
        if (is_scale(t)) scales += numel(t);
        else params += numel(t);
        bytes += t->nbytes;
    }
    char fp[17];
    v41_weights_fingerprint(w, fp);
    int T = v41_n_total_layers(c);
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", m->source);
        cJSON_AddStringToObject(o, "source_form", c->source_form);
        char *cj = v41_config_to_json(c);
        cJSON_AddItemToObject(o, "config", cJSON_Parse(cj));
        free(cj);
        cJSON *ls = cJSON_AddArrayToObject(o, "layers");
        for (int l = 0; l < T; l++) {
            lrole r = role_of(c, l);
            cJSON *e = cJSON_CreateObject();
            char txt[512];
            role_text(c, l, txt, sizeof txt);
            cJSON_AddNumberToObject(e, "layer", l);
            cJSON_AddStringToObject(e, "kind", r.stage ? "dspark_stage" : "backbone");
            if (r.stage) cJSON_AddNumberToObject(e, "dspark_stage", l - c->n_layers);
            cJSON_AddNumberToObject(e, "compress_ratio", r.ratio);
            cJSON_AddBoolToObject(e, "window_only", r.ratio == 0);
            cJSON_AddBoolToObject(e, "kv_source", r.kv_source);
            cJSON_AddBoolToObject(e, "index_source", r.index_source);
            cJSON_AddNumberToObject(e, "kv_from_layer", r.kv_from);
            cJSON_AddNumberToObject(e, "topk_from_layer", r.topk_from);
            cJSON_AddBoolToObject(e, "candidate_source", r.cand_source);
            cJSON_AddNumberToObject(e, "candidate_mask_from_layer", r.cand_source_of);
            cJSON_AddBoolToObject(e, "engram", r.engram);
            cJSON_AddBoolToObject(e, "dspark_target", r.target);
            cJSON_AddNumberToObject(e, "n_experts", v41_layer_n_experts(c, l));
            cJSON_AddNumberToObject(e, "n_active_experts", v41_layer_n_active(c, l));
            cJSON_AddStringToObject(e, "role", txt);
            cJSON_AddItemToArray(ls, e);
        }
        cJSON_AddNumberToObject(o, "tensors", (double)nt);
        cJSON_AddNumberToObject(o, "aliases", (double)v41w_alias_count(w));
        cJSON_AddNumberToObject(o, "files", v41w_nfiles(w));
        cJSON_AddNumberToObject(o, "tensors_required", (double)nreq);
        cJSON_AddNumberToObject(o, "tensors_unused", (double)nunused);
        cJSON *d = cJSON_AddObjectToObject(o, "dtypes");
        for (int k = 1; k <= V41_DT_F4; k++)
            if (dt_count[k]) cJSON_AddNumberToObject(d, v41_dtype_name((v41_dtype)k), (double)dt_count[k]);
        cJSON_AddNumberToObject(o, "parameters", (double)params);
        cJSON_AddNumberToObject(o, "scale_values", (double)scales);
        cJSON_AddNumberToObject(o, "bytes", (double)bytes);
        cJSON_AddStringToObject(o, "fingerprint", fp);
        char *s = cJSON_Print(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
        v41_model_free(m);
        return 0;
    }
    printf("model:       %s (config keys: %s)\n", m->source, !strcmp(c->source_form, "hf") ? "Hugging Face form" : "ModelArgs");
    printf("dims:        vocab %d, dim %d, %d layers + %d DSpark stages, %d heads x %d (rope %d)\n", c->vocab_size,
           c->dim, c->n_layers, c->n_mtp_layers, c->n_heads, c->head_dim, c->rope_head_dim);
    printf("attention:   q_lora %d, o %d groups x %d, window %d, indexer %d heads x %d, top-k %d\n", c->q_lora_rank,
           c->o_groups, c->o_lora_rank, c->window_size, c->index_n_heads, c->index_head_dim, c->index_topk);
    if (c->candidate_source_layer >= 0)
        printf("candidates:  source layer %d, top %d blocks of %d\n", c->candidate_source_layer, c->candidate_topk_blocks,
               c->candidate_block_size);
    else printf("candidates:  off\n");
    printf("rope:        theta %g, compressed %g", c->rope_theta, c->compress_rope_theta);
    if (c->original_seq_len > 0)
        printf(", YaRN original_seq_len %d factor %g beta %g/%g\n", c->original_seq_len, c->rope_factor, c->beta_fast,
               c->beta_slow);
    else printf(", YaRN off\n");
    printf("moe:         %d routed (%d active) + %d shared, inter %d, %s, gate_temp %g, route_scale %g, swiglu_limit %g\n",
           c->n_routed_experts, c->n_activated_experts, c->n_shared_experts, c->moe_inter_dim, score_name(c->score_func),
           c->gate_temp, c->route_scale, c->swiglu_limit);
    printf("mhc:         %d streams, %d sinkhorn iters, hc_eps %g, norm_eps %g\n", c->hc_mult, c->hc_sinkhorn_iters,
           c->hc_eps, c->norm_eps);
    if (c->n_engram_layers) {
        print_list("engram:      layers ", c->engram_layer_ids, c->n_engram_layers);
        printf(", n-grams up to %d, %d heads x %d, vocab %lld, compressed vocab %d, rows [", c->engram_max_ngram_size,
               c->engram_n_heads, c->engram_head_dim, (long long)c->engram_vocab_size, c->engram_compressed_vocab_size);
        for (int i = 0; i < c->n_engram_layers; i++)
            printf(i ? ", %lld" : "%lld", (long long)c->engram_num_embeddings[i]);
        printf("]\n");
    } else printf("engram:      none\n");
    if (c->n_mtp_layers) {
        printf("dspark:      %d stages, block %d, noise token %d, markov rank %d, ", c->n_mtp_layers,
               c->dspark_block_size, c->dspark_noise_token_id, c->dspark_markov_rank);
        print_list("targets ", c->dspark_target_layer_ids, c->n_dspark_targets);
        printf("\n");
    }
    printf("storage:     Linear %s, experts %s\n\n", c->dtype, c->expert_dtype);
    printf("layer schedule:\n");
    for (int l = 0; l < T; l++) {
        char txt[512];
        role_text(c, l, txt, sizeof txt);
        printf("  layer %-3d %s\n", l, txt);
    }
    printf("\ntensors:     %zu in %d file%s (+%zu aliases); %zu required by the config, %zu unused%s%s\n", nt,
           v41w_nfiles(w), v41w_nfiles(w) == 1 ? "" : "s", v41w_alias_count(w), nreq, nunused,
           nunused ? ", e.g. " : "", unused1);
    printf("dtypes:     ");
    for (int k = 1; k <= V41_DT_F4; k++)
        if (dt_count[k]) printf(" %s %lld", v41_dtype_name((v41_dtype)k), (long long)dt_count[k]);
    printf("\nparameters:  %lld (+ %lld scale values), %llu bytes (%.2f MiB)\n", (long long)params, (long long)scales,
           (unsigned long long)bytes, bytes / 1048576.0);
    printf("fingerprint: %s\n", fp);
    v41_model_free(m);
    return 0;
}

/* ------------------------------------------------------------------ export-tiny */

int v41_cmd_export_tiny(int argc, char **argv)
{
    const char *dir = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: v41 export-tiny DIR\n\n"
                   "Write the built-in tiny model as a checkpoint directory: config.json (ModelArgs keys),\n"
                   "model.safetensors (official storage dtypes: fp8 e4m3 + e8m0 32x32 scales, packed fp4 +\n"
                   "e8m0 per 32, bf16, fp32; DSpark embed/head as aliases in the metadata) and\n"
                   "engram_token_map.json. DIR is created if needed; files are written under temporary\n"
                   "names and renamed. `v41 inspect DIR` then shows the same fingerprint as `v41 inspect tiny`.\n");
            return 0;
        }
        if (a[0] == '-' && a[1]) return usage_error(argv[0], "unknown option '%s'", a);
        if (dir) return usage_error(argv[0], "more than one DIR given ('%s')", a);
        dir = a;
    }
    if (!dir || !*dir) return usage_error(argv[0], "%s", "missing DIR");
    v41_err err = {0};
    v41_model *m = NULL;
    if (v41_model_tiny(&m, &err) != V41_OK) {
        fprintf(stderr, "v41 export-tiny: %s\n", err.msg);
        return 2;
    }
    int rc = v41_model_export(m, dir, &err);
    if (rc) {
        fprintf(stderr, "v41 export-tiny: %s\n", err.msg);
        v41_model_free(m);
        return 2;
    }
    char fp[17];
    v41_weights_fingerprint(m->w, fp);
    printf("wrote %s (config.json, model.safetensors, engram_token_map.json); %zu tensors, fingerprint %s\n", dir,
           v41_weights_count(m->w), fp);
    v41_model_free(m);
    return 0;
}
