# ptk on Kubernetes: the variables the k8s/*.yaml-template files use, with their defaults.
# Render each template with k8s/render.sh, which sources this file (every value checked against what
# its place in the YAML allows) and writes each value quoted and escaped:
#
#   export IMAGE=123456789012.dkr.ecr.us-west-2.amazonaws.com/ptk:latest PVC_NAME=fsx-claim
#   bash k8s/render.sh k8s/download-job.yaml-template > download-job.yaml && kubectl apply -f download-job.yaml
#
# Every setting is an environment variable; one already set is kept. Sourcing this file checks them and
# exports them (`source k8s/env.sh` fails naming the first bad one). A plain `envsubst` (the EKS
# tutorial's way) pastes values into the YAML unescaped: a quote or a newline in a value changes the
# manifest, so render.sh is the supported path. Integers: decimal, at most 9 digits; LR, MIN_LR:
# decimal numbers; names (PVC_NAME, HF_TOKEN_SECRET): DNS subdomains of at most 253 characters;
# MEMORY_*: Kubernetes quantities; IMAGE: an image reference; MOUNT_PATH: an absolute path of
# [A-Za-z0-9._/-]; HF_REPO: a Hub repo id; HF_ENDPOINT: an http(s) URL; no value holds a control
# character (a newline, a tab); the free-form ones (STAGE_PATH, CKPT_DIR, HF_INCLUDE, HF_EXCLUDE, VALID_SUBDIR,
# HELDOUT_SUBDIRS, TRAIN_EXTRA_ARGS) may hold quotes, which render.sh escapes.
#
#   IMAGE                 ptk:latest       the image of ptk's Dockerfile, as pushed to your registry (the
#                                          tutorial's REPO_URI is taken when IMAGE is unset)
#   PVC_NAME              fsx-claim        the shared volume (ReadWriteMany: FSx for Lustre, EFS, NFS)
#   MOUNT_PATH            /fsx             where every pod mounts it
#   STAGE_PATH            $MOUNT_PATH/ptk  working area, laid out as the Slurm path's:
#                                          $STAGE_PATH/$DATASET_FOLDER_NAME/{raw,extracted,chunks,preprocessed}
#   DATASET_FOLDER_NAME   slimpajama
#   HF_REPO               cerebras/SlimPajama-627B   HF_REPO_TYPE dataset   HF_REVISION main
#   HF_INCLUDE            train/**         VALID_SUBDIR validation (the repo folder of the validation split;
#                                          downloaded too, kept out of the chunks, tokenized on its own)
#   HELDOUT_SUBDIRS       "validation test"  extracted folders never put into the training chunks (SlimPajama's
#                                          held-out splits, which a broad HF_INCLUDE downloads too); empty: none.
#                                          Words of folder names: no '/', '*', '?', '[', not . or ..
#   DROP_SETS             ""               RedPajama sets whose records extract leaves out (e.g. RedPajamaBook, as
#                                          NeMo drops it), separated by spaces
#   HF_EXCLUDE            ""               a pattern of files not to download (ptk-download --exclude)
#   DOWNLOAD_VERIFY       0                1: re-hash files already downloaded and fetch damaged ones again (--verify)
#   HF_ENDPOINT           https://huggingface.co     (a mirror, or the test's local hub)
#   HF_TOKEN_SECRET       hf-token         a Secret whose key `token` is the Hugging Face token (optional:
#                                          kubectl create secret generic hf-token --from-literal=token=hf_...)
#   DOWNLOAD_TASKS 1      DOWNLOAD_JOBS 16 (files at once per pod)
#   EXTRACT_TASKS 32      EXTRACT_PARALLELISM 8
#   CONCAT_CHUNKS 72      CONCAT_PARALLELISM 16    (one pod per chunk)
#   TOKENIZE_TASKS = CONCAT_CHUNKS                 TOKENIZE_PARALLELISM 16
#   CPUS_PER_TASK 4       MEMORY_PER_TASK 8Gi      requests of each data pod (its --jobs / --workers)
#   LOCK_WAIT 180         seconds a data or train pod waits for an output another pod's lock holds (--lock-wait; a
#                         node that died holding it on NFS keeps it ~90 s); 0: fail at once
#   BACKOFF_LIMIT_PER_INDEX 3                      reruns of one index before it counts as failed (and
#                                                  the backoffLimit of the one-pod concat-plan Job)
# Training (k8s/pytorchjob.yaml-template, or k8s/train-job.yaml-template without the training operator):
#   NUM_WORKERS 2         ranks, one pod each (WORKER_REPLICAS = NUM_WORKERS - 1 beside the PyTorchJob's Master)
#   GPU_PER_WORKER 1      nvidia.com/gpu per pod (a rank uses one; 0: the CPU backend)
#   CPUS_PER_WORKER 8     MEMORY_PER_WORKER 64Gi
#   MASTER_PORT 23456     the rendezvous port of rank 0
#   NUM_LAYERS 12  HIDDEN_SIZE 768  NUM_ATTENTION_HEADS 12  SEQ_LENGTH 1024  MAX_POSITION_EMBEDDINGS = SEQ_LENGTH
#   MICRO_BATCH_SIZE 4  GLOBAL_BATCH_SIZE 32  TRAIN_ITERS 5000  LR 6e-4  MIN_LR 6e-5  LR_WARMUP_ITERS 200
#   SAVE_INTERVAL 500  EVAL_INTERVAL 500  EVAL_ITERS 10  LOG_INTERVAL 10
#   TRAIN_EXTRA_ARGS      ""               more ptk-train flags (e.g. --bf16; --device cpu)
#   CKPT_DIR              $STAGE_PATH/checkpoints
#   TRAIN_BACKOFF_LIMIT 20  restarts of training containers before the job fails (one rank stopped restarts
#                         all NUM_WORKERS: each preemption costs NUM_WORKERS restarts)
#   TRAIN_GRACE_SECONDS 180 from SIGTERM (preemption, kubectl delete) to SIGKILL: the ranks save a checkpoint

: "${IMAGE:=${REPO_URI:-ptk:latest}}"
: "${PVC_NAME:=fsx-claim}"
: "${MOUNT_PATH:=/fsx}"
: "${STAGE_PATH:=$MOUNT_PATH/ptk}"
: "${DATASET_FOLDER_NAME:=slimpajama}"
: "${HF_REPO:=cerebras/SlimPajama-627B}"
: "${HF_REPO_TYPE:=dataset}"
: "${HF_REVISION:=main}"
: "${HF_INCLUDE:=train/**}"
: "${VALID_SUBDIR=validation}"
: "${HELDOUT_SUBDIRS=validation test}"
: "${DROP_SETS:=}"
: "${HF_EXCLUDE:=}"
: "${DOWNLOAD_VERIFY:=0}"
: "${HF_ENDPOINT:=https://huggingface.co}"
: "${HF_TOKEN_SECRET:=hf-token}"
: "${DOWNLOAD_TASKS:=1}"
: "${DOWNLOAD_JOBS:=16}"
: "${EXTRACT_TASKS:=32}"
: "${EXTRACT_PARALLELISM:=8}"
: "${CONCAT_CHUNKS:=72}"
: "${CONCAT_PARALLELISM:=16}"
: "${TOKENIZE_TASKS:=$CONCAT_CHUNKS}"
: "${TOKENIZE_PARALLELISM:=16}"
: "${CPUS_PER_TASK:=4}"
: "${MEMORY_PER_TASK:=8Gi}"
: "${BACKOFF_LIMIT_PER_INDEX:=3}"
: "${LOCK_WAIT:=180}"
: "${NUM_WORKERS:=2}"
: "${GPU_PER_WORKER:=1}"
: "${CPUS_PER_WORKER:=8}"
: "${MEMORY_PER_WORKER:=64Gi}"
: "${MASTER_PORT:=23456}"
: "${NUM_LAYERS:=12}"
: "${HIDDEN_SIZE:=768}"
: "${NUM_ATTENTION_HEADS:=12}"
: "${SEQ_LENGTH:=1024}"
: "${MAX_POSITION_EMBEDDINGS:=$SEQ_LENGTH}"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=32}"
: "${TRAIN_ITERS:=5000}"
: "${LR:=6e-4}"
: "${MIN_LR:=6e-5}"
: "${LR_WARMUP_ITERS:=200}"
: "${SAVE_INTERVAL:=500}"
: "${EVAL_INTERVAL:=500}"
: "${EVAL_ITERS:=10}"
: "${LOG_INTERVAL:=10}"
: "${TRAIN_EXTRA_ARGS:=}"
: "${CKPT_DIR:=$STAGE_PATH/checkpoints}"
: "${TRAIN_BACKOFF_LIMIT:=20}"
: "${TRAIN_GRACE_SECONDS:=180}"

PTK_K8S_VARS="IMAGE PVC_NAME MOUNT_PATH STAGE_PATH DATASET_FOLDER_NAME HF_REPO HF_REPO_TYPE HF_REVISION HF_INCLUDE
  VALID_SUBDIR HELDOUT_SUBDIRS DROP_SETS HF_EXCLUDE DOWNLOAD_VERIFY HF_ENDPOINT HF_TOKEN_SECRET DOWNLOAD_TASKS DOWNLOAD_JOBS EXTRACT_TASKS EXTRACT_PARALLELISM CONCAT_CHUNKS
  CONCAT_PARALLELISM TOKENIZE_TASKS TOKENIZE_PARALLELISM CPUS_PER_TASK MEMORY_PER_TASK BACKOFF_LIMIT_PER_INDEX LOCK_WAIT NUM_WORKERS
  WORKER_REPLICAS GPU_PER_WORKER CPUS_PER_WORKER MEMORY_PER_WORKER MASTER_PORT NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS
  SEQ_LENGTH MAX_POSITION_EMBEDDINGS MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS LR MIN_LR LR_WARMUP_ITERS SAVE_INTERVAL
  EVAL_INTERVAL EVAL_ITERS LOG_INTERVAL TRAIN_EXTRA_ARGS CKPT_DIR TRAIN_BACKOFF_LIMIT TRAIN_GRACE_SECONDS"
# Checked here rather than by a pod an hour later, each value against what its place in the YAML
# allows (k8s/render.sh quotes and escapes every string on top of it).
ptk_k8s_bad() {  # VARIABLE WHY: the one line that names it (the value shown as bash would quote it)
  local shown=${!1}
  [ "${#shown}" -le 80 ] || shown="${shown:0:80}..."
  echo "k8s/env.sh: $1=$(printf '%q' "$shown") $2" >&2
}
ptk_k8s_check() {
  local v val
  for v in DOWNLOAD_TASKS DOWNLOAD_JOBS EXTRACT_TASKS EXTRACT_PARALLELISM CONCAT_CHUNKS CONCAT_PARALLELISM TOKENIZE_TASKS \
           TOKENIZE_PARALLELISM CPUS_PER_TASK NUM_WORKERS CPUS_PER_WORKER MASTER_PORT NUM_LAYERS HIDDEN_SIZE \
           NUM_ATTENTION_HEADS SEQ_LENGTH MAX_POSITION_EMBEDDINGS MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS \
           SAVE_INTERVAL EVAL_INTERVAL LOG_INTERVAL TRAIN_GRACE_SECONDS; do
    [[ "${!v}" =~ ^[1-9][0-9]{0,8}$ ]] || { ptk_k8s_bad "$v" "must be a positive integer (at most 9 digits)"; return 2; }
  done
  for v in BACKOFF_LIMIT_PER_INDEX GPU_PER_WORKER EVAL_ITERS TRAIN_BACKOFF_LIMIT LR_WARMUP_ITERS LOCK_WAIT; do
    [[ "${!v}" =~ ^(0|[1-9][0-9]{0,8})$ ]] || { ptk_k8s_bad "$v" "must be a number >= 0 (at most 9 digits)"; return 2; }
  done
  [ "$MASTER_PORT" -le 65535 ] || { ptk_k8s_bad MASTER_PORT "must be a port number (1 to 65535)"; return 2; }
  for v in $PTK_K8S_VARS; do
    [ "$v" = WORKER_REPLICAS ] && continue
    val=${!v}
    [[ "$val" != *[[:cntrl:]]* ]] || { ptk_k8s_bad "$v" "holds a control character (a newline, a tab)"; return 2; }
    [ "${#val}" -le 4096 ] || { ptk_k8s_bad "$v" "is longer than 4096 characters"; return 2; }
  done
  for v in LR MIN_LR; do
    [[ "${!v}" =~ ^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]{1,3})?$ ]] ||
      { ptk_k8s_bad "$v" "must be a decimal number (6e-4, 0.0006)"; return 2; }
  done
  local dns='^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$'
  for v in PVC_NAME HF_TOKEN_SECRET; do
    val=${!v}
    [[ "$val" =~ $dns && ${#val} -le 253 ]] ||
      { ptk_k8s_bad "$v" "must be a Kubernetes object name (lower-case letters, digits, '-' and '.', at most 253)"; return 2; }
  done
  for v in MEMORY_PER_TASK MEMORY_PER_WORKER; do
    [[ "${!v}" =~ ^[0-9]{1,12}(\.[0-9]{1,6})?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$ ]] ||
      { ptk_k8s_bad "$v" "must be a Kubernetes memory quantity (8Gi, 512Mi)"; return 2; }
  done
  [[ "$IMAGE" =~ ^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,511}$ ]] ||
    { ptk_k8s_bad IMAGE "must be an image reference (registry/name:tag or @sha256:...)"; return 2; }
  [[ "$MOUNT_PATH" =~ ^/[A-Za-z0-9._/-]*$ ]] ||
    { ptk_k8s_bad MOUNT_PATH "must be an absolute path of letters, digits, '.', '_', '-' and '/'"; return 2; }
  for v in STAGE_PATH CKPT_DIR; do
    [[ "${!v}" == /* ]] || { ptk_k8s_bad "$v" "must be an absolute path"; return 2; }
  done
  [[ "$HF_REPO" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$ ]] ||
    { ptk_k8s_bad HF_REPO "must be a Hugging Face repo id (owner/name: letters, digits, '.', '_', '-')"; return 2; }
  [[ "$HF_REPO_TYPE" =~ ^(dataset|model|space)$ ]] || { ptk_k8s_bad HF_REPO_TYPE "must be dataset, model or space"; return 2; }
  [[ "$HF_REVISION" =~ ^[A-Za-z0-9._/-]{1,255}$ ]] ||
    { ptk_k8s_bad HF_REVISION "must be a branch, tag or commit (letters, digits, '.', '_', '-', '/')"; return 2; }
  local url="^https?://[][A-Za-z0-9._~:/?#@!\$&'()*+,;=%-]+\$"
  [[ "$HF_ENDPOINT" =~ $url ]] ||
    { ptk_k8s_bad HF_ENDPOINT "must be an http(s) URL without spaces, quotes or backslashes"; return 2; }
  [[ "$DATASET_FOLDER_NAME" =~ ^[A-Za-z0-9._-]{1,255}$ && "$DATASET_FOLDER_NAME" != . && "$DATASET_FOLDER_NAME" != .. ]] ||
    { ptk_k8s_bad DATASET_FOLDER_NAME "must be one folder name (letters, digits, '.', '_', '-')"; return 2; }
  local h words
  read -ra words <<<"$HELDOUT_SUBDIRS"  # words, never globbed: '*' is refused, not expanded
  for h in ${words[@]+"${words[@]}"}; do  # each is matched against an extracted folder's name (slurm/config.sh)
    [[ "$h" != */* && "$h" != *[][*?]* && "$h" != . && "$h" != .. ]] ||
      { ptk_k8s_bad HELDOUT_SUBDIRS "must be folder names separated by spaces (no '/', '*', '?', '[', . or ..)"; return 2; }
  done
  [[ "$DOWNLOAD_VERIFY" =~ ^[01]$ ]] || { ptk_k8s_bad DOWNLOAD_VERIFY "must be 0 or 1"; return 2; }
  [[ "$DROP_SETS" =~ ^[A-Za-z0-9_.\ -]*$ ]] ||
    { ptk_k8s_bad DROP_SETS "must be RedPajama set names (letters, digits, '_', '.', '-') separated by spaces"; return 2; }
  case "$STAGE_PATH/" in
    "$MOUNT_PATH"/*) ;;
    *) echo "k8s/env.sh: STAGE_PATH=$STAGE_PATH is not on the shared volume (MOUNT_PATH=$MOUNT_PATH)" >&2; return 2 ;;
  esac
  [ -n "$VALID_SUBDIR" ] || {
    echo "k8s/env.sh: VALID_SUBDIR is empty; the templates download it: name the repo's validation folder (a name" \
         "the repo lacks gives a warning and training splits --data-path instead)" >&2
    return 2
  }
  [ $((GLOBAL_BATCH_SIZE % (MICRO_BATCH_SIZE * NUM_WORKERS))) = 0 ] || {
    echo "k8s/env.sh: GLOBAL_BATCH_SIZE=$GLOBAL_BATCH_SIZE is not a multiple of MICRO_BATCH_SIZE x NUM_WORKERS" \
         "($MICRO_BATCH_SIZE x $NUM_WORKERS)" >&2
    return 2
  }
}
if ptk_k8s_check; then
  WORKER_REPLICAS=$((NUM_WORKERS - 1))
  # shellcheck disable=SC2086
  export $PTK_K8S_VARS
else
  false  # the status of `source k8s/env.sh`
fi
