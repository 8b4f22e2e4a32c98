"""FakeEngine: a tiny deterministic stand-in with the :mod:`sglite.runtime.engine` contract.

For fast tests of the HTTP layer (and of HTTP clients) without a model or torch. Tokens are
bytes (id = byte value, EOS = 256). The "model" answers ``reply`` (rotated by the seed when
sampling), a JSON instance of ``json_schema`` constraints, or ``regex_reply`` / ``ebnf_reply``;
it honours max_new_tokens, stop strings (held back while they may still match, trimmed unless
``no_stop_trim``), stop token ids, EOS / ignore_eos, logprobs, aborts and a radix-like count of
cached prompt tokens. KV accounting: a running request holds prompt + output tokens, released
when it ends, so ``available_tokens == max_total_tokens`` when idle.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any, Optional

from ..errors import CapacityError, GrammarError, InvalidRequestError
from ..sampling_params import SamplingParams

EOS = 256


class FakeTokenizer:
    """Byte-level tokenizer: token id = byte value; 256 = EOS."""

    vocab_size = 257
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")


def example_instance(schema: Any) -> Any:
    """A small JSON value valid for the simple JSON Schema ``schema`` (no $ref)."""
    if schema is True or not isinstance(schema, dict):
        return {}
    for key in ("const",):
        if key in schema:
            return schema[key]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return example_instance(schema[key][0])
    t = schema.get("type", "object")
    t = t[0] if isinstance(t, list) else t
    if t == "object":
        props = schema.get("properties", {})
        keys = schema.get("required", list(props))
        return {k: example_instance(props.get(k, {"type": "string"})) for k in keys}
    if t == "array":
        return [example_instance(schema.get("items", {"type": "integer"}))
                for _ in range(max(1, schema.get("minItems", 1)))]
    if t == "string":
        return "a" * max(3, schema.get("minLength", 0))
    if t == "integer":
        return max(1, schema.get("minimum", 1))
    if t == "number":
        return 1.5
    if t == "boolean":
        return True
    return None


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
        self._held: dict[str, int] = {}
        self._abort_flags: set[str] = set()
        self._seen: list[list[int]] = []
        self._hits = self._prompt_total = 0

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        parts = []
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
        if rid in self._held:
            self._abort_flags.add(rid)

    def flush_cache(self) -> bool:
        if self._held:
            return False
        self._seen.clear()
        return True

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------------ generation
    def _target(self, sp: SamplingParams) -> str:
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
            if kind in ("ebnf", "lark"):
                if "root" not in spec and "start" not in spec:
                    raise GrammarError(f"{kind}: the grammar has no root rule")
                return self.ebnf_reply
            return self.regex_reply
        if sp.temperature > 0:
            k = random.Random(sp.sampling_seed).randrange(len(self.reply))
            return self.reply[k:] + " " + self.reply[:k]
        return self.reply

    def _prepare(self, prompt, input_ids, sampling_params) -> tuple[list[int], SamplingParams, str]:
        if isinstance(sampling_params, SamplingParams):
            sp = sampling_params
        else:
            sp = SamplingParams.from_dict(sampling_params, vocab_size=self.tokenizer.vocab_size)
        ids = list(input_ids) if input_ids is not None else self.tokenizer.encode(prompt or "")
        if not ids:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        if len(ids) + sp.max_new_tokens > self.context_length:
            raise CapacityError(f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens "
                                f"({sp.max_new_tokens}) exceeds the context length ({self.context_length})",
                                field="max_new_tokens")
        return ids, sp, self._target(sp)

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for prev in self._seen:
            n = 0
            for a, b in zip(prev, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._seen.append(ids)
        best = min(best, len(ids) - 1)
        self._hits += best
        self._prompt_total += len(ids)
        return best

    async def _run(self, rid: str, ids: list[int], sp: SamplingParams, target: str, lp: dict):
        """Async generator of cumulative outputs (the last one finished)."""
        t0, ttft = time.perf_counter(), None
        out_ids, out_lps, out_tops = [], [], []
        tokens = self.tokenizer.encode(target)
        meta = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": self._cached(ids)}
        self._held[rid] = len(ids)
        finish = None
        try:
            if sp.max_new_tokens == 0:
                finish = {"type": "length", "length": 0}
            while finish is None:
                await asyncio.sleep(self.step_delay)
                if rid in self._abort_flags:
                    finish = {"type": "abort", "message": "aborted by request"}
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
                out_lps.append([-0.25 * (1 + i % 3), tok, self.tokenizer.decode([tok])])
                out_tops.append([[-0.25 * (1 + i % 3) - 0.5 * r, (tok + r) % 256, self.tokenizer.decode([(tok + r) % 256])]
                                 for r in range(lp["top_logprobs_num"])] or None)
                text = self.tokenizer.decode(out_ids)
                finish, text = self._check_stop(sp, tok, out_ids, text)
                if finish is None:
                    yield self._out(out_ids, self._hold_back(text, sp), meta, None, lp, out_lps, out_tops, ttft, t0, ids)
            yield self._out(out_ids, self._final_text(out_ids, sp, finish), meta, finish, lp, out_lps, out_tops,
                            ttft, t0, ids)
        finally:
            self._held.pop(rid, None)
            self._abort_flags.discard(rid)

    def _check_stop(self, sp, tok, out_ids, text):
        if tok == EOS or tok in (sp.stop_token_ids or []):
            return {"type": "stop", "matched": tok}, text
        for s in sp.stop or []:
            if s in text:
                return {"type": "stop", "matched": s}, text
        if len(out_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}, text
        return None, text

    def _final_text(self, out_ids, sp, finish) -> str:
        text = self.tokenizer.decode(out_ids)
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), str):
            s = finish["matched"]
            i = text.find(s)
            text = text[:i + len(s)] if sp.no_stop_trim else text[:i]
        return text

    @staticmethod
    def _hold_back(text: str, sp: SamplingParams) -> str:
        keep = len(text)
        for s in sp.stop or []:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if s.startswith(text[-k:]):
                    keep = min(keep, len(text) - k)
                    break
        return text[:keep]

    def _out(self, out_ids, text, meta, finish, lp, out_lps, out_tops, ttft, t0, ids) -> dict:
        m = dict(meta, completion_tokens=len(out_ids), finish_reason=finish,
                 e2e_latency=time.perf_counter() - t0, ttft=ttft or 0.0)
        if lp["return_logprob"]:
            start = lp["logprob_start_len"]
            m["output_token_logprobs"] = [list(x) for x in out_lps]
            m["output_top_logprobs"] = list(out_tops)
            if start >= 0:
                m["input_token_logprobs"] = [[None if p == 0 else -1.0, t, self.tokenizer.decode([t])]
                                             for p, t in enumerate(ids) if p >= start]
        return {"text": text, "output_ids": list(out_ids), "meta_info": m}

    async def async_generate(self, prompt: Optional[str] = None, sampling_params: Any = None,
                             input_ids: Optional[list[int]] = None, stream: bool = False,
                             rid: Optional[str] = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0, **_: Any):
        """Await it: a result dict, or (``stream=True``) an async iterator of cumulative dicts."""
        rid = rid or uuid.uuid4().hex
        self.calls.append({"prompt": prompt, "input_ids": input_ids, "sampling_params": sampling_params,
                           "rid": rid, "stream": stream, "return_logprob": return_logprob,
                           "top_logprobs_num": top_logprobs_num})
        ids, sp, target = self._prepare(prompt, input_ids, sampling_params)
        lp = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
              "top_logprobs_num": top_logprobs_num}
        gen = self._run(rid, ids, sp, target, lp)
        if stream:
            return gen
        last = None
        async for last in gen:
            pass
        return last

    def generate(self, prompt=None, sampling_params=None, **kw):
        """Synchronous form (non-streaming only)."""
        return asyncio.run(self.async_generate(prompt, sampling_params, **kw))
