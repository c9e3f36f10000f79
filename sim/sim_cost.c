/* sim_cost.c: FLOPs and bytes of one forward from the model config and the
 * batch composition, and their time from a measured profile or roofline
 * numbers (README.md, section 'Simulator' "Cost model").
 *
 * Layers with the same schedule (compress ratio, kv/index/candidate source,
 * Engram, position relative to the replay cut, expert counts) cost the same,
 * so they are grouped into classes computed once per step. Per request, the
 * attention key counts are closed-form sums over the rows of the forward:
 *   window keys of row t:      min(W, t - floor + 1)             (SPEC §4.2)
 *   visible compressed of t:   floor((t+1)/m)                    (SPEC §4.3)
 *   compressed keys of t:      min(index_topk, floor((t+1)/m))   (SPEC §6 top-k)
 *   indexer scores of t:       floor((t+1)/m) positions, or at most
 *                              candidate_topk_blocks*candidate_block_size for
 *                              index sources after the candidate source (SPEC §6)
 * Decoder-side replay (SPEC §7) keeps each prefill item's last min(rows, W)
 * rows from the cut layer's attention query on, floored at max(floor, end-W). */
#include "v41_sim.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAXR 8        /* distinct compress ratios */
#define MAXCLS 64

static const char *class_names[V41_OP_NCLASS] = {"gemm", "attn_decode", "attn_prefill", "indexer", "moe", "small"};
const char *v41_op_class_name(int c) { return c >= 0 && c < V41_OP_NCLASS ? class_names[c] : "?"; }

void v41_hw_h200(v41_hw *hw)
{
    memset(hw, 0, sizeof *hw);
    /* NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 tensor core, 4.8 TB/s HBM3e, 141 GB. */
    hw->peak_flops = 989e12;
    hw->peak_bw = 4.8e12;
    hw->hbm_bytes = 141e9;
    /* Achievable fractions of the peaks (README.md, section 'Simulator'): large cuBLAS GEMMs reach ~60-70% of
     * dense peak, streaming kernels ~80-90% of HBM bandwidth; sparse gathers less. */
    const double ef[V41_OP_NCLASS] = {0.60, 0.40, 0.50, 0.45, 0.50, 0.30};
    const double eb[V41_OP_NCLASS] = {0.80, 0.65, 0.70, 0.70, 0.75, 0.70};
    for (int c = 0; c < V41_OP_NCLASS; c++) {
        hw->eff_flops[c] = ef[c];
        hw->eff_bw[c] = eb[c];
    }
    hw->launch_s = 2e-6;  /* per kernel; CUDA-graph launches cost ~1-3 us */
    hw->gpus = 0;         /* 0 = auto from the weight size */
    hw->par_eff = 0.85;
}

/* ------------------------------------------------------------------ profile */

static int cmp2(const void *a, const void *b)
{
    const double *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

int v41_json_load(const char *path, const char *what, cJSON **out, v41_err *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return v41_err_set(err, V41_EIO, "%s %s: cannot open: %s", what, path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return v41_err_set(err, V41_EIO, "%s %s: read error", what, path);
    }
    fclose(f);
    buf[n] = 0;
    *out = cJSON_Parse(buf);
    free(buf);
    if (!*out) return v41_err_set(err, V41_EINVAL, "%s %s: not valid JSON", what, path);
    return V41_OK;
}

int v41_profile_load(const char *path, v41_profile *p, v41_err *err)
{
    memset(p, 0, sizeof *p);
    cJSON *j;
    int rc = v41_json_load(path, "profile", &j, err);
    if (rc) return rc;
    double (*pts)[2] = NULL;
    const cJSON *sch = cJSON_GetObjectItemCaseSensitive(j, "schema");
    if (!cJSON_IsString(sch) || strcmp(sch->valuestring, "v41-profile/1")) {
        rc = v41_err_set(err, V41_EINVAL, "profile %s: key 'schema' must be \"v41-profile/1\"", path);
        goto out;
    }
    const cJSON *dev = cJSON_GetObjectItemCaseSensitive(j, "device");
    snprintf(p->device, sizeof p->device, "%s", cJSON_IsString(dev) ? dev->valuestring : "unknown");
    const cJSON *ce = cJSON_GetObjectItemCaseSensitive(j, "ceilings");
    const cJSON *bw = ce ? cJSON_GetObjectItemCaseSensitive(ce, "copy_GBps") : NULL;
    const cJSON *fl = ce ? cJSON_GetObjectItemCaseSensitive(ce, "bf16_gemm_TFLOPs") : NULL;
    if (!cJSON_IsNumber(bw) || !(bw->valuedouble > 0 && bw->valuedouble < 1e12) || !cJSON_IsNumber(fl) ||
        !(fl->valuedouble > 0 && fl->valuedouble < 1e12)) {
        rc = v41_err_set(err, V41_EINVAL, "profile %s: 'ceilings' needs copy_GBps and bf16_gemm_TFLOPs in (0, 1e12)",
                         path);
        goto out;
    }
    p->peak_bw = bw->valuedouble * 1e9;
    p->peak_flops = fl->valuedouble * 1e12;
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(j, "launch_us");
    if (ls && !(cJSON_IsNumber(ls) && ls->valuedouble >= 0 && ls->valuedouble < 1e12)) {
        rc = v41_err_set(err, V41_EINVAL, "profile %s: 'launch_us' must be a number in [0, 1e12)", path);
        goto out;
    }
    if (ls) p->launch_s = ls->valuedouble * 1e-6;
    const cJSON *ops = cJSON_GetObjectItemCaseSensitive(j, "ops");
    if (!cJSON_IsArray(ops)) {
        rc = v41_err_set(err, V41_EINVAL, "profile %s: 'ops' must be an array", path);
        goto out;
    }
    int nops = cJSON_GetArraySize(ops);
    pts = malloc(sizeof *pts * (size_t)(nops + 1) * V41_OP_NCLASS);
    if (!pts) { rc = v41_err_set(err, V41_ENOMEM, "profile: out of memory"); goto out; }
    int cnt[V41_OP_NCLASS] = {0};
    int i = 0;
    for (const cJSON *o = ops->child; o; o = o->next, i++) {
        const cJSON *op = cJSON_GetObjectItemCaseSensitive(o, "op");
        const cJSON *F = cJSON_GetObjectItemCaseSensitive(o, "flops");
        const cJSON *B = cJSON_GetObjectItemCaseSensitive(o, "bytes");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "median_s");
        if (!cJSON_IsString(op) || !cJSON_IsNumber(F) || !cJSON_IsNumber(B) || !cJSON_IsNumber(t) ||
            F->valuedouble < 0 || B->valuedouble < 0 || !(t->valuedouble > 0) ||
            !(F->valuedouble > 0 || B->valuedouble > 0)) {
            rc = v41_err_set(err, V41_EINVAL,
                             "profile %s: ops[%d] needs op (string), flops >= 0, bytes >= 0 (not both 0), median_s > 0",
                             path, i);
            goto out;
        }
        int c = -1;
        for (int k = 0; k < V41_OP_NCLASS; k++)
            if (!strcmp(op->valuestring, class_names[k])) c = k;
        if (c < 0) { p->n_ignored++; continue; }   /* "layer" and future classes */
        double x = fmax(F->valuedouble / p->peak_flops, B->valuedouble / p->peak_bw);
        double *pt = pts[c * (nops + 1) + cnt[c]];
        pt[0] = log(x);
        pt[1] = log(x / t->valuedouble);
        if (!isfinite(pt[0]) || !isfinite(pt[1])) {  /* 1e999 parses as inf; 1e-320 bytes underflow */
            rc = v41_err_set(err, V41_EINVAL, "profile %s: ops[%d]: flops, bytes or median_s out of range "
                             "(roofline time %g s, measured %g s)", path, i, x, t->valuedouble);
            goto out;
        }
        cnt[c]++;
    }
    for (int c = 0; c < V41_OP_NCLASS; c++) {
        double (*pc)[2] = pts + c * (nops + 1);
        qsort(pc, (size_t)cnt[c], sizeof *pc, cmp2);
        /* merge equal sizes (average their log efficiency), keep at most MAXPTS */
        int m = 0;
        for (int k = 0; k < cnt[c];) {
            int e = k;
            double s = 0;
            while (e < cnt[c] && pc[e][0] == pc[k][0]) s += pc[e++][1];
            if (m < V41_PROFILE_MAXPTS) {
                p->x[c][m] = pc[k][0];
                p->le[c][m] = s / (e - k);
                m++;
            }
            k = e;
        }
        p->n[c] = m;
    }
out:
    free(pts);
    cJSON_Delete(j);
    return rc;
}

/* ------------------------------------------------------------------ model */

typedef struct layer_cls {
    int count;
    int ratio, rslot;        /* compress ratio, its slot in the per-ratio sums (-1: ratio 0) */
    bool kv_src, idx_src, cand_src, after_cand, engram;
    int trim;                /* 0 before the cut, 1 the cut layer, 2 after it */
    int n_exp, n_act;
} layer_cls;

struct v41_cost_model {
    v41_config c;
    v41_hw hw;
    v41_profile prof;
    bool have_prof;
    double peakF, peakB, launch, div;
    int nr, ratios[MAXR];
    int ncls, nstage;
    layer_cls cls[MAXCLS], stage[MAXCLS];
    double wfp8, wexp;       /* bytes per weight element of fp8 Linears and of routed experts */
    double wkb, ckb, ikb;    /* bytes per window key, compressed key, index key */
    bool have_cal;
    v41_calib cal;
};

static double wbytes_of(const char *dt)
{
    if (!strcmp(dt, "fp4")) return 0.5 + 1.0 / 32;      /* e2m1 + e8m0 per 32 (SPEC §2) */
    if (!strcmp(dt, "fp8")) return 1.0 + 1.0 / 1024;    /* e4m3 + e8m0 per 32x32 block */
    return 2.0;                                          /* bf16 */
}

static int add_cls(layer_cls *arr, int *n, const layer_cls *x)
{
    for (int i = 0; i < *n; i++) {
        layer_cls y = arr[i];
        y.count = x->count;
        if (!memcmp(&y, x, sizeof y)) { arr[i].count++; return 0; }
    }
    if (*n >= MAXCLS) return -1;
    arr[(*n)++] = *x;
    return 0;
}

static bool in_list(const int *v, int n, int x)
{
    for (int i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}

int v41_cost_create(const v41_config *cfg, const v41_hw *hw, const v41_profile *prof, v41_cost_model **out,
                    v41_err *err)
{
    v41_cost_model *m = calloc(1, sizeof *m);
    if (!m) return v41_err_set(err, V41_ENOMEM, "cost model: out of memory");
    m->c = *cfg;
    m->hw = *hw;
    const v41_config *c = &m->c;
    if (prof) {
        m->prof = *prof;
        m->have_prof = true;
        m->peakF = prof->peak_flops;
        m->peakB = prof->peak_bw;
        m->launch = prof->launch_s;
    } else {
        m->peakF = hw->peak_flops;
        m->peakB = hw->peak_bw;
        m->launch = hw->launch_s;
    }
    int g = hw->gpus > 0 ? hw->gpus : 1;
    m->div = g > 1 ? g * hw->par_eff : 1.0;
    m->wfp8 = wbytes_of(c->dtype);
    m->wexp = wbytes_of(c->expert_dtype);
    int d = c->head_dim, dI = c->index_head_dim;
    m->wkb = d + d / 32.0;          /* window K: e4m3 + e8m0 per 32 (act_quant, SPEC §2) */
    m->ckb = d / 2.0 + d / 16.0;    /* compressed latent: fp4 + e4m3 per 16 */
    m->ikb = dI / 2.0 + dI / 32.0;  /* index key: fp4 + e8m0 per 32 */
    int cut = -1;
    for (int i = 0; i < c->n_kv_sources; i++) cut = c->kv_source_layers[i] > cut ? c->kv_source_layers[i] : cut;
    for (int l = 0; l < c->n_layers + c->n_mtp_layers; l++) {
        int r = c->compress_ratios[l];
        layer_cls x = {0};
        x.count = 1;
        x.ratio = r;
        x.rslot = -1;
        if (r > 0) {
            int s = 0;
            while (s < m->nr && m->ratios[s] != r) s++;
            if (s == m->nr) {
                if (m->nr >= MAXR) { free(m); return v41_err_set(err, V41_EUNSUPPORTED, "cost model: more than %d compress ratios", MAXR); }
                m->ratios[m->nr++] = r;
            }
            x.rslot = s;
        }
        bool stage = l >= c->n_layers;
        x.kv_src = !stage && in_list(c->kv_source_layers, c->n_kv_sources, l);
        x.idx_src = !stage && r > 0 && in_list(c->index_source_layers, c->n_index_sources, l);
        x.cand_src = x.idx_src && c->candidate_source_layer == l;
        x.after_cand = x.idx_src && c->candidate_source_layer >= 0 && l > c->candidate_source_layer;
        x.engram = !stage && in_list(c->engram_layer_ids, c->n_engram_layers, l);
        x.trim = stage || cut < 0 || l < cut ? 0 : l == cut ? 1 : 2;
        x.n_exp = c->n_routed_experts;
        x.n_act = c->n_activated_experts;
        if (stage) {
            if (c->dspark_n_routed_experts > 0) x.n_exp = c->dspark_n_routed_experts;
            if (c->dspark_n_activated_experts > 0) x.n_act = c->dspark_n_activated_experts;
        }
        if (add_cls(stage ? m->stage : m->cls, stage ? &m->nstage : &m->ncls, &x)) {
            free(m);
            return v41_err_set(err, V41_EUNSUPPORTED, "cost model: more than %d layer classes", MAXCLS);
        }
    }
    *out = m;
    return V41_OK;
}

void v41_cost_destroy(v41_cost_model *m) { free(m); }

void v41_cost_set_calib(v41_cost_model *m, const v41_calib *cal)
{
    m->have_cal = cal != NULL;
    if (cal) m->cal = *cal;
}

int v41_calib_load(const char *path, v41_calib *c, v41_err *err)
{
    memset(c, 0, sizeof *c);
    snprintf(c->source, sizeof c->source, "%s", path);
    cJSON *j;
    int rc = v41_json_load(path, "calibration", &j, err);
    if (rc) return rc;
    const cJSON *sch = cJSON_GetObjectItemCaseSensitive(j, "schema");
    const cJSON *fit = cJSON_GetObjectItemCaseSensitive(j, "fit");
    if (!cJSON_IsString(sch) || strcmp(sch->valuestring, "v41-sim-validate/1")) {
        rc = v41_err_set(err, V41_EINVAL, "calibration %s: key 'schema' must be \"v41-sim-validate/1\" "
                                          "(the --json output of `v41 sim --validate ... --fit|--fit-from`)", path);
        goto out;
    }
    if (!cJSON_IsObject(fit)) {
        rc = v41_err_set(err, V41_EINVAL, "calibration %s: no 'fit' object (run `v41 sim --validate` with --fit or "
                                          "--fit-from)", path);
        goto out;
    }
    for (int k = -3; k < V41_OP_NCLASS; k++) {
        const char *key = k == -3 ? "c0_s" : k == -2 ? "per_row_s" : k == -1 ? "per_request_s" : v41_op_class_name(k);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(fit, key);
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || !isfinite(v->valuedouble)) {
            rc = v41_err_set(err, V41_EINVAL, "calibration %s: fit key '%s' missing or not a finite number >= 0", path,
                             key);
            goto out;
        }
        if (k == -3) c->c0 = v->valuedouble;
        else if (k == -2) c->per_row = v->valuedouble;
        else if (k == -1) c->per_request = v->valuedouble;
        else c->a[k] = v->valuedouble;
    }
    for (int k = 0; k < 2 && !rc; k++) { /* optional (calibrations written before they existed): 0 */
        const char *key = k ? "per_mixed_row_s" : "per_mixed_step_s";
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(fit, key);
        double *dst = k ? &c->per_mixed_row : &c->per_mixed_step;
        *dst = 0;
        if (v && (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || !isfinite(v->valuedouble)))
            rc = v41_err_set(err, V41_EINVAL, "calibration %s: fit key '%s' not a finite number >= 0", path, key);
        else if (v)
            *dst = v->valuedouble;
    }
out:
    cJSON_Delete(j);
    return rc;
}

void v41_cost_kv_bytes(const v41_cost_model *m, v41_kv_bytes *kb)
{
    const v41_config *c = &m->c;
    memset(kb, 0, sizeof *kb);
    kb->window_row = c->n_layers * m->wkb;
    kb->dspark_row = c->n_mtp_layers * m->wkb;
    for (int i = 0; i < c->n_kv_sources; i++) {
        int r = c->compress_ratios[c->kv_source_layers[i]];
        if (r <= 0) continue;
        kb->comp_tok += m->ckb / r;
        kb->index_tok += m->ikb / r;
        if (r > 1) kb->state_req += 2.0 * r * c->head_dim * 4;   /* fp32 kv + gate logits, m slots (SPEC §5) */
    }
    /* weights resident in HBM; Engram tables are host-resident (looked up by hash, not streamed) */
    double D = c->dim, H = c->n_heads, d = c->head_dim, h = c->hc_mult;
    double w = 0;
    for (int l = 0; l < c->n_layers + c->n_mtp_layers; l++) {
        bool stage = l >= c->n_layers;
        int r = c->compress_ratios[l];
        double E = stage && c->dspark_n_routed_experts > 0 ? c->dspark_n_routed_experts : c->n_routed_experts;
        w += (D * c->q_lora_rank + c->q_lora_rank * H * d + D * d + c->o_groups * c->o_lora_rank * D) * m->wfp8;
        w += 2.0 * c->o_lora_rank * H * d;                       /* wo_a bf16 */
        w += 2.0 * (2 + h) * h * h * D * 4;                      /* hc fn, fp32 */
        w += E * D * 4;                                          /* gate */
        w += E * 3 * D * c->moe_inter_dim * m->wexp;
        w += c->n_shared_experts * 3 * D * c->moe_inter_dim * m->wfp8;
        if (!stage && in_list(c->kv_source_layers, c->n_kv_sources, l))
            w += (r > 1 ? 2 : 1) * D * d * 2.0 + d * (double)c->index_head_dim * 2;
        if (!stage && r > 0 && in_list(c->index_source_layers, c->n_index_sources, l))
            w += c->q_lora_rank * (double)c->index_n_heads * c->index_head_dim * m->wfp8 + D * c->index_n_heads * 2.0;
        if (!stage && in_list(c->engram_layer_ids, c->n_engram_layers, l))
            w += (c->engram_max_ngram_size - 1.0) * c->engram_n_heads * c->engram_head_dim * (h + 1) * D * m->wfp8;
    }
    w += 2.0 * c->vocab_size * D * 2;                            /* embed + head (bf16) */
    if (c->n_mtp_layers > 0)
        w += c->n_dspark_targets * D * D * m->wfp8 + 2.0 * c->dspark_markov_rank * c->vocab_size * 2;
    kb->weights = w;
}

/* ------------------------------------------------------------------ closed-form sums */

/* sum_{y=1}^{n} min(W, y) */
static double sum_min_lin(double n, double W)
{
    if (n <= 0) return 0;
    if (n <= W) return n * (n + 1) / 2;
    return W * (W + 1) / 2 + W * (n - W);
}
/* sum_{x=0}^{n} floor(x/m) */
static double sum_floor(int64_t n, int64_t m)
{
    if (n <= 0) return 0;
    int64_t q = n / m, r = n % m;
    return (double)m * (double)q * (double)(q - 1) / 2 + (double)q * (double)(r + 1);
}
/* F(n) = sum_{x=1}^{n} min(K, floor(x/m)); K < 0: no cap */
static double sum_min_floor(int64_t n, int64_t m, int64_t K)
{
    if (n <= 0) return 0;
    if (K < 0 || n < K * m) return sum_floor(n, m);
    return sum_floor(K * m - 1, m) + (double)K * (double)(n - K * m + 1);
}

/* ------------------------------------------------------------------ step */

typedef struct view {
    double rows, rows_k[2];
    double wkeys[2], wuniq[2];
    double ckeys[MAXR][2], cuniq[MAXR][2];
    double vis[MAXR], viscand[MAXR], iuniq[MAXR];
} view;

typedef struct agg {
    view v[2];               /* [0] untrimmed rows, [1] rows kept by decoder-side replay */
    double new_rows, emit[MAXR];
    double logits;
    double draft_rows, draft_wkeys, draft_wuniq;   /* DSpark block rows over all decode items */
    double ctx_rows;         /* DSpark context-KV rows (prefill rows kept + verify rows) */
} agg;

typedef struct acc {
    const v41_cost_model *m;
    bool time;               /* false: FLOPs only */
    v41_step_cost *o;
    double flops;
} acc;

double v41_cost_kernel_time(const v41_cost_model *m, int c, double F, double B)
{
    double x = fmax(F / m->peakF, B / m->peakB);
    if (m->have_prof && m->prof.n[c] > 0) {
        /* piecewise log-linear efficiency in the roofline time, clamped at the ends */
        const double *X = m->prof.x[c], *E = m->prof.le[c];
        int n = m->prof.n[c];
        double lx = log(x), le;
        if (n == 1 || lx <= X[0]) le = E[0];
        else if (lx >= X[n - 1]) le = E[n - 1];
        else {
            int lo = 0, hi = n - 1;
            while (hi - lo > 1) {
                int mid = (lo + hi) / 2;
                if (X[mid] <= lx) lo = mid; else hi = mid;
            }
            double f = (lx - X[lo]) / (X[hi] - X[lo]);
            le = E[lo] + f * (E[hi] - E[lo]);
        }
        return x / exp(le);
    }
    return fmax(F / (m->peakF * m->hw.eff_flops[c]), B / (m->peakB * m->hw.eff_bw[c]));
}

static void op(acc *a, int c, double F, double B, double kernels)
{
    if (kernels <= 0 || (F <= 0 && B <= 0)) return;
    a->flops += F;
    if (!a->time) return;
    const v41_cost_model *m = a->m;
    v41_step_cost *o = a->o;
    double t = v41_cost_kernel_time(m, c, F / kernels, B / kernels);
    t = (t * kernels) / m->div + m->launch * kernels;
    o->time_s += t;
    o->time_c[c] += t;
    o->flops_c[c] += F;
    o->bytes_c[c] += B;
    o->flops += F;
    o->bytes += B;
    o->kernels += (int64_t)kernels;
}

/* dense Linear: M rows, K -> N, weight bytes per element wb; bf16 activations */
static void gemm(acc *a, double M, double K, double N, double wb, double count)
{
    if (M <= 0) return;
    op(a, V41_OP_GEMM, count * 2 * M * K * N, count * (K * N * wb + 2 * M * K + 2 * M * N), count);
}
static void small(acc *a, double bytes, double kernels)
{
    if (bytes <= 0) return;
    op(a, V41_OP_SMALL, 0, bytes, kernels);
}

/* One layer class: pre-query part on va (rows Ta), query part on vq. */
static void layer(acc *a, const layer_cls *L, const view *va, const view *vq, const agg *g, bool stage)
{
    const v41_cost_model *m = a->m;
    const v41_config *c = &m->c;
    double n = L->count;
    double D = c->dim, h = c->hc_mult, H = c->n_heads, d = c->head_dim, r = c->rope_head_dim;
    double ql = c->q_lora_rank, G = c->o_groups, ol = c->o_lora_rank;
    double nI = c->index_n_heads, dI = c->index_head_dim, I = c->moe_inter_dim;
    double Ta = va->rows, Tq = vq->rows;
    if (Ta <= 0 && Tq <= 0) return;
    int s = L->rslot;
    /* --- Engram (before the block, SPEC §8): gather + wkv */
    if (L->engram && Ta > 0) {
        double K = (c->engram_max_ngram_size - 1.0) * c->engram_n_heads * c->engram_head_dim;
        small(a, n * Ta * K * (1 + 1.0 / 32), n);
        gemm(a, Ta, K, (h + 1) * D, m->wfp8, n);
        small(a, n * Ta * h * D * 2 * 3, n);
    }
    /* --- pre-query: mHC attention mixes, hc_pre, attn_norm, window K */
    if (Ta > 0) {
        gemm(a, Ta, h * D, (2 + h) * h, 4, n);
        small(a, n * Ta * (h * D * 2 * 2 + D * 2 * 2), 2 * n);
        gemm(a, Ta, D, d, m->wfp8, n);
        small(a, n * Ta * d * 2 * 2, n);                 /* kv_norm + RoPE + act_quant */
    }
    /* --- compressor and index keys: only rows >= the hit write compressed state (SPEC §7) */
    if (L->kv_src && !stage && g->new_rows > 0) {
        double Tn = g->new_rows, Em = g->emit[s];
        gemm(a, Tn, D, d, 2, (L->ratio > 1 ? 2 : 1) * n);
        small(a, n * (Tn * d * 4 * 2 + Em * d * 2 * 2), n);
        gemm(a, Em, d, dI, 2, n);
        small(a, n * Em * dI * 2 * 2, n);
    }
    if (Tq <= 0) return;
    /* --- query */
    gemm(a, Tq, D, ql, m->wfp8, n);
    gemm(a, Tq, ql, H * d, m->wfp8, n);
    small(a, n * Tq * (ql * 2 * 2 + H * r * 2 * 2), 2 * n);
    /* --- lightning indexer (index sources) */
    if (L->idx_src) {
        gemm(a, Tq, ql, nI * dI, m->wfp8, n);
        gemm(a, Tq, D, nI, 2, n);
        double scored = L->after_cand ? vq->viscand[s] : vq->vis[s];
        op(a, V41_OP_INDEXER, n * 2 * nI * dI * scored,
           n * (vq->iuniq[s] * m->ikb + Tq * nI * dI * 2 + scored * 2), n);
        small(a, n * scored * 2, n);                     /* top-k over the scores */
        if (L->cand_src) small(a, n * scored * 2 / (c->candidate_block_size > 0 ? c->candidate_block_size : 1), n);
    }
    /* --- sparse attention with sink, per kind (separate decode / prefill kernels) */
    for (int k = 0; k < 2; k++) {
        double rows = vq->rows_k[k];
        if (rows <= 0) continue;
        double keys = vq->wkeys[k] + (s >= 0 ? vq->ckeys[s][k] : 0);
        double uniq = vq->wuniq[k] * m->wkb + (s >= 0 ? vq->cuniq[s][k] * m->ckb : 0);
        op(a, k ? V41_OP_ATTN_DECODE : V41_OP_ATTN_PREFILL, n * 4 * H * d * keys, n * (uniq + rows * H * d * 2 * 2), n);
    }
    /* --- grouped output projection */
    op(a, V41_OP_GEMM, n * 2 * Tq * H * d * ol, n * (2 * ol * H * d + Tq * H * d * 2 + Tq * G * ol * 2), n);
    gemm(a, Tq, G * ol, D, m->wfp8, n);
    /* --- hc_post, FFN mixes, hc_pre, ffn_norm */
    small(a, n * Tq * h * D * 2 * 3, n);
    gemm(a, Tq, h * D, (2 + h) * h, 4, n);
    small(a, n * Tq * (h * D * 2 * 2 + D * 2 * 2), 2 * n);
    /* --- MoE: gate, routed experts (weights of the experts touched), shared expert */
    double E = L->n_exp, k = L->n_act;
    gemm(a, Tq, D, E, 2, n);
    double touched = E * (1 - pow(1 - k / E, Tq));       /* expected distinct experts, uniform routing */
    op(a, V41_OP_MOE, n * 2 * Tq * k * 3 * D * I,
       n * (touched * 3 * D * I * m->wexp + Tq * k * (D * 2 * 2 + I * 2 * 3)), 3 * n);
    if (c->n_shared_experts > 0) {
        gemm(a, Tq, D, 2 * I, m->wfp8, c->n_shared_experts * n);
        gemm(a, Tq, I, D, m->wfp8, c->n_shared_experts * n);
    }
    small(a, n * Tq * h * D * 2 * 3, n);
}

static void add_rows(view *v, const v41_cost_model *m, int k, int64_t a, int64_t b, int64_t f)
{
    const v41_config *c = &m->c;
    double W = c->window_size;
    int64_t n = b - a;
    if (n <= 0) return;
    if (f > a) f = a;
    v->rows += n;
    v->rows_k[k] += n;
    v->wkeys[k] += sum_min_lin((double)(b - f), W) - sum_min_lin((double)(a - f), W);
    int64_t lo = a - c->window_size + 1;
    v->wuniq[k] += (double)(b - (lo > f ? lo : f));
    int64_t C = c->candidate_topk_blocks > 0 && c->candidate_block_size > 0 && c->candidate_source_layer >= 0
                    ? (int64_t)c->candidate_topk_blocks * c->candidate_block_size : -1;
    for (int s = 0; s < m->nr; s++) {
        int64_t r = m->ratios[s];
        double vis = sum_min_floor(b, r, -1) - sum_min_floor(a, r, -1);
        v->vis[s] += vis;
        v->viscand[s] += C >= 0 ? sum_min_floor(b, r, C) - sum_min_floor(a, r, C) : vis;
        v->ckeys[s][k] += sum_min_floor(b, r, c->index_topk) - sum_min_floor(a, r, c->index_topk);
        double vb = (double)(b / r);
        v->cuniq[s][k] += fmin(vb, (double)n * c->index_topk);
        v->iuniq[s] += vb;
    }
}

static void run_layers(acc *a, const agg *g, bool trimmed)
{
    const v41_cost_model *m = a->m;
    const v41_config *c = &m->c;
    const view *v0 = &g->v[0], *v1 = trimmed ? &g->v[1] : &g->v[0];
    double D = c->dim, h = c->hc_mult;
    /* embedding: every stream starts as embed(id) */
    small(a, v0->rows * (D * 2 + h * D * 2), 1);
    for (int i = 0; i < m->ncls; i++) {
        const layer_cls *L = &m->cls[i];
        const view *va = L->trim == 2 ? v1 : v0, *vq = L->trim >= 1 ? v1 : v0;
        layer(a, L, va, vq, g, false);
    }
    /* final hc_pre + norm + head on the rows that need logits */
    if (g->logits > 0) {
        small(a, g->logits * (h * D * 2 + D * 2 * 2), 2);
        gemm(a, g->logits, D, c->vocab_size, 2, 1);
    }
}

void v41_cost_step(const v41_cost_model *m, const v41_sim_item *items, int n, int draft_len, v41_step_cost *out)
{
    const v41_config *c = &m->c;
    memset(out, 0, sizeof *out);
    agg g;
    memset(&g, 0, sizeof g);
    bool any_trim = false;
    int64_t W = c->window_size;
    double n_draft_items = 0;
    for (int i = 0; i < n; i++) {
        const v41_sim_item *it = &items[i];
        int k = it->kind == V41_ITEM_PREFILL ? 0 : 1;
        int64_t a = it->start, b = it->end, f = it->kind == V41_ITEM_PREFILL ? it->floor : 0;
        if (b <= a) continue;
        add_rows(&g.v[0], m, k, a, b, f);
        if (it->trim && k == 0 && b - a > W) {
            add_rows(&g.v[1], m, k, b - W, b, f > b - W ? f : b - W);
            any_trim = true;
        } else {
            add_rows(&g.v[1], m, k, a, b, f);
        }
        int64_t nf = it->new_from > a ? it->new_from : a;
        if (b > nf) {
            g.new_rows += (double)(b - nf);
            for (int s = 0; s < m->nr; s++) g.emit[s] += (double)(b / m->ratios[s] - nf / m->ratios[s]);
        }
        if (k == 1) g.logits += (double)(b - a);
        else if (it->logits) g.logits += 1;
        if (draft_len > 0 && c->n_mtp_layers > 0) {
            if (k == 1) {
                double B = c->dspark_block_size > 0 ? c->dspark_block_size : draft_len;
                double ring = (double)(b < W ? b : W);
                g.draft_rows += B;
                g.draft_wkeys += B * (ring + B);   /* non-causal: ring slots + the block (SPEC §8) */
                g.draft_wuniq += ring + B;
                g.ctx_rows += (double)(b - a);
                n_draft_items++;
            } else {
                /* context KV of the stages: the kept window only under decoder-side replay */
                int64_t keep = it->trim && b - a > W ? W : b - a;
                g.ctx_rows += (double)keep;
            }
        }
    }
    acc A = {m, true, out, 0};
    run_layers(&A, &g, any_trim);
    out->rows = (int64_t)g.v[0].rows;
    if (any_trim) {
        acc U = {m, false, NULL, 0};
        run_layers(&U, &g, false);
        out->trimmed_flops = U.flops - A.flops;
        for (int i = 0; i < m->ncls; i++) {
            const layer_cls *L = &m->cls[i];
            if (L->trim) out->trimmed_layer_rows += (int64_t)(L->count * (g.v[0].rows - g.v[1].rows));
        }
    }
    /* --- DSpark: stage context KV (main_proj + each stage's wkv), then the draft block */
    if (draft_len > 0 && c->n_mtp_layers > 0 && (g.ctx_rows > 0 || g.draft_rows > 0)) {
        double f0 = A.flops, D = c->dim;
        if (g.ctx_rows > 0) {
            gemm(&A, g.ctx_rows, c->n_dspark_targets * D, D, m->wfp8, 1);
            gemm(&A, g.ctx_rows, D, c->head_dim, m->wfp8, c->n_mtp_layers);
            small(&A, g.ctx_rows * (c->n_dspark_targets * D * 2 + c->n_mtp_layers * c->head_dim * 2 * 2), 2);
        }
        if (g.draft_rows > 0) {
            view v;
            memset(&v, 0, sizeof v);
            v.rows = v.rows_k[1] = g.draft_rows;
            v.wkeys[1] = g.draft_wkeys;
            v.wuniq[1] = g.draft_wuniq;
            agg gd;
            memset(&gd, 0, sizeof gd);
            small(&A, g.draft_rows * D * 2 * (1 + c->hc_mult), 1);
            for (int i = 0; i < m->nstage; i++) layer(&A, &m->stage[i], &v, &v, &gd, true);
            /* head + Markov bias (rank-r GEMM) + confidence */
            gemm(&A, g.draft_rows, D, c->vocab_size, 2, 1);
            gemm(&A, g.draft_rows, c->dspark_markov_rank, c->vocab_size, 2, 1);
            small(&A, g.draft_rows * (c->hc_mult * D * 2 + c->dspark_markov_rank * 2 + D * 2), 3);
        }
        out->draft_flops = A.flops - f0;
        (void)n_draft_items;
    }
    if (m->have_cal) {   /* calibrated step time (v41_calib) */
        bool pure_decode = true;
        for (int k = 0; k < n; k++) pure_decode = pure_decode && items[k].kind == V41_ITEM_DECODE;
        double t = m->cal.c0 + m->cal.per_row * (double)out->rows + m->cal.per_request * (double)n;
        if (!pure_decode) t += m->cal.per_mixed_step + m->cal.per_mixed_row * (double)out->rows;
        for (int c2 = 0; c2 < V41_OP_NCLASS; c2++) t += m->cal.a[c2] * out->time_c[c2];
        out->time_s = t;
    }
}

/* ------------------------------------------------------------------ configs */

/* SPEC §1, column V4.1-Flash. */
static const char flash_json[] =
    "{\"vocab_size\":129280,\"dim\":5120,\"n_layers\":40,\"n_mtp_layers\":3,\"n_heads\":64,\"head_dim\":512,"
    "\"rope_head_dim\":64,\"q_lora_rank\":1280,\"o_groups\":8,\"o_lora_rank\":1024,\"window_size\":128,"
    "\"compress_ratios\":[0,0,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0],"
    "\"kv_source_layers\":[2,8,14,20],\"index_source_layers\":[2,8,14,20,24,28,32,36],"
    "\"candidate_source_layer\":20,\"candidate_topk_blocks\":2048,\"candidate_block_size\":8,"
    "\"index_n_heads\":32,\"index_head_dim\":128,\"index_topk\":512,\"rope_theta\":10000,"
    "\"compress_rope_theta\":160000,\"original_seq_len\":65536,\"rope_factor\":16,\"beta_fast\":32,\"beta_slow\":1,"
    "\"n_routed_experts\":384,\"n_activated_experts\":6,\"n_shared_experts\":1,\"moe_inter_dim\":2304,"
    "\"score_func\":\"sqrtsoftplus\",\"gate_temp\":1,\"norm_topk_prob\":true,\"route_scale\":1.5,\"swiglu_limit\":10,"
    "\"hc_mult\":4,\"hc_sinkhorn_iters\":20,\"hc_eps\":1e-6,\"norm_eps\":1e-20,"
    "\"engram_layer_ids\":[1,14],\"engram_max_ngram_size\":4,\"engram_n_heads\":8,\"engram_head_dim\":256,"
    "\"engram_vocab_size\":16000000,\"engram_num_embeddings\":[384006168,384016682],\"engram_pad_id\":2,"
    "\"engram_compressed_vocab_size\":99092,\"dspark_block_size\":5,\"dspark_noise_token_id\":128799,"
    "\"dspark_target_layer_ids\":[37,38,39],\"dspark_markov_rank\":256,\"dspark_n_routed_experts\":128,"
    "\"dspark_n_activated_experts\":3,\"dtype\":\"fp8\",\"expert_dtype\":\"fp4\",\"max_seq_len\":1048576}";

int v41_sim_config_flash(v41_config *cfg, v41_err *err)
{
    int rc = v41_config_parse(flash_json, sizeof flash_json - 1, cfg, err);
    if (rc) v41_err_prefix(err, "built-in flash preset");
    return rc;
}

int v41_sim_config_get(const char *name, v41_config *cfg, v41_err *err)
{
    if (!name || !strcmp(name, "flash")) return v41_sim_config_flash(cfg, err);
    if (!strcmp(name, "tiny")) {
        v41_config_tiny(cfg);
        return V41_OK;
    }
    return v41_config_load(name, cfg, err);
}
