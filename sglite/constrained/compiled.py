"""A compiled grammar bound to a tokenizer: matcher states, their token masks (cached) and steps.

Two state representations behind one interface:

* one DFA (no recursive rule): the state is the DFA state id (an int);
* pushdown (recursive rules): the state is a closed ``frozenset`` of stacks, a stack being a tuple
  of ``(rule, dfa_state)`` frames, bottom first. Closure pops frames whose rule may end (the parent
  frame already sits at its resume state) and pushes callees; several stacks at once make it a
  breadth-first (GLR-like) recognizer, so ambiguous grammars work without backtracking.

Masks are cached per state (DESIGN §5 lead 3): a warm mask is a dict lookup plus one tensor copy.
For a pushdown state the mask is the union over its stacks of per-stack masks (:mod:`.pushdown_mask`):
tokens that stay inside the top rule come from a cached vectorized vocabulary walk (lead 4), only
tokens that cross a rule boundary mid-token go through a vectorized pushdown walk, and a stack's mask
is cached under the top frames that decided it, so new nesting depths of a known shape cost lookups.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .dfa import DEAD
from .grammar import Automaton
from .protocols import CompiledGrammarProtocol
from .pushdown_mask import StackMasker
from .token_walk import pack_ids, walk_vocab
from .tokenizer_info import TokenizerInfo

MAX_STACK_DEPTH = 512
MAX_FORCED_BYTES = 2048
MAX_STATE_MASKS = 8192


class CompiledGrammar(CompiledGrammarProtocol):
    """Shared, immutable-from-outside compiled grammar. Create matchers with :meth:`matcher`.

    Thread-safe: slow paths (DFA expansion, mask computation) run under one lock.
    """

    def __init__(self, automaton: Automaton, tokenizer_info: TokenizerInfo, kind: str = "", spec=None):
        self.automaton, self.info = automaton, tokenizer_info
        self.kind, self.spec = kind, spec
        self.pushdown = automaton.has_calls
        self.root = automaton.dfas[automaton.root]
        self._lock = threading.RLock()
        self._masks: dict = {}
        self._forced: dict = {}  # state -> forced_bytes(state)
        self._forces: dict = {}  # (state, token id) -> forces_token_text(state, token id)
        self._walks: dict = {}
        self._stack_masks = (StackMasker(automaton.dfas, tokenizer_info.sorted_vocab, self._walk,
                                         tokenizer_info.mask_words, MAX_STACK_DEPTH)
                             if self.pushdown else None)
        self.initial_state = (self._close({((automaton.root, self.root.start),)})
                              if self.pushdown else self.root.start)

    def matcher(self):
        """A fresh :class:`~sglite.constrained.matcher.GrammarMatcher` at the start state."""
        from .matcher import GrammarMatcher

        return GrammarMatcher(self)

    # -- pushdown helpers -----------------------------------------------------------------------
    def _close(self, stacks) -> frozenset:
        dfas, out, work = self.automaton.dfas, set(), list(stacks)
        while work:
            st = work.pop()
            if st in out:
                continue
            out.add(st)
            rule, d = st[-1]
            dfa = dfas[rule]
            if dfa.acc[d] and len(st) > 1:
                work.append(st[:-1])
            if dfa.has_call[d] and len(st) < MAX_STACK_DEPTH:
                for callee, resume in dfa.calls(d):
                    work.append(st[:-1] + ((rule, resume), (callee, dfas[callee].start)))
        keep = frozenset(st for st in out if dfas[st[-1][0]].has_edges[st[-1][1]]
                         or (len(st) == 1 and dfas[st[0][0]].acc[st[0][1]]))
        return keep

    # -- generic state API ----------------------------------------------------------------------
    def step_bytes(self, state, data: bytes):
        """State after ``data``, or None if ``data`` leaves the language. Never mutates ``state``."""
        with self._lock:
            if not self.pushdown:
                dfa, s = self.root, state
                for b in data:
                    s = dfa.step(s, b)
                    if s == DEAD:
                        return None
                return s
            dfas = self.automaton.dfas
            for b in data:
                nxt = set()
                for st in state:
                    rule, d = st[-1]
                    d2 = dfas[rule].step(d, b)
                    if d2 != DEAD:
                        nxt.add(st[:-1] + ((rule, d2),))
                if not nxt:
                    return None
                state = self._close(nxt)
                if not state:
                    return None
            return state

    def accepting(self, state) -> bool:
        """True if the input so far is a complete sentence (EOS allowed)."""
        if not self.pushdown:
            return bool(self.root.acc[state])
        dfas = self.automaton.dfas
        return any(len(st) == 1 and dfas[st[0][0]].acc[st[0][1]] for st in state)

    def live_bytes(self, state) -> set:
        """Bytes that can follow ``state``."""
        with self._lock:
            if not self.pushdown:
                return set(self.root.live_bytes(state).tolist())
            out: set = set()
            for st in state:
                rule, d = st[-1]
                out.update(self.automaton.dfas[rule].live_bytes(d).tolist())
            return out

    def has_mask(self, state) -> bool:
        """Whether ``mask(state)`` is cached (a dict lookup, so filling it costs microseconds)."""
        return state in self._masks

    def mask(self, state) -> torch.Tensor:
        """Packed allowed-token mask, int32 [ceil(V/32)] (cached per state; do not modify it)."""
        m = self._masks.get(state)
        if m is None:
            with self._lock:
                m = self._masks.get(state)
                if m is None:
                    m = torch.from_numpy(self._compute_mask(state))
                    if self.pushdown and len(self._masks) >= MAX_STATE_MASKS:
                        self._masks.pop(next(iter(self._masks)))  # oldest; stack masks stay cached
                    self._masks[state] = m
        return m

    def _walk(self, rule: str, d: int, may_return: bool):
        key = (rule, d, may_return)
        w = self._walks.get(key)
        if w is None:
            w = walk_vocab(self.automaton.dfas[rule], d, self.info.sorted_vocab, may_return)
            self._walks[key] = w
        return w

    def _compute_mask(self, state) -> np.ndarray:
        info = self.info
        if not self.pushdown:
            out = pack_ids(self._walk(self.automaton.root, state, False).alive_ids, info.mask_words)
        else:
            out = np.zeros(info.mask_words, dtype=np.int32)
            for st in state:
                out |= self._stack_masks.mask(st)
        if self.accepting(state):
            out = out | pack_ids(sorted(info.eos_token_ids), info.mask_words)
        return out

    def forced_bytes(self, state) -> bytes:
        """Bytes every continuation of ``state`` must start with (stops at an accepting state);
        cached per state (jump-forward and speculative drafts ask after every token)."""
        return self._memo(self._forced, state, self._forced_bytes, state)

    def forces_token_text(self, state, token_id: int) -> bool:
        """Whether every token allowed at ``state`` is a prefix of ``token_id``'s bytes (False
        when ``token_id`` is special or not allowed); cached per (state, token)."""
        return self._memo(self._forces, (state, token_id), self._forces_token_text, state, token_id)

    def _memo(self, cache: dict, key, compute, *args):
        """``cache[key]``, computed as ``compute(*args)`` on a miss; at most ``MAX_STATE_MASKS``
        entries (the oldest goes first)."""
        out = cache.get(key)
        if out is None:
            out = compute(*args)
            with self._lock:
                if len(cache) >= MAX_STATE_MASKS:
                    cache.pop(next(iter(cache)))
                cache[key] = out
        return out

    def _forces_token_text(self, state, token_id: int) -> bool:
        info = self.info
        target = info.token_bytes[token_id] if 0 <= token_id < info.vocab_size else None
        if not target:
            return False
        words = self.mask(state).numpy()
        if not (int(words[token_id >> 5]) >> (token_id & 31)) & 1:
            return False
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:info.vocab_size])
        for t in allowed.tolist():
            b = info.token_bytes[t]
            if b is None or len(b) > len(target) or target[:len(b)] != b:
                return False
        return True

    def _forced_bytes(self, state) -> bytes:
        out = bytearray()
        while len(out) < MAX_FORCED_BYTES and not self.accepting(state):
            live = self.live_bytes(state)
            if len(live) != 1:
                break
            b = live.pop()
            state = self.step_bytes(state, bytes([b]))
            if state is None:
                break
            out.append(b)
        return bytes(out)
