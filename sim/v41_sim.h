/* v41_sim.h: trace-driven serving simulator (README.md, section 'Simulator').
 *
 * Four modules, one header:
 *   sim_trace.c  streaming trace readers (Mooncake JSONL, Azure 2023 CSV) and a
 *                synthetic generator; memory is one record, never the trace.
 *   sim_cost.c   per-step FLOPs and bytes of every op from the model config and
 *                the batch composition; time from a measured profile
 *                ("v41-profile/1") or H200 roofline numbers.
 *   sim_core.c   discrete-event simulation of continuous-batching replicas:
 *                token budget, chunked prefill, decode priority, block prefix
 *                cache with LRU eviction and a byte capacity, bounded replay
 *                (SPEC §7), DSpark speculation (SPEC §8), a router.
 *   sim_out.c    CSV / HDF5 / JSON outputs, streaming percentiles, sweep merge.
 * No global mutable state: everything lives in the objects passed around. */
#ifndef V41_SIM_H
#define V41_SIM_H

#include "v41_config.h"
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ traces */

typedef struct v41_trace_rec {
    int64_t line;          /* 1-based line in the file (synthetic: record number) */
    double t_arrive;       /* seconds from the first record */
    int64_t in_len, out_len;
    int n_hash;            /* prefix block ids (Mooncake hash_ids); 0 = none */
    int64_t *hash;         /* owned by the reader until the next call; copy to keep */
} v41_trace_rec;

typedef struct v41_trace v41_trace;

/* format: "mooncake", "azure" or "auto" (by extension, then by the first byte).
 * lenient: malformed rows are skipped and counted instead of failing. */
int v41_trace_open(const char *path, const char *format, bool lenient, v41_trace **out, v41_err *err);
/* Synthetic generator, spec "key=value,..." (README.md, section 'Simulator'): n, rate, arrival=poisson|gamma,
 * cv, in=DIST, out=DIST (DIST: fixed:N | uniform:A:B | lognormal:MEAN:SIGMA | exp:MEAN),
 * groups, prefix (shared tokens per group), block, seed. */
int v41_trace_open_synth(const char *spec, v41_trace **out, v41_err *err);
/* Next record: returns V41_OK and *eof=false with rec filled, V41_OK and *eof=true at
 * the end, or an error naming file and line (never under lenient, except I/O). */
int v41_trace_next(v41_trace *t, v41_trace_rec *rec, bool *eof, v41_err *err);
int64_t v41_trace_skipped(const v41_trace *t);   /* rows skipped under --lenient */
const char *v41_trace_format(const v41_trace *t);/* "mooncake", "azure", "synthetic" */
double v41_trace_progress(const v41_trace *t);   /* fraction of the file read, 0..1 (-1 unknown) */
void v41_trace_close(v41_trace *t);
/* Write records as Mooncake JSONL (the synthetic generator's --write-trace). */
int v41_trace_write_jsonl(v41_trace *t, FILE *f, int64_t limit, v41_err *err);

/* ------------------------------------------------------------------ cost model */

typedef enum {
    V41_OP_GEMM = 0, V41_OP_ATTN_DECODE, V41_OP_ATTN_PREFILL, V41_OP_INDEXER, V41_OP_MOE, V41_OP_SMALL,
    V41_OP_NCLASS
} v41_op_class;
const char *v41_op_class_name(int c);

#define V41_PROFILE_MAXPTS 512
typedef struct v41_profile {
    char device[128];
    double peak_flops, peak_bw;     /* ceilings (FLOP/s, B/s) */
    double launch_s;                /* per-kernel overhead added to every op (0 unless given) */
    int n[V41_OP_NCLASS];           /* points per class, sorted by roofline time */
    double x[V41_OP_NCLASS][V41_PROFILE_MAXPTS];   /* log roofline time */
    double le[V41_OP_NCLASS][V41_PROFILE_MAXPTS];  /* log efficiency */
    int n_ignored;                  /* "layer" and unknown op entries */
} v41_profile;

/* Parse a "v41-profile/1" JSON file. */
int v41_profile_load(const char *path, v41_profile *p, v41_err *err);

typedef struct v41_hw {
    double peak_flops;      /* FLOP/s (H200 dense bf16: 989e12) */
    double peak_bw;         /* B/s (H200 HBM3e: 4.8e12) */
    double eff_flops[V41_OP_NCLASS], eff_bw[V41_OP_NCLASS]; /* fallback efficiencies */
    double launch_s;        /* per kernel */
    int gpus;               /* GPUs per replica (ideal split of work) */
    double par_eff;         /* efficiency of the split when gpus > 1 */
    double hbm_bytes;       /* per GPU (141e9) */
} v41_hw;
void v41_hw_h200(v41_hw *hw);

/* One request's slice of a forward: rows at positions [start, end). */
typedef enum { V41_ITEM_PREFILL = 0, V41_ITEM_DECODE = 1, V41_ITEM_VERIFY = 2 } v41_item_kind;
typedef struct v41_sim_item {
    int kind;
    int64_t start, end;     /* positions of this forward's rows */
    int64_t floor;          /* window floor (replay_start, SPEC §7); 0 = none */
    int64_t new_from;       /* rows >= new_from write compressed KV / index keys (= the hit H) */
    bool trim;              /* decoder-side replay applies (prefill only) */
    bool logits;            /* the last row needs logits */
} v41_sim_item;

typedef struct v41_step_cost {
    double time_s, flops, bytes;
    double flops_c[V41_OP_NCLASS], bytes_c[V41_OP_NCLASS], time_c[V41_OP_NCLASS];
    int64_t kernels;
    int64_t rows;              /* rows entering layer 0 */
    int64_t trimmed_layer_rows;/* sum over trimmed layers of rows not computed */
    double trimmed_flops;      /* FLOPs the same batch would need without decoder-side trimming, minus ours */
    double draft_flops;        /* part of flops spent in DSpark stages */
} v41_step_cost;

typedef struct v41_cost_model v41_cost_model;
/* prof may be NULL (roofline fallback). cfg and prof are copied. */
int v41_cost_create(const v41_config *cfg, const v41_hw *hw, const v41_profile *prof, v41_cost_model **out,
                    v41_err *err);
void v41_cost_destroy(v41_cost_model *m);
/* Cost of one forward of the target over items, plus, when draft_len > 0, the DSpark
 * drafting for every decode/verify item (dspark_block_size rows per stage) and the
 * stage context-KV writes of prefill rows. */
/* Time of one kernel of class c (without launch overhead and GPU split): with a profile,
 * roofline time x = max(F/peak_flops, B/peak_bw) divided by the efficiency interpolated
 * piecewise log-linearly in x between the class's measured points (clamped at the ends);
 * else max(F/(peak_flops*eff_flops[c]), B/(peak_bw*eff_bw[c])). */
double v41_cost_kernel_time(const v41_cost_model *m, int c, double F, double B);
void v41_cost_step(const v41_cost_model *m, const v41_sim_item *items, int n, int draft_len, v41_step_cost *out);

/* A calibrated step-time model (from `v41 sim --validate ... --fit|--fit-from --json`, schema
 * v41-sim-validate/1, object "fit"): time = c0 + sum_k a[k] * time_c[k] + per_row * rows +
 * [per_mixed_step + per_mixed_row * rows when the step is not a pure decode batch] +
 * per_request * items (the GPU engine runs pure decode batches device-resident and every other
 * step through its host orchestration: two regimes; per_mixed_step_s and per_mixed_row_s are
 * optional in the file, 0 when absent). It replaces time_s of v41_cost_step (time_c keeps the uncalibrated
 * per-class times). Use it for an engine whose step time is not the sum of its kernels'
 * device times (host orchestration, launch and copy overheads). */
/* Read and parse the JSON file at path (what names it in errors: "profile", ...). *out is
 * NULL on error (cannot open, read error, not valid JSON); the caller cJSON_Delete()s it. */
struct cJSON;
int v41_json_load(const char *path, const char *what, struct cJSON **out, v41_err *err);

typedef struct v41_calib {
    double c0, a[V41_OP_NCLASS], per_row, per_mixed_step, per_mixed_row, per_request;
    char source[256];
} v41_calib;
int v41_calib_load(const char *path, v41_calib *c, v41_err *err);
/* cal NULL: uncalibrated (the default). The calibration is copied. */
void v41_cost_set_calib(v41_cost_model *m, const v41_calib *cal);
/* Bytes of caches (SPEC §4-§6 storage formats) */
typedef struct v41_kv_bytes {
    double window_row;      /* one window-KV row of ALL backbone layers (fp8 + e8m0/32) */
    double dspark_row;      /* one window row of all DSpark stages */
    double comp_tok;        /* compressed KV per token of prefix, all kv sources (fp4 + e4m3/16, / m) */
    double index_tok;       /* indexer keys per token, all kv sources (fp4 + e8m0/32, / m) */
    double state_req;       /* compressor partial-group state per request (fp32 kv + gate, m slots) */
    double weights;         /* model weight bytes (for --kv-capacity auto) */
} v41_kv_bytes;
void v41_cost_kv_bytes(const v41_cost_model *m, v41_kv_bytes *kb);
/* The built-in V4.1-Flash configuration (SPEC §1 table). */
int v41_sim_config_flash(v41_config *cfg, v41_err *err);
/* "tiny", "flash" or a config path. */
int v41_sim_config_get(const char *name, v41_config *cfg, v41_err *err);

/* ------------------------------------------------------------------ simulation */

typedef enum { V41_ACC_FIXED = 0, V41_ACC_GEOM, V41_ACC_EMPIRICAL } v41_acc_kind;
#define V41_ACC_MAXLEN 64
typedef struct v41_accept {
    int kind;
    double p;                          /* fixed: fraction of drafts accepted; geom: per-token prob */
    double pmf[V41_ACC_MAXLEN + 1];    /* empirical: probability of k accepted drafts */
    int pmf_len;                       /* entries used (max draft length seen + 1) */
} v41_accept;
/* "fixed:P", "geom:P" or "file:PATH" (v41 serve-trace JSON, README.md, section 'Simulator'). */
int v41_accept_parse(const char *spec, v41_accept *a, v41_err *err);

typedef enum { V41_ROUTE_RR = 0, V41_ROUTE_LEAST } v41_route;

typedef struct v41_sim_opts {
    v41_config cfg;
    char model_name[256];
    v41_hw hw;
    const v41_profile *profile;  /* NULL: roofline */
    const v41_calib *calib;      /* NULL: step time = the cost model's (see v41_calib) */
    bool replay_enc, replay_dec; /* SPEC §7 */
    int draft_len;               /* 0 = DSpark off */
    v41_accept accept;
    int replicas;
    int router;
    int64_t token_budget;        /* rows per step */
    int max_seqs;                /* running requests per replica */
    double kv_capacity;          /* bytes per replica, <= 0: auto */
    int64_t block_tokens;        /* prefix block size of the trace's hash ids (512) */
    uint64_t seed;
    double sample_dt;            /* KV timeline sampling period (sim seconds) */
    int64_t limit;               /* stop reading after this many records (0 = all) */
    bool progress;               /* progress bar on stderr */
} v41_sim_opts;
void v41_sim_opts_default(v41_sim_opts *o);

typedef struct v41_sim_req_out {
    int64_t id, line;
    int replica;
    int status;                  /* 0 finished, 1 rejected (cannot fit the KV capacity) */
    double t_arrive, t_admit, t_first, t_finish;
    double ttft, tpot, e2e;
    int64_t in_len, out_len, hit_tokens, computed_rows, replay_rows, trimmed_rows;
    int64_t verify_steps, drafted, accepted;
} v41_sim_req_out;

typedef struct v41_sim_kv_sample {
    double t;
    int replica;
    int running, waiting;
    double window, comp, index, state, dspark, cache_comp, cache_index, cache_window, capacity;
} v41_sim_kv_sample;

typedef struct v41_sim_sinks {
    void *ud;
    int (*on_request)(void *ud, const v41_sim_req_out *r);
    int (*on_kv)(void *ud, const v41_sim_kv_sample *s);
} v41_sim_sinks;

/* streaming percentile estimator: log-spaced bins, relative resolution 0.1% */
#define V41_HIST_BINS 12000
typedef struct v41_hist {
    double lo;          /* smallest binned value; below it goes to bin 0 */
    int64_t n, zero;
    double sum, min, max;
    int64_t bins[V41_HIST_BINS];
} v41_hist;
void v41_hist_init(v41_hist *h);
void v41_hist_add(v41_hist *h, double v);
double v41_hist_quantile(const v41_hist *h, double q);

typedef struct v41_sim_result {
    int64_t n_requests, n_finished, n_rejected, skipped_rows;
    double sim_end_s;                  /* time the last request finished */
    double wall_s;
    int64_t events, steps;
    int64_t in_tokens, out_tokens, hit_tokens, computed_rows, replay_rows, trimmed_layer_rows;
    int64_t cache_lookups_blocks, cache_hit_blocks, evictions;
    double flops, bytes, trimmed_flops, draft_flops, busy_s;
    double flops_c[V41_OP_NCLASS], time_c[V41_OP_NCLASS];
    int64_t verify_steps, drafted, accepted;
    double peak_window, peak_comp, peak_index, peak_state, peak_dspark, peak_cache, peak_total;
    double capacity;
    int gpus;
    v41_hist ttft, tpot, e2e;
} v41_sim_result;

int v41_sim_run(const v41_sim_opts *o, v41_trace *tr, const v41_sim_sinks *sinks, v41_sim_result *res,
                v41_err *err);

/* ------------------------------------------------------------------ outputs */

typedef struct v41_sim_out v41_sim_out;
/* Opens DIR/requests.csv, DIR/kv.csv and DIR/sim.h5 under temporary names. */
int v41_sim_out_open(const char *dir, v41_sim_out **out, v41_err *err);
void v41_sim_out_sinks(v41_sim_out *o, v41_sim_sinks *s);
/* Writes summary.json and renames everything into place; params_json: the run's
 * parameters as a JSON object text (may be NULL). */
int v41_sim_out_close(v41_sim_out *o, const v41_sim_opts *opts, const v41_sim_result *r, const char *params_json,
                      v41_err *err);
void v41_sim_out_abort(v41_sim_out *o);
/* Summary as JSON text (malloc'd). */
char *v41_sim_summary_json(const v41_sim_opts *opts, const v41_sim_result *r, const char *params_json);
void v41_sim_summary_print(FILE *f, const v41_sim_opts *opts, const v41_sim_result *r);
/* Collect DIR/summary.json (or DIR/run-N/summary.json) of sweep runs into one CSV. */
int v41_sim_merge(char **dirs, int n, const char *out_csv, v41_err *err);

#ifdef __cplusplus
}
#endif
#endif
