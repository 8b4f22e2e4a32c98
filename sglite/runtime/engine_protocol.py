"""EngineProtocol: the engine as the HTTP server (and other in-process clients) use it, and the
one request-id / sample-seed scheme every layer shares. No torch.

Implemented by :class:`sglite.Engine` and by the server's :class:`sglite.server.testing.FakeEngine`;
both pass the same contract suite (``tests/runtime/test_engine_contract.py``).

Request ids (one scheme, SGLang's shape):
    * a single prompt: ``rid`` as given (a fresh uuid4 hex when None);
    * a batch: ``rid`` may be a list (one per prompt); a single string is a per-item prefix,
      item ``i`` gets :func:`item_rid` ``(rid, i)`` = ``"<rid>-<i>"``;
    * ``n > 1`` samples of a prompt whose rid is ``r``: :func:`sample_rid` ``(r, j)`` = ``"<r>-<j>"``;
    * ``abort(r)`` aborts ``r`` and every ``"<r>-..."`` request (its samples, its batch items).
Sample seeds: sample ``j`` of a request with ``sampling_seed`` s uses :func:`sample_seed` ``(s, j)``,
so the same seeded ``n > 1`` request samples the same in Python and over HTTP.
"""
from __future__ import annotations

import uuid
from typing import Any, Optional, Protocol, Union, runtime_checkable

from ..errors import InvalidRequestError

SEED_MOD = 2 ** 62
SAMPLE_SEED_STRIDE = 7919  # a prime: sample seeds of nearby base seeds do not collide early


def item_rid(base: str, i: int) -> str:
    """Request id of item ``i`` of a batch whose rid prefix is ``base``."""
    return f"{base}-{i}"


def sample_rid(rid: str, j: int) -> str:
    """Request id of sample ``j`` (of ``n > 1``) of request ``rid``."""
    return f"{rid}-{j}"


def base_rids(rid, n_in: int, is_list: bool) -> list[str]:
    """One base rid per prompt of a call of ``n_in`` prompts (``is_list``: the prompt was a list):
    a list ``rid`` as given (empty or None entries get a fresh uuid4 hex), a string ``rid`` (or a
    fresh one when None) as is for one prompt, else :func:`item_rid` of it per item.

    Raises:
        InvalidRequestError: ``field="rid"``: a list of the wrong length, or an entry that is not
            a string or None.
    """
    if isinstance(rid, list):
        if len(rid) != n_in:
            raise InvalidRequestError(f"rid: {len(rid)} given for {n_in} prompts", field="rid")
        rids = rid
    else:
        rids = [rid]
    for r in rids:
        if r is not None and not isinstance(r, str):
            raise InvalidRequestError(f"rid: must be a string, got {type(r).__name__}", field="rid")
    if isinstance(rid, list):
        return [r or uuid.uuid4().hex for r in rids]
    base = rid or uuid.uuid4().hex
    return [item_rid(base, i) for i in range(n_in)] if is_list else [base]


def base_model_only(lora_path, n: int) -> list:
    """The adapters of ``n`` prompts on an engine that serves none: ``[None] * n`` when
    ``lora_path`` (a name or a list of names) names only the base model (None or ``""``).
    Raises InvalidRequestError naming ``lora_path`` otherwise."""
    names = lora_path if isinstance(lora_path, list) else [lora_path]
    if any(p not in (None, "") for p in names):
        raise InvalidRequestError("lora_path: this engine serves no LoRA adapters", field="lora_path")
    return [None] * n


def matches_rid(rid: str, query: str) -> bool:
    """True when ``abort(query)`` covers request ``rid`` (itself, or ``query-...``)."""
    return rid == query or rid.startswith(query + "-")


def sample_seed(seed: int, j: int) -> int:
    """Seed of sample ``j`` of a request seeded with ``seed`` (sample 0 keeps the seed)."""
    return (seed % SEED_MOD + SAMPLE_SEED_STRIDE * j) % SEED_MOD


class TokenizerLike(Protocol):
    """The tokenizer part of the contract: text <-> token ids."""

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids as the engine encodes it (the tokenizer's BOS first, if it adds one)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class EngineProtocol(Protocol):
    """What the server needs from an engine (see ``sglite/runtime/engine.py`` for the shapes).

    Output dicts: ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
    "cached_tokens", "finish_reason", "e2e_latency", "ttft", [logprob lists]}}``; a batch or
    ``n > 1`` gives a list in output order (prompt-major), streams tag each dict with ``index``.
    Streams are cumulative unless ``incremental=True`` (then text, ids and logprob lists are the
    new parts of each event). Bad input raises ``ValueError`` subclasses naming the field
    (``InvalidRequestError``, ``GrammarError``, ``CapacityError``) before anything is scheduled.
    """

    tokenizer: TokenizerLike

    def model_info(self) -> dict:
        """``model_path``, ``context_length``, ``vocab_size``, ``eos_token_ids``, ``role_markers``,
        ``end_of_turn``, ``default_system_prompt``."""
        ...

    def get_server_info(self) -> dict:
        """At least ``max_total_tokens``, ``free_tokens``, ``evictable_tokens``, ``available_tokens``,
        ``running_requests``, ``waiting_requests``, ``cache_hit_rate``, ``bytes_per_token``,
        ``context_length``."""
        ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list] = None, chat_template_kwargs: Optional[dict] = None) -> str: ...

    def generate(self, prompt: Union[str, list[str], None] = None, sampling_params: Union[dict, list, None] = None,
                 input_ids: Optional[list] = None, return_logprob: bool = False,
                 logprob_start_len: Union[int, list] = -1, top_logprobs_num: int = 0,
                 token_ids_logprob: Optional[list[int]] = None, stream: bool = False,
                 rid: Union[str, list, None] = None, incremental: bool = False,
                 lora_path: Union[str, list, None] = None) -> Any: ...

    async def async_generate(self, prompt: Union[str, list[str], None] = None,
                             sampling_params: Union[dict, list, None] = None, input_ids: Optional[list] = None,
                             return_logprob: bool = False, logprob_start_len: Union[int, list] = -1,
                             top_logprobs_num: int = 0, token_ids_logprob: Optional[list[int]] = None,
                             stream: bool = False, rid: Union[str, list, None] = None,
                             incremental: bool = False, lora_path: Union[str, list, None] = None) -> Any:
        """The result (dict or list), or with ``stream=True`` an async iterator of dicts.
        ``lora_path``: the LoRA adapter's name (a list: one per prompt); None or ``""``: the base
        model. An adapter the engine does not serve raises InvalidRequestError naming ``lora_path``."""
        ...

    def cache_prefix(self, prompt: Optional[str] = None, input_ids: Optional[list[int]] = None) -> dict:
        """Prefill a prefix into the prefix cache; ``{"prompt_tokens", "cached_tokens"}``."""
        ...

    def abort(self, rid: str) -> None: ...

    def flush_cache(self) -> bool: ...

    def shutdown(self) -> None: ...
