#!/usr/bin/env bash
# docs/cluster.md's "try this path on one machine" lines, run as printed in one shell from the checkout: a
# local Slurm, the bundled sample served as the Hub, the shrunk pipeline submitted, waited for, and judged
# complete by status.sh, then everything stopped. Only their /tmp/ paths are moved into a directory of this
# test's own (two runs of the suite never share a state directory), and the ports are free ones.
# Usage: cluster_doc_test.sh BIN_DIR SOURCE_DIR      (exit 77 = skipped: not root)
set -euo pipefail
BIN=$1
SRC=$2
[ "$(id -u)" = 0 ] || { echo "SKIP: a local Slurm needs root"; exit 77; }
export PATH="$PATH:/usr/sbin:/sbin"
W=$(mktemp -d /tmp/ptk-cdoc-XXXXXX)
fail() { echo "FAIL: $*" >&2; exit 1; }
GROUP=
cleanup() {
  [ -z "$GROUP" ] || kill -- "-$GROUP" 2>/dev/null || true  # the block's shell and its Hub, if a line failed
  "$SRC/tests/slurm/stop-slurm.sh" --purge "$W/slurm-local" >/dev/null 2>&1 || true
  rm -rf "$W"
}
trap cleanup EXIT

# The code block of docs/cluster.md that starts a local Slurm.
python3 - "$SRC/docs/cluster.md" > "$W/block.sh" <<'PY'
import re, sys
blocks = re.findall(r'^```[a-z]*\n(.*?)^```', open(sys.argv[1]).read(), re.M | re.S)
print(''.join(b for b in blocks if 'start-slurm.sh' in b), end='')
PY
grep -q 'start-slurm.sh' "$W/block.sh" && grep -q 'slurm/status.sh' "$W/block.sh" ||
  fail "no local-Slurm block in docs/cluster.md: $(cat "$W/block.sh")"
sed -i "s|/tmp/|$W/|g" "$W/block.sh"
# Free ports below the ephemeral range (free-ports.py: another test's port-0 bind or connection cannot take them),
# reserved while this shell lives (--hold): a trainer test beside it cannot pick them as a MASTER_PORT.
read -r SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT < <(python3 "$SRC/tests/slurm/free-ports.py" 2 --hold $$)
export SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT PTK_BIN=$BIN
# The block in one shell (its exports and its background Hub carry from line to line), stopping at the first
# line that fails; in a process group of its own, which the clean-up ends if a line before `kill %1` failed.
cd "$SRC"
setsid bash -e "$W/block.sh" > "$W/out" 2>&1 &
GROUP=$!
set +e
wait "$GROUP"
rc=$?
set -e
cat "$W/out"
[ "$rc" = 0 ] || fail "docs/cluster.md's local Slurm lines failed (exit $rc)"
grep -q '^status: every stage is complete' "$W/out" || fail "status.sh did not find the pipeline complete"
[ -f "$W/ptk-stage/checkpoints/latest_checkpointed_iteration.txt" ] || fail "no checkpoint in $W/ptk-stage/checkpoints"
echo "cluster_doc_test: OK"
