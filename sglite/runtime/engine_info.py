"""Snapshots the engine reports about itself: ``get_server_info`` and ``model_info`` payloads."""
from __future__ import annotations

from ..errors import InvalidRequestError


def server_info(config, runner, scheduler) -> dict:
    """Config, KV capacity and usage, queue lengths and counters. Call on the loop thread (the
    scheduler's queues and stats are read without a lock).

    Returns a dict: every ``EngineConfig`` field, ``max_total_tokens`` / ``free_tokens`` /
    ``evictable_tokens`` / ``available_tokens`` (tokens), ``running_requests``, ``waiting_requests``,
    ``cache_hit_rate`` (cached / prompt tokens, 0..1), ``bytes_per_token`` (KV bytes), ``dtype``,
    ``device``, ``context_length`` and the scheduler's counters (``stats``)."""
    s = scheduler
    free, ev = s.kv.free_tokens(), s.kv.cache.evictable_size
    st = dict(s.stats)
    hit = st["cached_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0
    return {**dict(config.__dict__),
            "max_total_tokens": runner.max_total_tokens, "free_tokens": free,
            "evictable_tokens": ev, "available_tokens": free + ev,
            "running_requests": len(s.running), "waiting_requests": len(s.waiting),
            "cache_hit_rate": hit, "bytes_per_token": runner.bytes_per_token,
            "dtype": str(runner.dtype).replace("torch.", ""), "device": runner.device,
            "context_length": runner.context_length, **st}


def model_info(checkpoint, runner, tokenizer) -> dict:
    """Model facts clients need: ``model_path`` (as given), ``context_length`` (tokens),
    ``vocab_size``, ``eos_token_ids``, ``bos_token_id`` (None when the tokenizer has none),
    ``role_markers``, ``end_of_turn``, ``default_system_prompt``, ``dtype``, ``device``.

    A tokenizer without a usable chat template (e.g. a GGUF with no ``tokenizer.chat_template``:
    raw completion only) gives ``role_markers`` ``{}`` and ``end_of_turn`` /
    ``default_system_prompt`` None, what a client reads as "no chat markers"; chat requests are
    still refused when they arrive (``InvalidRequestError`` naming ``chat_template``)."""
    tk = tokenizer
    try:
        chat = {"role_markers": {k: list(v) for k, v in tk.role_markers().items()},
                "end_of_turn": tk.end_of_turn, "default_system_prompt": tk.default_system_prompt}
    except InvalidRequestError:
        chat = {"role_markers": {}, "end_of_turn": None, "default_system_prompt": None}
    return {"model_path": checkpoint.source, "context_length": runner.context_length,
            "vocab_size": runner.vocab_size, "eos_token_ids": sorted(tk.eos_token_ids),
            "bos_token_id": getattr(tk.hf, "bos_token_id", None),
            **chat, "dtype": str(runner.dtype).replace("torch.", ""), "device": runner.device}
