/* sim_validate.c: `v41 sim --validate SERVE.json`: predicted vs measured
 * step latency. Every step that `v41 serve-trace` ran (its batch: per
 * request kind, positions, replay floor, trimming) is costed by the
 * simulator's cost model and compared with the seconds it took.
 *
 * Rates come from a measured profile (--profile, v41-profile/1 written by
 * `v41 bench gpu` in the same session), the H200 roofline (default), or
 * --fit: t = c0 + sum_k a_k * T_k + r * rows + [m + r' * rows if the step is not a pure decode
 * batch] + q * requests, where T_k is the
 * roofline time of op class k in that step, fitted (non-negative least squares) on the even
 * steps and evaluated on the odd ones (held out), or --fit-from CAL.json:
 * fitted on every step of a separate calibration run and evaluated on every
 * step of SERVE.json. T_k come from the profile when one is given. The fit is
 * how an engine whose step time is not the sum of its kernels' device times
 * (host orchestration, launch and copy overheads: the CPU reference, the
 * first-stage GPU engine) calibrates the cost model. */
#include "v41_cli.h"
#include "v41_sim.h"
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* fit features: 1 (per step), the op-class times, query rows, 1 and the rows again when the
 * step is not a pure decode batch ("mixed" steps), requests in the batch (the row and request
 * terms carry the host work of an engine that orchestrates on the CPU, like Vidur's
 * CPU-overhead terms; the GPU engine runs pure decode batches device-resident and the
 * other steps through its host orchestration, so it has two per-row costs) */
#define NF (1 + V41_OP_NCLASS + 4)

static void usage(FILE *f)
{
    fprintf(f, "usage: v41 sim --validate SERVE.json [--model M] [--profile P.json]\n"
               "                           [--fit | --fit-from CAL.json | --calibration FIT.json] [--json]\n\n"
               "Predicted vs measured step latency of a `v41 serve-trace --json` run.\n"
               "  --model M     model config (default: the one recorded in SERVE.json)\n"
               "  --profile P   measured rates (v41-profile/1, e.g. `v41 bench gpu --json P`)\n"
               "  --fit         fit t = c0 + sum_k a_k*T_k + r*rows + [m + r'*rows] + q*requests (T_k: time of op\n"
               "                class k; [..]: only for a step that is not a pure decode batch) on the even\n"
               "                steps by non-negative least squares; report the error on the odd steps\n"
               "  --fit-from C  the same fit on every step of another serve-trace run C (a calibration set of\n"
               "                batch mixes), evaluated on every step of SERVE.json\n"
               "  --calibration F  apply a fit made earlier (F = the --json output of --fit or --fit-from),\n"
               "                evaluated on every step (what `v41 sim --calibration F` uses)\n"
               "  (with --profile, T_k are the profile's op-class times, else the roofline's)\n"
               "Reports the median and p90 of |predicted - measured| / measured. Exit: 0 ok, 2 error.\n");
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* least squares on the active set, dropping the most negative coefficient until none is negative */
static void nnls_raw(int n, const double *X, const double *y, double *coef);
/* Relative least squares: minimise sum_i ((pred_i - y_i) / y_i)^2, the error the validation
 * reports (|pred - meas| / meas), so steps of 1 ms weigh as much as steps of 300 ms (an
 * absolute fit is ruled by the longest steps and misses short ones by their whole size).
 * Rows are divided by y_i (targets become 1), then columns scaled to unit maximum (the
 * features span ns to hundreds of rows), coefficients scaled back. y_i > 0 (load_steps). */
static void nnls(int n, const double *X, const double *y, double *coef)
{
    double sc[NF];
    double *Xs = malloc(sizeof *Xs * (size_t)n * NF), *ys = malloc(sizeof *ys * (size_t)(n > 0 ? n : 1));
    if (!Xs || !ys) {
        free(Xs);
        free(ys);
        for (int a = 0; a < NF; a++) coef[a] = 0;
        return;
    }
    for (int i = 0; i < n; i++) {
        ys[i] = 1;
        for (int a = 0; a < NF; a++) Xs[i * NF + a] = X[i * NF + a] / y[i];
    }
    for (int a = 0; a < NF; a++) {
        sc[a] = 0;
        for (int i = 0; i < n; i++) sc[a] = fmax(sc[a], fabs(Xs[i * NF + a]));
        if (!(sc[a] > 0)) sc[a] = 1;
    }
    for (int i = 0; i < n; i++)
        for (int a = 0; a < NF; a++) Xs[i * NF + a] /= sc[a];
    nnls_raw(n, Xs, ys, coef);
    for (int a = 0; a < NF; a++) coef[a] /= sc[a];
    free(Xs);
    free(ys);
}

static void nnls_raw(int n, const double *X, const double *y, double *coef)
{
    bool act[NF];
    for (int k = 0; k < NF; k++) act[k] = true;
    for (int iter = 0; iter < NF; iter++) {
        double A[NF][NF + 1];
        memset(A, 0, sizeof A);
        for (int i = 0; i < n; i++)
            for (int a = 0; a < NF; a++) {
                if (!act[a]) continue;
                for (int b = 0; b < NF; b++)
                    if (act[b]) A[a][b] += X[i * NF + a] * X[i * NF + b];
                A[a][NF] += X[i * NF + a] * y[i];
            }
        /* ridge of 1e-12 relative to the diagonal keeps empty classes solvable */
        for (int a = 0; a < NF; a++) A[a][a] = act[a] ? A[a][a] * (1 + 1e-12) + 1e-300 : 1;
        /* Gauss-Jordan with partial pivoting */
        for (int c = 0; c < NF; c++) {
            int p = c;
            for (int r = c + 1; r < NF; r++) if (fabs(A[r][c]) > fabs(A[p][c])) p = r;
            if (p != c) for (int k = 0; k <= NF; k++) { double t = A[c][k]; A[c][k] = A[p][k]; A[p][k] = t; }
            double d = A[c][c];
            if (d == 0) continue;
            for (int k = 0; k <= NF; k++) A[c][k] /= d;
            for (int r = 0; r < NF; r++) {
                if (r == c || A[r][c] == 0) continue;
                double f = A[r][c];
                for (int k = 0; k <= NF; k++) A[r][k] -= f * A[c][k];
            }
        }
        int worst = -1;
        for (int a = 0; a < NF; a++) {
            coef[a] = act[a] ? A[a][NF] : 0;
            if (act[a] && coef[a] < 0 && (worst < 0 || coef[a] < coef[worst])) worst = a;
        }
        if (worst < 0) return;
        act[worst] = false;
    }
}

/* the steps of one serve-trace run: per step the measured seconds, the cost
 * model's prediction and the fit features (1, op-class times) */
typedef struct {
    int n;
    double *meas, *pred, *X;
} step_set;

static void step_set_free(step_set *S)
{
    free(S->meas);
    free(S->pred);
    free(S->X);
    memset(S, 0, sizeof *S);
}

static int read_json(const char *path, cJSON **out, v41_err *err)
{
    int rc = v41_json_load(path, "serve-trace", out, err);
    if (rc) return rc;
    const cJSON *schema = cJSON_GetObjectItem(*out, "schema"), *steps = cJSON_GetObjectItem(*out, "steps");
    if (!cJSON_IsString(schema) || strcmp(schema->valuestring, "v41-serve-trace/1") || !cJSON_IsArray(steps)) {
        cJSON_Delete(*out);
        *out = NULL;
        return v41_err_set(err, V41_EINVAL, "%s: not a v41-serve-trace/1 JSON file (from `v41 serve-trace --json`)", path);
    }
    return 0;
}

/* predictions of the fitted model: pred[s] = sum_a coef[a] * X[s, a] */
static void predict(const double *coef, const double *X, int ns, double *pred)
{
    for (int s = 0; s < ns; s++) {
        double p = 0;
        for (int a = 0; a < NF; a++) p += coef[a] * X[s * NF + a];
        pred[s] = p;
    }
}

/* key of a step item as a whole number in [0, 2^40] (a position); missing, fractional, out of range or
 * not a number is an error (the conversion of NaN or a huge double to int64 is undefined) */
static int item_pos(const cJSON *it, const char *key, int64_t *out)
{
    const cJSON *v = cJSON_GetObjectItem(it, key);
    double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
    if (!(d >= 0 && d <= 0x1p40 && d == floor(d))) return -1;
    *out = (int64_t)d;
    return 0;
}

/* cost every step of a serve-trace JSON (its batch: per request kind, positions,
 * replay floor, trimming) with cm */
static int load_steps(const char *path, const cJSON *j, v41_cost_model *cm, step_set *S, v41_err *err)
{
    const cJSON *steps = cJSON_GetObjectItem(j, "steps");
    int n = cJSON_GetArraySize(steps), rc = 0, cap = 0;
    S->n = 0;
    S->meas = calloc((size_t)n + 1, sizeof *S->meas);
    S->pred = calloc((size_t)n + 1, sizeof *S->pred);
    S->X = calloc((size_t)(n + 1) * NF, sizeof *S->X);
    if (!S->meas || !S->pred || !S->X) return v41_err_set(err, V41_ENOMEM, "out of memory");
    v41_sim_item *items = NULL;
    for (int s = 0; s < n && !rc; s++) {
        const cJSON *st = cJSON_GetArrayItem(steps, s), *its = cJSON_GetObjectItem(st, "items");
        const cJSON *sec = cJSON_GetObjectItem(st, "seconds");
        if (!cJSON_IsArray(its) || !cJSON_IsNumber(sec) || !(sec->valuedouble > 0 && sec->valuedouble < 1e6)) {
            rc = v41_err_set(err, V41_EINVAL, "%s: step %d lacks items or seconds in (0, 1e6)", path, s);
            break;
        }
        int ni = cJSON_GetArraySize(its);
        if (ni > cap) {
            v41_sim_item *ni2 = realloc(items, sizeof *items * (size_t)ni * 2);
            if (!ni2) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); break; }
            items = ni2;
            cap = ni * 2;
        }
        for (int k = 0; k < ni; k++) {
            const cJSON *it = cJSON_GetArrayItem(its, k);
            const cJSON *kind = cJSON_GetObjectItem(it, "kind");
            const char *ks = cJSON_IsString(kind) ? kind->valuestring : "";
            v41_sim_item *x = &items[k];
            memset(x, 0, sizeof *x);
            x->kind = !strcmp(ks, "prefill") ? V41_ITEM_PREFILL : !strcmp(ks, "verify") ? V41_ITEM_VERIFY : V41_ITEM_DECODE;
            const char *bad = item_pos(it, "start", &x->start) ? "start" : item_pos(it, "end", &x->end) ? "end"
                              : item_pos(it, "floor", &x->floor) ? "floor"
                              : item_pos(it, "new_from", &x->new_from) ? "new_from" : NULL;
            if (bad) {
                rc = v41_err_set(err, V41_EINVAL, "%s: step %d item %d: '%s' missing or not a whole number in [0, 2^40]",
                                 path, s, k, bad);
                break;
            }
            x->trim = cJSON_IsTrue(cJSON_GetObjectItem(it, "trim"));
            x->logits = true;
            if (!(x->end > x->start) || x->start < 0) {
                rc = v41_err_set(err, V41_EINVAL, "%s: step %d item %d: bad start/end", path, s, k);
                break;
            }
        }
        if (rc) break;
        v41_step_cost sc;
        v41_cost_step(cm, items, ni, 0, &sc);
        int i = S->n++;
        S->meas[i] = sec->valuedouble;
        S->pred[i] = sc.time_s;
        S->X[i * NF] = 1;
        for (int c = 0; c < V41_OP_NCLASS; c++) S->X[i * NF + 1 + c] = sc.time_c[c];
        double rows = 0;
        for (int k = 0; k < ni; k++) rows += (double)(items[k].end - items[k].start);
        bool pure_decode = true;
        for (int k = 0; k < ni; k++) pure_decode = pure_decode && items[k].kind == V41_ITEM_DECODE;
        S->X[i * NF + 1 + V41_OP_NCLASS] = rows;
        S->X[i * NF + 2 + V41_OP_NCLASS] = pure_decode ? 0 : 1;
        S->X[i * NF + 3 + V41_OP_NCLASS] = pure_decode ? 0 : rows;
        S->X[i * NF + 4 + V41_OP_NCLASS] = ni;
    }
    free(items);
    return rc;
}

int v41_sim_validate(int argc, char **argv)
{
    const char *path = NULL, *model = NULL, *profile = NULL, *fit_from = NULL, *calibration = NULL;
    bool fit = false, json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--validate") && i + 1 < argc) path = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--profile") && i + 1 < argc) profile = argv[++i];
        else if (!strcmp(argv[i], "--fit")) fit = true;
        else if (!strcmp(argv[i], "--fit-from") && i + 1 < argc) fit_from = argv[++i];
        else if (!strcmp(argv[i], "--calibration") && i + 1 < argc) calibration = argv[++i];
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        else { fprintf(stderr, "v41 sim --validate: unexpected argument '%s'\n", argv[i]); usage(stderr); return 2; }
    }
    if (!path) { usage(stderr); return 2; }
    if (fit && fit_from) { fprintf(stderr, "v41 sim --validate: --fit and --fit-from exclude each other\n"); return 2; }
    if (calibration && (fit || fit_from)) {
        fprintf(stderr, "v41 sim --validate: --calibration applies a fit already made; it excludes --fit and --fit-from\n");
        return 2;
    }
    if (fit_from) fit = true;
    v41_err err = {0};
    v41_config cfg;
    v41_hw hw;
    v41_hw_h200(&hw);
    hw.gpus = 1;
    v41_profile *prof = NULL;
    v41_cost_model *cm = NULL;
    cJSON *j = NULL;
    step_set V = {0}, C = {0};
    double *rel = NULL, *pred = NULL;
    int rc = read_json(path, &j, &err);
    if (!rc && !model) {
        const cJSON *mj = cJSON_GetObjectItem(j, "model");
        model = cJSON_IsString(mj) ? mj->valuestring : "tiny";
    }
    if (!rc) rc = v41_sim_config_get(model, &cfg, &err);
    if (!rc && profile) {
        prof = calloc(1, sizeof *prof);
        rc = prof ? v41_profile_load(profile, prof, &err) : v41_err_set(&err, V41_ENOMEM, "out of memory");
    }
    if (!rc) rc = v41_cost_create(&cfg, &hw, prof, &cm, &err);
    v41_calib cal;
    if (!rc && calibration && !(rc = v41_calib_load(calibration, &cal, &err))) v41_cost_set_calib(cm, &cal);
    if (!rc) rc = load_steps(path, j, cm, &V, &err);
    if (!rc && fit_from) {
        cJSON *jc = NULL;
        rc = read_json(fit_from, &jc, &err);
        if (!rc) rc = load_steps(fit_from, jc, cm, &C, &err);
        cJSON_Delete(jc);
    }
    int ns = V.n;
    if (!rc && ns < ((fit && !fit_from) ? 4 : 1)) rc = v41_err_set(&err, V41_EINVAL, "%s: too few steps (%d) to validate", path, ns);
    if (!rc && fit_from && C.n < NF) rc = v41_err_set(&err, V41_EINVAL, "%s: too few steps (%d) to fit %d coefficients", fit_from, C.n, NF);
    if (!rc && (!(rel = calloc((size_t)ns + 1, sizeof *rel)) || !(pred = calloc((size_t)ns + 1, sizeof *pred))))
        rc = v41_err_set(&err, V41_ENOMEM, "out of memory");
    if (rc) {
        fprintf(stderr, "v41 sim --validate: %s\n", err.msg);
        goto out;
    }
    const double *meas = V.meas, *X = V.X;
    for (int s = 0; s < ns; s++) pred[s] = V.pred[s];
    double coef[NF] = {0};
    int nv = 0;
    if (fit_from) {
        nnls(C.n, C.X, C.meas, coef);
        predict(coef, X, ns, pred);
        for (int s = 0; s < ns; s++) rel[nv++] = fabs(pred[s] - meas[s]) / meas[s];
    } else if (fit) {
        size_t nt = ((size_t)ns + 1) / 2;
        double *Xt = calloc(nt * NF, sizeof *Xt), *yt = calloc(nt, sizeof *yt);
        if (!Xt || !yt) {
            free(Xt);
            free(yt);
            fprintf(stderr, "v41 sim --validate: out of memory\n");
            rc = 2;
            goto out;
        }
        for (int s = 0, i = 0; s < ns; s += 2, i++) { memcpy(Xt + i * NF, X + s * NF, sizeof(double) * NF); yt[i] = meas[s]; }
        nnls((int)nt, Xt, yt, coef);
        free(Xt);
        free(yt);
        predict(coef, X, ns, pred);
        for (int s = 1; s < ns; s += 2) rel[nv++] = fabs(pred[s] - meas[s]) / meas[s];
    } else {
        for (int s = 0; s < ns; s++) rel[nv++] = fabs(pred[s] - meas[s]) / meas[s];
    }
    qsort(rel, (size_t)nv, sizeof *rel, cmp_d);
    double med = rel[nv / 2], p90 = rel[(int)(0.9 * (nv - 1))];
    double sm = 0, sp = 0;
    for (int s = 0; s < ns; s++) { sm += meas[s]; sp += pred[s]; }
    char how[1024];
    const char *base = profile ? profile : "H200 roofline";
    if (fit_from) snprintf(how, sizeof how, "%s op-class times, fitted on every step of %s (%d steps), evaluated on every step", base, fit_from, C.n);
    else if (fit) snprintf(how, sizeof how, "%s op-class times, fitted on the even steps, evaluated on the odd steps", base);
    else if (calibration) snprintf(how, sizeof how, "%s op-class times, calibrated by %s", base, calibration);
    else snprintf(how, sizeof how, "%s", base);
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "schema", "v41-sim-validate/1");
        cJSON_AddStringToObject(o, "serve_trace", path);
        cJSON_AddStringToObject(o, "model", model);
        cJSON_AddStringToObject(o, "rates", how);
        cJSON_AddNumberToObject(o, "steps", ns);
        cJSON_AddNumberToObject(o, "evaluated", nv);
        cJSON_AddNumberToObject(o, "median_abs_rel_err", med);
        cJSON_AddNumberToObject(o, "p90_abs_rel_err", p90);
        cJSON_AddNumberToObject(o, "measured_total_s", sm);
        cJSON_AddNumberToObject(o, "predicted_total_s", sp);
        if (fit) {
            cJSON *cj = cJSON_AddObjectToObject(o, "fit");
            cJSON_AddNumberToObject(cj, "c0_s", coef[0]);
            for (int c = 0; c < V41_OP_NCLASS; c++) cJSON_AddNumberToObject(cj, v41_op_class_name(c), coef[1 + c]);
            cJSON_AddNumberToObject(cj, "per_row_s", coef[1 + V41_OP_NCLASS]);
            cJSON_AddNumberToObject(cj, "per_mixed_step_s", coef[2 + V41_OP_NCLASS]);
            cJSON_AddNumberToObject(cj, "per_mixed_row_s", coef[3 + V41_OP_NCLASS]);
            cJSON_AddNumberToObject(cj, "per_request_s", coef[4 + V41_OP_NCLASS]);
        }
        cJSON *pa = cJSON_AddArrayToObject(o, "per_step");
        for (int s = 0; s < ns; s++) {
            cJSON *e = cJSON_CreateArray();
            cJSON_AddItemToArray(e, cJSON_CreateNumber(meas[s]));
            cJSON_AddItemToArray(e, cJSON_CreateNumber(pred[s]));
            cJSON_AddItemToArray(pa, e);
        }
        char *t = cJSON_Print(o);
        puts(t);
        free(t);
        cJSON_Delete(o);
    } else {
        printf("sim validate: %s, model %s, rates: %s\n", path, model, how);
        printf("  %d steps (%d evaluated): |pred-meas|/meas median %.1f%%, p90 %.1f%%; total measured %.4g s, predicted %.4g s\n",
               ns, nv, 100 * med, 100 * p90, sm, sp);
        if (fit) {
            printf("  fit: c0 %.3g s", coef[0]);
            for (int c = 0; c < V41_OP_NCLASS; c++) printf(", %s x%.3g", v41_op_class_name(c), coef[1 + c]);
            printf(", per row %.3g s, per mixed step %.3g s + %.3g s a row, per request %.3g s\n",
                   coef[1 + V41_OP_NCLASS], coef[2 + V41_OP_NCLASS], coef[3 + V41_OP_NCLASS], coef[4 + V41_OP_NCLASS]);
        }
        printf("  %-6s %-12s %-12s\n", "step", "measured s", "predicted s");
        for (int s = 0; s < ns && s < 12; s++) printf("  %-6d %-12.4g %-12.4g\n", s, meas[s], pred[s]);
    }
out:
    step_set_free(&V);
    step_set_free(&C);
    free(pred);
    free(rel);
    free(prof);
    v41_cost_destroy(cm);
    cJSON_Delete(j);
    return rc ? 2 : 0;
}
