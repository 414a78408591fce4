#!/usr/bin/env bash
# The documented example commands run as printed, on the bundled sample: every `build/bin/...` line of
# README.md's sections whose examples run on it (the jsonl -> train -> Hugging Face recipe,
# ptk-download, against the fake Hub serving the sample as cerebras/SlimPajama-627B, ptk-extract, ptk-concat, ptk-tokenize, ptk-inspect, ptk-merge,
# ptk-convert) and of the manuals those tools' details live in (docs/ptk-download.md's try-it block, docs/ptk-extract.md, docs/ptk-concat.md,
# docs/ptk-tokenize.md, docs/ptk-inspect.md, docs/ptk-merge.md, docs/ptk-convert.md), and the lines of
# docs/ptk-train.md, docs/gpu.md and docs/interop.md that run on a CPU in seconds, and docs/cluster.md's
# Kubernetes render lines (below), extracted from the
# files (continuation lines joined, comments dropped) and run in a directory laid out as they expect: raw/
# (what README's ptk-download lines fetch), my.jsonl, data/train_*.jsonl.zst and wiki/ (the sample's files),
# the GPT-2 files, out/a_text_document and out/b_text_document, parts/, and ckpt/ and tb/ (what README's
# recipe trains).
# Also: every `build/bin/` line of a README tool section is printed in that tool's manual too (the
# README's screen is a summary of the manual, never a different command); docs/ptk-train.md's memory
# line is what the recipe's ptk-train line prints.
# Usage: readme_examples_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$1
SRC=$2
W=$(mktemp -d)
HUB_PID=
trap '[ -z "$HUB_PID" ] || kill "$HUB_PID" 2>/dev/null; rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
cd "$W"
mkdir -p build data out parts wiki
ln -s "$BIN" build/bin
# The Hub README's ptk-download lines ask (HF_ENDPOINT): the sample as cerebras/SlimPajama-627B, on 127.0.0.1.
python3 "$SRC/tests/support/fake_hub.py" --repo-dir "$SRC/sample/slimpajama-mini" --port-file hub-ports >hub.log 2>&1 &
HUB_PID=$!
end=$((SECONDS + 60)); until [ -s hub-ports ] || [ $SECONDS -ge $end ]; do sleep 0.05; done  # python starts late under load
[ -s hub-ports ] || fail "the fake Hub did not start: $(cat hub.log)"
HF_ENDPOINT=$(awk '/HUB/{print $2}' hub-ports)
export HF_ENDPOINT
cp "$SRC/tokenizer/data/gpt2-vocab.json" "$SRC/tokenizer/data/gpt2-merges.txt" .
n=0
for f in "$SRC"/sample/slimpajama-mini/train/chunk*/*.jsonl.zst; do
  ln -s "$f" "data/train_$n.jsonl.zst"
  [ "$n" -lt 2 ] && ln -s "$f" "wiki/wiki_$n.jsonl.zst"
  n=$((n + 1))
done
[ "$n" -gt 1 ] || fail "no sample files under $SRC/sample/slimpajama-mini/train"
# The datasets the examples name (made by the same tool, not by the README's lines).
# Half the sample each (about 970 documents: --split 969,30,1 leaves the test split a document).
half=$((n / 2))
"$BIN/ptk-tokenize" --quiet --input $(seq -f 'data/train_%g.jsonl.zst' 0 $((half - 1))) --output-prefix out/a \
  --append-eod >/dev/null 2>&1
"$BIN/ptk-tokenize" --quiet --input $(seq -f 'data/train_%g.jsonl.zst' "$half" $((n - 1))) --output-prefix out/b \
  --append-eod >/dev/null 2>&1
for p in a b; do
  for e in bin idx; do cp "out/${p}_text_document.$e" "${p}_text_document.$e"; cp "out/${p}_text_document.$e" "parts/${p}_text_document.$e"; done
done

# The lines of FILE's code blocks: of its section `## SECTION` (up to the next `## `), or of the whole file;
# continuation lines joined, comments dropped.
code_lines() {
  awk -v sec="${2:+## $2}" '
    sec != "" && $0 == sec { on = 1; next }
    sec != "" && on && /^## / { exit }
    sec == "" { on = 1 }
    on && /^```/ { code = !code; next }
    on && code { print }' "$SRC/$1" |
    awk '{ if (cont != "") { $0 = cont " " $0; cont = "" }
           if ($0 ~ /\\$/) { sub(/\\$/, ""); cont = $0; next }
           print }' |
    sed -E 's/[[:space:]]+#[^"'"'"']*$//'
}
# The example lines of FILE [SECTION]: its code lines that run a built tool (`build/bin/...`).
examples() { code_lines "$@" | grep -E '^build/bin/' || true; }
ran=0
run_examples() {  # run_examples FILE [SECTION [PATTERN]]: with PATTERN, the code lines matching it instead
  local where="$1${2:+, section '## $2'}" lines cmd out
  if [ -n "${3:-}" ]; then
    mapfile -t lines < <(code_lines "$1" "$2" | grep -E -- "$3" || true)
  else
    mapfile -t lines < <(examples "$@")
  fi
  [ "${#lines[@]}" -gt 0 ] || fail "no examples found in $where"
  for cmd in "${lines[@]}"; do
    echo "+ $cmd"
    out=$(bash -c "$cmd" 2>&1) || fail "example of $where failed as printed: $cmd
$out"
    ran=$((ran + 1))
  done
}
cat data/train_0.jsonl.zst data/train_1.jsonl.zst | zstd -dcq > my.jsonl
for section in "From your own jsonl to a Hugging Face model" ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect \
  ptk-merge ptk-convert; do
  run_examples README.md "$section"
done
for tool in ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-merge ptk-convert; do
  run_examples "docs/$tool.md"
done
# docs/ptk-download.md's try-it block as printed, in a directory of its own (the checkout's tests/, sample/ and
# build/bin): the fake Hub it starts in the background, the export, the download; that Hub stopped after.
mkdir -p try-download/build
ln -s "$SRC/tests" try-download/tests
ln -s "$SRC/sample" try-download/sample
ln -s "$BIN" try-download/build/bin
block=$(awk '/^To try it without the network/ { on = 1 } on && /^```/ { if (code) exit; code = 1; next } on && code' \
  "$SRC/docs/ptk-download.md")
grep -q '^build/bin/ptk-download ' <<<"$block" || fail "docs/ptk-download.md's try-it block has no ptk-download line: $block"
echo "+ $block"
out=$(cd try-download && timeout 120 bash -ec "trap 'kill \$(jobs -p) 2>/dev/null' EXIT"$'\n'"$block" 2>&1) ||
  fail "docs/ptk-download.md's try-it block failed as printed: $out"
[ "$(find try-download/raw/train -name '*.jsonl.zst' | wc -l)" = 24 ] ||
  fail "docs/ptk-download.md's try-it block fetched $(find try-download/raw | head)"
ran=$((ran + 1))
# The lines of the other manuals that run here, on what the recipe above trained (ckpt, tb): ptk-train.md's
# --dry-run plan, loss plot and conversions (not its training lines: GPT-2 small for 5000 iterations, srun,
# a GPU), gpu.md's --version, and interop.md's Megatron round trip (its ptk-train line is a placeholder) from
# a Megatron checkpoint made by ptk-convert.md's line.
ln -s "$SRC/scripts" scripts
run_examples docs/ptk-train.md "" '^(WORLD_SIZE=[0-9]+ LOCAL_WORLD_SIZE=[0-9]+ build/bin/ptk-train --dry-run |build/bin/ptk-convert |python3 scripts/plot-loss.py )'
[ -s loss.png ] || fail "ptk-train.md's plot-loss.py line wrote no loss.png"
run_examples docs/gpu.md "" '^build/bin/ptk-train --version$'
cp -r meg megatron-ckpt
run_examples docs/interop.md "Converting a Megatron checkpoint" '^build/bin/ptk-convert '
[ -f megatron-ckpt2/latest_checkpointed_iteration.txt ] || fail "interop.md's round trip wrote no megatron-ckpt2"
# cluster.md's Kubernetes render lines, in one shell (the export carries): every template rendered with the
# settings they give, into the manifests the kubectl lines apply.
ln -s "$SRC/k8s" k8s
render=$(code_lines docs/cluster.md Kubernetes | grep -E '^(export IMAGE=|for t in .*k8s/render\.sh|bash k8s/render\.sh)' || true)
[ "$(wc -l <<<"$render")" = 3 ] || fail "cluster.md's render lines are not the three expected: $render"
out=$(REGISTRY=registry.example.com bash -ec "$render" 2>&1) || fail "cluster.md's render lines failed: $out"
for m in download extract concat-plan concat tokenize; do
  grep -q '^kind: Job$' "$m-job.yaml" || fail "cluster.md's render loop wrote no Job into $m-job.yaml: $out"
done
grep -q '^kind: PyTorchJob$' pytorchjob.yaml || fail "cluster.md's render line wrote no PyTorchJob: $out"
grep -q '"registry.example.com/ptk:latest"' pytorchjob.yaml || fail "IMAGE is not in pytorchjob.yaml"
[ "$ran" -ge 42 ] || fail "only $ran examples ran"
[ "$(find raw/train -name '*.jsonl.zst' | wc -l)" = 24 ] || fail "README's ptk-download lines fetched $(find raw | head)"
# What the extract and concat lines promise: the layout kept, the sidecars, the plan's chunks.
[ -f extracted/train/chunk1/example_train_0.jsonl ] && [ -f extracted/train/chunk1/example_train_0.jsonl.ptk-done ] ||
  fail "ptk-extract raw --output-dir extracted did not keep the layout: $(find extracted | head)"
[ -f raw/train/chunk1/example_train_0.jsonl ] || fail "ptk-extract 'raw/train/chunk1/*.zst' wrote nothing beside its inputs"
[ -f chunks/train_chunk_0.jsonl ] && [ -f chunks/concat-plan.json ] || fail "NeMo's grouping wrote $(ls chunks)"
# README's screen per tool (each `## ptk-NAME` section) prints its manual's commands, never others.
mapfile -t tools < <(sed -n 's/^## \(ptk-[a-z]*\)$/\1/p' "$SRC/README.md")
[ "${#tools[@]}" -ge 8 ] || fail "README.md has ${#tools[@]} tool sections (## ptk-NAME), not 8"
for tool in "${tools[@]}"; do
  [ -f "$SRC/docs/$tool.md" ] || fail "README.md's section '## $tool' has no manual docs/$tool.md"
  manual=$(examples "docs/$tool.md")
  mapfile -t lines < <(examples README.md "$tool")
  [ "${#lines[@]}" -gt 0 ] || fail "README.md's section '## $tool' shows no example"
  for cmd in "${lines[@]}"; do
    grep -qxF -- "$cmd" <<<"$manual" || fail "README.md's $tool example is not in docs/$tool.md: $cmd"
  done
done
[ -f my-gpt2/model.safetensors ] || fail "the recipe wrote no Hugging Face model"
# docs/ptk-train.md's memory line is the recipe's run at --threads 2 (attention's work buffers count per
# thread): run again (its checkpoint is at the last iteration: nothing to train), the same line.
want=$(tr '\n' ' ' <"$SRC/docs/ptk-train.md" | tr -s ' ' | grep -o 'Theoretical memory footprints: [^`]*') ||
  fail "docs/ptk-train.md quotes no memory line"
train=$(examples README.md "From your own jsonl to a Hugging Face model" | grep '^build/bin/ptk-train')
mem=$(bash -c "$train --threads 2" 2>&1) || fail "the recipe's ptk-train line at --threads 2 failed: $mem"
got=$(grep -o 'Theoretical memory footprints: .*' <<<"$mem") || fail "the recipe printed no memory line: $mem"
[ "$got" = "$want" ] || fail "docs/ptk-train.md's memory line is not the recipe's: docs '$want', run '$got'"
# The ptk-inspect blend (weights and prefixes as separate words) printed a GPTDataset sample.
# (Output captured first: `grep -q` ending the pipe early would SIGPIPE the writer, and pipefail would
# turn a match into a failure.)
blend=$(bash -c "$(examples README.md ptk-inspect | grep -- '--data-path')" 2>&1) || fail "the --data-path example failed: $blend"
grep -q "sample 42" <<<"$blend" || fail "the --data-path example printed no sample 42: $blend"
# What docs/ptk-inspect.md promises of dataset names: ptk-merge --inputs gets the _text_document hint, and a
# .bin or .idx name is the dataset (not PREFIX.bin.bin).
set +e
hint=$(build/bin/ptk-merge --inputs out/a out/b_text_document --output-prefix out/m1 2>&1)
rc=$?
set -e
[ "$rc" != 0 ] || fail "ptk-merge took a prefix without its _text_document"
echo "$hint" | grep -q "did you mean out/a_text_document?" || fail "no hint from ptk-merge: $hint"
build/bin/ptk-merge --inputs out/a_text_document.bin out/b_text_document.idx --output-prefix out/m2 >/dev/null 2>&1 ||
  fail "ptk-merge --inputs PREFIX.bin"
[ -f out/m2.bin ] && [ ! -e out/m2.bin.bin ] || fail "ptk-merge wrote $(ls out/m2*)"
build/bin/ptk-inspect out/m2 --verify >/dev/null 2>&1 || fail "out/m2 does not verify"
echo "readme_examples_test: OK ($ran examples)"
