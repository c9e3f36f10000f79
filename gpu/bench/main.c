/* v41_gpu_bench: the `v41 bench gpu` benchmark without the harness (builds
 * even while other components are mid-edit). Same options. */
#include "v41_gpu.h"

int main(int argc, char **argv) { return v41g_bench_main(argc, argv); }
