// k_attn.cu: sparse attention with sink over an index list (SPEC §4.4), also
// used for DSpark's non-causal window attention (SPEC §8).
//
// One block (16 warps) per (query row, tile of 64 heads, split of the list). K = V
// is one shared head (MQA), so the heads are the M dimension of two tensor-core
// GEMMs per chunk of 64 list entries: S = Q.K^T [64 x 64] and O += P.V
// [64 x d] (mma.sync m16n8k16 bf16, fp32 accumulate; O stays in registers; the
// next chunk's keys are gathered by cp.async while this one is computed). The online softmax follows the
// official rounding points: chunks of 64 entries from index 0 of the list,
// running max from -1e30, fp32 denominator, probabilities rounded to bf16 in
// the numerator, sink added once with the final max. -1 entries are skipped in
// both sums (they never touch the normalisation), so padding has zero weight.
// When the list is split across blocks (small batches), per-split partials are
// merged by a second kernel (exactly the same result when all maxima agree).
#include "g_internal.cuh"

#define AT_MT 64      /* max heads per block (all of V4.1's: the key chunk is gathered once per row);
                         small batches use 32-head tiles (twice the CTAs, each chunk gathered twice) */
#define AT_CK 64      /* list entries per chunk (official chunk width) */
#define AT_THREADS 512
#define AT_NW (AT_THREADS / 32)   /* 16 warps */
#define AT_NEG (-1e30f)

struct at_smem {
    int dq, dp, ds;       /* leading dims (padded: conflict-free fragment loads) */
    size_t offQ, offK, offS, offP, offO, offV, total;
};
// Q tile | K chunk x 2 (double buffer) | S | P | m, l, corr | the split's index list
__host__ __device__ static inline at_smem at_layout(int d, int cps, int MT)
{
    at_smem L;
    L.dq = d + 8; L.dp = AT_CK + 8; L.ds = AT_CK + 4;
    L.offQ = 0;
    L.offK = L.offQ + (size_t)MT * L.dq * 2;
    L.offS = L.offK + 2 * (size_t)AT_CK * L.dq * 2;
    L.offP = L.offS + (size_t)MT * L.ds * 4;
    L.offO = L.offP + (size_t)MT * L.dp * 2;
    L.offV = L.offO + (size_t)3 * MT * 4;
    L.total = L.offV + (size_t)cps * AT_CK * 4;
    return L;
}
#define AT_MAX_CPS 16   /* index list of one split in shared memory: <= 4 KB */

// 16-byte global -> shared copy that bypasses registers (cp.async, L2 only);
// src_bytes = 0 zero-fills the destination (padding rows).
__device__ __forceinline__ void g_cp_async16(void *dst, const void *src, int src_bytes)
{
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void g_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void g_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void g_mma_bf16(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t g_ld32(const __nv_bfloat16 *p) { return *(const uint32_t *)p; }
// Fragment layouts of mma.m16n8k16 (g = lane/4, c = lane%4): A regs hold (row g | g+8, cols 2c,2c+1 | +8);
// B regs hold (k = 2c,2c+1 | +8, n = g); C holds (row g | g+8, cols 2c, 2c+1). Warp w computes the
// scores of keys 8(w%8).. for 32 of the 64 heads (S), then owns d/16 output columns of O for all 64
// heads (kept in registers, so the online-softmax rescale is a register multiply).
template <int NT, int DD, int MT>   /* head dim DD; 8-column n-tiles of O per warp NT = max(1, DD/128); MT heads */
__global__ void __launch_bounds__(AT_THREADS, 1)
g_sparse_attn_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv_a,
                     const uint16_t *__restrict__ kv_b, const int32_t *__restrict__ idx, int L, int n_a,
                     const float *__restrict__ sink, float scale, int H, int chunks_per_split,
                     uint16_t *__restrict__ o, float *__restrict__ part /* NS>1: [T,tiles,NS,MT,(d+2)] */)
{
    constexpr int d = DD;
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int MTL = MT / 16, MPW = MTL / 2;   // 16-head m-tiles; per warp in the S phase
    const at_smem Ly = at_layout(d, chunks_per_split, MT);
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)(smem + Ly.offQ);
    __nv_bfloat16 *Kbuf = (__nv_bfloat16 *)(smem + Ly.offK);
    float *Ss = (float *)(smem + Ly.offS);
    __nv_bfloat16 *Ps = (__nv_bfloat16 *)(smem + Ly.offP);
    float *Ms = (float *)(smem + Ly.offO), *Ls = Ms + MT, *Cs = Ls + MT;
    int *Vall = (int *)(smem + Ly.offV);
    const int dq = Ly.dq, dp = Ly.dp, ds = Ly.ds;

    const int t = blockIdx.x, tile = blockIdx.y, split = blockIdx.z, NS = gridDim.z;
    const int h0 = tile * MT;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
    constexpr int nv = d / 8;   /* 16-byte vectors per row */

    for (int i = tid; i < MT * nv; i += AT_THREADS) {
        int r = i / nv, c = i % nv;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (h0 + r < H) v = *(const uint4 *)(q + ((size_t)t * H + h0 + r) * d + c * 8);
        *(uint4 *)(Qs + r * dq + c * 8) = v;
    }
    if (tid < MT) { Ms[tid] = AT_NEG; Ls[tid] = 0.0f; }
    float acc[MTL][NT][4];
#pragma unroll
    for (int mt = 0; mt < MTL; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.0f;

    const int nchunks = (L + AT_CK - 1) / AT_CK;
    const int c0 = split * chunks_per_split, c1 = min(nchunks, c0 + chunks_per_split);
    const int32_t *row_idx = idx + (size_t)t * L;
    // the split's whole index list, once (positions past L are padding)
    for (int j = tid; j < (c1 - c0) * AT_CK; j += AT_THREADS) {
        int gj = c0 * AT_CK + j;
        Vall[j] = gj < L ? row_idx[gj] : -1;
    }
    __syncthreads();
    // issue the cp.async gather of chunk c into buffer b (invalid rows zero-filled)
    auto prefetch = [&](int c, int b) {
        __nv_bfloat16 *Kd = Kbuf + (size_t)b * AT_CK * dq;
        const int *Vc = Vall + (c - c0) * AT_CK;
#pragma unroll 4
        for (int i = tid; i < AT_CK * nv; i += AT_THREADS) {
            int j = i / nv, cc = i % nv, id = Vc[j];
            const uint16_t *pool = (c * AT_CK + j) < n_a ? kv_a : kv_b;
            const uint16_t *src = id >= 0 ? pool + (size_t)id * d + cc * 8 : pool;
            g_cp_async16(Kd + j * dq + cc * 8, src, id >= 0 ? 16 : 0);
        }
        g_cp_commit();
    };
    if (c0 < c1) prefetch(c0, 0);

    for (int c = c0; c < c1; c++) {
        const int b = (c - c0) & 1;
        const __nv_bfloat16 *Ks = Kbuf + (size_t)b * AT_CK * dq;
        const int *Vs = Vall + (c - c0) * AT_CK;
        // keep the next chunk's loads in flight while this one is computed
        if (c + 1 < c1) { prefetch(c + 1, b ^ 1); g_cp_wait<1>(); }
        else g_cp_wait<0>();
        __syncthreads();
        // S = Q . K^T: warp w -> keys 8w..8w+7, both 16-head m-tiles
        {
            float s[MPW][4];
#pragma unroll
            for (int m = 0; m < MPW; m++) s[m][0] = s[m][1] = s[m][2] = s[m][3] = 0.0f;
            const int kt = warp & 7, mb = (warp >> 3) * MPW;   // keys kt*8.., head m-tiles mb..mb+MPW-1
            const __nv_bfloat16 *kr = Ks + (kt * 8 + g) * dq + 2 * c4;
#pragma unroll 8
            for (int k0 = 0; k0 < d; k0 += 16) {
                uint32_t b0 = g_ld32(kr + k0), b1 = g_ld32(kr + k0 + 8);
#pragma unroll
                for (int m = 0; m < MPW; m++) {
                    const __nv_bfloat16 *qa = Qs + ((mb + m) * 16 + g) * dq + k0 + 2 * c4;
                    g_mma_bf16(s[m], g_ld32(qa), g_ld32(qa + 8 * dq), g_ld32(qa + 8), g_ld32(qa + 8 * dq + 8), b0, b1);
                }
            }
#pragma unroll
            for (int m = 0; m < MPW; m++) {
                float *sp = Ss + ((mb + m) * 16 + g) * ds + kt * 8 + 2 * c4;
                sp[0] = s[m][0]; sp[1] = s[m][1];
                sp[8 * ds] = s[m][2]; sp[8 * ds + 1] = s[m][3];
            }
        }
        __syncthreads();
        // online softmax over the chunk: warp w owns rows 4w..4w+3, lane owns columns lane, lane+32
        for (int rr = 0; rr < MT / AT_NW; rr++) {
            int r = warp * (MT / AT_NW) + rr;
            bool v0 = Vs[lane] >= 0, v1 = Vs[lane + 32] >= 0;
            float s0 = v0 ? Ss[r * ds + lane] * scale : -INFINITY;
            float s1 = v1 ? Ss[r * ds + lane + 32] * scale : -INFINITY;
            float cmax = g_warp_max(fmaxf(s0, s1));
            float mold = Ms[r];
            float mnew = fmaxf(mold, cmax);
            float p0 = v0 ? expf(s0 - mnew) : 0.0f, p1 = v1 ? expf(s1 - mnew) : 0.0f;
            float psum = g_warp_sum(p0 + p1);
            Ps[r * dp + lane] = __float2bfloat16_rn(p0);
            Ps[r * dp + lane + 32] = __float2bfloat16_rn(p1);
            __syncwarp();   // every lane has read Ms[r] / Ls[r]
            if (lane == 0) {
                float corr = expf(mold - mnew);
                Cs[r] = corr;
                Ls[r] = Ls[r] * corr + psum;
                Ms[r] = mnew;
            }
        }
        __syncthreads();
        // O = O*corr + P.V for this warp's columns (8*NT of them; warps past d/8 columns have none)
        if (warp * 8 * NT < d) {
#pragma unroll
            for (int mt = 0; mt < MTL; mt++) {
                float clo = Cs[mt * 16 + g], chi = Cs[mt * 16 + g + 8];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    acc[mt][nt][0] *= clo; acc[mt][nt][1] *= clo;
                    acc[mt][nt][2] *= chi; acc[mt][nt][3] *= chi;
                }
            }
#pragma unroll
            for (int k0 = 0; k0 < AT_CK; k0 += 16) {
                const uint16_t *vk = (const uint16_t *)Ks + (k0 + 2 * c4) * dq + warp * 8 * NT + g;
                uint32_t bb[NT][2];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint16_t *vp = vk + nt * 8;
                    bb[nt][0] = (uint32_t)vp[0] | ((uint32_t)vp[dq] << 16);
                    bb[nt][1] = (uint32_t)vp[8 * dq] | ((uint32_t)vp[9 * dq] << 16);
                }
#pragma unroll
                for (int mt = 0; mt < MTL; mt++) {
                    const __nv_bfloat16 *pa = Ps + (mt * 16 + g) * dp + k0 + 2 * c4;
                    uint32_t a0 = g_ld32(pa), a1 = g_ld32(pa + 8 * dp), a2 = g_ld32(pa + 8), a3 = g_ld32(pa + 8 * dp + 8);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) g_mma_bf16(acc[mt][nt], a0, a1, a2, a3, bb[nt][0], bb[nt][1]);
                }
            }
        }
        __syncthreads();   // all warps are done with buffer b before it is refilled
    }
    // epilogue: this thread holds rows (mt*16 + g [+8]) x columns (warp*8*NT + nt*8 + 2*c4 [+1])
#pragma unroll
    for (int mt = 0; mt < MTL; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            int r = mt * 16 + g + 8 * hf;
            if (warp * 8 * NT >= d) break;
            if (NS == 1) {
                if (h0 + r >= H) continue;
                float l = Ls[r];
                if (sink) l += expf(sink[h0 + r] - Ms[r]);
                float inv = l > 0.0f ? 1.0f / l : 0.0f;
                uint16_t *orow = o + ((size_t)t * H + h0 + r) * d + warp * 8 * NT + 2 * c4;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    *(uint32_t *)(orow + nt * 8) = (uint32_t)g_f2bf(acc[mt][nt][2 * hf] * inv) |
                                                   ((uint32_t)g_f2bf(acc[mt][nt][2 * hf + 1] * inv) << 16);
            } else {
                float *pp = part + ((((size_t)t * gridDim.y + tile) * NS + split) * MT + r) * (d + 2);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    pp[warp * 8 * NT + nt * 8 + 2 * c4] = acc[mt][nt][2 * hf];
                    pp[warp * 8 * NT + nt * 8 + 2 * c4 + 1] = acc[mt][nt][2 * hf + 1];
                }
                if (warp == 0 && c4 == 0) { pp[d] = Ms[r]; pp[d + 1] = Ls[r]; }
            }
        }
}

// Merge per-split partials: M = max m_s, l = sum l_s e^{m_s-M} (+ sink), o = sum O_s e^{m_s-M} / l.
__global__ void g_attn_merge_kernel(const float *__restrict__ part, const float *__restrict__ sink, int H, int d,
                                    int tiles, int NS, int MT, uint16_t *__restrict__ o)
{
    int t = blockIdx.x, h = blockIdx.y;
    int tile = h / MT, r = h % MT;
    const float *pp = part + (((size_t)t * tiles + tile) * NS) * MT * (d + 2) + (size_t)r * (d + 2);
    size_t sstride = (size_t)MT * (d + 2);
    float M = AT_NEG;
    for (int s = 0; s < NS; s++) M = fmaxf(M, pp[s * sstride + d]);
    float l = 0.0f;
    for (int s = 0; s < NS; s++) l += pp[s * sstride + d + 1] * expf(pp[s * sstride + d] - M);
    if (sink) l += expf(sink[h] - M);
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < NS; s++) a += pp[s * sstride + c] * expf(pp[s * sstride + d] - M);
        o[((size_t)t * H + h) * d + c] = g_f2bf(a * inv);
    }
}

template <int NT, int DD, int MT>
static int attn_launch(dim3 grid, size_t sm, cudaStream_t st, const uint16_t *q, const uint16_t *kv_a,
                       const uint16_t *kv_b, const int32_t *idx, int L, int n_a, const float *sink, float scale, int H,
                       int cps, uint16_t *o, float *part)
{
    G_CHECK(cudaFuncSetAttribute(g_sparse_attn_kernel<NT, DD, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
    G_CHECK(cudaFuncSetAttribute(g_sparse_attn_kernel<NT, DD, MT>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    g_sparse_attn_kernel<NT, DD, MT><<<grid, AT_THREADS, sm, st>>>(q, kv_a, kv_b, idx, L, n_a, sink, scale, H, cps, o, part);
    G_LAUNCHED();
    return 0;
}

extern "C" int v41g_sparse_attn(const uint16_t *q, const uint16_t *kv_a, const uint16_t *kv_b,
                                const int32_t *idx, int L, int n_a, const float *sink, float scale,
                                int T, int H, int d, uint16_t *o, v41g_stream s)
{
    if (T <= 0) return 0;
    if (L <= 0 || (d != 64 && d != 128 && d != 256 && d != 512)) return (int)cudaErrorInvalidValue;
    cudaStream_t st = G_STREAM(s);
    static_assert(AT_MT == 64 && AT_NW == 16, "S and softmax split assume 32 or 64 rows / 16 warps");
    // few rows: 32-head tiles double the CTAs (measured faster below ~32 rows); else all 64 heads
    const int MT = T < 32 ? 32 : AT_MT;
    int tiles = (H + MT - 1) / MT;
    int nchunks = (L + AT_CK - 1) / AT_CK;
    // Split the list across CTAs only when there are fewer (row, head-tile) pairs than SMs: one CTA
    // per SM fits (shared memory), so pick the split count with the fewest sequential chunk steps
    // (waves x chunks per CTA), the fewest splits on ties (each split adds partial traffic + a merge).
    int dev = 0, nsm = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev);
    int NS = 1, cps = nchunks;
    long best = -1;
    for (int ns = 1; ns <= ((long)T * tiles < nsm ? nchunks : 1); ns++) {   // enough rows: never split
        int c = (nchunks + ns - 1) / ns, nse = (nchunks + c - 1) / c;
        if (c > AT_MAX_CPS || nse != ns) continue;
        long waves = ((long)T * tiles * nse + nsm - 1) / nsm;
        long cost = waves * c;
        if (best < 0 || cost < best) { best = cost; NS = nse; cps = c; }
    }
    at_smem Ly = at_layout(d, cps, MT);
    float *part = NULL;
    if (NS > 1) G_CHECK(g_tmp_alloc((void **)&part, sizeof(float) * (size_t)T * tiles * NS * MT * (d + 2), st));
    dim3 grid(T, tiles, NS);
    int rc;
#define AT_L(NT_, D_, MT_) attn_launch<NT_, D_, MT_>(grid, Ly.total, st, q, kv_a, kv_b, idx, L, n_a, sink, scale, H, cps, o, part)
    switch (d) {
    case 64: rc = MT == 32 ? AT_L(1, 64, 32) : AT_L(1, 64, 64); break;
    case 128: rc = MT == 32 ? AT_L(1, 128, 32) : AT_L(1, 128, 64); break;
    case 256: rc = MT == 32 ? AT_L(2, 256, 32) : AT_L(2, 256, 64); break;
    default: rc = MT == 32 ? AT_L(4, 512, 32) : AT_L(4, 512, 64); break;
    }
#undef AT_L
    if (rc) return rc;
    if (NS > 1) {
        g_attn_merge_kernel<<<dim3(T, H), 128, 0, st>>>(part, sink, H, d, tiles, NS, MT, o);
        G_LAUNCHED();
        G_CHECK(cudaFreeAsync(part, st));
    }
    return 0;
}
