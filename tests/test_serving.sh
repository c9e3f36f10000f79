#!/bin/sh
# Serving semantics through the CLI (SPEC §7, §8):
#  1. DSpark speculation is lossless: with greedy acceptance the target's output ids are the same
#     with and without drafting (serve-trace --dspark vs plain), request by request.
#  2. serve-trace's JSON carries the acceptance histogram the simulator reads (v41 sim --accept file:).
#  3. replay-study runs and reports zero divergence for prompts no longer than the window
#     (trimming keeps every row when query_len <= W).
#  4. bad input: a malformed trace is an error (exit 2) naming the line.
set -eu
V41=${V41_BUILDDIR:-.}/harness/v41
PY=${PYTHON3:-/usr/bin/python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

synth="n=3,rate=1000,in=uniform:12:20,out=fixed:6,groups=1,prefix=8,block=8,seed=5"
"$V41" serve-trace --block 8 --synth "$synth" --limit 3 --max-len 48 --json "$tmp/plain.json" >/dev/null
"$V41" serve-trace --block 8 --synth "$synth" --limit 3 --max-len 48 --dspark --json "$tmp/spec.json" >/dev/null
"$PY" - "$tmp/plain.json" "$tmp/spec.json" <<'PYEOF'
import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
assert len(a["requests"]) == len(b["requests"]) == 3, "request count"
for ra, rb in zip(a["requests"], b["requests"]):
    assert len(ra["output_ids"]) == ra["out_len"], ("plain output length", ra)
    assert ra["output_ids"] == rb["output_ids"], ("DSpark changed the greedy output", ra["id"], ra["output_ids"], rb["output_ids"])
    assert rb["verify_steps"] > 0, "no verification step ran"
h = b["accepted_hist"]
assert sum(h) == sum(r["verify_steps"] for r in b["requests"]), "histogram counts one entry per verify step"
assert a["accepted_hist"] == [], "no histogram without --dspark"
print("serve-trace: DSpark lossless on", len(a["requests"]), "requests;", "accepted_hist", h)
PYEOF
"$V41" replay-study --random-prompts 2:8 --steps 2 --json "$tmp/rs.json" >/dev/null
"$PY" - "$tmp/rs.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["kl_max"] == 0.0 and r["greedy_agree"] == r["greedy_total"], r
assert all(x == 0.0 for x in r["layer_rel_rms"] if x is not None), r["layer_rel_rms"]
assert r["layer_rows_saved"] == 0, "prompts of W rows keep every row"
print("replay-study: prompts <= W unchanged by trimming")
PYEOF
# the simulator costs every measured step of the serve-trace run (predicted vs measured latency)
"$V41" sim --validate "$tmp/spec.json" --fit --json > "$tmp/val.json"
"$PY" - "$tmp/val.json" <<'PYEOF'
import json, sys
v = json.load(open(sys.argv[1]))
assert v["schema"] == "v41-sim-validate/1" and v["steps"] >= 4 and v["evaluated"] == v["steps"] // 2, v
assert all(p >= 0 for _, p in v["per_step"]) and v["median_abs_rel_err"] >= 0, v
print("sim --validate: %d steps, held-out median error %.1f%%" % (v["steps"], 100 * v["median_abs_rel_err"]))
PYEOF
# --fit-from: the cost model fitted on another run (a calibration run of 6 spaced-out requests: at least as
# many steps as the model has coefficients) and evaluated on every step of spec.json
# (all steps evaluated, the measured column is spec.json's step times, NNLS coefficients >= 0)
"$V41" serve-trace --block 8 --synth "n=6,rate=50,in=uniform:12:20,out=fixed:6,groups=1,prefix=8,block=8,seed=6" --max-len 48 --json "$tmp/cal.json" >/dev/null
"$V41" sim --validate "$tmp/spec.json" --fit-from "$tmp/cal.json" --json > "$tmp/val2.json"
"$PY" - "$tmp/val2.json" "$tmp/spec.json" <<'PYEOF'
import json, sys
v = json.load(open(sys.argv[1])); sp = json.load(open(sys.argv[2]))
assert v["evaluated"] == v["steps"] == len(sp["steps"]), (v["evaluated"], v["steps"], len(sp["steps"]))
assert "fitted on every step of" in v["rates"], v["rates"]
f = v["fit"]
assert all(f[k] >= 0 for k in f), ("NNLS coefficients must be non-negative", f)
meas = [m for m, _ in v["per_step"]]
assert meas == [s["seconds"] for s in sp["steps"]], "measured seconds are the serve-trace step times"
print("sim --validate --fit-from: %d steps, median error %.1f%%" % (v["steps"], 100 * v["median_abs_rel_err"]))
PYEOF
# --calibration applies that fit as it stands: the same per-step predictions, and `v41 sim`
# runs a trace with it (the simulator's step time is then the calibrated model)
"$V41" sim --validate "$tmp/spec.json" --calibration "$tmp/val2.json" --json > "$tmp/val3.json"
"$PY" - "$tmp/val2.json" "$tmp/val3.json" <<'PYEOF'
import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
# same model, terms summed in another order: equal to fp64 rounding of ~10 terms (1e-12 relative is ample)
assert len(a["per_step"]) == len(b["per_step"])
for (ma, pa), (mb, pb) in zip(a["per_step"], b["per_step"]):
    assert ma == mb and abs(pa - pb) <= 1e-12 * abs(pa), ("--calibration must reproduce --fit-from", pa, pb)
assert "calibrated by" in b["rates"], b["rates"]
print("sim --validate --calibration: reproduces the fit's %d predictions" % len(b["per_step"]))
PYEOF
"$V41" sim --model tiny --synth "n=6,rate=100,in=uniform:8:30,out=fixed:4,seed=3" --calibration "$tmp/val2.json" \
  --json --no-progress > "$tmp/simcal.json"
"$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['finished'] == 6, d" "$tmp/simcal.json" \
  || { echo "v41 sim --calibration: unexpected summary"; cat "$tmp/simcal.json"; exit 1; }
# bad input: a missing or foreign calibration file is an error naming it (exit 2)
for bad in "$tmp/none.json" "$tmp/bad.jsonl"; do
  [ "$bad" = "$tmp/bad.jsonl" ] && printf '{"schema": "something-else"}\n' > "$bad"
  set +e
  "$V41" sim --validate "$tmp/spec.json" --fit-from "$bad" 2>"$tmp/err" >/dev/null
  rc=$?
  "$V41" sim --model tiny --synth "n=2" --calibration "$bad" --no-progress 2>"$tmp/err2" >/dev/null
  rc2=$?
  set -e
  [ $rc -eq 2 ] && [ $rc2 -eq 2 ] || { echo "bad calibration file $bad: exit $rc / $rc2, want 2"; exit 1; }
  grep -q "$(basename "$bad")" "$tmp/err" && grep -q "$(basename "$bad")" "$tmp/err2" \
    || { echo "error does not name the file:"; cat "$tmp/err" "$tmp/err2"; exit 1; }
done
echo "sim --validate --fit-from: bad calibration files rejected"
# a serve-trace step item whose position is missing, fractional or huge is an error naming step, item
# and key (a missing key used to reach an undefined NaN -> int64 conversion)
for mut in 'del it["floor"]' 'it["end"] = 3.5' 'it["start"] = 1e300' 's["seconds"] = 1e999'; do
  "$PY" - "$tmp/spec.json" "$tmp/mut.json" "$mut" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1])); s = j["steps"][1]; it = s["items"][0]
exec(sys.argv[3])
open(sys.argv[2], "w").write(json.dumps(j).replace("Infinity", "1e999"))
PYEOF
  set +e
  "$V41" sim --validate "$tmp/mut.json" --fit 2>"$tmp/err" >/dev/null
  rc=$?
  set -e
  [ $rc -eq 2 ] && grep -q "mut.json: step 1 " "$tmp/err" \
    || { echo "serve-trace with $mut: exit $rc, want 2 and the step named:"; cat "$tmp/err"; exit 1; }
done
echo "sim --validate: malformed step items rejected"
printf '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 1, "input_length": "x"}\n' > "$tmp/bad.jsonl"
set +e
"$V41" serve-trace --trace "$tmp/bad.jsonl" --limit 2 2>"$tmp/err"
rc=$?
set -e
[ $rc -eq 2 ] || { echo "malformed trace: exit $rc, want 2"; exit 1; }
grep -Eq "(line 2|jsonl:2:)" "$tmp/err" || { echo "error does not name line 2:"; cat "$tmp/err"; exit 1; }
echo "malformed trace rejected: $(cat "$tmp/err")"
# 5. (serving helper) prefix hits with encoder-side replay: request 2 shares 2 blocks of 8 tokens (16 > W = 8)
#    with request 1, request 3 shares 3 blocks (24); arrivals 100 s apart (the idle clock jumps), so each
#    request finds the previous ones cached and forks them (start at H - W with the replay floor).
#    DSpark stays lossless on the hit requests.
cat > "$tmp/hit.jsonl" <<'TREOF'
{"timestamp": 0, "input_length": 26, "output_length": 5, "hash_ids": [1, 2, 3, 4]}
{"timestamp": 100000, "input_length": 27, "output_length": 5, "hash_ids": [1, 2, 5, 6]}
{"timestamp": 200000, "input_length": 28, "output_length": 5, "hash_ids": [1, 2, 3, 7]}
TREOF
"$V41" serve-trace --block 8 --trace "$tmp/hit.jsonl" --len-scale 1 --max-len 48 --json "$tmp/hit.json" >/dev/null
"$V41" serve-trace --block 8 --trace "$tmp/hit.jsonl" --len-scale 1 --max-len 48 --dspark --json "$tmp/hitspec.json" >/dev/null
"$PY" - "$tmp/hit.json" "$tmp/hitspec.json" <<'PYEOF'
import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
W = 8
assert [r["hit"] for r in a["requests"]] == [0, 16, 24], [r["hit"] for r in a["requests"]]
assert a["hit_tokens"] == 40 and a["replay_rows"] == 2 * W, (a["hit_tokens"], a["replay_rows"])
# trimmed rows: request 1 (26 cold rows), 2 (27 - 8 = 19 rows from H - W), 3 (28 - 16 = 12): each keeps W
assert a["trimmed_rows"] == (26 - W) + (19 - W) + (12 - W), a["trimmed_rows"]
hits = [r for r in a["requests"] if r["hit"] > 0]
# the first prefill item of a hit request starts at H - W with the floor there
for r in hits:
    it = [i for s in a["steps"] for i in s["items"] if i["req"] == r["id"] and i["kind"] == "prefill"][0]
    assert it["start"] == r["hit"] - W and it["floor"] == r["hit"] - W, it
for ra, rb in zip(a["requests"], b["requests"]):
    assert ra["hit"] == rb["hit"] and ra["output_ids"] == rb["output_ids"], ("DSpark changed a hit request's output", ra, rb)
print("serve-trace: prefix hits", [r["hit"] for r in a["requests"]], "replayed rows", a["replay_rows"], "lossless with DSpark")
PYEOF
# 6. (serving helper) replay-study on prompts > W: layers up to the cut are unchanged at the last prompt row,
#    the trimmed layers diverge, and trimming saves prefill rows and FLOPs.
"$V41" replay-study --random-prompts 2:24 --steps 2 --json "$tmp/rs2.json" >/dev/null
"$PY" - "$tmp/rs2.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
cut, lay = r["cut_layer"], r["layer_rel_rms"]
assert all(x == 0.0 for x in lay[:cut]), ("layers before the cut changed", lay)
assert any(x > 0 for x in lay[cut:]), ("no divergence from the cut on", lay)
assert r["layer_rows_saved"] == 2 * (24 - 8) * (len(lay) - cut - 1), r["layer_rows_saved"]
assert r["flops_replay_on"] < r["flops_replay_off"], r
assert r["kl_max"] > 0, "logits unchanged by trimming of prompts > W"
print("replay-study: prompts > W: divergence from layer", cut, "on, rows saved", r["layer_rows_saved"])
PYEOF
