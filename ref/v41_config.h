/* v41_config.h: the model description (SPEC.md §1), parsed from
 * DeepSeek's ModelArgs config.json or the Hugging Face form, validated. */
#ifndef V41_CONFIG_H
#define V41_CONFIG_H

#include "v41_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define V41_MAX_LAYERS 256   /* backbone + DSpark stages */
#define V41_MAX_LIST 64      /* kv/index sources, engram layers, dspark targets */

typedef enum { V41_SCORE_SQRTSOFTPLUS = 0, V41_SCORE_SOFTMAX, V41_SCORE_SIGMOID } v41_score_func;

typedef struct v41_config {
    int max_batch_size, max_seq_len;
    int vocab_size, dim;
    int n_layers, n_mtp_layers;          /* DSpark stages are layer ids n_layers.. */
    int n_heads, head_dim, rope_head_dim;
    int q_lora_rank, o_groups, o_lora_rank;
    int window_size;
    int compress_ratios[V41_MAX_LAYERS]; /* n_layers + n_mtp_layers entries */
    int n_kv_sources, kv_source_layers[V41_MAX_LIST];
    int n_index_sources, index_source_layers[V41_MAX_LIST];
    int candidate_source_layer;          /* < 0 disables */
    int candidate_topk_blocks, candidate_block_size;
    int index_n_heads, index_head_dim, index_topk;
    double rope_theta, compress_rope_theta;
    int original_seq_len;                /* 0 = YaRN off */
    double rope_factor, beta_fast, beta_slow;
    int n_routed_experts, n_activated_experts, n_shared_experts, moe_inter_dim;
    v41_score_func score_func;
    double gate_temp;
    bool norm_topk_prob;
    double route_scale, swiglu_limit;
    int hc_mult, hc_sinkhorn_iters;
    double hc_eps, norm_eps;
    int n_engram_layers, engram_layer_ids[V41_MAX_LIST];
    int64_t engram_num_embeddings[V41_MAX_LIST];
    int engram_max_ngram_size, engram_n_heads, engram_head_dim;
    int64_t engram_vocab_size;
    int engram_pad_id, engram_compressed_vocab_size;
    int dspark_block_size, dspark_noise_token_id;
    int n_dspark_targets, dspark_target_layer_ids[V41_MAX_LIST];
    int dspark_markov_rank, dspark_n_routed_experts, dspark_n_activated_experts;
    char dtype[16], expert_dtype[16];    /* "fp8", "fp4", "bf16" */
    char source_form[16];                /* "modelargs" or "hf": which key names were read */
} v41_config;

/* Parse and validate JSON text. Every failure names the key. */
int v41_config_parse(const char *json_text, size_t len, v41_config *cfg, v41_err *err);
/* Read DIR/config.json (or a .json path) and parse. */
int v41_config_load(const char *path, v41_config *cfg, v41_err *err);
/* Re-check consistency (SPEC §1 validation); called by parse. */
int v41_config_validate(const v41_config *cfg, v41_err *err);
/* Serialise as ModelArgs JSON (malloc'd string, caller frees). */
char *v41_config_to_json(const v41_config *cfg);
/* The built-in tiny configuration (same shapes as ../shared/oracle/v41-tiny). */
void v41_config_tiny(v41_config *cfg);

/* ---- layer schedule (SPEC §1, §5, §6) ---- */
static inline int v41_n_total_layers(const v41_config *c) { return c->n_layers + c->n_mtp_layers; }
bool v41_is_kv_source(const v41_config *c, int layer);
bool v41_is_index_source(const v41_config *c, int layer);
bool v41_is_engram_layer(const v41_config *c, int layer);
bool v41_is_dspark_target(const v41_config *c, int layer);
/* Newest kv source <= layer (the owner of the compressed KV and index keys this layer reads); -1 if none. */
int v41_kv_source_of(const v41_config *c, int layer);
/* Newest index source <= layer (whose top-k this layer uses); -1 if none. */
int v41_index_source_of(const v41_config *c, int layer);
/* Index of layer in engram_layer_ids, or -1. */
int v41_engram_index(const v41_config *c, int layer);
/* Last kv source layer (the decoder-side replay cut, SPEC §7); -1 if none. */
int v41_last_kv_source(const v41_config *c);
/* Expert counts of a layer (DSpark stages may override, 0 = backbone's). */
int v41_layer_n_experts(const v41_config *c, int layer);
int v41_layer_n_active(const v41_config *c, int layer);

#ifdef __cplusplus
}
#endif
#endif
