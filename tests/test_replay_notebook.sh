#!/bin/sh
# notebooks/replay.ipynb executes headless (nbconvert --execute): it runs `v41 replay-study`
# on prompts of 8 (= W: nothing trimmed), 16 and 32 tokens and plots divergence and savings;
# any failing cell (including its assertion that prompts <= W are unchanged) fails the test.
set -u
B=${V41_BUILDDIR:-.}
S=${V41_SRCDIR:-..}
PY=${PYTHON3:-python3}
J=${JUPYTER:-}
[ -n "$J" ] || J=$(command -v jupyter 2>/dev/null) || true
[ -n "$J" ] || { echo "skip: jupyter not found"; exit 77; }
"$PY" -c 'import numpy, matplotlib' 2>/dev/null || { echo "skip: $PY lacks numpy/matplotlib"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41rnb.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
export MPLBACKEND=Agg
V41="$B/harness/v41" V41_NB_OUT="$T" "$J" nbconvert --to notebook --execute --ExecutePreprocessor.timeout=300 \
  --output-dir "$T" --output replay "$S/notebooks/replay.ipynb" >"$T/out" 2>&1 || { tail -30 "$T/out"; exit 1; }
[ -s "$T/replay_layers.png" ] && [ -s "$T/replay_savings.png" ] || { echo "FAIL: figures missing"; exit 1; }
echo "test_replay_notebook: ok"
