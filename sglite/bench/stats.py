"""Latency and throughput statistics shared by every sglite benchmark (serving, sweep, offline).

Definitions (the ones vLLM's and SGLang's ``bench_serving`` use, times in seconds unless a key
ends in ``_ms``):

* **TTFT** – time from sending a request to receiving its first output token.
* **ITL** – every gap between two successive streamed chunks that carried new tokens (a chunk
  with several tokens, e.g. after a jump-forward, is one gap).
* **TPOT** – per request, ``(e2e - ttft) / (output_tokens - 1)``; undefined (NaN) for requests
  with fewer than two output tokens.
* **E2E** – time from sending a request to its last chunk.
* **Goodput** (DistServe, Zhong et al., OSDI'24, §2): a request is *good* when it meets every
  SLO given (TTFT ≤ ``slo_ttft_ms``, TPOT ≤ ``slo_tpot_ms``). For one run, ``goodput`` is the
  number of good requests per second of benchmark duration (vLLM's per-run form) and
  ``slo_attainment`` the fraction of good requests. Across a sweep of request rates,
  :func:`max_rate_meeting_attainment` gives DistServe's goodput proper: the highest request
  rate whose SLO attainment is at least the target (90 % by default).

Percentiles interpolate linearly between closest ranks (numpy's default ``linear`` method).
No torch, no numpy: pure Python so it is cheap to import and to test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

NAN = float("nan")
PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 ≤ q ≤ 100) of ``values``, linear interpolation between ranks.

    Rank ``r = q/100 · (n-1)`` of the sorted values; the result is ``v[floor r] + (r - floor r) ·
    (v[floor r + 1] - v[floor r])``. NaNs are ignored; an empty input gives NaN.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q: percentile must be in [0, 100], got {q}")
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return NAN
    rank = q / 100 * (len(vals) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (rank - lo) * (vals[hi] - vals[lo])


def summarize(values: Iterable[float], scale: float = 1.0) -> dict:
    """``{"mean", "median", "std", "p50", "p95", "p99", "min", "max", "count"}`` of ``values`` times
    ``scale`` (the unit of the result is the unit of ``values`` times ``scale``).

    ``median`` equals ``p50``; ``std`` is the population standard deviation (numpy's default,
    as SGLang's ``bench_serving`` reports it). NaNs are dropped first; with nothing left every
    statistic is NaN and ``count`` is 0.
    """
    vals = [v * scale for v in values if not math.isnan(v)]
    mean = sum(vals) / len(vals) if vals else NAN
    out = {"mean": mean, "median": percentile(vals, 50),
           "std": math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if vals else NAN}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(vals, q)
    out["min"] = min(vals) if vals else NAN
    out["max"] = max(vals) if vals else NAN
    out["count"] = len(vals)
    return out


@dataclass
class RequestOutcome:
    """What the client saw of one request.

    Attributes:
        success: the request finished without an error.
        prompt_tokens / output_tokens / cached_tokens: token counts reported by the server
            (``cached_tokens``: prompt tokens served from the prefix cache; 0 when unknown).
        start: send time in seconds since the benchmark started.
        ttft / e2e: seconds (NaN when the request failed before its first token).
        itl: seconds between successive token-carrying chunks (length = chunks - 1).
        error: the error message when ``success`` is False.
        output_text: the generated text (set by the HTTP clients; compared across sweep configs).
    """

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    start: float = 0.0
    ttft: float = NAN
    e2e: float = NAN
    itl: list = field(default_factory=list)
    error: str = ""
    output_text: str = ""

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (s); NaN with fewer than 2 output tokens."""
        if not self.success or self.output_tokens < 2 or math.isnan(self.ttft):
            return NAN
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def meets_slo(self, slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> bool:
        """True when successful and within every SLO given (a request without TPOT meets the TPOT SLO)."""
        if not self.success:
            return False
        if slo_ttft_ms is not None and not self.ttft <= slo_ttft_ms / 1000:
            return False
        tpot = self.tpot
        return slo_tpot_ms is None or math.isnan(tpot) or tpot <= slo_tpot_ms / 1000


def outcome_from_timeline(start: float, chunk_times: Sequence[float], prompt_tokens: int, output_tokens: int,
                          cached_tokens: int = 0, end: Optional[float] = None) -> RequestOutcome:
    """Build a successful :class:`RequestOutcome` from absolute times (seconds, one clock).

    Args:
        start: when the request was sent.
        chunk_times: arrival time of every chunk that carried new output tokens, ascending.
        end: when the response completed (default: the last chunk).
    Raises:
        ValueError: ``chunk_times`` not ascending or earlier than ``start``.
    """
    times = list(chunk_times)
    if any(b < a for a, b in zip(times, times[1:])) or (times and times[0] < start):
        raise ValueError("chunk_times: must be ascending and not earlier than start")
    last = end if end is not None else (times[-1] if times else start)
    return RequestOutcome(success=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                          cached_tokens=cached_tokens, start=start,
                          ttft=(times[0] - start) if times else NAN, e2e=last - start,
                          itl=[b - a for a, b in zip(times, times[1:])])


def compute_metrics(outcomes: Sequence[RequestOutcome], duration_s: float, slo_ttft_ms: Optional[float] = None,
                    slo_tpot_ms: Optional[float] = None) -> dict:
    """Aggregate metrics of one benchmark run.

    Returns a dict with ``completed``, ``failed``, ``duration_s``; throughputs per second of
    ``duration_s``: ``request_throughput``, ``input_throughput``, ``output_throughput``,
    ``total_token_throughput`` (tokens of successful requests); ``goodput`` (good requests/s)
    and ``slo_attainment`` (good / all requests); ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``
    as :func:`summarize` dicts in milliseconds; ``cache_hit_rate_client`` (Σ cached / Σ prompt
    tokens as the responses reported them); ``concurrency`` (Σ E2E / ``duration_s``: the mean
    number of requests in flight). :func:`flat_metrics` gives SGLang's flat keys.

    Raises:
        ValueError: ``duration_s`` not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    ok = [o for o in outcomes if o.success]
    good = [o for o in outcomes if o.meets_slo(slo_ttft_ms, slo_tpot_ms)]
    n_in = sum(o.prompt_tokens for o in ok)
    n_out = sum(o.output_tokens for o in ok)
    return {
        "completed": len(ok), "failed": len(outcomes) - len(ok), "duration_s": duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": n_in / duration_s, "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "goodput": len(good) / duration_s,
        "slo_attainment": len(good) / len(outcomes) if outcomes else NAN,
        "ttft_ms": summarize((o.ttft for o in ok), 1000.0),
        "tpot_ms": summarize((o.tpot for o in ok), 1000.0),
        "itl_ms": summarize((g for o in ok for g in o.itl), 1000.0),
        "e2e_ms": summarize((o.e2e for o in ok), 1000.0),
        "cache_hit_rate_client": sum(o.cached_tokens for o in ok) / n_in if n_in else NAN,
        "concurrency": sum(o.e2e for o in ok if not math.isnan(o.e2e)) / duration_s,
    }


# (nested key of compute_metrics, name in SGLang's flat keys)
FLAT_LATENCIES = (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl"), ("e2e_ms", "e2e_latency"))
FLAT_STATS = ("mean", "median", "std", "p95", "p99", "max")


def flat_metrics(metrics: dict) -> dict:
    """SGLang ``bench_serving``'s flat result keys from a :func:`compute_metrics` dict.

    Returns ``completed``, ``failed``, ``duration`` (s), ``total_input_tokens``,
    ``total_output_tokens``, ``request_throughput`` (req/s), ``input_throughput``,
    ``output_throughput``, ``total_throughput`` (tok/s), ``concurrency`` (mean requests in
    flight: Σ E2E / duration), ``goodput`` (req/s), ``slo_attainment``, and for each of
    ``ttft``, ``tpot``, ``itl``, ``e2e_latency`` the keys ``{mean,median,std,p95,p99,max}_<name>_ms``
    (milliseconds), e.g. ``median_ttft_ms``, ``p99_e2e_latency_ms``. Any other scalar entry of
    ``metrics`` (e.g. ``cache_hit_rate``, ``request_rate``) is passed through unchanged.
    """
    out = {"completed": metrics["completed"], "failed": metrics["failed"], "duration": metrics["duration_s"],
           "total_input_tokens": metrics["total_input_tokens"], "total_output_tokens": metrics["total_output_tokens"],
           "request_throughput": metrics["request_throughput"], "input_throughput": metrics["input_throughput"],
           "output_throughput": metrics["output_throughput"],
           "total_throughput": metrics["total_token_throughput"]}
    for key, name in FLAT_LATENCIES:
        s = metrics.get(key) or {}
        for stat in FLAT_STATS:
            out[f"{stat}_{name}_ms"] = s.get(stat, NAN)
    for k, v in metrics.items():
        if k not in out and k != "duration_s" and k != "total_token_throughput" and not isinstance(v, (dict, list)):
            out[k] = v
    return out


def max_rate_meeting_attainment(points: Iterable[tuple[float, float]], target: float = 0.9) -> Optional[float]:
    """DistServe goodput: the highest request rate whose SLO attainment is ≥ ``target``.

    Args:
        points: ``(request_rate, slo_attainment)`` pairs from a sweep (rates in requests/s;
            ``inf`` allowed).
        target: attainment goal in [0, 1].
    Returns:
        The rate, or None when no rate meets the goal.
    Raises:
        ValueError: ``target`` outside [0, 1].
    """
    if not 0 <= target <= 1:
        raise ValueError(f"target: must be in [0, 1], got {target}")
    rates = [r for r, a in points if not math.isnan(a) and a >= target]
    return max(rates) if rates else None
