#!/bin/sh
# v41 run / taps: a dump of the tiny model with the documented schema; two
# runs of the same inputs are bitwise identical; bad input -> exit 2 and no
# output file; --taps selects.
set -u
B=${V41_BUILDDIR:-.}
V41=$B/harness/v41
T=$(mktemp -d "${TMPDIR:-/tmp}/v41run.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && cat "$T/out"; exit 1; }
export OMP_NUM_THREADS=1
R="--threads 1 --random-prompts 2:10 --steps 2"

"$V41" run tiny --engine ref $R --dspark --dump "$T/a.h5" >"$T/out" 2>&1 || fail "run"
"$V41" run --engine ref:emulate $R --dspark --dump "$T/b.h5" >"$T/out" 2>&1 || fail "run 2"
"$V41" diff --atol 0 --rtol 0 "$T/a.h5" "$T/b.h5" >"$T/out" 2>&1 || fail "two identical runs differ"
grep -q "step0002 dspark.tokens" "$T/out" && fail "unexpected"
"$V41" diff --verbose "$T/a.h5" "$T/b.h5" >"$T/out" 2>&1
grep -q "step0002 dspark.tokens" "$T/out" || fail "no dspark taps with --dspark"
grep -q "step0000 layer.0.stream.in" "$T/out" || fail "no layer taps"

# prompt file
printf '1 2 3 4 5\n# comment\n\n7,8,9\n' >"$T/p.txt"
"$V41" run --prompt-ids "$T/p.txt" --steps 1 --threads 1 --taps 'tokens*,logits' --dump "$T/c.h5" >"$T/out" 2>&1 || fail "prompt file"
"$V41" diff --verbose "$T/c.h5" "$T/c.h5" >"$T/out" 2>&1
grep -q "^summary: 6 taps compared" "$T/out" || fail "--taps selection (want tokens.in, logits, tokens x 2 steps)"

# errors: no partial output file
"$V41" run --random-prompts 2:200 --steps 1 --dump "$T/d.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "too long prompt: exit"
[ ! -e "$T/d.h5" ] && [ ! -e "$T/d.h5.tmp" ] || fail "partial output after an error"
printf '1 2 99999\n' >"$T/bad.txt"
"$V41" run --prompt-ids "$T/bad.txt" --dump "$T/d.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "bad token id"
grep -q "bad.txt:1" "$T/out" || fail "bad token message"
"$V41" run --engine tpu --dump "$T/d.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "bad engine"
"$V41" run --inject no-such-fault --dump "$T/d.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "bad inject"
"$V41" run --steps 1 >"$T/out" 2>&1; [ $? = 2 ] || fail "missing --dump"
# a malformed V41_* switch stops the command before any work (ref/v41_env.h); an unknown V41_* name warns
V41_DSPARK_ALIGN=abc "$V41" run --steps 1 --dump "$T/d.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "V41_DSPARK_ALIGN=abc: exit"
grep -q "V41_DSPARK_ALIGN='abc': expected a whole number" "$T/out" || fail "V41_DSPARK_ALIGN message"
[ ! -e "$T/d.h5" ] && [ ! -e "$T/d.h5.tmp" ] || fail "output after a bad V41_* value"
V41_GEMM_ONECOLUMN=1 "$V41" run --random-prompts 1:4 --steps 1 --threads 1 --dump "$T/d.h5" >"$T/out" 2>&1 || fail "unknown V41_* name: run"
grep -q "warning: environment variable V41_GEMM_ONECOLUMN is not one v41 reads" "$T/out" || fail "unknown V41_* name: no warning"
rm -f "$T/d.h5"
"$V41" help env >"$T/out" 2>&1 && grep -q "^  V41_WQ_TAIL  *one of 0|8|16" "$T/out" || fail "v41 help env"
# integer options take whole numbers in range, never atoi's 0 (they fail before any work)
"$V41" run --steps abc --dump "$T/d.h5" >"$T/out" 2>&1; [ $? = 2 ] || fail "--steps abc"
"$V41" oracle-check "$T" "$T/x.h5" --steps 2x >"$T/out" 2>&1; [ $? = 2 ] || fail "oracle-check --steps 2x"
grep -q "steps '2x'" "$T/out" || fail "oracle-check --steps message"
"$V41" oracle-check "$T" "$T/x.h5" --threads 99999999999999999999 >"$T/out" 2>&1; [ $? = 2 ] || fail "oracle-check --threads overflow"
for a in "--tokens abc" "--tokens 1" "--decode -1" "--threads 0" "--experts 5" "--experts 385"; do
  "$V41" bench ref $a >"$T/out" 2>&1; [ $? = 2 ] || fail "bench ref $a"
  grep -q "expected a whole number" "$T/out" || fail "bench ref $a: message"
done

# taps
"$V41" taps >"$T/out" 2>&1 || fail "taps"
grep -q "layer.{l}.attn.q" "$T/out" || fail "taps table"
if [ -n "${PYTHON3:-}" ]; then
  "$V41" taps --json >"$T/taps.json" || fail "taps --json"
  "$PYTHON3" -c "
import json; t = json.load(open('$T/taps.json'))
d = {x['pattern']: x for x in t}
assert d['layer.{l}.attn.q']['golden'] == 'attn_q' and d['layer.{l}.attn.topk']['discrete']
" || fail "taps --json content"
fi
echo "test_run_cli: ok"
exit 0
