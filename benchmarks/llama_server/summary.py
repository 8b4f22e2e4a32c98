"""Print the results of ``compare.sh`` (one directory of serving JSONs and offline lines) as a table.

    python benchmarks/llama_server/summary.py /tmp/llama_server_bench
"""
import json
import re
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_server_bench")
    print("| run | output tok/s | output tokens | failed | median TTFT ms | median TPOT ms |")
    print("|---|---|---|---|---|---|")
    totals = set()
    for f in sorted(out.glob("serving_*.json")):
        d = json.loads(f.read_text())
        totals.add(d.get("total_output_tokens"))
        print(f"| serving {f.stem[8:]} | {d['output_throughput']:.1f} | {d.get('total_output_tokens', '?')} "
              f"| {d.get('failed', '?')} | {d.get('median_ttft_ms', float('nan')):.0f} "
              f"| {d.get('median_tpot_ms', float('nan')):.1f} |")
    for f in sorted(out.glob("offline_*.txt")):
        m = re.search(r"tokens=(\d+) ([\d.]+)s ([\d.]+) tok/s", f.read_text())
        cells = f"{m[3]} | {m[1]} ({m[2]} s)" if m else "(no result) |"
        print(f"| offline {f.stem[8:]} | {cells} | | | |")
    if len(totals) > 1:
        print("WARNING: the serving runs generated different token totals (a failed request, or a "
              "server stopping early): rerun before comparing them")


if __name__ == "__main__":
    main()
