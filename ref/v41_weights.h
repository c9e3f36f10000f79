/* v41_weights.h: memory-mapped safetensors checkpoints (single file or
 * sharded through model.safetensors.index.json) and the built-in tiny model.
 * Tensors are never copied whole; lookups check dtype and shape. */
#ifndef V41_WEIGHTS_H
#define V41_WEIGHTS_H

#include "v41_config.h"

#ifdef __cplusplus
extern "C" {
#endif

#define V41_MAX_DIMS 8

typedef struct v41_tensor {
    const char *name;        /* canonical name (no "model." prefix) */
    v41_dtype dtype;
    int ndim;
    int64_t shape[V41_MAX_DIMS]; /* as in the header: F4 counts fp4 elements */
    const void *data;        /* points into the mapping (or the in-memory tiny model) */
    size_t nbytes;
} v41_tensor;

typedef struct v41_weights v41_weights;

/* Open a checkpoint: a directory (model.safetensors or
 * model.safetensors.index.json inside), or one .safetensors file.
 * Hostile files fail with V41_EINVAL and a message naming file and tensor. */
int v41_weights_open(const char *path, v41_weights **out, v41_err *err);
void v41_weights_close(v41_weights *w);

/* Lookup by name; accepts "model." prefixes, "model.embed_tokens.weight"
 * and the aliases of the "aliases" metadata key. NULL when absent. */
const v41_tensor *v41_weights_find(const v41_weights *w, const char *name);
/* Lookup with checks: dtype must match (V41_DT_INVALID = any), ndim/shape
 * must match where shape != NULL (-1 entries = any). */
int v41_weights_get(const v41_weights *w, const char *name, v41_dtype dt,
                    int ndim, const int64_t *shape, const v41_tensor **out, v41_err *err);
size_t v41_weights_count(const v41_weights *w);
const v41_tensor *v41_weights_at(const v41_weights *w, size_t i); /* sorted by name */
/* Metadata value of the safetensors "__metadata__" (first shard), or NULL. */
const char *v41_weights_meta(const v41_weights *w, const char *key);
/* 64-bit FNV-1a over names, dtypes, shapes and bytes, as 16 hex chars. */
void v41_weights_fingerprint(const v41_weights *w, char out[17]);
/* Check that every tensor cfg requires is present with the right dtype/shape. */
int v41_weights_check_config(const v41_weights *w, const v41_config *cfg, v41_err *err);

/* A loaded model: config + weights + engram compressed-token map. */
typedef struct v41_model {
    v41_config cfg;
    v41_weights *w;
    int64_t *engram_token_map;  /* [vocab_size] compressed id of each token, or NULL when no engram */
    char source[4096];          /* "tiny" or the path */
} v41_model;

/* spec: "tiny" (built-in synthetic model) or a checkpoint dir/file.
 * Reads config.json and engram_token_map.json beside the weights. */
int v41_model_load(const char *spec, v41_model **out, v41_err *err);
void v41_model_free(v41_model *m);
/* Build the tiny model in memory (deterministic synthetic weights stored in
 * the official formats: fp8/fp4 + e8m0 scales, bf16, fp32). */
int v41_model_tiny(v41_model **out, v41_err *err);
/* Write a model as a checkpoint directory (config.json, model.safetensors,
 * engram_token_map.json). */
int v41_model_export(const v41_model *m, const char *dir, v41_err *err);

#ifdef __cplusplus
}
#endif
#endif
