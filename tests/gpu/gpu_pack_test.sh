#!/usr/bin/env bash
# scripts/gpu-pack.sh (what `scripts/gpu-check.sh pack` runs after its build) on a fake build tree: the
# programs, the gpu-labelled tests CTest lists (at their place, with gpu-tests.json), a shared library the
# build made (a CUDA backend module) at its place in the build tree, the libraries they load except the
# CUDA and driver ones, the build's versions; never the tests' stand-in driver (libcuda.so.1). It prints
# the pack's size, and refuses a pack over the limit (48 MiB; PTK_GPU_PACK_LIMIT_MIB here), or one that with
# the project tree is over what a device call carries (64 MiB; PTK_GPU_TRAVEL_LIMIT_MIB), leaving none.
# Usage: gpu_pack_test.sh SOURCE_DIR
set -uo pipefail
SRC=$1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
check() {
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
B=$T/build
mkdir -p "$B/bin" "$B/tests" "$B/trainer/cuda" "$B/tests/fake_driver" "$B/generated"
# Small real ELF files: programs, a test binary, a module (linked to libz, which the pack must take).
printf '#include <stdio.h>\nint main(int c, char** v) { puts("ptk-train (ptk 0.1.0)\\nbackends: CPU"); return 0; }\n' > "$T/p.c"
printf 'int ptk_backend(void) { return 1; }\n' > "$T/m.c"
cc -o "$B/bin/ptk-train" "$T/p.c" && cc -o "$B/bin/ptk-tokenize" "$T/p.c" && cc -o "$B/tests/fake_gpu_test" "$T/p.c" &&
  cc -shared -fPIC -o "$B/trainer/cuda/libptk_backend_cuda.so" "$T/m.c" -Wl,--no-as-needed -lz &&
  cc -shared -fPIC -o "$B/tests/fake_driver/libcuda.so.1" "$T/m.c" || { echo "FAIL: cannot compile the fake build"; exit 1; }
cat > "$B/CTestTestfile.cmake" <<EOF
add_test(fake_gpu_test "$B/tests/fake_gpu_test" "--data=$B/x")
set_tests_properties(fake_gpu_test PROPERTIES LABELS "gpu")
add_test(cli_gpu_test "$B/tests/fake_gpu_test")
set_tests_properties(cli_gpu_test PROPERTIES LABELS "gpu" ENVIRONMENT "PTK_TRAIN=$B/bin/ptk-train")
add_test(cpu_test "$B/tests/fake_gpu_test")
set_tests_properties(cpu_test PROPERTIES LABELS "unit")
EOF

cd "$T"
out=$(bash "$SRC/scripts/gpu-pack.sh" "$B" .gpu 2>&1); rc=$?
echo "$out"
check "the pack is made" [ "$rc" = 0 ]
check "its size is printed against the limit" grep -qE '^gpu-pack: \.gpu: [0-9.]+ MiB \([0-9.]+ MiB unpacked; limit 48 MiB\)$' <<<"$out"
mkdir -p "$T/x"
tar -C "$T/x" -xJf .gpu/ptk-gpu.tar.xz 2>/dev/null
P=$T/x/ptk-gpu
check "the programs" test -x "$P/bin/ptk-train" -a -x "$P/bin/ptk-tokenize"
check "the gpu test at its place, not the unit one" [ -x "$P/tests/fake_gpu_test" ]
# starts_ptk_train: the test's environment names ptk-train (gpu-run.sh holds it to the CUDA module's libraries).
check "gpu-tests.json: the gpu tests with their arguments, and whether they start ptk-train" python3 -c "
import json, sys
t = json.load(open(sys.argv[1]))
assert t == [{'name': 'fake_gpu_test', 'exe': 'tests/fake_gpu_test', 'args': ['--data=@PACK@/x'], 'starts_ptk_train': False},
             {'name': 'cli_gpu_test', 'exe': 'tests/fake_gpu_test', 'args': [], 'starts_ptk_train': True}], t" \
  "$P/tests/gpu-tests.json"
check "the build's module at its place in the build tree" [ -f "$P/trainer/cuda/libptk_backend_cuda.so" ]
has_libz() { compgen -G "$P/lib/libz.so*" >/dev/null; }
check "what the module loads (libz)" has_libz
check "not the tests' stand-in driver" [ -z "$(find "$P" -name 'libcuda.so*')" ]
check "the build's versions" grep -q '^backends: CPU' "$P/build-versions.txt"
check "the run script beside the pack" test -f .gpu/run.sh -a -f "$P/run.sh"

out=$(PTK_GPU_PACK_LIMIT_MIB=0 bash "$SRC/scripts/gpu-pack.sh" "$B" .gpu 2>&1); rc=$?
echo "$out"
check "a pack over the limit is refused" [ "$rc" = 1 ]
check "the refusal names the size and the limit" grep -q 'over the 0 MiB limit: refused' <<<"$out"
check "a refused pack leaves no .gpu" [ ! -e .gpu ]

# The pack travels with the project tree (SOURCE_DIR's, some MiB): over the device call's limit together, refused.
out=$(PTK_GPU_TRAVEL_LIMIT_MIB=1 bash "$SRC/scripts/gpu-pack.sh" "$B" .gpu 2>&1); rc=$?
echo "$out"
if git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
  check "a pack that with the tree is over the travel limit is refused" [ "$rc" = 1 ]
  check "the refusal names the pack, the tree and the limit" \
    grep -q "gpu-pack: the pack (.* MiB) and the project tree .* make .* MiB, over the 1 MiB a device call carries: refused" <<<"$out"
  check "and leaves no .gpu" [ ! -e .gpu ]
else
  check "outside a git checkout the tree is not counted" [ "$rc" = 0 ]
fi
[ "$fail" = 0 ] && echo "gpu-pack: OK"
exit "$fail"
