"""FakeBackend: a deterministic, counting backend for tests (no model, no torch).

Every call is recorded in :attr:`FakeBackend.requests` as a dict with ``kind`` ∈ {generate,
cache_prefix, score, flush_cache}. A "token" is one character. Outputs depend only on the
prompt (thread order does not matter). A radix cache is simulated: ``cached_tokens`` is the
longest prefix shared with any earlier prompt (at most ``prompt_tokens - 1``, as SGLang).
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from typing import Callable, Optional

from .backend import Backend
from .chat_template import ChatTemplate

#: a ChatML-like template, as SmolLM2's
CHATML = ChatTemplate({"system": ("<|im_start|>system\n", "<|im_end|>\n"),
                       "user": ("<|im_start|>user\n", "<|im_end|>\n"),
                       "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n")},
                      end_of_turn="<|im_end|>", default_system_prompt=None)


def _digest(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16)


class FakeBackend(Backend):
    """Deterministic backend that records every request.

    Args:
        respond: ``respond(prompt, sampling_params) -> str``; default: digits when the regex
            looks numeric, ``true``/``True`` for booleans, else ``"ans<hash of prompt>"``.
        score_fn: ``score_fn(prompt, choice) -> list of per-token logprobs`` (one per
            character); default: a deterministic pseudo-random value per (prompt, char).
        template: the chat template (default :data:`CHATML`).
    """

    def __init__(self, respond: Optional[Callable] = None, score_fn: Optional[Callable] = None,
                 template: ChatTemplate = CHATML, stream_chunk: int = 3):
        self.respond = respond
        self.score_fn = score_fn
        self.template = template
        self.stream_chunk = stream_chunk
        self.requests: list = []
        self._seen: list = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ helpers
    def calls(self, kind: str) -> list:
        """The recorded requests of one kind, in order."""
        with self._lock:
            return [r for r in self.requests if r["kind"] == kind]

    def _record(self, kind: str, prompt, **extra) -> int:
        with self._lock:
            self.requests.append({"kind": kind, "prompt": prompt, **extra})
            if isinstance(prompt, str):
                cached = max((len(os.path.commonprefix([prompt, p])) for p in self._seen), default=0)
                self._seen.append(prompt)
                return min(cached, max(len(prompt) - 1, 0))
            return 0

    def _text(self, prompt: str, sp: dict) -> str:
        if sp.get("max_new_tokens", 128) == 0:
            return ""
        if self.respond is not None:
            text = self.respond(prompt, sp)
        else:
            regex = sp.get("regex") or ""
            h = _digest(prompt)
            if "True|False" in regex:
                text = "True" if h % 2 else "False"
            elif "[0-9]" in regex:
                text = str(h % 1000)
            elif sp.get("json_schema"):
                text = "{}"
            else:
                text = f"ans{h % 100000}"
        for s in sp.get("stop") or []:
            if s in text:
                text = text[:text.index(s)]
        return text[: sp.get("max_new_tokens", 128)]

    # ------------------------------------------------------------------ Backend
    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def generate(self, prompt, sampling_params, **logprob):
        sp = dict(sampling_params)
        cached = self._record("generate" if sp.get("max_new_tokens", 128) else "cache_prefix", prompt,
                              sampling_params=sp, **logprob)
        texts = [self._text(prompt + ("" if i == 0 else f"#{i}"), sp) for i in range(sp.get("n", 1))]
        outs = [{"text": t, "output_ids": [ord(c) for c in t],
                 "meta_info": {"prompt_tokens": len(prompt), "completion_tokens": len(t), "cached_tokens": cached,
                               "finish_reason": {"type": "stop", "matched": None}}} for t in texts]
        return outs if len(outs) > 1 else outs[0]

    def generate_stream(self, prompt, sampling_params, **logprob):
        out = self.generate(prompt, sampling_params, **logprob)
        text, k = out["text"], self.stream_chunk
        for end in range(k, len(text), k):
            yield {"text": text[:end], "output_ids": out["output_ids"][:end], "meta_info": {"finish_reason": None}}
        yield out

    def cache_prefix(self, prefix):
        return self.generate(prefix, {"max_new_tokens": 0})["meta_info"]

    def score(self, prompt, continuations, unconditional=False, lora_path=None):
        self._record("score", prompt, continuations=list(continuations), unconditional=unconditional,
                     **({"lora_path": lora_path} if lora_path else {}))
        out = []
        for c in continuations:
            if self.score_fn is not None:
                lps = list(self.score_fn(prompt, c))
            else:
                lps = [-(_digest(prompt[-8:] + c[: i + 1]) % 1000) / 250.0 for i in range(len(c))]
            r = {"token_ids": [ord(ch) for ch in c], "logprobs": lps, "texts": list(c)}
            if unconditional:
                r["unconditional_logprobs"] = [None] + [lp / 2 for lp in lps[1:]]
            out.append(r)
        return out

    def flush_cache(self) -> bool:
        with self._lock:
            self.requests.append({"kind": "flush_cache", "prompt": None})
            self._seen.clear()
        return True

    def get_server_info(self) -> dict:
        with self._lock:
            return {"backend": "fake", "num_requests": len(self.requests)}


def regex_fullmatch(regex: str, text: str) -> bool:
    """Whether ``text`` fully matches ``regex`` (a test helper)."""
    return re.fullmatch(regex, text) is not None
