#!/usr/bin/env python3
"""Data-preparation benchmarks, each side by side in the same run with what users run today:
  download  ptk-download vs aria2c and curl, N files from a local fake Hub (tests/support/fake_hub.py)
  extract   ptk-extract vs `zstd -d` and `xz -d`, one file; and N files on all cores (linear scaling)
  concat    ptk-concat vs `cat`, M files into one chunk
Every tool's output is checked against the others before its time counts. Best of --repeats runs,
alternating tools so machine noise hits both. Prints a table and one JSON line with ratios.

Usage: python3 bench/bench_dataprep.py [--build build] [--mb 200] [--repeats 5]
Needs zstd, xz-utils, aria2 and curl (scripts/install-deps.sh installs them).
"""
import argparse
import atexit
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def timed(cmd, cwd=None, shell=False):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=cwd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t


def best_pair(a, b, repeats, setup=None):
    ta, tb = [], []
    for _ in range(repeats):
        tb.append(b())
        if setup:
            setup()
        ta.append(a())
    return min(ta), min(tb)


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--mb", type=int, default=200, help="size of the extraction/concatenation corpus")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--download-files", type=int, default=16)
    ap.add_argument("--download-mb", type=int, default=4, help="size of each downloaded file")
    a = ap.parse_args()
    bin_ = os.path.join(a.build, "bin")
    tmp = tempfile.mkdtemp(prefix="ptk-bench-dataprep-")
    atexit.register(shutil.rmtree, tmp, True)  # also when a step fails
    nproc = os.cpu_count()
    results = {}

    # ---- corpus: the bundled sample's train text, repeated to --mb
    raw = b"".join(subprocess.run(["zstd", "-dc", f], capture_output=True, check=True).stdout
                   for f in sorted(glob.glob(os.path.join(ROOT, "sample", "slimpajama-mini", "train", "*", "*.zst"))))
    big = os.path.join(tmp, "big.jsonl")
    with open(big, "wb") as f:
        f.write(raw * max(1, a.mb * 1000000 // len(raw)))
    mb = os.path.getsize(big) / 1e6
    subprocess.run(["zstd", "-q", "-3", "-f", big, "-o", big + ".zst"], check=True)
    small = os.path.join(tmp, "small.jsonl")
    with open(small, "wb") as f:
        f.write(raw * max(1, (a.mb // 4) * 1000000 // len(raw)))
    small_mb = os.path.getsize(small) / 1e6
    subprocess.run(["xz", "-q", "-1", "-T1", "-k", "-f", small], check=True)
    print(f"corpus: {mb:.0f} MB jsonl ({os.path.getsize(big + '.zst') / 1e6:.0f} MB .zst), {small_mb:.0f} MB for xz; "
          f"{nproc} cores; CPU {cpu_name()}")

    # ---- extract: one .zst
    out = os.path.join(tmp, "x")
    def clean():
        shutil.rmtree(out, ignore_errors=True)
    # ptk's outputs are durable (fsync before the rename); the anchors are timed both as users run
    # them and followed by `sync FILE`, the same guarantee.
    ptk_x = lambda: timed([os.path.join(bin_, "ptk-extract"), "--quiet", big + ".zst", "--output-dir", out])
    t_ptk, t_zstd = best_pair(ptk_x, lambda: timed(f"zstd -q -d -f -c {big}.zst > {tmp}/z.out", shell=True), a.repeats, clean)
    t_ptk2, t_zstd_sync = best_pair(ptk_x, lambda: timed(f"zstd -q -d -f -c {big}.zst > {tmp}/z.out && sync {tmp}/z.out", shell=True),
                                    a.repeats, clean)
    t_ptk = min(t_ptk, t_ptk2)
    assert sha(os.path.join(out, "big.jsonl")) == sha(os.path.join(tmp, "z.out")) == sha(big), "extract output differs"
    results["extract .zst 1 file"] = {"ptk_mb_s": round(mb / t_ptk, 1), "anchor": "zstd -d", "anchor_mb_s": round(mb / t_zstd, 1),
                                      "ratio": round(t_zstd / t_ptk, 3), "anchor_synced_mb_s": round(mb / t_zstd_sync, 1),
                                      "ratio_vs_synced": round(t_zstd_sync / t_ptk, 3)}
    t_ptk, t_xz = best_pair(lambda: timed([os.path.join(bin_, "ptk-extract"), "--quiet", small + ".xz", "--output-dir", out]),
                            lambda: timed(f"xz -q -d -c -T1 {small}.xz > {tmp}/x.out && sync {tmp}/x.out", shell=True),
                            a.repeats, clean)
    assert sha(os.path.join(out, "small.jsonl")) == sha(os.path.join(tmp, "x.out")), "xz output differs"
    results["extract .xz 1 file"] = {"ptk_mb_s": round(small_mb / t_ptk, 1), "anchor": "xz -d + sync", "anchor_mb_s": round(small_mb / t_xz, 1),
                                     "ratio": round(t_xz / t_ptk, 3)}
    # N files on N cores vs one file: linear scaling means the same time.
    files_dir = os.path.join(tmp, "zs")
    os.makedirs(files_dir)
    for i in range(nproc):
        shutil.copyfile(big + ".zst", os.path.join(files_dir, f"part{i}.jsonl.zst"))
    t_n, _ = best_pair(lambda: timed([os.path.join(bin_, "ptk-extract"), "--quiet", files_dir, "--output-dir", out, "--jobs", str(nproc)]),
                       lambda: 0.0, max(2, a.repeats // 2), clean)
    t_1, _ = best_pair(lambda: timed([os.path.join(bin_, "ptk-extract"), "--quiet", big + ".zst", "--output-dir", out]),
                       lambda: 0.0, max(2, a.repeats // 2), clean)
    results[f"extract {nproc} files on {nproc} cores"] = {"ptk_mb_s": round(nproc * mb / t_n, 1),
                                                          "scaling_efficiency": round(t_1 / t_n, 3)}

    # ---- concat: M files -> one chunk, vs cat
    parts = os.path.join(tmp, "parts")
    os.makedirs(parts)
    data = open(big, "rb").read()
    m = 64
    lines = data.split(b"\n")
    per = len(lines) // m + 1
    names = []
    for i in range(m):
        p = os.path.join(parts, f"p{i:03d}.jsonl")
        with open(p, "wb") as f:
            f.write(b"".join(l + b"\n" for l in lines[i * per:(i + 1) * per] if l))
        names.append(p)
    cout = os.path.join(tmp, "c")
    def cclean():
        shutil.rmtree(cout, ignore_errors=True)
        os.makedirs(cout)
    ptk_c = lambda: timed([os.path.join(bin_, "ptk-concat"), "--quiet", "--input", parts, "--output-dir", cout, "--chunks", "1"])
    t_ptk, t_cat = best_pair(ptk_c, lambda: timed(f"cat {parts}/*.jsonl > {tmp}/cat.out", shell=True), a.repeats, cclean)
    t_ptk2, t_cat_sync = best_pair(ptk_c, lambda: timed(f"cat {parts}/*.jsonl > {tmp}/cat.out && sync {tmp}/cat.out", shell=True),
                                   a.repeats, cclean)
    t_ptk = min(t_ptk, t_ptk2)
    assert sha(os.path.join(cout, "train_00.jsonl")) == sha(os.path.join(tmp, "cat.out")), "concat output differs"
    # Like for like with plain cat: --no-fsync leaves the chunk in the page cache, as cat does.
    ptk_nf = lambda: timed([os.path.join(bin_, "ptk-concat"), "--quiet", "--no-fsync", "--input", parts, "--output-dir", cout,
                            "--chunks", "1"])
    t_ptk_nf, t_cat_nf = best_pair(ptk_nf, lambda: timed(f"cat {parts}/*.jsonl > {tmp}/cat.out", shell=True), a.repeats, cclean)
    assert sha(os.path.join(cout, "train_00.jsonl")) == sha(os.path.join(tmp, "cat.out")), "concat --no-fsync output differs"
    results[f"concat {m} files"] = {"ptk_mb_s": round(mb / t_ptk, 1), "anchor": "cat", "anchor_mb_s": round(mb / t_cat, 1),
                                    "ratio": round(t_cat / t_ptk, 3), "anchor_synced_mb_s": round(mb / t_cat_sync, 1),
                                    "ratio_vs_synced": round(t_cat_sync / t_ptk, 3)}
    results[f"concat {m} files, --no-fsync"] = {"ptk_mb_s": round(mb / t_ptk_nf, 1), "anchor": "cat", "anchor_mb_s": round(mb / t_cat_nf, 1),
                                                "ratio": round(t_cat_nf / t_ptk_nf, 3)}

    # ---- download: N files from a local fake Hub, 8 at a time
    repo = os.path.join(tmp, "repo")
    os.makedirs(os.path.join(repo, "train"))
    for i in range(a.download_files):
        with open(os.path.join(repo, "train", f"example_train_{i}.jsonl.zst"), "wb") as f:
            f.write(os.urandom(a.download_mb * 1000000))
    ports = os.path.join(tmp, "ports")
    hub = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "support", "fake_hub.py"), "--repo-dir", repo,
                            "--port-file", ports], stdout=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(ports):
                break
            time.sleep(0.05)
        hub_url = open(ports).read().split()[1]
        urls = [f"{hub_url}/datasets/cerebras/SlimPajama-627B/resolve/main/train/example_train_{i}.jsonl.zst"
                for i in range(a.download_files)]
        with open(os.path.join(tmp, "urls.txt"), "w") as f:
            f.write("\n".join(urls) + "\n")
        dmb = a.download_files * a.download_mb
        dl = os.path.join(tmp, "dl")
        def dclean():
            shutil.rmtree(dl, ignore_errors=True)
            os.makedirs(dl)
        dclean()
        ptk_cmd = [os.path.join(bin_, "ptk-download"), "--quiet", "--repo", "cerebras/SlimPajama-627B", "--endpoint", hub_url,
                   "--local-dir", dl, "--include", "train/*", "--jobs", "8"]
        adl = os.path.join(tmp, "adl")
        os.makedirs(adl)
        aria = f"aria2c -q -j 8 -x 1 --allow-overwrite=true --auto-file-renaming=false -d {adl} -i {tmp}/urls.txt"
        t_ptk, t_aria = best_pair(lambda: timed(ptk_cmd), lambda: timed(aria, shell=True), max(2, a.repeats // 2), dclean)
        curl = (f"cd {adl} && curl -s -L --parallel --parallel-max 8 " +
                " ".join(f"-o example_train_{i}.jsonl.zst {u}" for i, u in enumerate(urls)))
        t_ptk2, t_curl = best_pair(lambda: timed(ptk_cmd), lambda: timed(curl, shell=True), max(2, a.repeats // 2), dclean)
        t_ptk3, t_curl_sync = best_pair(lambda: timed(ptk_cmd), lambda: timed(curl + " && sync *.jsonl.zst", shell=True),
                                        max(2, a.repeats // 2), dclean)
        for i in range(a.download_files):
            want = sha(os.path.join(repo, "train", f"example_train_{i}.jsonl.zst"))
            assert sha(os.path.join(dl, "train", f"example_train_{i}.jsonl.zst")) == want, "ptk-download output differs"
            assert sha(os.path.join(adl, f"example_train_{i}.jsonl.zst")) == want, "curl output differs"
        t_ptk = min(t_ptk, t_ptk2, t_ptk3)
        results[f"download {a.download_files} x {a.download_mb} MB, 8 at a time"] = {
            "ptk_mb_s": round(dmb / t_ptk, 1), "anchor": "aria2c -j 8 / curl --parallel", "aria2c_mb_s": round(dmb / t_aria, 1),
            "curl_mb_s": round(dmb / t_curl, 1), "ratio_vs_aria2c": round(t_aria / t_ptk, 3), "ratio_vs_curl": round(t_curl / t_ptk, 3),
            "curl_synced_mb_s": round(dmb / t_curl_sync, 1), "ratio_vs_curl_synced": round(t_curl_sync / t_ptk, 3)}
    finally:
        hub.kill()

    print(f"\n{'':40} {'ptk MB/s':>9} {'anchor MB/s':>12} {'ratio':>7} {'synced anchor':>14} {'ratio':>7}")
    for name, r in results.items():
        anchor = r.get("anchor_mb_s", r.get("aria2c_mb_s", ""))
        ratio = r.get("ratio", r.get("ratio_vs_aria2c", r.get("scaling_efficiency", "")))
        print(f"{name:40} {r['ptk_mb_s']:9.1f} {anchor!s:>12} {ratio!s:>7} {r.get('anchor_synced_mb_s', '')!s:>14} "
              f"{r.get('ratio_vs_synced', '')!s:>7}")
        if "curl_mb_s" in r:  # the download's second anchor
            print(f"{'  (anchor: curl --parallel)':40} {'':9} {r['curl_mb_s']!s:>12} {r['ratio_vs_curl']!s:>7} "
                  f"{r['curl_synced_mb_s']!s:>14} {r['ratio_vs_curl_synced']!s:>7}")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"bench": "dataprep", "commit": commit, "cpu": cpu_name(), "cores": nproc, "results": results}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
