"""Prefill / decode step times of the default model for docs/scaling.md: python scripts/pd_step_times.py

Also the P/D KV transfer time of a prompt's K/V (sglite.server.disaggregation.send_kv /
recv_kv over gloo on 127.0.0.1, the pool's shape and dtype, through a TCPStore as the servers do).
"""
import json, statistics, threading, time
from sglite import Engine
from sglite.bench.workloads import random_words
import random


def transfer_time(e, n: int, repeats: int = 3) -> float:
    """Seconds to send the K/V of ``n`` tokens of ``e``'s pool shape from one thread to another."""
    import torch
    import torch.distributed as dist
    from sglite.server.disaggregation import recv_kv, send_kv
    from sglite.runtime.parallel.ports import free_port

    pool = e.runner.token_to_kv_pool
    L, (H, D), dt = len(pool.k_buffers), pool.k_buffers[0].shape[1:], pool.k_buffers[0].dtype
    k, v = torch.randn(L, n, H, D).to(dt), torch.randn(L, n, H, D).to(dt)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False)
    ts = []
    for room in range(repeats):
        box = {}
        th = threading.Thread(target=lambda: box.update(got=recv_kv(client, room, dt, (L, H, D))))
        t = time.perf_counter()
        th.start()
        send_kv(server, room, list(range(n)), k, v)
        th.join()
        ts.append(time.perf_counter() - t)
        assert torch.equal(box["got"][1], k)
    return min(ts)


def main():
    e = Engine(dtype="bfloat16", log_level="warning")
    rng = random.Random(0)
    out = {}
    e.generate("warm up " * 20, {"max_new_tokens": 4, "temperature": 0})
    for n in (512, 1500):
        ts = []
        for _ in range(2):
            e.flush_cache()
            p = random_words(rng, n)
            t = time.perf_counter(); r = e.generate(p, {"max_new_tokens": 1, "temperature": 0}); ts.append(time.perf_counter() - t)
        out[f"prefill_{r['meta_info']['prompt_tokens']}_tok_s"] = min(ts)
    for b in (1, 8, 32):
        e.flush_cache()
        rs = e.generate([random_words(rng, 32) for _ in range(b)], {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
        tpot = statistics.median((r["meta_info"]["e2e_latency"] - r["meta_info"]["ttft"]) / 47 for r in rs)
        out[f"decode_step_batch{b}_s"] = tpot
    for n in (512, 1500):
        out[f"kv_transfer_{n}_tok_s"] = transfer_time(e, n)
    print(json.dumps(out, indent=1))
    e.shutdown()

if __name__ == "__main__":
    main()
