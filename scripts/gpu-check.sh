#!/usr/bin/env bash
# The CUDA backend's GPU check as one command, in two halves (a GPU machine often has the driver, CUDA,
# cuDNN and PyTorch but none of the Debian -dev packages ptk builds against):
#
#   here, where the build dependencies and nvcc are:   bash scripts/gpu-check.sh pack [ARCHS]
#     builds build-cuda/ (Release, PTK_CUDA=ON, no bench, CUDA architectures ARCHS, default 90: an H100
#     or H200; "80;90" for A100s too) and packs ptk-train, ptk-tokenize, the gpu-labelled tests and the
#     libraries they need into .gpu/ (scripts/gpu-pack.sh): prints its size, refuses one over 48 MiB
#   there, from the project tree with .gpu/ copied in:  bash scripts/gpu-check.sh run [--full] [BENCH ARGS...]
#     (scripts/gpu-run.sh) prints the driver, GPU and the CUDA, cuBLASLt, cuDNN and NCCL versions beside
#     the build's, runs every gpu-labelled test (each op against its CPU op, the whole model against the
#     CPU model, ptk-train end to end) under a time limit, then bench/bench_trainer_gpu.py (ptk-train
#     beside PyTorch eager at GPT-2 124M); the default quick profile ends within 9 minutes, --full adds
#     the slowest test cases, torch.compile and the 350M shape. With OUT=DIR the logs land in DIR (at
#     most five files; summary.txt, each test's verdict and seconds, is there however the run ends).
#     A library older than ptk needs fails the tests that load it, naming it. Ends with "N passed, N
#     failed, N skipped".
#
# Exit status: non-zero when a test failed or, where nvidia-smi lists a GPU, skipped; or the bench failed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
case "${1:-}" in
  pack)
    archs=${2:-90}
    defs=(-DCMAKE_BUILD_TYPE=Release -DPTK_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" -DPTK_BUILD_BENCH=OFF)
    # Configure, then build only what the pack holds: the programs, the gpu tests, and a CUDA backend
    # module where the build has one.
    first=()
    [ -f build-cuda/CMakeCache.txt ] || first=(-G Ninja)
    mkdir -p build-cuda  # build.sh below configures again and prints what it builds
    cmake -S . -B build-cuda "${first[@]}" "${defs[@]}" > build-cuda/configure.log 2>&1 ||
      { cat build-cuda/configure.log >&2; exit 1; }
    targets=(--target ptk-train --target ptk-tokenize)
    for t in $(ctest --test-dir build-cuda -N -L gpu | awk '/Test +#/ {print $3}'); do targets+=(--target "$t"); done
    # (The list is captured first: `grep -q` closing a pipe early SIGPIPEs its writer, and pipefail would
    # then leave the CUDA module out of the pack.)
    help=$(cmake --build build-cuda --target help)
    grep -q '^ptk_backend_cuda:' <<<"$help" && targets+=(--target ptk_backend_cuda)
    bash scripts/build.sh build-cuda "${defs[@]}" "${targets[@]}"
    PROGRAMS="ptk-train ptk-tokenize" bash scripts/gpu-pack.sh build-cuda .gpu
    echo "gpu-check: copy the project tree with .gpu/ to the GPU machine and run: bash scripts/gpu-check.sh run"
    ;;
  run)
    shift
    exec bash scripts/gpu-run.sh --pack "$ROOT/.gpu" "$@"
    ;;
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
  *)
    sed -n '2,/^[^#]/{/^#/p}' "$0" >&2  # the header comment (the fixed range 2-16 left out its exit status)
    exit 2
    ;;
esac
