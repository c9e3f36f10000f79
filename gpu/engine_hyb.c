/* engine_hyb.c: the orchestration of the GPU engine (first stage, see README.md, section 'GPU kernels'
 * "GPU engine"). The CPU reference orchestration (ref/engine.c) is compiled a
 * second time here with every Linear (v41_linear / v41_linear_ld), every
 * sparse-attention row (v41_sparse_attn_row), each request's indexer scores and
 * top-k (v41_indexer_scores_rows, v41_indexer_topk_rows), RMSNorm, RoPE and mHC pre/post
 * redirected to gpu/engine.cu, which runs them on the device (weights uploaded
 * once, dequantized to bf16; act_quant, cuBLAS GEMMs and the kernels of
 * gpu/v41_gpu.h). Caches, list building, compressor pooling, indexer scores and
 * top-k, candidate blocks, Sinkhorn, routing, Engram and DSpark control stay host
 * code for now.
 * ref/engine.c is not edited: its exported names are renamed below so the two
 * copies do not collide. */
#define v41_linear v41gh_linear
#define v41_linear_ld v41gh_linear_ld
#define v41_sparse_attn_row v41gh_sparse_attn_row
#define v41_indexer_scores_rows v41gh_indexer_scores_rows
#define v41_indexer_topk_rows v41gh_indexer_topk_rows
#define v41_rmsnorm v41gh_rmsnorm
#define v41_rope_apply v41gh_rope_apply
#define v41_hc_pre v41gh_hc_pre
#define v41_hc_post v41gh_hc_post
#define v41_engine_opts_default v41gh_engine_opts_default_unused
#define v41_ref_engine_create v41gh_ref_engine_create
#define v41_ref_dspark_draft_batch v41gh_ref_dspark_draft_batch
#include "../ref/engine.c"

/* The device hooks are driven from the calling thread only: the GPU engine runs
 * the orchestration's OpenMP loops on one thread and restores the caller's
 * setting afterwards (these two wrap omp_get/set_num_threads for engine.cu). */
int v41gh_omp_single(void)
{
#ifdef _OPENMP
    int n = omp_get_max_threads();
    omp_set_num_threads(1);
    return n;
#else
    return 1;
#endif
}
void v41gh_omp_restore(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}
/* ref_forward applies opts.threads itself: the GPU engine keeps it at 1. */
void v41gh_set_threads(v41_engine *e, int n) { ((ref_engine *)e)->threads = n; }
