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
    /* output buffers */
    float *out_logits;
    int32_t *out_argmax;
    int *out_rowoff;
} ref_engine;

#endif
