#!/usr/bin/env python3
"""k8s/render.sh takes no injected YAML: hostile settings are refused (exit 2, one line naming the
variable, nothing on stdout) or rendered into manifests that parse, that Kubernetes' schemas (and the
PyTorchJob CRD's) accept, and that hold the value exactly where a harmless value of the same variable
goes: the manifest rendered with the hostile value equals the one rendered with a harmless marker, the
marker replaced by the value in every string. Nothing else changes: no added argument, env entry or key.

Usage: k8s_render_test.py SOURCE_DIR
Exit 77 (skipped) only when the validator (kubernetes-validate, installed by scripts/install-deps.sh
--with-python-ref into /opt/ptk-pyref/kubernetes-validate) cannot be imported.
"""
import os
import re
import subprocess
import sys

import yaml

SRC = os.path.abspath(sys.argv[1])
for d in (os.environ.get("PTK_PYREF_DIR", ""), "/opt/ptk-pyref"):
    if d and os.path.isdir(os.path.join(d, "kubernetes-validate")):
        sys.path.insert(0, os.path.join(d, "kubernetes-validate"))
        break
try:
    import jsonschema
    import kubernetes_validate
except ImportError as e:
    print(f"SKIPPED: the rendered manifests were NOT validated: {e} (bash scripts/install-deps.sh --with-python-ref)")
    sys.exit(77)

failures = []


def check(ok, msg):
    if not ok:
        failures.append(msg)
        print(f"FAIL: {msg}", flush=True)
    return ok


env_sh = open(os.path.join(SRC, "k8s", "env.sh")).read()
VARS = re.search(r'PTK_K8S_VARS="([^"]*)"', env_sh).group(1).split()
TEMPLATES = sorted(f for f in os.listdir(os.path.join(SRC, "k8s")) if f.endswith(".yaml-template"))
USES = {t: set(re.findall(r"\$\{([A-Z_0-9]+)\}", open(os.path.join(SRC, "k8s", t)).read())) for t in TEMPLATES}
crd = yaml.safe_load(open(os.path.join(SRC, "tests", "k8s", "pytorchjob-crd", "kubeflow.org_pytorchjobs.yaml")))
PJ = jsonschema.Draft7Validator(next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])


def validate(doc):
    errs = []
    if doc.get("kind") == "PyTorchJob":
        errs += [f"PyTorchJob: {'.'.join(map(str, e.path))}: {e.message}" for e in PJ.iter_errors(doc)]
        for rtype, rs in doc["spec"]["pytorchReplicaSpecs"].items():
            errs += validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                              "template": rs["template"]})
        return errs
    try:
        kubernetes_validate.validate(doc, "1.29", strict=True)
    except kubernetes_validate.ValidationError as e:
        errs.append(f"{doc.get('kind')}: {'.'.join(map(str, e.path))}: {e.message}")
    return errs


def render(template, settings):
    env = {k: v for k, v in os.environ.items() if k not in VARS and k != "REPO_URI"}
    env.update(settings)
    return subprocess.run(["bash", "k8s/render.sh", f"k8s/{template}"], cwd=SRC, env=env, capture_output=True)


def replaced(doc, marker, value):
    if isinstance(doc, dict):
        return {replaced(k, marker, value): replaced(v, marker, value) for k, v in doc.items()}
    if isinstance(doc, list):
        return [replaced(v, marker, value) for v in doc]
    if isinstance(doc, str):
        return doc.replace(marker, value)
    return doc


# (variable, hostile value, a harmless value of the same kind that appears nowhere else, refused?)
CASES = [
    ("LR", '6e-4"\n            - "--train-iters=1', None, True),
    ("LR", '6e-4"', None, True),
    ("LR", "abc", None, True),
    ("LR", "6e-4 ", None, True),
    ("MIN_LR", "1e-5: {x: 1}", None, True),
    ("HF_ENDPOINT", 'https://hub.example"\n        - name: INJECTED\n          value: "x', None, True),
    ("HF_ENDPOINT", 'https://hub.example/"x', None, True),
    ("HF_ENDPOINT", "https://hub.example/a b", None, True),
    ("HF_ENDPOINT", "https://hub.example:8443/p?a=b&c='d'#f", "https://zzmarkerzz.example", False),
    ("HF_REPO", 'owner/na"me', None, True),
    ("HF_REPO", "owner/name\n", None, True),
    ("HF_REVISION", 'main"', None, True),
    ("HF_REPO_TYPE", "datasets", None, True),
    ("STAGE_PATH", '/fsx/pt"k', "/fsx/zzmarkerzz", False),
    ("STAGE_PATH", '/fsx/a\\"b: {c: [d]} # e', "/fsx/zzmarkerzz", False),
    ("STAGE_PATH", "/fsx/${IMAGE}", "/fsx/zzmarkerzz", False),
    ("STAGE_PATH", "/fsx/a\nb", None, True),
    ("CKPT_DIR", '/fsx/ck"pt", "--train-iters=1', "/fsx/zzmarkerzz", False),
    ("CKPT_DIR", "relative/ckpt", None, True),
    ("TRAIN_EXTRA_ARGS", '--bf16 "--x" \\ \'--y\' ${TRAIN_BACKOFF_LIMIT} $(id)', "--zzmarkerzz", False),
    ("TRAIN_EXTRA_ARGS", '--bf16"\n            - "--train-iters=1', None, True),
    ("TRAIN_EXTRA_ARGS", "--bf16\t--fp16", None, True),
    ("HF_INCLUDE", "train/**\nvalidation/**", None, True),
    ("HF_INCLUDE", 'train/"*.jsonl.zst', "zzmarkerzz/**", False),
    ("VALID_SUBDIR", 'valid"ation\\', "zzmarkerzz", False),
    ("HELDOUT_SUBDIRS", 'valid"ation\\ te\'st', "zzmarkerzz", False),
    ("HELDOUT_SUBDIRS", "validation a/b", None, True),
    ("HELDOUT_SUBDIRS", "test *", None, True),
    ("HELDOUT_SUBDIRS", "..", None, True),
    ("DROP_SETS", "RedPajamaBook RedPajamaArXiv", "zzmarkerzz", False),
    ("DROP_SETS", 'RedPajamaBook"', None, True),
    ("DROP_SETS", "RedPajama*", None, True),
    ("HF_EXCLUDE", '*.md" --verify \\', "zzmarkerzz", False),
    ("HF_EXCLUDE", "a\nb", None, True),
    ("DOWNLOAD_VERIFY", "yes", None, True),
    ("HELDOUT_SUBDIRS", "validation\ntest", None, True),
    ("DATASET_FOLDER_NAME", "../x", None, True),
    ("DATASET_FOLDER_NAME", 'a"b', None, True),
    ("PVC_NAME", "a" * 300, None, True),
    ("PVC_NAME", "Fsx_Claim", None, True),
    ("PVC_NAME", 'fsx"claim', None, True),
    ("PVC_NAME", "b" * 253, "zzmarkerzz", False),
    ("HF_TOKEN_SECRET", "hf-token\n  x: y", None, True),
    ("IMAGE", "ptk:latest\n        command: [evil]", None, True),
    ("IMAGE", "ptk latest", None, True),
    ("IMAGE", 'ptk:"x', None, True),
    ("MEMORY_PER_TASK", '8Gi"', None, True),
    ("MEMORY_PER_WORKER", "lots", None, True),
    ("MOUNT_PATH", '/fs"x', None, True),
    ("MASTER_PORT", "99999", None, True),
    ("NUM_WORKERS", "2 # x", None, True),
    ("NUM_WORKERS", "9" * 20, None, True),
    ("TRAIN_BACKOFF_LIMIT", "-1", None, True),
    ("GPU_PER_WORKER", "1\n", None, True),
    ("LR_WARMUP_ITERS", "5x", None, True),
    ("SAVE_INTERVAL", "1e3", None, True),
    ("LOCK_WAIT", "-1", None, True),
    ("LOCK_WAIT", "90s", None, True),
]
BASE = {"STAGE_PATH": "/fsx/ptk", "MOUNT_PATH": "/fsx"}

trials = refused = accepted = 0
for var, value, marker, want_refused in CASES:
    for t in TEMPLATES:
        # STAGE_PATH reaches a template through CKPT_DIR's default too.
        if var not in USES[t] and not (var == "STAGE_PATH" and "CKPT_DIR" in USES[t]):
            continue
        trials += 1
        where = f"{t} with {var}={value!r}"
        r = render(t, dict(BASE, **{var: value}))
        if want_refused:
            err = r.stderr.decode(errors="replace")
            ok = check(r.returncode == 2, f"{where}: exit {r.returncode}, not a refusal (exit 2)")
            ok &= check(r.stdout == b"", f"{where}: a refusal wrote a manifest")
            ok &= check(err.count("\n") == 1 and f"{var}=" in err, f"{where}: not one line naming {var}: {err!r}")
            refused += ok
            continue
        if not check(r.returncode == 0, f"{where}: refused: {r.stderr!r}"):
            continue
        try:
            docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        except yaml.YAMLError as e:
            check(False, f"{where}: not YAML: {e}")
            continue
        for d in docs:
            for e in validate(d):
                check(False, f"{where}: {e}")
        h = render(t, dict(BASE, **{var: marker}))
        check(h.returncode == 0, f"{where}: the harmless value {marker!r} is refused: {h.stderr!r}")
        want = [replaced(d, marker, value) for d in yaml.safe_load_all(h.stdout) if d]
        check(docs == want, f"{where}: the manifest is not the harmless one with the value in its place")
        accepted += 1

# Level with the Slurm path: a pod that runs a slurm/*.sbatch stage script gets every slurm/config.sh setting
# that script reads (itself or through a config.sh function it calls), so that k8s/env.sh can set it
# (HELDOUT_SUBDIRS was missing from the concat-plan pod: its config.sh default could not be changed). The
# exceptions keep Slurm's default on purpose, each named here with its reason.
CFG = open(os.path.join(SRC, "slurm", "config.sh")).read()
SETTINGS = re.findall(r'^: "\$\{([A-Z_0-9]+)[:=]', CFG, re.M)
FUNCS = {m.group(1): m.group(2) for m in re.finditer(r"^(ptk_[a-z_]+)\(\) \{\n(.*?)^\}", CFG, re.M | re.S)}
KEPT_DEFAULT = {"tokenize.sbatch": {"APPEND_EOD", "VOCAB_FILE", "MERGE_FILE", "TOKENIZE_LOG_INTERVAL"}}  # the
# image's built-in GPT-2 files, an EOD after each document and the log interval: Megatron's preprocessing
stage_pods = 0
for t in TEMPLATES:
    text = open(os.path.join(SRC, "k8s", t)).read()
    for script in re.findall(r'command: \["bash", "/opt/ptk/share/ptk/slurm/([a-z-]+\.sbatch)"\]', text):
        stage_pods += 1
        body = open(os.path.join(SRC, "slurm", script)).read()
        body += "".join(b for f, b in FUNCS.items() if re.search(r"\b" + f + r"\b", body))
        read = {v for v in SETTINGS if re.search(r"\$\{?" + v + r"\b", body)}
        env = set(re.findall(r"- name: ([A-Z_0-9]+)", text))
        missing = read - env - KEPT_DEFAULT.get(script, set())
        check(not missing, f"{t}: slurm/{script} reads {sorted(missing)}, which its pod is not given")
check(stage_pods >= 2, f"only {stage_pods} pods run a Slurm stage script")
check("HELDOUT_SUBDIRS" in VARS and "DROP_SETS" in VARS, "k8s/env.sh does not set HELDOUT_SUBDIRS and DROP_SETS")

print(f"{trials} hostile renders: {refused} refused naming the variable, {accepted} valid with the value intact, "
      f"{len(failures)} failures", flush=True)
check(trials >= 60, f"only {trials} trials")
if failures:
    sys.exit(1)
print("k8s render: OK")
