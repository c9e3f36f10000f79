#!/bin/sh
# notebooks/divergence.ipynb executes headless (nbconvert --execute) on dumps
# and a bisect JSON made here (tiny model, a fault injected on side B), and on
# the dumps alone; any failing cell fails the test.
set -u
B=${V41_BUILDDIR:-.}
S=${V41_SRCDIR:-..}
V41=$B/harness/v41
PY=${PYTHON3:-python3}
J=${JUPYTER:-}
[ -n "$J" ] || J=$(command -v jupyter 2>/dev/null) || true
[ -n "$J" ] || { echo "skip: jupyter not found"; exit 77; }
"$PY" -c 'import h5py, numpy, matplotlib' 2>/dev/null || { echo "skip: $PY lacks h5py/numpy/matplotlib"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41nb.XXXXXX") || exit 99
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && tail -30 "$T/out"; exit 1; }
export OMP_NUM_THREADS=1 MPLBACKEND=Agg

"$V41" bisect --a ref --b ref --inject sink-dropped@2 --threads 1 --random-prompts 2:10 --steps 1 \
  --json --keep "$T/k" >"$T/bisect.json" 2>"$T/out"
[ $? = 1 ] || fail "bisect"
run_nb() {
  V41_SRCDIR="$S" V41_NB_OUT="$T" "$J" nbconvert --to notebook --execute \
    --ExecutePreprocessor.timeout=120 --output-dir "$T" --output "$1" "$S/notebooks/divergence.ipynb" >"$T/out" 2>&1
}
V41_DUMP_A="$T/k/a.h5" V41_DUMP_B="$T/k/b.h5" V41_BISECT_JSON="$T/bisect.json" run_nb with_bisect || fail "notebook (bisect JSON + dumps)"
[ -s "$T/divergence_per_layer.png" ] && [ -s "$T/divergence_heatmap.png" ] && [ -s "$T/divergence_worst.png" ] || fail "figures"
grep -q "first local failure.*'layer': 2" "$T/with_bisect.ipynb" || fail "notebook did not report the injected layer"
rm -f "$T"/*.png
V41_DUMP_A="$T/k/a.h5" V41_DUMP_B="$T/k/b.h5" run_nb dumps_only || fail "notebook (dumps only)"
[ -s "$T/divergence_heatmap.png" ] || fail "figures (dumps only)"
echo "test_notebook: ok"
exit 0
