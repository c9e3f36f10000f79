/* v41 diff A.h5 B.h5: compare two dumps in execution order (README.md, section 'Harness'). */
#include "config.h"
#include "v41_cli.h"
#include "v41_diff.h"
#include <stdlib.h>
#include <string.h>

static void diff_usage(FILE *f)
{
    fprintf(f,
        "usage: v41 diff A.h5 B.h5 [--atol X] [--rtol Y] [--only PATTERN] [--json] [--quiet] [--verbose]\n                [--ignore-missing]\n"
        "\n"
        "Compare two v41 dumps tap by tap in execution order (step, then producing op).\n"
        "A is the reference: the pass rule per element is |a-b| <= atol + rtol*|a|.\n"
        "Without --atol/--rtol each tap gets defaults from its kind and the dumps' precision\n"
        "(bf16 level: rtol = 2^-6, atol = 2^-6*max|a|; fp32 level when both dumps are fp32:\n"
        "rtol = 2^-13, atol = 2^-13*max|a|). Discrete taps (top-k lists, expert choices,\n"
        "tokens, masks) are compared as sets per row and reported as decision flips.\n"
        "\n"
        "  --atol X        absolute tolerance for every continuous tap\n"
        "  --rtol Y        relative tolerance for every continuous tap\n"
        "  --only PATTERN  glob list of tap names (e.g. 'layer.3.*,logits')\n"
        "  --json          machine-readable report on stdout\n"
        "  --quiet         print nothing; the exit status says it\n"
        "  --verbose       list passing taps too\n"
        "  --ignore-missing  taps present in only one dump do not count as differences\n"
        "                  (partial dumps: a golden conversion, a user engine's subset)\n"
        "\n"
        "Exit status: 0 same within tolerance, 1 different (incl. shape mismatch, missing\n"
        "taps), 2 error (missing file, not a v41 dump, schema version mismatch).\n");
}

static int parse_double(const char *s, double *v)
{
    char *end;
    *v = strtod(s, &end);
    return *s && !*end && *v >= 0 ? 0 : -1;
}

int v41_cmd_diff(int argc, char **argv)
{
    v41_diff_opts o;
    v41_diff_opts_default(&o);
    const char *files[2] = {NULL, NULL};
    int nf = 0;
    bool json = false, quiet = false, verbose = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { diff_usage(stdout); return 0; }
        else if ((!strcmp(a, "--atol") || !strcmp(a, "--rtol") || !strcmp(a, "--only")) && i + 1 >= argc) {
            fprintf(stderr, "v41 diff: %s needs a value\n", a);
            return 2;
        } else if (!strcmp(a, "--atol")) {
            if (parse_double(argv[++i], &o.atol)) { fprintf(stderr, "v41 diff: bad --atol '%s'\n", argv[i]); return 2; }
            o.atol_set = true;
        } else if (!strcmp(a, "--rtol")) {
            if (parse_double(argv[++i], &o.rtol)) { fprintf(stderr, "v41 diff: bad --rtol '%s'\n", argv[i]); return 2; }
            o.rtol_set = true;
        } else if (!strcmp(a, "--only")) o.only = argv[++i];
        else if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "--ignore-missing")) o.ignore_missing = true;
        else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) quiet = true;
        else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) verbose = true;
        else if (a[0] == '-' && a[1]) { fprintf(stderr, "v41 diff: unknown option '%s' (see v41 diff --help)\n", a); return 2; }
        else if (nf < 2) files[nf++] = a;
        else { fprintf(stderr, "v41 diff: too many arguments\n"); return 2; }
    }
    if (nf != 2) { diff_usage(stderr); return 2; }
    v41_err err = {0};
    v41_diff_report *r = NULL;
    if (v41_diff_files(files[0], files[1], &o, &r, &err)) {
        if (!quiet || 1) fprintf(stderr, "v41 diff: %s\n", err.msg);
        return 2;
    }
    if (json && !quiet) {
        char *s = v41_diff_json(r);
        if (s) { fputs(s, stdout); fputc('\n', stdout); free(s); }
    } else if (!quiet) {
        v41_diff_print(r, stdout, verbose);
    }
    int rc = r->n_fail ? 1 : 0;
    v41_diff_report_free(r);
    return rc;
}
