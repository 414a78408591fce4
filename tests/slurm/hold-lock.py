#!/usr/bin/env python3
"""Holds OUTPUT's ptk lock (OUTPUT.ptk-lock, an open-file-description lock as ptk's OutputLock takes it,
named as a holder) until FILE holds TEXT, then lets it go; a dead node's lock that NFS keeps for its lease.
Usage: hold-lock.py OUTPUT FILE TEXT [SECONDS]   (exit 1: TEXT not seen within SECONDS, default 120)"""
import fcntl
import os
import struct
import sys
import time

out, watch, text = sys.argv[1], sys.argv[2], sys.argv[3]
limit = float(sys.argv[4]) if len(sys.argv) > 4 else 120.0
fd = os.open(out + ".ptk-lock", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.fcntl(fd, getattr(fcntl, "F_OFD_SETLK", 37), struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
os.ftruncate(fd, 0)
os.write(fd, f"hold-lock.py (pid {os.getpid()} on host {os.uname().nodename})\n".encode())
print("held", flush=True)
seen = False
until = time.monotonic() + limit
while not seen and time.monotonic() < until:
    try:
        seen = text in open(watch, errors="replace").read()
    except FileNotFoundError:
        pass
    time.sleep(0.1)
os.unlink(out + ".ptk-lock")
os.close(fd)
sys.exit(0 if seen else 1)
