#!/usr/bin/env bash
# The portable tree (scripts/make-portable.sh) on another, older Debian: a minimal Debian 11
# (bullseye, glibc 2.31) root file system made with debootstrap, where programs built here cannot
# run (they need glibc 2.34+). Inside it, from a path other than the one it was made at, the tree
# runs the pipeline: download from a fake Hub on the host (over loopback), extract, concat,
# tokenize, verify, train; the datasets equal this build's byte for byte, and the Slurm scripts in
# the tree find its programs.
# Usage: portable_test.sh SOURCE_DIR BUILD_DIR
# Exit 77 (skipped) without root (chroot), debootstrap, or the Debian mirror; the root file system is
# kept in BUILD_DIR/portable-rootfs-bullseye for the next run.
set -euo pipefail
SRC=$1
BUILD=$(cd "$2" && pwd)
SUITE=${PTK_PORTABLE_SUITE:-bullseye}
MIRROR=${PTK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
fail() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIPPED: $*"; exit 77; }

[ "$(id -u)" = 0 ] || skip "chroot needs root"
command -v debootstrap >/dev/null || skip "debootstrap is not installed (scripts/install-deps.sh installs it)"
ROOTFS=$BUILD/portable-rootfs-$SUITE
if [ ! -x "$ROOTFS/bin/bash" ]; then
  rm -rf "$ROOTFS.tmp"
  if ! debootstrap --variant=minbase "$SUITE" "$ROOTFS.tmp" "$MIRROR" > "$BUILD/portable-debootstrap.log" 2>&1; then
    tail -5 "$BUILD/portable-debootstrap.log"
    rm -rf "$ROOTFS.tmp"
    skip "debootstrap $SUITE from $MIRROR failed (is the mirror reachable?)"
  fi
  mv "$ROOTFS.tmp" "$ROOTFS"
fi

WORK=$(mktemp -d "$ROOTFS/tmp/ptk-portable-XXXXXX")
IN=/tmp/$(basename "$WORK")  # WORK as seen inside the root file system
HUB_PID=
cleanup() {
  [ -n "$HUB_PID" ] && kill "$HUB_PID" 2>/dev/null
  umount "$ROOTFS/proc" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
inside() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C "$@"; }

echo "== make the tree, then move it: nothing may point back to where it was made"
PTK_SKIP_BUILD=1 bash "$SRC/scripts/make-portable.sh" "$WORK/made/ptk" "$BUILD"
mkdir -p "$WORK/opt"
mv "$WORK/made/ptk" "$WORK/opt/ptk-moved"
rm -rf "$WORK/made"
T=$IN/opt/ptk-moved
mount -t proc proc "$ROOTFS/proc"

glibc=$(inside ldd --version | sed -n '1s/.* //p')
echo "== the system there: glibc $glibc"
[ "$glibc" = 2.31 ] || fail "expected glibc 2.31 in the $SUITE root file system, found ${glibc:-none}"
# Without the bundled loader (the tree's libraries, the system's glibc) the programs cannot run there.
mkdir -p "$WORK/no-glibc"
for l in "$WORK"/opt/ptk-moved/lib/ptk/*; do
  case "$(basename "$l")" in ld-linux*|libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*) ;; *) cp "$l" "$WORK/no-glibc/" ;; esac
done
if out=$(inside env LD_LIBRARY_PATH="$IN/no-glibc" "$T/libexec/ptk/ptk-tokenize" --help 2>&1); then
  fail "ptk-tokenize ran on the system's glibc 2.31: the test proves nothing"
fi
echo "$out" | grep -q "GLIBC_2\.3[2-9]' not found" || { echo "$out"; fail "unexpected failure on the system glibc"; }
echo "   as built: $(echo "$out" | grep -o "version .GLIBC_2\.3[2-9]. not found" | sed -n 1p)"

echo "== the pipeline inside $SUITE with the portable tree"
python3 "$SRC/tests/support/fake_hub.py" --repo-dir "$SRC/sample/slimpajama-mini" --port-file "$WORK/ports" \
  > "$WORK/hub.log" 2>&1 &
HUB_PID=$!
end=$((SECONDS + 60)); until [ -s "$WORK/ports" ] || [ $SECONDS -ge $end ]; do sleep 0.05; done  # python starts late under load
HUB=$(awk '/HUB/{print $2}' "$WORK/ports")
[ -n "$HUB" ] || { cat "$WORK/hub.log"; fail "the fake hub did not start"; }
pipeline() {  # BIN DIR: download, extract, concat, tokenize into DIR
  local b=$1 d=$2
  "$b/ptk-download" --quiet --repo cerebras/SlimPajama-627B --include 'train/**' --local-dir "$d/raw" --jobs 4 &&
    "$b/ptk-extract" --quiet "$d/raw" --output-dir "$d/extracted" &&
    "$b/ptk-concat" --quiet --input "$d/extracted" --output-dir "$d/chunks" --chunks 2 &&
    mkdir -p "$d/pre" &&
    for c in 00 01; do
      "$b/ptk-tokenize" --quiet --input "$d/chunks/train_$c.jsonl" --output-prefix "$d/pre/train_$c" --append-eod \
        --workers 2 || return 1
      "$b/ptk-inspect" "$d/pre/train_${c}_text_document" --verify || return 1
    done
}
inside env HF_ENDPOINT="$HUB" HF_TOKEN=hf_portable bash -c "$(declare -f pipeline); pipeline $T/bin $IN/inside" > "$WORK/inside.log" 2>&1 ||
  { cat "$WORK/inside.log"; fail "the pipeline failed inside $SUITE"; }
grep -c '^OK: ' "$WORK/inside.log" | grep -qx 2 || { cat "$WORK/inside.log"; fail "expected 2 verified datasets"; }
HF_ENDPOINT=$HUB HF_TOKEN=hf_portable pipeline "$BUILD/bin" "$WORK/host" > "$WORK/host.log" 2>&1 ||
  { cat "$WORK/host.log"; fail "the pipeline failed with this build"; }
for f in "$WORK"/host/pre/*.bin "$WORK"/host/pre/*.idx; do
  cmp -s "$f" "$WORK/inside/pre/$(basename "$f")" || fail "$(basename "$f") differs from this build's"
done
echo "   download (http via loopback), extract, concat, tokenize, verify: datasets identical to this build's"
inside "$T/bin/ptk-train" --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 \
  --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 4 --log-interval 2 --eval-iters 0 \
  --data-path "$IN/inside/pre/train_00_text_document" "$IN/inside/pre/train_01_text_document" \
  --data-cache-path "$IN/inside/cache" --save "$IN/inside/ckpt" > "$WORK/train.log" 2>&1 ||
  { cat "$WORK/train.log"; fail "ptk-train failed inside $SUITE"; }
grep -q 'iteration        4/       4' "$WORK/train.log" || { cat "$WORK/train.log"; fail "ptk-train did not reach 4"; }
echo "   ptk-train: 4 iterations and a checkpoint"
got=$(inside bash -c "STAGE_PATH=$IN/stage PTK_SLURM_DIR=$T/share/ptk/slurm; source $T/share/ptk/slurm/config.sh; echo \$PTK_BIN")
[ "$got" = "$T/bin" ] || fail "the tree's slurm/config.sh finds PTK_BIN=$got, not $T/bin"
echo "   share/ptk/slurm/config.sh finds the tree's programs: $got"
echo "PASS"
