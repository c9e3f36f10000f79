/* engine_serving.c: bounded replay in the CPU reference engine (SPEC §7).
 *
 * Encoder side (prefix-cache hit): after fork(src, dst, H) a forward of dst may
 * start at start_pos = replay_floor = H - W < H (its cached length). Rows at
 * positions < H are replayed: every layer recomputes them but only their window
 * KV is written (the compressor suppresses its history, state and latents for
 * them, see compressor() in engine.c: `pos < R->hit`), so the cached compressed
 * KV, index keys and partial-group state stay. Window attention is floored at
 * replay_floor. The engram look-back reads the cached token history.
 *
 * Decoder side (trimming): cut = the last kv source layer. The cut layer runs its
 * KV side (window KV, compressor, indexer incl. its top-k and candidate mask) on
 * every row; from its attention query on, the forward switches to a compacted
 * view holding each trimmed request's last W rows (other requests whole): the
 * mHC stream, pre-mix and attention-side pre are gathered, the top-k and
 * candidate rows realigned (fault replay-rows-misaligned: not realigned), and
 * after the last layer the stream is scattered back with zeros for the trimmed
 * rows. Layers after the cut floor the window of trimmed requests at
 * kv_start = max(replay_floor, L - W); the cut layer keeps replay_floor.
 * Trimmed: replay on, query_len > W, and none of prompt_logprobs, all_logits
 * (every row's logits asked for = prompt logprobs), verify, decode. */
#include "config.h"
#include "v41_env.h"
#include "engine_serving.h"
#include <stdlib.h>
#include <string.h>

int v41_srv_check_start(ref_engine *E, const req_state *st, const v41_req *rq, v41_err *err)
{
    if (!E->e.opts.replay || rq->start_pos > st->len || rq->replay_floor <= 0 || rq->replay_floor > rq->start_pos)
        return v41_err_set(err, V41_EINVAL,
                           "forward: request %d continues at %d but %d positions are cached (truncate first; a start "
                           "inside the cached prefix is a replay: replay on and 0 < replay_floor <= start_pos)",
                           rq->id, rq->start_pos, st->len);
    /* replayed rows must be the cached tokens (their engram history is kept) */
    if (E->eh) {
        const int64_t *map = E->e.model->engram_token_map;
        for (int i = 0; i < rq->n_tokens && rq->start_pos + i < st->len; i++) {
            int32_t tk = rq->tokens[i];
            if (tk < 0 || tk >= E->cfg->vocab_size) break; /* reported by the forward */
            int64_t v = map ? map[tk] : tk;
            if (v != st->etok[rq->start_pos + i])
                return v41_err_set(err, V41_EINVAL,
                                   "forward: request %d replays position %d with token %d, not the cached prefix's",
                                   rq->id, rq->start_pos + i, tk);
        }
    }
    return V41_OK;
}

int v41_srv_plan(ref_engine *E, fwd *F, v41_err *err)
{
    const v41_config *c = E->cfg;
    const int W = c->window_size;
    F->cut = -1;
    F->kept = NULL;
    if (!E->e.opts.replay) return V41_OK;
    F->kept = malloc((size_t)(F->T > 0 ? F->T : 1));
    if (!F->kept) return v41_err_set(err, V41_ENOMEM, "out of memory");
    memset(F->kept, 1, (size_t)F->T);
    const int cut = v41_last_kv_source(c);
    if (cut < 0 || W <= 0) return V41_OK;
    bool any = false;
    for (int q = 0; q < F->nr; q++) {
        fwd_req *R = &F->R[q];
        const v41_req *rq = R->q;
        bool decode = R->n == 1 && R->start > 0;
        R->trim = !rq->prompt_logprobs && !rq->all_logits && !rq->verify && !decode && R->n > W;
        if (!R->trim) continue;
        R->kv_start = R->E - W > R->floor_ ? R->E - W : R->floor_;
        memset(F->kept + R->r0, 0, (size_t)(R->n - W));
        any = true;
    }
    if (any) F->cut = cut;
    return V41_OK;
}

int v41_srv_compact(ref_engine *E, fwd *F, int l, float *rows, int64_t width, v41_err *err)
{
    const int W = E->cfg->window_size, T = F->T, nr = F->nr;
    int Tk = 0;
    for (int t = 0; t < T; t++) Tk += F->kept[t] != 0;
    int *map = malloc(sizeof(int) * (size_t)(Tk ? Tk : 1));
    fwd_req *R2 = malloc(sizeof(fwd_req) * (size_t)nr);
    int *rr = malloc(sizeof(int) * (size_t)(Tk ? Tk : 1)), *rp = malloc(sizeof(int) * (size_t)(Tk ? Tk : 1));
    int32_t *tk2 = F->topk && F->kmax > 0 ? malloc(sizeof(int32_t) * (size_t)(Tk ? Tk : 1) * F->kmax) : NULL;
    uint8_t *cd2 = F->cand && F->cmax > 0 ? malloc((size_t)(Tk ? Tk : 1) * F->cmax) : NULL;
    if (!map || !R2 || !rr || !rp || (F->topk && F->kmax > 0 && !tk2) || (F->cand && F->cmax > 0 && !cd2)) {
        free(map); free(R2); free(rr); free(rp); free(tk2); free(cd2);
        return v41_err_set(err, V41_ENOMEM, "out of memory");
    }
    int k = 0;
    for (int q = 0; q < nr; q++) {
        const fwd_req *R = &F->R[q];
        int nk = R->trim ? W : R->n;
        R2[q] = *R;
        R2[q].r0 = k;
        R2[q].n = nk;
        R2[q].start = R->E - nk;
        for (int i = R->n - nk; i < R->n; i++) {
            map[k] = R->r0 + i;
            rr[k] = q;
            rp[k] = R->start + i;
            k++;
        }
    }
    /* the top-k / candidate rows published by the index sources are keyed by row:
     * realign them (fault injection: the compacted row i reads full row i) */
    const int f = INJ_REPLAY_ROWS_MISALIGNED;
    const bool mis = E->inj[f][V41_MAX_LAYERS] && E->inj[f][l];
    for (int i = 0; i < Tk; i++) {
        int src = mis ? i : map[i];
        if (tk2) memcpy(tk2 + (size_t)i * F->kmax, F->topk + (size_t)src * F->kmax, sizeof(int32_t) * F->kmax);
        if (cd2) memcpy(cd2 + (size_t)i * F->cmax, F->cand + (size_t)src * F->cmax, (size_t)F->cmax);
    }
    if (tk2) { free(F->topk); F->topk = tk2; }
    if (cd2) { free(F->cand); F->cand = cd2; }
    F->R_full = F->R;
    F->row_req_full = F->row_req;
    F->row_pos_full = F->row_pos;
    F->T_full = T;
    F->R = R2;
    F->row_req = rr;
    F->row_pos = rp;
    F->T = Tk;
    F->full_row = map;
    F->just_cut = true;
    E->srv_map = map;
    E->srv_T = T;
    E->srv_Tk = Tk;
    if (rows) v41_srv_gather(F, rows, width);
    return V41_OK;
}

void v41_srv_gather(const fwd *F, float *buf, int64_t width)
{
    if (!F->full_row) return;
    for (int i = 0; i < F->T; i++) /* full_row[i] >= i, ascending: in place is safe */
        if (F->full_row[i] != i)
            memmove(buf + (size_t)i * width, buf + (size_t)F->full_row[i] * width, sizeof(float) * (size_t)width);
}

static void scatter_back(const fwd *F, float *buf, int64_t width)
{
    for (int i = F->T - 1; i >= 0; i--) /* descending: sources below i are not overwritten */
        if (F->full_row[i] != i)
            memmove(buf + (size_t)F->full_row[i] * width, buf + (size_t)i * width, sizeof(float) * (size_t)width);
    for (int t = 0; t < F->T_full; t++)
        if (!F->kept[t]) memset(buf + (size_t)t * width, 0, sizeof(float) * (size_t)width);
}

static void restore_full(ref_engine *E, fwd *F)
{
    free(F->R);
    free(F->row_req);
    free(F->row_pos);
    free(F->full_row);
    F->R = F->R_full;
    F->row_req = F->row_req_full;
    F->row_pos = F->row_pos_full;
    F->T = F->T_full;
    F->R_full = NULL;
    F->row_req_full = F->row_pos_full = NULL;
    F->full_row = NULL;
    F->just_cut = false;
    E->srv_map = NULL;
    E->srv_T = E->srv_Tk = 0;
}

int v41_srv_expand(ref_engine *E, fwd *F, float *X, float *premix, v41_err *err)
{
    (void)err;
    if (!F->full_row) return V41_OK;
    const int64_t hc = E->cfg->hc_mult, hD = hc * E->cfg->dim;
    scatter_back(F, X, hD);
    scatter_back(F, premix, hc);
    restore_full(E, F);
    return V41_OK;
}

void v41_srv_free(ref_engine *E, fwd *F)
{
    if (F->full_row) restore_full(E, F);
    free(F->kept);
    F->kept = NULL;
    E->srv_map = NULL;
}

/* a tap or forcing point with one entry per row of the forward: dims "[T" then ',' or ']' */
static bool row_dims(const char *name)
{
    const v41_tap_desc *d = v41_tap_lookup(name);
    return d && d->dims && d->dims[0] == '[' && d->dims[1] == 'T' && (d->dims[2] == ',' || d->dims[2] == ']');
}

static size_t row_bytes(v41_tap_kind kind, int ndim, const int64_t *shape)
{
    size_t n = kind == V41_TAP_U8 ? 1 : 4; /* F32/BF16 are floats, I32 4 bytes */
    for (int i = 1; i < ndim; i++) n *= (size_t)shape[i];
    return n;
}

int v41_srv_tap_scatter(ref_engine *E, v41_tap *t, void **buf)
{
    *buf = NULL;
    if (!E->srv_map || t->ndim < 1 || t->shape[0] != E->srv_Tk || !row_dims(t->name)) return 0;
    size_t rb = row_bytes(t->kind, t->ndim, t->shape);
    unsigned char *b = calloc((size_t)E->srv_T * rb + 1, 1);
    if (!b) return -1;
    for (int i = 0; i < E->srv_Tk; i++) memcpy(b + (size_t)E->srv_map[i] * rb, (const unsigned char *)t->data + (size_t)i * rb, rb);
    t->data = b;
    t->shape[0] = E->srv_T;
    *buf = b;
    return 0;
}

int v41_srv_force_fetch(ref_engine *E, v41_tap_source *f, const char *name, v41_tap_kind kind, int ndim,
                        const int64_t *shape, void *dst)
{
    if (!E->srv_map || ndim < 1 || shape[0] != E->srv_Tk || !row_dims(name))
        return f->fetch(f->ctx, name, E->tap_step, kind, ndim, shape, dst);
    size_t rb = row_bytes(kind, ndim, shape);
    unsigned char *b = calloc((size_t)E->srv_T * rb + 1, 1);
    if (!b) return -1;
    for (int i = 0; i < E->srv_Tk; i++) memcpy(b + (size_t)E->srv_map[i] * rb, (unsigned char *)dst + (size_t)i * rb, rb);
    int64_t sh[8];
    for (int i = 0; i < ndim && i < 8; i++) sh[i] = shape[i];
    sh[0] = E->srv_T;
    int r = f->fetch(f->ctx, name, E->tap_step, kind, ndim, sh, b);
    if (r == 1)
        for (int i = 0; i < E->srv_Tk; i++) memcpy((unsigned char *)dst + (size_t)i * rb, b + (size_t)E->srv_map[i] * rb, rb);
    free(b);
    return r;
}

int v41_srv_default_align(const ref_engine *E)
{
    const long a = v41_env_long("V41_DSPARK_ALIGN", 0);
    if (a) return (int)a;
    return E->inj[INJ_DSPARK_PADDING_COUNTED][V41_MAX_LAYERS] ? 64 : 0;
}
