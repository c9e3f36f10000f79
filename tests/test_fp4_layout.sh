#!/bin/sh
# The fp4 tile layout and shift decode of gpu/k_wq.cu (wq_col_of4, wq_dec_fp4x8 and its scale
# multipliers), modelled on the host by gpu/bench/fp4shift_model.py: the A-register pairs of every
# thread and k-step, and every code at every nibble position times every scale byte 0..254 against
# the bf16 rounding of code * 2^(e-127). Needs no GPU and no Python modules.
S=${V41_SRCDIR:-..}
PY=${PYTHON3:-python3}
exec "$PY" "$S/gpu/bench/fp4shift_model.py"
