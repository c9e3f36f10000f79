/* engine_impl.h: private structures of the CPU reference engine (ref/engine*.c). */
#ifndef V41_ENGINE_IMPL_H
#define V41_ENGINE_IMPL_H

#include "v41_engine.h"
#include "v41_ops.h"
#include "v41_engram.h"

typedef struct expert_w { v41_lin w1, w2, w3; } expert_w;

typedef struct layer_w {
    int id, stage;                 /* stage = id - n_layers for DSpark stages, else -1 */
    int ratio, ks, is;             /* compress ratio, kv source of, index source of */
    bool kv_src, idx_src, cand_src, cand_use;
    int eidx;                      /* engram index or -1 */
    int n_exp, n_act;
    v41_lin hc_attn_fn, hc_ffn_fn;
    float *hc_attn_base, *hc_ffn_base, hc_attn_scale[3], hc_ffn_scale[3];
    float *attn_norm, *ffn_norm, *q_norm, *kv_norm, *sink;
    v41_lin wq_a, wq_b, wkv, wo_a, wo_b;
    float *c_norm;
    v41_lin c_wkv, c_wgate;
    v41_lin i_wq_b, i_wproj, i_wk;
    float *i_knorm;
    v41_lin gate;
    float *gate_bias;
    expert_w *ex, sh;
    const v41_tensor *eg_emb, *eg_sc;
    v41_lin eg_wkv;
    float *eg_w;                   /* q_weight * k_weight, fp32 [hc, D] */
    v41_lin main_proj;             /* DSpark stage 0 */
    float *main_norm;
    float *fnorm;                  /* DSpark last stage */
    const v41_tensor *mk_embed;
    v41_lin mk_head, conf;
    v41_rope rope;
} layer_w;

typedef struct req_state {
    int id;
    bool used;
    int len;                       /* positions cached (next position) */
    int64_t *etok;                 /* compressed token ids [max_seq] (engram) */
    float **win;                   /* [L] window KV per position [max_seq, d] */
    float **ckv, **ik;             /* [L] kv sources: compressed KV [max_seq/m, d], index keys [.., dI] */
    float **kvh, **sch;            /* [L] ratio>1 kv sources: fp32 kv / score per position [max_seq, d] */
    float **kvst, **scst;          /* [L] official-layout partial-group state [m, d] */
    int ik_owner;                  /* --compat official: layer whose index keys were published last */
} req_state;

/* ---- forward context (shared by engine.c and engine_serving.c) */
typedef struct fwd_req {
    req_state *st;
    int r0, n, start, E;           /* first row, rows, start position, end position */
    int floor_;
    const v41_req *q;
    int hit;                       /* SPEC §7 encoder side: rows at positions < hit are replayed (cached
                                    * prefix): only their window KV is written; = start without a hit */
    bool trim;                     /* SPEC §7 decoder side: this request is trimmed after the cut */
    int kv_start;                  /* window floor of the layers after the cut (trimmed requests) */
} fwd_req;

typedef struct fwd {
    int T, nr;
    fwd_req *R;
    int *row_req, *row_pos;
    /* shared attention state of the current forward (SPEC §5-§6) */
    int32_t *topk;                 /* [T, kmax] compressed positions, -1 = none */
    int kmax;
    int *topk_k;                   /* per request: k */
    uint8_t *cand;                 /* [T, cmax] candidate mask of the candidate source */
    int cmax;
    bool cand_valid;
    /* SPEC §7 decoder-side trimming (engine_serving.c) */
    int cut;                       /* layer whose attention query starts the compacted view; -1 = none */
    uint8_t *kept;                 /* [T_full] 1 = row computed after the cut (NULL when replay is off) */
    int *full_row;                 /* compacted row -> full row; NULL while in the full view */
    bool just_cut;                 /* set by attention() at the cut; block() gathers its row buffers */
    int T_full;
    fwd_req *R_full;               /* the full view, saved while compacted */
    int *row_req_full, *row_pos_full;
} fwd;

enum {
    INJ_SINK_DROPPED = 0, INJ_ROPE_HALVES, INJ_SINKHORN_ROWS_LAST, INJ_COMPRESSED_EARLY, INJ_INDEXER_RELU_DROPPED,
    INJ_ROUTER_BIAS_IN_WEIGHTS, INJ_SWA_NOT_FLOORED, INJ_REPLAY_ROWS_MISALIGNED, INJ_DSPARK_PADDING_COUNTED,
    INJ_COUNT
};

typedef struct ref_engine {
    v41_engine e;
    const v41_config *cfg;
    bool emu;
    int threads;
    int max_seq;
    int nL;                        /* backbone + stages */
    layer_w *L;
    const v41_tensor *embed;
    v41_lin head;
    float *norm;
    v41_engram_hash *eh;
    int nslots;
    req_state *rs;
    unsigned char inj[INJ_COUNT][V41_MAX_LAYERS + 1]; /* [fault][layer], [..][V41_MAX_LAYERS] = any */
    int tap_order;
    int tap_step;
    /* compacted view of the current forward (SPEC §7 trimming): row taps and forcing points are
     * scattered to / gathered from srv_T full rows (zeros for trimmed rows); NULL = full view */
    const int *srv_map;
    int srv_T, srv_Tk;
    /* output buffers */
    float *out_logits;
    int32_t *out_argmax;
    int *out_rowoff;
} ref_engine;

#endif
