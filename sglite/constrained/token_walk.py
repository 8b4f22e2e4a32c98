"""Vectorized walk of the whole vocabulary through a lazy DFA from one state (DESIGN §5 lead 1).

The vocabulary is a byte matrix sorted by length (longest first), so step ``j`` touches only the
tokens longer than ``j`` (a prefix of the rows), and tokens that die are compacted away: the cost is
about the number of (token, byte) pairs still alive, a few milliseconds at 49k tokens, paid once per
DFA state and cached by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dfa import DEAD, LazyDFA
from .tokenizer_info import SortedVocab


@dataclass
class WalkResult:
    """Outcome of walking every token from one DFA state.

    Attributes:
        alive_ids: int64 [k] token ids fully consumed without dying (stay inside this rule).
        uncertain_rows: int64 [m] rows (of the sorted vocabulary matrix) of the tokens that died
            inside this rule after passing a boundary state (a call, or an accepting state when the
            rule may return) mid-token: only the pushdown matcher can decide them.
        uncertain_ids: int64 [m] the token ids of those rows.
    """

    alive_ids: np.ndarray
    uncertain_rows: np.ndarray
    uncertain_ids: np.ndarray


def walk_vocab(dfa: LazyDFA, state: int, vocab: SortedVocab, may_return: bool) -> WalkResult:
    """Walk all tokens of ``vocab`` from ``state`` (expands DFA rows on demand; mutates only ``dfa``).

    The first step only visits tokens whose first byte is live from ``state`` (per-first-byte row
    lists), later steps only the survivors; byte ``j`` of the survivors is read from the contiguous
    column ``vocab.columns[j]``.
    """
    track = may_return or dfa.any_call
    if not dfa.expanded[state]:
        dfa.expand(state)
    live = np.nonzero(dfa.trans[state])[0]
    if len(live) == 256:
        idx = np.arange(len(vocab.ids), dtype=np.int64)  # rows still alive, ascending
    else:
        groups = [vocab.first_byte_rows[b] for b in live.tolist()]
        idx = np.sort(np.concatenate(groups)) if groups else np.zeros(0, dtype=np.int64)
    cur = np.full(len(idx), state, dtype=np.int32)
    touched = np.zeros(len(idx), dtype=bool)
    alive_rows, uncertain_rows = [], []
    for j in range(vocab.matrix.shape[1]):
        k = int(np.searchsorted(idx, vocab.active[j]))
        if k < len(idx):  # tokens of length j end here, alive
            alive_rows.append(idx[k:])
            idx, cur, touched = idx[:k], cur[:k], touched[:k]
        if k == 0:
            break
        if j > 0:
            need = ~dfa.expanded[cur]
            if need.any():
                for s in np.unique(cur[need]):
                    dfa.expand(int(s))
            if track:
                flag = dfa.has_call[cur]
                if may_return:
                    flag |= dfa.acc[cur]
                touched |= flag
        cur = dfa.trans[cur, vocab.columns[j][idx]]
        dead = cur == DEAD
        if dead.any():
            if track:
                uncertain_rows.append(idx[dead & touched])
            keep = ~dead
            idx, cur, touched = idx[keep], cur[keep], touched[keep]
    else:
        alive_rows.append(idx)
    cat = (lambda rows: np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
    unsure = cat(uncertain_rows)
    return WalkResult(vocab.ids[cat(alive_rows)], unsure, vocab.ids[unsure])


def pack_ids(ids, words: int) -> np.ndarray:
    """Token ids → packed bitmask int32 [words] (bit ``i % 32`` of word ``i // 32``, LSB first)."""
    bits = np.zeros(words * 32, dtype=bool)
    bits[np.asarray(ids, dtype=np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
