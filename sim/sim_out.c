/* sim_out.c: simulator outputs (README.md, section 'Simulator' "Outputs"): per-request and KV
 * timeline tables as CSV and HDF5 (chunked, appended in blocks, so memory does
 * not grow with the trace), summary JSON / table, streaming percentiles, the
 * sweep merge, and the acceptance distribution read from serve-trace JSON. */
#include "v41_sim.h"
#include "sim_internal.h"
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <hdf5.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------------ histogram */

#define HIST_PER_DECADE 1000   /* bin ratio 10^(1/1000): 0.23% relative resolution */

void v41_hist_init(v41_hist *h)
{
    memset(h, 0, sizeof *h);
    h->lo = 1e-7;
    h->min = INFINITY;
    h->max = -INFINITY;
}

void v41_hist_add(v41_hist *h, double v)
{
    h->n++;
    h->sum += v;
    if (v < h->min) h->min = v;
    if (v > h->max) h->max = v;
    if (!(v > 0)) { h->zero++; return; }
    int b = (int)floor(log10(v / h->lo) * HIST_PER_DECADE);
    if (b < 0) b = 0;
    if (b >= V41_HIST_BINS) b = V41_HIST_BINS - 1;
    h->bins[b]++;
}

/* Quantile q in [0,1]: the geometric centre of the bin holding rank q*(n-1), clamped to [min, max]. */
double v41_hist_quantile(const v41_hist *h, double q)
{
    if (h->n == 0) return NAN;
    double rank = q * (double)(h->n - 1);
    if (rank < (double)h->zero) return h->min < 0 ? h->min : 0;
    int64_t c = h->zero;
    for (int b = 0; b < V41_HIST_BINS; b++) {
        c += h->bins[b];
        if ((double)c > rank) {
            double v = h->lo * pow(10.0, (b + 0.5) / HIST_PER_DECADE);
            return v < h->min ? h->min : v > h->max ? h->max : v;
        }
    }
    return h->max;
}

/* ------------------------------------------------------------------ tables */

#define TBUF 4096
typedef struct table {
    const char *name;
    int ncol;
    const char *const *cols;
    const bool *isint;
    FILE *csv;
    hid_t grp;
    hid_t *ds;
    double *buf;             /* [TBUF][ncol] */
    int nbuf;
    hsize_t rows;
} table;

static const char *req_cols[] = {"id", "line", "replica", "status", "t_arrive", "t_admit", "t_first", "t_finish",
                                 "ttft", "tpot", "e2e", "in_len", "out_len", "hit_tokens", "computed_rows",
                                 "replay_rows", "trimmed_rows", "verify_steps", "drafted", "accepted"};
static const bool req_int[] = {1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1};
static const char *kv_cols[] = {"t", "replica", "running", "waiting", "window", "comp", "index", "state", "dspark",
                                "cache_comp", "cache_index", "cache_window", "capacity"};
static const bool kv_int[] = {0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};

struct v41_sim_out {
    char *dir;
    char tmp[4][4096], fin[4][4096];
    hid_t h5;
    table req, kv;
    int err;
};

static int table_flush(table *t)
{
    if (!t->nbuf) return 0;
    hsize_t n = (hsize_t)t->nbuf, off = t->rows, tot = t->rows + n;
    int rc = 0;
    double *colbuf = malloc(sizeof(double) * n);
    int64_t *ibuf = malloc(sizeof(int64_t) * n);
    if (!colbuf || !ibuf) rc = -1;
    for (int c = 0; !rc && c < t->ncol; c++) {
        for (hsize_t i = 0; i < n; i++) {
            colbuf[i] = t->buf[i * t->ncol + c];
            ibuf[i] = (int64_t)colbuf[i];
        }
        if (H5Dset_extent(t->ds[c], &tot) < 0) { rc = -1; break; }
        hid_t fs = H5Dget_space(t->ds[c]);
        hid_t ms = H5Screate_simple(1, &n, NULL);
        H5Sselect_hyperslab(fs, H5S_SELECT_SET, &off, NULL, &n, NULL);
        herr_t e = t->isint[c] ? H5Dwrite(t->ds[c], H5T_NATIVE_INT64, ms, fs, H5P_DEFAULT, ibuf)
                               : H5Dwrite(t->ds[c], H5T_NATIVE_DOUBLE, ms, fs, H5P_DEFAULT, colbuf);
        H5Sclose(ms);
        H5Sclose(fs);
        if (e < 0) rc = -1;
    }
    free(colbuf);
    free(ibuf);
    t->rows = tot;
    t->nbuf = 0;
    return rc;
}

static int table_open(table *t, const char *name, const char *const *cols, const bool *isint, int ncol, FILE *csv,
                      hid_t h5)
{
    t->name = name;
    t->cols = cols;
    t->isint = isint;
    t->ncol = ncol;
    t->csv = csv;
    t->buf = malloc(sizeof(double) * TBUF * ncol);
    t->ds = calloc((size_t)ncol, sizeof *t->ds);
    if (!t->buf || !t->ds) return -1;
    for (int c = 0; c < ncol; c++) fprintf(csv, "%s%s", c ? "," : "", cols[c]);
    fputc('\n', csv);
    t->grp = H5Gcreate2(h5, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (t->grp < 0) return -1;
    hsize_t z = 0, mx = H5S_UNLIMITED, ch = TBUF;
    for (int c = 0; c < ncol; c++) {
        hid_t sp = H5Screate_simple(1, &z, &mx);
        hid_t pl = H5Pcreate(H5P_DATASET_CREATE);
        H5Pset_chunk(pl, 1, &ch);
        H5Pset_deflate(pl, 4);
        t->ds[c] = H5Dcreate2(t->grp, cols[c], isint[c] ? H5T_STD_I64LE : H5T_IEEE_F64LE, sp, H5P_DEFAULT, pl,
                              H5P_DEFAULT);
        H5Pclose(pl);
        H5Sclose(sp);
        if (t->ds[c] < 0) return -1;
    }
    return 0;
}

static int table_row(table *t, const double *v)
{
    for (int c = 0; c < t->ncol; c++) {
        if (t->isint[c]) fprintf(t->csv, "%s%lld", c ? "," : "", (long long)v[c]);
        else fprintf(t->csv, "%s%.9g", c ? "," : "", v[c]);
    }
    fputc('\n', t->csv);
    memcpy(t->buf + (size_t)t->nbuf * t->ncol, v, sizeof(double) * t->ncol);
    if (++t->nbuf == TBUF) return table_flush(t);
    return 0;
}

static void table_close(table *t)
{
    for (int c = 0; t->ds && c < t->ncol; c++)
        if (t->ds[c] > 0) H5Dclose(t->ds[c]);
    if (t->grp > 0) H5Gclose(t->grp);
    if (t->csv) fclose(t->csv);
    free(t->ds);
    free(t->buf);
    memset(t, 0, sizeof *t);
}

static int on_req(void *ud, const v41_sim_req_out *r)
{
    v41_sim_out *o = ud;
    double v[] = {(double)r->id, (double)r->line, r->replica, r->status, r->t_arrive, r->t_admit, r->t_first,
                  r->t_finish, r->ttft, r->tpot, r->e2e, (double)r->in_len, (double)r->out_len,
                  (double)r->hit_tokens, (double)r->computed_rows, (double)r->replay_rows, (double)r->trimmed_rows,
                  (double)r->verify_steps, (double)r->drafted, (double)r->accepted};
    if (table_row(&o->req, v)) o->err = 1;
    return o->err;
}

static int on_kv(void *ud, const v41_sim_kv_sample *s)
{
    v41_sim_out *o = ud;
    double v[] = {s->t, s->replica, s->running, s->waiting, s->window, s->comp, s->index, s->state, s->dspark,
                  s->cache_comp, s->cache_index, s->cache_window, s->capacity};
    if (table_row(&o->kv, v)) o->err = 1;
    return o->err;
}

static int mkdir_p(const char *dir)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, 0777) && errno != EEXIST) return -1;
            *p = '/';
        }
    if (mkdir(buf, 0777) && errno != EEXIST) return -1;
    return 0;
}

void v41_sim_out_abort(v41_sim_out *o)
{
    if (!o) return;
    table_close(&o->req);
    table_close(&o->kv);
    if (o->h5 > 0) H5Fclose(o->h5);
    for (int i = 0; i < 4; i++)
        if (o->tmp[i][0]) unlink(o->tmp[i]);
    free(o->dir);
    free(o);
}

int v41_sim_out_open(const char *dir, v41_sim_out **out, v41_err *err)
{
    *out = NULL;
    if (mkdir_p(dir)) return v41_err_set(err, V41_EIO, "--out %s: cannot create directory: %s", dir, strerror(errno));
    v41_sim_out *o = calloc(1, sizeof *o);
    if (!o) return v41_err_set(err, V41_ENOMEM, "out of memory");
    o->dir = strdup(dir);
    const char *names[4] = {"requests.csv", "kv.csv", "sim.h5", "summary.json"};
    for (int i = 0; i < 4; i++) {
        snprintf(o->fin[i], sizeof o->fin[i], "%s/%s", dir, names[i]);
        snprintf(o->tmp[i], sizeof o->tmp[i], "%s/.%s.tmp%ld", dir, names[i], (long)getpid());
    }
    FILE *f0 = fopen(o->tmp[0], "w"), *f1 = fopen(o->tmp[1], "w");
    o->h5 = H5Fcreate(o->tmp[2], H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (!f0 || !f1 || o->h5 < 0) {
        if (f0) fclose(f0);
        if (f1) fclose(f1);
        int e = errno;
        v41_sim_out_abort(o);
        return v41_err_set(err, V41_EIO, "--out %s: cannot create output files: %s", dir, strerror(e));
    }
    if (table_open(&o->req, "requests", req_cols, req_int, (int)(sizeof req_cols / sizeof *req_cols), f0, o->h5) ||
        table_open(&o->kv, "kv", kv_cols, kv_int, (int)(sizeof kv_cols / sizeof *kv_cols), f1, o->h5)) {
        v41_sim_out_abort(o);
        return v41_err_set(err, V41_EIO, "--out %s: cannot create HDF5 tables", dir);
    }
    *out = o;
    return V41_OK;
}

void v41_sim_out_sinks(v41_sim_out *o, v41_sim_sinks *s)
{
    s->ud = o;
    s->on_request = on_req;
    s->on_kv = on_kv;
}

int v41_sim_out_close(v41_sim_out *o, const v41_sim_opts *opts, const v41_sim_result *r, const char *params_json,
                      v41_err *err)
{
    char *js = v41_sim_summary_json(opts, r, params_json);
    int bad = o->err || !js || table_flush(&o->req) || table_flush(&o->kv);
    if (!bad) {
        hid_t st = H5Tcopy(H5T_C_S1);
        H5Tset_size(st, strlen(js) + 1);
        hid_t sp = H5Screate(H5S_SCALAR);
        hid_t a = H5Acreate2(o->h5, "summary", st, sp, H5P_DEFAULT, H5P_DEFAULT);
        bad |= a < 0 || H5Awrite(a, st, js) < 0;
        if (a >= 0) H5Aclose(a);
        const char *schema = "v41-sim/1";
        H5Tset_size(st, strlen(schema) + 1);
        a = H5Acreate2(o->h5, "schema", st, sp, H5P_DEFAULT, H5P_DEFAULT);
        bad |= a < 0 || H5Awrite(a, st, schema) < 0;
        if (a >= 0) H5Aclose(a);
        H5Sclose(sp);
        H5Tclose(st);
    }
    FILE *f = bad ? NULL : fopen(o->tmp[3], "w");
    if (f) {
        fputs(js, f);
        fputc('\n', f);
        bad |= fclose(f) != 0;
    } else bad = 1;
    free(js);
    bool ferr = (o->req.csv && (fflush(o->req.csv) || ferror(o->req.csv))) ||
                (o->kv.csv && (fflush(o->kv.csv) || ferror(o->kv.csv)));
    table_close(&o->req);
    table_close(&o->kv);
    bad |= H5Fclose(o->h5) < 0 || ferr;
    o->h5 = 0;
    if (bad) {
        int rc = v41_err_set(err, V41_EIO, "--out %s: write error", o->dir);
        v41_sim_out_abort(o);
        return rc;
    }
    for (int i = 0; i < 4; i++)
        if (rename(o->tmp[i], o->fin[i])) {
            int rc = v41_err_set(err, V41_EIO, "--out %s: rename: %s", o->fin[i], strerror(errno));
            v41_sim_out_abort(o);
            return rc;
        } else o->tmp[i][0] = 0;
    free(o->dir);
    free(o);
    return V41_OK;
}

/* ------------------------------------------------------------------ summary */

static void add_hist(cJSON *j, const char *name, const v41_hist *h)
{
    char k[64];
    const char *sfx[] = {"p50", "p90", "p99"};
    const double q[] = {0.5, 0.9, 0.99};
    snprintf(k, sizeof k, "%s_mean_s", name);
    cJSON_AddNumberToObject(j, k, h->n ? h->sum / (double)h->n : 0);
    for (int i = 0; i < 3; i++) {
        snprintf(k, sizeof k, "%s_%s_s", name, sfx[i]);
        cJSON_AddNumberToObject(j, k, h->n ? v41_hist_quantile(h, q[i]) : 0);
    }
    snprintf(k, sizeof k, "%s_max_s", name);
    cJSON_AddNumberToObject(j, k, h->n ? h->max : 0);
}

char *v41_sim_summary_json(const v41_sim_opts *o, const v41_sim_result *r, const char *params_json)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "schema", "v41-sim-summary/1");
    cJSON_AddStringToObject(j, "model", o->model_name);
    cJSON_AddStringToObject(j, "replay", o->replay_enc && o->replay_dec ? "on" : o->replay_enc ? "enc"
                                         : o->replay_dec ? "dec" : "off");
    cJSON_AddNumberToObject(j, "dspark", o->draft_len);
    cJSON_AddNumberToObject(j, "replicas", o->replicas);
    cJSON_AddNumberToObject(j, "gpus_per_replica", r->gpus);
    cJSON_AddNumberToObject(j, "token_budget", (double)o->token_budget);
    cJSON_AddNumberToObject(j, "kv_capacity_bytes", r->capacity);
    cJSON_AddStringToObject(j, "cost_source", o->profile ? o->profile->device : "roofline-h200");
#define N(k, v) cJSON_AddNumberToObject(j, k, (double)(v))
    N("requests", r->n_requests);
    N("finished", r->n_finished);
    N("rejected", r->n_rejected);
    N("skipped_rows", r->skipped_rows);
    N("sim_time_s", r->sim_end_s);
    N("wall_s", r->wall_s);
    N("events", r->events);
    N("events_per_s", r->wall_s > 0 ? r->events / r->wall_s : 0);
    N("steps", r->steps);
    N("busy_s", r->busy_s);
    N("in_tokens", r->in_tokens);
    N("out_tokens", r->out_tokens);
    N("throughput_out_tok_s", r->sim_end_s > 0 ? r->out_tokens / r->sim_end_s : 0);
    N("throughput_req_s", r->sim_end_s > 0 ? r->n_finished / r->sim_end_s : 0);
    add_hist(j, "ttft", &r->ttft);
    add_hist(j, "tpot", &r->tpot);
    add_hist(j, "e2e", &r->e2e);
    N("hit_tokens", r->hit_tokens);
    N("hit_ratio_tokens", r->in_tokens ? (double)r->hit_tokens / r->in_tokens : 0);
    N("cache_lookup_blocks", r->cache_lookups_blocks);
    N("cache_hit_blocks", r->cache_hit_blocks);
    N("evictions", r->evictions);
    N("prefill_rows_computed", r->computed_rows);
    N("replay_rows", r->replay_rows);
    N("trimmed_layer_rows", r->trimmed_layer_rows);
    N("flops", r->flops);
    N("bytes", r->bytes);
    N("trimmed_flops_saved", r->trimmed_flops);
    N("draft_flops", r->draft_flops);
    N("verify_steps", r->verify_steps);
    N("drafted", r->drafted);
    N("accepted", r->accepted);
    N("acceptance_rate", r->drafted ? (double)r->accepted / r->drafted : 0);
    N("tokens_per_verify", r->verify_steps ? (double)(r->accepted + r->verify_steps) / r->verify_steps : 0);
    N("peak_kv_window_bytes", r->peak_window);
    N("peak_kv_comp_bytes", r->peak_comp);
    N("peak_kv_index_bytes", r->peak_index);
    N("peak_kv_state_bytes", r->peak_state);
    N("peak_kv_dspark_bytes", r->peak_dspark);
    N("peak_kv_cache_bytes", r->peak_cache);
    N("peak_kv_total_bytes", r->peak_total);
    for (int c = 0; c < V41_OP_NCLASS; c++) {
        char k[64];
        snprintf(k, sizeof k, "time_%s_s", v41_op_class_name(c));
        N(k, r->time_c[c]);
    }
#undef N
    if (params_json) {
        cJSON *p = cJSON_Parse(params_json);
        if (p) cJSON_AddItemToObject(j, "params", p);
    }
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    return s;
}

static const char *hb(double b, char *buf)
{
    const char *u[] = {"B", "KB", "MB", "GB", "TB", "PB"};
    int i = 0;
    while (b >= 1000 && i < 5) { b /= 1000; i++; }
    snprintf(buf, 32, "%.3g %s", b, u[i]);
    return buf;
}

void v41_sim_summary_print(FILE *f, const v41_sim_opts *o, const v41_sim_result *r)
{
    char b1[32], b2[32], b3[32], b4[32];
    fprintf(f, "v41 sim: model %s, replay %s, dspark %d, %d replica(s) x %d GPU(s), budget %lld, KV capacity %s\n",
            o->model_name, o->replay_enc && o->replay_dec ? "on" : o->replay_enc ? "enc" : o->replay_dec ? "dec" : "off",
            o->draft_len, o->replicas, r->gpus, (long long)o->token_budget, hb(r->capacity, b1));
    fprintf(f, "  requests %lld  finished %lld  rejected %lld  skipped rows %lld\n", (long long)r->n_requests,
            (long long)r->n_finished, (long long)r->n_rejected, (long long)r->skipped_rows);
    fprintf(f, "  %-6s %10s %10s %10s %10s\n", "", "mean", "p50", "p90", "p99");
    const v41_hist *hs[] = {&r->ttft, &r->tpot, &r->e2e};
    const char *nm[] = {"TTFT", "TPOT", "E2E"};
    for (int i = 0; i < 3; i++)
        fprintf(f, "  %-6s %9.4gs %9.4gs %9.4gs %9.4gs\n", nm[i], hs[i]->n ? hs[i]->sum / hs[i]->n : 0,
                v41_hist_quantile(hs[i], .5), v41_hist_quantile(hs[i], .9), v41_hist_quantile(hs[i], .99));
    double T = r->sim_end_s > 0 ? r->sim_end_s : 1;
    fprintf(f, "  simulated %.1f s, busy %.1f s; throughput %.1f out tok/s, %.3f req/s\n", r->sim_end_s, r->busy_s,
            r->out_tokens / T, r->n_finished / T);
    fprintf(f, "  prefix cache: hit %lld of %lld input tokens (%.1f%%), %lld evictions\n", (long long)r->hit_tokens,
            (long long)r->in_tokens, r->in_tokens ? 100.0 * r->hit_tokens / r->in_tokens : 0, (long long)r->evictions);
    fprintf(f, "  prefill rows computed %lld (replayed %lld); decoder-side trim skipped %lld layer-rows, %.4g FLOPs\n",
            (long long)r->computed_rows, (long long)r->replay_rows, (long long)r->trimmed_layer_rows, r->trimmed_flops);
    if (r->drafted)
        fprintf(f, "  DSpark: %lld verify steps, acceptance %.3f, %.3f tokens per verify step\n",
                (long long)r->verify_steps, (double)r->accepted / r->drafted,
                (double)(r->accepted + r->verify_steps) / r->verify_steps);
    fprintf(f, "  peak KV: window %s, compressed %s, index %s, cache %s\n", hb(r->peak_window, b1),
            hb(r->peak_comp, b2), hb(r->peak_index, b3), hb(r->peak_cache, b4));
    fprintf(f, "  %lld events, %lld steps in %.2f s wall (%.3g events/s)\n", (long long)r->events,
            (long long)r->steps, r->wall_s, r->wall_s > 0 ? r->events / r->wall_s : 0);
}

/* ------------------------------------------------------------------ merge */

static cJSON *read_json(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    cJSON *j = NULL;
    if (b && fread(b, 1, (size_t)n, f) == (size_t)n) {
        b[n] = 0;
        j = cJSON_Parse(b);
    }
    free(b);
    fclose(f);
    return j;
}

static int cmpstr(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

typedef struct strv { char **v; int n, cap; } strv;
static int strv_add(strv *s, const char *x)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->v[i], x)) return 0;
    if (s->n == s->cap) {
        int nc = s->cap ? s->cap * 2 : 32;
        char **nv = realloc(s->v, sizeof *nv * (size_t)nc);
        if (!nv) return -1;
        s->v = nv;
        s->cap = nc;
    }
    s->v[s->n++] = strdup(x);
    return 0;
}
static void strv_free(strv *s)
{
    for (int i = 0; i < s->n; i++) free(s->v[i]);
    free(s->v);
}

static void csv_cell(FILE *f, const cJSON *v)
{
    if (cJSON_IsNumber(v)) fprintf(f, "%.10g", v->valuedouble);
    else if (cJSON_IsString(v)) {
        bool q = strpbrk(v->valuestring, ",\"\n") != NULL;
        if (!q) fputs(v->valuestring, f);
        else {
            fputc('"', f);
            for (const char *p = v->valuestring; *p; p++) {
                if (*p == '"') fputc('"', f);
                fputc(*p, f);
            }
            fputc('"', f);
        }
    } else if (cJSON_IsBool(v)) fputs(cJSON_IsTrue(v) ? "true" : "false", f);
}

int v41_sim_merge(char **dirs, int n, const char *out_csv, v41_err *err)
{
    strv files = {0}, cols = {0};
    int rc = V41_OK;
    for (int i = 0; i < n; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/summary.json", dirs[i]);
        if (access(p, R_OK) == 0) { strv_add(&files, p); continue; }
        DIR *d = opendir(dirs[i]);
        if (!d) { rc = v41_err_set(err, V41_EIO, "--merge %s: not a directory with summary.json", dirs[i]); goto out; }
        strv sub = {0};
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            snprintf(p, sizeof p, "%s/%s/summary.json", dirs[i], e->d_name);
            if (access(p, R_OK) == 0) strv_add(&sub, p);
        }
        closedir(d);
        qsort(sub.v, (size_t)sub.n, sizeof *sub.v, cmpstr);
        for (int k = 0; k < sub.n; k++) strv_add(&files, sub.v[k]);
        if (!sub.n) { strv_free(&sub); rc = v41_err_set(err, V41_ENOTFOUND, "--merge %s: no summary.json in it or its subdirectories", dirs[i]); goto out; }
        strv_free(&sub);
    }
    /* columns: params.* first, then the scalar summary keys, in order of first appearance */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < files.n; i++) {
            cJSON *j = read_json(files.v[i]);
            if (!j) { rc = v41_err_set(err, V41_EINVAL, "--merge: %s is not valid JSON", files.v[i]); goto out; }
            const cJSON *par = cJSON_GetObjectItemCaseSensitive(j, "params");
            char k[512];
            if (pass == 0 && par)
                for (const cJSON *x = par->child; x; x = x->next) {
                    snprintf(k, sizeof k, "params.%s", x->string);
                    strv_add(&cols, k);
                }
            if (pass == 1)
                for (const cJSON *x = j->child; x; x = x->next)
                    if (!cJSON_IsObject(x) && !cJSON_IsArray(x)) strv_add(&cols, x->string);
            cJSON_Delete(j);
        }
    char tmp[4200];
    FILE *f = stdout;
    if (out_csv) {
        snprintf(tmp, sizeof tmp, "%s.tmp%ld", out_csv, (long)getpid());
        f = fopen(tmp, "w");
        if (!f) { rc = v41_err_set(err, V41_EIO, "--merge: cannot write %s: %s", out_csv, strerror(errno)); goto out; }
    }
    fputs("source", f);
    for (int c = 0; c < cols.n; c++) fprintf(f, ",%s", cols.v[c]);
    fputc('\n', f);
    for (int i = 0; i < files.n; i++) {
        cJSON *j = read_json(files.v[i]);
        const cJSON *par = cJSON_GetObjectItemCaseSensitive(j, "params");
        fputs(files.v[i], f);
        for (int c = 0; c < cols.n; c++) {
            fputc(',', f);
            const cJSON *v = !strncmp(cols.v[c], "params.", 7)
                                 ? (par ? cJSON_GetObjectItemCaseSensitive(par, cols.v[c] + 7) : NULL)
                                 : cJSON_GetObjectItemCaseSensitive(j, cols.v[c]);
            csv_cell(f, v);
        }
        fputc('\n', f);
        cJSON_Delete(j);
    }
    if (out_csv) {
        if (fclose(f) || rename(tmp, out_csv)) {
            unlink(tmp);
            rc = v41_err_set(err, V41_EIO, "--merge: cannot write %s", out_csv);
        }
    }
out:
    strv_free(&files);
    strv_free(&cols);
    return rc;
}

/* ------------------------------------------------------------------ acceptance from serve-trace */

/* an accepted-draft count as an index 0..V41_ACC_MAXLEN, -1 for anything else (fractions truncate, as
 * before; the range test comes before the conversion, which is undefined for huge values) */
static int acc_index(double v)
{
    return v >= 0 && v < V41_ACC_MAXLEN + 1 ? (int)v : -1;
}

static void collect_acc(const cJSON *j, double *cnt, int *maxk)
{
    for (const cJSON *x = j ? j->child : NULL; x; x = x->next) {
        if (x->string && !strcmp(x->string, "accepted_hist") && cJSON_IsArray(x)) {
            int k = 0;
            for (const cJSON *e = x->child; e && k <= V41_ACC_MAXLEN; e = e->next, k++)
                if (cJSON_IsNumber(e) && e->valuedouble > 0 && e->valuedouble <= 1e300) {   /* finite counts */
                    cnt[k] += e->valuedouble;
                    if (k > *maxk) *maxk = k;
                }
        } else if (x->string && !strcmp(x->string, "accepted")) {
            if (cJSON_IsNumber(x)) {
                int k = acc_index(x->valuedouble);
                if (k >= 0) { cnt[k]++; if (k > *maxk) *maxk = k; }
            } else if (cJSON_IsArray(x)) {
                for (const cJSON *e = x->child; e; e = e->next) {
                    int k = cJSON_IsNumber(e) ? acc_index(e->valuedouble) : -1;
                    if (k >= 0) { cnt[k]++; if (k > *maxk) *maxk = k; }
                }
            }
        } else if (cJSON_IsObject(x) || cJSON_IsArray(x)) {
            collect_acc(x, cnt, maxk);
        }
    }
}

int v41_accept_load(const char *path, v41_accept *a, v41_err *err)
{
    memset(a, 0, sizeof *a);
    cJSON *j = read_json(path);
    if (!j) return v41_err_set(err, V41_EINVAL, "--accept file:%s: cannot read or not valid JSON", path);
    double cnt[V41_ACC_MAXLEN + 1] = {0}, tot = 0;
    int maxk = -1;
    collect_acc(j, cnt, &maxk);
    cJSON_Delete(j);
    for (int k = 0; k <= maxk; k++) tot += cnt[k];
    if (maxk < 0 || !(tot > 0 && isfinite(tot)))
        return v41_err_set(err, V41_EINVAL,
                           "--accept file:%s: no \"accepted\" counts (per verify step) or \"accepted_hist\" found", path);
    a->kind = V41_ACC_EMPIRICAL;
    a->pmf_len = maxk + 1;
    for (int k = 0; k <= maxk; k++) a->pmf[k] = cnt[k] / tot;
    return V41_OK;
}
