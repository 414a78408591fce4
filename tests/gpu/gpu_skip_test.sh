#!/usr/bin/env bash
# A gpu-labelled test binary (its main is tests/gpu_test_main.cpp) skips (exit 77) only where there is
# no GPU: no NVIDIA driver, or a driver that reports no device. With a driver that is there but older
# than the runtime, or broken, it fails (exit 1) naming cudaGetDeviceCount and the error: a skip would
# read as a pass on a GPU machine. The driver is tests/gpu/fake_libcuda.c, put first on the loader's path.
# Usage: gpu_skip_test.sh GPU_TEST_BINARY FAKE_DRIVER_DIR
set -uo pipefail
BIN=$1 FAKE=$2
fail=0
# expect RC TEXT [VAR=VALUE...]: the binary under the fake driver exits RC printing TEXT.
expect() {
  local want=$1 text=$2
  shift 2
  out=$(env LD_LIBRARY_PATH="$FAKE${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@" "$BIN" 2>&1); rc=$?
  if [ "$rc" = "$want" ] && [[ $out == *"$text"* ]]; then
    echo "ok: $* -> $rc"
  else
    echo "FAIL: $* -> rc $rc (want $want and '$text'): $out"
    fail=1
  fi
}
[ -e "$FAKE/libcuda.so.1" ] || { echo "FAIL: no fake driver in $FAKE"; exit 1; }
expect 77 "reports no device" FAKE_CUDA_RESULT=100
expect 1 "cudaGetDeviceCount: cudaErrorInsufficientDriver" FAKE_CUDA_DRIVER_VERSION=12080
expect 1 "(driver supports CUDA 12.8, this runtime is CUDA" FAKE_CUDA_DRIVER_VERSION=12080
expect 1 "cudaGetDeviceCount: cudaErrorUnknown" FAKE_CUDA_RESULT=999
expect 1 "cudaGetDeviceCount: cudaErrorInitializationError" FAKE_CUDA_RESULT=3
# No driver at all: only where the loader cannot find a real one (a machine without a GPU).
if grep -q 'libcuda\.so\.1 ' <<<"$(ldconfig -p 2>/dev/null)"; then
  echo "(a driver is installed here: the no-driver case is not checked)"
else
  out=$("$BIN" 2>&1); rc=$?
  if [ "$rc" = 77 ] && [[ $out == *"no NVIDIA driver installed"* ]]; then echo "ok: no driver -> 77"
  else echo "FAIL: no driver -> rc $rc: $out"; fail=1; fi
fi
[ "$fail" = 0 ] && echo "gpu skip rule: OK"
exit "$fail"
