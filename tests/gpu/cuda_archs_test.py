#!/usr/bin/env python3
"""The CUDA code built into FILE... carries machine code (SASS) for every architecture WANT names.

Usage: cuda_archs_test.py --want 80,90 [--cuobjdump PATH] FILE...

Reads the ELF cubins with `cuobjdump --list-elf` where cuobjdump is found (PATH, --cuobjdump, or beside
nvcc), else from the fat binaries in the files' .nv_fatbin sections itself (the CUDA fat binary layout: a
16-byte header, magic 0xBA55ED50, then entries whose header holds the kind, 1 PTX or 2 ELF, and the
architecture at byte 28). Exits 0 when every wanted sm_NN is there, 1 otherwise (naming what is there),
77 when WANT names nothing to check (e.g. CMAKE_CUDA_ARCHITECTURES=native)."""
import argparse
import os
import re
import shutil
import struct
import subprocess
import sys

MAGIC = 0xBA55ED50


def section(path, name):
    """The bytes of ELF64 section NAME, or None."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            sys.exit(f"cuda_archs_test: {path} is not a little-endian ELF64 file")
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        headers = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        _, _, _, _, stroff, strsize = headers[shstrndx]
        f.seek(stroff)
        strings = f.read(strsize)
        for name_off, _, _, _, off, size in headers:
            if strings[name_off:strings.index(b"\0", name_off)] == name.encode():
                f.seek(off)
                return f.read(size)
    return None


def fatbin_entries(data):
    """(kind, arch) of every entry of every fat binary in DATA."""
    out = []
    i = data.find(struct.pack("<I", MAGIC))
    while i != -1:
        _, version, header, size = struct.unpack_from("<IHHQ", data, i)
        if version != 1 or header != 16:
            sys.exit(f"cuda_archs_test: unknown fat binary header (version {version}, size {header}) at {i}")
        p, end = i + header, i + header + size
        while p < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            arch, = struct.unpack_from("<I", data, p + 28)
            out.append((kind, arch))
            p += entry_header + payload
        i = data.find(struct.pack("<I", MAGIC), end)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--want", required=True, help="architectures, e.g. 80,90")
    ap.add_argument("--cuobjdump", default="")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    want = sorted({f"sm_{w}" for w in a.want.replace(";", ",").split(",") if w})
    if not want:
        print("SKIP: no architectures to check")
        return 77
    tool = a.cuobjdump if a.cuobjdump and os.access(a.cuobjdump, os.X_OK) else shutil.which("cuobjdump")
    found = set()
    for path in a.files:
        if tool:
            r = subprocess.run([tool, "--list-elf", path], capture_output=True, text=True)
            if r.returncode != 0 and "does not contain device code" not in r.stderr + r.stdout:
                print(f"FAIL: {tool} --list-elf {path}: exit {r.returncode}: {r.stderr.strip()}")
                return 1
            have = set(re.findall(r"\.(sm_[0-9]+a?)\.cubin", r.stdout))
            how = "cuobjdump --list-elf"
        else:
            data = section(path, ".nv_fatbin") or b""
            have = {f"sm_{arch}" for kind, arch in fatbin_entries(data) if kind == 2}
            how = "its .nv_fatbin (no cuobjdump here)"
        print(f"{path}: ELF code for {' '.join(sorted(have)) or 'nothing'} (read from {how})")
        found |= have
    missing = [w for w in want if w not in found]
    if missing:
        print(f"FAIL: no {' '.join(missing)} code in {' '.join(a.files)}")
        return 1
    print(f"OK: {' '.join(want)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
