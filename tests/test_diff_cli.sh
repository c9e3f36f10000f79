#!/bin/sh
# v41 diff from the command line: exit status 0/1/2, the first divergent tap
# of a hand-made perturbation, the decision-flip report, --json, --quiet,
# --only. Dumps come from tests/v41_dump_fixture (deterministic content).
set -u
B=${V41_BUILDDIR:-.}
V41=$B/harness/v41
FIX=$B/tests/v41_dump_fixture
T=$(mktemp -d "${TMPDIR:-/tmp}/v41diffcli.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && cat "$T/out"; exit 1; }

"$FIX" "$T/a.h5" && "$FIX" "$T/b.h5" \
  && "$FIX" "$T/p.h5" --perturb 1:layer.0.attn.out:0.5 \
  && "$FIX" "$T/f.h5" --flip 2:layer.1.attn.topk \
  && "$FIX" "$T/t.h5" --flip 1:tokens \
  && "$FIX" "$T/fp.h5" --precision fp32 || fail "fixture"

# identical content -> 0
"$V41" diff "$T/a.h5" "$T/b.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 0 ] || fail "identical dumps: exit $rc"
grep -q "verdict: same within tolerance" "$T/out" || fail "no same verdict"

# perturbation at step 1 layer.0.attn.out (and everything after it, like a real bug) -> 1, named first
"$V41" diff "$T/a.h5" "$T/p.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 1 ] || fail "perturbed: exit $rc"
grep -q "^first divergent tap: step0001 layer.0.attn.out " "$T/out" || fail "perturbed tap not named first"
grep -q "DIFF    step0001 layer.0.attn.out \[2,16\] f32: max|a-b| 0.5 at \[0,7\]" "$T/out" || fail "max error/index not reported"

# decision flip in a top-k list -> 1, the flip with row, missing and extra
"$V41" diff "$T/a.h5" "$T/f.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 1 ] || fail "flip: exit $rc"
grep -q "^first decision flip: step0002 layer.1.attn.topk (1/2 rows)" "$T/out" || fail "first flip not named"
grep -q "row 1 \[1\]: missing {2} extra {20}" "$T/out" || fail "flip row/missing/extra"
"$V41" diff "$T/a.h5" "$T/t.h5" >"$T/out" 2>&1
grep -q "^first decision flip: step0001 tokens" "$T/out" || fail "token flip not named"

# --quiet prints nothing, exit status only
"$V41" diff --quiet "$T/a.h5" "$T/p.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 1 ] && [ ! -s "$T/out" ] || fail "--quiet: exit $rc or output"

# --only restricts the walk: the perturbed taps are outside -> same
"$V41" diff --only 'embed,layer.*.attn.topk' "$T/a.h5" "$T/p.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 0 ] || fail "--only: exit $rc"

# explicit tolerances: 0.5 passes with atol 0.6
"$V41" diff --atol 0.6 --rtol 0 "$T/a.h5" "$T/p.h5" >"$T/out" 2>&1; rc=$?
[ $rc = 0 ] || fail "--atol 0.6: exit $rc"

# --json: parseable, first divergent tap
"$V41" diff --json "$T/a.h5" "$T/p.h5" >"$T/out.json" 2>"$T/out"; rc=$?
[ $rc = 1 ] || fail "--json: exit $rc"
if [ -n "${PYTHON3:-}" ] && "$PYTHON3" -c 'import json' 2>/dev/null; then
  "$PYTHON3" - "$T/out.json" <<'PY' || fail "--json content"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["same"] is False, d["same"]
assert d["first_divergent"]["name"] == "layer.0.attn.out" and d["first_divergent"]["step"] == 1, d["first_divergent"]
t = [x for x in d["taps"] if x["name"] == "layer.0.attn.out" and x["step"] == 1][0]
assert t["max_abs"] == 0.5 and t["max_abs_index"] == [0, 7], t
assert t["sublayer"] == "attention" and t["layer"] == 0, t
PY
fi

# fp32 vs emulate: tolerance level reported
"$V41" diff "$T/fp.h5" "$T/a.h5" >"$T/out" 2>&1
grep -q "default tolerances: bf16 level" "$T/out" || fail "level"
"$V41" diff "$T/fp.h5" "$T/fp.h5" >"$T/out" 2>&1
grep -q "default tolerances: fp32 level" "$T/out" || fail "fp32 level"

# errors -> 2: missing file, not HDF5, HDF5 but not a dump, bad option, missing argument
"$V41" diff "$T/a.h5" "$T/nope.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "missing file"
grep -q "nope.h5" "$T/out" || fail "missing file not named"
echo hello >"$T/text.h5"
"$V41" diff "$T/a.h5" "$T/text.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "not HDF5"
"$V41" diff --atol x "$T/a.h5" "$T/b.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "bad --atol"
"$V41" diff "$T/a.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "one file"
if [ -n "${PYTHON3:-}" ] && "$PYTHON3" -c 'import h5py' 2>/dev/null; then
  "$PYTHON3" -c "import h5py; h5py.File('$T/plain.h5','w').close()"
  "$V41" diff "$T/a.h5" "$T/plain.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "plain HDF5"
  grep -q "not a v41 dump" "$T/out" || fail "plain HDF5 message"
  cp "$T/a.h5" "$T/v2.h5"
  "$PYTHON3" -c "import h5py, numpy as np; f = h5py.File('$T/v2.h5','r+'); f.attrs['version'] = np.int32(2); f.close()"
  "$V41" diff "$T/a.h5" "$T/v2.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "schema version"
  grep -q "schema version 2" "$T/out" || fail "schema version message"
  # shape mismatch is a difference (1) with a message
  cp "$T/a.h5" "$T/s.h5"
  "$PYTHON3" -c "
import h5py, numpy as np
f = h5py.File('$T/s.h5', 'r+'); g = f['step0000']; a = dict(g['logits'].attrs); del g['logits']
d = g.create_dataset('logits', data=np.zeros((3, 32), np.float32))
for k, v in a.items(): d.attrs[k] = v
f.close()"
  "$V41" diff "$T/a.h5" "$T/s.h5" >"$T/out" 2>&1; [ $? = 1 ] || fail "shape mismatch exit"
  grep -q "shape mismatch: A \[2,32\], B \[3,32\]" "$T/out" || fail "shape mismatch message"
fi
echo "test_diff_cli: ok"
exit 0
