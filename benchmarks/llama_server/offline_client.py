"""llama-server's side of the offline comparison: the 48 prompts x 64 tokens of
``benchmarks/vllm_cpu/offline.py`` sent at once (concurrency 48) to a running llama-server started
with ``-np 48``; greedy, ``ignore_eos``, ``n_predict`` 64; one untimed warm-up of the first two.

    python benchmarks/llama_server/offline_client.py --base-url http://127.0.0.1:30210

Checks every reply's ``tokens_predicted`` equals the requested count (so both engines do the same
work) and prints one line: ``engine=llama-server tokens=N S s T tok/s``.
"""
import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_cpu"))
from offline import prompts  # noqa: E402  (the same prompts as sglite's side)


async def _one(http: httpx.AsyncClient, url: str, prompt: str, n: int) -> int:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    r = await http.post(url + "/completion", json=body)
    r.raise_for_status()
    got = int(r.json()["tokens_predicted"])
    if got != n:
        raise SystemExit(f"llama-server predicted {got} tokens, asked for {n} (ignore_eos not honoured?)")
    return got


async def _run(url: str, ps: list[str], n: int) -> int:
    async with httpx.AsyncClient(timeout=3600) as http:
        return sum(await asyncio.gather(*(_one(http, url, p, n) for p in ps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30210", help="llama-server root")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    a = ap.parse_args()
    ps = prompts(a.seed)
    asyncio.run(_run(a.base_url, ps[:2], a.max_tokens))
    t = time.perf_counter()
    n = asyncio.run(_run(a.base_url, ps, a.max_tokens))
    dt = time.perf_counter() - t
    print(f"engine=llama-server tokens={n} {dt:.2f}s {n / dt:.1f} tok/s")


if __name__ == "__main__":
    main()
