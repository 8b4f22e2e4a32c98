#!/bin/bash
# colocated (1 thread, 2 threads, 2 DP workers behind the router) vs prefill/decode-disaggregated,
# chunked-prefill workload of docs/benchmarks.md, one `sglite bench sweep` (docs/benchmarks.md, issue 18).
cd "$(dirname "$0")/.."
OUT="${OUT:-docs/bench}"
(while true; do echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 60; done) > "$OUT/issue18_pd_sweep_load.txt" &
L=$!
timeout "${LIMIT:-4200}" .venv/bin/python -m sglite.cli bench sweep --dataset random --num-prompts 8 --input-len 1500 \
    --range-ratio 0.02 --output-len 48 --request-rates "${RATES:-0.05,0.15}" --server-args "--dtype bfloat16 --log-level warning" \
    --config "colocated=" --config "colocated-2threads=--num-threads 2" --config "dp2=--dp-size 2" \
    --config "pd=--pd-disaggregation" --slo-ttft-ms "${TTFT:-20000}" --slo-tpot-ms "${TPOT:-500}" --percentile p99 \
    --disable-tqdm --output-json "$OUT/issue18_pd_sweep.json" --plot "$OUT/issue18_pd_sweep.png"
RC=$?
kill $L
exit $RC
