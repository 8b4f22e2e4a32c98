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


def output_entries(meta: dict, start: int = 0, end: Optional[int] = None, drop_stop_token: bool = True
                   ) -> tuple[list, list]:
    """``(entries, top entries)`` of output tokens ``[start, end)``; with ``drop_stop_token``, less
    the stop token (EOS or a ``stop_token_ids`` id that ended the output: the text does not hold
    it, so the entries join to the text)."""
    toks = (meta.get("output_token_logprobs") or [])[start:end]
    tops = (meta.get("output_top_logprobs") or [])[start:end]
    fr = meta.get("finish_reason") or {}
    matched = fr.get("matched")
    if (drop_stop_token and toks and fr.get("type") == "stop" and isinstance(matched, int)
            and not isinstance(matched, bool) and toks[-1][1] == matched):
        toks = toks[:-1]
        tops = tops[:len(toks)]
    return toks, tops


def completion_logprobs(meta: dict, start: int, end: Optional[int], text_offset0: int,
                        prompt: bool = False) -> dict:
    """OpenAI completions ``logprobs`` for output tokens ``[start, end)``; with ``prompt`` (``echo``),
    the prompt tokens' entries first (``meta["input_token_logprobs"]``: the first one's logprob is
    null), as the legacy API and vLLM return them and lm-evaluation-harness reads them.

    The completion keeps its stop token's entry (EOS included, as vLLM does): harnesses slice
    ``[context_len:-1]`` assuming one entry per generated token. ``text_offset0`` is the character
    offset of the first entry in the choice text.
    """
    toks, tops = output_entries(meta, start, end, drop_stop_token=False)
    if prompt:
        ptoks = meta.get("input_token_logprobs") or []
        ptops = meta.get("input_top_logprobs") or []
        ptops = list(ptops) + [None] * (len(ptoks) - len(ptops))
        toks, tops = list(ptoks) + list(toks), ptops[:len(ptoks)] + list(tops) + [None] * (len(toks) - len(tops))
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


def chat_logprobs(meta: dict, start: int, end: Optional[int], token_bytes=None) -> dict:
    """OpenAI chat ``logprobs`` (``{"content": [...]}``) for output tokens ``[start, end)``, the stop
    token left out. ``bytes`` are each token's raw bytes from ``token_bytes(token_id)`` (so a token
    holding part of a UTF-8 character has its own bytes, not U+FFFD's); without it, the UTF-8 of
    the token text."""
    toks, tops = output_entries(meta, start, end)

    def raw(entry) -> list:
        if token_bytes is not None:
            return list(token_bytes(int(entry[1])))
        return list((entry[2] or "").encode("utf-8", "replace"))

    content = []
    for k, entry in enumerate(toks):
        lp, text = _tok(entry)
        top = tops[k] if k < len(tops) and tops[k] else []
        content.append({"token": text, "logprob": lp, "bytes": raw(entry),
                        "top_logprobs": [{"token": _tok(t)[1], "logprob": _tok(t)[0], "bytes": raw(t)} for t in top]})
    return {"content": content}


def num_logprob_tokens(meta: dict, drop_stop_token: bool = True) -> int:
    """Logprob entries of this output event (the stop token not counted unless ``drop_stop_token``
    is False)."""
    return len(output_entries(meta, drop_stop_token=drop_stop_token)[0])


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
