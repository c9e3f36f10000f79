/* runner.c: prefill + greedy decode (+ DSpark drafts) through an engine,
 * every tap streamed into a dump (v41_runner.h). */
#include "config.h"
#include "v41_runner.h"
#include "v41_cli.h"
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void v41_run_inputs_free(v41_run_inputs *in)
{
    if (!in) return;
    for (int i = 0; i < in->n_req; i++) free(in->ids ? in->ids[i] : NULL);
    free(in->ids);
    free(in->len);
    memset(in, 0, sizeof *in);
}

static int inputs_add(v41_run_inputs *in, int32_t *ids, int len)
{
    int32_t **ni = realloc(in->ids, sizeof *ni * (size_t)(in->n_req + 1));
    if (!ni) return -1;
    in->ids = ni;
    int *nl = realloc(in->len, sizeof *nl * (size_t)(in->n_req + 1));
    if (!nl) return -1;
    in->len = nl;
    in->ids[in->n_req] = ids;
    in->len[in->n_req] = len;
    in->n_req++;
    return 0;
}

int v41_run_inputs_load(const char *path, int vocab, v41_run_inputs *in, v41_err *err)
{
    memset(in, 0, sizeof *in);
    FILE *f = fopen(path, "r");
    if (!f) return v41_err_set(err, V41_EIO, "%s: cannot open prompt file (%s)", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int lineno = 0;
    int rc = 0;
    while (!rc && (n = getline(&line, &cap, f)) >= 0) {
        lineno++;
        char *h = strchr(line, '#');
        if (h) *h = 0;
        int32_t *ids = NULL;
        int len = 0, icap = 0;
        char *p = line;
        for (;;) {
            while (*p && (isspace((unsigned char)*p) || *p == ',')) p++;
            if (!*p) break;
            char *end;
            errno = 0;
            long v = strtol(p, &end, 10);
            if (end == p || errno || v < 0 || v >= vocab) {
                rc = v41_err_set(err, V41_EINVAL, "%s:%d: bad token id '%.20s' (vocab %d)", path, lineno, p, vocab);
                break;
            }
            if (len == icap) {
                icap = icap ? icap * 2 : 64;
                int32_t *ni = realloc(ids, sizeof(int32_t) * (size_t)icap);
                if (!ni) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); break; }
                ids = ni;
            }
            ids[len++] = (int32_t)v;
            p = end;
        }
        if (rc || len == 0) { free(ids); continue; }
        if (inputs_add(in, ids, len)) { free(ids); rc = v41_err_set(err, V41_ENOMEM, "out of memory"); }
    }
    free(line);
    fclose(f);
    if (!rc && in->n_req == 0) rc = v41_err_set(err, V41_EINVAL, "%s: no prompts (one line of token ids per request)", path);
    if (rc) v41_run_inputs_free(in);
    return rc;
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int v41_run_inputs_random(int n, int len, uint64_t seed, int vocab, v41_run_inputs *in, v41_err *err)
{
    memset(in, 0, sizeof *in);
    if (n <= 0 || len <= 0 || vocab <= 0)
        return v41_err_set(err, V41_EINVAL, "random prompts: need N >= 1 and LEN >= 1 (got %d:%d)", n, len);
    uint64_t s = seed;
    for (int r = 0; r < n; r++) {
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)len);
        if (!ids || inputs_add(in, ids, len)) {
            free(ids);
            v41_run_inputs_free(in);
            return v41_err_set(err, V41_ENOMEM, "out of memory");
        }
        for (int i = 0; i < len; i++) ids[i] = (int32_t)(splitmix64(&s) % (uint64_t)vocab);
    }
    return 0;
}

int v41_parse_nlen(const char *s, int *n, int *len)
{
    char *end;
    long a = strtol(s, &end, 10);
    if (end == s || *end != ':') return -1;
    const char *q = end + 1;
    long b = strtol(q, &end, 10);
    if (end == q || *end || a <= 0 || b <= 0 || a > 1 << 20 || b > 1 << 24) return -1;
    *n = (int)a;
    *len = (int)b;
    return 0;
}

const char *v41_prec_name(v41_precision p) { return p == V41_PREC_FP32 ? "fp32" : "emulate"; }

int v41_side_parse(const char *s, v41_side *side, v41_err *err)
{
    memset(side, 0, sizeof *side);
    const char *c = strchr(s, ':');
    size_t n = c ? (size_t)(c - s) : strlen(s);
    if (n == 0 || n >= sizeof side->engine) return v41_err_set(err, V41_EINVAL, "bad engine '%s' (ref[:fp32|:emulate] or gpu)", s);
    memcpy(side->engine, s, n);
    if (strcmp(side->engine, "ref") && strcmp(side->engine, "gpu"))
        return v41_err_set(err, V41_EINVAL, "unknown engine '%s' (ref or gpu)", side->engine);
    side->prec = V41_PREC_EMULATE;
    if (c) {
        if (!strcmp(c + 1, "fp32")) side->prec = V41_PREC_FP32;
        else if (!strcmp(c + 1, "emulate") || !strcmp(c + 1, "bf16")) side->prec = V41_PREC_EMULATE;
        else return v41_err_set(err, V41_EINVAL, "unknown precision '%s' (emulate or fp32)", c + 1);
    }
    return 0;
}

void v41_side_name(const v41_side *s, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s:%s", s->engine, v41_prec_name(s->prec));
}

void v41_run_opts_default(v41_run_opts *o)
{
    memset(o, 0, sizeof *o);
    snprintf(o->side.engine, sizeof o->side.engine, "ref");
    o->side.prec = V41_PREC_EMULATE;
    o->compat = V41_COMPAT_FIXED;
    o->replay = true;
}

int v41_run_engine_create(const v41_model *m, const v41_run_opts *o, v41_engine **out, v41_err *err)
{
    v41_engine_opts eo;
    v41_engine_opts_default(&eo);
    eo.precision = o->side.prec;
    eo.compat = o->compat;
    eo.threads = o->threads;
    eo.replay = o->replay;
    eo.dspark_align = o->dspark_align;
    if (o->max_requests > 0) eo.max_requests = o->max_requests;
    eo.inject = o->inject;
    if (!strcmp(o->side.engine, "gpu")) return v41_gpu_engine_create(m, &eo, out, err);
    return v41_ref_engine_create(m, &eo, out, err);
}

static const char *dims_of(const char *name)
{
    const v41_tap_desc *d = v41_tap_lookup(name);
    return d ? d->dims : NULL;
}

int v41_run_model(const v41_model *m, const v41_run_inputs *in, const v41_run_opts *o, const char *dump_path,
                  v41_tap_source *force, int32_t *tokens_out, v41_err *err)
{
    const v41_config *c = &m->cfg;
    const int nr = in->n_req;
    if (nr <= 0) return v41_err_set(err, V41_EINVAL, "run: no requests");
    for (int r = 0; r < nr; r++)
        if (c->max_seq_len > 0 && in->len[r] + o->steps > c->max_seq_len + (o->dspark ? -c->dspark_block_size : 0))
            return v41_err_set(err, V41_EINVAL,
                               "run: request %d needs %d positions (prompt %d + %d steps%s), model max_seq_len is %d", r,
                               in->len[r] + o->steps + (o->dspark ? c->dspark_block_size : 0), in->len[r], o->steps,
                               o->dspark ? " + draft block" : "", c->max_seq_len);
    v41_engine *e = NULL;
    int rc = v41_run_engine_create(m, o, &e, err);
    if (rc) return rc;
    v41_dump *d = NULL;
    v41_tap_sink sink;
    char *cfg_json = NULL;
    int32_t *tok = calloc((size_t)nr, sizeof(int32_t));
    int32_t *rows_req = NULL, *rows_pos = NULL;
    int *pos = calloc((size_t)nr, sizeof(int));
    v41_req *req = calloc((size_t)nr, sizeof(v41_req));
    int total = 0;
    for (int r = 0; r < nr; r++) total += in->len[r];
    rows_req = malloc(sizeof(int32_t) * (size_t)(total > nr ? total : nr));
    rows_pos = malloc(sizeof(int32_t) * (size_t)(total > nr ? total : nr));
    if (!tok || !pos || !req || !rows_req || !rows_pos) { rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
    if (dump_path) {
        char fp[17] = "";
        if (m->w) v41_weights_fingerprint(m->w, fp);
        cfg_json = v41_config_to_json(c);
        v41_dump_meta meta = {
            .engine = o->side.engine, .precision = v41_prec_name(o->side.prec),
            .compat = o->compat == V41_COMPAT_OFFICIAL ? "official" : "fixed", .config_json = cfg_json,
            .weights_fingerprint = fp, .replay = o->replay ? "on" : "off", .blas = V41_BLAS_NAME,
            .gpu = !strcmp(o->side.engine, "gpu") ? "cuda" : "", .inject = o->inject ? o->inject : "",
            .command = o->command, .model = m->source, .threads = o->threads,
        };
        if (!o->inject && getenv("V41_INJECT")) meta.inject = getenv("V41_INJECT");
        rc = v41_dump_create(dump_path, &meta, &d, err);
        if (rc) goto done;
        v41_dump_set_dims_fn(d, dims_of);
        v41_dump_sink(d, &sink, o->taps);
        v41_engine_set_sink(e, &sink);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)nr), *pl = malloc(sizeof(int32_t) * (size_t)nr);
        if (!ids || !pl) { free(ids); free(pl); rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
        for (int r = 0; r < nr; r++) { ids[r] = r; pl[r] = in->len[r]; }
        rc = v41_dump_set_requests(d, nr, ids, pl, NULL, err);
        free(ids);
        free(pl);
        if (rc) goto done;
    }
    e->force = force;
    for (int step = 0; step <= o->steps; step++) {
        int nrow = 0;
        for (int r = 0; r < nr; r++) {
            v41_req *q = &req[r];
            memset(q, 0, sizeof *q);
            q->id = r;
            if (step == 0) {
                q->start_pos = 0;
                q->n_tokens = in->len[r];
                q->tokens = in->ids[r];
            } else {
                q->start_pos = pos[r];
                q->n_tokens = 1;
                q->tokens = &tok[r];
            }
            for (int i = 0; i < q->n_tokens; i++) { rows_req[nrow] = r; rows_pos[nrow++] = q->start_pos + i; }
        }
        if (d && (rc = v41_dump_set_rows(d, e->step, nrow, rows_req, rows_pos, err))) goto done;
        if (o->progress)
            fprintf(stderr, "\rv41 run: %s step %d/%d (%s)   ", o->side.engine, step, o->steps,
                    step == 0 ? "prefill" : "decode");
        v41_batch b = {.n_req = nr, .req = req};
        v41_out out;
        memset(&out, 0, sizeof out);
        rc = v41_engine_forward(e, &b, &out, err);
        if (rc) { v41_err_prefix(err, "step %d", step); goto done; }
        for (int r = 0; r < nr; r++) {
            pos[r] = req[r].start_pos + req[r].n_tokens;
            /* last returned row of request r */
            int row = out.row_offset ? out.row_offset[r + 1] - 1 : r;
            tok[r] = out.argmax[row];
        }
        if (tokens_out) memcpy(tokens_out + (size_t)step * nr, tok, sizeof(int32_t) * (size_t)nr);
        /* teacher-forced decode inputs (bisect: B runs on A's tokens, and drafts from them) */
        if (o->force_tokens && step < o->steps) memcpy(tok, o->force_tokens + (size_t)step * nr, sizeof(int32_t) * (size_t)nr);
        if (o->dspark && step > 0 && c->dspark_block_size > 0 && c->n_mtp_layers > 0) {
            /* draft after each decode step, as the oracle's forward_spec does */
            int *ids = malloc(sizeof(int) * (size_t)nr), *ps = malloc(sizeof(int) * (size_t)nr);
            if (!ids || !ps) { free(ids); free(ps); rc = v41_err_set(err, V41_ENOMEM, "out of memory"); goto done; }
            for (int r = 0; r < nr; r++) { ids[r] = r; ps[r] = pos[r] - 1; }
            if (e->vt->dspark_draft_batch) {
                rc = e->vt->dspark_draft_batch(e, nr, ids, ps, tok, NULL, NULL, err);
            } else {
                int32_t *dr = malloc(sizeof(int32_t) * (size_t)(c->dspark_block_size + 1));
                float *cf = malloc(sizeof(float) * (size_t)(c->dspark_block_size + 1));
                for (int r = 0; !rc && r < nr && dr && cf; r++) rc = e->vt->dspark_draft(e, r, ps[r], tok[r], dr, cf, err);
                if (!dr || !cf) rc = v41_err_set(err, V41_ENOMEM, "out of memory");
                free(dr);
                free(cf);
            }
            free(ids);
            free(ps);
            if (rc) { v41_err_prefix(err, "step %d: dspark draft", step); goto done; }
        }
    }
    if (o->progress) fprintf(stderr, "\r%60s\r", "");
done:
    if (e) e->sink = NULL, e->force = NULL;
    v41_engine_destroy(e);
    if (d) {
        if (rc) {
            const v41_err *derr = v41_dump_error(d);   /* the sink's own error, if it caused the abort */
            if (derr->code) v41_err_prefix(err, "%s", derr->msg);
            v41_dump_abort(d);                         /* no partial output file */
        } else rc = v41_dump_close(d, err);
    }
    free(cfg_json);
    free(tok);
    free(pos);
    free(req);
    free(rows_req);
    free(rows_pos);
    return rc;
}
