/* v41_diff.h: compare two v41 dumps tap by tap in execution order.
 *
 * A = reference (first file), B = candidate. Continuous taps: per-element
 * pass rule |a-b| <= atol + rtol*|a| plus the metrics of README.md, section 'Harness'
 * (max abs with index and values, max rel with 0/0 = 0, RMS error, NMSE,
 * cosine, count over tolerance, NaN/Inf position mismatches, smallest atol
 * that passes at the given rtol). Discrete taps (I32/U8): each row (all
 * leading dims, the last dim is the set) compared as a set; a difference is
 * a decision flip (row, missing = in A not in B, extra = in B not in A).
 * Everything is read in bounded chunks. */
#ifndef V41_DIFF_H
#define V41_DIFF_H

#include "v41_dump.h"
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct v41_diff_opts {
    double atol, rtol;        /* used when atol_set / rtol_set; else per-tap defaults */
    bool atol_set, rtol_set;
    const char *only;         /* glob list over tap names, NULL = all */
    int64_t chunk_elems;      /* elements read per slab (0 = 1<<20) */
    int max_flip_rows;        /* flipped rows kept per tap (0 = 4) */
    bool ignore_missing;      /* taps present in one dump only are listed but do not count as differences */
} v41_diff_opts;

void v41_diff_opts_default(v41_diff_opts *o);

enum {
    V41_DIFF_SAME = 0,
    V41_DIFF_DIFF,            /* numeric failure or decision flip */
    V41_DIFF_MISSING_A,       /* tap only in B */
    V41_DIFF_MISSING_B,       /* tap only in A */
    V41_DIFF_SHAPE,           /* shapes (or kinds) differ */
};

#define V41_DIFF_FLIP_ITEMS 8
typedef struct v41_diff_flip {
    int64_t row;
    int n_missing, n_extra;               /* full counts */
    int32_t missing[V41_DIFF_FLIP_ITEMS]; /* first few items (U8 masks: column indices) */
    int32_t extra[V41_DIFF_FLIP_ITEMS];
} v41_diff_flip;

#define V41_DIFF_MAX_FLIPS 4
typedef struct v41_diff_tensor {
    int step;
    char name[V41_DUMP_NAME_MAX];
    int order, layer;
    v41_tap_kind kind;
    bool discrete;
    int status;
    char msg[256];            /* shape mismatch / missing explanation */
    int ndim;
    int64_t shape[V41_DUMP_MAX_DIMS];
    int64_t numel;
    double atol, rtol;        /* tolerances applied (atol absolute) */
    /* continuous */
    double max_abs, max_abs_a, max_abs_b;
    int64_t max_abs_idx;      /* flat index, -1 when no finite pair */
    double max_rel;
    int64_t max_rel_idx;
    double rms_err, nmse, cosine, ref_rms;
    int64_t n_compared, n_over;
    int64_t nonfinite_mismatch, first_nonfinite_idx;
    double min_atol;          /* smallest atol passing at rtol */
    /* discrete */
    int64_t n_rows, n_flipped;
    int n_flips;              /* entries kept in flips[] */
    v41_diff_flip flips[V41_DIFF_MAX_FLIPS];
} v41_diff_tensor;

typedef struct v41_diff_report {
    char a_path[4096], b_path[4096];
    char a_desc[256], b_desc[256];  /* "engine ref, precision emulate" */
    char tol_level[16];             /* "bf16" or "fp32": level of the default tolerances */
    char warning[256];              /* e.g. the dumps come from different weights ("" = none) */
    v41_diff_tensor *t;             /* in execution order */
    size_t n;
    long first_fail;                /* index of the first failing tap, -1 none */
    long first_flip;                /* index of the first decision flip, -1 none */
    long n_fail, n_flip_taps, n_missing, n_shape;
} v41_diff_report;

int v41_diff_readers(v41_dump_reader *a, v41_dump_reader *b, const v41_diff_opts *o,
                     v41_diff_report **out, v41_err *err);
int v41_diff_files(const char *a, const char *b, const v41_diff_opts *o, v41_diff_report **out,
                   v41_err *err);
void v41_diff_report_free(v41_diff_report *r);
/* Compare one tap of A with one of B (same step/name assumed). */
int v41_diff_tensor_compare(v41_dump_reader *a, const v41_dump_entry *ea, v41_dump_reader *b,
                            const v41_dump_entry *eb, const v41_diff_opts *o, const char *tol_level,
                            v41_diff_tensor *out, v41_err *err);

/* Default tolerances (README.md, section 'Harness'): level "bf16": rtol = 2^-6,
 * atol = 2^-6 * max|a|; level "fp32": rtol = 2^-13, atol = 2^-13 * max|a|.
 * Level = "fp32" when both dumps have precision fp32, else "bf16"; BF16
 * taps always get at least the bf16 level. */
#define V41_DIFF_RTOL_BF16 0.015625        /* 4 * 2^-8: four bf16 unit roundoffs */
#define V41_DIFF_RTOL_FP32 1.220703125e-4  /* 2^-13 = 2^11 fp32 unit roundoffs (2^-24) */
void v41_diff_default_tol(v41_tap_kind kind, const char *level, double ref_max, double *atol, double *rtol);
const char *v41_diff_level(const char *prec_a, const char *prec_b);

/* Printing: differences only (verbose: every tap), then the summary. */
void v41_diff_print(const v41_diff_report *r, FILE *f, bool verbose);
void v41_diff_print_summary(const v41_diff_report *r, FILE *f);
void v41_diff_print_tensor(const v41_diff_tensor *t, FILE *f);
/* JSON text (malloc'd). */
char *v41_diff_json(const v41_diff_report *r);
/* Format a flat index as "[i,j,k]". */
void v41_diff_format_index(int ndim, const int64_t *shape, int64_t flat, char *buf, size_t cap);
/* Sublayer of a tap name: "attention", "ffn", "engram", "hc", "stream", "dspark",
 * "embed", "head", "other"; layer from the name ("layer.{l}." / "dspark.{s}."). */
const char *v41_diff_sublayer(const char *name);

#ifdef __cplusplus
}
#endif
#endif
