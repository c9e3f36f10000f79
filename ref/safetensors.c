/* safetensors.c: memory-mapped safetensors checkpoints (one file, or shards
 * listed by model.safetensors.index.json), in-memory weight sets (the tiny
 * model), lookups with dtype/shape checks, the fingerprint, the writer and
 * the check of every tensor a config requires (SPEC §9).
 *
 * Format: u64 little-endian header length n, n bytes of JSON (an object:
 * "__metadata__" -> {str: str}, name -> {"dtype", "shape", "data_offsets"}),
 * then the data; offsets are relative to the end of the header. Every
 * field is checked before any byte of data is touched: a hostile file is
 * rejected with V41_EINVAL and a message naming the file and tensor. */
#include "v41_loader_internal.h"
#include "v41_quant.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_HEADER (100u << 20) /* the safetensors reference reader's limit */

typedef struct {
    char *path;
    const void *base;
    size_t size;
    bool mapped;
} wfile;

typedef struct {
    v41_tensor t;   /* first member: &went.t is what callers see */
    int file;       /* index in files, -1 = in memory */
    void *owned;    /* in-memory data to free */
} went;

typedef struct {
    char *alias, *target;
    const v41_tensor *t;
} walias;

typedef struct {
    char *key, *val;
} wmeta;

struct v41_weights {
    wfile *files;
    int nfiles;
    went *e;
    size_t n, cap;
    walias *al;
    size_t nal, capal;
    wmeta *meta;
    size_t nmeta, capmeta;
    bool finished;
};

/* ------------------------------------------------------------------ names */

/* canonical tensor name: no "model." prefix (every one: stripping one left "model.model.w" as
 * "model.w", which a lookup of that stored name canonicalised to "w" and missed; found by
 * fuzz_safetensors); HF embedding / head names. canon(canon(x)) == canon(x). */
static void canon(const char *in, char *out, size_t outlen)
{
    while (!strncmp(in, "model.", 6)) in += 6;
    if (!strcmp(in, "embed_tokens.weight")) in = "embed.weight";
    else if (!strcmp(in, "lm_head.weight")) in = "head.weight";
    snprintf(out, outlen, "%s", in);
}

static int cmp_went(const void *a, const void *b)
{
    return strcmp(((const went *)a)->t.name, ((const went *)b)->t.name);
}
static int cmp_alias(const void *a, const void *b)
{
    return strcmp(((const walias *)a)->alias, ((const walias *)b)->alias);
}

static const char *file_label(const v41_weights *w, int f) { return f >= 0 ? w->files[f].path : "(memory)"; }

/* ------------------------------------------------------------------ building */

v41_weights *v41w_new_mem(void) { return calloc(1, sizeof(v41_weights)); }

static int add_entry(v41_weights *w, const char *name, v41_dtype dt, int ndim, const int64_t *shape, const void *data,
                     size_t nbytes, int file, void *owned, v41_err *err)
{
    if (w->n == w->cap) {
        size_t nc = w->cap ? 2 * w->cap : 256;
        went *ne = realloc(w->e, nc * sizeof *ne);
        if (!ne) return v41_err_set(err, V41_ENOMEM, "out of memory");
        w->e = ne;
        w->cap = nc;
    }
    char cn[1024];
    canon(name, cn, sizeof cn);
    char *nm = strdup(cn);
    if (!nm) return v41_err_set(err, V41_ENOMEM, "out of memory");
    went *e = &w->e[w->n++];
    memset(e, 0, sizeof *e);
    e->t.name = nm;
    e->t.dtype = dt;
    e->t.ndim = ndim;
    for (int i = 0; i < ndim; i++) e->t.shape[i] = shape[i];
    e->t.data = data;
    e->t.nbytes = nbytes;
    e->file = file;
    e->owned = owned;
    return V41_OK;
}

/* numel of a shape with overflow checks; -1 when too large */
static int64_t numel_of(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] && n > ((int64_t)1 << 56) / shape[i]) return -1;
        n *= shape[i];
    }
    return n;
}

int v41w_add(v41_weights *w, const char *name, v41_dtype dt, int ndim, const int64_t *shape, void *data,
             size_t nbytes, v41_err *err)
{
    if (ndim < 0 || ndim > V41_MAX_DIMS) {
        free(data);
        return v41_err_set(err, V41_EINVAL, "tensor '%s': %d dims (at most %d)", name, ndim, V41_MAX_DIMS);
    }
    int64_t ne = numel_of(ndim, shape);
    if (ne < 0 || (dt == V41_DT_F4 && ne % 2) || v41_dtype_nbytes(dt, ne) != nbytes || dt == V41_DT_INVALID) {
        free(data);
        return v41_err_set(err, V41_EINVAL, "tensor '%s': %zu bytes do not match dtype %s x shape", name, nbytes,
                           v41_dtype_name(dt));
    }
    int rc = add_entry(w, name, dt, ndim, shape, data, nbytes, -1, data, err);
    if (rc) free(data);
    return rc;
}

int v41w_add_alias(v41_weights *w, const char *alias, const char *target, v41_err *err)
{
    if (w->nal == w->capal) {
        size_t nc = w->capal ? 2 * w->capal : 16;
        walias *na = realloc(w->al, nc * sizeof *na);
        if (!na) return v41_err_set(err, V41_ENOMEM, "out of memory");
        w->al = na;
        w->capal = nc;
    }
    char a[1024], t[1024];
    canon(alias, a, sizeof a);
    canon(target, t, sizeof t);
    walias *x = &w->al[w->nal];
    x->alias = strdup(a);
    x->target = strdup(t);
    x->t = NULL;
    if (!x->alias || !x->target) {
        free(x->alias);
        free(x->target);
        return v41_err_set(err, V41_ENOMEM, "out of memory");
    }
    w->nal++;
    return V41_OK;
}

int v41w_set_meta(v41_weights *w, const char *key, const char *value, v41_err *err)
{
    for (size_t i = 0; i < w->nmeta; i++)
        if (!strcmp(w->meta[i].key, key)) {
            char *v = strdup(value);
            if (!v) return v41_err_set(err, V41_ENOMEM, "out of memory");
            free(w->meta[i].val);
            w->meta[i].val = v;
            return V41_OK;
        }
    if (w->nmeta == w->capmeta) {
        size_t nc = w->capmeta ? 2 * w->capmeta : 8;
        wmeta *nm = realloc(w->meta, nc * sizeof *nm);
        if (!nm) return v41_err_set(err, V41_ENOMEM, "out of memory");
        w->meta = nm;
        w->capmeta = nc;
    }
    w->meta[w->nmeta].key = strdup(key);
    w->meta[w->nmeta].val = strdup(value);
    if (!w->meta[w->nmeta].key || !w->meta[w->nmeta].val) {
        free(w->meta[w->nmeta].key);
        free(w->meta[w->nmeta].val);
        return v41_err_set(err, V41_ENOMEM, "out of memory");
    }
    w->nmeta++;
    return V41_OK;
}

static const v41_tensor *find_stored(const v41_weights *w, const char *cname)
{
    size_t lo = 0, hi = w->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(w->e[mid].t.name, cname);
        if (!c) return &w->e[mid].t;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

int v41w_finish(v41_weights *w, v41_err *err)
{
    if (w->n) qsort(w->e, w->n, sizeof *w->e, cmp_went);
    for (size_t i = 1; i < w->n; i++)
        if (!strcmp(w->e[i].t.name, w->e[i - 1].t.name)) {
            if (w->e[i].file == w->e[i - 1].file)
                return v41_err_set(err, V41_EINVAL, "%s: duplicate tensor name '%s'", file_label(w, w->e[i].file),
                                   w->e[i].t.name);
            return v41_err_set(err, V41_EINVAL, "tensor '%s' is stored twice: in %s and in %s", w->e[i].t.name,
                               file_label(w, w->e[i - 1].file), file_label(w, w->e[i].file));
        }
    if (w->nal) qsort(w->al, w->nal, sizeof *w->al, cmp_alias);
    for (size_t i = 0; i < w->nal; i++) {
        if (i > 0 && !strcmp(w->al[i].alias, w->al[i - 1].alias) && strcmp(w->al[i].target, w->al[i - 1].target))
            return v41_err_set(err, V41_EINVAL, "alias '%s' is defined twice with different targets", w->al[i].alias);
        w->al[i].t = find_stored(w, w->al[i].target);
        if (!w->al[i].t)
            return v41_err_set(err, V41_EINVAL, "alias '%s' -> '%s': no such tensor in the checkpoint", w->al[i].alias,
                               w->al[i].target);
    }
    w->finished = true;
    return V41_OK;
}

/* ------------------------------------------------------------------ parsing */


typedef struct {
    uint64_t b, e;
    const char *name;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->b != y->b) return x->b < y->b ? -1 : 1;
    if (x->e != y->e) return x->e < y->e ? -1 : 1;
    return 0;
}

static int parse_aliases(v41_weights *w, const char *label, const char *json, v41_err *err)
{
    cJSON *a = cJSON_Parse(json);
    if (!a || !cJSON_IsObject(a)) {
        cJSON_Delete(a);
        return v41_err_set(err, V41_EINVAL, "%s: __metadata__ key 'aliases' is not a JSON object", label);
    }
    const cJSON *it;
    int rc = V41_OK;
    cJSON_ArrayForEach(it, a) {
        if (!cJSON_IsString(it)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: alias '%s' must map to a tensor name (string)", label, it->string);
            break;
        }
        if ((rc = v41w_add_alias(w, it->string, it->valuestring, err))) break;
    }
    cJSON_Delete(a);
    return rc;
}

/* Parse one safetensors image (header + data) and add its tensors. */
static int parse_image(v41_weights *w, int fidx, const char *label, const uint8_t *base, size_t size, v41_err *err)
{
    if (size < 8)
        return v41_err_set(err, V41_EINVAL, "%s: %zu bytes, too small for a safetensors header", label, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | base[i];
    if (hlen > size - 8)
        return v41_err_set(err, V41_EINVAL, "%s: header length %llu goes beyond the end of the file (%zu bytes)", label,
                           (unsigned long long)hlen, size);
    if (hlen > MAX_HEADER)
        return v41_err_set(err, V41_EINVAL, "%s: header length %llu exceeds the %u-byte limit", label,
                           (unsigned long long)hlen, MAX_HEADER);
    if (hlen < 2) return v41_err_set(err, V41_EINVAL, "%s: header of %llu bytes is not a JSON object", label,
                                     (unsigned long long)hlen);
    const char *htext = (const char *)base + 8;
    const uint8_t *data = base + 8 + hlen;
    uint64_t dsize = size - 8 - hlen;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(htext, (size_t)hlen, &end, 0);
    if (!root) {
        size_t off = end && end >= htext ? (size_t)(end - htext) : 0;
        if (off + 1 >= hlen)
            return v41_err_set(err, V41_EINVAL, "%s: header JSON is unterminated (ends inside a value at byte %llu)",
                               label, (unsigned long long)hlen);
        return v41_err_set(err, V41_EINVAL, "%s: header is not valid JSON (error near byte %zu of %llu)", label, off,
                           (unsigned long long)hlen);
    }
    int rc = V41_OK;
    span *spans = NULL;
    size_t nsp = 0;
    if (!cJSON_IsObject(root)) {
        rc = v41_err_set(err, V41_EINVAL, "%s: header must be a JSON object", label);
        goto out;
    }
    for (const char *p = end; p < htext + hlen; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r' && *p != '\0') {
            rc = v41_err_set(err, V41_EINVAL, "%s: trailing bytes after the header JSON object (byte %zu)", label,
                             (size_t)(p - htext));
            goto out;
        }
    int nchild = cJSON_GetArraySize(root);
    spans = calloc((size_t)nchild + 1, sizeof *spans);
    if (!spans) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto out; }
    size_t first_new = w->n;
    bool seen_meta = false;
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        const char *name = it->string ? it->string : "";
        if (!strcmp(name, "__metadata__")) {
            if (seen_meta) { rc = v41_err_set(err, V41_EINVAL, "%s: duplicate __metadata__", label); goto out; }
            seen_meta = true;
            if (!cJSON_IsObject(it)) {
                rc = v41_err_set(err, V41_EINVAL, "%s: __metadata__ must be an object", label);
                goto out;
            }
            const cJSON *m;
            cJSON_ArrayForEach(m, it) {
                if (!cJSON_IsString(m)) {
                    rc = v41_err_set(err, V41_EINVAL, "%s: __metadata__ key '%s': value must be a string", label,
                                     m->string ? m->string : "");
                    goto out;
                }
                bool have = false;
                for (size_t i = 0; i < w->nmeta; i++)
                    if (!strcmp(w->meta[i].key, m->string)) have = true;
                if (!have && (rc = v41w_set_meta(w, m->string, m->valuestring, err))) goto out;
                if (!strcmp(m->string, "aliases") && (rc = parse_aliases(w, label, m->valuestring, err))) goto out;
            }
            continue;
        }
        if (!cJSON_IsObject(it)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': header entry is not an object", label, name);
            goto out;
        }
        if (!*name || strlen(name) > 900) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor name of length %zu is not allowed", label, strlen(name));
            goto out;
        }
        int d1, d2, d3;
        const cJSON *jdt = v41_json_get_unique(it, "dtype", &d1), *jsh = v41_json_get_unique(it, "shape", &d2),
                    *jof = v41_json_get_unique(it, "data_offsets", &d3);
        if (d1 || d2 || d3) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': duplicate field in its header entry", label, name);
            goto out;
        }
        if (!jdt || !cJSON_IsString(jdt)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': missing or non-string \"dtype\"", label, name);
            goto out;
        }
        v41_dtype dt = v41_dtype_from_name(jdt->valuestring);
        if (dt == V41_DT_INVALID) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': unknown dtype '%.32s'", label, name, jdt->valuestring);
            goto out;
        }
        if (!jsh || !cJSON_IsArray(jsh)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': missing or non-list \"shape\"", label, name);
            goto out;
        }
        int ndim = cJSON_GetArraySize(jsh);
        if (ndim > V41_MAX_DIMS) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': %d dims (at most %d supported)", label, name, ndim,
                             V41_MAX_DIMS);
            goto out;
        }
        int64_t shape[V41_MAX_DIMS];
        int k = 0;
        const cJSON *d;
        cJSON_ArrayForEach(d, jsh) {
            /* range first: converting an out-of-range double to int64_t is undefined (found by fuzzing) */
            if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 9.0e15 ||
                d->valuedouble != (double)(int64_t)d->valuedouble) {
                rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': shape[%d] is not a non-negative integer", label,
                                 name, k);
                goto out;
            }
            shape[k++] = (int64_t)d->valuedouble;
        }
        if (!jof || !cJSON_IsArray(jof) || cJSON_GetArraySize(jof) != 2) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': \"data_offsets\" must be a list of 2 integers", label,
                             name);
            goto out;
        }
        uint64_t off[2];
        for (int i = 0; i < 2; i++) {
            const cJSON *o = cJSON_GetArrayItem(jof, i);
            if (!cJSON_IsNumber(o) || o->valuedouble < 0 || o->valuedouble > 9.0e15 ||
                o->valuedouble != (double)(int64_t)o->valuedouble) {
                rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': data_offsets[%d] is not a non-negative integer",
                                 label, name, i);
                goto out;
            }
            off[i] = (uint64_t)o->valuedouble;
        }
        if (off[0] > off[1] || off[1] > dsize) {
            rc = v41_err_set(err, V41_EINVAL,
                             "%s: tensor '%s': data_offsets [%llu, %llu] out of range (data section has %llu bytes)",
                             label, name, (unsigned long long)off[0], (unsigned long long)off[1],
                             (unsigned long long)dsize);
            goto out;
        }
        int64_t ne = numel_of(ndim, shape);
        if (ne < 0) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': shape too large", label, name);
            goto out;
        }
        if (dt == V41_DT_F4 && ne % 2) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s': odd number (%lld) of F4 elements", label, name,
                             (long long)ne);
            goto out;
        }
        size_t need = v41_dtype_nbytes(dt, ne);
        if ((uint64_t)need != off[1] - off[0]) {
            rc = v41_err_set(err, V41_EINVAL,
                             "%s: tensor '%s': %llu bytes in data_offsets, but dtype %s x shape needs %zu bytes", label,
                             name, (unsigned long long)(off[1] - off[0]), v41_dtype_name(dt), need);
            goto out;
        }
        spans[nsp].b = off[0];
        spans[nsp].e = off[1];
        spans[nsp].name = name;
        nsp++;
        if ((rc = add_entry(w, name, dt, ndim, shape, data + off[0], need, fidx, NULL, err))) goto out;
    }
    /* overlaps: sort spans by start; empty tensors overlap nothing */
    if (nsp) qsort(spans, nsp, sizeof *spans, cmp_span);
    {
        uint64_t maxe = 0;
        const char *maxn = NULL;
        for (size_t i = 0; i < nsp; i++) {
            if (spans[i].e == spans[i].b) continue;
            if (maxn && spans[i].b < maxe) {
                rc = v41_err_set(err, V41_EINVAL, "%s: tensors '%s' and '%s' overlap in the data section", label, maxn,
                                 spans[i].name);
                goto out;
            }
            if (spans[i].e > maxe) { maxe = spans[i].e; maxn = spans[i].name; }
        }
    }
    /* duplicate names (cJSON keeps both) are reported by v41w_finish, which sees all shards */
    (void)first_new;
out:
    free(spans);
    cJSON_Delete(root);
    return rc;
}

/* ------------------------------------------------------------------ opening */

static int map_file(v41_weights *w, const char *path, int *fidx, v41_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return v41_err_set(err, V41_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return v41_err_set(err, V41_EIO, "%s: not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    void *base = NULL;
    if (size > 0) {
        base = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (base == MAP_FAILED) {
            int e = errno;
            close(fd);
            return v41_err_set(err, V41_EIO, "%s: cannot mmap: %s", path, strerror(e));
        }
    }
    close(fd);
    wfile *nf = realloc(w->files, (size_t)(w->nfiles + 1) * sizeof *nf);
    if (!nf) {
        if (base) munmap(base, size);
        return v41_err_set(err, V41_ENOMEM, "out of memory");
    }
    w->files = nf;
    wfile *f = &w->files[w->nfiles];
    f->path = strdup(path);
    f->base = base;
    f->size = size;
    f->mapped = base != NULL;
    if (!f->path) {
        if (base) munmap(base, size);
        return v41_err_set(err, V41_ENOMEM, "out of memory");
    }
    *fidx = w->nfiles++;
    return V41_OK;
}

static const uint8_t empty_image[1] = {0};

static int open_one(v41_weights *w, const char *path, v41_err *err)
{
    int f = -1, rc;
    if ((rc = map_file(w, path, &f, err))) return rc;
    const uint8_t *base = w->files[f].base ? (const uint8_t *)w->files[f].base : empty_image;
    return parse_image(w, f, w->files[f].path, base, w->files[f].size, err);
}

static char *read_small(const char *path, size_t max, size_t *len, v41_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) { v41_err_set(err, V41_EIO, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    char *buf = malloc(max + 1);
    if (!buf) { fclose(f); v41_err_set(err, V41_ENOMEM, "out of memory"); return NULL; }
    size_t n = fread(buf, 1, max + 1, f);
    fclose(f);
    if (n > max) { free(buf); v41_err_set(err, V41_EINVAL, "%s: larger than %zu bytes", path, max); return NULL; }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int open_index(v41_weights *w, const char *index_path, v41_err *err)
{
    size_t len;
    char *text = read_small(index_path, 64u << 20, &len, err);
    if (!text) return err ? err->code : V41_EIO;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    int rc = V41_OK;
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return v41_err_set(err, V41_EINVAL, "%s: not a JSON object", index_path);
    }
    int dup;
    const cJSON *wm = v41_json_get_unique(root, "weight_map", &dup);
    if (!wm || !cJSON_IsObject(wm) || dup) {
        cJSON_Delete(root);
        return v41_err_set(err, V41_EINVAL, "%s: key 'weight_map' missing or not an object", index_path);
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", index_path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    /* unique shard names, in order of first appearance */
    const cJSON *it;
    cJSON_ArrayForEach(it, wm) {
        if (!cJSON_IsString(it)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: weight_map entry '%s' is not a file name", index_path, it->string);
            goto out;
        }
        const char *fn = it->valuestring;
        if (!*fn || fn[0] == '/' || strstr(fn, "..") || strlen(fn) > 1000) {
            rc = v41_err_set(err, V41_EINVAL, "%s: weight_map entry '%s': shard name '%.100s' is not a plain file name",
                             index_path, it->string, fn);
            goto out;
        }
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dir, fn);
        bool have = false;
        for (int i = 0; i < w->nfiles; i++)
            if (!strcmp(w->files[i].path, path)) have = true;
        if (!have && (rc = open_one(w, path, err))) goto out;
    }
    if (w->nfiles == 0) {
        rc = v41_err_set(err, V41_EINVAL, "%s: weight_map is empty", index_path);
        goto out;
    }
    if ((rc = v41w_finish(w, err))) goto out;
    /* every mapped tensor must be in the shard the index names */
    cJSON_ArrayForEach(it, wm) {
        char cn[1024], path[8192];
        canon(it->string, cn, sizeof cn);
        snprintf(path, sizeof path, "%s/%s", dir, it->valuestring);
        const v41_tensor *t = find_stored(w, cn);
        if (!t) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s' is mapped to %s, which does not contain it", index_path,
                             it->string, path);
            goto out;
        }
        const went *e = (const went *)t;
        if (strcmp(w->files[e->file].path, path)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: tensor '%s' is mapped to %s but stored in %s", index_path,
                             it->string, path, w->files[e->file].path);
            goto out;
        }
    }
out:
    cJSON_Delete(root);
    return rc;
}

static bool is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

int v41_weights_open(const char *path, v41_weights **out, v41_err *err)
{
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0) return v41_err_set(err, V41_EIO, "%s: %s", path, strerror(errno));
    v41_weights *w = v41w_new_mem();
    if (!w) return v41_err_set(err, V41_ENOMEM, "out of memory");
    int rc;
    size_t pl = strlen(path);
    if (S_ISDIR(st.st_mode)) {
        char p[8192];
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", path);
        if (is_file(p)) rc = open_index(w, p, err);
        else {
            snprintf(p, sizeof p, "%s/model.safetensors", path);
            if (!is_file(p)) {
                v41_weights_close(w);
                return v41_err_set(err, V41_ENOTFOUND,
                                   "%s: no model.safetensors or model.safetensors.index.json in this directory", path);
            }
            rc = open_one(w, p, err);
            if (!rc) rc = v41w_finish(w, err);
        }
    } else if (pl >= 5 && !strcmp(path + pl - 5, ".json")) {
        rc = open_index(w, path, err);
    } else {
        rc = open_one(w, path, err);
        if (!rc) rc = v41w_finish(w, err);
    }
    if (rc) {
        if (err && !strstr(err->msg, path)) v41_err_prefix(err, "%s", path);
        v41_weights_close(w);
        return rc;
    }
    *out = w;
    return V41_OK;
}

int v41w_open_buffer(const void *buf, size_t size, const char *label, v41_weights **out, v41_err *err)
{
    *out = NULL;
    v41_weights *w = v41w_new_mem();
    if (!w) return v41_err_set(err, V41_ENOMEM, "out of memory");
    w->files = calloc(1, sizeof *w->files);
    if (!w->files) { v41_weights_close(w); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    w->files[0].path = strdup(label ? label : "(buffer)");
    w->files[0].base = buf;
    w->files[0].size = size;
    w->files[0].mapped = false;
    w->nfiles = 1;
    int rc = parse_image(w, 0, w->files[0].path, buf ? buf : empty_image, buf ? size : 0, err);
    if (!rc) rc = v41w_finish(w, err);
    if (rc) {
        if (err && !strstr(err->msg, w->files[0].path)) v41_err_prefix(err, "%s", w->files[0].path);
        v41_weights_close(w);
        return rc;
    }
    *out = w;
    return V41_OK;
}

void v41_weights_close(v41_weights *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) {
        free((char *)w->e[i].t.name);
        free(w->e[i].owned);
    }
    free(w->e);
    for (size_t i = 0; i < w->nal; i++) { free(w->al[i].alias); free(w->al[i].target); }
    free(w->al);
    for (size_t i = 0; i < w->nmeta; i++) { free(w->meta[i].key); free(w->meta[i].val); }
    free(w->meta);
    for (int i = 0; i < w->nfiles; i++) {
        if (w->files[i].mapped) munmap((void *)w->files[i].base, w->files[i].size);
        free(w->files[i].path);
    }
    free(w->files);
    free(w);
}

/* ------------------------------------------------------------------ lookup */

const v41_tensor *v41_weights_find(const v41_weights *w, const char *name)
{
    if (!w || !name) return NULL;
    char cn[1024];
    canon(name, cn, sizeof cn);
    const v41_tensor *t = find_stored(w, cn);
    if (t) return t;
    size_t lo = 0, hi = w->nal;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(w->al[mid].alias, cn);
        if (!c) return w->al[mid].t;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static void shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, len - o, "[");
    for (int i = 0; i < ndim && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (o < len) snprintf(buf + o, len - o, "]");
}

int v41_weights_get(const v41_weights *w, const char *name, v41_dtype dt, int ndim, const int64_t *shape,
                    const v41_tensor **out, v41_err *err)
{
    const v41_tensor *t = v41_weights_find(w, name);
    if (out) *out = t;
    if (!t) return v41_err_set(err, V41_ENOTFOUND, "tensor '%s': missing from the checkpoint", name);
    if (dt != V41_DT_INVALID && t->dtype != dt)
        return v41_err_set(err, V41_EINVAL, "tensor '%s': dtype %s, expected %s", name, v41_dtype_name(t->dtype),
                           v41_dtype_name(dt));
    if (shape) {
        bool ok = t->ndim == ndim;
        for (int i = 0; ok && i < ndim; i++)
            if (shape[i] >= 0 && shape[i] != t->shape[i]) ok = false;
        if (!ok) {
            char a[256], b[256];
            shape_str(a, sizeof a, t->ndim, t->shape);
            shape_str(b, sizeof b, ndim, shape);
            return v41_err_set(err, V41_EINVAL, "tensor '%s': shape %s, expected %s", name, a, b);
        }
    }
    return V41_OK;
}

size_t v41_weights_count(const v41_weights *w) { return w ? w->n : 0; }
const v41_tensor *v41_weights_at(const v41_weights *w, size_t i) { return w && i < w->n ? &w->e[i].t : NULL; }

const char *v41_weights_meta(const v41_weights *w, const char *key)
{
    if (!w) return NULL;
    for (size_t i = 0; i < w->nmeta; i++)
        if (!strcmp(w->meta[i].key, key)) return w->meta[i].val;
    return NULL;
}

size_t v41w_alias_count(const v41_weights *w) { return w ? w->nal : 0; }
void v41w_alias_at(const v41_weights *w, size_t i, const char **alias, const char **target)
{
    *alias = w->al[i].alias;
    *target = w->al[i].target;
}
int v41w_nfiles(const v41_weights *w) { return w ? w->nfiles : 0; }

/* ------------------------------------------------------------------ fingerprint */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

void v41_weights_fingerprint(const v41_weights *w, char out[17])
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; w && i < w->n; i++) {
        const v41_tensor *t = &w->e[i].t;
        h = fnv(h, t->name, strlen(t->name) + 1);
        const char *dn = v41_dtype_name(t->dtype);
        h = fnv(h, dn, strlen(dn) + 1);
        uint8_t nd = (uint8_t)t->ndim;
        h = fnv(h, &nd, 1);
        for (int k = 0; k < t->ndim; k++) {
            uint8_t le[8];
            uint64_t v = (uint64_t)t->shape[k];
            for (int j = 0; j < 8; j++) le[j] = (uint8_t)(v >> (8 * j));
            h = fnv(h, le, 8);
        }
        h = fnv(h, t->data, t->nbytes);
    }
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* ------------------------------------------------------------------ writer */

static int elem_bits(v41_dtype dt) { return (int)v41_dtype_nbytes(dt, 8); } /* bytes per 8 elements */

static int cmp_write_order(const void *a, const void *b)
{
    const v41_tensor *x = *(const v41_tensor *const *)a, *y = *(const v41_tensor *const *)b;
    int ex = elem_bits(x->dtype), ey = elem_bits(y->dtype);
    if (ex != ey) return ey - ex; /* widest first: every tensor stays naturally aligned */
    return strcmp(x->name, y->name);
}

int v41w_write_safetensors(const v41_weights *w, const char *path, v41_err *err)
{
    const v41_tensor **ord = malloc((w->n + 1) * sizeof *ord);
    if (!ord) return v41_err_set(err, V41_ENOMEM, "out of memory");
    for (size_t i = 0; i < w->n; i++) ord[i] = &w->e[i].t;
    if (w->n) qsort(ord, w->n, sizeof *ord, cmp_write_order);
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "__metadata__", meta);
    for (size_t i = 0; i < w->nmeta; i++)
        if (strcmp(w->meta[i].key, "aliases")) cJSON_AddStringToObject(meta, w->meta[i].key, w->meta[i].val);
    if (w->nal) {
        cJSON *al = cJSON_CreateObject();
        for (size_t i = 0; i < w->nal; i++) cJSON_AddStringToObject(al, w->al[i].alias, w->al[i].target);
        char *s = cJSON_PrintUnformatted(al);
        cJSON_Delete(al);
        cJSON_AddStringToObject(meta, "aliases", s ? s : "{}");
        free(s);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n; i++) {
        const v41_tensor *t = ord[i];
        cJSON *e = cJSON_CreateObject(), *sh = cJSON_CreateArray(), *of = cJSON_CreateArray();
        cJSON_AddStringToObject(e, "dtype", v41_dtype_name(t->dtype));
        for (int k = 0; k < t->ndim; k++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[k]));
        cJSON_AddItemToObject(e, "shape", sh);
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(off + t->nbytes)));
        cJSON_AddItemToObject(e, "data_offsets", of);
        cJSON_AddItemToObject(root, t->name, e);
        off += t->nbytes;
    }
    char *hdr = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!hdr) { free(ord); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    size_t hl = strlen(hdr), pad = (8 - (hl % 8)) % 8; /* data starts 8-byte aligned */
    char tmp[8300];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    int rc = V41_OK;
    if (!f) {
        rc = v41_err_set(err, V41_EIO, "%s: cannot create: %s", tmp, strerror(errno));
        goto done;
    }
    uint8_t le[8];
    uint64_t n = hl + pad;
    for (int j = 0; j < 8; j++) le[j] = (uint8_t)(n >> (8 * j));
    bool ok = fwrite(le, 1, 8, f) == 8 && fwrite(hdr, 1, hl, f) == hl;
    for (size_t j = 0; ok && j < pad; j++) ok = fputc(' ', f) != EOF;
    for (size_t i = 0; ok && i < w->n; i++)
        ok = ord[i]->nbytes == 0 || fwrite(ord[i]->data, 1, ord[i]->nbytes, f) == ord[i]->nbytes;
    if (fflush(f) != 0) ok = false;
    if (fclose(f) != 0) ok = false;
    if (!ok) {
        unlink(tmp);
        rc = v41_err_set(err, V41_EIO, "%s: write failed: %s", tmp, strerror(errno));
        goto done;
    }
    if (rename(tmp, path) != 0) {
        rc = v41_err_set(err, V41_EIO, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
    }
done:
    free(hdr);
    free(ord);
    return rc;
}

/* ------------------------------------------------------------------ config check (SPEC §9) */

typedef struct {
    const v41_weights *w;
    bool *used;
    size_t n_required;
    v41_err *err;
} chk;

enum { T_BF16 = 1 << V41_DT_BF16, T_F32 = 1 << V41_DT_F32, T_F16 = 1 << V41_DT_F16, T_E4M3 = 1 << V41_DT_F8_E4M3,
       T_E8M0 = 1 << V41_DT_F8_E8M0, T_F4 = 1 << V41_DT_F4 };

static void mask_names(unsigned mask, char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = 0;
    for (int d = 1; d <= V41_DT_F4 && o < len; d++)
        if (mask & (1u << d)) o += (size_t)snprintf(buf + o, len - o, "%s%s", o ? " or " : "", v41_dtype_name((v41_dtype)d));
}

/* Look up name; absent -> NULL without error when optional. */
static const v41_tensor *need(chk *c, const char *name, bool optional)
{
    const v41_tensor *t = v41_weights_find(c->w, name);
    if (!t) {
        if (!optional) v41_err_set(c->err, V41_ENOTFOUND, "tensor '%s': missing (the config requires it)", name);
        return NULL;
    }
    size_t idx = (size_t)((const went *)t - c->w->e);
    if (!c->used[idx]) { c->used[idx] = true; c->n_required++; }
    return t;
}

static int check_t(chk *c, const v41_tensor *t, const char *name, unsigned mask, int64_t n0, int64_t n1)
{
    if (!(mask & (1u << t->dtype))) {
        char m[128];
        mask_names(mask, m, sizeof m);
        return v41_err_set(c->err, V41_EINVAL, "tensor '%s': dtype %s, expected %s", name, v41_dtype_name(t->dtype), m);
    }
    int nd = n1 < 0 ? 1 : 2;
    if (t->ndim != nd || t->shape[0] != n0 || (nd == 2 && t->shape[1] != n1)) {
        char a[256], b[256];
        int64_t s[2] = {n0, n1};
        shape_str(a, sizeof a, t->ndim, t->shape);
        shape_str(b, sizeof b, nd, s);
        return v41_err_set(c->err, V41_EINVAL, "tensor '%s': shape %s, expected %s", name, a, b);
    }
    return V41_OK;
}

/* plain tensor: [n0] (n1 < 0) or [n0, n1] */
static int req(chk *c, const char *name, unsigned mask, int64_t n0, int64_t n1)
{
    const v41_tensor *t = need(c, name, false);
    if (!t) return c->err ? c->err->code : V41_ENOTFOUND;
    return check_t(c, t, name, mask, n0, n1);
}

typedef enum { L_FP8, L_FP4, L_BF16, L_F32 } lkind;

/* A Linear "<p>.weight" [N, K] (+ "<p>.scale" when quantized). Accepted
 * storage per kind: FP8: F8_E4M3 + scale [ceil(N/32), ceil(K/32)] or BF16;
 * FP4: F4 + scale [N, K/32], or the FP8 forms; BF16: BF16/F32, or F8_E4M3 +
 * block scale (wo_a in the released checkpoint); F32: F32 or BF16. */
static int lin(chk *c, const char *p, lkind kind, int64_t N, int64_t K)
{
    char wn[512], sn[512];
    snprintf(wn, sizeof wn, "%s.weight", p);
    snprintf(sn, sizeof sn, "%s.scale", p);
    const v41_tensor *t = need(c, wn, false);
    if (!t) return c->err ? c->err->code : V41_ENOTFOUND;
    unsigned mask;
    switch (kind) {
    case L_FP8: mask = T_E4M3 | T_BF16; break;
    case L_FP4: mask = T_F4 | T_E4M3 | T_BF16; break;
    case L_BF16: mask = T_BF16 | T_F32 | T_E4M3; break;
    default: mask = T_F32 | T_BF16; break;
    }
    int rc = check_t(c, t, wn, mask, N, K);
    if (rc) return rc;
    if (t->dtype == V41_DT_F8_E4M3) return req(c, sn, T_E8M0 | T_F32, (N + 31) / 32, (K + 31) / 32);
    if (t->dtype == V41_DT_F4) {
        if (K % 32) return v41_err_set(c->err, V41_EINVAL, "tensor '%s': K = %lld is not a multiple of 32", wn, (long long)K);
        return req(c, sn, T_E8M0 | T_F32, N, K / 32);
    }
    return V41_OK;
}

#define NORM (T_BF16 | T_F32)
#define FP32 (T_F32 | T_BF16)

static int check_block(chk *c, const v41_config *cfg, int l)
{
    char p[64], n[512];
    int L = cfg->n_layers, rc;
    if (l < L) snprintf(p, sizeof p, "layers.%d", l);
    else snprintf(p, sizeof p, "mtp.%d", l - L);
    const int64_t D = cfg->dim, h = cfg->hc_mult, d = cfg->head_dim, H = cfg->n_heads, G = cfg->o_groups;
    const int64_t mix = (2 + h) * h;
#define Q(fmt, ...) (snprintf(n, sizeof n, "%s." fmt, p, ##__VA_ARGS__), n)
    if ((rc = req(c, Q("attn_norm.weight"), NORM, D, -1))) return rc;
    if ((rc = req(c, Q("ffn_norm.weight"), NORM, D, -1))) return rc;
    static const char *const sub[2] = {"attn", "ffn"};
    for (int s = 0; s < 2; s++) {
        if ((rc = req(c, Q("hc_%s_fn", sub[s]), FP32, mix, h * D))) return rc;
        if ((rc = req(c, Q("hc_%s_base", sub[s]), FP32, mix, -1))) return rc;
        if ((rc = req(c, Q("hc_%s_scale", sub[s]), FP32, 3, -1))) return rc;
    }
    /* attention */
    if ((rc = lin(c, Q("attn.wq_a"), L_FP8, cfg->q_lora_rank, D))) return rc;
    if ((rc = req(c, Q("attn.q_norm.weight"), NORM, cfg->q_lora_rank, -1))) return rc;
    if ((rc = lin(c, Q("attn.wq_b"), L_FP8, H * d, cfg->q_lora_rank))) return rc;
    if ((rc = lin(c, Q("attn.wkv"), L_FP8, d, D))) return rc;
    if ((rc = req(c, Q("attn.kv_norm.weight"), NORM, d, -1))) return rc;
    if ((rc = lin(c, Q("attn.wo_a"), L_BF16, G * cfg->o_lora_rank, H * d / G))) return rc;
    if ((rc = lin(c, Q("attn.wo_b"), L_FP8, D, G * cfg->o_lora_rank))) return rc;
    if ((rc = req(c, Q("attn.attn_sink"), FP32, H, -1))) return rc;
    int m = cfg->compress_ratios[l];
    if (l < L && v41_is_kv_source(cfg, l)) {
        if (m > 1) {
            if ((rc = lin(c, Q("attn.compressor.wkv"), L_F32, d, D))) return rc;
            if ((rc = lin(c, Q("attn.compressor.wgate"), L_F32, d, D))) return rc;
        } else {
            if ((rc = lin(c, Q("attn.compressor.wkv"), L_BF16, d, D))) return rc;
        }
        if ((rc = req(c, Q("attn.compressor.norm.weight"), NORM, d, -1))) return rc;
        if ((rc = lin(c, Q("attn.indexer.wk"), L_BF16, cfg->index_head_dim, d))) return rc;
        if ((rc = req(c, Q("attn.indexer.k_norm.weight"), NORM, cfg->index_head_dim, -1))) return rc;
    }
    if (l < L && v41_is_index_source(cfg, l)) {
        if ((rc = lin(c, Q("attn.indexer.wq_b"), L_FP8, (int64_t)cfg->index_n_heads * cfg->index_head_dim,
                      cfg->q_lora_rank)))
            return rc;
        if ((rc = lin(c, Q("attn.indexer.weights_proj"), L_BF16, cfg->index_n_heads, D))) return rc;
    }
    /* MoE */
    int64_t E = v41_layer_n_experts(cfg, l), I = cfg->moe_inter_dim;
    if ((rc = req(c, Q("ffn.gate.weight"), FP32, E, D))) return rc;
    if ((rc = req(c, Q("ffn.gate.bias"), FP32, E, -1))) return rc;
    for (int64_t e = 0; e < E; e++) {
        if ((rc = lin(c, Q("ffn.experts.%lld.w1", (long long)e), L_FP4, I, D))) return rc;
        if ((rc = lin(c, Q("ffn.experts.%lld.w2", (long long)e), L_FP4, D, I))) return rc;
        if ((rc = lin(c, Q("ffn.experts.%lld.w3", (long long)e), L_FP4, I, D))) return rc;
    }
    if (cfg->n_shared_experts > 0) {
        int64_t S = (int64_t)cfg->n_shared_experts * I;
        if ((rc = lin(c, Q("ffn.shared_experts.w1"), L_FP8, S, D))) return rc;
        if ((rc = lin(c, Q("ffn.shared_experts.w2"), L_FP8, D, S))) return rc;
        if ((rc = lin(c, Q("ffn.shared_experts.w3"), L_FP8, S, D))) return rc;
    }
    /* Engram */
    int ei = l < L ? v41_engram_index(cfg, l) : -1;
    if (ei >= 0) {
        int64_t rows = cfg->engram_num_embeddings[ei], hd = cfg->engram_head_dim;
        if ((rc = req(c, Q("engram.embed.weight"), T_E4M3, rows, hd))) return rc;
        if ((rc = req(c, Q("engram.embed.scale"), T_E8M0 | T_F32, rows, (hd + 31) / 32))) return rc;
        if ((rc = req(c, Q("engram.q_weight"), FP32, h, D))) return rc;
        if ((rc = req(c, Q("engram.k_weight"), FP32, h, D))) return rc;
        if ((rc = lin(c, Q("engram.wkv"), L_FP8, (h + 1) * D,
                      (int64_t)(cfg->engram_max_ngram_size - 1) * cfg->engram_n_heads * hd)))
            return rc;
    }
    /* DSpark stage extras */
    if (l == L) {
        if ((rc = lin(c, Q("main_proj"), L_FP8, D, (int64_t)cfg->n_dspark_targets * D))) return rc;
        if ((rc = req(c, Q("main_norm.weight"), NORM, D, -1))) return rc;
    }
    if (l >= L && l == L + cfg->n_mtp_layers - 1) {
        int64_t V = cfg->vocab_size, R = cfg->dspark_markov_rank;
        if ((rc = req(c, Q("norm.weight"), NORM, D, -1))) return rc;
        if ((rc = req(c, Q("markov_head.embed.weight"), NORM, V, R))) return rc;
        if ((rc = lin(c, Q("markov_head.head"), L_F32, V, R))) return rc;
        if ((rc = lin(c, Q("confidence_head.proj"), L_F32, 1, D + R))) return rc;
    }
#undef Q
    return V41_OK;
}

int v41w_check_config_ex(const v41_weights *w, const v41_config *cfg, size_t *n_required, size_t *n_unused,
                         char *first_unused, size_t first_unused_len, v41_err *err)
{
    chk c = {w, calloc(w->n + 1, sizeof(bool)), 0, err};
    if (!c.used) return v41_err_set(err, V41_ENOMEM, "out of memory");
    int rc;
    const int64_t V = cfg->vocab_size, D = cfg->dim;
    if ((rc = req(&c, "embed.weight", T_BF16 | T_F32, V, D))) goto out;
    if ((rc = req(&c, "norm.weight", NORM, D, -1))) goto out;
    if ((rc = lin(&c, "head", L_F32, V, D))) goto out;
    for (int l = 0; l < cfg->n_layers + cfg->n_mtp_layers; l++)
        if ((rc = check_block(&c, cfg, l))) goto out;
    if (n_required) *n_required = c.n_required;
    size_t nu = 0;
    for (size_t i = 0; i < w->n; i++)
        if (!c.used[i]) {
            if (!nu && first_unused) snprintf(first_unused, first_unused_len, "%s", w->e[i].t.name);
            nu++;
        }
    if (n_unused) *n_unused = nu;
    if (!nu && first_unused && first_unused_len) first_unused[0] = 0;
out:
    free(c.used);
    return rc;
}

int v41_weights_check_config(const v41_weights *w, const v41_config *cfg, v41_err *err)
{
    return v41w_check_config_ex(w, cfg, NULL, NULL, NULL, 0, err);
}
