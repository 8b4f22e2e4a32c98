"""Goodput per device of colocated vs prefill/decode-disaggregated placement (an estimate).

DistServe (Zhong et al., OSDI 2024), §3: goodput is the highest request rate at which the
latency SLOs (TTFT for the prefill phase, TPOT for decode) hold; a placement is judged by goodput
per device. The analysis there models a prefill instance as an M/D/1 queue (Poisson arrivals,
deterministic prefill time ``D``): average TTFT ``= D + R·D² / (2(1 − R·D))`` (§3.1, eq. 1), and a
decode instance as batches whose step time grows with the batch (§3.2). We use the same models,
fed with measured step times:

* ``prefill_s``: time to prefill one prompt of the workload's length on one device;
* ``decode_step_s(B)``: one decode step of a batch of ``B`` (linear in ``B``, fitted from two
  measurements);
* ``output_len``: tokens per request.

Disaggregated (``x`` prefill + ``y`` decode devices): the prefill devices each take rate ``R/x``
(M/D/1 TTFT); the decode devices hold ``B = (R/y)·output_len·t(B)`` requests each (Little's law),
TPOT ``= t(B)``. Colocated (``n`` devices): each device alternates prefills and decode steps; its
decode steps are stretched by the prefill share (TPOT ``= t(B) / (1 − ρ_p)``, ``ρ_p = R·D/n``), prefills go first
(SGLang's and DistServe's colocated baseline), so TTFT is the M/D/1 time of the prefills alone, and
decode keeps up while the batch's fixed point exists (its steps fill the time prefills leave). These are estimates (means, not percentiles); ``docs/scaling.md`` gives the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimes:
    """Measured times (seconds). ``decode_a + decode_b·B`` is one decode step at batch ``B``;
    ``transfer_s``: moving one prompt's KV from a prefill to a decode device (disaggregated
    placements only: added to their TTFT; the link is assumed not to queue)."""

    prefill_s: float
    decode_a: float
    decode_b: float
    output_len: int
    transfer_s: float = 0.0

    @classmethod
    def fit(cls, prefill_s: float, batch_times: dict, output_len: int, transfer_s: float = 0.0) -> "StepTimes":
        """From ``{batch: step seconds}`` (two or more batches): least-squares line."""
        xs, ys = list(batch_times), list(batch_times.values())
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
        return cls(prefill_s, max(0.0, my - b * mx), max(0.0, b), output_len, transfer_s)

    def step(self, batch: float) -> float:
        """Seconds of one decode step with ``batch`` requests decoding (the fitted line a + b·batch)."""
        return self.decode_a + self.decode_b * batch


def mdl_ttft(rate: float, service_s: float, busy: float | None = None) -> float:
    """Mean time in an M/D/1 queue (wait + service), seconds; ``busy`` = utilisation (default
    ``rate·service_s``). Infinite at or above utilisation 1."""
    rho = rate * service_s if busy is None else busy
    if rho >= 1:
        return float("inf")
    return service_s + rate * service_s ** 2 / (2 * (1 - rho))


def decode_batch(rate: float, st: StepTimes) -> float:
    """Requests decoding at once on one device fed ``rate`` req/s: the fixed point of
    ``B = rate·output_len·t(B)`` (inf when the device cannot keep up)."""
    k = rate * st.output_len
    if k * st.decode_b >= 1:
        return float("inf")
    return k * st.decode_a / (1 - k * st.decode_b)


def meets_disaggregated(rate: float, st: StepTimes, x: int, y: int, ttft_slo: float, tpot_slo: float) -> bool:
    """Whether ``x`` prefill devices and ``y`` decode devices meet both SLOs at ``rate`` req/s
    (DistServe, Zhong et al. 2024, §3.1-3.2: prefill instances as M/D/1 queues of ``rate/x``, TTFT =
    their mean time plus the KV transfer; decode at the fixed-point batch of ``rate/y``). SLOs in
    seconds."""
    b = decode_batch(rate / y, st)
    ttft = mdl_ttft(rate / x, st.prefill_s) + st.transfer_s
    return ttft <= ttft_slo and b != float("inf") and st.step(max(b, 1)) <= tpot_slo


def meets_colocated(rate: float, st: StepTimes, n: int, ttft_slo: float, tpot_slo: float) -> bool:
    """Whether ``n`` colocated devices (``rate/n`` req/s each, prefill and decode sharing a device)
    meet both SLOs (seconds): prefills take ``rho_p = rate/n · prefill_s`` of the time, decode steps
    run in the rest, so TPOT is stretched by ``1/(1 - rho_p)`` (the prefill-decode interference of
    the module docstring)."""
    r = rate / n
    rho_p = r * st.prefill_s
    if rho_p >= 1:
        return False
    # decode steps only run in the time prefills leave: B grows by the same stretch
    k = r * st.output_len / (1 - rho_p)
    if k * st.decode_b >= 1:
        return False
    b = max(1.0, k * st.decode_a / (1 - k * st.decode_b))
    tpot = st.step(b) / (1 - rho_p)
    return tpot <= tpot_slo and mdl_ttft(r, st.prefill_s) <= ttft_slo


def max_rate(ok, hi: float = 1e4) -> float:
    """The largest rate (req/s) with ``ok(rate)`` true, by bisection (0 when none)."""
    lo = 0.0
    if not ok(1e-9):
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def goodput_per_device(st: StepTimes, ttft_slo: float, tpot_slo: float, max_devices: int = 8) -> dict:
    """``{"colocated": (rate per device, n), "disaggregated": (rate per device, x, y)}``: the best
    per-device goodput over placements of up to ``max_devices`` devices."""
    colo = max(((max_rate(lambda r, n=n: meets_colocated(r, st, n, ttft_slo, tpot_slo)) / n, n)
                for n in range(1, max_devices + 1)), key=lambda t: t[0])
    dis = max(((max_rate(lambda r, x=x, y=y: meets_disaggregated(r, st, x, y, ttft_slo, tpot_slo)) / (x + y), x, y)
               for x in range(1, max_devices) for y in range(1, max_devices + 1 - x)), key=lambda t: t[0])
    return {"colocated": colo, "disaggregated": dis}
