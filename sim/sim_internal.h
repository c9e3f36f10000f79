/* sim_internal.h: helpers shared by the sim/ modules (not installed). */
#ifndef V41_SIM_INTERNAL_H
#define V41_SIM_INTERNAL_H

#include "v41_sim.h"
#include <math.h>
#include <stdint.h>

/* v41 serve-trace JSON -> empirical acceptance distribution (sim_out.c) */
int v41_accept_load(const char *path, v41_accept *a, v41_err *err);

/* xoshiro256** seeded through splitmix64: one generator per object, no globals. */
typedef struct v41_rng { uint64_t s[4]; } v41_rng;

static inline uint64_t v41_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static inline void v41_rng_seed(v41_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = v41_splitmix64(&seed);
}
static inline uint64_t v41_rng_u64(v41_rng *r)
{
    uint64_t *s = r->s;
    uint64_t res = ((s[1] * 5) << 7 | (s[1] * 5) >> 57) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t; s[3] = (s[3] << 45) | (s[3] >> 19);
    return res;
}
/* uniform in (0, 1): never 0, so log() is safe */
static inline double v41_rng_unif(v41_rng *r) { return ((double)(v41_rng_u64(r) >> 11) + 0.5) * 0x1.0p-53; }
static inline double v41_rng_normal(v41_rng *r)
{
    double u = v41_rng_unif(r), v = v41_rng_unif(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}
/* Gamma(k, 1) by Marsaglia-Tsang (k < 1 through the boost U^(1/k)). */
static inline double v41_rng_gamma(v41_rng *r, double k)
{
    if (k < 1.0) return v41_rng_gamma(r, k + 1.0) * pow(v41_rng_unif(r), 1.0 / k);
    double d = k - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = v41_rng_normal(r), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = v41_rng_unif(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v)) return d * v;
    }
}

#endif
