#!/bin/sh
# oracle-check of the ref engine against both golden files of the oracle
# (../shared/oracle/v41-tiny): golden_fixed.h5 in the default (fixed) index-key
# semantics and golden.h5 with --compat official. Both must exit 0. Skips (77)
# when the oracle directory is absent.
dir=${V41_ORACLE_DIR:-../shared/oracle/v41-tiny}
v41=${V41_BUILDDIR:-.}/harness/v41
if [ ! -f "$dir/golden_fixed.h5" ] || [ ! -f "$dir/golden.h5" ]; then
  echo "oracle not found in $dir: skipped"; exit 77
fi
set -e
echo "== golden_fixed.h5 (fixed)"
"$v41" oracle-check "$dir" "$dir/golden_fixed.h5" | tail -n 1
echo "== golden.h5 (--compat official)"
"$v41" oracle-check "$dir" "$dir/golden.h5" --compat official | tail -n 1
# the check discriminates: the wrong semantics must fail (exit 1); the files first differ at step02
rc=0; "$v41" oracle-check "$dir" "$dir/golden.h5" --compat fixed --steps 2 >/dev/null || rc=$?
[ "$rc" -eq 1 ] || { echo "golden.h5 with --compat fixed should differ (exit $rc)"; exit 1; }
