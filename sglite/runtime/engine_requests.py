"""RequestBuilder: validates and tokenizes user input into scheduler ``Req`` objects.

Everything that can be wrong with a request is caught here, in the caller's thread, before
anything reaches the scheduler: sampling params, prompt shape, length limits, grammars (compiled
here, off the scheduler thread, and cached by the grammar backend).
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config import EngineConfig
from ..errors import CapacityError, InvalidRequestError, context_length_message
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .tokenizer import check_text
from .engine_protocol import base_model_only, base_rids, sample_rid, sample_seed
from .logprob_options import NO_LOGPROBS, LogprobOptions
from .req import Req


@dataclass
class Batch:
    """Requests built from one generate call. ``outputs`` are the user-visible ones, in order."""

    all_reqs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    is_list: bool = False

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)


@dataclass
class ScoreSpec:
    """Inputs of a scoring batch and how to read its results back."""

    input_ids: list
    sampling_params: list
    logprob_start_lens: list
    texts: list
    n_cont: int
    unconditional: bool
    prompt_ids: list

    def collect(self, outs: list) -> list[dict]:
        res = []
        for i, text in enumerate(self.texts):
            o = outs[i]
            start = self.logprob_start_lens[i]
            toks = self.input_ids[i][start:]
            lps = [e[0] for e in o["meta_info"]["input_token_logprobs"]][-len(toks):] if toks else []
            item = {"text": text, "token_ids": toks, "logprobs": lps}
            if self.unconditional:
                u = outs[self.n_cont + i]["meta_info"]["input_token_logprobs"]
                item["unconditional_logprobs"] = [e[0] for e in u]
            res.append(item)
        return res


async def prepare_within(pool, fn: Callable, budget: float, field: str, what: str):
    """``fn()`` on the thread ``pool`` (so the caller's event loop never computes), awaited for at
    most ``budget`` seconds. ``what`` names the work in the error.

    Raises:
        InvalidRequestError: over the budget, naming ``field`` and ``request_prep_timeout`` (the
            abandoned call finishes in the pool and its result is dropped: nothing is scheduled).
        Whatever ``fn`` raises.
    """
    fut = asyncio.get_running_loop().run_in_executor(pool, fn)
    try:
        return await asyncio.wait_for(fut, timeout=budget)
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"{field}: preparing the request ({what}) took over request_prep_timeout="
                                  f"{budget} s (--request-prep-timeout)", field=field) from None


CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "lark", "structural_tag", "stop_regex")


def prep_field(prompt, input_ids, sampling_params) -> str:
    """The request field a slow preparation is blamed on: the first constraint field given (its
    grammar or regex is what can take long), else the prompt field."""
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for sp in sps:
        if isinstance(sp, dict):
            for name in CONSTRAINT_FIELDS:
                if sp.get(name) is not None:
                    return name
    return "input_ids" if prompt is None and input_ids is not None else "text"


class RequestBuilder:
    """Turns ``generate`` arguments into validated :class:`Req` objects."""

    def __init__(self, config: EngineConfig, tokenizer, runner, rng):
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.rng = rng
        self.lora = None  # the engine's sglite.lora.LoraManager (None: no adapters served)
        self._grammar = None
        self._grammar_lock = threading.Lock()  # requests are built on several preparation threads

    # ------------------------------------------------------------------ grammar
    @property
    def grammar_backend(self):
        """The grammar backend named by ``config.grammar_backend`` (built on first use).

        ``sglite`` (ours); ``llguidance`` / ``xgrammar`` for comparison when installed (ValueError
        naming the pip package otherwise).
        """
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = self._make_grammar_backend()
        return self._grammar

    def _make_grammar_backend(self):
        name = self.config.grammar_backend
        eos = set(self.tokenizer.eos_token_ids)
        if name == "sglite":
            from ..constrained import GrammarBackend, TokenizerInfo
            info = TokenizerInfo.from_hf(self.tokenizer.hf, self.runner.vocab_size, eos)
            return GrammarBackend(info, whitespace_pattern=self.config.constrained_json_whitespace_pattern,
                                  json_schema_strict=self.config.json_schema_strict)
        from ..constrained.external import make_backend
        return make_backend(name, self.tokenizer.hf, self.runner.vocab_size, eos)

    def compile_grammar(self, sp: SamplingParams):
        """Compiled grammar of ``sp``'s constraint, or None. Raises GrammarError."""
        c = sp.constraint
        if c is None:
            return None
        kind, spec = c
        return self.grammar_backend.compile(kind, spec)

    # ------------------------------------------------------------------ helpers
    def _ids(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("exactly one of prompt (text) and input_ids must be given", field="text")
        if prompt is not None:
            is_list = isinstance(prompt, list)
            items = prompt if is_list else [prompt]
            if not items:
                raise InvalidRequestError("text: empty batch", field="text")
            for p in items:
                if not isinstance(p, str):
                    raise InvalidRequestError(f"text: prompts must be strings, got {type(p).__name__}", field="text")
                check_text(p, "text")
            return [self.tokenizer.encode_prompt(p) for p in items], is_list
        if not isinstance(input_ids, list) or not input_ids:
            raise InvalidRequestError("input_ids: must be a non-empty list of token ids (or of lists)", field="input_ids")
        is_list = isinstance(input_ids[0], list)
        items = input_ids if is_list else [input_ids]
        V = self.runner.vocab_size
        for ids in items:
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in ids):
                raise InvalidRequestError(f"input_ids: entries must be token ids in [0, {V})", field="input_ids")
        return [list(x) for x in items], is_list

    def _check_prompt_count(self, prompt, input_ids) -> None:
        """Refuse a prompt list longer than ``max_sequences_per_request`` before tokenizing it."""
        cap = self.config.max_sequences_per_request
        if isinstance(prompt, list) and len(prompt) > cap:
            raise InvalidRequestError(f"text: {len(prompt)} prompts exceed max_sequences_per_request={cap} "
                                      "(--max-sequences-per-request)", field="text")
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list) and len(input_ids) > cap:
            raise InvalidRequestError(f"input_ids: {len(input_ids)} prompts exceed max_sequences_per_request={cap} "
                                      "(--max-sequences-per-request)", field="input_ids")

    def _check_fanout_and_stops(self, sps: list[SamplingParams]) -> None:
        """Prompts x ``n`` within ``max_sequences_per_request``; ``stop`` / ``stop_regex`` within
        ``max_stop_strings`` entries of at most ``max_stop_string_length`` characters."""
        c = self.config
        total = sum(sp.n for sp in sps)
        if total > c.max_sequences_per_request:
            raise InvalidRequestError(f"n: {len(sps)} prompt(s) x n make {total} sequences, over "
                                      f"max_sequences_per_request={c.max_sequences_per_request} "
                                      "(--max-sequences-per-request)", field="n")
        for sp in sps:
            for name in ("stop", "stop_regex"):
                entries = getattr(sp, name) or ()
                if len(entries) > c.max_stop_strings:
                    raise InvalidRequestError(f"{name}: {len(entries)} entries exceed max_stop_strings="
                                              f"{c.max_stop_strings} (--max-stop-strings)", field=name)
                longest = max((len(e) for e in entries), default=0)
                if longest > c.max_stop_string_length:
                    raise InvalidRequestError(f"{name}: an entry of {longest} characters exceeds "
                                              f"max_stop_string_length={c.max_stop_string_length} "
                                              "(--max-stop-string-length)", field=name)

    def _check_len(self, ids: list[int], sp: SamplingParams) -> None:
        ctx, cap = self.runner.context_length, self.runner.max_total_tokens
        if not ids:
            raise InvalidRequestError("text: the prompt is empty (0 tokens)", field="text")
        if len(ids) >= ctx:
            raise CapacityError(context_length_message(len(ids), ctx), field="prompt")
        if len(ids) + sp.max_new_tokens > ctx:
            raise CapacityError(context_length_message(len(ids), ctx, sp.max_new_tokens), field="max_new_tokens")
        if len(ids) + sp.max_new_tokens > cap - 2 * self.config.page_size:
            raise CapacityError(f"max_new_tokens: prompt + max_new_tokens ({len(ids) + sp.max_new_tokens}) exceeds "
                                f"the KV pool ({cap} tokens)", field="max_new_tokens")

    def _req(self, rid, ids, sp, sink, grammar, seed, **kw) -> Req:
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=sp.stop or (),
            stop_regex=sp.stop_regex or (), no_stop_trim=sp.no_stop_trim,
            stop_regex_timeout=self.config.stop_regex_timeout)
        return Req(rid=rid, input_ids=ids, params=sp, sink=sink, seed=seed,
                   grammar=grammar.matcher() if grammar is not None else None, detok=detok, **kw)

    def _prefill_only(self, rid: str, ids: list[int]) -> Req:
        """A request that only prefills ``ids`` into the radix cache (no output, no sink)."""
        return self._req(rid, list(ids), SamplingParams(max_new_tokens=0), lambda ev: None, None, 0)

    def _adapters(self, lora_path, n: int) -> list:
        """The LoRA adapter of each of ``n`` prompts (None: the base model) from ``lora_path``
        (a name, or a list of names, one per prompt). Raises InvalidRequestError naming
        ``lora_path``."""
        paths = lora_path if isinstance(lora_path, list) else [lora_path] * n
        if len(paths) != n:
            raise InvalidRequestError(f"lora_path: {len(paths)} given for {n} prompts", field="lora_path")
        if self.lora is None:
            return base_model_only(paths, n)
        return [self.lora.resolve(p) for p in paths]

    # ------------------------------------------------------------------ public
    def build(self, prompt, sampling_params, input_ids, rid, sink_factory: Callable, *,
              logprobs: LogprobOptions = NO_LOGPROBS, logprob_start_len=None, stream=False,
              shared_prefix: Optional[list[int]] = None, lora_path=None) -> Batch:
        """Validate everything, then build the requests of one generate call.

        ``logprobs`` are the call's options; ``logprob_start_len`` (a list, one per prompt)
        overrides their start per prompt. ``n > 1`` samples of a prompt wait for one prefill-only
        request of it (``Req.blocked_by``), so they share its KV; ``shared_prefix`` is prefilled
        once the same way before every request of the call. ``lora_path``: the LoRA adapter's
        name (or one per prompt; None: the base model).

        Raises:
            InvalidRequestError, GrammarError, CapacityError.
        """
        self._check_prompt_count(prompt, input_ids)
        all_ids, is_list = self._ids(prompt, input_ids)
        n_in = len(all_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n_in
        if len(sps) != n_in:
            raise InvalidRequestError(f"sampling_params: {len(sps)} given for {n_in} prompts", field="sampling_params")
        sps = [SamplingParams.from_dict(d, self.runner.vocab_size) for d in sps]
        self._check_fanout_and_stops(sps)
        starts = logprob_start_len if logprob_start_len is not None else logprobs.logprob_start_len
        starts = starts if isinstance(starts, list) else [starts] * n_in
        if len(starts) != n_in:
            raise InvalidRequestError(f"logprob_start_len: {len(starts)} given for {n_in} prompts",
                                      field="logprob_start_len")
        rids = base_rids(rid, n_in, is_list)  # one base rid per prompt
        loras = self._adapters(lora_path, n_in)
        opts, grammars = [], []
        for ids, sp, st in zip(all_ids, sps, starts):
            self._check_len(ids, sp)
            o = LogprobOptions.from_args(logprobs.return_logprob, st, logprobs.top_logprobs_num,
                                         logprobs.token_ids_logprob, self.runner.vocab_size)
            o.check_prompt(len(ids))
            opts.append(o)
            grammars.append(self.compile_grammar(sp))
        batch = Batch(is_list=is_list or any(sp.n > 1 for sp in sps))
        cache_on = not self.config.disable_radix_cache
        shared = None
        if shared_prefix and cache_on:
            shared = self._prefill_only(uuid.uuid4().hex + "-shared", shared_prefix)
            batch.all_reqs.append(shared)
        for base, ids, sp, o, g, lora in zip(rids, all_ids, sps, opts, grammars, loras):
            seed = sp.sampling_seed if sp.sampling_seed is not None else self.rng.getrandbits(62)
            blocker = shared
            if sp.n > 1 and cache_on:
                blocker = self._prefill_only(base + "-prefix", ids)
                blocker.blocked_by, blocker.lora = shared, lora
                batch.all_reqs.append(blocker)
            for j in range(sp.n):
                r = self._req(base if sp.n == 1 else sample_rid(base, j), ids, sp, sink_factory(len(batch.outputs)),
                              g, sample_seed(seed, j), logprobs=o, stream=stream, lora=lora)
                r.blocked_by = blocker
                batch.all_reqs.append(r)
                batch.outputs.append(r)
        return batch

    def prefix_request(self, prompt, input_ids, sink) -> Req:
        """The prefill-only request of :meth:`Engine.cache_prefix` (validated like a prompt).

        Raises:
            InvalidRequestError, CapacityError: not one prompt, or one that cannot fit.
        """
        all_ids, is_list = self._ids(prompt, input_ids)
        if is_list:
            raise InvalidRequestError("cache_prefix: give one prefix (a string or one list of ids)", field="text")
        sp = SamplingParams(max_new_tokens=0)
        self._check_len(all_ids[0], sp)
        r = self._prefill_only(uuid.uuid4().hex + "-cache", all_ids[0])
        r.sink = sink
        return r

    def score_requests(self, prompt: str, continuations: list[str], unconditional: bool) -> ScoreSpec:
        """Token ids and logprob start positions for :meth:`Engine.score`."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt: must be a string", field="prompt")
        if not isinstance(continuations, list) or not continuations or not all(isinstance(c, str) for c in continuations):
            raise InvalidRequestError("continuations: must be a non-empty list of strings", field="continuations")
        p = self.tokenizer.encode_prompt(prompt)
        ids, starts = [], []
        for c in continuations:
            full = self.tokenizer.encode_prompt(prompt + c)
            k = 0
            while k < min(len(p), len(full)) and p[k] == full[k]:
                k += 1
            ids.append(full)
            starts.append(k)
        sps = [{"max_new_tokens": 0}] * len(ids)
        texts = list(continuations)
        if unconditional:
            for full, k in zip(list(ids), list(starts)):
                ids.append(full[k:] or full[-1:])
                starts.append(0)
            sps = [{"max_new_tokens": 0}] * len(ids)
        # the shared prompt is prefilled once: a prefill-only request goes first and the scored
        # requests wait for it (see Req.blocked_by), so they all hit its cached prefix
        return ScoreSpec(ids, sps, starts, texts, len(continuations), unconditional, p)
