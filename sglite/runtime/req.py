"""Req: one generation request as the scheduler tracks it, and its finish reasons."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ..sampling_params import SamplingParams
from .kv_manager import KVState
from .logprob_options import NO_LOGPROBS, LogprobOptions


@dataclass
class FinishReason:
    """Why a request ended: ``stop`` (matched str or token id), ``length`` or ``abort``."""

    type: str
    matched: Union[str, int, None] = None
    length: Optional[int] = None
    message: Optional[str] = None

    def to_dict(self) -> dict:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message or "aborted"}


@dataclass(eq=False)
class Req:
    """A request inside the scheduler.

    Token bookkeeping: ``seq = input_ids + output_ids``; ``kv`` (a
    :class:`~sglite.runtime.kv_manager.KVState`, written only by the ``KVManager``) says how many
    tokens of ``seq`` have K/V in the pool and where. A request is prefilling while
    ``kv.kv_len < len(input_ids)``; afterwards each step extends it by its pending tokens
    (``seq[kv_len:]``: one sampled token, or several after a jump-forward).

    Output: the text lives in ``detok`` (no cumulative copy here); each event sent to ``sink``
    (an :class:`sglite.runtime.output.OutputEvent`) carries only what is new since the previous
    one (``emitted`` counts the output ids and logprob entries already sent).
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    sink: Callable[[Any], None]  # receives OutputEvent
    seed: int
    logprobs: LogprobOptions = NO_LOGPROBS
    stream: bool = False
    grammar: Any = None  # GrammarMatcher or None
    detok: Any = None  # IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    kv: KVState = field(default_factory=KVState)
    cached_tokens: int = 0
    finished: Optional[FinishReason] = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    aborted: bool = False
    retracted: int = 0
    blocked_by: Optional["Req"] = None  # admitted only after this request finished (shared prefix)
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)
    emitted: dict = field(default_factory=dict)  # output list name -> entries already sent in events
    spec: Any = None  # speculative decoding state (sglite.runtime.speculative.SpecState) or None
    lora: Any = None  # the request's LoRA adapter (sglite.lora.LoraAdapter) or None: the base model

    @property
    def cache_ns(self):
        """The radix-cache namespace of this request's KV: its adapter's uid (None: the base
        model's); prefixes are shared only within one namespace."""
        return None if self.lora is None else self.lora.uid

    # the logprob options, as the scheduler and sampler read them
    @property
    def return_logprob(self) -> bool:
        return self.logprobs.return_logprob

    @property
    def logprob_start_len(self) -> int:
        return self.logprobs.logprob_start_len

    @property
    def top_logprobs_num(self) -> int:
        return self.logprobs.top_logprobs_num

    @property
    def token_ids_logprob(self) -> Optional[tuple[int, ...]]:
        return self.logprobs.token_ids_logprob

    @property
    def seq(self) -> list[int]:
        return self.input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``seq[start:end]`` without building the whole sequence."""
        n_in = len(self.input_ids)
        if start >= n_in:
            return self.output_ids[start - n_in:end - n_in]
        if end <= n_in:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[:end - n_in]

    def token_at(self, i: int) -> int:
        """``seq[i]`` (0 <= i < ``seq_len``) without building the sequence."""
        n_in = len(self.input_ids)
        return self.input_ids[i] if i < n_in else self.output_ids[i - n_in]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.kv.kv_len < len(self.input_ids)

    def wants_input_logprobs(self) -> bool:
        return self.logprobs.wants_input

    @property
    def pending(self) -> int:
        """Tokens of ``seq`` without K/V yet."""
        return self.seq_len - self.kv.kv_len
