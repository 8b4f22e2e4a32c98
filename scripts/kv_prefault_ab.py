"""A/B of ``--kv-prefault-mb``: a fresh ``sglite serve`` per round, flag values alternated.

    python scripts/kv_prefault_ab.py [--rounds 4] [--values 0,512] [--prompts 5] [--input-len 2048]

Each round starts the server with one value, waits until ``/health`` answers and ``--settle`` more
seconds (the idle prefault), reads its RSS, then sends ``--prompts`` prompts of random token ids
through ``/generate`` (one new token) ``--gap`` seconds apart and records around each request: the
wall time (ms), the server's CPU time over all its threads (``/proc/PID/task/*/schedstat``, ms) and
its minor page faults. Prints one line per round and the medians of prompts 2.. per value (the
first prompt also pays first-use costs). Linux only. The load (``/proc/loadavg``) is printed with
each round: on a shared machine compare rounds of the same load only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request


def _proc(pid: int) -> tuple[int, float]:
    """(minor faults, CPU ms of all threads) of process ``pid``."""
    minflt = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
    ns = sum(int(open(p).read().split()[0]) for p in glob.glob(f"/proc/{pid}/task/*/schedstat"))
    return minflt, ns / 1e6


def _rss_mib(pid: int) -> float:
    return int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_round(mb: int, a) -> dict:
    url = f"http://127.0.0.1:{a.port}"
    srv = subprocess.Popen([sys.executable, "-m", "sglite.cli", "serve", "--port", str(a.port),
                            "--kv-prefault-mb", str(mb), "--log-level", "warning"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1500):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(a.settle)
        out = {"mb": mb, "rss_mib": round(_rss_mib(srv.pid)), "load": open("/proc/loadavg").read().split()[0],
               "wall_ms": [], "cpu_ms": [], "faults": []}
        rng = random.Random(time.time_ns())
        for _ in range(a.prompts):
            body = {"input_ids": [rng.randrange(100, 40000) for _ in range(a.input_len)],
                    "sampling_params": {"max_new_tokens": 1}}
            req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            f0, c0 = _proc(srv.pid)
            t = time.perf_counter()
            urllib.request.urlopen(req).read()
            wall = (time.perf_counter() - t) * 1e3
            f1, c1 = _proc(srv.pid)
            out["wall_ms"].append(round(wall))
            out["cpu_ms"].append(round(c1 - c0))
            out["faults"].append(f1 - f0)
            time.sleep(a.gap)
        return out
    finally:
        srv.terminate()
        srv.wait(30)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--values", default="0,512", help="--kv-prefault-mb values, alternated (default: 0,512)")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--settle", type=float, default=3.0, help="seconds after /health answers (default: 3)")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between prompts (default: 1)")
    p.add_argument("--port", type=int, default=30293)
    a = p.parse_args(argv)
    values = [int(v) for v in a.values.split(",")]
    rows: dict = {v: [] for v in values}
    for r in range(a.rounds):
        for mb in (values if r % 2 == 0 else values[::-1]):
            res = one_round(mb, a)
            rows[mb].append(res)
            print(json.dumps(res), flush=True)
    for mb, rs in rows.items():
        med = {k: statistics.median(x for res in rs for x in res[k][1:]) for k in ("wall_ms", "cpu_ms", "faults")}
        print(f"--kv-prefault-mb {mb}: median of prompts 2..: wall {med['wall_ms']:.0f} ms, server CPU "
              f"{med['cpu_ms']:.0f} ms, {med['faults']:.0f} minor faults; RSS after start-up "
              f"{[res['rss_mib'] for res in rs]} MiB")


if __name__ == "__main__":
    main()
