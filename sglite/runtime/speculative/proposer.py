"""Drafting: which source proposes which draft tokens, behind one small :class:`Proposer` Protocol.

A proposer gets a step's eligible decoding entries and returns, per entry, candidate *chains*:
draft token ids with the source of each token (``ngram<n>``, ``text``, ``text_word``,
``text_cont``, ``text_weak``, ``model``: the names :class:`.policy.AcceptModel` learns keep
probabilities for). Chains of one entry have distinct first tokens and come strongest first;
with more than one the decoder verifies them as a token tree (:mod:`.tree`). What the decoder
does with them after (the grammar walk, :mod:`.grammar_walk`; the step's draft budget,
:mod:`.budget`; KV, tree rows, verification) is the same for every proposer, so a new draft
source (EAGLE or Medusa heads) is one more class here.

* :class:`LookupProposer` (``NGRAM``) — n-gram continuations of the request's own prompt and
  output (:class:`.ngram.NgramIndex`) plus text-level matches of its tail in the prompt,
  re-encoded (:class:`.text_lookup.TextLookup`: values copied into JSON after a ``"`` where the
  prompt had a space), cut and gated by the :class:`.budget.DraftBudget`.
* :class:`DraftModelProposer` (``STANDALONE``) — greedy steps of a small draft model
  (:class:`.draft_model.DraftModel`), batched over the step's requests.
* :class:`EntryProposer` — a per-entry function as a proposer (test oracles, simple heads).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol

from ..step_plan import StepEntry
from .budget import DraftBudget
from .state import SpecState
from .text_lookup import CONT_CHARS_PER_TOKEN, TextLookup, TokenText

TREE_BRANCHES = 3  # most n-gram candidates (token-tree chains) verified per request and step
TEXT_TAIL_TOKENS = 12  # output tokens decoded as the tail of a text-level lookup
TEXT_MIN_CHARS = 3  # a text match shorter than this (and not word-aligned) is no draft
TEXT_TRUST_CHARS = 8  # a text match this long drafts the full length, whatever the cap
STRONG_NGRAM = 3  # an n-gram match this long looks for drafts whatever the request's backoff

Chain = tuple[list[int], list[str]]  # draft token ids, the source of each
# a head tree's chain may carry a third item: (parent chain, parent depth), :class:`.tree.TreeDraft`'s parents


class Proposer(Protocol):
    """A draft source."""

    def propose(self, entries: list[StepEntry], rooms: list[int], budget: DraftBudget) -> Iterable[list[Chain]]:
        """Candidate chains for each of ``entries`` (eligible decoding entries of one step).

        Args:
            entries: the entries to draft for, in step order.
            rooms: per entry, the most draft tokens it can take (its ``max_new_tokens``, the
                context, the configured most and the step's rows left).
            budget: the step's :class:`.budget.DraftBudget` (lookup caps and gates).
        Returns:
            per entry, in order (possibly lazily), its chains ``(token ids, per-token sources)``:
            distinct first tokens, strongest first; ``[]`` for none. A proposer may create
            ``req.spec`` (:class:`.SpecState`) and changes it only through its methods.
        """


class EntryProposer:
    """A proposer from a function ``fn(entry) -> list[Chain]``, called once per entry in step
    order (the rooms and the budget are the function's own business)."""

    def __init__(self, fn: Callable[[StepEntry], list[Chain]]):
        self.fn = fn

    def propose(self, entries: list[StepEntry], rooms: list[int], budget: DraftBudget) -> Iterator[list[Chain]]:
        return (self.fn(e) for e in entries)


class DraftModelProposer:
    """``STANDALONE``: one greedy chain per request from a :class:`.draft_model.DraftModel`; the
    step's rows left are shared evenly between the requests (at least one each)."""

    def __init__(self, model):
        self.model = model

    def propose(self, entries: list[StepEntry], rooms: list[int], budget: DraftBudget) -> list[list[Chain]]:
        share = max(1, budget.rows_left // len(entries))
        found = self.model.propose([e.req for e in entries], [min(share, k) for k in rooms])
        return [[(d, ["model"] * len(d))] if d else [] for d in found]


class LookupProposer:
    """``NGRAM``: token n-gram continuations (``ngram<n>``) and text-level prompt matches
    (``text`` / ``text_weak``), strongest match (in characters) first, distinct first tokens.

    With the measured-cost budget the lookups are gated, cheapest first: the n-gram lookup (a few
    dict probes) runs every step; the text lookup follows the request's backoff
    (:meth:`.SpecState.may_look`: after a run of fruitless looks, one look every 2, 4, 8 steps,
    unless an n-gram of ``STRONG_NGRAM`` tokens matches, grammar text was forced, or the request
    has a grammar); then :func:`.policy.may_pay` on the candidates' sources, before a text match
    is re-encoded: where even the optimistic bound does not pay, no chain is built.

    Args:
        token_text: per-token text of the tokenizer (:class:`.text_lookup.TokenText`).
        out: the scheduler's ``OutputProcessor`` (its ``tokenizer`` decodes a prompt once).
        width: most chains per request (``TREE_BRANCHES`` where token trees fit: page size 1).
    """

    def __init__(self, token_text: TokenText, out, width: int = TREE_BRANCHES):
        self.token_text, self.out, self.width = token_text, out, width

    def propose(self, entries: list[StepEntry], rooms: list[int], budget: DraftBudget) -> Iterator[list[Chain]]:
        return (self.lookup(e, k, budget) for e, k in zip(entries, rooms))

    def lookup(self, e: StepEntry, k: int, budget: DraftBudget) -> list[Chain]:
        """The chains of one entry with room for ``k`` draft tokens."""
        r = e.req
        if k < 1:
            if r.spec is not None:
                r.spec.mark_look(False)
            return []
        st = SpecState.of(r)
        index = st.ensure_index()
        index.sync(r.seq_len, r.tokens)
        tt, width = self.token_text, self.width
        found = index.propose_with_match(budget.cap(st, k), candidates=width)
        st.mark_look(budget.counts_looks)
        # the text lookup backs off after a run of fruitless looks (the n-gram one is cheap);
        # not for grammar requests (JSON values are copied by text, right after the forced key)
        strong = e.n > 1 or r.grammar is not None or (bool(found) and found[0][1] >= STRONG_NGRAM)
        texts = self._text_drafts(r, k, width) if budget.may_look(st, strong) else []
        if not budget.may_pay(st, found, texts, k):
            return []
        cands = []  # (matched chars, strong, chain or text to encode, source)
        if found:
            tail_chars = len(tt.text(r.tokens(r.seq_len - found[0][1], r.seq_len)))
            for cont, n in found:
                cands.append((tail_chars if n == found[0][1] else 0, n >= 2, cont[:budget.match_cap(n)], f"ngram{n}"))
        for chars, trusted, cont, src in texts:
            cands.append((chars, trusted, tt.encode(cont)[:budget.cap(st, k, trusted)], src))
        cands.sort(key=lambda c: -c[0])  # stable: token n-grams win ties
        # weak candidates (1-token n-gram matches, short text matches) may get fewer rows than
        # strong ones (the row-block budget: the rows of a block that cost next to nothing)
        weak = budget.weak_rows(k)
        chains, firsts, left = [], set(), k
        for _, strong, cont, src in cands:
            if not cont or cont[0] in firsts or len(chains) >= width or left < 1:
                continue
            c = cont[:left if not chains else max(1, left // 2)]
            if not strong:
                c = c[:weak]
                weak -= len(c)
            if not c:
                continue
            chains.append((c, self._token_sources(c, src)))
            firsts.add(c[0])
            left = max(0, left - len(c))
        return chains

    def _token_sources(self, chain: list[int], src: str) -> list[str]:
        """Per-token sources of a chain: a trusted text draft's tokens after the first that start
        a new word are ``text_word`` (copied JSON values end at such a token), the others
        ``text_cont`` (a copy that started right goes on: kept more often than a first token)."""
        if src != "text":
            return [src] * len(chain)
        starts = self.token_text.starts_word
        return [src] + [("text_word" if starts(t) else "text_cont") for t in chain[1:]]

    def _text_drafts(self, r, k: int, width: int) -> list[tuple[int, bool, str, str]]:
        """Text-level matches of the sequence's tail in the prompt, not yet re-encoded:
        ``(matched chars, trusted, continuation text, source)``. A word-aligned match (a copied
        value starting) or one of at least ``TEXT_TRUST_CHARS`` characters drafts up to ``k``
        tokens, whatever the request's cap; a weaker one (at least ``TEXT_MIN_CHARS``) at most the
        cap. The tail is the last ``TEXT_TAIL_TOKENS`` tokens' text (:class:`.TokenText`: joined
        cached bytes, no decode)."""
        st, tt = r.spec, self.token_text
        fresh = st.text is None
        look = st.text_lookup(lambda: TextLookup(self.out.tokenizer.decode(r.input_ids, skip_special_tokens=False)))
        if fresh:
            tt.check(r.input_ids, look.source)
        tail = tt.text(r.tokens(max(len(r.input_ids), r.seq_len - TEXT_TAIL_TOKENS), r.seq_len))
        out = []
        for m in look.find(tail, k * CONT_CHARS_PER_TOKEN, width, min_chars=TEXT_MIN_CHARS):
            trusted = m.aligned or m.chars >= TEXT_TRUST_CHARS
            if not trusted and m.chars < TEXT_MIN_CHARS:
                continue
            out.append((m.chars, trusted, m.cont, "text" if trusted else "text_weak"))
        return out
