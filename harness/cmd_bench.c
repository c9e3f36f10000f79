/* v41 bench ref|gpu: dispatch to the CPU or GPU benchmark. */
#include "v41_cli.h"
#include <string.h>

int v41_cmd_bench(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        printf("usage: v41 bench ref [OPTIONS]   CPU reference benchmark (v41 bench ref --help)\n"
               "       v41 bench gpu [OPTIONS]   CUDA engine benchmark on the GPU (v41 bench gpu --help)\n");
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "ref")) return v41_bench_ref(argc - 1, argv + 1);
    if (!strcmp(argv[1], "gpu")) return v41_bench_gpu(argc - 1, argv + 1);
    fprintf(stderr, "v41 bench: unknown target '%s' (ref or gpu)\n", argv[1]);
    return 2;
}
