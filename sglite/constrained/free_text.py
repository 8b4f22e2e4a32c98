"""Free text up to a stop string: the byte DFA of "any bytes containing none of these strings".

Used by structural tags (:mod:`.structural_tag`): the free text before a tool-call opener, the
thinking before ``</think>``, a tag's ``any_text`` content before its end string. Followed in a
grammar by the stop string itself, the automaton makes the *first* occurrence of a stop string the
switch into the constrained part, whichever token boundaries the model picks: a token that holds the
opener's last characters plus more (``call>\\n{"``) simply walks the same DFA through the switch.

The automaton is Aho & Corasick's string-matching machine ("Efficient string matching: an aid to
bibliographic search", CACM 18(6), 1975) with every state that has just matched a stop string made
dead; all other states accept. Its size is the total length of the stop strings plus one.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from sglite.errors import GrammarError

from .fsm_ops import TableDFA

MAX_STOP_BYTES = 4096


def text_without(stops) -> TableDFA:
    """Explicit DFA of the byte strings that contain none of ``stops``.

    Args:
        stops: non-empty ``str`` (UTF-8 encoded) or ``bytes`` strings, at most
            ``MAX_STOP_BYTES`` bytes together.

    Returns:
        a :class:`~sglite.constrained.fsm_ops.TableDFA` (state 0 dead, start 1, every live state
        accepting); with no stops, the DFA of all byte strings.

    Raises:
        GrammarError: an empty stop string, or too many stop bytes.
    """
    words = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in stops]
    if any(not w for w in words):
        raise GrammarError("a stop string (trigger or end tag) must not be empty")
    if sum(len(w) for w in words) > MAX_STOP_BYTES:
        raise GrammarError(f"stop strings (triggers / end tags) exceed {MAX_STOP_BYTES} bytes together")
    goto: list[dict] = [{}]
    hit = [False]
    for w in words:
        node = 0
        for b in w:
            nxt = goto[node].get(b)
            if nxt is None:
                nxt = len(goto)
                goto[node][b] = nxt
                goto.append({})
                hit.append(False)
            node = nxt
        hit[node] = True
    n = len(goto)
    delta = np.zeros((n, 256), dtype=np.int64)  # full transition function over trie nodes
    for b, t in goto[0].items():
        delta[0, b] = t
    fail = [0] * n
    queue = deque(goto[0].values())
    while queue:  # breadth first: a node's failure state is finished before its children
        s = queue.popleft()
        hit[s] = hit[s] or hit[fail[s]]
        delta[s] = delta[fail[s]]
        for b, t in goto[s].items():
            delta[s, b] = t
            fail[t] = int(delta[fail[s], b]) if s else 0
            queue.append(t)
    # table ids: trie node k -> k + 1; nodes that matched a stop string -> 0 (dead)
    ids = np.where(np.array(hit), 0, np.arange(1, n + 1))
    trans = np.zeros((n + 1, 256), dtype=np.int32)
    trans[1:] = ids[delta]
    hit_rows = np.concatenate([[True], np.array(hit)])  # row k + 1 is trie node k; row 0 is dead
    trans[hit_rows] = 0  # nodes that matched are never entered: their rows stay empty
    acc = ~hit_rows
    return TableDFA(trans, acc, 1)
