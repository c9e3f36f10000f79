/* v41_gpu_bench: the `v41 bench gpu` benchmark without the harness (builds
 * even while other components are mid-edit). Same options. Checks the V41_* variables
 * first, as `v41` does (ref/v41_env.h). */
#include "v41_gpu.h"
#include "v41_env.h"

int main(int argc, char **argv) { return v41_env_check() ? 2 : v41g_bench_main(argc, argv); }
