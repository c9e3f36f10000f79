// k_wq.cu: Linears whose weights stay in their storage formats on the device (SPEC §2):
// fp8 e4m3 codes with one e8m0 scale per 32x32 block, or fp4 e2m1 codes (two per byte) with one
// e8m0 scale per row and 32 columns. The weight is dequantized in registers, inside the GEMM.
//
// y[M,N] = x[M,K] . deq(W)^T on tensor cores, bf16 operands, fp32 accumulate. The dequantized
// operand is exact in bf16 (a 4-significant-bit e4m3 or 2-bit e2m1 code times a power of two),
// and x is bf16 (act_quant'ed by the caller for emulate-mode Linears, whose values q*scale are
// bf16-exact too), so every product is exact in fp32 and the result differs from ref's fp32 sum
// only by the fp32 summation order.
//
// Roles: the weight rows are the MMA's M dimension (A, dequantized into registers) and the
// activation rows (tokens) its N dimension (B, bf16 in shared memory): a decode batch of 1..8
// rows wastes no tensor work on padding rows. A CTA computes 128 weight rows x BM activation
// rows over 64-wide k tiles staged in shared memory by a 4- or 6-stage cp.async pipeline.
//  - sm_90a: g_wq_wgmma_kernel, 2 warpgroups (64 weight rows each), wgmma.m64nBMk16 with A from
//    registers and B (activations, 128-byte-swizzled K-major rows) from shared memory, BM = 8..128.
//  - elsewhere (or V41_WQ_NO_WGMMA=1): g_wq_mma_kernel, 4 warps (32 weight rows each, two m16
//    tiles), mma.sync m16n8k16, BM = 8*NT.
//
// Tiled codes: the device copy of the codes is cut into tiles of 128 rows x 64 columns, each tile
// one contiguous block (8 KB fp8, 4 KB fp4), the k tiles of one 128-row band consecutive,
// zero-padded past N and K (v41g_wq_tile). A CTA then streams contiguous blocks; in the
// checkpoint's row-major layout it would read 64 (fp8) or 32 (fp4) bytes from each of 128 rows
// a K row apart per tile, which DRAM serves at a fraction of its streaming rate. Inside a tile
// row the 64 columns are permuted into the MMA A-fragment order: the thread with lane % 4 = c
// needs, for k-step s, columns 16s + 2c, +1 (register a0/a1) and 16s + 2c + 8, +9 (a2/a3), and
// one 16-byte (fp8) or 8-byte (fp4) shared-memory load gives it all four k-steps of a row.
//  - fp8: position p = 16c + 4s + j holds column 16s + 2c + (j & 1) + 8 (j >> 1) (c, s, j = 0..3):
//    byte j of 32-bit word s is k-step s.
//  - fp4: element j (0..7) of 32-bit word w of thread c's 8 bytes (position p = 16c + 8w + j) holds
//    column 16 (2w + ((j >> 1) & 1)) + 2c + ((j >> 2) & 1) + 8 (j & 1): word w is k-steps 2w and
//    2w + 1, which is scale block 2kt + w, and elements j and j + 4 are the column pairs one A
//    register holds. The word does not keep element j as nibble j: its 4 bits are scattered
//    (wq_fp4_bit, session 28) for the rotate-permute decode below.
//
// Dequantization in registers:
//  - fp8: a byte permute puts each code in the high byte of a 16-bit lane (sign at bit 15) and its
//    7 magnitude bits shift down to bf16 bits 4..10: the bf16 number code * 2^-120 exactly, subnormal
//    codes included (as bf16 subnormals); one bf16x2 multiply by 2^(e-7) gives code * 2^(e-127)
//    exactly (a normal bf16 for e in [10, 134]). About 2.5 instructions per element.
//  - fp4: rotations, byte permutes and masks put the code's magnitude bits at bf16 bits 8..6 and
//    its sign at bit 15, the bf16 number code * 2^-126 exactly; one bf16x2 multiply by 2^(e-1) then
//    gives code * 2^(e-127) exactly (e > 128 takes a second multiply). 15 instructions per 8
//    elements (wq_dec_fp4x8).
// Small M: the k range is split over CTAs (gridDim.z) when there are too few CTAs for the SMs;
// each split writes fp32 partials and a second kernel sums them in split order (deterministic).
// That kernel is a programmatic dependent launch (g_launch_pdl): it may start once every GEMM CTA
// has left its k loop (the decode kernel: exited), and waits on the device for the GEMM to finish
// (H200, session 14: 0.2-0.6 us less a call at 1 and 64 rows). Summing the splits in the GEMM
// kernel instead (the last CTA of an output tile to arrive, by an atomic counter) was 2-8x slower:
// its serial chain of partial loads cost more than the second launch (session 13; so was a
// cluster reduction in general, session 12). The decode kernel sums its splits in a cluster where
// the grid is one wave of at most 8 splits (gemv_cluster: idx_wq_b at one row; session 22).
// Grouped calls (MoE): CTA (n tile, group) walks its group's rows in BM-row tiles; the group
// offsets are read on the device, so a call never waits for the host.
#include "g_internal.cuh"
#include "k_attn_wgmma.cuh"
#include "k_wq_layout.h"
#include "k_wq_wgmma.cuh"
#include <algorithm>
#include <cooperative_groups.h>
#include <limits.h>
#include <stdlib.h>

#define WQ_BN 128      /* weight rows per CTA */
#define WQ_XS 144      /* mma.sync kernel: activation row stride in shared memory (128 + 16: conflict-free) */

struct wq_args {
    const uint8_t *w, *s;
    long long w_stride, s_stride;
    int N, K, r0;
    const uint16_t *x;
    const int32_t *xrow, *off;   /* off NULL: dense (rows blockIdx.y*BM..), else grouped */
    int M;                       /* dense: rows; grouped: M_total */
    void *y;
    int out_f32;
    float *part;                 /* split-K partials [gridDim.z][M][N], or NULL */
    int kt_per_split;
    int xr;                      /* g_wq_gemv_kernel: activation rows per m tile (1..8, or 1..16 with NT = 2) */
    int kc;                      /* g_wq_gemv_kernel: k tiles per staged chunk of the rows (0: the split's k range) */
};

__host__ __device__ constexpr int wq_wrow(int fmt) { return fmt == V41G_WQ_FP8 ? 64 : 32; }   /* code bytes per row per k tile */
// pipeline depth: small activation tiles (decode) leave room for more weight tiles in flight
__host__ __device__ constexpr int wq_stages(int bm) { return bm <= 16 ? 6 : 4; }
// wq_col_of4 (column of tile-row position p, fp8 and fp4), wq_pos_of (fp8's inverse) and the fp4
// bit scatter wq_fp4_bit are in k_wq_layout.h, which the host tests compile too

// prmt.b32 of u and 0 with selector sel in PTX's generic mode: a selector nibble with bit 3 set
// gives the sign of the selected byte replicated over the byte (0xFF or 0x00). ptxas folds a
// constant selector into the instruction (the same cubin as an immediate-operand form)
__device__ __forceinline__ uint32_t wq_prmt(uint32_t u, uint32_t sel)
{
    uint32_t d;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(u), "r"(sel));
    return d;
}
// bytes 2h, 2h + 1 of u as two 16-bit lanes [byte, its sign replicated] (see wq_fp8_lanes)
#define WQ_SEL_FP8(h) ((h) ? 0xB3A2u : 0x9180u)
// the lanes of wq_prmt(u, WQ_SEL_FP8(h)) as e4m3 -> bf16 bit patterns: the 7 magnitude bits shift
// to bf16 bits 4..10, the replicated sign to bit 15 (a shift and one mask: the byte's own sign bit,
// now at bit 11, and the spill into the next lane fall outside 0x87F0)
__device__ __forceinline__ uint32_t wq_fp8_lanes(uint32_t x) { return (x & 0x087F087Fu) << 4; }
// 4 e4m3 codes (byte j = element j) times the bf16x2 scale mul = 2^(e-7): bf16x2 of elements 0,1
// and 2,3. Each code's magnitude bits go to bf16 bits 4..10 and its sign to bit 15: the bf16 number
// code * 2^-120 exactly (a subnormal code becomes a bf16 subnormal); the bf16x2 multiply then gives
// code * 2^(e-127) exactly.
__device__ __forceinline__ void wq_cvt_fp8(uint32_t u, uint32_t mul, uint32_t &p01, uint32_t &p23)
{
    uint32_t a = wq_fp8_lanes(wq_prmt(u, WQ_SEL_FP8(0))), b = wq_fp8_lanes(wq_prmt(u, WQ_SEL_FP8(1)));
    __nv_bfloat162 m = *(__nv_bfloat162 *)&mul;
    __nv_bfloat162 ra = __hmul2(*(__nv_bfloat162 *)&a, m), rb = __hmul2(*(__nv_bfloat162 *)&b, m);
    p01 = *(uint32_t *)&ra;
    p23 = *(uint32_t *)&rb;
}
// bf16x2 product of two bf16x2 bit patterns
__device__ __forceinline__ uint32_t wq_hmul2(uint32_t a, uint32_t b)
{
    __nv_bfloat162 r = __hmul2(*(const __nv_bfloat162 *)&a, *(const __nv_bfloat162 *)&b);
    return *(uint32_t *)&r;
}
// 8 e2m1 codes (element j = 0..7 of a word) as their exact bf16 values times the bf16x2 multiplier
// mul, without lookups: q[t] = bf16x2 of elements 3 - t (low half) and 7 - t (high half). A code's
// magnitude bits e1 e0 m at bf16 bits 8..6 (exponent field e, mantissa msb m) and its sign at bit
// 15 make the bf16 number code * 2^-126 exactly (e = 0: the subnormal (m/2) * 2^-126; bf16
// arithmetic keeps subnormal inputs, as the fp8 conversion above relies on too), so one bf16x2
// multiply by 2^126 gives the code's value and one by 2^(e-1) (wq_mul_fp4) the code times
// 2^(e-127), both exactly.
// The tiled word does not hold the codes as nibbles: g_wq_tile_kernel scatters bit k (0: m, 1: e0,
// 2: e1, 3: sign) of element j to bit wq_fp4_bit(j, k), so that the left rotations of the word by
// 0, 1, 3 and 6 bits hold every code's bit pairs (m, e0) at bits 6, 7 of a byte (the low byte of a
// bf16 lane) and (e1, sign) at bits 0, 7 of a byte (its high byte): one byte permute of two
// rotations and one mask then form each bf16x2 pair. Per 8 codes 3 rotations, 4 permutes, 4 ands
// and 4 multiplies: 15 instructions, 11 of them on the integer pipe (the nibble layout's shifts
// took 19, 15). Session 28 searched the layouts: none decodes with fewer using at most three
// rotation instructions (the word and each rotation of it can serve at most 4 of the 16 bit pairs,
// so four words are needed, and with four no pair can skip the permute); more rotations were not
// searched. With the fp4 tile
// layout, word w of a thread's row gives its A registers of k-steps 2w (q[3]: a0/a1, q[2]: a2/a3)
// and 2w + 1 (q[1], q[0]). gpu/bench/fp4shift_model.py models both sides.
// wq_fp4_bit, WQ_FP4_SEL_LO/HI and WQ_FP4_MASK: k_wq_layout.h.
__device__ __forceinline__ uint32_t wq_fp4_pair(uint32_t rl, uint32_t rh, uint32_t sel, uint32_t mul)
{
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(rl), "r"(rh), "r"(sel));
    return wq_hmul2(d & WQ_FP4_MASK, mul);
}
__device__ __forceinline__ void wq_dec_fp4x8(uint32_t W, uint32_t mul, uint32_t (&q)[4])
{
    const uint32_t r1 = __funnelshift_l(W, W, 1), r3 = __funnelshift_l(W, W, 3), r6 = __funnelshift_l(W, W, 6);
    q[0] = wq_fp4_pair(r1, W, WQ_FP4_SEL_LO, mul);
    q[1] = wq_fp4_pair(r1, W, WQ_FP4_SEL_HI, mul);
    q[2] = wq_fp4_pair(r3, r6, WQ_FP4_SEL_LO, mul);
    q[3] = wq_fp4_pair(r3, r6, WQ_FP4_SEL_HI, mul);
}
// half h of wq_dec_fp4x8: q[2h] and q[2h + 1] (h = 1: rotations 3 and 6; h = 0: 1 and the word).
// (wq_dec_fp4x8 as two calls of it computes the same values but changes the PTX of 13 measured
// kernels, the tiled ones included; session 29 kept their code as measured.)
__device__ __forceinline__ void wq_dec_fp4_half(uint32_t W, uint32_t mul, int h, uint32_t (&q)[4])
{
    const uint32_t rl = __funnelshift_l(W, W, h ? 3 : 1), rh = h ? __funnelshift_l(W, W, 6) : W;
    q[2 * h] = wq_fp4_pair(rl, rh, WQ_FP4_SEL_LO, mul);
    q[2 * h + 1] = wq_fp4_pair(rl, rh, WQ_FP4_SEL_HI, mul);
}
// pair t alone (g_wq_dequant_kernel: t at run time)
__device__ __forceinline__ uint32_t wq_dec_fp4_one(uint32_t W, int t, uint32_t mul)
{
    const uint32_t rl = __funnelshift_l(W, W, t < 2 ? 1 : 3), rh = t < 2 ? W : __funnelshift_l(W, W, 6);
    return wq_fp4_pair(rl, rh, (t & 1) ? WQ_FP4_SEL_HI : WQ_FP4_SEL_LO, mul);
}
// Multipliers of an e8m0 scale byte: fp8 path (bf16x2 2^(e-7); e in [10, 134], clamped); fp4 path
// (applied to code * 2^-126): 2^(min(e, 128) - 1), and for e > 128 the second factor 2^(e-128)
// (e = 255, e8m0's NaN: a bf16 NaN, as ref's scale is NaN); 1 otherwise.
#define WQ_S126 0x7E807E80u   /* bf16x2 2^126 */
__device__ __forceinline__ uint32_t wq_mul_fp8(uint32_t e)
{
    const uint32_t b = (min(e, 134u) + 120u) << 7;
    return b | (b << 16);
}
__device__ __forceinline__ uint32_t wq_mul_fp4(uint32_t e)
{
    const uint32_t b = (min(e, 128u) + 126u) << 7;
    return b | (b << 16);
}
// wq_mul_fp4 of a scale byte e <= 128 in one integer multiply-add ((e + 126) << 7 in both halves)
__device__ __forceinline__ uint32_t wq_mul_fp4_le128(uint32_t e) { return e * 0x00800080u + 0x3F003F00u; }
// wq_mul_fp4_le128 of byte i of w: PRMT puts the byte in both 16-bit halves, one IMAD then forms
// (e + 126) << 7 in each
template <int I> __device__ __forceinline__ uint32_t wq_mul_fp4_byte(uint32_t w)
{
    return __byte_perm(w, 0u, 0x4040u | (I << 8) | I) * 128u + 0x3F003F00u;
}
// nonzero where a byte of w exceeds 128 (bit 7 set and a low bit set; no carry crosses a byte)
__device__ __forceinline__ uint32_t wq_gt128x4(uint32_t w) { return ((w & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & w & 0x80808080u; }
__device__ __forceinline__ uint32_t wq_big_fp4(uint32_t e)
{
    const uint32_t b = e <= 128u ? 0x3F80u : e == 255u ? 0x7FC0u : (e - 1u) << 7;
    return b | (b << 16);
}


// ---- shared pieces of both kernels: the CTA's rows, their scales, the activation loads, the epilogue
struct wq_cta {
    int grp, mbeg, mend, n0, KT, ldsK, kt0, kt1;
    const uint8_t *S;
    __device__ wq_cta(const wq_args &a, int BM) {
        n0 = blockIdx.x * WQ_BN;
        grp = 0;
        if (a.off) { grp = blockIdx.y; mbeg = a.off[grp]; mend = a.off[grp + 1]; }
        else { mbeg = blockIdx.y * BM; mend = min(a.M, mbeg + BM); }
        KT = (a.K + 63) / 64;
        ldsK = a.K / 32;
        kt0 = blockIdx.z * a.kt_per_split;
        kt1 = min(KT, kt0 + a.kt_per_split);
        S = a.s + (size_t)grp * a.s_stride;
    }
};
// scale row of weight row n of the CTA's band (clamped into the matrix)
template <int FMT> __device__ __forceinline__ const uint8_t *wq_srow(const wq_args &a, const uint8_t *S, int n)
{
    n = min(n, a.N - 1);
    return S + (size_t)(FMT == V41G_WQ_FP8 ? (a.r0 + n) >> 5 : n) * (a.K / 32);
}
// the two scale bytes (blocks 2kt, 2kt+1) of a row as bf16x2 multipliers m, and for fp4 the
// second factors big (wq_big_fp4); returns whether either scale byte needs one (fp4, e > 128)
template <int FMT>
__device__ __forceinline__ bool wq_scales(const uint8_t *srow, int kt, int ldsK, uint32_t (&m)[2], uint32_t (&big)[2])
{
    bool any = false;
#pragma unroll
    for (int b = 0; b < 2; b++) {
        const int kb = 2 * kt + b;
        const uint32_t e = kb < ldsK ? (uint32_t)__ldg(srow + kb) : 127u;
        m[b] = FMT == V41G_WQ_FP8 ? wq_mul_fp8(e) : wq_mul_fp4(e);
        big[b] = FMT == V41G_WQ_FP8 ? 0u : wq_big_fp4(e);
        any |= FMT == V41G_WQ_FP4 && e > 128u;
    }
    return any;
}
// the four k-steps of one row: lo[s], hi[s] = bf16x2 of columns (16s + 2c, +1) and (16s + 2c + 8, +9)
template <int FMT> __device__ __forceinline__ void wq_row(const uint32_t *raw, const uint32_t (&m)[2],
                                                          uint32_t (&lo)[4], uint32_t (&hi)[4])
{
    if (FMT == V41G_WQ_FP8) {
#pragma unroll
        for (int s = 0; s < 4; s++) wq_cvt_fp8(raw[s], m[s >> 1], lo[s], hi[s]);
    } else {
#pragma unroll
        for (int w = 0; w < 2; w++) {
            uint32_t q[4];
            wq_dec_fp4x8(raw[w], m[w], q);
            lo[2 * w] = q[3]; hi[2 * w] = q[2]; lo[2 * w + 1] = q[1]; hi[2 * w + 1] = q[0];
        }
    }
}
// fp4 rows whose scale bytes exceed 128: the second multiply of wq_row's results (called only
// when a warp vote found one, so the common case issues nothing for it)
__device__ __forceinline__ void wq_row_fix(const uint32_t (&big)[2], uint32_t (&lo)[4], uint32_t (&hi)[4])
{
#pragma unroll
    for (int s = 0; s < 4; s++) {
        lo[s] = wq_hmul2(lo[s], big[s >> 1]);
        hi[s] = wq_hmul2(hi[s], big[s >> 1]);
    }
}
// raw codes of one row of the staged tile: this thread's 16 (fp8) or 8 (fp4) bytes
template <int FMT> __device__ __forceinline__ void wq_raw(const unsigned char *Ws, int row, int c, uint32_t *raw)
{
    constexpr int WROW = wq_wrow(FMT);
    const unsigned char *p = Ws + row * WROW + (WROW / 4) * c;
    if (FMT == V41G_WQ_FP8) {
        const uint4 v = *(const uint4 *)p;
        raw[0] = v.x; raw[1] = v.y; raw[2] = v.z; raw[3] = v.w;
    } else {
        const uint2 v = *(const uint2 *)p;
        raw[0] = v.x; raw[1] = v.y;
    }
}
// wq_raw from a 32-bit shared address (the wgmma kernel: the thread's address, computed once, plus the
// sub-stage's offset; volatile keeps the loads after the stage's barrier)
template <int FMT> __device__ __forceinline__ void wq_raw_s(uint32_t sa, uint32_t *raw)
{
    if (FMT == V41G_WQ_FP8)
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(raw[0]), "=r"(raw[1]), "=r"(raw[2]), "=r"(raw[3]) : "r"(sa));
    else
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(raw[0]), "=r"(raw[1]) : "r"(sa));
}
__device__ __forceinline__ void wq_store(const wq_args &a, int m0, int r, int n, float v)
{
    const size_t o = (size_t)(m0 + r) * a.N + n;
    if (a.part) a.part[(size_t)blockIdx.z * a.M * a.N + o] = v;
    else if (a.out_f32) ((float *)a.y)[o] = v;
    else ((uint16_t *)a.y)[o] = g_f2bf(v);
}

// The activation chunks one thread copies per k tile: 16-byte column chunk ch = tid % 8 of rows
// tid / 8 + RS*j (RS = threads / 8) of the BM-row m tile; the row pointers (gathered through xrow)
// are resolved once per m tile. load() issues the k tile's cp.async copies, dst(r) giving the
// shared address of row r's chunk ch (rows past the m tile, or k past K, zero-filled: a copy of 0
// bytes from the row's own pointer, a.x for rows past the tile, so the source address needs no
// reload of a.x from the parameter bank).
template <int BM, int THREADS> struct wq_xsrc {
    static constexpr int RS = THREADS / 8, NXR = (BM * 8 + THREADS - 1) / THREADS;
    const uint16_t *p[NXR];
    bool ok[NXR];
    int ch, xr0;
    __device__ wq_xsrc(const wq_args &a, int tid, int m0, int mrows) : ch(tid & 7), xr0(tid >> 3) {
#pragma unroll
        for (int j = 0; j < NXR; j++) {
            const int r = xr0 + RS * j;
            ok[j] = r < BM && r < mrows;
            p[j] = ok[j] ? a.x + (size_t)(a.xrow ? a.xrow[m0 + r] : m0 + r) * a.K + ch * 8 : a.x;
        }
    }
    // KO (the grouped instances): one 32-bit byte offset per k tile for all of the thread's rows, so
    // that a copy is a 64-bit add and the cp.async, without the 64-bit select of its source (session
    // 32, H100 SASS: 113 -> 92 instructions for a stage's copies in the grouped fp4 kernel; its
    // w1||w3 and w2 calls at 4096 tokens 1-3 % faster; the dense 64-row calls measured 0-4 % slower
    // with it, so they keep the select)
    template <bool KO, typename D> __device__ void load(const wq_args &a, int kt, D dst) const {
        const bool kin = kt * 64 + ch * 8 < a.K;
        const uint32_t ko = kin ? (uint32_t)kt * 128u : 0u;
#pragma unroll
        for (int j = 0; j < NXR; j++) {
            const int r = xr0 + RS * j;
            if (r < BM)
                g_cp_async16(dst(r), KO ? (const void *)((const char *)p[j] + ko) : kin ? p[j] + kt * 64 : p[j],
                             ok[j] && kin ? 16 : 0);
        }
    }
};
// the weight tile (WT contiguous bytes) into shared memory at sw, 16 bytes a copy
template <int WT, int THREADS> __device__ __forceinline__ void wq_wload(uint32_t sw, const uint8_t *tile, int tid)
{
#pragma unroll
    for (int j = 0; j < WT / 16 / THREADS; j++) g_cp_async16(sw + (tid + j * THREADS) * 16, tile + (tid + j * THREADS) * 16, 16);
}

// The wgmma kernel's output tile into y0 (fp32 partials of split blockIdx.z, or the fp32 or bf16
// output, [M][N]): acc[4i + e] is weight row n (+8 for e >= 2) and activation row 8i + 2c (+1 for
// odd e) of the m tile at m0. One pointer steps 8 rows an i; the other row parity and the +8
// weight row are offsets from it. Per element a store and its predicate, where a 64-bit index
// product per element (wq_store) took about 8 instructions: at 64 rows 992 instead of 1296 SASS
// instructions in the fp8 kernel; the fp8 Linears at 64 rows 1-5 % faster on the H200 (session 19).
template <int BN, typename T, typename F>
__device__ __forceinline__ void wq_store_tile(T *y0, const wq_args &a, int m0, int mrows, int n, int c,
                                              const float (&acc)[BN / 2], F cvt)
{
    const bool okA = n < a.N, okB = n + 8 < a.N;
    T *p = y0 + (size_t)(m0 + 2 * c) * a.N + n;
    const size_t N8 = (size_t)8 * a.N;
#pragma unroll
    for (int i = 0; i < BN / 8; i++, p += N8) {
        const int r = 8 * i + 2 * c;
        if (r < mrows) {
            if (okA) p[0] = cvt(acc[4 * i]);
            if (okB) p[8] = cvt(acc[4 * i + 2]);
        }
        if (r + 1 < mrows) {
            if (okA) p[a.N] = cvt(acc[4 * i + 1]);
            if (okB) p[a.N + 8] = cvt(acc[4 * i + 3]);
        }
    }
}

// ---- mma.sync kernel (any sm_80+ device): 4 warps, warp w: weight rows 32w.. (two m16 tiles)
template <int FMT, int NT>
__global__ void __launch_bounds__(128) g_wq_mma_kernel(wq_args a)
{
    constexpr int THREADS = 128, WROW = wq_wrow(FMT), BM = 8 * NT, WT = WQ_BN * WROW;
    constexpr int STAGE = WT + BM * WQ_XS, STAGES = wq_stages(BM);
    extern __shared__ __align__(16) unsigned char wq_sm[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(wq_sm);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    wq_cta C(a, BM);
    if (C.mbeg >= C.mend) return;
    const uint8_t *Wb = a.w + (size_t)C.grp * a.w_stride + (size_t)blockIdx.x * C.KT * WT;
    const uint8_t *srow[4];   /* rows i = 2*mt + half: row 16mt + 8half + g of the warp */
#pragma unroll
    for (int i = 0; i < 4; i++) srow[i] = wq_srow<FMT>(a, C.S, C.n0 + warp * 32 + 8 * i + g);
    for (int m0 = C.mbeg; m0 < C.mend; m0 += BM) {
        const int mrows = min(BM, C.mend - m0);
        const wq_xsrc<BM, THREADS> X(a, tid, m0, mrows);
        auto load = [&](int kt, int st) {
            const uint32_t sw = sbase + st * STAGE, sx = sw + WT;
            wq_wload<WT, THREADS>(sw, Wb + (size_t)kt * WT, tid);
            X.template load<false>(a, kt, [&](int r) { return sx + r * WQ_XS + X.ch * 16; });
        };
        float acc[2][NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
        __syncthreads();   // every warp is done with the previous m tile's stages
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) {
            if (C.kt0 + st < C.kt1) load(C.kt0 + st, st);
            g_cp_commit();
        }
        for (int kt = C.kt0; kt < C.kt1; kt++) {
            const int st = (kt - C.kt0) % STAGES;
            g_cp_wait<STAGES - 2>();
            __syncthreads();   // tile kt landed for all threads; every warp is done with tile kt-1's stage
            {
                const int kn = kt + STAGES - 1;
                if (kn < C.kt1) load(kn, (kn - C.kt0) % STAGES);
                g_cp_commit();
            }
            uint32_t mul[4][2], big[4][2];
            bool fix = false;
#pragma unroll
            for (int i = 0; i < 4; i++) fix |= wq_scales<FMT>(srow[i], kt, C.ldsK, mul[i], big[i]);
            const unsigned char *Ws = wq_sm + st * STAGE, *Xs = Ws + WT;
            uint32_t raw[4][WROW / 16], lo[4][4], hi[4][4];   /* [row i][k-step s] */
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wq_raw<FMT>(Ws, warp * 32 + 8 * i + g, c, raw[i]);
                if (FMT == V41G_WQ_FP4) wq_row<FMT>(raw[i], mul[i], lo[i], hi[i]);   /* fp8: per k-step below */
            }
            if (FMT == V41G_WQ_FP4 && __any_sync(0xFFFFFFFFu, fix))
#pragma unroll
                for (int i = 0; i < 4; i++) wq_row_fix(big[i], lo[i], hi[i]);
#pragma unroll
            for (int s = 0; s < 4; s++) {
                if (FMT == V41G_WQ_FP8)
#pragma unroll
                    for (int i = 0; i < 4; i++) wq_cvt_fp8(raw[i][s], mul[i][s >> 1], lo[i][s], hi[i][s]);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const unsigned char *xr = Xs + (8 * j + g) * WQ_XS + (16 * s + 2 * c) * 2;
                    const uint32_t b0 = *(const uint32_t *)xr, b1 = *(const uint32_t *)(xr + 16);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
                        g_mma_bf16(acc[mt][j], lo[2 * mt][s], lo[2 * mt + 1][s], hi[2 * mt][s], hi[2 * mt + 1][s], b0,
                                   b1);
                }
            }
        }
        g_cp_wait<0>();
        g_pdl_trigger();   // the split-K reduction may launch (it waits for this grid to finish)
        // acc[mt][j][e] = (weight row 16mt + g (+8 for e >= 2), activation row 8j + 2c (+1 for odd e))
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = C.n0 + warp * 32 + 16 * mt + g + (e >> 1) * 8, r = 8 * j + 2 * c + (e & 1);
                    if (n < a.N && r < mrows) wq_store(a, m0, r, n, acc[mt][j][e]);
                }
    }
}

// ---- wgmma kernel (sm_90a): 2 warpgroups, warpgroup w: weight rows 64w..64w+63; BN activation
// rows per m tile (wgmma N). Shared memory per stage: the weight tile (raw codes) then the
// activation tile, BN rows of 128 bytes with the 128-byte swizzle (16-byte chunk j of row r at
// chunk j ^ (r % 8)), every stage 1024-byte aligned (the swizzle atom).
__host__ __device__ constexpr int wq_wg_stage(int fmt, int bn) { return WQ_BN * wq_wrow(fmt) + bn * 128; }
template <int BN> __device__ __forceinline__ void wq_wg_mma(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t db)
{
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (BN == 8) wq_mma_rs_n8(d, a[0], a[1], a[2], a[3], db, 1);
    else if constexpr (BN == 16) wq_mma_rs_n16(d, a[0], a[1], a[2], a[3], db, 1);
    else if constexpr (BN == 32) wq_mma_rs_n32(d, a[0], a[1], a[2], a[3], db, 1);
    else if constexpr (BN == 64) wq_mma_rs_n64(d, a[0], a[1], a[2], a[3], db, 1);
    else wq_mma_rs_n128(d, a[0], a[1], a[2], a[3], db, 1);
#endif
}

// k tiles per pipeline stage: fp4 takes two (the second tile's dequantization overlaps the first
// tile's wgmmas, and the barrier, cp.async addressing and wgmma wait are per two tiles); fp8's
// 8 KB tiles keep one (two would halve its CTAs per SM at BN = 64)
__host__ __device__ constexpr int wq_wg_u(int fmt) { return fmt == V41G_WQ_FP4 ? 2 : 1; }
// TL > 0 (grouped calls): an m tile stages BN + TL activation rows, and a group's last rows, when
// at most BN + TL remain, run in one pass: the first BN as wgmma N = BN, the rest (1..TL) as a
// second wgmma of N = TL on the same A registers (TL * 128 bytes further in the stage). Without
// it a group of 65..80 rows took a second pass over its whole weight band for its last rows,
// dequantizing every tile again (the MoE at 4096 tokens: 64 rows a group on average, about half
// of the groups over 64)
template <int FMT, int BN, int TL>
__global__ void __launch_bounds__(256, BN <= 64 ? 2 : 1) g_wq_wgmma_kernel(wq_args a)
{
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int THREADS = 256, WROW = wq_wrow(FMT), WT = WQ_BN * WROW, BR = BN + TL, STAGE = wq_wg_stage(FMT, BR),
                  U = wq_wg_u(FMT), STAGES = wq_stages(BN);
    static_assert(TL == 0 || TL == 8 || TL == 16 || TL == 32, "a wgmma N for the tail");
    static_assert(WT % 1024 == 0 && STAGE % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
    extern __shared__ __align__(1024) unsigned char wq_smw[];
    const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(wq_smw);
    const uint32_t sbase = (sraw + 1023u) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
    wq_cta C(a, BN);
    if (C.mbeg >= C.mend) return;
    const uint8_t *Wb = a.w + (size_t)C.grp * a.w_stride + (size_t)blockIdx.x * C.KT * WT;
    const int rA = 64 * wg + 16 * w4 + g, rB = rA + 8;   /* this thread's rows of the CTA's 128 */
    const uint8_t *sA = wq_srow<FMT>(a, C.S, C.n0 + rA), *sB = wq_srow<FMT>(a, C.S, C.n0 + rB);
    // grouped fp4 calls (the MoE), K a multiple of 128, an even k range: the four scale bytes of a
    // stage's two k tiles are one aligned 32-bit word of each of the thread's rows, loaded before
    // the stage's barrier and voted on once a stage (session 25: ncu found the warps of the MoE at
    // 4096 tokens stalled on the per-tile byte loads, issued right before their use, in 23 % of
    // their samples; grouped w1||w3 4270-4291 -> 3480-3509 us with the addressing below). The dense
    // instances (TL = 0) keep the per-tile loads: their 64-row expert w2 measured 5 % slower with
    // the word
    const bool s4 = TL > 0 && FMT == V41G_WQ_FP4 && U == 2 && (C.ldsK & 3) == 0 && ((C.kt0 | C.kt1) & 1) == 0 &&
                    ((uintptr_t)C.S & 3) == 0;
    // Addresses computed once: the shared address of this thread's codes of row rA (row rB is 8 rows
    // further), and the descriptor of sub-stage 0's activations; sub-stage ss adds ss * STAGE >> 4 to
    // the descriptor's 14-bit address field (every shared address of a CTA is below 256 KB, the
    // field's range, so no carry leaves it). Built from sbase at every tile, they cost about 25 SASS
    // instructions a stage of the grouped fp4 kernel; now ptxas still rematerialises part of sbase
    // (its 128 registers are full) but the descriptors between the wgmmas are one uniform op each:
    // the grouped fp4 calls at 4096 tokens 3-4 % faster on an H100 (session 32), the dense 64-row
    // calls within 1 %
    const uint32_t sthr = sbase + rA * WROW + (WROW / 4) * c;
    const uint64_t dx0 = aw_desc(sbase + WT, 16, 1024);
    for (int m0 = C.mbeg, rows; m0 < C.mend; m0 += rows) {
        rows = C.mend - m0 <= BR ? C.mend - m0 : BN;   /* this pass: the main tile and the tail */
        const int mrows = min(BN, rows), trows = rows - mrows;   /* trows > 0 only where TL > 0 */
        const wq_xsrc<BR, THREADS> X(a, tid, m0, rows);
        // the 128-byte swizzle (chunk ch of row r at chunk ch ^ (r % 8)): a thread's rows are RS apart,
        // so they share r % 8 and one offset serves them all
        static_assert(X.RS % 8 == 0, "a thread's activation rows share their swizzle phase");
        const uint32_t xo = X.xr0 * 128 + ((X.ch ^ (X.xr0 & 7)) << 4);
        // stage st holds U sub-stages (weight tile, then activation tile), k tiles kt, kt + 1, ...
        // (those below the split's end); a band's k tiles are consecutive in global memory
        auto load = [&](int kt, int st) {
#pragma unroll
            for (int j = 0; j < U; j++)
                if (kt + j < C.kt1) {
                    const uint32_t sw = sbase + (st * U + j) * STAGE, sx = sw + WT;
                    wq_wload<WT, THREADS>(sw, Wb + (size_t)(kt + j) * WT, tid);
                    X.template load<(TL > 0)>(a, kt + j, [&](int r) { return sx + xo + (r - X.xr0) * 128; });
                }
        };
        // the A registers of k tile kt from sub-stage ss: af[s] = a0 (row g, cols 2c..), a1 (row g+8),
        // a2 (row g, cols 2c+8..), a3 of k-step s
        auto decode = [&](int kt, int ss, uint32_t (&af)[4][4], uint32_t swA, uint32_t swB, bool sfix, int h) {
            uint32_t mA[2], mB[2], bA[2], bB[2];
            bool fix = false;
            if (FMT == V41G_WQ_FP4 && s4) {
                fix = sfix;
                if (!fix) {
                    if (h == 0) {
                        mA[0] = wq_mul_fp4_byte<0>(swA); mA[1] = wq_mul_fp4_byte<1>(swA);
                        mB[0] = wq_mul_fp4_byte<0>(swB); mB[1] = wq_mul_fp4_byte<1>(swB);
                    } else {
                        mA[0] = wq_mul_fp4_byte<2>(swA); mA[1] = wq_mul_fp4_byte<3>(swA);
                        mB[0] = wq_mul_fp4_byte<2>(swB); mB[1] = wq_mul_fp4_byte<3>(swB);
                    }
                } else {
#pragma unroll
                    for (int b = 0; b < 2; b++) {
                        const uint32_t eA = (swA >> (16 * h + 8 * b)) & 0xFFu, eB = (swB >> (16 * h + 8 * b)) & 0xFFu;
                        mA[b] = wq_mul_fp4(eA); bA[b] = wq_big_fp4(eA);
                        mB[b] = wq_mul_fp4(eB); bB[b] = wq_big_fp4(eB);
                    }
                }
            } else if constexpr (FMT == V41G_WQ_FP4) {
                // the scale bytes, and their multipliers by one IMAD each while no byte of the warp's
                // exceeds 128 (a real checkpoint's scales are far below 2^1), else with the clamp and
                // the second factors of wq_scales (the MoE at 4096 tokens 0.7 % faster than with
                // wq_scales's per-byte selects, the w2 call 2.7 %; H200, session 23)
                uint32_t eA[2], eB[2];
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    const int kb = 2 * kt + b;
                    eA[b] = kb < C.ldsK ? (uint32_t)__ldg(sA + kb) : 127u;
                    eB[b] = kb < C.ldsK ? (uint32_t)__ldg(sB + kb) : 127u;
                }
                fix = __any_sync(0xFFFFFFFFu, max(max(eA[0], eA[1]), max(eB[0], eB[1])) > 128u);
                if (!fix) {
#pragma unroll
                    for (int b = 0; b < 2; b++) { mA[b] = wq_mul_fp4_le128(eA[b]); mB[b] = wq_mul_fp4_le128(eB[b]); }
                } else {
#pragma unroll
                    for (int b = 0; b < 2; b++) {
                        mA[b] = wq_mul_fp4(eA[b]); bA[b] = wq_big_fp4(eA[b]);
                        mB[b] = wq_mul_fp4(eB[b]); bB[b] = wq_big_fp4(eB[b]);
                    }
                }
            } else
                fix = wq_scales<FMT>(sA, kt, C.ldsK, mA, bA) | wq_scales<FMT>(sB, kt, C.ldsK, mB, bB);
            uint32_t rawA[WROW / 16], rawB[WROW / 16];
            wq_raw_s<FMT>(sthr + ss * STAGE, rawA);
            wq_raw_s<FMT>(sthr + ss * STAGE + 8 * WROW, rawB);
            uint32_t loA[4], hiA[4], loB[4], hiB[4];
            wq_row<FMT>(rawA, mA, loA, hiA);
            wq_row<FMT>(rawB, mB, loB, hiB);
            if (FMT == V41G_WQ_FP4 && fix) {   /* fp4: fix is the warp's vote already */
                wq_row_fix(bA, loA, hiA);
                wq_row_fix(bB, loB, hiB);
            }
#pragma unroll
            for (int s = 0; s < 4; s++) {
                af[s][0] = loA[s]; af[s][1] = loB[s]; af[s][2] = hiA[s]; af[s][3] = hiB[s];
            }
        };
        float acc[BN / 2], acct[TL ? TL / 2 : 1];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.0f;
#pragma unroll
        for (int i = 0; i < (TL ? TL / 2 : 1); i++) acct[i] = 0.0f;
        // the 4 wgmmas of a decoded tile against sub-stage ss's activations (and the tail's 4), one
        // commit group
        auto mma = [&](int ss, const uint32_t (&af)[4][4]) {
            const uint64_t dx = dx0 + (uint64_t)((ss * STAGE) >> 4);   /* K-major, 128-byte swizzle */
            aw_wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; s++) wq_wg_mma<BN>(acc, af[s], dx + (uint64_t)((s * 32) >> 4));
            if constexpr (TL > 0)
                if (trows > 0) {   /* uniform over the CTA */
                    const uint64_t dt = dx0 + (uint64_t)((ss * STAGE + BN * 128) >> 4);
#pragma unroll
                    for (int s = 0; s < 4; s++) wq_wg_mma<TL>(acct, af[s], dt + (uint64_t)((s * 32) >> 4));
                }
            aw_wgmma_commit();
        };
        __syncthreads();   // every warp is done with the previous m tile's stages
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) {
            if (C.kt0 + st * U < C.kt1) load(C.kt0 + st * U, st);
            g_cp_commit();
        }
        for (int i = 0, kt = C.kt0; kt < C.kt1; i++, kt += U) {
            const int st = i % STAGES;
            uint32_t swA = 0, swB = 0;
            if (s4) {
                swA = __ldg((const unsigned int *)(sA + 2 * kt));
                swB = __ldg((const unsigned int *)(sB + 2 * kt));
            }
            g_cp_wait<STAGES - 2>();
            aw_fence_proxy_async();   // this thread's activation rows become visible to wgmma
            __syncthreads();          // stage i landed for all threads; everyone is done with stage i-1
            {
                const int kn = kt + (STAGES - 1) * U;
                if (kn < C.kt1) load(kn, (i + STAGES - 1) % STAGES);
                g_cp_commit();
            }
            const bool sfix = s4 && __any_sync(0xFFFFFFFFu, (wq_gt128x4(swA) | wq_gt128x4(swB)) != 0u);
            uint32_t af[4][4];
            decode(kt, st * U, af, swA, swB, sfix, 0);
            aw_fence_regs(acc);
            if constexpr (TL > 0) aw_fence_regs(acct);
            mma(st * U, af);
            if (U > 1 && kt + 1 < C.kt1) {
                // the second tile's dequantization runs while the first tile's wgmmas do (its own
                // registers: af is read by the wgmmas in flight)
                uint32_t af2[4][4];
                decode(kt + 1, st * U + 1, af2, swA, swB, sfix, 1);
                mma(st * U + 1, af2);
            }
            aw_wgmma_wait<0>();
            aw_fence_regs(acc);
            if constexpr (TL > 0) aw_fence_regs(acct);
        }
        g_cp_wait<0>();
        g_pdl_trigger();   // the split-K reduction may launch (it waits for this grid to finish)
        // the main tile's rows, then the tail's (fp32 partials or output, or bf16 output)
        auto store = [&](auto *y0, auto cvt) {
            wq_store_tile<BN>(y0, a, m0, mrows, C.n0 + rA, c, acc, cvt);
            if constexpr (TL > 0)
                if (trows > 0) wq_store_tile<TL>(y0, a, m0 + BN, trows, C.n0 + rA, c, acct, cvt);
        };
        if (a.part || a.out_f32)
            store(a.part ? a.part + (size_t)blockIdx.z * a.M * a.N : (float *)a.y, [](float v) { return v; });
        else
            store((uint16_t *)a.y, [](float v) { return g_f2bf(v); });
    }
#endif
}

// ---- decode kernel (any sm_80+ device; M <= 8 rows, or groups of a few rows): no block-level
// pipeline. The CTA's activation rows (at most XR = a.xr <= 8, or 16 in the NT = 2 instance) of its
// k range are staged in shared memory, in the A-fragment column order (below): at once, or (NT = 2,
// grouped calls) in chunks of a.kc k tiles with a CTA barrier between chunks, so that four CTAs
// fit an SM (session 24: the MoE at 512 tokens 4.51 -> 3.67 ms on the H200; with the whole k range
// staged, 16 rows of w1||w3 took 164 KB, one CTA an SM). Every warp then streams its own 32
// weight rows of the 128-row band straight from global memory into registers: tile kt of warp w is
// the contiguous bytes [32w, 32w + 32) rows x WROW of the 4/8 KB tile, each thread 8 (fp4) or 16
// (fp8) bytes of 4 rows, loaded P tiles ahead (4 KB per warp in flight), the scale bytes a group of
// P tiles ahead.
// There is no __syncthreads in the k loop, so a warp never waits for another warp or for a
// shared-memory stage, only for its own loads; the g_wq_wgmma_kernel, by contrast, syncs its 256
// threads and waits for its wgmma group at every 64-column tile, which at 1..8 activation rows
// leaves it latency-bound (about 1 TB/s over the MoE's experts).
// mma.sync m16n8k16 with the weight rows as M (two m16 tiles a warp) and the activation rows as N
// (thread g of a quad-row holds row g of B): rows past XR give zero B fragments without loads.
// Activation row r of the staged copy: tile t (of the CTA's k range) at r * xs + 128 t bytes
// (xs = 128 * tiles + 16: consecutive rows 4 banks apart, so the 8 rows x 4 threads of one 16-byte
// load phase hit distinct banks), column k of the tile at position wq_pos_of(k): thread c's 16
// values of all four k-steps are the 32 bytes at 32c, word 2s / 2s + 1 = B registers b0 / b1 of
// k-step s (columns 16s + 2c, +1 and 16s + 2c + 8, +9).
// shared memory of g_wq_gemv_kernel: xr staged activation rows of kps k tiles (128 bytes a tile, 16
// of padding a row); a cluster call (its CL instance) adds the partial tile [xr][WQ_BN] fp32 after them
__host__ __device__ inline size_t gemv_smem(int xr, int kps) { return (size_t)xr * (128 * (size_t)kps + 16); }
__host__ __device__ inline size_t gemv_smem_cl(int xr, int kps, bool cl)
{
    return gemv_smem(xr, kps) + (cl ? sizeof(float) * WQ_BN * (size_t)xr : 0);
}
// thread-block clusters (compute 9.0+); an sm_80 build compiles the cluster sum out and never asks for it
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define WQ_HAVE_CLUSTER 1
namespace cg = cooperative_groups;
#else
#define WQ_HAVE_CLUSTER 0
#endif
template <int FMT> struct wq_gv {
    static constexpr int P = FMT == V41G_WQ_FP8 ? 2 : 4;   /* tiles in flight per warp (4 KB either way) */
    static constexpr int RW = FMT == V41G_WQ_FP8 ? 4 : 2;  /* 32-bit code words per row per tile */
};
__device__ __forceinline__ void wq_ld_stream(uint32_t *r, const uint8_t *p, int words)
{
    if (words == 4)
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
    else
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "l"(p));
}
// g_wq_gemv_kernel's fp4 block step: rows 16mt + g and + 8 of tile slot u, k-steps 2bl (q[3], q[2]) and
// 2bl + 1 (q[1], q[0]), their codes times the multipliers MA, MB, against row tile j's B fragments
// (tile 1 only where two): D[j][mt] = the block's sums from zero where Z, else added to D (the folded
// path's MMAs accumulate straight into acc). (A macro, not a lambda: a lambda
// changed the generated code of the measured kernels.) The 16-row instance (NT = 2) decodes each word
// in halves, each right before the MMAs that read it: with session 28's whole-word decode ptxas
// spilled 16 bytes there (128 registers, its cap; none before), and with the halves it spills none
// (ptxas --resource-usage, nvcc 13.0, session 29). NT = 1 keeps the whole-word decode: its PTX is
// the same as before, where the halves gave its non-cluster fp4 instance a 24-byte spill.
#define WQ_FP4_BLOCK_MMA(MA, MB, D, Z)                                                                             \
    do {                                                                                                           \
        const uint32_t wa = raw[u][2 * mt][bl], wb = raw[u][2 * mt + 1][bl], ma = (MA), mb = (MB);                \
        uint32_t qa[4], qb[4];                                                                                     \
        if constexpr (NT == 1) {                                                                                   \
            wq_dec_fp4x8(wa, ma, qa);                                                                              \
            wq_dec_fp4x8(wb, mb, qb);                                                                              \
        } else {                                                                                                   \
            wq_dec_fp4_half(wa, ma, 1, qa);                                                                        \
            wq_dec_fp4_half(wb, mb, 1, qb);                                                                        \
        }                                                                                                          \
        _Pragma("unroll") for (int j = 0; j < NT; j++) if (j == 0 || two) {                                       \
            if (Z) D[j][mt][0] = D[j][mt][1] = D[j][mt][2] = D[j][mt][3] = 0.0f;                                   \
            g_mma_bf16(D[j][mt], qa[3], qb[3], qa[2], qb[2], bwj[j][4 * bl], bwj[j][4 * bl + 1]);                  \
        }                                                                                                          \
        if constexpr (NT > 1) {                                                                                    \
            wq_dec_fp4_half(wa, ma, 0, qa);                                                                        \
            wq_dec_fp4_half(wb, mb, 0, qb);                                                                        \
        }                                                                                                          \
        _Pragma("unroll") for (int j = 0; j < NT; j++) if (j == 0 || two)                                         \
            g_mma_bf16(D[j][mt], qa[1], qb[1], qa[0], qb[0], bwj[j][4 * bl + 2], bwj[j][4 * bl + 3]);              \
    } while (0)
// CL: the gridDim.z splits of an n band are one cluster and sum their partials in distributed
// shared memory (part NULL); its own instance, so the plain one's registers stay as they were
// NT: n8 tiles of activation rows per pass (XR = a.xr <= 8 NT rows; the second tile's MMAs run only
// where a pass has more than 8 rows). NT = 2 is for grouped calls (no cluster instance).
// FOLD (fp4): the scale folded into the decode multiplier while no scale byte of the warp's group of
// k tiles exceeds 128, the MMAs then accumulating into acc; else, and without FOLD, the codes decode
// unscaled and each block sum takes one FMA by 2^(e-127). Both scale the same sums by a power of two
// (exact while a block sum stays in the normal fp32 range; not compared bit for bit). On the H200
// (session 24) the fold made the 16-row instance 5-7 % faster (w1||w3 at 512 tokens 2325-2355 ->
// 2184-2201 us) and the 8-row ones 2-5 % slower (a 24-byte spill in the non-cluster instance), so
// only NT = 2 folds.
template <int FMT, bool CL, int NT = 1, bool FOLD = (NT > 1)>
__global__ void __launch_bounds__(128, NT == 1 || FMT == V41G_WQ_FP4 ? 4 : 3) g_wq_gemv_kernel(wq_args a)
{
    static_assert(NT == 1 || (NT == 2 && !CL), "two row tiles only without the cluster sum");
    // (NT = 2: two tiles in flight a warp, so that the fp4 instance fits 128 registers, four CTAs an SM)
    constexpr int WROW = wq_wrow(FMT), WT = WQ_BN * WROW, P = NT > 1 ? 2 : wq_gv<FMT>::P, RW = wq_gv<FMT>::RW;
    extern __shared__ __align__(16) unsigned char wq_smg[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    wq_cta C(a, a.xr);
    if (C.mbeg >= C.mend || C.kt0 >= C.kt1) return;
    // the rows are staged kc k tiles at a time (a.kc, a multiple of P; 0: the whole k range)
    const int XR = a.xr, nt = C.kt1 - C.kt0, kc = NT > 1 && a.kc > 0 && a.kc < nt ? a.kc : nt, xs = 128 * kc + 16;
    const uint8_t *Wb = a.w + (size_t)C.grp * a.w_stride + (size_t)blockIdx.x * C.KT * WT;
    // rows i = 2 mt + half: warp row 8i + g, codes at wrow + i * 8 WROW; scale row at C.S + soff[i]
    const uint8_t *wrow = Wb + (warp * 32 + g) * WROW + (WROW / 4) * c;
    uint32_t soff[4];
#pragma unroll
    for (int i = 0; i < 4; i++) soff[i] = (uint32_t)(wq_srow<FMT>(a, C.S, C.n0 + warp * 32 + 8 * i + g) - C.S);
    // slot u: the codes of tile kt (4 rows x RW words). Scale bytes come per group of P tiles (the
    // host guarantees K % 256 == 0, k ranges of whole groups and 8-byte aligned scale rows): row i's
    // 2P bytes in SW words, loaded one group ahead.
    constexpr int SW = P / 2;
    uint32_t raw[P][4][RW], scg[4][SW], scn[4][SW];
    auto fetch = [&](int kt, int u) {
        kt = min(kt, C.kt1 - 1);
        const uint8_t *p = wrow + (size_t)kt * WT;
#pragma unroll
        for (int i = 0; i < 4; i++) wq_ld_stream(raw[u][i], p + i * 8 * WROW, RW);
    };
    auto sfetch = [&](int kb, uint32_t (&d)[4][SW]) {
        kb = min(kb, C.kt1 - P);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint8_t *sp = C.S + soff[i] + 2 * kb;
            if (SW == 2) {
                const uint2 v = __ldg((const uint2 *)sp);
                d[i][0] = v.x; d[i][SW - 1] = v.y;
            } else
                d[i][0] = __ldg((const uint32_t *)sp);
        }
    };
    for (int m0 = C.mbeg; m0 < C.mend; m0 += XR) {
        const int mrows = min(XR, C.mend - m0);
#pragma unroll
        for (int u = 0; u < P; u++) fetch(C.kt0 + u, u);   /* the weights do not depend on the rows */
        sfetch(C.kt0, scg);
        const bool two = NT > 1 && mrows > 8;   /* the second row tile has rows (uniform over the CTA) */
        float acc[NT][2][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int mt = 0; mt < 2; mt++) acc[j][mt][0] = acc[j][mt][1] = acc[j][mt][2] = acc[j][mt][3] = 0.0f;
        const unsigned char *xg = wq_smg + g * xs + 32 * c;
        for (int kcb = C.kt0, kce; kcb < C.kt1; kcb = kce) {
            kce = NT == 1 ? C.kt1 : min(C.kt1, kcb + kc);   /* (NT = 1: one chunk, the compiler sees it) */
            const int nc = kce - kcb;
            if (m0 > C.mbeg || kcb > C.kt0) __syncthreads();   // every warp is done with the previous rows or chunk
            // stage the rows: 16-byte source chunks (row r, tile t, columns 8j..8j+7) -> 4 words each
            for (int q = tid; q < mrows * nc * 8; q += 128) {
                const int r = q / (nc * 8), t = (q / 8) % nc, j = q % 8, k = (kcb + t) * 64 + 8 * j;
                uint4 v = make_uint4(0, 0, 0, 0);
                if (k < a.K) v = *(const uint4 *)(a.x + (size_t)(a.xrow ? a.xrow[m0 + r] : m0 + r) * a.K + k);
                uint32_t *dst = (uint32_t *)(wq_smg + r * xs + 128 * t);
                const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int h = 0; h < 4; h++) dst[wq_pos_of(8 * j + 2 * h) >> 1] = w4[h];
            }
            __syncthreads();
            for (int kb = kcb; kb < kce; kb += P) {
                // (fp4, FOLD) whether a scale byte of the group, in any lane of the warp, exceeds 128: a
                // byte x > 128 has bit 7 and a nonzero low part ((x & 0x7F) + 0x7F carries into bit 7)
                bool big = false;
                if (FMT == V41G_WQ_FP4 && FOLD) {
                    uint32_t t = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++)
#pragma unroll
                        for (int w = 0; w < SW; w++) t |= ((scg[i][w] & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & scg[i][w];
                    big = __any_sync(0xFFFFFFFFu, (t & 0x80808080u) != 0);
                }
                sfetch(kb + P, scn);
#pragma unroll
                for (int u = 0; u < P; u++) {
                    const int kt = kb + u;
                    // B fragments of row tile j: activation row 8j + g
                    uint32_t bwj[NT][8];
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        uint4 b01 = make_uint4(0, 0, 0, 0), b23 = b01;
                        if ((j == 0 || two) && 8 * j + g < mrows) {
                            b01 = *(const uint4 *)(xg + 8 * j * xs + 128 * (kt - kcb));
                            b23 = *(const uint4 *)(xg + 8 * j * xs + 128 * (kt - kcb) + 16);
                        }
                        bwj[j][0] = b01.x; bwj[j][1] = b01.y; bwj[j][2] = b01.z; bwj[j][3] = b01.w;
                        bwj[j][4] = b23.x; bwj[j][5] = b23.y; bwj[j][6] = b23.z; bwj[j][7] = b23.w;
                    }
                    if (FMT == V41G_WQ_FP4) {
                        if (FOLD && !big) {
                            // each code decodes to code * 2^(e-127), its scale folded into the bf16x2 multiplier
                            // (wq_mul_fp4_le128, one integer multiply-add; the warp's vote found no scale byte
                            // of the group over 128), so the MMAs accumulate straight into acc: four independent
                            // chains a warp here (session 30/31: 5 % faster than summing each 32-column block from
                            // zero and adding it, w1||w3 at 512 tokens 2183.7 -> 2060.1 us on the H200)
#pragma unroll
                            for (int bl = 0; bl < 2; bl++)
#pragma unroll
                                for (int mt = 0; mt < 2; mt++) {
                                    const int sh = 16 * (u & 1) + 8 * bl;
                                    const uint32_t ea = (scg[2 * mt][u >> 1] >> sh) & 0xFFu, eb = (scg[2 * mt + 1][u >> 1] >> sh) & 0xFFu;
                                    WQ_FP4_BLOCK_MMA(wq_mul_fp4_le128(ea), wq_mul_fp4_le128(eb), acc, false);
                                }
                        } else {
                            // e2m1 codes decode to their exact values; each 32-column block (k-steps 2b, 2b+1)
                            // is summed on its own and scaled after, by the power of two 2^(e-127) (exact)
#pragma unroll
                            for (int bl = 0; bl < 2; bl++) {
                                float part[NT][2][4];
#pragma unroll
                                for (int mt = 0; mt < 2; mt++) {
                                    WQ_FP4_BLOCK_MMA(WQ_S126, WQ_S126, part, true);
                                }
#pragma unroll
                                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                                    for (int h = 0; h < 2; h++) {
                                        const int i = 2 * mt + h;
                                        const uint32_t e = (scg[i][u >> 1] >> (16 * (u & 1) + 8 * bl)) & 0xFFu;
                                        const float f = __uint_as_float(e ? e << 23 : 0x00400000u);   /* 2^(e-127) */
#pragma unroll
                                        for (int j = 0; j < NT; j++)
                                            if (j == 0 || two) {
                                                acc[j][mt][2 * h] = fmaf(part[j][mt][2 * h], f, acc[j][mt][2 * h]);
                                                acc[j][mt][2 * h + 1] = fmaf(part[j][mt][2 * h + 1], f, acc[j][mt][2 * h + 1]);
                                            }
                                    }
                            }
                        }
                    } else {
                        uint32_t mul[4][2];
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            const uint32_t e = scg[i][0] >> (16 * u);
                            mul[i][0] = wq_mul_fp8(e & 0xFFu);
                            mul[i][1] = wq_mul_fp8((e >> 8) & 0xFFu);
                        }
#pragma unroll
                        for (int s = 0; s < 4; s++) {
                            uint32_t af[4][2];
#pragma unroll
                            for (int i = 0; i < 4; i++) wq_cvt_fp8(raw[u][i][s], mul[i][s >> 1], af[i][0], af[i][1]);
#pragma unroll
                            for (int j = 0; j < NT; j++)
                                if (j == 0 || two)
#pragma unroll
                                    for (int mt = 0; mt < 2; mt++)
                                        g_mma_bf16(acc[j][mt], af[2 * mt][0], af[2 * mt + 1][0], af[2 * mt][1], af[2 * mt + 1][1],
                                                   bwj[j][2 * s], bwj[j][2 * s + 1]);
                        }
                    }
                    fetch(kt + P, u);
                }
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int w = 0; w < SW; w++) scg[i][w] = scn[i][w];
            }
        }
        // acc[j][mt][e] = (weight row 16mt + g (+8 for e >= 2) of the warp, activation row 8j + 2c (+1 for odd e))
        if constexpr (CL) {
#if WQ_HAVE_CLUSTER
            // the band's splits are the ranks of one cluster: each puts its partial tile [mrows][128]
            // after the staged rows (the same offset in every rank: gemv_smem of the full k range),
            // then rank R sums its share of the outputs over ranks 0, 1, .. in order (the additions
            // of g_wq_reduce_kernel, so the same bits) and stores them
            float *ps = (float *)(wq_smg + gemv_smem(XR, a.kt_per_split));
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = 2 * c + (e & 1);
                    if (r < mrows) ps[r * WQ_BN + warp * 32 + 16 * mt + g + (e >> 1) * 8] = acc[0][mt][e];
                }
            cg::cluster_group cl = cg::this_cluster();
            cl.sync();   // every rank's partial is written (release / acquire)
            const int S = (int)cl.num_blocks(), R = (int)cl.block_rank(), tot = mrows * WQ_BN, ch = (tot + S - 1) / S;
            for (int q = R * ch + tid; q < min(tot, (R + 1) * ch); q += 128) {
                const int n = C.n0 + q % WQ_BN;
                if (n >= a.N) continue;
                float v = *cl.map_shared_rank(ps + q, 0);
                for (int z = 1; z < S; z++) v += *cl.map_shared_rank(ps + q, z);
                wq_store(a, m0, q / WQ_BN, n, v);
            }
            cl.sync();   // no rank leaves (or overwrites its tile) while another may still read it
#else
            __trap();   // (never launched without clusters)
#endif
        } else {
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int n = C.n0 + warp * 32 + 16 * mt + g + (e >> 1) * 8, r = 8 * j + 2 * c + (e & 1);
                        if (n < a.N && r < mrows) wq_store(a, m0, r, n, acc[j][mt][e]);
                    }
        }
        // (no g_pdl_trigger in this kernel: the reduction launches as its CTAs exit; with a trigger
        // anywhere in it the fp4 instance, at its 128-register cap, spilled 12 bytes; session 13)
    }
}

// y = sum over splits (in split order) of the partials
__global__ void g_wq_reduce_kernel(const float *__restrict__ part, int splits, size_t MN, void *y, int out_f32)
{
    g_pdl_wait();   // launched with g_launch_pdl: the partials are complete past this point
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float v = part[i];
    for (int z = 1; z < splits; z++) v += part[(size_t)z * MN + i];
    if (out_f32) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = g_f2bf(v);
}
// The same sums four outputs a thread (16-byte partial loads, the split loop unrolled so a thread's
// loads are in flight together; each output summed in split order: the same bits). For large
// outputs only (v41g_wq_gemm: at least a wave of CTAs): session 19 measured it 2-3 % faster on the
// larger 64-row calls and slower where a quarter of the CTAs left SMs idle (one row, wkv).
// MN % 4 == 0; part 16-byte and y 16-byte (fp32) or 8-byte (bf16) aligned.
__global__ void g_wq_reduce4_kernel(const float *__restrict__ part, int splits, size_t MN, void *y, int out_f32)
{
    g_pdl_wait();
    const size_t i = 4 * (blockIdx.x * (size_t)blockDim.x + threadIdx.x);
    if (i >= MN) return;
    float4 v = *(const float4 *)(part + i);
#pragma unroll 4
    for (int z = 1; z < splits; z++) {
        const float4 w = *(const float4 *)(part + (size_t)z * MN + i);
        v.x += w.x; v.y += w.y; v.z += w.z; v.w += w.w;
    }
    if (out_f32) *(float4 *)((float *)y + i) = v;
    else *(uint2 *)((uint16_t *)y + i) = make_uint2(g_f2bf(v.x) | (uint32_t)g_f2bf(v.y) << 16,
                                                    g_f2bf(v.z) | (uint32_t)g_f2bf(v.w) << 16);
}

// bf16 copy of group g (v41g_wq_dequant; session 12). No shared-memory stage: a warp converts one
// unit of 4 rows x 64 columns of a tiled block. Lane l takes row 4u + l / 8 of the unit's 128-row
// band and writes the 8 columns 8 (l % 8) .. + 7 of the k tile, so each 16-byte store instruction
// of the warp writes 4 whole 128-byte row segments. The lane loads the 4 words over which the
// A-fragment permutation spreads those columns (one per 16-byte (fp8) or 8-byte (fp4) chunk c of
// the tile row; the two lanes of a k-step share them, served by L1) and converts them with the
// GEMM kernels' register conversions. Consecutive warps take consecutive 256 (fp8) or 128 (fp4)
// bytes of the tiled codes.
//  - fp8, columns 16s + 8h .. + 7 (s = (l % 8) / 2, h = l % 2): bytes 2h, 2h + 1 of word s of chunk
//    c are columns 16s + 8h + 2c, + 1.
//  - fp4: elements j0 = 2 (s % 2) + h and j0 + 4 of word s / 2 of chunk c (its pair 3 - j0) are the
//    same columns.
// The kernel it replaced staged a whole tile per CTA in shared memory and wrote half row segments
// per store instruction; on the H200 this one is 15-23 % faster (wq_b 49.2 -> 38.1 us, 60 -> 78 %
// of copy). A warp with 2, 4 or 8 units in flight measured the same or slower (session 12).
#define WQ_DQ_THREADS 256
template <int FMT>
__global__ void __launch_bounds__(WQ_DQ_THREADS) g_wq_dequant_kernel(v41g_wq W, int g, int units, uint16_t *__restrict__ out)
{
    constexpr int WROW = wq_wrow(FMT), WT = WQ_BN * WROW, CB = WROW / 4;   /* CB: bytes per chunk */
    const int u = blockIdx.x * (WQ_DQ_THREADS / 32) + (threadIdx.x >> 5);
    if (u >= units) return;
    const int lane = threadIdx.x & 31, q = lane >> 3, p = lane & 7, s = p >> 1, h = p & 1;
    const int KT = (W.K + 63) / 64, ldsK = W.K / 32;
    const int t = u >> 5, kt = t % KT, n = (t / KT) * WQ_BN + 4 * (u & 31) + q, k = kt * 64 + 8 * p;
    const uint8_t *row = W.w + (size_t)g * W.w_stride + (size_t)t * WT + (4 * (u & 31) + q) * WROW +
                         (FMT == V41G_WQ_FP8 ? 4 * s : 4 * (s >> 1));
    uint32_t wd[4];
#pragma unroll
    for (int c = 0; c < 4; c++) wd[c] = __ldg((const uint32_t *)(row + CB * c));
    if (n >= W.N || k >= W.K) return;   /* the tiles' zero padding */
    const uint8_t *sc = W.s + (size_t)g * W.s_stride;
    uint32_t v[4];
    if (FMT == V41G_WQ_FP8) {
        const uint32_t mul = wq_mul_fp8(__ldg(sc + (size_t)((W.r0 + n) >> 5) * ldsK + (k >> 5)));
        const uint32_t sel = WQ_SEL_FP8(h);   /* bytes 2h, 2h + 1 with their signs, as wq_cvt_fp8 */
#pragma unroll
        for (int c = 0; c < 4; c++) {
            v[c] = wq_hmul2(wq_fp8_lanes(wq_prmt(wd[c], sel)), mul);
        }
    } else {
        const uint32_t e = __ldg(sc + (size_t)n * ldsK + (k >> 5)), mul = wq_mul_fp4(e);
        const int pt = 3 - (2 * (s & 1) + h);   /* elements j0 = 3 - pt and j0 + 4: pair pt */
#pragma unroll
        for (int c = 0; c < 4; c++) v[c] = wq_dec_fp4_one(wd[c], pt, mul);
        if (e > 128u) {
            const uint32_t big = wq_big_fp4(e);
#pragma unroll
            for (int c = 0; c < 4; c++) v[c] = wq_hmul2(v[c], big);
        }
    }
    *(uint4 *)(out + (size_t)n * W.K + k) = make_uint4(v[0], v[1], v[2], v[3]);
}

// Tiled copy of checkpoint-layout codes: thread i -> byte i of a tile row segment (fp8: column
// wq_col_of(i); fp4: the word of bytes i & ~3 holds the 8 elements at positions 2 (i & ~3) + j,
// column wq_col_of4 of each, their bits scattered by wq_fp4_bit), i over the whole tiled buffer.
__global__ void g_wq_tile_kernel(int fmt, int N, int K, const uint8_t *__restrict__ codes, uint8_t *__restrict__ tiled,
                                 size_t bytes)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= bytes) return;
    const int WROW = wq_wrow(fmt), WT = WQ_BN * WROW, KT = (K + 63) / 64;
    const size_t t = i / WT;
    const int in = (int)(i % WT), r = in / WROW, b = in % WROW;
    const int n = (int)(t / KT) * WQ_BN + r, kt = (int)(t % KT);
    uint8_t v = 0;
    if (fmt == V41G_WQ_FP8) {
        const int k = kt * 64 + wq_col_of(b);
        if (n < N && k < K) v = codes[(size_t)n * K + k];
    } else {
        // checkpoint fp4: element k is the low (k even) or high nibble of byte k / 2 of its row.
        // Byte b % 4 of the word of bytes b & ~3 (elements j = 0..7 at positions 2 (b & ~3) + j):
        // bit k of element j goes to bit wq_fp4_bit(j, k) of the word
        const int byte = b & 3;
        for (int j = 0; j < 8; j++) {
            const int k = kt * 64 + wq_col_of4(2 * (b & ~3) + j);
            if (n >= N || k >= K) continue;
            const uint32_t code = (codes[(size_t)n * (K / 2) + k / 2] >> (4 * (k & 1))) & 15u;
            for (int kb = 0; kb < 4; kb++) {
                const int pos = wq_fp4_bit(j, kb);
                if ((pos >> 3) == byte && (code >> kb & 1u)) v |= (uint8_t)(1u << (pos & 7));
            }
        }
    }
    tiled[i] = v;
}

namespace {

bool wq_valid(const v41g_wq *W)
{
    if (!W || !W->w || !W->s || W->N <= 0 || W->K <= 0 || W->K % 32 || W->r0 < 0) return false;
    if (W->fmt != V41G_WQ_FP8 && W->fmt != V41G_WQ_FP4) return false;
    if (W->fmt == V41G_WQ_FP4 && W->r0 != 0) return false;
    // cp.async moves 16-byte chunks: code rows and groups must start 16-byte aligned
    return ((uintptr_t)W->w | (uintptr_t)W->w_stride) % 16 == 0;
}

// activation rows per m tile: 8..128 (wgmma N); the mma.sync kernel takes at most 64 (NT = 8)
int bm_for(int rows, bool wg) { return rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 || !wg ? 64 : 128; }

// The wgmma kernel runs on a compute 9.0 device whose loaded code for it is the sm_90a build (a
// PTX-only build compiles the body away: few registers), unless V41_WQ_NO_WGMMA is set (read at
// every call: the tests compare both kernels).
bool use_wgmma()
{
    static int ok = -1;
    if (ok < 0) {
        int dev = 0, maj = 0, mnr = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&maj, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&mnr, cudaDevAttrComputeCapabilityMinor, dev);
        cudaFuncAttributes fa;
        ok = maj == 9 && mnr == 0 && cudaFuncGetAttributes(&fa, g_wq_wgmma_kernel<V41G_WQ_FP8, 64, 0>) == cudaSuccess &&
             fa.numRegs >= 32;
        cudaGetLastError();
    }
    return ok == 1 && !g_env_flag("V41_WQ_NO_WGMMA");
}

// (every launch: the kernels share one function type, so a static "done" flag per type would
// serve only the first of them; the call costs about a microsecond of host time)
template <typename F> int set_smem(F *kern, int bytes)
{
    G_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return 0;
}
template <int FMT, int BM, int TL = 0> int smem_of(bool wg)
{
    return wg ? wq_stages(BM) * wq_wg_u(FMT) * wq_wg_stage(FMT, BM + TL) + 1024   /* + alignment of the swizzle atoms */
              : wq_stages(BM) * (WQ_BN * wq_wrow(FMT) + BM * WQ_XS);
}
// CTAs of the kernel that fit one SM (registers, shared memory), cached per kernel
template <int FMT, int BM> int per_sm_t(bool wg)
{
    static int n[2] = {0, 0};
    if (!n[wg]) {
        int v = 0;
        const int sm = smem_of<FMT, BM>(wg);
        if (wg) {
            if (!set_smem(g_wq_wgmma_kernel<FMT, BM, 0>, sm))
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, g_wq_wgmma_kernel<FMT, BM, 0>, 256, sm);
        } else if constexpr (BM <= 64) {
            if (!set_smem(g_wq_mma_kernel<FMT, BM / 8>, sm))
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, g_wq_mma_kernel<FMT, BM / 8>, 128, sm);
        }
        cudaGetLastError();
        n[wg] = v > 0 ? v : 1;
    }
    return n[wg];
}
int per_sm(int fmt, int bm, bool wg)
{
#define WQ_O(F) (bm == 8 ? per_sm_t<F, 8>(wg) : bm == 16 ? per_sm_t<F, 16>(wg) : bm == 32 ? per_sm_t<F, 32>(wg) \
                 : bm == 64 ? per_sm_t<F, 64>(wg) : per_sm_t<F, 128>(wg))
    return fmt == V41G_WQ_FP8 ? WQ_O(V41G_WQ_FP8) : WQ_O(V41G_WQ_FP4);
#undef WQ_O
}

// Split count of a dense call: the CTAs of one split run k = ceil(KT/sp) k tiles, and a CTA takes
// about the same time per k tile at 8..64 rows (wo_b at 64 rows, 3 splits of 43 k tiles: 40.6 us
// on the H200; 6 or 8 pipeline stages instead of 4 did not shorten it, session 17), so the call
// takes about k steps times the load of the busiest SM. With L = ceil(ctas * sp / SMs) CTAs an SM
// and P of them resident at once, that load is floor(L/P) waves of P co-resident CTAs and one of
// L % P; j co-resident CTAs take rho_j = 1 + 0.7 (j - 1) times one CTA's time (they share the SM
// but hide each other's latency). Each split adds its fp32 partials (4 M N bytes, written and
// summed by the second kernel): 0.5 step per MB. Take the cheapest sp (the fewest splits on ties),
// at least 4 k tiles per split, the partials within ws. Fitted to split sweeps at 64 rows on the
// H200 (session 17: the best split of each of the nine Flash Linears but wq_a, whose pick (12)
// measured 0.8 us over the best (10) in one sweep). The former rule, waves of P CTAs an SM at no
// cost for sharing the SM, picked 160 CTAs for idx_wq_b (k = 4, 12.6-12.7 us) where 128 (k = 5)
// take 11.4. It still serves calls of more than 64 rows (several m tiles, larger partials: not
// swept).
double wq_rho(int j) { return j <= 0 ? 0.0 : 1.0 + 0.7 * (j - 1); }
int split_for(const v41g_wq *W, int M, bool wg, size_t ws_bytes, int *kps)
{
    const int BM = bm_for(M, wg), KT = (W->K + 63) / 64;
    const long ctas = (long)((W->N + WQ_BN - 1) / WQ_BN) * ((M + BM - 1) / BM), sms = g_num_sms();
    const long P = per_sm(W->fmt, BM, wg), slots = P * sms;
    const size_t per = sizeof(float) * (size_t)M * W->N;
    // V41_WQ_SPLITS=n (read at every call): n splits instead of the rule's, for split sweeps and for
    // tuning on another GPU; rounded to whole k tiles a split, fewer where the partials would not
    // fit ws. The sum order, so the output bits, follow the split count. (The decode kernel's dense
    // calls, split_gemv, take it too, rounded to whole groups of 4 k tiles a split.)
    if (const long e = v41_env_long("V41_WQ_SPLITS", 0)) {
        int n = (int)std::min<long>(e, KT);
        while (n > 1 && per * n > ws_bytes) n--;
        *kps = (KT + n - 1) / n;
        return (KT + *kps - 1) / *kps;
    }
    int sp = 1;
    double best = -1;
    // a full wave already: no split (partials would add 4*M*N bytes per split; measured 2x slower at M = 4096)
    for (int s = 1; s <= (ctas < slots ? std::max(1, KT / 4) : 1); s++) {
        if (s > 1 && per * s > ws_bytes) break;
        const int k = (KT + s - 1) / s;
        if ((KT + k - 1) / k != s) continue;   /* the same tiles per split as a smaller s */
        const long L = (ctas * s + sms - 1) / sms;
        const double c = M > 64 ? (double)(((ctas * s + slots - 1) / slots) * k)
                                : k * ((double)(L / P) * wq_rho((int)P) + wq_rho((int)(L % P))) +
                                      (s > 1 ? 0.5 * (double)(per * s) / 1048576.0 : 0.0);
        if (best < 0 || c < best) { best = c; sp = s; }
    }
    *kps = (KT + sp - 1) / sp;
    return (KT + *kps - 1) / *kps;
}

// The decode kernel (g_wq_gemv_kernel) serves dense calls of M <= 8 rows and grouped calls of at
// most 8 rows per group on average, unless V41_WQ_NO_GEMV is set (read at every call: the tests
// compare it with the tiled kernels), K % 256 != 0, or its staged rows do not fit shared memory.
bool use_gemv() { return !g_env_flag("V41_WQ_NO_GEMV"); }
// (the kernel loads the scale bytes of 4 (fp4) or 2 (fp8) tiles at once and runs whole groups of
// 4 tiles: K % 256 == 0, k ranges of whole groups, 8-byte aligned scale rows and groups)
bool gemv_ok(const v41g_wq *W, int xr, int kps, bool cl)
{
    return W->K % 256 == 0 && kps % 4 == 0 && ((uintptr_t)W->s | (uintptr_t)W->s_stride) % 8 == 0 &&
           gemv_smem_cl(xr, kps, cl) <= (size_t)g_smem_optin();
}
// Whether the splits of a dense decode call may sum in a cluster (the CL instance of g_wq_gemv_kernel):
// 2..8 of them (the portable cluster size), the whole grid resident at once (at most the four CTAs
// an SM of the split rule), compute 9.0+ and V41_WQ_NO_CLUSTER unset (read at every call). Session
// 12 measured the cluster sum slower than the second kernel wherever the grid took more than one
// wave (co-scheduling 5-8 CTAs that wait for free slots) and faster for idx_wq_b (160 CTAs).
bool gemv_cluster(long ctas, int sp)
{
    return sp >= 2 && sp <= 8 && ctas * sp <= 4L * g_num_sms() && g_cc_major() >= 9 && !g_env_flag("V41_WQ_NO_CLUSTER");
}
// Split count of a dense decode call: enough CTAs for about four per SM (the kernel keeps 4 warps x
// P tiles in flight per CTA), at least 4 k tiles per split, the partials within ws unless the
// splits sum in a cluster (*cl; no workspace then).
int split_gemv(const v41g_wq *W, int M, size_t ws_bytes, int *kps, bool *cl)
{
    const int KT = (W->K + 63) / 64;
    const long ctas = (W->N + WQ_BN - 1) / WQ_BN, want = 4L * g_num_sms();
    const size_t per = sizeof(float) * (size_t)M * W->N;
    int sp = (int)std::min<long>(std::max(1, KT / 4), (want + ctas - 1) / ctas);
    if (const long e = v41_env_long("V41_WQ_SPLITS", 0))   /* as in split_for (k ranges of whole groups here) */
        sp = (int)std::min<long>(e, KT);
    auto kps_of = [&](int n) { return ((KT + n - 1) / n + 3) / 4 * 4; };   /* whole groups of 4 tiles */
    *kps = kps_of(sp);
    sp = (KT + *kps - 1) / *kps;   /* so every split has tiles (the cluster sum needs every rank) */
    if ((*cl = gemv_cluster(ctas, sp))) return sp;
    while (sp > 1 && per * sp > ws_bytes) {
        *kps = kps_of(sp - 1);
        sp = (KT + *kps - 1) / *kps;
    }
    *cl = gemv_cluster(ctas, sp);
    return sp;
}
// V41_WQ_GEMV16=0 (read at every call; A/B runs and the tests): grouped calls of 5..8 rows a group on
// average take the decode kernel with 8 rows a pass (its rows staged for the whole k range at
// once), as before session 24, instead of 16 in chunks
bool gemv16() { return v41_env_flag("V41_WQ_GEMV16", 1) != 0; }
// k tiles a staged chunk of xr rows, for kt tiles: the fewest chunks that keep the staged rows of a
// CTA within a quarter (fp4) or a third (fp8) of an SM's shared memory, the CTAs an SM that the
// NT = 2 instance's registers allow (fp4: 128 with 2 weight tiles in flight a warp; H200, session
// 24: the MoE at 512 tokens 3.67 ms, against 4.16 ms at three CTAs an SM and 3.78 ms with 4 tiles
// in flight at three), as even as whole groups of 4 tiles allow
int gemv_chunk(int fmt, int kt, int xr)
{
    const int per = fmt == V41G_WQ_FP4 ? 4 : 3;
    const long cap = std::max<long>(4, ((long)g_smem_optin() / per - 1024) / xr / 128 / 4 * 4);
    const long n = (kt + cap - 1) / cap;
    return (int)std::min<long>(cap, ((kt + n - 1) / n + 3) / 4 * 4);
}
// the split plan of a dense call: gemv (*cl: its splits sum in a cluster) or the tiled kernels
// (wg: wgmma or mma.sync)
int plan(const v41g_wq *W, int M, bool wg, size_t ws_bytes, int *kps, bool *gv, bool *cl)
{
    *gv = *cl = false;
    if (M <= 8 && use_gemv()) {
        bool c;
        int k, sp = split_gemv(W, M, ws_bytes, &k, &c);
        if (gemv_ok(W, M, k, c)) {
            *gv = true;
            *cl = c;
            *kps = k;
            return sp;
        }
    }
    return split_for(W, M, wg, ws_bytes, kps);
}
// cl: the cluster instance, grid.z splits as clusters of (1, 1, grid.z)
int launch_gemv(int fmt, dim3 grid, const wq_args &a, bool cl, cudaStream_t st)
{
    if (a.xr > 8 && cl) return (int)cudaErrorInvalidValue;   /* (no such instance; never asked for) */
    const int sm = (int)gemv_smem_cl(a.xr, a.kc > 0 ? a.kc : a.kt_per_split, cl);
    const cudaLaunchAttribute at = g_attr_cluster(dim3(1, 1, grid.z));
    auto go = [&](auto *kern) -> int {
        if (int rc = set_smem(kern, sm)) return rc;
        G_CHECK(g_launch_ex(kern, grid, dim3(128), sm, st, cl ? &at : NULL, a));
        return 0;
    };
    if (a.xr > 8)
        return fmt == V41G_WQ_FP8 ? go(g_wq_gemv_kernel<V41G_WQ_FP8, false, 2>) : go(g_wq_gemv_kernel<V41G_WQ_FP4, false, 2>);
    if (fmt == V41G_WQ_FP8) return cl ? go(g_wq_gemv_kernel<V41G_WQ_FP8, true>) : go(g_wq_gemv_kernel<V41G_WQ_FP8, false>);
    return cl ? go(g_wq_gemv_kernel<V41G_WQ_FP4, true>) : go(g_wq_gemv_kernel<V41G_WQ_FP4, false>);
}

template <int FMT, int BM, int TL = 0>
int launch_t(dim3 grid, const wq_args &a, cudaStream_t st, bool wg)
{
    if (wg) {
        const int sm = smem_of<FMT, BM, TL>(true);
        if (int rc = set_smem(g_wq_wgmma_kernel<FMT, BM, TL>, sm)) return rc;
        g_wq_wgmma_kernel<FMT, BM, TL><<<grid, 256, sm, st>>>(a);
    } else if constexpr (BM <= 64) {
        const int sm = smem_of<FMT, BM>(false);
        if (int rc = set_smem(g_wq_mma_kernel<FMT, BM / 8>, sm)) return rc;
        g_wq_mma_kernel<FMT, BM / 8><<<grid, 128, sm, st>>>(a);
    } else
        return (int)cudaErrorInvalidValue;
    G_LAUNCHED();
    return 0;
}

int launch(int fmt, int bm, dim3 grid, const wq_args &a, cudaStream_t st, bool wg)
{
#define WQ_L(F) (bm == 8 ? launch_t<F, 8>(grid, a, st, wg) : bm == 16 ? launch_t<F, 16>(grid, a, st, wg) \
                 : bm == 32 ? launch_t<F, 32>(grid, a, st, wg) : bm == 64 ? launch_t<F, 64>(grid, a, st, wg) \
                 : launch_t<F, 128>(grid, a, st, wg))
    return fmt == V41G_WQ_FP8 ? WQ_L(V41G_WQ_FP8) : WQ_L(V41G_WQ_FP4);
#undef WQ_L
}

// Tail rows of the wgmma kernel's 64-row m tiles in grouped calls (g_wq_wgmma_kernel's TL): a
// group's last 65..64 + TL rows in one pass over its weights. V41_WQ_TAIL=0, 8 or 16 (read at
// every call; A/B runs and the tests) overrides the default 16.
int tail_rows() { return (int)v41_env_long("V41_WQ_TAIL", 16); }

wq_args args_of(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32)
{
    wq_args a;
    a.w = W->w; a.s = W->s; a.w_stride = W->w_stride; a.s_stride = W->s_stride;
    a.N = W->N; a.K = W->K; a.r0 = W->r0;
    a.x = x; a.xrow = NULL; a.off = NULL; a.M = M;
    a.y = y; a.out_f32 = out_f32; a.part = NULL;
    a.kt_per_split = (W->K + 63) / 64;
    a.xr = 8;
    a.kc = 0;
    return a;
}

}  // namespace

extern "C" size_t v41g_wq_tiled_bytes(int fmt, int N, int K)
{
    if ((fmt != V41G_WQ_FP8 && fmt != V41G_WQ_FP4) || N <= 0 || K <= 0 || K % 32) return 0;
    return (size_t)((N + WQ_BN - 1) / WQ_BN) * ((K + 63) / 64) * WQ_BN * wq_wrow(fmt);
}

extern "C" int v41g_wq_tile(int fmt, int N, int K, const uint8_t *codes, uint8_t *tiled, v41g_stream s)
{
    const size_t bytes = v41g_wq_tiled_bytes(fmt, N, K);
    if (!bytes || !codes || !tiled || ((uintptr_t)codes | (uintptr_t)tiled) % 16) return (int)cudaErrorInvalidValue;
    g_wq_tile_kernel<<<(unsigned)((bytes + 255) / 256), 256, 0, G_STREAM(s)>>>(fmt, N, K, codes, tiled, bytes);
    G_LAUNCHED();
    return 0;
}

extern "C" int v41g_wq_f8_active(const v41g_wq *W) { return g_env_flag("V41_WQ_F8MMA") && v41g_wq_f8_ok(W); }

namespace {
// V41_WQ_F8MMA=1: dense calls of fp8 Linears that v41g_wq_f8_ok accepts run as fp8 MMAs
// (k_wq_f8.cu), their input re-quantized into the workspace: codes (M K bytes, rounded up to 16),
// then scales [K/32][ldm] (ldm: M rounded up to 4), 32 bytes of slack for aligning the start
size_t f8_codes(const v41g_wq *W, int M) { return ((size_t)M * W->K + 15) / 16 * 16; }
int f8_ldm(int M) { return (M + 3) / 4 * 4; }
size_t f8_ws(const v41g_wq *W, int M) { return f8_codes(W, M) + 4 * (size_t)f8_ldm(M) * (W->K / 32) + 32; }
// the f8 path of a dense call (V41_WQ_F8MMA): 1 and *rc set when it ran; 0 when the workspace is
// too small for it (the caller then runs the bf16 kernels)
bool f8_call(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32, void *ws, size_t ws_bytes, cudaStream_t st,
             int *rc)
{
    if (!ws || ws_bytes < f8_ws(W, M)) return false;
    const uintptr_t b = ((uintptr_t)ws + 15) & ~(uintptr_t)15;
    uint8_t *x8 = (uint8_t *)b;
    float *xs = (float *)(b + f8_codes(W, M));
    const int ldm = f8_ldm(M);
    // x is the act_quant'ed input: quantizing it again gives codes and scales whose products are
    // the same values (k_wq_f8.cu), so the call computes the same products as the bf16 kernels
    *rc = v41g_act_quant_f8(x, M, W->K, x8, xs, ldm, st);
    if (!*rc) *rc = v41g_wq_gemm_f8(W, x8, xs, ldm, M, y, out_f32, st);
    return true;
}
}  // namespace

extern "C" size_t v41g_wq_ws_bytes(const v41g_wq *W, int M)
{
    if (!wq_valid(W) || M <= 0) return 0;
    if (v41g_wq_f8_active(W)) return f8_ws(W, M);
    bool gv, cl;
    int kps, sp = plan(W, M, use_wgmma(), (size_t)-1, &kps, &gv, &cl);
    return sp > 1 && !cl ? sizeof(float) * (size_t)sp * M * W->N : 0;
}

extern "C" int v41g_wq_gemm(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32, void *ws,
                            size_t ws_bytes, v41g_stream s)
{
    if (!wq_valid(W) || M < 0 || ((uintptr_t)x % 16)) return (int)cudaErrorInvalidValue;
    if (M == 0) return 0;
    cudaStream_t st = G_STREAM(s);
    int frc;
    if (v41g_wq_f8_active(W) && f8_call(W, x, M, y, out_f32, ws, ws_bytes, st, &frc)) return frc;
    const bool wg = use_wgmma();
    const int BM = bm_for(M, wg);
    wq_args a = args_of(W, x, M, y, out_f32);
    bool gv, cl;
    const int sp = plan(W, M, wg, ws ? ws_bytes : 0, &a.kt_per_split, &gv, &cl);
    if (sp > 1 && !cl) a.part = (float *)ws;
    int rc;
    if (gv) {
        a.xr = M;
        rc = launch_gemv(W->fmt, dim3((W->N + WQ_BN - 1) / WQ_BN, 1, sp), a, cl, st);
    } else
        rc = launch(W->fmt, BM, dim3((W->N + WQ_BN - 1) / WQ_BN, (M + BM - 1) / BM, sp), a, st, wg);
    if (rc || sp == 1 || cl) return rc;
    const size_t MN = (size_t)M * W->N;
    // PDL: the reduction's launch overlaps the end of the GEMM (it waits for the partials on the device)
    if (MN % 4 == 0 && MN >= (size_t)1024 * g_num_sms() && !g_env_flag("V41_WQ_REDUCE1") && (uintptr_t)a.part % 16 == 0 &&
        (uintptr_t)y % (out_f32 ? 16 : 8) == 0)
        G_CHECK(g_launch_pdl(g_wq_reduce4_kernel, dim3((unsigned)((MN / 4 + 255) / 256)), dim3(256), 0, st,
                             (const float *)a.part, sp, MN, y, out_f32));
    else
        G_CHECK(g_launch_pdl(g_wq_reduce_kernel, dim3((unsigned)((MN + 255) / 256)), dim3(256), 0, st, (const float *)a.part,
                             sp, MN, y, out_f32));
    return 0;
}

namespace {
bool linear_deq(const v41g_wq *W, int M) { return M >= V41G_WQ_DEQUANT_ROWS && !v41g_wq_f8_active(W); }
}  // namespace

extern "C" size_t v41g_wq_linear_ws_bytes(const v41g_wq *W, int M)
{
    if (!wq_valid(W) || M <= 0) return 0;
    return linear_deq(W, M) ? 2 * (size_t)W->N * W->K : v41g_wq_ws_bytes(W, M);
}

extern "C" int v41g_wq_linear(const v41g_wq *W, const uint16_t *x, int M, void *y, int out_f32, void *ws,
                              size_t ws_bytes, v41g_stream s)
{
    if (!wq_valid(W) || M < 0) return (int)cudaErrorInvalidValue;
    if (!linear_deq(W, M)) return v41g_wq_gemm(W, x, M, y, out_f32, ws, ws_bytes, s);
    if (!ws || ws_bytes < 2 * (size_t)W->N * W->K) return (int)cudaErrorInvalidValue;
    int rc = v41g_wq_dequant(W, 0, (uint16_t *)ws, s);
    return rc ? rc : v41g_gemm_bf16(x, (const uint16_t *)ws, y, M, W->N, W->K, out_f32, 1, 0, 0, 0, s);
}

extern "C" int v41g_wq_gemm_grouped(const v41g_wq *W, int G, const int32_t *off, const int32_t *xrow,
                                    const uint16_t *x, int M_total, void *y, int out_f32, v41g_stream s)
{
    if (!wq_valid(W) || G <= 0 || !off || M_total < 0 || ((uintptr_t)x % 16)) return (int)cudaErrorInvalidValue;
    if (M_total == 0) return 0;
    // rows per m tile from the mean rows per group (the counts themselves stay on the device); a
    // tile for 128 rows at the MoE's 4096 tokens (64 a group on average) measured 13.1 against
    // 10.4 ms (session 9): decoding the weights of the groups past 64 rows twice costs less than
    // half-empty MMAs for all of them
    const bool wg = use_wgmma();
    const int BM = bm_for((M_total + G - 1) / G, wg);
    wq_args a = args_of(W, x, M_total, y, out_f32);
    a.off = off;
    a.xrow = xrow;
    const int mean = (M_total + G - 1) / G;
    if (mean <= 8 && use_gemv()) {
        // rows a pass: groups of more rows loop over m tiles (the weights again). From 5 rows a group
        // on average, 16 (two n8 tiles, the second skipped where a pass has at most 8 rows), staged in
        // chunks of kc k tiles that keep four CTAs an SM. H200, session 24: the MoE at 512 tokens (8 a
        // group; about 40 % of the groups have 9..16 rows) 4.51 -> 3.67 ms; at 256 tokens (4 a group)
        // 16 rows a pass was slower (w2 875 -> 1043 us: its 8 staged rows fit four CTAs an SM already)
        a.xr = mean <= 2 ? 4 : mean <= 4 || !gemv16() ? 8 : 16;
        if (a.xr == 16) a.kc = gemv_chunk(W->fmt, a.kt_per_split, a.xr);
        if (gemv_ok(W, a.xr, a.kc ? a.kc : a.kt_per_split, false))
            return launch_gemv(W->fmt, dim3((W->N + WQ_BN - 1) / WQ_BN, G, 1), a, false, G_STREAM(s));
    }
    const dim3 grid((W->N + WQ_BN - 1) / WQ_BN, G, 1);
    if (wg && BM == 64) {
        const int tl = tail_rows();
        if (tl == 16)
            return W->fmt == V41G_WQ_FP8 ? launch_t<V41G_WQ_FP8, 64, 16>(grid, a, G_STREAM(s), true)
                                         : launch_t<V41G_WQ_FP4, 64, 16>(grid, a, G_STREAM(s), true);
        if (tl == 8)
            return W->fmt == V41G_WQ_FP8 ? launch_t<V41G_WQ_FP8, 64, 8>(grid, a, G_STREAM(s), true)
                                         : launch_t<V41G_WQ_FP4, 64, 8>(grid, a, G_STREAM(s), true);
    }
    return launch(W->fmt, BM, grid, a, G_STREAM(s), wg);
}

extern "C" int v41g_wq_dequant(const v41g_wq *W, int g, uint16_t *out, v41g_stream s)
{
    if (!wq_valid(W) || g < 0 || !out) return (int)cudaErrorInvalidValue;
    if ((uintptr_t)out % 16) return (int)cudaErrorInvalidValue;   /* 16-byte stores */
    /* one warp per 4 rows x 64 columns of a tile: 32 units per tile */
    const long units = (long)((W->K + 63) / 64) * ((W->N + WQ_BN - 1) / WQ_BN) * 32;
    if (units > INT_MAX) return (int)cudaErrorInvalidValue;
    const unsigned nb = (unsigned)((units + WQ_DQ_THREADS / 32 - 1) / (WQ_DQ_THREADS / 32));
    if (W->fmt == V41G_WQ_FP8) g_wq_dequant_kernel<V41G_WQ_FP8><<<nb, WQ_DQ_THREADS, 0, G_STREAM(s)>>>(*W, g, (int)units, out);
    else g_wq_dequant_kernel<V41G_WQ_FP4><<<nb, WQ_DQ_THREADS, 0, G_STREAM(s)>>>(*W, g, (int)units, out);
    G_LAUNCHED();
    return 0;
}
