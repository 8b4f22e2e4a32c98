"""RequestBuilder: validates and tokenizes user input into scheduler ``Req`` objects.

Everything that can be wrong with a request is caught here, in the caller's thread, before
anything reaches the scheduler: sampling params, prompt shape, length limits, grammars (compiled
here, off the scheduler thread, and cached by the grammar backend).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config import EngineConfig
from ..errors import CapacityError, InvalidRequestError
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
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


class RequestBuilder:
    """Turns ``generate`` arguments into validated :class:`Req` objects."""

    def __init__(self, config: EngineConfig, tokenizer, runner, rng):
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.rng = rng
        self._grammar = None

    # ------------------------------------------------------------------ grammar
    @property
    def grammar_backend(self):
        """The grammar backend named by ``config.grammar_backend`` (built on first use).

        ``sglite`` (ours); ``llguidance`` / ``xgrammar`` for comparison when installed (ValueError
        naming the pip package otherwise).
        """
        if self._grammar is None:
            name = self.config.grammar_backend
            eos = set(self.tokenizer.eos_token_ids)
            if name == "sglite":
                from ..constrained import GrammarBackend, TokenizerInfo
                info = TokenizerInfo.from_hf(self.tokenizer.hf, self.runner.vocab_size, eos)
                self._grammar = GrammarBackend(
                    info, whitespace_pattern=self.config.constrained_json_whitespace_pattern)
            else:
                from ..constrained.external import make_backend
                self._grammar = make_backend(name, self.tokenizer.hf, self.runner.vocab_size, eos)
        return self._grammar

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
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise InvalidRequestError(f"text: not valid Unicode text ({exc.reason} at {exc.start})",
                                              field="text") from None
            return [self.tokenizer.encode(p) for p in items], is_list
        if not isinstance(input_ids, list) or not input_ids:
            raise InvalidRequestError("input_ids: must be a non-empty list of token ids (or of lists)", field="input_ids")
        is_list = isinstance(input_ids[0], list)
        items = input_ids if is_list else [input_ids]
        V = self.runner.vocab_size
        for ids in items:
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in ids):
                raise InvalidRequestError(f"input_ids: entries must be token ids in [0, {V})", field="input_ids")
        return [list(x) for x in items], is_list

    def _check_len(self, ids: list[int], sp: SamplingParams) -> None:
        ctx, cap = self.runner.context_length, self.runner.max_total_tokens
        if not ids:
            raise InvalidRequestError("text: the prompt is empty (0 tokens)", field="text")
        if len(ids) >= ctx:
            raise CapacityError(f"prompt: {len(ids)} tokens, the context length is {ctx}", field="prompt")
        if len(ids) + sp.max_new_tokens > ctx:
            raise CapacityError(f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                                f"exceeds the context length {ctx}", field="max_new_tokens")
        if len(ids) + sp.max_new_tokens > cap - 2 * self.config.page_size:
            raise CapacityError(f"max_new_tokens: prompt + max_new_tokens ({len(ids) + sp.max_new_tokens}) exceeds "
                                f"the KV pool ({cap} tokens)", field="max_new_tokens")

    def _req(self, rid, ids, sp, sink, grammar, seed, **kw) -> Req:
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=sp.stop or (),
            stop_regex=sp.stop_regex or (), no_stop_trim=sp.no_stop_trim)
        return Req(rid=rid, input_ids=ids, params=sp, sink=sink, seed=seed,
                   grammar=grammar.matcher() if grammar is not None else None, detok=detok, **kw)

    # ------------------------------------------------------------------ public
    def build(self, prompt, sampling_params, input_ids, rid, sink_factory: Callable, *, return_logprob=False,
              logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
              shared_prefix: Optional[list[int]] = None) -> Batch:
        """Validate everything, then build the requests of one generate call.

        Raises:
            InvalidRequestError, GrammarError, CapacityError.
        """
        all_ids, is_list = self._ids(prompt, input_ids)
        n_in = len(all_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n_in
        if len(sps) != n_in:
            raise InvalidRequestError(f"sampling_params: {len(sps)} given for {n_in} prompts", field="sampling_params")
        sps = [SamplingParams.from_dict(d, self.runner.vocab_size) for d in sps]
        starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * n_in
        rids = rid if isinstance(rid, list) else [rid] * n_in
        for name, vals in (("logprob_start_len", starts), ("rid", rids)):
            if len(vals) != n_in:
                raise InvalidRequestError(f"{name}: {len(vals)} given for {n_in} prompts", field=name)
        for r in rids:
            if r is not None and not isinstance(r, str):
                raise InvalidRequestError(f"rid: must be a string, got {type(r).__name__}", field="rid")
        if not isinstance(return_logprob, bool):
            raise InvalidRequestError("return_logprob: must be true or false", field="return_logprob")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise InvalidRequestError("top_logprobs_num: must be an integer in [0, 20]", field="top_logprobs_num")
        if token_ids_logprob is not None and not isinstance(token_ids_logprob, list):
            raise InvalidRequestError("token_ids_logprob: must be a list of token ids", field="token_ids_logprob")
        for t in token_ids_logprob or []:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.runner.vocab_size:
                raise InvalidRequestError(f"token_ids_logprob: {t!r} is not a token id", field="token_ids_logprob")
        grammars = []
        for ids, sp, st in zip(all_ids, sps, starts):
            self._check_len(ids, sp)
            if isinstance(st, bool) or not isinstance(st, int) or st < -1 or st > len(ids):
                raise InvalidRequestError(f"logprob_start_len: must be -1 or in [0, {len(ids)}], got {st!r}",
                                          field="logprob_start_len")
            grammars.append(self.compile_grammar(sp))
        batch = Batch(is_list=is_list or any(sp.n > 1 for sp in sps))
        shared = None
        if shared_prefix and not self.config.disable_radix_cache:
            shared = self._req(uuid.uuid4().hex + "-shared", list(shared_prefix), SamplingParams(max_new_tokens=0),
                               lambda ev: None, None, 0)
            batch.all_reqs.append(shared)
        for i, (ids, sp, st, g) in enumerate(zip(all_ids, sps, starts, grammars)):
            base = rids[i] if (isinstance(rids[i], str) and rids[i]) else uuid.uuid4().hex
            kw = dict(return_logprob=return_logprob, logprob_start_len=st, top_logprobs_num=top_logprobs_num,
                      token_ids_logprob=token_ids_logprob, stream=stream)
            seed = sp.sampling_seed % 2**62 if sp.sampling_seed is not None else self.rng.getrandbits(62)
            blocker = shared
            if sp.n > 1 and not self.config.disable_radix_cache:
                pre = SamplingParams(max_new_tokens=0)
                blocker = self._req(base + "-prefix", ids, pre, lambda ev: None, None, 0)
                blocker.blocked_by = shared
                batch.all_reqs.append(blocker)
            for j in range(sp.n):
                k = len(batch.outputs)
                r = self._req(base if sp.n == 1 else f"{base}-{j}", ids, sp, sink_factory(k), g,
                              (seed + 7919 * j) % (2**62), **kw)
                r.blocked_by = blocker
                batch.all_reqs.append(r)
                batch.outputs.append(r)
        return batch

    def score_requests(self, prompt: str, continuations: list[str], unconditional: bool) -> ScoreSpec:
        """Token ids and logprob start positions for :meth:`Engine.score`."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt: must be a string", field="prompt")
        if not isinstance(continuations, list) or not continuations or not all(isinstance(c, str) for c in continuations):
            raise InvalidRequestError("continuations: must be a non-empty list of strings", field="continuations")
        p = self.tokenizer.encode(prompt)
        ids, starts = [], []
        for c in continuations:
            full = self.tokenizer.encode(prompt + c)
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
