"""Backends: where a program's requests go. The frontend never imports torch.

:class:`Backend` is the interface the interpreter calls; :class:`EngineBackend` wraps an
in-process ``sglite.Engine`` (duck-typed: anything with ``generate``, ``score``,
``model_info``, ``flush_cache``, ``get_server_info`` as documented in
``sglite/runtime/engine.py``). The HTTP backend is :class:`~sglite.frontend.runtime_endpoint.RuntimeEndpoint`.

Result shape of ``generate`` (SGLang's): ``{"text", "output_ids", "meta_info": {"prompt_tokens",
"completion_tokens", "cached_tokens", "finish_reason", ...}}``; a list of them when
``sampling_params["n"] > 1``.
"""
from __future__ import annotations

import threading
from typing import Iterator, Optional

from .chat_template import ChatTemplate
from .choices import ChoicesDecision, ChoicesMethod, mean_logprob


def logprob_kwargs(return_logprob=None, logprob_start_len=None, top_logprobs_num=None,
                   return_text_in_logprobs=None, with_text_flag: bool = False, lora_path=None) -> dict:
    """The logprob request fields that are set (None ones dropped), and ``lora_path`` (the LoRA
    adapter's name) when set.

    ``return_text_in_logprobs`` is kept only ``with_text_flag`` (the HTTP API takes it; the
    in-process engine always puts each token's text in its logprob entries).
    """
    out = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
           "top_logprobs_num": top_logprobs_num, "lora_path": lora_path}
    if with_text_flag:
        out["return_text_in_logprobs"] = return_text_in_logprobs
    return {k: v for k, v in out.items() if v is not None}


def start_token_id(model_info: dict) -> int:
    """The token an empty prompt starts from: the model's BOS (``bos_token_id``), else its
    smallest EOS id (GPT-2-style models use the end-of-text token as BOS).

    Raises:
        InvalidRequestError: the model info names neither.
    """
    bos = model_info.get("bos_token_id")
    if bos is None:
        eos = model_info.get("eos_token_ids") or []
        if not eos:
            from sglite.errors import InvalidRequestError
            raise InvalidRequestError("text: the prompt is empty and the model has no BOS or EOS token to "
                                      "start from", field="text")
        bos = min(eos)
    return int(bos)


class Backend:
    """What the interpreter needs from a model server. Methods must be thread-safe.

    ``generate("")`` (a program that generates before any text, e.g. right after a fork at the
    start) starts from the model's BOS token (see :func:`start_token_id`), as SGLang's
    tokenizer-added BOS does.
    """

    def get_chat_template(self) -> ChatTemplate:
        """The model's role markers (see :class:`ChatTemplate`)."""
        raise NotImplementedError

    def generate(self, prompt: str, sampling_params: dict, **logprob) -> dict | list:
        """One completion of ``prompt`` (a list of ``n`` when ``sampling_params['n'] > 1``)."""
        raise NotImplementedError

    def generate_stream(self, prompt: str, sampling_params: dict, **logprob) -> Iterator[dict]:
        """Dicts of the ``generate`` shape with CUMULATIVE ``text``; the last has the finish reason."""
        raise NotImplementedError

    def cache_prefix(self, prefix: str) -> dict:
        """Prefill ``prefix`` into the prefix cache (generate with ``max_new_tokens=0``); its meta_info."""
        return self.generate(prefix, {"max_new_tokens": 0})["meta_info"]

    def score(self, prompt: str, continuations: list, unconditional: bool = False, lora_path=None) -> list:
        """Per continuation: ``{"token_ids": [...], "logprobs": [...], "texts": [...] (optional),
        "unconditional_logprobs": [...] (when asked)}``, the logprobs of its tokens given ``prompt``,
        under the LoRA adapter ``lora_path`` (None: the base model)."""
        raise NotImplementedError

    def select(self, prompt: str, choices: list, choices_method: ChoicesMethod, lora_path=None) -> ChoicesDecision:
        """Score every choice after ``prompt`` (prefix prefilled once) and decide with ``choices_method``;
        ``lora_path``: the LoRA adapter scoring them (None: the base model)."""
        need_uncond = choices_method.requires_unconditional_logprobs
        scored = self.score(prompt, list(choices), unconditional=need_uncond,
                            **({"lora_path": lora_path} if lora_path else {}))
        entries, uncond = [], []
        for r in scored:
            texts = r.get("texts") or [None] * len(r["token_ids"])
            entries.append([[lp, tid, tx] for lp, tid, tx in zip(r["logprobs"], r["token_ids"], texts)])
            if need_uncond:
                ulps = list(r["unconditional_logprobs"])
                if len(ulps) == len(r["token_ids"]) - 1:  # the context-free first token may be omitted
                    ulps = [None] + ulps
                uncond.append([[lp, tid, tx] for lp, tid, tx in zip(ulps, r["token_ids"], texts)])
        return choices_method(choices=list(choices), normalized_prompt_logprobs=[mean_logprob(e) for e in entries],
                              input_token_logprobs=entries, output_token_logprobs=[[] for _ in choices],
                              unconditional_token_logprobs=uncond if need_uncond else None)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; False when the server refuses (requests running)."""
        raise NotImplementedError

    def get_server_info(self) -> dict:
        """Server configuration and counters."""
        raise NotImplementedError


class EngineBackend(Backend):
    """An in-process ``sglite.Engine`` as a frontend backend (calls go straight to the engine).

    The engine is thread-safe (its step loop runs in its own thread), so concurrent programs and
    fork branches are batched together by the engine's scheduler.
    """

    def __init__(self, engine):
        for attr in ("generate", "score", "model_info"):
            if not hasattr(engine, attr):
                raise TypeError(f"EngineBackend needs an engine with .{attr}(), got {type(engine).__name__}")
        self.engine = engine
        self._template: Optional[ChatTemplate] = None
        self._lock = threading.Lock()

    def get_chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                self._template = ChatTemplate.from_model_info(self.engine.model_info())
            return self._template

    def _input(self, prompt: str) -> dict:
        if prompt == "":
            return {"input_ids": [start_token_id(self.engine.model_info())]}
        return {"prompt": prompt}

    def generate(self, prompt, sampling_params, **logprob):
        return self.engine.generate(**self._input(prompt), sampling_params=dict(sampling_params),
                                    **logprob_kwargs(**logprob))

    def generate_stream(self, prompt, sampling_params, **logprob):
        return self.engine.generate(**self._input(prompt), sampling_params=dict(sampling_params), stream=True,
                                    **logprob_kwargs(**logprob))

    def score(self, prompt, continuations, unconditional=False, lora_path=None):
        return self.engine.score(prompt, list(continuations), unconditional=unconditional, lora_path=lora_path)

    def cache_prefix(self, prefix: str) -> dict:
        return self.engine.cache_prefix(prefix)  # Engine.cache_prefix: {"prompt_tokens", "cached_tokens"}

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def __repr__(self):
        return f"EngineBackend({type(self.engine).__name__})"


def as_backend(obj) -> Backend:
    """A Backend from a Backend, a ``Runtime`` (its endpoint), an Engine-like object, or an
    ``http(s)://`` URL.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(obj, Backend):
        return obj
    if isinstance(getattr(obj, "endpoint", None), Backend):  # sglite.Runtime (a server in a child process)
        return obj.endpoint
    if isinstance(obj, str) and obj.startswith(("http://", "https://")):
        from .runtime_endpoint import RuntimeEndpoint
        return RuntimeEndpoint(obj)
    if hasattr(obj, "generate") and hasattr(obj, "score"):
        return EngineBackend(obj)
    raise TypeError(f"not a backend: {obj!r} (expected a Backend, an sglite.Engine or a server URL)")
