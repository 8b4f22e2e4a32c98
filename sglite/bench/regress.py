"""``sglite bench regress``: the CI regression gate. Counts the instructions of a fixed workload under
callgrind and fails when a phase costs more than the baseline stored in the repository.

    sglite bench regress                     # measure, compare with benchmarks/regression_baseline.json
    sglite bench regress --update            # measure and write the baseline (then commit it, saying why)
    sglite bench regress --runs 3            # repeatability: the spread of 3 counts

Method (seed section 8.1, "measure against a fixed baseline, block any regression"): wall time on
these shared machines drifts by 2x, an instruction count does not. The workload
(:mod:`.regress_workload`: a 256-token prefill of 8 requests, then 4 decode steps at batch 8, the
default model dequantized to float32, greedy, one torch thread) runs under ``valgrind --tool=callgrind --instr-atstart=no``
with instrumentation switched on only around each phase, so importing torch and loading the model
cost no counted instructions (and run far faster). Each phase's ``Ir`` (instructions executed, all
threads) is compared with the baseline: a rise of more than ``threshold_pct`` fails and names the
phase, both counts and the change; a fall of as much is reported (re-record the baseline to lock it
in).

Counts are comparable between machines with the same torch, compiler and valgrind versions (the
AVX2-level builds are counted, see :mod:`.regress_workload`); the baseline records them and a
mismatch is printed as a warning next to the verdict. ``perf stat -e instructions`` was not used:
virtual machines like ours expose no hardware counters (``<not supported>``).

Exit status: 0 pass, 1 a phase regressed, 2 the gate could not run (no valgrind, no baseline, the
workload failed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .report import HelpFormatter

PHASES = ("prefill", "decode")
DEFAULT_BASELINE = Path(__file__).resolve().parents[2] / "benchmarks" / "regression_baseline.json"
DEFAULT_THRESHOLD_PCT = 1.0
WORKLOAD_MODULE = "sglite.bench.regress_workload"


@dataclass(frozen=True)
class Verdict:
    """One phase's comparison: ``change_pct`` = 100 * (measured - baseline) / baseline."""

    phase: str
    baseline: int
    measured: int
    change_pct: float
    threshold_pct: float

    @property
    def regressed(self) -> bool:
        return self.change_pct > self.threshold_pct

    @property
    def improved(self) -> bool:
        return self.change_pct < -self.threshold_pct

    def line(self) -> str:
        state = "REGRESSION" if self.regressed else "improved" if self.improved else "ok"
        return (f"{self.phase:8s} baseline {self.baseline:>15,d} Ir   measured {self.measured:>15,d} Ir   "
                f"{self.change_pct:+7.2f} % (threshold +{self.threshold_pct:g} %)   {state}")


def compare(baseline: Mapping[str, int], measured: Mapping[str, int], threshold_pct: float) -> list[Verdict]:
    """Compare instruction counts phase by phase (the baseline's phases, in :data:`PHASES` order first).

    Raises:
        ValueError: ``threshold_pct`` < 0, a baseline count <= 0, or a baseline phase missing from
            ``measured`` (names the phase).
    """
    if threshold_pct < 0:
        raise ValueError(f"threshold_pct: must be >= 0, got {threshold_pct}")
    order = [p for p in PHASES if p in baseline] + [p for p in baseline if p not in PHASES]
    out = []
    for phase in order:
        base = int(baseline[phase])
        if base <= 0:
            raise ValueError(f"baseline count of phase {phase!r}: must be > 0, got {base}")
        if phase not in measured:
            raise ValueError(f"phase {phase!r}: in the baseline but not measured (measured: {sorted(measured)})")
        got = int(measured[phase])
        out.append(Verdict(phase, base, got, 100.0 * (got - base) / base, threshold_pct))
    return out


def spread_pct(counts: Sequence[int]) -> float:
    """(max - min) / min of repeated counts, in percent (0 for one count).

    Raises:
        ValueError: no counts, or a count <= 0.
    """
    if not counts or min(counts) <= 0:
        raise ValueError(f"counts: need at least one count > 0, got {list(counts)}")
    return 100.0 * (max(counts) - min(counts)) / min(counts)


_TRIGGER = re.compile(r"^desc: Trigger: Client Request: (\S+)")
_TOTAL = re.compile(r"^(?:totals|summary): (\d+)")


def parse_dump(text: str) -> tuple[Optional[str], Optional[int]]:
    """(phase named by ``CALLGRIND_DUMP_STATS_AT``, total Ir) of one callgrind dump; None where absent."""
    phase = total = None
    for line in text.splitlines():
        m = _TRIGGER.match(line)
        if m:
            phase = m.group(1)
        m = _TOTAL.match(line)
        if m and total is None:
            total = int(m.group(1))
    return phase, total


def read_dumps(folder: Path) -> dict[str, int]:
    """{phase: Ir} from every ``cg.out*`` dump in ``folder`` written at a named client request."""
    out: dict[str, int] = {}
    for f in sorted(folder.glob("cg.out*")):
        phase, total = parse_dump(f.read_text(errors="replace"))
        if phase is not None and total is not None:
            out[phase] = total
    return out


def _version(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unavailable"


def machine() -> dict:
    """What the counts depend on: CPU model and flags, torch, compiler, valgrind, Python."""
    import torch

    from sglite.kernels.device import cpu_flags

    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": " ".join(sorted(cpu_flags())), "torch": torch.__version__,
            "compiler": _version([os.environ.get("CXX", "c++"), "--version"]),
            "valgrind": _version(["valgrind", "--version"]), "python": platform.python_version()}


def workload_command(out_file: Path, model_path: Optional[str]) -> list[str]:
    """The argv that runs the fixed workload under callgrind, counting from its start-instrumentation
    marker, writing the profile to ``out_file``."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
           sys.executable, "-m", WORKLOAD_MODULE]
    return cmd + (["--model-path", model_path] if model_path else [])


def measure_once(model_path: Optional[str], timeout_s: float) -> tuple[dict[str, int], float]:
    """One callgrind run of the workload: ({phase: Ir}, wall seconds).

    Raises:
        RuntimeError: valgrind missing, the run failed or timed out, or a phase was not dumped.
    """
    if shutil.which("valgrind") is None:
        raise RuntimeError("valgrind not found (Debian: apt-get install -y valgrind)")
    from .regress_workload import NO_FMA_ENV

    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **NO_FMA_ENV}
    with tempfile.TemporaryDirectory(prefix="sglite-regress-") as d:
        cmd = workload_command(Path(d) / "cg.out", model_path)
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the workload ran past --timeout-s {timeout_s:g} s: {shlex.join(cmd)}") from None
        wall = time.perf_counter() - t
        if r.returncode != 0:
            raise RuntimeError(f"the workload failed (exit {r.returncode}): {shlex.join(cmd)}\n{r.stderr[-3000:]}")
        counts = read_dumps(Path(d))
    missing = [p for p in PHASES if p not in counts]
    if missing:
        raise RuntimeError(f"phases {missing} were not dumped (got {sorted(counts)}); is the shim built?")
    return counts, wall


def load_baseline(path: Path) -> dict:
    """The stored baseline. Raises RuntimeError when the file is missing or has no ``counts``."""
    if not path.exists():
        raise RuntimeError(f"no baseline at {path}: record one with `sglite bench regress --update`")
    data = json.loads(path.read_text())
    if not isinstance(data.get("counts"), dict):
        raise RuntimeError(f"{path}: no 'counts' object")
    return data


def environment_mismatch(recorded: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """Keys whose values differ between the baseline's machine and this one (``cpu_model`` and
    ``cpu_flags`` excluded: the counted builds are the same AVX2-level code on every x86-64-v3 CPU)."""
    return [k for k in ("torch", "compiler", "valgrind", "python") if recorded.get(k) != now.get(k)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench regress", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--baseline", default=None,
                   help="baseline JSON (default: benchmarks/regression_baseline.json of this checkout)")
    p.add_argument("--update", action="store_true", help="write the measured counts as the new baseline")
    p.add_argument("--reason", default="", help="why the baseline changes, stored with --update")
    p.add_argument("--runs", type=int, default=1, help="callgrind runs; the median count per phase is used")
    p.add_argument("--threshold-pct", type=float, default=None,
                   help="allowed rise per phase in percent (default: the baseline's, else 1.0)")
    p.add_argument("--model-path", default=None, help="model (default: the cached default model)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="seconds one callgrind run may take")
    p.add_argument("--output-json", default=None, help="write the counts and verdicts here (default: none)")
    return p


def _median(xs: Sequence[int]) -> int:
    s = sorted(xs)
    return s[len(s) // 2]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglite bench regress``."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.runs < 1:
        parser.error(f"--runs: must be >= 1, got {a.runs}")
    if a.threshold_pct is not None and a.threshold_pct < 0:
        parser.error(f"--threshold-pct: must be >= 0, got {a.threshold_pct}")
    path = Path(a.baseline) if a.baseline else DEFAULT_BASELINE
    try:
        base = None if a.update else load_baseline(path)
        runs = []
        for i in range(a.runs):
            counts, wall = measure_once(a.model_path, a.timeout_s)
            runs.append({"counts": counts, "wall_s": round(wall, 1)})
            print(f"[regress] run {i + 1}/{a.runs}: " + ", ".join(f"{p} {c:,d} Ir" for p, c in counts.items())
                  + f" ({wall:.0f} s under callgrind)", flush=True)
    except RuntimeError as exc:
        print(f"[regress] error: {exc}", file=sys.stderr)
        return 2
    measured = {p: _median([r["counts"][p] for r in runs]) for p in PHASES}
    spreads = {p: spread_pct([r["counts"][p] for r in runs]) for p in PHASES}
    if a.runs > 1:
        print("[regress] spread over runs: " + ", ".join(f"{p} {s:.4f} %" for p, s in spreads.items()))
    now = machine()
    if a.update:
        old = json.loads(path.read_text()) if path.exists() else {}
        threshold = a.threshold_pct if a.threshold_pct is not None else old.get("threshold_pct", DEFAULT_THRESHOLD_PCT)
        data = {"counts": measured, "threshold_pct": threshold, "reason": a.reason,
                "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": "sglite bench regress --update" + (f" --runs {a.runs}" if a.runs > 1 else ""),
                "workload": _workload_summary(), "machine": now, "runs": runs, "spread_pct": spreads}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"[regress] baseline written to {path}; commit it with a message that says why")
        return 0
    threshold = a.threshold_pct if a.threshold_pct is not None else float(base.get("threshold_pct",
                                                                                   DEFAULT_THRESHOLD_PCT))
    verdicts = compare(base["counts"], measured, threshold)
    for v in verdicts:
        print("[regress] " + v.line())
    drift = environment_mismatch(base.get("machine", {}), now)
    if drift:
        print("[regress] warning: counts may not be comparable, the baseline was recorded with other "
              + ", ".join(f"{k} ({base.get('machine', {}).get(k)!r} -> {now[k]!r})" for k in drift))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps({"measured": measured, "runs": runs, "machine": now,
                                                   "verdicts": [v.__dict__ for v in verdicts]}, indent=2) + "\n")
    bad = [v for v in verdicts if v.regressed]
    if bad:
        print("[regress] FAILED: " + "; ".join(f"{v.phase} +{v.change_pct:.2f} % ({v.baseline:,d} -> {v.measured:,d} Ir)"
                                               for v in bad) + f" exceeds +{threshold:g} %", file=sys.stderr)
        return 1
    if any(v.improved for v in verdicts):
        print("[regress] faster than the baseline: lock it in with `sglite bench regress --update --reason ...`")
    print("[regress] passed")
    return 0


def _workload_summary() -> dict:
    from . import regress_workload as w

    return {"module": WORKLOAD_MODULE, "dtype": w.DTYPE, "quantization": w.QUANTIZATION, "batch": w.BATCH, "prompt_len": w.PROMPT_LEN,
            "decode_steps": w.DECODE_STEPS, "seed": w.SEED, "threads": 1}


if __name__ == "__main__":
    sys.exit(main())
