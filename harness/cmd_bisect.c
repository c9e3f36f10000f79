/* v41 bisect: separate a local bug from inherited error (Polygraphy-style
 * layerwise inputs). Three runs over the same inputs:
 *   A free        -> a.h5  (reference)
 *   B free        -> b.h5  (PROPAGATED error: diff a.h5 b.h5)
 *   B forced on A -> bf.h5 (LOCAL error: every forcing point -- layer input
 *                   stream and pre-mix, mid stream, attention pre, shared
 *                   top-k / candidate state -- and every decode token
 *                   taken from a.h5; diff a.h5 bf.h5)
 * and a table per step x layer x sublayer of local vs propagated error.
 * --inject applies to side B only. */
#include "config.h"
#include "v41_cli.h"
#include "v41_cli_common.h"
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int rm_rf_dir(const char *dir, const char *const *files, int n)
{
    char p[4200];
    for (int i = 0; i < n; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    return rmdir(dir);
}

static void side_acc(v41_bisect_side_err *s, const v41_diff_tensor *t)
{
    s->taps++;
    if (t->status != V41_DIFF_SAME) {
        if (!s->fail) snprintf(s->first_tap, sizeof s->first_tap, "%s", t->name);
        s->fail++;
    }
    if (t->discrete) {
        if (t->status == V41_DIFF_DIFF) s->flips++;
        return;
    }
    if (t->status == V41_DIFF_SAME || t->status == V41_DIFF_DIFF) {
        double nr = t->ref_rms > 0 ? t->rms_err / t->ref_rms : (t->rms_err > 0 ? INFINITY : 0);
        if (nr > s->nrmse) s->nrmse = nr;
        if (t->max_abs > s->max_abs) s->max_abs = t->max_abs;
    }
}

static const v41_diff_tensor *find_in(const v41_diff_report *r, size_t *hint, int step, const char *name)
{
    for (size_t k = 0; k < r->n; k++) {
        size_t i = (*hint + k) % (r->n ? r->n : 1);
        if (r->t[i].step == step && !strcmp(r->t[i].name, name)) { *hint = i + 1; return &r->t[i]; }
    }
    return NULL;
}

static int build_groups(v41_bisect_result *res)
{
    size_t cap = 0, hint = 0;
    res->first_local = res->first_prop = -1;
    long first_local_tap = -1, first_prop_tap = -1;
    for (size_t i = 0; i < res->local->n; i++) {
        const v41_diff_tensor *t = &res->local->t[i];
        const char *sub = v41_diff_sublayer(t->name);
        int layer = t->layer;
        v41_bisect_group *g = NULL;
        for (size_t k = res->n; k-- > 0;) {   /* groups of a step are recent: search backwards */
            v41_bisect_group *x = &res->g[k];
            if (x->step != t->step) break;
            if (x->layer == layer && !strcmp(x->sublayer, sub)) { g = x; break; }
        }
        if (!g) {
            if (res->n == cap) {
                cap = cap ? cap * 2 : 64;
                v41_bisect_group *ng = realloc(res->g, cap * sizeof *ng);
                if (!ng) return -1;
                res->g = ng;
            }
            g = &res->g[res->n++];
            memset(g, 0, sizeof *g);
            g->step = t->step;
            g->layer = layer;
            snprintf(g->sublayer, sizeof g->sublayer, "%s", sub);
        }
        side_acc(&g->local, t);
        if (t->status != V41_DIFF_SAME && first_local_tap < 0) {
            first_local_tap = (long)i;
            res->first_local = (long)(g - res->g);
        }
        const v41_diff_tensor *p = find_in(res->prop, &hint, t->step, t->name);
        if (p) {
            side_acc(&g->prop, p);
            if (p->status != V41_DIFF_SAME && first_prop_tap < 0) {
                first_prop_tap = (long)(p - res->prop->t);
                res->first_prop = (long)(g - res->g);
            }
        }
    }
    return 0;
}

int v41_bisect_run(const v41_model *m, const v41_run_inputs *in, const v41_bisect_cfg *cfg, v41_bisect_result *res,
                   v41_err *err)
{
    memset(res, 0, sizeof *res);
    res->first_local = res->first_prop = -1;
    v41_side_name(&cfg->a, res->a_name, sizeof res->a_name);
    v41_side_name(&cfg->b, res->b_name, sizeof res->b_name);
    snprintf(res->inject, sizeof res->inject, "%s", cfg->inject ? cfg->inject : "");
    char dir[3072];
    bool tmp = !cfg->keep_dir;
    if (tmp) {
        const char *td = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/v41bisect.XXXXXX", td && *td ? td : "/tmp");
        if (!mkdtemp(dir)) return v41_err_set(err, V41_EIO, "bisect: cannot create a temp dir under %s", td && *td ? td : "/tmp");
    } else {
        snprintf(dir, sizeof dir, "%s", cfg->keep_dir);
        if (mkdir(dir, 0777) != 0 && access(dir, W_OK) != 0)
            return v41_err_set(err, V41_EIO, "bisect: cannot create %s", dir);
    }
    snprintf(res->a_path, sizeof res->a_path, "%s/a.h5", dir);
    snprintf(res->b_path, sizeof res->b_path, "%s/b.h5", dir);
    snprintf(res->bf_path, sizeof res->bf_path, "%s/b_forced.h5", dir);
    const v41_cli_common *c = cfg->c;
    int nr = in->n_req;
    int32_t *tok_a = calloc((size_t)(c->steps + 1) * (size_t)nr, sizeof(int32_t));
    int rc = tok_a ? 0 : v41_err_set(err, V41_ENOMEM, "out of memory");
    v41_run_opts o;
    v41_run_opts_default(&o);
    o.compat = c->compat;
    o.replay = !c->no_replay;
    o.dspark_align = c->dspark_align;
    o.threads = c->threads;
    o.steps = c->steps;
    o.dspark = c->dspark;
    o.taps = c->taps;
    o.progress = cfg->progress;
    o.command = cfg->command;
    /* A: reference, never injected (an empty spec also masks V41_INJECT) */
    /* A's dump must hold every forcing point whatever --taps selects */
    char a_taps[2048];
    if (c->taps && *c->taps)
        snprintf(a_taps, sizeof a_taps, "%s,*.stream.in,*.premix.in,*.stream.mid,*.hc.attn.pre,*.indexer.topk,"
                 "*.candidate.mask,tokens", c->taps);
    if (!rc) {
        o.side = cfg->a;
        o.taps = c->taps && *c->taps ? a_taps : NULL;
        o.inject = "";
        rc = v41_run_model(m, in, &o, res->a_path, NULL, tok_a, err);
        if (rc) v41_err_prefix(err, "side A (%s)", res->a_name);
    }
    o.taps = c->taps;
    if (!rc) {
        o.side = cfg->b;
        o.inject = cfg->inject ? cfg->inject : "";
        rc = v41_run_model(m, in, &o, res->b_path, NULL, NULL, err);
        if (rc) v41_err_prefix(err, "side B (%s)", res->b_name);
    }
    v41_dump_reader *ra = NULL;
    if (!rc) rc = v41_dump_open(res->a_path, &ra, err);
    bool skip_forced = false;
    if (!rc && cfg->forced_only_if_differ) {
        v41_dump_reader *rb = NULL;
        rc = v41_dump_open(res->b_path, &rb, err);
        v41_diff_opts dop;
        if (cfg->dopts) dop = *cfg->dopts; else v41_diff_opts_default(&dop);
        if (c->taps && *c->taps) dop.ignore_missing = true;
        if (!rc) rc = v41_diff_readers(ra, rb, &dop, &res->prop, err);
        v41_dump_reader_close(rb);
        skip_forced = !rc && res->prop->n_fail == 0;
    }
    if (!rc && !skip_forced) {
        v41_tap_source src;
        v41_dump_source *ds = NULL;
        rc = v41_dump_source_create(ra, NULL, &ds, &src, err);
        if (!rc) {
            o.force_tokens = tok_a;
            rc = v41_run_model(m, in, &o, res->bf_path, &src, NULL, err);
            if (rc && v41_dump_source_error(ds)->code) v41_err_prefix(err, "%s", v41_dump_source_error(ds)->msg);
            if (rc) v41_err_prefix(err, "side B teacher-forced");
            res->forced_hits = v41_dump_source_hits(ds);
            v41_dump_source_free(ds);
        }
    }
    if (!rc && !skip_forced) {
        v41_dump_reader *rb = NULL, *rbf = NULL;
        rc = v41_dump_open(res->b_path, &rb, err);
        if (!rc) rc = v41_dump_open(res->bf_path, &rbf, err);
        /* with --taps, A also holds the forcing points B did not dump: not a difference */
        v41_diff_opts dop;
        if (cfg->dopts) dop = *cfg->dopts; else v41_diff_opts_default(&dop);
        if (c->taps && *c->taps) dop.ignore_missing = true;
        if (!rc && !res->prop) rc = v41_diff_readers(ra, rb, &dop, &res->prop, err);
        if (!rc) rc = v41_diff_readers(ra, rbf, &dop, &res->local, err);
        v41_dump_reader_close(rb);
        v41_dump_reader_close(rbf);
    }
    v41_dump_reader_close(ra);
    if (!rc && res->local && build_groups(res)) rc = v41_err_set(err, V41_ENOMEM, "out of memory");
    free(tok_a);
    if (tmp) {
        const char *files[] = {"a.h5", "b.h5", "b_forced.h5", "a.h5.tmp", "b.h5.tmp", "b_forced.h5.tmp"};
        rm_rf_dir(dir, files, 6);
        res->a_path[0] = res->b_path[0] = res->bf_path[0] = 0;
    }
    return rc;
}

void v41_bisect_result_free(v41_bisect_result *r)
{
    v41_diff_report_free(r->prop);
    v41_diff_report_free(r->local);
    free(r->g);
    memset(r, 0, sizeof *r);
}

static void fmt_side(char *buf, size_t cap, const v41_bisect_side_err *s)
{
    snprintf(buf, cap, "%-9.3g %-9.3g %3d/%-3d %-5d %-4s", s->nrmse, s->max_abs, s->fail, s->taps, s->flips,
             s->fail ? "FAIL" : "ok");
}

static void group_name(const v41_bisect_group *g, char *buf, size_t cap)
{
    if (g->layer >= 0) snprintf(buf, cap, "step %d layer %d %s", g->step, g->layer, g->sublayer);
    else snprintf(buf, cap, "step %d %s", g->step, g->sublayer);
}

void v41_bisect_print(const v41_bisect_result *r, FILE *f, bool all)
{
    fprintf(f, "v41 bisect: A = %s (reference), B = %s%s%s\n", r->a_name, r->b_name, r->inject[0] ? ", B injected: " : "",
            r->inject);
    fprintf(f, "LOCAL = B run on A's inputs at every forcing point (%ld values forced); PROPAGATED = B free run.\n",
            r->forced_hits);
    if (r->forced_hits == 0)
        fprintf(f, "WARNING: engine B asked for no forcing point (no teacher forcing support?): LOCAL is a free run\n");
    fprintf(f, "nrmse = RMS(b-a)/RMS(a), worst tap of the group; taps = failing/compared; flips = taps with decision flips\n\n");
    fprintf(f, "%-5s %-5s %-10s | %-9s %-9s %-7s %-5s %-4s | %-9s %-9s %-7s %-5s %-4s\n", "step", "layer", "sublayer",
            "local", "max|d|", "taps", "flips", "", "propag.", "max|d|", "taps", "flips", "");
    int shown = 0, hidden = 0;
    for (size_t i = 0; i < r->n; i++) {
        const v41_bisect_group *g = &r->g[i];
        bool interesting = g->local.fail || g->prop.fail || g->local.nrmse > 0 || g->prop.nrmse > 0;
        if (!all && (!interesting || shown >= 60)) { hidden++; continue; }
        char l[96], p[96], ly[16];
        fmt_side(l, sizeof l, &g->local);
        fmt_side(p, sizeof p, &g->prop);
        if (g->layer >= 0) snprintf(ly, sizeof ly, "%d", g->layer);
        else snprintf(ly, sizeof ly, "-");
        fprintf(f, "%-5d %-5s %-10s | %s | %s%s\n", g->step, ly, g->sublayer, l, p,
                (long)i == r->first_local ? "  <- first local failure" : "");
        shown++;
    }
    if (hidden) fprintf(f, "(%d groups with zero error in both runs not shown; --all lists them)\n", hidden);
    fputc('\n', f);
    char nm[128];
    if (r->first_local >= 0) {
        const v41_bisect_group *g = &r->g[r->first_local];
        group_name(g, nm, sizeof nm);
        fprintf(f, "first local failure: %s (tap %s)\n", nm, g->local.first_tap);
        if (r->local->first_fail >= 0) {
            fprintf(f, "  ");
            v41_diff_print_tensor(&r->local->t[r->local->first_fail], f);
        }
    } else {
        fprintf(f, "first local failure: none: every layer and sublayer of B is within tolerance on A's inputs\n");
    }
    if (r->first_prop >= 0) {
        const v41_bisect_group *g = &r->g[r->first_prop];
        group_name(g, nm, sizeof nm);
        fprintf(f, "first propagated failure: %s (tap %s)\n", nm, g->prop.first_tap);
    } else {
        fprintf(f, "first propagated failure: none (free runs agree within tolerance)\n");
    }
    if (r->first_local < 0 && r->first_prop >= 0)
        fprintf(f, "diagnosis: the free-run difference is accumulated/inherited error (rounding amplified by later\n"
                   "           layers or decisions), not a local bug in one layer.\n");
    else if (r->first_local >= 0)
        fprintf(f, "diagnosis: B computes %s differently from A given the same inputs: look there first.\n", nm[0] ? nm : "?");
}

static cJSON *side_json(const v41_bisect_side_err *s)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "nrmse", isfinite(s->nrmse) ? s->nrmse : 1e308);
    cJSON_AddNumberToObject(o, "max_abs", isfinite(s->max_abs) ? s->max_abs : 1e308);
    cJSON_AddNumberToObject(o, "taps", s->taps);
    cJSON_AddNumberToObject(o, "fail", s->fail);
    cJSON_AddNumberToObject(o, "flips", s->flips);
    cJSON_AddBoolToObject(o, "pass", s->fail == 0);
    if (s->first_tap[0]) cJSON_AddStringToObject(o, "first_tap", s->first_tap);
    return o;
}

static cJSON *group_ref(const v41_bisect_result *r, long i, bool local)
{
    if (i < 0) return cJSON_CreateNull();
    const v41_bisect_group *g = &r->g[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", g->step);
    cJSON_AddNumberToObject(o, "layer", g->layer);
    cJSON_AddStringToObject(o, "sublayer", g->sublayer);
    cJSON_AddStringToObject(o, "tap", local ? g->local.first_tap : g->prop.first_tap);
    return o;
}

char *v41_bisect_json(const v41_bisect_result *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "tool", "v41 bisect");
    cJSON_AddStringToObject(o, "a", r->a_name);
    cJSON_AddStringToObject(o, "b", r->b_name);
    cJSON_AddStringToObject(o, "inject", r->inject);
    cJSON_AddNumberToObject(o, "forced_values", (double)r->forced_hits);
    cJSON_AddItemToObject(o, "first_local_failure", group_ref(r, r->first_local, true));
    cJSON_AddItemToObject(o, "first_propagated_failure", group_ref(r, r->first_prop, false));
    cJSON *arr = cJSON_AddArrayToObject(o, "groups");
    for (size_t i = 0; i < r->n; i++) {
        cJSON *g = cJSON_CreateObject();
        cJSON_AddNumberToObject(g, "step", r->g[i].step);
        cJSON_AddNumberToObject(g, "layer", r->g[i].layer);
        cJSON_AddStringToObject(g, "sublayer", r->g[i].sublayer);
        cJSON_AddItemToObject(g, "local", side_json(&r->g[i].local));
        cJSON_AddItemToObject(g, "propagated", side_json(&r->g[i].prop));
        cJSON_AddItemToArray(arr, g);
    }
    /* the two tap-level diff reports, for the notebook's heat maps */
    char *ls = v41_diff_json(r->local), *ps = v41_diff_json(r->prop);
    cJSON_AddItemToObject(o, "local_diff", ls ? cJSON_Parse(ls) : cJSON_CreateNull());
    cJSON_AddItemToObject(o, "propagated_diff", ps ? cJSON_Parse(ps) : cJSON_CreateNull());
    free(ls);
    free(ps);
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}

static void bisect_usage(FILE *f)
{
    fprintf(f, "usage: v41 bisect [MODEL] --a ENGINE[:precision] --b ENGINE[:precision] [inputs as for run]\n"
               "                 [--inject NAME[@L]] [--atol X] [--rtol Y] [--json] [--all] [--keep DIR]\n\n"
               "Runs A free (reference), B free (propagated error) and B teacher-forced on A's\n"
               "values at every forcing point (layer input stream and pre-mix, mid stream, attention\n"
               "pre, shared top-k/candidate state, decode tokens: local error). Prints per step,\n"
               "layer and sublayer (input, engram, attention, ffn, dspark, head) the LOCAL beside\n"
               "the PROPAGATED error and names the first layer/sublayer whose local error fails.\n"
               "ENGINE: ref or gpu; precision: emulate (default) or fp32. --inject applies to B only.\n\n%s"
               "  --atol X --rtol Y     tolerances (default: per tap, see v41 diff --help)\n"
               "  --json                machine-readable result (groups + both tap-level diffs)\n"
               "  --all                 list every group, not only those with an error\n"
               "  --keep DIR            keep the three dumps (a.h5, b.h5, b_forced.h5) in DIR\n\n"
               "Exit status: 0 no failure, 1 a local or propagated failure, 2 error.\n",
            v41_cli_common_help());
}

int v41_cmd_bisect(int argc, char **argv)
{
    v41_cli_common c;
    v41_cli_common_init(&c);
    v41_diff_opts dopts;
    v41_diff_opts_default(&dopts);
    v41_bisect_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    bool have_a = false, have_b = false, all = false;
    v41_err err = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { bisect_usage(stdout); return 0; }
        int r = v41_cli_common_arg(&c, argc, argv, &i, &err);
        if (r < 0) { fprintf(stderr, "v41 bisect: %s\n", err.msg); return 2; }
        if (r > 0) continue;
        if ((!strcmp(a, "--a") || !strcmp(a, "--b") || !strcmp(a, "--atol") || !strcmp(a, "--rtol") ||
             !strcmp(a, "--keep")) && i + 1 >= argc) {
            fprintf(stderr, "v41 bisect: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--a") || !strcmp(a, "--b")) {
            v41_side *s = a[2] == 'a' ? &cfg.a : &cfg.b;
            if (v41_side_parse(argv[++i], s, &err)) { fprintf(stderr, "v41 bisect: %s\n", err.msg); return 2; }
            if (a[2] == 'a') have_a = true; else have_b = true;
        } else if (!strcmp(a, "--atol") || !strcmp(a, "--rtol")) {
            char *end;
            double v = strtod(argv[++i], &end);
            if (*end || v < 0) { fprintf(stderr, "v41 bisect: bad %s '%s'\n", a, argv[i]); return 2; }
            if (a[2] == 'a') { dopts.atol = v; dopts.atol_set = true; } else { dopts.rtol = v; dopts.rtol_set = true; }
        } else if (!strcmp(a, "--keep")) cfg.keep_dir = argv[++i];
        else if (!strcmp(a, "--all")) all = true;
        else { fprintf(stderr, "v41 bisect: unknown argument '%s' (see v41 bisect --help)\n", a); return 2; }
    }
    if (!have_a || !have_b) { fprintf(stderr, "v41 bisect: --a and --b are required (e.g. --a ref --b ref:fp32)\n"); return 2; }
    v41_model *m = NULL;
    if (v41_model_load(c.model, &m, &err)) { fprintf(stderr, "v41 bisect: %s\n", err.msg); return 2; }
    v41_run_inputs in;
    if (v41_cli_inputs(&c, m, &in, &err)) { fprintf(stderr, "v41 bisect: %s\n", err.msg); v41_model_free(m); return 2; }
    char cmdline[2048];
    v41_cli_command_line(argc, argv, cmdline, sizeof cmdline);
    cfg.inject = c.inject;
    cfg.c = &c;
    cfg.dopts = &dopts;
    cfg.progress = v41_isatty_stderr();
    cfg.command = cmdline;
    v41_bisect_result res;
    int rc = v41_bisect_run(m, &in, &cfg, &res, &err);
    v41_run_inputs_free(&in);
    v41_model_free(m);
    if (rc) {
        fprintf(stderr, "v41 bisect: %s\n", err.msg);
        v41_bisect_result_free(&res);
        return 2;
    }
    if (c.json) {
        char *s = v41_bisect_json(&res);
        if (s) { puts(s); free(s); }
    } else {
        v41_bisect_print(&res, stdout, all);
    }
    int status = (res.first_local >= 0 || res.first_prop >= 0) ? 1 : 0;
    v41_bisect_result_free(&res);
    return status;
}
