#!/bin/sh
# The weight decodes of gpu/k_wq.cu, modelled on the host (no GPU, no Python modules needed):
#  - gpu/bench/fp4shift_model.py: the fp4 tile layout and rotate-permute decode (wq_col_of4,
#    wq_fp4_bit, wq_dec_fp4x8 and its halves, the scale multipliers): the A-register pairs of every
#    thread and k-step, the bit scatter against the former nibble decode, and every code at every
#    element position times every scale byte 0..254 against the bf16 rounding of code * 2^(e-127);
#    and, through tests/wq_layout_dump (gpu/k_wq_layout.h compiled on the host), that the C
#    layout functions and constants the kernels use are the model's;
#  - gpu/bench/fp8lanes_model.py: the e4m3 lanes (sign-replicating prmt, wq_fp8_lanes, wq_mul_fp8):
#    every code byte at every byte position, equal to the pre-session-18 formula's bits, and
#    code * 2^(e-7) * 2^-120 exact for every scale byte the engine keeps packed.
S=${V41_SRCDIR:-..}
B=${V41_BUILDDIR:-.}
PY=${PYTHON3:-python3}
L=$(mktemp) || exit 1
trap 'rm -f "$L"' EXIT
"$B/tests/wq_layout_dump" > "$L" || { echo "tests/wq_layout_dump failed"; exit 1; }
"$PY" "$S/gpu/bench/fp4shift_model.py" --c-layout "$L" || exit 1
exec "$PY" "$S/gpu/bench/fp8lanes_model.py"
