"""Engine outputs -> OpenAI response pieces: finish reasons, ``matched_stop``, logprobs, usage.

Engine logprob entries are ``[logprob, token_id, text]`` (SGLang's layout); OpenAI's completions
API wants parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``),
chat wants ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_info(meta: dict) -> tuple[Optional[str], Any]:
    """``(finish_reason, matched_stop)`` from the engine's ``meta_info["finish_reason"]``.

    ``stop`` -> ("stop", matched string or token id); ``length`` -> ("length", None);
    ``abort`` -> ("abort", None); unfinished -> (None, None).
    """
    fr = meta["finish_reason"]
    if fr is None:
        return None, None
    if fr["type"] == "stop":
        return "stop", fr["matched"]
    return fr["type"], None


def _tok(entry) -> tuple[float, str]:
    """``(logprob, text)`` of a ``[logprob, token_id, text]`` entry."""
    lp, _tid, text = entry
    return (float(lp) if lp is not None else None), text


def completion_logprobs(meta: dict, start: int, end: Optional[int], text_offset0: int) -> dict:
    """OpenAI completions ``logprobs`` for output tokens ``[start, end)``.

    ``text_offset0`` is the character offset of the first of those tokens in the choice text.
    """
    toks = (meta.get("output_token_logprobs") or [])[start:end]
    tops = (meta.get("output_top_logprobs") or [])[start:end]
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset0
    for k, entry in enumerate(toks):
        lp, text = _tok(entry)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["text_offset"].append(offset)
        offset += len(text)
        top = tops[k] if k < len(tops) else None
        out["top_logprobs"].append({_tok(t)[1]: _tok(t)[0] for t in top} if top else None)
    return out


def chat_logprobs(meta: dict, start: int, end: Optional[int]) -> dict:
    """OpenAI chat ``logprobs`` (``{"content": [...]}``) for output tokens ``[start, end)``."""
    toks = (meta.get("output_token_logprobs") or [])[start:end]
    tops = (meta.get("output_top_logprobs") or [])[start:end]
    content = []
    for k, entry in enumerate(toks):
        lp, text = _tok(entry)
        top = tops[k] if k < len(tops) and tops[k] else []
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace")),
                        "top_logprobs": [{"token": _tok(t)[1], "logprob": _tok(t)[0],
                                          "bytes": list(_tok(t)[1].encode("utf-8", "replace"))} for t in top]})
    return {"content": content}


def num_logprob_tokens(meta: dict) -> int:
    return len(meta.get("output_token_logprobs") or [])


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` (radix-cache hits)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outputs: list[dict], n: int) -> dict:
    """Usage of ``len(outputs)`` choices, ``n`` per prompt: each prompt is counted once."""
    metas = [o["meta_info"] for o in outputs]
    prompt = sum(m["prompt_tokens"] for m in metas[::n])
    cached = sum(m["cached_tokens"] for m in metas[::n])
    completion = sum(m["completion_tokens"] for m in metas)
    return usage(prompt, completion, cached)
