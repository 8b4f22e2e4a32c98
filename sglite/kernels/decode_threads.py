"""The default CPU thread count: the fastest one measured for the fused batch-1 decode
(:mod:`.decode_fused`, whose thread pool is ``csrc/thread_pool.h``).

Why measure: batch-1 decode streams every weight once per token, so it scales with the cores'
share of memory bandwidth, not their number; a machine whose bandwidth one core already fills, or
a shared one, is faster with fewer threads, and ``cores - 1`` (the old default) leaves one core
idle on a 2-core machine. The probe times one pass over every layer GEMV and the LM head of the
loaded model (the ``probe_gemvs`` entry of ``csrc/decode_layer.cpp``; about 95 % of a batch-1
step of the default model) at 1, 2, 4, ... threads up to the CPUs this process may use (and that
count itself), in rounds that time each count once (so every count sees the same load; a shared
machine's noise), the best pass of each count kept, and picks the fastest; a larger count must win
by :data:`MIN_GAIN` to be taken. Rounds go on while :data:`BUDGET_S` lasts (at least :data:`REPS`,
at most :data:`ROUNDS`): the default model takes ~4 ms a pass on one core, so the probe costs
about 0.3 s.

The answer is cached in ``<cache_root>/thread_probe.json`` under a key of the CPU model, the
usable CPU count and the model's weight shapes, bit widths and layout, so a restart on the same
machine and model reuses it (delete the file, or set ``SGLITE_THREAD_PROBE=refresh``, to measure
again; ``SGLITE_THREAD_PROBE=off`` skips the probe: ``cores - 1``). A probe taken while the
machine was busy (1-minute load average at least :data:`BUSY_LOAD` per usable CPU: other processes
take the extra cores, so fewer threads win) is cached with that load and measured again at the next
start on a quiet machine. ``--num-threads`` / ``EngineConfig.num_threads`` overrides all of it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Optional

from .cpu_build import cache_root

log = logging.getLogger(__name__)

REPS = 3  # at least this many timed passes per thread count (best kept)
ROUNDS = 40  # at most this many: rounds continue while the time budget lasts
MIN_GAIN = 0.03  # a larger thread count must be this much faster than the best smaller one
BUDGET_S = 0.3  # the probe starts no new round after this long (with REPS rounds done)
BUSY_LOAD = 0.5  # 1-minute load average per usable CPU from which a probe counts as taken on a busy machine


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def fallback_threads() -> int:
    """The default without a probe: usable CPUs - 1, at least 1."""
    return max(1, usable_cpus() - 1)


def candidates(cpus: int) -> list[int]:
    """Thread counts the probe tries: powers of two below ``cpus``, ``cpus - 1`` and ``cpus``."""
    c = {cpus, max(1, cpus - 1)}
    p = 1
    while p < cpus:
        c.add(p)
        p *= 2
    return sorted(c)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cache_key(fused) -> str:
    """Key of a probe result: CPU model, usable CPUs, and the fused model's weight shapes/bits/layout."""
    shapes = [(tuple(t.shape), str(t.dtype)) for t in fused.lin] + [fused.bits, fused.q8, fused.tiled, fused.head_kind]
    h = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    return f"{_cpu_model()}|cpus={usable_cpus()}|model={h}"


def _cache_path():
    return cache_root() / "thread_probe.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    try:
        data = _read_cache()
        data[key] = entry
        p = _cache_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, p)
    except OSError as e:  # an unwritable cache costs one probe per start, nothing else
        log.warning("thread probe: could not write %s (%s)", _cache_path(), e)


def measure(fused, cpus: Optional[int] = None) -> dict:
    """Seconds of one GEMV pass of ``fused``'s model per thread count, best over the rounds:
    ``{threads: seconds}`` (see the module docstring)."""
    from . import decode_fused

    mod = decode_fused.load(fused.portable)
    head = []
    hw = fused.model.lm_head
    if fused.head_kind == "q8":
        head = [hw.qweight, hw.scales, hw.mins if hw.mins is not None else hw.scales.new_empty(0)]
    args = (fused.lin, fused.bits, fused.q8, fused.tiled, head, bool(head) and hw.tiled, hw.bits if head else 4)
    counts = candidates(cpus or usable_cpus())
    out: dict = {}
    t_start = time.perf_counter()
    for t in counts:
        mod.probe_gemvs(*args, t, 1)  # warm-up: wakes / creates the pool's workers
    for r in range(ROUNDS):  # rounds over all counts (each count sees the same load), best kept
        for t in counts:
            out[t] = min(out.get(t, float("inf")), mod.probe_gemvs(*args, t, 1))
        if r + 1 >= REPS and time.perf_counter() - t_start > BUDGET_S:
            break
    return out


def pick(times: dict) -> int:
    """The fastest thread count of ``times`` ({threads: seconds}); a larger count must beat the
    best smaller one by :data:`MIN_GAIN`."""
    best = None
    for t in sorted(times):
        if best is None or times[t] < times[best] * (1 - MIN_GAIN):
            best = t
    return best or 1


def default_threads(fused) -> int:
    """The engine's default ``num_threads``: the cached or freshly probed fastest count for the
    fused decode ``fused`` (a :class:`.decode_fused.FusedDecode`), or :func:`fallback_threads`
    when there is none or ``SGLITE_THREAD_PROBE=off``. Logs the choice."""
    mode = os.environ.get("SGLITE_THREAD_PROBE", "")
    if fused is None or mode == "off":
        return fallback_threads()
    key = cache_key(fused)
    entry = None if mode == "refresh" else _read_cache().get(key)
    load = load_per_cpu()
    if entry is not None and entry.get("load", 0.0) >= BUSY_LOAD > load:
        log.info("CPU threads: the cached probe was taken on a busy machine (load %.2f per CPU); measuring "
                 "again now that it is quiet", entry["load"])
        entry = None
    if entry is not None and isinstance(entry.get("threads"), int) and 1 <= entry["threads"] <= usable_cpus():
        log.info("CPU threads: %d (the fastest measured for this model on this machine, cached in %s)",
                 entry["threads"], _cache_path())
        return entry["threads"]
    t0 = time.perf_counter()
    times = measure(fused)
    best = pick(times)
    summary = ", ".join(f"{t}: {1e3 * s:.2f} ms" for t, s in sorted(times.items()))
    log.info("CPU threads: %d, the fastest batch-1 decode GEMV pass measured (%s; probe %.2f s)", best, summary,
             time.perf_counter() - t0)
    _write_cache(key, {"threads": best, "ms": {str(t): round(1e3 * s, 3) for t, s in times.items()},
                       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load": round(load, 2)})
    return best


def load_per_cpu() -> float:
    """The 1-minute load average divided by the usable CPUs (0.0 where the OS does not report it)."""
    try:
        return os.getloadavg()[0] / usable_cpus()
    except OSError:
        return 0.0
