// engine_gpu.h: the private interface between gpu/engine.cu (the hybrid engine:
// the reference orchestration with device hooks) and gpu/engine_dev.cu (the
// device-resident decode step). Not installed.
#pragma once
#include "v41_engine.h"
#include "v41_ops.h"
#include "v41_gpu.h"
#include <stdint.h>
#include <string.h>
#include <vector>

// fp32 <-> bf16 bits of the host side (values the device keeps as bf16): is f a bf16 value,
// its top 16 bits, and back.
static inline bool bf_exact(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0xffffu) == 0;
}
static inline uint16_t bf_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static inline float bf_val(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct gd_ctx;

// A Linear's weight packed in its storage format for v41g_wq (host side): the codes of rows
// row0..row0+N and the e8m0 scale rows they use. gh_pack_host returns false (out untouched)
// when the checkpoint's format does not fit the kernels: not an fp8/fp4 weight, row-wise fp8
// scales, fp32/bf16 scales that are not powers of two, or scales outside the range where
// every dequantized value is a normal bf16 (fp8: e in [10, 134]; fp4: e in [2, 254]).
struct gh_wq_host {
    int fmt = 0, r0 = 0;   // V41G_WQ_FP8 / V41G_WQ_FP4; fp8: first row's offset in its 32-row block
    std::vector<uint8_t> codes, scales;
};
bool gh_pack_host(const v41_lin *L, gh_wq_host *out);
// Upload the row-major codes of `groups` groups (group_bytes apart on the host) of an [N, K]
// fmt weight, tiled for v41g_wq (v41g_wq_tile), into one new device buffer (*out, cudaFree
// it), groups *stride bytes apart. Returns a CUDA error code (0 = success).
int gh_upload_tiled(int fmt, int N, int K, int groups, const uint8_t *codes, size_t group_bytes, uint8_t **out,
                    size_t *stride);

// engine.cu: the device copy of a Linear's weight (uploaded on first use, owned by the
// engine). With q != NULL, an fp8/fp4 Linear (kind Q) whose format fits gh_pack_host stays
// packed: q describes it (q->w != NULL) and *d is NULL. Otherwise *d holds bf16 bits when
// want_bf and the dequantized weight is bf16-exact, else fp32 (and q->w is NULL).
int gh_dev_weight(v41_engine *e, const v41_lin *L, bool want_bf, const void **d, bool *is_bf, v41g_wq *q,
                  v41_err *err);

// engine_dev.cu. gd_create: NULL result (and V41_OK) when the device path cannot serve
// this engine (fp32 precision, weights that are not bf16 values, shapes the kernels do
// not take); *why names the reason.
int gd_create(v41_engine *e, gd_ctx **out, const char **why, v41_err *err);
void gd_destroy(gd_ctx *g);
// A decode batch on the device: 1 = done (out filled as the reference forward fills it),
// 0 = not eligible (the caller runs the hybrid forward), < 0 = error (err set).
int gd_forward(gd_ctx *g, v41_engine *e, const v41_batch *b, v41_out *out, v41_err *err);
// Before any host-side use of the caches: copy every row the device holds ahead of the
// host back into the host caches. Returns V41_OK or an error.
int gd_to_host(gd_ctx *g, v41_engine *e, v41_err *err);
// After a host-side forward of these requests: the device rows from each request's
// start position on are stale.
void gd_host_wrote(gd_ctx *g, v41_engine *e, const v41_batch *b);
// After a host-side truncate of request id to pos.
void gd_host_truncated(gd_ctx *g, v41_engine *e, int req_id, int pos);
// Decode steps run on the device.
long gd_steps(const gd_ctx *g);
// Counters for V41_GPU_VERBOSE.
void gd_report(const gd_ctx *g);
