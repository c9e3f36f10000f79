#!/bin/sh
# v41 parity: the verdict and its exit status. Same engine and precision:
# in parity (every tap agrees). A fault on side B: not in parity, the
# injected layer named. The default sides (no GPU: ref:fp32 vs ref:emulate):
# in parity, the precision gap reported as information, flips explained.
# The oracle directory as MODEL adds the oracle check.
set -u
B=${V41_BUILDDIR:-.}
S=${V41_SRCDIR:-..}
V41=$B/harness/v41
PY=${PYTHON3:-python3}
O=${V41_ORACLE_DIR:-$S/../shared/oracle/v41-tiny}
T=$(mktemp -d "${TMPDIR:-/tmp}/v41parity.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && tail -30 "$T/out"; exit 1; }
export OMP_NUM_THREADS=1
R="--threads 1 --random-prompts 2:10 --steps 1"

"$V41" parity --a ref --b ref $R >"$T/out" 2>&1; rc=$?
[ $rc = 0 ] || fail "ref vs ref: exit $rc"
grep -q "verdict: IN PARITY within the expected tolerances: every tap agrees" "$T/out" || fail "ref vs ref verdict"

"$V41" parity --a ref --b ref --inject rope-not-interleaved@2 $R >"$T/out" 2>&1; rc=$?
[ $rc = 1 ] || fail "fault: exit $rc"
grep -q "^bisect: first local failure: step 0 layer 2 attention" "$T/out" || fail "fault not localized"
grep -q "^verdict: NOT IN PARITY" "$T/out" || fail "fault verdict"

# The default sides without a GPU (fp32 against emulate): in parity, every flip explained, in
# configurations where the free run flips a row of a tap whose teacher-forced flip is a near tie
# in another token (before session 27 the classifier decided "inherited" per tap, and these
# three configurations ended NOT IN PARITY: the replay-trimmed 10-token prompts by a logit margin
# of 0.92, the other two by 2-3 logits).
i=0
for args in "$R" "--threads 1 --random-prompts 2:16 --seed 7 --steps 6" "--threads 1 --random-prompts 3:24 --seed 6 --steps 6"; do
  i=$((i + 1))
  "$V41" parity $args --json >"$T/out" 2>"$T/err"; rc=$?
  if "$PY" -c 'import json' 2>/dev/null; then
    "$PY" - "$T/out" "$rc" <<'PY' || fail "default sides, configuration $i: $args"
import json, sys
d = json.load(open(sys.argv[1])); rc = int(sys.argv[2])
assert d["in_parity"] == (rc == 0), (d["in_parity"], rc)
if d["b"].startswith("ref"):   # no GPU: the precision gap is expected and reported
    assert d["a"] == "ref:fp32" and d["b"] == "ref:emulate", d
    assert d["precision_gap_expected"] and not d["same"] and d["worst_nrmse"] > 0, d
    assert rc == 0, "fp32 vs emulate must be in parity: %s" % [f for f in d["flips"] if f["why"] == "UNEXPLAINED"]
    # the free run's flips are explained row by row: some inherited, none unexplained
    assert any(f["why"] == "inherited" for f in d["flips"] if f["run"] == "propagated"), d["flips"]
PY
  else
    [ $rc = 0 ] || fail "default sides, configuration $i: exit $rc"
  fi
done
"$V41" parity --a ref --b tpu $R >"$T/out" 2>&1; [ $? = 2 ] || fail "bad side"

if [ -f "$O/golden_fixed.h5" ]; then
  "$V41" parity "$O" --a ref --b ref $R >"$T/out" 2>&1; rc=$?
  [ $rc = 0 ] || fail "oracle dir: exit $rc"
  grep -q "^oracle verdict: ref matches the official code" "$T/out" || fail "oracle verdict"
fi
echo "test_parity: ok"
exit 0
