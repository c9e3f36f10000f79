/* nprng.c: bit-exact reproduction of the numpy pieces behind
 *   np.random.default_rng(seed).integers(low, high, n, dtype=np.int64)
 * as used by DeepSeek's engram.py for the hash multipliers (SPEC.md §8).
 *
 * The chain (numpy >= 1.17 Generator API; unchanged through numpy 2.x):
 *   1. SeedSequence(seed): the integer is split into little-endian uint32 words
 *      (0 -> one word 0), hashed into a 4-word pool (O'Neill's seed_seq variant).
 *   2. PCG64: generate_state(4, uint64) -> s[0..3]; seed = s[0]:s[1] (high:low),
 *      stream = s[2]:s[3]; PCG "srandom": state 0, inc = stream*2+1, step,
 *      state += seed, step. Output: XSL-RR of the stepped state.
 *   3. Generator.integers: closed range [low, high-1], rng = high-1-low; Lemire's
 *      multiply-shift rejection (never the masked method), on 32-bit draws when
 *      rng < 2^32-1, on 64-bit draws otherwise.
 * Written from the description of numpy's algorithms (bit_generator.pyx,
 * pcg64.h, distributions.c); see README.md, section 'Engram hashing'. */
#include "v41_engram.h"

#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "ref/nprng.c needs a compiler with unsigned __int128 (GCC or clang on a 64-bit target)"
#endif
__extension__ typedef unsigned __int128 u128;

/* ---- SeedSequence ---- */

#define SS_POOL 4u
#define SS_INIT_A 0x43b0d7e5u
#define SS_MULT_A 0x931e8875u
#define SS_INIT_B 0x8b51f9ddu
#define SS_MULT_B 0x58f38dedu
#define SS_MIX_L 0xca01f9ddu
#define SS_MIX_R 0x4973f715u
#define SS_XSHIFT 16u

/* Hash one word with the running multiplier hc (updated in place). */
static uint32_t ss_hash(uint32_t v, uint32_t *hc)
{
    v ^= *hc;
    *hc *= SS_MULT_A;
    v *= *hc;
    return v ^ (v >> SS_XSHIFT);
}

static uint32_t ss_mix(uint32_t x, uint32_t y)
{
    uint32_t r = SS_MIX_L * x - SS_MIX_R * y;
    return r ^ (r >> SS_XSHIFT);
}

/* Pool of SeedSequence(seed) (no spawn key, pool size 4). */
static void ss_pool(uint64_t seed, uint32_t pool[SS_POOL])
{
    uint32_t ent[2];
    size_t nent = 0;
    if (seed == 0) {
        ent[nent++] = 0;
    } else {
        while (seed) {                 /* lowest word first, no leading zero words */
            ent[nent++] = (uint32_t)seed;
            seed >>= 32;
        }
    }
    uint32_t hc = SS_INIT_A;
    for (size_t i = 0; i < SS_POOL; i++)
        pool[i] = ss_hash(i < nent ? ent[i] : 0u, &hc);
    for (size_t s = 0; s < SS_POOL; s++)
        for (size_t d = 0; d < SS_POOL; d++)
            if (s != d)
                pool[d] = ss_mix(pool[d], ss_hash(pool[s], &hc));
    /* entropy words beyond the pool size: none (at most 2 words for a uint64 seed) */
}

void v41_np_seedseq_generate_state(uint64_t seed, size_t n_words, uint32_t *out)
{
    uint32_t pool[SS_POOL];
    ss_pool(seed, pool);
    uint32_t hc = SS_INIT_B;
    for (size_t i = 0; i < n_words; i++) {
        uint32_t v = pool[i % SS_POOL];
        v ^= hc;
        hc *= SS_MULT_B;
        v *= hc;
        out[i] = v ^ (v >> SS_XSHIFT);
    }
}

/* ---- PCG64 (XSL-RR 128/64) ---- */

/* PCG's default 128-bit LCG multiplier. */
#define PCG_MULT_HI 2549297995355413924ULL
#define PCG_MULT_LO 4865540595714422341ULL

static u128 mk128(uint64_t hi, uint64_t lo) { return ((u128)hi << 64) | lo; }

static void pcg_store(v41_np_pcg64 *g, u128 state)
{
    g->state_hi = (uint64_t)(state >> 64);
    g->state_lo = (uint64_t)state;
}

static u128 pcg_step(u128 state, u128 inc)
{
    return state * mk128(PCG_MULT_HI, PCG_MULT_LO) + inc;
}

void v41_np_pcg64_seed(v41_np_pcg64 *g, uint64_t seed)
{
    uint32_t w[8];
    v41_np_seedseq_generate_state(seed, 8, w);
    uint64_t s[4];                       /* generate_state(4, uint64): little-endian word pairs */
    for (int i = 0; i < 4; i++)
        s[i] = (uint64_t)w[2 * i] | ((uint64_t)w[2 * i + 1] << 32);
    u128 initstate = mk128(s[0], s[1]);
    u128 initseq = mk128(s[2], s[3]);
    u128 inc = (initseq << 1) | 1u;
    u128 state = pcg_step(0, inc);
    state = pcg_step(state + initstate, inc);
    pcg_store(g, state);
    g->inc_hi = (uint64_t)(inc >> 64);
    g->inc_lo = (uint64_t)inc;
    g->has_uint32 = 0;
    g->uinteger = 0;
}

uint64_t v41_np_pcg64_next64(v41_np_pcg64 *g)
{
    u128 state = pcg_step(mk128(g->state_hi, g->state_lo), mk128(g->inc_hi, g->inc_lo));
    pcg_store(g, state);
    uint64_t x = g->state_hi ^ g->state_lo;
    unsigned rot = (unsigned)(g->state_hi >> 58);   /* top 6 bits of the 128-bit state */
    return (x >> rot) | (x << ((64u - rot) & 63u));
}

uint32_t v41_np_pcg64_next32(v41_np_pcg64 *g)
{
    if (g->has_uint32) {
        g->has_uint32 = 0;
        return g->uinteger;
    }
    uint64_t x = v41_np_pcg64_next64(g);
    g->has_uint32 = 1;
    g->uinteger = (uint32_t)(x >> 32);
    return (uint32_t)x;
}

/* ---- bounded integers (Lemire) ---- */

/* Uniform in [0, rng], rng < 2^32 - 1, from 32-bit draws. */
static uint32_t lemire32(v41_np_pcg64 *g, uint32_t rng)
{
    const uint32_t excl = rng + 1u;
    uint64_t m = (uint64_t)v41_np_pcg64_next32(g) * excl;
    uint32_t left = (uint32_t)m;
    if (left < excl) {
        const uint32_t thresh = (uint32_t)(UINT32_MAX - rng) % excl;
        while (left < thresh) {
            m = (uint64_t)v41_np_pcg64_next32(g) * excl;
            left = (uint32_t)m;
        }
    }
    return (uint32_t)(m >> 32);
}

/* Uniform in [0, rng], rng < 2^64 - 1, from 64-bit draws. */
static uint64_t lemire64(v41_np_pcg64 *g, uint64_t rng)
{
    const uint64_t excl = rng + 1u;
    u128 m = (u128)v41_np_pcg64_next64(g) * excl;
    uint64_t left = (uint64_t)m;
    if (left < excl) {
        const uint64_t thresh = (UINT64_MAX - rng) % excl;
        while (left < thresh) {
            m = (u128)v41_np_pcg64_next64(g) * excl;
            left = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

void v41_np_bounded_u64_fill(v41_np_pcg64 *g, uint64_t off, uint64_t rng, size_t n, uint64_t *out)
{
    if (rng == 0) {
        for (size_t i = 0; i < n; i++)
            out[i] = off;
    } else if (rng == 0xFFFFFFFFu) {     /* full 32-bit range: raw 32-bit draws */
        for (size_t i = 0; i < n; i++)
            out[i] = off + v41_np_pcg64_next32(g);
    } else if (rng < 0xFFFFFFFFu) {
        for (size_t i = 0; i < n; i++)
            out[i] = off + lemire32(g, (uint32_t)rng);
    } else if (rng == UINT64_MAX) {      /* full 64-bit range: raw 64-bit draws */
        for (size_t i = 0; i < n; i++)
            out[i] = off + v41_np_pcg64_next64(g);
    } else {
        for (size_t i = 0; i < n; i++)
            out[i] = off + lemire64(g, rng);
    }
}

void v41_np_integers_i64(uint64_t seed, int64_t low, int64_t high, size_t n, int64_t *out)
{
    if (n == 0)
        return;
    if (high <= low) {                   /* numpy raises ValueError; documented fallback */
        for (size_t i = 0; i < n; i++)
            out[i] = low;
        return;
    }
    v41_np_pcg64 g;
    v41_np_pcg64_seed(&g, seed);
    /* closed range [low, high-1]; the difference fits in uint64 whatever the signs */
    uint64_t rng = (uint64_t)(high - 1) - (uint64_t)low;
    uint64_t off = (uint64_t)low;
    /* uint64 and int64 have the same size and representation: fill in place */
    uint64_t *u = (uint64_t *)(void *)out;
    v41_np_bounded_u64_fill(&g, off, rng, n, u);
}
