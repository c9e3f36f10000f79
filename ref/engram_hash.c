/* engram_hash.c: Engram n-gram hash ids (SPEC.md §8), bit-exact with
 * DeepSeek's inference/engram.py (compute_hash_multipliers, EngramLayout
 * primes, NgramHashState.forward). See README.md, section 'Engram hashing'. */
#include "v41_engram.h"

#include <stdlib.h>
#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "ref/engram_hash.c needs a compiler with unsigned __int128 (GCC or clang on a 64-bit target)"
#endif
__extension__ typedef unsigned __int128 u128;

struct v41_engram_hash {
    int n_layers;        /* engram layers */
    int max_ngram;       /* N */
    int heads;
    int width;           /* (N-1) * heads */
    int64_t *mult;       /* [n_layers][N] */
    int64_t *primes;     /* [n_layers][width], (size, head) order */
    int64_t *offsets;    /* [n_layers][width], exclusive prefix sum of primes per layer */
};

/* ---- primality ---- */

static uint64_t mulmod(uint64_t a, uint64_t b, uint64_t m) { return (uint64_t)((u128)a * b % m); }

static uint64_t powmod(uint64_t a, uint64_t e, uint64_t m)
{
    uint64_t r = 1 % m;
    a %= m;
    while (e) {
        if (e & 1u)
            r = mulmod(r, a, m);
        a = mulmod(a, a, m);
        e >>= 1;
    }
    return r;
}

bool v41_is_prime_u64(uint64_t n)
{
    static const uint64_t small[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
    if (n < 2)
        return false;
    for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
        if (n == small[i])
            return true;
        if (n % small[i] == 0)
            return false;
    }
    uint64_t d = n - 1;
    int s = 0;
    while ((d & 1u) == 0) {
        d >>= 1;
        s++;
    }
    /* these 12 bases make Miller-Rabin deterministic for every n < 2^64 */
    for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
        uint64_t x = powmod(small[i], d, n);
        if (x == 1 || x == n - 1)
            continue;
        bool composite = true;
        for (int r = 1; r < s; r++) {
            x = mulmod(x, x, n);
            if (x == n - 1) {
                composite = false;
                break;
            }
        }
        if (composite)
            return false;
    }
    return true;
}

/* engram.py find_next_prime: the smallest prime > start not handed out yet. */
static int64_t next_unused_prime(int64_t start, const int64_t *seen, size_t n_seen)
{
    for (int64_t c = start + 1;; c++) {
        if (c < 2 || !v41_is_prime_u64((uint64_t)c))
            continue;
        bool used = false;
        for (size_t i = 0; i < n_seen && !used; i++)
            used = seen[i] == c;
        if (!used)
            return c;
    }
}

/* ---- init ---- */

void v41_engram_hash_free(v41_engram_hash *h)
{
    if (!h)
        return;
    free(h->mult);
    free(h->primes);
    free(h->offsets);
    free(h);
}

int v41_engram_hash_init(const v41_config *cfg, v41_engram_hash **out, v41_err *err)
{
    if (!out)
        return v41_err_set(err, V41_EINVAL, "engram: v41_engram_hash_init: out is NULL");
    *out = NULL;
    if (!cfg)
        return v41_err_set(err, V41_EINVAL, "engram: v41_engram_hash_init: config is NULL");
    const int L = cfg->n_engram_layers;
    if (L < 0 || L > V41_MAX_LIST)
        return v41_err_set(err, V41_EINVAL, "engram: engram_layer_ids: %d entries (allowed 0..%d)",
                           L, V41_MAX_LIST);
    const int N = cfg->engram_max_ngram_size, H = cfg->engram_n_heads;
    if (L > 0) {
        if (N < 2 || N > V41_ENGRAM_MAX_NGRAM)
            return v41_err_set(err, V41_EINVAL,
                               "engram: engram_max_ngram_size = %d (allowed 2..%d: the smallest n-gram is a 2-gram)",
                               N, V41_ENGRAM_MAX_NGRAM);
        if (H < 1)
            return v41_err_set(err, V41_EINVAL, "engram: engram_n_heads = %d (must be >= 1)", H);
        if (cfg->engram_compressed_vocab_size < 1)
            return v41_err_set(err, V41_EINVAL, "engram: engram_compressed_vocab_size = %d (must be >= 1)",
                               cfg->engram_compressed_vocab_size);
        if (cfg->engram_vocab_size < 1)
            return v41_err_set(err, V41_EINVAL, "engram: engram_vocab_size = %lld (must be >= 1)",
                               (long long)cfg->engram_vocab_size);
        if ((int64_t)(N - 1) * H > 1 << 20)
            return v41_err_set(err, V41_EINVAL,
                               "engram: engram_max_ngram_size = %d x engram_n_heads = %d: too many hash columns", N, H);
        for (int e = 0; e < L; e++)
            if (cfg->engram_layer_ids[e] < 0)
                return v41_err_set(err, V41_EINVAL, "engram: engram_layer_ids[%d] = %d is negative",
                                   e, cfg->engram_layer_ids[e]);
    }

    v41_engram_hash *h = calloc(1, sizeof *h);
    if (!h)
        return v41_err_set(err, V41_ENOMEM, "engram: out of memory");
    h->n_layers = L;
    h->max_ngram = L > 0 ? N : 0;
    h->heads = L > 0 ? H : 0;
    h->width = L > 0 ? (N - 1) * H : 0;
    const size_t nl = L > 0 ? (size_t)L : 1u;
    h->mult = calloc(nl * (size_t)(h->max_ngram > 0 ? h->max_ngram : 1), sizeof(int64_t));
    h->primes = calloc(nl * (size_t)(h->width > 0 ? h->width : 1), sizeof(int64_t));
    h->offsets = calloc(nl * (size_t)(h->width > 0 ? h->width : 1), sizeof(int64_t));
    if (!h->mult || !h->primes || !h->offsets) {
        v41_engram_hash_free(h);
        return v41_err_set(err, V41_ENOMEM, "engram: out of memory");
    }

    /* multipliers: default_rng(10007*layer_id).integers(0, bound, N, int64) * 2 + 1,
     * bound = max(1, (INT64_MAX // compressed_vocab) // 2); values < bound keep 2v+1 in int64 */
    const int64_t bound = (L > 0 && (INT64_MAX / cfg->engram_compressed_vocab_size) / 2 > 1)
                              ? (INT64_MAX / cfg->engram_compressed_vocab_size) / 2 : 1;
    for (int e = 0; e < L; e++) {
        int64_t *m = h->mult + (size_t)e * (size_t)N;
        v41_np_integers_i64(10007u * (uint64_t)cfg->engram_layer_ids[e], 0, bound, (size_t)N, m);
        for (int i = 0; i < N; i++)
            m[i] = m[i] * 2 + 1;
    }

    /* primes: layer -> size -> head; each size restarts the search at engram_vocab_size - 1,
     * the used set spans every layer. */
    size_t n_seen = 0;
    for (int e = 0; e < L; e++) {
        int64_t *p = h->primes + (size_t)e * (size_t)h->width;
        int64_t *o = h->offsets + (size_t)e * (size_t)h->width;
        for (int n = 0; n < N - 1; n++) {
            int64_t cur = cfg->engram_vocab_size - 1;
            for (int k = 0; k < H; k++) {
                cur = next_unused_prime(cur, h->primes, n_seen);
                h->primes[n_seen++] = cur;   /* the primes array doubles as the used set */
            }
        }
        int64_t acc = 0;
        for (int j = 0; j < h->width; j++) {
            o[j] = acc;
            acc += p[j];
        }
        const int64_t rows = cfg->engram_num_embeddings[e];
        if (rows > 0 && acc > rows) {
            int lid = cfg->engram_layer_ids[e];
            v41_engram_hash_free(h);
            return v41_err_set(err, V41_EINVAL,
                               "engram: engram_num_embeddings[%d] = %lld (layer %d) is smaller than the %lld rows "
                               "its hash ids address (sum of its %d primes)",
                               e, (long long)rows, lid, (long long)acc, (N - 1) * H);
        }
    }
    *out = h;
    return V41_OK;
}

/* ---- accessors ---- */

int v41_engram_hash_width(const v41_engram_hash *h) { return h ? h->width : 0; }
int v41_engram_hash_n_layers(const v41_engram_hash *h) { return h ? h->n_layers : 0; }
int v41_engram_hash_max_ngram(const v41_engram_hash *h) { return h ? h->max_ngram : 0; }

const int64_t *v41_engram_multipliers(const v41_engram_hash *h, int e)
{
    if (!h || e < 0 || e >= h->n_layers)
        return NULL;
    return h->mult + (size_t)e * (size_t)h->max_ngram;
}

const int64_t *v41_engram_primes(const v41_engram_hash *h, int e)
{
    if (!h || e < 0 || e >= h->n_layers)
        return NULL;
    return h->primes + (size_t)e * (size_t)h->width;
}

const int64_t *v41_engram_offsets(const v41_engram_hash *h, int e)
{
    if (!h || e < 0 || e >= h->n_layers)
        return NULL;
    return h->offsets + (size_t)e * (size_t)h->width;
}

int64_t v41_engram_table_rows(const v41_engram_hash *h, int e)
{
    if (!h || e < 0 || e >= h->n_layers || h->width == 0)
        return 0;
    size_t last = (size_t)e * (size_t)h->width + (size_t)h->width - 1;
    return h->offsets[last] + h->primes[last];
}

/* ---- hashing ---- */

void v41_engram_hash_row(const v41_engram_hash *h, int e, const int64_t *back, int64_t *out)
{
    const int64_t *m = h->mult + (size_t)e * (size_t)h->max_ngram;
    const int64_t *p = h->primes + (size_t)e * (size_t)h->width;
    const int64_t *o = h->offsets + (size_t)e * (size_t)h->width;
    /* products in uint64: identical bits to torch's wrapping int64 multiply, no UB for
     * out-of-range ids (in-range ids never overflow: id < vocab, mult <= INT64_MAX / vocab) */
    uint64_t rolling = (uint64_t)back[0] * (uint64_t)m[0];
    for (int i = 1; i < h->max_ngram; i++) {
        rolling ^= (uint64_t)back[i] * (uint64_t)m[i];   /* hash of the (i+1)-gram */
        const int64_t hv = (int64_t)rolling;
        for (int k = 0; k < h->heads; k++) {
            const int j = (i - 1) * h->heads + k;
            int64_t r = hv % p[j];
            if (r < 0)                                     /* torch %: sign of the divisor */
                r += p[j];
            out[j] = r + o[j];
        }
    }
}

void v41_engram_hash_at(const v41_engram_hash *h, int e, const int64_t *hist, int64_t pos,
                        int64_t pad, int64_t *out)
{
    int64_t b[V41_ENGRAM_MAX_NGRAM];
    /* once a look-back passes the sequence start (or a DEAD token) it and every longer one is pad */
    bool blocked = false;
    for (int i = 0; i < h->max_ngram; i++) {
        blocked = blocked || pos - i < 0 || hist[pos - i] == V41_ENGRAM_DEAD;
        b[i] = blocked ? pad : hist[pos - i];
    }
    v41_engram_hash_row(h, e, b, out);
}
