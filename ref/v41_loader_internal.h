/* v41_loader_internal.h: private interface between safetensors.c, model.c
 * and tiny.c (not installed). A v41_weights is backed either by mmapped
 * safetensors files or by buffers it owns (the built-in tiny model). */
#ifndef V41_LOADER_INTERNAL_H
#define V41_LOADER_INTERNAL_H

#include "v41_weights.h"
#include <cjson/cJSON.h>

/* Member `key` of a JSON object; *dup = 1 when the key occurs more than once (cJSON keeps
 * every duplicate, a checkpoint or config with one is rejected by the callers). */
const cJSON *v41_json_get_unique(const cJSON *obj, const char *key, int *dup);

/* An empty in-memory weight set. */
v41_weights *v41w_new_mem(void);
/* Add a tensor; the weight set takes ownership of data (malloc'd, nbytes
 * bytes, which must equal dtype x shape). On error data is freed too. */
int v41w_add(v41_weights *w, const char *name, v41_dtype dt, int ndim, const int64_t *shape, void *data,
             size_t nbytes, v41_err *err);
/* Add an alias (name -> stored tensor). */
int v41w_add_alias(v41_weights *w, const char *alias, const char *target, v41_err *err);
/* Set a metadata string (copied). */
int v41w_set_meta(v41_weights *w, const char *key, const char *value, v41_err *err);
/* Sort, reject duplicates, resolve aliases. Must be called once after the adds. */
int v41w_finish(v41_weights *w, v41_err *err);

/* Number of aliases and the i-th (sorted by alias name). */
size_t v41w_alias_count(const v41_weights *w);
void v41w_alias_at(const v41_weights *w, size_t i, const char **alias, const char **target);
/* Number of files backing it (0 = in memory). */
int v41w_nfiles(const v41_weights *w);

/* Write as one safetensors file (8-byte aligned data, "__metadata__" with
 * the aliases as a JSON string). Writes path.tmp.PID then renames. */
int v41w_write_safetensors(const v41_weights *w, const char *path, v41_err *err);

/* v41_weights_check_config, also reporting how many stored tensors the
 * config requires (n_required) and how many stored tensors it does not use
 * (n_unused; the first one's name in first_unused, if any). */
int v41w_check_config_ex(const v41_weights *w, const v41_config *cfg, size_t *n_required, size_t *n_unused,
                         char *first_unused, size_t first_unused_len, v41_err *err);

/* Parse a safetensors image already in memory (used by the fuzzer and tests):
 * same checks as a file. label names it in messages. On success the weight
 * set points into buf, which must outlive it. */
int v41w_open_buffer(const void *buf, size_t size, const char *label, v41_weights **out, v41_err *err);

#endif
