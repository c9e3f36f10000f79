/* v41_cli.h: subcommands of the `v41` tool. Each returns the process exit
 * status: 0 ok / same, 1 different, 2 error or bad input. argv[0] is the
 * subcommand name; every command handles --help. */
#ifndef V41_CLI_H
#define V41_CLI_H

#include <stdio.h>

typedef int (*v41_cmd_fn)(int argc, char **argv);

int v41_cmd_version(int argc, char **argv);
int v41_cmd_inspect(int argc, char **argv);
int v41_cmd_export_tiny(int argc, char **argv);
int v41_cmd_oracle_check(int argc, char **argv);
int v41_cmd_run(int argc, char **argv);
int v41_cmd_diff(int argc, char **argv);
int v41_cmd_bisect(int argc, char **argv);
int v41_cmd_parity(int argc, char **argv);
int v41_cmd_bench(int argc, char **argv);
int v41_cmd_replay_study(int argc, char **argv);
int v41_cmd_serve_trace(int argc, char **argv);
int v41_cmd_sim(int argc, char **argv);
int v41_cmd_taps(int argc, char **argv);

/* A whole decimal number in [lo, hi] with nothing after it: 0, or -1 (bad or out of range). What every
 * integer option uses, so "--steps abc" or "--threads 1e9" is an error (exit 2), not 0 or a wrap. */
int v41_cli_parse_int(const char *s, long lo, long hi, long *v);
/* The same for an int option: on a bad value prints "CMD: OPT 'S': expected a whole number in [LO, HI]"
 * to stderr and returns -1 (the caller exits 2). hi must fit an int. */
int v41_cli_int_opt(const char *cmd, const char *opt, const char *s, long lo, long hi, int *out);

/* bench sub-targets (v41 bench ref|gpu) */
int v41_bench_ref(int argc, char **argv);
int v41_bench_gpu(int argc, char **argv);
/* v41 sim --validate (harness/sim_validate.c) */
int v41_sim_validate(int argc, char **argv);

/* true when stderr is a terminal (progress lines are shown only then) */
int v41_isatty_stderr(void);

#endif
