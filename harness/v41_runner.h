/* v41_runner.h: the run driver shared by `v41 run`, `v41 bisect` and
 * `v41 parity`: inputs (prompt files, random prompts), engine sides
 * ("ref:fp32"), and prefill + K greedy decode steps (+ DSpark drafts) into
 * a dump, optionally teacher-forced from another dump. */
#ifndef V41_RUNNER_H
#define V41_RUNNER_H

#include "v41_dump.h"
#include "v41_engine.h"

typedef struct v41_run_inputs {
    int n_req;
    int *len;          /* [n_req] prompt lengths */
    int32_t **ids;     /* [n_req][len] */
} v41_run_inputs;

/* Text file: one request per line, token ids separated by spaces or commas;
 * '#' starts a comment; blank lines are skipped. */
int v41_run_inputs_load(const char *path, int vocab, v41_run_inputs *in, v41_err *err);
/* N requests of LEN uniform random tokens in [0, vocab) from seed (splitmix64). */
int v41_run_inputs_random(int n, int len, uint64_t seed, int vocab, v41_run_inputs *in, v41_err *err);
void v41_run_inputs_free(v41_run_inputs *in);

/* "ref", "ref:fp32", "gpu", "gpu:emulate" */
typedef struct v41_side {
    char engine[16];
    v41_precision prec;
} v41_side;
int v41_side_parse(const char *s, v41_side *side, v41_err *err);
const char *v41_prec_name(v41_precision p);
void v41_side_name(const v41_side *s, char *buf, size_t cap);

typedef struct v41_run_opts {
    v41_side side;
    v41_compat compat;
    int threads;
    const char *inject;       /* NULL = none (V41_INJECT is ignored unless inject_env) */
    bool replay;
    int dspark_align;         /* DSpark index-list padding alignment (0 = none) */
    int max_requests;         /* engine cache slots (0 = engine default) */
    int steps;                /* decode steps after the prefill */
    bool dspark;              /* DSpark draft after every decode step */
    const char *taps;         /* glob list or NULL = all */
    bool progress;            /* progress line on stderr */
    const char *command;      /* stored in the dump */
    const int32_t *force_tokens; /* [steps][n_req] decode inputs to use instead of own argmax (bisect) */
} v41_run_opts;

void v41_run_opts_default(v41_run_opts *o);

/* Create the engine of a side. V41_EUNSUPPORTED when that engine is absent. */
int v41_run_engine_create(const v41_model *m, const v41_run_opts *o, v41_engine **out, v41_err *err);

/* Prefill all requests in one ragged forward, then o->steps greedy decode
 * forwards (+ drafts). Writes every tap to dump_path (NULL = no dump).
 * tokens_out (optional): [(steps+1)][n_req] greedy tokens of every forward.
 * force: teacher-forcing source or NULL. */
int v41_run_model(const v41_model *m, const v41_run_inputs *in, const v41_run_opts *o, const char *dump_path,
                  v41_tap_source *force, int32_t *tokens_out, v41_err *err);

/* Parse "N:LEN" */
int v41_parse_nlen(const char *s, int *n, int *len);

#endif
