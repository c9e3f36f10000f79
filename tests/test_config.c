/* test_config.c: config.json parsing (ModelArgs and Hugging Face forms),
 * validation errors naming their key, layer-schedule helpers. */
#include "v41_config.h"
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *oracle_dir(void)
{
    const char *d = getenv("V41_ORACLE_DIR");
    return d && *d ? d : V41_TESTDATA "/../shared/oracle/v41-tiny";
}

/* the tiny config as a cJSON object, to be edited by a test */
static cJSON *tiny_obj(void)
{
    v41_config c;
    v41_config_tiny(&c);
    char *s = v41_config_to_json(&c);
    cJSON *o = cJSON_Parse(s);
    free(s);
    ck_assert_ptr_nonnull(o);
    return o;
}

static int parse_obj(cJSON *o, v41_config *c, v41_err *err)
{
    char *s = cJSON_PrintUnformatted(o);
    int rc = v41_config_parse(s, strlen(s), c, err);
    free(s);
    cJSON_Delete(o);
    return rc;
}

static cJSON *int_list(const int *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

/* expect a failure whose message names `key` in quotes */
#define EXPECT_KEY_ERROR(obj, key)                                                                          \
    do {                                                                                                    \
        v41_config c_;                                                                                      \
        v41_err e_ = {0};                                                                                   \
        int rc_ = parse_obj(obj, &c_, &e_);                                                                 \
        ck_assert_msg(rc_ != V41_OK, "expected an error naming '%s'", key);                                 \
        char q_[128];                                                                                       \
        snprintf(q_, sizeof q_, "'%s'", key);                                                               \
        ck_assert_msg(strstr(e_.msg, q_) != NULL, "message does not name %s: %s", q_, e_.msg);             \
    } while (0)

START_TEST(test_tiny_equals_oracle)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", oracle_dir());
    v41_config a, b;
    v41_err err;
    ck_assert_msg(v41_config_load(p, &a, &err) == V41_OK, "%s", err.msg);
    v41_config_tiny(&b);
    ck_assert(!memcmp(&a, &b, sizeof a));
    ck_assert_str_eq(a.source_form, "modelargs");
    /* spot values of the oracle's config.json */
    ck_assert_int_eq(a.vocab_size, 512);
    ck_assert_int_eq(a.n_layers, 7);
    ck_assert_int_eq(a.n_mtp_layers, 2);
    ck_assert_int_eq(a.compress_ratios[3], 2);
    ck_assert_int_eq(a.compress_ratios[4], 1);
    ck_assert_int_eq(a.n_index_sources, 4);
    ck_assert_int_eq(a.candidate_source_layer, 4);
    ck_assert(a.gate_temp == 1.25 && a.route_scale == 1.5 && a.swiglu_limit == 1.0 && a.norm_eps == 1e-20);
    ck_assert(a.engram_num_embeddings[1] == 306 && a.engram_vocab_size == 53);
    ck_assert_int_eq(a.dspark_n_routed_experts, 6);
    ck_assert_str_eq(a.dtype, "fp8");
    ck_assert_str_eq(a.expert_dtype, "fp4");
    /* directory form of load */
    ck_assert(v41_config_load(oracle_dir(), &b, &err) == V41_OK);
    ck_assert(!memcmp(&a, &b, sizeof a));
    /* serialisation round trip */
    char *s = v41_config_to_json(&a);
    ck_assert(v41_config_parse(s, strlen(s), &b, &err) == V41_OK);
    free(s);
    ck_assert(!memcmp(&a, &b, sizeof a));
}
END_TEST

/* Serialisation keeps every double bit for bit. cJSON's own number printing rounds to 15 digits
 * when that comes within a relative epsilon, which changed about one double in eight (fuzz_config
 * found compress_rope_theta 4.8888888888888889e47 -> ...97e47). 2000 positive doubles over 600
 * binary orders of magnitude from a fixed LCG, plus that value; each must parse back equal. */
START_TEST(test_roundtrip_exact)
{
    v41_config a, b;
    v41_err err = {0};
    v41_config_tiny(&a);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i <= 2000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        double v = i == 0 ? strtod("4.8888888888888889e47", NULL)
                          : ldexp(1.0 + (double)(x >> 11) / 9007199254740992.0, (int)((x >> 3) % 600) - 300);
        a.compress_rope_theta = v;
        ck_assert_int_eq(v41_config_validate(&a, &err), V41_OK);
        char *s = v41_config_to_json(&a);
        ck_assert_ptr_nonnull(s);
        ck_assert_msg(v41_config_parse(s, strlen(s), &b, &err) == V41_OK, "%s", err.msg);
        free(s);
        ck_assert_msg(b.compress_rope_theta == v, "compress_rope_theta %.17g came back as %.17g", v, b.compress_rope_theta);
        ck_assert(!memcmp(&a, &b, sizeof a));
    }
}
END_TEST

START_TEST(test_schedule)
{
    v41_config c;
    v41_config_tiny(&c);
    ck_assert_int_eq(v41_n_total_layers(&c), 9);
    ck_assert(!v41_is_kv_source(&c, 0) && v41_is_kv_source(&c, 1) && !v41_is_kv_source(&c, 2));
    ck_assert(v41_is_index_source(&c, 5) && !v41_is_index_source(&c, 6));
    ck_assert_int_eq(v41_kv_source_of(&c, 0), -1);
    ck_assert_int_eq(v41_kv_source_of(&c, 2), 1);
    ck_assert_int_eq(v41_kv_source_of(&c, 6), 4);
    ck_assert_int_eq(v41_index_source_of(&c, 2), 1);
    ck_assert_int_eq(v41_index_source_of(&c, 6), 5);
    ck_assert_int_eq(v41_engram_index(&c, 4), 1);
    ck_assert_int_eq(v41_engram_index(&c, 3), -1);
    ck_assert(v41_is_engram_layer(&c, 2) && v41_is_dspark_target(&c, 6) && !v41_is_dspark_target(&c, 3));
    ck_assert_int_eq(v41_last_kv_source(&c), 4);
    ck_assert_int_eq(v41_layer_n_experts(&c, 6), 8);
    ck_assert_int_eq(v41_layer_n_experts(&c, 7), 6);
    ck_assert_int_eq(v41_layer_n_active(&c, 0), 2);
    ck_assert_int_eq(v41_layer_n_active(&c, 8), 3);
}
END_TEST

/* The released V4.1-Flash values of SPEC §1 (DeepSeek's inference config). */
static const char flash_json[] =
    "{\"vocab_size\":129280,\"dim\":5120,\"moe_inter_dim\":2304,\"n_layers\":40,\"n_mtp_layers\":3,"
    "\"dspark_block_size\":5,\"dspark_noise_token_id\":128799,\"dspark_target_layer_ids\":[37,38,39],"
    "\"dspark_markov_rank\":256,\"dspark_n_routed_experts\":128,\"dspark_n_activated_experts\":3,\"n_heads\":64,"
    "\"n_routed_experts\":384,\"n_shared_experts\":1,\"n_activated_experts\":6,\"score_func\":\"sqrtsoftplus\","
    "\"route_scale\":1.5,\"swiglu_limit\":10.0,\"q_lora_rank\":1280,\"head_dim\":512,\"rope_head_dim\":64,"
    "\"norm_eps\":1e-20,\"o_groups\":8,\"o_lora_rank\":1024,\"window_size\":128,\"kv_source_layers\":[2,8,14,20],"
    "\"index_source_layers\":[2,8,14,20,24,28,32,36],\"original_seq_len\":65536,\"rope_theta\":10000,"
    "\"rope_factor\":16,\"beta_fast\":32,\"beta_slow\":1,\"index_n_heads\":32,\"index_head_dim\":128,"
    "\"index_topk\":512,\"candidate_source_layer\":20,\"candidate_topk_blocks\":2048,\"candidate_block_size\":8,"
    "\"hc_mult\":4,\"hc_sinkhorn_iters\":20,\"hc_eps\":1e-06,\"engram_layer_ids\":[1,14],\"engram_vocab_size\":16000000,"
    "\"engram_num_embeddings\":[384006168,384016682],\"engram_max_ngram_size\":4,\"engram_pad_id\":2,"
    "\"engram_compressed_vocab_size\":99092,\"dtype\":\"fp8\",\"expert_dtype\":\"fp4\",\"compress_rope_theta\":160000,"
    "\"compress_ratios\":[0,0,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0],"
    "\"vision_n_layers\":32,\"vision_max_wh_ratio\":null,\"engram_n_heads\":8,\"engram_head_dim\":256}";

START_TEST(test_released_flash)
{
    v41_config c;
    v41_err err;
    ck_assert_msg(v41_config_parse(flash_json, strlen(flash_json), &c, &err) == V41_OK, "%s", err.msg);
    ck_assert_int_eq(c.n_layers + c.n_mtp_layers, 43);
    ck_assert(c.engram_num_embeddings[1] == 384016682LL);
    ck_assert_int_eq(c.kv_source_layers[3], 20);
    ck_assert_int_eq(v41_kv_source_of(&c, 19), 14);
    ck_assert_int_eq(v41_kv_source_of(&c, 39), 20);
    ck_assert_int_eq(v41_index_source_of(&c, 27), 24);
    ck_assert_int_eq(v41_last_kv_source(&c), 20);
    ck_assert_int_eq(v41_layer_n_experts(&c, 41), 128);
    /* defaults of ModelArgs for absent keys */
    ck_assert(c.gate_temp == 1.0 && c.norm_topk_prob && c.max_batch_size == 4 && c.max_seq_len == 4096);
}
END_TEST

START_TEST(test_hf_form)
{
    /* the same tiny model in Hugging Face names, nested under text_config */
    cJSON *t = tiny_obj();
    static const char *ren[][2] = {
        {"dim", "hidden_size"}, {"n_layers", "num_hidden_layers"}, {"n_heads", "num_attention_heads"},
        {"norm_eps", "rms_norm_eps"}, {"rope_head_dim", "qk_rope_head_dim"}, {"moe_inter_dim", "moe_intermediate_size"},
        {"n_activated_experts", "num_experts_per_tok"}, {"route_scale", "routed_scaling_factor"},
        {"kv_source_layers", "kv_source_layer_ids"}, {"index_source_layers", "index_source_layer_ids"},
        {"candidate_source_layer", "candidate_source_layer_id"}, {"n_mtp_layers", "num_nextn_predict_layers"},
        {"dspark_n_activated_experts", "dspark_num_experts_per_tok"}, {"engram_pad_id", "engram_pad_token_id"},
        {"score_func", "scoring_func"}, {"window_size", "sliding_window"}, {"max_seq_len", "max_position_embeddings"},
    };
    for (size_t i = 0; i < sizeof ren / sizeof ren[0]; i++) {
        cJSON *v = cJSON_DetachItemFromObjectCaseSensitive(t, ren[i][0]);
        ck_assert_ptr_nonnull(v);
        cJSON_AddItemToObject(t, ren[i][1], v);
    }
    cJSON *rs = cJSON_CreateObject();
    cJSON_AddStringToObject(rs, "type", "yarn");
    static const char *yk[][2] = {{"rope_factor", "factor"}, {"beta_fast", "beta_fast"}, {"beta_slow", "beta_slow"},
                                  {"original_seq_len", "original_max_position_embeddings"}};
    for (int i = 0; i < 4; i++) cJSON_AddItemToObject(rs, yk[i][1], cJSON_DetachItemFromObjectCaseSensitive(t, yk[i][0]));
    cJSON_AddItemToObject(t, "rope_scaling", rs);
    cJSON_AddStringToObject(t, "model_type", "deepseek_v41");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "text_config", t);
    cJSON *qc = cJSON_CreateObject();
    int bs[2] = {32, 32};
    cJSON_AddItemToObject(qc, "weight_block_size", int_list(bs, 2));
    cJSON_AddItemToObject(root, "quantization_config", qc);
    cJSON_AddStringToObject(root, "architectures", "DeepseekV41ForCausalLM");
    cJSON *root2 = cJSON_Duplicate(root, 1);

    v41_config a, b;
    v41_err err;
    ck_assert_msg(parse_obj(root, &a, &err) == V41_OK, "%s", err.msg);
    ck_assert_str_eq(a.source_form, "hf");
    v41_config_tiny(&b);
    memset(b.source_form, 0, sizeof b.source_form);
    snprintf(b.source_form, sizeof b.source_form, "hf");
    ck_assert(!memcmp(&a, &b, sizeof a));

    /* weight_block_size other than [32, 32] is rejected */
    cJSON *q2 = cJSON_GetObjectItem(root2, "quantization_config");
    int bs2[2] = {128, 128};
    cJSON_ReplaceItemInObject(q2, "weight_block_size", int_list(bs2, 2));
    EXPECT_KEY_ERROR(root2, "quantization_config.weight_block_size");
}
END_TEST

START_TEST(test_errors_name_key)
{
    cJSON *o;
    /* missing key */
    o = tiny_obj(); cJSON_DeleteItemFromObject(o, "dim"); EXPECT_KEY_ERROR(o, "dim");
    o = tiny_obj(); cJSON_DeleteItemFromObject(o, "compress_ratios"); EXPECT_KEY_ERROR(o, "compress_ratios");
    /* wrong types */
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "dim", cJSON_CreateString("128")); EXPECT_KEY_ERROR(o, "dim");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "n_heads", cJSON_CreateNumber(4.5)); EXPECT_KEY_ERROR(o, "n_heads");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "norm_topk_prob", cJSON_CreateNumber(1)); EXPECT_KEY_ERROR(o, "norm_topk_prob");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "kv_source_layers", cJSON_CreateNumber(1)); EXPECT_KEY_ERROR(o, "kv_source_layers");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "score_func", cJSON_CreateString("relu")); EXPECT_KEY_ERROR(o, "score_func");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "dtype", cJSON_CreateString("int3")); EXPECT_KEY_ERROR(o, "dtype");
    /* list length: compress_ratios must have n_layers + n_mtp_layers entries */
    {
        int cr[8] = {0, 2, 2, 2, 1, 1, 1, 0};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "compress_ratios", int_list(cr, 8)); EXPECT_KEY_ERROR(o, "compress_ratios");
    }
    {
        int64_t dummy = 0; (void)dummy;
        int ne[1] = {240};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "engram_num_embeddings", int_list(ne, 1));
        EXPECT_KEY_ERROR(o, "engram_num_embeddings");
    }
    /* compressed layer 1 without a kv source <= 1 */
    {
        int kv[2] = {3, 4}, ix[3] = {3, 4, 5};
        o = tiny_obj();
        cJSON_ReplaceItemInObject(o, "kv_source_layers", int_list(kv, 2));
        cJSON_ReplaceItemInObject(o, "index_source_layers", int_list(ix, 3));
        EXPECT_KEY_ERROR(o, "kv_source_layers");
    }
    /* layer 2 ratio 1, newest kv source (1) ratio 2 */
    {
        int cr[9] = {0, 2, 1, 2, 1, 1, 1, 0, 0};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "compress_ratios", int_list(cr, 9)); EXPECT_KEY_ERROR(o, "kv_source_layers");
    }
    /* an index-only layer whose ratio differs from its newest index source */
    {
        int ix[4] = {1, 3, 4, 5}, cr[9] = {0, 2, 2, 2, 1, 1, 1, 0, 0}, kv[3] = {1, 3, 4};
        (void)ix; (void)kv;
        cr[5] = 2; /* layer 5: ratio 2 but its kv source (4) has ratio 1 */
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "compress_ratios", int_list(cr, 9)); EXPECT_KEY_ERROR(o, "kv_source_layers");
    }
    /* a kv source that is not an index source */
    {
        int ix[3] = {1, 4, 5};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "index_source_layers", int_list(ix, 3));
        EXPECT_KEY_ERROR(o, "index_source_layers");
    }
    /* kv source on a window-only layer */
    {
        int kv[4] = {0, 1, 3, 4};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "kv_source_layers", int_list(kv, 4)); EXPECT_KEY_ERROR(o, "kv_source_layers");
    }
    /* candidate source must be an index source */
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "candidate_source_layer", cJSON_CreateNumber(2));
    EXPECT_KEY_ERROR(o, "candidate_source_layer");
    /* candidate_topk_blocks * candidate_block_size >= index_topk */
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "candidate_topk_blocks", cJSON_CreateNumber(1));
    EXPECT_KEY_ERROR(o, "candidate_topk_blocks");
    /* a later index source with a different ratio than the candidate source */
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "candidate_source_layer", cJSON_CreateNumber(3));
    EXPECT_KEY_ERROR(o, "candidate_source_layer");
    /* DSpark stages have ratio 0 */
    {
        int cr[9] = {0, 2, 2, 2, 1, 1, 1, 0, 1};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "compress_ratios", int_list(cr, 9)); EXPECT_KEY_ERROR(o, "compress_ratios");
    }
    /* quantized dims: multiples of 32 */
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "dim", cJSON_CreateNumber(100)); EXPECT_KEY_ERROR(o, "dim");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "moe_inter_dim", cJSON_CreateNumber(48)); EXPECT_KEY_ERROR(o, "moe_inter_dim");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "q_lora_rank", cJSON_CreateNumber(40)); EXPECT_KEY_ERROR(o, "q_lora_rank");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "engram_head_dim", cJSON_CreateNumber(24)); EXPECT_KEY_ERROR(o, "engram_head_dim");
    /* other shape constraints */
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "rope_head_dim", cJSON_CreateNumber(128)); EXPECT_KEY_ERROR(o, "rope_head_dim");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "o_groups", cJSON_CreateNumber(3)); EXPECT_KEY_ERROR(o, "o_groups");
    o = tiny_obj(); cJSON_ReplaceItemInObject(o, "n_activated_experts", cJSON_CreateNumber(9)); EXPECT_KEY_ERROR(o, "n_activated_experts");
    {
        int t[2] = {4, 9};
        o = tiny_obj(); cJSON_ReplaceItemInObject(o, "dspark_target_layer_ids", int_list(t, 2));
        EXPECT_KEY_ERROR(o, "dspark_target_layer_ids");
    }
    /* duplicate key in the JSON text */
    {
        v41_config c;
        v41_err e;
        v41_config_tiny(&c);
        char *s = v41_config_to_json(&c);
        size_t n = strlen(s);
        char *s2 = malloc(n + 32);
        memcpy(s2, "{\"dim\": 256, ", 13);
        memcpy(s2 + 13, s + 1, n);
        ck_assert_int_ne(v41_config_parse(s2, strlen(s2), &c, &e), V41_OK);
        ck_assert_ptr_nonnull(strstr(e.msg, "'dim'"));
        free(s);
        free(s2);
    }
    /* not JSON / not an object */
    {
        v41_config c;
        v41_err e;
        ck_assert_int_eq(v41_config_parse("{\"dim\": 12", 10, &c, &e), V41_EINVAL);
        ck_assert_ptr_nonnull(strstr(e.msg, "not valid JSON"));
        ck_assert_int_eq(v41_config_parse("[1,2]", 5, &c, &e), V41_EINVAL);
        ck_assert_int_eq(v41_config_load("/nonexistent/config.json", &c, &e), V41_EIO);
        ck_assert_ptr_nonnull(strstr(e.msg, "/nonexistent/config.json"));
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, test_tiny_equals_oracle);
    tcase_add_test(tc, test_schedule);
    tcase_add_test(tc, test_roundtrip_exact);
    tcase_add_test(tc, test_released_flash);
    tcase_add_test(tc, test_hf_form);
    tcase_add_test(tc, test_errors_name_key);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? 1 : 0;
}
