// k_dev_a.cu: kernels of the device-resident decode step (gpu/v41_gpu_dev.h): element-wise
// conversions, row scatter/gather, decode key lists, the ratio-m compressor's decode step and the
// candidate-block mask. Everything here reproduces ref's arithmetic bit for bit (the one
// exception: compress_dec's exp, see g_exp_ref): bf16 rounding with ref's own bit operations
// (v41_f32_to_bf16 / v41_bf16r, NaN included), fp32 arithmetic through the _rn intrinsics so nvcc
// never contracts a multiply and an add that ref (C11, -ffp-contract=off) keeps separate.
// No entry point allocates, synchronises or reads device values on the host: all of them can be
// captured in a CUDA graph; per-step values (positions, lengths, row numbers) are read from device
// memory by the kernels.
#include "g_internal.cuh"
#include "v41_gpu_dev.h"
#include <math.h>

// ref/quant.c v41_f32_to_bf16: RNE; NaN keeps sign and payload's top bits, quiet bit forced.
__device__ __forceinline__ uint16_t g_f2bf_ref(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
// ref/v41_ops.h v41_bf16r: RNE to a bf16 value kept in fp32; NaN returned unchanged.
__device__ __forceinline__ float g_bf16r_ref(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

// Grid of a grid-stride loop over n elements (256 threads a block).
static inline unsigned g_nblocks(size_t n)
{
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 65536 ? 65536 : b);
}

// ---------------------------------------------------------------- conversions
__global__ void g_f32_to_bf16_kernel(const float *__restrict__ x, uint16_t *__restrict__ y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = g_f2bf_ref(x[i]);
}
__global__ void g_bf16_to_f32_kernel(const uint16_t *__restrict__ x, float *__restrict__ y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = g_bf2f(x[i]);
}
// ref indexer(): wv = w * wscale; w = v41_bf16r(wv)
__global__ void g_scale_bf16r_kernel(const float *__restrict__ x, float scale, float *__restrict__ y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = g_bf16r_ref(__fmul_rn(x[i], scale));
}

extern "C" int v41g_f32_to_bf16(const float *x, uint16_t *y, size_t n, v41g_stream s)
{
    if (n == 0) return 0;
    g_f32_to_bf16_kernel<<<g_nblocks(n), 256, 0, G_STREAM(s)>>>(x, y, n);
    G_LAUNCHED();
    return 0;
}
extern "C" int v41g_bf16_to_f32(const uint16_t *x, float *y, size_t n, v41g_stream s)
{
    if (n == 0) return 0;
    g_bf16_to_f32_kernel<<<g_nblocks(n), 256, 0, G_STREAM(s)>>>(x, y, n);
    G_LAUNCHED();
    return 0;
}
extern "C" int v41g_scale_bf16r(const float *x, float scale, float *y, size_t n, v41g_stream s)
{
    if (n == 0) return 0;
    g_scale_bf16r_kernel<<<g_nblocks(n), 256, 0, G_STREAM(s)>>>(x, scale, y, n);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- row movement
// One block per source row i (grid n), threads over the width. scatter: rows[i] < 0 skips the
// row. gather: rows[i] >= 0 is the contract; a negative entry leaves dst row i untouched (no
// out-of-bounds read).
template <typename E>
__global__ void g_scatter_rows_kernel(const E *__restrict__ src, int64_t ld_src, const int64_t *__restrict__ rows,
                                      int width, E *__restrict__ dst, int64_t ld_dst)
{
    const int64_t r = rows[blockIdx.x];
    if (r < 0) return;
    const E *sr = src + (int64_t)blockIdx.x * ld_src;
    E *dr = dst + r * ld_dst;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dr[c] = sr[c];
}
template <typename E>
__global__ void g_gather_rows_kernel(const E *__restrict__ src, int64_t ld_src, const int64_t *__restrict__ rows,
                                     int width, E *__restrict__ dst, int64_t ld_dst)
{
    const int64_t r = rows[blockIdx.x];
    if (r < 0) return;
    const E *sr = src + r * ld_src;
    E *dr = dst + (int64_t)blockIdx.x * ld_dst;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dr[c] = sr[c];
}
static inline int g_row_threads(int width) { return width >= 256 ? 256 : width >= 128 ? 128 : 64; }

extern "C" int v41g_scatter_rows16(const uint16_t *src, int64_t ld_src, const int64_t *rows, int n, int width,
                                   uint16_t *dst, int64_t ld_dst, v41g_stream s)
{
    if (n <= 0 || width <= 0) return 0;
    g_scatter_rows_kernel<uint16_t><<<n, g_row_threads(width), 0, G_STREAM(s)>>>(src, ld_src, rows, width, dst,
                                                                                 ld_dst);
    G_LAUNCHED();
    return 0;
}
extern "C" int v41g_scatter_rows32(const float *src, int64_t ld_src, const int64_t *rows, int n, int width,
                                   float *dst, int64_t ld_dst, v41g_stream s)
{
    if (n <= 0 || width <= 0) return 0;
    g_scatter_rows_kernel<float><<<n, g_row_threads(width), 0, G_STREAM(s)>>>(src, ld_src, rows, width, dst, ld_dst);
    G_LAUNCHED();
    return 0;
}
extern "C" int v41g_gather_rows16(const uint16_t *src, int64_t ld_src, const int64_t *rows, int n, int width,
                                  uint16_t *dst, int64_t ld_dst, v41g_stream s)
{
    if (n <= 0 || width <= 0) return 0;
    g_gather_rows_kernel<uint16_t><<<n, g_row_threads(width), 0, G_STREAM(s)>>>(src, ld_src, rows, width, dst,
                                                                                ld_dst);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- decode key lists
// One block per decode row, threads over the W + k entries (ref/engine.c attention(), decode).
__global__ void g_dec_lists_kernel(const int32_t *__restrict__ pos, const int32_t *__restrict__ floor_,
                                   const int64_t *__restrict__ win_row0, const int64_t *__restrict__ ckv_row0,
                                   const int32_t *__restrict__ topk, int W, int k, int32_t *__restrict__ idx)
{
    const int t = blockIdx.x;
    const int p = pos[t], fl = floor_[t];
    const int64_t w0 = win_row0[t];
    const int L = W + k;
    int32_t *row = idx + (int64_t)t * L;
    for (int j = threadIdx.x; j < W; j += blockDim.x) {
        const int slot = (p + 1 + j) % W;
        const int ps = p - ((p - slot) % W + W) % W;
        row[j] = (ps >= 0 && ps >= fl) ? (int32_t)(w0 + ps) : -1;
    }
    if (k > 0) {
        const int64_t c0 = ckv_row0[t];
        const int32_t *tk = topk + (int64_t)t * k;
        for (int j = threadIdx.x; j < k; j += blockDim.x) {
            const int32_t sj = tk[j];
            row[W + j] = sj >= 0 ? (int32_t)(c0 + sj) : -1;
        }
    }
}

extern "C" int v41g_dec_lists(const int32_t *pos, const int32_t *floor_, const int64_t *win_row0,
                              const int64_t *ckv_row0, const int32_t *topk, int T, int W, int k, int32_t *idx,
                              v41g_stream s)
{
    if (T <= 0) return 0;
    if (W < 0 || k < 0 || (k > 0 && !topk)) return (int)cudaErrorInvalidValue;
    if (W + k == 0) return 0;
    const int L = W + k;
    const int th = L >= 256 ? 256 : L >= 128 ? 128 : 64;
    g_dec_lists_kernel<<<T, th, 0, G_STREAM(s)>>>(pos, floor_, win_row0, ckv_row0, topk, W, k, idx);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- compressor decode step
// exp of ref's compressor softmax. ref calls glibc expf (correctly rounded in all but ~1e-4 of
// the arguments); the device expf is within 2 ulps and differs from it far more often. The
// double exp (within 1 double ulp) rounded once to fp32 is the correctly rounded expf except
// within 2^-29 ulp of a rounding boundary, so it agrees with glibc wherever glibc is correctly
// rounded (measured on glibc 2.36 over a stride of the arguments <= 0: 1 in 11600 differs, by
// one ulp). expf(-inf) = 0, expf(0) = 1 and NaN -> NaN as glibc.
__device__ __forceinline__ float g_exp_ref(float x) { return (float)exp((double)x); }

// Step 1: the history rows (kvh/sch[hrow0 + p] = kv/sc[t]); one block per row. A separate
// launch from step 2, so a group completed by a row reads every other row of the group from
// memory written before (also when several rows of one request share the launch).
__global__ void g_compress_hist_kernel(const float *__restrict__ kv, const float *__restrict__ sc,
                                       const int32_t *__restrict__ pos, const int64_t *__restrict__ hrow0, int d,
                                       float *__restrict__ kvh, float *__restrict__ sch)
{
    const int t = blockIdx.x;
    const int64_t hr = (hrow0[t] + pos[t]) * (int64_t)d;
    const float *kr = kv + (int64_t)t * d, *sr = sc + (int64_t)t * d;
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x) {
        kvh[hr + ch] = kr[ch];
        sch[hr + ch] = sr[ch];
    }
}

// Step 2: per channel, the softmax pooling of ref/engine.c compressor() over the group
// g0 = p/m*m .. p when (p + 1) % m == 0 (same operations in the same order: max by
// `s > mx ? s : mx` from -inf, e_k = expf(s_k - mx), sum += e_k in k order, acc += kv_k * (e_k /
// sum) in k order from 0). The e_k are computed again in the last loop (the same function of the
// same value: the same bits) instead of being kept in a per-thread array of m.
__global__ void g_compress_pool_kernel(const int32_t *__restrict__ pos, const int64_t *__restrict__ hrow0, int d,
                                       int m, const float *__restrict__ kvh, const float *__restrict__ sch,
                                       uint16_t *__restrict__ latent, uint8_t *__restrict__ emit)
{
    const int t = blockIdx.x;
    const int p = pos[t];
    uint16_t *lat = latent + (int64_t)t * d;
    const bool full = ((p + 1) % m) == 0;
    if (threadIdx.x == 0) emit[t] = full ? 1 : 0;
    if (!full) {
        for (int ch = threadIdx.x; ch < d; ch += blockDim.x) lat[ch] = 0;
        return;
    }
    const int g0 = p / m * m;
    const float *kg = kvh + (hrow0[t] + g0) * (int64_t)d, *sg = sch + (hrow0[t] + g0) * (int64_t)d;
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x) {
        float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
        for (int k = 0; k < m; k++) {
            const float sv = sg[(int64_t)k * d + ch];
            mx = sv > mx ? sv : mx;
        }
        for (int k = 0; k < m; k++) sum = __fadd_rn(sum, g_exp_ref(__fsub_rn(sg[(int64_t)k * d + ch], mx)));
        for (int k = 0; k < m; k++) {
            const float e = g_exp_ref(__fsub_rn(sg[(int64_t)k * d + ch], mx));
            acc = __fadd_rn(acc, __fmul_rn(kg[(int64_t)k * d + ch], __fdiv_rn(e, sum)));
        }
        lat[ch] = g_f2bf_ref(acc);
    }
}

extern "C" int v41g_compress_dec(const float *kv, const float *sc, const int32_t *pos, const int64_t *hrow0, int T,
                                 int d, int m, float *kvh, float *sch, uint16_t *latent, uint8_t *emit, v41g_stream s)
{
    if (T <= 0) return 0;
    if (m <= 0 || d < 0) return (int)cudaErrorInvalidValue;
    const int th = d >= 256 ? 256 : d >= 128 ? 128 : 64;
    if (d > 0) {
        g_compress_hist_kernel<<<T, th, 0, G_STREAM(s)>>>(kv, sc, pos, hrow0, d, kvh, sch);
        G_LAUNCHED();
    }
    g_compress_pool_kernel<<<T, th, 0, G_STREAM(s)>>>(pos, hrow0, d, m, kvh, sch, latent, emit);
    G_LAUNCHED();
    return 0;
}

// ---------------------------------------------------------------- candidate blocks
// One block of CM_THREADS per row. Block scores bs[b] (b < nb) = max of I[t, s] over the block's
// s < Lc (NaN never wins, so bs is never NaN; -0 vs +0 may come out either way, which no comparison
// sees), the +inf pin, then the kb best blocks of the total order "bs descending, block id
// ascending" (v41_topk_desc; NaN as -inf).
//
// Selection without sorting. Each bs is mapped to an order-preserving uint32 key (g_cm_key; -0 and
// +0 share the key of +0, as they compare equal). The kb-th best key is found by a radix select on
// the keys (4 passes of 8-bit digits, most significant first: a histogram of the digit among the
// keys that match the digits chosen so far, then the digit where the count from the top reaches
// the rank still wanted): it gives the threshold key thr and the number `need` of blocks with key
// == thr that are kept (those of the lowest ids). The id threshold thr_id is the id of the
// need-th block with key == thr in id order (a block-wide prefix count). Block b is chosen iff
// key(b) > thr or (key(b) == thr and b <= thr_id). When kb >= the number of blocks with bs > -inf,
// every such block is among the kb best (they rank above all -inf blocks): thr = key(-inf),
// thr_id = -1; otherwise thr > key(-inf), so all chosen blocks have bs > -inf. Either way the mask
// is exactly that of the kb best blocks with bs > -inf.
//
// The keys live in dynamic shared memory when ceil(S / B) of them fit (the device's opt-in limit);
// otherwise every pass computes them again from I (slower, only for very long rows). Block scores:
// where B / 4 is a power of two <= 32 and the rows are 16-byte aligned, a warp reads 32 float4 in
// one coalesced load and the B / 4 lanes of a block combine their maxima by shuffles (fmaxf from
// -inf: the largest non-NaN value, or -inf); otherwise one thread per block reads it.
#define CM_THREADS 1024
#define CM_U 8                     // float4 loads in flight per thread (block-score pass)
#define CM_HCOPIES 8               // histogram copies (lane % 8): fewer same-address atomics
#define CM_HSTRIDE 257             // words between copies (the copies of one digit: other banks)
#define CM_KEY_NEGINF 0x007fffffu  // g_cm_key(-inf), the smallest key

// Order-preserving image of a non-NaN float (a > b as floats <=> key(a) > key(b); key(-0) = key(+0)).
__device__ __forceinline__ uint32_t g_cm_key(float v)
{
    uint32_t u = __float_as_uint(v);
    if (v == 0.0f) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// max of I over block b (s < Lc) by `v > mx ? v : mx` from -inf, with the pin
__device__ __forceinline__ float g_block_score(const float *__restrict__ It, int b, int B, int Lc, int pin)
{
    if (b == pin) return INFINITY;
    float mx = -INFINITY;
    const int e = (int)min((int64_t)(b + 1) * B, (int64_t)Lc);
    for (int s = b * B; s < e; s++) {   // b * B < Lc: fits int
        const float v = It[s];
        mx = v > mx ? v : mx;
    }
    return mx;
}

__global__ void __launch_bounds__(CM_THREADS)
    g_cand_mask_kernel(const float *__restrict__ I, const int32_t *__restrict__ Lc_, const int32_t *__restrict__ pos,
                       int S, int m, int B, int kb_max, int use_smem, int vec, uint8_t *__restrict__ mask)
{
    extern __shared__ uint32_t cm_key[];   // [ceil(S/B)] when use_smem
    __shared__ uint32_t hist[CM_HCOPIES * CM_HSTRIDE];
    __shared__ uint32_t hcnt[256 + 32];   // digit d at d + d / 8 (warp 0's reads: no bank conflicts)
    __shared__ uint32_t s_dig, s_rem;
    __shared__ int s_nval, s_thr_id;
    __shared__ int s_wcnt[CM_THREADS / 32];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const float *It = I + (int64_t)t * S;
    uint8_t *mk = mask + (int64_t)t * S;
    int Lc = Lc_[t];
    Lc = Lc < 0 ? 0 : (Lc > S ? S : Lc);
    const int nb = (int)(((int64_t)Lc + B - 1) / B);
    const int p = pos[t];
    const int Lraw = (p + 1) / m;
    int pin = -1;
    if (Lraw > 0) {
        const int last = (Lraw - 1) / B;
        if (last < nb) pin = last;
    }
    const int kb = kb_max < nb ? kb_max : nb;
    if (tid == 0) { s_nval = 0; s_thr_id = -1; }
    __syncthreads();

    // block keys (shared memory) and the number of blocks with bs > -inf
    int nval = 0;
    if (use_smem && vec) {
        const int g = B >> 2;                       // lanes per block: a power of two <= 32
        const int nq = nb * g;                      // float4 slots of the nb blocks
        const float4 *I4 = reinterpret_cast<const float4 *>(It);
        for (int q0 = 0; q0 < nq; q0 += CM_THREADS * CM_U) {   // uniform: every lane shuffles
            float mx[CM_U];
#pragma unroll
            for (int u = 0; u < CM_U; u++) {
                const int q = q0 + u * CM_THREADS + tid;
                const int64_t s = 4 * (int64_t)q;
                float4 v = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
                if (q < nq && s < Lc) v = __ldg(I4 + q);   // s < Lc <= S, S % 4 == 0: the float4 is in the row
                float a = -INFINITY;
                if (s + 0 < Lc) a = fmaxf(a, v.x);
                if (s + 1 < Lc) a = fmaxf(a, v.y);
                if (s + 2 < Lc) a = fmaxf(a, v.z);
                if (s + 3 < Lc) a = fmaxf(a, v.w);
                mx[u] = a;
            }
#pragma unroll
            for (int u = 0; u < CM_U; u++)
                for (int o = 1; o < g; o <<= 1) mx[u] = fmaxf(mx[u], __shfl_xor_sync(0xffffffffu, mx[u], o));
#pragma unroll
            for (int u = 0; u < CM_U; u++) {
                const int q = q0 + u * CM_THREADS + tid;
                if (q < nq && (lane & (g - 1)) == 0) {
                    const int b = q / g;
                    const uint32_t key = g_cm_key(b == pin ? INFINITY : mx[u]);
                    cm_key[b] = key;
                    nval += key > CM_KEY_NEGINF;
                }
            }
        }
    } else {
        for (int b = tid; b < nb; b += CM_THREADS) {
            const uint32_t key = g_cm_key(g_block_score(It, b, B, Lc, pin));
            if (use_smem) cm_key[b] = key;
            nval += key > CM_KEY_NEGINF;
        }
    }
    for (int o = 16; o > 0; o >>= 1) nval += __shfl_xor_sync(0xffffffffu, nval, o);
    if (lane == 0 && nval) atomicAdd(&s_nval, nval);
    __syncthreads();   // also publishes cm_key
    nval = s_nval;
    // key of block b (b < nb)
    auto key_of = [&](int b) -> uint32_t {
        return use_smem ? cm_key[b] : g_cm_key(g_block_score(It, b, B, Lc, pin));
    };

    // threshold (thr, thr_id): chosen(b) = key(b) > thr || (key(b) == thr && b <= thr_id)
    uint32_t thr = 0xffffffffu;   // kb <= 0: nothing (no key reaches it)
    int thr_id = -1;
    if (kb > 0 && kb >= nval) {
        thr = CM_KEY_NEGINF;      // every block with bs > -inf
    } else if (kb > 0) {
        // radix select of the kb-th largest key; rem: its rank among the keys matching prefix
        uint32_t prefix = 0, pmask = 0, rem = (uint32_t)kb;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < CM_HCOPIES * CM_HSTRIDE; i += CM_THREADS) hist[i] = 0;
            __syncthreads();
            uint32_t *hc = hist + (tid & (CM_HCOPIES - 1)) * CM_HSTRIDE;
            for (int b = tid; b < nb; b += CM_THREADS) {
                const uint32_t key = key_of(b);
                if ((key & pmask) == prefix) atomicAdd(hc + ((key >> shift) & 255u), 1u);
            }
            __syncthreads();
            if (tid < 256) {
                uint32_t x = 0;
#pragma unroll
                for (int cp = 0; cp < CM_HCOPIES; cp++) x += hist[cp * CM_HSTRIDE + tid];
                hcnt[tid + (tid >> 3)] = x;
            }
            __syncthreads();
            if (wid == 0) {   // lane l: digits 255 - 8l - i, i = 0..7 (from the top)
                uint32_t c[8], tot = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int d = 255 - 8 * lane - i;
                    c[i] = hcnt[d + (d >> 3)];
                    tot += c[i];
                }
                const uint32_t inc = g_warp_scan_incl(tot, lane);   // inclusive prefix over the lanes (higher digits first)
                const uint32_t ex = inc - tot;
                if (ex < rem && rem <= inc) {   // exactly one lane
                    uint32_t r = rem - ex;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        if (r <= c[i]) { s_dig = (uint32_t)(255 - 8 * lane - i); s_rem = r; break; }
                        r -= c[i];
                    }
                }
            }
            __syncthreads();
            prefix |= s_dig << shift;
            pmask |= 255u << shift;
            rem = s_rem;
        }
        thr = prefix;
        // the rem-th block with key == thr in id order: tiles of CM_THREADS ids
        const int need = (int)rem;
        int run = 0;
        for (int base = 0; base < nb; base += CM_THREADS) {
            const int b = base + tid;
            const bool eq = b < nb && key_of(b) == thr;
            const int c = __syncthreads_count(eq);
            if (run + c >= need) {   // uniform
                const unsigned bal = __ballot_sync(0xffffffffu, eq);
                if (lane == 0) s_wcnt[wid] = __popc(bal);
                __syncthreads();
                int pre = run;
                for (int w = 0; w < wid; w++) pre += s_wcnt[w];
                pre += __popc(bal & ((1u << lane) - 1u));
                if (eq && pre == need - 1) s_thr_id = b;
                __syncthreads();
                break;
            }
            run += c;
        }
        thr_id = s_thr_id;
    }
    auto chosen = [&](uint32_t key, int b) -> bool { return key > thr || (key == thr && b <= thr_id); };

    // the mask: 1 for s < Lc in a chosen block, 0 elsewhere in [0, S)
    if (use_smem) {
        int s_done = 0;
        if ((reinterpret_cast<uintptr_t>(mk) & 15) == 0) {   // 16 bytes a thread
            const int nv = S >> 4;
            for (int c = tid; c < nv; c += CM_THREADS) {
                const int s0 = c << 4;
                uint32_t w[4] = {0u, 0u, 0u, 0u};
                if (s0 < Lc) {
                    int b = s0 / B, r = s0 - b * B;
                    bool o = chosen(cm_key[b], b);
#pragma unroll
                    for (int j = 0; j < 16; j++) {
                        if (s0 + j < Lc) {
                            if (r == B) { b++; r = 0; o = chosen(cm_key[b], b); }
                            if (o) w[j >> 2] |= 1u << ((j & 3) * 8);
                            r++;
                        }
                    }
                }
                reinterpret_cast<uint4 *>(mk)[c] = make_uint4(w[0], w[1], w[2], w[3]);
            }
            s_done = nv << 4;
        }
        for (int s = s_done + tid; s < S; s += CM_THREADS) {
            uint8_t o = 0;
            if (s < Lc) {
                const int b = s / B;
                o = chosen(cm_key[b], b) ? 1 : 0;
            }
            mk[s] = o;
        }
    } else {
        for (int b = tid; b < nb; b += CM_THREADS) {
            const uint8_t o = chosen(key_of(b), b) ? 1 : 0;
            const int e = (int)min((int64_t)(b + 1) * B, (int64_t)Lc);
            for (int s = b * B; s < e; s++) mk[s] = o;
        }
        for (int s = Lc + tid; s < S; s += CM_THREADS) mk[s] = 0;
    }
}

extern "C" int v41g_cand_mask(const float *I, const int32_t *Lc_, const int32_t *pos, int T, int S, int m, int B,
                              int kb_max, uint8_t *mask, v41g_stream s)
{
    if (T <= 0 || S <= 0) return 0;
    if (m <= 0 || B <= 0) return (int)cudaErrorInvalidValue;
    // shared memory: the keys when they fit the device's opt-in limit (beyond the default 48 KiB the
    // kernel's limit is raised, as k_attn.cu does; a function attribute, allowed during a capture)
    static size_t static_sm = 0;  // the kernel's static shared memory
    const int optin = g_smem_optin();
    size_t ssm = static_sm;
    if (!ssm) {
        cudaFuncAttributes fa;
        if (cudaFuncGetAttributes(&fa, g_cand_mask_kernel) == cudaSuccess) ssm = static_sm = fa.sharedSizeBytes;
        else {
            cudaGetLastError();
            ssm = 16 * 1024;   // (more than the static arrays: a conservative choice of the path)
        }
    }
    const size_t nbmax = ((size_t)S + B - 1) / B;
    const int use_smem = nbmax * sizeof(uint32_t) + ssm + 1024 <= (size_t)optin;   // (+1 KiB reserve)
    const size_t sm = use_smem ? nbmax * sizeof(uint32_t) : 0;
    const int g = B / 4;
    const int vec = B % 4 == 0 && g <= 32 && (g & (g - 1)) == 0 && S % 4 == 0 &&
                    (reinterpret_cast<uintptr_t>(I) & 15) == 0;
    if (sm + ssm > 48 * 1024)
        G_CHECK(cudaFuncSetAttribute(g_cand_mask_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    g_cand_mask_kernel<<<T, CM_THREADS, sm, G_STREAM(s)>>>(I, Lc_, pos, S, m, B, kb_max, use_smem, vec, mask);
    G_LAUNCHED();
    return 0;
}

// I[t, s] = -inf for s < min(S, *cmax) where mask[t, s] == 0. Grid (column chunks, rows).
__global__ void g_cand_apply_kernel(float *I, int S, const uint8_t *__restrict__ mask, int ld_mask,
                                    const int32_t *__restrict__ cmax, int T)
{
    const int cm = *cmax;
    const int lim = cm < S ? cm : S;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        float *It = I + (int64_t)t * S;
        const uint8_t *mt = mask + (int64_t)t * ld_mask;
        for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < lim; s += gridDim.x * blockDim.x)
            if (!mt[s]) It[s] = -INFINITY;
    }
}

extern "C" int v41g_cand_apply(float *I, int S, const uint8_t *mask, int ld_mask, const int32_t *cmax, int T,
                               v41g_stream s)
{
    if (T <= 0 || S <= 0) return 0;
    const int bx = (S + 255) / 256;
    dim3 grid(bx > 1024 ? 1024 : bx, T > 65535 ? 65535 : T);
    g_cand_apply_kernel<<<grid, 256, 0, G_STREAM(s)>>>(I, S, mask, ld_mask, cmax, T);
    G_LAUNCHED();
    return 0;
}
