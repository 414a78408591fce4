#!/usr/bin/env python3
"""tests/k8s/podsim.py's own rules, where k8s_local_run_test relies on them:

  1. a pod ends with all of its container's processes, not with the first one alone: a replacement pod
     (podReplacementPolicy Failed) never starts while a process of the pod it replaces still runs
     (k8s_local_run_test's killed tokenize pod: its ptk-tokenize, a child of the pod's shell, outlives
     the shell it is killed with in most kills, and holds its output's lock until it is gone);
  2. a pod the simulator cannot start (here a Secret that is missing) fails its Job at once, saying why,
     instead of leaving the Job waiting for it until the test's time limit ('did not finish within 240 s',
     with no reason and no logs).

Usage: podsim_test.py SOURCE_DIR
"""
import os
import shutil
import sys
import tempfile

SRC = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.join(SRC, "tests", "k8s"))
import podsim  # noqa: E402

WORK = tempfile.mkdtemp(prefix="ptk-podsim-test-")
failures = []


def check(ok, msg):
    print(("ok: " if ok else "FAIL: ") + msg, flush=True)
    if not ok:
        failures.append(msg)


def job(name, command, env=(), completions=1):
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": completions,
                     "backoffLimitPerIndex": 2, "podReplacementPolicy": "Failed",
                     "template": {"spec": {"restartPolicy": "Never", "containers": [
                         {"name": "c", "image": "x", "command": ["sh", "-c", command], "env": list(env),
                          "volumeMounts": [{"name": "v", "mountPath": "/vol"}]}]}}}}


try:
    vol = os.path.join(WORK, "vol")
    os.makedirs(vol)
    sim = podsim.Sim(vol, os.path.join(WORK, "bin"), os.path.join(SRC, "slurm"), os.path.join(WORK, "pods"))

    # 1. The first pod leaves a child running (as a killed pod's shell leaves its tool: the tool is still
    # exiting when the shell is reaped) and fails; its replacement looks for that child.
    first = ('if [ ! -e /vol/first ]; then touch /vol/first; sleep 60 & echo $! > /vol/child; exit 1; fi; '
             'st=$(sed "s/.*) //" /proc/$(cat /vol/child)/stat 2>/dev/null | cut -d" " -f1); '
             'echo "${st:-gone}" > /vol/seen')
    r = sim.run_job(job("leftover", first), timeout=120)
    seen = open(os.path.join(vol, "seen")).read().strip() if os.path.exists(os.path.join(vol, "seen")) else "?"
    check(r["succeeded"] and [p.exit_code for p in r["pods"]] == [1, 0],
          f"the pod that failed was replaced and the replacement succeeded (exit codes "
          f"{[p.exit_code for p in r['pods']]})")
    check(seen in ("gone", "Z"), f"the replaced pod's left-behind process was gone when its replacement started "
                                 f"(its state then: {seen}; expected gone, or a zombie)")

    # 2. A pod that cannot be started: the Job fails at once with the reason.
    secret = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "token"}}}]
    try:
        r = sim.run_job(job("unstartable", "true", env=secret), timeout=60)
        check(not r["succeeded"] and "secret absent is missing" in (r["reason"] or ""),
              f"a pod that cannot be started fails its Job, saying why (reason: {r['reason']})")
    except TimeoutError as e:
        check(False, f"a pod that cannot be started fails its Job, saying why (the Job waited instead: {e})")
finally:
    shutil.rmtree(WORK, ignore_errors=True)

if failures:
    sys.exit(1)
print("podsim: OK")
