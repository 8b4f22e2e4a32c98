"""The stop-regex hold-back test: exact on regular patterns, bounded on pathological ones."""
import random

import pytest

from sglite.constrained.regex_prefix import RegexPrefix
from sglite.errors import GrammarError


def oracle_could_start(pattern: str, text: str) -> bool:
    """Oracle: the ``regex`` package's partial full-match (an independent backtracking engine):
    ``text`` is a match or a prefix of one."""
    regex = pytest.importorskip("regex")
    return regex.fullmatch(pattern, text, partial=True) is not None


@pytest.mark.parametrize("pattern,alphabet", [(r"ab+c", "abcx"), (r"(cat|dog)s?!", "catdogs!"),
                                              (r"[0-9]{2,3}x", "09xa"), (r"a(b|c)*d", "abcdx"), (r"é+z", "éza")])
def test_matches_the_bruteforce_oracle(pattern, alphabet):
    """Every text of up to 4 characters over the pattern's own letters plus one other: the checker
    says "could still match" exactly when the oracle does."""
    import itertools

    checker = RegexPrefix(pattern)
    assert checker.supported
    for n in range(5):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert checker.could_start(text) == oracle_could_start(pattern, text), text


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
