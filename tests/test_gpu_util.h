/* test_gpu_util.h: helpers of the GPU kernel suites (include after check.h and v41_gpu.h):
 * a xorshift generator (deterministic per seed), random host arrays, and device buffers
 * that fail the test when an allocation or copy fails. */
#ifndef V41_TEST_GPU_UTIL_H
#define V41_TEST_GPU_UTIL_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static uint64_t rng_state;
static inline void rng_seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }
static inline uint32_t rng_u32(void)
{
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static inline float rng_unit(void) { return (rng_u32() & 0xffffff) / 16777216.0f * 2.0f - 1.0f; }   /* [-1,1) */
static inline int rng_int(int n) { return n > 0 ? (int)(rng_u32() % (uint32_t)n) : 0; }              /* [0,n) */
static inline float *rand_f32(size_t n, float amp)
{
    float *x = malloc(4 * n + 4);
    for (size_t i = 0; i < n; i++) x[i] = amp * rng_unit();
    return x;
}
/* host -> new device buffer */
static inline void *up(const void *h, size_t n)
{
    void *d = v41g_malloc(n);
    ck_assert_ptr_nonnull(d);
    ck_assert_int_eq(v41g_h2d(d, h, n), 0);
    return d;
}
/* a device buffer of n bytes equal to `byte` */
static inline void *dfill(size_t n, int byte)
{
    void *d = v41g_malloc(n);
    ck_assert_ptr_nonnull(d);
    ck_assert_int_eq(v41g_memset(d, byte, n), 0);
    return d;
}
/* 0xFF bytes: bf16/f32 NaN, int -1, u8 0xff (an unwritten output fails its comparison) */
static inline void *dpoison(size_t n) { return dfill(n, 0xff); }
/* device -> new host buffer, after the device finished */
static inline void *down(const void *d, size_t n)
{
    void *h = malloc(n);
    ck_assert_int_eq(v41g_sync(), 0);
    ck_assert_int_eq(v41g_d2h(h, d, n), 0);
    return h;
}
/* |got - exp| <= atol + rtol |exp|; NaN/Inf positions must match (worst element reported) */
static inline void check_f32(const char *what, const float *got, const float *exp, size_t n, double atol, double rtol)
{
    size_t bad = 0, worst = 0;
    double wd = -1;
    for (size_t i = 0; i < n; i++) {
        double g = got[i], e = exp[i];
        if (isnan(e) || isinf(e) || isnan(g) || isinf(g)) {
            if (!(isnan(g) && isnan(e)) && g != e) { if (!bad++) worst = i; wd = INFINITY; }
            continue;
        }
        double d = fabs(g - e), lim = atol + rtol * fabs(e);
        if (d > lim) { bad++; if (d - lim > wd) { wd = d - lim; worst = i; } }
    }
    ck_assert_msg(bad == 0, "%s: %zu of %zu outside tolerance; worst at %zu: got %.9g want %.9g", what, bad, n, worst,
                  (double)got[worst], (double)exp[worst]);
}
#endif
