#!/usr/bin/env python3
"""Assembles the tokenizer golden corpus: tests/data/tokenizer/corpus.jsonl.

One JSON object per line: {"name": ..., "text": ...}, or for big inputs that are cheaper to
regenerate than to store {"name": ..., "repeat": UNIT, "count": N} (text = UNIT * N).

Sources, all redistributable:
  * hand-written edge cases (below);
  * Unicode CLDR 41 (Debian package unicode-cldr-core, Unicode-DFS-2016 licence): localized
    language/territory names and emoji annotations, i.e. real text in ~100 scripts/languages;
  * WordNet 3.0 glosses (Debian package wordnet-base, WordNet licence): English prose;
  * deterministic random strings over an adversarial alphabet.

Usage: python3 tests/support/make_tokenizer_corpus.py [--cldr DIR] [--wordnet DIR] > tests/data/tokenizer/corpus.jsonl
(the directories default to the Debian install locations; `apt-get install unicode-cldr-core wordnet-base`).
"""
import argparse
import glob
import json
import os
import random
import re
import sys

WS = ["\t", "\n", "\v", "\f", "\r", " ", "\x85", "\xa0", "\u1680"] + [chr(c) for c in range(0x2000, 0x200B)] + \
     ["\u2028", "\u2029", "\u202f", "\u205f", "\u3000"]
NOT_WS = ["\x1c", "\x1d", "\x1e", "\x1f", "\u180e", "\u200b", "\u2060", "\ufeff"]


def edge_cases():
    c = []
    add = lambda name, text: c.append({"name": name, "text": text})
    add("notes-1", "Hello world")
    add("notes-2", " Hello  world\n\n")
    add("notes-3", "I'm  here")
    add("notes-4", "Ünïcödé 😀")
    add("empty", "")
    for i, t in enumerate(["don't", "DON'T", "I'LL", "we've", "they're", "it'd", "I'm", "'s'S'", "''s", " 's", "!!'s",
                           "don'texist", "'", "''", "'re've'll'd'm't's", "x's's", "'st", "'rE", "'Re", "’s", "l'amour",
                           "rock 'n' roll", "'ll've", "a'b'c", "1's", " ' s", "'\n's"]):
        add(f"contraction-{i}", t)
    for i, w in enumerate(WS):
        for j, pat in enumerate(["a{w}b", "a{w}{w}b", "{w}", "a{w}", "{w}a", "a {w} b", "{w} a", "a{w} ", " {w}{w} x",
                                 "x{w}{w}{w}y", "1{w}2", "!{w}?", "{w}'s", "é{w}{w}中"]):
            add(f"ws-{i}-{j}", pat.format(w=w))
    for i, w in enumerate(NOT_WS):
        for j, pat in enumerate(["a{w}b", "{w}", " {w} ", "{w}{w}a", "1{w}1"]):
            add(f"notws-{i}-{j}", pat.format(w=w))
    for i, t in enumerate(["x  \n  y", "a\t\tb", "a   b", "line1\r\nline2\r\n", "\n\n\n", "   ", "\t \t", " \n", "\n ",
                           "a \n b", "end with space ", "end with spaces   ", "  lead", "\u3000\u3000x", "mix \u00a0\u00a0 y",
                           "tabs\tand\tspaces  \t  here"]):
        add(f"wsmix-{i}", t)
    for i, t in enumerate(["1234567890", "3.14159", "１２３", "²³½Ⅻ", "1²½Ⅻ 3", "١٢٣", "٣٫١٤", "१२३", "௧௨௩", "〇一二",
                           "12,345,678.90", "0x1F600", "1e-10", "2024-11-22T12:00:00Z", "$100", "100%", "v1.2.3",
                           "123456789012345678901234567890"]):
        add(f"digits-{i}", t)
    for i, t in enumerate(["👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇩🇪🇯🇵🇺🇸", "1️⃣", "😀😃😄😁", "❤️", "🧑🏿‍🚀",
                           "I ❤️ NY 🗽", "☃", "✓✗", "emoji😀inside", "🫠🫡🫥", "👩🏻‍❤️‍💋‍👨🏼"]):
        add(f"emoji-{i}", t)
    for i, t in enumerate(["e\u0301te\u0301", "क्षेत्र", "nai\u0308ve", "Z̸̡̢̛̗̘̙̜̝̞̟̠", "שָׁלוֹם", "สวัสดีครับ",
                           "ሰላም", "안녕하세요", "각", "Ελληνικά", "Привет, мир!", "مرحبا بالعالم", "नमस्ते दुनिया",
                           "বাংলা", "ਪੰਜਾਬੀ", "ગુજરાતી", "ଓଡ଼ିଆ", "தமிழ்", "తెలుగు", "ಕನ್ನಡ", "മലയാളം", "සිංහල",
                           "ລາວ", "བོད་སྐད་", "မြန်မာ", "ខ្មែរ", "ქართული", "Հայերեն", "ᠮᠣᠩᠭᠣᠯ", "ᏣᎳᎩ", "ᐃᓄᒃᑎᑐᑦ",
                           "ߒߞߏ", "ܣܘܪܝܝܐ", "ދިވެހި", "𐌰𐌱𐌲", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝟘𝟙𝟚", "ℌℑℜ", "ﬁﬂ", "Ǆǅǆ", "ᾈᾉ"]):
        add(f"script-{i}", t)
    for i, t in enumerate(["你好，世界！", "日本語のテキストです。", "한국어 텍스트", "中文English混合123", "ｆｕｌｌｗｉｄｔｈ",
                           "｢半角｣ｶﾀｶﾅ", "〜〜〜", "。。。"]):
        add(f"cjk-{i}", t)
    for i, t in enumerate(["a<|endoftext|>b", "<|endoftext|>", "x <|endoftext|> y", "<|endoftext|><|endoftext|>",
                           "<|endoftext", "<|ENDOFTEXT|>", "text\n<|endoftext|>\nmore", " <|endoftext|>", "<|endoftext|> ",
                           "<|endoftext|>'s", "1<|endoftext|>2", "<<|endoftext|>>", "<|endoftext|>|>"]):
        add(f"eot-{i}", t)
    for i, t in enumerate(["\x00\x01\x02\x7f", "a\x00b", "\x85", "\ue000\uf8ff", "\U000f0000\U0010fffd", "\u0378\u0379",
                           "\U000e0001\U000e0041", "\ufffd", "\uffff\ufffe", "\U0001f9ff", "\u1c89\u1c8a",
                           "\U00016d40\U00016d41", "\U0001ccd6",
                           # first assigned in Unicode 17.0 / 18.0: letters for tiktoken 0.14, "other" for HF and ptk
                           "a\u088fb \u088f\u088f 1\u088f", "a\u0558b \u0558x", "x\U00011de0y 1\U00011de01",
                           "q\U0001246fq 2\U0001246f", "\U0002ebf0\U0002ebf1 x\U0002ebf0"]):
        add(f"special-{i}", t)
    add("code-python", "def f(x):\n    return x ** 2  # square\n\n\tif x >= 10:\n\t\tprint(f\"{x!r}\")\n")
    add("code-c", "int main(int argc, char** argv) {\n  for (int i = 0; i < argc; ++i) printf(\"%s\\n\", argv[i]);\n  return 0;\n}\n")
    add("markup", "<html><body class=\"x\">Hello &amp; welcome!</body></html>\n# Title\n* item 1\n* item 2\n> quote")
    add("json", '{"key": "value", "n": [1, 2, 3], "nested": {"a": null, "b": true}}')
    add("url", "https://example.com/path?query=1&x=y#frag mailto:someone@example.org")
    add("punct", "!!!???...,,,;;;:::---___===+++***///\\\\\\|||~~~```^^^%%%$$$###@@@&&&((()))[[[]]]{{{}}}<<<>>>")
    for unit, n in [("a", 1000), (" ", 1000), ("\n", 1000), ("0", 1000), ("-", 1000), ("^", 1000), ("ab", 500),
                    ("é", 500), ("😀", 300), (" a", 500), ("\t", 700), (". ", 400)]:
        c.append({"name": f"run-{ord(unit[0]):x}-{n}", "repeat": unit, "count": n})
    for unit, n in [("a", 1000000), ("^", 1000000), ("-", 1000000), ("0", 1000000), (" ", 1000000), ("\n", 1000000),
                    ("abcdefghijklmnopqrstuvwxyz", 40000)]:
        c.append({"name": f"big-{ord(unit[0]):x}-{n}", "repeat": unit, "count": n})
    return c


def cldr_texts(cldr_dir):
    out = []
    main = sorted(glob.glob(os.path.join(cldr_dir, "common", "main", "*.xml")))
    keep = [p for p in main if re.fullmatch(r"[a-z]{2,3}(_[A-Z][a-z]{3})?\.xml", os.path.basename(p))]
    for path in keep[::3]:
        txt = open(path, encoding="utf-8").read()
        names = re.findall(r"<(?:language|territory|script|month|day)\b[^>]*>([^<]{1,80})</", txt)
        if len(names) < 20:
            continue
        loc = os.path.basename(path)[:-4]
        body = " ".join(names[:50]) + "\n" + ", ".join(names[50:80])
        out.append({"name": f"cldr-{loc}", "text": body})
    ann = sorted(glob.glob(os.path.join(cldr_dir, "common", "annotations", "*.xml")))
    for path in ann[::12]:
        txt = open(path, encoding="utf-8").read()
        items = re.findall(r'<annotation cp="([^"]+)"[^>]*>([^<]+)</annotation>', txt)[:40]
        if not items:
            continue
        loc = os.path.basename(path)[:-4]
        out.append({"name": f"cldr-ann-{loc}", "text": "\n".join(f"{cp} {t}" for cp, t in items)})
    return out


def wordnet_texts(wn_dir):
    out = []
    glosses = []
    with open(os.path.join(wn_dir, "data.noun"), encoding="latin-1") as f:
        for line in f:
            if line.startswith("  ") or "|" not in line:
                continue
            glosses.append(line.split("|", 1)[1].strip())
    rng = random.Random(7)
    picked = rng.sample(glosses, 600)
    for i in range(0, len(picked), 40):
        out.append({"name": f"wordnet-{i // 40}", "text": " ".join(picked[i:i + 40])})
    return out


def random_strings():
    alphabet = (list("abcZ'strlevmd") + ["é", "ß", "中", "Ω", "ж"] + list("01") + ["²", "½", "Ⅻ", "٣"] +
                [" ", " ", " ", "\t", "\n", "\r", "\v", "\f", "\x85", "\xa0", "\u2000", "\u2028", "\u3000", "\u1680",
                 "\u202f"] + ["\x1c", "\u180e", "\u200b"] + ["\u0301", "\u093f"] + list("!.,-_<>|") +
                ["😀", "👍", "\u200d", "\ufe0f", "日"] + ["\u0378", "\ue000", "\U0010fffd", "\u1c89"])
    rng = random.Random(20261122)
    out = []
    for i in range(400):
        n = rng.randint(1, 40)
        out.append({"name": f"random-{i}", "text": "".join(rng.choice(alphabet) for _ in range(n))})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cldr", default="/usr/share/unicode/cldr")
    ap.add_argument("--wordnet", default="/usr/share/wordnet")
    a = ap.parse_args()
    cases = edge_cases() + cldr_texts(a.cldr) + wordnet_texts(a.wordnet) + random_strings()
    names = set()
    for c in cases:
        assert c["name"] not in names, c["name"]
        names.add(c["name"])
        sys.stdout.write(json.dumps(c, ensure_ascii=True) + "\n")
    print(f"{len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
