#!/usr/bin/env bash
# Nothing stale in README.md and docs/*.md: every ptk-* word names a tool of tools/CMakeLists.txt (or
# one of the file, lock and pod names listed below), and every --flag written after a tool's name on
# a line (continuation lines joined; up to a pipe, ;, &, a comment's # or a closing backtick) is in
# that tool's --help or one of its subcommands' (ptk-tokenize also takes argparse's prefixes, as
# preprocess_data.py does). And every relative link of README.md and docs/*.md ([text](path) or
# [text](path#anchor)) names a file or directory that exists, and an anchor into a Markdown file names
# one of its headings (GitHub's anchors). First checks that the checkers fail on a stale tool, a stale
# flag, a link to no file and an anchor to no heading.
# Usage: docs_flags_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$1
SRC=$2
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
# ptk-* words that are not tools: outputs' marker, lock and temporary names, directories, pods, a flag.
NOT_TOOLS="ptk-done ptk-lock ptk-pyref ptk-tmp ptk-stage ptk-resume ptk-publish ptk-old ptk-extracting
  ptk-train-master ptk-train-worker ptk-train-0 ptk-profile-ops ptk-ckpt"

check() {  # check ROOT: README.md and docs/*.md under ROOT
  python3 - "$BIN" "$SRC" "$1" "$NOT_TOOLS" <<'PY'
import glob, os, re, subprocess, sys
BIN, SRC, ROOT, NOT_TOOLS = sys.argv[1], sys.argv[2], sys.argv[3], set(sys.argv[4].split())
TOOLS = re.findall(r'ptk_add_tool\((ptk-[a-z]+)', open(os.path.join(SRC, 'tools/CMakeLists.txt')).read())
ABBREV = {'ptk-tokenize'}
FLAG = r'(?<![\w-])(--[a-z0-9][a-z0-9-]*)'

def help_flags(tool):
    run = lambda *a: subprocess.run([os.path.join(BIN, tool), *a, '--help'], capture_output=True, text=True).stdout
    text = run()
    if not text: sys.exit(f'FAIL: {tool} --help printed nothing (is {BIN}/{tool} built?)')
    m = re.search(r'^Subcommands:\n((?:  \S.*\n?)+)', text, re.M)
    for sub in re.findall(r'^  (\S+)', m.group(1), re.M) if m else []:
        text += run(sub)
    return set(re.findall(FLAG, text))

flags = {t: help_flags(t) for t in TOOLS}
def known(tool, f):
    return f in flags[tool] or (tool in ABBREV and any(g.startswith(f) for g in flags[tool]))

bad = []
for doc in [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md'))):
    name = os.path.relpath(doc, ROOT)
    for line in open(doc).read().replace('\\\n', ' ').split('\n'):
        for w in re.findall(r'(?<![\w.-])(ptk-[a-z][a-z0-9-]*)', line):
            if w not in TOOLS and w not in NOT_TOOLS and not any(w.startswith(x + '-') for x in NOT_TOOLS):
                bad.append(f'{name}: "{w}" is no ptk tool (tools: {" ".join(TOOLS)})')
        for m in re.finditer(r'(?<![\w-])(ptk-[a-z]+)\b([^`|;&#]*)', line):
            if m.group(1) in flags:
                bad += [f'{name}: {m.group(1)} {f} is not in its --help: {line.strip()[:120]}'
                        for f in re.findall(FLAG, m.group(2)) if not known(m.group(1), f)]
for b in sorted(set(bad)): print('FAIL:', b)
sys.exit(1 if bad else 0)
PY
}

links() {  # links ROOT: the relative links of README.md and docs/*.md under ROOT
  python3 - "$1" <<'PY'
import glob, os, re, sys
ROOT = sys.argv[1]

def slugs(path):  # GitHub's heading anchors of a Markdown file (outside code blocks)
    out, seen, code = set(), {}, False
    for line in open(path, encoding='utf-8'):
        if line.startswith('```'): code = not code
        m = None if code else re.match(r'#{1,6} +(.*?) *#* *$', line.rstrip('\n'))
        if not m: continue
        s = re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
        n = seen.get(s, 0); seen[s] = n + 1
        out.add(s if n == 0 else f'{s}-{n}')
    return out

bad = []
for doc in [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md'))):
    name, code = os.path.relpath(doc, ROOT), False
    for n, line in enumerate(open(doc, encoding='utf-8'), 1):
        if line.startswith('```'): code = not code
        if code: continue
        for target in re.findall(r'\]\(([^)\s]+)\)', line):
            if re.match(r'[a-z][a-z0-9+.-]*:', target): continue  # https:, mailto:
            path, _, anchor = target.partition('#')
            full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(full):
                bad.append(f'{name}:{n}: link to {target}: no such file')
            elif anchor and full.endswith('.md') and anchor not in slugs(full):
                bad.append(f'{name}:{n}: link to {target}: {os.path.relpath(full, ROOT)} has no heading #{anchor}')
for b in bad: print('FAIL:', b)
sys.exit(1 if bad else 0)
PY
}

# The checkers can fail: a stale tool name, a stale flag, a link to no file and to no heading are found.
mkdir -p "$W/docs"
printf 'Run `ptk-train --data-path x --no-such-flag 1`.\n' > "$W/README.md"
printf 'build/bin/ptk-preprocess --input x\n' > "$W/docs/old.md"
if out=$(check "$W" 2>&1); then echo "FAIL: the checker passed stale docs" >&2; exit 1; fi
grep -q 'ptk-train --no-such-flag' <<<"$out" || { echo "FAIL: stale flag not found: $out" >&2; exit 1; }
grep -q '"ptk-preprocess" is no ptk tool' <<<"$out" || { echo "FAIL: stale tool not found: $out" >&2; exit 1; }
printf '# Old\n\n## A heading\n\nSee [gone](docs/gone.md), [old](docs/old.md#no-heading) and [ok](#a-heading).\n' > "$W/README.md"
if out=$(links "$W" 2>&1); then echo "FAIL: the link checker passed broken links" >&2; exit 1; fi
grep -q 'README.md:5: link to docs/gone.md: no such file' <<<"$out" || { echo "FAIL: missing file not found: $out" >&2; exit 1; }
grep -q 'docs/old.md has no heading #no-heading' <<<"$out" || { echo "FAIL: missing anchor not found: $out" >&2; exit 1; }
if grep -q '#a-heading' <<<"$out"; then echo "FAIL: a good anchor was refused: $out" >&2; exit 1; fi

check "$SRC"
links "$SRC"
echo "docs_flags_test: README.md and docs/*.md name only tools and flags that exist, and link only to files and headings that exist"
