#!/usr/bin/env bash
# Installs every Debian package that ptk's build, tests and benchmarks need.
# Idempotent: when everything is already installed it only checks and returns.
# Usage: scripts/install-deps.sh [--with-python-ref | --build-only]   (as root on Debian bookworm)
#   --with-python-ref  also installs the Python pieces the compatibility tests use
#                      (python3-numpy, python3-torch from Debian; megatron-core, tensorboard and
#                      transformers from PyPI; transformers 4.51.3 for the Qwen3 test in a folder of its
#                      own) and the Kubernetes manifest validator of tests/k8s (kubernetes-validate from PyPI).
#   --build-only       only what building the programs needs (scripts/build.sh
#                      -DPTK_BUILD_TESTS=OFF -DPTK_BUILD_BENCH=OFF): the Dockerfile's set; the same
#                      package names serve on Ubuntu 24.04 (the base of NGC's and NVIDIA's CUDA images).
set -euo pipefail

BUILD_PKGS=(
  build-essential cmake ninja-build pkg-config ca-certificates
  libabsl-dev libfmt-dev libcli11-dev libsimdjson-dev libtbb-dev
  libcurl4-openssl-dev libssl-dev libzstd-dev liblzma-dev zlib1g-dev libopenblas-dev libgloo-dev libxxhash-dev
  libprotobuf-dev protobuf-compiler libisal-dev
)
PKGS=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libabsl-dev libfmt-dev libcli11-dev libsimdjson-dev libtbb-dev
  libcurl4-openssl-dev libssl-dev libzstd-dev liblzma-dev libre2-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libgloo-dev libxxhash-dev zlib1g-dev
  libprotobuf-dev protobuf-compiler libisal-dev
  zstd xz-utils curl aria2 python3 python3-venv python3-pip python3-matplotlib
  slurmctld slurmd slurm-client munge debootstrap strace
  gettext-base python3-yaml clang-format
)
REF_PKGS=(python3-numpy python3-torch python3-packaging
  python3-absl python3-protobuf python3-yaml python3-requests python3-tqdm python3-filelock python3-regex
  python3-typing-extensions)

want_ref=0
for a in "$@"; do
  case "$a" in
    --with-python-ref) want_ref=1 ;;
    --build-only) PKGS=("${BUILD_PKGS[@]}") ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    *) echo "install-deps.sh: unknown argument: $a" >&2; exit 2 ;;
  esac
done
[ "$want_ref" = 1 ] && PKGS+=("${REF_PKGS[@]}")

# The CUDA backend (built wherever nvcc is, as CMake finds it) also needs cuDNN and NVIDIA's
# header-only cudnn-frontend (from PyPI, below), so pip joins the packages there.
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
[ -n "$NVCC" ] && PKGS+=(python3 python3-pip)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    SUDO=sudo
  else
    SUDO=
  fi
  echo "install-deps: installing ${#missing[@]} package(s): ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # The slurm/munge postinst scripts try to start services; policy-rc.d may deny that, which is fine.
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/ptk-apt.log 2>&1 || {
    tail -30 /tmp/ptk-apt.log >&2; echo "install-deps: apt-get install failed" >&2; exit 1; }
else
  echo "install-deps: all ${#PKGS[@]} packages present" >&2
fi

# Installs pinned PyPI packages, without their dependencies, into a folder of their own (emptied
# first) unless its tag file DIR/.TAG-<hash of the pins> says these pins are in, then checks that
# the Python code CHECK runs with PYTHONPATH=DIR<PATH_TAIL> ("WHAT does not import from DIR" if not).
# Usage: private_pip_install DIR TAG PATH_TAIL CHECK WHAT PIN...
private_pip_install() {
  local dir=$1 name=$2 path_tail=$3 check=$4 what=$5 tag
  shift 5
  tag=$(printf '%s\n' "$@" | sha256sum | cut -c1-12)
  if [ -f "$dir/.$name-$tag" ]; then
    return 0
  fi
  echo "install-deps: installing $* into $dir" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  /usr/bin/python3 -m pip install -q --no-deps --no-compile --target "$dir" \
    --break-system-packages "$@" >&2 2>/dev/null ||
  /usr/bin/python3 -m pip install -q --no-deps --no-compile --target "$dir" "$@" >&2
  PYTHONPATH="$dir$path_tail" /usr/bin/python3 -c "$check" ||
    { echo "install-deps: $what does not import from $dir" >&2; exit 1; }
  touch "$dir/.$name-$tag"
}

if [ "$want_ref" = 1 ]; then
  # megatron-core from PyPI, for the compatibility tests only (never a runtime dependency).
  # Installed without its dependencies: Debian's numpy/torch serve, with the import shims in
  # tests/support/megatron_shim.py.
  REF_DIR="${PTK_PYREF_DIR:-/opt/ptk-pyref}"
  if [ ! -f "$REF_DIR/.megatron-core-0.16.1" ]; then
    echo "install-deps: installing megatron-core 0.16.1 into $REF_DIR" >&2
    mkdir -p "$REF_DIR"
    /usr/bin/python3 -m pip install -q --no-deps --no-compile --target "$REF_DIR" \
      --break-system-packages megatron-core==0.16.1 >&2 2>/dev/null ||
    /usr/bin/python3 -m pip install -q --no-deps --no-compile --target "$REF_DIR" megatron-core==0.16.1 >&2
    touch "$REF_DIR/.megatron-core-0.16.1"
  fi
  # TensorBoard's own event reader and Hugging Face transformers, for the tests of ptk-train's event
  # files and ptk-convert's GPT-2 export only, pinned and without their dependencies (Debian's
  # torch, numpy, protobuf, absl, yaml, requests, tqdm, filelock, regex serve). transformers 4.44.2
  # runs on Debian's torch 1.13 (GPT2LMHeadModel loads, runs and generates; current releases require
  # torch 2); huggingface-hub, tokenizers and safetensors are versions it accepts.
  PYREF_PINS=(tensorboard==2.17.1 transformers==4.44.2 huggingface-hub==0.24.6 tokenizers==0.19.1 safetensors==0.4.4)
  PINS_TAG=$(printf '%s\n' "${PYREF_PINS[@]}" | sha256sum | cut -c1-12)
  if [ ! -f "$REF_DIR/.hf-tb-$PINS_TAG" ]; then
    echo "install-deps: installing ${PYREF_PINS[*]} into $REF_DIR" >&2
    mkdir -p "$REF_DIR"
    /usr/bin/python3 -m pip install -q --no-deps --no-compile --upgrade --target "$REF_DIR" \
      --break-system-packages "${PYREF_PINS[@]}" >&2 2>/dev/null ||
    /usr/bin/python3 -m pip install -q --no-deps --no-compile --upgrade --target "$REF_DIR" "${PYREF_PINS[@]}" >&2
    touch "$REF_DIR/.hf-tb-$PINS_TAG"
  fi
  # kubernetes-validate (Kubernetes' JSON schemas per release) and the jsonschema it runs on, for
  # tests/k8s/k8s_manifests_test.py only, in a folder of their own so that their jsonschema, packaging
  # and typing-extensions never shadow Debian's for the other reference tests. Pinned with their
  # dependencies.
  KV_PINS=(kubernetes-validate==1.37.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
           rpds-py==2026.9.1 attrs==26.1.0 typing-extensions==4.16.0 importlib-resources==7.1.0 packaging==26.3)
  private_pip_install "$REF_DIR/kubernetes-validate" kubernetes-validate "" \
    'import kubernetes_validate, jsonschema' kubernetes-validate "${KV_PINS[@]}"
  # transformers 4.51.3, the first line with Qwen3ForCausalLM (ptk-convert's --qk-layernorm export), for
  # tests/interop/hf_qwen3_test.py only, in a folder of its own so that the 4.44.2 above (and the goldens it
  # made) stays what the other tests import. Pinned with the dependencies Debian does not provide (fsspec;
  # filelock, numpy, packaging, yaml, regex, requests, tqdm, typing-extensions are Debian's), 15 MB in all.
  # It runs on Debian's torch 1.13 with tests/support/torch2_shim.py: PyPI's x86-64 torch 2 wheels are
  # CUDA builds (hundreds of MB, importing NVIDIA's CUDA library wheels), which CI has no room for.
  QW_PINS=(transformers==4.51.3 huggingface-hub==0.30.2 tokenizers==0.21.1 safetensors==0.5.3 fsspec==2025.3.2)
  SHIM_DIR=$(cd "$(dirname "$0")/../tests/support" && pwd)
  private_pip_install "$REF_DIR/transformers-qwen3" transformers-qwen3 ":$SHIM_DIR" \
    'import torch2_shim; torch2_shim.install(); from transformers import Qwen3ForCausalLM' \
    "transformers' Qwen3ForCausalLM" "${QW_PINS[@]}"
fi

if [ -n "$NVCC" ]; then
  # cuDNN itself: NVIDIA's CUDA images configure NVIDIA's apt repository but ship no cuDNN; its
  # package for this CUDA major version (libcudnn9-dev-cuda-NN) is installed when no cudnn.h is found.
  CUDA_HOME_DIR=$(cd "$(dirname "$NVCC")/.." && pwd)
  have_cudnn=0
  for h in "$CUDA_HOME_DIR"/include/cudnn.h /usr/include/cudnn.h /usr/include/*-linux-gnu/cudnn.h; do
    [ -f "$h" ] && have_cudnn=1
  done
  if [ "$have_cudnn" = 0 ]; then
    CUDA_MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    CUDNN_PKG="libcudnn9-dev-cuda-$CUDA_MAJOR"
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq || true
    if apt-cache show "$CUDNN_PKG" >/dev/null 2>&1; then
      echo "install-deps: installing $CUDNN_PKG (cuDNN for the CUDA backend)" >&2
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$CUDNN_PKG" >/tmp/ptk-apt.log 2>&1 || {
        tail -30 /tmp/ptk-apt.log >&2; echo "install-deps: apt-get install $CUDNN_PKG failed" >&2; exit 1; }
    else
      echo "install-deps: warning: nvcc is at $NVCC but no cudnn.h was found and apt has no $CUDNN_PKG;" \
           "install cuDNN 9 for CUDA $CUDA_MAJOR (or build with -DPTK_CUDA=OFF)" >&2
    fi
  fi
  # cudnn-frontend, pinned: 1.18.0 is NVIDIA's recommended frontend for cuDNN 9.18.1 and later (this
  # tree is built against cuDNN 9.19); its headers compile as C++17 under nvcc 13. Only its include/
  # is used (trainer/cuda/CMakeLists.txt looks in $FE_DIR/include); the Python module is never loaded.
  FE_VERSION=1.18.0
  FE_DIR="${PTK_CUDNN_FRONTEND_DIR:-/opt/ptk-cudnn-frontend}"
  if [ ! -f "$FE_DIR/.nvidia-cudnn-frontend-$FE_VERSION" ] || [ ! -f "$FE_DIR/include/cudnn_frontend.h" ]; then
    echo "install-deps: installing nvidia-cudnn-frontend $FE_VERSION (headers) into $FE_DIR" >&2
    mkdir -p "$FE_DIR"
    /usr/bin/python3 -m pip install -q --no-deps --no-compile --upgrade --target "$FE_DIR" \
      --break-system-packages "nvidia-cudnn-frontend==$FE_VERSION" >&2 2>/dev/null ||
    /usr/bin/python3 -m pip install -q --no-deps --no-compile --upgrade --target "$FE_DIR" \
      "nvidia-cudnn-frontend==$FE_VERSION" >&2
    [ -f "$FE_DIR/include/cudnn_frontend.h" ] || {
      echo "install-deps: nvidia-cudnn-frontend $FE_VERSION has no include/cudnn_frontend.h in $FE_DIR" >&2; exit 1; }
    touch "$FE_DIR/.nvidia-cudnn-frontend-$FE_VERSION"
  fi
fi
