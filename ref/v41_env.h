/* v41_env.h: the environment variables v41 reads, in one table, and their checked readers
 * (internal; C11 and C++: ref/, harness/ and gpu/ include it).
 *
 * Switches (0 or 1) and numbers that select a code path for A/B runs and tests are read where
 * they are used, often at every call. A malformed value used to fall back to the default without
 * a word (V41_WQ_TAIL=12 ran the default 16; V41_WQ_NO_GEMV=no turned the decode kernel off), so an
 * A/B run could measure something other than what it was asked to. Now:
 *  - every reader checks the value against the table: a malformed one is an error naming the
 *    variable, its value and what it accepts, and exits with status 2 (they are read deep inside
 *    kernel launches, where no error path reaches the user);
 *  - v41_env_check(), run by `v41` and `v41_gpu_bench` before any work, checks every V41_*
 *    variable of the environment up front (so no output is half-written when one is bad) and
 *    warns about V41_* names v41 does not read (a misspelt switch does nothing).
 * A switch is off when unset or empty. `v41 help env` prints the table. */
#ifndef V41_ENV_H
#define V41_ENV_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* environ (_GNU_SOURCE) */

typedef enum {
    V41_ENVK_FLAG, /* 0 or 1 */
    V41_ENVK_INT,  /* a whole number in [lo, hi]; with a choice list (0-terminated "a|b|c"), one of those */
    V41_ENVK_STR   /* free text (paths, inject specs): not checked here */
} v41_env_kind;

typedef struct {
    const char *name;
    v41_env_kind kind;
    long lo, hi;
    const char *choices; /* V41_ENVK_INT: "0|8|16" restricts to those values; NULL: any in [lo, hi] */
    const char *what;
} v41_env_var;

/* every V41_* variable that v41's programs, tests, scripts and notebooks read */
static const v41_env_var v41_env_vars[] = {
    /* GPU engine and kernels (gpu/) */
    {"V41_GPU_VERBOSE", V41_ENVK_FLAG, 0, 1, NULL, "1: the GPU engine reports its path choices on stderr"},
    {"V41_GPU_RESIDENT", V41_ENVK_FLAG, 0, 1, NULL, "0: decode batches run the hybrid path, not the device-resident step (default 1)"},
    {"V41_GPU_GRAPH", V41_ENVK_FLAG, 0, 1, NULL, "0: the device-resident decode step is launched without CUDA-graph replay (default 1)"},
    {"V41_NO_PDL", V41_ENVK_FLAG, 0, 1, NULL, "1: no programmatic dependent launches"},
    {"V41_ATTN_NO_WGMMA", V41_ENVK_FLAG, 0, 1, NULL, "1: sparse attention without the wgmma kernel"},
    {"V41_ATTN_MERGE_PULL", V41_ENVK_FLAG, 0, 1, NULL, "1: the attention's two-CTA merge pulls the peer's partials"},
    {"V41_ATTN_DEPTH", V41_ENVK_INT, 1, 2, NULL, "1 or 2: the attention's gather depth (default: chosen per call)"},
    {"V41_TOPK_NO_CLUSTER", V41_ENVK_FLAG, 0, 1, NULL, "1: the indexer's top-k without thread-block clusters"},
    {"V41_WQ_NO_WGMMA", V41_ENVK_FLAG, 0, 1, NULL, "1: storage-format Linears without the wgmma kernel"},
    {"V41_WQ_NO_GEMV", V41_ENVK_FLAG, 0, 1, NULL, "1: storage-format Linears without the decode kernel"},
    {"V41_WQ_NO_CLUSTER", V41_ENVK_FLAG, 0, 1, NULL, "1: split-K partials summed by a second kernel, not in a cluster"},
    {"V41_WQ_REDUCE1", V41_ENVK_FLAG, 0, 1, NULL, "1: the split-K reduction one element a thread"},
    {"V41_WQ_F8MMA", V41_ENVK_FLAG, 0, 1, NULL, "1: fp8 Linears as fp8 tensor-core MMAs (reduced-precision accumulation)"},
    {"V41_WQ_GEMV16", V41_ENVK_FLAG, 0, 1, NULL, "0: grouped decode-kernel calls take 8 rows a pass, not 16 (default 1)"},
    {"V41_WQ_SPLITS", V41_ENVK_INT, 1, 4096, NULL, "split-K count of the storage-format Linears (default: chosen per call)"},
    {"V41_WQ_TAIL", V41_ENVK_INT, 0, 16, "0|8|16", "tail rows of the grouped wgmma kernel (default 16)"},
    /* CPU reference and serving (ref/) */
    {"V41_ATTN_C", V41_ENVK_FLAG, 0, 1, NULL, "1: ref's attention and indexer dots in plain C, not the AVX2 kernels"},
    {"V41_GEMM_ONE_COLUMN", V41_ENVK_FLAG, 0, 1, NULL, "1: ref's GEMM one column at a time (testing)"},
    {"V41_DSPARK_ALIGN", V41_ENVK_INT, 1, 4096, NULL, "DSpark block alignment of the serving layer (default: 0, or 64 with the padding fault)"},
    {"V41_INJECT", V41_ENVK_STR, 0, 0, NULL, "fault injection spec (the --inject of `v41 run`)"},
    {"V41_BENCH_REEXEC", V41_ENVK_STR, 0, 0, NULL, "internal: set by `v41 bench ref` when it re-runs itself with huge pages"},
    /* tests, scripts and notebooks */
    {"V41_SRCDIR", V41_ENVK_STR, 0, 0, NULL, "source tree (tests, notebooks)"},
    {"V41_BUILDDIR", V41_ENVK_STR, 0, 0, NULL, "build tree (tests, notebooks)"},
    {"V41_ORACLE_DIR", V41_ENVK_STR, 0, 0, NULL, "the oracle's folder (tests)"},
    {"V41_FAULTS_ENGINE", V41_ENVK_STR, 0, 0, NULL, "ref or gpu (tests/test_serving_faults.sh)"},
    {"V41_NB_OUT", V41_ENVK_STR, 0, 0, NULL, "where the notebooks save figures"},
    {"V41_DUMP_A", V41_ENVK_STR, 0, 0, NULL, "notebooks: dump A"},
    {"V41_DUMP_B", V41_ENVK_STR, 0, 0, NULL, "notebooks: dump B"},
    {"V41_BISECT_JSON", V41_ENVK_STR, 0, 0, NULL, "notebooks: a `v41 bisect --json` file"},
    {"V41_DIFF_JSON", V41_ENVK_STR, 0, 0, NULL, "notebooks: a `v41 diff --json` file"},
    {"V41_REPLAY_JSON", V41_ENVK_STR, 0, 0, NULL, "notebooks: a `v41 replay-study --json` file"},
    {"V41_REPLAY_LENGTHS", V41_ENVK_STR, 0, 0, NULL, "notebooks: replay lengths to study"},
    {"V41_SIM_NOTEBOOK_LIMIT", V41_ENVK_STR, 0, 0, NULL, "notebooks: requests the simulator notebook reads"},
};
#define V41_ENV_NVARS (sizeof v41_env_vars / sizeof v41_env_vars[0])

static inline const v41_env_var *v41_env_find(const char *name, size_t len)
{
    for (size_t i = 0; i < V41_ENV_NVARS; i++)
        if (!strncmp(v41_env_vars[i].name, name, len) && !v41_env_vars[i].name[len]) return &v41_env_vars[i];
    return NULL;
}

/* whether value s is valid for v (the parsed number in *out); "" never reaches here */
static inline int v41_env_parse(const v41_env_var *v, const char *s, long *out)
{
    if (v->kind == V41_ENVK_STR) return 1;
    char *end;
    const long x = strtol(s, &end, 10);
    if (*end || end == s || s[0] == ' ' || s[0] == '+' || x < v->lo || x > v->hi) return 0;
    if (v->choices) {
        int hit = 0;
        for (const char *c = v->choices; *c;) {
            char *e2;
            if (strtol(c, &e2, 10) == x) hit = 1;
            c = *e2 == '|' ? e2 + 1 : e2;
        }
        if (!hit) return 0;
    }
    *out = x;
    return 1;
}

/* what v accepts, for messages */
static inline void v41_env_accepts(const v41_env_var *v, char *buf, size_t n)
{
    if (v->kind == V41_ENVK_FLAG) snprintf(buf, n, "0 or 1");
    else if (v->choices) snprintf(buf, n, "one of %s", v->choices);
    else snprintf(buf, n, "a whole number in [%ld, %ld]", v->lo, v->hi);
}

/* the error of a malformed value s of v (both the readers and the up-front check print it) */
static inline void v41_env_bad(FILE *f, const v41_env_var *v, const char *s)
{
    char acc[64];
    v41_env_accepts(v, acc, sizeof acc);
    fprintf(f, "v41: environment variable %s='%s': expected %s; %s: %s\n", v->name, s, acc, v->name, v->what);
}

/* the value of variable name (in the table: a programming error otherwise, reported and exit 2):
 * def when unset or empty, else its number; a malformed value is reported and exits with status 2 */
static inline long v41_env_long(const char *name, long def)
{
    const v41_env_var *v = v41_env_find(name, strlen(name));
    if (!v || v->kind == V41_ENVK_STR) {
        fprintf(stderr, "v41: internal error: %s is not a numeric variable of ref/v41_env.h\n", name);
        exit(2);
    }
    const char *s = getenv(name);
    if (!s || !*s) return def;
    long x;
    if (!v41_env_parse(v, s, &x)) {
        v41_env_bad(stderr, v, s);
        exit(2);
    }
    return x;
}
/* a switch: def when unset or empty, else 0 or 1 */
static inline int v41_env_flag(const char *name, int def) { return (int)v41_env_long(name, def); }

/* Check every V41_* variable of envp (a NULL-terminated "NAME=value" list): report each
 * malformed value (an error) and each V41_* name not in the table (a warning), to f. Returns the number of errors; callers exit with status 2 on nonzero. */
static inline int v41_env_check_list(char *const *envp, FILE *f)
{
    int bad = 0;
    for (char *const *p = envp; p && *p; p++) {
        const char *kv = *p, *eq = strchr(kv, '=');
        if (strncmp(kv, "V41_", 4) || !eq) continue;
        const v41_env_var *v = v41_env_find(kv, (size_t)(eq - kv));
        long x;
        if (!v)
            fprintf(f, "v41: warning: environment variable %.*s is not one v41 reads (misspelt? `v41 help env` lists them)\n",
                    (int)(eq - kv), kv);
        else if (eq[1] && !v41_env_parse(v, eq + 1, &x)) {
            v41_env_bad(f, v, eq + 1);
            bad++;
        }
    }
    return bad;
}

/* v41_env_check_list of the process's environment, reports on stderr */
static inline int v41_env_check(void) { return v41_env_check_list(environ, stderr); }

/* the table, for `v41 help env` */
static inline void v41_env_print(FILE *f)
{
    fprintf(f, "Environment variables v41 reads (switches are off when unset or empty; a malformed value\n"
               "is an error, exit 2; `v41` warns about V41_* names not listed here):\n\n");
    for (size_t i = 0; i < V41_ENV_NVARS; i++) {
        const v41_env_var *v = &v41_env_vars[i];
        char acc[64];
        if (v->kind == V41_ENVK_STR) snprintf(acc, sizeof acc, "text");
        else v41_env_accepts(v, acc, sizeof acc);
        fprintf(f, "  %-22s %-28s %s\n", v->name, acc, v->what);
    }
}

#endif /* V41_ENV_H */
