/* dump.c: HDF5 dump writer (a tap sink, streaming) and reader, schema
 * "v41-dump" version 1 (README.md, section 'Harness').
 *
 * Memory: the writer hands each tap's buffer straight to H5Dwrite and closes
 * the dataset (HDF5 writes chunk by chunk through a small chunk cache); the
 * reader serves flat element ranges through hyperslab unions, so neither
 * side ever holds a whole dump. */
#include "config.h"
#include "v41_dump.h"
#include "v41_h5_internal.h"
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* small helpers                                                       */

bool v41_dump_match(const char *pattern, const char *name)
{
    if (!pattern || !*pattern) return true;
    const char *p = pattern;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        /* iterative glob over p[0..len) with backtracking on the last '*' */
        const char *s = name, *star = NULL, *ss = NULL;
        size_t i = 0, star_i = 0;
        bool ok = true;
        while (*s) {
            if (i < len && (p[i] == '?' || p[i] == *s)) { i++; s++; }
            else if (i < len && p[i] == '*') { star = p; star_i = ++i; ss = s; }
            else if (star) { i = star_i; s = ++ss; }
            else { ok = false; break; }
        }
        if (ok) {
            while (i < len && p[i] == '*') i++;
            if (i == len) return true;
        }
        if (!end) break;
        p = end + 1;
    }
    return false;
}

static const char *kind_names[] = {"f32", "bf16", "i32", "u8"};

const char *v41_dump_kind_name(v41_tap_kind k)
{
    return (unsigned)k < 4 ? kind_names[k] : "?";
}

int v41_dump_kind_parse(const char *s, v41_tap_kind *k)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, kind_names[i])) { *k = (v41_tap_kind)i; return 0; }
    return -1;
}

static hid_t kind_mem_type(v41_tap_kind k)
{
    switch (k) {
    case V41_TAP_I32: return H5T_NATIVE_INT32;
    case V41_TAP_U8: return H5T_NATIVE_UINT8;
    default: return H5T_NATIVE_FLOAT;
    }
}


static int attr_str(hid_t obj, const char *key, const char *val)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, key, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    const char *v = val ? val : "";
    herr_t rc = a < 0 ? -1 : H5Awrite(a, t, &v);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    H5Tclose(t);
    return rc < 0 ? -1 : 0;
}

static int attr_num(hid_t obj, const char *key, hid_t type, const void *val)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, key, type, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t rc = a < 0 ? -1 : H5Awrite(a, type, val);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    return rc < 0 ? -1 : 0;
}

static int attr_int(hid_t obj, const char *key, int v)
{
    int32_t x = v;
    return attr_num(obj, key, H5T_NATIVE_INT32, &x);
}

static int attr_dbl(hid_t obj, const char *key, double v)
{
    return attr_num(obj, key, H5T_NATIVE_DOUBLE, &v);
}

/* Open attribute key of obj when it holds exactly one value (a scalar or a 1-element array); -1
 * otherwise. Every reader below reads one value into one variable, so an array attribute in a
 * hostile file would overrun it. */
static hid_t open_attr1(hid_t obj, const char *key)
{
    if (H5Aexists(obj, key) <= 0) return -1;
    hid_t a = H5Aopen(obj, key, H5P_DEFAULT);
    if (a < 0) return -1;
    hid_t sp = H5Aget_space(a);
    hssize_t n = sp >= 0 ? H5Sget_simple_extent_npoints(sp) : -1;
    if (sp >= 0) H5Sclose(sp);
    if (n != 1) {
        H5Aclose(a);
        return -1;
    }
    return a;
}

/* (v41_h5_internal.h) */
int v41_h5_attr_str(hid_t obj, const char *key, char *buf, size_t cap)
{
    buf[0] = 0;
    hid_t a = open_attr1(obj, key);
    if (a < 0) return -1;
    hid_t ft = H5Aget_type(a);
    int rc = -1;
    if (H5Tget_class(ft) == H5T_STRING) {
        if (H5Tis_variable_str(ft) > 0) {
            hid_t mt = H5Tcopy(H5T_C_S1);
            H5Tset_size(mt, H5T_VARIABLE);
            H5Tset_cset(mt, H5Tget_cset(ft));
            char *v = NULL;
            if (H5Aread(a, mt, &v) >= 0) {
                snprintf(buf, cap, "%s", v ? v : "");
                rc = 0;
                if (v) {
                    hid_t sp = H5Screate(H5S_SCALAR);
                    H5Dvlen_reclaim(mt, sp, H5P_DEFAULT, &v);
                    H5Sclose(sp);
                }
            }
            H5Tclose(mt);
        } else {
            size_t sz = H5Tget_size(ft);
            char *tmp = calloc(1, sz + 1);
            hid_t mt = H5Tcopy(H5T_C_S1);
            H5Tset_size(mt, sz + 1);
            if (tmp && H5Aread(a, mt, tmp) >= 0) { snprintf(buf, cap, "%s", tmp); rc = 0; }
            H5Tclose(mt);
            free(tmp);
        }
    } else if (H5Tget_class(ft) == H5T_INTEGER) {
        long long v = 0;
        if (H5Aread(a, H5T_NATIVE_LLONG, &v) >= 0) { snprintf(buf, cap, "%lld", v); rc = 0; }
    } else if (H5Tget_class(ft) == H5T_FLOAT) {
        double v = 0;
        if (H5Aread(a, H5T_NATIVE_DOUBLE, &v) >= 0) { snprintf(buf, cap, "%.17g", v); rc = 0; }
    }
    H5Tclose(ft);
    H5Aclose(a);
    return rc;
}

static int read_attr_long(hid_t obj, const char *key, long long *v)
{
    hid_t a = open_attr1(obj, key);
    if (a < 0) return -1;
    hid_t ft = H5Aget_type(a);
    int rc = -1;
    H5T_class_t c = H5Tget_class(ft);
    if (c == H5T_INTEGER) rc = H5Aread(a, H5T_NATIVE_LLONG, v) < 0 ? -1 : 0;
    else if (c == H5T_FLOAT) {
        double d;
        /* a whole number in range of long long (NaN fails): the conversion is undefined outside
         * it, and 1.5 is no integer */
        if (H5Aread(a, H5T_NATIVE_DOUBLE, &d) >= 0 && d > -0x1p63 && d < 0x1p63 && d == (double)(long long)d) {
            *v = (long long)d;
            rc = 0;
        }
    }
    H5Tclose(ft);
    H5Aclose(a);
    return rc;
}

static int read_attr_dbl(hid_t obj, const char *key, double *v)
{
    hid_t a = open_attr1(obj, key);
    if (a < 0) return -1;
    int rc = H5Aread(a, H5T_NATIVE_DOUBLE, v) < 0 ? -1 : 0;
    H5Aclose(a);
    return rc;
}

static bool silence_done;
static void hdf5_silence(void)
{
    /* HDF5 prints error stacks to stderr by default; we report our own
     * messages. Process-wide, idempotent. */
    if (!silence_done) { H5Eset_auto2(H5E_DEFAULT, NULL, NULL); silence_done = true; }
}

/* ------------------------------------------------------------------ */
/* writer                                                              */

struct v41_dump {
    hid_t file;
    char path[4096], tmp[4200];
    int cur_step;              /* step of the open group, -1 none */
    hid_t step_grp;
    int deflate;
    long n_taps;
    const char *(*dims_of)(const char *name);
    v41_err err;               /* first error (sink path) */
    char pattern[1024];
    bool has_pattern;
};

static int open_step(v41_dump *d, int step, v41_err *err)
{
    if (d->cur_step == step && d->step_grp >= 0) return 0;
    if (d->step_grp >= 0) { H5Gclose(d->step_grp); d->step_grp = -1; }
    char g[32];
    snprintf(g, sizeof g, "/step%04d", step);
    htri_t ex = H5Lexists(d->file, g, H5P_DEFAULT);
    if (ex > 0) d->step_grp = H5Gopen2(d->file, g, H5P_DEFAULT);
    else {
        d->step_grp = H5Gcreate2(d->file, g, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (d->step_grp >= 0) attr_int(d->step_grp, "step", step);
    }
    if (d->step_grp < 0) return v41_err_set(err, V41_EIO, "%s: cannot create group %s", d->tmp, g);
    d->cur_step = step;
    return 0;
}

int v41_dump_create(const char *path, const v41_dump_meta *m, v41_dump **out, v41_err *err)
{
    hdf5_silence();
    *out = NULL;
    v41_dump *d = calloc(1, sizeof *d);
    if (!d) return v41_err_set(err, V41_ENOMEM, "dump: out of memory");
    snprintf(d->path, sizeof d->path, "%s", path);
    snprintf(d->tmp, sizeof d->tmp, "%s.tmp", path);
    d->cur_step = -1;
    d->step_grp = -1;
    d->deflate = 1;
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    /* 1.8+ format: dense link storage for steps with thousands of taps. */
    H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_LATEST);
    d->file = H5Fcreate(d->tmp, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    H5Pclose(fapl);
    if (d->file < 0) {
        free(d);
        return v41_err_set(err, V41_EIO, "%s: cannot create file", path);
    }
    v41_dump_meta z = {0};
    if (!m) m = &z;
    char tbuf[64];
    time_t now = time(NULL);
    struct tm tmv;
    gmtime_r(&now, &tmv);
    strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%SZ", &tmv);
    int rc = 0;
    rc |= attr_str(d->file, "schema", V41_DUMP_SCHEMA);
    rc |= attr_int(d->file, "version", V41_DUMP_VERSION);
    rc |= attr_str(d->file, "engine", m->engine);
    rc |= attr_str(d->file, "precision", m->precision);
    rc |= attr_str(d->file, "compat", m->compat);
    rc |= attr_str(d->file, "config_json", m->config_json);
    rc |= attr_str(d->file, "weights_fingerprint", m->weights_fingerprint);
    rc |= attr_str(d->file, "replay", m->replay);
    rc |= attr_int(d->file, "threads", m->threads);
    rc |= attr_str(d->file, "blas", m->blas);
    rc |= attr_str(d->file, "gpu", m->gpu);
    rc |= attr_str(d->file, "inject", m->inject);
    rc |= attr_str(d->file, "command", m->command);
    rc |= attr_str(d->file, "model", m->model);
    rc |= attr_str(d->file, "tool_version", "v41 " PACKAGE_VERSION);
    rc |= attr_str(d->file, "created", tbuf);
    if (rc) {
        H5Fclose(d->file);
        unlink(d->tmp);
        free(d);
        return v41_err_set(err, V41_EIO, "%s: cannot write root attributes", path);
    }
    *out = d;
    return 0;
}

void v41_dump_set_dims_fn(v41_dump *d, const char *(*fn)(const char *)) { d->dims_of = fn; }
void v41_dump_set_deflate(v41_dump *d, int level) { d->deflate = level < 0 ? 0 : level > 9 ? 9 : level; }
long v41_dump_n_taps(const v41_dump *d) { return d->n_taps; }
const v41_err *v41_dump_error(const v41_dump *d) { return &d->err; }

static int write_i32_1d(hid_t loc, const char *name, int n, const int32_t *v)
{
    hsize_t dim = (hsize_t)n;
    hid_t sp = H5Screate_simple(1, &dim, NULL);
    hid_t ds = H5Dcreate2(loc, name, H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    herr_t rc = -1;
    if (ds >= 0) {
        int32_t *z = NULL;
        if (!v) { z = calloc((size_t)n + 1, sizeof *z); v = z; }
        rc = v ? H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) : -1;
        free(z);
        H5Dclose(ds);
    }
    H5Sclose(sp);
    return rc < 0 ? -1 : 0;
}

int v41_dump_set_requests(v41_dump *d, int n, const int32_t *id, const int32_t *plen,
                          const int32_t *hit, v41_err *err)
{
    if (H5Lexists(d->file, "/requests", H5P_DEFAULT) > 0)
        H5Ldelete(d->file, "/requests", H5P_DEFAULT);
    hid_t g = H5Gcreate2(d->file, "/requests", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (g < 0) return v41_err_set(err, V41_EIO, "%s: cannot create /requests", d->tmp);
    int rc = write_i32_1d(g, "id", n, id) | write_i32_1d(g, "prompt_len", n, plen) |
             write_i32_1d(g, "prefix_hit", n, hit);
    H5Gclose(g);
    return rc ? v41_err_set(err, V41_EIO, "%s: cannot write /requests", d->tmp) : 0;
}

int v41_dump_set_rows(v41_dump *d, int step, int n, const int32_t *req, const int32_t *pos,
                      v41_err *err)
{
    if (open_step(d, step, err)) return err ? err->code : V41_EIO;
    if (H5Lexists(d->step_grp, "rows", H5P_DEFAULT) > 0) H5Ldelete(d->step_grp, "rows", H5P_DEFAULT);
    hsize_t dims[2] = {(hsize_t)n, 2};
    int32_t *buf = malloc(sizeof(int32_t) * 2 * (size_t)(n > 0 ? n : 1));
    if (!buf) return v41_err_set(err, V41_ENOMEM, "dump: out of memory");
    for (int i = 0; i < n; i++) { buf[2 * i] = req ? req[i] : 0; buf[2 * i + 1] = pos ? pos[i] : i; }
    hid_t sp = H5Screate_simple(2, dims, NULL);
    hid_t ds = H5Dcreate2(d->step_grp, "rows", H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    herr_t rc = ds < 0 ? -1 : H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
    if (ds >= 0) {
        attr_str(ds, "columns", "request_id,position");
        H5Dclose(ds);
    }
    H5Sclose(sp);
    free(buf);
    attr_int(d->step_grp, "n_rows", n);
    return rc < 0 ? v41_err_set(err, V41_EIO, "%s: cannot write step%04d/rows", d->tmp, step) : 0;
}

/* Chunk shape: the full shape with leading dims halved until a chunk holds
 * at most 2^18 elements (1 MiB of fp32): large enough for deflate, small
 * enough that the chunk cache and the reader's slabs stay bounded. */
static void chunk_dims(int ndim, const hsize_t *dims, hsize_t *ch)
{
    const hsize_t cap = (hsize_t)1 << 18;
    for (int i = 0; i < ndim; i++) ch[i] = dims[i] ? dims[i] : 1;
    for (int i = 0; i < ndim; i++) {
        hsize_t tot = 1;
        for (int j = 0; j < ndim; j++) tot *= ch[j];
        if (tot <= cap) break;
        hsize_t rest = tot / ch[i];
        if (rest >= cap) { ch[i] = 1; continue; }
        ch[i] = cap / rest;
        if (ch[i] < 1) ch[i] = 1;
        break;
    }
}

static void float_stats(const float *x, int64_t n, double *rms, double *absmax, int64_t *nan, int64_t *inf)
{
    double ss = 0, mx = 0;
    int64_t nn = 0, ni = 0, nf = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (isnan(v)) { nn++; continue; }
        if (isinf(v)) { ni++; continue; }
        double a = fabs((double)v);
        ss += a * a;
        if (a > mx) mx = a;
        nf++;
    }
    *rms = nf ? sqrt(ss / (double)nf) : 0;
    *absmax = mx;
    *nan = nn;
    *inf = ni;
}

static int append_tap(v41_dump *d, hid_t ds, const v41_tap *t, v41_err *err)
{
    hid_t sp = H5Dget_space(ds);
    int nd = H5Sget_simple_extent_ndims(sp);
    hsize_t cur[V41_DUMP_MAX_DIMS], mx[V41_DUMP_MAX_DIMS];
    H5Sget_simple_extent_dims(sp, cur, mx);
    H5Sclose(sp);
    bool ok = nd == t->ndim && nd >= 1 && mx[0] == H5S_UNLIMITED;
    for (int i = 1; ok && i < nd; i++) ok = cur[i] == (hsize_t)t->shape[i];
    if (!ok)
        return v41_err_set(err, V41_EINVAL, "dump: tap %s emitted twice in step %d with different trailing dims",
                           t->name, t->step);
    hsize_t start[V41_DUMP_MAX_DIMS] = {0}, cnt[V41_DUMP_MAX_DIMS];
    start[0] = cur[0];
    for (int i = 0; i < nd; i++) cnt[i] = (hsize_t)t->shape[i];
    cur[0] += (hsize_t)t->shape[0];
    if (H5Dset_extent(ds, cur) < 0) return v41_err_set(err, V41_EIO, "%s: cannot extend %s", d->tmp, t->name);
    hid_t fs = H5Dget_space(ds);
    H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, cnt, NULL);
    hid_t ms = H5Screate_simple(nd, cnt, NULL);
    herr_t rc = cnt[0] ? H5Dwrite(ds, kind_mem_type(t->kind), ms, fs, H5P_DEFAULT, t->data) : 0;
    H5Sclose(ms);
    H5Sclose(fs);
    if (rc < 0) return v41_err_set(err, V41_EIO, "%s: cannot append to %s", d->tmp, t->name);
    /* stats of the appended tensor are no longer those of the whole: drop them */
    if (H5Aexists(ds, "rms") > 0) H5Adelete(ds, "rms");
    if (H5Aexists(ds, "absmax") > 0) H5Adelete(ds, "absmax");
    return 0;
}

int v41_dump_write_tap(v41_dump *d, const v41_tap *t, v41_err *err)
{
    if (!t || !t->name || !*t->name || strchr(t->name, '/') || strlen(t->name) >= V41_DUMP_NAME_MAX)
        return v41_err_set(err, V41_EINVAL, "dump: invalid tap name '%s'", t && t->name ? t->name : "(null)");
    if (!strcmp(t->name, "rows"))
        return v41_err_set(err, V41_EINVAL, "dump: tap name 'rows' is reserved");
    if (t->ndim < 0 || t->ndim > V41_DUMP_MAX_DIMS || (unsigned)t->kind > V41_TAP_U8)
        return v41_err_set(err, V41_EINVAL, "dump: tap %s: bad ndim %d or kind %d", t->name, t->ndim, (int)t->kind);
    if (t->step < 0) return v41_err_set(err, V41_EINVAL, "dump: tap %s: negative step", t->name);
    int64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) return v41_err_set(err, V41_EINVAL, "dump: tap %s: negative dim", t->name);
        numel *= t->shape[i];
    }
    if (numel > 0 && !t->data) return v41_err_set(err, V41_EINVAL, "dump: tap %s: NULL data", t->name);
    if (open_step(d, t->step, err)) return err ? err->code : V41_EIO;

    if (H5Lexists(d->step_grp, t->name, H5P_DEFAULT) > 0) {
        hid_t ds = H5Dopen2(d->step_grp, t->name, H5P_DEFAULT);
        if (ds < 0) return v41_err_set(err, V41_EIO, "%s: cannot reopen %s", d->tmp, t->name);
        int rc = append_tap(d, ds, t, err);
        H5Dclose(ds);
        return rc;
    }

    hid_t ftype = t->kind == V41_TAP_I32 ? H5T_STD_I32LE : t->kind == V41_TAP_U8 ? H5T_STD_U8LE
                                                                                  : H5T_IEEE_F32LE;
    hid_t sp, dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (t->ndim == 0) {
        sp = H5Screate(H5S_SCALAR);
    } else {
        hsize_t dims[V41_DUMP_MAX_DIMS], mx[V41_DUMP_MAX_DIMS], ch[V41_DUMP_MAX_DIMS];
        for (int i = 0; i < t->ndim; i++) { dims[i] = (hsize_t)t->shape[i]; mx[i] = dims[i]; }
        mx[0] = H5S_UNLIMITED;     /* extendable along the row dim (appends) */
        sp = H5Screate_simple(t->ndim, dims, mx);
        chunk_dims(t->ndim, dims, ch);
        H5Pset_chunk(dcpl, t->ndim, ch);
        if (d->deflate > 0) {
            H5Pset_shuffle(dcpl);
            H5Pset_deflate(dcpl, (unsigned)d->deflate);
        }
    }
    hid_t ds = H5Dcreate2(d->step_grp, t->name, ftype, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    H5Pclose(dcpl);
    H5Sclose(sp);
    if (ds < 0) return v41_err_set(err, V41_EIO, "%s: cannot create dataset step%04d/%s", d->tmp, t->step, t->name);
    herr_t wr = numel > 0 ? H5Dwrite(ds, kind_mem_type(t->kind), H5S_ALL, H5S_ALL, H5P_DEFAULT, t->data) : 0;
    int rc = wr < 0 ? -1 : 0;
    rc |= attr_int(ds, "order", t->order);
    rc |= attr_str(ds, "kind", v41_dump_kind_name(t->kind));
    rc |= attr_int(ds, "layer", t->layer);
    rc |= attr_int(ds, "discrete", t->kind == V41_TAP_I32 || t->kind == V41_TAP_U8);
    if (d->dims_of) {
        const char *dm = d->dims_of(t->name);
        if (dm) rc |= attr_str(ds, "dims", dm);
    }
    if (t->kind == V41_TAP_F32 || t->kind == V41_TAP_BF16) {
        double rms, amax;
        int64_t nn, ni;
        float_stats(t->data, numel, &rms, &amax, &nn, &ni);
        rc |= attr_dbl(ds, "rms", rms);
        rc |= attr_dbl(ds, "absmax", amax);
        long long nnl = nn, nil = ni;
        rc |= attr_num(ds, "n_nan", H5T_NATIVE_LLONG, &nnl);
        rc |= attr_num(ds, "n_inf", H5T_NATIVE_LLONG, &nil);
    }
    H5Dclose(ds);
    if (rc) return v41_err_set(err, V41_EIO, "%s: cannot write step%04d/%s", d->tmp, t->step, t->name);
    d->n_taps++;
    return 0;
}

static int dump_emit(void *ctx, const v41_tap *t)
{
    v41_dump *d = ctx;
    if (d->err.code) return d->err.code;
    if (d->has_pattern && !v41_dump_match(d->pattern, t->name)) return 0;
    return v41_dump_write_tap(d, t, &d->err);
}

void v41_dump_sink(v41_dump *d, v41_tap_sink *s, const char *pattern)
{
    d->has_pattern = pattern && *pattern;
    snprintf(d->pattern, sizeof d->pattern, "%s", pattern ? pattern : "");
    s->emit = dump_emit;
    s->ctx = d;
    s->pattern = d->has_pattern ? d->pattern : NULL;
}

static void dump_free(v41_dump *d, bool remove_tmp)
{
    if (d->step_grp >= 0) H5Gclose(d->step_grp);
    if (d->file >= 0) H5Fclose(d->file);
    if (remove_tmp) unlink(d->tmp);
    free(d);
}

int v41_dump_close(v41_dump *d, v41_err *err)
{
    if (!d) return 0;
    if (d->err.code) {
        if (err) *err = d->err;
        dump_free(d, true);
        return err ? err->code : V41_EIO;
    }
    long long nt = d->n_taps;
    int rc = attr_num(d->file, "n_taps", H5T_NATIVE_LLONG, &nt);
    if (d->step_grp >= 0) { H5Gclose(d->step_grp); d->step_grp = -1; }
    herr_t fc = H5Fclose(d->file);
    d->file = -1;
    if (rc || fc < 0) {
        v41_err_set(err, V41_EIO, "%s: cannot finish the file", d->tmp);
        dump_free(d, true);
        return V41_EIO;
    }
    if (rename(d->tmp, d->path) != 0) {
        v41_err_set(err, V41_EIO, "%s: cannot rename to %s", d->tmp, d->path);
        dump_free(d, true);
        return V41_EIO;
    }
    dump_free(d, false);
    return 0;
}

void v41_dump_abort(v41_dump *d)
{
    if (d) dump_free(d, true);
}

/* ------------------------------------------------------------------ */
/* reader                                                              */

typedef struct { char key[64]; char *val; } kv_attr;

struct v41_dump_reader {
    hid_t file;
    char path[4096];
    v41_dump_entry *e;
    size_t n, cap;
    int *steps;
    int n_steps;
    kv_attr *attrs;
    size_t n_attrs;
    /* cache of the last opened dataset */
    hid_t ds;
    const v41_dump_entry *ds_entry;
};

static int cmp_entry(const void *a, const void *b)
{
    const v41_dump_entry *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    if (x->order != y->order) return x->order < y->order ? -1 : 1;
    return strcmp(x->name, y->name);
}

typedef struct { v41_dump_reader *r; int step; hid_t grp; int err; char msg[400]; } iter_ctx;

/* The most elements one tap may hold (2^36: 256 GiB as fp32, far above any activation of a
 * forward); a larger dataset (possible in a hostile file: chunked storage need not exist) is an
 * error, not hours of reading fill values. */
#define V41_DUMP_MAX_NUMEL ((int64_t)1 << 36)

static herr_t visit_tap(hid_t g, const char *name, const H5L_info_t *info, void *vctx)
{
    iter_ctx *c = vctx;
    (void)info;
    if (!strcmp(name, "rows")) return 0;
    H5O_info_t oi;
    if (H5Oget_info_by_name(g, name, &oi, H5P_DEFAULT) < 0 || oi.type != H5O_TYPE_DATASET) return 0;
    if (strlen(name) >= V41_DUMP_NAME_MAX) return 0;
    hid_t ds = H5Dopen2(g, name, H5P_DEFAULT);
    if (ds < 0) { c->err = 1; return -1; }
    v41_dump_reader *r = c->r;
    if (r->n == r->cap) {
        size_t nc = r->cap ? r->cap * 2 : 256;
        v41_dump_entry *ne = realloc(r->e, nc * sizeof *ne);
        if (!ne) { H5Dclose(ds); c->err = 2; return -1; }
        r->e = ne;
        r->cap = nc;
    }
    v41_dump_entry *e = &r->e[r->n];
    memset(e, 0, sizeof *e);
    e->step = c->step;
    snprintf(e->name, sizeof e->name, "%s", name);
    /* the attributes that decide what diff and bisect report (op order, layer, kind, exact or
     * toleranced comparison): absent is allowed (a dump written by another tool), present but
     * not one value in range is an error naming it, never a silent fallback that would reorder
     * the taps or change how they compare */
    long long v;
    const char *bad = NULL;
    char kb[32];
    hid_t ft = H5Dget_type(ds);
    H5T_class_t cls = H5Tget_class(ft);
    size_t tsz = H5Tget_size(ft);
    H5Tclose(ft);
    e->order = 1 << 30;
    e->layer = -1;
    if (cls == H5T_FLOAT) e->kind = V41_TAP_F32;
    else if (cls == H5T_INTEGER && tsz == 1) e->kind = V41_TAP_U8;
    else e->kind = V41_TAP_I32;
    if (H5Aexists(ds, "order") > 0) {
        if (read_attr_long(ds, "order", &v) == 0 && v >= 0 && v < (1 << 30)) e->order = (int)v;
        else bad = "order (one integer in [0, 2^30))";
    }
    if (!bad && H5Aexists(ds, "layer") > 0) {
        if (read_attr_long(ds, "layer", &v) == 0 && v >= -1 && v < (1 << 30)) e->layer = (int)v;
        else bad = "layer (one integer in [-1, 2^30))";
    }
    if (!bad && H5Aexists(ds, "kind") > 0 &&
        (v41_h5_attr_str(ds, "kind", kb, sizeof kb) != 0 || v41_dump_kind_parse(kb, &e->kind) != 0))
        bad = "kind (one of f32, bf16, i32, u8)";
    e->discrete = e->kind == V41_TAP_I32 || e->kind == V41_TAP_U8;
    if (!bad && H5Aexists(ds, "discrete") > 0) {
        if (read_attr_long(ds, "discrete", &v) == 0 && (v == 0 || v == 1)) e->discrete = v != 0;
        else bad = "discrete (one integer, 0 or 1)";
    }
    if (bad) {
        snprintf(c->msg, sizeof c->msg, "step%04d/%s: attribute %s is malformed", c->step, name, bad);
        H5Dclose(ds);
        c->err = 3;
        return -1;
    }
    hid_t sp = H5Dget_space(ds);
    int nd = H5Sget_simple_extent_ndims(sp);
    hsize_t dims[32];
    if (nd < 0 || nd > V41_DUMP_MAX_DIMS) { H5Sclose(sp); H5Dclose(ds); return 0; }
    H5Sget_simple_extent_dims(sp, dims, NULL);
    H5Sclose(sp);
    e->ndim = nd;
    e->numel = 1;
    for (int i = 0; i < nd; i++) {
        /* dims[i] <= 2^36 and the running product <= 2^36 before each step: no overflow */
        if (dims[i] > (hsize_t)V41_DUMP_MAX_NUMEL || (e->numel *= (int64_t)dims[i]) > V41_DUMP_MAX_NUMEL) {
            snprintf(c->msg, sizeof c->msg, "step%04d/%s has more than 2^36 elements", c->step, name);
            H5Dclose(ds);
            c->err = 3;
            return -1;
        }
        e->shape[i] = (int64_t)dims[i];
    }
    e->has_stats = read_attr_dbl(ds, "rms", &e->rms) == 0 && read_attr_dbl(ds, "absmax", &e->absmax) == 0;
    v41_h5_attr_str(ds, "dims", e->dims, sizeof e->dims);
    H5Dclose(ds);
    r->n++;
    return 0;
}

static herr_t visit_root(hid_t root, const char *name, const H5L_info_t *info, void *vctx)
{
    iter_ctx *c = vctx;
    (void)info;
    if (strncmp(name, "step", 4) != 0) return 0;
    char *end;
    long s = strtol(name + 4, &end, 10);
    if (*end || end == name + 4 || s < 0 || s > (1L << 30)) return 0;
    H5O_info_t oi;
    if (H5Oget_info_by_name(root, name, &oi, H5P_DEFAULT) < 0 || oi.type != H5O_TYPE_GROUP) return 0;
    hid_t g = H5Gopen2(root, name, H5P_DEFAULT);
    if (g < 0) { c->err = 1; return -1; }
    v41_dump_reader *r = c->r;
    int *ns = realloc(r->steps, sizeof(int) * (size_t)(r->n_steps + 1));
    if (!ns) { H5Gclose(g); c->err = 2; return -1; }
    r->steps = ns;
    r->steps[r->n_steps++] = (int)s;
    iter_ctx sub = {r, (int)s, g, 0, ""};
    herr_t rc = H5Literate(g, H5_INDEX_NAME, H5_ITER_NATIVE, NULL, visit_tap, &sub);
    H5Gclose(g);
    if (rc < 0 || sub.err) {
        c->err = sub.err ? sub.err : 1;
        memcpy(c->msg, sub.msg, sizeof c->msg);
        return -1;
    }
    return 0;
}

static herr_t visit_attr(hid_t loc, const char *name, const H5A_info_t *ai, void *vctx)
{
    (void)ai;
    v41_dump_reader *r = vctx;
    char *buf = malloc(1 << 20);
    if (!buf) return -1;
    if (v41_h5_attr_str(loc, name, buf, 1 << 20) == 0) {
        kv_attr *na = realloc(r->attrs, sizeof *na * (r->n_attrs + 1));
        if (!na) { free(buf); return -1; }
        r->attrs = na;
        snprintf(na[r->n_attrs].key, sizeof na[r->n_attrs].key, "%s", name);
        na[r->n_attrs].val = strdup(buf);
        r->n_attrs++;
    }
    free(buf);
    return 0;
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int v41_dump_open(const char *path, v41_dump_reader **out, v41_err *err)
{
    hdf5_silence();
    *out = NULL;
    if (access(path, R_OK) != 0) return v41_err_set(err, V41_EIO, "%s: cannot open (no such file or not readable)", path);
    if (H5Fis_hdf5(path) <= 0) return v41_err_set(err, V41_EINVAL, "%s: not an HDF5 file", path);
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    /* small raw-data chunk cache: 521 slots, 4 MiB, evict fully read chunks first */
    H5Pset_cache(fapl, 0, 521, 4u << 20, 1.0);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
    H5Pclose(fapl);
    if (f < 0) return v41_err_set(err, V41_EIO, "%s: cannot open HDF5 file", path);
    v41_dump_reader *r = calloc(1, sizeof *r);
    if (!r) { H5Fclose(f); return v41_err_set(err, V41_ENOMEM, "dump: out of memory"); }
    r->file = f;
    r->ds = -1;
    snprintf(r->path, sizeof r->path, "%s", path);
    char buf[64];
    if (v41_h5_attr_str(f, "schema", buf, sizeof buf) != 0 || strcmp(buf, V41_DUMP_SCHEMA) != 0) {
        v41_dump_reader_close(r);
        return v41_err_set(err, V41_EINVAL, "%s: not a v41 dump (root attribute schema is not \"%s\")",
                           path, V41_DUMP_SCHEMA);
    }
    long long ver;
    const bool is_num = read_attr_long(f, "version", &ver) == 0;
    if (!is_num || ver != V41_DUMP_VERSION) {
        const bool have = v41_h5_attr_str(f, "version", buf, sizeof buf) == 0;
        if (!have) snprintf(buf, sizeof buf, "(missing or not one value)");
        v41_dump_reader_close(r);
        return v41_err_set(err, V41_EINVAL, "%s: dump schema version %s%s, this tool reads version %d (an integer)",
                           path, buf, have && !is_num ? " (not an integer)" : "", V41_DUMP_VERSION);
    }
    hsize_t idx = 0;
    H5Aiterate2(f, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, visit_attr, r);
    iter_ctx c = {r, -1, f, 0, ""};
    herr_t rc = H5Literate(f, H5_INDEX_NAME, H5_ITER_NATIVE, NULL, visit_root, &c);
    if (rc < 0 || c.err) {
        v41_dump_reader_close(r);
        return v41_err_set(err, c.err == 2 ? V41_ENOMEM : V41_EINVAL, "%s: %s", path,
                           c.msg[0] ? c.msg : "cannot list the step groups");
    }
    qsort(r->e, r->n, sizeof *r->e, cmp_entry);
    qsort(r->steps, (size_t)r->n_steps, sizeof(int), cmp_int);
    *out = r;
    return 0;
}

void v41_dump_reader_close(v41_dump_reader *r)
{
    if (!r) return;
    if (r->ds >= 0) H5Dclose(r->ds);
    if (r->file >= 0) H5Fclose(r->file);
    for (size_t i = 0; i < r->n_attrs; i++) free(r->attrs[i].val);
    free(r->attrs);
    free(r->e);
    free(r->steps);
    free(r);
}

const char *v41_dump_path(const v41_dump_reader *r) { return r->path; }

const char *v41_dump_attr(const v41_dump_reader *r, const char *key)
{
    for (size_t i = 0; i < r->n_attrs; i++)
        if (!strcmp(r->attrs[i].key, key)) return r->attrs[i].val;
    return NULL;
}

size_t v41_dump_count(const v41_dump_reader *r) { return r->n; }
const v41_dump_entry *v41_dump_at(const v41_dump_reader *r, size_t i) { return i < r->n ? &r->e[i] : NULL; }
int v41_dump_n_steps(const v41_dump_reader *r) { return r->n_steps; }
int v41_dump_step_at(const v41_dump_reader *r, int i) { return i >= 0 && i < r->n_steps ? r->steps[i] : -1; }

const v41_dump_entry *v41_dump_find(const v41_dump_reader *r, int step, const char *name)
{
    /* entries are sorted by step: binary search the step's range, then scan */
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (r->e[mid].step < step) lo = mid + 1; else hi = mid;
    }
    for (size_t i = lo; i < r->n && r->e[i].step == step; i++)
        if (!strcmp(r->e[i].name, name)) return &r->e[i];
    return NULL;
}

static hid_t open_entry(v41_dump_reader *r, const v41_dump_entry *e)
{
    if (r->ds >= 0 && r->ds_entry == e) return r->ds;
    if (r->ds >= 0) { H5Dclose(r->ds); r->ds = -1; }
    char p[V41_DUMP_NAME_MAX + 32];
    snprintf(p, sizeof p, "/step%04d/%s", e->step, e->name);
    r->ds = H5Dopen2(r->file, p, H5P_DEFAULT);
    r->ds_entry = r->ds >= 0 ? e : NULL;
    return r->ds;
}

/* Select flat row-major range [s, s+n) of a dataspace as a union of at
 * most 2*ndim regular blocks (HDF5 iterates a selection in row-major
 * order, so the memory buffer receives the elements in flat order). */
static int select_flat(hid_t sp, int nd, const int64_t *dims, int64_t s, int64_t n)
{
    int64_t e = s + n;
    bool first = true;
    int64_t stride[V41_DUMP_MAX_DIMS + 1];
    stride[nd] = 1;
    for (int i = nd - 1; i >= 0; i--) stride[i] = stride[i + 1] * dims[i];
    /* stride[j+1] = elements per unit step of dim j */
    while (s < e) {
        int j;
        int64_t step = 1, cnt = 1;
        for (j = 0; j < nd; j++) {
            step = stride[j + 1];
            if (s % step == 0 && s + step <= e) break;
        }
        if (j == nd) j = nd - 1, step = 1;
        int64_t idx_j = (s / step) % dims[j];
        cnt = (e - s) / step;
        if (cnt > dims[j] - idx_j) cnt = dims[j] - idx_j;
        hsize_t start[V41_DUMP_MAX_DIMS], count[V41_DUMP_MAX_DIMS];
        for (int i = 0; i < nd; i++) {
            if (i < j) { start[i] = (hsize_t)((s / stride[i + 1]) % dims[i]); count[i] = 1; }
            else if (i == j) { start[i] = (hsize_t)idx_j; count[i] = (hsize_t)cnt; }
            else { start[i] = 0; count[i] = (hsize_t)dims[i]; }
        }
        if (H5Sselect_hyperslab(sp, first ? H5S_SELECT_SET : H5S_SELECT_OR, start, NULL, count, NULL) < 0)
            return -1;
        first = false;
        s += cnt * step;
    }
    return 0;
}

int v41_dump_read(v41_dump_reader *r, const v41_dump_entry *e, int64_t off, int64_t n, void *dst,
                  v41_err *err)
{
    if (n <= 0) return 0;
    if (off < 0 || off + n > e->numel)
        return v41_err_set(err, V41_EINVAL, "%s: step%04d/%s: read [%lld,+%lld) out of range (%lld elements)",
                           r->path, e->step, e->name, (long long)off, (long long)n, (long long)e->numel);
    hid_t ds = open_entry(r, e);
    if (ds < 0) return v41_err_set(err, V41_EIO, "%s: cannot open step%04d/%s", r->path, e->step, e->name);
    hid_t fs = H5Dget_space(ds);
    int rc;
    if (e->ndim == 0) {
        rc = H5Dread(ds, kind_mem_type(e->kind), H5S_ALL, H5S_ALL, H5P_DEFAULT, dst) < 0 ? -1 : 0;
    } else {
        hsize_t mn = (hsize_t)n;
        hid_t ms = H5Screate_simple(1, &mn, NULL);
        rc = select_flat(fs, e->ndim, e->shape, off, n);
        if (rc == 0) rc = H5Dread(ds, kind_mem_type(e->kind), ms, fs, H5P_DEFAULT, dst) < 0 ? -1 : 0;
        H5Sclose(ms);
    }
    H5Sclose(fs);
    if (rc) {
        hid_t ft = H5Dget_type(ds);
        H5T_class_t c = ft >= 0 ? H5Tget_class(ft) : H5T_NO_CLASS;
        if (ft >= 0) H5Tclose(ft);
        bool num = c == H5T_INTEGER || c == H5T_FLOAT || c == H5T_ENUM;
        return v41_err_set(err, num ? V41_EIO : V41_EINVAL, "%s: cannot read step%04d/%s%s", r->path, e->step,
                           e->name, num ? "" : " (its HDF5 type is not a number type: a tap holds integers or floats)");
    }
    return 0;
}

int v41_dump_read_rows(v41_dump_reader *r, int step, int *n, int32_t **req, int32_t **pos, v41_err *err)
{
    *n = 0;
    *req = *pos = NULL;
    char p[64];
    snprintf(p, sizeof p, "/step%04d/rows", step);
    if (H5Lexists(r->file, p, H5P_DEFAULT) <= 0) return 0;
    hid_t ds = H5Dopen2(r->file, p, H5P_DEFAULT);
    if (ds < 0) return v41_err_set(err, V41_EIO, "%s: cannot open %s", r->path, p);
    hid_t sp = H5Dget_space(ds);
    hsize_t dims[2] = {0, 0};
    int nd = H5Sget_simple_extent_ndims(sp);
    H5Sget_simple_extent_dims(sp, dims, NULL);
    H5Sclose(sp);
    if (nd != 2 || dims[1] != 2) {
        H5Dclose(ds);
        return v41_err_set(err, V41_EINVAL, "%s: %s is not [n,2]", r->path, p);
    }
    int32_t *buf = malloc(sizeof(int32_t) * 2 * (dims[0] + 1));
    *req = malloc(sizeof(int32_t) * (dims[0] + 1));
    *pos = malloc(sizeof(int32_t) * (dims[0] + 1));
    if (!buf || !*req || !*pos) {
        free(buf); free(*req); free(*pos); *req = *pos = NULL;
        H5Dclose(ds);
        return v41_err_set(err, V41_ENOMEM, "dump: out of memory");
    }
    herr_t rc = dims[0] ? H5Dread(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) : 0;
    H5Dclose(ds);
    if (rc < 0) {
        free(buf); free(*req); free(*pos); *req = *pos = NULL;
        return v41_err_set(err, V41_EIO, "%s: cannot read %s", r->path, p);
    }
    for (hsize_t i = 0; i < dims[0]; i++) { (*req)[i] = buf[2 * i]; (*pos)[i] = buf[2 * i + 1]; }
    free(buf);
    *n = (int)dims[0];
    return 0;
}

/* ------------------------------------------------------------------ */
/* tap source over a dump (teacher forcing)                            */

struct v41_dump_source {
    v41_dump_reader *r;
    char pattern[1024];
    v41_err err;
    long hits;
};

static int source_fetch(void *ctx, const char *name, int step, v41_tap_kind kind, int ndim,
                        const int64_t *shape, void *dst)
{
    v41_dump_source *s = ctx;
    if (s->pattern[0] && !v41_dump_match(s->pattern, name)) return 0;
    const v41_dump_entry *e = v41_dump_find(s->r, step, name);
    if (!e) return 0;
    bool same = e->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = e->shape[i] == shape[i];
    if (!same) {
        char a[128] = "", b[128] = "";
        for (int i = 0; i < e->ndim; i++)
            snprintf(a + strlen(a), sizeof a - strlen(a), "%s%lld", i ? "," : "", (long long)e->shape[i]);
        for (int i = 0; i < ndim; i++)
            snprintf(b + strlen(b), sizeof b - strlen(b), "%s%lld", i ? "," : "", (long long)shape[i]);
        v41_err_set(&s->err, V41_EINVAL, "%s: step%04d/%s has shape [%s], the engine asks for [%s]",
                    s->r->path, step, name, a, b);
        return -1;
    }
    bool kf = kind == V41_TAP_F32 || kind == V41_TAP_BF16, ef = e->kind == V41_TAP_F32 || e->kind == V41_TAP_BF16;
    if (kf != ef || (!kf && kind != e->kind)) {
        v41_err_set(&s->err, V41_EINVAL, "%s: step%04d/%s has kind %s, the engine asks for %s", s->r->path,
                    step, name, v41_dump_kind_name(e->kind), v41_dump_kind_name(kind));
        return -1;
    }
    int rc = v41_dump_read(s->r, e, 0, e->numel, dst, &s->err);
    if (rc) return -1;
    s->hits++;
    return 1;
}

int v41_dump_source_create(v41_dump_reader *r, const char *pattern, v41_dump_source **out,
                           v41_tap_source *src, v41_err *err)
{
    v41_dump_source *s = calloc(1, sizeof *s);
    if (!s) return v41_err_set(err, V41_ENOMEM, "dump: out of memory");
    s->r = r;
    snprintf(s->pattern, sizeof s->pattern, "%s", pattern ? pattern : "");
    src->fetch = source_fetch;
    src->ctx = s;
    src->pattern = s->pattern[0] ? s->pattern : NULL;
    *out = s;
    return 0;
}

const v41_err *v41_dump_source_error(const v41_dump_source *s) { return &s->err; }
long v41_dump_source_hits(const v41_dump_source *s) { return s->hits; }
void v41_dump_source_free(v41_dump_source *s) { free(s); }
