/* model.c: a loaded model = config.json + weights + engram token map, and
 * the checkpoint exporter (config.json, model.safetensors,
 * engram_token_map.json, each written to a temporary name and renamed). */
#include "v41_loader_internal.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int read_text(const char *path, size_t max, char **out, size_t *len, v41_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return v41_err_set(err, errno == ENOENT ? V41_ENOTFOUND : V41_EIO, "%s: cannot open: %s", path,
                               strerror(errno));
    char *buf = malloc(max + 1);
    if (!buf) { fclose(f); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    size_t n = fread(buf, 1, max + 1, f);
    fclose(f);
    if (n > max) { free(buf); return v41_err_set(err, V41_EINVAL, "%s: larger than %zu bytes", path, max); }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return V41_OK;
}

/* engram_token_map.json: {"lookup": [compressed id of token 0, 1, ...], ...}
 * (the oracle's form) or a bare list. */
static int load_token_map(const char *path, const v41_config *cfg, int64_t **out, v41_err *err)
{
    char *text = NULL;
    size_t len = 0;
    int rc = read_text(path, 256u << 20, &text, &len, err);
    if (rc) return rc;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return v41_err_set(err, V41_EINVAL, "%s: not valid JSON", path);
    const cJSON *lk = cJSON_IsArray(root) ? root : cJSON_GetObjectItemCaseSensitive(root, "lookup");
    if (!lk || !cJSON_IsArray(lk)) {
        cJSON_Delete(root);
        return v41_err_set(err, V41_EINVAL, "%s: key 'lookup' missing or not a list", path);
    }
    int n = cJSON_GetArraySize(lk);
    if (n != cfg->vocab_size) {
        cJSON_Delete(root);
        return v41_err_set(err, V41_EINVAL, "%s: key 'lookup' has %d entries, expected vocab_size = %d", path, n,
                           cfg->vocab_size);
    }
    int64_t *map = malloc((size_t)n * sizeof *map);
    if (!map) { cJSON_Delete(root); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, lk) {
        double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (v < 0 || v >= cfg->engram_compressed_vocab_size || v != (double)(int64_t)v) {
            free(map);
            cJSON_Delete(root);
            return v41_err_set(err, V41_EINVAL,
                               "%s: lookup[%d] is not an id in [0, engram_compressed_vocab_size = %d)", path, i,
                               cfg->engram_compressed_vocab_size);
        }
        map[i++] = (int64_t)v;
    }
    cJSON_Delete(root);
    *out = map;
    return V41_OK;
}

int v41_model_load(const char *spec, v41_model **out, v41_err *err)
{
    *out = NULL;
    if (!spec || !*spec || !strcmp(spec, "tiny")) return v41_model_tiny(out, err);
    struct stat st;
    if (stat(spec, &st) != 0)
        return v41_err_set(err, V41_ENOTFOUND, "%s: %s (MODEL is `tiny` or a checkpoint directory)", spec,
                           strerror(errno));
    char dir[4096];
    if (S_ISDIR(st.st_mode)) snprintf(dir, sizeof dir, "%s", spec);
    else {
        snprintf(dir, sizeof dir, "%s", spec);
        char *s = strrchr(dir, '/');
        if (s) *s = 0;
        else snprintf(dir, sizeof dir, ".");
    }
    v41_model *m = calloc(1, sizeof *m);
    if (!m) return v41_err_set(err, V41_ENOMEM, "out of memory");
    snprintf(m->source, sizeof m->source, "%s", spec);
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", dir);
    int rc = v41_weights_open(spec, &m->w, err);
    if (!rc) rc = v41_config_load(p, &m->cfg, err);
    if (!rc) rc = v41_weights_check_config(m->w, &m->cfg, err);
    if (rc == V41_OK && m->cfg.n_engram_layers > 0) {
        snprintf(p, sizeof p, "%s/engram_token_map.json", dir);
        rc = load_token_map(p, &m->cfg, &m->engram_token_map, err);
        if (rc == V41_ENOTFOUND) v41_err_prefix(err, "the config has engram layers, so the token map is required");
    }
    if (rc) {
        v41_model_free(m);
        return rc;
    }
    *out = m;
    return V41_OK;
}

void v41_model_free(v41_model *m)
{
    if (!m) return;
    v41_weights_close(m->w);
    free(m->engram_token_map);
    free(m);
}

static int write_atomic(const char *path, const char *text, v41_err *err)
{
    char tmp[4400];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return v41_err_set(err, V41_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n && fputc('\n', f) != EOF;
    if (fclose(f) != 0) ok = false;
    if (!ok) {
        unlink(tmp);
        return v41_err_set(err, V41_EIO, "%s: write failed", tmp);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return v41_err_set(err, V41_EIO, "%s: cannot rename to %s: %s", tmp, path, strerror(e));
    }
    return V41_OK;
}

int v41_model_export(const v41_model *m, const char *dir, v41_err *err)
{
    struct stat st;
    if (stat(dir, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) return v41_err_set(err, V41_EIO, "%s: exists and is not a directory", dir);
    } else if (mkdir(dir, 0777) != 0) {
        return v41_err_set(err, V41_EIO, "%s: cannot create directory: %s", dir, strerror(errno));
    }
    char p[4200];
    int rc;
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    if ((rc = v41w_write_safetensors(m->w, p, err))) return rc;
    if (m->engram_token_map) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "vocab_size", m->cfg.vocab_size);
        cJSON_AddNumberToObject(o, "compressed_vocab_size", m->cfg.engram_compressed_vocab_size);
        cJSON_AddNumberToObject(o, "engram_pad_id", m->cfg.engram_pad_id);
        cJSON_AddNumberToObject(o, "compressed_pad_id", (double)m->engram_token_map[m->cfg.engram_pad_id]);
        cJSON_AddStringToObject(o, "note", "lookup[token_id] = compressed id");
        cJSON *a = cJSON_AddArrayToObject(o, "lookup");
        for (int i = 0; i < m->cfg.vocab_size; i++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)m->engram_token_map[i]));
        char *s = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!s) return v41_err_set(err, V41_ENOMEM, "out of memory");
        snprintf(p, sizeof p, "%s/engram_token_map.json", dir);
        rc = write_atomic(p, s, err);
        free(s);
        if (rc) return rc;
    }
    /* config.json last: a directory with a config is a complete checkpoint */
    char *cj = v41_config_to_json(&m->cfg);
    if (!cj) return v41_err_set(err, V41_ENOMEM, "out of memory");
    snprintf(p, sizeof p, "%s/config.json", dir);
    rc = write_atomic(p, cj, err);
    free(cj);
    return rc;
}
