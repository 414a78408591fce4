#!/usr/bin/env bash
# scripts/gpu-run.sh (what `scripts/gpu-check.sh run` runs on a GPU machine) tells the truth, driven with a
# fake nvidia-smi on PATH and a pack of fake test binaries: where nvidia-smi lists a GPU a skipped gpu
# test (exit 77, or a gtest case skipped) fails the run, where it lists none skips are fine; a failing
# test fails the run and is rerun, its failed case only, with PTK_CUDA_SYNC_OPS=1; a hanging test is
# stopped at its time limit; a test reading stdin takes no test list with it; tests the budget leaves no
# time for fail as not run; the run ends with
# "N passed, N failed, N skipped" and leaves at most eight log files in $OUT, tests.log under 16 MiB; the
# bench ends a ptk-train run that hangs at its --run-timeout. summary.txt holds every test's verdict and
# seconds (a hang a TIMEOUT with its case), and is there, naming the test running and the counts so far,
# while a test hangs and after a TERM or a KILL of the run; a library older than ptk needs (a stand-in
# NCCL 2.10.3) fails the tests that load it without running them, by their binary or through
# ptk-train's CUDA module.
# Usage: gpu_run_test.sh SOURCE_DIR
set -uo pipefail
SRC=$1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
check() {  # check WHAT CONDITION...
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
# wait_for SECONDS CONDITION...: polls CONDITION every 0.1 s until it holds (0) or SECONDS pass (1). Each
# wait below is for a state, with a deadline that start-up on a loaded machine cannot miss, never a sleep.
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.1
  done
}

# nvidia-smi: FAKE_GPUS=N lists N H100s, else fails as it does without a driver.
mkdir -p "$T/fakebin"
cat > "$T/fakebin/nvidia-smi" <<'EOF'
#!/bin/sh
[ "${FAKE_GPUS:-0}" -ge 1 ] || { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9; }
case "$*" in
  -L) i=0; while [ $i -lt "$FAKE_GPUS" ]; do
        echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-00000000000$i)"; i=$((i + 1)); done ;;
  *) echo "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB" ;;
esac
EOF
chmod +x "$T/fakebin/nvidia-smi"

# make_pack DIR TEST...: a pack as scripts/gpu-pack.sh makes it, whose tests are the fake ones named
# (pass, skip77, skipcase, fail, hang): shell scripts printing what a gtest binary prints.
make_pack() {
  local pack=$1
  shift
  local p=$T/stage/ptk-gpu
  rm -rf "$T/stage"
  mkdir -p "$p/bin" "$p/tests" "$p/lib" "$pack"
  printf '#!/bin/sh\necho "ptk-train (ptk 0.1.0)"\n' > "$p/bin/ptk-train"
  printf 'ptk-train (ptk 0.1.0)\nbackends: CPU; CUDA 13.0 for sm_90 (cuBLASLt 13.1.0, cuDNN 9.19.0); NCCL 2.28.9\n' > "$p/build-versions.txt"
  local json="[" sep=""
  for t in "$@"; do
    case $t in
      pass) body='echo "[ RUN      ] A.B"; echo "[       OK ] A.B (1 ms)"; exit 0' ;;
      skip77) body='echo "SKIP: the NVIDIA driver (CUDA 13.0) reports no device (no CUDA-capable device is detected)"; exit 77' ;;
      skipcase) body='echo "[ RUN      ] A.C"; echo "[  SKIPPED ] A.C (0 ms)"; echo "[  SKIPPED ] 1 test, listed below:"; echo "[  SKIPPED ] A.C"; exit 0' ;;
      fail) body='echo "run: PTK_CUDA_SYNC_OPS=${PTK_CUDA_SYNC_OPS:-unset} $*" >> "$FAKE_RECORD"
        echo "[ RUN      ] Ops.Good"; echo "[       OK ] Ops.Good (1 ms)"
        echo "[ RUN      ] Ops.Bad"; echo "x.cu:12: Failure"; echo "[  FAILED  ] Ops.Bad (3 ms)"
        echo "[  FAILED  ] 1 test, listed below:"; echo "[  FAILED  ] Ops.Bad"; exit 1' ;;
      hang) body='echo $$ > "$FAKE_RECORD.hang"; echo "[ RUN      ] Slow.Forever"; exec sleep 600' ;;
      twogpu) body='echo "[ RUN      ] A.D"; echo "x.cpp:9: Skipped"; echo "needs two GPUs; 1 visible"; echo "[  SKIPPED ] A.D (0 ms)"
        echo "[ RUN      ] A.E"; echo "[       OK ] A.E (1 ms)"; echo "[  SKIPPED ] 1 test, listed below:"; echo "[  SKIPPED ] A.D"; exit 0' ;;
      threegpu) body='echo "[ RUN      ] A.F"; echo "x.cpp:9: Skipped"; echo "needs three GPUs; 2 visible"; echo "[  SKIPPED ] A.F (0 ms)"
        echo "[  SKIPPED ] 1 test, listed below:"; echo "[  SKIPPED ] A.F"; exit 0' ;;
      cuda_toolchain|ops_cuda) body='echo "order: $0" >> "$FAKE_RECORD"; exit 0' ;;
      passrec) body='echo "run: passrec" >> "$FAKE_RECORD"; exit 0' ;;
      stdin) body='cat > /dev/null; echo "[ RUN      ] A.In"; echo "[       OK ] A.In (1 ms)"; exit 0' ;;
      flood) body='echo "[ RUN      ] A.Flood"; head -c 18000000 /dev/zero | tr "\\0" x; echo; echo "[       OK ] A.Flood (1 ms)"; exit 0' ;;
      cuda_train_cli) body='echo "cli: $*" >> "$FAKE_RECORD"; exit 0' ;;
    esac
    printf '#!/bin/sh\n%s\n' "$body" > "$p/tests/${t}_test"
    chmod +x "$p/tests/${t}_test"
    json+="$sep{\"name\": \"${t}_test\", \"exe\": \"tests/${t}_test\", \"args\": []}"
    sep=", "
  done
  echo "$json]" > "$p/tests/gpu-tests.json"
  chmod +x "$p/bin/ptk-train"
  tar -C "$T/stage" -cJf "$pack/ptk-gpu.tar.xz" ptk-gpu
}
# run NAME [VAR=VALUE...] -- ARGS...: gpu-run.sh with the fake nvidia-smi; output in $T/NAME.out, rc in $T/NAME.rc.
run() {
  local name=$1 vars=()
  shift
  while [ "$1" != -- ]; do vars+=("$1"); shift; done
  shift
  env PATH="$T/fakebin:$PATH" FAKE_RECORD="$T/record" "${vars[@]}" bash "$SRC/scripts/gpu-run.sh" --no-bench "$@" \
    > "$T/$name.out" 2>&1
  echo $? > "$T/$name.rc"
}
last() { tail -1 "$T/$1.out"; }
rc() { cat "$T/$1.rc"; }
has() { grep -qF -- "$2" "$T/$1.out"; }

make_pack "$T/skips" pass skip77 skipcase
run gpu FAKE_GPUS=1 OUT="$T/out-gpu" -- --pack "$T/skips"
check "a GPU listed and tests skipped: the run fails" [ "$(rc gpu)" = 1 ]
check "a GPU listed: the counts are the last line" [ "$(last gpu)" = "1 passed, 0 failed, 2 skipped" ]
check "a GPU listed: the skips are named as the failure" has gpu "nvidia-smi lists a GPU and 2 gpu test(s) skipped"
check "a GPU listed: the versions come first" [ "$(sed -n 1p "$T/gpu.out")" = "== versions (profile quick, budget 540s)" ]
check "a GPU listed: its name and driver are printed" has gpu "GPU: NVIDIA H100 80GB HBM3 (81559 MiB), driver 580.159.04"
check "a GPU listed: the build's header versions are printed" has gpu "cuDNN 9.19.0"
check "a gtest case skipped inside a passing binary is a skip" has gpu "SKIP skipcase_test (1 case(s) skipped)"
check "the logs in OUT are at most eight files" [ "$(find "$T/out-gpu" -type f | wc -l)" -le 8 ]
for f in versions.txt tests.log summary.txt gpu-check.log; do
  check "OUT has $f" [ -s "$T/out-gpu/$f" ]
done
check "summary.txt ends with the counts" [ "$(tail -1 "$T/out-gpu/summary.txt")" = "1 passed, 0 failed, 2 skipped" ]

run nogpu -- --pack "$T/skips"
check "no GPU listed: skips are fine" [ "$(rc nogpu)" = 0 ]
check "no GPU listed: the counts are the last line" [ "$(last nogpu)" = "1 passed, 0 failed, 2 skipped" ]
check "no GPU listed: said so" has nogpu "GPU: none listed by nvidia-smi"

make_pack "$T/passes" pass pass
run allpass FAKE_GPUS=1 -- --pack "$T/passes"
check "a GPU listed and every test passed: the run passes" [ "$(rc allpass)" = 0 ]
check "every test passed: the counts" [ "$(last allpass)" = "2 passed, 0 failed, 0 skipped" ]

make_pack "$T/fails" pass fail
: > "$T/record"
run failing FAKE_GPUS=1 OUT="$T/out-fail" -- --pack "$T/fails"
check "a failing test fails the run" [ "$(rc failing)" = 1 ]
check "a failing test: the counts" [ "$(last failing)" = "1 passed, 1 failed, 0 skipped" ]
check "a failing test is named with its failed case" has failing "[  FAILED  ] Ops.Bad"
check "the failed case is rerun alone with PTK_CUDA_SYNC_OPS=1" \
  grep -qx "run: PTK_CUDA_SYNC_OPS=1 --gtest_filter=Ops.Bad" "$T/record"
check "the rerun's output is in tests.log" grep -q "rerun with PTK_CUDA_SYNC_OPS=1 --gtest_filter=Ops.Bad" "$T/out-fail/tests.log"

make_pack "$T/hangs" hang pass
run hanging FAKE_GPUS=1 PTK_GPU_TEST_TIMEOUT=2 -- --pack "$T/hangs"
check "a hanging test is stopped at its limit and fails" has hanging "FAIL hang_test (stopped after 2s"
check "a hanging test: the tests after it still run" [ "$(last hanging)" = "1 passed, 1 failed, 0 skipped" ]
check "the hanging case is the one rerun" has hanging "RERUN hang_test --gtest_filter=Slow.Forever with PTK_CUDA_SYNC_OPS=1: exit 124"

# A failure's reruns wait until every test has run: they never take the time of the tests after it.
make_pack "$T/rerunlast" fail passrec
: > "$T/record"
run rerunlast FAKE_GPUS=1 -- --pack "$T/rerunlast"
printf 'run: PTK_CUDA_SYNC_OPS=unset \nrun: passrec\nrun: PTK_CUDA_SYNC_OPS=1 --gtest_filter=Ops.Bad\n' > "$T/want"
check "a failing test's rerun comes after the tests that follow it" cmp -s "$T/record" "$T/want"
check "a failing test's rerun: the counts" [ "$(last rerunlast)" = "1 passed, 1 failed, 0 skipped" ]

# A test (or a program it starts: popen's children share its stdin) that reads its standard input
# reads no test list: every test after it still runs.
make_pack "$T/stdin" stdin passrec
: > "$T/record"
run stdin FAKE_GPUS=1 -- --pack "$T/stdin"
check "a test reading stdin: the tests after it still run" grep -qx "run: passrec" "$T/record"
check "a test reading stdin: the counts" [ "$(last stdin)" = "2 passed, 0 failed, 0 skipped" ]

make_pack "$T/cli" cuda_train_cli
: > "$T/record"
run quick FAKE_GPUS=1 -- --pack "$T/cli"
run full FAKE_GPUS=1 -- --pack "$T/cli" --full
printf 'cli: --gtest_filter=-%s\ncli: \n' \
  "CudaTrainCli.DeterministicModeGivesIdenticalLossLines:CudaTrainCli.CheckpointsCrossBackends:CudaTrainCli.InterleavedStagesShareOneGpuOverGlooAndCrossBackends:CudaTrainCli.MixtureOfExpertsCrossesBackendsAndRepeatsBitForBit" \
  > "$T/want"
check "quick leaves the slowest CLI cases out, --full runs them" cmp -s "$T/record" "$T/want"
check "--full says so first" [ "$(sed -n 1p "$T/full.out")" = "== versions (profile full, budget 570s)" ]

make_pack "$T/twogpu" twogpu skipcase
run onegpu FAKE_GPUS=1 -- --pack "$T/twogpu"
check "one GPU listed: a case that needs two GPUs is no failure" grep -qE "^PASS twogpu_test \([0-9]+s; 1 case\(s\) need more GPUs, 1 listed\)" "$T/onegpu.out"
check "one GPU listed: the summary names it as not runnable here" has onegpu "NOTE twogpu_test: 1 case(s) need more GPUs"
check "one GPU listed: any other skip still fails" [ "$(rc onegpu)" = 1 ]
check "one GPU listed: the counts" [ "$(last onegpu)" = "1 passed, 0 failed, 1 skipped" ]
make_pack "$T/twogpu-only" twogpu pass
run onegpu2 FAKE_GPUS=1 -- --pack "$T/twogpu-only"
check "one GPU listed, only two-GPU cases skipped: the run passes" [ "$(rc onegpu2)" = 0 ]
run twogpus FAKE_GPUS=2 -- --pack "$T/twogpu-only"
check "two GPUs listed: a case that still skips for two GPUs fails the run" [ "$(rc twogpus)" = 1 ]
# A case that needs three GPUs (cuda_train_cli_test's P = 3 over NCCL) is no failure where fewer are
# listed, and fails where three are.
make_pack "$T/threegpu" threegpu pass
run twoforthree FAKE_GPUS=2 -- --pack "$T/threegpu"
check "two GPUs listed: a case that needs three is no failure" [ "$(rc twoforthree)" = 0 ]
check "two GPUs listed: a case that needs three is named" has twoforthree "NOTE threegpu_test: 1 case(s) need more GPUs"
run threeforthree FAKE_GPUS=3 -- --pack "$T/threegpu"
check "three GPUs listed: a case that still skips for three GPUs fails the run" [ "$(rc threeforthree)" = 1 ]

make_pack "$T/order" cuda_train_cli pass ops_cuda cuda_toolchain
: > "$T/record"
run order FAKE_GPUS=1 -- --pack "$T/order"
check "the toolchain runs first, the ops next, ptk-train end to end last" \
  [ "$(grep -o '[a-z_]*_test' "$T/record" | paste -sd' ')" = "cuda_toolchain_test ops_cuda_test" ] 
check "ptk-train end to end runs after the unknown tests" \
  bash -c "sed '/^== summary/q' '$T/order.out' | grep -E '^(PASS|SKIP|FAIL) ' | awk '{print \$2}' | paste -sd' ' | grep -qx 'cuda_toolchain_test ops_cuda_test cuda_train_cli_test pass_test'"

# A test that floods its output: tests.log stays under 16 MiB (a remote run brings back no larger file),
# its beginning and end kept.
make_pack "$T/flood" flood pass
run flood FAKE_GPUS=1 OUT="$T/out-flood" -- --pack "$T/flood"
check "a flooded tests.log is cut under 16 MiB" [ "$(stat -c %s "$T/out-flood/tests.log")" -lt $((16 << 20)) ]
check "a flooded tests.log keeps its beginning" grep -q "==== flood_test" "$T/out-flood/tests.log"
check "a flooded tests.log keeps its end" grep -q "==== pass_test" "$T/out-flood/tests.log"
check "a flooded tests.log says what it left out" grep -q "bytes of tests.log left out here" "$T/out-flood/tests.log"
check "a flooded tests.log: the verdicts stand" [ "$(last flood)" = "2 passed, 0 failed, 0 skipped" ]

# The bench gives each ptk-train run --run-timeout seconds (gpu-run: a third of its time box): one that
# hangs is a failed row, and the bench goes on.
printf '#!/bin/sh\necho "starting"\nexec sleep 600\n' > "$T/fakebin/ptk-train-hangs"
chmod +x "$T/fakebin/ptk-train-hangs"
start=$(date +%s)
python3 "$SRC/bench/bench_trainer_gpu.py" --bin "$T/fakebin/ptk-train-hangs" --shapes 124m --no-torch --iters 15 \
  --run-timeout 2 > "$T/bench.out" 2>&1
echo $? > "$T/bench.rc"
check "a hanging ptk-train in the bench fails its row within --run-timeout" \
  grep -q '"error": "ptk-train did not finish within 2.0 s' "$T/bench.out"
check "a hanging ptk-train: the bench fails" [ "$(rc bench)" != 0 ]
check "a hanging ptk-train: the bench ends soon after" [ $(($(date +%s) - start)) -lt 30 ]
check "gpu-run passes the bench its --run-timeout" grep -q 'bargs+=(--run-timeout' "$SRC/scripts/gpu-run.sh"
# ptk-train's row comes out as soon as it ran, whatever PyTorch's run does after it (here: no torch, or
# no GPU for it).
printf '#!/bin/sh\nfor i in 1 2 3 4; do echo " iteration $i | elapsed time per iteration (ms): 100.0 | lm loss: 5.0E+00 |"; done\n' \
  > "$T/fakebin/ptk-train-logs"
chmod +x "$T/fakebin/ptk-train-logs"
python3 "$SRC/bench/bench_trainer_gpu.py" --bin "$T/fakebin/ptk-train-logs" --shapes 124m --no-compile --iters 15 \
  --run-timeout 60 > "$T/bench2.out" 2>&1
check "the bench prints ptk-train's row first" \
  bash -c "head -1 '$T/bench2.out' | grep -q '\"engine\": \"ptk\", \"ms_step\": 100.0'"
check "the bench ends with its summary line" grep -q '^{"summary": ' "$T/bench2.out"

run spent FAKE_GPUS=1 -- --pack "$T/passes" --budget 5
check "tests the budget leaves no time for fail as not run" has spent "TIME pass_test: not run"
check "a spent budget fails the run" [ "$(rc spent)" = 1 ]
check "a spent budget: the counts" [ "$(last spent)" = "0 passed, 2 failed, 0 skipped" ]

# Every test's verdict and duration in summary.txt, a hang's as TIMEOUT with the case it was in; each
# test within its own time limit, so the tests after a hang still run.
make_pack "$T/verdicts" hang pass fail
: > "$T/record"
run verdicts FAKE_GPUS=1 PTK_GPU_TEST_TIMEOUT=2 OUT="$T/out-verdicts" -- --pack "$T/verdicts" --budget 60
check "summary.txt: a hang is a TIMEOUT at its limit, naming its case" \
  grep -qE '^TIMEOUT hang_test \([0-9]+s, stopped after 2s\): Slow.Forever$' "$T/out-verdicts/summary.txt"
check "summary.txt: a pass with its seconds" grep -qE '^PASS pass_test \([0-9]+s\)$' "$T/out-verdicts/summary.txt"
check "summary.txt: a failure with its exit status and failed case" \
  grep -qE '^FAIL fail_test \([0-9]+s, exit 1\): Ops.Bad$' "$T/out-verdicts/summary.txt"
check "summary.txt: the counts last" [ "$(tail -1 "$T/out-verdicts/summary.txt")" = "1 passed, 2 failed, 0 skipped" ]
check "summary.txt: the run's state first" grep -q '^profile quick, [0-9]*s of 60s; GPU: GPU 0: NVIDIA H100 80GB HBM3; done$' \
  "$T/out-verdicts/summary.txt"

# A run stopped mid-test (the device call's limit, a signal): summary.txt, written before each test,
# names the one running and holds the verdicts so far; TERM also ends the test and writes it whole.
# watch NAME SIGNAL: gpu-run.sh in its own session over [pass, hang], SIGNAL sent once the summary names
# the hanging test as running.
watch() {
  rm -rf "$T/out-$1" "$T/record.hang"
  setsid env PATH="$T/fakebin:$PATH" FAKE_RECORD="$T/record" FAKE_GPUS=1 PTK_GPU_TEST_TIMEOUT=120 OUT="$T/out-$1" \
    bash "$SRC/scripts/gpu-run.sh" --no-bench --pack "$T/watch" > "$T/$1.out" 2>&1 &
  local pid=$!
  wait_for 120 grep -qs '^RUNNING hang_test' "$T/out-$1/summary.txt"
  check "$1: while a test hangs, summary.txt names it as running" grep -q '^RUNNING hang_test (time box 120s)' "$T/out-$1/summary.txt"
  check "$1: while a test hangs, summary.txt holds the verdicts so far" grep -q '^PASS pass_test' "$T/out-$1/summary.txt"
  kill -"$2" -- -"$pid"
  wait "$pid"
  echo $? > "$T/$1.rc"
}
make_pack "$T/watch" pass hang
watch term TERM
check "TERM: the run fails" [ "$(rc term)" = 1 ]
# Ended, not at once: gpu-run passes the TERM on through timeout and exits without waiting for the test.
check "TERM: the hanging test is ended" wait_for 60 bash -c "! kill -0 \$(cat '$T/record.hang') 2>/dev/null"
check "TERM: summary.txt names the test it interrupted" grep -qE '^INTERRUPTED hang_test \(time box 120s\) after [0-9]+s \(SIGTERM\)$' \
  "$T/out-term/summary.txt"
check "TERM: summary.txt ends with the counts" [ "$(tail -1 "$T/out-term/summary.txt")" = "1 passed, 1 failed, 0 skipped" ]
check "TERM: no partial summary left" [ ! -e "$T/out-term/summary.txt.part" ]
watch kill KILL
kill "$(cat "$T/record.hang")" 2>/dev/null  # the orphaned test (its timeout ends with it)
check "KILL: summary.txt still names the test that was running" grep -q '^RUNNING hang_test' "$T/out-kill/summary.txt"
check "KILL: summary.txt still ends with the counts so far" [ "$(tail -1 "$T/out-kill/summary.txt")" = "1 passed, 0 failed, 0 skipped" ]

# The bench runs in the background too: a TERM while it hangs ends it and writes the summary, the
# bench said interrupted (a python3 that hangs on the bench and is itself otherwise).
mkdir -p "$T/benchbin"
printf '#!/bin/sh\ncase "$1" in bench/*) echo "bench starting"; exec sleep 300 ;; esac\nexec %s "$@"\n' \
  "$(command -v python3)" > "$T/benchbin/python3"
chmod +x "$T/benchbin/python3"
setsid env PATH="$T/benchbin:$T/fakebin:$PATH" FAKE_RECORD="$T/record" OUT="$T/out-bench" \
  bash "$SRC/scripts/gpu-run.sh" --pack "$T/passes" --budget 300 > "$T/benchterm.out" 2>&1 &
pid=$!
wait_for 120 grep -qs '^RUNNING the bench' "$T/out-bench/summary.txt"
check "the bench: summary.txt names it as running" grep -q '^RUNNING the bench' "$T/out-bench/summary.txt"
kill -TERM -- -"$pid"
wait "$pid"
check "the bench: TERM ends the run" [ $? = 1 ]
check "the bench: the summary says it was interrupted" grep -qE '^bench: interrupted after [0-9]+s \(SIGTERM\)$' "$T/out-bench/summary.txt"
check "the bench: the tests' counts stand" [ "$(tail -1 "$T/out-bench/summary.txt")" = "2 passed, 0 failed, 0 skipped" ]

# A library older than ptk needs (here a stand-in NCCL 2.10.3; ptk needs 2.14): every test that loads
# it, by its binary or through ptk-train's CUDA module, fails without running, saying why; the others run.
if command -v cc > /dev/null; then
  rm -rf "$T/stage"
  p=$T/stage/ptk-gpu
  mkdir -p "$p/bin" "$p/tests" "$p/lib/ptk" "$T/old"
  echo 'int ncclGetVersion(int* v) { *v = 21003; return 0; }' > "$T/nccl.c"
  cc -shared -fPIC -Wl,-soname,libnccl.so.2 -o "$p/lib/libnccl.so.2" "$T/nccl.c"
  for t in nccl_old plain; do
    printf '#include <stdio.h>\n#include <stdlib.h>\nint main(void) { FILE* f = fopen(getenv("FAKE_RECORD"), "a"); fprintf(f, "ran: %s\\n"); fclose(f); puts("[ RUN      ] A.B"); puts("[       OK ] A.B (1 ms)"); return 0; }\n' "$t" > "$T/$t.c"
  done
  cc -o "$p/tests/nccl_old_test" "$T/nccl_old.c" -Wl,--no-as-needed -L"$p/lib" -l:libnccl.so.2
  cc -o "$p/tests/plain_test" "$T/plain.c"
  cc -shared -fPIC -o "$p/lib/ptk/libptk_backend_cuda.so" "$T/nccl.c" -Wl,--no-as-needed -L"$p/lib" -l:libnccl.so.2
  printf '#!/bin/sh\necho "cli ran" >> "$FAKE_RECORD"\n' > "$p/tests/cli_test"
  chmod +x "$p/tests/cli_test"
  printf '#!/bin/sh\necho "ptk-train (ptk 0.1.0)"\n' > "$p/bin/ptk-train"
  chmod +x "$p/bin/ptk-train"
  printf 'ptk-train (ptk 0.1.0)\nbackends: CPU; CUDA 13.0 for sm_90 (cuBLASLt 13.1.0, cuDNN 9.19.0); NCCL 2.28.9\n' > "$p/build-versions.txt"
  cat > "$p/tests/gpu-tests.json" <<'JSON'
[{"name": "nccl_old_test", "exe": "tests/nccl_old_test", "args": []},
 {"name": "plain_test", "exe": "tests/plain_test", "args": []},
 {"name": "cli_test", "exe": "tests/cli_test", "args": [], "starts_ptk_train": true}]
JSON
  tar -C "$T/stage" -cJf "$T/old/ptk-gpu.tar.xz" ptk-gpu
  : > "$T/record"
  run old FAKE_GPUS=1 OUT="$T/out-old" -- --pack "$T/old"
  check "an old NCCL: said first, with what ptk needs" \
    grep -q "^REQUIRED: NCCL 2.10.3 was loaded ($p/lib/libnccl.so.2\|.*/ptk-gpu/lib/libnccl.so.2); ptk needs 2.14.0 or newer (built with 2.28.9)" "$T/old.out"
  check "an old NCCL: the test linked to it fails without running" \
    grep -q "^FAIL nccl_old_test: not run: NCCL 2.10.3 was loaded" "$T/out-old/summary.txt"
  check "an old NCCL: a test starting ptk-train (whose module loads it) fails without running" \
    grep -q "^FAIL cli_test: not run: NCCL 2.10.3" "$T/out-old/summary.txt"
  check "an old NCCL: neither ran, the test without it did" [ "$(cat "$T/record")" = "ran: plain" ]
  check "an old NCCL: the summary says so" grep -q "^REQUIRED: NCCL 2.10.3" "$T/out-old/summary.txt"
  check "an old NCCL: the counts" [ "$(last old)" = "1 passed, 2 failed, 0 skipped" ]
  check "an old NCCL: the run fails" [ "$(rc old)" = 1 ]
fi

# The versions against real CUDA libraries where they are (a CUDA build's machine): a "ptk-train" linked to
# cudart, cuBLASLt, cuDNN and NCCL, whose build claims a newer cuDNN than the one here: a warning.
L=/usr/local/cuda/lib64
if [ -e $L/libcudart.so ] && [ -e $L/libcublasLt.so ] && [ -e $L/libcudnn.so ] && [ -e $L/libnccl.so ]; then
  rm -rf "$T/stage"
  mkdir -p "$T/stage/ptk-gpu/bin" "$T/stage/ptk-gpu/tests" "$T/real"
  echo 'int main(void) { return 0; }' > "$T/m.c"
  cc -o "$T/stage/ptk-gpu/bin/ptk-train" "$T/m.c" -Wl,--no-as-needed -L$L -lcudart -lcublasLt -lcudnn -lnccl
  echo '[]' > "$T/stage/ptk-gpu/tests/gpu-tests.json"
  printf 'ptk-train (ptk 0.1.0)\nbackends: CPU; CUDA 13.0 for sm_90 (cuBLASLt 1.0.0, cuDNN 99.0.0); NCCL 1.0.0\n' \
    > "$T/stage/ptk-gpu/build-versions.txt"
  tar -C "$T/stage" -cJf "$T/real/ptk-gpu.tar.xz" ptk-gpu
  run real -- --pack "$T/real"
  check "the CUDA runtime ptk-train loads is named" grep -q "^CUDA runtime: [0-9]*\.[0-9]* ($L/libcudart.so" "$T/real.out"
  check "a cuDNN older than the build's headers: a warning" grep -q "^WARNING: cuDNN [0-9.]* here is older than the 99.0.0 headers" "$T/real.out"
  check "a newer NCCL: no warning" bash -c "! grep -q 'WARNING: NCCL' '$T/real.out'"
  # As the real pack has them: ptk-train linked to no CUDA library, the CUDA backend's module in lib/ptk/
  # (the build's own folder, below lib/ where the other libraries lie) linked to all four.
  rm -rf "$T/stage"
  mkdir -p "$T/stage/ptk-gpu/bin" "$T/stage/ptk-gpu/tests" "$T/stage/ptk-gpu/lib/ptk" "$T/module"
  cc -o "$T/stage/ptk-gpu/bin/ptk-train" "$T/m.c"
  echo 'int ptk_backend_cuda_v11(void) { return 0; }' > "$T/mod.c"
  cc -shared -fPIC -o "$T/stage/ptk-gpu/lib/ptk/libptk_backend_cuda.so" "$T/mod.c" -Wl,--no-as-needed -L$L \
    -lcudart -lcublasLt -lcudnn -lnccl
  echo '[]' > "$T/stage/ptk-gpu/tests/gpu-tests.json"
  printf 'ptk-train (ptk 0.1.0)\nbackends: CPU; CUDA 13.0 for sm_90 (cuBLASLt 1.0.0, cuDNN 1.0.0); NCCL 1.0.0\n' \
    > "$T/stage/ptk-gpu/build-versions.txt"
  tar -C "$T/stage" -cJf "$T/module/ptk-gpu.tar.xz" ptk-gpu
  run module -- --pack "$T/module"
  check "the module in lib/ptk: the CUDA runtime it loads is named" \
    grep -q "^CUDA runtime: [0-9]*\.[0-9]* ($L/libcudart.so" "$T/module.out"
  for lib in cuBLASLt cuDNN NCCL; do
    check "the module in lib/ptk: the $lib it loads is named" grep -q "^$lib: [0-9]*\.[0-9]*\.[0-9]* (/" "$T/module.out"
  done
else
  echo "(no CUDA libraries in $L: the versions against real libraries are not checked)"
fi

if [ "$fail" != 0 ]; then
  for f in "$T"/*.out; do echo "---- $f"; cat "$f"; done
fi
[ "$fail" = 0 ] && echo "gpu-run: OK"
exit "$fail"
