/* diff.c: tap-by-tap comparison of two dumps (metrics: README.md, section 'Harness').
 * Reads both tensors in slabs of at most opts.chunk_elems elements, so the
 * memory used is bounded by the slab size, not by the dump size. */
#include "config.h"
#include "v41_diff.h"
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void v41_diff_opts_default(v41_diff_opts *o)
{
    memset(o, 0, sizeof *o);
    o->chunk_elems = 1 << 20;
    o->max_flip_rows = 4;
}

const char *v41_diff_level(const char *pa, const char *pb)
{
    return pa && pb && !strcmp(pa, "fp32") && !strcmp(pb, "fp32") ? "fp32" : "bf16";
}

void v41_diff_default_tol(v41_tap_kind kind, const char *level, double ref_max, double *atol, double *rtol)
{
    double r = (level && !strcmp(level, "fp32") && kind != V41_TAP_BF16) ? V41_DIFF_RTOL_FP32 : V41_DIFF_RTOL_BF16;
    *rtol = r;
    /* absolute floor scaled by the tensor's largest magnitude: an element made
     * by cancellation or by a sum over the row carries the rounding error of
     * the largest terms, not its own (same scale as oracle-check's rule) */
    *atol = r * ref_max;
    if (!(*atol > 0)) *atol = 0;
}

const char *v41_diff_sublayer(const char *name)
{
    if (!strncmp(name, "dspark.", 7)) return "dspark";
    if (!strncmp(name, "layer.", 6)) {
        const char *p = strchr(name + 6, '.');
        if (!p) return "other";
        p++;
        static const struct { const char *pre; const char *sub; } map[] = {
            {"hc.attn", "attention"}, {"hc.ffn", "ffn"}, {"stream.in", "input"}, {"premix.in", "input"},
            {"stream.mid", "attention"}, {"stream.out", "ffn"}, {"premix.out", "ffn"},
            {"attn", "attention"}, {"indexer", "attention"}, {"compressor", "attention"},
            {"candidate", "attention"}, {"kv", "attention"}, {"window", "attention"}, {"index", "attention"},
            {"cache", "attention"},
            {"ffn", "ffn"}, {"moe", "ffn"}, {"gate", "ffn"}, {"engram", "engram"}, {"hc", "hc"},
            {"stream", "stream"},
        };
        for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
            size_t n = strlen(map[i].pre);
            if (!strncmp(p, map[i].pre, n) && (p[n] == 0 || p[n] == '.' || p[n] == '_')) return map[i].sub;
        }
        return "other";
    }
    if (!strncmp(name, "embed", 5) || !strcmp(name, "tokens.in") || !strncmp(name, "engram", 6)) return "embed";
    if (!strncmp(name, "logits", 6) || !strncmp(name, "final", 5) || !strncmp(name, "head", 4) ||
        !strcmp(name, "tokens") || !strncmp(name, "output", 6))
        return "head";
    return "other";
}

void v41_diff_format_index(int ndim, const int64_t *shape, int64_t flat, char *buf, size_t cap)
{
    int64_t idx[V41_DUMP_MAX_DIMS];
    for (int i = ndim - 1; i >= 0; i--) {
        idx[i] = shape[i] ? flat % shape[i] : 0;
        flat = shape[i] ? flat / shape[i] : 0;
    }
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int i = 0; i < ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? "," : "", (long long)idx[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

static void shape_str(int nd, const int64_t *s, char *buf, size_t cap)
{
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < nd && o < cap; i++) o += (size_t)snprintf(buf + o, cap - o, "%s%lld", i ? "," : "", (long long)s[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* ---- continuous comparison ---- */

static int nonfinite_class(float v) { return isnan(v) ? 1 : isinf(v) ? (v > 0 ? 2 : 3) : 0; }

static int compare_float(v41_dump_reader *ra, const v41_dump_entry *ea, v41_dump_reader *rb,
                         const v41_dump_entry *eb, const v41_diff_opts *o, const char *level,
                         v41_diff_tensor *t, v41_err *err)
{
    int64_t n = ea->numel, cs = o->chunk_elems > 0 ? o->chunk_elems : (1 << 20);
    float *a = malloc(sizeof(float) * (size_t)(cs > n ? (n ? n : 1) : cs));
    float *b = malloc(sizeof(float) * (size_t)(cs > n ? (n ? n : 1) : cs));
    if (!a || !b) { free(a); free(b); return v41_err_set(err, V41_ENOMEM, "diff: out of memory"); }
    int rc = 0;
    /* the default atol needs max|a| (finite): from the writer's stats attribute, else one extra pass */
    double ref_max = ea->has_stats ? ea->absmax : -1;
    if (ref_max < 0 && !(o->atol_set)) {
        double mx = 0;
        for (int64_t off = 0; off < n && !rc; off += cs) {
            int64_t m = n - off < cs ? n - off : cs;
            rc = v41_dump_read(ra, ea, off, m, a, err);
            for (int64_t i = 0; !rc && i < m; i++)
                if (isfinite(a[i]) && fabs((double)a[i]) > mx) mx = fabs((double)a[i]);
        }
        ref_max = mx;
    }
    double datol, drtol;
    v41_diff_default_tol(ea->kind == V41_TAP_BF16 || eb->kind == V41_TAP_BF16 ? V41_TAP_BF16 : V41_TAP_F32,
                         level, ref_max > 0 ? ref_max : 0, &datol, &drtol);
    t->atol = o->atol_set ? o->atol : datol;
    t->rtol = o->rtol_set ? o->rtol : drtol;
    t->max_abs_idx = t->max_rel_idx = t->first_nonfinite_idx = -1;
    double saa = 0, sbb = 0, sab = 0, sdd = 0, min_atol = 0;
    for (int64_t off = 0; off < n && !rc; off += cs) {
        int64_t m = n - off < cs ? n - off : cs;
        rc = v41_dump_read(ra, ea, off, m, a, err);
        if (!rc) rc = v41_dump_read(rb, eb, off, m, b, err);
        if (rc) break;
        for (int64_t i = 0; i < m; i++) {
            float x = a[i], y = b[i];
            int cx = nonfinite_class(x), cy = nonfinite_class(y);
            if (cx || cy) {
                if (cx != cy) {
                    if (t->nonfinite_mismatch++ == 0) t->first_nonfinite_idx = off + i;
                }
                continue;
            }
            double dx = x, dy = y, d = fabs(dy - dx), ax = fabs(dx);
            t->n_compared++;
            saa += dx * dx;
            sbb += dy * dy;
            sab += dx * dy;
            sdd += d * d;
            if (d > t->max_abs || t->max_abs_idx < 0) {
                t->max_abs = d; t->max_abs_idx = off + i; t->max_abs_a = dx; t->max_abs_b = dy;
            }
            double rel = d == 0 ? 0 : ax == 0 ? INFINITY : d / ax;   /* 0/0 = 0 */
            if (rel > t->max_rel || t->max_rel_idx < 0) { t->max_rel = rel; t->max_rel_idx = off + i; }
            if (d > t->atol + t->rtol * ax) t->n_over++;
            double need = d - t->rtol * ax;
            if (need > min_atol) min_atol = need;
        }
    }
    free(a);
    free(b);
    if (rc) return rc;
    int64_t nc = t->n_compared;
    t->ref_rms = nc ? sqrt(saa / (double)nc) : 0;
    t->rms_err = nc ? sqrt(sdd / (double)nc) : 0;
    t->nmse = sdd == 0 ? 0 : saa == 0 ? INFINITY : sdd / saa;
    t->cosine = (saa == 0 && sbb == 0) ? 1 : (saa == 0 || sbb == 0) ? 0 : sab / sqrt(saa * sbb);
    t->min_atol = min_atol;
    t->status = (t->n_over || t->nonfinite_mismatch) ? V41_DIFF_DIFF : V41_DIFF_SAME;
    return 0;
}

/* ---- discrete comparison (sets per row) ---- */

static int cmp_i32(const void *x, const void *y)
{
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

static void record_flip(v41_diff_tensor *t, const v41_diff_opts *o, int64_t row, const int32_t *miss, int nm,
                        const int32_t *extra, int ne)
{
    t->n_flipped++;
    int keep = o->max_flip_rows > 0 ? o->max_flip_rows : 4;
    if (keep > V41_DIFF_MAX_FLIPS) keep = V41_DIFF_MAX_FLIPS;
    if (t->n_flips >= keep) return;
    v41_diff_flip *f = &t->flips[t->n_flips++];
    f->row = row;
    f->n_missing = nm;
    f->n_extra = ne;
    for (int i = 0; i < nm && i < V41_DIFF_FLIP_ITEMS; i++) f->missing[i] = miss[i];
    for (int i = 0; i < ne && i < V41_DIFF_FLIP_ITEMS; i++) f->extra[i] = extra[i];
}

static int compare_discrete(v41_dump_reader *ra, const v41_dump_entry *ea, v41_dump_reader *rb,
                            const v41_dump_entry *eb, const v41_diff_opts *o, v41_diff_tensor *t, v41_err *err)
{
    int64_t k = ea->ndim >= 2 ? ea->shape[ea->ndim - 1] : 1;
    if (k <= 0) { t->status = V41_DIFF_SAME; return 0; }
    int64_t rows = ea->numel / k;
    t->n_rows = rows;
    int64_t cs = o->chunk_elems > 0 ? o->chunk_elems : (1 << 20);
    int64_t rpc = cs / k < 1 ? 1 : cs / k;
    if (rpc > rows) rpc = rows ? rows : 1;
    bool u8 = ea->kind == V41_TAP_U8;
    size_t esz = u8 ? 1 : 4;
    void *a = malloc(esz * (size_t)(rpc * k)), *b = malloc(esz * (size_t)(rpc * k));
    int32_t *sa = malloc(sizeof(int32_t) * (size_t)k), *sb = malloc(sizeof(int32_t) * (size_t)k);
    int32_t *miss = malloc(sizeof(int32_t) * (size_t)k), *extra = malloc(sizeof(int32_t) * (size_t)k);
    int rc = 0;
    if (!a || !b || !sa || !sb || !miss || !extra) rc = v41_err_set(err, V41_ENOMEM, "diff: out of memory");
    for (int64_t r0 = 0; r0 < rows && !rc; r0 += rpc) {
        int64_t nr = rows - r0 < rpc ? rows - r0 : rpc;
        rc = v41_dump_read(ra, ea, r0 * k, nr * k, a, err);
        if (!rc) rc = v41_dump_read(rb, eb, r0 * k, nr * k, b, err);
        if (rc) break;
        for (int64_t r = 0; r < nr; r++) {
            int nm = 0, ne = 0;
            if (u8) {
                const uint8_t *x = (const uint8_t *)a + r * k, *y = (const uint8_t *)b + r * k;
                if (!memcmp(x, y, (size_t)k)) continue;
                for (int64_t j = 0; j < k; j++) {
                    bool in_a = x[j] != 0, in_b = y[j] != 0;
                    if (in_a && !in_b) miss[nm++] = (int32_t)j;
                    else if (in_b && !in_a) extra[ne++] = (int32_t)j;
                }
            } else {
                const int32_t *x = (const int32_t *)a + r * k, *y = (const int32_t *)b + r * k;
                if (!memcmp(x, y, (size_t)k * 4)) continue;
                int na = 0, nb = 0;
                for (int64_t j = 0; j < k; j++) {
                    if (x[j] != -1) sa[na++] = x[j];   /* -1 = none (empty slot / unreachable) */
                    if (y[j] != -1) sb[nb++] = y[j];
                }
                qsort(sa, (size_t)na, 4, cmp_i32);
                qsort(sb, (size_t)nb, 4, cmp_i32);
                int i = 0, j = 0;   /* multiset difference of two sorted lists */
                while (i < na || j < nb) {
                    if (j >= nb || (i < na && sa[i] < sb[j])) miss[nm++] = sa[i++];
                    else if (i >= na || sb[j] < sa[i]) extra[ne++] = sb[j++];
                    else { i++; j++; }
                }
            }
            if (nm || ne) record_flip(t, o, r0 + r, miss, nm, extra, ne);
        }
    }
    free(a); free(b); free(sa); free(sb); free(miss); free(extra);
    if (rc) return rc;
    t->status = t->n_flipped ? V41_DIFF_DIFF : V41_DIFF_SAME;
    return 0;
}

static void fill_from_entry(v41_diff_tensor *t, const v41_dump_entry *e)
{
    t->step = e->step;
    snprintf(t->name, sizeof t->name, "%s", e->name);
    t->order = e->order;
    t->layer = e->layer;
    t->kind = e->kind;
    t->discrete = e->discrete;
    t->ndim = e->ndim;
    memcpy(t->shape, e->shape, sizeof t->shape);
    t->numel = e->numel;
    t->max_abs_idx = t->max_rel_idx = t->first_nonfinite_idx = -1;
}

int v41_diff_tensor_compare(v41_dump_reader *ra, const v41_dump_entry *ea, v41_dump_reader *rb,
                            const v41_dump_entry *eb, const v41_diff_opts *o, const char *level,
                            v41_diff_tensor *t, v41_err *err)
{
    memset(t, 0, sizeof *t);
    fill_from_entry(t, ea ? ea : eb);
    if (!ea || !eb) {
        /* an empty tensor on one side and no tap on the other say the same thing */
        if ((ea ? ea : eb)->numel == 0) { t->status = V41_DIFF_SAME; return 0; }
        t->status = ea ? V41_DIFF_MISSING_B : V41_DIFF_MISSING_A;
        snprintf(t->msg, sizeof t->msg, "present only in %s", ea ? "A" : "B");
        if (o->ignore_missing) { t->status = V41_DIFF_SAME; snprintf(t->msg, sizeof t->msg, "present only in %s (ignored)", ea ? "A" : "B"); }
        return 0;
    }
    bool same = ea->ndim == eb->ndim;
    for (int i = 0; same && i < ea->ndim; i++) same = ea->shape[i] == eb->shape[i];
    if (!same || ea->discrete != eb->discrete) {
        char sa[96], sb[96];
        shape_str(ea->ndim, ea->shape, sa, sizeof sa);
        shape_str(eb->ndim, eb->shape, sb, sizeof sb);
        t->status = V41_DIFF_SHAPE;
        if (!same) snprintf(t->msg, sizeof t->msg, "shape mismatch: A %s, B %s", sa, sb);
        else snprintf(t->msg, sizeof t->msg, "kind mismatch: A %s, B %s", v41_dump_kind_name(ea->kind),
                      v41_dump_kind_name(eb->kind));
        return 0;
    }
    if (ea->discrete) {
        if ((ea->kind == V41_TAP_U8) != (eb->kind == V41_TAP_U8)) {
            t->status = V41_DIFF_SHAPE;
            snprintf(t->msg, sizeof t->msg, "kind mismatch: A %s, B %s", v41_dump_kind_name(ea->kind),
                     v41_dump_kind_name(eb->kind));
            return 0;
        }
        return compare_discrete(ra, ea, rb, eb, o, t, err);
    }
    return compare_float(ra, ea, rb, eb, o, level, t, err);
}

/* rows of every step: a difference means the dumps were made from different inputs */
static int compare_rows(v41_dump_reader *a, v41_dump_reader *b, int step, v41_diff_tensor *t, v41_err *err)
{
    int na, nb;
    int32_t *qa, *pa, *qb, *pb;
    if (v41_dump_read_rows(a, step, &na, &qa, &pa, err)) return err->code;
    if (v41_dump_read_rows(b, step, &nb, &qb, &pb, err)) { free(qa); free(pa); return err->code; }
    memset(t, 0, sizeof *t);
    t->step = step;
    snprintf(t->name, sizeof t->name, "rows");
    t->order = -1;
    t->layer = -1;
    t->kind = V41_TAP_I32;
    t->discrete = true;
    t->ndim = 2;
    t->shape[0] = na;
    t->shape[1] = 2;
    t->numel = 2 * (int64_t)na;
    t->n_rows = na;
    t->max_abs_idx = t->max_rel_idx = t->first_nonfinite_idx = -1;
    int rc = 1;   /* 1 = nothing to report (no rows in either) */
    if (na || nb) {
        rc = 0;
        if (na != nb) {
            t->status = V41_DIFF_SHAPE;
            snprintf(t->msg, sizeof t->msg, "rows: A has %d rows, B has %d (different inputs)", na, nb);
        } else {
            for (int i = 0; i < na; i++)
                if (qa[i] != qb[i] || pa[i] != pb[i]) {
                    if (t->n_flipped++ == 0)
                        snprintf(t->msg, sizeof t->msg,
                                 "rows differ (different inputs): first at row %d: A (req %d, pos %d), B (req %d, pos %d)",
                                 i, qa[i], pa[i], qb[i], pb[i]);
                }
            t->status = t->n_flipped ? V41_DIFF_SHAPE : V41_DIFF_SAME;
        }
    }
    free(qa); free(pa); free(qb); free(pb);
    return rc == 1 ? -1 : 0;
}

static int push(v41_diff_report *r, size_t *cap, const v41_diff_tensor *t)
{
    if (r->n == *cap) {
        size_t nc = *cap ? *cap * 2 : 256;
        v41_diff_tensor *nt = realloc(r->t, nc * sizeof *nt);
        if (!nt) return -1;
        r->t = nt;
        *cap = nc;
    }
    r->t[r->n] = *t;
    long i = (long)r->n++;
    if (t->status != V41_DIFF_SAME) {
        r->n_fail++;
        if (r->first_fail < 0) r->first_fail = i;
        if (t->status == V41_DIFF_MISSING_A || t->status == V41_DIFF_MISSING_B) r->n_missing++;
        if (t->status == V41_DIFF_SHAPE) r->n_shape++;
        if (t->status == V41_DIFF_DIFF && t->discrete) {
            r->n_flip_taps++;
            if (r->first_flip < 0) r->first_flip = i;
        }
    }
    return 0;
}

static void describe(v41_dump_reader *d, char *buf, size_t cap)
{
    const char *e = v41_dump_attr(d, "engine"), *p = v41_dump_attr(d, "precision"), *inj = v41_dump_attr(d, "inject");
    snprintf(buf, cap, "engine %s, precision %s%s%s", e && *e ? e : "?", p && *p ? p : "?",
             inj && *inj ? ", inject " : "", inj && *inj ? inj : "");
}

int v41_diff_readers(v41_dump_reader *a, v41_dump_reader *b, const v41_diff_opts *oin, v41_diff_report **out,
                     v41_err *err)
{
    v41_diff_opts o;
    if (oin) o = *oin; else v41_diff_opts_default(&o);
    *out = NULL;
    v41_diff_report *r = calloc(1, sizeof *r);
    if (!r) return v41_err_set(err, V41_ENOMEM, "diff: out of memory");
    r->first_fail = r->first_flip = -1;
    snprintf(r->a_path, sizeof r->a_path, "%s", v41_dump_path(a));
    snprintf(r->b_path, sizeof r->b_path, "%s", v41_dump_path(b));
    describe(a, r->a_desc, sizeof r->a_desc);
    describe(b, r->b_desc, sizeof r->b_desc);
    snprintf(r->tol_level, sizeof r->tol_level, "%s",
             v41_diff_level(v41_dump_attr(a, "precision"), v41_dump_attr(b, "precision")));
    const char *fa = v41_dump_attr(a, "weights_fingerprint"), *fb = v41_dump_attr(b, "weights_fingerprint");
    if (fa && fb && *fa && *fb && strcmp(fa, fb))
        snprintf(r->warning, sizeof r->warning, "the dumps come from different weights (fingerprints %.16s vs %.16s)", fa, fb);
    size_t cap = 0, na = v41_dump_count(a), nb = v41_dump_count(b);
    /* walk A in execution order; taps of a step only in B follow that step's A taps */
    size_t ib = 0;
    int rc = 0;
    int last_rows_step = -1;
    v41_diff_tensor t;
    for (size_t ia = 0; ia <= na && !rc; ia++) {
        const v41_dump_entry *ea = ia < na ? v41_dump_at(a, ia) : NULL;
        int step = ea ? ea->step : 1 << 30;
        /* flush B-only taps of steps before this one */
        while (ib < nb && !rc) {
            const v41_dump_entry *eb = v41_dump_at(b, ib);
            if (eb->step >= step && ea) break;
            if (!v41_dump_find(a, eb->step, eb->name) && v41_dump_match(o.only, eb->name)) {
                v41_diff_tensor_compare(a, NULL, b, eb, &o, r->tol_level, &t, err);
                if (push(r, &cap, &t)) rc = v41_err_set(err, V41_ENOMEM, "diff: out of memory");
            }
            ib++;
        }
        if (!ea) break;
        if (ea->step != last_rows_step) {
            last_rows_step = ea->step;
            int q = compare_rows(a, b, ea->step, &t, err);
            if (q > 0) { rc = q; break; }
            if (q == 0 && t.status != V41_DIFF_SAME && push(r, &cap, &t))
                rc = v41_err_set(err, V41_ENOMEM, "diff: out of memory");
        }
        if (!v41_dump_match(o.only, ea->name)) continue;
        const v41_dump_entry *eb = v41_dump_find(b, ea->step, ea->name);
        rc = v41_diff_tensor_compare(a, ea, b, eb, &o, r->tol_level, &t, err);
        if (!rc && push(r, &cap, &t)) rc = v41_err_set(err, V41_ENOMEM, "diff: out of memory");
    }
    if (rc) { v41_diff_report_free(r); return rc; }
    *out = r;
    return 0;
}

int v41_diff_files(const char *pa, const char *pb, const v41_diff_opts *o, v41_diff_report **out, v41_err *err)
{
    v41_dump_reader *a = NULL, *b = NULL;
    int rc = v41_dump_open(pa, &a, err);
    if (!rc) rc = v41_dump_open(pb, &b, err);
    if (!rc) rc = v41_diff_readers(a, b, o, out, err);
    v41_dump_reader_close(a);
    v41_dump_reader_close(b);
    return rc;
}

void v41_diff_report_free(v41_diff_report *r)
{
    if (!r) return;
    free(r->t);
    free(r);
}

/* ---- printing ---- */

static void print_items(FILE *f, const int32_t *v, int n)
{
    fputc('{', f);
    for (int i = 0; i < n && i < V41_DIFF_FLIP_ITEMS; i++) fprintf(f, "%s%d", i ? "," : "", v[i]);
    if (n > V41_DIFF_FLIP_ITEMS) fprintf(f, ",... %d in all", n);
    fputc('}', f);
}

void v41_diff_print_tensor(const v41_diff_tensor *t, FILE *f)
{
    char sh[96], ix[96];
    shape_str(t->ndim, t->shape, sh, sizeof sh);
    const char *tag = t->status == V41_DIFF_SAME ? "same" : t->status == V41_DIFF_DIFF ? (t->discrete ? "FLIP" : "DIFF")
                    : t->status == V41_DIFF_SHAPE ? "SHAPE" : "MISSING";
    fprintf(f, "%-7s step%04d %s %s %s", tag, t->step, t->name, sh, v41_dump_kind_name(t->kind));
    if (t->status == V41_DIFF_MISSING_A || t->status == V41_DIFF_MISSING_B || t->status == V41_DIFF_SHAPE || t->msg[0]) {
        fprintf(f, ": %s\n", t->msg[0] ? t->msg : "empty on one side, absent on the other");
        return;
    }
    if (t->discrete) {
        fprintf(f, ": %lld/%lld rows differ as sets\n", (long long)t->n_flipped, (long long)t->n_rows);
        for (int i = 0; i < t->n_flips; i++) {
            const v41_diff_flip *fl = &t->flips[i];
            int64_t rs[V41_DUMP_MAX_DIMS];
            int rn = t->ndim >= 2 ? t->ndim - 1 : t->ndim;
            for (int j = 0; j < rn; j++) rs[j] = t->shape[j];
            v41_diff_format_index(rn, rs, fl->row, ix, sizeof ix);
            fprintf(f, "          row %lld %s: missing ", (long long)fl->row, ix);
            print_items(f, fl->missing, fl->n_missing);
            fprintf(f, " extra ");
            print_items(f, fl->extra, fl->n_extra);
            fputc('\n', f);
        }
        if (t->n_flipped > t->n_flips) fprintf(f, "          ... %lld more rows\n", (long long)(t->n_flipped - t->n_flips));
        return;
    }
    if (t->max_abs_idx >= 0) v41_diff_format_index(t->ndim, t->shape, t->max_abs_idx, ix, sizeof ix);
    else snprintf(ix, sizeof ix, "-");
    fprintf(f, ": max|a-b| %.4g at %s (a=%.7g b=%.7g) maxrel %.3g rms %.3g nmse %.3g cos %.7f over-tol %lld/%lld "
               "(atol %.3g rtol %.3g; passes at atol %.3g)",
            t->max_abs, ix, t->max_abs_a, t->max_abs_b, t->max_rel, t->rms_err, t->nmse, t->cosine,
            (long long)t->n_over, (long long)t->n_compared, t->atol, t->rtol, t->min_atol);
    if (t->nonfinite_mismatch) {
        v41_diff_format_index(t->ndim, t->shape, t->first_nonfinite_idx, ix, sizeof ix);
        fprintf(f, "; NaN/Inf position mismatch at %lld elements, first %s", (long long)t->nonfinite_mismatch, ix);
    }
    fputc('\n', f);
}

void v41_diff_print_summary(const v41_diff_report *r, FILE *f)
{
    long ncmp = (long)r->n;
    fprintf(f, "summary: %ld taps compared, %ld differ (%ld with decision flips, %ld missing, %ld shape)\n", ncmp,
            r->n_fail, r->n_flip_taps, r->n_missing, r->n_shape);
    if (r->first_fail >= 0) {
        const v41_diff_tensor *t = &r->t[r->first_fail];
        fprintf(f, "first divergent tap: step%04d %s", t->step, t->name);
        if (!t->discrete && t->status == V41_DIFF_DIFF) fprintf(f, " (max|a-b| %.3g, needs atol %.3g)", t->max_abs, t->min_atol);
        fputc('\n', f);
    }
    if (r->first_flip >= 0) {
        const v41_diff_tensor *t = &r->t[r->first_flip];
        fprintf(f, "first decision flip: step%04d %s (%lld/%lld rows)\n", t->step, t->name, (long long)t->n_flipped,
                (long long)t->n_rows);
        if (r->first_fail >= 0 && r->first_fail < r->first_flip)
            fprintf(f, "  (numeric divergence precedes the flip: the flip may be inherited rounding)\n");
        else
            fprintf(f, "  (likely root cause: everything before it agrees within tolerance)\n");
    }
    fprintf(f, "verdict: %s\n", r->n_fail ? "DIFFERENT" : "same within tolerance");
}

void v41_diff_print(const v41_diff_report *r, FILE *f, bool verbose)
{
    fprintf(f, "A (reference): %s [%s]\nB: %s [%s]\ndefault tolerances: %s level\n", r->a_path, r->a_desc, r->b_path,
            r->b_desc, r->tol_level);
    if (r->warning[0]) fprintf(f, "WARNING: %s\n", r->warning);
    long shown = 0, more = 0;
    for (size_t i = 0; i < r->n; i++) {
        if (!verbose && r->t[i].status == V41_DIFF_SAME) continue;
        /* differences-only report: the first 50 (and the first flip) are enough to act on */
        if (!verbose && shown >= 50 && (long)i != r->first_flip) { more++; continue; }
        v41_diff_print_tensor(&r->t[i], f);
        shown++;
    }
    if (more) fprintf(f, "... %ld more differing taps (--verbose lists every tap, --json all metrics)\n", more);
    v41_diff_print_summary(r, f);
}

static cJSON *num(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateString(isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"); }

static const char *status_name(int s)
{
    switch (s) {
    case V41_DIFF_SAME: return "same";
    case V41_DIFF_DIFF: return "diff";
    case V41_DIFF_MISSING_A: return "missing_in_a";
    case V41_DIFF_MISSING_B: return "missing_in_b";
    default: return "shape";
    }
}

static cJSON *tensor_json(const v41_diff_tensor *t)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", t->step);
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddNumberToObject(o, "order", t->order);
    cJSON_AddNumberToObject(o, "layer", t->layer);
    cJSON_AddStringToObject(o, "sublayer", v41_diff_sublayer(t->name));
    cJSON_AddStringToObject(o, "kind", v41_dump_kind_name(t->kind));
    cJSON_AddBoolToObject(o, "discrete", t->discrete);
    cJSON_AddStringToObject(o, "status", status_name(t->status));
    if (t->msg[0]) cJSON_AddStringToObject(o, "message", t->msg);
    cJSON *sh = cJSON_AddArrayToObject(o, "shape");
    for (int i = 0; i < t->ndim; i++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[i]));
    if (t->status == V41_DIFF_MISSING_A || t->status == V41_DIFF_MISSING_B || t->status == V41_DIFF_SHAPE) return o;
    if (t->discrete) {
        cJSON_AddNumberToObject(o, "rows", (double)t->n_rows);
        cJSON_AddNumberToObject(o, "flipped_rows", (double)t->n_flipped);
        cJSON *fl = cJSON_AddArrayToObject(o, "flips");
        for (int i = 0; i < t->n_flips; i++) {
            cJSON *x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "row", (double)t->flips[i].row);
            cJSON *m = cJSON_AddArrayToObject(x, "missing"), *e = cJSON_AddArrayToObject(x, "extra");
            for (int j = 0; j < t->flips[i].n_missing && j < V41_DIFF_FLIP_ITEMS; j++)
                cJSON_AddItemToArray(m, cJSON_CreateNumber(t->flips[i].missing[j]));
            for (int j = 0; j < t->flips[i].n_extra && j < V41_DIFF_FLIP_ITEMS; j++)
                cJSON_AddItemToArray(e, cJSON_CreateNumber(t->flips[i].extra[j]));
            cJSON_AddNumberToObject(x, "n_missing", t->flips[i].n_missing);
            cJSON_AddNumberToObject(x, "n_extra", t->flips[i].n_extra);
            cJSON_AddItemToArray(fl, x);
        }
        return o;
    }
    cJSON_AddItemToObject(o, "max_abs", num(t->max_abs));
    cJSON *ix = cJSON_AddArrayToObject(o, "max_abs_index");
    if (t->max_abs_idx >= 0) {
        int64_t f = t->max_abs_idx, id[V41_DUMP_MAX_DIMS];
        for (int i = t->ndim - 1; i >= 0; i--) { id[i] = t->shape[i] ? f % t->shape[i] : 0; f = t->shape[i] ? f / t->shape[i] : 0; }
        for (int i = 0; i < t->ndim; i++) cJSON_AddItemToArray(ix, cJSON_CreateNumber((double)id[i]));
    }
    cJSON_AddItemToObject(o, "max_abs_a", num(t->max_abs_a));
    cJSON_AddItemToObject(o, "max_abs_b", num(t->max_abs_b));
    cJSON_AddItemToObject(o, "max_rel", num(t->max_rel));
    cJSON_AddItemToObject(o, "rms_err", num(t->rms_err));
    cJSON_AddItemToObject(o, "ref_rms", num(t->ref_rms));
    cJSON_AddItemToObject(o, "nmse", num(t->nmse));
    cJSON_AddItemToObject(o, "cosine", num(t->cosine));
    cJSON_AddNumberToObject(o, "n_compared", (double)t->n_compared);
    cJSON_AddNumberToObject(o, "n_over_tol", (double)t->n_over);
    cJSON_AddNumberToObject(o, "nonfinite_mismatch", (double)t->nonfinite_mismatch);
    cJSON_AddItemToObject(o, "atol", num(t->atol));
    cJSON_AddItemToObject(o, "rtol", num(t->rtol));
    cJSON_AddItemToObject(o, "min_passing_atol", num(t->min_atol));
    return o;
}

static cJSON *ref_json(const v41_diff_report *r, long i)
{
    if (i < 0) return cJSON_CreateNull();
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", r->t[i].step);
    cJSON_AddStringToObject(o, "name", r->t[i].name);
    cJSON_AddNumberToObject(o, "layer", r->t[i].layer);
    cJSON_AddStringToObject(o, "sublayer", v41_diff_sublayer(r->t[i].name));
    return o;
}

char *v41_diff_json(const v41_diff_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "tool", "v41 diff");
    cJSON_AddStringToObject(o, "a", r->a_path);
    cJSON_AddStringToObject(o, "b", r->b_path);
    cJSON_AddStringToObject(o, "a_desc", r->a_desc);
    cJSON_AddStringToObject(o, "b_desc", r->b_desc);
    cJSON_AddStringToObject(o, "tolerance_level", r->tol_level);
    if (r->warning[0]) cJSON_AddStringToObject(o, "warning", r->warning);
    cJSON_AddBoolToObject(o, "same", r->n_fail == 0);
    cJSON_AddNumberToObject(o, "n_taps", (double)r->n);
    cJSON_AddNumberToObject(o, "n_differ", (double)r->n_fail);
    cJSON_AddNumberToObject(o, "n_flip_taps", (double)r->n_flip_taps);
    cJSON_AddItemToObject(o, "first_divergent", ref_json(r, r->first_fail));
    cJSON_AddItemToObject(o, "first_flip", ref_json(r, r->first_flip));
    cJSON *arr = cJSON_AddArrayToObject(o, "taps");
    for (size_t i = 0; i < r->n; i++) cJSON_AddItemToArray(arr, tensor_json(&r->t[i]));
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}
