/* v41_engram.h: Engram n-gram hashing (SPEC.md §8), bit-exact with DeepSeek's
 * inference/engram.py, and the piece of numpy's random module it needs
 * (np.random.default_rng(seed).integers(low, high, n, dtype=np.int64)).
 *
 * Everything here is pure and thread-safe: the hash object is read-only after
 * v41_engram_hash_init. See README.md, section 'Engram hashing'. */
#ifndef V41_ENGRAM_H
#define V41_ENGRAM_H

#include "v41_common.h"
#include "v41_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- numpy reproduction (ref/nprng.c) ---- */

/* numpy: np.random.default_rng(seed).integers(low, high, n, dtype=np.int64):
 * SeedSequence(seed) -> PCG64 -> Generator.integers (Lemire's method, high exclusive).
 * Precondition low < high (numpy raises otherwise; here out is then filled with low). */
void v41_np_integers_i64(uint64_t seed, int64_t low, int64_t high, size_t n, int64_t *out);

/* SeedSequence(seed).generate_state(n_words, np.uint32) (pool size 4, no spawn key). */
void v41_np_seedseq_generate_state(uint64_t seed, size_t n_words, uint32_t *out);

/* numpy's PCG64 bit generator (XSL-RR 128/64), including its 32-bit half buffer.
 * The 128-bit state and increment are kept as high/low 64-bit halves, the way
 * PCG64().state reports them (state = state_hi * 2^64 + state_lo). */
typedef struct v41_np_pcg64 {
    uint64_t state_hi, state_lo, inc_hi, inc_lo;
    int has_uint32;
    uint32_t uinteger;
} v41_np_pcg64;
/* np.random.PCG64(seed): seeded through SeedSequence(seed). */
void v41_np_pcg64_seed(v41_np_pcg64 *g, uint64_t seed);
uint64_t v41_np_pcg64_next64(v41_np_pcg64 *g);   /* = random_raw() */
uint32_t v41_np_pcg64_next32(v41_np_pcg64 *g);   /* low half first, then the buffered high half */
/* Generator.integers core: n values in the CLOSED range [off, off + rng] (unsigned, wrapping),
 * exactly numpy's random_bounded_uint64_fill with use_masked = false. */
void v41_np_bounded_u64_fill(v41_np_pcg64 *g, uint64_t off, uint64_t rng, size_t n, uint64_t *out);

/* ---- Engram hashing (ref/engram_hash.c) ---- */

typedef struct v41_engram_hash v41_engram_hash;

#define V41_ENGRAM_MAX_NGRAM 64   /* largest engram_max_ngram_size accepted */

/* Builds multipliers, primes and offsets for every layer in cfg->engram_layer_ids.
 * Errors (V41_EINVAL, message naming the config key): max_ngram < 2, heads < 1,
 * compressed vocab < 1, vocab < 1, max_ngram > V41_ENGRAM_MAX_NGRAM, negative layer id, or primes whose sum exceeds
 * engram_num_embeddings[e] (when that is > 0). A config with no engram layers is valid. */
int  v41_engram_hash_init(const v41_config *cfg, v41_engram_hash **out, v41_err *err);
void v41_engram_hash_free(v41_engram_hash *h);
int  v41_engram_hash_width(const v41_engram_hash *h);      /* (max_ngram-1) * engram_n_heads */
int  v41_engram_hash_n_layers(const v41_engram_hash *h);   /* = cfg->n_engram_layers */
int  v41_engram_hash_max_ngram(const v41_engram_hash *h);  /* = cfg->engram_max_ngram_size */

/* Table rows for one engram layer (index e into cfg->engram_layer_ids) at one position.
 * back[i] = compressed token id i positions back (back[0] = current token), for i = 0..max_ngram-1;
 * callers pass the compressed pad id for look-backs before the sequence start.
 * out: width ids, (size n = 2..N, head k) order, offsets included. */
void v41_engram_hash_row(const v41_engram_hash *h, int e, const int64_t *back, int64_t *out);

/* Convenience: the row at position pos of a sequence whose compressed ids are hist[0..pos]
 * (hist[p] = token_map[token at p]). As engram.py's NgramHashState: look-backs before
 * position 0 read pad, and so does every look-back at or beyond a V41_ENGRAM_DEAD entry
 * (a token that takes no part in n-grams, e.g. an image span). */
#define V41_ENGRAM_DEAD (-1)
void v41_engram_hash_at(const v41_engram_hash *h, int e, const int64_t *hist, int64_t pos,
                        int64_t pad, int64_t *out);

const int64_t *v41_engram_multipliers(const v41_engram_hash *h, int e); /* [max_ngram] */
const int64_t *v41_engram_primes(const v41_engram_hash *h, int e);      /* [(N-1)*heads] */
const int64_t *v41_engram_offsets(const v41_engram_hash *h, int e);     /* [(N-1)*heads], exclusive prefix sum */
/* Rows the layer's table needs: sum of its primes (= offsets[last] + primes[last]). */
int64_t v41_engram_table_rows(const v41_engram_hash *h, int e);

/* Deterministic primality test for any 64-bit value (Miller-Rabin, fixed bases). */
bool v41_is_prime_u64(uint64_t n);

#ifdef __cplusplus
}
#endif
#endif
