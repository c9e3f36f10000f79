/* v41 run: prefill + K greedy decode steps through an engine, every tap
 * dumped (schema: README.md, section 'Harness'). v41 taps: the tap table.
 * The option parser for inputs is shared with bisect and parity. */
#include "config.h"
#include "v41_cli.h"
#include "v41_cli_common.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

void v41_cli_common_init(v41_cli_common *c)
{
    memset(c, 0, sizeof *c);
    c->model = "tiny";
    c->seed = 1;
    c->steps = 4;
    c->rand_n = 2;
    c->rand_len = 16;
    c->compat = V41_COMPAT_FIXED;
}

static int need(int argc, char **argv, int i, v41_err *err)
{
    if (i + 1 >= argc) return v41_err_set(err, V41_EINVAL, "%s needs a value", argv[i]);
    return 0;
}

int v41_cli_parse_int(const char *s, long lo, long hi, long *v)
{
    char *end;
    errno = 0;
    *v = strtol(s, &end, 10);
    return (end != s && !*end && !errno && *v >= lo && *v <= hi) ? 0 : -1;
}

int v41_cli_int_opt(const char *cmd, const char *opt, const char *s, long lo, long hi, int *out)
{
    long v;
    if (v41_cli_parse_int(s, lo, hi, &v)) {
        fprintf(stderr, "%s: %s '%s': expected a whole number in [%ld, %ld]\n", cmd, opt, s, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

int v41_cli_common_arg(v41_cli_common *c, int argc, char **argv, int *ip, v41_err *err)
{
    int i = *ip;
    const char *a = argv[i];
    long v;
    if (!strcmp(a, "--prompt-ids")) {
        if (need(argc, argv, i, err)) return -1;
        c->prompt_file = argv[++i];
    } else if (!strcmp(a, "--random-prompts")) {
        if (need(argc, argv, i, err)) return -1;
        if (v41_parse_nlen(argv[++i], &c->rand_n, &c->rand_len)) {
            v41_err_set(err, V41_EINVAL, "--random-prompts wants N:LEN, got '%s'", argv[i]);
            return -1;
        }
        c->prompt_file = NULL;
    } else if (!strcmp(a, "--seed")) {
        if (need(argc, argv, i, err)) return -1;
        char *end;
        c->seed = strtoull(argv[++i], &end, 10);
        if (*end || end == argv[i]) { v41_err_set(err, V41_EINVAL, "bad --seed '%s'", argv[i]); return -1; }
    } else if (!strcmp(a, "--steps")) {
        if (need(argc, argv, i, err)) return -1;
        if (v41_cli_parse_int(argv[++i], 0, 1 << 20, &v)) { v41_err_set(err, V41_EINVAL, "bad --steps '%s'", argv[i]); return -1; }
        c->steps = (int)v;
    } else if (!strcmp(a, "--threads")) {
        if (need(argc, argv, i, err)) return -1;
        if (v41_cli_parse_int(argv[++i], 0, 4096, &v)) { v41_err_set(err, V41_EINVAL, "bad --threads '%s'", argv[i]); return -1; }
        c->threads = (int)v;
    } else if (!strcmp(a, "--compat")) {
        if (need(argc, argv, i, err)) return -1;
        i++;
        if (!strcmp(argv[i], "fixed")) c->compat = V41_COMPAT_FIXED;
        else if (!strcmp(argv[i], "official")) c->compat = V41_COMPAT_OFFICIAL;
        else { v41_err_set(err, V41_EINVAL, "--compat wants fixed or official, got '%s'", argv[i]); return -1; }
    } else if (!strcmp(a, "--dspark")) {
        c->dspark = true;
    } else if (!strcmp(a, "--no-dspark")) {
        c->dspark = false;
        c->no_dspark = true;
    } else if (!strcmp(a, "--no-replay")) {
        c->no_replay = true;
    } else if (!strcmp(a, "--dspark-align")) {
        if (need(argc, argv, i, err)) return -1;
        if (v41_cli_parse_int(argv[++i], 0, 4096, &v)) { v41_err_set(err, V41_EINVAL, "bad --dspark-align '%s'", argv[i]); return -1; }
        c->dspark_align = (int)v;
    } else if (!strcmp(a, "--taps")) {
        if (need(argc, argv, i, err)) return -1;
        c->taps = argv[++i];
    } else if (!strcmp(a, "--inject")) {
        if (need(argc, argv, i, err)) return -1;
        c->inject = argv[++i];
    } else if (!strcmp(a, "--json")) {
        c->json = true;
    } else if (a[0] != '-' && !c->model_set) {
        c->model = a;
        c->model_set = true;
    } else {
        return 0;
    }
    *ip = i;
    return 1;
}

int v41_cli_inputs(const v41_cli_common *c, const v41_model *m, v41_run_inputs *in, v41_err *err)
{
    if (c->prompt_file) return v41_run_inputs_load(c->prompt_file, m->cfg.vocab_size, in, err);
    return v41_run_inputs_random(c->rand_n, c->rand_len, c->seed, m->cfg.vocab_size, in, err);
}

void v41_cli_command_line(int argc, char **argv, char *buf, size_t cap)
{
    size_t o = (size_t)snprintf(buf, cap, "v41");
    for (int i = 0; i < argc && o < cap; i++) o += (size_t)snprintf(buf + o, cap - o, " %s", argv[i]);
}

const char *v41_cli_common_help(void)
{
    return "  MODEL                 `tiny` (built-in, default) or a checkpoint directory\n"
           "  --prompt-ids FILE     prompts: one request per line, token ids separated by spaces/commas\n"
           "  --random-prompts N:LEN  N random prompts of LEN tokens (default 2:16)\n"
           "  --seed S              seed of the random prompts (default 1)\n"
           "  --steps K             greedy decode steps after the prefill (default 4)\n"
           "  --dspark              DSpark draft after every decode step (dspark.* taps)\n"
           "  --compat fixed|official  index-key semantics (default fixed)\n"
           "  --no-replay           bounded replay off: no decoder-side trimming (SPEC §7)\n"
           "  --dspark-align N      pad DSpark index lists to a multiple of N (-1 = zero weight)\n"
           "  --threads N           engine threads (0 = default)\n"
           "  --taps PATTERN        glob list of tap names to dump (default all)\n";
}

static void run_usage(FILE *f)
{
    fprintf(f, "usage: v41 run [MODEL] --engine ref|gpu [--precision emulate|fp32] [--compat fixed|official]\n"
               "              [--prompt-ids FILE | --random-prompts N:LEN] [--seed S] [--steps K] [--dspark]\n"
               "              --dump OUT.h5 [--taps PATTERN] [--inject NAME[@L]] [--threads N]\n"
               "              [--force-from DUMP [--force-taps PATTERN]]\n\n"
               "Prefill every prompt in one ragged forward, then K greedy decode steps; every tap\n"
               "(or those matching --taps) is streamed into OUT.h5 (schema v41-dump v1, README.md, section 'Harness').\n"
               "OUT.h5 appears only when the run succeeded.\n\n%s"
               "  --engine ref|gpu      engine (default ref)\n"
               "  --precision P         emulate (bf16/fp8/fp4 rounding points, default) or fp32\n"
               "  --inject NAME[@L]     fault injection in the engine (also env V41_INJECT)\n"
               "  --dump OUT.h5         output file (required)\n"
               "  --force-from DUMP     teacher forcing: take the forcing points (layer inputs, mid\n"
               "                        stream, attention pre, shared top-k/candidate state) from DUMP\n"
               "  --force-taps PATTERN  only these forcing points (e.g. 'layer.*.indexer.topk' to adopt\n"
               "                        another engine's tie choices)\n",
            v41_cli_common_help());
}

int v41_cmd_run(int argc, char **argv)
{
    v41_cli_common c;
    v41_cli_common_init(&c);
    v41_run_opts o;
    v41_run_opts_default(&o);
    const char *dump = NULL, *force_from = NULL, *force_taps = NULL;
    v41_err err = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { run_usage(stdout); return 0; }
        int r = v41_cli_common_arg(&c, argc, argv, &i, &err);
        if (r < 0) { fprintf(stderr, "v41 run: %s\n", err.msg); return 2; }
        if (r > 0) continue;
        if ((!strcmp(a, "--engine") || !strcmp(a, "--precision") || !strcmp(a, "--dump")) && i + 1 >= argc) {
            fprintf(stderr, "v41 run: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--engine")) {
            v41_precision keep = o.side.prec;
            if (v41_side_parse(argv[++i], &o.side, &err)) { fprintf(stderr, "v41 run: %s\n", err.msg); return 2; }
            if (!strchr(argv[i], ':')) o.side.prec = keep;
        } else if (!strcmp(a, "--precision")) {
            i++;
            if (!strcmp(argv[i], "fp32")) o.side.prec = V41_PREC_FP32;
            else if (!strcmp(argv[i], "emulate")) o.side.prec = V41_PREC_EMULATE;
            else { fprintf(stderr, "v41 run: --precision wants emulate or fp32, got '%s'\n", argv[i]); return 2; }
        } else if (!strcmp(a, "--dump")) {
            dump = argv[++i];
        } else if (!strcmp(a, "--force-from") || !strcmp(a, "--force-taps")) {
            if (i + 1 >= argc) { fprintf(stderr, "v41 run: %s needs a value\n", a); return 2; }
            if (a[8] == 'f') force_from = argv[++i]; else force_taps = argv[++i];
        } else {
            fprintf(stderr, "v41 run: unknown argument '%s' (see v41 run --help)\n", a);
            return 2;
        }
    }
    if (!dump) { fprintf(stderr, "v41 run: --dump OUT.h5 is required\n"); return 2; }
    v41_model *m = NULL;
    if (v41_model_load(c.model, &m, &err)) { fprintf(stderr, "v41 run: %s\n", err.msg); return 2; }
    v41_run_inputs in;
    if (v41_cli_inputs(&c, m, &in, &err)) { fprintf(stderr, "v41 run: %s\n", err.msg); v41_model_free(m); return 2; }
    char cmdline[2048];
    v41_cli_command_line(argc, argv, cmdline, sizeof cmdline);
    o.compat = c.compat;
    o.replay = !c.no_replay;
    o.dspark_align = c.dspark_align;
    o.threads = c.threads;
    o.inject = c.inject;
    o.steps = c.steps;
    o.dspark = c.dspark;
    o.taps = c.taps;
    o.progress = v41_isatty_stderr();
    o.command = cmdline;
    v41_dump_reader *fr = NULL;
    v41_dump_source *fs = NULL;
    v41_tap_source src;
    int rc = 0;
    if (force_from) {
        rc = v41_dump_open(force_from, &fr, &err);
        if (!rc) rc = v41_dump_source_create(fr, force_taps, &fs, &src, &err);
    }
    if (!rc) rc = v41_run_model(m, &in, &o, dump, force_from ? &src : NULL, NULL, &err);
    if (rc && fs && v41_dump_source_error(fs)->code) v41_err_prefix(&err, "%s", v41_dump_source_error(fs)->msg);
    if (fs && !rc && !c.json) fprintf(stderr, "v41 run: %ld values forced from %s\n", v41_dump_source_hits(fs), force_from);
    v41_dump_source_free(fs);
    v41_dump_reader_close(fr);
    v41_run_inputs_free(&in);
    v41_model_free(m);
    if (rc) {
        fprintf(stderr, "v41 run: %s\n", err.msg);
        return 2;
    }
    return 0;
}

/* ---- v41 taps ---- */

static const char *kind_str(v41_tap_kind k)
{
    switch (k) {
    case V41_TAP_F32: return "f32";
    case V41_TAP_BF16: return "bf16";
    case V41_TAP_I32: return "i32";
    default: return "u8";
    }
}

int v41_cmd_taps(int argc, char **argv)
{
    bool json = false;
    const char *pat = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: v41 taps [--json] [PATTERN]\n\n"
                   "List the tap table (ref/v41_taps.def): name pattern, dims, kind, discrete,\n"
                   "the golden dataset it corresponds to in the oracle files, meaning.\n"
                   "PATTERN: glob list over the patterns (e.g. 'layer.{l}.attn.*').\n");
            return 0;
        }
        if (!strcmp(argv[i], "--json")) json = true;
        else if (argv[i][0] == '-') { fprintf(stderr, "v41 taps: unknown option '%s'\n", argv[i]); return 2; }
        else pat = argv[i];
    }
    size_t n;
    const v41_tap_desc *t = v41_tap_table(&n);
    if (json) {
        cJSON *arr = cJSON_CreateArray();
        for (size_t i = 0; i < n; i++) {
            if (pat && !v41_tap_match(pat, t[i].pattern)) continue;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "pattern", t[i].pattern);
            cJSON_AddStringToObject(o, "dims", t[i].dims ? t[i].dims : "");
            cJSON_AddStringToObject(o, "kind", kind_str(t[i].kind));
            cJSON_AddBoolToObject(o, "discrete", t[i].discrete);
            if (t[i].golden) cJSON_AddStringToObject(o, "golden", t[i].golden);
            else cJSON_AddNullToObject(o, "golden");
            cJSON_AddStringToObject(o, "meaning", t[i].meaning ? t[i].meaning : "");
            cJSON_AddItemToArray(arr, o);
        }
        char *s = cJSON_Print(arr);
        puts(s);
        free(s);
        cJSON_Delete(arr);
        return 0;
    }
    printf("%-34s %-28s %-5s %-4s %-28s %s\n", "pattern", "dims", "kind", "disc", "golden", "meaning");
    for (size_t i = 0; i < n; i++) {
        if (pat && !v41_tap_match(pat, t[i].pattern)) continue;
        printf("%-34s %-28s %-5s %-4s %-28s %s\n", t[i].pattern, t[i].dims ? t[i].dims : "", kind_str(t[i].kind),
               t[i].discrete ? "yes" : "no", t[i].golden ? t[i].golden : "-", t[i].meaning ? t[i].meaning : "");
    }
    return 0;
}
