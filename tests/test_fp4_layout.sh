#!/bin/sh
# The weight decodes of gpu/k_wq.cu, modelled on the host (no GPU, no Python modules needed):
#  - gpu/bench/fp4shift_model.py: the fp4 tile layout and shift decode (wq_col_of4, wq_dec_fp4x8 and
#    its scale multipliers): the A-register pairs of every thread and k-step, and every code at
#    every nibble position times every scale byte 0..254 against the bf16 rounding of code * 2^(e-127);
#  - gpu/bench/fp8lanes_model.py: the e4m3 lanes (sign-replicating prmt, wq_fp8_lanes, wq_mul_fp8):
#    every code byte at every byte position, equal to the pre-session-18 formula's bits, and
#    code * 2^(e-7) * 2^-120 exact for every scale byte the engine keeps packed.
S=${V41_SRCDIR:-..}
PY=${PYTHON3:-python3}
"$PY" "$S/gpu/bench/fp4shift_model.py" || exit 1
exec "$PY" "$S/gpu/bench/fp8lanes_model.py"
