// k_hc.cu: mHC (SPEC §3): mixes + Sinkhorn per token, hc_pre, hc_post.
//
// Mixes are NM = (2+h)h dot products of length n = hD per token, times the token's RMS factor
// r = 1/sqrt(mean X^2 + eps). fn is genuine fp32; it is split once into two bf16 matrices
// hi = bf16(fn), lo = bf16(fn - hi) (|fn - hi - lo| <= 2^-16 |fn|), so the dots run on tensor
// cores (bf16 x bf16 products are exact in fp32, fp32 accumulation). hc_mult 1, 2 or 4.
//
// v41g_hc_mixes2 reads X once: g_hc_mix_kernel streams a tile of rows x a slice of K through
// shared memory (cp.async, several stages in flight), stages the matching hi/lo chunk of fn with
// it, and per 32 columns of K issues mma.sync m16n8k16 for every row m-tile against the hi and lo
// n-tiles, and against the tile's own rows (the diagonal of X.X^T: each row's sum of squares, the
// RMS statistic). The slices' partial sums go to a scratch [S][T][NPP] array; g_hc_fin_kernel adds
// a token's S partials in a fixed order, scales the mixes by r and computes pre, post and comb
// (g_sinkhorn_token, the arithmetic of v41g_sinkhorn, the device step's kernel in k_dev_b.cu).
// Every stage has a fixed reduction shape, so the results are the same bits at every run.
//
// Why tensor cores: at T = 4096, hD = 20480, NM = 24 the dots are 2.0e9 multiply-adds; as fp32
// FMAs on the CUDA cores (132 SMs x 128 lanes x 1.98 GHz) that is >= 60 us, more than the ~40 us
// of reading X (168 MB) once. As mma.sync on the hi and lo parts it is 2.0e6 instructions
// (~15 us of tensor issue), hidden under the stream of X. The squares were 32 FMAs and bit
// operations per 32 columns and m-tile on the CUDA cores; as 4 more MMAs they cost no issue slots
// to speak of.
//
// Numerics (unchanged in kind from the former cuBLAS GEMM of X against [hi; lo]): every product
// x*hi, x*lo is exact in fp32 and is summed in fp32; only the summation order differs. Each
// accumulator chains n/(16 S) tensor-core steps (16 products each), then hi + lo, then the S
// slices (S/LPT sequential adds and a log2(LPT)-level butterfly), so a dot's rounding error is
// about (n/(16 S) + S + 6) * 2^-24 * sum|x*fn| (+ 2^-16 sum|x*fn| from the split, as before): less
// than the bound of a sequential fp32 sum over the n terms (the CPU reference's, depth n - 1), so
// the existing tolerances, derived for "the same fp32 dot in another order", still hold. The sum
// of squares is the same kind of sum (squares of bf16 are exact in fp32, fp32 accumulation in the
// same tensor-core steps and slices), so r = 1/sqrtf(ss/n + eps) keeps the precision of the former
// RMS pass (fp32 sums, n/32 per lane and a butterfly).
#include "g_internal.cuh"
#include "v41_gpu_dev.h"

__global__ void g_hc_split_kernel(const float *__restrict__ fn, size_t n, uint16_t *__restrict__ hi,
                                  uint16_t *__restrict__ lo)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint16_t h = g_f2bf(fn[i]);
        hi[i] = h;
        lo[i] = g_f2bf(fn[i] - g_bf2f(h));
    }
}

extern "C" int v41g_hc_split_fn(const float *fn, int h, int D, uint16_t *fn2, v41g_stream s)
{
    size_t n = (size_t)(2 + h) * h * h * D;
    g_hc_split_kernel<<<1024, 256, 0, G_STREAM(s)>>>(fn, n, fn2, fn2 + n);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- fused mixes + sum of squares
// Shapes for hc_mult H: NT n-tiles of 8 mixes (the last zero-padded: h = 1 has NM = 3), NF rows of
// fn in shared memory (NT*8 hi rows, then NT*8 lo rows), NPP floats per partial row (NM dots, the
// sum of squares, zeros to a multiple of 4 for float4 reads).
template <int H> struct hm_shape {
    static constexpr int NM = (2 + H) * H;
    static constexpr int NT = (NM + 7) / 8;
    static constexpr int NF = 2 * NT * 8;
    static constexpr int NPP = (NM + 1 + 3) / 4 * 4;
};
// CTA: WM warps, each owning MT m-tiles (16 rows each) of the R = 16*MT*WM rows from blockIdx.x*R;
// blockIdx.y = s takes KC-element blocks [s*nkb/S, (s+1)*nkb/S) of K (nkb = ceil(K/KC); the tail
// block and rows >= T are zero-filled by cp.async, so they add exact zeros). NST stages of
// (R + NF) rows x 2 KC bytes; the 16-byte chunk c of stage row r sits at chunk c ^ ((r & 1) << 2),
// which makes both the cp.async writes (8 lanes: 8 consecutive chunks of one row) and the fragment
// reads (8 lanes: chunks 4j+q of rows g, g+1: the two rows land in different 64-byte halves of the
// 128-byte bank window) conflict-free.
//
// Fragments without ldmatrix: the order of the k terms inside one dot is free as long as A and B
// use the same one. Lane (g = lane/4, q = lane%4) reads the 16 bytes at k = 32j + 8q .. 8q+7 of its
// rows g and g+8 (A) and of fn row g of each n-tile (B); words 0,1 feed one m16n8k16 (as the
// fragment's k pairs {2q, 2q+1} and {2q+8, 2q+9}), words 2,3 a second one. Over the 4 lanes of a
// quad that covers the 32 k of the block once, for A and B alike.
template <int H, int MT, int WM, int NST, int KC>
__global__ void __launch_bounds__(WM * 32, 1)
    g_hc_mix_kernel(const uint16_t *__restrict__ X, const uint16_t *__restrict__ fn2, int T, int K, int nkb,
                    float *__restrict__ P)
{
    using Sh = hm_shape<H>;
    constexpr int NM = Sh::NM, NT = Sh::NT, NF = Sh::NF, NPP = Sh::NPP;
    constexpr int CPR = KC / 8, RB = KC * 2;   // 16-byte chunks and bytes of a stage row
    constexpr int R = 16 * MT * WM, NTHR = 32 * WM, ROWS = R + NF, CH = ROWS * CPR, STAGE = ROWS * RB;
    extern __shared__ __align__(128) uint8_t hm_sm[];
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wrow = (tid >> 5) * 16 * MT;   // the warp's first row in the tile
    const int row0 = blockIdx.x * R, S = gridDim.y, s = blockIdx.y;
    const int kb0 = (int)((long long)s * nkb / S), nb = (int)((long long)(s + 1) * nkb / S) - kb0;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(hm_sm);

    // Staging: thread tid copies chunk c = tid % CPR of stage rows r = tid/CPR + u*NTHR/CPR
    // (NTHR/CPR is even: the swizzle c ^ ((r & 1) << 2) is the same for all u); sources
    // precomputed at block 0.
    constexpr int NU = (CH + NTHR - 1) / NTHR;
    static_assert(NTHR % (2 * CPR) == 0, "row parity must not depend on u");
    const int c8 = (tid % CPR) * 8;
    const uint32_t dst0 = sbase + (tid / CPR) * RB + (((tid % CPR) ^ (((tid / CPR) & 1) << 2)) << 4);
    const uint16_t *src[NU];
    bool rok[NU];
#pragma unroll
    for (int u = 0; u < NU; u++) {
        const int r = tid / CPR + u * (NTHR / CPR);
        if (r < R) {
            rok[u] = row0 + r < T;
            src[u] = X + (size_t)(rok[u] ? row0 + r : 0) * K + c8;
        } else {
            const int f = r - R, lo = f >= NT * 8, fr = f - lo * NT * 8;
            rok[u] = r < ROWS && fr < NM;
            src[u] = fn2 + (rok[u] ? lo * (size_t)NM * K + (size_t)fr * K : 0) + c8;
        }
    }
    auto load_stage = [&](int buf, int kb) {
        const bool kok = kb * KC + c8 < K;
#pragma unroll
        for (int u = 0; u < NU; u++)
            if (CH % NTHR == 0 || tid / CPR + u * (NTHR / CPR) < ROWS) {
                const bool ok = rok[u] && kok;   // else zero-fill (from a valid address, reading nothing)
                g_cp_async16(dst0 + buf * STAGE + u * (NTHR / CPR) * RB,
                             ok ? (const void *)(src[u] + (size_t)kb * KC) : (const void *)fn2, ok ? 16 : 0);
            }
    };

    float acc[MT][2 * NT][4];   // [m-tile][hi n-tiles, then lo n-tiles][fragment]
    float sq[MT][2][4];         // [m-tile][X.X^T against the tile's rows 0-7, rows 8-15][fragment]
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int n = 0; n < 2; n++) sq[m][n][0] = sq[m][n][1] = sq[m][n][2] = sq[m][n][3] = 0.0f;
#pragma unroll
        for (int n = 0; n < 2 * NT; n++) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
    }
    const bool live = row0 + wrow < T;   // warp-uniform: the warp has rows to compute
    const int swz = (g & 1) << 2;

    auto compute = [&](int buf) {
        const uint8_t *st = hm_sm + buf * STAGE;
#pragma unroll
        for (int j = 0; j < KC / 32; j++) {
            const int co = ((4 * j + q) ^ swz) << 4;
            uint4 b[2 * NT];
#pragma unroll
            for (int n = 0; n < 2 * NT; n++) b[n] = *(const uint4 *)(st + (R + n * 8 + g) * RB + co);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                const uint4 a0 = *(const uint4 *)(st + (wrow + m * 16 + g) * RB + co);
                const uint4 a1 = *(const uint4 *)(st + (wrow + m * 16 + g + 8) * RB + co);
                // the squares on the tensor cores: the tile's rows against its own rows 0-7 (B =
                // the a0 words) and 8-15 (B = the a1 words); the diagonal of X.X^T is each row's
                // sum of squares (read out in the epilogue)
                g_mma_bf16(sq[m][0], a0.x, a1.x, a0.y, a1.y, a0.x, a0.y);
                g_mma_bf16(sq[m][0], a0.z, a1.z, a0.w, a1.w, a0.z, a0.w);
                g_mma_bf16(sq[m][1], a0.x, a1.x, a0.y, a1.y, a1.x, a1.y);
                g_mma_bf16(sq[m][1], a0.z, a1.z, a0.w, a1.w, a1.z, a1.w);
#pragma unroll
                for (int n = 0; n < 2 * NT; n++) {
                    g_mma_bf16(acc[m][n], a0.x, a1.x, a0.y, a1.y, b[n].x, b[n].y);
                    g_mma_bf16(acc[m][n], a0.z, a1.z, a0.w, a1.w, b[n].z, b[n].w);
                }
            }
        }
    };

    // NST-stage pipeline, one __syncthreads per block: at iteration b block b has landed (own
    // copies: wait_group; everyone's: the barrier) and every warp is done with block b-1, whose
    // buffer then receives block b+NST-1. Empty commit groups keep the group count uniform.
#pragma unroll
    for (int p = 0; p < NST - 1; p++) {
        if (p < nb) load_stage(p, kb0 + p);
        g_cp_commit();
    }
    for (int b = 0; b < nb; b++) {
        g_cp_wait<NST - 2>();
        __syncthreads();
        if (b + NST - 1 < nb) load_stage((b + NST - 1) % NST, kb0 + b + NST - 1);
        g_cp_commit();
        if (live) compute(b % NST);
    }
    g_cp_wait<0>();
    if (!live) return;

    // partial row of this slice: dots (hi + lo) of cols n*8 + 2q, +1 for rows g / g+8; the sum of
    // squares stored by lane q == 0; pads zeroed by q >= 1
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            // the diagonal: row g (hh = 0) is element (g, g) of the rows-0-7 product, fragment
            // c[g & 1] of lane (g, q = g/2); row g+8 is element (g+8, 8+g) of the rows-8-15
            // product, c[2 + (g & 1)] of the same lane
            const float mine = (g & 1) ? sq[m][hh][2 * hh + 1] : sq[m][hh][2 * hh];
            const float v = __shfl_sync(0xffffffffu, mine, (lane & ~3) | (g >> 1));
            const int row = row0 + wrow + m * 16 + g + hh * 8;
            if (row >= T) continue;
            float *pr = P + ((size_t)s * T + row) * NPP;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = n * 8 + 2 * q + e;
                    if (col < NM) pr[col] = acc[m][n][2 * hh + e] + acc[m][NT + n][2 * hh + e];
                }
            if (q == 0) pr[NM] = v;
            else if (NM + q < NPP) pr[NM + q] = 0.0f;
        }
    }
}

// The tail, one launch: each token's partial rows are summed (lanes s0 = lane % LPT add rows s = s0,
// s0 + LPT, ... in order, then an xor butterfly over the token's LPT lanes: a fixed shape), giving
// the RMS factor r = 1/sqrtf(ss/n + eps) and the mixes a[i] * r; then lanes e = lane % (h h) run
// g_sinkhorn_token (g_internal.cuh: the split and Sinkhorn of v41g_sinkhorn, operation for
// operation) on them. LPT = 32: one token a warp (the S partials of a small T, where S is large,
// spread over 32 lanes; lanes from h h on only take part in the shuffles). LPT = h h: 32 / (h h)
// tokens a warp, every lane busy in the 20 Sinkhorn iterations (at T = 4096, h = 4: 7.7 against
// 11.6 us for one token a warp; at T = 64 the other way round, 19.5 against 17.3 us for the call).
template <int H, int LPT>
__global__ void __launch_bounds__(128) g_hc_fin_kernel(const float *__restrict__ P, int S, int T, int n,
                                                       float norm_eps, const float *__restrict__ sc,
                                                       const float *__restrict__ base, int iters, float eps,
                                                       float *pre, float *post, float *comb)
{
    using Sh = hm_shape<H>;
    constexpr int NM = Sh::NM, NPP = Sh::NPP, HH = H * H, TPW = 32 / LPT;
    static_assert(LPT == 32 || LPT == HH, "one token a warp, or one per h x h lanes");
    const int w = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31, l = lane % LPT;
    if (w * TPW >= T) return;   // warp-uniform
    const int tk = w * TPW + lane / LPT;
    const bool live = tk < T;
    const int t = live ? tk : T - 1;
    float a[NPP];
#pragma unroll
    for (int i = 0; i < NPP; i++) a[i] = 0.0f;
#pragma unroll(LPT == 32 ? 2 : 4)
    for (int s = l; s < S; s += LPT) {
        const float4 *p = (const float4 *)(P + ((size_t)s * T + t) * NPP);
#pragma unroll
        for (int v = 0; v < NPP / 4; v++) {
            const float4 x = __ldg(p + v);
            a[4 * v] += x.x;
            a[4 * v + 1] += x.y;
            a[4 * v + 2] += x.z;
            a[4 * v + 3] += x.w;
        }
    }
#pragma unroll
    for (int i = 0; i <= NM; i++)
#pragma unroll
        for (int o = LPT / 2; o > 0; o >>= 1) a[i] += __shfl_xor_sync(0xffffffffu, a[i], o);
    const float r = 1.0f / sqrtf(a[NM] / (float)n + norm_eps);
    auto mix = [&](int i) {   // a[i] * r for a lane-dependent i, without indexing the register array
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < NM; k++) v = k == i ? a[k] : v;
        return v * r;
    };
    g_sinkhorn_token<H>(mix, lane % HH, live && l < HH, t, sc, base, iters, eps, pre, post, comb);
}

// Tile shapes, measured on the H200 (session 10, h = 4, hD = 20480):
// - T >= 512: 128 rows a CTA (8 warps x 1 m-tile), 128-element blocks (256 contiguous bytes of
//   each row a stage), 4 stages of 44 KiB, one CTA per SM; fn is read from L2 once per 128 rows
//   (at T = 4096: 32 x 1.97 MB). The kernel takes 45-47 us at T = 4096 (ncu), against 54.8 us
//   for the sessions-5-9 shape (256 rows x 64-element blocks, squares on the CUDA cores), whose
//   loads alone, without the compute, took 47 us: a row's 128 bytes a stage were the limit.
// - small T: 64 rows a CTA (4 warps x 1 m-tile), 64-element blocks, 6 stages of 14 KiB (a CTA's
//   whole slice is usually in flight at once), two or more CTAs per SM.
#define HM_BIG_T 512
// need != NULL: only store the scratch size of this call in *need (nothing launched); else run
// with the scratch ws (ws_bytes of it; NULL: allocated here, stream-ordered).
template <int H, int MT, int WM, int NST, int KC, int LPT>
static int hm_run(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3, int T, int n,
                  float norm_eps, float hc_eps, int iters, float *pre, float *post, float *comb, void *ws,
                  size_t ws_bytes, size_t *need, cudaStream_t st)
{
    using Sh = hm_shape<H>;
    constexpr int R = 16 * MT * WM, NTHR = 32 * WM;
    const size_t smem = (size_t)NST * (R + Sh::NF) * KC * 2;
    auto kern = g_hc_mix_kernel<H, MT, WM, NST, KC>;
    G_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int nsm = g_num_sms();
    int cps = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cps, kern, NTHR, smem) != cudaSuccess) {
        cudaGetLastError();   // (not sticky) fall back to one CTA per SM
        cps = 1;
    }
    if (cps < 1) cps = 1;
    // K split S: the fewest sequential block steps per CTA slot (waves x (blocks + 2); the 2 stand
    // for a CTA's pipeline fill and partial write), the fewest splits on ties (each split adds
    // T x NPP floats of partials and work for the tail).
    const int tiles = (T + R - 1) / R, nkb = (n + KC - 1) / KC;
    const long slots = (long)nsm * cps;
    int S = 1;
    long best = -1;
    for (int sp = 1; sp <= nkb && sp <= 65535; sp++) {
        long waves = ((long)tiles * sp + slots - 1) / slots, cost = waves * ((nkb + sp - 1) / sp + 2);
        if (best < 0 || cost < best) { best = cost; S = sp; }
    }
    const size_t pbytes = sizeof(float) * (size_t)S * T * Sh::NPP;
    if (need) { *need = pbytes; return 0; }
    float *P = (float *)ws;
    if (P && ws_bytes < pbytes) return (int)cudaErrorInvalidValue;
    if (!P) G_CHECK(g_tmp_alloc((void **)&P, pbytes, st));
    kern<<<dim3((unsigned)tiles, (unsigned)S), NTHR, smem, st>>>(X, fn2, T, n, nkb, P);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        constexpr int TPW = 32 / LPT;
        g_hc_fin_kernel<H, LPT><<<(unsigned)((T + 4 * TPW - 1) / (4 * TPW)), 128, 0, st>>>(
            P, S, T, n, norm_eps, scale3, base, iters, hc_eps, pre, post, comb);
        e = cudaGetLastError();
    }
    cudaError_t f = ws ? cudaSuccess : cudaFreeAsync(P, st);   // freed on the error path too
    G_CHECK(e);
    G_CHECK(f);
    return 0;
}

template <int H>
static int hm_dispatch(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3, int T,
                       int n, float norm_eps, float hc_eps, int iters, float *pre, float *post, float *comb,
                       void *ws, size_t ws_bytes, size_t *need, cudaStream_t st)
{
    if (T >= HM_BIG_T)
        return hm_run<H, 1, 8, 4, 128, H * H>(X, fn2, base, scale3, T, n, norm_eps, hc_eps, iters, pre, post, comb,
                                              ws, ws_bytes, need, st);
    return hm_run<H, 1, 4, 6, 64, 32>(X, fn2, base, scale3, T, n, norm_eps, hc_eps, iters, pre, post, comb, ws,
                                      ws_bytes, need, st);
}

// X and fn2 16-byte aligned and h*D % 8 == 0 (16-byte rows; v41_gpu.h promises h*D % 256 == 0).
static int hm_entry(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3, int T, int h,
                    int D, float norm_eps, float hc_eps, int iters, float *pre, float *post, float *comb, void *ws,
                    size_t ws_bytes, size_t *need, cudaStream_t st)
{
    const int n = h * D;
    if (D <= 0 || n % 8 || (((uintptr_t)X | (uintptr_t)fn2) & 15)) return (int)cudaErrorInvalidValue;
    switch (h) {
    case 1: return hm_dispatch<1>(X, fn2, base, scale3, T, n, norm_eps, hc_eps, iters, pre, post, comb, ws, ws_bytes, need, st);
    case 2: return hm_dispatch<2>(X, fn2, base, scale3, T, n, norm_eps, hc_eps, iters, pre, post, comb, ws, ws_bytes, need, st);
    case 4: return hm_dispatch<4>(X, fn2, base, scale3, T, n, norm_eps, hc_eps, iters, pre, post, comb, ws, ws_bytes, need, st);
    default: return (int)cudaErrorInvalidValue;
    }
}
extern "C" int v41g_hc_mixes2(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3,
                              int T, int h, int D, float norm_eps, float hc_eps, int iters,
                              float *pre, float *post, float *comb, v41g_stream s)
{
    if (T <= 0) return 0;
    return hm_entry(X, fn2, base, scale3, T, h, D, norm_eps, hc_eps, iters, pre, post, comb, NULL, 0, NULL,
                    G_STREAM(s));
}
extern "C" size_t v41g_hc_mixes2_ws_size(int T, int h, int D)
{
    size_t need = 0;
    /* (16-byte aligned dummies: only the shapes are looked at) */
    static const uint16_t dummy[8] __attribute__((aligned(16))) = {0};
    if (T <= 0 || hm_entry(dummy, dummy, NULL, NULL, T, h, D, 0.0f, 0.0f, 0, NULL, NULL, NULL, NULL, 0, &need, 0))
        return 0;
    return need;
}
extern "C" int v41g_hc_mixes2_ws(const uint16_t *X, const uint16_t *fn2, const float *base, const float *scale3,
                                 int T, int h, int D, float norm_eps, float hc_eps, int iters,
                                 float *pre, float *post, float *comb, void *ws, size_t ws_bytes, v41g_stream s)
{
    if (T <= 0) return 0;
    if (!ws || ((uintptr_t)ws & 15)) return (int)cudaErrorInvalidValue;
    return hm_entry(X, fn2, base, scale3, T, h, D, norm_eps, hc_eps, iters, pre, post, comb, ws, ws_bytes, NULL,
                    G_STREAM(s));
}

extern "C" int v41g_hc_mixes(const uint16_t *X, const float *fn, const float *base, const float *scale3,
                             int T, int h, int D, float norm_eps, float hc_eps, int iters,
                             float *pre, float *post, float *comb, v41g_stream s)
{
    if (T <= 0) return 0;
    if (h != 1 && h != 2 && h != 4) return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    uint16_t *fn2 = NULL;   // the hi/lo split, here per call (an engine does it once at upload)
    size_t n = (size_t)(2 + h) * h * h * D;
    G_CHECK(g_tmp_alloc((void **)&fn2, 2 * n * sizeof(uint16_t), st));
    int rc = v41g_hc_split_fn(fn, h, D, fn2, s);
    if (!rc) rc = v41g_hc_mixes2(X, fn2, base, scale3, T, h, D, norm_eps, hc_eps, iters, pre, post, comb, s);
    if (rc) return rc;
    G_CHECK(cudaFreeAsync(fn2, st));
    return 0;
}

// y[t,:] = bf16(sum_i p[t,i] X[t,i,:]); one thread per 8-vector of D.
__global__ void g_hc_pre_kernel(const uint16_t *__restrict__ X, const float *__restrict__ p, uint16_t *y,
                                int T, int h, int D)
{
    int nv = D / 8;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * nv) return;
    int t = (int)(i / nv), v = (int)(i % nv);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int s = 0; s < h; s++) {
        float w = p[(size_t)t * h + s];
        uint4 x = *(const uint4 *)(X + ((size_t)t * h + s) * D + v * 8);
        const uint16_t *e = (const uint16_t *)&x;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] += w * g_bf2f(e[k]);
    }
    uint4 o;
    uint16_t *oe = (uint16_t *)&o;
#pragma unroll
    for (int k = 0; k < 8; k++) oe[k] = g_f2bf(acc[k]);
    *(uint4 *)(y + (size_t)t * D + v * 8) = o;
}

extern "C" int v41g_hc_pre(const uint16_t *X, const float *p, uint16_t *y, int T, int h, int D, v41g_stream s)
{
    if (D % 8) return (int)cudaErrorInvalidValue;
    size_t n = (size_t)T * (D / 8);
    if (!n) return 0;
    g_hc_pre_kernel<<<(unsigned)((n + 255) / 256), 256, 0, G_STREAM(s)>>>(X, p, y, T, h, D);
    G_LAUNCHED();
    return 0;
}

// Xout[t,j,:] = bf16(post_j*y + sum_i C[i][j]*X_i); all h inputs are read before
// any output is written, so Xout may alias X.
template <int H>
__global__ void g_hc_post_kernel(const uint16_t *__restrict__ y, const uint16_t *X, const float *__restrict__ post,
                                 const float *__restrict__ comb, uint16_t *Xout, int T, int D)
{
    int nv = D / 8;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)T * nv) return;
    int t = (int)(i / nv), v = (int)(i % nv);
    float xs[H][8], yv[8];
    uint4 yy = *(const uint4 *)(y + (size_t)t * D + v * 8);
#pragma unroll
    for (int k = 0; k < 8; k++) yv[k] = g_bf2f(((const uint16_t *)&yy)[k]);
#pragma unroll
    for (int s = 0; s < H; s++) {
        uint4 x = *(const uint4 *)(X + ((size_t)t * H + s) * D + v * 8);
#pragma unroll
        for (int k = 0; k < 8; k++) xs[s][k] = g_bf2f(((const uint16_t *)&x)[k]);
    }
    const float *C = comb + (size_t)t * H * H;
#pragma unroll
    for (int j = 0; j < H; j++) {
        float pj = post[(size_t)t * H + j];
        uint4 o;
        uint16_t *oe = (uint16_t *)&o;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float a = pj * yv[k];
#pragma unroll
            for (int s = 0; s < H; s++) a += C[s * H + j] * xs[s][k];
            oe[k] = g_f2bf(a);
        }
        *(uint4 *)(Xout + ((size_t)t * H + j) * D + v * 8) = o;
    }
}

extern "C" int v41g_hc_post(const uint16_t *y, const uint16_t *X, const float *post, const float *comb,
                            uint16_t *Xout, int T, int h, int D, v41g_stream s)
{
    if (D % 8) return (int)cudaErrorInvalidValue;
    size_t n = (size_t)T * (D / 8);
    if (!n) return 0;
    unsigned g = (unsigned)((n + 127) / 128);
    cudaStream_t st = G_STREAM(s);
    switch (h) {
    case 1: g_hc_post_kernel<1><<<g, 128, 0, st>>>(y, X, post, comb, Xout, T, D); break;
    case 2: g_hc_post_kernel<2><<<g, 128, 0, st>>>(y, X, post, comb, Xout, T, D); break;
    case 4: g_hc_post_kernel<4><<<g, 128, 0, st>>>(y, X, post, comb, Xout, T, D); break;
    default: return (int)cudaErrorInvalidValue;
    }
    G_LAUNCHED();
    return 0;
}
