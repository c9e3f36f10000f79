// engine.cu: v41_gpu_engine_create (the v41_engine interface on CUDA).
//
// Status: the kernels of gpu/ (v41_gpu.h) are in place and tested; the engine
// that strings them into the forward pass (weight upload, device caches,
// taps, CUDA-graph decode) is not written yet. Until it is, creating a GPU
// engine fails cleanly with V41_EUNSUPPORTED and says why, so `v41 parity
// --b gpu` reports an error instead of crashing.
#include "g_internal.cuh"
#include "v41_engine.h"

extern "C" int v41_gpu_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out,
                                     v41_err *err)
{
    (void)m; (void)o;
    if (out) *out = NULL;
    if (v41g_device_count() <= 0)
        return v41_err_set(err, V41_EUNSUPPORTED, "gpu engine: no CUDA device is visible to this process");
    return v41_err_set(err, V41_EUNSUPPORTED,
                       "gpu engine: the CUDA forward pass is not implemented yet (kernels only: see docs/gpu.md)");
}
