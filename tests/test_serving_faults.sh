#!/bin/sh
# The serving faults are localized by `v41 bisect --a ref --b ref --inject NAME`
# (SPEC §7, §8). Inputs that trigger them: prompts longer than the window W = 8
# of the tiny model (replay on is the default of v41 bisect: decoder-side trimming
# after the cut = last kv source, layer 4), and --dspark with a padded DSpark list
# (V41_DSPARK_ALIGN=64 for both sides: bisect has no --dspark-align flag).
#   swa-not-floored        the window floor kv_start = L - W of the trimmed layers is
#                          ignored -> first local failure: layer 5 (first after the cut) attention
#   replay-rows-misaligned the top-k / candidate rows are not realigned after the
#                          compaction at the cut -> layer 4 (the cut) attention
#   dspark-padding-counted the padded width enters the DSpark softmax denominator
#                          -> layer 7 (DSpark stage 0) dspark
# ref vs ref is deterministic: exact comparison (atol = rtol = 0).
# V41_FAULTS_ENGINE=gpu runs the same list as gpu vs gpu (tests/test_serving_gpu.sh does: same GEMM
# shapes on both sides, so everything before the fault is bitwise identical there too).
set -u
B=${V41_BUILDDIR:-.}
V41=$B/harness/v41
PY=${PYTHON3:-python3}
"$PY" -c 'import json' 2>/dev/null || { echo "skip: no python3"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41srvfaults.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=1 V41_DSPARK_ALIGN=64
R="--threads 1 --random-prompts 2:14 --steps 1 --dspark"
E=${V41_FAULTS_ENGINE:-ref}
nfail=0
while read -r f layer sub; do
  "$V41" bisect --a "$E" --b "$E" --inject "$f" $R --atol 0 --rtol 0 --json >"$T/b.json" 2>"$T/err"
  rc=$?
  if [ $rc != 1 ]; then echo "FAIL $f: bisect exit $rc (want 1)"; cat "$T/err"; nfail=$((nfail + 1)); continue; fi
  got=$("$PY" -c "
import json; d = json.load(open('$T/b.json'))['first_local_failure']
print(d['layer'], d['sublayer'], d['tap']) if d else print('none none none')")
  set -- $got
  if [ "$1" = "$layer" ] && [ "$2" = "$sub" ]; then echo "ok   $E/$E $f -> layer $1 $2 ($3)"
  else echo "FAIL $f: first local failure '$got', want layer $layer $sub"; nfail=$((nfail + 1)); fi
done <<'LIST'
swa-not-floored 5 attention
replay-rows-misaligned 4 attention
dspark-padding-counted 7 dspark
swa-not-floored@6 6 attention
dspark-padding-counted@8 8 dspark
LIST
# prompts no longer than W: nothing is trimmed, the replay faults have nothing to act on
"$V41" bisect --a "$E" --b "$E" --inject swa-not-floored --threads 1 --random-prompts 2:8 --steps 1 --atol 0 --rtol 0 \
  --json >"$T/b.json" 2>"$T/err"
rc=$?
[ $rc = 0 ] || { echo "FAIL swa-not-floored on prompts <= W: bisect exit $rc (want 0: no difference)"; nfail=$((nfail + 1)); }
[ $nfail = 0 ] || exit 1
echo "test_serving_faults: ok"
exit 0
