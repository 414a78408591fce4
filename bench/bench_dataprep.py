#!/usr/bin/env python3
"""Data-preparation benchmarks, each side by side in the same run with what users run today:
  download  ptk-download vs curl --parallel, aria2c -x 8 -s 8 (and hf_transfer when importable) from a local
            fake Hub (tests/support/fake_hub.py), on loopback and on a link paced per connection
            (--paced-mb-s, as a CDN caps each connection), many small files and a few large ones
  extract   ptk-extract vs `zstd -d` and `xz -d`, one file; and N files on all cores (linear scaling)
  concat    ptk-concat vs `cat`, M files into one chunk
Every tool's output is checked against the others before its time counts. Best of --repeats runs,
alternating tools so machine noise hits both. Prints a table and one JSON line with ratios.

Usage: python3 bench/bench_dataprep.py [--build build] [--mb 200] [--repeats 5] [--stages download]
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


def start_hub(repo, tmp, name, extra):
    ports = os.path.join(tmp, name + ".ports")
    hub = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "support", "fake_hub.py"), "--repo-dir", repo,
                            "--port-file", ports] + extra, stdout=subprocess.DEVNULL)
    atexit.register(hub.kill)
    for _ in range(400):
        if os.path.exists(ports):
            break
        time.sleep(0.05)
    return hub, open(ports).read().split()[1]


def bench_download(a, bin_, tmp):
    """ptk-download beside curl --parallel and aria2c -x 8 -s 8 (and hf_transfer when importable), on
    loopback and on a link paced per connection (a CDN's per-connection cap), with many small files
    and with a few large ones. Every tool's files are checked against the repo's sha256 before its
    times count; ptk verifies sha256 and fsyncs as it always does, the others neither."""
    try:
        import hf_transfer  # noqa: F401  (never installed by this bench)
        have_hf = True
    except ImportError:
        have_hf = False
        print("hf_transfer: not importable here; skipped (this bench installs nothing)")
    repo = os.path.join(tmp, "repo")
    sets = {"small": (a.small_files, a.small_kb * 1000), "large": (a.large_files, a.large_mb * 1000000)}
    want = {}
    for kind, (n, size) in sets.items():
        os.makedirs(os.path.join(repo, "train", kind))
        for i in range(n):
            rel = f"train/{kind}/f{i:04d}.bin"
            data = os.urandom(size)
            with open(os.path.join(repo, rel), "wb") as f:
                f.write(data)
            want[rel] = hashlib.sha256(data).hexdigest()
    results = {}
    links = [("loopback", []), (f"paced {a.paced_mb_s:g} MB/s per connection",
                                ["--bytes-per-second", str(a.paced_mb_s * 1e6)])]
    for link, extra in links:
        hub, hub_url = start_hub(repo, tmp, link.split()[0], extra)
        try:
            for kind, (n, size) in sets.items():
                rels = [f"train/{kind}/f{i:04d}.bin" for i in range(n)]
                urls = [f"{hub_url}/datasets/cerebras/SlimPajama-627B/resolve/main/{r}" for r in rels]
                with open(os.path.join(tmp, "urls.txt"), "w") as f:  # aria2c's input file, names given
                    f.write("".join(f"{u}\n  out=f{i:04d}.bin\n" for i, u in enumerate(urls)))
                out = {t: os.path.join(tmp, "dl-" + t) for t in ("ptk", "curl", "aria2c", "hf_transfer")}
                with open(os.path.join(tmp, "ptk-urls.txt"), "w") as f:  # the same URLs, with their sha256
                    f.write("".join(f"{u} sha256={want[r]} size={size} path={r}\n" for u, r in zip(urls, rels)))
                out["ptk-urls"] = os.path.join(tmp, "dl-ptk-urls")
                cmds = {
                    "ptk": [os.path.join(bin_, "ptk-download"), "--quiet", "--repo", "cerebras/SlimPajama-627B",
                            "--endpoint", hub_url, "--local-dir", out["ptk"], "--include", f"train/{kind}/*", "--jobs", "8"],
                    "ptk-urls": [os.path.join(bin_, "ptk-download"), "--quiet", "--url-list", f"{tmp}/ptk-urls.txt",
                                 "--local-dir", out["ptk-urls"], "--jobs", "8"],
                    "curl": f"cd {out['curl']} && curl -s -f -L --parallel --parallel-max 8 " +
                            " ".join(f"-o f{i:04d}.bin {u}" for i, u in enumerate(urls)),
                    "aria2c": f"aria2c -q -j 8 -x 8 -s 8 --allow-overwrite=true --auto-file-renaming=false "
                              f"-d {out['aria2c']} -i {tmp}/urls.txt",
                }
                if have_hf:
                    cmds["hf_transfer"] = [sys.executable, "-c",
                                           "import sys, hf_transfer\n"
                                           "for i, u in enumerate(sys.argv[2:]):\n"
                                           "    hf_transfer.download(u, f'{sys.argv[1]}/f{i:04d}.bin', max_files=64, "
                                           "chunk_size=10485760)", out["hf_transfer"]] + urls
                times = {t: [] for t in cmds}
                for _ in range(min(3, a.repeats)):
                    for t, cmd in cmds.items():  # the tools take turns, so that the machine's drifts reach all
                        shutil.rmtree(out[t], ignore_errors=True)
                        os.makedirs(out[t])
                        times[t].append(timed(cmd, shell=isinstance(cmd, str)))
                for t in cmds:
                    for i, r in enumerate(rels):
                        got = os.path.join(out[t], r) if t.startswith("ptk") else os.path.join(out[t], f"f{i:04d}.bin")
                        assert sha(got) == want[r], f"{t}: {got} differs"
                mb = n * size / 1e6
                best = {t: min(v) for t, v in times.items()}
                name = f"download {link}, {n} x {size / 1e6:g} MB"
                # ptk as users run it on a repo (listing included), and from a URL list with the sha256s
                # (the URLs the anchors are given, so no listing): both verify every byte and fsync.
                for p, label in (("ptk", ""), ("ptk-urls", " (ptk --url-list)")):
                    for t in [t for t in cmds if not t.startswith("ptk")]:
                        anchor = {"curl": "curl --parallel", "aria2c": "aria2c -x 8 -s 8", "hf_transfer": "hf_transfer"}[t]
                        results[f"{name} vs {anchor}{label}"] = {"ptk_mb_s": round(mb / best[p], 1), "anchor": anchor,
                                                                 "anchor_mb_s": round(mb / best[t], 1),
                                                                 "ratio": round(best[t] / best[p], 3)}
                print(f"{name}: " + ", ".join(f"{t} {mb / best[t]:.1f} MB/s" for t in cmds), flush=True)
        finally:
            hub.kill()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--mb", type=int, default=200, help="size of the extraction/concatenation corpus")
    ap.add_argument("--repeats", type=int, default=5, help="best of (download: at most 3)")
    ap.add_argument("--stages", nargs="+", default=["extract", "concat", "download"],
                    choices=["extract", "concat", "download"])
    ap.add_argument("--small-files", type=int, default=200, help="download: how many small files")
    ap.add_argument("--small-kb", type=int, default=256, help="download: size of each small file, KB")
    ap.add_argument("--large-files", type=int, default=3, help="download: how many large files")
    ap.add_argument("--large-mb", type=int, default=80, help="download: size of each large file, MB")
    ap.add_argument("--paced-mb-s", type=float, default=20, help="download: the paced link's rate per connection")
    a = ap.parse_args()
    bin_ = os.path.join(a.build, "bin")
    tmp = tempfile.mkdtemp(prefix="ptk-bench-dataprep-")
    atexit.register(shutil.rmtree, tmp, True)  # also when a step fails
    nproc = os.cpu_count()
    results = {}

    if "extract" in a.stages or "concat" in a.stages:  # (both read the same corpus)
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

    if "download" in a.stages:
        results.update(bench_download(a, bin_, tmp))

    print(f"\n{'':90} {'ptk MB/s':>9} {'anchor MB/s':>12} {'ratio':>7} {'synced anchor':>14} {'ratio':>7}")
    for name, r in results.items():
        anchor = r.get("anchor_mb_s", r.get("aria2c_mb_s", ""))
        ratio = r.get("ratio", r.get("ratio_vs_aria2c", r.get("scaling_efficiency", "")))
        print(f"{name:90} {r['ptk_mb_s']:9.1f} {anchor!s:>12} {ratio!s:>7} {r.get('anchor_synced_mb_s', '')!s:>14} "
              f"{r.get('ratio_vs_synced', '')!s:>7}")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    load = open("/proc/loadavg").read().split()[:3]
    print(f"load average at the end: {' '.join(load)} on {nproc} cores")
    print(json.dumps({"bench": "dataprep", "commit": commit, "cpu": cpu_name(), "cores": nproc, "loadavg": load,
                      "results": results}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
