#!/usr/bin/env bash
# Packs a CUDA build made here for a GPU machine that has the NVIDIA driver and CUDA libraries but no
# build environment (scripts/gpu-check.sh pack runs it; scripts/gpu-run.sh unpacks and runs it there).
#
# Usage: scripts/gpu-pack.sh BUILD_DIR [DEST=.gpu]      (PROGRAMS: the build's bin/ programs, default
#                                                        "ptk-train ptk-tokenize")
#
# DEST/ptk-gpu.tar.xz holds, under ptk-gpu/:
#   bin/ptk-*              the programs
#   tests/...              the gpu-labelled test binaries and gpu-tests.json (name, binary, arguments,
#                          whether it starts ptk-train)
#   <path in the build>    every shared library the build made itself (a CUDA backend module, say), at its
#                          place in the build tree, so a program finds it where it finds it in the build
#   lib/                   every other shared library those load, except glibc's, the CUDA toolkit's and
#                          the driver's (the GPU machine has its own: scripts/gpu-run.sh uses them)
#   build-versions.txt     `ptk-train --version`: the commit, and the CUDA, cuBLASLt, cuDNN and NCCL headers
#                          it was built with
# and DEST/run.sh (a copy of scripts/gpu-run.sh). Prints the pack's size; a pack over 48 MiB is refused
# (exit 1, DEST removed), and so is one that with the project tree (its tracked and untracked-not-ignored
# files, which travel beside it) is over the 64 MiB a device call carries (PTK_GPU_TRAVEL_LIMIT_MIB).
# xz -9 in one thread: its 64 MiB dictionary spans the test binaries, which share most of their code
# (about half the size of a multi-threaded -6 pack).
set -euo pipefail
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    -*) echo "gpu-pack.sh: unknown option $a (usage: gpu-pack.sh BUILD_DIR [DEST])" >&2; exit 2 ;;
  esac
done
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: gpu-pack.sh BUILD_DIR [DEST]" >&2; exit 2; }
[ -d "$1" ] || { echo "gpu-pack.sh: BUILD_DIR $1: no such directory" >&2; exit 2; }
build=$(cd "$1" && pwd)
out=${2:-.gpu}
here=$(cd "$(dirname "$0")" && pwd)
limit_mib=${PTK_GPU_PACK_LIMIT_MIB:-48}
travel_mib=${PTK_GPU_TRAVEL_LIMIT_MIB:-64}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
dest=$stage/ptk-gpu
mkdir -p "$dest/bin" "$dest/tests" "$dest/lib"
is_elf() { [ -f "$1" ] && [ "$(head -c4 "$1" | od -An -c | tr -d ' ')" = "177ELF" ]; }

for p in ${PROGRAMS:-ptk-train ptk-tokenize}; do
  is_elf "$build/bin/$p" || { echo "gpu-pack: no program $build/bin/$p (build it first)" >&2; exit 1; }
  cp -p "$build/bin/$p" "$dest/bin/"
done

# The gpu-labelled tests as CTest runs them (their binaries must lie in the build tree).
ctest --test-dir "$build" -N -L gpu --show-only=json-v1 > "$stage/ctest.json"
python3 - "$build" "$dest" "$stage/ctest.json" <<'PY'
import json, os, shutil, sys
build, dest, listing = sys.argv[1:4]
out = []
for t in json.load(open(listing))["tests"]:
    exe = t["command"][0]
    if not exe.startswith(build + "/"):
        sys.exit(f"gpu-pack: gpu test {t['name']} runs {exe}, outside the build")
    if not os.path.exists(exe):
        sys.exit(f"gpu-pack: gpu test {t['name']}: {exe} is not built")
    rel = os.path.relpath(exe, build)
    os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
    shutil.copy2(exe, os.path.join(dest, rel))
    env = [e for p in t.get("properties", []) if p.get("name") == "ENVIRONMENT" for e in p.get("value", [])]
    # starts_ptk_train: the test runs ptk-train (its environment names it), which loads the CUDA module's
    # libraries: gpu-run.sh holds it to their versions too.
    out.append({"name": t["name"], "exe": rel, "args": [a.replace(build, "@PACK@") for a in t["command"][1:]],
                "starts_ptk_train": any(e.startswith("PTK_TRAIN=") for e in env)})
if not out:
    sys.exit("gpu-pack: the build has no gpu-labelled tests (configured without CUDA?)")
json.dump(out, open(os.path.join(dest, "tests", "gpu-tests.json"), "w"), indent=1)
print(f"gpu-pack: {len(out)} gpu-labelled tests", file=sys.stderr)
PY

# Shared libraries the build made (a module loaded with dlopen is invisible to ldd): at their place in
# the build tree. Not the tests' stand-in driver (tests/gpu/fake_libcuda.c), nor CMake's own probes.
while IFS= read -r lib; do
  rel=${lib#"$build"/}
  case "$rel" in CMakeFiles/*|*/CMakeFiles/*|tests/fake_driver/*|libcuda.so*|*/libcuda.so*) continue ;; esac
  mkdir -p "$dest/$(dirname "$rel")"
  cp -P "$lib" "$dest/$rel"
  echo "gpu-pack: $rel (built here)" >&2
done < <(find "$build" \( -type f -o -type l \) -name 'lib*.so*' | sort)

# What those load, except glibc's, the CUDA toolkit's and the driver's.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libcuda\.so|libnvidia|libcudart|libcublas|libcudnn|libnccl|libnvrtc|libcurand|libcufft|libcusparse|libcusolver|libnvJitLink|libcupti)'
find "$dest" -type f ! -name '*.json' | while read -r f; do
  is_elf "$f" || continue
  ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    case "$path" in "$build"/*) continue ;; esac  # one of the build's own, packed above
    [[ $name =~ $skip ]] || [ -e "$dest/lib/$name" ] || cp -L "$path" "$dest/lib/$name"
  done
done
strip --strip-unneeded "$dest"/lib/* 2>/dev/null || true

# The versions the build was made with (gpu-run.sh compares the GPU machine's libraries with them).
if ! "$dest/bin/ptk-train" --version > "$dest/build-versions.txt" 2>/dev/null; then
  { echo "ptk-train (from the build's configuration; the program did not start here)"
    sed -n 's/^#define PTK_\([A-Z_]*\) "\(.*\)"$/\1: \2/p' "$build"/generated/ptk_build_config.h "$build"/generated/ptk_git_commit.h
  } > "$dest/build-versions.txt"
fi
cp "$here/gpu-run.sh" "$dest/run.sh"

rm -rf "$out"
mkdir -p "$out"
XZ_OPT="-9 -T1" tar -C "$stage" -cJf "$out/ptk-gpu.tar.xz" ptk-gpu
cp "$here/gpu-run.sh" "$out/run.sh"
bytes=$(du -cb "$out"/* | tail -1 | cut -f1)
unpacked=$(du -sb "$dest" | cut -f1)
mib() { awk -v b="$1" 'BEGIN{printf "%.1f MiB", b/1048576}'; }
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
  rm -rf "$out"
  echo "gpu-pack: the pack is $(mib "$bytes") ($(mib "$unpacked") unpacked), over the ${limit_mib} MiB limit: refused (fewer architectures, or PROGRAMS)" >&2
  exit 1
fi
# The project tree travels with the pack: their sum must fit one device call (where this is a git checkout).
root=$(cd "$here/.." && pwd)
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  tree=$(cd "$root" && git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
    awk '{s += $1} END {print s + 0}') || tree=0
  if [ $((tree + bytes)) -gt $((travel_mib * 1048576)) ]; then
    rm -rf "$out"
    echo "gpu-pack: the pack ($(mib "$bytes")) and the project tree $root ($(mib "$tree"): tracked and untracked-not-ignored files) make $(mib $((tree + bytes))), over the ${travel_mib} MiB a device call carries: refused (fewer architectures, or PROGRAMS; or a smaller tree)" >&2
    exit 1
  fi
fi
echo "gpu-pack: $out: $(mib "$bytes") ($(mib "$unpacked") unpacked; limit ${limit_mib} MiB)"
