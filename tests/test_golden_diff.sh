#!/bin/sh
# The oracle's golden_fixed.h5 (and golden.h5 with --compat official), converted into the dump schema by
# harness/python/golden_to_v41.py, against a ref run of the same inputs:
# `v41 diff` must pass. The ref run is teacher-forced from the converted
# golden at the layer inputs (stream, pre-mix) and the shared top-k /
# candidate state (as oracle-check does: layer-local comparison, and the
# golden's choices at exact bf16 ties), so the comparison is per layer.
# Taps the golden file does not capture are ignored (--ignore-missing).
set -u
B=${V41_BUILDDIR:-.}
S=${V41_SRCDIR:-..}
V41=$B/harness/v41
PY=${PYTHON3:-python3}
O=${V41_ORACLE_DIR:-$S/../shared/oracle/v41-tiny}
[ -f "$O/golden_fixed.h5" ] || { echo "skip: no oracle at $O"; exit 77; }
"$PY" -c 'import h5py, numpy' 2>/dev/null || { echo "skip: $PY lacks h5py/numpy"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41golden.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && tail -40 "$T/out"; exit 1; }
export OMP_NUM_THREADS=1

"$PY" "$S/harness/python/golden_to_v41.py" "$O/golden_fixed.h5" "$T/golden.h5" --v41 "$V41" \
  --prompts "$T/prompts.txt" >"$T/out" 2>&1 || fail "converter"
steps=$("$PY" -c "import h5py; print(h5py.File('$O/golden_fixed.h5','r').attrs['n_decode'])")
"$V41" run "$O" --no-replay --prompt-ids "$T/prompts.txt" --steps "$steps" --dspark --threads 1 --dump "$T/ref.h5" \
  --force-from "$T/golden.h5" --force-taps '*.stream.in,*.premix.in,*.indexer.topk,*.candidate.mask' >"$T/out" 2>&1 \
  || fail "ref run"
"$V41" diff --ignore-missing "$T/golden.h5" "$T/ref.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 0 ] || fail "golden_fixed vs ref: exit $rc"
# the comparison really covered the model: layers, caches, DSpark stages, discrete taps
"$V41" diff --verbose --ignore-missing "$T/golden.h5" "$T/ref.h5" >"$T/out" 2>&1
for t in "step0000 layer.0.attn.q " "step0003 layer.4.indexer.topk " "step0002 layer.1.cache.compressed " \
         "step0001 dspark.0.attn.core " "step0008 tokens " "step0005 dspark.tokens " "step0000 logits "; do
  grep "^same    $t" "$T/out" >/dev/null || fail "tap not compared: $t"
done
n=$(grep -c "^same " "$T/out")
[ "$n" -gt 2000 ] || fail "only $n taps compared"
# golden.h5 (the published code's index-key semantics) against ref --compat official
if [ -f "$O/golden.h5" ]; then
  "$PY" "$S/harness/python/golden_to_v41.py" "$O/golden.h5" "$T/golden_off.h5" --v41 "$V41" >"$T/out" 2>&1 || fail "converter (golden.h5)"
  "$V41" run "$O" --no-replay --compat official --prompt-ids "$T/prompts.txt" --steps "$steps" --dspark --threads 1 --dump "$T/ref_off.h5" \
    --force-from "$T/golden_off.h5" --force-taps '*.stream.in,*.premix.in,*.indexer.topk,*.candidate.mask' >"$T/out" 2>&1 \
    || fail "ref run (official)"
  "$V41" diff --ignore-missing "$T/golden_off.h5" "$T/ref_off.h5" >"$T/out" 2>&1; rc=$?
  [ $rc = 0 ] || fail "golden.h5 vs ref --compat official: exit $rc"
fi
# and a free (unforced) run is NOT the same: the diff detects the divergence
"$V41" run "$O" --no-replay --prompt-ids "$T/prompts.txt" --steps 2 --threads 1 --dump "$T/free.h5" >"$T/out" 2>&1 || fail "free run"
"$V41" diff --quiet --ignore-missing --only 'layer.*' "$T/golden.h5" "$T/free.h5"; rc=$?
echo "test_golden_diff: ok ($n taps within tolerance; free run diff exit $rc)"
exit 0
