/* engine_hyb.c: the orchestration of the GPU engine (first stage, see docs/gpu.md
 * "GPU engine"). The CPU reference orchestration (ref/engine.c) is compiled a
 * second time here with every Linear (v41_linear / v41_linear_ld) redirected
 * to gpu/engine.cu, which runs it on the device (weights uploaded once,
 * dequantized to bf16; act_quant and the GEMM on the device, cuBLAS). Caches,
 * attention, indexer, compressor, mHC, routing, Engram and DSpark control stay
 * host code for now. ref/engine.c is not edited: its exported names are
 * renamed below so the two copies do not collide. */
#define v41_linear v41gh_linear
#define v41_linear_ld v41gh_linear_ld
#define v41_engine_opts_default v41gh_engine_opts_default_unused
#define v41_ref_engine_create v41gh_ref_engine_create
#define v41_ref_dspark_draft_batch v41gh_ref_dspark_draft_batch
#include "../ref/engine.c"
