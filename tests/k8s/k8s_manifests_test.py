#!/usr/bin/env python3
"""Every manifest k8s/ renders is one a cluster accepts, checked offline:

  - rendered as docs/cluster.md says (k8s/render.sh: env.sh's checks, every value quoted and escaped), with the
    defaults and with the test's small settings; the templates hold no $ reference but k8s/env.sh's
    variables, no variable is left unset, and every ${...} outside double quotes is an integer setting
    (hostile values: k8s_render_test.py);
  - Job and Service against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field is
    an error, as `kubectl apply`'s server-side field validation makes it) for 1.29 (the first release
    with backoffLimitPerIndex, podReplacementPolicy and FailIndex on by default) and the newest the
    validator knows;
  - the PyTorchJob against the openAPIV3Schema of the training operator's CRD (v1.9.0, vendored in
    tests/k8s/pytorchjob-crd/, unknown fields rejected as the API server does for a structural schema
    under strict field validation), and each of its pod templates against Kubernetes' PodTemplateSpec;
  - what the API server and the controllers check beyond the schemas (k8s.io/kubernetes
    pkg/apis/batch/validation, the training operator's defaults and env): podFailurePolicy needs
    restartPolicy Never and podReplacementPolicy Failed, FailIndex needs backoffLimitPerIndex, which
    needs an Indexed Job; onExitCodes names the container; an Indexed Job's pod hostname (<job>-<index>)
    is a DNS label; the headless Service selects the Job's pods and the pods' subdomain is its name;
    MASTER_ADDR is rank 0's name; the PyTorchJob has one Master, a container named pytorch with a port
    named pytorchjob-port, and each pod's PTK_RUN_ID is the job's name (the operator's
    training.kubeflow.org/job-name label); JOB_COMPLETIONS equals completions; every image is IMAGE, every pod mounts
    PVC_NAME at MOUNT_PATH, and the paths the commands name under /opt/ptk are in the Dockerfile's tree;
  - and the checks bite: a manifest with an unknown field, a wrong type, or a restartPolicy the
    operator does not know, a Worker without the job's run id fails them.

Usage: k8s_manifests_test.py SOURCE_DIR
Exit 77 (skipped) only when the validator (kubernetes-validate, installed by scripts/install-deps.sh
--with-python-ref into /opt/ptk-pyref/kubernetes-validate) cannot be imported.
"""
import copy
import json
import os
import re
import subprocess
import sys
import time

import yaml

SRC = os.path.abspath(sys.argv[1])
T0 = time.time()
for d in (os.environ.get("PTK_PYREF_DIR", ""), "/opt/ptk-pyref"):  # where install-deps.sh puts it
    if d and os.path.isdir(os.path.join(d, "kubernetes-validate")):
        sys.path.insert(0, os.path.join(d, "kubernetes-validate"))
        break
try:
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate import utils as kv_utils
except ImportError as e:
    bar = "!" * 100
    msg = (f"{bar}\nSKIPPED: the Kubernetes manifests were NOT validated: {e}.\n"
           "Install the validator with: bash scripts/install-deps.sh --with-python-ref\n"
           "(kubernetes-validate and jsonschema from PyPI into /opt/ptk-pyref/kubernetes-validate, or "
           f"$PTK_PYREF_DIR/kubernetes-validate)\n{bar}")
    print(msg, flush=True)
    print(msg, file=sys.stderr, flush=True)
    sys.exit(77)

VERSIONS = ["1.29", kv_utils.latest_version().rsplit(".", 1)[0]]
failures = []
expecting_failures = [False]  # while a broken manifest is checked: its failures are the point


def check(ok, msg):
    if not ok:
        failures.append(msg)
        print(f"{'   caught' if expecting_failures[0] else 'FAIL'}: {msg}", flush=True)
    return ok


def caught_by(fn, *args):
    before = len(failures)
    expecting_failures[0] = True
    fn(*args)
    expecting_failures[0] = False
    caught = len(failures) > before
    del failures[before:]
    return caught


# ---- rendering
env_sh = open(os.path.join(SRC, "k8s", "env.sh")).read()
VARS = re.search(r'PTK_K8S_VARS="([^"]*)"', env_sh).group(1).split()
TEMPLATES = sorted(f[:-len(".yaml-template")] for f in os.listdir(os.path.join(SRC, "k8s"))
                   if f.endswith(".yaml-template"))
check(TEMPLATES == ["concat-job", "concat-plan-job", "download-job", "extract-job", "pytorchjob", "tokenize-job",
                    "train-job"], f"templates: {TEMPLATES}")
INTEGER_VARS = set(re.search(r"for v in (DOWNLOAD_TASKS[^;]*);", env_sh).group(1).replace("\\", " ").split()) | set(
    re.search(r"for v in (BACKOFF_LIMIT_PER_INDEX[^;]*);", env_sh).group(1).split()) | {"WORKER_REPLICAS"}
used = set()
for t in TEMPLATES:
    text = open(os.path.join(SRC, "k8s", t + ".yaml-template")).read()
    for m in re.finditer(r"\$(\{?)([A-Za-z_][A-Za-z0-9_]*)?", text):
        name = m.group(2)
        if name is None:  # $( : a command substitution in a shell line, which envsubst leaves alone
            check(text[m.start():m.start() + 2] == "$(", f"{t}: a bare $ at {text[m.start():m.start() + 20]!r}")
            continue
        check(m.group(1) == "{", f"{t}: ${name} without braces (write ${{{name}}})")
        check(name in VARS, f"{t}: ${{{name}}} is not one of k8s/env.sh's variables: envsubst would empty it")
        line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.start())]
        # Unquoted: only the settings env.sh allows as decimal digits (render.sh escapes the rest for "...").
        quoted = re.fullmatch(r'\s*(- )?([\w./-]+: )?"[^"]*"\s*', line) is not None
        check(quoted or name in INTEGER_VARS, f"{t}: ${{{name}}} outside double quotes: {line.strip()}")
        used.add(name)
check(set(VARS) == used, f"variables of k8s/env.sh no template uses: {sorted(set(VARS) - used)}")

TEST_CONFIG = {"IMAGE": "registry.example/ptk:1.0", "MOUNT_PATH": "/data", "STAGE_PATH": "/data/ptk",
               "HF_ENDPOINT": "http://127.0.0.1:8080", "DOWNLOAD_TASKS": "2", "EXTRACT_TASKS": "3", "CONCAT_CHUNKS": "4",
               "TOKENIZE_TASKS": "3", "CPUS_PER_TASK": "1", "NUM_WORKERS": "2", "GPU_PER_WORKER": "0",
               "MASTER_PORT": "29500", "TRAIN_EXTRA_ARGS": "--device cpu"}


def render(template, config):
    env = {k: v for k, v in os.environ.items() if k not in VARS and k != "REPO_URI"}
    env.update(config)
    out = subprocess.run(["bash", "k8s/render.sh", f"k8s/{template}.yaml-template"], cwd=SRC,
                         env=env, capture_output=True, text=True)
    if not check(out.returncode == 0, f"rendering {template}: {out.stderr}"):
        return []
    check("${" not in out.stdout, f"{template}: a ${{...}} left after rendering")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# ---- the image the templates name: the Dockerfile's portable tree in /opt/ptk, its bin/ on PATH, and
# the slurm/ scripts the pods run installed beside it (cmake --install puts slurm/ in share/ptk/slurm)
dockerfile = open(os.path.join(SRC, "Dockerfile")).read()
check("--portable /opt/ptk" in dockerfile and re.search(r"^ENV PATH=/opt/ptk/bin:", dockerfile, re.M),
      "the Dockerfile no longer puts ptk in /opt/ptk with /opt/ptk/bin on PATH (the templates rely on it)")
for d in ("slurm", "k8s"):
    check(re.search(r"install\(DIRECTORY \$\{PROJECT_SOURCE_DIR\}/" + d + r"/ DESTINATION share/ptk/" + d,
                    open(os.path.join(SRC, "CMakeLists.txt")).read()),
          f"CMakeLists.txt no longer installs {d}/ into share/ptk/{d} (the templates run scripts from there)")

# ---- schemas
crd = yaml.safe_load(open(os.path.join(SRC, "tests", "k8s", "pytorchjob-crd", "kubeflow.org_pytorchjobs.yaml")))
version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
check(crd["spec"]["names"]["kind"] == "PyTorchJob" and crd["spec"]["group"] == "kubeflow.org", "the vendored CRD")


def strict(schema):
    """The API server's view of a structural schema under strict field validation: a field that is not
    in `properties` is an error unless the schema preserves unknown fields or says additionalProperties."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


PJ_SCHEMA = strict(version["schema"]["openAPIV3Schema"])
PJ_VALIDATOR = jsonschema.Draft7Validator(PJ_SCHEMA)


def validate(doc, where):
    """Schema errors of one manifest (a list of strings)."""
    errs = []
    if doc.get("kind") == "PyTorchJob":
        if doc.get("apiVersion") != "kubeflow.org/v1":
            return [f"{where}: apiVersion {doc.get('apiVersion')}"]
        for e in PJ_VALIDATOR.iter_errors(doc):
            errs.append(f"{where}: PyTorchJob CRD schema: {'.'.join(map(str, e.path))}: {e.message}")
        for rtype, rs in (doc.get("spec", {}).get("pytorchReplicaSpecs") or {}).items():
            pt = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"x-{rtype.lower()}"},
                  "template": rs.get("template", {})}
            errs += validate(pt, f"{where} {rtype}'s pod template")
        return errs
    for v in VERSIONS:
        try:
            kubernetes_validate.validate(doc, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            errs.append(f"{where}: Kubernetes {v}: {'.'.join(map(str, e.path))}: {e.message}")
        except kv_utils.SchemaNotFoundError as e:
            errs.append(f"{where}: {e.message}")
    return errs


# ---- what the API server and the controllers check beyond the schemas
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def pod_checks(where, spec, cfg):
    c = spec["containers"]
    for ctr in spec.get("initContainers", []) + c:
        check(ctr["image"] == cfg["IMAGE"], f"{where}: image {ctr['image']} is not IMAGE")
        names = [e["name"] for e in ctr.get("env", [])]
        check(len(names) == len(set(names)), f"{where}: env names repeated: {names}")
        defined = set(names) | {"JOB_COMPLETION_INDEX", "HOSTNAME"}
        for s in ctr.get("command", []) + ctr.get("args", []):
            for ref in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", s):
                check(ref in defined, f"{where}: $({ref}) refers to no env entry")
            for p in re.findall(r"/opt/ptk/[\w./-]+", s):
                m = re.match(r"/opt/ptk/share/ptk/(slurm|k8s)/(.*)", p)
                if m:
                    check(os.path.exists(os.path.join(SRC, m.group(1), m.group(2))),
                          f"{where}: {p}: no such script in {m.group(1)}/ (installed there by cmake --install)")
                else:
                    check(p.startswith("/opt/ptk/bin/"), f"{where}: {p} is not in the Dockerfile's /opt/ptk tree")
        for e in ctr.get("env", []):
            if str(e.get("value", "")).startswith("/opt/ptk/share/ptk/slurm"):
                check(os.path.isdir(os.path.join(SRC, "slurm")), f"{where}: PTK_SLURM_DIR")
        res = ctr.get("resources", {})
        if ctr in c:
            check("cpu" in res.get("requests", {}) and "memory" in res.get("requests", {}),
                  f"{where}: {ctr['name']} requests no cpu/memory")
            check(res.get("limits", {}).get("memory") == res.get("requests", {}).get("memory"),
                  f"{where}: memory limit != request (a pod over its request would be OOM-killed at random)")
        mounts = {m["name"]: m["mountPath"] for m in ctr.get("volumeMounts", [])}
        if ctr in c:
            check(mounts.get("shared") == cfg["MOUNT_PATH"], f"{where}: the shared volume is not at MOUNT_PATH")
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    check(vols.get("shared", {}).get("persistentVolumeClaim", {}).get("claimName") == cfg["PVC_NAME"],
          f"{where}: the shared volume is not the PVC PVC_NAME")


def one_rank_per_pod_checks(where, ctr, cfg):
    """A training pod is one rank: its threads are its CPU request (--threads), not a share of the node's
    cores that ptk-train would have to split by a count of ranks on the node the pod cannot know; nor
    does it claim one (LOCAL_WORLD_SIZE: the pods on a node do not share a memory cgroup). It waits
    LOCK_WAIT for --save's lock, as the data pods do for theirs: a restarted rank whose node died holding
    it on NFS (the lock lasts the server's lease, ~90 s) failed at once and spent the job's restarts."""
    args = ctr.get("command", []) + ctr.get("args", [])
    lock_wait = cfg.get("LOCK_WAIT", "180")
    check(f"--lock-wait={lock_wait}" in args, f"{where}: ptk-train is not given --lock-wait={lock_wait} (LOCK_WAIT)")
    cpu = str(ctr["resources"]["requests"]["cpu"])
    check(f"--threads={cpu}" in args, f"{where}: ptk-train's --threads is not the pod's cpu request {cpu}")
    env = {e["name"] for e in ctr.get("env", [])}
    check("LOCAL_WORLD_SIZE" not in env, f"{where}: LOCAL_WORLD_SIZE set for a pod of one rank")


def job_checks(job, cfg, service=None):
    name = job["metadata"]["name"]
    s = job["spec"]
    t = s["template"]["spec"]
    where = f"Job {name}"
    pod_checks(where, t, cfg)
    check(t["restartPolicy"] in ("Never", "OnFailure"), f"{where}: restartPolicy {t['restartPolicy']}")
    indexed = s.get("completionMode") == "Indexed"
    if indexed:
        check(isinstance(s.get("completions"), int) and s["completions"] >= 1, f"{where}: completions")
        check(s.get("parallelism", 1) >= 1, f"{where}: parallelism")
        longest = f"{name}-{s['completions'] - 1}"
        check(DNS_LABEL.match(longest) and len(longest) <= 63, f"{where}: pod hostname {longest} is not a DNS label")
        env = {e["name"]: e.get("value") for e in t["containers"][0].get("env", [])}
        if "JOB_COMPLETIONS" in env:
            check(env["JOB_COMPLETIONS"] == str(s["completions"]), f"{where}: JOB_COMPLETIONS != completions")
    pfp = s.get("podFailurePolicy")
    if pfp:
        check(t["restartPolicy"] == "Never", f"{where}: podFailurePolicy needs restartPolicy Never")
        check(s.get("podReplacementPolicy", "Failed") == "Failed",
              f"{where}: podFailurePolicy allows only podReplacementPolicy Failed")
        for r in pfp["rules"]:
            if r["action"] == "FailIndex":
                check(s.get("backoffLimitPerIndex") is not None, f"{where}: FailIndex needs backoffLimitPerIndex")
            oe = r.get("onExitCodes")
            if oe:
                check(oe.get("containerName") in [c["name"] for c in t["containers"]],
                      f"{where}: onExitCodes names no container")
                check(0 not in oe["values"] or oe["operator"] == "NotIn", f"{where}: exit code 0 in an In rule")
    if s.get("backoffLimitPerIndex") is not None:
        check(indexed, f"{where}: backoffLimitPerIndex needs completionMode Indexed")
    if t.get("subdomain"):
        check(service is not None and service["metadata"]["name"] == t["subdomain"],
              f"{where}: subdomain {t['subdomain']} names no Service in the same file")
    if service is not None:
        sp = service["spec"]
        check(sp.get("clusterIP") == "None", "the Service is not headless")
        check(sp.get("publishNotReadyAddresses") is True, "the Service does not publish pods before they are ready")
        pod_labels = dict(s["template"].get("metadata", {}).get("labels", {}))
        pod_labels.update({"batch.kubernetes.io/job-name": name, "job-name": name})
        check(all(pod_labels.get(k) == v for k, v in sp["selector"].items()), "the Service selects no pod of the Job")
        env = {e["name"]: e for e in t["containers"][0]["env"]}
        check(env["MASTER_ADDR"]["value"] == f"{name}-0.{t['subdomain']}", "MASTER_ADDR is not pod 0's name")
        check(env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] ==
              "metadata.annotations['batch.kubernetes.io/job-completion-index']", "RANK is not the completion index")
        check(env["WORLD_SIZE"]["value"] == str(s["completions"]), "WORLD_SIZE != completions")
        check(env["PTK_RUN_ID"]["valueFrom"]["fieldRef"]["fieldPath"] ==
              "metadata.labels['batch.kubernetes.io/controller-uid']", "PTK_RUN_ID is not the Job's uid")
        check(str(sp["ports"][0]["port"]) == env["MASTER_PORT"]["value"], "the Service's port is not MASTER_PORT")
        one_rank_per_pod_checks(where, t["containers"][0], cfg)


def pytorchjob_checks(pj, cfg):
    specs = pj["spec"]["pytorchReplicaSpecs"]
    check(specs["Master"]["replicas"] == 1, "PyTorchJob: one Master")
    total = sum(r["replicas"] for r in specs.values())
    check(total == int(cfg.get("NUM_WORKERS", 2)), f"PyTorchJob: {total} pods, NUM_WORKERS {cfg.get('NUM_WORKERS', 2)}")
    for rtype, rs in specs.items():
        check(rs["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode"), f"{rtype}: restartPolicy")
        spec = rs["template"]["spec"]
        pod_checks(f"PyTorchJob {rtype}", spec, cfg)
        c = spec["containers"][0]
        check(c["name"] == "pytorch", f"{rtype}: the operator sets its env in the container named pytorch")
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        check(ports.get("pytorchjob-port") == int(cfg.get("MASTER_PORT", 23456)),
              f"{rtype}: MASTER_PORT comes from the port named pytorchjob-port")
        env = {e["name"] for e in c.get("env", [])}
        check(not env & {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"},
              f"{rtype}: sets what the operator sets: {env & {'RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'}}")
        run_id = next((e for e in c.get("env", []) if e["name"] == "PTK_RUN_ID"), {})
        check(run_id.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") ==
              "metadata.labels['training.kubeflow.org/job-name']",
              f"{rtype}: PTK_RUN_ID is not the PyTorchJob's name (the operator's job-name label)")
        one_rank_per_pod_checks(f"PyTorchJob {rtype}", c, cfg)


# ---- run
n = 0
for label, cfg in (("defaults", {}), ("test settings", TEST_CONFIG)):
    full = {"IMAGE": "ptk:latest", "PVC_NAME": "fsx-claim", "MOUNT_PATH": "/fsx", "NUM_WORKERS": "2",
            "MASTER_PORT": "23456"}
    full.update(cfg)
    for t in TEMPLATES:
        docs = render(t, cfg)
        check(len(docs) == (2 if t == "train-job" else 1), f"{t}: {len(docs)} documents")
        for d in docs:
            for e in validate(d, f"{t} ({label})"):
                check(False, e)
            n += 1
        if t == "pytorchjob" and docs:
            pytorchjob_checks(docs[0], full)
        elif t == "train-job" and len(docs) == 2:
            svc = next(d for d in docs if d["kind"] == "Service")
            job_checks(next(d for d in docs if d["kind"] == "Job"), full, svc)
        elif docs:
            job_checks(docs[0], full)
from importlib.metadata import version as pkg_version  # noqa: E402

print(f"{n} rendered manifests valid against Kubernetes {' and '.join(VERSIONS)} and the PyTorchJob CRD "
      f"(kubernetes-validate {pkg_version('kubernetes-validate')}, jsonschema {pkg_version('jsonschema')})", flush=True)

# ---- the checks bite
base = {t: render(t, TEST_CONFIG) for t in ("extract-job", "pytorchjob", "train-job")}
mutations = []
m = copy.deepcopy(base["extract-job"][0])
m["spec"]["completionz"] = 3
mutations.append(("an unknown Job field", m))
m = copy.deepcopy(base["extract-job"][0])
m["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = ["1"]
mutations.append(("a list where a quantity goes", m))
m = copy.deepcopy(base["extract-job"][0])
m["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
mutations.append(("a misspelt container field", m))
m = copy.deepcopy(base["pytorchjob"][0])
m["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
mutations.append(("a string where the Worker's replicas go", m))
m = copy.deepcopy(base["pytorchjob"][0])
m["spec"]["runPolicy"]["backofLimit"] = 3
mutations.append(("an unknown PyTorchJob field", m))
m = copy.deepcopy(base["pytorchjob"][0])
m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"][0]["valu"] = "x"
mutations.append(("an unknown field in a replica's pod template", m))
m = copy.deepcopy(base["train-job"][0])
m["spec"]["clusterIP"] = 0
mutations.append(("a number where the Service's clusterIP string goes", m))
for what, doc in mutations:
    errs = validate(doc, what)
    check(errs != [], f"the validation accepts {what}")
    if errs:
        print(f"   caught: {errs[0]}")
m = copy.deepcopy(base["extract-job"][0])
m["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
check(caught_by(job_checks, m, dict(TEST_CONFIG, PVC_NAME="fsx-claim")),
      "the semantic checks accept podFailurePolicy with restartPolicy OnFailure")
m = copy.deepcopy(base["pytorchjob"][0])
m["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"  # the operator's webhook refuses it
check(caught_by(pytorchjob_checks, m, dict(TEST_CONFIG, PVC_NAME="fsx-claim")),
      "the semantic checks accept a restartPolicy the training operator does not know")
m = copy.deepcopy(base["pytorchjob"][0])
worker_env = m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
worker_env[:] = [e for e in worker_env if e["name"] != "PTK_RUN_ID"]  # its pods would meet with no run id
check(caught_by(pytorchjob_checks, m, dict(TEST_CONFIG, PVC_NAME="fsx-claim")),
      "the semantic checks accept a Worker without the job's run id")
print(f"the validation rejects each of {len(mutations) + 3} broken manifests", flush=True)

if failures:
    print(f"{len(failures)} failures", flush=True)
    sys.exit(1)
print(f"k8s manifests: OK ({time.time() - T0:.1f} s)")
