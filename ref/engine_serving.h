/* engine_serving.h: serving semantics of the CPU reference engine (SPEC §7):
 * encoder-side replay of a cached prefix and decoder-side trimming.
 * Private to ref/ (engine.c calls these at a few points of the forward). */
#ifndef V41_ENGINE_SERVING_H
#define V41_ENGINE_SERVING_H

#include "engine_impl.h"

/* A forward of a cached request that does not start at its cached length:
 * allowed only as a replay of the cached prefix (replay on, 0 < replay_floor <=
 * start_pos < cached length, replayed tokens equal to the cached ones). Returns
 * V41_OK or the error (EINVAL) for the caller. */
int v41_srv_check_start(ref_engine *E, const req_state *st, const v41_req *rq, v41_err *err);

/* Decides the decoder-side trimming of the forward: F->kept[T] (NULL when replay is
 * off), per request R->trim / R->kv_start, F->cut (the last kv source, or -1 when no
 * request is trimmed). */
int v41_srv_plan(ref_engine *E, fwd *F, v41_err *err);

/* At the cut layer's attention, after the KV side (window KV, compressor, indexer)
 * ran on every row: switch F to the kept rows (request slices, positions, top-k and
 * candidate rows realigned) and gather rows[T, width] in place. Sets F->just_cut. */
int v41_srv_compact(ref_engine *E, fwd *F, int l, float *rows, int64_t width, v41_err *err);

/* In-place gather of buf[T_full, width] to the kept rows (compacted view only). */
void v41_srv_gather(const fwd *F, float *buf, int64_t width);

/* After the last layer: scatter X[., hc*D] and premix[., hc] back to the full rows
 * (trimmed rows: zeros) and restore the full view. */
int v41_srv_expand(ref_engine *E, fwd *F, float *X, float *premix, v41_err *err);

/* Frees the trimming state (restores the full view if still compacted). */
void v41_srv_free(ref_engine *E, fwd *F);

/* Compacted view: a row tap ("[T..." dims) of the kept rows is scattered into a new
 * buffer of the full rows (zeros elsewhere); *buf receives it (caller frees). Returns
 * non-zero on allocation failure. */
int v41_srv_tap_scatter(ref_engine *E, v41_tap *t, void **buf);

/* Compacted view: a row forcing point is fetched with the full row count (the
 * engine's own kept rows scattered, zeros elsewhere) and gathered back. */
int v41_srv_force_fetch(ref_engine *E, v41_tap_source *f, const char *name, v41_tap_kind kind, int ndim,
                        const int64_t *shape, void *dst);

/* DSpark list alignment when opts.dspark_align is 0: env V41_DSPARK_ALIGN, else 64
 * when the dspark-padding-counted fault is injected (a padded kernel's width), else 0. */
int v41_srv_default_align(const ref_engine *E);

#endif
