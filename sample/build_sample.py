#!/usr/bin/env python3
"""Builds sample/slimpajama-mini: a small dataset shaped like cerebras/SlimPajama-627B (chunked
.jsonl.zst files of {"text", "meta": {"redpajama_set_name"}} records) from redistributable text
in Debian packages. See sample/PROVENANCE.md. Deterministic: the same packages give the same files.

Usage (Debian bookworm): apt-get install bible-kjv bible-kjv-text wordnet-base unicode-cldr-core zstd
                         python3 sample/build_sample.py
Options --kjv-dir/--wordnet-dir/--cldr-dir/--bible-bin point at unpacked packages instead.
"""
import argparse
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "slimpajama-mini")


def kjv_chapters(bible_bin, kjv_dir):
    cmd = [bible_bin] + (["-p", kjv_dir] if kjv_dir else []) + ["gen1:1-rev22:21"]
    text = subprocess.run(cmd, capture_output=True, check=True, text=True).stdout
    docs, title, verses = [], None, []
    for line in text.splitlines():
        m = re.fullmatch(r"(\S.*\S) (\d+)", line)
        if m and not line.startswith(" "):
            if title:
                docs.append(title + "\n\n" + " ".join(verses))
            title, verses = line, []
        elif line.startswith("  ") and re.match(r"\s+\d+ ", line):
            verses.append(re.sub(r"^\s+\d+ ", "", line))
        elif line.strip() and verses:
            verses[-1] += " " + line.strip()
    if title:
        docs.append(title + "\n\n" + " ".join(verses))
    return docs


def wordnet_docs(wn_dir, n_docs=700):
    entries = []
    for part in ("noun", "verb", "adj", "adv"):
        with open(os.path.join(wn_dir, "data." + part), encoding="latin-1") as f:
            for line in f:
                if line.startswith("  ") or "|" not in line:
                    continue
                fields = line.split()
                words = [fields[4 + 2 * i].replace("_", " ") for i in range(int(fields[3], 16))]
                gloss = line.split("|", 1)[1].strip()
                entries.append(f"{words[0]} ({part}): {gloss}")
    rng = random.Random(11)
    rng.shuffle(entries)
    per = 30
    return ["\n".join(entries[i * per:(i + 1) * per]) for i in range(n_docs)]


def cldr_docs(cldr_dir):
    docs = []
    for path in sorted(glob.glob(os.path.join(cldr_dir, "common", "main", "*.xml"))):
        loc = os.path.basename(path)[:-4]
        if not re.fullmatch(r"[a-z]{2,3}", loc):
            continue
        txt = open(path, encoding="utf-8").read()
        langs = re.findall(r'<language type="[a-z]{2,3}">([^<]+)</language>', txt)
        terrs = re.findall(r'<territory type="[A-Z]{2}">([^<]+)</territory>', txt)
        months = re.findall(r"<month type=\"\d+\">([^<]+)</month>", txt)[:12]
        if len(langs) < 50:
            continue
        docs.append(f"{loc}\n" + ", ".join(langs[:150]) + "\n" + ", ".join(terrs[:120]) + "\n" + " ".join(months))
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bible-bin", default="bible")
    ap.add_argument("--kjv-dir", default=None, help="directory holding bible.data (default: the package's)")
    ap.add_argument("--wordnet-dir", default="/usr/share/wordnet")
    ap.add_argument("--cldr-dir", default="/usr/share/unicode/cldr")
    a = ap.parse_args()

    records = []
    for t in kjv_chapters(a.bible_bin, a.kjv_dir):
        records.append({"text": t, "meta": {"redpajama_set_name": "RedPajamaBook"}})
    for t in wordnet_docs(a.wordnet_dir):
        records.append({"text": t, "meta": {"redpajama_set_name": "RedPajamaWikipedia"}})
    for t in cldr_docs(a.cldr_dir):
        records.append({"text": t, "meta": {"redpajama_set_name": "RedPajamaCommonCrawl"}})
    rng = random.Random(627)
    rng.shuffle(records)

    n_hold = 40
    splits = {"validation": records[:n_hold], "test": records[n_hold:2 * n_hold], "train": records[2 * n_hold:]}
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    layout = {"train": (3, 8, "example_train"), "validation": (2, 2, "example_holdout"), "test": (2, 2, "example_holdout")}
    for split, recs in splits.items():
        chunks, files_per_chunk, stem = layout[split]
        nfiles = chunks * files_per_chunk
        for f in range(nfiles):
            chunk, idx = f // files_per_chunk + 1, f % files_per_chunk
            part = recs[f::nfiles]
            d = os.path.join(OUT, split, f"chunk{chunk}")
            os.makedirs(d, exist_ok=True)
            raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part).encode("utf-8")
            path = os.path.join(d, f"{stem}_{idx}.jsonl.zst")
            subprocess.run(["zstd", "-q", "-19", "--no-progress", "-f", "-o", path], input=raw, check=True)
    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write("# slimpajama-mini\n\nA tiny stand-in for cerebras/SlimPajama-627B built by sample/build_sample.py; "
                "see sample/PROVENANCE.md.\n")
    with open(os.path.join(OUT, ".gitattributes"), "w") as f:
        f.write("*.jsonl.zst filter=lfs diff=lfs merge=lfs -text\n")
    total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(OUT, "**", "*.zst"), recursive=True))
    print(f"{len(records)} documents, {total} compressed bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
