#!/bin/sh
# gpu/bench/ab_summary.py (device_run.sh's `ab` table) on hand-made profiles: the medians over
# passes, the ranges and the ratio A/B of each record, records missing from a pass left out and
# named, and bad input (no file, no 'ops', a non-positive time) refused with exit 2.
S=${V41_SRCDIR:-..}
PY=${PYTHON3:-python3}
T=$(mktemp -d) || exit 1
trap 'rm -rf "$T"' EXIT
prof() {   # prof FILE NAME=SECONDS...
  f=$1; shift
  { printf '{"schema": "v41-profile/1", "ops": ['; sep=""
    for kv in "$@"; do printf '%s{"op": "x", "name": "%s", "median_s": %s}' "$sep" "${kv%%=*}" "${kv#*=}"; sep=", "; done
    printf ']}\n'; } > "$f"
}
prof "$T/a1.json" moe=0.003 lin=0.0001
prof "$T/a2.json" moe=0.0032 lin=0.0001 only_a=1
prof "$T/a3.json" moe=0.0031 lin=0.0001
prof "$T/b1.json" moe=0.004 lin=0.0002
prof "$T/b2.json" moe=0.0038 lin=0.0002
prof "$T/b3.json" moe=0.0041 lin=0.0002
out=$("$PY" "$S/gpu/bench/ab_summary.py" --json "$T/ab.json" --a "$T"/a?.json --b "$T"/b?.json) || { echo "ab_summary failed"; exit 1; }
echo "$out"
# moe: A median 3100 us (3000-3200), B median 4000 us (3800-4100), ratio 0.775
echo "$out" | grep -Eq '^moe +3100\.0 3000\.0-3200\.0 +4000\.0 3800\.0-4100\.0 +0\.775$' || { echo "FAIL: moe row"; exit 1; }
echo "$out" | grep -Eq '^lin +100\.0 .* +200\.0 .* 0\.500$' || { echo "FAIL: lin row"; exit 1; }
echo "$out" | grep -q 'not compared): only_a' || { echo "FAIL: only_a not named"; exit 1; }
"$PY" - "$T/ab.json" <<'PY' || { echo "FAIL: ab.json"; exit 1; }
import json, sys
d = json.load(open(sys.argv[1]))
assert d["schema"] == "v41-ab-1" and d["not_compared"] == ["only_a"], d
r = {o["op"]: o for o in d["ops"]}
assert abs(r["moe"]["ratio"] - 3100 / 4000) < 1e-12 and r["moe"]["b_us"] == [4000.0, 3800.0, 4100.0], r["moe"]
PY
for bad in nofile notprofile zerotime; do
  case $bad in
    nofile) f=$T/none.json ;;
    notprofile) f=$T/np.json; echo '{"x": 1}' > "$f" ;;
    zerotime) f=$T/z.json; prof "$f" moe=0 ;;
  esac
  "$PY" "$S/gpu/bench/ab_summary.py" --a "$T/a1.json" --b "$f" > /dev/null 2> "$T/err"; rc=$?
  [ $rc -eq 2 ] || { echo "FAIL: $bad: exit $rc, want 2"; exit 1; }
  echo "$bad: $(cat "$T/err")"
done
echo "ab_summary ok"
