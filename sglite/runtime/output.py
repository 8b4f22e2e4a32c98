"""OutputProcessor: turns sampled tokens into text, finish reasons, logprob entries and events.

Per token: grammar advance → EOS / stop-token / stop-string / grammar-termination / length checks
→ jump-forward (SGLang paper §4, compressed FSM: a string the grammar forces is appended as its
canonical tokens, each passing the same checks, and computed by one extend step next time).
Events go to the request's ``sink``: partial ones for streaming requests, and one final event.
Each :class:`OutputEvent` carries only what is new since the request's previous event (text
piece, output ids, logprob entries); :class:`sglite.runtime.engine_stream.OutputAccumulator`
joins them back into SGLang's cumulative output dicts where those are wanted.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..constrained.tokenizer_info import SPECIAL_MARK
from .engine_stream import OutputEvent
from .req import FinishReason, Req


JUMP_CACHE = 4096  # forced strings whose canonical tokens are kept (JSON keys repeat)


class OutputProcessor:
    """Stateless helper of the scheduler (state lives on :class:`Req`; the only memory is a
    cache of forced strings' token ids). ``stream_interval``: a streaming request's partial event
    goes out once this many tokens are unsent (SGLang's ``--stream-interval``); final events always."""

    def __init__(self, tokenizer, enable_jump_forward: bool = True, stream_interval: int = 1):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.eos = tokenizer.eos_token_ids
        self.enable_jump_forward = enable_jump_forward
        self._encoded: dict[str, list[int]] = {}  # forced string -> its canonical tokens

    # ------------------------------------------------------------------ logprobs
    def _entry(self, lp: float, tid: int) -> list:
        return [lp, tid, self.tokenizer.id_to_text(tid)]

    def _top(self, row: torch.Tensor, k: int) -> list:
        vals, ids = row.topk(k)
        return [self._entry(float(v), int(i)) for v, i in zip(vals.tolist(), ids.tolist())]

    def record_input_logprobs(self, r: Req, logits: torch.Tensor, in_rows: list) -> None:
        """Store logprobs of prompt tokens at ``in_rows`` = [(position, logits row)]."""
        if r.logprob_start_len == 0 and not r.input_token_logprobs:
            r.input_token_logprobs.append([None, r.input_ids[0], self.tokenizer.id_to_text(r.input_ids[0])])
            if r.top_logprobs_num:
                r.input_top_logprobs.append(None)
        if not in_rows:
            return
        idx = torch.tensor([row for _, row in in_rows])
        lps = torch.log_softmax(logits[idx], dim=-1)  # [k, V]
        for (p, _), lp in zip(in_rows, lps):
            tid = r.input_ids[p]
            r.input_token_logprobs.append(self._entry(float(lp[tid]), tid))
            if r.top_logprobs_num:
                r.input_top_logprobs.append(self._top(lp, r.top_logprobs_num))
            if r.token_ids_logprob:
                r.input_token_ids_logprobs.append([self._entry(float(lp[t]), t) for t in r.token_ids_logprob])

    # ------------------------------------------------------------------ tokens
    def _check(self, r: Req, tok: int, jumped: bool = False) -> Optional[FinishReason]:
        """Append one token, update text, return a finish reason or None."""
        p = r.params
        r.output_ids.append(tok)
        if r.first_token_time is None:
            r.first_token_time = time.perf_counter()
        if r.grammar is not None and not jumped:
            if not r.grammar.accept_token(tok):
                return FinishReason("abort", message=f"grammar rejected token {tok} (internal error)")
        if tok in self.eos and not p.ignore_eos:
            r.detok.flush()
            return FinishReason("stop", matched=tok)
        if p.stop_token_ids and tok in p.stop_token_ids:
            r.detok.flush()
            return FinishReason("stop", matched=tok)
        _, matched = r.detok.push([tok])
        if matched is not None:
            return FinishReason("stop", matched=matched)
        if r.detok.error is not None:  # the stop regexes' time budget is spent
            return FinishReason("abort", message=r.detok.error)
        if r.grammar is not None and r.grammar.is_terminated():
            r.detok.flush()
            return FinishReason("stop", matched=None)
        if len(r.output_ids) >= p.max_new_tokens:
            r.detok.flush()
            return FinishReason("length", length=p.max_new_tokens)
        return None

    def append_token(self, r: Req, tok: int, logprobs: Optional[torch.Tensor],
                     jump: bool = True) -> Optional[FinishReason]:
        """Process a sampled token (and any jump-forward that follows, unless ``jump`` is False:
        more accepted speculative tokens follow it). Returns the finish reason."""
        if logprobs is not None:
            r.output_token_logprobs.append(self._entry(float(logprobs[tok]), tok))
            if r.top_logprobs_num:
                r.output_top_logprobs.append(self._top(logprobs, r.top_logprobs_num))
            if r.token_ids_logprob:
                r.output_token_ids_logprobs.append([self._entry(float(logprobs[t]), t) for t in r.token_ids_logprob])
        reason = self._check(r, tok)
        if reason is None and r.grammar is not None and self.enable_jump_forward and not r.return_logprob and jump:
            reason = self._jump_forward(r)
        if reason is None and r.stream and self._stream_due(r):
            r.sink(self.event(r))
        return reason

    def _stream_due(self, r: Req) -> bool:
        """Whether ``stream_interval`` of the request's tokens are unsent (the ``output_ids``
        cursor :meth:`_new` advances at each event)."""
        return len(r.output_ids) - r.emitted.get("output_ids", 0) >= self.stream_interval

    def jump_tokens(self, grammar) -> list[int]:
        """The tokens jump-forward appends at the grammar's current state: the canonical tokens
        of the string it forces (none when it forces nothing). ``grammar`` is not advanced (the
        tokens are checked on a fork). Speculative decoding drafts these same tokens after a
        draft token that forces text, so a verify step stays what the plain run computes."""
        # a special-token opener (NUL + its text, see constrained.tokenizer_info) is never
        # jumped: its text would encode as other tokens; the grammar leaves the model the token
        s = grammar.find_jump_forward_string().split(SPECIAL_MARK, 1)[0]
        if not s:
            return []
        toks = self._encoded.get(s)
        if toks is None:
            toks = self.tokenizer.encode(s)
            if len(self._encoded) >= JUMP_CACHE:
                self._encoded.pop(next(iter(self._encoded)))
            self._encoded[s] = toks
        probe = grammar.fork()
        if not all(probe.accept_token(t) for t in toks[:-1]):
            return []
        # whether no token allowed at the last token's position reaches past its bytes: then the
        # boundary cannot merge with what follows and the last token is jumped too
        last_forced = probe.forces_token_text(toks[-1])
        if not probe.accept_token(toks[-1]):
            return []
        if not probe.is_terminated() and not last_forced:
            # leave the last token to the model: the canonical tokens of the forced string alone
            # often end where the model would have merged the boundary with what follows
            # (`name"` + `:` vs `name` + `":`), and keeping it would change the text
            toks = toks[:-1]
        return list(toks)

    def _jump_forward(self, r: Req) -> Optional[FinishReason]:
        for tok in self.jump_tokens(r.grammar):
            if not r.grammar.accept_token(tok):
                break
            reason = self._check(r, tok, jumped=True)
            if reason is not None:
                return reason
        return None

    # ------------------------------------------------------------------ events
    @staticmethod
    def _new(r: Req, name: str, entries: list) -> list:
        """Entries of ``entries`` not sent yet (advances the request's cursor for ``name``)."""
        k = r.emitted.get(name, 0)
        r.emitted[name] = len(entries)
        return entries[k:]

    def event(self, r: Req) -> OutputEvent:
        """The request's next event (what is new since its previous one); ``finish_reason`` None
        while running."""
        now = time.perf_counter()
        meta = {
            "id": r.rid,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "finish_reason": r.finished.to_dict() if r.finished else None,
            "e2e_latency": now - r.arrival,
            "ttft": (r.first_token_time - r.arrival) if r.first_token_time else None,
        }
        if r.spec is not None:  # speculative decoding: verify steps and accept lengths
            meta.update(r.spec.meta())
        if r.return_logprob:
            names = ["input_token_logprobs", "output_token_logprobs"]
            if r.top_logprobs_num:
                names += ["input_top_logprobs", "output_top_logprobs"]
            if r.token_ids_logprob:
                names += ["input_token_ids_logprobs", "output_token_ids_logprobs"]
            for name in names:
                meta[name] = self._new(r, name, getattr(r, name))
        text = r.detok.take() if r.detok is not None else ""
        return OutputEvent(text, self._new(r, "output_ids", r.output_ids), meta)

    def emit_final(self, r: Req) -> None:
        """Send the final event; never raises before the sink is called (callers wait on it)."""
        try:
            if r.finished.type != "stop" and r.detok is not None:
                r.detok.flush()
        finally:
            r.sink(self.event(r))
