"""The stop-regex hold-back test: exact on regular patterns, bounded on pathological ones."""
import random
import re

import pytest

from sglite.constrained.regex_prefix import RegexPrefix
from sglite.errors import GrammarError


def brute_could_start(pattern: str, text: str, alphabet: str, depth: int) -> bool:
    """Oracle: ``text`` + some continuation up to ``depth`` characters fully matches."""
    rx = re.compile(pattern)
    frontier = [text]
    for _ in range(depth + 1):
        if any(rx.fullmatch(t) for t in frontier):
            return True
        frontier = [t + c for t in frontier for c in alphabet]
    return False


@pytest.mark.parametrize("pattern", [r"ab+c", r"(cat|dog)s?!", r"[0-9]{2,3}x", r"a(b|c)*d", r"é+z"])
def test_matches_the_bruteforce_oracle(pattern):
    rng = random.Random(0)
    alphabet = "abcdgost!0129xzé"
    checker = RegexPrefix(pattern)
    assert checker.supported
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
        assert checker.could_start(text) == brute_could_start(pattern, text, "abcdgost!0129xzé", 4), text


def test_exponential_pattern_costs_one_state_per_byte():
    """(a|b)*a(a|b){13}: 2^14 DFA states if built ahead (it froze a server for ~22 s); lazily,
    a walk of n bytes materializes at most n + 1 states."""
    checker = RegexPrefix("(a|b)*a(a|b){13}")
    text = "".join(random.Random(1).choice("ab") for _ in range(2000))
    assert checker.could_start(text)
    assert len(checker.dfa.sets) <= len(text) + 2
    assert not checker.could_start(text + "c")


def test_dfa_budget_stops_hold_back_instead_of_growing():
    checker = RegexPrefix("abcdefghij", max_dfa_states=5)
    assert checker.could_start("abcdefgh")  # this walk spent the budget (9 states)
    assert not checker.supported and not checker.could_start("a")


def test_nfa_budget_is_a_grammar_error_naming_it():
    with pytest.raises(GrammarError, match="100 automaton states"):
        RegexPrefix("(abcdefghij){30}", max_nfa_states=100)


@pytest.mark.parametrize("pattern", [r"(?<=a)b", r"(a)\1"])
def test_non_regular_patterns_are_matched_only(pattern):
    checker = RegexPrefix(pattern)
    assert not checker.supported and not checker.could_start("a")
