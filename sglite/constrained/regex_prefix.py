"""Can a text still grow into a match of a regex? (the stop-regex hold-back test)

A stop regex ends output at its first match; text that could still become a match is held back
from the stream until it either matches or cannot any more. :class:`RegexPrefix` answers "is this
text a prefix of some string the regex matches" by walking its UTF-8 bytes through a lazy byte
DFA (:class:`~sglite.constrained.dfa.LazyDFA`) whose states keep only NFA states that can still
reach the accepting state: a walk that falls into the dead state cannot match.

Cost is bounded, whatever the pattern: the NFA is capped at :data:`MAX_NFA_STATES` states (a
larger pattern is refused: :class:`~sglite.errors.GrammarError`), and the DFA is never built
ahead; only the states a walk reaches are materialized, at most :data:`MAX_DFA_STATES` in all, after
which the checker stops holding text back (the regex is then still matched, only streamed
without hold-back). ``(a|b)*a(a|b){13}``, whose full DFA has 2^14 states (the textbook
exponential subset construction), costs one state per byte walked.

Patterns outside the regular subset the grammar engine parses (lookarounds, back-references,
anchors) get no hold-back (``supported`` is False): they are matched only.
"""
from __future__ import annotations

from ..errors import GrammarError
from .dfa import DEAD, LazyDFA
from .grammar import coreachable
from .nfa import NFA
from .regex_parse import parse_regex

#: NFA states one stop regex may build (larger: GrammarError)
MAX_NFA_STATES = 20_000
#: DFA states materialized over a request's life before hold-back is given up
MAX_DFA_STATES = 4_096


class RegexPrefix:
    """Prefix test of one Python regex (``re`` syntax, search semantics from a given start).

    Args:
        pattern: the regex.
        max_nfa_states: NFA budget (see :data:`MAX_NFA_STATES`).
        max_dfa_states: lazily materialized DFA budget (see :data:`MAX_DFA_STATES`).

    Raises:
        GrammarError: the pattern needs more than ``max_nfa_states`` NFA states (the message names
            the budget). A pattern outside the regular subset is not an error: ``supported`` is False.
    """

    def __init__(self, pattern: str, max_nfa_states: int = MAX_NFA_STATES, max_dfa_states: int = MAX_DFA_STATES):
        self.dfa: LazyDFA | None = None
        self.max_dfa_states = max_dfa_states
        try:
            node = parse_regex(pattern)
        except GrammarError:
            return  # not regular (lookaround, backref, anchor...): matched only, never held back for
        nfa = NFA(max_nfa_states)
        try:
            final = nfa.new()
            start = nfa.build(node, final)
        except GrammarError:
            raise GrammarError(f"the pattern needs more than {max_nfa_states} automaton states") from None
        self.dfa = LazyDFA(nfa, start, final, coreachable(nfa, final))

    @property
    def supported(self) -> bool:
        """False when the pattern is not regular, or the DFA budget was spent: no hold-back."""
        return self.dfa is not None

    def could_start(self, text: str) -> bool:
        """True if ``text`` is a prefix of some string the regex matches (``text`` itself may
        already be a match). Always False when not :attr:`supported`."""
        dfa = self.dfa
        if dfa is None:
            return False
        s = dfa.start
        for b in text.encode("utf-8", "surrogatepass"):
            s = dfa.step(s, b)
            if s == DEAD:
                return False
        if len(dfa.sets) > self.max_dfa_states:
            self.dfa = None  # budget spent: stop holding back (matching goes on)
        return True
