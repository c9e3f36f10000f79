/* cmd_bench_ref.c: `v41 bench ref` — one DeepSeek-V4.1-Flash-shaped layer
 * (dim 5120, 64 x 512 heads, q_lora 1280, 8 x 1024 output groups, window 128,
 * ratio-2 compressor + lightning indexer (32 x 128, top-512), 384 experts x 2304
 * (6 active) + shared expert, mHC 4) with synthetic weights generated directly in
 * the storage formats (fp8 + e8m0 blocks, fp4 + e8m0, bf16, fp32), run through the
 * ref engine: prefill of N tokens then D decode steps. Reports tokens/s, the
 * fraction of time in sgemm, the engine's achieved GEMM GFLOP/s and a bare
 * cblas_sgemm of the same shapes measured in the same run, and peak RSS. */
#include "config.h"
#include "v41_cli.h"
#include "v41_engine.h"
#include "v41_ops.h"
#include "v41_loader_internal.h"
#include <cblas.h>
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull; x ^= x >> 27; x *= 0x94d049bb133111ebull; x ^= x >> 31;
    return x;
}

/* fill n bytes deterministically; kind 0 = e4m3 codes of magnitude 0.25..1.9, 1 = any fp4 pair */
static void fill_bytes(uint8_t *p, size_t n, uint64_t seed, int kind)
{
#pragma omp parallel for schedule(static)
    for (size_t i0 = 0; i0 < n; i0 += 65536) {
        uint64_t s = mix64(seed ^ (i0 * 0x9e3779b97f4a7c15ull));
        size_t i1 = i0 + 65536 < n ? i0 + 65536 : n;
        for (size_t i = i0; i < i1; i++) {
            if ((i & 7) == 0) s = mix64(s + i);
            uint8_t r = (uint8_t)(s >> ((i & 7) * 8));
            if (kind == 0) p[i] = (uint8_t)((r & 0x87) | ((5 + (r >> 3) % 3) << 3));
            else p[i] = r;
        }
    }
}

typedef struct gen { v41_weights *w; uint64_t seed; int rc; v41_err *err; double bytes; } gen;

static void add(gen *g, const char *name, v41_dtype dt, int ndim, int64_t d0, int64_t d1, int fill, float val)
{
    if (g->rc) return;
    int64_t shape[2] = {d0, d1};
    int64_t n = ndim == 1 ? d0 : d0 * d1;
    size_t nb = v41_dtype_nbytes(dt, n);
    void *data = malloc(nb ? nb : 1);
    if (!data) { g->rc = v41_err_set(g->err, V41_ENOMEM, "bench: out of memory for %s", name); return; }
    g->seed = mix64(g->seed + 1);
    if (dt == V41_DT_F8_E4M3) fill_bytes(data, nb, g->seed, 0);
    else if (dt == V41_DT_F4) fill_bytes(data, nb, g->seed, 1);
    else if (dt == V41_DT_F8_E8M0) memset(data, (int)val, nb); /* val = biased exponent */
    else if (dt == V41_DT_BF16) {
        uint16_t *b = data;
        for (int64_t i = 0; i < n; i++) {
            float v = fill ? val * ((int)(mix64(g->seed + i) % 2001) - 1000) / 1000.0f : val;
            b[i] = v41_f32_to_bf16(v);
        }
    } else {
        float *f = data;
        for (int64_t i = 0; i < n; i++)
            f[i] = fill ? v41_round_bf16(val * ((int)(mix64(g->seed + i) % 2001) - 1000) / 1000.0f) : val;
    }
    g->bytes += (double)nb;
    g->rc = v41w_add(g->w, name, dt, ndim, shape, data, nb, g->err);
}

static void add_fp8(gen *g, const char *base, int64_t N, int64_t K, int sexp)
{
    char nm[160];
    snprintf(nm, sizeof nm, "%s.weight", base);
    add(g, nm, V41_DT_F8_E4M3, 2, N, K, 1, 0);
    snprintf(nm, sizeof nm, "%s.scale", base);
    add(g, nm, V41_DT_F8_E8M0, 2, (N + 31) / 32, (K + 31) / 32, 0, (float)sexp);
}

static const char *flash_json =
    "{\"max_batch_size\": 1, \"max_seq_len\": %d, \"vocab_size\": %d, \"dim\": 5120, \"moe_inter_dim\": 2304,"
    " \"n_layers\": 1, \"n_mtp_layers\": 0, \"n_heads\": 64, \"n_routed_experts\": %d, \"n_shared_experts\": 1,"
    " \"n_activated_experts\": 6, \"score_func\": \"sqrtsoftplus\", \"gate_temp\": 1.0, \"norm_topk_prob\": true,"
    " \"route_scale\": 1.5, \"swiglu_limit\": 10.0, \"q_lora_rank\": 1280, \"head_dim\": 512, \"rope_head_dim\": 64,"
    " \"norm_eps\": 1e-20, \"o_groups\": 8, \"o_lora_rank\": 1024, \"window_size\": 128, \"compress_ratios\": [2],"
    " \"kv_source_layers\": [0], \"index_source_layers\": [0], \"compress_rope_theta\": 160000.0,"
    " \"original_seq_len\": 65536, \"rope_theta\": 10000.0, \"rope_factor\": 16.0, \"beta_fast\": 32, \"beta_slow\": 1,"
    " \"index_n_heads\": 32, \"index_head_dim\": 128, \"index_topk\": 512, \"candidate_source_layer\": -1,"
    " \"candidate_topk_blocks\": 0, \"candidate_block_size\": 0, \"hc_mult\": 4, \"hc_sinkhorn_iters\": 20,"
    " \"hc_eps\": 1e-6, \"dtype\": \"fp8\", \"expert_dtype\": \"fp4\", \"dspark_block_size\": 0}";

static int build_model(int max_seq, int vocab, int n_exp, v41_model **out, double *gbytes, v41_err *err)
{
    char js[4096];
    snprintf(js, sizeof js, flash_json, max_seq, vocab, n_exp);
    v41_model *m = calloc(1, sizeof *m);
    if (!m) return v41_err_set(err, V41_ENOMEM, "out of memory");
    int rc = v41_config_parse(js, strlen(js), &m->cfg, err);
    if (rc) { free(m); return v41_err_prefix(err, "bench config"); }
    snprintf(m->source, sizeof m->source, "synthetic Flash-shaped layer");
    gen g = {v41w_new_mem(), 20260101, 0, err, 0};
    if (!g.w) { free(m); return v41_err_set(err, V41_ENOMEM, "out of memory"); }
    const int D = 5120, hD = 4 * D, mix = 24, H = 64, d = 512, QL = 1280, G = 8, OL = 1024, IM = 2304;
    add(&g, "embed.weight", V41_DT_BF16, 2, vocab, D, 1, 1.0f);
    add(&g, "head.weight", V41_DT_F32, 2, vocab, D, 1, 0.02f);
    add(&g, "norm.weight", V41_DT_BF16, 1, D, 0, 0, 1.0f);
    const char *p = "layers.0";
    char nm[160];
#define N(s) (snprintf(nm, sizeof nm, "%s.%s", p, s), nm)
    add(&g, N("hc_attn_fn"), V41_DT_F32, 2, mix, hD, 1, 0.01f);
    add(&g, N("hc_ffn_fn"), V41_DT_F32, 2, mix, hD, 1, 0.01f);
    add(&g, N("hc_attn_base"), V41_DT_F32, 1, mix, 0, 1, 0.5f);
    add(&g, N("hc_ffn_base"), V41_DT_F32, 1, mix, 0, 1, 0.5f);
    add(&g, N("hc_attn_scale"), V41_DT_F32, 1, 3, 0, 0, 1.0f);
    add(&g, N("hc_ffn_scale"), V41_DT_F32, 1, 3, 0, 0, 1.0f);
    add(&g, N("attn_norm.weight"), V41_DT_BF16, 1, D, 0, 0, 1.0f);
    add(&g, N("ffn_norm.weight"), V41_DT_BF16, 1, D, 0, 0, 1.0f);
    add(&g, N("attn.attn_sink"), V41_DT_F32, 1, H, 0, 1, 0.8f);
    add_fp8(&g, N("attn.wq_a"), QL, D, 127 - 7);
    add(&g, N("attn.q_norm.weight"), V41_DT_BF16, 1, QL, 0, 0, 1.0f);
    add_fp8(&g, N("attn.wq_b"), (int64_t)H * d, QL, 127 - 6);
    add_fp8(&g, N("attn.wkv"), d, D, 127 - 7);
    add(&g, N("attn.kv_norm.weight"), V41_DT_BF16, 1, d, 0, 0, 1.0f);
    add(&g, N("attn.wo_a.weight"), V41_DT_BF16, 2, (int64_t)G * OL, (int64_t)H * d / G, 1, 0.016f);
    add_fp8(&g, N("attn.wo_b"), D, (int64_t)G * OL, 127 - 8);
    add(&g, N("attn.compressor.wkv.weight"), V41_DT_F32, 2, d, D, 1, 0.014f);
    add(&g, N("attn.compressor.wgate.weight"), V41_DT_F32, 2, d, D, 1, 0.014f);
    add(&g, N("attn.compressor.norm.weight"), V41_DT_BF16, 1, d, 0, 0, 1.0f);
    add_fp8(&g, N("attn.indexer.wq_b"), 32 * 128, QL, 127 - 6);
    add(&g, N("attn.indexer.weights_proj.weight"), V41_DT_BF16, 2, 32, D, 1, 0.014f);
    add(&g, N("attn.indexer.wk.weight"), V41_DT_BF16, 2, 128, d, 1, 0.044f);
    add(&g, N("attn.indexer.k_norm.weight"), V41_DT_BF16, 1, 128, 0, 0, 1.0f);
    add(&g, N("ffn.gate.weight"), V41_DT_BF16, 2, n_exp, D, 1, 0.014f);
    add(&g, N("ffn.gate.bias"), V41_DT_F32, 1, n_exp, 0, 1, 0.3f);
    for (int e = 0; e < n_exp && !g.rc; e++) {
        char b2[96];
        const int64_t sh[3][2] = {{IM, D}, {D, IM}, {IM, D}};
        for (int j = 0; j < 3; j++) {
            snprintf(b2, sizeof b2, "ffn.experts.%d.w%d.weight", e, j + 1);
            add(&g, N(b2), V41_DT_F4, 2, sh[j][0], sh[j][1], 1, 0);
            snprintf(b2, sizeof b2, "ffn.experts.%d.w%d.scale", e, j + 1);
            add(&g, N(b2), V41_DT_F8_E8M0, 2, sh[j][0], sh[j][1] / 32, 0, 127 - 8);
        }
    }
    add_fp8(&g, N("ffn.shared_experts.w1"), IM, D, 127 - 8);
    add_fp8(&g, N("ffn.shared_experts.w2"), D, IM, 127 - 8);
    add_fp8(&g, N("ffn.shared_experts.w3"), IM, D, 127 - 8);
#undef N
    if (!g.rc) g.rc = v41w_finish(g.w, err);
    if (g.rc) { v41_weights_close(g.w); free(m); return g.rc; }
    m->w = g.w;
    *gbytes = g.bytes;
    *out = m;
    return V41_OK;
}

/* --profile: wall time between consecutive taps, summed per tap name (the time
 * up to a tap is charged to it), to see where the non-GEMM time goes. */
typedef struct prof {
    double last;
    int n;
    char name[256][64];
    double secs[256];
} prof;
static int prof_emit(void *ctx, const v41_tap *t)
{
    prof *p = ctx;
    double now = now_s();
    int i = 0;
    for (; i < p->n; i++)
        if (!strcmp(p->name[i], t->name)) break;
    if (i == p->n && p->n < 256) snprintf(p->name[p->n++], sizeof p->name[0], "%s", t->name);
    if (i < 256) p->secs[i] += now - p->last;
    p->last = now_s();
    return 0;
}
static void prof_print(prof *p, const char *what, double total)
{
    printf("  %s: wall time up to each tap (top 15 of %d)\n", what, p->n);
    for (int k = 0; k < 15 && k < p->n; k++) {
        int b = -1;
        for (int i = 0; i < p->n; i++)
            if (p->secs[i] >= 0 && (b < 0 || p->secs[i] > p->secs[b])) b = i;
        if (b < 0) break;
        printf("    %-40s %8.3f s  %5.1f%%\n", p->name[b], p->secs[b], 100 * p->secs[b] / total);
        p->secs[b] = -1;
    }
    memset(p, 0, sizeof *p);
}

typedef struct shape { int64_t M, N, K; int reps; const char *what; } shape;

/* bare sgemm GFLOP/s over the layer's GEMM shapes (row-major C = A . W^T, fp32) */
static double bare_sgemm(const shape *sh, int n, int threads, double *secs_out)
{
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(threads > 0 ? threads : 1);
#endif
    double fl = 0, secs = 0;
    for (int i = 0; i < n; i++) {
        int64_t M = sh[i].M, N = sh[i].N, K = sh[i].K;
        float *A = malloc(sizeof(float) * (size_t)(M * K)), *W = malloc(sizeof(float) * (size_t)(N * K));
        float *C = malloc(sizeof(float) * (size_t)(M * N));
        if (!A || !W || !C) { free(A); free(W); free(C); continue; }
        for (int64_t j = 0; j < M * K; j++) A[j] = (float)((j * 7919) % 1000) * 1e-3f;
        for (int64_t j = 0; j < N * K; j++) W[j] = (float)((j * 104729) % 1000) * 1e-3f;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, A, (int)K, W, (int)K, 0.0f, C, (int)N);
        double t0 = now_s();
        for (int r = 0; r < sh[i].reps; r++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, A, (int)K, W, (int)K, 0.0f, C, (int)N);
        secs += now_s() - t0;
        fl += 2.0 * M * N * K * sh[i].reps;
        free(A); free(W); free(C);
    }
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1);
#endif
    if (secs_out) *secs_out = secs;
    return secs > 0 ? fl / secs / 1e9 : 0;
}

/* Large buffers of a forward are fresh anonymous mappings, and first-touch page
 * faults are expensive on VMs (measured: ~1/3 of the non-GEMM prefill time here).
 * The bench therefore re-executes itself once with glibc's malloc asking for
 * transparent huge pages on its mmapped chunks (GLIBC_TUNABLES=glibc.malloc.hugetlb=1,
 * glibc >= 2.35; read at startup only, ignored by older versions). --no-hugepages
 * keeps the plain allocator. Returns only when it did not re-execute. */
static void reexec_hugetlb(void)
{
    const char *t = getenv("GLIBC_TUNABLES");
    if (getenv("V41_BENCH_REEXEC") || (t && strstr(t, "glibc.malloc.hugetlb"))) return;
    FILE *f = fopen("/proc/self/cmdline", "rb");
    if (!f) return;
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    if (n == 0 || n >= sizeof buf - 1) return;
    buf[n] = 0;
    char *args[256];
    int na = 0;
    for (size_t i = 0; i < n && na < 255; i += strlen(buf + i) + 1) args[na++] = buf + i;
    args[na] = NULL;
    char tun[4096];
    snprintf(tun, sizeof tun, "%s%sglibc.malloc.hugetlb=1", t ? t : "", t && *t ? ":" : "");
    if (setenv("GLIBC_TUNABLES", tun, 1) || setenv("V41_BENCH_REEXEC", "1", 1)) return;
    fflush(NULL);
    execv("/proc/self/exe", args);
    unsetenv("V41_BENCH_REEXEC"); /* exec failed: run as is */
}

static void usage(FILE *f)
{
    fprintf(f, "usage: v41 bench ref [--tokens N] [--decode N] [--threads N] [--experts N] [--json] [--profile] [--no-hugepages]\n\n"
               "One DeepSeek-V4.1-Flash-shaped layer (dim 5120, 64x512 heads, ratio-2 compressor +\n"
               "indexer, 384 experts x 2304, synthetic weights in fp8/fp4/bf16/fp32 storage) through\n"
               "the ref engine in emulate mode: prefill of N tokens (default 1024), then decode steps\n"
               "(default 64). Reports tokens/s, fraction of time in sgemm, the engine's GEMM GFLOP/s,\n"
               "a bare cblas_sgemm of the same shapes in the same run, and peak RSS. --profile prints\n"
               "the wall time between consecutive taps (where the non-GEMM time goes). The bench\n"
               "re-executes itself once with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge\n"
               "pages for malloc's large chunks: fewer first-touch page faults); --no-hugepages\n"
               "keeps the plain allocator.\n");
}

int v41_bench_ref(int argc, char **argv)
{
    int T = 1024, ND = 64, threads = 2, n_exp = 384;
    bool json = false, profile = false, hugepages = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(stdout); return 0; }
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--profile")) profile = true;
        else if (!strcmp(argv[i], "--no-hugepages")) hugepages = false;
        /* bounds: a prefill of at least 2 rows, at most 2^20 rows of prefill or decode; the
         * layer activates 6 of at most 384 experts */
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) { if (v41_cli_int_opt("bench ref", argv[i], argv[i + 1], 2, 1L << 20, &T)) return 2; i++; }
        else if (!strcmp(argv[i], "--decode") && i + 1 < argc) { if (v41_cli_int_opt("bench ref", argv[i], argv[i + 1], 0, 1L << 20, &ND)) return 2; i++; }
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) { if (v41_cli_int_opt("bench ref", argv[i], argv[i + 1], 1, 4096, &threads)) return 2; i++; }
        else if (!strcmp(argv[i], "--experts") && i + 1 < argc) { if (v41_cli_int_opt("bench ref", argv[i], argv[i + 1], 6, 384, &n_exp)) return 2; i++; }
        else { fprintf(stderr, "bench ref: unknown argument %s\n", argv[i]); usage(stderr); return 2; }
    }
    if (hugepages) reexec_hugetlb();
    const char *tun = getenv("GLIBC_TUNABLES");
    const bool huge_on = tun && strstr(tun, "glibc.malloc.hugetlb=1");
    const int vocab = 1024;
    v41_err err = {0};
    v41_model *m = NULL;
    double gbytes = 0, t0 = now_s();
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1); /* the engine threads over weight chunks itself */
#endif
    if (build_model(T + ND + 8, vocab, n_exp, &m, &gbytes, &err)) { fprintf(stderr, "bench ref: %s\n", err.msg); return 2; }
    double tgen = now_s() - t0;
    if (!json) fprintf(stderr, "bench ref: synthetic layer built: %.2f GB of weights in %.1f s\n", gbytes / 1e9, tgen);
    v41_engine_opts o;
    v41_engine_opts_default(&o);
    o.threads = threads;
    o.max_seq_len = T + ND + 8;
    o.max_requests = 1;
    v41_engine *e = NULL;
    int rc = 2;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(T + ND));
    if (v41_ref_engine_create(m, &o, &e, &err)) { fprintf(stderr, "bench ref: %s\n", err.msg); goto out; }
    for (int i = 0; i < T + ND; i++) tok[i] = (int32_t)(mix64((uint64_t)i) % vocab);
    v41_gemm_count_enable(true);
    v41_gemm_stats(NULL, NULL, NULL, true);
    v41_gemm_dequant_stats(NULL, true);
    v41_req r = {.id = 0, .start_pos = 0, .n_tokens = T, .tokens = tok};
    v41_batch b = {1, &r};
    v41_out out;
    prof *pf = profile ? calloc(1, sizeof *pf) : NULL;
    v41_tap_sink psink = {prof_emit, pf, NULL};
    if (pf) v41_engine_set_sink(e, &psink);
    double tp0 = now_s();
    if (pf) pf->last = tp0;
    if (v41_engine_forward(e, &b, &out, &err)) { fprintf(stderr, "bench ref: prefill: %s\n", err.msg); goto out; }
    double tp = now_s() - tp0, pg_s, pg_fl, pl_s;
    v41_gemm_stats(&pg_s, &pg_fl, &pl_s, true);
    double pq_s, dq_s;
    v41_gemm_dequant_stats(&pq_s, true);
    if (pf) prof_print(pf, "prefill", tp);
    double td0 = now_s();
    if (pf) pf->last = td0;
    for (int s = 0; s < ND; s++) {
        v41_req rd = {.id = 0, .start_pos = T + s, .n_tokens = 1, .tokens = tok + T + s};
        v41_batch bd = {1, &rd};
        if (v41_engine_forward(e, &bd, &out, &err)) { fprintf(stderr, "bench ref: decode: %s\n", err.msg); goto out; }
    }
    double td = now_s() - td0, dg_s, dg_fl, dl_s;
    v41_gemm_stats(&dg_s, &dg_fl, &dl_s, true);
    v41_gemm_dequant_stats(&dq_s, true);
    if (pf) { prof_print(pf, "decode", td); v41_engine_set_sink(e, NULL); free(pf); }
    v41_gemm_count_enable(false);
    /* bare sgemm of the layer's shapes (prefill M = T; routed experts at their mean M) */
    int64_t me = (int64_t)T * 6 / n_exp;
    if (me < 1) me = 1;
    shape sh[] = {
        {T, 1280, 5120, 1, "wq_a"}, {T, 32768, 1280, 1, "wq_b"}, {T, 512, 5120, 1, "wkv"},
        {T, 1024, 4096, 8, "wo_a (x8 groups)"}, {T, 5120, 8192, 1, "wo_b"}, {T, 512, 5120, 2, "compressor"},
        {T, 4096, 1280, 1, "indexer wq_b"}, {T, 24, 20480, 2, "hc mixes"}, {T, 2304, 5120, 2, "shared w1,w3"},
        {T, 5120, 2304, 1, "shared w2"}, {me, 2304, 5120, 16, "expert w1,w3 (8 experts)"},
        {me, 5120, 2304, 8, "expert w2 (8 experts)"},
    };
    double bare_s = 0;
    double bare = bare_sgemm(sh, (int)(sizeof sh / sizeof sh[0]), threads, &bare_s);
    shape shd[] = {{1, 32768, 1280, 2, "wq_b"}, {1, 5120, 8192, 2, "wo_b"}, {1, 2304, 5120, 8, "expert"}};
    double bare_d = bare_sgemm(shd, 3, threads, NULL);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double rss_gb = ru.ru_maxrss / 1048576.0;
    /* engine GEMM rate: executed flops per wall second of sgemm (thread-seconds / threads) */
    double p_gf = pg_s > 0 ? pg_fl / (pg_s / threads) / 1e9 : 0, d_gf = dg_s > 0 ? dg_fl / (dg_s / threads) / 1e9 : 0;
    double p_frac = pg_s / threads / tp, d_frac = ND ? dg_s / threads / td : 0;
    double p_dq = pq_s / threads / tp, d_dq = ND ? dq_s / threads / td : 0;
    /* whole-layer time over its GEMM (sgemm) time: 1 / gemm fraction (target <= 1.5) */
    double p_ratio = p_frac > 0 ? 1 / p_frac : 0, d_ratio = d_frac > 0 ? 1 / d_frac : 0;
    const int tmode = v41_gemm_tile_mode();
    const char *tdesc = tmode == 1 ? "16 (fixed)" : "1 (fallback)";
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "engine", "ref");
        cJSON_AddStringToObject(j, "precision", "emulate");
        cJSON_AddNumberToObject(j, "threads", threads);
        cJSON_AddNumberToObject(j, "experts", n_exp);
        cJSON_AddNumberToObject(j, "weights_gb", gbytes / 1e9);
        cJSON_AddNumberToObject(j, "prefill_tokens", T);
        cJSON_AddNumberToObject(j, "prefill_s", tp);
        cJSON_AddNumberToObject(j, "prefill_tokens_per_s", T / tp);
        cJSON_AddNumberToObject(j, "prefill_gemm_fraction", p_frac);
        cJSON_AddNumberToObject(j, "prefill_linear_fraction", pl_s / tp);
        cJSON_AddNumberToObject(j, "prefill_gemm_gflops", p_gf);
        cJSON_AddNumberToObject(j, "prefill_dequant_fraction", p_dq);
        cJSON_AddNumberToObject(j, "prefill_layer_over_gemm", p_ratio);
        cJSON_AddNumberToObject(j, "decode_steps", ND);
        cJSON_AddNumberToObject(j, "decode_s", td);
        cJSON_AddNumberToObject(j, "decode_tokens_per_s", ND ? ND / td : 0);
        cJSON_AddNumberToObject(j, "decode_gemm_fraction", d_frac);
        cJSON_AddNumberToObject(j, "decode_linear_fraction", ND ? dl_s / td : 0);
        cJSON_AddNumberToObject(j, "decode_gemm_gflops", d_gf);
        cJSON_AddNumberToObject(j, "decode_dequant_fraction", d_dq);
        cJSON_AddNumberToObject(j, "decode_layer_over_gemm", d_ratio);
        cJSON_AddStringToObject(j, "gemm_column_tiles", tdesc);
        cJSON_AddBoolToObject(j, "malloc_hugetlb", huge_on);
        cJSON_AddNumberToObject(j, "bare_sgemm_gflops", bare);
        cJSON_AddNumberToObject(j, "bare_sgemm_decode_gflops", bare_d);
        cJSON_AddNumberToObject(j, "gemm_vs_bare", bare > 0 ? p_gf / bare : 0);
        cJSON_AddNumberToObject(j, "peak_rss_gb", rss_gb);
        char *s = cJSON_Print(j);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(j);
    } else {
        printf("v41 bench ref: one V4.1-Flash-shaped layer (ratio-2 kv+index source, %d experts), %d threads, emulate\n",
               n_exp, threads);
        printf("  weights (synthetic, storage formats): %.2f GB, built in %.1f s; peak RSS %.2f GB\n", gbytes / 1e9, tgen, rss_gb);
        printf("  prefill %d tokens: %.2f s = %.1f tokens/s; sgemm %.0f%% of the time (layer = %.2fx GEMM), Linear (dequant+sgemm) %.0f%%, dequant %.0f%%\n",
               T, tp, T / tp, 100 * p_frac, p_ratio, 100 * pl_s / tp, 100 * p_dq);
        printf("  decode %d steps: %.2f s = %.2f tokens/s; sgemm %.0f%% of the time (layer = %.2fx GEMM), Linear %.0f%%, dequant %.0f%%\n",
               ND, td, ND ? ND / td : 0, 100 * d_frac, d_ratio, ND ? 100 * dl_s / td : 0, 100 * d_dq);
        printf("  sgemm column tiles: %s; malloc huge pages (glibc.malloc.hugetlb=1): %s\n", tdesc, huge_on ? "on" : "off");
        printf("  engine sgemm: prefill %.1f GFLOP/s, decode %.1f GFLOP/s (executed flops, padded tiles included)\n", p_gf, d_gf);
        printf("  bare cblas_sgemm, same shapes, same run: %.1f GFLOP/s (prefill shapes), %.1f GFLOP/s (M=1)\n", bare, bare_d);
        printf("  engine GEMM / bare sgemm (prefill): %.2f\n", bare > 0 ? p_gf / bare : 0);
    }
    rc = 0;
out:
    free(tok);
    if (e) v41_engine_destroy(e);
    if (m) { v41_weights_close(m->w); free(m); }
    return rc;
}
