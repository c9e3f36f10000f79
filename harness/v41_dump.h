/* v41_dump.h: HDF5 activation dumps, schema "v41-dump" version 1
 * (README.md, section 'Harness' documents every group, dataset and attribute).
 *
 * Writer: a v41_tap_sink that streams every tap to disk as it arrives
 * (chunked, shuffle+deflate, nothing accumulated), into OUT.tmp, renamed to
 * OUT by v41_dump_close() only when everything was written.
 * Reader: lists the taps of a dump in execution order (step, then the 'order'
 * attribute) and reads any flat element range of a tap (hyperslabs), so
 * callers work in bounded memory whatever the dump size. */
#ifndef V41_DUMP_H
#define V41_DUMP_H

#include "v41_engine.h"   /* v41_tap_source */

#ifdef __cplusplus
extern "C" {
#endif

#define V41_DUMP_SCHEMA "v41-dump"
#define V41_DUMP_VERSION 1
#define V41_DUMP_MAX_DIMS 8
#define V41_DUMP_NAME_MAX 256

/* Root attributes; NULL strings are written as "". */
typedef struct v41_dump_meta {
    const char *engine;              /* "ref", "gpu", "pytorch", "oracle", ... */
    const char *precision;           /* "emulate", "fp32", "bf16", ... */
    const char *compat;              /* "fixed" or "official" */
    const char *config_json;         /* model config (ModelArgs JSON) */
    const char *weights_fingerprint; /* 16 hex chars (v41_weights_fingerprint) */
    const char *replay;              /* "on" or "off" */
    const char *blas;                /* BLAS name / config */
    const char *gpu;                 /* GPU name or "" */
    const char *inject;              /* fault injection spec or "" */
    const char *command;             /* command line that produced the dump */
    const char *model;               /* model source ("tiny" or the path) */
    int threads;
} v41_dump_meta;

/* ---- writer ---- */
typedef struct v41_dump v41_dump;

int v41_dump_create(const char *path, const v41_dump_meta *meta, v41_dump **out, v41_err *err);
/* Optional: dims string ("[T,H,d]") per tap name, stored as attribute 'dims'. */
void v41_dump_set_dims_fn(v41_dump *d, const char *(*dims_of)(const char *name));
/* Deflate level 0..9 (default 1; 0 = no compression filter). */
void v41_dump_set_deflate(v41_dump *d, int level);
/* /requests table: one entry per request (columns may be NULL = 0). */
int v41_dump_set_requests(v41_dump *d, int n, const int32_t *id, const int32_t *prompt_len,
                          const int32_t *prefix_hit, v41_err *err);
/* /step{NNNN}/rows: request id and absolute position of every row of that step. */
int v41_dump_set_rows(v41_dump *d, int step, int n, const int32_t *req, const int32_t *pos,
                      v41_err *err);
/* Write one tap now. A second tap of the same name in the same step is
 * appended along dim 0 (trailing dims must match). */
int v41_dump_write_tap(v41_dump *d, const v41_tap *tap, v41_err *err);
/* Fill a sink that writes into d (pattern: glob list or NULL = all).
 * The sink returns non-zero on a write error; v41_dump_close reports it. */
void v41_dump_sink(v41_dump *d, v41_tap_sink *s, const char *pattern);
/* Number of taps written so far. */
long v41_dump_n_taps(const v41_dump *d);
/* Finish: root 'complete' attributes, close, rename OUT.tmp -> OUT.
 * On any earlier error (or on failure here) the temp file is removed and
 * the error returned. d is freed in every case. */
int v41_dump_close(v41_dump *d, v41_err *err);
/* First error met by the sink (code 0 = none). */
const v41_err *v41_dump_error(const v41_dump *d);
/* Abandon: close and remove the temp file; d is freed. */
void v41_dump_abort(v41_dump *d);

/* ---- reader ---- */
typedef struct v41_dump_entry {
    int step;
    char name[V41_DUMP_NAME_MAX];
    int order;                 /* execution order within the step */
    int layer;                 /* -1 = none */
    v41_tap_kind kind;
    bool discrete;
    int ndim;
    int64_t shape[V41_DUMP_MAX_DIMS];
    int64_t numel;
    bool has_stats;            /* float taps written by v41 writers carry rms/absmax */
    double rms, absmax;
    char dims[64];             /* attribute 'dims' ("" when absent) */
} v41_dump_entry;

typedef struct v41_dump_reader v41_dump_reader;

/* Opens and validates (schema name and version): V41_EIO when the file
 * cannot be opened, V41_EINVAL when it is not a v41 dump or the version differs. */
int v41_dump_open(const char *path, v41_dump_reader **out, v41_err *err);
void v41_dump_reader_close(v41_dump_reader *r);
const char *v41_dump_path(const v41_dump_reader *r);
/* Root string attribute (NULL when absent); integers are returned formatted. */
const char *v41_dump_attr(const v41_dump_reader *r, const char *key);
/* Taps in execution order: sorted by (step, order, name). */
size_t v41_dump_count(const v41_dump_reader *r);
const v41_dump_entry *v41_dump_at(const v41_dump_reader *r, size_t i);
const v41_dump_entry *v41_dump_find(const v41_dump_reader *r, int step, const char *name);
/* Steps present (sorted), number. */
int v41_dump_n_steps(const v41_dump_reader *r);
int v41_dump_step_at(const v41_dump_reader *r, int i);
/* Read flat (row-major) elements [off, off+n) of a tap, converted to the
 * kind's memory type: float for F32/BF16, int32_t for I32, uint8_t for U8. */
int v41_dump_read(v41_dump_reader *r, const v41_dump_entry *e, int64_t off, int64_t n,
                  void *dst, v41_err *err);
/* /step{NNNN}/rows as two malloc'd arrays (caller frees); *n = 0 when absent. */
int v41_dump_read_rows(v41_dump_reader *r, int step, int *n, int32_t **req, int32_t **pos,
                       v41_err *err);

/* A tap source (teacher forcing) that serves the taps of a dump: fetch()
 * returns 1 with the values when (name, step) exists with the same shape,
 * 0 when absent, <0 on a read error or shape mismatch (message in *err of
 * the source, see v41_dump_source_error). */
typedef struct v41_dump_source v41_dump_source;
int v41_dump_source_create(v41_dump_reader *r, const char *pattern, v41_dump_source **out,
                           v41_tap_source *src, v41_err *err);
const v41_err *v41_dump_source_error(const v41_dump_source *s);
long v41_dump_source_hits(const v41_dump_source *s);
void v41_dump_source_free(v41_dump_source *s);

/* Glob list match ('*', '?', comma-separated alternatives); NULL/"" pattern = all. */
bool v41_dump_match(const char *pattern, const char *name);
const char *v41_dump_kind_name(v41_tap_kind k);   /* "f32" "bf16" "i32" "u8" */
int v41_dump_kind_parse(const char *s, v41_tap_kind *k);

#ifdef __cplusplus
}
#endif
#endif
