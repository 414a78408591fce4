#!/usr/bin/env bash
# ptk-tokenize on a terminal: each "Processed N documents" log line is followed by the progress line
# saying N docs, not the count of the line's last periodic redraw (here never: PTK_PROGRESS_INTERVAL
# is longer than the run). The terminal is script(1)'s pseudo-terminal.
# Usage: tokenize_progress_test.sh BIN_DIR
set -euo pipefail
BIN=$1
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v script >/dev/null || { echo "skip: no script(1)"; exit 77; }
for i in $(seq 1 300); do printf '{"text": "document %d, a few words of text"}\n' "$i"; done > "$W/in.jsonl"
PTK_PROGRESS_INTERVAL=3600 script -qfec "$BIN/ptk-tokenize --input $W/in.jsonl --output-prefix $W/out --workers 1 \
  --log-interval 100" /dev/null > "$W/tty.txt" 2>&1 || fail "ptk-tokenize failed: $(cat "$W/tty.txt")"
# Split the terminal stream at the redraws (\r) and line ends.
tr '\r' '\n' < "$W/tty.txt" | sed 's/\x1b\[K//g' > "$W/lines.txt"
for n in 100 200 300; do
  grep -q "^Processed $n documents" "$W/lines.txt" || fail "no 'Processed $n documents' line: $(cat "$W/lines.txt")"
  awk -v n="$n" '$0 ~ "^Processed " n " documents" { seen = 1; next }
                 seen && /^tokenize: / { ok = ($2 == n); exit }
                 END { exit ok ? 0 : 1 }' "$W/lines.txt" ||
    fail "the progress line after 'Processed $n documents' does not say $n docs: $(cat "$W/lines.txt")"
done
echo "tokenize_progress_test: OK"
