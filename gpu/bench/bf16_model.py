# bf16_model.py: the bf16 helpers shared by the host models of gpu/k_wq.cu's decodes
# (fp4shift_model.py, fp8lanes_model.py): a bf16 bit pattern's value, and the bf16 rounding of an
# exact value (what the hardware's bf16x2 multiply does to the exact product).
import math, struct

def bf16_val(b):
    return struct.unpack('<f', struct.pack('<I', (b & 0xFFFF) << 16))[0]

def bf16_round(v):   # exact double -> nearest bf16 value (ties to even, subnormals, overflow to inf)
    if v == 0 or math.isinf(v):
        return v
    a = abs(v)
    ex = max(math.frexp(a)[1] - 1, -126)   # unbiased exponent, subnormal range clamped
    quantum = 2.0 ** (ex - 7)
    n = a / quantum
    r = math.floor(n)
    if n - r > 0.5 or (n - r == 0.5 and r % 2 == 1):
        r += 1
    out = r * quantum
    if out >= 2.0 ** 128:
        out = math.inf
    return math.copysign(out, v)
