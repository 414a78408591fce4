#!/usr/bin/env bash
# On the GPU machine: the packed build's gpu-labelled tests, then the bench, inside a time budget
# (scripts/gpu-check.sh run runs it; scripts/gpu-pack.sh made the pack).
#
# Usage: scripts/gpu-run.sh [--full] [--pack DIR] [--budget SECONDS] [--no-bench] [BENCH ARGS...]
#   quick (default): the gpu tests but their slowest cases, then bench/bench_trainer_gpu.py at GPT-2
#                    124M (16 x 1024, bf16) beside PyTorch eager; ends within --budget (540 s: one device
#                    call of 9 minutes) even when tests hang: each test runs under `timeout`, cut to what is
#                    left before the bench's share. The tests run cheapest and most telling first (the
#                    toolchain, the ops against the CPU's, the model, NCCL, the parallel layouts, ptk-train)
#   --full:          every test case, and the bench at 124M and 350M beside PyTorch eager and compiled
#                    (--budget 570 s by default, one 10-minute command; what it leaves out fails as not run)
#   --pack DIR:      where gpu-pack.sh put ptk-gpu.tar.xz (default: .gpu beside this script's folder, or
#                    this script's own folder when it is the pack's run.sh)
#   BENCH ARGS:      passed on to the bench (e.g. --iters 40)
# Environment: OUT=DIR puts the logs there as at most five files: versions.txt, tests.log (every test's
# output and the reruns of failures; kept under 15 MiB), bench.log, summary.txt, and the console's copy
# gpu-check.log. summary.txt is rewritten before and after every test, so that it is there however the
# run ends (a hang, a spent budget, TERM/INT/HUP, a kill at the call's limit): the run's state, each
# library older than ptk needs (REQUIRED), one line per test in the order run (PASS, FAIL, TIMEOUT,
# SKIP, NOT RUN, INTERRUPTED, with its seconds, and the failed cases or the case a hang was in), the
# test running when it was written (RUNNING), the bench, and the counts last.
# PTK_GPU_TEST_TIMEOUT=S caps every test at S seconds.
#
# Prints first the driver, GPU, CUDA runtime, cuBLASLt, cuDNN and NCCL that ptk-train and the tests
# load, beside the versions of the headers it was built with: a warning for each library older than its
# headers; a REQUIRED line for each one older than ptk's code needs (the CUDA runtime and cuBLASLt of
# the build's CUDA major, cuDNN 9.0, NCCL 2.14, a driver for the build's CUDA major) or not found, and
# then every test that loads it (by its binary, or through ptk-train's CUDA module when it starts
# ptk-train), and the bench, fails without running, naming it. A
# failing test is run again once every test has run (its reruns never take the time of the tests after
# it), its failed cases only, with PTK_CUDA_SYNC_OPS=1 (the backend synchronizes after every op and
# names the one that failed) and under compute-sanitizer where it is installed, each time-boxed; the
# verdict stays a failure. Ends with the line "N passed, N failed, N skipped".
# Exit status 1 when a test failed, ran out of time, or skipped while nvidia-smi lists a GPU (there a
# skip is a false pass), or when the bench failed. The one skip that stays a pass: a case that says it
# "needs two GPUs" (or three) where nvidia-smi lists fewer (named in the summary as not runnable on
# this machine).
set -uo pipefail
started=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
profile=quick budget="" bench=1 pack="" bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) profile=full; shift ;;
    --quick) profile=quick; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --pack) pack=${2:?--pack needs a folder}; shift 2 ;;
    --no-bench) bench=0; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    *) bench_args+=("$1"); shift ;;
  esac
done
if [ -z "$pack" ]; then
  if [ -f "$here/ptk-gpu.tar.xz" ]; then pack=$here; else pack=$root/.gpu; fi
fi
[ -f "$pack/ptk-gpu.tar.xz" ] || { echo "gpu-run: no $pack/ptk-gpu.tar.xz: run 'bash scripts/gpu-check.sh pack' first" >&2; exit 2; }
if [ -z "$budget" ]; then
  if [ $profile = quick ]; then budget=540; else budget=570; fi
fi
# What the bench keeps for itself: the tests stop being started (and are cut) at budget - reserve.
if [ $bench = 0 ]; then reserve=0; elif [ $profile = quick ]; then reserve=150; else reserve=270; fi
deadline=$((started + budget))
tests_deadline=$((deadline - reserve))
out=${OUT:-}
[ -z "$out" ] || mkdir -p "$out" || exit 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
logdir=${out:-$work}
testlog=$logdir/tests.log
: > "$testlog"
# Everything printed also lands in gpu-check.log.
if [ -n "$out" ]; then exec > >(tee "$out/gpu-check.log") 2>&1; fi

# The machine's own environment, for PyTorch; ptk's: the packed libraries first, then the CUDA
# toolkit's and the NVIDIA libraries of the machine's Python environment (cuDNN, NCCL, cuBLAS wheels).
machine_ld=${LD_LIBRARY_PATH:-}
python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" \
  "$pack/ptk-gpu.tar.xz" "$work" 2>/dev/null ||
  tar -C "$work" -xJf "$pack/ptk-gpu.tar.xz" || { echo "gpu-run: cannot unpack $pack/ptk-gpu.tar.xz"; exit 1; }
dir=$work/ptk-gpu
site=$(timeout 60 python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null || true)
nv=""
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && nv="$nv:$d"; done
# The build's own shared libraries (a CUDA backend module) lie at their place in the build tree: their
# folders too, for a binary linked to one (its build-tree RUNPATH does not exist here). The other
# libraries are lib/'s own files; the build's may lie in a folder below it (the module's lib/ptk/).
others=(! \( -path "$dir/lib/*" ! -path "$dir/lib/*/*" \))
own=$(find "$dir" -name 'lib*.so*' "${others[@]}" -printf '%h\n' | sort -u | paste -sd:)
ptk_ld="$dir/lib${own:+:$own}:/usr/local/cuda/lib64$nv${machine_ld:+:$machine_ld}"
ptk_env=(env "LD_LIBRARY_PATH=$ptk_ld" "PATH=$dir/bin:$PATH" "PTK_SOURCE_DIR=$root")
left() { echo $(($1 - $(date +%s))); }

# ---- versions ----------------------------------------------------------------
: > "$work/blocked.tsv"  # "LIBRARY<TAB>why" for each library older than ptk needs (or missing)
gpus=$(timeout 15 nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)
ngpus=$(grep -c '^GPU ' <<<"$gpus" || true)
gpu_list=$(sed 's/ (UUID[^)]*)//' <<<"$gpus" | paste -sd';')  # one line, for the summary
{
  echo "== versions (profile $profile, budget ${budget}s)"
  if [ -n "$gpus" ]; then
    timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
      awk -F', ' '{print "GPU: " $1 " (" $3 "), driver " $2}'
  else
    echo "GPU: none listed by nvidia-smi"
  fi
  # The libraries ptk-train and the packed modules load, as the loader resolves them with ptk's path.
  # The tests' binaries too: a test fails without running when a library it loads is older than ptk needs.
  libs=$(find "$dir" -type f \( -path "$dir/bin/*" -o -path "$dir/tests/*" -o -name 'lib*.so*' \) "${others[@]}" \
         -exec env LD_LIBRARY_PATH="$ptk_ld" ldd {} \; 2>/dev/null | awk '$2 == "=>" {print $1, $3}' | sort -u)
  timeout 60 "${ptk_env[@]}" python3 - "$dir/build-versions.txt" "$libs" "$work/blocked.tsv" <<'PY'
import ctypes, re, sys
built_text = open(sys.argv[1]).read() if sys.argv[1] else ""
print(built_text.strip())
resolved = dict(line.split(" ", 1) for line in sys.argv[2].splitlines() if " " in line)
def header(name):
    m = re.search(name + r" ([0-9][0-9.]*)", built_text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None
def load(prefix):
    for soname, path in resolved.items():
        if soname.startswith(prefix):
            if path == "not":
                return None, f"{soname} NOT FOUND"
            try:
                return ctypes.CDLL(path), path
            except OSError as e:
                return None, f"{path}: {e}"
    return None, "not used by the packed programs"
# What ptk's code needs at least (older: the tests that load it fail without running, each saying
# why): the CUDA runtime and cuBLASLt of the build's CUDA major (libcudart.so.13, libcublasLt.so.13);
# cuDNN 9 (libcudnn.so.9: cudnn-frontend 1.18's fused attention); NCCL 2.14 (the non-blocking
# ncclCommInitRankConfig and ncclCommFinalize); a driver that supports the build's CUDA major (minor
# version compatibility). Older than the headers but not than these: a warning.
required = {"CUDA runtime": None, "cuBLASLt": None, "cuDNN": (9, 0, 0), "NCCL": (2, 14, 0)}
blocked = open(sys.argv[3], "w")
def dotted(v):
    return ".".join(map(str, v)) if v else "?"
def block(key, line):
    print("REQUIRED: " + line + ": the tests that load it fail without running")
    blocked.write(f"{key}\t{line}\n")
def show(label, built, got, where, key):
    line = f"{label}: {dotted(got)} ({where}); built with {dotted(built)}"
    need = required.get(label) or ((built[0], 0) if built else None)
    print(line)
    if "NOT FOUND" in where or (where.startswith("/") and ": " in where):  # not found, or did not load
        block(key, f"{label}: {where}")
    elif got and need and got[:len(need)] < need:
        block(key, f"{label} {dotted(got)} was loaded ({where}); ptk needs {dotted(need)} or newer (built with {dotted(built)})")
    elif got and built and got[:len(built)] < built:
        print(f"WARNING: {label} {dotted(got)} here is older than the {dotted(built)} headers ptk was built with")
v = ctypes.c_int(0)
lib, where = load("libcudart.so")
cuda_built = header("CUDA")
if lib:
    lib.cudaDriverGetVersion(ctypes.byref(v)); d = v.value
    lib.cudaRuntimeGetVersion(ctypes.byref(v)); r = v.value
    print(f"driver supports CUDA {d // 1000}.{d % 1000 // 10}" if d else "driver: none found by the CUDA runtime")
    if cuda_built and d and d // 1000 < cuda_built[0]:
        block("driver", f"the driver supports CUDA {d // 1000}.{d % 1000 // 10}, older than the CUDA {cuda_built[0]} ptk was built for: update the driver")
    elif cuda_built and d and (d // 1000, d % 1000 // 10) < cuda_built[:2]:
        print(f"WARNING: the driver supports CUDA {d // 1000}.{d % 1000 // 10}, older than the CUDA {cuda_built[0]}.{cuda_built[1]} ptk was built with")
    show("CUDA runtime", cuda_built, (r // 1000, r % 1000 // 10), where, "libcudart.so")
else:
    show("CUDA runtime", cuda_built, None, where, "libcudart.so")
lib, where = load("libcublasLt.so")
n = lib.cublasLtGetVersion() if lib else 0
show("cuBLASLt", header("cuBLASLt"), (n // 10000, n // 100 % 100, n % 100) if n else None, where, "libcublasLt.so")
lib, where = load("libcudnn.so")
n = lib.cudnnGetVersion() if lib else 0
show("cuDNN", header("cuDNN"), (n // 10000, n // 100 % 100, n % 100) if n >= 90000 else (n // 1000, n // 100 % 10, n % 100) if n else None, where, "libcudnn.so")
lib, where = load("libnccl.so")
if lib and lib.ncclGetVersion(ctypes.byref(v)) == 0:
    n = v.value
    show("NCCL", header("NCCL"), (n // 10000, n // 100 % 100, n % 100) if n >= 20900 else (n // 1000, n // 100 % 10, n % 100), where, "libnccl.so")
else:
    show("NCCL", header("NCCL"), None, where, "libnccl.so")
PY
  missing=$(echo "$libs" | awk '$2 == "not" {print $1}' | sort -u | paste -sd' ')
  [ -z "$missing" ] || echo "WARNING: libraries not found for the packed programs: $missing"
  command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/compute-sanitizer ] ||
    echo "compute-sanitizer: not installed (failures are rerun with PTK_CUDA_SYNC_OPS=1 only)"
} 2>&1 | tee "$logdir/versions.txt"

# ---- tests -------------------------------------------------------------------
# The slowest cases, left to --full: each runs ptk-train four or five times where another case checks
# the same property faster (determinism: CudaModel.SameSeedSameBits; state across backends:
# CudaModel.StateCrossesBackendsExactly; the interleaved schedule on CUDA:
# cuda_pipeline_interleaved_test).
declare -A quick_exclude=(
  [cuda_train_cli_test]="CudaTrainCli.DeterministicModeGivesIdenticalLossLines:CudaTrainCli.CheckpointsCrossBackends:CudaTrainCli.InterleavedStagesShareOneGpuOverGlooAndCrossBackends:CudaTrainCli.MixtureOfExpertsCrossesBackendsAndRepeatsBitForBit"
)
# Each test's cap in seconds (the deadline cuts it further); unknown tests get 120.
declare -A cap=([cuda_toolchain_test]=30 [matmul_attention_cuda_test]=90 [ops_cuda_test]=90 [cuda_model_test]=120
  [cuda_llama_model_test]=90 [cuda_train_cli_test]=180 [nccl_cuda_test]=120 [tensor_parallel_cuda_test]=60 [cuda_tensor_parallel_test]=90
  [cuda_pipeline_test]=90 [cuda_pipeline_interleaved_test]=120 [context_parallel_cuda_test]=60
  [cuda_context_parallel_test]=90 [cuda_context_pipeline_test]=120)
[ $profile = quick ] || cap[cuda_train_cli_test]=300  # its two slowest cases too
sanitizer=$(command -v compute-sanitizer || { [ -x /usr/local/cuda/bin/compute-sanitizer ] && echo /usr/local/cuda/bin/compute-sanitizer; } || true)
pass=0 fail=0 skip=0
results=() reruns=()
verdicts=()    # one line per test, in the order run: its verdict, seconds and why
running=""     # the test (or rerun, or the bench) running now, for a summary written meanwhile
box_pid=""     # its `timeout` process
# summary.txt as it stands, rewritten (whole, through a rename) before and after every test and at
# the end however the run ends: a hang, a spent budget, a signal (TERM, INT, HUP) or a kill at the
# call's limit leave the verdicts so far, the one running named, and the counts as its last line.
write_summary() {
  {
    echo "profile $profile, $(($(date +%s) - started))s of ${budget}s; GPU: ${gpu_list:-none listed}; $1"
    cut -f2 "$work/blocked.tsv" 2>/dev/null | sed 's/^/REQUIRED: /'
    for r in "${verdicts[@]}"; do echo "$r"; done
    for r in "${results[@]}"; do case $r in NOTE*) echo "$r" ;; esac; done
    [ -z "$running" ] || echo "RUNNING $running (started $(($(date +%s) - running_since))s ago)"
    [ -z "${bench_line:-}" ] || echo "$bench_line"
    echo "$pass passed, $fail failed, $skip skipped"
  } > "$logdir/summary.txt.part" && mv -f "$logdir/summary.txt.part" "$logdir/summary.txt"
}
on_signal() {
  trap '' TERM INT HUP PIPE  # the console's tee may be gone with the same signal
  # timeout passes it on to the test. Every job of this shell, not $box_pid alone: a signal that lands
  # while the test's `&` forks runs this trap before `box_pid=$!`, and the test ran on, orphaned, to its
  # time box (gpu_run_test's "TERM: the hanging test is ended" then fails).
  local jobs_now
  jobs_now=$(jobs -pr)  # running ones only: a finished job's pid may be another process's by now
  [ -z "$jobs_now" ] || kill -TERM $jobs_now 2>/dev/null
  if [ "${running#the bench}" != "$running" ]; then
    bench_line="bench: interrupted after $(($(date +%s) - running_since))s (SIG$1)"; running=""
  elif [ -n "$running" ]; then
    verdicts+=("INTERRUPTED $running after $(($(date +%s) - running_since))s (SIG$1)"); fail=$((fail + 1)); running=""
  fi
  write_summary "stopped by SIG$1 before the end"
  { echo "gpu-run: stopped by SIG$1; summary.txt holds the verdicts so far"; tail -1 "$logdir/summary.txt"; } 2>/dev/null
  exit 1
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal HUP' HUP
# run_box SECONDS LABEL CMD...: runs CMD in $work/run with ptk's environment, appending to tests.log.
# Its standard input is /dev/null: the loop below reads the test list from its own, which a test (or
# a program it starts: popen's children share it) reading stdin would otherwise empty. In the
# background, waited for: a signal's trap runs at once, not after the test.
run_box() {
  local secs=$1 label=$2 rc
  shift 2
  echo "==== $label (time box ${secs}s)" >> "$testlog"
  mkdir -p "$work/run"
  (cd "$work/run" && exec "${ptk_env[@]}" timeout -k 10 "$secs" "$@") < /dev/null >> "$testlog" 2>&1 &
  box_pid=$!
  wait "$box_pid"
  rc=$?
  box_pid=""
  return $rc
}
# The libraries a test loads: its binary's, and the CUDA module's when it starts ptk-train.
module_libs=$(find "$dir" -type f -name 'libptk_backend_cuda*.so*' -exec env LD_LIBRARY_PATH="$ptk_ld" ldd {} \; \
  2>/dev/null | awk '$2 == "=>" {print $1}' | sort -u)
# why_not_run EXE STARTS_PTK_TRAIN: "; "-joined, what the versions step found too old (or missing)
# among them, the driver's for every test; empty when nothing is.
why_not_run() {
  local deps key line why=""
  [ -s "$work/blocked.tsv" ] || return 0
  deps=$(env LD_LIBRARY_PATH="$ptk_ld" ldd "$1" 2>/dev/null | awk '$2 == "=>" {print $1}')
  [ "$2" != 1 ] || deps+=$'\n'"$module_libs"
  while IFS=$'\t' read -r key line; do
    if [ "$key" = driver ] || grep -q "^$key" <<<"$deps"; then why+="${why:+; }$line"; fi
  done < "$work/blocked.tsv"
  echo "$why"
}
# The gtest cases that failed, or the one running when the test was stopped, in the log since LINE.
failed_cases() {
  tail -n +"$1" "$testlog" | awk '
    /^\[ RUN      \] / {running = $4}
    /^\[       OK \] / || /^\[  SKIPPED \] / {running = ""}
    /^\[  FAILED  \] / && $4 ~ /\./ {f[$4] = 1; running = ""}
    END {for (c in f) print c; if (running != "") print running}' | sort -u | paste -sd:
}
while IFS=$'\t' read -r name exe starts args; do
  filter=()
  if [ $profile = quick ] && [ -n "${quick_exclude[$name]:-}" ]; then filter=("--gtest_filter=-${quick_exclude[$name]}"); fi
  limit=${PTK_GPU_TEST_TIMEOUT:-${cap[$name]:-120}}
  need=$((limit < 15 ? limit : 15))  # what is worth starting a test or a rerun for
  secs=$(left $tests_deadline)
  [ "$secs" -le "$limit" ] || secs=$limit
  if [ "$secs" -lt "$need" ]; then
    fail=$((fail + 1)); results+=("TIME $name: not run, the budget's ${budget}s were spent")
    verdicts+=("NOT RUN $name: the budget's ${budget}s were spent")
    echo "TIME $name: not run (the budget is spent)"; write_summary "running the tests"; continue
  fi
  # A library it loads older than ptk needs (the versions above): a failure, said so, not a crash.
  why=$(why_not_run "$dir/$exe" "$starts")
  if [ -n "$why" ]; then
    fail=$((fail + 1)); verdicts+=("FAIL $name: not run: $why")
    echo "FAIL $name (not run: $why)"; write_summary "running the tests"; continue
  fi
  eval "argv=(${args//@PACK@/$dir})"
  line=$(($(wc -l < "$testlog") + 1))
  t0=$(date +%s)
  running="$name (time box ${secs}s)" running_since=$t0
  write_summary "running the tests"
  run_box "$secs" "$name ${filter[*]}" "$dir/$exe" "${argv[@]}" "${filter[@]}"; rc=$?
  running=""
  t=$(($(date +%s) - t0))
  skipped_cases=$(tail -n +"$line" "$testlog" | awk '/^\[  SKIPPED \] / && $4 ~ /\./ {print $4}' | sort -u | wc -l)
  # Cases that skip themselves for want of GPUs ("needs two GPUs", "needs three GPUs"), where this
  # machine lists fewer than they need.
  more_gpu_cases=$(tail -n +"$line" "$testlog" | awk -v have="$ngpus" '
    /^\[ RUN      \] / {running = $4; need = 0}
    /needs two GPUs/ {need = 2}
    /needs three GPUs/ {need = 3}
    /^\[  SKIPPED \] / && $4 == running && need > have {print running}' | sort -u | wc -l)
  if [ $rc -eq 0 ] && [ "$skipped_cases" -eq 0 ]; then
    pass=$((pass + 1)); echo "PASS $name (${t}s)"; verdicts+=("PASS $name (${t}s)")
  elif [ $rc -eq 0 ] && [ "$skipped_cases" -eq "$more_gpu_cases" ]; then
    pass=$((pass + 1)); echo "PASS $name (${t}s; $more_gpu_cases case(s) need more GPUs, ${ngpus} listed)"
    verdicts+=("PASS $name (${t}s; $more_gpu_cases case(s) need more GPUs)")
    results+=("NOTE $name: $more_gpu_cases case(s) need more GPUs: not runnable on this machine (${ngpus} GPU listed)")
  elif [ $rc -eq 0 ] || [ $rc -eq 77 ]; then
    why=$([ $rc -eq 77 ] && tail -n +"$line" "$testlog" | grep -m1 '^SKIP' || echo "$skipped_cases case(s) skipped")
    skip=$((skip + 1)); results+=("SKIP $name: $why"); echo "SKIP $name ($why)"; verdicts+=("SKIP $name (${t}s): ${why#SKIP: }")
  else
    what="exit $rc" verdict=FAIL
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then what="stopped after ${secs}s" verdict=TIMEOUT; fi
    fail=$((fail + 1)); results+=("FAIL $name ($what)"); echo "FAIL $name ($what, ${t}s)"
    tail -n +"$line" "$testlog" | grep -E '^\[  FAILED  \]|Failure|error|FAIL' | head -20 | sed 's/^/    /'
    cases=$(failed_cases "$line")
    verdicts+=("$verdict $name (${t}s, $what)${cases:+: $cases}")
    refilter=${filter[*]}
    [ -z "$cases" ] || refilter="--gtest_filter=$cases"
    reruns+=("$name"$'\x1f'"$exe"$'\x1f'"$args"$'\x1f'"$refilter"$'\x1f'"$limit")
  fi
  write_summary "running the tests"
done < <(python3 -c "
import json, shlex, sys
# The order: the toolchain, the ops against the CPU's, the whole model, NCCL, the parallel layouts, then
# ptk-train end to end (the slowest); tests not named here after these, in the pack's order.
first = ['cuda_toolchain_test', 'ops_cuda_test', 'matmul_attention_cuda_test', 'context_parallel_cuda_test',
         'tensor_parallel_cuda_test', 'cuda_model_test', 'cuda_llama_model_test', 'nccl_cuda_test',
         'cuda_pipeline_test', 'cuda_pipeline_interleaved_test', 'cuda_tensor_parallel_test',
         'cuda_context_parallel_test', 'cuda_context_pipeline_test', 'cuda_train_cli_test']
tests = json.load(open(sys.argv[1]))
rank = {n: i for i, n in enumerate(first)}
for t in sorted(tests, key=lambda t: (rank.get(t['name'], len(first)), tests.index(t))):
    starts = 1 if t.get('starts_ptk_train') else 0  # gpu-pack.sh: the test's environment names ptk-train
    print(t['name'], t['exe'], starts, ' '.join(shlex.quote(a) for a in t['args']), sep='\t')" "$dir/tests/gpu-tests.json")
# Attribution, once every test has run (a failure's reruns never take the time of the tests after it),
# time-boxed within the tests' share: the failed cases again with every op synchronized and named, then
# under compute-sanitizer.
for r in "${reruns[@]}"; do
  IFS=$'\x1f' read -r name exe args refilter limit <<<"$r"
  eval "argv=(${args//@PACK@/$dir})"
  refilter=(${refilter:+"$refilter"})
  need=$((limit < 15 ? limit : 15))
  box=$(left $tests_deadline)
  [ "$box" -le "$limit" ] || box=$limit
  if [ "$box" -ge "$need" ]; then
    running="$name's rerun with PTK_CUDA_SYNC_OPS=1 (time box ${box}s)" running_since=$(date +%s)
    write_summary "rerunning failures"
    run_box "$box" "$name rerun with PTK_CUDA_SYNC_OPS=1 ${refilter[*]}" env PTK_CUDA_SYNC_OPS=1 "$dir/$exe" "${argv[@]}" "${refilter[@]}"
    echo "RERUN $name ${refilter[*]} with PTK_CUDA_SYNC_OPS=1: exit $? (tests.log)"
    running=""
  else
    echo "RERUN $name: not run (the budget is spent)"
  fi
  box=$(left $tests_deadline)
  [ "$box" -le 120 ] || box=120
  if [ -n "$sanitizer" ] && [ "$box" -ge 30 ]; then
    running="$name under compute-sanitizer (time box ${box}s)" running_since=$(date +%s)
    write_summary "rerunning failures"
    run_box "$box" "$name under compute-sanitizer ${refilter[*]}" "$sanitizer" --target-processes all --error-exitcode 99 "$dir/$exe" "${argv[@]}" "${refilter[@]}"
    echo "RERUN $name ${refilter[*]} under compute-sanitizer: exit $? (tests.log)"
    running=""
  fi
done
write_summary "the tests done"
if [ -n "$gpus" ] && [ $skip -gt 0 ]; then
  echo "FAIL: nvidia-smi lists a GPU and $skip gpu test(s) skipped: on a GPU machine a skip is a failure"
fi
# A log comes back from a remote run only under 16 MiB: tests.log beyond 15 MiB keeps its first 2 MiB
# and its last 13 MiB (a test that floods its output, a sanitizer's report).
log_bytes=$(stat -c %s "$testlog")
if [ "$log_bytes" -gt $((15 << 20)) ]; then
  { head -c $((2 << 20)) "$testlog"
    printf '\n[gpu-run: %d bytes of tests.log left out here: it is kept under 15 MiB]\n' $((log_bytes - (15 << 20)))
    tail -c $((13 << 20)) "$testlog"
  } > "$work/tests.log.cut" && mv "$work/tests.log.cut" "$testlog"
  echo "tests.log: $log_bytes bytes cut to its first 2 MiB and last 13 MiB"
fi

# ---- bench -------------------------------------------------------------------
bench_rc=0
if [ $bench = 1 ]; then
  if [ $profile = quick ]; then
    bargs=(--shapes 124m --no-compile --profile)
  else
    bargs=(--shapes 124m,350m --profile)
  fi
  secs=$(($(left $deadline) - 5))
  # Each ptk-train run of the bench within a third of its time box: one that hangs leaves the time of
  # PyTorch's runs (and of the bench's lines) to them.
  bargs+=(--run-timeout $((secs / 3)))
  why=$(why_not_run "$dir/bin/ptk-train" 1)
  if [ -n "$why" ]; then
    echo "bench: not run: $why"; bench_rc=1 bench_line="bench: not run: $why"
  elif [ "$secs" -lt 30 ]; then
    echo "bench: not run (the budget is spent)"; bench_rc=1 bench_line="bench: not run, the budget was spent"
  else
    echo "== bench (time box ${secs}s): ptk-train with the pack's libraries, PyTorch with this machine's"
    running="the bench (time box ${secs}s)" running_since=$(date +%s)
    write_summary "running the bench"
    # PyTorch gets the environment this script started with; ptk-train, through the bench, the pack's.
    # In the background, its log followed on the console: a signal's trap runs at once.
    : > "$logdir/bench.log"
    (cd "$root" && exec env LD_LIBRARY_PATH="$machine_ld" timeout -k 10 "$secs" python3 bench/bench_trainer_gpu.py \
      --bin "$dir/bin/ptk-train" --ptk-library-path "$ptk_ld" "${bargs[@]}" "${bench_args[@]}") \
      < /dev/null > "$logdir/bench.log" 2>&1 &
    box_pid=$!
    tail -n +1 -f --pid="$box_pid" "$logdir/bench.log" &
    tail_pid=$!
    wait "$box_pid"
    bench_rc=$?
    box_pid="" running=""
    wait "$tail_pid"
    [ $bench_rc -eq 0 ] || echo "bench: FAIL (exit $bench_rc)"
    bench_line="bench: $([ $bench_rc -eq 0 ] && echo ok || echo "failed (exit $bench_rc)")"
  fi
fi

# ---- summary -----------------------------------------------------------------
status=0
[ $fail -eq 0 ] || status=1
[ -z "$gpus" ] || [ $skip -eq 0 ] || status=1
[ $bench_rc -eq 0 ] || status=1
write_summary "done"
trap - TERM INT HUP
echo "== summary (summary.txt)"
grep -v ' passed, ' "$logdir/summary.txt" | sed -n '2,$p'
echo "$pass passed, $fail failed, $skip skipped"
exit $status
