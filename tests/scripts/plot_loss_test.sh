#!/usr/bin/env bash
# scripts/plot-loss.py run as docs/ptk-train.md prints it (`python3 scripts/plot-loss.py ...`) by a python3 that
# has no matplotlib (a virtualenv first on PATH) while another Python has it: it reruns itself with
# that one; with no Python that has it, it names the interpreter and what to install.
# Usage: plot_loss_test.sh SOURCE_DIR
set -euo pipefail
SRC=$1
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || { echo "skip: /usr/bin/python3 has no matplotlib"; exit 77; }
/usr/bin/python3 -m venv --without-pip "$W/venv" >/dev/null 2>&1 || { echo "skip: no venv module"; exit 77; }
"$W/venv/bin/python3" -c 'import matplotlib' 2>/dev/null && fail "the venv sees matplotlib"
# An evaluation's record between the iterations' is passed over (the curve is the training loss).
printf '{"iteration": 1, "lm_loss": 10.5}\n{"iteration": 1, "consumed_samples": 4, "lm_loss_validation": 10.75, "lm_loss_validation_ppl": 46630.3}\n{"iteration": 2, "lm_loss": 9.25}\n' > "$W/metrics.jsonl"
out=$(cd "$SRC" && PATH=$W/venv/bin:$PATH python3 scripts/plot-loss.py "$W/metrics.jsonl" -o "$W/loss.png" 2>&1) ||
  fail "plot-loss under a Python without matplotlib: $out"
[ -s "$W/loss.png" ] || fail "no loss.png: $out"
echo "$out" | grep -q "has no matplotlib; running .*, which has it" || fail "no note on the interpreter: $out"
# No Python with matplotlib anywhere it looks: one line naming the interpreter and the remedy.
mkdir "$W/bin"
ln -s "$W/venv/bin/python3" "$W/bin/python3"
set +e
out=$(cd "$SRC" && PTK_PLOT_LOSS_REEXEC=1 PATH=$W/bin "$W/venv/bin/python3" scripts/plot-loss.py "$W/metrics.jsonl" \
  -o "$W/loss2.png" 2>&1)
rc=$?
set -e
[ "$rc" = 1 ] || fail "exit $rc without matplotlib: $out"
echo "$out" | grep -q "matplotlib is missing for $W/venv/bin/python3 .*python3-matplotlib" || fail "message: $out"
# A typo'd path or the --tensorboard-dir itself: one line (was a Python traceback), and the directory stands for
# its metrics.jsonl.
set +e
out=$(cd "$SRC" && python3 scripts/plot-loss.py "$W/metrcs.jsonl" -o "$W/loss3.png" 2>&1)
rc=$?
set -e
[ "$rc" = 1 ] || fail "exit $rc for a missing file: $out"
[ "$out" = "plot-loss: $W/metrcs.jsonl: no such file (ptk-train writes metrics.jsonl in its --tensorboard-dir, or at --metrics-file)" ] ||
  fail "a missing file: $out"
out=$(cd "$SRC" && python3 scripts/plot-loss.py "$W" -o "$W/loss4.png" 2>&1) || fail "a directory: $out"
[ -s "$W/loss4.png" ] || fail "a directory holding metrics.jsonl gave no loss4.png: $out"
echo "plot_loss_test: OK"
