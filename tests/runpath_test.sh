#!/usr/bin/env bash
# No program or library of the build has an empty element in its RUNPATH/RPATH (CMake padded the
# build-tree RUNPATH for its install-time rewrite: '$ORIGIN/../lib/ptk:', '/usr/local/cuda/lib:'):
# an empty element makes the loader search the current directory, so a libfoo.so wherever the program
# is started from would be loaded, and scripts/gpu-pack.sh packs these build-tree files as they are.
# ptk-train still finds its CUDA backend in lib/ptk/ beside bin/.
# Usage: runpath_test.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: runpath_test.sh BUILD_DIR}
fail=0 checked=0
while IFS= read -r -d '' f; do
  head -c 4 "$f" 2>/dev/null | grep -q $'^\x7fELF' || continue
  paths=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(\(RUNPATH\|RPATH\)).*: \[\(.*\)\]$/\2/p')
  checked=$((checked + 1))
  [ -n "$paths" ] || continue
  while IFS= read -r p; do
    case ":$p:" in
      *::*) echo "FAIL: ${f#"$build"/}: an empty element in its RUNPATH [$p]"; fail=1 ;;
    esac
  done <<< "$paths"
done < <(find "$build/bin" "$build/lib" "$build/tests" -path '*/CMakeFiles' -prune -o -type f -print0 2>/dev/null)
[ "$checked" -gt 0 ] || { echo "FAIL: no ELF file under $build/bin, lib, tests"; exit 1; }
train_rp=$(readelf -d "$build/bin/ptk-train" | sed -n 's/.*(RUNPATH).*: \[\(.*\)\]$/\1/p')
[ "$train_rp" = '$ORIGIN/../lib/ptk' ] || { echo "FAIL: ptk-train's RUNPATH is [$train_rp], not [\$ORIGIN/../lib/ptk]"; fail=1; }
[ "$fail" = 0 ] && echo "runpath_test: $checked ELF files, no empty RUNPATH element"
exit "$fail"
