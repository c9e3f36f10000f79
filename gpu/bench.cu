// bench.cu: `v41 bench gpu [--json OUT] [--quick]`: ceilings measured in the
// same run (device-to-device copy bandwidth, cuBLAS bf16 GEMM TFLOP/s), then
// every kernel at V4.1-Flash shapes (synthetic weights). Each measurement is
// the median of N timed runs (cudaEvent pairs), the L2 flushed before each run
// outside the timed region (--flush, below). Byte counts are the fewest
// bytes the op must move through device memory (each input read once, each
// output written once); FLOP counts are 2 per multiply-add. JSON schema
// "v41-profile/1" (read by the simulator): {"schema","device","ceilings":
// {"copy_GBps","bf16_gemm_TFLOPs","timing_floor_us","l2_flush"},"ops":[{"op","name","params","flops","bytes",
// "median_s"[,"p10_s","p90_s"]}]} (the percentiles of the same samples, on records timed as one op).
#include "g_internal.cuh"
#include "v41_gpu_dev.h"
#include <algorithm>
#include <functional>
#include <string>
#include <vector>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

namespace {

struct op_rec {
    std::string op, name, params;   // params: JSON object text
    double flops, bytes, median_s;
    double p10_s, p90_s;   // the 10th and 90th percentile of the same samples (-1: not a single timing)
};

// How the L2 is emptied before each timed run (--flush):
//  clean  (default) a read-only sweep over a 256 MiB buffer: every line an earlier run left dirty is
//         written back during the sweep, and the L2 then holds clean lines of an unrelated buffer.
//         The op pays for its own misses, not for another buffer's write-back; as in a decode step,
//         where the kernels before an op mostly read (weights, caches).
//  dirty  a 256 MiB memset (sessions 1-20): the L2 is left full of dirty lines of the flush buffer,
//         so a timed op that misses also writes back up to an L2's worth of them (60 MB on the
//         H200), in proportion to its own footprint: a cache-sized op (the batch-64 attention reads
//         50 MB) pays nearly all of it, and bf16 cuBLAS twice what an fp8 kernel of the shape pays.
//  drain  clean, and the timed run is the op followed by a read sweep of a second 256 MiB buffer,
//         minus the same sweep alone timed right before (a paired difference): the op's time
//         including the write-back of what it left dirty in the L2. It overcharges writes somewhat:
//         the sweep also loses its read-only streaming rate while that write-back shares DRAM.
enum flush_mode { FLUSH_CLEAN, FLUSH_DIRTY, FLUSH_DRAIN };

__global__ void flush_read_kernel(const uint4 *__restrict__ p, size_t n, unsigned *sink)
{
    unsigned x = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x9E3779B9u) *sink = x;   // the buffer is zeros: never taken, but the loads must stay
}

struct bench {
    cudaStream_t st = 0;
    void *flush = NULL, *drain = NULL;
    size_t flush_bytes = 256u << 20;
    flush_mode mode = FLUSH_CLEAN;
    int reps = 15;
    double copy_GBps = 0, gemm_TFLOPs = 0;
    double floor_s = 0;   // one empty kernel timed like every op (graph launch + events): see ceilings()
    std::vector<op_rec> ops;
    struct stat3 { double med, p10, p90; };
    std::vector<stat3> recent;   // of the latest timings (the last 16), found by rec() by their median
    std::vector<void *> allocs;

    void *alloc(size_t n) {
        void *p = v41g_malloc(n);
        if (!p) { fprintf(stderr, "v41 bench gpu: cudaMalloc(%zu) failed\n", n); exit(2); }
        allocs.push_back(p);
        return p;
    }
    void free_all() { for (void *p : allocs) v41g_free(p); allocs.clear(); }

    // Median seconds of fn over reps runs (2 warm-ups), L2 flushed before each.
    // fn is captured once into a CUDA graph and the graph is replayed, so host
    // launch overhead (attribute calls, allocations, cuBLAS setup) stays out of
    // the device time, as in a graph-replayed decode step; graph = false for
    // code that synchronises with the host (MoE: per-expert row counts).
    // FLUSH_DRAIN: the drain sweep follows fn in the same graph, and each sample is paired with a
    // sweep alone launched the same way right before it; the median of the differences is returned
    // (pairing cancels the drift of the sweep's own time with the clocks).
    double time(const std::function<int()> &fn, int nrep = 0, bool graph = true) { return times({fn}, nrep, graph)[0]; }
    // The same for several ops at once, their samples interleaved (rep r of each, then rep r + 1):
    // ratios between them are then free of the drift of clocks and temperature between sections.
    std::vector<double> times(const std::vector<std::function<int()>> &fns, int nrep = 0, bool graph = true) {
        if (nrep <= 0 || nrep > reps) nrep = reps;
        const bool drain_on = mode == FLUSH_DRAIN;
        const size_t n = fns.size();
        cudaEvent_t a, b;
        cudaEventCreate(&a); cudaEventCreate(&b);
        for (const auto &fn : fns)
            for (int w = 0; w < 2; w++) if (fn()) { fprintf(stderr, "v41 bench gpu: kernel failed\n"); exit(2); }
        auto capture = [&](const std::function<int()> &f) {
            cudaGraphExec_t ge = NULL;
            cudaGraph_t g = NULL;
            if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
                int rc = f();
                cudaError_t e = cudaStreamEndCapture(st, &g);
                if (rc || e != cudaSuccess || cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) ge = NULL;
                if (g) cudaGraphDestroy(g);
            }
            cudaGetLastError();
            if (ge) cudaGraphLaunch(ge, st);   // warm-up of the graph itself
            return ge;
        };
        const std::function<int()> sw = [&] { sweep(drain); return (int)cudaGetLastError(); };
        std::vector<std::function<int()>> run(n);   // what one timed sample runs: the op (+ the drain sweep)
        std::vector<cudaGraphExec_t> ge(n, (cudaGraphExec_t)NULL);
        for (size_t i = 0; i < n; i++) {
            run[i] = drain_on ? std::function<int()>([&, i] { int rc = fns[i](); return rc ? rc : sw(); }) : fns[i];
            if (graph) ge[i] = capture(run[i]);
        }
        cudaGraphExec_t gs = graph && drain_on ? capture(sw) : NULL;
        auto one = [&](int r, cudaGraphExec_t g, const std::function<int()> &f) {
            flush_l2(r);
            cudaEventRecord(a, st);
            if (g) cudaGraphLaunch(g, st);
            else f();
            cudaEventRecord(b, st);
            cudaEventSynchronize(b);
            float ms = 0;
            cudaEventElapsedTime(&ms, a, b);
            return ms * 1e-3;
        };
        std::vector<std::vector<double>> ts(n);
        for (int r = 0; r < nrep; r++)
            for (size_t i = 0; i < n; i++) {
                const double t0 = drain_on ? one(r, gs, sw) : 0.0;
                ts[i].push_back(one(r, ge[i], run[i]) - t0);
            }
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) { fprintf(stderr, "v41 bench gpu: %s\n", cudaGetErrorString(e)); exit(2); }
        cudaEventDestroy(a); cudaEventDestroy(b);
        for (cudaGraphExec_t g : ge) if (g) cudaGraphExecDestroy(g);
        if (gs) cudaGraphExecDestroy(gs);
        std::vector<double> med(n);
        for (size_t i = 0; i < n; i++) {
            std::vector<double> &t = ts[i];
            std::sort(t.begin(), t.end());
            med[i] = t[t.size() / 2];
            recent.push_back({med[i], t[t.size() / 10], t[std::min(t.size() - 1, t.size() * 9 / 10)]});
        }
        if (recent.size() > 16) recent.erase(recent.begin(), recent.end() - 16);
        return med;
    }
    void sweep(void *buf) {
        flush_read_kernel<<<(unsigned)g_num_sms() * 4, 512, 0, st>>>((const uint4 *)buf, flush_bytes / 16,
                                                                     (unsigned *)buf);
    }
    void flush_l2(int r) {
        if (mode == FLUSH_DIRTY) cudaMemsetAsync(flush, r & 0xff, flush_bytes, st);
        else sweep(flush);
    }
    int setup() {
        flush = v41g_malloc(flush_bytes);
        drain = v41g_malloc(flush_bytes);
        if (!flush || !drain) { fprintf(stderr, "v41 bench gpu: cudaMalloc of the flush buffers failed\n"); return 2; }
        cudaMemsetAsync(flush, 0, flush_bytes, st);
        cudaMemsetAsync(drain, 0, flush_bytes, st);
        return cudaStreamSynchronize(st) == cudaSuccess ? 0 : 2;
    }
    void rec(const char *op, const std::string &name, const std::string &params, double flops, double bytes,
             double t) {
        double p10 = -1, p90 = -1;   // a record timed by one of the latest time() calls (not a sum of them)
        for (auto r = recent.rbegin(); r != recent.rend(); ++r)
            if (r->med == t) { p10 = r->p10; p90 = r->p90; break; }
        ops.push_back({op, name, params, flops, bytes, t, p10, p90});
        double gbs = bytes / t * 1e-9, tf = flops / t * 1e-12;
        printf("%-12s %-34s %10.2f us %9.1f GB/s (%5.1f%% copy) %8.1f TFLOP/s (%5.1f%% gemm)  %s\n", op,
               name.c_str(), t * 1e6, gbs, copy_GBps > 0 ? 100 * gbs / copy_GBps : 0, tf,
               gemm_TFLOPs > 0 ? 100 * tf / gemm_TFLOPs : 0, params.c_str());
        fflush(stdout);
    }
};

std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char *f, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

// V4.1-Flash shapes (SPEC §1)
const int D = 5120, H = 64, HD = 512, R = 64, QL = 1280, G = 8, OL = 1024, W = 128;
const int NI = 32, DI = 128, TOPK = 512, E = 384, KA = 6, IM = 2304, HC = 4;

__global__ void empty_kernel() {}

void ceilings(bench &B)
{
    // The timing floor: a graph of one empty kernel, timed exactly as every op below (events around
    // one graph launch). Every record includes it once; a small op of a few tens of microseconds
    // cannot amortise it, a kernel inside a graph-replayed step pays only the kernel-to-kernel gap.
    B.floor_s = B.time([&] {
        empty_kernel<<<1, 32, 0, B.st>>>();
        return (int)cudaGetLastError();
    });
    size_t n = (size_t)2 << 30;   // 2 GiB each way
    void *a = B.alloc(n), *b = B.alloc(n);
    v41g_fill_bf16((uint16_t *)a, n / 2, 1, 1.0f, B.st);
    // (not graph-captured: a graph's memcpy node may run on a copy engine, slower than the stream copy)
    double t = B.time([&] { return (int)cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, B.st); }, 10, false);
    B.copy_GBps = 2.0 * n / t * 1e-9;
    B.rec("copy", "d2d_copy_2GiB", "{\"bytes\":2147483648}", 0, 2.0 * n, t);
    B.ops.pop_back();   // a ceiling, not an op of the model: reported under "ceilings" only
    // bf16 GEMM ceiling: the square 8192 problem and the model's largest shapes, random data
    struct { int M, N, K; const char *nm; } sh[] = {
        {8192, 8192, 8192, "square_8192"}, {4096, 32768, 1280, "wq_b_M4096"}, {4096, 5120, 8192, "wo_b_M4096"},
        {4096, 4608, 5120, "w13_M4096"}};
    uint16_t *x = (uint16_t *)B.alloc((size_t)8192 * 8192 * 2), *w = (uint16_t *)B.alloc((size_t)32768 * 8192 * 2),
             *y = (uint16_t *)B.alloc((size_t)4096 * 32768 * 2);
    v41g_fill_bf16(x, (size_t)8192 * 8192, 2, 1.0f, B.st);
    v41g_fill_bf16(w, (size_t)32768 * 8192, 3, 0.05f, B.st);
    for (auto &s : sh) {
        double tt = B.time([&] { return v41g_gemm_bf16(x, w, y, s.M, s.N, s.K, 0, 1, 0, 0, 0, B.st); }, 10);
        double fl = 2.0 * s.M * s.N * s.K;
        B.gemm_TFLOPs = std::max(B.gemm_TFLOPs, fl / tt * 1e-12);
        B.rec("gemm", std::string("ceiling_") + s.nm, fmt("{\"M\":%d,\"N\":%d,\"K\":%d}", s.M, s.N, s.K), fl,
              2.0 * ((double)s.M * s.K + (double)s.N * s.K + (double)s.M * s.N), tt);
    }
    B.free_all();
}

void gemms(bench &B, bool quick)
{
    struct { const char *nm; int N, K, batch; } sh[] = {
        {"wq_a", QL, D, 1}, {"wq_b", H * HD, QL, 1}, {"wkv", HD, D, 1}, {"wo_a_grouped", OL, H * HD / G, G},
        {"wo_b", D, G * OL, 1}, {"shared_w13", 2 * IM, D, 1}, {"shared_w2", D, IM, 1}, {"idx_wq_b", NI * DI, QL, 1}};
    int Ms[] = {1, 64, 512, 4096};
    uint16_t *x = (uint16_t *)B.alloc((size_t)4096 * 32768 * 2), *w = (uint16_t *)B.alloc((size_t)32768 * 8192 * 2),
             *y = (uint16_t *)B.alloc((size_t)4096 * 32768 * 2);
    v41g_fill_bf16(x, (size_t)4096 * 32768, 4, 1.0f, B.st);
    v41g_fill_bf16(w, (size_t)32768 * 8192, 5, 0.05f, B.st);
    for (auto &s : sh)
        for (int M : Ms) {
            if (quick && M != 64) continue;
            long long sx = (long long)M * s.K, sw = (long long)s.N * s.K, sy = (long long)M * s.N;
            // wo_a: o[M, G, Hd/G] read group by group (row stride H*d), u[M, G, o_lora]
            bool grp = s.batch > 1;
            if (grp) { sx = s.K; sy = s.N; }
            double t = B.time([&] { return v41g_gemm_bf16_ld(x, grp ? s.K * s.batch : s.K, w, y, grp ? s.N * s.batch : s.N,
                                                             M, s.N, s.K, 0, s.batch, sx, sw, sy, B.st); });
            double fl = 2.0 * M * s.N * s.K * s.batch;
            double by = 2.0 * ((double)M * s.K + (double)s.N * s.K + (double)M * s.N) * s.batch;
            B.rec("gemm", fmt("%s_M%d", s.nm, M), fmt("{\"M\":%d,\"N\":%d,\"K\":%d,\"batch\":%d}", M, s.N, s.K, s.batch),
                  fl, by, t);
        }
    B.free_all();
}

// number of distinct expert ids in a device array of n ids (the experts whose weights a MoE step reads)
int distinct_experts(const int32_t *d_idx, size_t n)
{
    std::vector<int32_t> h(n);
    v41g_sync();
    v41g_d2h(h.data(), d_idx, n * 4);
    std::vector<char> seen(E, 0);
    int c = 0;
    for (int32_t e : h) if (e >= 0 && e < E && !seen[e]) { seen[e] = 1; c++; }
    return c;
}

// random sorted top-k positions in [0, n) per row (host), offset by base
void rand_sorted(std::vector<int32_t> &dst, int k, int n, int64_t base, uint64_t &seed)
{
    std::vector<int32_t> pick;
    pick.reserve(k);
    std::vector<char> used(n, 0);
    while ((int)pick.size() < std::min(k, n)) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        int p = (int)((seed >> 33) % (uint64_t)n);
        if (!used[p]) { used[p] = 1; pick.push_back(p); }
    }
    std::sort(pick.begin(), pick.end());
    for (int p : pick) dst.push_back((int32_t)(p + base));
    for (int i = (int)pick.size(); i < k; i++) dst.push_back(-1);
}

void attention(bench &B, bool quick)
{
    int batches[] = {1, 8, 64, 256};
    int ctxs[] = {8192, 65536};
    const int L = W + TOPK;
    const float scale = 1.0f / sqrtf((float)HD);
    float *sink = (float *)B.alloc(H * 4);
    v41g_fill_f32(sink, H, 9, 1.0f, B.st);
    for (int C : ctxs)
        for (int b : batches) {
            if (quick && (b > 64 || C > 8192)) continue;
            // pools: window rings [b, W, d]; compressed caches [b, C, d] (ratio 1: C positions)
            uint16_t *q = (uint16_t *)B.alloc((size_t)b * H * HD * 2), *o = (uint16_t *)B.alloc((size_t)b * H * HD * 2);
            uint16_t *kw = (uint16_t *)B.alloc((size_t)b * W * HD * 2), *kc = (uint16_t *)B.alloc((size_t)b * C * HD * 2);
            v41g_fill_bf16(q, (size_t)b * H * HD, 10, 1.0f, B.st);
            v41g_fill_bf16(kw, (size_t)b * W * HD, 11, 1.0f, B.st);
            v41g_fill_bf16(kc, (size_t)b * C * HD, 12, 1.0f, B.st);
            std::vector<int32_t> idx;
            uint64_t seed = 77;
            for (int r = 0; r < b; r++) {
                for (int j = 0; j < W; j++) idx.push_back(r * W + j);
                rand_sorted(idx, TOPK, C, (int64_t)r * C, seed);
            }
            int32_t *di = (int32_t *)B.alloc(idx.size() * 4);
            v41g_h2d(di, idx.data(), idx.size() * 4);
            double t = B.time([&] { return v41g_sparse_attn(q, kw, kc, di, L, W, sink, scale, b, H, HD, o, B.st); });
            double fl = 4.0 * b * H * L * HD;
            double by = (double)b * (L * HD * 2.0 + 2.0 * H * HD * 2 + L * 4.0);
            B.rec("attn_decode", fmt("attn_decode_b%d_ctx%dK", b, C / 1024),
                  fmt("{\"batch\":%d,\"context\":%d,\"heads\":%d,\"head_dim\":%d,\"window\":%d,\"topk\":%d}", b, C, H,
                      HD, W, TOPK), fl, by, t);
            B.free_all();
            sink = (float *)B.alloc(H * 4);
            v41g_fill_f32(sink, H, 9, 1.0f, B.st);
        }
    // prefill: one request of T rows, window part min(T,W) + top-512 compressed (ratio 1)
    {
        int T = quick ? 256 : 4096;
        uint16_t *q = (uint16_t *)B.alloc((size_t)T * H * HD * 2), *o = (uint16_t *)B.alloc((size_t)T * H * HD * 2);
        uint16_t *kw = (uint16_t *)B.alloc((size_t)T * HD * 2);
        v41g_fill_bf16(q, (size_t)T * H * HD, 13, 1.0f, B.st);
        v41g_fill_bf16(kw, (size_t)T * HD, 14, 1.0f, B.st);
        std::vector<int32_t> idx;
        uint64_t seed = 5;
        for (int t = 0; t < T; t++) {
            int lo = std::max(0, t - W + 1);
            for (int j = 0; j < W; j++) idx.push_back(lo + j <= t ? lo + j : -1);
            rand_sorted(idx, TOPK, t + 1, 0, seed);
        }
        int32_t *di = (int32_t *)B.alloc(idx.size() * 4);
        v41g_h2d(di, idx.data(), idx.size() * 4);
        double t = B.time([&] { return v41g_sparse_attn(q, kw, kw, di, W + TOPK, W, sink, 1.0f / sqrtf((float)HD), T,
                                                        H, HD, o, B.st); }, 5);
        B.rec("attn_prefill", fmt("attn_prefill_T%d", T), fmt("{\"T\":%d,\"heads\":%d,\"head_dim\":%d,\"L\":%d}", T,
              H, HD, W + TOPK), 4.0 * T * H * (W + TOPK) * HD,
              (double)T * (HD * 2.0 + 2.0 * H * HD * 2 + (W + TOPK) * 4.0), t);
        B.free_all();
    }
}

void indexer(bench &B, bool quick)
{
    int batches[] = {1, 64};
    int Ss[] = {8192, 65536};
    for (int S : Ss)
        for (int b : batches) {
            uint16_t *q = (uint16_t *)B.alloc((size_t)b * NI * DI * 2), *k = (uint16_t *)B.alloc((size_t)b * S * DI * 2);
            float *w = (float *)B.alloc((size_t)b * NI * 4), *I = (float *)B.alloc((size_t)b * S * 4);
            int32_t *out = (int32_t *)B.alloc((size_t)b * TOPK * 4), *vis = (int32_t *)B.alloc(b * 4);
            int64_t *kb = (int64_t *)B.alloc(b * 8);
            v41g_fill_bf16(q, (size_t)b * NI * DI, 20, 1.0f, B.st);
            v41g_fill_bf16(k, (size_t)b * S * DI, 21, 1.0f, B.st);
            v41g_fill_f32(w, (size_t)b * NI, 22, 0.1f, B.st);
            std::vector<int32_t> hv(b, S);
            std::vector<int64_t> hb(b);
            for (int r = 0; r < b; r++) hb[r] = (int64_t)r * S;
            v41g_h2d(vis, hv.data(), b * 4);
            v41g_h2d(kb, hb.data(), b * 8);
            std::string p = fmt("{\"batch\":%d,\"positions\":%d,\"heads\":%d,\"head_dim\":%d,\"topk\":%d}", b, S, NI, DI, TOPK);
            double ts = B.time([&] { return v41g_indexer_scores(q, w, k, kb, vis, b, NI, DI, S, I, B.st); });
            B.rec("indexer", fmt("indexer_scores_b%d_S%dK", b, S / 1024), p, 2.0 * b * S * NI * DI,
                  (double)b * (S * DI * 2.0 + S * 4.0 + NI * DI * 2), ts);
            double tk = B.time([&] { return v41g_topk(I, vis, b, S, TOPK, out, NULL, B.st); });
            B.rec("indexer", fmt("indexer_topk_b%d_S%dK", b, S / 1024), p, 0, (double)b * (S * 4.0 + TOPK * 4.0), tk);
            double tb = B.time([&] {
                int rc = v41g_indexer_scores(q, w, k, kb, vis, b, NI, DI, S, I, B.st);
                return rc ? rc : v41g_topk(I, vis, b, S, TOPK, out, NULL, B.st);
            });
            B.rec("indexer", fmt("indexer_total_b%d_S%dK", b, S / 1024), p, 2.0 * b * S * NI * DI,
                  (double)b * (S * DI * 2.0 + NI * DI * 2 + TOPK * 4.0), tb);
            B.free_all();
            if (quick) break;
        }
}

// One MoE layer on T random tokens: the bf16 gate GEMM, routing, v41g_moe_ffn(m) (m.T = T). Median
// time; *ne = the experts that got tokens (their weights are the bytes read).
double time_moe(bench &B, v41g_moe m, const uint16_t *gateW, int T, bool graph, int *ne)
{
    uint16_t *x = (uint16_t *)B.alloc((size_t)T * D * 2), *out = (uint16_t *)B.alloc((size_t)T * D * 2);
    float *logits = (float *)B.alloc((size_t)T * E * 4), *wts = (float *)B.alloc((size_t)T * KA * 4);
    int32_t *idx = (int32_t *)B.alloc((size_t)T * KA * 4);
    v41g_fill_bf16(x, (size_t)T * D, 35, 1.0f, B.st);
    m.T = T;
    void *ws = B.alloc(v41g_moe_ws_size(&m));
    auto run = [&] {
        int rc = v41g_gemm_bf16(x, gateW, logits, T, E, D, 1, 1, 0, 0, 0, B.st);
        if (!rc) rc = v41g_moe_route(logits, NULL, T, E, KA, 0, 1.0f, 1, 1.5f, idx, wts, B.st);
        if (!rc) rc = v41g_moe_ffn(&m, x, idx, wts, ws, out, B.st);
        return rc;
    };
    double t = B.time(run, 7, graph);
    *ne = distinct_experts(idx, (size_t)T * KA);
    return t;
}
// Dense cuBLAS at the MoE's FLOPs: [T*(k+1), D] x [2I, D]^T then [T*(k+1), I] x [D, I]^T, over
// w13/w2 (one expert's bf16 weights; NULL: random ones allocated here).
double time_moe_dense(bench &B, int T, const uint16_t *w13, const uint16_t *w2)
{
    const int M = T * (KA + 1);
    if (!w13 || !w2) {
        uint16_t *a = (uint16_t *)B.alloc((size_t)2 * IM * D * 2), *b = (uint16_t *)B.alloc((size_t)D * IM * 2);
        v41g_fill_bf16(a, (size_t)2 * IM * D, 30, 0.02f, B.st);
        v41g_fill_bf16(b, (size_t)D * IM, 31, 0.02f, B.st);
        w13 = a;
        w2 = b;
    }
    uint16_t *xa = (uint16_t *)B.alloc((size_t)M * D * 2), *ha = (uint16_t *)B.alloc((size_t)M * 2 * IM * 2),
             *ya = (uint16_t *)B.alloc((size_t)M * D * 2);
    v41g_fill_bf16(xa, (size_t)M * D, 36, 1.0f, B.st);
    return B.time([&] {
        int rc = v41g_gemm_bf16(xa, w13, ha, M, 2 * IM, D, 0, 1, 0, 0, 0, B.st);
        return rc ? rc : v41g_gemm_bf16(ha, w2, ya, M, D, IM, 0, 1, 0, 0, 0, B.st);
    }, 7);
}

void moe(bench &B, bool quick)
{
    size_t w13n = (size_t)E * 2 * IM * D, w2n = (size_t)E * D * IM;
    uint16_t *w13 = (uint16_t *)B.alloc(w13n * 2), *w2 = (uint16_t *)B.alloc(w2n * 2);
    uint16_t *w13s = (uint16_t *)B.alloc((size_t)2 * IM * D * 2), *w2s = (uint16_t *)B.alloc((size_t)D * IM * 2);
    float *wg = (float *)B.alloc((size_t)E * D * 4);   (void)wg;
    v41g_fill_bf16(w13, w13n, 30, 0.02f, B.st);
    v41g_fill_bf16(w2, w2n, 31, 0.02f, B.st);
    v41g_fill_bf16(w13s, (size_t)2 * IM * D, 32, 0.02f, B.st);
    v41g_fill_bf16(w2s, (size_t)D * IM, 33, 0.02f, B.st);
    uint16_t *gateW = (uint16_t *)B.alloc((size_t)E * D * 2);
    v41g_fill_bf16(gateW, (size_t)E * D, 34, 0.02f, B.st);
    int Ts[] = {512, 4096};
    for (int T : Ts) {
        if (quick && T != 512) continue;
        int ne;
        const v41g_moe m = {T, D, IM, E, KA, 10.0f, w13, w2, w13s, w2s, NULL, NULL, NULL, NULL};
        double t = time_moe(B, m, gateW, T, false, &ne);
        // weights read: the experts that got tokens + shared + gate
        double fl = 2.0 * T * (KA + 1) * 3.0 * D * IM + 2.0 * T * E * D;
        double by = ne * 3.0 * IM * D * 2 + 3.0 * IM * D * 2 + E * D * 2.0 + 2.0 * T * D * 2;
        B.rec("moe", fmt("moe_T%d", T), fmt("{\"T\":%d,\"experts\":%d,\"active\":%d,\"shared\":1,\"dim\":%d,\"inter\":%d,"
              "\"weights\":\"bf16\"}", T, E, KA, D, IM), fl, by, t);
        // dense cuBLAS at equal FLOPs
        const int M = T * (KA + 1);
        double td = time_moe_dense(B, T, w13, w2);
        B.rec("gemm", fmt("moe_dense_equiv_T%d", T), fmt("{\"M\":%d,\"N1\":%d,\"N2\":%d,\"K1\":%d,\"K2\":%d}", M,
              2 * IM, D, D, IM), 2.0 * M * 3.0 * D * IM, 2.0 * (3.0 * IM * D + 2.0 * M * D + 3.0 * M * IM), td);
    }
    B.free_all();
}

// ---- Linears over weights in their storage formats (v41g_wq)
// Codes and scales as the checkpoint stores them, dequantized inside the GEMM: fp8 at the
// attention and shared-expert shapes of the gemm section, fp4 at the routed experts' shapes, and
// the MoE over fp4 experts with an fp8 shared expert. Synthetic weights: random code bytes (fp8:
// bit 3 cleared, so the exponent field is even and never 15: no NaN code 0x7F/0xFF, subnormals
// and both signs kept; fp4: any byte), every e8m0 scale 120 (2^-7). Bytes count the codes and
// scales read once. Records are op "wq" (a class of their own: the simulator's bf16 "gemm" and
// "moe" fits stay bf16-only); params compare with bf16 in the same run: "vs_cublas_bf16" = this
// time / bf16 cuBLAS at the same shape, timed here with each record's op, their samples interleaved
// (B.times: since session 21; before, the gemm section's record, taken minutes earlier), and
// "cublas_bf16_s" that cuBLAS time; and for the MoE "vs_dense" = this time / the dense cuBLAS GEMMs
// of equal FLOPs (moe_dense_equiv) and "vs_moe_bf16" = this time / the bf16-weight MoE (when the
// moe section ran).
__global__ void g_bench_bytes_kernel(uint8_t *p, size_t n, uint64_t seed, uint32_t mask)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);   // splitmix64 of the index
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    p[i] = (uint8_t)((z ^ (z >> 31)) & mask);
}
void fill_bytes(bench &B, uint8_t *p, size_t n, uint64_t seed, uint32_t mask)
{
    g_bench_bytes_kernel<<<(unsigned)((n + 255) / 256), 256, 0, B.st>>>(p, n, seed, mask);
}
const uint32_t FP8_CODES = 0xf7, FP4_CODES = 0xff;
void fill_scales(bench &B, uint8_t *p, size_t n) { cudaMemsetAsync(p, 120, n, B.st); }   // e8m0 2^-7

// Bytes of a storage-format Linear: codes + e8m0 scales (fp8: 32 x 32 blocks; fp4: 1 x 32 groups).
double stored_bytes(const v41g_wq &q)
{
    return q.fmt == V41G_WQ_FP8 ? (double)q.N * q.K + (double)((q.N + 31) / 32) * (q.K / 32)
                                : (double)q.N * q.K / 2 + (double)q.N * (q.K / 32);
}

// An fp8 Linear [N][K] (e4m3 codes from seed, e8m0 scales per 32 x 32 block). Random codes stand
// for tiled codes: the callers' shapes are whole 128 x 64 tiles, where both sizes agree.
v41g_wq fp8_weight(bench &B, int N, int K, uint64_t seed)
{
    const size_t nc = (size_t)N * K, ns = (size_t)((N + 31) / 32) * (K / 32);
    uint8_t *c = (uint8_t *)B.alloc(nc), *sc = (uint8_t *)B.alloc(ns);
    fill_bytes(B, c, nc, seed, FP8_CODES);
    fill_scales(B, sc, ns);
    return v41g_wq{V41G_WQ_FP8, N, K, 0, c, sc, 0, 0};
}

// The Flash MoE's experts in their storage format (whole tiles: 2I = 4608, D = 5120, I = 2304):
// routed experts fp4 (w1|w3 [E][2I][D/2] + scales [E][2I][D/32], w2 [E][D][I/2] + [E][D][I/32]),
// the shared expert fp8 (w1|w3 [2I][D], w2 [D][I], 32 x 32 scale blocks). Codes from seed ..
// seed + 3 (routed w1|w3, routed w2, shared w1|w3, shared w2). Bytes: one routed expert's codes +
// scales, and the shared expert's.
struct moe_storage {
    v41g_wq W13, W2, W13s, W2s;
    double expert_bytes, shared_bytes;
};
moe_storage make_moe_storage(bench &B, uint64_t seed)
{
    const size_t c13 = (size_t)2 * IM * D / 2, s13 = (size_t)2 * IM * (D / 32), c2 = (size_t)D * IM / 2,
                 s2 = (size_t)D * (IM / 32);
    uint8_t *q13 = (uint8_t *)B.alloc(E * c13), *q13sc = (uint8_t *)B.alloc(E * s13);
    uint8_t *q2 = (uint8_t *)B.alloc(E * c2), *q2sc = (uint8_t *)B.alloc(E * s2);
    fill_bytes(B, q13, E * c13, seed, FP4_CODES);
    fill_bytes(B, q2, E * c2, seed + 1, FP4_CODES);
    fill_scales(B, q13sc, E * s13);
    fill_scales(B, q2sc, E * s2);
    moe_storage m;
    m.W13 = {V41G_WQ_FP4, 2 * IM, D, 0, q13, q13sc, (long long)c13, (long long)s13};
    m.W2 = {V41G_WQ_FP4, D, IM, 0, q2, q2sc, (long long)c2, (long long)s2};
    m.W13s = fp8_weight(B, 2 * IM, D, seed + 2);
    m.W2s = fp8_weight(B, D, IM, seed + 3);
    m.expert_bytes = stored_bytes(m.W13) + stored_bytes(m.W2);
    m.shared_bytes = stored_bytes(m.W13s) + stored_bytes(m.W2s);
    return m;
}

// median_s of the first record of op whose name (if non-empty) and params (if non-empty) match; -1: none
double find_op(const bench &B, const char *op, const std::string &name, const std::string &params)
{
    for (const op_rec &o : B.ops)
        if (o.op == op && (name.empty() || o.name == name) && (params.empty() || o.params == params)) return o.median_s;
    return -1;
}

// The weight dequantized into scratch (2 N K bytes), then a cuBLAS bf16 GEMM: what the engines'
// packed Linears (v41g_wq_linear) run from V41G_WQ_DEQUANT_ROWS rows on
int dequant_cublas(const v41g_wq &q, const uint16_t *in, int M, uint16_t *out, void *scratch, cudaStream_t st)
{
    int r = v41g_wq_dequant(&q, 0, (uint16_t *)scratch, st);
    return r ? r : v41g_gemm_bf16(in, (const uint16_t *)scratch, out, M, q.N, q.K, 0, 1, 0, 0, 0, st);
}
// --match: keep a wq record only when its name contains the string
bool skip_rec(const char *match, const std::string &name) { return match && !strstr(name.c_str(), match); }

void wq(bench &B, bool quick, const char *match)
{
    struct { const char *nm; int fmt, N, K; } sh[] = {
        {"wq_a", V41G_WQ_FP8, QL, D}, {"wq_b", V41G_WQ_FP8, H * HD, QL}, {"wkv", V41G_WQ_FP8, HD, D},
        {"wo_b", V41G_WQ_FP8, D, G * OL}, {"shared_w13", V41G_WQ_FP8, 2 * IM, D}, {"shared_w2", V41G_WQ_FP8, D, IM},
        {"idx_wq_b", V41G_WQ_FP8, NI * DI, QL}, {"expert_w13", V41G_WQ_FP4, 2 * IM, D}, {"expert_w2", V41G_WQ_FP4, D, IM}};
    const int M8[] = {1, 64, 512, 4096}, M4[] = {1, 8, 64, 512};
    {
        size_t wmax = 0, smax = 0, nbf = 0;
        for (auto &s : sh) {
            wmax = std::max(wmax, s.fmt == V41G_WQ_FP8 ? (size_t)s.N * s.K : (size_t)s.N * s.K / 2);
            smax = std::max(smax, s.fmt == V41G_WQ_FP8 ? (size_t)(s.N + 31) / 32 * (s.K / 32) : (size_t)s.N * (s.K / 32));
            nbf = std::max(nbf, (size_t)s.N * s.K);
        }
        uint8_t *codes = (uint8_t *)B.alloc(wmax), *scales = (uint8_t *)B.alloc(smax);
        uint16_t *x = (uint16_t *)B.alloc((size_t)4096 * 8192 * 2), *y = (uint16_t *)B.alloc((size_t)4096 * 32768 * 2);
        uint16_t *wb = NULL;   // bf16 weights for cuBLAS, only when the gemm section did not run
        uint16_t *wd = NULL;   // the engine's dequantized-weight scratch (M >= V41G_WQ_DEQUANT_ROWS)
        uint8_t *x8 = NULL;    // the fp8 MMA path's input codes and scales (v41g_act_quant_f8)
        float *xs = NULL;
        fill_bytes(B, codes, wmax, 50, FP8_CODES);
        fill_scales(B, scales, smax);
        v41g_fill_bf16(x, (size_t)4096 * 8192, 51, 1.0f, B.st);
        size_t wsmax = 0;   // the full split-K workspace of every call
        for (auto &s : sh) {
            v41g_wq W = {s.fmt, s.N, s.K, 0, codes, scales, 0, 0};
            for (int i = 0; i < 4; i++) wsmax = std::max(wsmax, v41g_wq_ws_bytes(&W, s.fmt == V41G_WQ_FP8 ? M8[i] : M4[i]));
        }
        void *ws = wsmax ? B.alloc(wsmax) : NULL;
        bool fp4_codes = false;
        for (auto &s : sh) {
            const bool f8 = s.fmt == V41G_WQ_FP8;
            // random codes stand for tiled codes directly: these shapes are whole 128 x 64 tiles,
            // so the tiled and the row-major sizes agree (and no padding is needed)
            if (v41g_wq_tiled_bytes(s.fmt, s.N, s.K) != (f8 ? (size_t)s.N * s.K : (size_t)s.N * s.K / 2)) {
                fprintf(stderr, "v41 bench gpu: %s is not a whole number of tiles\n", s.nm);
                exit(2);
            }
            if (!f8 && !fp4_codes) { fill_bytes(B, codes, wmax, 52, FP4_CODES); fp4_codes = true; }
            v41g_wq W = {s.fmt, s.N, s.K, 0, codes, scales, 0, 0};
            const double wby = stored_bytes(W);
            // the dequantization alone (the first half of the large-M path): bytes = codes + scales
            // read, the bf16 weight written
            const std::string dn = fmt("%s_%s_dequant", s.nm, f8 ? "fp8" : "fp4");
            if (!quick && !skip_rec(match, dn)) {
                if (!wd) wd = (uint16_t *)B.alloc(nbf * 2);
                double t = B.time([&] { return v41g_wq_dequant(&W, 0, wd, B.st); });
                B.rec("wq", dn, fmt("{\"N\":%d,\"K\":%d,\"weights\":\"%s\"}", s.N, s.K, f8 ? "fp8" : "fp4"), 0,
                      wby + 2.0 * s.N * s.K, t);
            }
            for (int i = 0; i < 4; i++) {
                const int M = f8 ? M8[i] : M4[i];
                if (quick && M != (f8 ? 64 : 8)) continue;
                const std::string nm = fmt("%s_%s_M%d", s.nm, f8 ? "fp8" : "fp4", M);
                // from V41G_WQ_DEQUANT_ROWS rows on, also what the engine runs there (v41g_wq_linear):
                // the weight dequantized to a bf16 scratch, then the cuBLAS bf16 GEMM
                const bool want_k = !skip_rec(match, nm),
                           want_d = M >= V41G_WQ_DEQUANT_ROWS && !skip_rec(match, nm + "_deq_cublas");
                // the fp8 MMA path (gpu/k_wq_f8.cu) from 128 rows: the GEMM alone (its input codes
                // and scales prepared), and with the quantization of the bf16 input (what the engine runs)
                const bool want_f = f8 && M >= 128 && !skip_rec(match, nm + "_f8mma") && v41g_wq_f8_ok(&W);
                if (!want_k && !want_d && !want_f) continue;
                // bf16 cuBLAS at the same shape, timed with each record's op, samples interleaved
                if (!wb) {
                    wb = (uint16_t *)B.alloc(nbf * 2);
                    v41g_fill_bf16(wb, nbf, 53, 0.05f, B.st);
                }
                const std::function<int()> cub = [&] { return v41g_gemm_bf16(x, wb, y, M, s.N, s.K, 0, 1, 0, 0, 0, B.st); };
                double tc = -1;   // the latest paired cuBLAS time (for the fp8 MMA records)
                if (want_k) {
                    const size_t wsb = v41g_wq_ws_bytes(&W, M);
                    const std::vector<double> tt = B.times({[&] { return v41g_wq_gemm(&W, x, M, y, 0, ws, wsb, B.st); }, cub});
                    const double t = tt[0];
                    tc = tt[1];
                    B.rec("wq", nm,
                          fmt("{\"M\":%d,\"N\":%d,\"K\":%d,\"weights\":\"%s\",\"ws_bytes\":%zu,\"vs_cublas_bf16\":%.4g,"
                              "\"cublas_bf16_s\":%.6g}", M, s.N, s.K, f8 ? "fp8" : "fp4", wsb, t / tc, tc),
                          2.0 * M * s.N * s.K, wby + 2.0 * M * s.K + 2.0 * M * s.N, t);
                }
                if (tc < 0 && want_f) tc = B.time(cub);
                if (want_f) {
                    const int ldm = (M + 3) / 4 * 4;
                    if (!x8) {
                        x8 = (uint8_t *)B.alloc((size_t)4096 * 8192);
                        xs = (float *)B.alloc(sizeof(float) * 4096 * (8192 / 32));
                    }
                    if (v41g_act_quant_f8(x, M, s.K, x8, xs, ldm, B.st)) {
                        fprintf(stderr, "v41 bench gpu: v41g_act_quant_f8 failed\n");
                        exit(1);
                    }
                    double tf = B.time([&] { return v41g_wq_gemm_f8(&W, x8, xs, ldm, M, y, 0, B.st); });
                    double tq = B.time([&] {
                        int r = v41g_act_quant_f8(x, M, s.K, x8, xs, ldm, B.st);
                        return r ? r : v41g_wq_gemm_f8(&W, x8, xs, ldm, M, y, 0, B.st);
                    });
                    // bytes: codes + scales, fp8 activations and their fp32 scales in, bf16 out
                    // (with the quantization: + the bf16 input read and the codes and scales written)
                    const double ab = (double)M * s.K + 4.0 * M * (s.K / 32);
                    B.rec("wq", nm + "_f8mma",
                          fmt("{\"M\":%d,\"N\":%d,\"K\":%d,\"weights\":\"fp8\",\"path\":\"fp8 mma\",\"vs_cublas_bf16\":%.4g,"
                              "\"cublas_bf16_s\":%.6g}", M, s.N, s.K, tf / tc, tc),
                          2.0 * M * s.N * s.K, wby + ab + 2.0 * M * s.N, tf);
                    B.rec("wq", nm + "_f8mma_q",
                          fmt("{\"M\":%d,\"N\":%d,\"K\":%d,\"weights\":\"fp8\",\"path\":\"act_quant_f8+fp8 mma\","
                              "\"vs_cublas_bf16\":%.4g,\"cublas_bf16_s\":%.6g}", M, s.N, s.K, tq / tc, tc),
                          2.0 * M * s.N * s.K, wby + 2.0 * ab + 2.0 * M * s.K + 2.0 * M * s.N, tq);
                }
                // bytes: codes + scales read, bf16 weight written and read back, activations in and out
                if (want_d) {
                    if (!wd) wd = (uint16_t *)B.alloc(nbf * 2);
                    const std::vector<double> tt = B.times({[&] { return dequant_cublas(W, x, M, y, wd, B.st); }, cub});
                    const double td = tt[0];
                    tc = tt[1];
                    B.rec("wq", nm + "_deq_cublas",
                          fmt("{\"M\":%d,\"N\":%d,\"K\":%d,\"weights\":\"%s\",\"path\":\"dequant+cublas\","
                              "\"vs_cublas_bf16\":%.4g,\"cublas_bf16_s\":%.6g}", M, s.N, s.K, f8 ? "fp8" : "fp4", td / tc, tc),
                          2.0 * M * s.N * s.K, wby + 4.0 * s.N * s.K + 2.0 * M * s.K + 2.0 * M * s.N, td);
                }
            }
        }
        B.free_all();
    }

    // MoE: fp4 routed experts, fp8 shared expert; the gate bf16, as in moe
    const moe_storage ms = make_moe_storage(B, 54);
    // The routed experts' grouped GEMMs alone (v41g_wq_gemm_grouped, what v41g_moe_ffn runs for
    // them): T tokens, each on KA distinct uniformly drawn experts, rows sorted by expert; w1||w3
    // reads the tokens through the row list, w2 the sorted rows. Bytes: the stored weights of the
    // experts that got rows + activations in + out.
    for (int T : {64, 256, 512, 4096}) {
        if (quick && T != 64) continue;
        if (skip_rec(match, fmt("expert_w13_fp4_grouped_T%d", T)) && skip_rec(match, fmt("expert_w2_fp4_grouped_T%d", T)))
            continue;
        const int A = T * KA;
        std::vector<int> cnt(E, 0);
        std::vector<int32_t> pick;
        uint64_t sd = 0x5eed + T;
        std::vector<std::pair<int, int>> asg;   // (expert, token)
        for (int t = 0; t < T; t++) {
            pick.clear();
            rand_sorted(pick, KA, E, 0, sd);   // KA distinct experts
            for (int e : pick) { asg.push_back({e, t}); cnt[e]++; }
        }
        std::sort(asg.begin(), asg.end());
        std::vector<int32_t> off(E + 1, 0), xrow(A);
        for (int e = 0; e < E; e++) off[e + 1] = off[e] + cnt[e];
        for (int p = 0; p < A; p++) xrow[p] = asg[p].second;
        int ne = 0;
        for (int e = 0; e < E; e++) ne += cnt[e] > 0;
        int32_t *doff = (int32_t *)B.alloc(off.size() * 4), *dxrow = (int32_t *)B.alloc(xrow.size() * 4);
        v41g_h2d(doff, off.data(), off.size() * 4);
        v41g_h2d(dxrow, xrow.data(), xrow.size() * 4);
        uint16_t *x = (uint16_t *)B.alloc((size_t)T * D * 2), *h = (uint16_t *)B.alloc((size_t)A * IM * 2);
        uint16_t *y13 = (uint16_t *)B.alloc((size_t)A * 2 * IM * 2), *y2 = (uint16_t *)B.alloc((size_t)A * D * 2);
        v41g_fill_bf16(x, (size_t)T * D, 55, 1.0f, B.st);
        v41g_fill_bf16(h, (size_t)A * IM, 56, 1.0f, B.st);
        const struct { const char *nm; const v41g_wq *W; const int32_t *xr; const uint16_t *x; uint16_t *y; } g[] = {
            {"w13", &ms.W13, dxrow, x, y13}, {"w2", &ms.W2, NULL, h, y2}};
        for (auto &q : g) {
            const std::string nm = fmt("expert_%s_fp4_grouped_T%d", q.nm, T);
            if (skip_rec(match, nm)) continue;
            double t = B.time([&] { return v41g_wq_gemm_grouped(q.W, E, doff, q.xr, q.x, A, q.y, 0, B.st); });
            const double wb = stored_bytes(*q.W);   // one expert's codes + scales
            B.rec("wq", nm,
                  fmt("{\"T\":%d,\"rows\":%d,\"experts\":%d,\"experts_used\":%d,\"N\":%d,\"K\":%d}", T, A, E, ne,
                      q.W->N, q.W->K),
                  2.0 * A * q.W->N * q.W->K, ne * wb + 2.0 * (q.xr ? (double)T : A) * q.W->K + 2.0 * A * q.W->N, t);
        }
    }
    uint16_t *gateW = (uint16_t *)B.alloc((size_t)E * D * 2);
    v41g_fill_bf16(gateW, (size_t)E * D, 34, 0.02f, B.st);
    int Ts[] = {64, 256, 512, 4096};   // two decode batches, then the issue's two token counts
    for (int T : Ts) {
        if (quick && T >= 256 && T != 512) continue;
        if (skip_rec(match, fmt("moe_fp4_T%d", T))) continue;
        int ne;
        const v41g_moe m = {T, D, IM, E, KA, 10.0f, NULL, NULL, NULL, NULL, &ms.W13, &ms.W2, &ms.W13s, &ms.W2s};
        // graph-replayed: the storage-format path never waits for the host (the bf16 moe op does,
        // for its per-expert row counts, so it is timed without a graph)
        double t = time_moe(B, m, gateW, T, true, &ne);
        double fl = 2.0 * T * (KA + 1) * 3.0 * D * IM + 2.0 * T * E * D;
        double by = ne * ms.expert_bytes + ms.shared_bytes + E * D * 2.0 + 2.0 * T * D * 2;
        // dense cuBLAS at equal FLOPs: the moe section's moe_dense_equiv, else timed here the same way
        double td = find_op(B, "gemm", fmt("moe_dense_equiv_T%d", T), "");
        if (td < 0) td = time_moe_dense(B, T, NULL, NULL);
        double tb = find_op(B, "moe", fmt("moe_T%d", T), "");
        std::string p = fmt("{\"T\":%d,\"experts\":%d,\"active\":%d,\"shared\":1,\"dim\":%d,\"inter\":%d,"
                            "\"weights\":\"fp4\",\"shared_weights\":\"fp8\",\"vs_dense\":%.4g", T, E, KA, D, IM, t / td);
        if (tb > 0) p += fmt(",\"vs_moe_bf16\":%.4g", t / tb);
        B.rec("wq", fmt("moe_fp4_T%d", T), p + "}", fl, by, t);
    }
    B.free_all();
}

// Access-pattern ceilings for the small ops (op "pattern": not ops of the model, the simulator's
// profile loader ignores the class). They move exactly the bytes of the op they shadow, the same
// way, with no arithmetic, so "op time / pattern time" is how far an op is from what its own
// access pattern allows on this device (the copy ceiling is a dense read + write stream):
// - pattern_read: one streaming read of n 16-byte vectors (the mHC mixes read X once), 4 loads in
//   flight a thread, grid-stride; the xor of the data is stored only if it matches an impossible
//   key, so the loads cannot be dropped.
// - pattern_rope: RoPE's read-modify-write of the last r elements of every (row, head) (d-element
//   rows, 16-byte vectors), mapped like g_rope_vec_kernel (a block of 256 threads per row, 2
//   vectors a thread), the data written back unchanged.
// - pattern_copy: a dense copy of n 16-byte vectors the same way (rmsnorm's T x dim bf16 in and out):
//   the copy ceiling at a small op's size, timed like the op (floor, flush method and all).
// (one kernel for both: COPY stores each vector to y, else its bits go into the xor)
template <bool COPY>
__global__ void __launch_bounds__(256) pattern_stream_kernel(const uint4 *__restrict__ x, uint4 *__restrict__ y, size_t n,
                                                             uint32_t *sink)
{
    uint32_t a = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    auto use = [&](size_t j, const uint4 &v) {
        if (COPY) y[j] = v;
        else a ^= v.x ^ v.y ^ v.z ^ v.w;
    };
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = __ldcs(x + i + u * stride);
#pragma unroll
        for (int u = 0; u < 4; u++) use(i + u * stride, v[u]);
    }
    for (; i < n; i += stride) use(i, __ldcs(x + i));
    if (!COPY && a == 0x9e3779b9u) sink[0] = a;
}

__global__ void __launch_bounds__(256) pattern_rope_kernel(uint16_t *x, int rows, int heads, int d, int r)
{
    const int vph = r / 8, nvr = heads * vph;
    uint16_t *xb = x + (size_t)blockIdx.x * heads * d + (d - r);
    uint4 v[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int i = threadIdx.x + k * 256;
        if (i < nvr) v[k] = *(const uint4 *)(xb + (i / vph) * d + (i % vph) * 8);
    }
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int i = threadIdx.x + k * 256;
        if (i < nvr) *(uint4 *)(xb + (i / vph) * d + (i % vph) * 8) = v[k];
    }
}

void small(bench &B, bool quick)
{
    int Ts[] = {64, 4096};
    float *freqs = (float *)B.alloc(R / 2 * 4);
    float hf[R / 2];
    v41g_rope_freqs(R, 160000.0, 65536, 16, 32, 1, hf);
    v41g_h2d(freqs, hf, sizeof hf);
    for (int T : Ts) {
        if (quick && T != 4096) continue;
        uint16_t *x = (uint16_t *)B.alloc((size_t)T * HC * D * 2), *y = (uint16_t *)B.alloc((size_t)T * HC * D * 2);
        uint16_t *wn = (uint16_t *)B.alloc(D * 2), *qb = (uint16_t *)B.alloc((size_t)T * H * HD * 2);
        uint8_t *q8 = (uint8_t *)B.alloc((size_t)T * D);
        float *sc = (float *)B.alloc((size_t)T * D / 32 * 4);
        int32_t *pos = (int32_t *)B.alloc(T * 4);
        float *fn = (float *)B.alloc((size_t)(2 + HC) * HC * HC * D * 4), *base = (float *)B.alloc(64 * 4),
              *s3 = (float *)B.alloc(16);
        float *pre = (float *)B.alloc((size_t)T * HC * 4), *post = (float *)B.alloc((size_t)T * HC * 4),
              *comb = (float *)B.alloc((size_t)T * HC * HC * 4);
        v41g_fill_bf16(x, (size_t)T * HC * D, 40, 1.0f, B.st);
        v41g_fill_bf16(wn, D, 41, 1.0f, B.st);
        v41g_fill_bf16(qb, (size_t)T * H * HD, 42, 1.0f, B.st);
        v41g_fill_f32(fn, (size_t)(2 + HC) * HC * HC * D, 43, 0.01f, B.st);
        v41g_fill_f32(base, 64, 44, 0.1f, B.st);
        v41g_fill_f32(s3, 4, 45, 1.0f, B.st);
        std::vector<int32_t> hp(T);
        for (int i = 0; i < T; i++) hp[i] = 1000 + i;
        v41g_h2d(pos, hp.data(), T * 4);
        std::string p = fmt("{\"T\":%d,\"dim\":%d}", T, D);
        double t;
        t = B.time([&] { return v41g_rmsnorm(x, wn, y, T, D, 1e-6f, B.st); });
        B.rec("small", fmt("rmsnorm_T%d", T), p, 4.0 * T * D, 2.0 * T * D * 2 + D * 2, t);
        {
            const size_t nv = (size_t)T * D / 8;
            const unsigned nb = (unsigned)std::min<size_t>((nv + 255) / 256, (size_t)g_num_sms() * 8);
            t = B.time([&] {
                pattern_stream_kernel<true><<<nb, 256, 0, B.st>>>((const uint4 *)x, (uint4 *)y, nv, NULL);
                return (int)cudaGetLastError();
            });
            B.rec("pattern", fmt("pattern_copy_T%d", T), p, 0, 2.0 * T * D * 2, t);
        }
        const std::string rp = fmt("{\"T\":%d,\"heads\":%d,\"head_dim\":%d,\"rope_dim\":%d}", T, H, HD, R);
        t = B.time([&] { return v41g_rope(qb, pos, freqs, T, H, HD, R, 0, B.st); });
        B.rec("small", fmt("rope_q_T%d", T), rp, 6.0 * T * H * R / 2, 2.0 * T * H * R * 2, t);
        if (H * R / 8 <= 512) {   // the pattern kernel's 2 vectors a thread
            t = B.time([&] {
                pattern_rope_kernel<<<T, 256, 0, B.st>>>(qb, T, H, HD, R);
                return (int)cudaGetLastError();
            });
            B.rec("pattern", fmt("pattern_rope_q_T%d", T), rp, 0, 2.0 * T * H * R * 2, t);
        }
        t = B.time([&] { return v41g_act_quant(x, q8, sc, y, T, D, B.st); });
        B.rec("small", fmt("act_quant_T%d", T), p, 0, T * D * (2.0 + 1 + 2) + T * D / 32 * 4.0, t);
        t = B.time([&] { return v41g_fp4_qdq(x, y, T, HD, 16, 1, B.st); });
        B.rec("small", fmt("fp4_qdq_e4m3_g16_T%d", T), fmt("{\"T\":%d,\"n\":%d,\"g\":16}", T, HD), 0, 2.0 * T * HD * 2, t);
        t = B.time([&] { return v41g_fp4_qdq(x, y, T * NI, DI, 32, 0, B.st); });
        B.rec("small", fmt("fp4_qdq_e8m0_g32_T%d", T), fmt("{\"rows\":%d,\"n\":%d,\"g\":32}", T * NI, DI), 0,
              2.0 * T * NI * DI * 2, t);
        uint16_t *fn2 = (uint16_t *)B.alloc((size_t)2 * (2 + HC) * HC * HC * D * 2);
        v41g_hc_split_fn(fn, HC, D, fn2, B.st);   // once, at weight upload
        const std::string mp = fmt("{\"T\":%d,\"hc\":%d,\"dim\":%d}", T, HC, D);
        const size_t hws_n = v41g_hc_mixes2_ws_size(T, HC, D);
        void *hws = B.alloc(hws_n);
        t = B.time([&] {   // caller scratch: the graph holds no allocation nodes (as an engine would run it)
            return v41g_hc_mixes2_ws(x, fn2, base, s3, T, HC, D, 1e-20f, 1e-6f, 20, pre, post, comb, hws, hws_n, B.st);
        });
        B.rec("small", fmt("hc_mixes_sinkhorn_T%d", T), mp, 2.0 * T * HC * D * (2 + HC) * HC,
              (double)T * HC * D * 2 + (2 + HC) * HC * HC * D * 4.0, t);
        {
            const size_t nv = (size_t)T * HC * D / 8;
            uint32_t *sink = (uint32_t *)B.alloc(16);
            const unsigned nb = (unsigned)std::min<size_t>((nv + 255) / 256, (size_t)g_num_sms() * 8);
            t = B.time([&] {
                pattern_stream_kernel<false><<<nb, 256, 0, B.st>>>((const uint4 *)x, NULL, nv, sink);
                return (int)cudaGetLastError();
            });
            B.rec("pattern", fmt("pattern_read_X_T%d", T), mp, 0, (double)T * HC * D * 2, t);
        }
        t = B.time([&] { return v41g_hc_pre(x, pre, y, T, HC, D, B.st); });
        B.rec("small", fmt("hc_pre_T%d", T), p, 2.0 * T * HC * D, (double)T * (HC + 1) * D * 2, t);
        t = B.time([&] { return v41g_hc_post(y, x, post, comb, x, T, HC, D, B.st); });
        B.rec("small", fmt("hc_post_T%d", T), p, 2.0 * T * HC * D * (HC + 1), (double)T * (2 * HC + 1) * D * 2, t);
        B.free_all();
        freqs = (float *)B.alloc(R / 2 * 4);
        v41g_h2d(freqs, hf, sizeof hf);
    }
    B.free_all();
    // the same records net of the timing floor (ceilings()): what the kernel itself moves per second
    for (const op_rec &o : B.ops) {
        if ((o.op != "small" && o.op != "pattern") || o.median_s <= B.floor_s || o.name.find("_T64") != std::string::npos)
            continue;
        const double tn = o.median_s - B.floor_s, gbs = o.bytes / tn * 1e-9;
        printf("net          %-34s %10.2f us %9.1f GB/s (%5.1f%% copy)  (median - %.2f us floor)\n", o.name.c_str(),
               tn * 1e6, gbs, 100 * gbs / B.copy_GBps, B.floor_s * 1e6);
    }
}

// The kernels of the device-resident decode step (gpu/v41_gpu_dev.h) at V4.1-Flash shapes, a
// decode batch of T = 64 rows. Op "decode": the simulator's profile loader ignores it (these
// kernels are part of the decode step's "small" work but are not yet in its cost classes).
// Bytes: every input read once, every output written once.
void decode_ops(bench &B, bool quick)
{
    const int T = 64, V = 129280, m = 2, CB = 8, KB = 2048;
    int32_t *pos = (int32_t *)B.alloc(T * 4), *fl = (int32_t *)B.alloc(T * 4), *topk = (int32_t *)B.alloc(T * TOPK * 4);
    int64_t *wr0 = (int64_t *)B.alloc(T * 8), *cr0 = (int64_t *)B.alloc(T * 8), *hr0 = (int64_t *)B.alloc(T * 8),
            *rows = (int64_t *)B.alloc((size_t)T * HC * 8);
    int32_t *idx = (int32_t *)B.alloc((size_t)T * (W + TOPK) * 4);
    {
        std::vector<int32_t> hp(T), hf(T, 0), ht((size_t)T * TOPK);
        std::vector<int64_t> hw(T), hc(T), hh(T), hr((size_t)T * HC);
        for (int t = 0; t < T; t++) {
            hp[t] = 8191 - (t % 2);   // (p + 1) % m == 0 for even rows: half the rows complete a group
            hw[t] = (int64_t)t * 8192;
            hc[t] = (int64_t)t * 4097;
            hh[t] = (int64_t)2 * t - 8190;
            for (int j = 0; j < TOPK; j++) ht[(size_t)t * TOPK + j] = j * 7 % 4096;
            for (int j = 0; j < HC; j++) hr[(size_t)t * HC + j] = (t * 977 + j) % V;
        }
        v41g_h2d(pos, hp.data(), T * 4);
        v41g_h2d(fl, hf.data(), T * 4);
        v41g_h2d(topk, ht.data(), ht.size() * 4);
        v41g_h2d(wr0, hw.data(), T * 8);
        v41g_h2d(cr0, hc.data(), T * 8);
        v41g_h2d(hr0, hh.data(), T * 8);
        v41g_h2d(rows, hr.data(), hr.size() * 8);
    }
    double t;
    const std::string pT = fmt("{\"T\":%d}", T);
    t = B.time([&] { return v41g_dec_lists(pos, fl, wr0, cr0, topk, T, W, TOPK, idx, B.st); });
    B.rec("decode", "dec_lists_T64", fmt("{\"T\":%d,\"W\":%d,\"k\":%d}", T, W, TOPK), 0,
          (double)T * TOPK * 4 + (double)T * (W + TOPK) * 4 + T * 24.0, t);
    {   // compressor step, ratio 2, d = 512: kv and scores in, history rows out, half the rows pool a group
        float *kv = (float *)B.alloc((size_t)T * HD * 4), *sc = (float *)B.alloc((size_t)T * HD * 4);
        // history rows: hrow0[t] + p with hrow0[t] = 2t - 8190, so row t owns rows 2t, 2t + 1
        float *hk = (float *)B.alloc((size_t)2 * T * HD * 4), *hs = (float *)B.alloc((size_t)2 * T * HD * 4);
        uint16_t *lat = (uint16_t *)B.alloc((size_t)T * HD * 2);
        uint8_t *em = (uint8_t *)B.alloc(T);
        v41g_fill_f32(kv, (size_t)T * HD, 60, 1.0f, B.st);
        v41g_fill_f32(sc, (size_t)T * HD, 61, 1.0f, B.st);
        t = B.time([&] { return v41g_compress_dec(kv, sc, pos, hr0, T, HD, m, hk, hs, lat, em, B.st); });
        B.rec("decode", "compress_dec_m2_T64", fmt("{\"T\":%d,\"d\":%d,\"m\":%d}", T, HD, m), 0,
              (double)T * HD * 4 * 2 * 2 + (double)(T / 2) * m * HD * 4 * 2 + (double)T * HD * 2, t);
    }
    {   // mHC statistics and Sinkhorn, DSpark mean, Engram gate, embedding gather
        const int mix = (2 + HC) * HC;
        uint16_t *X = (uint16_t *)B.alloc((size_t)T * HC * D * 2), *y = (uint16_t *)B.alloc((size_t)T * D * 2);
        uint16_t *kv = (uint16_t *)B.alloc((size_t)T * (HC + 1) * D * 2), *emb = (uint16_t *)B.alloc((size_t)V * D * 2);
        float *mixes = (float *)B.alloc((size_t)T * mix * 4), *s3 = (float *)B.alloc(16), *base = (float *)B.alloc(mix * 4);
        float *pre = (float *)B.alloc(T * HC * 4), *post = (float *)B.alloc(T * HC * 4), *comb = (float *)B.alloc(T * HC * HC * 4);
        float *wq = (float *)B.alloc((size_t)HC * D * 4);
        v41g_fill_bf16(X, (size_t)T * HC * D, 63, 1.0f, B.st);
        v41g_fill_bf16(kv, (size_t)T * (HC + 1) * D, 64, 1.0f, B.st);
        v41g_fill_f32(mixes, (size_t)T * mix, 65, 1.0f, B.st);
        v41g_fill_f32(s3, 4, 66, 1.0f, B.st);
        v41g_fill_f32(base, mix, 67, 0.1f, B.st);
        v41g_fill_f32(wq, (size_t)HC * D, 68, 1.0f, B.st);
        t = B.time([&] { return v41g_rms_scale(X, T, HC * D, 1e-6f, mixes, mix, B.st); });
        B.rec("decode", "rms_scale_T64", fmt("{\"T\":%d,\"n\":%d}", T, HC * D), 0,
              (double)T * HC * D * 2 + (double)T * mix * 4 * 2, t);
        t = B.time([&] { return v41g_sinkhorn(mixes, s3, base, T, HC, 20, 1e-6f, pre, post, comb, B.st); });
        B.rec("decode", "sinkhorn_T64", fmt("{\"T\":%d,\"hc\":%d,\"iters\":20}", T, HC), 0,
              (double)T * mix * 4 + (double)T * (2 * HC + HC * HC) * 4, t);
        t = B.time([&] { return v41g_hc_mean(X, T, HC, D, y, D, B.st); });
        B.rec("decode", "hc_mean_T64", fmt("{\"T\":%d,\"hc\":%d,\"dim\":%d}", T, HC, D), 0,
              (double)T * HC * D * 2 + (double)T * D * 2, t);
        t = B.time([&] { return v41g_engram_gate(kv, wq, T, HC, D, 1e-6f, X, B.st); });
        B.rec("decode", "engram_gate_T64", fmt("{\"T\":%d,\"hc\":%d,\"dim\":%d}", T, HC, D), 6.0 * T * HC * D,
              (double)T * (HC + 1) * D * 2 + 2.0 * T * HC * D * 2 + (double)HC * D * 4, t);
        t = B.time([&] { return v41g_gather_rows16(emb, D, rows, T * HC, D, X, D, B.st); });
        B.rec("decode", "gather_rows_embed_T64", fmt("{\"rows\":%d,\"dim\":%d}", T * HC, D), 0,
              2.0 * T * HC * D * 2, t);
        B.free_all();
    }
    {   // head argmax, MoE SwiGLU and combine
        float *lg = (float *)B.alloc((size_t)T * V * 4);
        int32_t *am = (int32_t *)B.alloc(T * 4), *ridx = (int32_t *)B.alloc(T * KA * 4);
        uint16_t *h13 = (uint16_t *)B.alloc((size_t)T * KA * 2 * IM * 2), *h = (uint16_t *)B.alloc((size_t)T * KA * IM * 2);
        uint16_t *ye = (uint16_t *)B.alloc((size_t)T * KA * D * 2), *ys = (uint16_t *)B.alloc((size_t)T * D * 2),
                 *out = (uint16_t *)B.alloc((size_t)T * D * 2);
        float *wts = (float *)B.alloc(T * KA * 4);
        std::vector<int32_t> hi((size_t)T * KA);
        for (int q = 0; q < T; q++)
            for (int j = 0; j < KA; j++) hi[(size_t)q * KA + j] = (q * 31 + j * 67) % E;
        v41g_h2d(ridx, hi.data(), hi.size() * 4);
        v41g_fill_f32(lg, (size_t)T * V, 70, 1.0f, B.st);
        v41g_fill_bf16(h13, (size_t)T * KA * 2 * IM, 71, 1.0f, B.st);
        v41g_fill_bf16(ye, (size_t)T * KA * D, 72, 1.0f, B.st);
        v41g_fill_bf16(ys, (size_t)T * D, 73, 1.0f, B.st);
        v41g_fill_f32(wts, (size_t)T * KA, 74, 1.0f, B.st);
        t = B.time([&] { return v41g_argmax_rows(lg, T, V, am, B.st); });
        B.rec("decode", "argmax_T64", fmt("{\"T\":%d,\"V\":%d}", T, V), 0, (double)T * V * 4 + T * 4.0, t);
        t = B.time([&] { return v41g_swiglu(h13, T * KA, IM, 10.0f, wts, h, B.st); });
        B.rec("decode", "swiglu_T64", fmt("{\"rows\":%d,\"inter\":%d}", T * KA, IM), 6.0 * T * KA * IM,
              (double)T * KA * (2 * IM + IM) * 2 + T * KA * 4.0, t);
        t = B.time([&] { return v41g_moe_combine(ye, ridx, ys, T, KA, D, out, B.st); });
        B.rec("decode", "moe_combine_T64", fmt("{\"T\":%d,\"k\":%d,\"dim\":%d}", T, KA, D), (double)T * (KA + 1) * D,
              (double)T * KA * D * 2 + 2.0 * T * D * 2 + T * KA * 4.0, t);
    }
    B.free_all();
    for (int L : {8192, 65536}) {   // candidate blocks of the ratio-1 candidate source (B = 8, 2048 blocks kept)
        if (quick && L != 65536) continue;
        float *I = (float *)B.alloc((size_t)T * L * 4);
        uint8_t *mask = (uint8_t *)B.alloc((size_t)T * L);
        int32_t *Lc = (int32_t *)B.alloc(T * 4), *cmax = (int32_t *)B.alloc(4), *pl = (int32_t *)B.alloc(T * 4);
        std::vector<int32_t> hl(T, L), hp2(T, L - 1);
        v41g_h2d(Lc, hl.data(), T * 4);
        v41g_h2d(pl, hp2.data(), T * 4);
        v41g_h2d(cmax, hl.data(), 4);
        v41g_fill_f32(I, (size_t)T * L, 62, 1.0f, B.st);
        t = B.time([&] { return v41g_cand_mask(I, Lc, pl, T, L, 1, CB, KB, mask, B.st); });
        B.rec("decode", fmt("cand_mask_T64_L%d", L), fmt("{\"T\":%d,\"L\":%d,\"block\":%d,\"keep\":%d}", T, L, CB, KB), 0,
              (double)T * L * 4 + (double)T * L, t);
        t = B.time([&] { return v41g_cand_apply(I, L, mask, L, cmax, T, B.st); });
        B.rec("decode", fmt("cand_apply_T64_L%d", L), fmt("{\"T\":%d,\"L\":%d}", T, L), 0,
              (double)T * L * 4 * 2 + (double)T * L, t);
        B.free_all();
    }
}

// One V4.1-Flash-shaped layer (a ratio-1 layer that runs its indexer): mHC mixes,
// q/kv projections with their norms, RoPE and act_quant, indexer scores + top-512,
// sparse attention over window 128 + top-512, inverse RoPE, grouped output
// projection, hc_post, then the FFN half (mixes, gate, routing, 384-expert MoE +
// shared, hc_post). decode: T requests of one row each, context ctx; prefill: one
// request of T rows. Weights: bf16 (experts dequantized), or with packed = true as
// the engine keeps them since session 4: wq_a, wq_b, wkv, the indexer's wq_b and
// wo_b fp8 (e4m3 + 32x32 e8m0 blocks), routed experts fp4, the shared expert fp8,
// run like the engine's hybrid path (v41g_wq_linear: v41g_wq_gemm below 256 rows, else
// dequantize into a scratch + cuBLAS; v41g_moe_ffn with the storage-format experts); wo_a, the
// indexer's head projection and the gate stay bf16.
void layer(bench &B, int T, bool decode, int ctx, bool packed)
{
    const int NM = (2 + HC) * HC, S = decode ? ctx : T, L = W + TOPK;
    auto bf = [&](size_t n, float amp) { uint16_t *p = (uint16_t *)B.alloc(n * 2); v41g_fill_bf16(p, n, n + 7, amp, B.st); return p; };
    auto f32 = [&](size_t n, float amp) { float *p = (float *)B.alloc(n * 4); v41g_fill_f32(p, n, n + 9, amp, B.st); return p; };
    // weights
    uint16_t *wq_a = bf((size_t)QL * D, 0.02f), *wq_b = bf((size_t)H * HD * QL, 0.02f), *wkv = bf((size_t)HD * D, 0.02f);
    uint16_t *wo_a = bf((size_t)G * OL * (H * HD / G), 0.02f), *wo_b = bf((size_t)D * G * OL, 0.02f);
    uint16_t *iwq = bf((size_t)NI * DI * QL, 0.02f), *iwp = bf((size_t)NI * D, 0.02f), *gate = bf((size_t)E * D, 0.02f);
    uint16_t *nw = bf(D, 1.0f), *qn = bf(QL, 1.0f), *kvn = bf(HD, 1.0f);
    uint16_t *fn2a = bf((size_t)2 * NM * HC * D, 0.01f), *fn2f = bf((size_t)2 * NM * HC * D, 0.01f);
    float *base = f32(NM, 0.1f), *s3 = f32(4, 1.0f), *sink = f32(H, 1.0f);
    uint16_t *w13 = packed ? NULL : bf((size_t)E * 2 * IM * D, 0.02f), *w2 = packed ? NULL : bf((size_t)E * D * IM, 0.02f);
    uint16_t *w13s = packed ? NULL : bf((size_t)2 * IM * D, 0.02f), *w2s = packed ? NULL : bf((size_t)D * IM, 0.02f);
    // storage-format weights (packed)
    v41g_wq Qa = {}, Qb = {}, Qkv = {}, Qi = {}, Qo = {};
    moe_storage Qm = {};
    double wq_bytes = 0;   /* storage bytes of the packed Linears of the attention half */
    if (packed) {
        Qa = fp8_weight(B, QL, D, 60); Qb = fp8_weight(B, H * HD, QL, 61); Qkv = fp8_weight(B, HD, D, 62);
        Qi = fp8_weight(B, NI * DI, QL, 63); Qo = fp8_weight(B, D, G * OL, 64);
        for (const v41g_wq *q : {&Qa, &Qb, &Qkv, &Qi, &Qo}) wq_bytes += stored_bytes(*q);
        Qm = make_moe_storage(B, 65);
    }
    // workspace of the packed path (v41g_wq_linear): split-K partials, or from V41G_WQ_DEQUANT_ROWS
    // rows on the dequantized weight
    size_t pk_ws = 0;
    if (packed)
        for (const v41g_wq *q : {&Qa, &Qb, &Qkv, &Qi, &Qo}) pk_ws = std::max(pk_ws, v41g_wq_linear_ws_bytes(q, T));
    void *pk = pk_ws ? B.alloc(pk_ws) : NULL;
    float hf[R / 2];
    v41g_rope_freqs(R, 160000.0, 65536, 16, 32, 1, hf);
    float *freqs = (float *)B.alloc(sizeof hf);
    v41g_h2d(freqs, hf, sizeof hf);
    // activations and caches
    uint16_t *X = bf((size_t)T * HC * D, 1.0f), *x = bf((size_t)T * D, 1.0f), *xn = bf((size_t)T * D, 1.0f);
    uint16_t *qr = bf((size_t)T * QL, 1.0f), *q = bf((size_t)T * H * HD, 1.0f), *kv = bf((size_t)T * HD, 1.0f);
    uint16_t *iq = bf((size_t)T * NI * DI, 1.0f), *o = bf((size_t)T * H * HD, 1.0f), *u = bf((size_t)T * G * OL, 1.0f);
    uint16_t *y = bf((size_t)T * D, 1.0f);
    size_t nwin = decode ? (size_t)T * W : (size_t)T, ncmp = decode ? (size_t)T * S : (size_t)T;
    uint16_t *kwin = bf(nwin * HD, 1.0f), *kcmp = bf(ncmp * HD, 1.0f), *ikeys = bf(ncmp * DI, 1.0f);
    float *pre = f32((size_t)T * HC, 0.2f), *post = f32((size_t)T * HC, 1.0f), *comb = f32((size_t)T * HC * HC, 0.2f);
    float *iw = f32((size_t)T * NI, 0.1f), *I = (float *)B.alloc((size_t)T * S * 4), *logits = (float *)B.alloc((size_t)T * E * 4);
    float *wts = (float *)B.alloc((size_t)T * KA * 4);
    const size_t hws_n = v41g_hc_mixes2_ws_size(T, HC, D);
    void *hws = B.alloc(hws_n);
    int32_t *topk = (int32_t *)B.alloc((size_t)T * TOPK * 4), *eidx = (int32_t *)B.alloc((size_t)T * KA * 4);
    std::vector<int32_t> pos(T), vis(T), list((size_t)T * L);
    std::vector<int64_t> kb(T);
    for (int t = 0; t < T; t++) {
        pos[t] = decode ? ctx - 1 : t;
        vis[t] = decode ? S : t + 1;
        kb[t] = decode ? (int64_t)t * S : 0;
        for (int j = 0; j < W; j++) list[(size_t)t * L + j] = decode ? t * W + j : (t - W + 1 + j >= 0 ? t - W + 1 + j : -1);
    }
    int32_t *dpos = (int32_t *)B.alloc(T * 4), *dvis = (int32_t *)B.alloc(T * 4), *dlist = (int32_t *)B.alloc(list.size() * 4);
    int64_t *dkb = (int64_t *)B.alloc(T * 8);
    v41g_h2d(dpos, pos.data(), T * 4); v41g_h2d(dvis, vis.data(), T * 4); v41g_h2d(dkb, kb.data(), T * 8);
    v41g_h2d(dlist, list.data(), list.size() * 4);
    v41g_moe m = {T, D, IM, E, KA, 10.0f, w13, w2, w13s, w2s, NULL, NULL, NULL, NULL};
    if (packed) { m.q13 = &Qm.W13; m.q2 = &Qm.W2; m.q13s = &Qm.W13s; m.q2s = &Qm.W2s; }
    // a Linear of the attention half: bf16 weights through cuBLAS, or the packed path
    auto lin = [&](const v41g_wq &q, const uint16_t *wb, const uint16_t *in, uint16_t *out, int N, int K) {
        return packed ? v41g_wq_linear(&q, in, T, out, 0, pk, pk_ws, B.st)
                      : v41g_gemm_bf16(in, wb, out, T, N, K, 0, 1, 0, 0, 0, B.st);
    };
    void *ws = B.alloc(v41g_moe_ws_size(&m));
    cudaStream_t st = B.st;
    const float sc = 1.0f / sqrtf((float)HD);
    auto attn_half = [&]() {
        int rc = 0;
#define R_(call) do { if (!rc) rc = (call); } while (0)
        R_(v41g_hc_mixes2_ws(X, fn2a, base, s3, T, HC, D, 1e-20f, 1e-6f, 20, pre, post, comb, hws, hws_n, st));
        R_(v41g_hc_pre(X, pre, x, T, HC, D, st));
        R_(v41g_rmsnorm(x, nw, xn, T, D, 1e-6f, st));
        R_(v41g_act_quant(xn, NULL, NULL, x, T, D, st));                       /* fp8 Linear input */
        R_(lin(Qa, wq_a, x, qr, QL, D));
        R_(v41g_rmsnorm(qr, qn, qr, T, QL, 1e-6f, st));
        R_(v41g_act_quant(qr, NULL, NULL, y, T, QL, st));
        R_(lin(Qb, wq_b, y, q, H * HD, QL));
        R_(v41g_rope(q, dpos, freqs, T, H, HD, R, 0, st));
        R_(lin(Qkv, wkv, x, kv, HD, D));
        R_(v41g_rmsnorm(kv, kvn, kv, T, HD, 1e-6f, st));
        R_(v41g_rope(kv, dpos, freqs, T, 1, HD, R, 0, st));
        R_(v41g_act_quant(kv, NULL, NULL, kv, T, HD, st));                    /* -> window ring */
        R_(lin(Qi, iwq, y, iq, NI * DI, QL));                                 /* indexer */
        R_(v41g_rope(iq, dpos, freqs, T, NI, DI, R, 0, st));
        R_(v41g_fp4_qdq(iq, iq, T * NI, DI, 32, 0, st));
        R_(v41g_gemm_bf16(xn, iwp, iw, T, NI, D, 1, 1, 0, 0, 0, st));
        R_(v41g_indexer_scores(iq, iw, ikeys, dkb, dvis, T, NI, DI, S, I, st));
        R_(v41g_topk(I, dvis, T, S, TOPK, topk, NULL, st));
        R_(cudaMemcpy2DAsync(dlist + W, L * 4, topk, TOPK * 4, TOPK * 4, T, cudaMemcpyDeviceToDevice, st));
        R_(v41g_sparse_attn(q, kwin, kcmp, dlist, L, W, sink, sc, T, H, HD, o, st));
        R_(v41g_rope(o, dpos, freqs, T, H, HD, R, 1, st));
        R_(v41g_gemm_bf16_ld(o, H * HD, wo_a, u, G * OL, T, OL, H * HD / G, 0, G, (long long)H * HD / G,
                             (long long)OL * H * HD / G, (long long)OL, st));   /* u_g = wo_a[g] . o_g */
        R_(v41g_act_quant(u, NULL, NULL, u, T, G * OL, st));
        R_(lin(Qo, wo_b, u, y, D, G * OL));
        R_(v41g_hc_post(y, X, post, comb, X, T, HC, D, st));
        return rc;
    };
    auto ffn_half = [&]() {
        int rc = 0;
        R_(v41g_hc_mixes2_ws(X, fn2f, base, s3, T, HC, D, 1e-20f, 1e-6f, 20, pre, post, comb, hws, hws_n, st));
        R_(v41g_hc_pre(X, pre, x, T, HC, D, st));
        R_(v41g_rmsnorm(x, nw, xn, T, D, 1e-6f, st));
        R_(v41g_gemm_bf16(xn, gate, logits, T, E, D, 1, 1, 0, 0, 0, st));
        R_(v41g_moe_route(logits, NULL, T, E, KA, 0, 1.0f, 1, 1.5f, eidx, wts, st));
        R_(v41g_moe_ffn(&m, xn, eidx, wts, ws, y, st));
        R_(v41g_hc_post(y, X, post, comb, X, T, HC, D, st));
#undef R_
        return rc;
    };
    double ta = B.time(attn_half, 7, true);
    double tf = B.time(ffn_half, 5, packed);   // (the bf16-expert MoE waits for the host: no graph)
    // bytes: weights once (bf16) + KV/keys read + activations of the stream; FLOPs: 2 per MAC
    double attn_w = packed ? wq_bytes + 2.0 * ((double)G * OL * H * HD / G + (double)NI * D + 2.0 * 2 * NM * HC * D)
                           : 2.0 * ((double)QL * D + (double)H * HD * QL + (double)HD * D + (double)G * OL * H * HD / G +
                                    (double)D * G * OL + (double)NI * DI * QL + (double)NI * D + 2.0 * 2 * NM * HC * D);
    double kvb = decode ? (double)T * (L * HD * 2.0 + S * DI * 2.0) : (double)T * (2.0 * HD + DI * 2.0);
    double act = (double)T * HC * D * 2 * 4;
    double attn_fl = 2.0 * T * ((double)QL * D + (double)H * HD * QL + (double)HD * D + (double)H * HD * OL +
                                (double)D * G * OL + (double)NI * DI * QL) + 4.0 * T * H * L * HD + 2.0 * T * S * NI * DI;
    std::string nm = (decode ? fmt("layer_decode_b%d_ctx%dK", T, ctx / 1024) : fmt("layer_prefill_T%d", T)) +
                     (packed ? "_fp8fp4" : "");
    std::string p = fmt("{\"T\":%d,\"decode\":%d,\"context\":%d,\"weights\":\"%s\"}", T, decode ? 1 : 0,
                        decode ? ctx : T, packed ? "fp8/fp4" : "bf16");
    B.rec("layer", nm + "_attn_half", p, attn_fl, attn_w + kvb + act, ta);
    // MoE: the experts that got tokens are read once
    double touched = distinct_experts(eidx, (size_t)T * KA);
    double moe_w = packed ? touched * Qm.expert_bytes + Qm.shared_bytes + (double)E * D * 2
                          : touched * 3.0 * IM * D * 2 + 3.0 * IM * D * 2 + (double)E * D * 2;
    double moe_fl = 2.0 * T * (KA + 1) * 3.0 * D * IM + 2.0 * T * E * D;
    B.rec("layer", nm + "_ffn_half", p, moe_fl, moe_w + act, tf);
    B.rec("layer", nm, p, attn_fl + moe_fl, attn_w + kvb + 2 * act + moe_w, ta + tf);
    double floor_s = std::max((attn_w + kvb + 2 * act + moe_w) / (B.copy_GBps * 1e9), (attn_fl + moe_fl) / (B.gemm_TFLOPs * 1e12));
    printf("%-12s %-34s roofline floor %.1f us (%s weights); measured / floor = %.2f\n", "layer", nm.c_str(),
           floor_s * 1e6, packed ? "fp8/fp4" : "bf16", (ta + tf) / floor_s);
    B.free_all();
}

int write_json(const bench &B, const char *path, const char *dev)
{
    std::string tmp = std::string(path) + ".tmp";
    FILE *f = fopen(tmp.c_str(), "w");
    if (!f) { fprintf(stderr, "v41 bench gpu: cannot write %s\n", tmp.c_str()); return 2; }
    fprintf(f, "{\"schema\":\"v41-profile/1\",\"device\":\"%s\",\"ceilings\":{\"copy_GBps\":%.6g,\"bf16_gemm_TFLOPs\":%.6g,"
            "\"timing_floor_us\":%.6g,\"l2_flush\":\"%s\"},\"ops\":[", dev, B.copy_GBps, B.gemm_TFLOPs, B.floor_s * 1e6,
            B.mode == FLUSH_DIRTY ? "dirty" : B.mode == FLUSH_DRAIN ? "drain" : "clean");
    for (size_t i = 0; i < B.ops.size(); i++) {
        const op_rec &o = B.ops[i];
        fprintf(f, "%s\n {\"op\":\"%s\",\"name\":\"%s\",\"params\":%s,\"flops\":%.6g,\"bytes\":%.6g,\"median_s\":%.6g",
                i ? "," : "", o.op.c_str(), o.name.c_str(), o.params.c_str(), o.flops, o.bytes, o.median_s);
        if (o.p10_s >= 0) fprintf(f, ",\"p10_s\":%.6g,\"p90_s\":%.6g", o.p10_s, o.p90_s);
        fprintf(f, "}");
    }
    fprintf(f, "\n]}\n");
    if (fclose(f) || rename(tmp.c_str(), path)) { unlink(tmp.c_str()); fprintf(stderr, "v41 bench gpu: cannot write %s\n", path); return 2; }
    return 0;
}

}  // namespace

extern "C" int v41g_bench_main(int argc, char **argv)
{
    const char *json = NULL, *only = NULL, *match = NULL;
    int reps = 15;
    bool quick = false;
    flush_mode fm = FLUSH_CLEAN;
    const char *flush_name = "clean";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end || v < 1 || v > 100000) {
                fprintf(stderr, "v41 bench gpu: --reps '%s': expected a whole number in [1, 100000]\n", argv[i]);
                return 2;
            }
            reps = (int)v;
        }
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--match") && i + 1 < argc) match = argv[++i];
        else if (!strcmp(argv[i], "--flush") && i + 1 < argc) {
            flush_name = argv[++i];
            if (!strcmp(flush_name, "clean")) fm = FLUSH_CLEAN;
            else if (!strcmp(flush_name, "dirty")) fm = FLUSH_DIRTY;
            else if (!strcmp(flush_name, "drain")) fm = FLUSH_DRAIN;
            else { fprintf(stderr, "v41 bench gpu: --flush '%s': expected clean, dirty or drain\n", flush_name); return 2; }
        }
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: v41 bench gpu [--json OUT] [--quick] [--reps N] [--only gemm,attn,indexer,moe,wq,small,layer,decode]\n"
                   "                    [--match SUBSTR] [--flush clean|dirty|drain]\n"
                   "  Ceilings (D2D copy, cuBLAS bf16 GEMM) then every CUDA kernel at V4.1-Flash shapes;\n"
                   "  medians of cudaEvent-timed runs with the L2 flushed. --json writes schema v41-profile/1.\n"
                   "  --flush: clean (default) empties the L2 by a 256 MiB read sweep, leaving it clean; dirty by a\n"
                   "  256 MiB memset (the op then also writes back the flush buffer's dirty lines it evicts: the\n"
                   "  method before 0.1.0's session 21); drain is clean plus a read sweep after the op inside the\n"
                   "  timed run, minus the sweep's own time: the op including the write-back of its own output.\n"
                   "  wq: the Linears and the MoE over fp8/fp4 weights in their storage formats (v41g_wq),\n"
                   "  each against bf16 cuBLAS (and the bf16 / dense MoE) at the same shape; op \"wq\".\n"
                   "  --match: in the wq section, only the records whose names contain SUBSTR (profiling one shape).\n"
                   "  decode (the device-resident decode step's kernels) runs only when --only names it.\n");
            return 0;
        } else { fprintf(stderr, "v41 bench gpu: unknown option '%s' (see --help)\n", argv[i]); return 2; }
    }
    if (v41g_device_count() <= 0) { fprintf(stderr, "v41 bench gpu: no CUDA device\n"); return 2; }
    char dev[256];
    v41g_device_name(dev, sizeof dev);
    printf("device: %s\n", dev);
    bench B;
    cudaStreamCreateWithFlags(&B.st, cudaStreamNonBlocking);
    B.reps = reps > 0 ? reps : 1;
    B.mode = fm;
    if (B.setup()) return 2;
    printf("L2 flush before each run: %s\n", flush_name);
    auto want = [&](const char *k) { return !only || strstr(only, k); };
    ceilings(B);
    printf("ceilings: copy %.1f GB/s, bf16 GEMM %.1f TFLOP/s, timing floor (one empty kernel) %.2f us\n",
           B.copy_GBps, B.gemm_TFLOPs, B.floor_s * 1e6);
    if (want("small")) small(B, quick);
    if (want("attn")) attention(B, quick);
    if (want("indexer")) indexer(B, quick);
    if (want("gemm")) gemms(B, quick);
    if (want("moe")) moe(B, quick);
    if (want("wq")) wq(B, quick, match);   // after gemm and moe: reuses their bf16 timings
    if (want("layer"))
        for (bool pk : {false, true}) { layer(B, 64, true, 8192, pk); if (!quick) layer(B, 4096, false, 0, pk); }
    if (only && strstr(only, "decode")) decode_ops(B, quick);   // opt-in: see --help
    v41g_free(B.flush);
    v41g_free(B.drain);
    v41g_gemm_release();
    if (json) return write_json(B, json, dev);
    return 0;
}
