#!/usr/bin/env bash
# Builds ptk: the one build recipe that README, CI (scripts/test.sh), the main job and the
# Dockerfile all run.
#
# Usage: scripts/build.sh [BUILD_DIR] [--target T]... [--install PREFIX] [--portable OUT] [-DVAR=VALUE]...
#   BUILD_DIR          default build/ (configured with Ninja, RelWithDebInfo, on first use)
#   --target T         build only these targets (default: everything the configuration enables)
#   --install PREFIX   then `cmake --install` into PREFIX: a relocatable tree (bin/, share/ptk/gpt2,
#                      share/ptk/slurm) that runs from wherever it is copied, on this distribution
#   --portable OUT     then scripts/make-portable.sh OUT: the same tree with its libraries and glibc
#                      bundled, for any x86-64 Linux
#   -DVAR=VALUE        passed to CMake, e.g. -DPTK_BUILD_TESTS=OFF -DPTK_BUILD_BENCH=OFF (programs only,
#                      as scripts/install-deps.sh --build-only provides for) or -DPTK_CUDA=OFF
# Environment: PTK_JOBS (parallel jobs, default nproc).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=build
targets=() defs=() install="" portable=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets+=(--target "${2:?--target needs a name}"); shift 2 ;;
    --install) install=${2:?--install needs a prefix}; shift 2 ;;
    --portable) portable=${2:?--portable needs a directory}; shift 2 ;;
    -D*) defs+=("$1"); shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    -*) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) BUILD=$1; shift ;;
  esac
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
JOBS=${PTK_JOBS:-$(nproc)}

first=()
[ -f "$BUILD/CMakeCache.txt" ] || first=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo)  # later -D values win
cmake -S "$ROOT" -B "$BUILD" "${first[@]}" "${defs[@]}" >/dev/null
cmake --build "$BUILD" -j "$JOBS" "${targets[@]}"
if [ -n "$install" ]; then
  cmake --install "$BUILD" --prefix "$install" >/dev/null
  echo "build.sh: installed into $install" >&2
fi
if [ -n "$portable" ]; then
  PTK_SKIP_BUILD=1 bash "$ROOT/scripts/make-portable.sh" "$portable" "$BUILD"
fi
