#!/bin/sh
# Every injected fault is localized: `v41 diff` of a clean and a faulty run
# reports a difference, and `v41 bisect` (fault on side B only) names the
# layer and sublayer where it was injected as the first local failure.
# ref vs ref in the same precision is deterministic, so the comparison is
# exact (atol = rtol = 0): sinkhorn-rows-last changes a converged Sinkhorn
# by ~1e-7 only, below any rounding-derived tolerance.
set -u
B=${V41_BUILDDIR:-.}
V41=$B/harness/v41
PY=${PYTHON3:-python3}
"$PY" -c 'import json' 2>/dev/null || { echo "skip: no python3"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41faults.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=1
R="--threads 1 --random-prompts 2:12 --steps 1"
nfail=0
# fault@layer  expected-layer  expected-sublayer
while read -r f layer sub; do
  "$V41" bisect --a ref --b ref --inject "$f" $R --dspark --atol 0 --rtol 0 --json --keep "$T/k" >"$T/b.json" 2>"$T/err"
  rc=$?
  if [ $rc != 1 ]; then echo "FAIL $f: bisect exit $rc"; cat "$T/err"; nfail=$((nfail + 1)); continue; fi
  "$V41" diff --quiet "$T/k/a.h5" "$T/k/b.h5" --atol 0 --rtol 0; drc=$?
  [ $drc = 1 ] || { echo "FAIL $f: diff exit $drc"; nfail=$((nfail + 1)); }
  got=$("$PY" -c "
import json; d = json.load(open('$T/b.json'))['first_local_failure']
print(d['layer'], d['sublayer'], d['tap']) if d else print('none none none')")
  set -- $got
  if [ "$1" = "$layer" ] && [ "$2" = "$sub" ]; then echo "ok   $f -> layer $1 $2 ($3)"
  else echo "FAIL $f: first local failure '$got', want layer $layer $sub"; nfail=$((nfail + 1)); fi
  rm -rf "$T/k"
done <<'LIST'
sink-dropped@3 3 attention
rope-not-interleaved@2 2 attention
sinkhorn-rows-last@1 1 attention
compressed-visible-one-group-early@3 3 attention
indexer-relu-dropped@4 4 attention
router-bias-in-weights@2 2 ffn
sink-dropped@8 8 dspark
sink-dropped 0 attention
LIST
[ $nfail = 0 ] || exit 1
echo "test_faults: ok"
exit 0
