#!/bin/sh
# Hostile HDF5 inputs (structurally valid files that no v41 writer or DeepSeek's golden script
# produces). Dumps: `v41 diff` and teacher forcing (`v41 run --force-from`); golden files:
# `v41 oracle-check`. Each must answer with exit status 0, 1 or 2 and, for 2 (or a failed
# comparison), a message naming the problem; never a crash, a sanitizer report or a hang. The
# files are made by h5py from one real dump and from the oracle fixture: array-valued attributes
# where one value is read (an overrun before session 26), out-of-range and NaN numbers, strings
# where numbers belong, non-numeric, high-rank and huge datasets, links that go nowhere.
set -u
B=${V41_BUILDDIR:-.}
V41=$B/harness/v41
PY=${PYTHON3:-/usr/bin/python3}
"$PY" -c 'import h5py, numpy' 2>/dev/null || { echo "skip: $PY lacks h5py/numpy"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/v41hostile.XXXXXX") || exit 99
ORACLE=${V41_ORACLE_DIR:-${V41_SRCDIR:-..}/tests/fixtures/v41-tiny}
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; [ -f "$T/out" ] && cat "$T/out"; exit 1; }
export OMP_NUM_THREADS=1

"$V41" run tiny --engine ref --threads 1 --random-prompts 1:6 --steps 1 --dump "$T/base.h5" >"$T/out" 2>&1 \
  || fail "base dump"

"$PY" - "$T" <<'PYEOF' || fail "making the hostile files"
import sys, shutil, h5py, numpy as np
d = sys.argv[1]
base = d + '/base.h5'
def mk(name, fn):
    shutil.copy(base, '%s/%s.h5' % (d, name))
    with h5py.File('%s/%s.h5' % (d, name), 'r+') as f:
        fn(f)
S = 'step0000'
TAP = 'embed'
def tap(f): return f[S][TAP]
def attr(key, val): return lambda f: tap(f).attrs.__setitem__(key, val)
def root(key, val): return lambda f: f.attrs.__setitem__(key, val)
def replace(data=None, keep=True, name='embed', **kw):
    def fn(f):
        t = f[S][name]; a = dict(t.attrs); shp = t.shape
        del f[S][name]
        n = f[S].create_dataset(name, data=data(shp) if data else None, **kw)
        if keep:
            for k, v in a.items(): n.attrs[k] = v
    return fn
cases = {
    # one value expected, an array given
    'arr_order': attr('order', np.arange(100)),
    'arr_rms': attr('rms', np.arange(100.0)),
    'arr_kind': attr('kind', np.array([b'bf16'] * 50)),
    'arr_dims': attr('dims', np.arange(1000)),
    'arr_version': root('version', np.arange(100)),
    # numbers out of range, NaN, wrong types
    'order_huge': attr('order', np.float64(1e300)),
    'order_nan': attr('order', np.float64('nan')),
    'order_frac': attr('order', np.float64(2.5)),
    'discrete_2': attr('discrete', np.int32(2)),
    'layer_str': attr('layer', 'x'),
    'kind_bad': attr('kind', 'complex128'),
    'dims_long': attr('dims', 'x' * 5000),
    'version_str': root('version', '1'),
    'version_huge': root('version', 1e300),
    'schema_int': root('schema', 5),
    # datasets no writer makes
    'strings': replace(lambda s: np.full(s, b'abcd')),
    'compound': replace(lambda s: np.zeros(s, dtype=[('a', 'f4'), ('b', 'i4')])),
    'nan_f64': replace(lambda s: np.full(s, np.nan)),
    'huge_i64': replace(lambda s: np.full(s, 2**62, dtype='i8')),
    'scalar': replace(lambda s: np.float32(3)),
    'empty': replace(None, shape=(0, 64), dtype='f4'),
    'huge_dims': replace(None, shape=(2**31, 2**31), dtype='f4', chunks=(1, 64)),
    'rows_shape': lambda f: (f[S].__delitem__('rows'), f[S].create_dataset('rows', data=np.zeros((3, 5), 'i4'))),
    'rows_group': lambda f: (f[S].__delitem__('rows'), f[S].create_group('rows')),
    # links
    'link_loop': lambda f: f[S].__setitem__('loop', h5py.SoftLink('/step0000/loop')),
    'ext_link': lambda f: f[S].__setitem__('ext', h5py.ExternalLink('/nonexistent.h5', '/x')),
    'step_huge': lambda f: f.move(S, 'step99999999999'),
    # a forcing point (what `run --force-from` reads)
    'force_scalar': replace(lambda s: np.float32(3), name='layer.0.stream.in'),
    'force_strings': replace(lambda s: np.full(s, b'abcd'), name='layer.0.stream.in'),
    'force_i32': replace(lambda s: np.zeros(s, 'i4'), keep=False, name='layer.0.stream.in'),
    'force_arr_kind': lambda f: f[S]['layer.0.stream.in'].attrs.__setitem__('kind', np.array([b'f32'] * 9)),
}
for k, fn in cases.items():
    mk(k, fn)
PYEOF

# run CMD...: exit status into $rc, output into $T/out; fail on a crash, a sanitizer report or a hang
run() {
  timeout 120 "$@" >"$T/out" 2>&1; rc=$?
  [ $rc = 124 ] && fail "hang: $*"
  [ $rc -le 2 ] || fail "exit $rc: $*"
  if grep -q "Sanitizer\|runtime error" "$T/out"; then fail "sanitizer report: $*"; fi
  return 0
}
n=0
for f in "$T"/*.h5; do
  [ "$f" = "$T/base.h5" ] && continue
  run "$V41" diff "$T/base.h5" "$f"
  run "$V41" diff "$f" "$T/base.h5"
  run "$V41" diff "$f" "$f"
  n=$((n + 1))
done
[ $n -ge 25 ] || fail "only $n hostile files"

# the cases that must be errors, each with a message naming what is wrong
expect2() {  # file, message fragment
  run "$V41" diff "$T/base.h5" "$T/$1.h5"
  [ $rc = 2 ] || fail "$1: exit $rc, want 2"
  grep -q "$2" "$T/out" || fail "$1: message lacks '$2'"
}
expect2 version_str "version 1 (not an integer)"
expect2 version_huge "not an integer"
expect2 arr_version "missing or not one value"
expect2 schema_int "not a v41 dump"
expect2 huge_dims "step0000/embed has more than 2^36 elements"
expect2 strings "not a number type"
expect2 compound "not a number type"
expect2 rows_shape "rows is not \[n,2\]"
# the attributes that decide what diff reports (order, layer, kind, discrete) are errors when
# present but not one value in range; the informational ones (rms, absmax, dims) count as absent
expect2 arr_order "step0000/embed: attribute order (one integer in \[0, 2^30)) is malformed"
expect2 order_huge "attribute order"
expect2 order_nan "attribute order"
expect2 order_frac "attribute order"
expect2 layer_str "step0000/embed: attribute layer"
expect2 arr_kind "step0000/embed: attribute kind (one of f32, bf16, i32, u8) is malformed"
expect2 kind_bad "attribute kind"
expect2 discrete_2 "attribute discrete (one integer, 0 or 1)"
for f in arr_rms arr_dims dims_long; do
  run "$V41" diff "$T/base.h5" "$T/$f.h5"
  [ $rc = 0 ] || fail "$f: exit $rc, want 0 (same data)"
done

# teacher forcing from a hostile dump: an error naming the tap, or a run; never a crash
for f in arr_order strings huge_dims force_scalar force_strings force_i32 force_arr_kind; do
  run "$V41" run tiny --engine ref --threads 1 --random-prompts 1:6 --steps 1 --force-from "$T/$f.h5" \
    --dump "$T/forced.h5"
  if [ $rc = 2 ]; then [ ! -e "$T/forced.h5" ] || fail "$f: partial output after an error"; fi
  rm -f "$T/forced.h5"
done
forced() {  # file, message fragment
  run "$V41" run tiny --engine ref --threads 1 --random-prompts 1:6 --steps 1 --force-from "$T/$1.h5" \
    --dump "$T/forced.h5"
  [ $rc = 2 ] || fail "forcing from $1: exit $rc, want 2"
  grep -q "$2" "$T/out" || fail "forcing from $1: message lacks '$2'"
  [ ! -e "$T/forced.h5" ] || fail "forcing from $1: partial output after an error"
}
forced force_scalar "step0000/layer.0.stream.in has shape \[\]"
forced force_strings "not a number type"
forced force_i32 "has kind i32"

# ---- golden files for oracle-check
[ -f "$ORACLE/golden_fixed.h5" ] || fail "no oracle fixture at $ORACLE"
"$PY" - "$T" "$ORACLE/golden_fixed.h5" <<'PYEOF' || fail "making the hostile golden files"
import sys, shutil, h5py, numpy as np
d, src = sys.argv[1], sys.argv[2]
def mk(name, fn):
    shutil.copy(src, '%s/g_%s.h5' % (d, name))
    with h5py.File('%s/g_%s.h5' % (d, name), 'r+') as f:
        fn(f)
def put(path, data):
    def fn(f):
        del f[path]
        f.create_dataset(path, data=data(f) if callable(data) else data)
    return fn
L5 = 'step00/layer05/'
cases = {
    'prompt_rank3': put('prompt_ids', np.zeros((2, 37, 1), 'i8')),
    'prompt_huge_b': put('prompt_ids', np.zeros((5000, 1), 'i8')),
    'ids_past_int32': put('step00/input_ids', np.full((2, 37), 2**40, 'i8')),
    'kv_2d': put(L5 + 'attn_kv', np.zeros((2, 74 * 64), 'f4')),
    'kv_short': put(L5 + 'attn_kv', np.zeros((2, 3, 64), 'f4')),
    'topk_nan': put(L5 + 'indexer_topk', np.full((2, 37, 6), np.nan, 'f4')),
    'topk_huge': put(L5 + 'indexer_topk', np.full((2, 37, 6), 1e9, 'f4')),
    'topk_width0': put(L5 + 'attn_topk_idxs', np.zeros((2, 37, 0), 'f4')),
    'mask_nan': put('step00/layer04/candidate_mask', np.full((2, 37, 37), np.nan, 'f4')),
    'rank9': put(L5 + 'attn_out', np.zeros((1,) * 9, 'f4')),
    'strings': put(L5 + 'attn_out', np.full((2, 37, 128), b'ab')),
    'spec_ids_short': put('step01/spec/input_ids', np.zeros((1,), 'i8')),
    # an array where the one string index_k_semantics belongs: read as absent, so compat official
    'arr_semantics': lambda f: f.attrs.__setitem__('index_k_semantics', ['fixed'] * 50),
}
for k, fn in cases.items():
    mk(k, fn)
PYEOF
ocheck() {  # name, wanted exit status, message fragment
  run "$V41" oracle-check "$ORACLE" "$T/g_$1.h5" --threads 1
  [ $rc = $2 ] || fail "oracle-check g_$1: exit $rc, want $2"
  grep -q "$3" "$T/out" || fail "oracle-check g_$1: output lacks '$3'"
}
ocheck prompt_rank3 2 "no /prompt_ids \\[B,S\\]"
ocheck prompt_huge_b 2 "1 <= B <= 4096"
ocheck ids_past_int32 2 "token -1 out of range"
ocheck kv_2d 1 "golden attn_kv is not \\[B, N >= 37, d\\]"
ocheck kv_short 1 "golden attn_kv is not"
ocheck topk_nan 1 "FAIL"
ocheck topk_huge 1 "FAIL"
ocheck topk_width0 1 "FAIL"
ocheck mask_nan 1 "FAIL"
ocheck rank9 1 "FAIL"
ocheck strings 1 "FAIL"
ocheck spec_ids_short 1 "FAIL"
ocheck arr_semantics 1 "compat official"
run "$V41" oracle-check "$ORACLE" "$T/g_rank9.h5" --threads 1 --verbose
grep -q "golden dataset unusable" "$T/out" || fail "rank 9: no 'golden dataset unusable' note"
echo "test_hostile_h5: ok ($n dumps, 3 diffs each; 13 golden files)"
