/* test_engram.c: Engram hashing (SPEC.md §8) and the numpy RNG reproduction.
 *
 * (a) v41_np_* against numpy: hard-coded values (computed once with numpy 1.24.2,
 *     tests/gen_numpy_rng.py) and, when a python3 with numpy is around, every case
 *     that script prints at test time;
 * (b) the full hash against the oracle: /stepKK/engram_hash_ids of golden_fixed.h5 and
 *     golden.h5, every id of every step, rebuilt from /all_input_ids and /engram/token_map;
 * (c) primes: prime, distinct, >= engram_vocab_size, the smallest possible ones, and the
 *     table sizes they imply equal engram_num_embeddings (tiny and V4.1-Flash). */
#include "v41_engram.h"

#include <check.h>
#include <cJSON.h>
#include <hdf5.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef V41_TESTDATA
#define V41_TESTDATA "."
#endif

#define INT64_MAX_ (INT64_MAX)

/* ------------------------------------------------------------------ helpers */

static const char *srcdir(void)
{
    const char *s = getenv("V41_SRCDIR");
    return s && *s ? s : V41_TESTDATA;
}

static void oracle_path(char *buf, size_t n, const char *file)
{
    const char *d = getenv("V41_ORACLE_DIR");
    if (d && *d)
        snprintf(buf, n, "%s/%s", d, file);
    else
        snprintf(buf, n, "%s/../shared/oracle/v41-tiny/%s", srcdir(), file);
}

/* Independent primality check for the tests: trial division. */
static bool trial_prime(int64_t n)
{
    if (n < 2)
        return false;
    for (int64_t d = 2; d * d <= n; d++)
        if (n % d == 0)
            return false;
    return true;
}

/* Engram part of the V4.1-Flash config (SPEC.md §1 table). */
static void flash_config(v41_config *c)
{
    memset(c, 0, sizeof *c);
    c->n_engram_layers = 2;
    c->engram_layer_ids[0] = 1;
    c->engram_layer_ids[1] = 14;
    c->engram_max_ngram_size = 4;
    c->engram_n_heads = 8;
    c->engram_head_dim = 256;
    c->engram_vocab_size = 16000000;
    c->engram_num_embeddings[0] = 384006168;
    c->engram_num_embeddings[1] = 384016682;
    c->engram_pad_id = 2;
    c->engram_compressed_vocab_size = 99092;
}

/* Engram part of a config JSON (ModelArgs key names), as the oracle's config.json. */
static void config_from_json(const char *text, v41_config *c)
{
    memset(c, 0, sizeof *c);
    cJSON *j = cJSON_Parse(text);
    ck_assert_msg(j != NULL, "config_json does not parse");
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(j, "engram_layer_ids");
    const cJSON *ne = cJSON_GetObjectItemCaseSensitive(j, "engram_num_embeddings");
    ck_assert(cJSON_IsArray(ids) && cJSON_IsArray(ne));
    c->n_engram_layers = cJSON_GetArraySize(ids);
    ck_assert_int_eq(cJSON_GetArraySize(ne), c->n_engram_layers);
    for (int i = 0; i < c->n_engram_layers; i++) {
        c->engram_layer_ids[i] = (int)cJSON_GetArrayItem(ids, i)->valuedouble;
        c->engram_num_embeddings[i] = (int64_t)cJSON_GetArrayItem(ne, i)->valuedouble;
    }
#define GETI(key) (ck_assert_msg(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, key)), "no %s", key), \
                   cJSON_GetObjectItemCaseSensitive(j, key)->valuedouble)
    c->engram_max_ngram_size = (int)GETI("engram_max_ngram_size");
    c->engram_n_heads = (int)GETI("engram_n_heads");
    c->engram_head_dim = (int)GETI("engram_head_dim");
    c->engram_vocab_size = (int64_t)GETI("engram_vocab_size");
    c->engram_pad_id = (int)GETI("engram_pad_id");
    c->engram_compressed_vocab_size = (int)GETI("engram_compressed_vocab_size");
    c->max_batch_size = (int)GETI("max_batch_size");
    c->max_seq_len = (int)GETI("max_seq_len");
    c->vocab_size = (int)GETI("vocab_size");
#undef GETI
    cJSON_Delete(j);
}

/* ------------------------------------------------------------------ HDF5 */

static char *h5_read_str_attr(hid_t obj, const char *name)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    ck_assert_msg(a >= 0, "attribute %s missing", name);
    hid_t t = H5Aget_type(a);
    char *out = NULL;
    if (H5Tis_variable_str(t) > 0) {
        hid_t mt = H5Tcopy(H5T_C_S1);
        H5Tset_size(mt, H5T_VARIABLE);
        char *v = NULL;
        ck_assert(H5Aread(a, mt, &v) >= 0);
        out = strdup(v);
        H5free_memory(v);
        H5Tclose(mt);
    } else {
        size_t n = H5Tget_size(t);
        out = calloc(n + 1, 1);
        hid_t mt = H5Tcopy(H5T_C_S1);
        H5Tset_size(mt, n);
        H5Tset_strpad(mt, H5T_STR_NULLPAD);   /* all n bytes are text; out[n] stays 0 */
        ck_assert(H5Aread(a, mt, out) >= 0);
        H5Tclose(mt);
    }
    H5Tclose(t);
    H5Aclose(a);
    return out;
}

static int64_t h5_read_int_attr(hid_t obj, const char *name)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    ck_assert_msg(a >= 0, "attribute %s missing", name);
    int64_t v = 0;
    ck_assert(H5Aread(a, H5T_NATIVE_INT64, &v) >= 0);
    H5Aclose(a);
    return v;
}

/* Reads an integer dataset as int64; dims (up to 4) returned in dims, rank in *rank. */
static int64_t *h5_read_i64(hid_t f, const char *path, int *rank, hsize_t dims[4])
{
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    ck_assert_msg(d >= 0, "dataset %s missing", path);
    hid_t s = H5Dget_space(d);
    int r = H5Sget_simple_extent_ndims(s);
    ck_assert_msg(r >= 1 && r <= 4, "%s: rank %d", path, r);
    H5Sget_simple_extent_dims(s, dims, NULL);
    size_t n = 1;
    for (int i = 0; i < r; i++)
        n *= (size_t)dims[i];
    int64_t *buf = malloc(n * sizeof *buf);
    ck_assert(buf != NULL);
    ck_assert_msg(H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0, "read %s", path);
    H5Sclose(s);
    H5Dclose(d);
    *rank = r;
    return buf;
}

/* ------------------------------------------------------------------ (a) numpy, hard-coded */

/* Every expected value below was computed once with numpy 1.24.2
 * (/usr/bin/python3 tests/gen_numpy_rng.py, same call as in the comment). */

START_TEST(test_np_seedseq_pcg64_hardcoded)
{
    /* np.random.SeedSequence(0).generate_state(8, np.uint32) */
    static const uint32_t g0[8] = {2968811710u, 3677149159u, 745650761u, 2884920346u,
                                   2642120001u, 549907821u, 574372308u, 742431198u};
    uint32_t w[8];
    v41_np_seedseq_generate_state(0, 8, w);
    for (int i = 0; i < 8; i++)
        ck_assert_uint_eq(w[i], g0[i]);

    /* np.random.PCG64(0).state['state'] (state, inc as hi/lo 64-bit halves) */
    v41_np_pcg64 g;
    v41_np_pcg64_seed(&g, 0);
    ck_assert_uint_eq(g.state_hi, 1919014152682489133ull);
    ck_assert_uint_eq(g.state_lo, 673392287158723043ull);
    ck_assert_uint_eq(g.inc_hi, 4723672219303484034ull);
    ck_assert_uint_eq(g.inc_lo, 6377435431028945833ull);
    /* np.random.PCG64(0).random_raw(6) */
    static const uint64_t r0[6] = {11749869230777074271ull, 4976686463289251617ull, 755828109848996024ull,
                                   304881062738325533ull, 15002187965291974971ull, 16837368535893154894ull};
    for (int i = 0; i < 6; i++)
        ck_assert_uint_eq(v41_np_pcg64_next64(&g), r0[i]);

    /* np.random.PCG64(2**64-1).state: a two-word seed */
    v41_np_pcg64_seed(&g, UINT64_MAX);
    ck_assert_uint_eq(g.state_hi, 15979925158385933945ull);
    ck_assert_uint_eq(g.state_lo, 5587571011278785968ull);
    ck_assert_uint_eq(g.inc_hi, 3996428640577160527ull);
    ck_assert_uint_eq(g.inc_lo, 5680767321095361005ull);

    /* next32: low half of a 64-bit draw first, then its high half */
    v41_np_pcg64_seed(&g, 0);
    ck_assert_uint_eq(v41_np_pcg64_next32(&g), (uint32_t)11749869230777074271ull);
    ck_assert_uint_eq(v41_np_pcg64_next32(&g), (uint32_t)(11749869230777074271ull >> 32));
    ck_assert_uint_eq(v41_np_pcg64_next32(&g), (uint32_t)4976686463289251617ull);
}
END_TEST

struct np_case {
    uint64_t seed;
    int64_t low, high;
    int n;
    int64_t v[17];
};

START_TEST(test_np_integers_hardcoded)
{
    /* np.random.default_rng(seed).integers(low, high, n, dtype=np.int64) */
    static const struct np_case cases[] = {
        /* bound of the tiny config: (INT64_MAX // 300) // 2 (Lemire, 64-bit draws) */
        {0, 0, 15372286728091293, 3, {9791557692314228, 4147238719407709, 629856758207496}},
        {20014, 0, 15372286728091293, 4, {12635463650887978, 6126826198795191, 3740291214970664, 11796002834837385}},
        /* small ranges: Lemire on buffered 32-bit draws */
        {0, 0, 1000, 7, {850, 636, 511, 269, 307, 40, 75}},
        {0, -5, 7, 7, {5, 2, 1, -2, -2, -5, -5}},
        {20014, -5, 7, 3, {2, 4, 5}},
        {0, -1000, -10, 7, {-158, -370, -494, -733, -696, -960, -926}},
        {UINT64_MAX, -1000, -10, 4, {-458, -327, -60, -164}},
        {1099511640121ull, 0, 1000, 7, {304, 190, 162, 802, 762, 149, 588}},
        /* rng = 2^32-1: raw 32-bit draws */
        {0, 0, 4294967296, 7, {3653403231, 2735729615, 2195314465, 1158725112, 1322117304, 175979945, 323153949}},
        /* rng = 2^32: 64-bit Lemire */
        {0, 0, 4294967297, 3, {2735729616, 1158725112, 175979945}},
        {1099511640121ull, 0, 4294967297, 3, {816574443, 3445862595, 640310939}},
        /* nearly the whole int64 range */
        {0, 0, INT64_MAX, 4, {5874934615388537134, 2488343231644625808, 377914054924498011, 152440531369162766}},
        {0, INT64_MIN, INT64_MAX, 4,
         {2526497193922298462, -4246685573565524192, -8467543927005779785, -8918490974116450276}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int64_t out[17];
        v41_np_integers_i64(cases[c].seed, cases[c].low, cases[c].high, (size_t)cases[c].n, out);
        for (int i = 0; i < cases[c].n; i++)
            ck_assert_msg(out[i] == cases[c].v[i], "case %zu (seed %" PRIu64 ", [%" PRId64 ", %" PRId64 ")) [%d]: %"
                          PRId64 " != numpy %" PRId64, c, cases[c].seed, cases[c].low, cases[c].high, i, out[i],
                          cases[c].v[i]);
    }
    /* rng = 0: no draw, every value is low; n = 0 writes nothing */
    int64_t o[3] = {-1, -1, -1};
    v41_np_integers_i64(7, 5, 6, 3, o);
    ck_assert(o[0] == 5 && o[1] == 5 && o[2] == 5);
    o[0] = 42;
    v41_np_integers_i64(7, 0, 100, 0, o);
    ck_assert_int_eq(o[0], 42);
}
END_TEST

START_TEST(test_multipliers_hardcoded)
{
    /* engram.py compute_hash_multipliers: default_rng(10007*layer).integers(0, bound, N) * 2 + 1 */
    v41_config c;
    memset(&c, 0, sizeof c);
    c.n_engram_layers = 2;            /* the tiny oracle config */
    c.engram_layer_ids[0] = 2;
    c.engram_layer_ids[1] = 4;
    c.engram_max_ngram_size = 3;
    c.engram_n_heads = 2;
    c.engram_vocab_size = 53;
    c.engram_compressed_vocab_size = 300;
    c.engram_num_embeddings[0] = 240;
    c.engram_num_embeddings[1] = 306;
    v41_engram_hash *h = NULL;
    v41_err err = {0};
    ck_assert_msg(v41_engram_hash_init(&c, &h, &err) == V41_OK, "%s", err.msg);
    static const int64_t tiny[2][3] = {{25270927301775957, 12253652397590383, 7480582429941329},
                                       {27171098617865603, 1664016290499501, 24328227015100263}};
    for (int e = 0; e < 2; e++)
        for (int i = 0; i < 3; i++)
            ck_assert_int_eq(v41_engram_multipliers(h, e)[i], tiny[e][i]);
    v41_engram_hash_free(h);

    flash_config(&c);                 /* V4.1-Flash: compressed vocab 99092, layers 1 and 14, N = 4 */
    ck_assert_msg(v41_engram_hash_init(&c, &h, &err) == V41_OK, "%s", err.msg);
    static const int64_t flash[2][4] = {{76632096046245, 4839876093313, 35959672319349, 73987337458391},
                                        {67716810739261, 51510806800915, 30921347202721, 82619226485591}};
    for (int e = 0; e < 2; e++)
        for (int i = 0; i < 4; i++) {
            int64_t m = v41_engram_multipliers(h, e)[i];
            ck_assert_int_eq(m, flash[e][i]);
            /* odd, and id * m cannot overflow int64 for any id < compressed vocab */
            ck_assert(m & 1);
            ck_assert(m <= INT64_MAX_ / c.engram_compressed_vocab_size);
        }
    v41_engram_hash_free(h);
}
END_TEST

/* ------------------------------------------------------------------ (a) numpy, at test time */

static const char *python_with_numpy(void)
{
    static char found[512];
    const char *cands[] = {getenv("PYTHON3"), "/usr/bin/python3", "python3"};
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++) {
        if (!cands[i] || !*cands[i])
            continue;
        char cmd[700];
        snprintf(cmd, sizeof cmd, "'%s' -c 'import numpy' >/dev/null 2>&1", cands[i]);
        if (system(cmd) == 0) {
            snprintf(found, sizeof found, "%s", cands[i]);
            return found;
        }
    }
    return NULL;
}

static int parse_u64s(char **p, uint64_t *v, int n)
{
    for (int i = 0; i < n; i++) {
        char *end;
        v[i] = strtoull(*p, &end, 10);
        if (end == *p)
            return -1;
        *p = end;
    }
    return 0;
}

static int parse_i64s(char **p, int64_t *v, int n)
{
    for (int i = 0; i < n; i++) {
        char *end;
        v[i] = strtoll(*p, &end, 10);
        if (end == *p)
            return -1;
        *p = end;
    }
    return 0;
}

START_TEST(test_np_vs_numpy_runtime)
{
    const char *py = python_with_numpy();
    if (!py) {
        fprintf(stderr, "SKIP test_np_vs_numpy_runtime: no python3 with numpy found ($PYTHON3, /usr/bin/python3, "
                        "python3); only the hard-coded numpy values were checked\n");
        return;
    }
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "'%s' '%s/tests/gen_numpy_rng.py'", py, srcdir());
    FILE *f = popen(cmd, "r");
    ck_assert_msg(f != NULL, "cannot run %s", cmd);
    char *line = NULL;
    size_t cap = 0;
    int counts[5] = {0};
    while (getline(&line, &cap, f) > 0) {
        char *p = line + 1;
        uint64_t u[64];
        int64_t s[64], out[64];
        switch (line[0]) {
        case 'G': {              /* G seed n w... */
            ck_assert(parse_u64s(&p, u, 2) == 0 && u[1] <= 32);
            uint64_t seed = u[0];
            int n = (int)u[1];
            ck_assert(parse_u64s(&p, u, n) == 0);
            uint32_t w[32];
            v41_np_seedseq_generate_state(seed, (size_t)n, w);
            for (int i = 0; i < n; i++)
                ck_assert_msg(w[i] == u[i], "SeedSequence(%" PRIu64 ") word %d", seed, i);
            counts[0]++;
            break;
        }
        case 'S': {              /* S seed state_hi state_lo inc_hi inc_lo */
            ck_assert(parse_u64s(&p, u, 5) == 0);
            v41_np_pcg64 g;
            v41_np_pcg64_seed(&g, u[0]);
            ck_assert_msg(g.state_hi == u[1] && g.state_lo == u[2] && g.inc_hi == u[3] && g.inc_lo == u[4],
                          "PCG64(%" PRIu64 ") state", u[0]);
            counts[1]++;
            break;
        }
        case 'R': {              /* R seed n raw... */
            ck_assert(parse_u64s(&p, u, 2) == 0 && u[1] <= 32);
            uint64_t seed = u[0];
            int n = (int)u[1];
            ck_assert(parse_u64s(&p, u, n) == 0);
            v41_np_pcg64 g;
            v41_np_pcg64_seed(&g, seed);
            for (int i = 0; i < n; i++)
                ck_assert_msg(v41_np_pcg64_next64(&g) == u[i], "PCG64(%" PRIu64 ").random_raw [%d]", seed, i);
            counts[2]++;
            break;
        }
        case 'I': {              /* I seed low high n v... */
            ck_assert(parse_u64s(&p, u, 1) == 0);
            ck_assert(parse_i64s(&p, s, 3) == 0 && s[2] >= 0 && s[2] <= 64);
            int64_t lo = s[0], hi = s[1];
            int n = (int)s[2];
            ck_assert(parse_i64s(&p, s, n) == 0);
            v41_np_integers_i64(u[0], lo, hi, (size_t)n, out);
            for (int i = 0; i < n; i++)
                ck_assert_msg(out[i] == s[i], "default_rng(%" PRIu64 ").integers(%" PRId64 ", %" PRId64
                              ", %d) [%d]: %" PRId64 " != numpy %" PRId64, u[0], lo, hi, n, i, out[i], s[i]);
            counts[3]++;
            break;
        }
        case 'M': {              /* M vocab layer N m... */
            ck_assert(parse_i64s(&p, s, 3) == 0 && s[2] >= 2 && s[2] <= 16);
            v41_config c;
            memset(&c, 0, sizeof c);
            c.n_engram_layers = 1;
            c.engram_layer_ids[0] = (int)s[1];
            c.engram_max_ngram_size = (int)s[2];
            c.engram_n_heads = 1;
            c.engram_vocab_size = 11;
            c.engram_compressed_vocab_size = (int)s[0];
            int n = (int)s[2];
            int64_t vocab = s[0], layer = s[1];
            ck_assert(parse_i64s(&p, s, n) == 0);
            v41_engram_hash *h = NULL;
            v41_err err = {0};
            ck_assert_msg(v41_engram_hash_init(&c, &h, &err) == V41_OK, "%s", err.msg);
            for (int i = 0; i < n; i++)
                ck_assert_msg(v41_engram_multipliers(h, 0)[i] == s[i], "multiplier vocab %" PRId64 " layer %" PRId64
                              " [%d]", vocab, layer, i);
            v41_engram_hash_free(h);
            counts[4]++;
            break;
        }
        default:
            ck_abort_msg("unexpected line from gen_numpy_rng.py: %s", line);
        }
    }
    free(line);
    int rc = pclose(f);
    ck_assert_msg(rc == 0, "%s exited with status %d", cmd, rc);
    /* the script prints every kind of case; none may be missing */
    for (int k = 0; k < 5; k++)
        ck_assert_msg(counts[k] > 0, "no case of kind %d from gen_numpy_rng.py", k);
    fprintf(stderr, "numpy (%s): %d SeedSequence, %d PCG64 state, %d raw, %d integers, %d multiplier cases match\n",
            py, counts[0], counts[1], counts[2], counts[3], counts[4]);
}
END_TEST

/* ------------------------------------------------------------------ (b) golden */

static void check_golden(const char *file)
{
    char path[2048];
    oracle_path(path, sizeof path, file);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    ck_assert_msg(f >= 0, "cannot open %s (set V41_ORACLE_DIR)", path);

    char *cj = h5_read_str_attr(f, "config_json");
    v41_config cfg;
    config_from_json(cj, &cfg);
    free(cj);

    int rank;
    hsize_t dp[4], da[4], dm[4];
    int64_t *prompt = h5_read_i64(f, "/prompt_ids", &rank, dp);
    ck_assert_int_eq(rank, 2);
    int64_t *all = h5_read_i64(f, "/all_input_ids", &rank, da);
    ck_assert_int_eq(rank, 2);
    int64_t *map = h5_read_i64(f, "/engram/token_map", &rank, dm);
    ck_assert_int_eq(rank, 1);
    const int64_t B = (int64_t)da[0], T = (int64_t)da[1], V = (int64_t)dm[0], S0 = (int64_t)dp[1];
    ck_assert_int_eq((int64_t)dp[0], B);
    ck_assert_int_eq(V, cfg.vocab_size);
    for (int64_t b = 0; b < B; b++)   /* all_input_ids starts with the prompt */
        for (int64_t s = 0; s < S0; s++)
            ck_assert_int_eq(all[b * T + s], prompt[b * S0 + s]);

    v41_engram_hash *h = NULL;
    v41_err err = {0};
    ck_assert_msg(v41_engram_hash_init(&cfg, &h, &err) == V41_OK, "%s", err.msg);
    const int E = cfg.n_engram_layers, W = v41_engram_hash_width(h);
    ck_assert_int_eq(W, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads);

    /* compressed history of every row; pad = map[engram_pad_id] */
    int64_t *hist = malloc((size_t)(B * T) * sizeof *hist);
    ck_assert(hist != NULL);
    for (int64_t i = 0; i < B * T; i++) {
        ck_assert(all[i] >= 0 && all[i] < V);
        hist[i] = map[all[i]];
        ck_assert(hist[i] >= 0 && hist[i] < cfg.engram_compressed_vocab_size);
    }
    ck_assert(cfg.engram_pad_id >= 0 && cfg.engram_pad_id < V);
    const int64_t pad = map[cfg.engram_pad_id];

    int64_t row[V41_ENGRAM_MAX_NGRAM * 64];
    ck_assert(W <= (int)(sizeof row / sizeof row[0]));
    long compared = 0, steps = 0;
    int64_t covered_end = 0;
    for (int k = 0;; k++) {
        char g[32];
        snprintf(g, sizeof g, "/step%02d", k);
        if (H5Lexists(f, g, H5P_DEFAULT) <= 0)
            break;
        hid_t grp = H5Gopen2(f, g, H5P_DEFAULT);
        ck_assert(grp >= 0);
        const int64_t start = h5_read_int_attr(grp, "start_pos");
        const int64_t S = h5_read_int_attr(grp, "seqlen");
        H5Gclose(grp);
        /* step00 is the prefill over the prompt, later steps feed one token each */
        ck_assert_int_eq(start, k == 0 ? 0 : S0 + k - 1);
        ck_assert_int_eq(S, k == 0 ? S0 : 1);
        ck_assert(start + S <= T);

        char p[64];
        hsize_t di[4], dh[4];
        snprintf(p, sizeof p, "%s/input_ids", g);
        int64_t *in = h5_read_i64(f, p, &rank, di);
        ck_assert(rank == 2 && (int64_t)di[0] == B && (int64_t)di[1] == S);
        for (int64_t b = 0; b < B; b++)   /* the fed tokens are the history's [start, start+S) */
            for (int64_t s = 0; s < S; s++)
                ck_assert_int_eq(in[b * S + s], all[b * T + start + s]);
        free(in);

        snprintf(p, sizeof p, "%s/engram_hash_ids", g);
        int64_t *ids = h5_read_i64(f, p, &rank, dh);
        ck_assert(rank == 4 && (int64_t)dh[0] == B && (int64_t)dh[1] == S && (int)dh[2] == E && (int)dh[3] == W);
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = 0; s < S; s++)
                for (int e = 0; e < E; e++) {
                    const int64_t pos = start + s;
                    v41_engram_hash_at(h, e, hist + b * T, pos, pad, row);
                    const int64_t *want = ids + ((b * S + s) * E + e) * W;
                    for (int j = 0; j < W; j++) {
                        ck_assert_msg(row[j] == want[j],
                                      "%s %s: row %" PRId64 " pos %" PRId64 " engram layer %d col %d: %" PRId64
                                      " != golden %" PRId64, file, g, b, pos, cfg.engram_layer_ids[e], j, row[j],
                                      want[j]);
                        /* every id addresses the layer's table */
                        ck_assert(row[j] >= 0 && row[j] < cfg.engram_num_embeddings[e]);
                        compared++;
                    }
                }
        free(ids);
        covered_end = start + S;
        steps++;
    }
    /* every step of the file was found and compared, prefill included */
    ck_assert_int_eq(steps, T - S0 + 1);
    ck_assert_int_eq(covered_end, T);
    ck_assert_int_eq(compared, (long)(B * T * E * W));

    /* the check can fail: at position 0 every look-back is pad, so hashing with another pad
     * id must change some id there (and the golden then disagrees) */
    {
        int64_t alt[V41_ENGRAM_MAX_NGRAM * 64];
        v41_engram_hash_at(h, 0, hist, 0, pad, row);
        v41_engram_hash_at(h, 0, hist, 0, (pad + 1) % cfg.engram_compressed_vocab_size, alt);
        int diff = 0;
        for (int j = 0; j < W; j++)
            diff += row[j] != alt[j];
        ck_assert_int_gt(diff, 0);
    }
    fprintf(stderr, "%s: %ld engram hash ids over %ld steps match\n", file, compared, steps);

    v41_engram_hash_free(h);
    free(hist);
    free(map);
    free(all);
    free(prompt);
    H5Fclose(f);
}

START_TEST(test_golden_fixed) { check_golden("golden_fixed.h5"); }
END_TEST

START_TEST(test_golden_official) { check_golden("golden.h5"); }
END_TEST

/* ------------------------------------------------------------------ (c) primes */

static void check_primes(const v41_config *c)
{
    v41_engram_hash *h = NULL;
    v41_err err = {0};
    ck_assert_msg(v41_engram_hash_init(c, &h, &err) == V41_OK, "%s", err.msg);
    const int W = v41_engram_hash_width(h), E = c->n_engram_layers, H = c->engram_n_heads;
    ck_assert_int_eq(W, (c->engram_max_ngram_size - 1) * H);
    /* the (N-1)*heads*layers smallest primes >= engram_vocab_size, in order, by trial division */
    int64_t want = c->engram_vocab_size - 1;
    for (int e = 0; e < E; e++) {
        const int64_t *p = v41_engram_primes(h, e), *o = v41_engram_offsets(h, e);
        int64_t acc = 0;
        for (int j = 0; j < W; j++) {
            do
                want++;
            while (!trial_prime(want));
            ck_assert_msg(p[j] == want, "layer %d prime %d: %" PRId64 ", expected %" PRId64, e, j, p[j], want);
            ck_assert(trial_prime(p[j]));
            ck_assert(v41_is_prime_u64((uint64_t)p[j]));
            ck_assert(p[j] >= c->engram_vocab_size);
            ck_assert_int_eq(o[j], acc);   /* exclusive prefix sum */
            acc += p[j];
        }
        /* distinct across every layer */
        for (int e2 = 0; e2 <= e; e2++)
            for (int j = 0; j < W; j++)
                for (int j2 = 0; j2 < W; j2++)
                    if (e2 != e || j2 != j)
                        ck_assert(v41_engram_primes(h, e2)[j2] != p[j]);
        ck_assert_int_eq(v41_engram_table_rows(h, e), acc);
        ck_assert_int_eq(acc, c->engram_num_embeddings[e]);  /* the shipped table sizes */
    }
    v41_engram_hash_free(h);
}

START_TEST(test_primes_tiny)
{
    char path[2048];
    oracle_path(path, sizeof path, "config.json");
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    char *txt = calloc(1 << 20, 1);
    size_t n = fread(txt, 1, (1 << 20) - 1, f);
    fclose(f);
    ck_assert(n > 0);
    v41_config c;
    config_from_json(txt, &c);
    free(txt);
    ck_assert_int_eq(c.n_engram_layers, 2);
    check_primes(&c);
    /* explicit: 53 59 | 61 67 for layer 2, 71 73 | 79 83 for layer 4 */
    v41_engram_hash *h = NULL;
    ck_assert(v41_engram_hash_init(&c, &h, NULL) == V41_OK);
    static const int64_t want[2][4] = {{53, 59, 61, 67}, {71, 73, 79, 83}};
    for (int e = 0; e < 2; e++)
        for (int j = 0; j < 4; j++)
            ck_assert_int_eq(v41_engram_primes(h, e)[j], want[e][j]);
    v41_engram_hash_free(h);
}
END_TEST

START_TEST(test_primes_flash)
{
    v41_config c;
    flash_config(&c);
    check_primes(&c);   /* sums must be 384006168 and 384016682 (SPEC.md §1) */
}
END_TEST

START_TEST(test_is_prime)
{
    for (int64_t n = 0; n < 5000; n++)
        ck_assert_int_eq(v41_is_prime_u64((uint64_t)n), trial_prime(n));
    ck_assert(v41_is_prime_u64(18446744073709551557ull));    /* largest prime < 2^64 */
    ck_assert(!v41_is_prime_u64(18446744073709551615ull));
    ck_assert(!v41_is_prime_u64(3215031751ull));             /* strong pseudoprime to bases 2,3,5,7 */
    ck_assert(!v41_is_prime_u64(3825123056546413051ull));    /* strong pseudoprime to bases 2..23 */
    ck_assert(v41_is_prime_u64(2305843009213693951ull));     /* 2^61 - 1 */
}
END_TEST

/* ------------------------------------------------------------------ row formula */

START_TEST(test_row_formula)
{
    /* SPEC §8 written out naively: hash_n = XOR_{i<n} tok_i*mult_i; id = hash_n mod P + off */
    v41_config c;
    flash_config(&c);
    v41_engram_hash *h = NULL;
    ck_assert(v41_engram_hash_init(&c, &h, NULL) == V41_OK);
    const int N = c.engram_max_ngram_size, H = c.engram_n_heads, W = v41_engram_hash_width(h);
    uint64_t x = 88172645463325252ull;   /* xorshift64 test inputs */
    for (int it = 0; it < 2000; it++) {
        int64_t back[4], out[24];
        for (int i = 0; i < N; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            back[i] = it == 0 ? c.engram_compressed_vocab_size - 1 : (int64_t)(x % (uint64_t)c.engram_compressed_vocab_size);
        }
        const int e = it & 1;
        v41_engram_hash_row(h, e, back, out);
        const int64_t *m = v41_engram_multipliers(h, e), *p = v41_engram_primes(h, e), *o = v41_engram_offsets(h, e);
        for (int n = 2; n <= N; n++) {
            int64_t hv = 0;
            for (int i = 0; i < n; i++) {
                ck_assert(back[i] <= INT64_MAX_ / m[i]);   /* in-range ids never overflow */
                hv ^= back[i] * m[i];
            }
            ck_assert(hv >= 0);
            for (int k = 0; k < H; k++) {
                const int j = (n - 2) * H + k;
                ck_assert_int_eq(out[j], hv % p[j] + o[j]);
                ck_assert(out[j] >= o[j] && out[j] < o[j] + p[j]);   /* inside its own bucket range */
            }
        }
        ck_assert_int_eq(W, 24);
    }
    /* hash_at: look-backs before 0 and at/after a DEAD token read pad */
    int64_t hist[5] = {7, 8, V41_ENGRAM_DEAD, 10, 11}, a[24], b[24];
    const int64_t pad = 3;
    v41_engram_hash_at(h, 0, hist, 1, pad, a);
    int64_t back1[4] = {8, 7, pad, pad};
    v41_engram_hash_row(h, 0, back1, b);
    ck_assert_mem_eq(a, b, sizeof a);
    v41_engram_hash_at(h, 0, hist, 4, pad, a);
    int64_t back4[4] = {11, 10, pad, pad};
    v41_engram_hash_row(h, 0, back4, b);
    ck_assert_mem_eq(a, b, sizeof a);
    v41_engram_hash_free(h);
}
END_TEST

/* ------------------------------------------------------------------ errors */

START_TEST(test_bad_config)
{
    v41_config c;
    v41_engram_hash *h = (v41_engram_hash *)&c;   /* must be reset to NULL on failure */
    v41_err err = {0};

    flash_config(&c);
    c.engram_max_ngram_size = 1;
    ck_assert_int_eq(v41_engram_hash_init(&c, &h, &err), V41_EINVAL);
    ck_assert_ptr_null(h);
    ck_assert_msg(strstr(err.msg, "engram_max_ngram_size") != NULL, "%s", err.msg);

    flash_config(&c);
    c.engram_n_heads = 0;
    ck_assert_int_eq(v41_engram_hash_init(&c, &h, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "engram_n_heads") != NULL, "%s", err.msg);

    flash_config(&c);
    c.engram_compressed_vocab_size = 0;
    ck_assert_int_eq(v41_engram_hash_init(&c, &h, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "engram_compressed_vocab_size") != NULL, "%s", err.msg);

    flash_config(&c);
    c.engram_layer_ids[1] = -3;
    ck_assert_int_eq(v41_engram_hash_init(&c, &h, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "engram_layer_ids[1]") != NULL, "%s", err.msg);

    flash_config(&c);
    c.engram_num_embeddings[1] = 384016681;   /* one row short of the sum of layer 14's primes */
    ck_assert_int_eq(v41_engram_hash_init(&c, &h, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "engram_num_embeddings[1]") != NULL, "%s", err.msg);
    ck_assert_ptr_null(h);

    ck_assert_int_eq(v41_engram_hash_init(NULL, &h, &err), V41_EINVAL);

    /* no engram layers: valid, width 0, accessors return NULL */
    memset(&c, 0, sizeof c);
    ck_assert_int_eq(v41_engram_hash_init(&c, &h, &err), V41_OK);
    ck_assert_int_eq(v41_engram_hash_width(h), 0);
    ck_assert_ptr_null(v41_engram_primes(h, 0));
    v41_engram_hash_free(h);
    v41_engram_hash_free(NULL);
}
END_TEST

static Suite *engram_suite(void)
{
    Suite *s = suite_create("engram");
    TCase *np = tcase_create("numpy");
    tcase_add_test(np, test_np_seedseq_pcg64_hardcoded);
    tcase_add_test(np, test_np_integers_hardcoded);
    tcase_add_test(np, test_multipliers_hardcoded);
    tcase_add_test(np, test_np_vs_numpy_runtime);
    tcase_set_timeout(np, 60);
    suite_add_tcase(s, np);
    TCase *gold = tcase_create("golden");
    tcase_add_test(gold, test_golden_fixed);
    tcase_add_test(gold, test_golden_official);
    tcase_set_timeout(gold, 60);
    suite_add_tcase(s, gold);
    TCase *pr = tcase_create("primes");
    tcase_add_test(pr, test_primes_tiny);
    tcase_add_test(pr, test_primes_flash);
    tcase_add_test(pr, test_is_prime);
    suite_add_tcase(s, pr);
    TCase *hs = tcase_create("hash");
    tcase_add_test(hs, test_row_formula);
    tcase_add_test(hs, test_bad_config);
    suite_add_tcase(s, hs);
    return s;
}

int main(void)
{
    SRunner *r = srunner_create(engram_suite());
    srunner_run_all(r, CK_NORMAL);
    int failed = srunner_ntests_failed(r);
    srunner_free(r);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
