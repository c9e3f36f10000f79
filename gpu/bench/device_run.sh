#!/bin/bash
# device_run.sh: build the GPU parts, run the GPU tests (plus compute-sanitizer)
# and the benchmark on a machine with a GPU, in one go. Run from the repo root:
#   gpu/bench/device_run.sh [tests] [memcheck] [racecheck] [bench] [quickbench] [torch]
#                           [check] [oracle] [parity] [serve] [oracledump] [resident] [decodebench] [wq] [ab]
# The kernel library, its tests and the standalone benchmark are always built;
# check/oracle/parity/serve also build the harness and every test program
# (FULL=1 builds them up front).
# Check and cJSON may come as .deb files in deps/ (unpacked into deps/root).
# Logs and results go to $OUT (default /tmp/v41-device).
set -u
OUT=${OUT:-/tmp/v41-device}
mkdir -p "$OUT"
TOP=$PWD
R=$TOP/deps/root
J=$(nproc)
if ls deps/*.deb >/dev/null 2>&1; then
  mkdir -p "$R"
  for f in deps/*.deb; do dpkg -x "$f" "$R"; done
  for pc in "$R"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do sed -i "s|=/usr|=$R/usr|" "$pc"; done
  export PKG_CONFIG_PATH=$R/usr/lib/x86_64-linux-gnu/pkgconfig
  export LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
# Debian's check.pc requires libsubunit: without libsubunit-dev and libsubunit0 in deps/ the
# test programs are configured without Check and do not link
pkg-config --exists check 2>/dev/null || echo "device_run.sh: pkg-config finds no Check (deps/ needs check, libsubunit-dev, libsubunit0): GPU test programs will not link" >&2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if [ ! -x build-dev/gpu/bench/v41_gpu_bench ] || [ "${REBUILD:-1}" = 1 ]; then
  # the generated autotools files travel with the tree (carry); make them newer
  # than their sources so make does not try to re-run automake there
  # (the two machines' clocks differ, so set the sources' times to the past)
  if [ -f configure ]; then
    { find . -path ./deps -prune -o \( -name '*.am' -o -name configure.ac -o -name '*.m4' \) -print | xargs touch -d '2020-01-01'
      touch aclocal.m4; sleep 1; touch configure; sleep 1; touch Makefile.in config.h.in; rm -rf build-dev; } > "$OUT/build.log" 2>&1
  elif ! autoreconf -fi > "$OUT/build.log" 2>&1; then
    # the GPU machine's autotools lack libtool's m4 files (session 28): the generated files have to
    # travel with the tree
    echo "device_run.sh: autoreconf failed here ($OUT/build.log); carry the generated autotools files" \
         "instead: configure aclocal.m4 Makefile.in config.h.in build-aux m4 (and deps)" >&2
    exit 1
  fi
  mkdir -p build-dev
  (cd build-dev && { [ -f Makefile ] || ../configure --with-cuda -q; }) >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  (cd build-dev && make -j"$J" gpu/libv41gpukern.la gpu/bench/v41_gpu_bench tests/test_gpu_kernels) >> "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1; }
fi
case " $* " in *" check "*|*" oracle"*|*" parity "*|*" serve "*|*" resident "*|*" wq "*) FULL=1 ;; esac
if [ "${FULL:-0}" = 1 ]; then
  (cd build-dev && make -j"$J" && make -j"$J" check TESTS=) >> "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - t0 )) s"
# this machine's ptxas report of every kernel (registers, spills; nvcc may differ from the dev machine's)
(cd build-dev && "$(sed -n 's/^NVCC = //p' Makefile)" --version 2>/dev/null | tail -n 2; make -s ptxas-report) > "$OUT/ptxas.txt" 2>&1
# merge_steps OUT IN...: one serve-trace JSON whose steps are those of every IN (the first IN's header)
merge_steps() {
  python3 - "$@" <<'PY'
import json, sys
a = json.load(open(sys.argv[2]))
for f in sys.argv[3:]: a["steps"] += json.load(open(f))["steps"]
json.dump(a, open(sys.argv[1], "w"))
PY
}
cd build-dev
for what in "$@"; do
  t0=$(date +%s)
  case $what in
  tests) ./tests/test_gpu_kernels > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "^[0-9]+%|Fail|Error|error" "$OUT/tests.log" | head -40 ;;
  memcheck) CK_TIMEOUT_MULTIPLIER=20 compute-sanitizer --tool memcheck --target-processes all --print-limit 20 \
              ./tests/test_gpu_kernels > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|^[0-9]+%" "$OUT/memcheck.log" | sort | uniq -c | head ;;
  racecheck) : > "$OUT/racecheck.log"
     for tc in ${RACE_CASES:-attention indexer small moe}; do
       CK_TIMEOUT_MULTIPLIER=40 CK_RUN_CASE=$tc compute-sanitizer --tool racecheck --target-processes all \
         --print-limit 20 ./tests/test_gpu_kernels >> "$OUT/racecheck.log" 2>&1; echo "racecheck $tc rc=$?"
     done
     grep -E "RACECHECK SUMMARY|^[0-9]+%" "$OUT/racecheck.log" | sort | uniq -c | head ;;
  bench) ./gpu/bench/v41_gpu_bench --json "$OUT/profile.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; echo "bench rc=$?" ;;
  quickbench) ./gpu/bench/v41_gpu_bench --quick --json "$OUT/profile.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; echo "bench rc=$?" ;;
  decodebench) ./gpu/bench/v41_gpu_bench --only decode --json "$OUT/profile-decode.json" > "$OUT/bench-decode.log" 2>&1
     echo "decode bench rc=$?"; grep -E "^decode|ceilings" "$OUT/bench-decode.log" ;;
  benchmemcheck) compute-sanitizer --tool memcheck --print-limit 10 ./gpu/bench/v41_gpu_bench --quick --reps 1 \
         --only ${MC_ONLY:-attn} > "$OUT/benchmemcheck.log" 2>&1; echo "benchmemcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|at .*0x|by thread" "$OUT/benchmemcheck.log" | head -12 ;;
  ncu) # NCU_BENCH: the benchmark's options (default --quick; --quick runs the grouped wq calls at
     # 64 tokens only, so profiling them at 4096 takes e.g. NCU_BENCH="--match expert_w13_fp4_grouped_T4096 --reps 1")
     ncu --clock-control none -k regex:${NCU_KERNEL:-g_sparse_attn_kernel} -c 1 ${NCU_ARGS:-} --section SpeedOfLight --section WarpStateStats \
         --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
         ./gpu/bench/v41_gpu_bench ${NCU_BENCH:---quick} --only ${NCU_ONLY:-attn} > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?" ;;
  check) # the whole suite on the GPU machine: the GPU suites run instead of skipping
     make -j"$J" check > "$OUT/check.log" 2>&1; echo "check rc=$?"
     grep -E "^(PASS|FAIL|SKIP|ERROR|XFAIL|XPASS):|^# " "$OUT/check.log" | head -60
     for f in $(grep -lE "^:test-result: (FAIL|ERROR)" tests/*.trs 2>/dev/null); do echo "== ${f%.trs}.log"; tail -25 "${f%.trs}.log"; done > "$OUT/check-failures.log" ;;
  oracle) O=$TOP/tests/fixtures/v41-tiny
     { ./harness/v41 oracle-check "$O" "$O/golden_fixed.h5" --engine gpu; echo "rc=$?"
       ./harness/v41 oracle-check "$O" "$O/golden.h5" --compat official --engine gpu; echo "rc=$?"
       ./harness/v41 oracle-check "$O" "$O/golden_fixed.h5" --engine ref; echo "rc=$?"; } > "$OUT/oracle-gpu.log" 2>&1
     grep -E "^oracle-check|failed|rc=|PASS|FAIL" "$OUT/oracle-gpu.log" | grep -v "^  " | head -20 ;;
  parity) { V41_GPU_VERBOSE=1 ./harness/v41 parity --a ref --b gpu; echo "rc=$?"
            ./harness/v41 parity "$TOP/tests/fixtures/v41-tiny" --a ref --b gpu --no-replay; echo "rc=$?"; } > "$OUT/parity.log" 2>&1
     grep -E "verdict|rc=|first divergent|flip" "$OUT/parity.log" | head -30 ;;
  serve) # issue 7: serve-trace through the GPU engine on calibration and validation batch mixes,
     # then the simulator's predicted vs measured step latency with the profile of this session
     # (profile.json from a bench/quickbench step earlier in the same command line).
     P=""; [ -f "$OUT/profile.json" ] && P="--profile $OUT/profile.json"
     V="--engine gpu --block 8 --max-len 64"
     ./harness/v41 serve-trace $V --synth "n=24,rate=200,in=uniform:8:48,out=uniform:2:12,groups=4,prefix=16,block=8,seed=1" --json "$OUT/serve-cal.json" > "$OUT/serve.log" 2>&1
     ./harness/v41 serve-trace $V --synth "n=24,rate=400,in=uniform:8:48,out=uniform:2:12,groups=2,prefix=24,block=8,seed=2" --dspark --json "$OUT/serve-cal2.json" >> "$OUT/serve.log" 2>&1
     # a decode-heavy mix (short prompts, long outputs: small steps) so the calibration spans both ends
     ./harness/v41 serve-trace $V --synth "n=24,rate=300,in=uniform:4:16,out=uniform:8:40,groups=2,prefix=8,block=8,seed=3" --json "$OUT/serve-cal3.json" >> "$OUT/serve.log" 2>&1
     # short prompts arriving one by one: small mixed steps (a prefill chunk of a few rows beside
     # decodes), which the GPU engine runs through its host orchestration, unlike pure decode batches
     ./harness/v41 serve-trace $V --synth "n=24,rate=100,in=uniform:2:10,out=uniform:4:20,groups=2,prefix=0,block=8,seed=4" --json "$OUT/serve-cal4.json" >> "$OUT/serve.log" 2>&1
     ./harness/v41 serve-trace $V --trace "$TOP/traces/mooncake_conversation_head200.jsonl" --limit 80 --json "$OUT/serve-val.json" >> "$OUT/serve.log" 2>&1
     ./harness/v41 serve-trace $V --synth "n=16,rate=1000,in=uniform:16:52,out=fixed:8,groups=1,prefix=32,block=8,seed=7" --dspark --json "$OUT/serve-val2.json" >> "$OUT/serve.log" 2>&1
     ./harness/v41 serve-trace $V --trace "$TOP/traces/azure_conv_head200.csv" --limit 40 --json "$OUT/serve-val3.json" >> "$OUT/serve.log" 2>&1
     echo "serve-trace rc=$?"; grep -E "^serve-trace:" "$OUT/serve.log"
     # one calibration file from both calibration runs (the fit reads one file)
     merge_steps "$OUT/serve-calall.json" "$OUT/serve-cal.json" "$OUT/serve-cal2.json" "$OUT/serve-cal3.json" "$OUT/serve-cal4.json"
     # and the pooled validation: every validation step of the three runs in one file
     merge_steps "$OUT/serve-valall.json" "$OUT/serve-val.json" "$OUT/serve-val2.json" "$OUT/serve-val3.json"
     for v in serve-val serve-val2 serve-val3 serve-valall; do
       ./harness/v41 sim --validate "$OUT/$v.json" $P | head -3
       ./harness/v41 sim --validate "$OUT/$v.json" $P --fit-from "$OUT/serve-calall.json" --json > "$OUT/validate-$v.json"
       ./harness/v41 sim --validate "$OUT/$v.json" $P --fit-from "$OUT/serve-calall.json" | head -3
     done 2>&1 | tee "$OUT/validate.log" ;;
  oracledump) O=$TOP/tests/fixtures/v41-tiny   # prefill-step dumps of both engines (for v41 diff)
     ./harness/v41 oracle-check "$O" "$O/golden_fixed.h5" --engine gpu --steps 0 --dump "$OUT/oracle-gpu.h5" > "$OUT/oracledump.log" 2>&1
     ./harness/v41 oracle-check "$O" "$O/golden_fixed.h5" --engine ref --steps 0 --dump "$OUT/oracle-ref.h5" >> "$OUT/oracledump.log" 2>&1
     grep -E "PASS:|FAIL:" "$OUT/oracledump.log" ;;
  resident) # the device-resident decode step: its kernel suites and the engine suite, memcheck on
     # each, then the same decode-heavy serving trace through the hybrid (0) and resident (1) paths
     for t in test_gpu_dev_a test_gpu_dev_b test_gpu_resident; do
       ./tests/$t > "$OUT/$t.log" 2>&1; echo "$t rc=$?"; grep -E "^[0-9]+%|Fail|Error|error|near tie" "$OUT/$t.log" | head -20
     done
     for t in test_gpu_dev_a test_gpu_dev_b test_gpu_resident; do
       CK_TIMEOUT_MULTIPLIER=20 compute-sanitizer --tool memcheck --target-processes all --print-limit 10 ./tests/$t \
         > "$OUT/memcheck-$t.log" 2>&1; echo "memcheck $t rc=$?"; grep -E "ERROR SUMMARY" "$OUT/memcheck-$t.log" | sort | uniq -c
     done
     S="n=16,rate=1000,in=uniform:4:12,out=fixed:40,groups=1,prefix=0,block=8,seed=5"
     for r in 0 1; do
       V41_GPU_VERBOSE=1 V41_GPU_RESIDENT=$r ./harness/v41 serve-trace --engine gpu --block 8 --max-len 64 --synth "$S" \
         --json "$OUT/resident-$r.json" > "$OUT/resident-$r.log" 2>&1; echo "serve-trace resident=$r rc=$?"
       grep -E "^serve-trace:|device path|gpu engine:" "$OUT/resident-$r.log"
     done
     python3 - "$OUT/resident-0.json" "$OUT/resident-1.json" <<'PY' | tee "$OUT/resident-steps.txt"
import json, sys, statistics as st
for f, name in zip(sys.argv[1:], ("hybrid", "resident")):
    d = [s for s in json.load(open(f))["steps"] if all(i["kind"] == "decode" for i in s["items"])]
    by = {}
    for s in d: by.setdefault(s["rows"], []).append(s["seconds"] * 1e3)
    print(name, "decode-only steps:", len(d), "median ms by batch rows:",
          {k: round(st.median(v), 3) for k, v in sorted(by.items())})
PY
     ;;
  wq) # weights in their storage formats (gpu/k_wq.cu): the kernel suite, memcheck + racecheck on
     # it, and the benchmark section (fp8/fp4 GEMMs vs cuBLAS bf16, the MoE with fp4 experts)
     ./tests/test_gpu_wq > "$OUT/test_gpu_wq.log" 2>&1; echo "test_gpu_wq rc=$?"; grep -E "^[0-9]+%|Fail|Error|error" "$OUT/test_gpu_wq.log" | head -20
     for tool in memcheck racecheck; do   # racecheck on one test case (CK_RUN_CASE; default the grouped one)
       C=""; [ $tool = racecheck ] && C=${WQ_RACE_CASE:-grouped}
       env ${C:+CK_RUN_CASE=$C} CK_TIMEOUT_MULTIPLIER=40 compute-sanitizer --tool $tool --target-processes all --print-limit 10 ./tests/test_gpu_wq \
         > "$OUT/$tool-test_gpu_wq.log" 2>&1; echo "$tool test_gpu_wq rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool-test_gpu_wq.log" | sort | uniq -c
     done
     ./gpu/bench/v41_gpu_bench --only wq --json "$OUT/profile-wq.json" > "$OUT/bench-wq.log" 2>&1
     echo "wq bench rc=$?"; grep -E "^(wq|moe|gemm)|ceilings" "$OUT/bench-wq.log" | cut -c1-150 ;;
  ab) # A/B in one session: the current tree (A) against the same tree with the files under AB_OLD
     # (default ab-old/, laid out as the tree: e.g. ab-old/gpu/k_wq.cu from `git show REV:gpu/k_wq.cu`;
     # an untracked folder travels with the working tree), built in /tmp/v41-ab; then AB_PASSES
     # (default 3) alternating passes A, B, A, B, ... of v41_gpu_bench with AB_BENCH (default
     # "--only moe,wq --match moe_fp4 --reps 7"); each pass's JSON and log in $OUT/ab/, the table of
     # gpu/bench/ab_summary.py in $OUT/ab.txt and $OUT/ab.json
     D=${AB_OLD:-$TOP/ab-old}; W=/tmp/v41-ab; mkdir -p "$OUT/ab"
     files=$([ -d "$D" ] && cd "$D" && find . -type f)
     if [ -z "$files" ]; then echo "ab: no files under $D to build the B side from"; continue; fi
     miss=$(printf '%s\n' "$files" | while read -r f; do [ -f "$TOP/$f" ] || echo "$f"; done)
     if [ -n "$miss" ]; then echo "ab: not files of the tree: $miss"; continue; fi
     rm -rf "$W" && mkdir -p "$W"
     (cd "$TOP" && tar --exclude=./build-dev --exclude=./deps/root --exclude=./.git --exclude="./${D#$TOP/}" -cf - .) | (cd "$W" && tar xf -)
     printf '%s\n' "$files" | while read -r f; do cp "$D/$f" "$W/$f"; echo "ab: B side takes $f"; done
     mkdir -p "$W/build-ab"
     if ! (cd "$W/build-ab" && ../configure --with-cuda -q && make -j"$J" gpu/bench/v41_gpu_bench) > "$OUT/ab/build.log" 2>&1; then
       echo "ab: the B build failed"; grep -E "error|Error" "$OUT/ab/build.log" | head -20; continue
     fi
     for p in $(seq 1 "${AB_PASSES:-3}"); do
       for side in a b; do
         B=./gpu/bench/v41_gpu_bench; [ $side = b ] && B=$W/build-ab/gpu/bench/v41_gpu_bench
         $B ${AB_BENCH:---only moe,wq --match moe_fp4 --reps 7} --json "$OUT/ab/$side$p.json" > "$OUT/ab/$side$p.log" 2>&1
         echo "ab pass $p $side rc=$?"
       done
     done
     if ls "$OUT"/ab/a*.json >/dev/null 2>&1 && ls "$OUT"/ab/b*.json >/dev/null 2>&1; then
       python3 "$TOP/gpu/bench/ab_summary.py" --json "$OUT/ab.json" --a "$OUT"/ab/a*.json --b "$OUT"/ab/b*.json | tee "$OUT/ab.txt"
     else echo "ab: a side has no profile (see $OUT/ab/*.log)"; fi ;;
  torch) (cd "$TOP" && PYTHONUNBUFFERED=1 python3 gpu/bench/torch_layer.py --json "$OUT/torch.json") > "$OUT/torch.log" 2>&1; echo "torch rc=$?"; tail -15 "$OUT/torch.log" ;;
  esac
  echo "$what: $(( $(date +%s) - t0 )) s"
done
# Every suite's and sanitizer's summary line once more, last, and in $OUT/summary.txt: the caller may
# see only the end of the output and get back only a few of the files (session 32 lost its racecheck
# result that way, behind the wq benchmark's table)
grep -H -E "ERROR SUMMARY|RACECHECK SUMMARY|^[0-9]+%: Checks" "$OUT"/*.log "$OUT"/ab/*.log 2>/dev/null \
  | sed "s|^$OUT/||" | sort | uniq -c | tee "$OUT/summary.txt"
