/* v41 bench gpu: kernel and ceiling benchmarks of the CUDA path (gpu/bench.cu). */
#include "config.h"
#include "v41_cli.h"
#ifdef HAVE_CUDA
#include "v41_gpu.h"
#endif

int v41_bench_gpu(int argc, char **argv)
{
#ifdef HAVE_CUDA
    return v41g_bench_main(argc, argv);
#else
    (void)argc;
    fprintf(stderr, "v41 %s: this build has no CUDA support (reconfigure with --with-cuda=DIR on a machine "
            "with the CUDA toolkit)\n", argv[0]);
    return 2;
#endif
}
