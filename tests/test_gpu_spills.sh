#!/bin/sh
# The registers that ptxas could not fit: every kernel of gpu/*.cu spills exactly the bytes that
# gpu/ptxas_spills.txt lists (none where it lists nothing). A spill in a measured kernel costs
# local-memory traffic in its inner loop, and a change of the decode or the tiling can bring one
# without any test of values noticing (session 28's fp4 decode gave the MoE's 16-row kernel a
# 16-byte spill, found only in session 29). Reads the reports the build keeps
# (gpu/.libs/NAME.ru); needs a CUDA build, not a GPU: skips (77) without one, and when the build's
# nvcc is another than the one the list was taken with.
S=${V41_SRCDIR:-..}
B=${V41_BUILDDIR:-.}
[ -f "$B/gpu/libv41gpukern.la" ] || { echo "no CUDA build (gpu/libv41gpukern.la absent): skip"; exit 77; }
set --
for cu in "$S"/gpu/*.cu; do
  n=$(basename "$cu" .cu)
  set -- "$@" "$B/gpu/.libs/$n.ru"
done
exec sh "$S/gpu/bench/ptxas_spills.sh" --check "$S/gpu/ptxas_spills.txt" "$@"
