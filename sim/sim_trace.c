/* sim_trace.c: streaming request-trace readers (README.md, section 'Simulator' "Traces").
 *
 * Mooncake FAST'25 JSONL: {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}.
 * Azure LLM inference 2023 CSV: TIMESTAMP (YYYY-MM-DD HH:MM:SS.fffffff), ContextTokens, GeneratedTokens.
 * Synthetic: Poisson or gamma arrivals, length distributions, shared-prefix groups.
 * One record is held at a time, so memory does not grow with the trace. */
#include "v41_sim.h"
#include "sim_internal.h"
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { FMT_MOONCAKE = 0, FMT_AZURE, FMT_SYNTH };

/* Input bounds, so that every count and time the simulator derives from a record stays a finite
 * double and an int64 without overflow: request lengths (and synthetic prefixes and block sizes)
 * up to 10^9 tokens, timestamps up to 10^15 ms (31,000 years), synthetic traces up to 10^9
 * requests at rates of 10^-9 to 10^9 per second. */
#define V41_TRACE_MAX_TOKENS 1.0e9
#define V41_TRACE_MAX_MS 1.0e15
static const char *fmt_names[] = {"mooncake", "azure", "synthetic"};

typedef struct synth_dist {
    int kind;          /* 0 fixed, 1 uniform, 2 lognormal, 3 exp */
    double a, b;
} synth_dist;

struct v41_trace {
    int fmt;
    bool lenient;
    char *path;
    FILE *f;
    double size;            /* bytes, for progress */
    double pos;
    char *line;
    size_t cap;
    int64_t lineno, skipped, nrec;
    double t0, last_t;      /* first record's absolute time; last relative time */
    bool have_t0;
    int64_t *hash;
    int hash_cap;
    /* azure: column indices */
    int c_ts, c_in, c_out, ncols;
    /* synthetic */
    v41_rng rng;
    int64_t s_n, s_block, s_groups, s_prefix;
    double s_rate, s_cv, s_t;
    int s_arrival;          /* 0 poisson, 1 gamma */
    synth_dist s_in, s_out;
    int64_t s_next_id;
};

int64_t v41_trace_skipped(const v41_trace *t) { return t->skipped; }
const char *v41_trace_format(const v41_trace *t) { return fmt_names[t->fmt]; }
double v41_trace_progress(const v41_trace *t)
{
    if (t->fmt == FMT_SYNTH) return t->s_n > 0 ? (double)t->nrec / (double)t->s_n : -1;
    return t->size > 0 ? t->pos / t->size : -1;
}

void v41_trace_close(v41_trace *t)
{
    if (!t) return;
    if (t->f) fclose(t->f);
    free(t->path);
    free(t->line);
    free(t->hash);
    free(t);
}

static int hash_reserve(v41_trace *t, int n)
{
    if (n <= t->hash_cap) return 0;
    int64_t c = t->hash_cap ? t->hash_cap : 64;
    while (c < n) c *= 2;
    if (c > INT32_MAX) c = n;
    int64_t *h = realloc(t->hash, (size_t)c * sizeof *h);
    if (!h) return -1;
    t->hash = h;
    t->hash_cap = (int)c;
    return 0;
}

/* Read one line (without the newline) into t->line; returns length, -1 at EOF. */
static ssize_t read_line(v41_trace *t)
{
    ssize_t n = getline(&t->line, &t->cap, t->f);
    if (n < 0) return -1;
    t->pos += (double)n;
    t->lineno++;
    while (n > 0 && (t->line[n - 1] == '\n' || t->line[n - 1] == '\r')) t->line[--n] = 0;
    return n;
}

static bool blank(const char *s)
{
    for (; *s; s++)
        if (!isspace((unsigned char)*s)) return false;
    return true;
}

int v41_trace_open(const char *path, const char *format, bool lenient, v41_trace **out, v41_err *err)
{
    *out = NULL;
    v41_trace *t = calloc(1, sizeof *t);
    if (!t) return v41_err_set(err, V41_ENOMEM, "trace %s: out of memory", path);
    t->lenient = lenient;
    t->path = strdup(path);
    t->f = fopen(path, "rb");
    if (!t->f) {
        int e = errno;
        v41_trace_close(t);
        return v41_err_set(err, V41_EIO, "trace %s: cannot open: %s", path, strerror(e));
    }
    struct stat st;
    if (fstat(fileno(t->f), &st) == 0 && S_ISREG(st.st_mode)) t->size = (double)st.st_size;
    if (!format || !strcmp(format, "auto")) {
        const char *dot = strrchr(path, '.');
        if (dot && (!strcmp(dot, ".jsonl") || !strcmp(dot, ".json"))) t->fmt = FMT_MOONCAKE;
        else if (dot && !strcmp(dot, ".csv")) t->fmt = FMT_AZURE;
        else {
            int c;
            while ((c = fgetc(t->f)) != EOF && isspace(c)) {}
            t->fmt = c == '{' ? FMT_MOONCAKE : FMT_AZURE;
            rewind(t->f);
        }
    } else if (!strcmp(format, "mooncake")) t->fmt = FMT_MOONCAKE;
    else if (!strcmp(format, "azure")) t->fmt = FMT_AZURE;
    else {
        v41_trace_close(t);
        return v41_err_set(err, V41_EINVAL, "trace format '%s': expected mooncake, azure or auto", format);
    }
    if (t->fmt == FMT_AZURE) {
        /* header: find the three columns by name */
        ssize_t n;
        do n = read_line(t); while (n >= 0 && blank(t->line));
        if (n < 0) {
            v41_trace_close(t);
            return v41_err_set(err, V41_EINVAL, "trace %s: empty file (expected a CSV header)", path);
        }
        t->c_ts = t->c_in = t->c_out = -1;
        int col = 0;
        for (char *s = t->line, *tok; (tok = strsep(&s, ",")); col++) {
            while (isspace((unsigned char)*tok)) tok++;
            size_t l = strlen(tok);
            while (l && isspace((unsigned char)tok[l - 1])) tok[--l] = 0;
            if (!strcmp(tok, "TIMESTAMP")) t->c_ts = col;
            else if (!strcmp(tok, "ContextTokens")) t->c_in = col;
            else if (!strcmp(tok, "GeneratedTokens")) t->c_out = col;
        }
        t->ncols = col;
        if (t->c_ts < 0 || t->c_in < 0 || t->c_out < 0) {
            int64_t ln = t->lineno;
            v41_trace_close(t);
            return v41_err_set(err, V41_EINVAL,
                               "trace %s:%lld: header must name TIMESTAMP, ContextTokens and GeneratedTokens "
                               "(Azure LLM inference 2023 CSV)", path, (long long)ln);
        }
    }
    *out = t;
    return V41_OK;
}

/* days from 1970-01-01 of a civil date (proleptic Gregorian) */
static int64_t days_from_civil(int64_t y, int m, int d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* "YYYY-MM-DD HH:MM:SS[.fffffff]" (optional 'T', optional trailing Z/+00:00) -> seconds */
static int parse_stamp(const char *s, double *out)
{
    int y, mo, d, h, mi, n = 0;
    if (sscanf(s, "%4d-%2d-%2d%*1[ T]%2d:%2d:%n", &y, &mo, &d, &h, &mi, &n) != 5 || n == 0) return -1;
    if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || h < 0 || mi < 0) return -1;
    char *e;
    errno = 0;
    double sec = strtod(s + n, &e);
    if (e == s + n || errno || !(sec >= 0 && sec < 61)) return -1;   /* NaN fails too */
    while (isspace((unsigned char)*e)) e++;
    if (*e == 'Z') e++;
    else if (!strcmp(e, "+00:00")) e += 6;
    if (*e) return -1;
    *out = (double)days_from_civil(y, mo, d) * 86400.0 + h * 3600.0 + mi * 60.0 + sec;
    return 0;
}

static int parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    while (isspace((unsigned char)*s)) s++;
    char *e;
    errno = 0;
    long long v = strtoll(s, &e, 10);
    if (e == s || errno) return -1;
    while (isspace((unsigned char)*e)) e++;
    if (*e || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* A malformed row: an error naming file and line, or (lenient) a skip. */
static int bad_row(v41_trace *t, v41_err *err, const char *what)
{
    if (t->lenient) {
        t->skipped++;
        return 1;
    }
    return v41_err_set(err, V41_EINVAL, "trace %s:%lld: %s", t->path, (long long)t->lineno, what);
}

static const cJSON *get_num(const cJSON *o, const char *k)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(j) ? j : NULL;
}

static bool is_int(double v, double lo, double hi) { return v >= lo && v <= hi && v == floor(v); }

static int next_mooncake(v41_trace *t, v41_trace_rec *rec, bool *eof, v41_err *err)
{
    char msg[256];
    for (;;) {
        ssize_t n = read_line(t);
        if (n < 0) {
            if (ferror(t->f)) return v41_err_set(err, V41_EIO, "trace %s: read error", t->path);
            *eof = true;
            return V41_OK;
        }
        if (blank(t->line)) continue;
        cJSON *j = cJSON_ParseWithLength(t->line, (size_t)n);
        int rc;
        if (!j || !cJSON_IsObject(j)) {
            cJSON_Delete(j);
            if ((rc = bad_row(t, err, "not a JSON object (Mooncake JSONL: one request per line)")) == 1) continue;
            return rc;
        }
        const cJSON *ts = get_num(j, "timestamp"), *il = get_num(j, "input_length"),
                    *ol = get_num(j, "output_length");
        const cJSON *hs = cJSON_GetObjectItemCaseSensitive(j, "hash_ids");
        const char *bad = NULL;
        if (!ts || !(ts->valuedouble >= 0 && ts->valuedouble <= V41_TRACE_MAX_MS))
            bad = "'timestamp' missing or not a number in [0, 1e15] (milliseconds)";
        else if (!il || !is_int(il->valuedouble, 1, V41_TRACE_MAX_TOKENS))
            bad = "'input_length' missing or not an integer in [1, 1e9]";
        else if (!ol || !is_int(ol->valuedouble, 1, V41_TRACE_MAX_TOKENS))
            bad = "'output_length' missing or not an integer in [1, 1e9]";
        else if (hs && !cJSON_IsArray(hs)) bad = "'hash_ids' is not an array";
        int nh = hs ? cJSON_GetArraySize(hs) : 0;
        if (!bad && hash_reserve(t, nh)) {
            cJSON_Delete(j);
            return v41_err_set(err, V41_ENOMEM, "trace %s:%lld: out of memory", t->path, (long long)t->lineno);
        }
        if (!bad && hs) {
            int i = 0;
            for (const cJSON *h = hs->child; h; h = h->next, i++) {
                if (!cJSON_IsNumber(h) || !is_int(h->valuedouble, 0, 9.0e15)) {
                    snprintf(msg, sizeof msg, "'hash_ids'[%d] is not an integer in [0, 9e15]", i);
                    bad = msg;
                    break;
                }
                t->hash[i] = (int64_t)h->valuedouble;
            }
        }
        double tsec = ts ? ts->valuedouble / 1000.0 : 0;
        if (!bad && t->nrec > 0 && tsec - t->t0 < t->last_t) {
            snprintf(msg, sizeof msg, "timestamp %.0f ms is earlier than the previous row's %.0f ms (trace must be sorted)",
                     ts->valuedouble, (t->last_t + t->t0) * 1000.0);
            bad = msg;
        }
        if (bad) {
            cJSON_Delete(j);
            if ((rc = bad_row(t, err, bad)) == 1) continue;
            return rc;
        }
        if (!t->have_t0) {
            t->t0 = tsec;
            t->have_t0 = true;
        }
        rec->line = t->lineno;
        rec->t_arrive = tsec - t->t0;
        rec->in_len = (int64_t)il->valuedouble;
        rec->out_len = (int64_t)ol->valuedouble;
        rec->n_hash = nh;
        rec->hash = t->hash;
        t->last_t = rec->t_arrive;
        t->nrec++;
        cJSON_Delete(j);
        *eof = false;
        return V41_OK;
    }
}

static int next_azure(v41_trace *t, v41_trace_rec *rec, bool *eof, v41_err *err)
{
    char msg[256];
    for (;;) {
        ssize_t n = read_line(t);
        if (n < 0) {
            if (ferror(t->f)) return v41_err_set(err, V41_EIO, "trace %s: read error", t->path);
            *eof = true;
            return V41_OK;
        }
        if (blank(t->line)) continue;
        char *cols[64];
        int nc = 0;
        for (char *s = t->line, *tok; (tok = strsep(&s, ",")) && nc < 64;) cols[nc++] = tok;
        const char *bad = NULL;
        double ts = 0;
        int64_t in = 0, outl = 0;
        if (nc != t->ncols) {
            snprintf(msg, sizeof msg, "%d columns, the header has %d", nc, t->ncols);
            bad = msg;
        } else if (parse_stamp(cols[t->c_ts], &ts)) {
            snprintf(msg, sizeof msg, "TIMESTAMP '%.40s' is not YYYY-MM-DD HH:MM:SS[.fffffff]", cols[t->c_ts]);
            bad = msg;
        } else if (parse_int(cols[t->c_in], 1, (int64_t)V41_TRACE_MAX_TOKENS, &in))
            bad = "ContextTokens is not an integer in [1, 1e9]";
        else if (parse_int(cols[t->c_out], 1, (int64_t)V41_TRACE_MAX_TOKENS, &outl))
            bad = "GeneratedTokens is not an integer in [1, 1e9]";
        else if (t->have_t0 && ts - t->t0 < t->last_t) bad = "TIMESTAMP earlier than the previous row's (trace must be sorted)";
        if (bad) {
            int rc = bad_row(t, err, bad);
            if (rc == 1) continue;
            return rc;
        }
        if (!t->have_t0) {
            t->t0 = ts;
            t->have_t0 = true;
        }
        rec->line = t->lineno;
        rec->t_arrive = ts - t->t0;
        rec->in_len = in;
        rec->out_len = outl;
        rec->n_hash = 0;
        rec->hash = NULL;
        t->last_t = rec->t_arrive;
        t->nrec++;
        *eof = false;
        return V41_OK;
    }
}

/* ---------------------------------------------------------------- synthetic */

static int parse_dist(const char *v, synth_dist *d)
{
    char kind[16] = {0};
    double a = 0, b = 0;
    int n = sscanf(v, "%15[a-z]:%lf:%lf", kind, &a, &b);
    if (n >= 2 && !strcmp(kind, "fixed")) *d = (synth_dist){0, a, 0};
    else if (n == 3 && !strcmp(kind, "uniform") && b >= a && b <= V41_TRACE_MAX_TOKENS) *d = (synth_dist){1, a, b};
    else if (n == 3 && !strcmp(kind, "lognormal") && b >= 0 && b <= 10) *d = (synth_dist){2, a, b};
    else if (n >= 2 && !strcmp(kind, "exp")) *d = (synth_dist){3, a, 0};
    else return -1;
    return d->a >= 1 && d->a <= V41_TRACE_MAX_TOKENS ? 0 : -1;   /* NaN fails too */
}

static int64_t draw(v41_rng *r, const synth_dist *d)
{
    double x;
    switch (d->kind) {
    case 0: x = d->a; break;
    case 1: x = d->a + (d->b - d->a + 1) * v41_rng_unif(r); break;
    case 2: /* lognormal with the given MEAN (not median): mu = ln(mean) - sigma^2/2 */
        x = exp(log(d->a) - 0.5 * d->b * d->b + d->b * v41_rng_normal(r));
        break;
    default: x = -d->a * log(v41_rng_unif(r)); break;
    }
    /* the tails of lognormal and exp are clamped to the token bound */
    if (!(x < V41_TRACE_MAX_TOKENS)) return (int64_t)V41_TRACE_MAX_TOKENS;
    int64_t v = (int64_t)floor(x);
    return v < 1 ? 1 : v;
}

int v41_trace_open_synth(const char *spec, v41_trace **out, v41_err *err)
{
    *out = NULL;
    v41_trace *t = calloc(1, sizeof *t);
    if (!t) return v41_err_set(err, V41_ENOMEM, "synthetic trace: out of memory");
    t->fmt = FMT_SYNTH;
    t->path = strdup("synthetic");
    t->s_n = 1000;
    t->s_rate = 1.0;
    t->s_cv = 1.0;
    t->s_block = 512;
    t->s_in = (synth_dist){2, 4096, 1.0};
    t->s_out = (synth_dist){2, 300, 0.8};
    uint64_t seed = 1;
    char *dup = strdup(spec ? spec : ""), *s = dup, *kv;
    int rc = V41_OK;
    while ((kv = strsep(&s, ","))) {
        if (!*kv) continue;
        char *eq = strchr(kv, '=');
        if (!eq) { rc = v41_err_set(err, V41_EINVAL, "--synth: '%s' is not key=value", kv); break; }
        *eq = 0;
        const char *k = kv, *v = eq + 1;
        char *e;
        double x = strtod(v, &e);
        bool num = e != v && !*e;
        if (!strcmp(k, "n") && num && is_int(x, 1, 1e9)) t->s_n = (int64_t)x;
        else if (!strcmp(k, "rate") && num && x >= 1e-9 && x <= 1e9) t->s_rate = x;
        else if (!strcmp(k, "cv") && num && x >= 1e-6 && x <= 1e6) t->s_cv = x;
        else if (!strcmp(k, "arrival") && (!strcmp(v, "poisson") || !strcmp(v, "gamma"))) t->s_arrival = !strcmp(v, "gamma");
        else if (!strcmp(k, "in") && !parse_dist(v, &t->s_in)) {}
        else if (!strcmp(k, "out") && !parse_dist(v, &t->s_out)) {}
        else if (!strcmp(k, "groups") && num && is_int(x, 0, 1e9)) t->s_groups = (int64_t)x;
        else if (!strcmp(k, "prefix") && num && is_int(x, 0, V41_TRACE_MAX_TOKENS)) t->s_prefix = (int64_t)x;
        else if (!strcmp(k, "block") && num && is_int(x, 1, V41_TRACE_MAX_TOKENS)) t->s_block = (int64_t)x;
        else if (!strcmp(k, "seed") && num && is_int(x, 0, 9.0e15)) seed = (uint64_t)x;
        else { rc = v41_err_set(err, V41_EINVAL, "--synth: bad or unknown '%s=%s' (see v41 sim --help)", k, v); break; }
    }
    free(dup);
    if (rc) { v41_trace_close(t); return rc; }
    v41_rng_seed(&t->rng, seed);
    t->s_next_id = (t->s_groups + 1) * ((t->s_prefix + t->s_block - 1) / t->s_block + 1);
    *out = t;
    return V41_OK;
}

static int next_synth(v41_trace *t, v41_trace_rec *rec, bool *eof, v41_err *err)
{
    if (t->nrec >= t->s_n) { *eof = true; return V41_OK; }
    if (t->nrec > 0) {
        double gap;
        if (t->s_arrival == 0) gap = -log(v41_rng_unif(&t->rng)) / t->s_rate;
        else {   /* gamma with mean 1/rate and coefficient of variation cv: shape 1/cv^2 */
            double k = 1.0 / (t->s_cv * t->s_cv);
            gap = v41_rng_gamma(&t->rng, k) / (k * t->s_rate);
        }
        t->s_t += gap;
    }
    int64_t g = t->s_groups > 0 ? (int64_t)(v41_rng_u64(&t->rng) % (uint64_t)t->s_groups) : -1;
    int64_t pre = g >= 0 ? t->s_prefix : 0;
    int64_t in = pre + draw(&t->rng, &t->s_in);
    int64_t outl = draw(&t->rng, &t->s_out);
    int64_t nb64 = (in + t->s_block - 1) / t->s_block;
    if (nb64 > (1 << 26))
        return v41_err_set(err, V41_EINVAL, "synthetic trace: request %lld has %lld tokens, %lld prefix blocks of "
                           "block=%lld (at most 2^26 blocks a request: raise block)", (long long)t->nrec + 1,
                           (long long)in, (long long)nb64, (long long)t->s_block);
    int nb = (int)nb64;
    if (hash_reserve(t, nb)) return v41_err_set(err, V41_ENOMEM, "synthetic trace: out of memory");
    int64_t shared = pre / t->s_block;  /* full blocks of the group prefix */
    int64_t per_group = (t->s_prefix + t->s_block - 1) / t->s_block + 1;
    for (int i = 0; i < nb; i++)
        t->hash[i] = i < shared ? g * per_group + i : t->s_next_id++;
    t->nrec++;
    t->lineno = t->nrec;
    rec->line = t->nrec;
    rec->t_arrive = t->s_t;
    rec->in_len = in;
    rec->out_len = outl;
    rec->n_hash = nb;
    rec->hash = t->hash;
    *eof = false;
    return V41_OK;
}

int v41_trace_next(v41_trace *t, v41_trace_rec *rec, bool *eof, v41_err *err)
{
    switch (t->fmt) {
    case FMT_MOONCAKE: return next_mooncake(t, rec, eof, err);
    case FMT_AZURE: return next_azure(t, rec, eof, err);
    default: return next_synth(t, rec, eof, err);
    }
}

int v41_trace_write_jsonl(v41_trace *t, FILE *f, int64_t limit, v41_err *err)
{
    v41_trace_rec r;
    bool eof = false;
    for (int64_t i = 0; limit <= 0 || i < limit; i++) {
        int rc = v41_trace_next(t, &r, &eof, err);
        if (rc) return rc;
        if (eof) break;
        fprintf(f, "{\"timestamp\": %.0f, \"input_length\": %lld, \"output_length\": %lld, \"hash_ids\": [",
                floor(r.t_arrive * 1000.0), (long long)r.in_len, (long long)r.out_len);
        for (int k = 0; k < r.n_hash; k++) fprintf(f, "%s%lld", k ? ", " : "", (long long)r.hash[k]);
        fputs("]}\n", f);
    }
    if (ferror(f)) return v41_err_set(err, V41_EIO, "write error");
    return V41_OK;
}
