#!/bin/bash
# The kernels whose gpu tests compare a fused kernel bitwise with its unfused twin (LayerNorm and
# RMSNorm with the residual add or the dropout fused in, DropoutRows, ResidualAdd) spell out every
# rounding, so that nvcc's default --fmad=true cannot contract a * b + c into a multiply-add in one
# kernel and not in its twin. Checked without a GPU on their PTX, built with --fmad=true and with
# --fmad=false (trainer/cuda/CMakeLists.txt), file by file:
#   - the same instructions both ways once the .rn that --fmad=false writes on every add, sub and
#     mul is dropped (and the anonymous namespace's per-compile hash): nvcc's front end contracted
#     nothing;
#   - no bare mul.f32 / mul.f64 in the --fmad=true PTX: nothing left that ptxas may fuse with an add.
# Usage: cuda_fmad_test.sh "A.ptx;B.ptx;..." "A.ptx;B.ptx;..." (the two builds, in the same order).
set -euo pipefail
IFS=';' read -r -a with <<<"$1"
IFS=';' read -r -a without <<<"$2"
if [ "${#with[@]}" -eq 0 ] || [ "${#with[@]}" -ne "${#without[@]}" ]; then
  echo "cuda_fmad_test: ${#with[@]} and ${#without[@]} PTX files: expected the same non-zero count" >&2
  exit 1
fi
normalise() {
  sed -E 's/\b(add|sub|mul)\.rn\.(f32|f64)/\1.\2/g; s/[0-9]*_GLOBAL__N__[A-Za-z0-9_]*_cu_[0-9a-f]{8}_[0-9]+/ANON/g' "$1"
}
failed=0
for i in "${!with[@]}"; do
  a=${with[$i]} b=${without[$i]}
  if [ "$(basename "$a")" != "$(basename "$b")" ]; then
    echo "cuda_fmad_test: $a and $b are not the same source's" >&2
    exit 1
  fi
  name=$(basename "$a" .ptx)
  bad=0
  if ! grep -q '^\.visible \.entry\|^\.entry\|^\.weak \.entry' "$a"; then
    echo "FAIL $name: no kernels in $a" >&2
    failed=1
    continue
  fi
  if ! diff <(normalise "$a") <(normalise "$b") >/dev/null; then
    echo "FAIL $name: its PTX depends on --fmad (a product and a sum not spelled out with __fmaf_rn," \
      "__fmul_rn, __fadd_rn or their double forms); first differences:" >&2
    diff <(normalise "$a") <(normalise "$b") | head -n 8 >&2 || true
    bad=1
  fi
  bare=$(grep -cE '^\s*mul\.f(32|64)\b' "$a" || true)
  if [ "$bare" -ne 0 ]; then
    echo "FAIL $name: $bare bare mul.f32/mul.f64 in the --fmad=true PTX (ptxas may fuse them with an add):" >&2
    grep -nE '^\s*mul\.f(32|64)\b' "$a" | head -n 5 >&2
    bad=1
  fi
  if [ "$bad" -eq 0 ]; then echo "ok   $name"; else failed=1; fi
done
exit "$failed"
