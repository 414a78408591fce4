#!/usr/bin/env bash
# The CUDA backend's GPU checks as one command, in two halves (a GPU machine often has CUDA, cuDNN and
# PyTorch but none of the Debian -dev packages ptk builds against):
#
#   here, where the build dependencies and nvcc are:   bash scripts/gpu-check.sh pack [ARCHS]
#     builds build-cuda/ (Release, PTK_CUDA=ON, CUDA architectures ARCHS, default "80;90") and packs its
#     gpu-labelled tests, ptk-train and ptk-tokenize into .gpu/ with ../shared/gpu/pack.sh
#   there, from the project tree with .gpu/ copied in:  bash scripts/gpu-check.sh run [BENCH ARGS...]
#     runs every gpu-labelled test (each op against its CPU op, the whole model against the CPU model,
#     ptk-train end to end on the bundled sample: loss curves, determinism, kill + --load, checkpoints
#     across backends), then bench/bench_trainer_gpu.py (ptk-train beside PyTorch eager and compiled:
#     tokens/s, MFU, ratios). With OUT=DIR, every test log and the bench's output land in DIR.
#
# Exit status: non-zero when a test failed (the bench still runs and prints).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
case "${1:-}" in
  pack)
    archs=${2:-"80;90"}
    pack=${PTK_GPU_PACK:-$ROOT/../shared/gpu/pack.sh}
    [ -x "$pack" ] || [ -f "$pack" ] || { echo "gpu-check: no pack.sh at $pack (set PTK_GPU_PACK)" >&2; exit 2; }
    bash scripts/build.sh build-cuda -DCMAKE_BUILD_TYPE=Release -DPTK_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
      -DPTK_BUILD_BENCH=OFF
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    # The CUDA backend's module goes beside the programs (ptk-train loads it from its own folder).
    PROGRAMS="ptk-train ptk-tokenize ../lib/ptk/libptk_backend_cuda.so" bash "$pack" build-cuda .gpu
    echo "gpu-check: copy the project tree with .gpu/ to the GPU machine and run: bash scripts/gpu-check.sh run"
    ;;
  run)
    shift
    [ -f .gpu/run.sh ] || { echo "gpu-check: no .gpu/run.sh: run 'bash scripts/gpu-check.sh pack' first" >&2; exit 2; }
    out=${OUT:-}
    # The tests find the bundled sample through PTK_SOURCE_DIR and the packed programs on PATH.
    if [ -n "$out" ]; then
      PTK_SOURCE_DIR=$ROOT bash .gpu/run.sh python3 bench/bench_trainer_gpu.py "$@" 2>&1 | tee "$out/gpu-check.log"
      exit "${PIPESTATUS[0]}"
    fi
    PTK_SOURCE_DIR=$ROOT exec bash .gpu/run.sh python3 bench/bench_trainer_gpu.py "$@"
    ;;
  *)
    sed -n '2,16p' "$0"
    exit 2
    ;;
esac
