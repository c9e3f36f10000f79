#!/bin/sh
# ptxas_spills.sh: the register and spill report of the CUDA kernels, from the ptxas resource
# reports the build keeps beside each object (gpu/.libs/NAME.ru, written by the .cu.lo rule of
# gpu/Local.am with nvcc --resource-usage).
#
#   ptxas_spills.sh RU_FILE...                 table: object, registers, stack frame bytes, spill
#                                              store / load bytes, kernel (demangled)
#   ptxas_spills.sh --check LIST RU_FILE...    compare the spill stores of every kernel with LIST
#
# LIST (gpu/ptxas_spills.txt) holds the kernels that spill, one a line: the spill store bytes, a
# tab, the demangled name as this table prints it; '#' lines are comments, and the line
# '# nvcc: VERSION' names the compiler the list was taken with. A kernel not in LIST must not
# spill. --check exits 0 when every kernel spills exactly what LIST says (fewer is reported too:
# the list, and the README figures taken from it, would be stale) and every LIST entry names a
# kernel of the reports; 1 otherwise, naming each difference; 77 (skip) when the reports come
# from another nvcc than LIST's (ptxas versions allocate registers differently), after printing
# the differences. NVCC (environment) is the compiler whose version is compared.
set -u
check=""
if [ "${1:-}" = "--check" ]; then
  [ $# -ge 2 ] || { echo "ptxas_spills.sh: --check needs a list file" >&2; exit 2; }
  check=$2; shift 2
  [ -r "$check" ] || { echo "ptxas_spills.sh: cannot read the spill list '$check'" >&2; exit 2; }
fi
[ $# -ge 1 ] || { echo "usage: ptxas_spills.sh [--check LIST] RU_FILE..." >&2; exit 2; }
for f in "$@"; do
  [ -r "$f" ] || { echo "ptxas_spills.sh: no ptxas report '$f' (rebuild the gpu objects)" >&2; exit 2; }
done
command -v c++filt >/dev/null 2>&1 || { echo "ptxas_spills.sh: c++filt (binutils) is needed to name the kernels" >&2; exit 2; }

# one record a function: object, registers, stack, spill stores, spill loads, mangled name
# ("Function properties for F", then "N bytes stack frame, S bytes spill stores, L bytes spill
# loads", then, for a kernel, "Used R registers, ...")
table=$(for f in "$@"; do
  o=$(basename "$f" .ru)
  awk -v o="$o" '
    /Function properties for/ { if (name != "") print o, regs, st, ss, sl, name; name = $NF; regs = "-" }
    /bytes stack frame/ { st = $1; ss = $5; sl = $9 }
    /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") regs = $(i + 1) }
    END { if (name != "") print o, regs, st, ss, sl, name }' "$f"
done | while read -r o r st ss sl m; do
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$o" "$r" "$st" "$ss" "$sl" "$(printf '%s\n' "$m" | c++filt)"
done)
[ -n "$table" ] || { echo "ptxas_spills.sh: no kernel in the reports (were they built with --resource-usage?)" >&2; exit 2; }

if [ -z "$check" ]; then
  printf '%-12s %5s %6s %7s %7s  %s\n' object regs stack spill-st spill-ld kernel
  printf '%s\n' "$table" | awk -F '\t' '{ printf "%-12s %5s %6s %7s %7s  %s\n", $1, $2, $3, $4, $5, $6 }'
  exit 0
fi

want=$(sed -n 's/^# nvcc: *//p' "$check" | head -n 1)
have=$("${NVCC:-nvcc}" --version 2>/dev/null | sed -n 's/^Cuda compilation tools, //p' | head -n 1)
diffs=$(printf '%s\n' "$table" | awk -F '\t' -v list="$check" '
  BEGIN {
    while ((getline line < list) > 0) {
      if (line ~ /^#/ || line ~ /^[ \t]*$/) continue
      t = index(line, "\t")
      n = substr(line, 1, t - 1)
      if (t == 0 || n !~ /^[0-9]+$/) { printf "%s: malformed line (want BYTES<tab>KERNEL): %s\n", list, line; bad = 1; continue }
      k = substr(line, t + 1)
      if (k in lim) { printf "%s: %s listed twice\n", list, k; bad = 1 }
      lim[k] = n + 0
    }
  }
  { seen[$6] = 1; allow = ($6 in lim) ? lim[$6] : 0
    if ($4 + 0 != allow) printf "%s: %s spills %d bytes (%s registers), the list says %d\n", $1, $6, $4, $2, allow }
  END { for (k in lim) if (!(k in seen)) printf "%s: lists %s, which no report has\n", list, k; exit bad }')
rc=$?
if [ -z "$diffs" ] && [ $rc -eq 0 ]; then
  echo "ptxas_spills.sh: every kernel spills as $check says (nvcc ${have:-unknown})"
  exit 0
fi
printf '%s\n' "$diffs"
[ $rc -eq 0 ] || exit 1   # a malformed list fails whatever the compiler
if [ -n "$want" ] && [ "$have" != "$want" ]; then
  echo "ptxas_spills.sh: the list was taken with nvcc $want, this build's is ${have:-unknown}: not compared (skip)"
  exit 77
fi
exit 1
