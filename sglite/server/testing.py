"""FakeEngine: a tiny deterministic stand-in implementing
:class:`~sglite.runtime.engine_protocol.EngineProtocol` (the same contract suite as the real engine).

For fast tests of the HTTP layer (and of HTTP clients) without a model or torch. Tokens are
bytes (id = byte value, EOS = 256). The "model" answers ``reply`` (rotated by the seed when
sampling), a JSON instance of ``json_schema`` constraints, or ``regex_reply`` / ``ebnf_reply``;
it honours batches, ``n`` (the engine's sample rids and seeds), max_new_tokens, stop strings
(held back while they may still match, trimmed unless ``no_stop_trim``), stop token ids,
EOS / ignore_eos, logprobs, cumulative and incremental streams, aborts (``rid`` and ``rid-...``),
duplicate rids in flight, a radix-like count of cached prompt tokens. KV: a running request holds
prompt + output tokens until it ends (``available_tokens == max_total_tokens`` when idle).
"""
from __future__ import annotations

import asyncio
import json
import queue
import random
import threading
import time
from typing import Any, Optional

from ..errors import CapacityError, GrammarError, InvalidRequestError, context_length_message
from ..runtime.engine_protocol import base_model_only, base_rids, matches_rid, sample_rid, sample_seed
from ..runtime.engine_stream import BatchView, OutputEvent
from ..runtime.logprob_options import LogprobOptions
from ..sampling_params import SamplingParams

EOS = 256


class FakeTokenizer:
    """Byte-level tokenizer: token id = byte value; 256 = EOS."""

    vocab_size, eos_token_id = 257, EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))
    encode_prompt = encode  # a prompt's ids: no BOS

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")

    def id_to_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
    return node


def example_instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A small JSON value valid for the simple JSON Schema ``schema``; local ``$ref`` s (``#/...``)
    resolve against ``root`` (default: ``schema`` itself)."""
    root = schema if root is None else root
    if schema is True or not isinstance(schema, dict) or depth > 32:
        return {}
    if isinstance(schema.get("$ref"), str):
        return example_instance(_resolve(root, schema["$ref"]), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return example_instance(schema[key][0], root, depth + 1)
    t = schema.get("type", "object")
    t = t[0] if isinstance(t, list) else t
    if t == "object":
        props = schema.get("properties", {})
        keys = schema.get("required") or list(props)  # none required: show them all (a fuller answer)
        return {k: example_instance(props.get(k, {"type": "string"}), root, depth + 1) for k in keys}
    if t == "array":
        return [example_instance(schema.get("items", {"type": "integer"}), root, depth + 1)
                for _ in range(max(1, schema.get("minItems", 1)))]
    if t == "string":
        return "a" * max(3, schema.get("minLength", 0))
    if t == "integer":
        return max(1, schema.get("minimum", 1))
    return {"number": 1.5, "boolean": True}.get(t)


class FakeEngine:
    """A deterministic fake engine (see module docstring). Inspect ``calls`` and ``aborted`` in tests."""

    def __init__(self, context_length: int = 512, max_total_tokens: int = 4096, step_delay: float = 0.0,
                 reply: str = "Hello world! The quick brown fox jumps over the lazy dog.",
                 tools_in_template: bool = True, model_path: str = "/models/fake-model"):
        self.tokenizer = FakeTokenizer()
        self.context_length, self.max_total_tokens, self.step_delay = context_length, max_total_tokens, step_delay
        self.reply, self.regex_reply, self.ebnf_reply = reply, "42", "yes"
        self.tools_in_template, self.model_path = tools_in_template, model_path
        self.calls: list[dict] = []
        self.aborted: list[str] = []
        self._held: dict[str, int] = {}  # rid in flight -> KV tokens it holds
        self._abort_flags: set[str] = set()
        self._seen: list[list[int]] = []
        self._hits = self._prompt_total = 0
        self._rng = random.Random(0)

    # ------------------------------------------------------------------ info
    def model_info(self) -> dict:
        return {"model_path": self.model_path, "context_length": self.context_length,
                "vocab_size": self.tokenizer.vocab_size, "eos_token_ids": [EOS],
                "role_markers": {"system": ["<|im_start|>system\n", "<|im_end|>\n"],
                                 "user": ["<|im_start|>user\n", "<|im_end|>\n"],
                                 "assistant": ["<|im_start|>assistant\n", "<|im_end|>\n"]},
                "end_of_turn": "<|im_end|>", "default_system_prompt": None}

    def get_server_info(self) -> dict:
        held = sum(self._held.values())
        return {"max_total_tokens": self.max_total_tokens, "free_tokens": self.max_total_tokens - held,
                "evictable_tokens": 0, "available_tokens": self.max_total_tokens - held,
                "running_requests": len(self._held), "waiting_requests": 0, "bytes_per_token": 64,
                "cache_hit_rate": self._hits / self._prompt_total if self._prompt_total else 0.0,
                "context_length": self.context_length}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                            chat_template_kwargs=None) -> str:
        parts = []
        if chat_template_kwargs and chat_template_kwargs.get("enable_thinking") is False:
            parts.append("<|no_think|>")  # what a thinking model's template would switch on
        if tools and self.tools_in_template:
            names = [t["function"]["name"] for t in tools]
            parts.append(f"<|im_start|>system\nTools: {json.dumps(names)}<|im_end|>\n")
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m['role']!r}")
            parts.append(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    # ------------------------------------------------------------------ control
    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self._abort_flags.update(r for r in self._held if matches_rid(r, rid))

    def start_profile(self, **_opts) -> str:
        raise InvalidRequestError("profile: the fake engine runs no model, so there is nothing to profile", field="profile")

    def stop_profile(self) -> dict:
        raise InvalidRequestError("profile: no profile was started", field="profile")

    def flush_cache(self) -> bool:
        if self._held:
            return False
        self._seen.clear()
        return True

    def cache_prefix(self, prompt: Optional[str] = None, input_ids: Optional[list[int]] = None) -> dict:
        all_ids, is_list = self._prompts(prompt, input_ids)
        if is_list:
            raise InvalidRequestError("cache_prefix: give one prefix (a string or one list of ids)", field="text")
        ids = all_ids[0]
        return {"prompt_tokens": len(ids), "cached_tokens": self._cached(ids, record=True)}

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------------ validation
    def _target(self, sp: SamplingParams, seed: int) -> str:
        c = sp.constraint
        if c is not None:
            kind, spec = c
            if kind == "json_schema":
                try:
                    schema = json.loads(spec) if isinstance(spec, str) else spec
                except json.JSONDecodeError as e:
                    raise GrammarError(f"json_schema: not valid JSON: {e}") from None
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError("json_schema: must be an object or a boolean")
                return json.dumps(example_instance(schema))
            if kind == "structural_tag":  # checked; free text is the fake's reply unless the tag allows none
                from ..constrained.structural_tag import structural_tag_rules
                structural_tag_rules(spec)
                from .agent_testing import tags_only_instance  # (it imports this module)
                forced = tags_only_instance(spec)
                return forced if forced is not None else self._free_reply(sp, seed)
            if kind in ("ebnf", "lark"):
                if "root" not in spec and "start" not in spec:
                    raise GrammarError(f"{kind}: the grammar has no root rule")
                return self.ebnf_reply
            return self.regex_reply
        return self._free_reply(sp, seed)

    def _free_reply(self, sp: SamplingParams, seed: int) -> str:
        if sp.temperature > 0:
            k = random.Random(seed).randrange(len(self.reply))
            return self.reply[k:] + " " + self.reply[:k]
        return self.reply

    def _prompts(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("exactly one of prompt (text) and input_ids must be given", field="text")
        if prompt is not None:
            items, is_list = (prompt, True) if isinstance(prompt, list) else ([prompt], False)
            if not items or not all(isinstance(p, str) for p in items):
                raise InvalidRequestError("text: must be a string or a non-empty list of strings", field="text")
            all_ids = [self.tokenizer.encode(p) for p in items]
        else:
            is_list = bool(input_ids) and isinstance(input_ids[0], list)
            all_ids = [list(x) for x in input_ids] if is_list else [list(input_ids)]
            V = self.tokenizer.vocab_size
            if not input_ids or any(not 0 <= t < V for ids in all_ids for t in ids):
                raise InvalidRequestError(f"input_ids: entries must be token ids in [0, {V})", field="input_ids")
        for ids in all_ids:
            if not ids:
                raise InvalidRequestError("text: the prompt is empty (0 tokens)", field="text")
        return all_ids, is_list

    def _plan(self, prompt, sampling_params, input_ids, rid, lp_kw) -> tuple[list[tuple], bool]:
        """Validate a call; ``[(rid, ids, sp, target, logprob options)]`` per output, is it a list."""
        all_ids, is_list = self._prompts(prompt, input_ids)
        n_in = len(all_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n_in
        if len(sps) != n_in:
            raise InvalidRequestError(f"sampling_params: {len(sps)} given for {n_in} prompts", field="sampling_params")
        sps = [sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp, self.tokenizer.vocab_size)
               for sp in sps]
        rids = base_rids(rid, n_in, is_list)
        lp = LogprobOptions.from_args(vocab_size=self.tokenizer.vocab_size, **lp_kw)
        plan = []
        for base, ids, sp in zip(rids, all_ids, sps):
            if len(ids) >= self.context_length:
                raise CapacityError(context_length_message(len(ids), self.context_length), field="prompt")
            if len(ids) + sp.max_new_tokens > self.context_length:
                raise CapacityError(context_length_message(len(ids), self.context_length, sp.max_new_tokens),
                                    field="max_new_tokens")
            lp.check_prompt(len(ids))
            seed = sp.sampling_seed if sp.sampling_seed is not None else self._rng.getrandbits(62)
            for j in range(sp.n):
                s = sample_seed(seed, j)
                plan.append((base if sp.n == 1 else sample_rid(base, j), ids, sp, self._target(sp, s), lp))
        rids_out = [p[0] for p in plan]
        dup = sorted({r for r in rids_out if r in self._held or rids_out.count(r) > 1})
        if dup:
            raise InvalidRequestError(f"rid: request id(s) {dup[:3]} already in flight", field="rid")
        return plan, is_list or any(sp.n > 1 for sp in sps)

    def _cached(self, ids: list[int], record: bool = True) -> int:
        best = 0
        for prev in self._seen:
            n = 0
            for a, b in zip(prev, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        if record:
            self._seen.append(ids)
        return min(best, len(ids) - 1)

    # ------------------------------------------------------------------ generation
    async def _run(self, rid: str, ids: list[int], sp: SamplingParams, target: str, lp: LogprobOptions):
        """Async generator of this request's OutputEvents (deltas; the last one finished)."""
        t0, ttft = time.perf_counter(), None
        out_ids: list[int] = []
        tokens = self.tokenizer.encode(target)
        cached = self._cached(ids)
        self._hits += cached
        self._prompt_total += len(ids)
        sent = {"ids": 0, "text": 0, "lps": 0, "input": False}
        lps: list = []
        tops: list = []
        finish = None

        def event(text: str) -> OutputEvent:
            meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": len(out_ids), "cached_tokens": cached,
                    "finish_reason": finish, "e2e_latency": time.perf_counter() - t0, "ttft": ttft}
            if lp.return_logprob:
                meta["output_token_logprobs"] = [list(x) for x in lps[sent["lps"]:]]
                if lp.top_logprobs_num:
                    meta["output_top_logprobs"] = list(tops[sent["lps"]:])
                    meta["input_top_logprobs"] = []
                meta["input_token_logprobs"] = []
                if lp.wants_input and not sent["input"]:
                    meta["input_token_logprobs"] = [[None if p == 0 else -1.0, t, self.tokenizer.decode([t])]
                                                    for p, t in enumerate(ids) if p >= lp.logprob_start_len]
                    if lp.top_logprobs_num:
                        meta["input_top_logprobs"] = [None] * len(meta["input_token_logprobs"])
                sent["input"] = True
            ev = OutputEvent(text[sent["text"]:], out_ids[sent["ids"]:], meta)
            sent.update(ids=len(out_ids), text=len(text), lps=len(lps))
            return ev

        self._held[rid] = len(ids)
        try:
            if sp.max_new_tokens == 0:
                finish = {"type": "length", "length": 0}
            while finish is None:
                await asyncio.sleep(self.step_delay)
                if rid in self._abort_flags:
                    finish = {"type": "abort", "message": "aborted by client"}
                    break
                i = len(out_ids)
                if i < len(tokens):
                    tok = tokens[i]
                elif sp.ignore_eos or i < sp.min_new_tokens:
                    tok = tokens[i % len(tokens)] if tokens else 32
                else:
                    tok = EOS
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                out_ids.append(tok)
                self._held[rid] += 1
                lps.append([-0.25 * (1 + i % 3), tok, self.tokenizer.decode([tok])])
                tops.append([[-0.25 * (1 + i % 3) - 0.5 * r, (tok + r) % 256, self.tokenizer.decode([(tok + r) % 256])]
                             for r in range(lp.top_logprobs_num)] or None)
                finish = self._check_stop(sp, tok, out_ids, self.tokenizer.decode(out_ids))
                if finish is None:
                    yield event(self._hold_back(self.tokenizer.decode(out_ids), sp))
            yield event(self._final_text(out_ids, sp, finish))
        finally:
            self._held.pop(rid, None)
            self._abort_flags.discard(rid)

    def _check_stop(self, sp, tok, out_ids, text):
        if tok == EOS or tok in (sp.stop_token_ids or []):
            return {"type": "stop", "matched": tok}
        for s in sp.stop or []:
            if s in text:
                return {"type": "stop", "matched": s}
        if len(out_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        return None

    def _final_text(self, out_ids, sp, finish) -> str:
        text = self.tokenizer.decode(out_ids)
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), str):
            s = finish["matched"]
            i = text.find(s)
            text = text[:i + len(s)] if sp.no_stop_trim else text[:i]
        return text

    @staticmethod
    def _hold_back(text: str, sp: SamplingParams) -> str:
        while text.endswith("\ufffd"):  # an incomplete UTF-8 character waits for its other bytes
            text = text[:-1]
        keep = len(text)
        for s in sp.stop or []:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if s.startswith(text[-k:]):
                    keep = min(keep, len(text) - k)
                    break
        return text[:keep]

    async def _events(self, plan: list[tuple]):
        """``(output index, OutputEvent)`` of every output of a call, in arrival order."""
        q: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int, gen):
            try:
                async for ev in gen:
                    await q.put((i, ev))
            finally:
                q.put_nowait((i, end))
        gens = [self._run(*p) for p in plan]
        for rid, ids, *_ in plan:  # held from submission on, like the real engine's queue
            self._held.setdefault(rid, len(ids))
        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        left = len(tasks)
        try:
            while left:
                i, ev = await q.get()
                if ev is end:
                    left -= 1
                else:
                    yield i, ev
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for rid, *_ in plan:
                self._held.pop(rid, None)

    async def async_generate(self, prompt=None, sampling_params: Any = None, input_ids=None,
                             return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                             token_ids_logprob=None, stream: bool = False, rid=None, incremental: bool = False,
                             lora_path=None):  # the fake serves no adapters: only None or "" (the base model)
        """Await it: a result dict (a list for a batch or ``n > 1``), or (``stream=True``) an
        async iterator of output dicts (cumulative unless ``incremental``; ``index`` when several)."""
        base_model_only(lora_path, 1)
        text = prompt if prompt is not None or not input_ids or not isinstance(input_ids[0], int) else \
            self.tokenizer.decode(input_ids)  # the prompt text either way (turn_tokens may send ids)
        self.calls.append({"prompt": prompt, "input_ids": input_ids, "text": text, "sampling_params": sampling_params,
                           "rid": rid, "stream": stream, "return_logprob": return_logprob,
                           "top_logprobs_num": top_logprobs_num})
        lp_kw = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                     top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob)
        plan, is_list = self._plan(prompt, sampling_params, input_ids, rid, lp_kw)
        view = BatchView(len(plan), incremental and stream)
        events = self._events(plan)

        async def gen():
            async for i, ev in events:
                yield view.view(i, ev)
        if stream:
            return gen()
        results = {}
        async for out in gen():
            if out["meta_info"]["finish_reason"] is not None:
                results[out.pop("index", 0)] = out
        outs = [results[i] for i in range(len(plan))]
        return outs if is_list else outs[0]

    def generate(self, prompt=None, sampling_params=None, stream: bool = False, **kw):
        """Synchronous form; a stream runs on its own event loop in a helper thread (closing the
        iterator early ends its requests). Bad input raises here, before anything runs."""
        if not stream:
            return asyncio.run(self.async_generate(prompt, sampling_params, **kw))
        q: queue.Queue = queue.Queue()
        closed = threading.Event()

        async def main():
            try:
                it = await self.async_generate(prompt, sampling_params, stream=True, **kw)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                q.put(("err", e))
                return
            q.put(("ok", None))
            try:
                async for ev in it:
                    q.put(("ev", ev))
                    if closed.is_set():
                        break
            finally:
                await it.aclose()
                q.put(("end", None))
        threading.Thread(target=asyncio.run, args=(main(),), name="fake-engine-stream", daemon=True).start()
        kind, val = q.get()
        if kind == "err":
            raise val

        def events():
            try:
                while True:
                    kind, val = q.get()
                    if kind == "end":
                        return
                    yield val
            finally:
                closed.set()
        return events()
