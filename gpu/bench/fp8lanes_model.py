#!/usr/bin/python3
# fp8lanes_model.py: host-side model of the e4m3 -> bf16 conversion of gpu/k_wq.cu (wq_prmt in
# PTX's generic, sign-replicating mode, WQ_SEL_FP8, wq_fp8_lanes, wq_mul_fp8). Checks, without a GPU,
# for every code byte at every byte position of a 32-bit word:
#  - the lanes: selector WQ_SEL_FP8(h) gives bytes 2h (low lane) and 2h + 1 (high lane), and the
#    lane bits equal those of the formula the kernels used before session 18 ([0, byte] lanes,
#    magnitude shifted down 4, sign kept at bit 15), NaN codes included;
#  - the value: the lane is the bf16 number code * 2^-120 (subnormal codes and -0 included), and
#    times the multiplier 2^(e-7) for every scale byte e in [10, 134] (the range the engine keeps
#    packed) it is code * 2^(e-127) exactly, so the bf16x2 multiply does not round.
# Mirrors the kernel's formulas; run it after changing either side. Exit 0 when all hold.
import math
from bf16_model import bf16_val, bf16_round

def prmt(a, sel):   # prmt.b32 d, a, 0, sel (generic mode): nibble bit 3 replicates the byte's sign
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [0, 0, 0, 0]
    d = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 15
        v = src[n & 7]
        if n & 8:
            v = 0xFF if v & 0x80 else 0
        d |= v << (8 * i)
    return d

SEL = {0: 0x9180, 1: 0xB3A2}
def lanes(x): return ((x & 0x087F087F) << 4) & 0xFFFFFFFF
def old_lanes(u, h):
    x = prmt(u, 0x3424 if h else 0x1404)   # [0, byte 2h, 0, byte 2h + 1]
    return ((x & 0x7F007F00) >> 4) | (x & 0x80008000)

def e4m3(b):   # e4m3fn value of a code byte (None for the NaN codes 0x7F, 0xFF)
    if b & 0x7F == 0x7F:
        return None
    s = -1.0 if b & 0x80 else 1.0
    ex, m = (b >> 3) & 15, b & 7
    return s * (m / 8.0 * 2.0 ** -6 if ex == 0 else (1 + m / 8.0) * 2.0 ** (ex - 7))

checked = 0
for b in range(256):
    v = e4m3(b)
    for pos in range(4):
        for fill in (0x00000000, 0xFFFFFFFF, 0x5A3C96E1):   # the other bytes must not leak in
            u = (fill & ~(0xFF << (8 * pos)) | (b << (8 * pos))) & 0xFFFFFFFF
            h, half = pos >> 1, pos & 1
            got = lanes(prmt(u, SEL[h]))
            assert got == old_lanes(u, h), (b, pos, hex(fill))
            if v is None:
                continue
            x = bf16_val((got >> (16 * half)) & 0xFFFF)
            assert x == v * 2.0 ** -120 and math.copysign(1, x) == math.copysign(1, v), (b, pos, x, v)
    if v is None:
        continue
    # the lane is the same number at every position (asserted above): the scales once per code
    x = v * 2.0 ** -120
    for e in range(10, 135):
        mul = bf16_val((min(e, 134) + 120) << 7)   # wq_mul_fp8's bf16 bits
        assert mul == 2.0 ** (e - 7), e
        got_v = bf16_round(x * mul)   # the bf16x2 multiply: exact product, rounded once
        want = v * 2.0 ** (e - 127)
        assert got_v == want and math.copysign(1, got_v) == math.copysign(1, want), (b, e, got_v, want)
        checked += 1
print("fp8 lanes ok (%d code x scale pairs)" % checked)
