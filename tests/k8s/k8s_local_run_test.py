#!/usr/bin/env python3
"""k8s/'s manifests run as their pods would run, without a cluster (tests/k8s/podsim.py):

  1. the templates are rendered as docs/cluster.md says (k8s/render.sh) for the bundled sample,
     served as the dataset repo by tests/support/fake_hub.py, the shared volume a local directory;
  2. download -> extract -> concat-plan -> concat -> tokenize run as the Indexed Jobs' pods, in parallel
     as the controller runs them (JOB_COMPLETION_INDEX, the manifests' env and commands): a download
     pod killed mid-file is replaced and resumes the file with a Range request, a tokenize pod killed
     mid-file is replaced and redoes it; the chunks and datasets are byte-identical to a
     single-process run of the same tools (what the Slurm path gives, tests/slurm/slurm_pipeline_test.sh)
     and nothing is left behind; an extract index that fails on a damaged download fails alone after its
     retries, and a verified re-download and the Job applied again repair it (docs/cluster.md's resume steps);
     a usage error fails its index at once;
  3. ptk-train as the plain Indexed Job (+ headless Service) variant, 2 ranks over loopback, and as
     the PyTorchJob with its Worker (rank 1) SIGKILLed after a checkpoint and its restarted Master
     SIGTERMed while it waits for the Worker, whose restart the test holds (all ranks save after one
     iteration and stop, ptk-train says so with exit 75 and k8s/train.sh exits 143 and 75 so that they run
     again rather than count as done; their run length is given as --train-it, an abbreviation): the ranks restart in place, resume from the latest checkpoint, and end with checkpoints
     bit-identical to the uninterrupted run's; every iteration is logged.

Usage: k8s_local_run_test.py BIN_DIR SOURCE_DIR
"""
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

BIN, SRC = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
sys.path.insert(0, os.path.join(SRC, "tests", "k8s"))
import podsim  # noqa: E402

T0 = time.time()
WORK = tempfile.mkdtemp(prefix="ptk-k8s-run-")
VOL = os.path.join(WORK, "fsx")  # the PVC, mounted at /fsx in every pod
DATA = os.path.join(VOL, "ptk", "slimpajama")
os.makedirs(VOL)


def say(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# Where a failed run leaves its pods' logs and the volume's listing (the work directory is removed): beside the
# build's bin/, which CI keeps with the build tree.
ARTIFACTS = os.path.join(os.path.dirname(BIN), "k8s_local_run_test-failure")
shutil.rmtree(ARTIFACTS, ignore_errors=True)  # an earlier run's


def keep_for_diagnosis():
    """The pods' logs and a listing of the volume (every file with its size: what each stage left, resume
    records, locks, temporaries), copied to ARTIFACTS."""
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    try:
        shutil.copytree(os.path.join(WORK, "pods"), os.path.join(ARTIFACTS, "pods"),
                        ignore=shutil.ignore_patterns("pod-cwd-*"))
        with open(os.path.join(ARTIFACTS, "volume.txt"), "w") as out:
            for f in sorted(os.path.join(d, n) for d, dirs, files in os.walk(VOL) for n in dirs + files):
                st = os.lstat(f)
                out.write(f"{st.st_size:>12} {time.strftime('%H:%M:%S', time.localtime(st.st_mtime))} "
                          f"{os.path.relpath(f, VOL)}\n")
        print(f"pod logs and the volume's listing kept in {ARTIFACTS}")
    except OSError as e:
        print(f"could not keep the pods' logs in {ARTIFACTS}: {e}")


def fail(msg, sim=None):
    print(f"FAIL: {msg}", flush=True)
    if sim is not None:
        for t, pod, what in sim.events[-60:]:
            print(f"  event {t - T0:6.1f}s {pod}: {what}")
        # The tails of the 8 logs written last (the failed job's pods').
        logs = sorted(glob.glob(os.path.join(sim.log_dir, "*.log")), key=os.path.getmtime)[-8:]
        for log in logs:
            print(f"---- {log}\n" + open(log, errors="replace").read()[-3000:])
    if os.path.isdir(os.path.join(WORK, "pods")):
        keep_for_diagnosis()
    sys.exit(1)


def free_port():
    """A port for the rendezvous below the kernel's ephemeral range (the ranks' own gloo connections
    and every other test's take ports from that range, and one could hold this port when a rank 0
    binds it, across the several jobs that reuse it), free when picked, and reserved for the life of
    this process as the trainer tests' MASTER_PORTs are (tests/slurm/free-ports.py: a trainer test
    beside this one could pick it before its jobs bind it)."""
    spec = importlib.util.spec_from_file_location("free_ports", os.path.join(SRC, "tests", "slurm", "free-ports.py"))
    free_ports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(free_ports)
    return free_ports.reserve_ports(1)[0]


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---- the local hub: the sample as cerebras/SlimPajama-627B; one file's first transfer is slow
SLOW = "train/chunk1/example_train_0.jsonl.zst"
faults = os.path.join(WORK, "faults.json")
json.dump({SLOW: ["slow:40000"]}, open(faults, "w"))
ports = os.path.join(WORK, "ports")
hub = subprocess.Popen([sys.executable, os.path.join(SRC, "tests", "support", "fake_hub.py"), "--repo-dir",
                        os.path.join(SRC, "sample", "slimpajama-mini"), "--port-file", ports, "--faults", faults],
                       stdout=subprocess.DEVNULL, stderr=open(os.path.join(WORK, "hub.log"), "w"))
try:
    until = time.time() + 60  # python starts late on a loaded machine
    while time.time() < until:
        if os.path.exists(ports) and os.path.getsize(ports) > 0:
            break
        time.sleep(0.05)
    endpoint = next(line.split()[1] for line in open(ports) if line.startswith("HUB"))

    # ---- 1. render, as docs/cluster.md says
    config = {
        "IMAGE": "ptk:test", "PVC_NAME": "fsx-claim", "MOUNT_PATH": "/fsx", "STAGE_PATH": "/fsx/ptk",
        "HF_ENDPOINT": endpoint, "DOWNLOAD_TASKS": "2", "DOWNLOAD_JOBS": "4", "EXTRACT_TASKS": "3",
        "EXTRACT_PARALLELISM": "2", "CONCAT_CHUNKS": "4", "CONCAT_PARALLELISM": "2", "TOKENIZE_TASKS": "3",
        "TOKENIZE_PARALLELISM": "2", "CPUS_PER_TASK": "1", "MEMORY_PER_TASK": "1Gi",
        "NUM_WORKERS": "2", "GPU_PER_WORKER": "0", "CPUS_PER_WORKER": "1", "MEMORY_PER_WORKER": "2Gi",
        "MASTER_PORT": str(free_port()), "NUM_LAYERS": "1", "HIDDEN_SIZE": "32", "NUM_ATTENTION_HEADS": "2",
        "SEQ_LENGTH": "32", "MICRO_BATCH_SIZE": "2", "GLOBAL_BATCH_SIZE": "8", "TRAIN_ITERS": "60",
        "LR": "1e-3", "MIN_LR": "1e-4", "LR_WARMUP_ITERS": "5", "SAVE_INTERVAL": "20", "EVAL_INTERVAL": "30",
        "EVAL_ITERS": "1", "LOG_INTERVAL": "10", "TRAIN_GRACE_SECONDS": "30",
    }

    def render(template, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION"))}
        env.update(config)
        env.update(extra)
        out = subprocess.run(["bash", "k8s/render.sh", f"k8s/{template}.yaml-template"],
                             cwd=SRC, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            fail(f"rendering {template}: {out.stderr}")
        return [d for d in yaml.safe_load_all(out.stdout) if d]

    sim = podsim.Sim(VOL, BIN, os.path.join(SRC, "slurm"), os.path.join(WORK, "pods"),
                     secrets={"hf-token": {"token": "hf_k8s_test_token"}})

    def run(template, chaos=None, **extra):
        (job,) = render(template, **extra)
        say(f"{job['kind']} {job['metadata']['name']}: {job['spec'].get('completions', 1)} completions, "
            f"parallelism {job['spec'].get('parallelism', 1)}")
        r = sim.run_job(job, chaos=chaos, timeout=240)
        if not r["succeeded"]:
            fail(f"{job['metadata']['name']} failed: indexes {r['failed_indexes']}, {r['reason']}", sim)
        return r

    def open_files(pid_root):
        """Paths the process group of pid_root (the pod's container) has open."""
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.getpgid(int(pid)) != pid_root:
                    continue
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        return out

    def comms(pid_root):
        out = []
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.getpgid(int(pid)) == pid_root:
                    out.append(open(f"/proc/{pid}/comm").read().strip())
            except OSError:
                continue
        return out

    # ---- 2. the data stages
    part = os.path.join(DATA, "raw", SLOW) + ".part"
    killed = []

    def kill_download_mid_file(running):
        if killed or not os.path.exists(part) or os.path.getsize(part) < 30000:
            return []
        holders = [p for p in running if any(f.endswith(SLOW + ".part") for f in open_files(p.proc.pid))]
        if len(holders) != 1:
            return []
        killed.append((holders[0], os.path.getsize(part)))
        return holders

    r = run("download-job", chaos=kill_download_mid_file)
    if not killed:
        fail("the download pod writing the slow file was never caught mid-file", sim)
    victim, at = killed[0]
    reruns = [p for p in r["pods"] if p.index == victim.index and p is not victim]
    if victim.exit_code != 137 or len(reruns) != 1 or reruns[0].exit_code != 0:
        fail(f"download index {victim.index}: killed pod exit {victim.exit_code}, reruns {len(reruns)}", sim)
    stats = json.load(urllib.request.urlopen(endpoint + "/_stats"))
    gets = stats["cdn_gets"].get(SLOW, [])
    resumed = [g for g in gets if g.startswith("bytes=") and int(g[6:].split("-")[0]) > 0]
    if len(gets) != 2 or not resumed:
        fail(f"the killed file was not resumed with a Range request: CDN requests {gets}")
    for f in glob.glob(os.path.join(SRC, "sample", "slimpajama-mini", "*", "chunk*", "*.zst")):
        rel = os.path.relpath(f, os.path.join(SRC, "sample", "slimpajama-mini"))
        if not rel.startswith(("train/", "validation/")):
            continue
        got = os.path.join(DATA, "raw", rel)
        if not os.path.exists(got) or sha(got) != sha(f):
            fail(f"raw/{rel} differs from the repo's file")
    if glob.glob(os.path.join(DATA, "raw", "**", "*.part"), recursive=True):
        fail("a .part file was left behind")
    say(f"   download pod {victim.name} killed mid-file ({at} bytes of {SLOW}); its replacement resumed it "
        f"({resumed[0]}); every file verified")

    run("extract-job")
    run("concat-plan-job")
    run("concat-job")
    tok_killed = []

    def kill_tokenize_mid_file(running):
        """A pod whose ptk-tokenize runs, killed while it runs: each pod is stopped (SIGSTOP to its process group)
        before its processes are listed, so that the one seen running is still running when the kill lands (the
        listing takes milliseconds; a pod whose ptk-tokenize ended meanwhile exited 0, and the test failed)."""
        if tok_killed:
            return []
        for p in running:
            try:
                os.killpg(p.proc.pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            if "ptk-tokenize" in comms(p.proc.pid):
                tok_killed.append(p)
                return [p]  # SIGKILL ends it stopped
            try:
                os.killpg(p.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        return []

    r = run("tokenize-job", chaos=kill_tokenize_mid_file)
    if not tok_killed or tok_killed[0].exit_code != 137:
        fail("no tokenize pod was killed mid-file", sim)
    if not [p for p in r["pods"] if p.index == tok_killed[0].index and p.exit_code == 0]:
        fail("the killed tokenize index was not rerun", sim)
    if sim.uts and "workers on ptk-tokenize-1\n" not in open(os.path.join(sim.log_dir, "ptk-tokenize-1-0.ptk.log")).read():
        fail("the tokenize pod of index 1 does not run under its pod's hostname ptk-tokenize-1")
    say(f"   tokenize pod {tok_killed[0].name} killed while ptk-tokenize ran; its replacement finished the index")

    # ---- the same tools in one process: what the Slurm path and the main job give
    REF = os.path.join(WORK, "ref")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION"))}
    env.update(HF_ENDPOINT=endpoint, HF_TOKEN="hf_k8s_test_token")

    def tool(*argv):
        out = subprocess.run([os.path.join(BIN, argv[0]), *argv[1:]], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            fail(f"reference {' '.join(argv)}: {out.stderr[-2000:]}")

    say("reference: the same tools in one process")
    tool("ptk-download", "--quiet", "--repo", "cerebras/SlimPajama-627B", "--include", "train/**", "--include",
         "validation/**", "--local-dir", f"{REF}/raw")
    tool("ptk-extract", "--quiet", f"{REF}/raw", "--output-dir", f"{REF}/extracted")
    tool("ptk-concat", "--quiet", "--input", f"{REF}/extracted/train", "--output-dir", f"{REF}/chunks", "--chunks", "4")
    os.makedirs(f"{REF}/pre")
    for c in sorted(glob.glob(f"{REF}/chunks/train_*.jsonl")):
        n = os.path.basename(c)[:-len(".jsonl")]
        tool("ptk-tokenize", "--quiet", "--input", c, "--output-prefix", f"{REF}/pre/{n}", "--append-eod",
             "--workers", "2")
    tool("ptk-tokenize", "--quiet", "--input", f"{REF}/extracted/validation", "--output-prefix",
         f"{REF}/pre/validation", "--append-eod", "--workers", "2")
    compared = 0
    for f in sorted(glob.glob(f"{REF}/chunks/train_*.jsonl")) + sorted(glob.glob(f"{REF}/pre/*_text_document.bin")) + \
            sorted(glob.glob(f"{REF}/pre/*_text_document.idx")):
        sub = "chunks" if "/chunks/" in f else "preprocessed"
        got = os.path.join(DATA, sub, os.path.basename(f))
        if not os.path.exists(got) or sha(got) != sha(f):
            fail(f"{sub}/{os.path.basename(f)} differs from the single-process run")
        compared += 1
    if compared != 4 + 10:
        fail(f"compared {compared} files, expected 4 chunks and 5 datasets")
    for name, ref in (("vocab.json", "gpt2-vocab.json"), ("merges.txt", "gpt2-merges.txt")):
        if sha(os.path.join(DATA, "bpe", name)) != sha(os.path.join(SRC, "tokenizer", "data", ref)):
            fail(f"bpe/{name} is not the GPT-2 file")
    litter = [f for f in glob.glob(os.path.join(VOL, "**", "*"), recursive=True)
              if any(m in os.path.basename(f) for m in (".ptk-tmp", ".ptk-resume", ".ptk-publish", ".part"))
              or os.path.basename(f).startswith((".vocab.json.", ".merges.txt."))]
    if litter:
        fail(f"left behind: {litter}")
    say("   4 chunks and 5 datasets (4 chunks, validation) byte-identical to the single-process run; no litter")

    # ---- docs/cluster.md's "resume after a failure": an index that fails for good, then delete and apply again
    victim = sorted(glob.glob(os.path.join(DATA, "raw", "train", "**", "*.zst"), recursive=True))[0]
    with open(victim, "r+b") as f:  # damaged on the volume: extract fails on it at every try
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"garbage!")
    (job,) = render("extract-job")
    say("Job ptk-extract again, over a damaged download")
    r = sim.run_job(job, timeout=120)
    tries = [p for p in r["pods"] if p.exit_code != 0]
    if r["succeeded"] or len(r["failed_indexes"]) != 1 or len(tries) != 4:
        fail(f"a damaged input: succeeded {r['succeeded']}, failed indexes {r['failed_indexes']}, {len(tries)} failed "
             "pods (expected one index failing 1 + BACKOFF_LIMIT_PER_INDEX 3 times)", sim)
    bad_log = open(os.path.join(sim.log_dir, f"{tries[-1].name}.ptk.log")).read()
    if "corrupt zstd data" not in bad_log:
        fail("the failed pod's log does not say why:\n" + bad_log[-2000:])
    (dl,) = render("download-job", DOWNLOAD_VERIFY="1")  # docs/cluster.md: re-download verified
    if not sim.run_job(dl, timeout=120)["succeeded"]:
        fail("the verified re-download failed", sim)
    if sha(victim) != sha(os.path.join(SRC, "sample", "slimpajama-mini", os.path.relpath(victim, f"{DATA}/raw"))):
        fail("--verify did not repair the damaged download")
    run("extract-job")
    for f in glob.glob(f"{REF}/extracted/**/*.jsonl", recursive=True):
        if sha(f) != sha(os.path.join(DATA, "extracted", os.path.relpath(f, f"{REF}/extracted"))):
            fail(f"extracted/{os.path.relpath(f, REF + '/extracted')} differs after the repair")
    say(f"   index {r['failed_indexes'][0]} failed 4 times ('corrupt zstd data'), the others completed; a verified "
        "re-download and the Job applied again repaired it")
    (job,) = render("extract-job")
    job["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"] = "2"  # JOB_COMPLETIONS != completions 3
    r = sim.run_job(job, timeout=60)
    two = [p for p in r["pods"] if p.index == 2]
    if r["failed_indexes"] != [2] or len(two) != 1 or two[0].exit_code != 2:
        fail(f"a usage error: failed indexes {r['failed_indexes']}, index 2 ran {len(two)} times "
             f"(exit {[p.exit_code for p in two]}); FailIndex should stop it at once", sim)
    say("   a usage error (JOB_COMPLETIONS 2 for 3 completions): index 2 exits 2 and fails at once (FailIndex)")

    # ---- 3. training: the Indexed Job variant uninterrupted, then the PyTorchJob with rank 1 killed
    tb = os.path.join(VOL, "ptk", "results", "train", "tensorboard", "metrics.jsonl")
    docs = render("train-job", CKPT_DIR="/fsx/ptk/ckpt-indexed")
    svc = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    if job["spec"]["template"]["spec"]["subdomain"] != svc["metadata"]["name"]:
        fail("the Job's pods are not under the headless Service's name")
    say("Job ptk-train (Indexed, 2 ranks) + headless Service ptk-train")
    r = sim.run_job(job, timeout=240)
    if not r["succeeded"]:
        fail("the Indexed Job's training failed", sim)
    # Rank 0 prints Megatron's print_rank_0 lines, the last rank (1) its print_rank_last lines: the log
    # lines and the evaluations'.
    log0 = open(os.path.join(sim.log_dir, "ptk-train-0-0.pytorch.log")).read()
    log1 = open(os.path.join(sim.log_dir, "ptk-train-1-0.pytorch.log")).read()
    if "data parallel: 2 ranks (torchrun variables)" not in log0 or "iteration       60/      60" not in log1:
        fail("the Indexed Job did not train 2 ranks to iteration 60:\n" + log0[-3000:] + log1[-3000:])
    if "validation loss at iteration 60 on validation set" not in log1:
        fail("training did not evaluate on the validation split:\n" + log1[-3000:])
    ref_ckpt = os.path.join(VOL, "ptk", "ckpt-indexed")
    # The PyTorchJob's run starts afresh: beside the Indexed Job's event files it would write in a
    # TensorBoard run directory of its own (run-2), so the Indexed Job's directory is moved aside.
    os.rename(os.path.dirname(tb), os.path.dirname(tb) + ".indexed")
    say("   2 ranks over loopback (rank 0 reached as ptk-train-0.ptk-train), iteration 60, checkpoints 20/40/60")

    (pj,) = render("pytorchjob", CKPT_DIR="/fsx/ptk/ckpt-pytorchjob")
    # The run's length as an abbreviation ptk-train accepts (--train-it, as argparse takes it). Regression:
    # train.sh judged completion from --train-iters alone, so the Worker that stopped with the SIGTERMed
    # Master exited 0 (Succeeded, never run again) and the Master waited for it until the timeout.
    for spec in pj["spec"]["pytorchReplicaSpecs"].values():
        args = spec["template"]["spec"]["containers"][0]["args"]
        args[args.index("--train-iters=60")] = "--train-it=60"
    ckpt = os.path.join(VOL, "ptk", "ckpt-pytorchjob")
    worker_killed, master_stopped, resumed_from = [], [], []

    def sigterm_caught(pid):
        """Whether process pid has a handler for SIGTERM (its SigCgt mask): train.sh's trap, ptk-train's
        --exit-signal-handler."""
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
        except OSError:
            pass
        return False

    def trainer_pid(pid_root):
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.getpgid(int(pid)) == pid_root and \
                        open(f"/proc/{pid}/comm").read().strip() == "ptk-train":
                    return int(pid)
            except OSError:
                continue
        return None

    def kill_worker_then_stop_master(running):
        """SIGKILL the Worker (rank 1) once a checkpoint is saved (20, or 40) and training goes on. Its restart
        is held, so the restarted Master waits for it at the rendezvous, before its first iteration: SIGTERM
        the Master there (once train.sh and ptk-train catch it), as a preemption would, then let the Worker
        start. The Master stops after one iteration, at the checkpoint's iteration + 1, however slow the
        machine: no window to hit."""
        try:
            latest = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())
        except (OSError, ValueError):
            return []
        if not worker_killed and 20 <= latest < 60:
            w = [p for p in running if p.replica == ("Worker", 0)]
            for p in w:
                p.hold = threading.Event()
            worker_killed.extend(w)
            return w
        if worker_killed and not master_stopped:
            m = [p for p in running if p.replica == ("Master", 0) and p.restarts >= 1]
            if m and sigterm_caught(m[0].proc.pid):
                child = trainer_pid(m[0].proc.pid)
                if child is not None and sigterm_caught(child):
                    master_stopped.extend(m)
                    resumed_from.append(latest)
                    sim.terminate(m[0])
                    worker_killed[0].hold.set()
        return []

    say("PyTorchJob ptk-train: Master + 1 Worker; the Worker (rank 1) SIGKILLed after a checkpoint, the restarted "
        "Master (rank 0) SIGTERMed while it waits for the Worker")
    try:
        r = sim.run_pytorchjob(pj, chaos=kill_worker_then_stop_master, timeout=150)
    except TimeoutError as e:
        fail(str(e), sim)
    if not worker_killed or not master_stopped:
        fail("the Worker was never killed or the Master never stopped mid-run (training too fast?)", sim)
    if not r["succeeded"]:
        fail(f"the PyTorchJob did not recover: {r['exit_codes']}", sim)
    restarts = {p.name: p.restarts for p in r["pods"]}
    if restarts.get("ptk-train-worker-0", 0) < 2 or restarts.get("ptk-train-master-0", 0) < 2:
        fail(f"the ranks were not restarted in place after each stop: {restarts}", sim)
    mlog = open(os.path.join(sim.log_dir, "ptk-train-master-0.pytorch.log")).read()
    wlog = open(os.path.join(sim.log_dir, "ptk-train-worker-0.pytorch.log")).read()
    if "loaded checkpoint" not in mlog or "iteration       60/      60" not in wlog:  # the log lines: the last rank's
        fail("the restarted ranks did not resume from the checkpoint to iteration 60:\n" + mlog[-4000:] + wlog[-4000:],
             sim)
    stop = resumed_from[0] + 1  # the checkpoint the restarted ranks loaded, and the one iteration after the SIGTERM
    if "train.sh: ptk-train stopped before its last iteration on SIGTERM with a checkpoint saved; exit 143" \
            not in mlog or "train.sh: ptk-train stopped before its last iteration with a checkpoint saved; exit 75" \
            not in wlog:
        fail("the SIGTERMed Master and the Worker that stopped with it did not exit 143 and 75 (their pods would "
             "have counted as succeeded):\n" + mlog[-3000:] + wlog[-3000:], sim)
    its = sorted({json.loads(line)["iteration"] for line in open(tb)})
    if its != list(range(1, 61)):
        fail(f"iterations logged: {its[:5]}...{its[-5:]} ({len(its)} distinct), expected 1..60")
    def checkpoint(path):
        """A ptk checkpoint (trainer/checkpoint.cpp): magic, u64 header length, JSON header, the arrays
        (parameters, AdamW moments), a hex SHA-256. The header's training wall time differs between runs, and
        its record of the command line names each run's checkpoint directory."""
        b = open(path, "rb").read()
        n = int.from_bytes(b[8:16], "little")
        header = json.loads(b[16:16 + n].decode().replace("/ckpt-pytorchjob", "/ckpt-indexed")
                            .replace('"--train-it=60"', '"--train-iters=60"'))
        header.pop("wall_seconds")
        return header, hashlib.sha256(b[16 + n:-64]).hexdigest()

    files = sorted(os.path.relpath(f, ref_ckpt) for f in glob.glob(os.path.join(ref_ckpt, "**", "*.ptk"), recursive=True))
    extra = sorted(set(os.listdir(ckpt)) - set(os.listdir(ref_ckpt)))
    if len(files) != 3 or extra != [f"iter_{stop:07d}"]:  # the checkpoints at 20, 40, 60, and the SIGTERM's
        fail(f"checkpoints: {files} (uninterrupted) vs {sorted(os.listdir(ckpt))}")
    for f in files:
        if checkpoint(os.path.join(ckpt, f)) != checkpoint(os.path.join(ref_ckpt, f)):
            fail(f"checkpoint {f} differs from the uninterrupted run's (weights, moments or state)")
    if open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() != "60":
        fail("latest_checkpointed_iteration.txt is not 60")
    say(f"   both ranks restarted in place after each stop {restarts}, the SIGTERMed Master saved {extra[0]}, it "
        "exited 143 and the Worker 75, each restart resumed from the latest checkpoint: iterations 1..60 all logged; checkpoints "
        "20/40/60 (weights, moments, state) bit-identical to the uninterrupted run's")
    print(f"k8s local run: OK ({time.time() - T0:.0f} s)")
except TimeoutError as e:  # a Job that did not finish: its pods' processes, events and logs, kept
    fail(str(e), sim)
finally:
    hub.kill()
    hub.wait()
    if os.environ.get("PTK_KEEP_WORK"):
        print(f"work directory kept: {WORK}")
    else:
        shutil.rmtree(WORK, ignore_errors=True)
