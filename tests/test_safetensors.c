/* test_safetensors.c: the safetensors loader on the oracle checkpoint, hostile
 * files (one test per case, each built in a temporary directory), sharded
 * checkpoints, aliases, the config check, the built-in tiny model and its
 * export / reload round trip, and the `v41 inspect` CLI on a hostile file. */
#include "v41_loader_internal.h"
#include "v41_quant.h"
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *oracle_dir(void)
{
    const char *d = getenv("V41_ORACLE_DIR");
    return d && *d ? d : V41_TESTDATA "/../shared/oracle/v41-tiny";
}

static char tmpdir[64];

static void mk_tmp(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/v41-test-st-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void rm_tmp(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    ck_assert_int_eq(system(cmd), 0);
}

/* write u64 header length (hlen_override if >= 0), header text, data bytes */
static void write_st(const char *path, const char *hdr, const void *data, size_t dlen, long long hlen_override)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    uint64_t n = hlen_override >= 0 ? (uint64_t)hlen_override : strlen(hdr);
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(n >> (8 * i));
    fwrite(le, 1, 8, f);
    fwrite(hdr, 1, strlen(hdr), f);
    if (dlen) fwrite(data, 1, dlen, f);
    fclose(f);
}

static char path_buf[512];
static const char *tpath(const char *name)
{
    snprintf(path_buf, sizeof path_buf, "%s/%s", tmpdir, name);
    return path_buf;
}

/* open hdr+data as a file; expect V41_EINVAL with the file name and `needle` in the message */
static void expect_hostile(const char *hdr, size_t dlen, long long hlen, const char *needle)
{
    mk_tmp();
    static uint8_t data[4096];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)i;
    const char *p = tpath("bad.safetensors");
    char pcopy[512];
    snprintf(pcopy, sizeof pcopy, "%s", p);
    write_st(pcopy, hdr, data, dlen, hlen);
    v41_weights *w = (v41_weights *)0x1;
    v41_err err = {0};
    int rc = v41_weights_open(pcopy, &w, &err);
    ck_assert_msg(rc == V41_EINVAL, "rc %d (%s) for header %s", rc, err.msg, hdr);
    ck_assert_ptr_null(w);
    ck_assert_msg(strstr(err.msg, pcopy) != NULL, "message does not name the file: %s", err.msg);
    ck_assert_msg(strstr(err.msg, needle) != NULL, "message lacks '%s': %s", needle, err.msg);
    /* the same bytes through the in-memory parser */
    FILE *f = fopen(pcopy, "rb");
    static uint8_t img[1 << 16];
    size_t n = fread(img, 1, sizeof img, f);
    fclose(f);
    ck_assert_int_eq(v41w_open_buffer(img, n, "buf", &w, &err), V41_EINVAL);
    rm_tmp();
}

#define T1 "\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"
#define T2 "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[16,24]}"

START_TEST(test_valid_small)
{
    mk_tmp();
    float d[4] = {1, 2, 3, 4};
    uint8_t buf[24];
    memcpy(buf, d, 16);
    uint16_t b[4] = {0x3f80, 0x4000, 0xbf80, 0};
    memcpy(buf + 16, b, 8);
    char p[512];
    snprintf(p, sizeof p, "%s", tpath("ok.safetensors"));
    write_st(p, "{\"__metadata__\":{\"format\":\"pt\",\"aliases\":\"{\\\"c\\\":\\\"b\\\"}\"}," T1 "," T2 "}   ", buf, 24, -1);
    v41_weights *w;
    v41_err err;
    ck_assert_msg(v41_weights_open(p, &w, &err) == V41_OK, "%s", err.msg);
    ck_assert_int_eq(v41_weights_count(w), 2);
    ck_assert_str_eq(v41_weights_at(w, 0)->name, "a");
    ck_assert_ptr_eq(v41_weights_find(w, "c"), v41_weights_find(w, "b"));
    ck_assert_ptr_eq(v41_weights_find(w, "model.a"), v41_weights_find(w, "a"));
    ck_assert_str_eq(v41_weights_meta(w, "format"), "pt");
    const v41_tensor *t;
    int64_t sh[2] = {2, -1};
    ck_assert_int_eq(v41_weights_get(w, "a", V41_DT_F32, 2, sh, &t, &err), V41_OK);
    float f4;
    memcpy(&f4, (const uint8_t *)t->data + 12, 4);
    ck_assert(f4 == 4.0f);
    ck_assert_int_eq(v41_weights_get(w, "a", V41_DT_BF16, 2, sh, &t, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "'a'"));
    int64_t sh3[2] = {3, 2};
    ck_assert_int_eq(v41_weights_get(w, "a", V41_DT_F32, 2, sh3, &t, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "shape [2, 2], expected [3, 2]"));
    ck_assert_int_eq(v41_weights_get(w, "zz", V41_DT_INVALID, 0, NULL, &t, &err), V41_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(err.msg, "'zz'"));
    float out[4];
    ck_assert_int_eq(v41_dequant_rows(v41_weights_find(w, "c"), NULL, 0, 1, out, &err), V41_OK);
    ck_assert(out[0] == 1.0f && out[1] == 2.0f && out[2] == -1.0f && out[3] == 0.0f);
    v41_weights_close(w);
    rm_tmp();
}
END_TEST

/* ---- one test per hostile case ---- */
START_TEST(hostile_header_beyond_file) { expect_hostile("{" T1 "}", 16, 1000000, "beyond the end of the file"); }
END_TEST
START_TEST(hostile_tiny_file)
{
    mk_tmp();
    char p[512];
    snprintf(p, sizeof p, "%s", tpath("t.safetensors"));
    FILE *f = fopen(p, "wb");
    fwrite("abc", 1, 3, f);
    fclose(f);
    v41_weights *w;
    v41_err err;
    ck_assert_int_eq(v41_weights_open(p, &w, &err), V41_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "too small"));
    rm_tmp();
}
END_TEST
START_TEST(hostile_unterminated) { expect_hostile("{\"a\":{\"dtype\":\"F32\",\"shape\":[2,", 0, -1, "unterminated"); }
END_TEST
START_TEST(hostile_not_json) { expect_hostile("hello, world", 0, -1, "not valid JSON"); }
END_TEST
START_TEST(hostile_not_object) { expect_hostile("[1, 2, 3]", 0, -1, "must be a JSON object"); }
END_TEST
START_TEST(hostile_trailing) { expect_hostile("{" T1 "} xx", 16, -1, "trailing bytes"); }
END_TEST
START_TEST(hostile_offsets_out_of_range)
{
    expect_hostile("{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[8,24]}}", 16, -1, "'a': data_offsets");
}
END_TEST
START_TEST(hostile_offsets_reversed)
{
    expect_hostile("{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 16, -1, "out of range");
}
END_TEST
START_TEST(hostile_overlap)
{
    expect_hostile("{" T1 ",\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 24, -1, "overlap");
}
END_TEST
START_TEST(hostile_nbytes_mismatch)
{
    expect_hostile("{\"a\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,16]}}", 16, -1,
                   "'a': 16 bytes in data_offsets, but dtype F32 x shape needs 24");
}
END_TEST
START_TEST(hostile_f4_nbytes)
{
    /* F4 counts elements: [4, 8] = 32 elements = 16 bytes, not 32 */
    expect_hostile("{\"a\":{\"dtype\":\"F4\",\"shape\":[4,8],\"data_offsets\":[0,32]}}", 32, -1, "needs 16 bytes");
}
END_TEST
START_TEST(hostile_f4_odd)
{
    expect_hostile("{\"a\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2, -1, "odd number");
}
END_TEST
START_TEST(hostile_unknown_dtype)
{
    expect_hostile("{\"a\":{\"dtype\":\"F7\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, -1, "'a': unknown dtype 'F7'");
}
END_TEST
START_TEST(hostile_duplicate)
{
    expect_hostile("{" T1 ",\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}", 24, -1,
                   "duplicate tensor name 'a'");
}
END_TEST
START_TEST(hostile_duplicate_after_prefix)
{
    expect_hostile("{" T1 ",\"model.a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}", 24, -1,
                   "duplicate tensor name 'a'");
}
END_TEST
START_TEST(hostile_duplicate_after_double_prefix)
{
    expect_hostile("{" T1 ",\"model.model.a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}", 24, -1,
                   "duplicate tensor name 'a'");
}
END_TEST
/* a stored tensor is found under its own (canonical) name and under the checkpoint's name,
 * however many "model." prefixes that carries (the fuzzer's input: "model.model.weight") */
START_TEST(test_double_prefix_lookup)
{
    static const uint8_t data[16] = {0};
    const char *hdr = "{\"model.model.a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}";
    uint8_t img[256];
    const uint64_t hl = strlen(hdr);
    memcpy(img, &hl, 8);
    memcpy(img + 8, hdr, hl);
    memcpy(img + 8 + hl, data, sizeof data);
    v41_weights *w = NULL;
    v41_err err = {0};
    ck_assert_msg(v41w_open_buffer(img, 8 + hl + sizeof data, "buf", &w, &err) == V41_OK, "%s", err.msg);
    ck_assert_int_eq(v41_weights_count(w), 1);
    const v41_tensor *t = v41_weights_at(w, 0);
    ck_assert_str_eq(t->name, "a");
    ck_assert_ptr_eq(v41_weights_find(w, t->name), t);
    ck_assert_ptr_eq(v41_weights_find(w, "model.model.a"), t);
    ck_assert_ptr_eq(v41_weights_find(w, "model.a"), t);
    v41_weights_close(w);
}
END_TEST
START_TEST(hostile_entry_not_object) { expect_hostile("{\"a\":[1,2,3]}", 0, -1, "'a': header entry is not an object"); }
END_TEST
START_TEST(hostile_negative_shape)
{
    expect_hostile("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1,4],\"data_offsets\":[0,16]}}", 16, -1, "'a': shape[0]");
}
END_TEST
START_TEST(hostile_too_many_dims)
{
    expect_hostile("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, -1, "9 dims");
}
END_TEST
START_TEST(hostile_missing_field)
{
    expect_hostile("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,16]}}", 16, -1, "'a': missing or non-list \"shape\"");
}
END_TEST
START_TEST(hostile_huge_shape)
{
    expect_hostile("{\"a\":{\"dtype\":\"F64\",\"shape\":[4000000000,4000000000,4000000000],\"data_offsets\":[0,8]}}", 8,
                   -1, "'a': shape too large");
}
END_TEST
START_TEST(hostile_metadata_value)
{
    expect_hostile("{\"__metadata__\":{\"x\":3}," T1 "}", 16, -1, "__metadata__ key 'x'");
}
END_TEST
START_TEST(hostile_alias_target)
{
    expect_hostile("{\"__metadata__\":{\"aliases\":\"{\\\"b\\\":\\\"nope\\\"}\"}," T1 "}", 16, -1, "'nope'");
}
END_TEST

/* ---- the oracle checkpoint ---- */
START_TEST(test_oracle)
{
    v41_weights *w;
    v41_err err;
    ck_assert_msg(v41_weights_open(oracle_dir(), &w, &err) == V41_OK, "%s", err.msg);
    /* 708 tensors: the header has 709 keys, one of them "__metadata__" */
    ck_assert_int_eq(v41_weights_count(w), 708);
    ck_assert_int_eq(v41w_alias_count(w), 4);
    ck_assert_ptr_eq(v41_weights_find(w, "mtp.1.head.weight"), v41_weights_find(w, "head.weight"));
    ck_assert_ptr_eq(v41_weights_find(w, "mtp.0.embed.weight"), v41_weights_find(w, "embed.weight"));
    ck_assert_ptr_eq(v41_weights_find(w, "model.embed_tokens.weight"), v41_weights_find(w, "embed.weight"));
    ck_assert_ptr_nonnull(v41_weights_find(w, "model.layers.0.attn_norm.weight"));
    ck_assert_str_eq(v41_weights_meta(w, "format"), "pt");
    const v41_tensor *t = v41_weights_find(w, "layers.0.ffn.experts.0.w1.weight");
    ck_assert(t->dtype == V41_DT_F4 && t->shape[0] == 64 && t->shape[1] == 128 && t->nbytes == 4096);
    t = v41_weights_find(w, "layers.0.attn.wq_a.scale");
    ck_assert(t->dtype == V41_DT_F8_E8M0 && t->shape[0] == 2 && t->shape[1] == 4 && t->nbytes == 8);
    int counts[V41_DT_F4 + 1] = {0};
    for (size_t i = 0; i < v41_weights_count(w); i++) {
        counts[v41_weights_at(w, i)->dtype]++;
        if (i) ck_assert(strcmp(v41_weights_at(w, i - 1)->name, v41_weights_at(w, i)->name) < 0);
    }
    ck_assert(counts[V41_DT_F8_E8M0] == 276 && counts[V41_DT_F4] == 204 && counts[V41_DT_F32] == 79 &&
              counts[V41_DT_BF16] == 77 && counts[V41_DT_F8_E4M3] == 72);
    /* every stored tensor is required by the config, and present with its dtype/shape */
    v41_config cfg;
    ck_assert(v41_config_load(oracle_dir(), &cfg, &err) == V41_OK);
    size_t nreq, nun;
    char un[256];
    ck_assert_msg(v41w_check_config_ex(w, &cfg, &nreq, &nun, un, sizeof un, &err) == V41_OK, "%s", err.msg);
    ck_assert_int_eq(nreq, 708);
    ck_assert_int_eq(nun, 0);
    /* the fingerprint is stable and changes with any byte */
    char fp1[17], fp2[17];
    v41_weights_fingerprint(w, fp1);
    v41_weights_fingerprint(w, fp2);
    ck_assert_str_eq(fp1, fp2);
    ck_assert_int_eq(strlen(fp1), 16);
    v41_weights_close(w);
    /* the model loader: config + weights + token map */
    v41_model *m;
    ck_assert_msg(v41_model_load(oracle_dir(), &m, &err) == V41_OK, "%s", err.msg);
    ck_assert_ptr_nonnull(m->engram_token_map);
    ck_assert_int_eq(m->engram_token_map[0], 168); /* lookup[0] of engram_token_map.json */
    ck_assert_int_eq(m->engram_token_map[2], 291); /* the pad token's compressed id */
    v41_weights_fingerprint(m->w, fp2);
    ck_assert_str_eq(fp1, fp2);
    v41_model_free(m);
}
END_TEST

/* a weight set without one tensor, or with a wrong shape: the check names it */
static v41_weights *copy_without(const v41_weights *src, const char *skip, const char *reshape)
{
    v41_weights *w = v41w_new_mem();
    v41_err err;
    for (size_t i = 0; i < v41_weights_count(src); i++) {
        const v41_tensor *t = v41_weights_at(src, i);
        if (!strcmp(t->name, skip)) continue;
        void *d = malloc(t->nbytes ? t->nbytes : 1);
        memcpy(d, t->data, t->nbytes);
        int64_t sh[V41_MAX_DIMS];
        memcpy(sh, t->shape, sizeof sh);
        if (reshape && !strcmp(t->name, reshape)) { sh[0] = t->shape[1]; sh[1] = t->shape[0]; }
        ck_assert(v41w_add(w, t->name, t->dtype, t->ndim, sh, d, t->nbytes, &err) == V41_OK);
    }
    ck_assert(v41w_finish(w, &err) == V41_OK);
    return w;
}

START_TEST(test_missing_required)
{
    v41_weights *o, *w;
    v41_err err;
    v41_config cfg;
    ck_assert(v41_weights_open(oracle_dir(), &o, &err) == V41_OK);
    ck_assert(v41_config_load(oracle_dir(), &cfg, &err) == V41_OK);
    w = copy_without(o, "layers.3.attn.indexer.wk.weight", NULL);
    ck_assert_int_eq(v41_weights_check_config(w, &cfg, &err), V41_ENOTFOUND);
    ck_assert_msg(strstr(err.msg, "'layers.3.attn.indexer.wk.weight'") != NULL, "%s", err.msg);
    v41_weights_close(w);
    w = copy_without(o, "mtp.0.ffn.experts.5.w2.scale", NULL);
    ck_assert_int_eq(v41_weights_check_config(w, &cfg, &err), V41_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(err.msg, "'mtp.0.ffn.experts.5.w2.scale'"));
    v41_weights_close(w);
    w = copy_without(o, "", "layers.2.attn.wo_a.weight");
    ck_assert_int_eq(v41_weights_check_config(w, &cfg, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "'layers.2.attn.wo_a.weight': shape [128, 64], expected [64, 128]") != NULL, "%s",
                  err.msg);
    v41_weights_close(w);
    /* a config asking for more experts than stored */
    cfg.n_routed_experts = 9;
    ck_assert_int_eq(v41_weights_check_config(o, &cfg, &err), V41_EINVAL); /* gate shape first */
    ck_assert_ptr_nonnull(strstr(err.msg, "'layers.0.ffn.gate.weight'"));
    v41_weights_close(o);
}
END_TEST

START_TEST(test_sharded)
{
    mk_tmp();
    float d[4] = {1, 2, 3, 4};
    char p[512];
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", tmpdir);
    write_st(p, "{\"model.x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", d, 16, -1);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", tmpdir);
    write_st(p, "{\"__metadata__\":{\"aliases\":\"{\\\"z\\\":\\\"x\\\"}\"},"
                "\"y\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}", d, 8, -1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", tmpdir);
    FILE *f = fopen(p, "w");
    fprintf(f, "{\"metadata\":{\"total_size\":24},\"weight_map\":{\"model.x\":\"model-00001-of-00002.safetensors\","
               "\"y\":\"model-00002-of-00002.safetensors\"}}");
    fclose(f);
    v41_weights *w;
    v41_err err;
    ck_assert_msg(v41_weights_open(tmpdir, &w, &err) == V41_OK, "%s", err.msg);
    ck_assert_int_eq(v41_weights_count(w), 2);
    ck_assert_int_eq(v41w_nfiles(w), 2);
    float f3;
    memcpy(&f3, (const uint8_t *)v41_weights_find(w, "x")->data + 8, 4);
    ck_assert(f3 == 3.0f);
    ck_assert_ptr_eq(v41_weights_find(w, "z"), v41_weights_find(w, "model.x"));
    ck_assert(v41_weights_find(w, "y")->dtype == V41_DT_I32);
    v41_weights_close(w);
    /* the index names the wrong shard for y */
    f = fopen(p, "w");
    fprintf(f, "{\"weight_map\":{\"x\":\"model-00001-of-00002.safetensors\",\"y\":\"model-00001-of-00002.safetensors\"}}");
    fclose(f);
    ck_assert_int_eq(v41_weights_open(tmpdir, &w, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "'y'") != NULL, "%s", err.msg);
    /* a shard that does not exist */
    f = fopen(p, "w");
    fprintf(f, "{\"weight_map\":{\"x\":\"model-00001-of-00002.safetensors\",\"y\":\"nope.safetensors\"}}");
    fclose(f);
    ck_assert_int_eq(v41_weights_open(tmpdir, &w, &err), V41_EIO);
    ck_assert_ptr_nonnull(strstr(err.msg, "nope.safetensors"));
    /* a shard name escaping the directory */
    f = fopen(p, "w");
    fprintf(f, "{\"weight_map\":{\"x\":\"../x.safetensors\"}}");
    fclose(f);
    ck_assert_int_eq(v41_weights_open(tmpdir, &w, &err), V41_EINVAL);
    /* the same tensor in two shards */
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", tmpdir);
    write_st(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", d, 8, -1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", tmpdir);
    f = fopen(p, "w");
    fprintf(f, "{\"weight_map\":{\"x\":\"model-00001-of-00002.safetensors\",\"y\":\"model-00002-of-00002.safetensors\"}}");
    fclose(f);
    ck_assert_int_eq(v41_weights_open(tmpdir, &w, &err), V41_EINVAL);
    ck_assert_msg(strstr(err.msg, "'x' is stored twice") != NULL, "%s", err.msg);
    rm_tmp();
}
END_TEST

/* ---- built-in tiny model ---- */
START_TEST(test_tiny_matches_oracle_layout)
{
    v41_model *m;
    v41_weights *o;
    v41_err err;
    ck_assert_msg(v41_model_tiny(&m, &err) == V41_OK, "%s", err.msg);
    ck_assert(v41_weights_open(oracle_dir(), &o, &err) == V41_OK);
    /* same names, dtypes, shapes and aliases as the oracle checkpoint */
    ck_assert_int_eq(v41_weights_count(m->w), v41_weights_count(o));
    for (size_t i = 0; i < v41_weights_count(o); i++) {
        const v41_tensor *a = v41_weights_at(o, i), *b = v41_weights_at(m->w, i);
        ck_assert_str_eq(a->name, b->name);
        ck_assert_msg(a->dtype == b->dtype && a->ndim == b->ndim && a->nbytes == b->nbytes, "%s", a->name);
        for (int k = 0; k < a->ndim; k++) ck_assert_msg(a->shape[k] == b->shape[k], "%s", a->name);
    }
    ck_assert_int_eq(v41w_alias_count(m->w), v41w_alias_count(o));
    /* deterministic */
    v41_model *m2;
    ck_assert(v41_model_tiny(&m2, &err) == V41_OK);
    char f1[17], f2[17];
    v41_weights_fingerprint(m->w, f1);
    v41_weights_fingerprint(m2->w, f2);
    ck_assert_str_eq(f1, f2);
    /* value statistics as documented: a norm weight ~ 1 + 0.2 N, a fp8 Linear ~ N / sqrt(fan_in) */
    int64_t N = 128;
    float v[128 * 128];
    ck_assert(v41_dequant_rows(v41_weights_find(m->w, "layers.3.attn_norm.weight"), NULL, 0, 1, v, &err) == V41_OK);
    double s = 0, s2 = 0;
    for (int i = 0; i < N; i++) { s += v[i]; s2 += (v[i] - 1) * (v[i] - 1); }
    /* mean of 128 draws of 1 + 0.2N: within 5 sigma = 5 * 0.2 / sqrt(128) = 0.089 of 1 */
    ck_assert_msg(s / N > 0.91 && s / N < 1.09, "mean %g", s / N);
    ck_assert_msg(sqrt(s2 / N) > 0.14 && sqrt(s2 / N) < 0.26, "std %g", sqrt(s2 / N));
    const v41_tensor *w = v41_weights_find(m->w, "layers.3.attn.wq_a.weight");
    ck_assert(v41_dequant_rows(w, v41_weights_find(m->w, "layers.3.attn.wq_a.scale"), 0, 64, v, &err) == V41_OK);
    s2 = 0;
    for (int i = 0; i < 64 * 128; i++) s2 += (double)v[i] * v[i];
    /* RMS of N(0, 1/128) with block multipliers {0.5,1,2} (mean square 1.75): sqrt(1.75/128) = 0.117 */
    ck_assert_msg(sqrt(s2 / (64 * 128)) > 0.08 && sqrt(s2 / (64 * 128)) < 0.16, "rms %g", sqrt(s2 / (64 * 128)));
    /* token map: a surjection onto the compressed ids */
    ck_assert_ptr_nonnull(m->engram_token_map);
    int hit[300] = {0};
    for (int i = 0; i < m->cfg.vocab_size; i++) {
        ck_assert(m->engram_token_map[i] >= 0 && m->engram_token_map[i] < 300);
        hit[m->engram_token_map[i]] = 1;
    }
    for (int i = 0; i < 300; i++) ck_assert_msg(hit[i], "compressed id %d unused", i);
    v41_model_free(m2);
    v41_model_free(m);
    v41_weights_close(o);
}
END_TEST

START_TEST(test_export_roundtrip)
{
    mk_tmp();
    v41_model *m, *r;
    v41_err err;
    ck_assert(v41_model_tiny(&m, &err) == V41_OK);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny-ckpt", tmpdir);
    ck_assert_msg(v41_model_export(m, dir, &err) == V41_OK, "%s", err.msg);
    ck_assert_msg(v41_model_load(dir, &r, &err) == V41_OK, "%s", err.msg);
    char f1[17], f2[17];
    v41_weights_fingerprint(m->w, f1);
    v41_weights_fingerprint(r->w, f2);
    ck_assert_str_eq(f1, f2);
    ck_assert(!memcmp(&m->cfg, &r->cfg, sizeof m->cfg));
    ck_assert(!memcmp(m->engram_token_map, r->engram_token_map, (size_t)m->cfg.vocab_size * sizeof(int64_t)));
    ck_assert_int_eq(v41w_alias_count(r->w), 4);
    ck_assert_ptr_eq(v41_weights_find(r->w, "mtp.1.embed.weight"), v41_weights_find(r->w, "embed.weight"));
    ck_assert_int_eq(v41w_nfiles(r->w), 1);
    /* header length keeps the data 8-byte aligned; every tensor naturally aligned */
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    FILE *f = fopen(p, "rb");
    uint8_t le[8];
    ck_assert_int_eq(fread(le, 1, 8, f), 8);
    fclose(f);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | le[i];
    ck_assert_int_eq((8 + hl) % 8, 0);
    for (size_t i = 0; i < v41_weights_count(r->w); i++) {
        const v41_tensor *t = v41_weights_at(r->w, i);
        size_t al = t->dtype == V41_DT_F32 ? 4 : t->dtype == V41_DT_BF16 ? 2 : 1;
        ck_assert_msg(((uintptr_t)t->data) % al == 0, "%s misaligned", t->name);
    }
    /* no temporary files left */
    char cmd[700];
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q tmp", dir);
    ck_assert_int_ne(system(cmd), 0);
    v41_model_free(r);
    /* a checkpoint dir without the token map is refused (the config has engram layers) */
    snprintf(p, sizeof p, "%s/engram_token_map.json", dir);
    ck_assert_int_eq(unlink(p), 0);
    ck_assert_int_eq(v41_model_load(dir, &r, &err), V41_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(err.msg, "engram_token_map.json"));
    /* re-export over an existing directory works */
    ck_assert(v41_model_export(m, dir, &err) == V41_OK);
    v41_model_free(m);
    rm_tmp();
}
END_TEST

/* ---- the CLI ---- */
static int run_cli(const char *args, char *out, size_t outlen)
{
    /* V41_BUILDDIR (set by the test environment); else the current directory,
     * where make runs the tests (the serial test driver ignores AM_TESTS_ENVIRONMENT) */
    const char *bd = getenv("V41_BUILDDIR");
    if (!bd || !*bd) bd = access("harness/v41", X_OK) == 0 ? "." : NULL;
    ck_assert_msg(bd != NULL, "V41_BUILDDIR is not set and ./harness/v41 does not exist");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s/harness/v41' %s 2>&1", bd, args);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t n = fread(out, 1, outlen - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(test_cli)
{
    static char out[1 << 16];
    mk_tmp();
    char p[512], args[1024];
    snprintf(p, sizeof p, "%s/hostile.safetensors", tmpdir);
    write_st(p, "{" T1 "}", "", 0, 1 << 20);
    snprintf(args, sizeof args, "inspect '%s'", p);
    ck_assert_int_eq(run_cli(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "header length") && strstr(out, "hostile.safetensors"), "%s", out);
    /* directory with a hostile weights file and the oracle's config */
    snprintf(args, sizeof args, "cp '%s/config.json' '%s/' && cp '%s' '%s/model.safetensors'", oracle_dir(), tmpdir, p,
             tmpdir);
    ck_assert_int_eq(system(args), 0);
    snprintf(args, sizeof args, "inspect '%s'", tmpdir);
    ck_assert_int_eq(run_cli(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "model.safetensors") != NULL, "%s", out);
    ck_assert_int_eq(run_cli("inspect --bogus", out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "--bogus"));
    ck_assert_int_eq(run_cli("inspect tiny tiny", out, sizeof out), 2);
    ck_assert_int_eq(run_cli("inspect /nonexistent/dir", out, sizeof out), 2);
    ck_assert_int_eq(run_cli("export-tiny", out, sizeof out), 2);
    ck_assert_int_eq(run_cli("version --bogus", out, sizeof out), 2);
    ck_assert_int_eq(run_cli("inspect --help", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "usage: v41 inspect"));
    ck_assert_int_eq(run_cli("version --json", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "\"blas\""));
    /* the oracle: 708 tensors, its fingerprint equals the library's */
    snprintf(args, sizeof args, "inspect '%s' --json", oracle_dir());
    ck_assert_int_eq(run_cli(args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "\"tensors\":\t708") || strstr(out, "\"tensors\": 708"), "%s", out);
    v41_weights *w;
    v41_err err;
    ck_assert(v41_weights_open(oracle_dir(), &w, &err) == V41_OK);
    char fp[17], needle[64];
    v41_weights_fingerprint(w, fp);
    v41_weights_close(w);
    snprintf(needle, sizeof needle, "\"%s\"", fp);
    ck_assert_ptr_nonnull(strstr(out, needle));
    ck_assert_ptr_nonnull(strstr(out, "\"source_form\":\t\"modelargs\""));
    snprintf(args, sizeof args, "inspect '%s'", oracle_dir());
    ck_assert_int_eq(run_cli(args, out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "layer 5   ratio 1: reads compressed KV of layer 4, index source"));
    ck_assert_ptr_nonnull(strstr(out, "layer 2   ratio 2: reads compressed KV of layer 1, reuses top-k of layer 1"));
    /* export-tiny then inspect: same fingerprint as the built-in model */
    snprintf(args, sizeof args, "export-tiny '%s/exp'", tmpdir);
    ck_assert_int_eq(run_cli(args, out, sizeof out), 0);
    v41_model *m;
    ck_assert(v41_model_tiny(&m, &err) == V41_OK);
    v41_weights_fingerprint(m->w, fp);
    v41_model_free(m);
    snprintf(args, sizeof args, "inspect '%s/exp'", tmpdir);
    ck_assert_int_eq(run_cli(args, out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, fp));
    rm_tmp();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("safetensors");
    TCase *h = tcase_create("hostile");
    tcase_add_test(h, test_valid_small);
    tcase_add_test(h, hostile_header_beyond_file);
    tcase_add_test(h, hostile_tiny_file);
    tcase_add_test(h, hostile_unterminated);
    tcase_add_test(h, hostile_not_json);
    tcase_add_test(h, hostile_not_object);
    tcase_add_test(h, hostile_trailing);
    tcase_add_test(h, hostile_offsets_out_of_range);
    tcase_add_test(h, hostile_offsets_reversed);
    tcase_add_test(h, hostile_overlap);
    tcase_add_test(h, hostile_nbytes_mismatch);
    tcase_add_test(h, hostile_f4_nbytes);
    tcase_add_test(h, hostile_f4_odd);
    tcase_add_test(h, hostile_unknown_dtype);
    tcase_add_test(h, hostile_duplicate);
    tcase_add_test(h, hostile_duplicate_after_prefix);
    tcase_add_test(h, hostile_duplicate_after_double_prefix);
    tcase_add_test(h, test_double_prefix_lookup);
    tcase_add_test(h, hostile_entry_not_object);
    tcase_add_test(h, hostile_negative_shape);
    tcase_add_test(h, hostile_too_many_dims);
    tcase_add_test(h, hostile_missing_field);
    tcase_add_test(h, hostile_huge_shape);
    tcase_add_test(h, hostile_metadata_value);
    tcase_add_test(h, hostile_alias_target);
    suite_add_tcase(s, h);
    TCase *o = tcase_create("checkpoints");
    tcase_set_timeout(o, 60);
    tcase_add_test(o, test_oracle);
    tcase_add_test(o, test_missing_required);
    tcase_add_test(o, test_sharded);
    tcase_add_test(o, test_tiny_matches_oracle_layout);
    tcase_add_test(o, test_export_roundtrip);
    suite_add_tcase(s, o);
    TCase *c = tcase_create("cli");
    tcase_set_timeout(c, 60);
    tcase_add_test(c, test_cli);
    suite_add_tcase(s, c);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
