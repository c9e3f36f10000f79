/* test_gpu_probe.h: the skip decision of the GPU test suites (include after v41_gpu.h).
 * It runs in a child so the parent, which forks the Check tests, never initialises CUDA
 * (a forked child of a CUDA process cannot use the device). */
#ifndef V41_TEST_GPU_PROBE_H
#define V41_TEST_GPU_PROBE_H
#include <sys/wait.h>
#include <unistd.h>

static inline int gpu_present(void)
{
    pid_t p = fork();
    if (p < 0) return 0;
    if (p == 0) _exit(v41g_device_count() > 0 ? 0 : 1);
    int st = 0;
    if (waitpid(p, &st, 0) < 0) return 0;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}
#endif
