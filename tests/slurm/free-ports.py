#!/usr/bin/env python3
"""free-ports.py N [--hold PID]: N distinct TCP ports, free now and reserved, printed on one line.

Below the kernel's ephemeral range (ip_local_port_range), as k8s_local_run_test's rendezvous port: a port there
is what the kernel hands out for a bind to port 0 or an outgoing connection (another test's fake hub, a gloo
rank, a curl connection), so one picked by binding port 0, freed, then bound again by slurmctld a second later
could be taken in between, and Slurm would not start. Also below ptk-train's ports under Slurm (20000 + the job id
times 7, common/slurm_env.cpp), which the jobs of these tests use.

Reserved as tests/trainer/test_ports.h reserves the C++ tests' MASTER_PORTs (a record lock on the port's byte of
/tmp/ptk-test-ports.lock, in the same range): a trainer test running beside (ctest -j) cannot pick one of them while
the reservation lives, nor this script one of theirs. The locks live as long as the process that took them: with
--hold PID this script stays, quietly, until process PID (the test's shell) has ended; without it they end with it.
k8s_local_run_test imports reserve_ports and keeps them for its own life.
"""
import fcntl
import os
import random
import socket
import sys
import time

LOCK_FILE = "/tmp/ptk-test-ports.lock"
LO, HI = 10000, 20000  # tests/trainer/test_ports.h's kTestPortLo, kTestPortHi

_lock_fd = None  # open for the life of the process: closing any descriptor of the file would let go of every lock


def _reserve(port):
    """Locks byte `port` of LOCK_FILE for this process; False when another process holds it."""
    global _lock_fd
    if _lock_fd is None:
        try:
            _lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            return True  # no reservation possible: the bind check alone
    try:
        fcntl.lockf(_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
        return True
    except OSError:
        return False


def reserve_ports(want):
    """`want` distinct ports in [LO, HI) below the ephemeral range, free now and reserved for this process."""
    try:
        lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    top = max(min(lo, HI), LO + 2000)
    ports = []
    for _ in range(2000):
        if len(ports) == want:
            break
        p = random.randrange(LO, top)
        if p in ports or not _reserve(p):
            continue
        with socket.socket() as s:
            try:
                s.bind(("", p))
            except OSError:
                continue  # reserved by this process, harmless: it is never handed out
        ports.append(p)
    if len(ports) < want:
        sys.exit(f"free-ports.py: fewer than {want} free ports in {LO}-{top - 1}")
    return ports


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main():
    args = sys.argv[1:]
    hold = None
    if len(args) >= 2 and args[-2] == "--hold":
        hold = int(args[-1])
        args = args[:-2]
    print(" ".join(map(str, reserve_ports(int(args[0]) if args else 1))), flush=True)
    if hold is None:
        return
    # The reader (the test's `read`) has its line; nothing more goes out, so that no pipe is held open for it.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while _alive(hold):
        time.sleep(0.5)


if __name__ == "__main__":
    main()
