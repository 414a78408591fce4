#!/usr/bin/env python3
"""Functions longer than a limit, for scripts/check-rules.sh.

A heuristic, not a parser: a function is a line at indentation 0 or 2 (a namespace's or a class's
member) that ends with `) {` (with const, override, noexcept or a trailing return type between),
and its body runs to the brace that closes it; braces inside string and character literals (raw
strings too) and comments are not counted. Lambdas and nested classes count toward the function
they sit in.

Usage: function-lengths.py MAX_LINES FILE...   prints FILE:LINE: NAME N for each one over MAX_LINES.
"""
import re
import sys

HEAD = re.compile(r'^ {0,2}[A-Za-z_~].*\)\s*(const)?\s*(override)?\s*(noexcept)?\s*(->\s*\S+)?\s*\{\s*$')
NOT_A_FUNCTION = re.compile(r'^\s*(if|for|while|switch|namespace|class|struct|enum|return|else|do)\b')
NAME = re.compile(r'([A-Za-z_~][\w:~]*)\s*\(')


def code_only(lines):
    """The lines with literals and comments blanked (one output line per input line)."""
    out, in_comment, raw_end = [], False, None
    for line in lines:
        text, i = '', 0
        while i < len(line):
            if raw_end is not None:
                j = line.find(raw_end, i)
                if j < 0:
                    i = len(line)
                    break
                i, raw_end = j + len(raw_end), None
                continue
            if in_comment:
                j = line.find('*/', i)
                if j < 0:
                    i = len(line)
                    break
                i, in_comment = j + 2, False
                continue
            if line.startswith('//', i):
                break
            if line.startswith('/*', i):
                in_comment, i = True, i + 2
                continue
            m = re.match(r'R"([^(\s]*)\(', line[i:])
            if m:
                raw_end, i = ')' + m.group(1) + '"', i + len(m.group(0))
                text += '""'
                continue
            c = line[i]
            if c in '"\'' and not (c == '\'' and i > 0 and line[i - 1].isalnum()):  # 1'000 digit separators
                j = i + 1
                while j < len(line) and line[j] != c:
                    j += 2 if line[j] == '\\' else 1
                i = j + 1
                text += '""'
                continue
            text += c
            i += 1
        out.append(text)
    return out


def long_functions(path, max_lines):
    raw = open(path, encoding='utf-8', errors='replace').read().split('\n')
    code = code_only(raw)
    i = 0
    while i < len(code):
        if HEAD.match(code[i]) and not NOT_A_FUNCTION.match(code[i]):
            depth, j = 0, i
            while j < len(code):
                depth += code[j].count('{') - code[j].count('}')
                if depth <= 0:
                    break
                j += 1
            n = j - i + 1
            if n > max_lines:
                names = NAME.findall(code[i])
                yield i + 1, names[0] if names else '?', n
            i = j + 1
            continue
        i += 1


def main():
    max_lines = int(sys.argv[1])
    for path in sys.argv[2:]:
        for line, name, n in long_functions(path, max_lines):
            print(f'{path}:{line}: {name} {n}')


if __name__ == '__main__':
    main()
