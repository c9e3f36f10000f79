#!/usr/bin/python3
# fp4shift_model.py: host-side model of the fp4 tile layout and shift decode of gpu/k_wq.cu
# (wq_col_of4, wq_dec_fp4x8, wq_mul_fp4, wq_big_fp4, g_wq_tile_kernel). Checks, without a GPU:
#  - the layout: wq_col_of4 is a permutation of each 64-column tile row, and for every thread
#    (lane % 4 = c) and word w of its 8 bytes, wq_dec_fp4x8's pairs (nibble 3-t low, 7-t high) are
#    the mma/wgmma A registers of k-steps 2w (q[3] = a0/a1: columns 16s + 2c, +1; q[2] = a2/a3:
#    16s + 2c + 8, +9) and 2w + 1 (q[1], q[0]), and word w lies in one 32-column scale block;
#  - the decode: for all 16 codes at every nibble position and every scale byte e = 0..254, the
#    bf16 bits (sign at 15, magnitude at 8..6) times 2^(min(e,128)-1), then for e > 128 times
#    2^(e-128), each product rounded to bf16 as the hardware's bf16x2 multiply rounds it, equal
#    the bf16 rounding of code * 2^(e-127) (what ref's fp32 product gives; the sign of zero too).
# Mirrors the kernel's formulas; run it after changing either side. Exit 0 when all hold.
import math
from bf16_model import bf16_val, bf16_round

def col_of4(p):   # tile-row position p = 16c + 8w + j -> column
    return 16 * (2 * ((p >> 3) & 1) + ((p >> 1) & 1)) + 2 * (p >> 4) + ((p >> 2) & 1) + 8 * (p & 1)

assert sorted(col_of4(p) for p in range(64)) == list(range(64))
for c in range(4):
    for w in range(2):
        col = lambda j: col_of4(16 * c + 8 * w + j)
        q = {t: (col(3 - t), col(7 - t)) for t in range(4)}
        for s, lo, hi in ((2 * w, q[3], q[2]), (2 * w + 1, q[1], q[0])):
            assert lo == (16 * s + 2 * c, 16 * s + 2 * c + 1), (c, w, s, lo)
            assert hi == (16 * s + 2 * c + 8, 16 * s + 2 * c + 9), (c, w, s, hi)
        assert len({col(j) // 32 for j in range(8)}) == 1 and col(0) // 32 == w
# g_wq_tile_kernel: byte b of a tile row holds positions 2b (low nibble), 2b + 1 (high); word w of
# thread c is bytes 8c + 4w .. + 3 little-endian, so its nibble j is position 16c + 8w + j
for c in range(4):
    for w in range(2):
        for j in range(8):
            b, h = divmod(16 * c + 8 * w + j, 2)
            assert b == 8 * c + 4 * w + j // 2 and h == j % 2
print("layout ok")

E2M1 = [0.0, .5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
def mul_fp4(e): return 2.0 ** (min(e, 128) - 1)
def big_fp4(e): return 1.0 if e <= 128 else 2.0 ** (e - 128)
checked = 0
for W in [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x10325476, 0x98BADCFE, 0xEFCDAB89, 0x67452301]:
    for t in range(4):
        y = ((W << (4 * t)) & 0xFFFFFFFF) & 0xF000F000
        b = (y | (y >> 6)) & 0x81C081C0
        for half, nib in ((0, 3 - t), (1, 7 - t)):
            code = (W >> (4 * nib)) & 15
            x = bf16_val(b >> (16 * half))
            assert x == (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * 2.0 ** -126, (hex(W), t, code)
            for e in range(255):
                got = bf16_round(bf16_round(x * mul_fp4(e)) * big_fp4(e))
                want = bf16_round((-1.0 if code & 8 else 1.0) * E2M1[code & 7] * 2.0 ** (e - 127))
                assert got == want and math.copysign(1, got) == math.copysign(1, want), (hex(W), t, code, e, got, want)
                checked += 1
print("decode ok (%d code x scale pairs)" % checked)
# g_wq_dequant_kernel decodes one k-step s of word W: V = W << 8 (s even) or W (s odd), low pair
# from V << 4, high pair from V: the same bits as wq_dec_fp4x8's q[3], q[2] (even) or q[1], q[0]
for W in [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]:
    y = lambda t: ((W << (4 * t)) & 0xFFFFFFFF) & 0xF000F000
    for odd in (0, 1):
        V = (W << (8 * (1 - odd))) & 0xFFFFFFFF
        assert ((V << 4) & 0xFFFFFFFF) & 0xF000F000 == y(1 if odd else 3)
        assert V & 0xF000F000 == y(0 if odd else 2)
print("dequant half decode ok")
