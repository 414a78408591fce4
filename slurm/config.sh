# ptk pipeline configuration, shared by the sbatch scripts and submit-pipeline.sh.
# Every setting is an environment variable with the seeds' defaults; set them before submitting.
#
#   STAGE_PATH            (required) working area, as in the Azure/NeMo recipes
#   PARTITION, NNODES, TASKS_PER_NODE   the tutorials' names: defaults of the *_PARTITION settings,
#                         TRAIN_NODES and TRAIN_TASKS_PER_NODE (HyperPod: PARTITION=dev)
#   DATASET_FOLDER_NAME   slimpajama          -> $STAGE_PATH/$DATASET_FOLDER_NAME/{raw,extracted,chunks,preprocessed}
#   PTK_BIN               ptk binaries        (default: bin/ of the install tree these scripts are in, else
#                                             build/bin of this checkout)
#   HF_REPO               cerebras/SlimPajama-627B      HF_REPO_TYPE dataset   HF_REVISION main
#   HF_INCLUDE            'train/**' (empty: the same)  HF_EXCLUDE (unset)   HF_ENDPOINT / HF_TOKEN as for huggingface_hub
#   VALID_SUBDIR          validation          the repo folder of the validation split (SlimPajama's validation/):
#                         downloaded too, kept out of the chunks, tokenized into
#                         preprocessed/${VALID_SUBDIR}_text_document; training evaluates on it
#                         (--train-data-path + --valid-data-path). Empty, or no such folder: no
#                         validation split (training splits --data-path by --split).
#   HELDOUT_SUBDIRS       "validation test"   repo folders never put into the training chunks (SlimPajama's held-out
#                         splits), whatever HF_INCLUDE downloaded (HF_INCLUDE='**' fetches test/ too); VALID_SUBDIR
#                         is always held out. Empty: only VALID_SUBDIR.
#   DOWNLOAD_PARTITION    htc                 DOWNLOAD_TASKS 1     DOWNLOAD_JOBS 16    DOWNLOAD_VERIFY 0
#   PREP_PARTITION        hpc                 (extract, concat, tokenize)
#   EXTRACT_TASKS 32      EXTRACT_CONCURRENCY 8    EXTRACT_JOBS 4    DROP_SETS "" (e.g. RedPajamaBook)
#   CONCAT_CHUNKS 72      CONCAT_TASKS = CONCAT_CHUNKS   CONCAT_CONCURRENCY 16
#   TOKENIZE_TASKS = CONCAT_CHUNKS   TOKENIZE_CONCURRENCY 16   TOKENIZE_LOG_INTERVAL 100000   APPEND_EOD 1
#   VOCAB_FILE/MERGE_FILE (built-in GPT-2)
#   CPUS_PER_TASK 4       TIME_LIMIT 24:00:00   SBATCH_EXTRA (e.g. "--account=proj --qos=normal")
#   LOCK_WAIT 180         seconds a data or train task waits for an output another run's lock holds (--lock-wait): a node
#                         that died holding it on NFS keeps it for the server's lease (~90 s); 0: fail at once
#   TRAIN_PARTITION gpu   TRAIN_NODES 1   TRAIN_TASKS_PER_NODE 1 (ranks)   TRAIN_CPUS_PER_TASK = CPUS_PER_TASK
#   TRAIN_GPUS_PER_NODE 0 (>0: --gpus-per-node; give TRAIN_TASKS_PER_NODE the same number: a rank per GPU)
#   NUM_LAYERS 12  HIDDEN_SIZE 512  NUM_ATTENTION_HEADS 8  SEQ_LENGTH 1024 (the Azure tutorial's system
#                         check; MAX_POSITION_EMBEDDINGS = the run's sequence length); a flag in TRAIN_ARGS wins
#   TRAIN_ITERS 100       TRAIN_ARGS (the other flags as for pretrain_gpt.py: batch, optimizer, schedule, ...)
#   DATA_PATH / MOCK_DATA=1  train on these instead of the pipeline's chunks (train.sbatch alone)
#   NCCL_ENV none         ib (Azure InfiniBand) or efa (AWS EFA): the tutorials' NCCL settings (train.sbatch)
#   CKPT_DIR $STAGE_PATH/checkpoints   TRAIN_TIME_LIMIT = TIME_LIMIT

if [ -z "${STAGE_PATH:-}" ]; then
  echo "ptk: STAGE_PATH is not set: export STAGE_PATH=/path/to/work/area (then sbatch or submit-pipeline.sh)" >&2
  exit 2
fi
if [ -z "${PTK_BIN:-}" ]; then
  # An install tree (PREFIX/share/ptk/slurm -> PREFIX/bin), wherever it was copied; else a checkout.
  for d in "$PTK_SLURM_DIR/../../../bin" "$PTK_SLURM_DIR/../build/bin"; do
    if [ -x "$d/ptk-tokenize" ]; then PTK_BIN=$(cd "$d" && pwd); break; fi
  done
  : "${PTK_BIN:=$PTK_SLURM_DIR/../build/bin}"
fi
: "${DATASET_FOLDER_NAME:=slimpajama}"
: "${HF_REPO:=cerebras/SlimPajama-627B}"
: "${HF_REPO_TYPE:=dataset}"
: "${HF_REVISION:=main}"
: "${HF_INCLUDE:=train/**}"
: "${HF_EXCLUDE:=}"
: "${VALID_SUBDIR=validation}"
: "${HELDOUT_SUBDIRS=validation test}"
: "${DOWNLOAD_PARTITION:=${PARTITION:-htc}}"
: "${DOWNLOAD_TASKS:=1}"
: "${DOWNLOAD_JOBS:=16}"
: "${DOWNLOAD_VERIFY:=0}"
: "${PREP_PARTITION:=${PARTITION:-hpc}}"
: "${EXTRACT_TASKS:=32}"
: "${EXTRACT_CONCURRENCY:=8}"
: "${EXTRACT_JOBS:=4}"
: "${DROP_SETS:=}"
: "${CONCAT_CHUNKS:=72}"
: "${CONCAT_TASKS:=$CONCAT_CHUNKS}"
: "${CONCAT_CONCURRENCY:=16}"
: "${TOKENIZE_TASKS:=$CONCAT_CHUNKS}"
: "${TOKENIZE_CONCURRENCY:=16}"
: "${TOKENIZE_LOG_INTERVAL:=100000}"   # Megatron's "Processed N documents" line every this many documents
: "${APPEND_EOD:=1}"
: "${VOCAB_FILE:=}"
: "${MERGE_FILE:=}"
: "${CPUS_PER_TASK:=4}"
: "${LOCK_WAIT:=180}"   # --lock-wait of the data tools and ptk-train: a requeued task outwaits a dead node's NFS lock
: "${TIME_LIMIT:=24:00:00}"
: "${SBATCH_EXTRA:=}"
: "${TRAIN_PARTITION:=${PARTITION:-gpu}}"
: "${TRAIN_NODES:=${NNODES:-1}}"
: "${TRAIN_TASKS_PER_NODE:=${TASKS_PER_NODE:-1}}"
: "${TRAIN_CPUS_PER_TASK:=$CPUS_PER_TASK}"
: "${TRAIN_GPUS_PER_NODE:=0}"
: "${NUM_LAYERS:=12}"
: "${HIDDEN_SIZE:=512}"
: "${NUM_ATTENTION_HEADS:=8}"
: "${SEQ_LENGTH:=1024}"
: "${TRAIN_ITERS:=100}"
: "${TRAIN_TIME_LIMIT:=$TIME_LIMIT}"
: "${TRAIN_ARGS:=--micro-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --log-interval 10 --eval-interval 50 --eval-iters 2 --save-interval 50}"

DATA_DIR="$STAGE_PATH/$DATASET_FOLDER_NAME"
RAW_DIR="$DATA_DIR/raw"
EXTRACT_DIR="$DATA_DIR/extracted"
CHUNK_DIR="$DATA_DIR/chunks"
PREPROCESSED_DIR="$DATA_DIR/preprocessed"
RESULTS_DIR="$STAGE_PATH/results"
PLAN_FILE="$CHUNK_DIR/concat-plan.json"
CKPT_DIR="${CKPT_DIR:-$STAGE_PATH/checkpoints}"
STAGES="download extract concat-plan concat tokenize train"
VALID_DIR="$EXTRACT_DIR/$VALID_SUBDIR"                      # the extracted validation split
VALID_DATASET="$PREPROCESSED_DIR/${VALID_SUBDIR}_text_document"

# Whether an extracted top-level entry is a held-out split (VALID_SUBDIR, HELDOUT_SUBDIRS): never training data.
ptk_is_heldout() {
  local name=${1##*/} h words
  read -ra words <<<"$VALID_SUBDIR $HELDOUT_SUBDIRS"  # split on blanks, never globbed (a 'test*' is a name)
  for h in ${words[@]+"${words[@]}"}; do [ "$name" = "$h" ] && return 0; done
  return 1
}
# Whether this run has a validation split: configured, and its folder was extracted.
ptk_has_valid() { [ -n "$VALID_SUBDIR" ] && [ -d "$VALID_DIR" ]; }
# What a dataset is made from, as its stamp records it: a chunk's sidecar, or for the validation
# folder a digest of its files' sidecars (a re-extracted file changes it). The names go NUL-separated:
# a file named it's a.jsonl is one name, not an unmatched quote (the same digest as newline-separated).
ptk_source_id() {
  if [ -d "$1" ]; then
    find "$1" -name '*.ptk-done' -type f -print0 | LC_ALL=C sort -z | xargs -0 -r cat | sha256sum | cut -d' ' -f1
  else
    cat "$1.ptk-done" 2>/dev/null || stat -c '%s %Y' "$1"
  fi
}

ptk_log() { printf '[%s] %s\n' "$(date '+%F %T')" "$*"; }

# TRAIN_ARGS must not give a flag train.sbatch sets after it from its own variable: ptk-train (as
# argparse) would take the script's value without a word, and the requeue and status.sh count to
# TRAIN_ITERS. Prints the mistake and returns 1.
ptk_check_train_args() {
  local a flag var
  for a in $TRAIN_ARGS; do
    flag=${a%%=*}
    case "$flag" in
      --train-iters) var="set TRAIN_ITERS instead (the requeue and status.sh count to it)" ;;
      --train-samples) var="the Slurm path counts iterations: set TRAIN_ITERS (--train-iters) instead" ;;
      --save | --load) var="set CKPT_DIR instead (the job saves and resumes there)" ;;
      --data-path | --train-data-path | --valid-data-path | --test-data-path | --mock-data)
        var="set DATA_PATH (Megatron's --data-path value) or MOCK_DATA=1 instead" ;;
      --tensorboard-dir) var="the job writes TensorBoard's files to RESULTS_DIR/train/tensorboard" ;;
      *) continue ;;
    esac
    echo "TRAIN_ARGS gives $flag, which train.sbatch sets itself: $var" >&2
    return 1
  done
  return 0
}
