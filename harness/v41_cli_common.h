/* v41_cli_common.h: options shared by run, bisect and parity (inputs,
 * steps, model) and the run driver. Private to the v41 binary. */
#ifndef V41_CLI_COMMON_H
#define V41_CLI_COMMON_H

#include "v41_runner.h"
#include <stdio.h>

typedef struct v41_cli_common {
    const char *model;        /* "tiny" default */
    bool model_set;
    const char *prompt_file;
    int rand_n, rand_len;
    uint64_t seed;
    int steps;
    bool dspark, no_dspark;
    bool no_replay;           /* --no-replay: bounded replay off (SPEC §7) */
    int dspark_align;         /* --dspark-align N: DSpark index-list padding width alignment */
    const char *taps;
    const char *inject;
    int threads;
    v41_compat compat;
    bool json;
} v41_cli_common;

void v41_cli_common_init(v41_cli_common *c);
/* 1 = consumed argv[*i] (and its value; *i advanced), 0 = not a common option, -1 = error. */
int v41_cli_common_arg(v41_cli_common *c, int argc, char **argv, int *i, v41_err *err);
int v41_cli_inputs(const v41_cli_common *c, const v41_model *m, v41_run_inputs *in, v41_err *err);
void v41_cli_command_line(int argc, char **argv, char *buf, size_t cap);
const char *v41_cli_common_help(void);

#endif

/* ---- bisect core (cmd_bisect.c), shared with parity ---- */
#include "v41_diff.h"

typedef struct v41_bisect_side_err {
    int taps, fail, flips;
    double nrmse;             /* worst sqrt(NMSE) = RMS error / RMS(a) over the group's continuous taps */
    double max_abs;           /* worst max |a-b| */
    char first_tap[V41_DUMP_NAME_MAX]; /* first failing tap of the group ("" = none) */
} v41_bisect_side_err;

typedef struct v41_bisect_group {
    int step, layer;
    char sublayer[16];
    v41_bisect_side_err local, prop;
} v41_bisect_group;

typedef struct v41_bisect_result {
    v41_diff_report *prop;    /* A free vs B free */
    v41_diff_report *local;   /* A free vs B teacher-forced on A (NULL when skipped) */
    v41_bisect_group *g;
    size_t n;
    long first_local, first_prop;  /* group indices, -1 = none */
    char a_name[32], b_name[32], inject[256];
    char a_path[4096], b_path[4096], bf_path[4096];
    long forced_hits;
} v41_bisect_result;

typedef struct v41_bisect_cfg {
    v41_side a, b;
    const char *inject;       /* applied to side B only */
    const v41_cli_common *c;
    const v41_diff_opts *dopts;
    const char *keep_dir;     /* keep the three dumps there (NULL = temp dir, removed) */
    bool progress;
    const char *command;
    bool forced_only_if_differ; /* parity: skip the teacher-forced run when A and B agree */
} v41_bisect_cfg;

int v41_bisect_run(const v41_model *m, const v41_run_inputs *in, const v41_bisect_cfg *cfg, v41_bisect_result *res,
                   v41_err *err);
void v41_bisect_print(const v41_bisect_result *r, FILE *f, bool all);
char *v41_bisect_json(const v41_bisect_result *r);   /* malloc'd */
void v41_bisect_result_free(v41_bisect_result *r);
