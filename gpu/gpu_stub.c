/* gpu_stub.c: the GPU engine entry point of a build without CUDA. */
#include "v41_engine.h"

int v41_gpu_engine_create(const v41_model *m, const v41_engine_opts *o, v41_engine **out, v41_err *err)
{
    (void)m; (void)o;
    if (out) *out = NULL;
    return v41_err_set(err, V41_EUNSUPPORTED,
                       "gpu engine: this build has no CUDA support (reconfigure with --with-cuda=DIR)");
}

long v41_gpu_engine_resident_steps(const v41_engine *e)
{
    (void)e;
    return 0;
}
