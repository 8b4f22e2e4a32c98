#!/bin/bash
# colocated vs prefill/decode-disaggregated, chunked-prefill workload of docs/benchmarks.md
cd "$(dirname "$0")/.."
mkdir -p "${OUT:-/tmp/sglite_pd}"
S=".venv/bin/python -m sglite.cli"
W="--dataset random --num-prompts 8 --input-len 1500 --range-ratio 0.02 --output-len 48 --request-rate 0.5 --slo-ttft-ms 4000 --slo-tpot-ms 400 --disable-tqdm"
wait_up() { for i in $(seq 1 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
$S serve --dtype bfloat16 --port 31100 --log-level warning > ${OUT:-/tmp/sglite_pd}/colo.log 2>&1 & C=$!
wait_up http://127.0.0.1:31100 && $S bench serving --base-url http://127.0.0.1:31100 $W --output-json ${OUT:-/tmp/sglite_pd}/colo.json > ${OUT:-/tmp/sglite_pd}/colo_bench.txt 2>&1
kill $C; wait $C
$S serve --dtype bfloat16 --port 31101 --disaggregation-mode prefill --disaggregation-bootstrap-port 31199 --log-level warning > ${OUT:-/tmp/sglite_pd}/pre.log 2>&1 & P=$!
$S serve --dtype bfloat16 --port 31102 --disaggregation-mode decode --log-level warning > ${OUT:-/tmp/sglite_pd}/dec.log 2>&1 & D=$!
wait_up http://127.0.0.1:31101 && wait_up http://127.0.0.1:31102 || { echo "servers did not start"; kill $P $D; exit 1; }
$S router --pd-disaggregation --prefill http://127.0.0.1:31101 31199 --decode http://127.0.0.1:31102 --port 31103 --log-level warning > ${OUT:-/tmp/sglite_pd}/router.log 2>&1 & R=$!
wait_up http://127.0.0.1:31103 && $S bench serving --base-url http://127.0.0.1:31103 $W --output-json ${OUT:-/tmp/sglite_pd}/pd.json > ${OUT:-/tmp/sglite_pd}/pd_bench.txt 2>&1
curl -s http://127.0.0.1:31103/get_server_info | python3 -c "import json,sys; print(json.load(sys.stdin)['pd'])" > ${OUT:-/tmp/sglite_pd}/pd_info.txt
kill $R $P $D; wait
echo done > ${OUT:-/tmp/sglite_pd}/done
