"""``sglite bench serving``: load-test a running server (or one it launches) and time every token.

    sglite bench serving --base-url http://127.0.0.1:30000 --dataset shared-prefix \\
        --num-prompts 64 --request-rate 2 --slo-ttft-ms 2000 --slo-tpot-ms 200 \\
        --output-json out.json --plot out.png
    sglite bench serving --launch --server-args "--dtype bfloat16 --disable-radix-cache" ...

Sessions (see :mod:`sglite.bench.workloads`) arrive as a Poisson process at ``--request-rate``
(``inf``: all at once, the default), at most ``--max-concurrency`` requests in flight; every
response is streamed (:mod:`sglite.bench.client`) to time TTFT, each inter-token gap, TPOT and
E2E. The server's prefix-cache hit rate is the change of its ``cached_tokens`` / ``prompt_tokens``
counters (``/get_server_info``) over the run. The ``agent`` dataset runs a ReAct ``@function``
through the frontend's ``run_batch`` against the server; its per-call TTFT/E2E are the server's.
``--dataset sharegpt --dataset-path FILE`` (``--dataset-name`` is an alias of ``--dataset``)
replays a ShareGPT-format JSON file as SGLang does (:func:`sglite.bench.workloads.sharegpt_workload`).

The printed table and the ``--output-json`` keys follow SGLang's ``bench_serving``
(``mean_ttft_ms``, ``median_e2e_latency_ms``, ``request_throughput`` …; times in ms, throughputs
per second); the nested ``metrics`` dict is kept alongside.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import httpx

from . import client as http_client
from ..server.launcher import MODES, LaunchedServer
from .profiling import add_profile_args, server_profile
from .report import HelpFormatter, at_least, format_serving, positive_rate, write_json
from .stats import NAN, RequestOutcome, compute_metrics, flat_metrics
from .workloads import (DATASETS, SHAREGPT_CONTEXT_LEN, SHAREGPT_MIN_LEN, Session, WorkloadOptions, agent_arguments,
                        agent_program, build_workload, load_sharegpt, sharegpt_workload, with_adapters)


@dataclass(frozen=True)
class RunOptions:
    """How requests are sent: ``request_rate`` (sessions/s, ``inf`` = all at once),
    ``max_concurrency`` (None = unbounded), ``seed`` of the arrival process, SLOs in ms,
    ``warmup_requests`` sent (untimed) before the run, ``flush_cache`` before the run."""

    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    seed: int = 0
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    warmup_requests: int = 1
    flush_cache: bool = True
    disable_tqdm: bool = False

    def __post_init__(self):
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")


@dataclass
class ServingResult:
    """One run: per-request ``outcomes``, aggregated ``metrics``, the server's info after the run."""

    label: str
    outcomes: list
    metrics: dict
    server_info: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def to_json(self, details: bool = False) -> dict:
        """The ``--output-json`` payload: SGLang's flat keys (:func:`stats.flat_metrics`: ``completed``,
        ``duration``, ``request_throughput``, ``mean_ttft_ms``, ``median_e2e_latency_ms`` …) plus
        ``backend``, ``dataset_name``, ``max_concurrency``, then ``label``, ``config``, the nested
        ``metrics`` and the server's scalar info; with ``details`` every request under ``requests``."""
        out = {**flat_metrics(self.metrics), "backend": self.config.get("backend"),
               "dataset_name": self.config.get("dataset"), "max_concurrency": self.config.get("max_concurrency"),
               "label": self.label, "config": self.config, "metrics": self.metrics,
               "server_info": {k: v for k, v in self.server_info.items() if not isinstance(v, (dict, list))}}
        if details:
            out["requests"] = [asdict(o) | {"tpot": o.tpot} for o in self.outcomes]
        return out


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send offsets (s) of ``n`` sessions: a Poisson process of ``rate``/s (first at 0), all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _drive(cfg: http_client.ClientConfig, sessions: Sequence[Session], opts: RunOptions, bar):
    offsets = arrival_times(len(sessions), opts.request_rate, random.Random(opts.seed))
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as http:
        t0 = time.perf_counter()

        async def one(prompt, turn):
            if sem is None:
                return await http_client.send(http, cfg, prompt, turn.output_len, turn.extra, turn.ignore_eos, t0)
            async with sem:
                return await http_client.send(http, cfg, prompt, turn.output_len, turn.extra, turn.ignore_eos, t0)

        async def session(i: int, s: Session) -> list:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            history, outs = "", []
            for k, turn in enumerate(s.turns):
                prompt = f"{history}User: {turn.text}\nAssistant:" if s.chat else turn.text
                out, text = await one(prompt, turn)
                outs.append(out)
                bar.update(1)
                if not out.success:
                    rest = len(s.turns) - k - 1
                    outs += [RequestOutcome(False, error="an earlier turn failed") for _ in range(rest)]
                    bar.update(rest)
                    break
                history = prompt + text + "\n"
            return outs

        per_session = await asyncio.gather(*(session(i, s) for i, s in enumerate(sessions)))
        return [o for outs in per_session for o in outs], time.perf_counter() - t0


def _warmup(cfg: http_client.ClientConfig, n: int) -> None:
    async def go():
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as http:
            for _ in range(n):
                await http_client.send(http, cfg, "Warm up the server.", 4, {}, True, time.perf_counter())
    if n > 0:
        asyncio.run(go())


def _cache_hit_rate(before: dict, after: dict, fallback: float) -> float:
    """Δ cached_tokens / Δ prompt_tokens of the server's counters; ``fallback`` (the responses'
    own ``cached_tokens``) when the server does not expose the counters."""
    try:
        d_prompt = after["prompt_tokens"] - before["prompt_tokens"]
        return (after["cached_tokens"] - before["cached_tokens"]) / d_prompt if d_prompt > 0 else NAN
    except (KeyError, TypeError):
        return fallback


def _prepare(cfg: http_client.ClientConfig, opts: RunOptions) -> tuple[http_client.ClientConfig, dict]:
    if cfg.backend == "openai" and not cfg.model:
        cfg = http_client.ClientConfig(cfg.base_url, cfg.backend, http_client.first_model(cfg), cfg.api_key,
                                       cfg.temperature)
    _warmup(cfg, opts.warmup_requests)
    if opts.flush_cache:
        http_client.flush_cache(cfg)
    return cfg, http_client.server_info(cfg)


def run_serving(cfg: http_client.ClientConfig, sessions: Sequence[Session], opts: RunOptions,
                label: str = "") -> ServingResult:
    """Send ``sessions`` to the server at ``cfg.base_url`` and measure them (blocks until done)."""
    from tqdm import tqdm

    cfg, before = _prepare(cfg, opts)
    total = sum(len(s.turns) for s in sessions)
    with tqdm(total=total, desc=label or "requests", disable=opts.disable_tqdm) as bar:
        outcomes, duration = asyncio.run(_drive(cfg, sessions, opts, bar))
    after = http_client.server_info(cfg)
    metrics = compute_metrics(outcomes, duration, opts.slo_ttft_ms, opts.slo_tpot_ms)
    metrics["cache_hit_rate"] = _cache_hit_rate(before, after, metrics["cache_hit_rate_client"])
    metrics["request_rate"] = opts.request_rate
    errors = [o.error for o in outcomes if not o.success]
    if errors:
        metrics["first_error"] = errors[0]
    return ServingResult(label, outcomes, metrics, after, {**asdict(opts), "base_url": cfg.base_url,
                                                           "backend": cfg.backend, "model": cfg.model})


def run_agent(cfg: http_client.ClientConfig, num_programs: int, opts: RunOptions, steps: int = 2,
              system_len: int = 256, label: str = "agent") -> ServingResult:
    """Run the ReAct ``@function`` of :mod:`workloads` ``num_programs`` times with ``run_batch``.

    Metrics are per ``gen`` call (TTFT/E2E as the server measured them, no ITL) plus
    ``programs`` and ``program_throughput`` (programs/s).
    Raises:
        ValueError: ``cfg.backend`` is not ``sglite`` (the frontend speaks the native API).
    """
    if cfg.backend != "sglite":
        raise ValueError("backend: the agent workload needs the native sglite API (--backend sglite)")
    from sglite.frontend import RuntimeEndpoint

    cfg, before = _prepare(cfg, opts)
    program, args = agent_program(), agent_arguments(num_programs, opts.seed, steps, system_len)
    endpoint = RuntimeEndpoint(cfg.base_url, api_key=cfg.api_key)
    t0 = time.perf_counter()
    states = program.run_batch(args, backend=endpoint, num_threads=opts.max_concurrency or 16,
                               progress_bar=not opts.disable_tqdm, temperature=0)
    names = [f"{p}_{i}" for i in range(steps) for p in ("thought", "input")] + ["answer"]
    outcomes = []
    for st in states:
        for name in names:
            try:
                m = st.get_meta_info(name)
            except Exception as e:  # noqa: BLE001 - a failed program counts as failed calls
                outcomes.append(RequestOutcome(False, error=f"{type(e).__name__}: {e}"))
                continue
            outcomes.append(RequestOutcome(True, int(m.get("prompt_tokens", 0)), int(m.get("completion_tokens", 0)),
                                           int(m.get("cached_tokens", 0)), ttft=float(m.get("ttft", NAN)),
                                           e2e=float(m.get("e2e_latency", NAN))))
    duration = time.perf_counter() - t0
    after = http_client.server_info(cfg)
    metrics = compute_metrics(outcomes, duration, opts.slo_ttft_ms, opts.slo_tpot_ms)
    metrics.update(programs=num_programs, program_throughput=num_programs / duration,
                   cache_hit_rate=_cache_hit_rate(before, after, metrics["cache_hit_rate_client"]),
                   request_rate=opts.request_rate)
    return ServingResult(label, outcomes, metrics, after, {**asdict(opts), "base_url": cfg.base_url,
                                                           "backend": cfg.backend, "dataset": "agent"})


# ---------------------------------------------------------------------------------- CLI
def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``serving`` and ``sweep``: workload, load shape, SLOs, launching."""
    d = WorkloadOptions()
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default=None, choices=DATASETS, metavar="NAME",
                   help="workload: %(choices)s (default: random, or sharegpt when --dataset-path is given)")
    p.add_argument("--dataset-path", default=None,
                   help="ShareGPT-format JSON file (a list of {'conversations': [{'from': 'human', ...}, "
                        "{'from': 'gpt', ...}]}) for --dataset sharegpt")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: new tokens per request (default: the token length of the gpt reply)")
    p.add_argument("--sharegpt-context-len", type=int, default=SHAREGPT_CONTEXT_LEN,
                   help="sharegpt: skip pairs whose prompt + output tokens exceed this")
    p.add_argument("--tokenizer", default=None,
                   help="sharegpt: HF folder or .gguf whose tokenizer counts the lengths (default: --model-path, "
                        "else the server's model when local, else the default model)")
    p.add_argument("--num-prompts", type=int, default=64, help="sessions (conversations for multi-turn)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival process")
    p.add_argument("--max-concurrency", type=at_least(1), default=None,
                   help="most requests in flight at once (default: unbounded)")
    p.add_argument("--input-len", "--random-input-len", type=at_least(1), default=d.input_len,
                   help="random: prompt length (words, about tokens)")
    p.add_argument("--output-len", "--random-output-len", type=at_least(1), default=d.output_len,
                   help="new tokens per request (random, shared-prefix, multi-turn; the cap for json)")
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=d.range_ratio,
                   help="random: lengths uniform in [len*ratio, len] (1 = fixed)")
    p.add_argument("--num-groups", type=at_least(1), default=d.num_groups, help="shared-prefix: system prompts")
    p.add_argument("--system-len", type=int, default=d.system_len, help="shared-prefix/agent: prefix words")
    p.add_argument("--question-len", type=int, default=d.question_len, help="shared-prefix: question words")
    p.add_argument("--num-turns", type=at_least(1), default=d.num_turns, help="multi-turn: turns per conversation")
    p.add_argument("--turn-len", type=int, default=d.turn_len, help="multi-turn: words per user message")
    p.add_argument("--agent-steps", type=at_least(1), default=2, help="agent: thought/action/observation steps")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT, ms (default: none)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT, ms (default: none)")
    p.add_argument("--warmup-requests", type=at_least(0), default=1, help="untimed requests sent before the run")
    p.add_argument("--no-flush-cache", action="store_true",
                   help="keep the server's prefix cache (default: flushed before the run)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar (default: shown)")
    p.add_argument("--backend", default="sglite", choices=http_client.BACKENDS,
                   help="sglite: native /generate; openai: /v1/completions")
    p.add_argument("--model", default=None, help="OpenAI model name (default: first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token sent with every request (default: none)")
    p.add_argument("--lora-names", "--lora-name", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters served (--lora-paths): session i goes to adapter i %% len (native lora_path, "
                        "OpenAI model); default: the base model")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--launch-mode", default="subprocess", choices=MODES,
                   help="how --launch / sweep start the server")
    p.add_argument("--model-path", default=None,
                   help="with --launch/sweep: the model to serve (default: the default model)")


def check_args(a: argparse.Namespace) -> None:
    """Resolve ``a.dataset`` (None → ``sharegpt`` with ``--dataset-path``, else ``random``) and check
    the ShareGPT flags.

    Raises:
        ValueError: naming the flag: ``--dataset sharegpt`` without ``--dataset-path``,
            ``--dataset-path`` with another dataset, ``--sharegpt-output-len`` < 1,
            ``--sharegpt-context-len`` < 4, ``--num-prompts`` < 1.
    """
    if a.dataset is None:
        a.dataset = "sharegpt" if a.dataset_path else "random"
    if a.dataset == "sharegpt" and not a.dataset_path:
        raise ValueError("--dataset-path: required with --dataset sharegpt (a ShareGPT-format JSON file)")
    if a.dataset_path and a.dataset != "sharegpt":
        raise ValueError(f"--dataset-path: only read by --dataset sharegpt, got --dataset {a.dataset}")
    if a.sharegpt_output_len is not None and a.sharegpt_output_len < 1:
        raise ValueError(f"--sharegpt-output-len: must be >= 1, got {a.sharegpt_output_len}")
    if a.sharegpt_context_len < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"--sharegpt-context-len: must be >= {2 * SHAREGPT_MIN_LEN}, got {a.sharegpt_context_len}")
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts: must be >= 1, got {a.num_prompts}")
    if getattr(a, "lora_names", None) and a.dataset == "agent":
        raise ValueError("--lora-names: not supported with --dataset agent (its requests go through /v1/responses)")


def workload_options(a: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(input_len=a.input_len, output_len=a.output_len, range_ratio=a.range_ratio,
                           num_groups=a.num_groups, system_len=a.system_len, question_len=a.question_len,
                           num_turns=a.num_turns, turn_len=a.turn_len)


def run_options(a: argparse.Namespace, rate: float) -> RunOptions:
    return RunOptions(request_rate=rate, max_concurrency=a.max_concurrency, seed=a.seed, slo_ttft_ms=a.slo_ttft_ms,
                      slo_tpot_ms=a.slo_tpot_ms, warmup_requests=a.warmup_requests,
                      flush_cache=not a.no_flush_cache, disable_tqdm=a.disable_tqdm)


def tokenizer_source(a: argparse.Namespace, cfg: http_client.ClientConfig) -> Optional[str]:
    """Which model's tokenizer counts ShareGPT lengths: ``--tokenizer``, ``--model-path``, the
    server's ``/get_model_info`` ``tokenizer_path`` when it exists on this machine, else None
    (the default model)."""
    import os

    if a.tokenizer or a.model_path:
        return a.tokenizer or a.model_path
    try:
        path = httpx.get(cfg.base_url + "/get_model_info", headers=cfg.headers, timeout=30).json().get(
            "tokenizer_path")
    except (httpx.HTTPError, ValueError, AttributeError):
        path = None
    return path if path and os.path.exists(path) else None


def load_encoder(source: Optional[str]):
    """``text -> token ids`` of the tokenizer of ``source`` (HF folder, ``.gguf``, None = default model)."""
    from sglite.runtime.model_loader import load_checkpoint
    from sglite.runtime.tokenizer import Tokenizer

    ck = load_checkpoint(source)
    return Tokenizer.from_dir(ck.model_dir, ck.hf_config).encode


def run_dataset(a: argparse.Namespace, base_url: str, rate: float, label: str,
                pairs: Optional[list] = None) -> ServingResult:
    """One run of ``a.dataset`` at ``rate`` against ``base_url`` (agent, sharegpt or generated workloads).

    ``pairs``: ShareGPT ``(prompt, reply)`` pairs already read from ``--dataset-path`` (read here when None).
    """
    check_args(a)
    cfg = http_client.ClientConfig(base_url, a.backend, a.model, a.api_key, a.temperature)
    opts = run_options(a, rate)
    if a.dataset == "agent":
        return run_agent(cfg, a.num_prompts, opts, a.agent_steps, a.system_len, label)
    if a.dataset == "sharegpt":
        pairs = pairs if pairs is not None else load_sharegpt(a.dataset_path)
        sessions = sharegpt_workload(pairs, a.num_prompts, load_encoder(tokenizer_source(a, cfg)), a.seed,
                                     a.sharegpt_output_len, a.sharegpt_context_len)
        if len(sessions) < a.num_prompts:
            print(f"note: --dataset-path has {len(sessions)} usable conversations, fewer than --num-prompts "
                  f"{a.num_prompts}", file=sys.stderr)
    else:
        sessions = build_workload(a.dataset, a.num_prompts, a.seed, workload_options(a))
    sessions = with_adapters(sessions, getattr(a, "lora_names", None))
    res = run_serving(cfg, sessions, opts, label)
    if getattr(a, "lora_names", None):
        res.config["lora_names"] = list(a.lora_names)
    res.config["dataset"] = a.dataset
    if a.dataset_path:
        res.config["dataset_path"] = a.dataset_path
    return res


def server_argv(a: argparse.Namespace, extra: str) -> list[str]:
    """``sglite serve`` flags: ``--model-path`` (when given) plus the shell-split ``extra``."""
    return (["--model-path", a.model_path] if a.model_path else []) + shlex.split(extra or "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench serving", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="root of a running server")
    p.add_argument("--launch", action="store_true",
                   help="start a server (see --server-args) for this run (default: use --base-url)")
    p.add_argument("--server-args", default="", help='flags of `sglite serve`, e.g. "--disable-radix-cache"')
    p.add_argument("--request-rate", type=positive_rate, default=math.inf, help="sessions per second, or inf")
    p.add_argument("--output-json", default=None, help="write the result here (SGLang's flat keys + nested metrics)")
    p.add_argument("--output-details", action="store_true", help="include every request in the JSON")
    p.add_argument("--plot", default=None, help="PNG with latency CDFs and throughput bars (default: none)")
    add_workload_args(p)
    add_profile_args(p, remote=True)
    return p


def model_name(res: ServingResult) -> str:
    """The served model's name as the run saw it (``--model``, the server's name or path)."""
    info = res.server_info
    return str(res.config.get("model") or info.get("served_model_name") or info.get("model_path") or "unknown model")


def plot_title(res: ServingResult, dataset: str, rate: float) -> str:
    """``"<model> | <dataset> | request rate <rate> req/s"`` (the ``--plot`` title)."""
    return f"{model_name(res)} | {dataset} | request rate {rate:g} req/s"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglite bench serving``; returns 0 when at least one request succeeded."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        check_args(a)
        pairs = load_sharegpt(a.dataset_path) if a.dataset == "sharegpt" else None
    except ValueError as exc:
        parser.error(str(exc))
    label = f"{a.dataset} @ {a.request_rate} req/s"
    if a.launch:
        with LaunchedServer(server_argv(a, a.server_args), a.launch_mode) as srv, server_profile(a, srv.url) as prof:
            res = run_dataset(a, srv.url, a.request_rate, label, pairs)
        res.config["server_args"] = server_argv(a, a.server_args)
    else:
        with server_profile(a, a.base_url.rstrip("/")) as prof:
            res = run_dataset(a, a.base_url.rstrip("/"), a.request_rate, label, pairs)
    if prof:
        res.config["profile"] = prof
    extra = {"Backend:": a.backend, "Dataset:": a.dataset, "Traffic request rate:": a.request_rate,
             "Max request concurrency:": a.max_concurrency or "not set"}
    if "program_throughput" in res.metrics:
        extra["Programs/s:"] = res.metrics["program_throughput"]
    print(format_serving(res.metrics, extra=extra))
    if "first_error" in res.metrics:
        print(f"first error: {res.metrics['first_error']}", file=sys.stderr)
    if a.output_json:
        write_json(a.output_json, res.to_json(a.output_details))
    if a.plot:
        from .plots import plot_serving

        plot_serving([(label, res.outcomes, res.metrics)], a.plot, title=plot_title(res, a.dataset, a.request_rate))
    return 0 if res.metrics["completed"] else 1
