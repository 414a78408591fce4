"""Runs rendered Kubernetes manifests' pods as local processes, as the controllers would run them.

No cluster: each pod's container is started with exactly its manifest's command, args and env, plus
what Kubernetes adds, and the Job / PyTorchJob controllers' retry rules are applied to its exit:

  - the kubelet's environment: the image's PATH (/opt/ptk/bin first, as the Dockerfile sets it),
    HOSTNAME (the pod's hostname), the container's env in order with `$(VAR)` references to earlier
    entries expanded, valueFrom fieldRef (the pod's annotations, labels, name, namespace) and
    secretKeyRef (from a dict standing in for the cluster's Secrets; optional ones may be missing);
    `$(VAR)` in command and args expanded against that env ($$ is a literal $, unknown names are
    left as written) -- the algorithm of k8s.io/kubernetes third_party/forked/golang/expansion;
  - the Job controller (Indexed Jobs): one pod per completion index, at most `parallelism` at once,
    lowest pending index first; the Job's uid (a fresh uuid for each Job run) as its pods' labels
    batch.kubernetes.io/controller-uid and controller-uid (as Kubernetes 1.27+); JOB_COMPLETION_INDEX appended to every container's env as a fieldRef
    to the pod's batch.kubernetes.io/job-completion-index annotation (as
    pkg/controller/job/indexed_job_utils.go does), the pod's hostname `<job>-<index>`;
    restartPolicy Never: a failed pod is matched against podFailurePolicy (FailIndex, FailJob,
    Ignore, Count), counted against backoffLimitPerIndex (or backoffLimit), and replaced by a new pod
    for the same index once the old one is gone (podReplacementPolicy Failed); OnFailure: the
    container is restarted in place, restarts counted against backoffLimit;
  - the training operator (PyTorchJob, kubeflow.org/v1): Master and Worker pods started together,
    the env the operator appends (pkg/controller.v1/pytorch/envvar.go, master.go of v1.9.0):
    PYTHONUNBUFFERED, MASTER_PORT/PET_MASTER_PORT (the port named pytorchjob-port), MASTER_ADDR/
    PET_MASTER_ADDR (the Master's service name), WORLD_SIZE, RANK (Master 0, Worker i -> i + 1),
    PET_NODE_RANK, PET_NNODES; restartPolicy OnFailure restarts in place against runPolicy.backoffLimit.

What stands in for the cluster: the shared volume is a local directory (the volumeMount's
mountPath is replaced by it in command, args and env values), the image's /opt/ptk/bin is the build's
bin directory and /opt/ptk/share/ptk/{slurm,k8s} this checkout's slurm/ and k8s/ (where the
Dockerfile's portable tree has them), and the cluster's DNS is a table of names (the Master's service, `<pod>.<subdomain>`)
that resolve to 127.0.0.1, replaced in env values, command and args. Restart back-off is 0.2 s
doubling instead of the kubelet's 10 s. The operator's injected init container (an nslookup loop in
alpine) is not run: its DNS wait has nothing to wait for here. Each container runs in its own process
group, in a scratch directory (the image's WORKDIR would be the checkout's slurm/), and, as root, in a
UTS namespace of its own whose hostname is the pod's (otherwise only HOSTNAME says it).
"""
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid

IMAGE_PATH = "/opt/ptk/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def expand(s, env):
    """Kubernetes' $(VAR) expansion: $$ -> $, $(NAME) -> env[NAME] when defined, else left as written."""
    out = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "$" and i + 1 < len(s):
            n = s[i + 1]
            if n == "$":
                out.append("$")
                i += 2
                continue
            if n == "(":
                j = s.find(")", i + 2)
                if j < 0:  # no closing parenthesis: the rest as written
                    out.append(s[i:])
                    break
                name = s[i + 2:j]
                out.append(env[name] if name in env else "$(" + name + ")")
                i = j + 1
                continue
            out.append("$" + n)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


class Pod:
    def __init__(self, name, hostname, spec, annotations, labels, injected_env, index=None, replica=None):
        self.name, self.hostname, self.spec = name, hostname, spec
        self.annotations, self.labels = annotations, labels
        self.injected_env = injected_env  # what a controller appends to every container's env
        self.index, self.replica = index, replica
        self.proc = None
        self.restarts = 0
        self.exit_code = None
        self.killed = False  # by the test (SIGKILL), as an OOM kill or a lost node would
        self.disrupted = False  # with a DisruptionTarget condition (eviction, preemption)
        # A threading.Event the test may set here: the pod's next (re)start of its containers waits for
        # it, so that a test can act while this pod is known to be down (as a slow image pull or node).
        self.hold = None


class Sim:
    """One cluster: a volume directory, the image's files, Secrets, DNS names and a log directory."""

    def __init__(self, volume_dir, bin_dir, slurm_dir, log_dir, secrets=None, dns=(), restart_backoff=0.2):
        self.volume_dir, self.bin_dir, self.slurm_dir, self.log_dir = volume_dir, bin_dir, slurm_dir, log_dir
        self.k8s_dir = os.path.join(os.path.dirname(slurm_dir), "k8s")
        self.secrets = secrets or {}
        self.dns = set(dns)
        self.restart_backoff = restart_backoff
        # A UTS namespace per container (root only) gives it the pod's hostname; else HOSTNAME alone.
        self.uts = os.geteuid() == 0 and subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0
        self.events = []  # (time, pod, what) for the test's checks and for failure messages
        self.lock = threading.Lock()
        os.makedirs(log_dir, exist_ok=True)

    def event(self, pod, what):
        with self.lock:
            self.events.append((time.time(), pod.name, what))

    # ---- what the image and the cluster stand for
    def mapping(self, mounts):
        m = [(mp, self.volume_dir) for mp in mounts] + [("/opt/ptk/bin", self.bin_dir),
                                                         ("/opt/ptk/share/ptk/slurm", self.slurm_dir),
                                                         ("/opt/ptk/share/ptk/k8s", self.k8s_dir)]
        return sorted(m, key=lambda x: -len(x[0]))

    def localize(self, s, mounts):
        for name in sorted(self.dns, key=len, reverse=True):
            s = re.sub(r"(?<![\w.-])" + re.escape(name) + r"(?![\w.-])", "127.0.0.1", s)
        for image_path, local in self.mapping(mounts):
            s = s.replace(image_path, local)
        return s

    def field(self, pod, path):
        m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
        if m:
            return (pod.annotations if m.group(1) == "annotations" else pod.labels).get(m.group(2))
        return {"metadata.name": pod.name, "metadata.namespace": "default", "spec.nodeName": "localhost",
                "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1"}.get(path)

    def container_env(self, pod, c):
        env = {"PATH": IMAGE_PATH, "HOSTNAME": pod.hostname, "HOME": "/root"}
        for e in list(c.get("env", [])) + pod.injected_env:
            name = e["name"]
            if "value" in e:
                env[name] = expand(str(e["value"]), env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    v = self.field(pod, vf["fieldRef"]["fieldPath"])
                    if v is None:
                        raise RuntimeError(f"{pod.name}: env {name}: no field {vf['fieldRef']['fieldPath']}")
                    env[name] = v
                elif "secretKeyRef" in vf:
                    ref = vf["secretKeyRef"]
                    v = self.secrets.get(ref["name"], {}).get(ref["key"])
                    if v is None:
                        if not ref.get("optional"):
                            raise RuntimeError(f"{pod.name}: env {name}: secret {ref['name']} is missing")
                        continue
                    env[name] = v
                else:
                    raise RuntimeError(f"{pod.name}: env {name}: unsupported valueFrom {vf}")
            else:
                env[name] = ""
        return env

    def start(self, pod, c, tag):
        mounts = [vm["mountPath"] for vm in c.get("volumeMounts", [])]
        env = self.container_env(pod, c)
        argv = [expand(str(a), env) for a in list(c.get("command", [])) + list(c.get("args", []))]
        if not argv:
            raise RuntimeError(f"{pod.name}: container {c['name']} has no command (the image has no entrypoint)")
        env = {k: self.localize(v, mounts) for k, v in env.items()}
        argv = [self.localize(a, mounts) for a in argv]
        if self.uts:  # the pod's own hostname, as gethostname() and `hostname` see it
            argv = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', pod.hostname] + argv
        cwd = tempfile.mkdtemp(prefix="pod-cwd-", dir=self.log_dir)
        log = open(os.path.join(self.log_dir, f"{pod.name}.{tag}.log"), "ab")
        log.write(f"== {pod.name} {c['name']} attempt {pod.restarts}: {argv}\n".encode())
        log.flush()
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        log.close()
        return p

    def run_containers(self, pod, restart_on_failure):
        """Init containers in order, then the (single) main container; OnFailure restarts in place."""
        spec = pod.spec
        containers = spec["containers"]
        assert len(containers) == 1, "one container per pod"
        while True:
            if pod.hold is not None:
                self.event(pod, "held before its start")
                pod.hold.wait()
                pod.hold = None
            rc = 0
            for ic in spec.get("initContainers", []):
                p = self.start(pod, ic, ic["name"])
                rc = p.wait()
                self.end_container(pod, p)
                if rc != 0:
                    break
            if rc == 0:
                pod.proc = self.start(pod, containers[0], containers[0]["name"])
                self.event(pod, "started")
                rc = pod.proc.wait()
                self.end_container(pod, pod.proc)
                if rc < 0:
                    rc = 128 - rc  # a container killed by signal N exits 128 + N
            pod.exit_code = rc
            self.event(pod, f"exited {rc}")
            if rc == 0 or not restart_on_failure or pod.restarts_left() <= 0:
                return rc
            time.sleep(self.restart_backoff * (2 ** min(pod.restarts, 4)))
            pod.restarts += 1
            pod.killed = False
            self.event(pod, "restarted in place")

    def end_container(self, pod, proc, bound=60):
        """A container ends with its first process: the runtime then kills what is left of it (its PID
        namespace goes), and the pod ends, and a replacement may start (podReplacementPolicy Failed), only
        once all of its processes are gone. Here the rest of the process group is SIGKILLed and waited
        for (at most `bound` seconds: then the failure's events say what was left). Without it a
        replacement could start while a killed container's ptk-tokenize was still exiting (it outlives the
        shell it is killed with in most kills), its output's lock still held: two pods on one index's files."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        until = time.time() + bound
        while True:  # zombies are gone for this purpose (their files are closed); init reaps them
            left = [x for x in self.group_processes(proc.pid) if x[2] not in ("Z", "X")]
            if not left:
                return
            if time.time() > until:
                self.event(pod, f"processes left {bound} s after its container ended: {left}")
                return
            time.sleep(0.01)

    @staticmethod
    def group_processes(pgid):
        """The processes of process group pgid (a pod's container) as (pid, comm, state, wchan): what a
        failure message shows of a pod that did not end (T: stopped, D: in uninterruptible I/O, Z: a zombie)."""
        out = []
        for pid in os.listdir("/proc"):
            try:
                if not pid.isdigit() or os.getpgid(int(pid)) != pgid:
                    continue
                comm = open(f"/proc/{pid}/comm", errors="replace").read().strip()
                state = open(f"/proc/{pid}/stat", errors="replace").read().rsplit(")", 1)[1].split()[0]
                wchan = open(f"/proc/{pid}/wchan", errors="replace").read().strip() or "-"
                out.append((int(pid), comm, state, wchan))
            except OSError:
                continue
        return out

    def snapshot(self, pods):
        """One line per pod that is still up, with its processes, for a failure message."""
        lines = []
        for p in pods:
            procs = self.group_processes(p.proc.pid) if p.proc is not None else []
            lines.append(f"  {p.name}: " + (", ".join(f"{c} (pid {i}, state {s}, wchan {w})" for i, c, s, w in procs)
                                            or ("not started" if p.proc is None else "no process left")))
        return "\n".join(lines)

    def kill(self, pod, disruption=False):
        """SIGKILL the pod's container (its process group), as an OOM kill, a lost node or an eviction."""
        pod.killed = True
        pod.disrupted = disruption
        self.event(pod, "killed" + (" (DisruptionTarget)" if disruption else ""))
        if pod.proc is None:  # not started yet (its thread is still starting it)
            return
        try:
            os.killpg(pod.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def terminate(self, pod):
        """SIGTERM to the container's first process only, as the kubelet stops a container (preemption,
        eviction, kubectl delete). Here the container is then restarted in place when it fails (OnFailure),
        where a cluster would run the rank in a new pod: either way the rank runs again."""
        self.event(pod, "SIGTERM")
        try:
            os.kill(pod.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    # ---- batch/v1 Job
    def run_job(self, job, chaos=None, timeout=300):
        """Runs a Job to its end; returns {'succeeded': bool, 'failed_indexes': [...], 'pods': [Pod]}."""
        spec = job["spec"]
        name = job["metadata"]["name"]
        indexed = spec.get("completionMode") == "Indexed"
        completions = spec.get("completions", 1)
        parallelism = spec.get("parallelism", 1)
        template = job["spec"]["template"]
        pspec = template["spec"]
        restart = pspec["restartPolicy"]
        per_index = spec.get("backoffLimitPerIndex")
        backoff_limit = spec.get("backoffLimit", 2147483647 if per_index is not None else 6)
        rules = (spec.get("podFailurePolicy") or {}).get("rules", [])
        labels = dict(template.get("metadata", {}).get("labels", {}))
        uid = str(uuid.uuid4())  # the Job's, which the controller puts on its pods (1.27+: both labels)
        labels.update({"batch.kubernetes.io/job-name": name, "job-name": name,
                       "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid})
        if indexed and pspec.get("subdomain"):  # <hostname>.<subdomain> of every index, in the cluster's DNS
            for i in range(completions):
                for suffix in ("", ".default", ".default.svc", ".default.svc.cluster.local"):
                    self.dns.add(f"{name}-{i}.{pspec['subdomain']}{suffix}")
        pending = list(range(completions))
        failures = {i: 0 for i in range(completions)}
        total_failures = [0]
        done, failed_indexes = set(), set()
        job_failed = [None]
        running = {}
        all_pods = []
        lock = threading.Lock()

        def make_pod(i):
            ann = {COMPLETION_INDEX_ANNOTATION: str(i)} if indexed else {}
            lab = dict(labels)
            if indexed:
                lab[COMPLETION_INDEX_ANNOTATION] = str(i)
            hostname = f"{name}-{i}" if indexed else f"{name}-{len(all_pods)}"
            inj = ([{"name": "JOB_COMPLETION_INDEX",
                     "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}}]
                   if indexed else [])
            pod = Pod(f"{name}-{i}-{failures[i]}", hostname, pspec, ann, lab, inj, index=i)
            pod.restarts_left = lambda: backoff_limit - sum(p.restarts for p in all_pods)
            all_pods.append(pod)
            return pod

        def judge(pod, rc):
            """The podFailurePolicy's action for a failed pod: FailJob, FailIndex, Ignore or Count."""
            for r in rules:
                oe = r.get("onExitCodes")
                if oe is not None:
                    if oe.get("containerName") not in (None, pspec["containers"][0]["name"]):
                        continue
                    hit = rc in oe["values"]
                    if (oe["operator"] == "In") == hit:
                        return r["action"]
                for pc in r.get("onPodConditions", []):
                    if pc["type"] == "DisruptionTarget" and pod.disrupted and pc.get("status", "True") == "True":
                        return r["action"]
            return "Count"

        def worker(pod):
            try:
                rc = self.run_containers(pod, restart == "OnFailure")
            except Exception as e:  # the simulator's own failure (a pod not started): the job ends, saying why,
                with lock:  # rather than waiting for a pod that no thread runs any more
                    del running[pod.index]
                    job_failed[0] = f"simulator error in pod {pod.name}: {type(e).__name__}: {e}"
                return
            with lock:
                del running[pod.index]
                if rc == 0:
                    done.add(pod.index)
                    return
                rc_seen = rc
                if restart == "OnFailure":  # restarts exhausted
                    job_failed[0] = f"BackoffLimitExceeded (pod {pod.name} exit {rc_seen})"
                    return
                action = judge(pod, rc_seen)
                self.event(pod, f"podFailurePolicy: {action} (exit {rc_seen})")
                if action == "FailJob":
                    job_failed[0] = f"PodFailurePolicy FailJob (pod {pod.name} exit {rc_seen})"
                elif action == "FailIndex":
                    failed_indexes.add(pod.index)
                elif action == "Ignore":
                    pending.insert(0, pod.index)
                else:
                    failures[pod.index] += 1
                    total_failures[0] += 1
                    if per_index is not None and failures[pod.index] > per_index:
                        failed_indexes.add(pod.index)
                    elif total_failures[0] > backoff_limit:
                        job_failed[0] = f"BackoffLimitExceeded ({total_failures[0]} failed pods)"
                    else:
                        pending.insert(0, pod.index)  # the replacement, now that the old pod is gone

        deadline = time.time() + timeout
        threads = []
        while True:
            with lock:
                if job_failed[0]:
                    for p in running.values():
                        self.kill(p)
                    if not running:
                        break
                else:
                    while pending and len(running) < parallelism:
                        i = pending.pop(0)
                        pod = make_pod(i)
                        running[i] = pod
                        t = threading.Thread(target=worker, args=(pod,), daemon=True)
                        t.start()
                        threads.append(t)
                    if not pending and not running:
                        break
                now_running = [p for p in running.values() if p.proc is not None and p.proc.poll() is None]
            if chaos:
                for p in chaos(now_running) or []:
                    self.kill(p)
            if time.time() > deadline:
                with lock:
                    up = self.snapshot(running.values())
                    for p in running.values():
                        self.kill(p)
                raise TimeoutError(f"job {name} did not finish within {timeout} s; pods still up:\n{up}")
            time.sleep(0.05)
        for t in threads:
            t.join()
        ok = not job_failed[0] and not failed_indexes and len(done) == completions
        return {"succeeded": ok, "failed_indexes": sorted(failed_indexes), "reason": job_failed[0], "pods": all_pods}

    # ---- kubeflow.org/v1 PyTorchJob
    def run_pytorchjob(self, pj, chaos=None, timeout=300):
        name = pj["metadata"]["name"]
        specs = pj["spec"]["pytorchReplicaSpecs"]
        backoff_limit = pj["spec"].get("runPolicy", {}).get("backoffLimit", 2147483647)
        total = sum(int(s.get("replicas", 1)) for s in specs.values())
        master = specs["Master"]
        port = next(p["containerPort"] for c in master["template"]["spec"]["containers"] if c["name"] == "pytorch"
                    for p in c.get("ports", []) if p.get("name") == "pytorchjob-port")
        master_addr = f"{name}-master-0"
        self.dns.add(master_addr)
        pods = []
        for rtype in ("Master", "Worker"):
            if rtype not in specs:
                continue
            rs = specs[rtype]
            for i in range(int(rs.get("replicas", 1))):
                rank = i + 1 if rtype == "Worker" else i
                inj = [{"name": "PYTHONUNBUFFERED", "value": "1"},
                       {"name": "MASTER_PORT", "value": str(port)}, {"name": "PET_MASTER_PORT", "value": str(port)},
                       {"name": "MASTER_ADDR", "value": master_addr},
                       {"name": "PET_MASTER_ADDR", "value": master_addr},
                       {"name": "WORLD_SIZE", "value": str(total)}, {"name": "RANK", "value": str(rank)},
                       {"name": "PET_NODE_RANK", "value": str(rank)}, {"name": "PET_NNODES", "value": str(total)}]
                pname = f"{name}-{rtype.lower()}-{i}"
                labels = dict(rs["template"].get("metadata", {}).get("labels", {}))
                labels.update({"training.kubeflow.org/job-name": name,
                               "training.kubeflow.org/replica-type": rtype.lower(),
                               "training.kubeflow.org/replica-index": str(i)})
                pod = Pod(pname, pname, rs["template"]["spec"], {}, labels, inj, replica=(rtype, i))
                pod.policy = rs.get("restartPolicy", "Never")
                pod.restarts_left = lambda: backoff_limit - sum(p.restarts for p in pods)
                pods.append(pod)
        results = {}

        def worker(pod):
            try:
                results[pod.name] = self.run_containers(pod, pod.policy in ("OnFailure", "Always"))
            except Exception as e:  # the simulator's own failure: the job fails saying why
                results[pod.name] = f"simulator error: {type(e).__name__}: {e}"

        threads = [threading.Thread(target=worker, args=(p,), daemon=True) for p in pods]
        for t in threads:
            t.start()
        deadline = time.time() + timeout
        while any(t.is_alive() for t in threads):
            running = [p for p in pods if p.proc is not None and p.proc.poll() is None]
            if chaos:
                for p in chaos(running) or []:
                    self.kill(p)
            if time.time() > deadline:
                up = self.snapshot(running)
                for p in running:
                    self.kill(p)
                raise TimeoutError(f"PyTorchJob {name} did not finish within {timeout} s; pods still up:\n{up}")
            time.sleep(0.05)
        ok = all(rc == 0 for rc in results.values())
        return {"succeeded": ok, "pods": pods, "exit_codes": results}
