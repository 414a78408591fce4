#!/usr/bin/env python3
"""free-ports.py N: N distinct TCP ports, free now, for a test's local slurmctld and slurmd, printed on one line.

Below the kernel's ephemeral range (ip_local_port_range), as k8s_local_run_test's rendezvous port: a port there
is what the kernel hands out for a bind to port 0 or an outgoing connection (another test's fake hub, a gloo
rank, a curl connection), so one picked by binding port 0, freed, then bound again by slurmctld a second later
could be taken in between, and Slurm would not start. Also below ptk-train's ports under Slurm (20000 + the job id
times 7, common/slurm_env.cpp), which the jobs of these tests use.
"""
import random
import socket
import sys

want = int(sys.argv[1]) if len(sys.argv) > 1 else 1
try:
    lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    lo = 32768
top = max(min(lo, 20000), 12000)
ports = []
for _ in range(2000):
    if len(ports) == want:
        break
    p = random.randrange(10000, top)
    if p in ports:
        continue
    with socket.socket() as s:
        try:
            s.bind(("", p))
        except OSError:
            continue
    ports.append(p)
if len(ports) < want:
    sys.exit(f"free-ports.py: fewer than {want} free ports in 10000-{top - 1}")
print(" ".join(map(str, ports)))
