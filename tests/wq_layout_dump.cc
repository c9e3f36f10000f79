// wq_layout_dump: prints the tile layout functions of gpu/k_wq_layout.h as compiled on the host,
// one line each, for gpu/bench/fp4shift_model.py (tests/test_fp4_layout.sh) to check against its
// model of the fp4 decode:
//   col_of4 P0 .. P63        wq_col_of4(p), p = 0..63
//   pos_of K0 .. K63         wq_pos_of(k), k = 0..63
//   fp4_bit B0 .. B31        wq_fp4_bit(j, k), j = 0..7 (outer), k = 0..3
//   fp4_sel LO HI MASK       WQ_FP4_SEL_LO, WQ_FP4_SEL_HI, WQ_FP4_MASK (hex)
#include "k_wq_layout.h"
#include <cstdio>

// the functions are constant expressions, as the kernels use them
static_assert(wq_col_of4(63) == 63 && wq_fp4_bit(7, 3) >= 0, "constexpr");

int main()
{
    std::printf("col_of4");
    for (int p = 0; p < 64; p++) std::printf(" %d", wq_col_of4(p));
    std::printf("\npos_of");
    for (int k = 0; k < 64; k++) std::printf(" %d", wq_pos_of(k));
    std::printf("\nfp4_bit");
    for (int j = 0; j < 8; j++)
        for (int k = 0; k < 4; k++) std::printf(" %d", wq_fp4_bit(j, k));
    std::printf("\nfp4_sel 0x%X 0x%X 0x%X\n", WQ_FP4_SEL_LO, WQ_FP4_SEL_HI, WQ_FP4_MASK);
    return 0;
}
