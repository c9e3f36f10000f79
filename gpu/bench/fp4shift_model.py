#!/usr/bin/python3
# fp4shift_model.py: host-side model of the decode kernel's fp4 shift decode (gpu/k_wq.cu,
# V41_WQ_FP4_SHIFT). Checks, without a GPU:
#  - the index mapping: with the tiled code layout (wq_col_of), wq_dec_fp4x8's pairs (nibble 3-t,
#    7-t of a thread's word) as the A fragments of the two MMAs of a 32-column block and the
#    activation words staged as the kernel stages them (the B fragments), every virtual k of an
#    MMA meets the same actual column in A and B, and each column of the block is used once;
#  - the decode: for all 16 codes at every nibble position, the bf16 bits (sign at 15, magnitude
#    at 8..6) times 2^126 are the e2m1 value, the sign of zero included.
# Mirrors the kernel's formulas; run it after changing either side.  Exit 0 when both hold.
import itertools, struct
def col_of(p):  # tile position -> column (wq_col_of)
    return 16*((p>>2)&3) + 2*(p>>4) + (p&1) + 8*((p>>1)&1)
def pos_of(k):
    return 16*((k&7)>>1) + 4*(k>>4) + 2*((k>>3)&1) + (k&1)
assert all(col_of(pos_of(k))==k for k in range(64))
# A side: for thread c, word bl, nibble n -> position 16c + 8bl + n -> column
def acol(c, bl, n): return col_of(16*c + 8*bl + n)
# q[t]: lo = nibble 3-t, hi = nibble 7-t
def q(c, bl, t): return (acol(c,bl,3-t), acol(c,bl,7-t))
# staging: word index within row-tile segment (32 words) -> (lo col, hi col)
stage = {}
for j in (0,1,4,5):
    for h in range(4):
        k = 8*j + 2*h
        w = 8*h + 4*(j>>2) + (j&1)
        assert w not in stage and w+2 not in stage
        stage[w] = (k, k+16); stage[w+2] = (k+1, k+17)
assert sorted(stage) == list(range(32)), sorted(stage)
def bw(c, i): return stage[8*c + i]
for bl in range(2):
    cols = []
    for c in range(4):
        for (A0, A2, B0, B1) in ((q(c,bl,3), q(c,bl,1), bw(c,4*bl), bw(c,4*bl+1)), (q(c,bl,2), q(c,bl,0), bw(c,4*bl+2), bw(c,4*bl+3))):
            # a0 (virtual 2c, 2c+1) pairs with b0 (virtual 2c, 2c+1); a2 with b1
            assert A0 == B0, (bl, c, A0, B0)
            assert A2 == B1, (bl, c, A2, B1)
            cols += list(A0) + list(A2)
    assert sorted(cols) == list(range(32*bl, 32*bl+32)), (bl, sorted(cols))
print("mapping ok")
# decode exactness: bf16 bits -> value
def bf16(b):
    return struct.unpack('<f', struct.pack('<I', (b & 0xFFFF) << 16))[0]
E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6]
# every code at every nibble position
for W in [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x10325476, 0x98BADCFE, 0xEFCDAB89, 0x67452301]:
    for t in range(4):
        y = ((W << (4*t)) & 0xFFFFFFFF) & 0xF000F000
        b = (y | (y >> 6)) & 0x81C081C0
        for half, nib in ((0, 3-t), (1, 7-t)):
            code = (W >> (4*nib)) & 15
            want = (-1 if code & 8 else 1) * E2M1[code & 7]
            got = bf16(b >> (16*half)) * 2.0**126
            assert got == want, (hex(W), t, half, code, got, want)
            # the sign of zero too (0x8 is -0)
            assert (struct.pack('<f', got)[3] & 0x80 != 0) == (code & 8 != 0), ('sign', hex(W), t, half, code)
print("decode ok")
