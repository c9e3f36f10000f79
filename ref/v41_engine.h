/* v41_engine.h: the engine interface implemented by ref/ (CPU reference)
 * and gpu/ (CUDA). A forward takes a ragged batch: per request its token
 * ids, start position, replay floor and flags. Caches (window rings,
 * compressor partial groups, compressed KV, index keys, engram history,
 * DSpark rings) live per request inside the engine, keyed by request id. */
#ifndef V41_ENGINE_H
#define V41_ENGINE_H

#include "v41_weights.h"
#include "v41_tap.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { V41_PREC_EMULATE = 0, V41_PREC_FP32 = 1 } v41_precision;
/* Index-key semantics (SPEC §6): fixed (default) or the published decode bug. */
typedef enum { V41_COMPAT_FIXED = 0, V41_COMPAT_OFFICIAL = 1 } v41_compat;

typedef struct v41_engine_opts {
    v41_precision precision;
    v41_compat compat;
    int threads;              /* 0 = default */
    bool replay;              /* bounded replay (SPEC §7); default true */
    const char *inject;       /* fault injection "NAME[@LAYER][,NAME...]" or NULL (also env V41_INJECT) */
    int max_requests;         /* cache slots; 0 = default */
    int max_seq_len;          /* 0 = config's max_seq_len */
    int dspark_align;         /* padding width alignment of DSpark index lists (0 = none) */
} v41_engine_opts;

void v41_engine_opts_default(v41_engine_opts *o);

/* One request's slice of a ragged forward. */
typedef struct v41_req {
    int id;                   /* request id (cache slot key) */
    int start_pos;            /* absolute position of tokens[0] */
    int n_tokens;
    const int32_t *tokens;
    int replay_floor;         /* SPEC §7 replay_start (0 = none) */
    bool prompt_logprobs;     /* never trimmed */
    bool verify;              /* DSpark verification step (never trimmed) */
    bool all_logits;          /* return logits for every row (else last row only) */
} v41_req;

typedef struct v41_batch {
    int n_req;
    const v41_req *req;
} v41_batch;

/* Output of a forward. logits: per request, [n_rows_out, vocab] fp32 where
 * n_rows_out = all_logits ? n_tokens : 1; argmax: greedy token per returned row. */
typedef struct v41_out {
    float *logits;            /* concatenated over requests (engine-owned until next forward) */
    int32_t *argmax;
    int *row_offset;          /* [n_req+1] offsets into logits rows */
} v41_out;

typedef struct v41_engine v41_engine;

/* Teacher forcing (bisect): at each forcing point (an input of a layer or
 * sublayer, named like the tap that produced it on the other side, e.g.
 * "layer.3.stream.in", "layer.3.premix.in", "layer.3.stream.mid",
 * "layer.5.attn.topk"), the engine asks the source for the value (ref engine:
 * dst holds the engine's own value on entry, so a source may edit it in place); when
 * fetch returns 1 it overwrites its own tensor with dst (same shape/kind as
 * the tap) before using it. 0 = not available, keep own; <0 = error. */
typedef struct v41_tap_source {
    int (*fetch)(void *ctx, const char *name, int step, v41_tap_kind kind,
                 int ndim, const int64_t *shape, void *dst);
    void *ctx;
    const char *pattern;      /* which forcing points are enabled (glob list), NULL = all */
} v41_tap_source;

typedef struct v41_engine_vtbl {
    const char *name;  /* "ref" or "gpu" */
    int (*forward)(v41_engine *e, const v41_batch *b, v41_out *out, v41_err *err);
    /* DSpark draft after the target produced position p for request id:
     * first = token sampled from p's logits. Writes block_size draft ids
     * (ids[0] = first) + confidences. */
    int (*dspark_draft)(v41_engine *e, int req_id, int p, int32_t first,
                        int32_t *ids, float *confidence, v41_err *err);
    /* Drop cache state of a request at positions >= pos (rollback after rejected drafts). */
    int (*truncate)(v41_engine *e, int req_id, int pos, v41_err *err);
    /* Copy cached prefix [0, n) of request src into request dst (prefix-cache hit). */
    int (*fork)(v41_engine *e, int src_id, int dst_id, int n, v41_err *err);
    void (*release)(v41_engine *e, int req_id);
    void (*destroy)(v41_engine *e);
    /* (added by the ref engine) DSpark drafts of n requests in one batch: request
     * req_ids[i] after the target produced position ps[i], first token firsts[i].
     * ids: [n, block_size+1] (column 0 = first, column i+1 = argmax of draft row i),
     * confidence: [n, block_size]. Either output may be NULL. NULL entry = unsupported. */
    int (*dspark_draft_batch)(v41_engine *e, int n, const int *req_ids, const int *ps, const int32_t *firsts,
                              int32_t *ids, float *confidence, v41_err *err);
} v41_engine_vtbl;

struct v41_engine {
    const v41_engine_vtbl *vt;
    const v41_model *model;
    v41_engine_opts opts;
    v41_tap_sink *sink;       /* NULL = no taps */
    v41_tap_source *force;    /* NULL = free run */
    int step;                 /* forward counter, stamped on taps */
    void *impl;
};

int v41_ref_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out, v41_err *err);
/* GPU engine (gpu/); returns V41_EUNSUPPORTED when built without CUDA or no device. */
int v41_gpu_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out, v41_err *err);
/* Decode steps the GPU engine ran device-resident so far (its caches on the device, one
 * CUDA graph per batch size; README.md, "Device-resident decode"); 0 for any other engine. */
long v41_gpu_engine_resident_steps(const v41_engine *e);

static inline int v41_engine_forward(v41_engine *e, const v41_batch *b, v41_out *out, v41_err *err)
{ return e->vt->forward(e, b, out, err); }
static inline void v41_engine_destroy(v41_engine *e) { if (e) e->vt->destroy(e); }
static inline void v41_engine_set_sink(v41_engine *e, v41_tap_sink *s) { e->sink = s; }

#ifdef __cplusplus
}
#endif
#endif
