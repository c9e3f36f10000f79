/* v41: one binary, one subcommand per job. `v41 help` lists them;
 * `v41 COMMAND --help` describes each. */
#include "config.h"
#include "v41_cli.h"
#include "v41_env.h"
#include <string.h>
#include <unistd.h>

typedef struct {
    const char *name;
    v41_cmd_fn fn;
    const char *summary;
} v41_cmd;

static const v41_cmd cmds[] = {
    {"parity", v41_cmd_parity, "run two engines, diff, bisect on difference, verdict (the main job)"},
    {"run", v41_cmd_run, "prefill + decode steps, dump every tap to HDF5"},
    {"diff", v41_cmd_diff, "compare two dumps, name the first divergent tap and decision flip"},
    {"bisect", v41_cmd_bisect, "teacher-forced per-layer comparison of two engines (local vs propagated error)"},
    {"oracle-check", v41_cmd_oracle_check, "replay a golden file through ref and compare every tensor"},
    {"taps", v41_cmd_taps, "list the tap table (names, dims, dtypes, meaning; --json)"},
    {"inspect", v41_cmd_inspect, "config summary, layer schedule, tensors, parameter count, fingerprint"},
    {"export-tiny", v41_cmd_export_tiny, "write the built-in tiny model as a checkpoint directory"},
    {"bench", v41_cmd_bench, "benchmarks: `v41 bench ref` (CPU) and `v41 bench gpu` (H200)"},
    {"replay-study", v41_cmd_replay_study, "bounded replay on vs off: divergence, KL, agreement, savings"},
    {"serve-trace", v41_cmd_serve_trace, "run a request trace through an engine with continuous batching"},
    {"sim", v41_cmd_sim, "trace-driven serving simulator"},
    {"version", v41_cmd_version, "version and build options"},
};
#define NCMDS (sizeof cmds / sizeof cmds[0])

int v41_isatty_stderr(void) { return isatty(2); }

static void usage(FILE *f)
{
    fprintf(f, "usage: v41 COMMAND [ARGS...]\n\n"
               "DeepSeek-V4.1 reference, dumps, diff/bisect and serving simulator (%s).\n\n"
               "commands:\n", PACKAGE_VERSION);
    for (size_t i = 0; i < NCMDS; i++) fprintf(f, "  %-14s %s\n", cmds[i].name, cmds[i].summary);
    fprintf(f, "\nMODEL arguments are `tiny` (the built-in model, default) or a checkpoint directory.\n"
               "`v41 COMMAND --help` describes a command; `v41 help env` lists the environment variables\n"
               "v41 reads. Exit status: 0 ok/same, 1 different, 2 error.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) { usage(stderr); return 2; }
    const char *c = argv[1];
    if (!strcmp(c, "help") || !strcmp(c, "--help") || !strcmp(c, "-h")) {
        if (argc > 2) {
            if (!strcmp(argv[2], "env")) {
                v41_env_print(stdout);
                return 0;
            }
            for (size_t i = 0; i < NCMDS; i++)
                if (!strcmp(cmds[i].name, argv[2])) {
                    char *hv[] = {argv[2], "--help", NULL};
                    return cmds[i].fn(2, hv);
                }
        }
        usage(stdout);
        return 0;
    }
    if (!strcmp(c, "--version")) c = "version";
    for (size_t i = 0; i < NCMDS; i++)
        if (!strcmp(cmds[i].name, c)) {
            /* the V41_* switches, before any work (a bad one would otherwise stop a command midway) */
            if (v41_env_check()) return 2;
            return cmds[i].fn(argc - 1, argv + 1);
        }
    fprintf(stderr, "v41: unknown command '%s' (see `v41 help`)\n", c);
    return 2;
}
