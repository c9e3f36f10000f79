// g_common.cu: device/memory helpers, deterministic fills, RoPE frequency table.
#include "g_internal.cuh"
#include <math.h>
#include <string.h>

extern "C" int v41g_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
    return n;
}

extern "C" int v41g_device_name(char *buf, size_t n)
{
    cudaDeviceProp p;
    G_CHECK(cudaGetDeviceProperties(&p, 0));
    snprintf(buf, n, "%s (sm_%d%d, %d SMs, %.0f MiB, L2 %d KiB)", p.name, p.major, p.minor,
             p.multiProcessorCount, p.totalGlobalMem / 1048576.0, p.l2CacheSize / 1024);
    return 0;
}

// per-device cache of one attribute (devices 0..15; others are queried at every call)
static int g_dev_attr(cudaDeviceAttr a, int *cache, int fallback)
{
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); return fallback; }
    if (dev >= 0 && dev < 16 && cache[dev] > 0) return cache[dev];
    if (cudaDeviceGetAttribute(&v, a, dev) != cudaSuccess || v <= 0) { cudaGetLastError(); return fallback; }
    if (dev >= 0 && dev < 16) cache[dev] = v;
    return v;
}
int g_num_sms(void)
{
    static int cache[16];
    return g_dev_attr(cudaDevAttrMultiProcessorCount, cache, 132);
}
int g_cc_major(void)
{
    static int cache[16];
    return g_dev_attr(cudaDevAttrComputeCapabilityMajor, cache, 0);
}
bool g_pdl_ok(void) { return g_cc_major() >= 9 && !g_env_flag("V41_NO_PDL"); }
int g_smem_optin(void)
{
    static int cache[16];
    return g_dev_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, cache, 48 * 1024);
}

extern "C" const char *v41g_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

extern "C" void *v41g_malloc(size_t nbytes)
{
    void *p = NULL;
    if (cudaMalloc(&p, nbytes ? nbytes : 1) != cudaSuccess) { cudaGetLastError(); return NULL; }
    return p;
}
extern "C" void v41g_free(void *p) { if (p) cudaFree(p); }
extern "C" int v41g_h2d(void *d, const void *s, size_t n) { G_CHECK(cudaMemcpy(d, s, n, cudaMemcpyHostToDevice)); return 0; }
extern "C" int v41g_d2h(void *d, const void *s, size_t n) { G_CHECK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost)); return 0; }
extern "C" int v41g_memset(void *d, int b, size_t n) { G_CHECK(cudaMemset(d, b, n)); return 0; }
extern "C" int v41g_sync(void) { G_CHECK(cudaDeviceSynchronize()); return 0; }

// splitmix64 of (seed, i): a counter-based generator, so fills are reproducible
// whatever the launch shape.
__device__ __forceinline__ float g_hash_unit(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;   // [-1, 1)
}
__global__ void g_fill_bf16_kernel(uint16_t *x, size_t n, uint64_t seed, float amp)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = g_f2bf(amp * g_hash_unit(seed, i));
}
__global__ void g_fill_f32_kernel(float *x, size_t n, uint64_t seed, float amp)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = amp * g_hash_unit(seed, i);
}
extern "C" int v41g_fill_bf16(uint16_t *x, size_t n, uint64_t seed, float amp, v41g_stream s)
{
    g_fill_bf16_kernel<<<4096, 256, 0, G_STREAM(s)>>>(x, n, seed, amp);
    G_LAUNCHED();
    return 0;
}
extern "C" int v41g_fill_f32(float *x, size_t n, uint64_t seed, float amp, v41g_stream s)
{
    g_fill_f32_kernel<<<4096, 256, 0, G_STREAM(s)>>>(x, n, seed, amp);
    G_LAUNCHED();
    return 0;
}

// SPEC §4: f_j = 1/fp32pow(theta, 2j/r); YaRN ramp computed in double, blend in fp32.
extern "C" void v41g_rope_freqs(int r, double theta, int orig, double factor, double beta_fast,
                                double beta_slow, float *out)
{
    for (int j = 0; j < r / 2; j++)
        out[j] = 1.0f / powf((float)theta, (float)(2 * j) / (float)r);
    if (orig <= 0) return;
    double cf = r * log(orig / (2 * M_PI * beta_fast)) / (2 * log(theta));
    double cs = r * log(orig / (2 * M_PI * beta_slow)) / (2 * log(theta));
    double low = fmax(floor(cf), 0.0), high = fmin(ceil(cs), (double)(r - 1));
    for (int j = 0; j < r / 2; j++) {
        float ramp = (float)((j - low) / fmax(high - low, 1e-3));
        ramp = fminf(fmaxf(ramp, 0.0f), 1.0f);
        float smooth = 1.0f - ramp;
        out[j] = (out[j] / (float)factor) * (1.0f - smooth) + out[j] * smooth;
    }
}
