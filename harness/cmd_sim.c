/* cmd_sim.c: `v41 sim`, the trace-driven serving simulator (README.md, section 'Simulator').
 * Parses options into v41_sim_opts, runs one simulation, one index of a
 * parameter sweep, or merges sweep outputs. */
#include "v41_cli.h"
#include "v41_sim.h"
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cjson/cJSON.h>

static void usage(FILE *f)
{
    fprintf(f,
"usage: v41 sim --trace FILE [OPTIONS]          simulate a request trace\n"
"       v41 sim --synth SPEC [OPTIONS]          simulate a synthetic trace\n"
"       v41 sim --synth SPEC --write-trace FILE write the synthetic trace as Mooncake JSONL\n"
"       v41 sim ... --sweep 'P=v1,v2;Q=...' --out DIR [--sweep-index I|all]\n"
"       v41 sim --merge DIR... [--merge-out FILE.csv]\n"
"       v41 sim --validate SERVE.json [--profile P] [--fit | --fit-from CAL | --calibration FIT]\n"
"                                               predicted vs measured step latency\n"
"\n"
"Discrete-event simulation of continuous-batching replicas serving a trace, with\n"
"per-step cost from the model's FLOP/byte counts and measured or roofline rates.\n"
"\n"
"trace:\n"
"  --trace FILE            Mooncake JSONL or Azure 2023 CSV\n"
"  --format F              mooncake | azure | auto (default: by extension, then content)\n"
"  --lenient               skip malformed rows (counted) instead of failing with file:line\n"
"  --limit N               simulate only the first N requests\n"
"  --synth SPEC            synthetic trace, SPEC = key=value,... with n, rate (req/s),\n"
"                          arrival=poisson|gamma, cv, in=DIST, out=DIST, groups, prefix,\n"
"                          block, seed; DIST = fixed:N | uniform:A:B | lognormal:MEAN:SIGMA | exp:MEAN\n"
"  --block-tokens N        tokens per prefix block of hash_ids (default 512, Mooncake)\n"
"model and cost:\n"
"  --model M               flash (default, SPEC §1 V4.1-Flash) | tiny | CONFIG.json | checkpoint dir\n"
"  --profile FILE          measured rates, schema v41-profile/1 (default: H200 roofline)\n"
"  --calibration FILE      calibrated step time: the --json output of `v41 sim --validate\n"
"                          ... --fit|--fit-from` (c0 + per-class multipliers + per-row and\n"
"                          per-request terms); for engines with host overheads\n"
"  --gpus N|auto           GPUs per replica (auto: weights fit in 60%% of HBM)\n"
"  --launch-us X           per-kernel launch overhead of the roofline model (default 2)\n"
"server:\n"
"  --replay on|off|enc|dec bounded replay, SPEC §7: encoder side, decoder side, both (default on)\n"
"  --dspark off|LEN        DSpark speculation with LEN drafts per step (default off)\n"
"  --accept MODEL          fixed:P (fraction P of drafts accepted) | geom:P (each draft accepted\n"
"                          with prob. P until the first miss, default geom:0.8) | file:SERVE_TRACE.json\n"
"  --replicas N            replicas behind the router (default 1)\n"
"  --router rr|least       round robin or least outstanding requests (default least)\n"
"  --token-budget N        rows per step (default 8192)\n"
"  --max-seqs N            running requests per replica (default 256)\n"
"  --kv-capacity B|auto    KV bytes per replica (suffix K, M, G, T allowed; auto = 90%% HBM - weights)\n"
"  --seed N                RNG seed (acceptance sampling)\n"
"output:\n"
"  --out DIR               requests.csv, kv.csv, sim.h5, summary.json\n"
"  --json                  print the summary as JSON instead of a table\n"
"  --sample-dt S           KV timeline period in simulated seconds (default 1)\n"
"  --no-progress           no progress bar (shown only when stderr is a terminal)\n"
"sweeps:\n"
"  --sweep SPEC            'param=v1,v2;param2=w1,w2': the cartesian product of option values\n"
"                          (param = any option name above without --); needs --out DIR\n"
"  --sweep-index I|all     run combination I (row-major, last param fastest) into DIR/run-IIII;\n"
"                          without it, print the combinations\n"
"  --merge DIR...          collect summary.json of runs into one CSV (stdout or --merge-out)\n"
"\n"
"Exit status: 0 ok, 2 bad input or error.\n");
}

static int parse_bytes(const char *s, double *out)
{
    char *e;
    errno = 0;
    double v = strtod(s, &e);
    if (e == s || errno || !(v > 0)) return -1;
    double mul = 1;
    if (*e == 'K' || *e == 'k') mul = 1e3, e++;
    else if (*e == 'M') mul = 1e6, e++;
    else if (*e == 'G') mul = 1e9, e++;
    else if (*e == 'T') mul = 1e12, e++;
    if (*e == 'B') e++;
    if (*e) return -1;
    *out = v * mul;
    return 0;
}

/* a whole number >= lo (v41_cli_parse_int, the parser of every command's integer options) */
static int parse_i64(const char *s, int64_t lo, int64_t *out)
{
    long v;
    if (v41_cli_parse_int(s, (long)lo, LONG_MAX, &v)) return -1;
    *out = v;
    return 0;
}

typedef struct cli {
    v41_sim_opts o;
    v41_profile prof;
    v41_calib calib;
    const char *trace, *format, *synth, *write_trace, *model, *profile, *calibration, *out;
    bool lenient, json;
    int progress;  /* -1 auto */
} cli;

static int bad(const char *opt, const char *val, const char *what)
{
    fprintf(stderr, "v41 sim: %s %s: %s\n", opt, val ? val : "", what);
    return 2;
}

/* Options that take a value (the sweep reuses this list for param names). */
static const char *valopts[] = {"trace", "format", "limit", "synth", "write-trace", "block-tokens", "model", "profile",
                                "calibration",
                                "gpus", "launch-us", "replay", "dspark", "accept", "replicas", "router",
                                "token-budget", "max-seqs", "kv-capacity", "seed", "out", "sample-dt", NULL};

static int parse(int argc, char **argv, cli *c)
{
    memset(c, 0, sizeof *c);
    v41_sim_opts_default(&c->o);
    c->model = "flash";
    c->progress = -1;
    v41_err err = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--lenient")) { c->lenient = true; continue; }
        if (!strcmp(a, "--json")) { c->json = true; continue; }
        if (!strcmp(a, "--no-progress")) { c->progress = 0; continue; }
        if (!strcmp(a, "--progress")) { c->progress = 1; continue; }
        bool known = false;
        for (int k = 0; valopts[k]; k++)
            if (!strncmp(a, "--", 2) && !strcmp(a + 2, valopts[k])) known = true;
        if (!known) return bad(a, NULL, "unknown option (see v41 sim --help)");
        if (i + 1 >= argc) return bad(a, NULL, "needs a value");
        const char *v = argv[++i];
        int64_t n;
        double x;
        char *e;
        if (!strcmp(a, "--trace")) c->trace = v;
        else if (!strcmp(a, "--format")) {
            if (strcmp(v, "mooncake") && strcmp(v, "azure") && strcmp(v, "auto")) return bad(a, v, "expected mooncake, azure or auto");
            c->format = v;
        } else if (!strcmp(a, "--limit")) {
            if (parse_i64(v, 1, &n)) return bad(a, v, "expected an integer >= 1");
            c->o.limit = n;
        } else if (!strcmp(a, "--synth")) c->synth = v;
        else if (!strcmp(a, "--write-trace")) c->write_trace = v;
        else if (!strcmp(a, "--block-tokens")) {
            if (parse_i64(v, 1, &n)) return bad(a, v, "expected an integer >= 1");
            c->o.block_tokens = n;
        } else if (!strcmp(a, "--model")) c->model = v;
        else if (!strcmp(a, "--profile")) c->profile = strcmp(v, "none") ? v : NULL;
        else if (!strcmp(a, "--calibration")) c->calibration = strcmp(v, "none") ? v : NULL;
        else if (!strcmp(a, "--gpus")) {
            if (!strcmp(v, "auto")) c->o.hw.gpus = 0;
            else if (parse_i64(v, 1, &n) || n > 4096) return bad(a, v, "expected auto or an integer >= 1");
            else c->o.hw.gpus = (int)n;
        } else if (!strcmp(a, "--launch-us")) {
            x = strtod(v, &e);
            if (e == v || *e || !(x >= 0)) return bad(a, v, "expected a number >= 0");
            c->o.hw.launch_s = x * 1e-6;
        } else if (!strcmp(a, "--replay")) {
            if (!strcmp(v, "on")) c->o.replay_enc = c->o.replay_dec = true;
            else if (!strcmp(v, "off")) c->o.replay_enc = c->o.replay_dec = false;
            else if (!strcmp(v, "enc")) c->o.replay_enc = true, c->o.replay_dec = false;
            else if (!strcmp(v, "dec")) c->o.replay_enc = false, c->o.replay_dec = true;
            else return bad(a, v, "expected on, off, enc or dec");
        } else if (!strcmp(a, "--dspark")) {
            if (!strcmp(v, "off") || !strcmp(v, "0")) c->o.draft_len = 0;
            else if (parse_i64(v, 1, &n) || n > V41_ACC_MAXLEN) return bad(a, v, "expected off or a draft length 1..64");
            else c->o.draft_len = (int)n;
        } else if (!strcmp(a, "--accept")) {
            if (v41_accept_parse(v, &c->o.accept, &err)) { fprintf(stderr, "v41 sim: %s\n", err.msg); return 2; }
        } else if (!strcmp(a, "--replicas")) {
            if (parse_i64(v, 1, &n) || n > 4096) return bad(a, v, "expected an integer 1..4096");
            c->o.replicas = (int)n;
        } else if (!strcmp(a, "--router")) {
            if (!strcmp(v, "rr")) c->o.router = V41_ROUTE_RR;
            else if (!strcmp(v, "least")) c->o.router = V41_ROUTE_LEAST;
            else return bad(a, v, "expected rr or least");
        } else if (!strcmp(a, "--token-budget")) {
            if (parse_i64(v, 1, &n)) return bad(a, v, "expected an integer >= 1");
            c->o.token_budget = n;
        } else if (!strcmp(a, "--max-seqs")) {
            if (parse_i64(v, 1, &n) || n > 1000000) return bad(a, v, "expected an integer >= 1");
            c->o.max_seqs = (int)n;
        } else if (!strcmp(a, "--kv-capacity")) {
            if (!strcmp(v, "auto")) c->o.kv_capacity = 0;
            else if (parse_bytes(v, &c->o.kv_capacity)) return bad(a, v, "expected auto or bytes > 0 (e.g. 80G)");
        } else if (!strcmp(a, "--seed")) {
            if (parse_i64(v, 0, &n)) return bad(a, v, "expected an integer >= 0");
            c->o.seed = (uint64_t)n;
        } else if (!strcmp(a, "--out")) c->out = v;
        else if (!strcmp(a, "--sample-dt")) {
            x = strtod(v, &e);
            if (e == v || *e || !(x >= 0)) return bad(a, v, "expected seconds >= 0");
            c->o.sample_dt = x;
        }
    }
    return 0;
}

/* Run one simulation from parsed options. */
static int run_one(cli *c, const char *params_json)
{
    v41_err err = {0};
    if (!!c->trace == !!c->synth) {
        fprintf(stderr, "v41 sim: give exactly one of --trace FILE or --synth SPEC (see v41 sim --help)\n");
        return 2;
    }
    v41_trace *tr = NULL;
    int rc = c->trace ? v41_trace_open(c->trace, c->format, c->lenient, &tr, &err)
                      : v41_trace_open_synth(c->synth, &tr, &err);
    if (rc) { fprintf(stderr, "v41 sim: %s\n", err.msg); return 2; }
    if (c->write_trace) {
        char tmp[4200];
        snprintf(tmp, sizeof tmp, "%s.tmp", c->write_trace);
        FILE *f = fopen(tmp, "w");
        if (!f) { fprintf(stderr, "v41 sim: --write-trace %s: %s\n", c->write_trace, strerror(errno)); v41_trace_close(tr); return 2; }
        rc = v41_trace_write_jsonl(tr, f, c->o.limit, &err);
        v41_trace_close(tr);
        if (fclose(f) || rc || rename(tmp, c->write_trace)) {
            unlink(tmp);
            fprintf(stderr, "v41 sim: --write-trace %s: %s\n", c->write_trace, rc ? err.msg : "write error");
            return 2;
        }
        return 0;
    }
    if (v41_sim_config_get(c->model, &c->o.cfg, &err)) {
        fprintf(stderr, "v41 sim: --model %s: %s\n", c->model, err.msg);
        v41_trace_close(tr);
        return 2;
    }
    snprintf(c->o.model_name, sizeof c->o.model_name, "%s", c->model);
    if (c->profile) {
        if (v41_profile_load(c->profile, &c->prof, &err)) {
            fprintf(stderr, "v41 sim: %s\n", err.msg);
            v41_trace_close(tr);
            return 2;
        }
        c->o.profile = &c->prof;
    }
    if (c->calibration) {
        if (v41_calib_load(c->calibration, &c->calib, &err)) {
            fprintf(stderr, "v41 sim: %s\n", err.msg);
            v41_trace_close(tr);
            return 2;
        }
        c->o.calib = &c->calib;
    }
    c->o.progress = c->progress < 0 ? v41_isatty_stderr() : c->progress;
    v41_sim_out *out = NULL;
    v41_sim_sinks sinks = {0};
    if (c->out) {
        if (v41_sim_out_open(c->out, &out, &err)) {
            fprintf(stderr, "v41 sim: %s\n", err.msg);
            v41_trace_close(tr);
            return 2;
        }
        v41_sim_out_sinks(out, &sinks);
    }
    v41_sim_result *res = malloc(sizeof *res);
    if (!res) { v41_sim_out_abort(out); v41_trace_close(tr); fprintf(stderr, "v41 sim: out of memory\n"); return 2; }
    rc = v41_sim_run(&c->o, tr, &sinks, res, &err);
    v41_trace_close(tr);
    if (rc) {
        fprintf(stderr, "v41 sim: %s\n", err.msg);
        v41_sim_out_abort(out);
        free(res);
        return 2;
    }
    if (out && v41_sim_out_close(out, &c->o, res, params_json, &err)) {
        fprintf(stderr, "v41 sim: %s\n", err.msg);
        free(res);
        return 2;
    }
    if (c->json) {
        char *js = v41_sim_summary_json(&c->o, res, params_json);
        puts(js);
        free(js);
    } else {
        v41_sim_summary_print(stdout, &c->o, res);
        if (res->skipped_rows) printf("  (--lenient: %lld malformed rows skipped)\n", (long long)res->skipped_rows);
    }
    free(res);
    return 0;
}

/* ---- sweeps */

typedef struct sweep {
    int np;
    char *name[16];
    char *vals[16][64];
    int nv[16];
    char *buf;
} sweep;

static int sweep_parse(const char *spec, sweep *s)
{
    memset(s, 0, sizeof *s);
    s->buf = strdup(spec);
    char *p = s->buf, *part;
    while ((part = strsep(&p, ";"))) {
        if (!*part) continue;
        char *eq = strchr(part, '=');
        if (!eq || eq == part || s->np >= 16) return -1;
        *eq = 0;
        bool ok = false;
        for (int k = 0; valopts[k]; k++)
            if (!strcmp(part, valopts[k])) ok = true;
        if (!ok || !strcmp(part, "out") || !strcmp(part, "write-trace")) {
            fprintf(stderr, "v41 sim: --sweep: unknown parameter '%s'\n", part);
            return -1;
        }
        int i = s->np++;
        s->name[i] = part;
        char *q = eq + 1, *v;
        while ((v = strsep(&q, ","))) {
            if (!*v) continue;
            if (s->nv[i] >= 64) return -1;
            s->vals[i][s->nv[i]++] = v;
        }
        if (!s->nv[i]) return -1;
    }
    return s->np ? 0 : -1;
}

static long sweep_count(const sweep *s)
{
    long n = 1;
    for (int i = 0; i < s->np; i++) n *= s->nv[i];
    return n;
}

static void sweep_pick(const sweep *s, long idx, int *pick)
{
    for (int i = s->np - 1; i >= 0; i--) {
        pick[i] = (int)(idx % s->nv[i]);
        idx /= s->nv[i];
    }
}

static int run_sweep_index(int argc, char **argv, const sweep *s, long idx, const char *outdir)
{
    int pick[16];
    sweep_pick(s, idx, pick);
    char **av = calloc((size_t)argc + 2 * (size_t)s->np + 3, sizeof *av);
    char names[16][80], dir[4200];
    int n = 0;
    for (int i = 0; i < argc; i++) av[n++] = argv[i];
    for (int i = 0; i < s->np; i++) {
        snprintf(names[i], sizeof names[i], "--%s", s->name[i]);
        av[n++] = names[i];
        av[n++] = s->vals[i][pick[i]];
    }
    snprintf(dir, sizeof dir, "%s/run-%04ld", outdir, idx);
    av[n++] = "--out";
    av[n++] = dir;
    cJSON *pj = cJSON_CreateObject();
    cJSON_AddNumberToObject(pj, "sweep_index", (double)idx);
    for (int i = 0; i < s->np; i++) cJSON_AddStringToObject(pj, s->name[i], s->vals[i][pick[i]]);
    char *params = cJSON_PrintUnformatted(pj);
    cJSON_Delete(pj);
    cli c;
    int rc = parse(n, av, &c);
    if (!rc) rc = run_one(&c, params);
    free(params);
    free(av);
    return rc;
}

int v41_cmd_sim(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(stdout); return 0; }
    if (argc < 2) { usage(stderr); return 2; }
    if (!strcmp(argv[1], "--validate")) return v41_sim_validate(argc, argv);
    /* merge mode */
    if (!strcmp(argv[1], "--merge")) {
        const char *mout = NULL;
        char **dirs = calloc((size_t)argc, sizeof *dirs);
        int nd = 0;
        for (int i = 2; i < argc; i++) {
            if (!strcmp(argv[i], "--merge-out") && i + 1 < argc) mout = argv[++i];
            else dirs[nd++] = argv[i];
        }
        if (!nd) { free(dirs); fprintf(stderr, "v41 sim: --merge needs at least one DIR\n"); return 2; }
        v41_err err = {0};
        int rc = v41_sim_merge(dirs, nd, mout, &err);
        free(dirs);
        if (rc) { fprintf(stderr, "v41 sim: %s\n", err.msg); return 2; }
        return 0;
    }
    /* strip sweep options; the rest is a normal command line */
    const char *sw = NULL, *swi = NULL, *outdir = NULL;
    char **base = calloc((size_t)argc + 1, sizeof *base);
    int nb = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--sweep") && i + 1 < argc) sw = argv[++i];
        else if (!strcmp(argv[i], "--sweep-index") && i + 1 < argc) swi = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) { outdir = argv[i + 1]; base[nb++] = argv[i++]; base[nb++] = argv[i]; }
        else if (!strcmp(argv[i], "--merge")) { free(base); return bad("--merge", NULL, "must come first: v41 sim --merge DIR..."); }
        else base[nb++] = argv[i];
    }
    int rc;
    if (!sw) {
        if (swi) { free(base); return bad("--sweep-index", swi, "needs --sweep"); }
        cli c;
        rc = parse(nb, base, &c);
        if (!rc) rc = run_one(&c, NULL);
        free(base);
        return rc;
    }
    sweep s;
    if (sweep_parse(sw, &s)) { free(s.buf); free(base); return bad("--sweep", sw, "expected 'param=v1,v2;param2=...'"); }
    long total = sweep_count(&s);
    if (!swi) {
        printf("# %ld combinations; run each with --sweep-index I (0..%ld)\n", total, total - 1);
        for (long i = 0; i < total; i++) {
            int pick[16];
            sweep_pick(&s, i, pick);
            printf("%ld", i);
            for (int k = 0; k < s.np; k++) printf(" %s=%s", s.name[k], s.vals[k][pick[k]]);
            putchar('\n');
        }
        free(s.buf);
        free(base);
        return 0;
    }
    if (!outdir) { free(s.buf); free(base); return bad("--sweep", sw, "needs --out DIR"); }
    /* drop --out from base: each index writes DIR/run-IIII */
    int k = 0;
    for (int i = 0; i < nb; i++) {
        if (!strcmp(base[i], "--out")) { i++; continue; }
        base[k++] = base[i];
    }
    nb = k;
    if (!strcmp(swi, "all")) {
        rc = 0;
        for (long i = 0; i < total && !rc; i++) rc = run_sweep_index(nb, base, &s, i, outdir);
    } else {
        int64_t idx;
        if (parse_i64(swi, 0, &idx) || idx >= total) {
            fprintf(stderr, "v41 sim: --sweep-index %s: expected all or 0..%ld\n", swi, total - 1);
            rc = 2;
        } else rc = run_sweep_index(nb, base, &s, (long)idx, outdir);
    }
    free(s.buf);
    free(base);
    return rc;
}
