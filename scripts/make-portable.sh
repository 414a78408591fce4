#!/usr/bin/env bash
# Makes a portable ptk tree for CPU nodes without containers: it runs on any x86-64 Linux (kernel
# 3.2 or newer), whatever its glibc and libraries, from wherever it is copied.
#
# Usage: scripts/make-portable.sh OUT_DIR [BUILD_DIR]      (BUILD_DIR: build, built first)
#
#   OUT_DIR/bin/ptk-*          launchers: run the program below with the bundled loader and libraries
#   OUT_DIR/libexec/ptk/ptk-*  the programs (as `cmake --install` puts them in bin/)
#   OUT_DIR/lib/ptk/           every shared library they load, glibc and its loader included, and the
#                              CUDA backend's module with its CUDA libraries (loaded for --device cuda only)
#   OUT_DIR/share/ptk/         the GPT-2 files and the slurm/ scripts (PTK_BIN defaults to OUT_DIR/bin)
#
# Why a loader and not only an $ORIGIN rpath: programs built on Debian bookworm need glibc 2.34+
# symbols, which older systems (RHEL 8: 2.28, Debian 11: 2.31) lack; the bundled loader runs them
# with the bundled glibc and never touches the system's. Nothing is installed or set for child
# processes (no LD_LIBRARY_PATH). https finds the system's CA certificates (see FindCaBundle).
set -euo pipefail
# An option is never taken for OUT_DIR (--help built everything, then wrote the tree into ./--help).
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    -*) echo "make-portable: unknown option $a (usage: scripts/make-portable.sh OUT_DIR [BUILD_DIR])" >&2; exit 2 ;;
  esac
done
[ $# -le 2 ] || { echo "make-portable: too many arguments (usage: scripts/make-portable.sh OUT_DIR [BUILD_DIR])" >&2; exit 2; }
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/make-portable.sh OUT_DIR [BUILD_DIR]}
BUILD=${2:-build}

[ "$(uname -m)" = x86_64 ] || { echo "make-portable: x86-64 only" >&2; exit 2; }
if [ "${PTK_SKIP_BUILD:-0}" != 1 ]; then  # the tests set it: their build is done
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  fi
  cmake --build "$BUILD" -j "${PTK_JOBS:-$(nproc)}" >/dev/null
fi

stage="$OUT.ptk-tmp-$$"
rm -rf "$stage"
trap 'rm -rf "$stage"' EXIT
cmake --install "$BUILD" --prefix "$stage" >/dev/null
mkdir -p "$stage/libexec/ptk" "$stage/lib/ptk"
programs=()
for p in "$stage"/bin/ptk-*; do
  name=$(basename "$p")
  mv "$p" "$stage/libexec/ptk/$name"
  programs+=("$name")
done
[ ${#programs[@]} -gt 0 ] || { echo "make-portable: no ptk programs were installed from $BUILD" >&2; exit 1; }
# The CUDA backend (where the build has one): a module that ptk-train loads from lib/ptk/ only for
# --device cuda; its CUDA libraries are bundled beside it, and a CPU run never loads them.
modules=()
for m in "$stage"/lib/ptk/libptk_backend_*.so; do [ -f "$m" ] && modules+=("$m"); done
strip --strip-debug "$stage"/libexec/ptk/ptk-* "${modules[@]}"  # debug info stays in the build tree

# The libraries: what ldd resolves for each program (glibc and the loader included), plus what
# oneTBB and cuDNN load by name at run time (the scalable allocator; cuDNN's sub-libraries).
loader=""
declare -A libs=()
for name in "${programs[@]}"; do
  while read -r line; do
    case "$line" in
      *"=> not found"*) echo "make-portable: $name: ${line%% *} not found" >&2; exit 1 ;;
      *"libcuda.so"*|*"libnvidia-"*) ;;  # the GPU driver's: always the host's own
      *"=> /"*) path=${line#*=> }; libs[${path%% (*}]=1 ;;
      /*ld-linux*) loader=${line%% (*} ;;
    esac
  done < <(ldd "$stage/libexec/ptk/$name")
done
for m in "${modules[@]}"; do
  while read -r line; do
    case "$line" in
      *"=> not found"*) echo "make-portable: $(basename "$m"): ${line%% *} not found" >&2; exit 1 ;;
      *"libcuda.so"*|*"libnvidia-"*) ;;
      *"=> /"*) path=${line#*=> }; libs[${path%% (*}]=1 ;;
    esac
  done < <(ldd "$m")
done
[ -n "$loader" ] || { echo "make-portable: no dynamic loader found by ldd" >&2; exit 1; }
for l in "${!libs[@]}"; do
  case "$(basename "$l")" in
    libtbb.so.*) for m in "$(dirname "$l")"/libtbbmalloc.so.2; do [ -f "$m" ] && libs[$m]=1; done ;;
    # cuDNN 9 loads its graph, engine and heuristic libraries by name at run time (ldd does not see
    # them): without them the CUDA backend's fused attention fails on the first bf16 step.
    libcudnn.so.*) for m in "$(dirname "$l")"/libcudnn_*.so.9; do [ -f "$m" ] && libs[$m]=1; done ;;
  esac
done
for l in "${!libs[@]}" "$loader"; do cp -L "$l" "$stage/lib/ptk/$(basename "$l")"; done
cp -L "$loader" "$stage/lib/ptk/ld-linux-x86-64.so.2"

for name in "${programs[@]}"; do
  cat > "$stage/bin/$name" <<EOF
#!/bin/sh
# ptk portable tree: runs libexec/ptk/$name with the glibc and libraries bundled in lib/ptk
# (made by scripts/make-portable.sh; the system's own libraries are not used).
self=\$(readlink -f "\$0" 2>/dev/null) || self=\$0
root=\${self%/bin/*}
exec "\$root/lib/ptk/ld-linux-x86-64.so.2" --library-path "\$root/lib/ptk" --argv0 "\$0" "\$root/libexec/ptk/$name" "\$@"
EOF
  chmod 755 "$stage/bin/$name"
done
# Each launcher runs here, from the staging path (nothing points back to the build); each module's
# libraries resolve inside the tree.
for m in "${modules[@]}"; do
  if ! deps=$("$stage/lib/ptk/ld-linux-x86-64.so.2" --library-path "$stage/lib/ptk" --list "$m" 2>&1) ||
     [[ $deps == *"not found"* ]]; then
    echo "make-portable: $(basename "$m") in the portable tree: $deps" >&2; exit 1
  fi
done
# Each launcher runs here, from the staging path (nothing points back to the build).
for name in "${programs[@]}"; do
  "$stage/bin/$name" --help >/dev/null || { echo "make-portable: $name --help failed in the portable tree" >&2; exit 1; }
done

rm -rf "$OUT"
mkdir -p "$(dirname "$OUT")"
mv "$stage" "$OUT"
trap - EXIT
echo "make-portable: $OUT: ${#programs[@]} programs, $(ls "$OUT/lib/ptk" | wc -l) libraries ($(du -sh "$OUT" | cut -f1)); glibc $(ldd --version | head -1 | awk '{print $NF}') bundled"
