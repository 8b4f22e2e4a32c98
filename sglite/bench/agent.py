"""`sglite bench agent`: multi-turn tool-calling conversations over ``/v1/responses``.

N conversations run concurrently, each K turns. Turn k sends the user's k-th question (and,
from turn 2 on, the result of the previous turn's tool call as a ``function_call_output``); the
model must call ``get_weather`` (a named ``tool_choice``, so every turn is a call whatever the
model). Two modes, run one after the other on the same server:

* ``previous``: each turn sends only its new items with ``previous_response_id`` (the server
  holds the conversation: ``store`` on);
* ``full``: each turn resends the whole history (user messages, ``function_call`` items and
  their outputs), as the OpenAI Agents SDK and most frameworks do (``store`` off).

Per turn it reports the time to the first streamed output event (the call's item) (TTFT, seconds: mean and
median over conversations) and the prefix-cache hit rate (``usage.input_tokens_details.
cached_tokens / usage.input_tokens``, summed over conversations). ``hit_rate_after_first`` sums
turns 2..K (turn 1's prompt is new but for the shared system text). ``prefix_reuse`` is the cached
tokens of turns 2..K over their reusable prefix (the previous turn's prompt + output tokens): 1.0
when every turn's prompt extends the previous prompt and output token for token and the cache
kept them (the new input itself can never hit, so ``hit_rate`` stays below it). Both modes flush the radix
cache first (``POST /flush_cache``; skipped when refused) so they start equal.

Target (issue 34; the lead measures on a quiet machine): 8 conversations x 10 turns on the
default model, TTFT(turn 10) <= 1.5 x TTFT(turn 1) and hit rate >= 0.9.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import httpx

MODES = ("previous", "full")
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Rome", "Delhi"]
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}
INSTRUCTIONS = "You are a weather assistant. Call get_weather for every city the user asks about."


@dataclass
class TurnResult:
    """One turn of one conversation: TTFT (seconds; None when nothing streamed), prompt and
    cached prompt tokens, and the call the model made (``name``, ``arguments`` text, ``call_id``)."""

    ttft: Optional[float]
    input_tokens: int
    cached_tokens: int
    call: Optional[dict] = None
    status: str = "completed"
    output_tokens: int = 0


@dataclass
class Conversation:
    """The client-side state of one conversation (the history for ``full`` mode)."""

    index: int
    history: list = field(default_factory=list)
    previous_id: Optional[str] = None
    turns: list = field(default_factory=list)


def tool_result(call: Optional[dict]) -> str:
    """The fake tool's output for a call (deterministic; unknown arguments still get an answer)."""
    try:
        city = json.loads(call["arguments"]).get("city", "?") if call else "?"
    except (json.JSONDecodeError, AttributeError):
        city = "?"
    return json.dumps({"city": city, "temperature_c": 21, "sky": "clear"})


def turn_input(conv: Conversation, k: int, mode: str) -> list:
    """The items turn ``k`` (0-based) sends, and the history extended by them (``full`` mode)."""
    new = []
    if k > 0:
        prev = conv.turns[-1].call
        if prev is not None:
            new.append({"type": "function_call_output", "call_id": prev["call_id"], "output": tool_result(prev)})
    city = CITIES[(conv.index + k) % len(CITIES)]
    new.append({"role": "user", "content": f"Question {k + 1}: what is the weather in {city} right now?"})
    conv.history.extend(new)
    return list(conv.history) if mode == "full" else new


def request_body(conv: Conversation, k: int, mode: str, model: str, max_output_tokens: int) -> dict:
    """The ``/v1/responses`` body of turn ``k``."""
    body = {"model": model, "input": turn_input(conv, k, mode), "instructions": INSTRUCTIONS, "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
            "temperature": 0, "max_output_tokens": max_output_tokens, "stream": True,
            "store": mode == "previous"}
    if mode == "previous" and conv.previous_id is not None:
        body["previous_response_id"] = conv.previous_id
    return body


async def read_stream(res: httpx.Response, t0: float) -> tuple[Optional[float], dict]:
    """``(TTFT, final response object)`` of a Responses event stream: TTFT is the time to the first
    output event (an ``output_item.added`` or a ``.delta``; the server sends one as soon as the first
    tokens decode to something, e.g. a call's name)."""
    ttft, final = None, None
    async for line in res.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[len("data: "):])
        typ = ev.get("type", "")
        if ttft is None and (typ.endswith(".delta") or typ == "response.output_item.added"):
            ttft = time.perf_counter() - t0
        if typ in ("response.completed", "response.incomplete", "response.failed"):
            final = ev["response"]
        if "error" in ev and typ in ("", "error"):
            raise RuntimeError(f"server error: {ev['error']}")
    if final is None:
        raise RuntimeError("the stream ended without response.completed")
    return ttft, final


def record(conv: Conversation, mode: str, ttft: Optional[float], resp: dict) -> TurnResult:
    """Book one finished turn: its numbers, the call (appended to the history in ``full`` mode)."""
    use = resp.get("usage") or {}
    call = next((it for it in resp.get("output", []) if it.get("type") == "function_call"), None)
    if call is not None and mode == "full":
        conv.history.append({"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                             "arguments": call["arguments"]})
    conv.previous_id = resp.get("id")
    res = TurnResult(ttft, use.get("input_tokens", 0), (use.get("input_tokens_details") or {}).get("cached_tokens", 0),
                     call, resp.get("status", "completed"), use.get("output_tokens", 0))
    conv.turns.append(res)
    return res


async def run_conversation(client: httpx.AsyncClient, conv: Conversation, turns: int, mode: str, model: str,
                           max_output_tokens: int) -> Conversation:
    for k in range(turns):
        body = request_body(conv, k, mode, model, max_output_tokens)
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/responses", json=body) as res:
            if res.status_code != 200:
                raise RuntimeError(f"turn {k + 1} of conversation {conv.index}: HTTP {res.status_code}: "
                                   f"{(await res.aread()).decode()[:300]}")
            ttft, final = await read_stream(res, t0)
        done = record(conv, mode, ttft, final)
        if done.status == "incomplete" and k + 1 < turns:  # its call was cut off: the next turn cannot go on
            raise RuntimeError(f"turn {k + 1} of conversation {conv.index} ended incomplete at "
                               f"--max-output-tokens {max_output_tokens} (its tool call was cut off); raise it")
    return conv


def summarize(convs: Sequence[Conversation], turns: int) -> dict:
    """Per-turn TTFT (mean / median seconds) and hit rates of finished conversations."""
    per_turn = []
    for k in range(turns):
        rs = [c.turns[k] for c in convs if len(c.turns) > k]
        ttfts = [r.ttft for r in rs if r.ttft is not None]
        inp, hit = sum(r.input_tokens for r in rs), sum(r.cached_tokens for r in rs)
        per_turn.append({"turn": k + 1, "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
                         "ttft_median_s": statistics.median(ttfts) if ttfts else None,
                         "input_tokens": inp, "cached_tokens": hit, "hit_rate": hit / inp if inp else 0.0,
                         "calls": sum(r.call is not None for r in rs)})
    later = per_turn[1:]
    inp, hit = sum(t["input_tokens"] for t in later), sum(t["cached_tokens"] for t in later)
    # the reusable prefix of turn k: turn k-1's prompt + output (what a token-exact history extends)
    reusable = sum(min(c.turns[k - 1].input_tokens + c.turns[k - 1].output_tokens, c.turns[k].input_tokens)
                   for c in convs for k in range(1, min(turns, len(c.turns))))
    first, last = per_turn[0]["ttft_mean_s"], per_turn[-1]["ttft_mean_s"]
    return {"per_turn": per_turn,
            "hit_rate": sum(t["cached_tokens"] for t in per_turn) / max(1, sum(t["input_tokens"] for t in per_turn)),
            "hit_rate_after_first": hit / inp if inp else 0.0,
            "prefix_reuse": hit / reusable if reusable else 0.0,
            "ttft_last_over_first": last / first if first and last is not None else None}


async def run_mode(base_url: str, mode: str, n: int, turns: int, model: Optional[str], max_output_tokens: int,
                   api_key: Optional[str] = None, timeout: float = 600.0) -> dict:
    """Run ``n`` conversations of ``turns`` turns in ``mode``; the :func:`summarize` dict plus timing."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await client.post("/flush_cache")  # equal start; a refusal (busy server) only costs accuracy
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(run_conversation(client, Conversation(i), turns, mode, model,
                                                        max_output_tokens) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"mode": mode, "conversations": n, "turns": turns, "wall_s": wall, **summarize(convs, turns)}


def print_table(res: dict) -> None:
    """Print one mode's result of :func:`run_mode` (``res``): the summary line, then TTFT, input tokens,
    cached tokens, hit rate and calls per turn."""
    print(f"== mode {res['mode']}: {res['conversations']} conversations x {res['turns']} turns, "
          f"{res['wall_s']:.2f} s; hit rate {res['hit_rate']:.3f} (turns 2..: {res['hit_rate_after_first']:.3f}; "
          f"of the previous prompt + output: {res['prefix_reuse']:.3f}); "
          f"TTFT last/first {res['ttft_last_over_first'] or float('nan'):.2f}")
    print(f"{'turn':>4} {'ttft_mean_ms':>12} {'ttft_p50_ms':>11} {'input_tok':>9} {'cached':>7} {'hit':>6} {'calls':>5}")
    for t in res["per_turn"]:
        ms = [f"{x * 1e3:.1f}" if x is not None else "-" for x in (t["ttft_mean_s"], t["ttft_median_s"])]
        print(f"{t['turn']:>4} {ms[0]:>12} {ms[1]:>11} {t['input_tokens']:>9} {t['cached_tokens']:>7} "
              f"{t['hit_rate']:>6.3f} {t['calls']:>5}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token, when the server has --api-key")
    p.add_argument("--num-conversations", type=int, default=8, help="concurrent conversations (default: %(default)s)")
    p.add_argument("--turns", type=int, default=10, help="turns per conversation (default: %(default)s)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="which modes, run in this order (default: %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=64, help="per turn (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, alternated (mode order in "
                   "each round), and print each mode's TTFT last/first ratios and their median and range: the "
                   "ratio moves with the order in which the conversations' turns arrive (default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the results here")
    return p


def spread(results: Sequence[dict]) -> dict:
    """Per mode, over rounds: ``{mode: {"ratios": [TTFT last/first per round], "median", "min", "max",
    "hit_rate_min"}}`` (rounds whose ratio is unknown are left out)."""
    out: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        ratios = [r["ttft_last_over_first"] for r in rs if r["ttft_last_over_first"] is not None]
        out[mode] = {"ratios": ratios, "median": statistics.median(ratios) if ratios else None,
                     "min": min(ratios, default=None), "max": max(ratios, default=None),
                     "hit_rate_min": min(r["hit_rate"] for r in rs)}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    for name in ("num_conversations", "turns", "max_output_tokens", "rounds"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    results = []
    for _ in range(a.rounds):
        for mode in a.modes:
            res = asyncio.run(run_mode(a.base_url, mode, a.num_conversations, a.turns, a.model,
                                       a.max_output_tokens, a.api_key))
            print_table(res)
            results.append(res)
    summary = spread(results)
    if a.rounds > 1:
        for mode, sp in summary.items():
            if not sp["ratios"]:  # no round of this mode had both TTFTs
                continue
            ratios = ", ".join(f"{x:.2f}" for x in sp["ratios"])
            print(f"== {mode}, {len(sp['ratios'])} runs: TTFT last/first {ratios}; median {sp['median']:.2f}, "
                  f"range {sp['min']:.2f}-{sp['max']:.2f}; lowest hit rate {sp['hit_rate_min']:.3f}")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"results": results, "spread": summary}, f, indent=2)
    return 0
