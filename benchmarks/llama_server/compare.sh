#!/usr/bin/env bash
# sglite against llama-server on one GGUF (issue 27: Gemma 3 270M Q4_K_M, serving at 16 clients and offline).
#   benchmarks/llama_server/compare.sh GGUF [LLAMA_BIN_DIR]
# Serving: llama-server -np 16 (one run per thread count in $THREADS) and `sglite serve`, each loaded by
#   `sglite bench serving --backend openai` (random 256/128 words/tokens, range 0.5, 16 clients, 64 prompts).
# Offline: sglite's Engine.generate on the 48 x 64-token prompts (benchmarks/vllm_cpu/sglite_offline.py);
#   llama-server -np 48 with the same 48 prompts sent at once (offline_client.py); and, when built
#   (cmake --build build --target llama-batched-bench), llama-batched-bench on 48 x (107 + 64) tokens
#   (107: the prompts' mean length), llama.cpp's decode without a server or sampling.
# Both sides: greedy, ignore_eos (llama-server's token counts are checked: offline_client.py fails on a
# short reply; the serving JSONs' total output tokens are printed side by side).
# Environment: THREADS (llama.cpp thread counts tried, default "1 2"), SGLITE_THREADS (default: the
# engine's), PARTS (default "serving offline"), OUT (default /tmp/llama_server_bench), PORT (default 30210).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
GGUF="$1"
BIN="${2:-/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
THREADS="${THREADS:-1 2}"
PARTS="${PARTS:-serving offline}"
OUT="${OUT:-/tmp/llama_server_bench}"
PORT="${PORT:-30210}"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
if compgen -G "$OUT/serving_*.json" >/dev/null || compgen -G "$OUT/offline_*.txt" >/dev/null; then
  echo "$OUT already holds results (summary.py would mix them in); set OUT to a fresh folder" >&2; exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PID=""
stop() { if [ -n "$PID" ]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; fi; }
trap stop EXIT
port_free() {  # a server left on $PORT would be measured instead of the one just started
  if curl -s -o /dev/null "$URL/health" 2>/dev/null; then echo "port $PORT already serves; stop it or set PORT" >&2; exit 1; fi
}
wait_up() {  # $1: health path
  for _ in $(seq 1 600); do
    curl -sf "$URL$1" >/dev/null 2>&1 && return 0
    kill -0 "$PID" 2>/dev/null || { echo "server exited; see $OUT/$2" >&2; exit 1; }
    sleep 1
  done
  echo "server not up after 600 s" >&2; exit 1
}
llama_up() {  # $1 threads, $2 slots
  port_free
  "$BIN/llama-server" -m "$GGUF" -np "$2" -c $(($2 * 1024)) -t "$1" -tb "$1" --host 127.0.0.1 \
    --port "$PORT" --no-webui > "$OUT/llama_server_t$1_np$2.log" 2>&1 &
  PID=$!
  wait_up /health "llama_server_t$1_np$2.log"
}
serving() {  # $1 label
  echo "== serving $1 ($(uptime | sed 's/.*load/load/'))"
  "$PY" -m sglite.cli bench serving --backend openai --base-url "$URL" --model-path "$GGUF" \
    --dataset random --input-len 256 --output-len 128 --range-ratio 0.5 --max-concurrency 16 \
    --num-prompts 64 --disable-tqdm --output-json "$OUT/serving_$1.json" | tee "$OUT/serving_$1.txt"
}
for part in $PARTS; do
  case "$part" in
    serving)
      for t in $THREADS; do llama_up "$t" 16; serving "llama_t$t"; stop; done
      port_free
      "$PY" -m sglite.cli serve --model-path "$GGUF" --port "$PORT" \
        ${SGLITE_THREADS:+--num-threads "$SGLITE_THREADS"} > "$OUT/sglite_serve.log" 2>&1 &
      PID=$!
      wait_up /health sglite_serve.log
      serving sglite; stop ;;
    offline)
      for t in $THREADS; do
        llama_up "$t" 48
        echo "== offline llama t=$t ($(uptime | sed 's/.*load/load/'))"
        "$PY" "$HERE/offline_client.py" --base-url "$URL" | tee "$OUT/offline_llama_t$t.txt"
        stop
      done
      if [ -x "$BIN/llama-batched-bench" ]; then  # llama.cpp's own batched decode, no server, no sampling
        for t in $THREADS; do
          echo "== offline llama-batched-bench t=$t ($(uptime | sed 's/.*load/load/'))"
          # 48 sequences of 107 prompt tokens (the mean of the 48 prompts, BOS included) + 64 generated
          "$BIN/llama-batched-bench" -m "$GGUF" -c 8448 -b 2048 -ub 512 -npp 107 -ntg 64 -npl 48 \
            -t "$t" -tb "$t" 2>&1 | tee "$OUT/batched_bench_t$t.log" | grep -E "^\|" || true
          awk -F'|' '$2+0 == 107 {printf "engine=llama-batched-bench tokens=%d %.2fs %.1f tok/s\n", \
            $3 * $4, $10, $3 * $4 / $10}' "$OUT/batched_bench_t$t.log" | tee "$OUT/offline_batched_t$t.txt"
        done
      fi
      echo "== offline sglite ($(uptime | sed 's/.*load/load/'))"
      "$PY" "$ROOT/benchmarks/vllm_cpu/sglite_offline.py" --model-path "$GGUF" \
        ${SGLITE_THREADS:+--num-threads "$SGLITE_THREADS"} | tee "$OUT/offline_sglite.txt" ;;
    *) echo "unknown part $part (serving, offline)" >&2; exit 2 ;;
  esac
done
"$PY" "$HERE/summary.py" "$OUT"
