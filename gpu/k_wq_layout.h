// k_wq_layout.h: where gpu/k_wq.cu's tiled weight codes put each column and each fp4 code bit.
// constexpr functions that compile for the device (k_wq.cu) and for the host (g++:
// tests/wq_layout_dump.cc prints them, and gpu/bench/fp4shift_model.py, run by
// tests/test_fp4_layout.sh in make check, checks that output against its model of the decode),
// so the layout the kernels use is the one the model proves, on a machine without a GPU.
// C++ only (constexpr); the layouts themselves are described in k_wq.cu.
#ifndef V41_K_WQ_LAYOUT_H
#define V41_K_WQ_LAYOUT_H

#ifdef __CUDACC__
#define WQ_HD __host__ __device__
#else
#define WQ_HD
#endif

// column of tile-row position p (the A-fragment permutations; fp8 and fp4), and fp8's inverse
WQ_HD constexpr int wq_col_of4(int p)
{
    return 16 * (2 * ((p >> 3) & 1) + ((p >> 1) & 1)) + 2 * (p >> 4) + ((p >> 2) & 1) + 8 * (p & 1);
}
WQ_HD constexpr int wq_pos_of(int k)
{
    return 16 * ((k & 7) >> 1) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1);
}

// fp4: bit k (0: m, 1: e0, 2: e1, 3: sign) of element j (0..7) of a tiled 32-bit word sits at bit
// wq_fp4_bit(j, k). Pair t of the word (elements 3 - t and 7 - t): bytes 2 (t % 2) and 2 (t % 2) + 1
// of rotation rL(t) = 1 (t < 2) or 3 give their (m, e0) bytes, the same bytes of rotation
// rH(t) = 0 or 6 their (e1, sign) bytes.
WQ_HD constexpr int wq_fp4_bit(int j, int k)
{
    const int t = j < 4 ? 3 - j : 7 - j;              /* element j's pair */
    const int b = 2 * (t & 1) + (j < 4 ? 0 : 1);      /* its byte in both rotations (lane 0: the first) */
    const int rl = t < 2 ? 1 : 3, rh = t < 2 ? 0 : 6; /* the rotations of its (m, e0) and (e1, sign) bytes */
    const int at[4] = {6 - rl, 7 - rl, -rh, 7 - rh};  /* bit k's place in byte b, before the rotation */
    return (8 * b + at[k]) & 31;
}
#define WQ_FP4_SEL_LO 0x5140u   /* prmt: bytes 0 (rL), 0 (rH), 1 (rL), 1 (rH) */
#define WQ_FP4_SEL_HI 0x7362u   /* bytes 2, 2, 3, 3 */
#define WQ_FP4_MASK 0x81C081C0u /* sign at bit 15, magnitude at bits 8..6, both halves */

#endif
