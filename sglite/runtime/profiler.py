"""Built-in torch.profiler sessions of the engine: a Chrome trace plus per-op and per-phase tables.

The engine's loop thread owns a session (:class:`ProfileSession`): it is started and stopped there
(between steps, through :meth:`sglite.runtime.engine.Engine.start_profile` / ``stop_profile``, the
server's ``/start_profile`` / ``/stop_profile`` routes and ``sglite bench offline|serving
--profile``), because torch's profiler records the thread that started it.

Phases. Every scheduler step runs inside ``sglite::step`` with ``sglite::schedule``,
``sglite::build_batch``, ``sglite::forward``, ``sglite::sample`` and ``sglite::process`` (output:
detokenize, stop checks) ranges (:func:`phase`: a shared no-op context when no session runs, so the
hot path pays one global read). While a session runs, the public ops of :mod:`sglite.kernels` are
wrapped in ``sglite::gemm`` (``linear``), ``sglite::attention`` (``decode_attention``,
``extend_attention``, ``store_kv``), ``sglite::elementwise`` (``rms_norm``, ``add_rms_norm``,
``rope_store_kv``, ``silu_mul``, ``gelu_tanh_mul``) and ``sglite::fused_decode`` (the fused C++ decode, GEMM and attention together)
ranges; the wrappers are removed when the last session stops, so they cost nothing otherwise.

The phase table (:func:`phase_summary`) splits the steps' wall time into GEMM, attention,
elementwise, fused decode, sampling, scheduling, output processing and Python/other (the rest of
the step: the model's Python between kernels, RoPE tables, embedding, loop bookkeeping); its rows
add up to the step total. The output directory is the ``output_dir`` argument, else the
``SGLITE_TORCH_PROFILER_DIR`` environment variable (SGLang: ``SGLANG_TORCH_PROFILER_DIR``), else
``/tmp/sglite_profiles``.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import InvalidRequestError

PROFILER_DIR_ENV = "SGLITE_TORCH_PROFILER_DIR"
DEFAULT_PROFILER_DIR = "/tmp/sglite_profiles"
ACTIVITIES = ("CPU", "GPU")
_NULL = contextlib.nullcontext()
_active = 0  # sessions running in this process (read on the hot path: phase())
_lock = threading.Lock()
_saved: dict = {}  # kernels attributes replaced by probes while a session runs

#: phase table rows: (row, the record_function ranges summed into it)
CATEGORIES = (("GEMM", ("sglite::gemm",)),
              ("attention", ("sglite::attention",)),
              ("elementwise (norm, activation, RoPE)", ("sglite::elementwise",)),
              ("fused decode (C++: GEMM + attention)", ("sglite::fused_decode",)),
              ("sampling", ("sglite::sample",)),
              ("scheduling (plan + batch tensors)", ("sglite::schedule", "sglite::build_batch")),
              ("output (detokenize, stop checks)", ("sglite::process",)))
OTHER = "Python/other"
_PROBES = {"linear": "sglite::gemm", "linear_silu": "sglite::gemm", "decode_attention": "sglite::attention",
           "extend_attention": "sglite::attention", "store_kv": "sglite::attention",
           "rms_norm": "sglite::elementwise", "silu_mul": "sglite::elementwise",
           "gelu_tanh_mul": "sglite::elementwise", "add_rms_norm": "sglite::elementwise",
           "rope_store_kv": "sglite::elementwise"}


def phase(name: str):
    """``record_function("sglite::<name>")`` while a session runs, else a shared no-op context."""
    return torch.profiler.record_function("sglite::" + name) if _active else _NULL


def profiler_dir(output_dir: Optional[str] = None) -> str:
    """``output_dir``, else ``$SGLITE_TORCH_PROFILER_DIR``, else ``/tmp/sglite_profiles``."""
    return output_dir or os.environ.get(PROFILER_DIR_ENV) or DEFAULT_PROFILER_DIR


def _probe(fn, name: str):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    wrapped.__wrapped__ = fn
    return wrapped


def _install_probes() -> None:
    from sglite import kernels
    from sglite.kernels.decode_fused import FusedDecode

    for attr, name in _PROBES.items():
        _saved[(kernels, attr)] = getattr(kernels, attr)
        setattr(kernels, attr, _probe(getattr(kernels, attr), name))
    _saved[(FusedDecode, "forward")] = FusedDecode.forward
    FusedDecode.forward = _probe(FusedDecode.forward, "sglite::fused_decode")


def _remove_probes() -> None:
    for (owner, attr), fn in _saved.items():
        setattr(owner, attr, fn)
    _saved.clear()


@dataclass
class ProfileResult:
    """What a stopped session wrote: ``trace`` (Chrome trace JSON), ``summary`` (text tables),
    ``summary_json`` (the phase table as JSON), the steps profiled and the phase rows
    ``{row: {"us": total µs, "us_per_step": µs, "percent": % of step time}}``."""

    trace: str
    summary: str
    summary_json: str
    steps: int
    phases: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"trace": self.trace, "summary": self.summary, "summary_json": self.summary_json,
                "steps": self.steps, "phases": self.phases}


def phase_summary(events, steps: int) -> dict:
    """The phase table of a profile's ``events`` (``torch.autograd.profiler_util.FunctionEvent``s;
    microseconds). ``Python/other`` is the step total (``sglite::step`` ranges) minus every other
    row, floored at 0. Rows: ``{"us", "us_per_step", "percent"}``."""
    totals: dict = {}
    for ev in events:
        if ev.name.startswith("sglite::"):
            totals[ev.name] = totals.get(ev.name, 0.0) + float(ev.cpu_time_total)
    step_us = totals.get("sglite::step", 0.0)
    rows = {row: sum(totals.get(n, 0.0) for n in names) for row, names in CATEGORIES}
    rows[OTHER] = max(step_us - sum(rows.values()), 0.0)
    per = max(steps, 1)
    out = {row: {"us": round(us, 1), "us_per_step": round(us / per, 1),
                 "percent": round(100.0 * us / step_us, 1) if step_us else 0.0} for row, us in rows.items()}
    out["step total"] = {"us": round(step_us, 1), "us_per_step": round(step_us / per, 1),
                         "percent": 100.0 if step_us else 0.0}
    return out


def format_phases(phases: dict, steps: int) -> str:
    """The phase table as aligned text."""
    lines = [f"per-phase time over {steps} steps (record_function ranges, CPU wall time)",
             f"{'phase':40s} {'total ms':>10s} {'us/step':>10s} {'% of step':>10s}"]
    for row, v in phases.items():
        lines.append(f"{row:40s} {v['us'] / 1000:10.2f} {v['us_per_step']:10.1f} {v['percent']:10.1f}")
    return "\n".join(lines)


class ProfileSession:
    """One torch.profiler run on the engine thread.

    Args:
        output_dir: where the files go (see :func:`profiler_dir`); created if missing.
        num_steps: stop by itself after this many steps (None: at :meth:`stop`); must be >= 1.
        activities: a non-empty subset of ``("CPU", "GPU")``, GPU only where CUDA is available
            (default: CPU, plus GPU when CUDA is available).
        record_shapes, with_stack: torch.profiler options (shapes per op; Python stacks).
        prefix: file name prefix.
    Raises:
        InvalidRequestError: bad ``num_steps`` or ``activities`` (naming the field).
    """

    def __init__(self, output_dir: Optional[str] = None, num_steps: Optional[int] = None,
                 activities=None, record_shapes: bool = False, with_stack: bool = False, prefix: str = "sglite"):
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
            raise InvalidRequestError(f"num_steps: must be an integer >= 1, got {num_steps!r}", field="num_steps")
        here = ["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"]
        acts = list(activities) if activities is not None else here
        if not acts:
            raise InvalidRequestError(f"activities: must name at least one of {here} (or be left out)",
                                      field="activities")
        bad = [x for x in acts if x not in ACTIVITIES]
        if bad:
            raise InvalidRequestError(f"activities: choose from {list(ACTIVITIES)}, got {bad}", field="activities")
        absent = [x for x in acts if x not in here]
        if absent:
            raise InvalidRequestError(f"activities: {', '.join(absent)} is not available on this machine; "
                                      f"available: {', '.join(here)}", field="activities")
        self.output_dir = profiler_dir(output_dir)
        self.num_steps = num_steps
        self.steps = 0
        self.name = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        self._prof = torch.profiler.profile(activities=[kinds[x] for x in acts], record_shapes=record_shapes,
                                            with_stack=with_stack)

    def start(self) -> None:
        """Start recording (call on the engine thread).

        Raises:
            InvalidRequestError: ``output_dir`` cannot be created (field ``output_dir``).
        """
        global _active
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as exc:
            raise InvalidRequestError(f"output_dir: cannot create {self.output_dir!r}: {exc}",
                                      field="output_dir") from exc
        with _lock:
            if _active == 0:
                _install_probes()
            _active += 1
        self._prof.__enter__()

    def step_done(self) -> bool:
        """Count a step; True when ``num_steps`` are done (the caller then calls :meth:`stop`)."""
        self.steps += 1
        return self.num_steps is not None and self.steps >= self.num_steps

    def stop(self) -> ProfileResult:
        """Stop recording and write ``<name>.trace.json`` (Chrome trace), ``<name>.summary.txt``
        (phase table, then torch's per-op table by self CPU time) and ``<name>.summary.json``."""
        global _active
        try:
            self._prof.__exit__(None, None, None)
        finally:
            with _lock:
                _active -= 1
                if _active == 0:
                    _remove_probes()
        base = os.path.join(self.output_dir, self.name)
        trace, summary, sjson = base + ".trace.json", base + ".summary.txt", base + ".summary.json"
        self._prof.export_chrome_trace(trace)
        phases = phase_summary(self._prof.events(), self.steps)
        ops = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        with open(summary, "w") as f:
            f.write(format_phases(phases, self.steps) + "\n\nper-op (self CPU time)\n" + ops + "\n")
        with open(sjson, "w") as f:
            json.dump({"steps": self.steps, "phases": phases}, f, indent=1)
        return ProfileResult(trace, summary, sjson, self.steps, phases)
