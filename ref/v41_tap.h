/* v41_tap.h: named intermediates ("taps") emitted by the engines.
 *
 * Every tap is declared once, in ref/v41_taps.def (name pattern, dims in
 * terms of the config, dtype, meaning, discrete or not). Engines call
 * v41_tap_emit(); with no sink attached it costs one pointer test.
 * Names: "layer.{l}.attn.q", "layer.{l}.ffn.gate.indices", "dspark.{s}.attn.out",
 * "logits", ... Both engines emit the same names, shapes and dtypes. */
#ifndef V41_TAP_H
#define V41_TAP_H

#include "v41_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum v41_tap_kind {
    V41_TAP_F32 = 0,   /* continuous, fp32 values */
    V41_TAP_BF16,      /* continuous, values exactly representable in bf16 (engine stored bf16) */
    V41_TAP_I32,       /* discrete: indices (top-k lists, -1 = none), expert ids, tokens */
    V41_TAP_U8,        /* discrete: masks / flags */
} v41_tap_kind;

typedef struct v41_tap {
    const char *name;          /* full name, e.g. "layer.3.attn.topk" */
    int step;                  /* forward index (0 = first forward of the run) */
    int layer;                 /* layer id (DSpark stages: n_layers + s), -1 = none */
    v41_tap_kind kind;
    int ndim;
    int64_t shape[6];          /* row-major; first dim is the row (token) dim where it has one */
    const void *data;          /* float* for F32/BF16, int32_t* for I32, uint8_t* for U8 */
    int order;                 /* execution order within the step (monotone) */
} v41_tap;

/* A sink receives taps. Return non-zero to abort the forward (error propagated). */
typedef struct v41_tap_sink {
    int (*emit)(void *ctx, const v41_tap *tap);
    void *ctx;
    const char *pattern;       /* glob list "a*,b*" selecting names; NULL = all */
} v41_tap_sink;

/* Glob match with '*' and '?', comma-separated alternatives. */
bool v41_tap_match(const char *pattern, const char *name);

/* Tap table (from v41_taps.def). */
typedef struct v41_tap_desc {
    const char *pattern;   /* "layer.{l}.attn.q" */
    const char *dims;      /* "[T,H,d]" in SPEC notation */
    v41_tap_kind kind;
    const char *meaning;
    const char *golden;    /* dataset name in the oracle's golden files ("attn_q"), or NULL */
    bool discrete;         /* compared as sets / decisions, not numerically */
} v41_tap_desc;
const v41_tap_desc *v41_tap_table(size_t *n);
/* Find the descriptor of a concrete name ("layer.3.attn.q" -> "layer.{l}.attn.q"). */
const v41_tap_desc *v41_tap_lookup(const char *name);

#ifdef __cplusplus
}
#endif
#endif
