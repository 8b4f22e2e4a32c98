"""The grammar walk of speculative drafts: which draft tokens a request's grammar allows, the
jump-forward text that follows a token as always-kept drafts, and where a copied JSON string
value closes (issue 17: "draft tokens are walked through the grammar matcher, a draft token the
grammar forbids ends the draft, ... jump-forward strings act as free, always-accepted drafts").

Owned by :class:`~.decoder.SpecDecoder` (one per scheduler): it walks each step's candidate
chains before the policy cuts them; :func:`whole_forced` keeps a closing token and its forced text
together through those cuts; :meth:`GrammarWalk.learn_close` learns from verification how the
model merges a closing quote with the text after it.
"""
from __future__ import annotations

from typing import Optional

import torch

FORCED = "forced"  # draft source of jump-forward tokens (kept whenever the token before them is)
CLOSE = "close"  # draft source of a `"` closing a copied JSON string value at a word boundary
CLOSE_MIN_RATE = 0.5  # close copied values at word boundaries only while P(a value ends there) >= this


def whole_forced(sources: list, n: int, up: bool) -> int:
    """A chain's draft length ``n`` moved out of its jump-forward tail (``sources`` per token,
    ``FORCED`` at the end): the token forcing the text and the text go together or not at all;
    ``up``: the whole chain, else the part before that token."""
    f = next((i for i, s in enumerate(sources) if s == FORCED), len(sources))
    if f == len(sources) or n < f or n >= len(sources):
        return n
    return len(sources) if up else max(0, f - 1)


class GrammarWalk:
    """Walks draft chains through a request's grammar matcher (the matcher is always left where
    it was).

    Args:
        out: the scheduler's ``OutputProcessor`` (tokenizer, ``jump_tokens``, whether
            jump-forward is on); None: no tokenizer (no jump-forward, no closing guesses).
        sampler: the scheduler's ``Sampler`` (``words``: int32 words of a bitmask row).
        token_text: the decoder's :class:`~.text_lookup.TokenText` (cached per-token text,
            ``starts_word``, the fast ``encode``); None with ``out``.

    Attributes:
        close_values: propose closing tokens at word boundaries (on by default).
    """

    def __init__(self, out, sampler, token_text):
        self.out, self.sampler, self.text = out, sampler, token_text
        self.close_values = True
        self._quote: Optional[int] = None  # token id of a lone `"` (-1: none), looked up once
        self._close_merge: Optional[int] = None  # characters of the model's own string-closing token

    def quote_id(self) -> Optional[int]:
        """The token of a lone ``"`` (None when the tokenizer has none)."""
        if self._quote is None:
            ids = self.text.encode('"')
            self._quote = ids[0] if len(ids) == 1 else -1
        return self._quote if self._quote >= 0 else None

    def value_ends_before(self, chain: list[int], i: int) -> bool:
        """Whether a value copied from the prompt likely ends before ``chain[i]`` (``i > 0``):
        the token starts a new word, or is punctuation followed by one (a sentence's end; the
        dot inside `example.org` is not)."""
        if i == 0:
            return False
        if self.text.starts_word(chain[i]):
            return True
        piece = self.text.text([chain[i]])
        return bool(piece) and piece[0] in ".,;:!?)" and i + 1 < len(chain) and self.text.starts_word(chain[i + 1])

    def closing_token(self, g, quote: int) -> Optional[int]:
        """The token that would close the grammar's current JSON string as the model writes it,
        or None where ``"`` cannot close here. Candidates: the single tokens spelling ``"`` plus
        a prefix of the text the grammar then forces (`"`, `",`, `","` before `"email":"`): the
        one merging as many characters as the model did when it last refused a closing draft
        (models differ in how they merge the boundary), else the canonical first token of the
        whole. ``g`` is left where it was."""
        if not g.accept_token(quote):
            return None
        try:
            s = g.find_jump_forward_string() if hasattr(g, "find_jump_forward_string") else ""
        finally:
            g.rollback(1)
        if not s:
            return quote
        enc = self.text.encode
        if self._close_merge is not None and self._close_merge <= len(s) + 1:
            ids = enc('"' + s[:self._close_merge - 1])
            if len(ids) == 1:
                return ids[0]
        return enc('"' + s)[0]

    def walk(self, r, chains: list[list[int]], need_masks: bool = True,
                      sources: Optional[list] = None, limit: int = 1 << 30, close: bool = True,
                      close_points: Optional[list] = None
                      ) -> tuple[list[list[int]], Optional[list[torch.Tensor]]]:
        """The longest prefix of each chain the grammar allows, and (``need_masks``: sampled
        requests) the bitmask rows of the verify step: ``[root mask [1, W]] + [one [len, W] per
        chain]`` (the mask after each node). Greedy requests need no masks (None): verification
        checks the argmax against the matcher and fills a mask only where it is refused
        (:func:`.verify.greedy_walk`). The matcher is left where it was, also when it raises.

        With ``sources`` (per chain, per token; updated in place) two more things happen:

        * **Jump-forward text as free drafts** (when jump-forward is on): after a draft token
          that makes the grammar force text, the plain run appends that text's tokens
          (:meth:`OutputProcessor.jump_tokens`) without asking the model. The chain ends with
          those tokens appended, source ``FORCED``: kept whenever the token before them is,
          never checked against the model (the issue's "jump-forward strings act as free,
          always-accepted drafts"), so the verify row after them predicts what the plain run's
          next step predicts (e.g. the first token of the next JSON value). Without ``sources``
          or room within ``limit`` tokens the chain ends *before* such a token instead (a verify
          row after it would predict text the plain run never samples).
        * **Closing a copied value**: where a prompt copy inside a JSON string reaches a word
          boundary (:meth:`value_ends_before`) and the grammar lets ``"`` close the string, the
          chain takes the closing token there (:meth:`closing_token`, source ``CLOSE``) and
          ends after it and its forced text: extracted values end where the prompt's phrase
          goes on (`Hamburg` + `",` + `"job":"` instead of `Hamburg` + ` and works`).
          With ``close`` False (values of this request tend to go on past word boundaries:
          copied sentences) the copy goes on instead, and ``close_points`` (a list, filled with
          one list per chain) gets the chain positions where a closing token would have gone, so
          that verification can learn whether the model closed there (:meth:`close_outcomes`).
        """
        g, W = r.grammar, self.sampler.words
        jump = bool(getattr(self.out, "enable_jump_forward", False)) and hasattr(g, "find_jump_forward_string")
        quote = self.quote_id() if sources is not None and self.close_values else None
        masks = None
        if need_masks:
            masks = [torch.full((1, W), -1, dtype=torch.int32)]
            g.fill_next_token_bitmask(masks[0], 0)
        kept_chains = []
        for b, c in enumerate(chains):
            rows: list[torch.Tensor] = []
            out: list[int] = []
            points: list[int] = []
            if close_points is not None:
                close_points.append(points)
            walked = 0
            try:
                for i, t in enumerate(c):
                    closing = False
                    if g.is_terminated():
                        break
                    tok = None
                    if quote is not None and self.value_ends_before(c, i):
                        if close:
                            tok = self.closing_token(g, quote)
                        elif g.accept_token(quote):  # a close could go here (which merge does not matter)
                            g.rollback(1)
                            points.append(len(out))
                    if tok is not None and tok != t and g.accept_token(tok):
                        t, closing = tok, True
                    elif not g.accept_token(t):
                        break
                    walked += 1
                    forced = self.out.jump_tokens(g) if jump and g.find_jump_forward_string() else []
                    if forced and (sources is None or len(out) + 1 + len(forced) > limit):
                        g.rollback(1)  # see above: the draft ends before a token that forces text
                        walked -= 1
                        break
                    for j, tok in enumerate([t] + forced):
                        if j and not g.accept_token(tok):  # jump_tokens checked them on a fork
                            raise RuntimeError(f"grammar refused its own jump-forward token {tok}")
                        walked += j > 0
                        out.append(tok)
                        if need_masks:
                            rows.append(torch.full((1, W), -1, dtype=torch.int32))
                            # after the grammar's end the request ends at this token: the row after it
                            # is drawn from and dropped, so it stays unconstrained (a terminated
                            # matcher's EOS-only row has no mass under min_new_tokens)
                            if not g.is_terminated():
                                g.fill_next_token_bitmask(rows[-1], 0)
                    if closing or forced:
                        n = len(out) - len(forced)
                        sources[b] = list(sources[b][:n - 1]) + [CLOSE if closing else sources[b][n - 1]] + [FORCED] * len(forced)
                        break
            finally:
                g.rollback(walked)
            kept_chains.append(out)
            if masks is not None:
                masks.append(torch.cat(rows) if rows else torch.empty((0, W), dtype=torch.int32))
        return kept_chains, masks

    def close_outcomes(self, points: list[int], a: int, tokens: list[int]) -> tuple[int, int]:
        """(closes that would have been kept, closes tried) at the word boundaries ``points`` of a
        chain verified without closing drafts (:meth:`walk` with ``close`` False) that kept ``a``
        draft tokens and appended ``tokens``: a boundary before ``a`` is a close the model
        refused (the value went on); at a boundary at ``a`` the model's own token decides: a
        close kept when it starts with ``"`` (it closed the string there, in whatever merge),
        else refused. Boundaries after ``a`` teach nothing."""
        refused = sum(1 for i in points if i < a)
        if a not in points or a >= len(tokens):
            return 0, refused
        ended = self.text.text([tokens[a]]).startswith('"')
        return int(ended), refused + 1

    def learn_close(self, srcs: list, a: int, tokens: list[int]) -> bool:
        """A closing draft (source ``CLOSE``) refused where the model closed the string with a
        token of its own (`",` for our `"`): remember how many characters it merges, and return
        True (the value did end there)."""
        if a < len(srcs) and srcs[a] == CLOSE and a < len(tokens):
            piece = self.text.text([tokens[a]])
            if piece.startswith('"') and len(piece) <= 3:
                self._close_merge = len(piece)
                return True
        return False
