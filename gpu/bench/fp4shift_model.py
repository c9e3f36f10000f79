#!/usr/bin/python3
# fp4shift_model.py: host-side model of the fp4 tile layout and rotate-permute decode of
# gpu/k_wq.cu (wq_col_of4, wq_fp4_bit, wq_dec_fp4x8, wq_dec_fp4_half, wq_dec_fp4_one, wq_mul_fp4,
# wq_big_fp4, g_wq_tile_kernel). Checks, without a GPU:
#  - the layout: wq_col_of4 is a permutation of each 64-column tile row, and for every thread
#    (lane % 4 = c) and word w of its 8 bytes, wq_dec_fp4x8's pairs (element 3-t low, 7-t high) are
#    the mma/wgmma A registers of k-steps 2w (q[3] = a0/a1: columns 16s + 2c, +1; q[2] = a2/a3:
#    16s + 2c + 8, +9) and 2w + 1 (q[1], q[0]), and word w lies in one 32-column scale block;
#  - the bit scatter: wq_fp4_bit is a permutation of the word's 32 bits, and the rotations by 1, 3, 6
#    and byte permutes of wq_dec_fp4x8 give, for random words, the same bf16 bit patterns as the
#    nibble layout's shift decode it replaced (sessions 1-27);
#  - the decode: for all 16 codes at every element position and every scale byte e = 0..254, the
#    bf16 bits (sign at 15, magnitude at 8..6) times 2^(min(e,128)-1), then for e > 128 times
#    2^(e-128), each product rounded to bf16 as the hardware's bf16x2 multiply rounds it, equal
#    the bf16 rounding of code * 2^(e-127) (what ref's fp32 product gives; the sign of zero too).
#  - with --c-layout FILE (the output of tests/wq_layout_dump, which compiles gpu/k_wq_layout.h on
#    the host): that the C functions wq_col_of4, wq_pos_of, wq_fp4_bit and the constants
#    WQ_FP4_SEL_LO/HI, WQ_FP4_MASK the kernels use give exactly this model's values, so the model's
#    proofs hold for the kernels' layout (tests/test_fp4_layout.sh passes it in make check);
#  - wq_pos_of (the decode kernel's activation staging) inverts the fp8 position map.
# Mirrors the kernel's formulas; run it after changing either side. Exit 0 when all hold.
import math
import sys
from bf16_model import bf16_val, bf16_round

if not (len(sys.argv) == 1 or (len(sys.argv) == 3 and sys.argv[1] == "--c-layout")):
    sys.exit("usage: fp4shift_model.py [--c-layout FILE]")

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
# g_wq_tile_kernel: the word of bytes 8c + 4w .. + 3 (little-endian) of a tile row holds the
# elements j = 0..7 at positions 2 (8c + 4w) + j = 16c + 8w + j, the positions checked above
print("layout ok")

def pos_of(k):   # wq_pos_of: fp8 tile-row position of column k (thread c's B words: k-step s at 16c + 4s)
    return 16 * ((k & 7) >> 1) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)
def col8(p):   # fp8 position p = 16c + 4s + j -> column 16s + 2c + (j & 1) + 8 (j >> 1)
    c, st, j = p >> 4, (p >> 2) & 3, p & 3
    return 16 * st + 2 * c + (j & 1) + 8 * (j >> 1)
assert all(pos_of(col8(p)) == p for p in range(64))

M32 = 0xFFFFFFFF
def wq_fp4_bit(j, k):   # as the C constexpr: element j's pair t, lane, byte m, rotations rL, rH
    t = 3 - j if j < 4 else 7 - j
    m = 8 * (2 * (t & 1) + (0 if j < 4 else 1))
    rl, rh = (1, 0) if t < 2 else (3, 6)
    return (m + (6 - rl, 7 - rl, -rh, 7 - rh)[k]) & 31
assert sorted(wq_fp4_bit(j, k) for j in range(8) for k in range(4)) == list(range(32))
def tile_word(old):   # g_wq_tile_kernel: nibble-layout word (element j = nibble j) -> tiled word
    return sum(((old >> (4 * j + k)) & 1) << wq_fp4_bit(j, k) for j in range(8) for k in range(4))
def rotl(w, r): return ((w << r) | (w >> (32 - r))) & M32 if r else w
def prmt(a, b, sel):
    by = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    return sum(by[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))
SEL_LO, SEL_HI, MASK = 0x5140, 0x7362, 0x81C081C0
def dec_fp4x8(T):   # wq_dec_fp4x8 before the multiply: q[0..3]
    r1, r3, r6 = rotl(T, 1), rotl(T, 3), rotl(T, 6)
    return [prmt(r1, T, SEL_LO) & MASK, prmt(r1, T, SEL_HI) & MASK, prmt(r3, r6, SEL_LO) & MASK, prmt(r3, r6, SEL_HI) & MASK]
def dec_one(T, t):   # wq_dec_fp4_one
    rl, rh = (rotl(T, 1), T) if t < 2 else (rotl(T, 3), rotl(T, 6))
    return prmt(rl, rh, SEL_HI if t & 1 else SEL_LO) & MASK
def dec_half(T, h):   # wq_dec_fp4_half: q[2h], q[2h + 1] (the decode kernel's 16-row instance)
    rl, rh = (rotl(T, 3), rotl(T, 6)) if h else (rotl(T, 1), T)
    return [prmt(rl, rh, SEL_LO) & MASK, prmt(rl, rh, SEL_HI) & MASK]
def dec_shift(W, t):   # the nibble layout's decode (sessions 1-27), for comparison
    y = ((W << (4 * t)) & M32) & 0xF000F000
    return (y | (y >> 6)) & MASK
import random
rng = random.Random(28)
words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x10325476, 0x98BADCFE, 0xEFCDAB89, 0x67452301, 0, M32]
words += [rng.getrandbits(32) for _ in range(20000)]
for W in words:
    q = dec_fp4x8(tile_word(W))
    for t in range(4):
        assert q[t] == dec_shift(W, t), (hex(W), t)
        assert dec_one(tile_word(W), t) == q[t], (hex(W), t)
    assert dec_half(tile_word(W), 0) + dec_half(tile_word(W), 1) == q, hex(W)
print("bit scatter ok (%d words)" % len(words))
E2M1 = [0.0, .5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
def mul_fp4(e): return 2.0 ** (min(e, 128) - 1)
def big_fp4(e): return 1.0 if e <= 128 else 2.0 ** (e - 128)
checked = 0
for W in [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x10325476, 0x98BADCFE, 0xEFCDAB89, 0x67452301]:
    q = dec_fp4x8(tile_word(W))
    for t in range(4):
        b = q[t]
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
# g_wq_dequant_kernel decodes pair 3 - j0 of each word (j0 = 2 (s % 2) + h): checked with
# dec_one above

if len(sys.argv) == 3:   # --c-layout FILE
    want = {"col_of4": [col_of4(p) for p in range(64)], "pos_of": [pos_of(k) for k in range(64)],
            "fp4_bit": [wq_fp4_bit(j, k) for j in range(8) for k in range(4)], "fp4_sel": [SEL_LO, SEL_HI, MASK]}
    got = {}
    with open(sys.argv[2]) as f:
        for line in f:
            name, *vals = line.split()
            got[name] = [int(v, 0) for v in vals]
    for name in want:
        assert got.get(name) == want[name], "k_wq_layout.h's %s differs from the model: %s, model %s" % (name, got.get(name), want[name])
    print("C layout ok (%s)" % ", ".join(sorted(want)))
