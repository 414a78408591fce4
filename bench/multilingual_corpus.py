#!/usr/bin/env python3
"""A multilingual benchmark corpus from real text on this machine: Debian's translated message
catalogues (/usr/share/locale/*/LC_MESSAGES/*.mo: the translations, in 100+ languages and 30+
scripts) and translated manual pages (/usr/share/man/LANG/, roff markup stripped). One document
per catalogue or page, as JSON lines {"text": ..., "lang": ...}, in a fixed order, round-robin over
the languages (the corpus is the same bytes on machines with the same packages).

Usage: python3 bench/multilingual_corpus.py OUT.jsonl [--max-mb 24]
"""
import argparse
import glob
import gzip
import json
import os
import re
import struct
import sys


def mo_translations(path):
    """The msgstr texts of a GNU .mo file (plural forms split on NUL)."""
    data = open(path, "rb").read()
    if len(data) < 28:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    endian = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if endian is None:
        return []
    _, n, _, trans_off = struct.unpack(endian + "4I", data[4:20])
    out = []
    for i in range(1, n):  # entry 0 is the header
        length, off = struct.unpack(endian + "2I", data[trans_off + 8 * i:trans_off + 8 * i + 8])
        for s in data[off:off + length].split(b"\0"):
            try:
                t = s.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if t.strip():
                out.append(t)
    return out


ROFF_ESCAPE = re.compile(r"\\(f[BIRP]|f\(..|\(..|\*.|s[-+]?\d|[-&e|^ ])")


def man_text(path):
    try:
        raw = gzip.open(path).read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    lines = []
    for line in raw.splitlines():
        if line.startswith((".\\\"", "'\\\"")):
            continue
        if line.startswith("."):
            parts = line.split(None, 1)
            if len(parts) < 2 or parts[0] in (".TH", ".so", ".de", ".ds", ".nr", ".if", ".ie", ".el"):
                continue
            line = parts[1]
        lines.append(ROFF_ESCAPE.sub(lambda m: "-" if m.group(1) == "-" else "", line).replace('"', ""))
    return "\n".join(lines)


def documents():
    for path in sorted(glob.glob("/usr/share/locale/*/LC_MESSAGES/*.mo")):
        lang = path.split("/")[4]
        if lang.startswith("en"):
            continue
        texts = mo_translations(path)
        if texts:
            yield lang, "\n".join(texts)
    for path in sorted(glob.glob("/usr/share/man/*/man*/*.gz")):
        lang = path.split("/")[4]
        if lang.startswith("man") or lang.startswith("en"):
            continue
        text = man_text(path)
        if text.strip():
            yield lang, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-mb", type=float, default=24.0)
    a = ap.parse_args()
    total = ndocs = 0
    langs = set()
    # Round-robin over the languages, so that any prefix of the corpus holds every script.
    by_lang = {}
    for lang, text in documents():
        by_lang.setdefault(lang, []).append(text)
    order = []
    for i in range(max(len(v) for v in by_lang.values())):
        order += [(lang, v[i]) for lang, v in sorted(by_lang.items()) if i < len(v)]
    with open(a.out, "w", encoding="utf-8") as f:
        for lang, text in order:
            f.write(json.dumps({"text": text, "lang": lang}, ensure_ascii=False) + "\n")
            total += len(text.encode("utf-8"))
            ndocs += 1
            langs.add(lang)
            if total >= a.max_mb * 1e6:
                break
    if ndocs == 0:
        sys.exit("multilingual_corpus: no translated catalogues or manual pages found")
    print(f"{a.out}: {ndocs} documents, {total / 1e6:.1f} MB of text, {len(langs)} languages", file=sys.stderr)


if __name__ == "__main__":
    main()
