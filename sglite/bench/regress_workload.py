"""The fixed workload of the instruction-count regression gate (:mod:`.regress`), run under callgrind.

    valgrind --tool=callgrind --instr-atstart=no ... python -m sglite.bench.regress_workload [--model-path P]

The default model dequantized to float32 (:data:`DTYPE`, :data:`QUANTIZATION`), one process, one torch
thread, greedy, fixed token ids (no tokenizer in the counted part):

* **prefill**: :data:`BATCH` requests of :data:`PROMPT_LEN` token ids each (``BATCH * PROMPT_LEN`` =
  256 prompt tokens), scheduled until every request holds its first token (one step unless the
  scheduler splits it);
* **decode**: :data:`DECODE_STEPS` scheduler steps at batch :data:`BATCH`.

Both phases run on the engine's own loop thread (:meth:`EngineLoop.call`) through
``Scheduler.step()``: the scheduler, ``ForwardBatch`` building, the model forward, sampling and the
per-token bookkeeping are all counted, and no wall-clock wait or polling loop is (the other threads
block on futexes meanwhile); Python's garbage collector is paused inside them (when a collection
runs depends on the whole process's history). A warm-up request runs first, uncounted, so that one-time work (kernel
builds and loads, first-call caches) stays out of the counts.

Collection is switched with callgrind's client requests (``CALLGRIND_START_INSTRUMENTATION``,
``CALLGRIND_ZERO_STATS``, ``CALLGRIND_DUMP_STATS_AT(phase)``) through a 20-line C shim built with
the system compiler (header ``valgrind/callgrind.h``); outside callgrind they are no-ops, so the
script also runs natively (``--native`` prints wall times instead).

valgrind does not decode AVX-512 or AMX (an EVEX instruction stops the process with SIGILL), so
before the model loads this module masks ``avx512*``/``amx*``/``avx_vnni*`` out of
:func:`sglite.kernels.device.cpu_flags` and rewrites the C++ kernels' compiler flags
(``-march=x86-64-v3 -mno-fma`` in place of ``-march=native`` or none, no ``-mavx512*``/``-mamx*``;
valgrind emulates FMA one lane at a time, so MKL, oneDNN and ATen are held to AVX without FMA too,
:data:`NO_FMA_ENV`): the kernels build their
portable or AVX2 variants, torch and oneDNN pick their AVX2 code (valgrind's CPUID shows no
AVX-512). The gate therefore counts the AVX2-level build of every path, the same on every
x86-64-v3 machine with the same compiler and torch.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH = 8
PROMPT_LEN = 32
DECODE_STEPS = 4  # counts are exact: 4 steps flag the same relative change as 16, at a quarter of the callgrind time
SEED = 0
# The default model's weights dequantized at load to float32: F.linear (AVX2 sgemm under valgrind) keeps
# the GEMMs a small, stable share of the count, so the step's own cost (Python, scheduling, attention,
# elementwise ops, sampling) moves the counts visibly. The masked (portable) quantized kernels ran
# far past the gate's time budget under callgrind, measured before FMA was switched off (NO_FMA_ENV):
# "auto" (the GGUF's own quantized path) is worth re-measuring now.
DTYPE = "float32"
QUANTIZATION = "none"
MASKED_PREFIXES = ("avx512", "amx", "avx_vnni", "fma")
DROPPED_CFLAG_PREFIXES = ("-mavx512", "-mamx", "-mavxvnni", "-mfma")
# valgrind runs FMA instructions through a helper call per lane: MKL's and ATen's AVX2+FMA code ran
# 1,600x slower than native under it (F.linear 64x576x1536: 2.8 s vs 1.7 ms), 30x less with these.
NO_FMA_ENV = {"MKL_ENABLE_INSTRUCTIONS": "AVX", "ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "AVX"}

_SHIM_SRC = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""


def build_shim(cache_dir: Path) -> ctypes.CDLL:
    """Compile (once per source hash) and load the client-request shim.

    Raises:
        RuntimeError: no C compiler or no ``valgrind/callgrind.h`` (install ``valgrind``).
    """
    tag = hashlib.sha1(_SHIM_SRC.encode()).hexdigest()[:12]
    so = cache_dir / f"callgrind_shim_{tag}.so"
    if not so.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "shim.c"
            src.write_text(_SHIM_SRC)
            tmp = Path(d) / "shim.so"
            r = subprocess.run([os.environ.get("CC", "cc"), "-O1", "-shared", "-fPIC", str(src), "-o", str(tmp)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"building the callgrind shim failed (needs a C compiler and valgrind's "
                                   f"headers, e.g. apt-get install valgrind gcc):\n{r.stderr}")
            os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.cg_dump.argtypes = [ctypes.c_char_p]
    return lib


def mask_simd() -> None:
    """Make every loaded ``sglite`` module see a CPU without AVX-512/AMX and build its C++ kernels
    without them (see the module docstring). Call after ``import sglite.runtime.engine`` and before
    the engine is built (the kernels build lazily, on first use)."""
    from sglite.kernels import cpu_build, device

    real_flags, real_load = device.cpu_flags, cpu_build.load_cpp
    masked = frozenset(f for f in real_flags() if not f.startswith(MASKED_PREFIXES))

    def cpu_flags() -> frozenset:
        return masked

    def load_cpp(name, source, extra_cflags=("-O3",), *args, **kw):
        flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in extra_cflags
                      if not f.startswith(DROPPED_CFLAG_PREFIXES))
        if not any(f.startswith("-march=") for f in flags):
            flags += ("-march=x86-64-v3",)  # the portable builds: AVX2 auto-vectorization
        flags += ("-mno-fma",)  # see NO_FMA_ENV
        return real_load(name, source, flags, *args, **kw)

    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("sglite."):
            continue
        if getattr(mod, "cpu_flags", None) is real_flags:
            mod.cpu_flags = cpu_flags
        if getattr(mod, "load_cpp", None) is real_load:
            mod.load_cpp = load_cpp


def prompts(vocab_size: int) -> list[list[int]]:
    """:data:`BATCH` prompts of :data:`PROMPT_LEN` token ids, fixed by :data:`SEED` (ids 100..vocab-1)."""
    rng = random.Random(SEED)
    return [[rng.randrange(100, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]


def _mark(what: str) -> None:
    print(f"[regress_workload] {what}: {time.process_time():.1f} s CPU, {time.perf_counter() - _T0:.1f} s wall",
          file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def run(model_path, shim, native: bool) -> dict:
    """Build the engine, warm up, run both phases; returns {phase: {"steps": n, "wall_s": s}}."""
    import torch
    import sglite.runtime.engine as engine_mod  # noqa: F401  (imports the kernels before masking)
    _mark("imports")

    if os.environ.get("SGLITE_REGRESS_NO_MASK") != "1":  # diagnosis only: the native SIMD builds
        mask_simd()
    torch.manual_seed(SEED)
    eng = engine_mod.Engine(model_path=model_path, num_threads=1, log_level="warning", dtype=DTYPE,
                            quantization=QUANTIZATION, disable_radix_cache=True, random_seed=SEED)
    _mark("engine ready")
    try:
        vocab = eng.runner.vocab_size
        sp = {"max_new_tokens": DECODE_STEPS + 2, "temperature": 0, "ignore_eos": True}
        eng.generate(input_ids=prompts(vocab)[:2], sampling_params={**sp, "max_new_tokens": 2})  # warm-up
        _mark("warm-up done")
        sched = eng.scheduler
        result: dict = {}

        def workload():
            batch = eng.requests.build(None, sp, prompts(vocab), None, lambda i: (lambda ev: None))
            reqs = list(batch.all_reqs)
            for r in reqs:
                sched.add_request(r)
            gc.collect()
            gc.disable()  # a collection's timing depends on the whole process's history, not on the workload
            shim.cg_start()
            t, steps = time.perf_counter(), 0
            while any(len(r.output_ids) == 0 for r in reqs):
                sched.step()
                steps += 1
            shim.cg_dump(b"prefill")
            result["prefill"] = {"steps": steps, "wall_s": time.perf_counter() - t}
            t = time.perf_counter()
            for _ in range(DECODE_STEPS):
                sched.step()
            shim.cg_dump(b"decode")
            shim.cg_stop()
            gc.enable()
            result["decode"] = {"steps": DECODE_STEPS, "wall_s": time.perf_counter() - t,
                                "batch": sum(r.finished is None for r in reqs)}
            while sched.has_work():  # finish uncounted
                sched.step()

        eng._loop.call(workload)
        _mark("workload done")
        return result
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglite.bench.regress_workload", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="model (default: the default model)")
    ap.add_argument("--native", action="store_true", help="run without callgrind (client requests are no-ops)")
    ap.add_argument("--shim-dir", default=None, help="where the shim .so is cached (default: the sglite cache)")
    ap.add_argument("--result-json", default=None, help="write {phase: {steps, wall_s}} here")
    a = ap.parse_args(argv)
    for k, v in NO_FMA_ENV.items():  # before torch loads (sglite.bench.regress sets them in the child's env too)
        os.environ.setdefault(k, v)
    from sglite.kernels.cpu_build import cache_root

    shim = build_shim(Path(a.shim_dir) if a.shim_dir else cache_root())
    res = run(a.model_path, shim, a.native)
    print(json.dumps(res))
    if a.result_json:
        Path(a.result_json).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
