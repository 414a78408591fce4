#!/usr/bin/env bash
# Every flag of Megatron-LM's pretrain_gpt.py (tests/data/trainer/megatron_gpt_flags.txt, written by
# tests/support/list_megatron_flags.py from Megatron's own parser) is one ptk-train declares by that
# exact name: implemented, accepted with a note, or refused with a reason; none is a bare "unknown
# flag" (nor taken as the prefix of another flag). Each is given to ptk-train alone (with a value "1"
# where Megatron's takes one) and the output must not say "unknown flag" or "ambiguous option". The
# flags not classified yet are listed in tests/data/trainer/megatron_gpt_flags_unclassified.txt: a
# flag missing from both fails, and so does a listed flag that ptk-train knows now (the list only
# shrinks). First checks that the checker finds a made-up flag unknown. Prints the counts.
# Usage: megatron_flag_list_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
exec python3 - "$1/ptk-train" "$2/tests/data/trainer" <<'PY'
import re, subprocess, sys
TRAIN, DATA = sys.argv[1], sys.argv[2]

def rows(name):
    return [l.split() for l in open(f'{DATA}/{name}') if l.strip() and not l.startswith('#')]

help_text = subprocess.run([TRAIN, '--help'], capture_output=True, text=True).stdout
declared = {}  # --flag -> its --help description
lines = help_text.split('\n')
for i, line in enumerate(lines):  # CLI11: "  --a,--b TYPE", the description from column 34 or on the next line
    m = re.match(r'  ((?:--?[\w-]+,)*--?[\w-]+)', line)
    if m:
        after = lines[i + 1] if i + 1 < len(lines) else ''
        d = after.strip() if after.startswith(' ' * 34) else line[34:]
        for name in m.group(1).split(','):
            declared[name] = d
if len(declared) < 100: sys.exit(f'FAIL: {TRAIN} --help lists {len(declared)} flags')

def unknown(flag, kind):
    out = subprocess.run([TRAIN, flag] + (['1'] if kind != 'none' else []), capture_output=True, text=True)
    text = out.stdout + out.stderr
    return flag not in declared or 'unknown flag' in text or 'ambiguous option' in text

if not unknown('--ptk-made-up-megatron-flag', 'value'): sys.exit('FAIL: the checker took a made-up flag as known')
megatron = rows('megatron_gpt_flags.txt')
left = {r[0] for r in rows('megatron_gpt_flags_unclassified.txt')}
names = {f for f, _ in megatron}
bad = [f'{f}: listed as unclassified but no Megatron flag' for f in sorted(left - names)]
counts = {'implemented': 0, 'noted': 0, 'refused': 0, 'left': 0}
for flag, kind in megatron:
    if unknown(flag, kind):
        counts['left'] += 1
        if flag not in left:
            bad.append(f'{flag}: a bare unknown flag to ptk-train; implement it, alias it, accept it with a note '
                       '(tools/train_compat_flags.cpp) or refuse it saying what is missing')
        continue
    if flag in left:
        bad.append(f'{flag}: ptk-train knows it now; remove it from megatron_gpt_flags_unclassified.txt')
    d = declared[flag]
    counts['refused' if d.startswith('Not supported') else 'noted' if d.startswith('Accepted for') else
           'implemented'] += 1
print(f'Megatron pretrain_gpt.py flags: {len(megatron)};', ', '.join(f'{k} {v}' for k, v in counts.items()))
for b in bad: print('FAIL:', b)
sys.exit(1 if bad else 0)
PY
