#!/usr/bin/env bash
# ptk-merge's progress (it was silent until done, over hundreds of GB of chunks): on a terminal a line
# per dataset copied, with the datasets and bytes done of the total, the rate and the ETA; --quiet
# prints none. PTK_PROGRESS_INTERVAL is longer than the run, so every line seen is the one drawn as a
# dataset is done (no periodic redraw). The terminal is script(1)'s pseudo-terminal.
# Usage: merge_progress_test.sh BIN_DIR
set -euo pipefail
BIN=$1
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v script >/dev/null || { echo "skip: no script(1)"; exit 77; }
for k in 0 1 2; do
  for i in $(seq 1 50); do printf '{"text": "dataset %d, document %d, a few words"}\n' "$k" "$i"; done > "$W/in$k.jsonl"
  "$BIN/ptk-tokenize" --quiet --input "$W/in$k.jsonl" --output-prefix "$W/p$k" --workers 1 >/dev/null 2>&1 ||
    fail "ptk-tokenize in$k.jsonl failed"
done
P="$W/p0_text_document $W/p1_text_document $W/p2_text_document"
PTK_PROGRESS_INTERVAL=3600 script -qfec "$BIN/ptk-merge --inputs $P --output-prefix $W/m" /dev/null > "$W/tty.txt" 2>&1 ||
  fail "ptk-merge failed: $(cat "$W/tty.txt")"
tr '\r' '\n' < "$W/tty.txt" | sed 's/\x1b\[K//g' > "$W/lines.txt"
for n in 1 2 3; do
  grep -Eq "^merge: $n/3 datasets, .* / .*, .*/s, ETA .*, elapsed " "$W/lines.txt" ||
    fail "no progress line for dataset $n of 3: $(cat "$W/lines.txt")"
done
grep -q "merged 3 datasets into $W/m" "$W/lines.txt" || fail "no summary: $(cat "$W/lines.txt")"
PTK_PROGRESS_INTERVAL=3600 script -qfec "$BIN/ptk-merge --quiet --force --inputs $P --output-prefix $W/m" /dev/null \
  > "$W/quiet.txt" 2>&1 || fail "ptk-merge --quiet failed: $(cat "$W/quiet.txt")"
if tr '\r' '\n' < "$W/quiet.txt" | grep -q "^merge: "; then fail "--quiet printed progress: $(cat "$W/quiet.txt")"; fi
echo "merge_progress_test: OK"
