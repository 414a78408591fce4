#!/usr/bin/env bash
# The house rules that a machine can check (CONTRIBUTING.md), run first by scripts/test.sh and as the
# CTest test check_rules (tests/scripts/check_rules_test.sh checks the check on planted violations):
#   size     no C++/CUDA file of a library or tools/ over 600 lines, but the allowlist below
#   flags    no InvalidArgumentError("--...") (or with fmt::format("--...")) in library code: a flag's
#            error is a UsageError, and
#            only a main knows a value came from a flag (tools/ may)
#   headers  every header of a library is included by some file
#   functions no function of a library or tools/ over 100 lines (found by scripts/function-lengths.py,
#            a heuristic), but the allowlist below
#   format   every C++/CUDA file of the libraries, tools/, tests/ and bench/ as clang-format 14 (Debian
#            bookworm's; scripts/install-deps.sh installs it) formats it with .clang-format, but
#            generated files (a first line that says GENERATED); skipped, with a note, without
#            clang-format 14 (other versions format differently)
# Each violation is printed as FILE:LINE: what; the exit status is 1 when there is one.
# Usage: scripts/check-rules.sh [ROOT]   (default: this checkout)
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
  -*) echo "check-rules: unknown option $1 (usage: scripts/check-rules.sh [ROOT])" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "check-rules: too many arguments (usage: scripts/check-rules.sh [ROOT])" >&2; exit 2; }
[ -z "${1:-}" ] || [ -d "$1" ] || { echo "check-rules: ROOT $1: no such directory" >&2; exit 2; }
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
ROOT=${1:-$(cd "$SCRIPTS/.." && pwd)}
cd "$ROOT"

LIBRARIES=(common tokenizer indexed_dataset tensorboard dataprep trainer interop)
MAX_LINES=600
FLAG_ERROR='InvalidArgumentError\((fmt::format\()?"--'
# Files allowed over MAX_LINES: data tables, and files being split.
SIZE_ALLOWLIST=(
)
MAX_FUNCTION_LINES=100
# Functions allowed over MAX_FUNCTION_LINES, as FILE:NAME: tables, and functions being cut.
FUNCTION_ALLOWLIST=(
  interop/torch_unpickle.cpp:Run       # the pickle opcodes' table: one case each
)
# Library files allowed an InvalidArgumentError("--...") (none).
FLAG_ALLOWLIST=()

violations=0
report() {
  echo "$*"
  violations=$((violations + 1))
}
listed() {  # listed NAME ALLOWLIST...
  local f=$1
  shift
  local a
  for a in "$@"; do [ "$a" = "$f" ] && return 0; done
  return 1
}
# The C++/CUDA files under the given folders, sorted, relative to ROOT.
sources() {
  local d
  for d in "$@"; do [ -d "$d" ] || { echo "check-rules: no folder $ROOT/$d" >&2; exit 2; }; done
  find "$@" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.c' -o -name '*.cpp' \
    -o -name '*.cc' -o -name '*.cu' \) | LC_ALL=C sort
}

# size
while IFS= read -r f; do
  n=$(wc -l <"$f")
  if [ "$n" -gt "$MAX_LINES" ] && ! listed "$f" "${SIZE_ALLOWLIST[@]}"; then
    report "$f:$((MAX_LINES + 1)): $n lines, over $MAX_LINES: split it along its seams"
  fi
done < <(sources "${LIBRARIES[@]}" tools)

# functions
mapfile -t function_files < <(sources "${LIBRARIES[@]}" tools)
if [ "${#function_files[@]}" -gt 0 ]; then
  while IFS= read -r hit; do
    [ -z "$hit" ] && continue
    f=${hit%%:*}
    rest=${hit#*:}
    line=${rest%%:*}
    read -r name n <<<"${rest#*: }"
    listed "$f:$name" "${FUNCTION_ALLOWLIST[@]}" && continue
    report "$f:$line: $name is $n lines, over $MAX_FUNCTION_LINES: cut it where its reference cuts it"
  done < <(python3 "$SCRIPTS/function-lengths.py" "$MAX_FUNCTION_LINES" "${function_files[@]}")
fi

# flags
while IFS= read -r f; do
  listed "$f" "${FLAG_ALLOWLIST[@]}" && continue
  while IFS= read -r hit; do
    report "$f:${hit%%:*}: InvalidArgumentError(\"--...\") in library code: return UsageError (common/status.h)," \
      "or let the main that knows the flag mark it (AsUsageError)"
  done < <(grep -nE "$FLAG_ERROR" "$f" || true)
done < <(sources "${LIBRARIES[@]}")

# headers: includers in any C++/CUDA file of the libraries, tools, tests and benchmarks (and the
# libraries' assembler templates, *.S.in)
includer_dirs=()
for d in "${LIBRARIES[@]}" tools tests bench; do [ -d "$d" ] && includer_dirs+=("$d"); done
includes=$(find "${includer_dirs[@]}" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.c' \
  -o -name '*.cpp' -o -name '*.cc' -o -name '*.cu' -o -name '*.in' \) -print0 |
  { xargs -0 -r grep -h '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' || true; } |
  sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]*)".*/\1/' | LC_ALL=C sort -u)
while IFS= read -r f; do
  case "$f" in *.h | *.hpp | *.cuh) ;; *) continue ;; esac
  grep -qxF "$f" <<<"$includes" || report "$f:1: no file includes this header: remove it, or include it where used"
done < <(sources "${LIBRARIES[@]}")

# format
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
if ! command -v "$CLANG_FORMAT" >/dev/null 2>&1; then
  echo "check-rules: note: no $CLANG_FORMAT: the format rule is skipped (scripts/install-deps.sh installs it)" >&2
elif ! "$CLANG_FORMAT" --version | grep -qE 'version 14\.'; then
  echo "check-rules: note: $("$CLANG_FORMAT" --version | head -1) is not clang-format 14: the format rule is" \
    "skipped (other versions format differently)" >&2
else
  format_dirs=()
  for d in "${LIBRARIES[@]}" tools tests bench; do [ -d "$d" ] && format_dirs+=("$d"); done
  to_format=()
  while IFS= read -r f; do
    head -1 "$f" | grep -q GENERATED || to_format+=("$f")
  done < <(sources "${format_dirs[@]}")
  if [ "${#to_format[@]}" -gt 0 ]; then
    declare -A format_seen=()
    while IFS= read -r hit; do
      f=${hit%%:*}
      [ -n "${format_seen[$f]:-}" ] && continue
      format_seen[$f]=1
      rest=${hit#*:}
      report "$f:${rest%%:*}: not as clang-format formats it: clang-format -i $f"
    done < <("$CLANG_FORMAT" --style=file --dry-run "${to_format[@]}" 2>&1 | grep -E '^[^ :]+:[0-9]+:[0-9]+: (warning|error):' || true)
  fi
fi

# Allowlist entries that no longer need to be there: a note, so that the list shrinks as files are
# split and fixed (not a failure: the file's own change may land before the list's).
for f in "${SIZE_ALLOWLIST[@]}"; do
  if [ ! -f "$f" ] || [ "$(wc -l <"$f")" -le "$MAX_LINES" ]; then
    echo "check-rules: note: $f is not over $MAX_LINES lines: take it off SIZE_ALLOWLIST" >&2
  fi
done
if [ "${#function_files[@]}" -gt 0 ]; then
  long_now=$(python3 "$SCRIPTS/function-lengths.py" "$MAX_FUNCTION_LINES" "${function_files[@]}" |
    sed -E 's/^([^:]+):[0-9]+: ([^ ]+) .*/\1:\2/')
  for entry in "${FUNCTION_ALLOWLIST[@]}"; do
    grep -qxF "$entry" <<<"$long_now" ||
      echo "check-rules: note: $entry is not over $MAX_FUNCTION_LINES lines: take it off FUNCTION_ALLOWLIST" >&2
  done
fi
for f in "${FLAG_ALLOWLIST[@]}"; do
  if [ ! -f "$f" ] || ! grep -qE "$FLAG_ERROR" "$f"; then
    echo "check-rules: note: $f has no InvalidArgumentError(\"--: take it off FLAG_ALLOWLIST" >&2
  fi
done

if [ "$violations" -gt 0 ]; then
  echo "check-rules: $violations violation(s) of the house rules (CONTRIBUTING.md)" >&2
  exit 1
fi
echo "check-rules: OK"
