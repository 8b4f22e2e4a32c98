"""Incremental detokenizer: byte safety, equality with a full decode, stop strings and regexes."""
import random

import pytest

from sglite.errors import InvalidRequestError
from sglite.runtime.detokenizer import IncrementalDetokenizer

SAMPLE = "Hello 世界! 😀👍🏽 naïve café — ∑x² <tag> 1234 the end.\n你好吗？ 🇫🇷 done"


def _stream(detok, ids, rng=None):
    """Push ids in random-size chunks; return the list of deltas (flush included)."""
    deltas, i = [], 0
    while i < len(ids) and not detok.finished:
        n = rng.randint(1, 3) if rng else 1
        delta, _ = detok.push(ids[i:i + n])
        deltas.append(delta)
        i += n
    deltas.append(detok.flush())
    return deltas


def _random_ids(tok, rng, n):
    """Mix of ordinary tokens, single-byte tokens that split characters, and special tokens."""
    specials = sorted(tok.special_token_ids)
    pieces = tok.encode(SAMPLE)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            out.append(rng.choice(pieces))
        elif r < 0.5:
            out.append(rng.choice(specials))
        else:
            out.append(rng.randrange(tok.vocab_size))
    return out


def test_sample_text_streams_without_half_characters(real_tokenizer):
    ids = real_tokenizer.encode(SAMPLE)
    detok = IncrementalDetokenizer(real_tokenizer)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == detok.text == SAMPLE
    assert all("\ufffd" not in d for d in deltas)
    # at least one multi-byte character was split over tokens and held back for a step
    assert any(d == "" for d in deltas[:-1])


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_equal_full_decode(real_tokenizer, skip):
    rng = random.Random(1234 + skip)
    for _ in range(30):
        ids = _random_ids(real_tokenizer, rng, rng.randint(1, 60))
        detok = IncrementalDetokenizer(real_tokenizer, skip_special_tokens=skip)
        deltas = _stream(detok, ids, rng)
        expected = real_tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == detok.text == expected


def test_byte_tokens_of_one_emoji(real_tokenizer):
    tok = real_tokenizer
    byte_ids = [tok.hf.convert_tokens_to_ids(t) for t in tok.convert_ids_to_tokens(tok.encode("😀"))]
    assert len(byte_ids) > 1
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i])[0] for i in byte_ids]
    assert deltas[:-1] == [""] * (len(byte_ids) - 1) and deltas[-1] == "😀"


def test_window_stays_small(real_tokenizer):
    """Per-token decoding touches a bounded window, not the whole output."""
    calls = []

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return real_tokenizer.decode(ids, **kw)

    ids = real_tokenizer.encode(SAMPLE * 20)
    detok = IncrementalDetokenizer(Spy())
    _stream(detok, ids)
    assert detok.text == SAMPLE * 20
    assert max(calls) <= 8, max(calls)


def test_stop_string_spanning_tokens(real_tokenizer):
    tok = real_tokenizer
    text = "The answer is 42. Observation: done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["Observation:"])
    released, matched = [], None
    for i in ids:
        delta, matched = detok.push([i])
        released.append(delta)
        assert "Obs" not in detok.text  # the prefix of the stop is held back, never leaked
        if matched:
            break
    assert matched == "Observation:"
    assert detok.finished and detok.text == "The answer is 42. "
    assert "".join(released) == detok.text
    assert detok.push(tok.encode(" more")) == ("", None) and detok.flush() == ""


def test_held_back_prefix_is_released_when_it_cannot_match(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop=["STOP!"])
    first, _ = detok.push(tok.encode("go ST"))
    assert first == "go " and detok.text == "go "
    second, matched = detok.push(tok.encode("ep up"))
    assert matched is None and detok.text == "go STep up"
    assert first + second == detok.text


def test_prefix_held_at_end_is_flushed(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop="</answer>")
    detok.push(tok.encode("x </ans"))
    assert detok.text == "x "
    assert detok.flush() == "</ans" and detok.text == "x </ans" and detok.matched_stop is None


def test_no_stop_trim_keeps_the_stop(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop=["\n\n", "END"], no_stop_trim=True)
    deltas = _stream(detok, tok.encode("line one END two\n\nthree"))
    assert detok.text == "line one END" == "".join(deltas) and detok.matched_stop == "END"


def test_earliest_stop_wins_and_stop_inside_one_token(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop=["world", "lo"])
    delta, matched = detok.push(tok.encode("Hello world"))
    assert (delta, matched) == ("Hel", "lo")


def test_stop_regex(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop_regex=[r"Answer: \d+\."])
    deltas, matched = [], None
    for i in tok.encode("Thinking... Answer: 17. And more"):
        delta, matched = detok.push([i])
        deltas.append(delta)
        assert "Answer" not in detok.text
        if matched:
            break
    assert matched == "Answer: 17." and detok.text == "Thinking... " == "".join(deltas)


def test_stop_regex_no_trim_and_release_when_dead(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop_regex=r"<\w+>", no_stop_trim=True)
    detok.push(tok.encode("a < b and "))
    assert detok.text == "a < b and "  # "<" followed by a space can no longer match
    detok.push(tok.encode("<tool> rest"))
    assert detok.text == "a < b and <tool>" and detok.matched_stop == "<tool>"


def test_bad_stop_regex():
    with pytest.raises(InvalidRequestError, match="stop_regex"):
        IncrementalDetokenizer(None, stop_regex=["(unclosed"])
    with pytest.raises(InvalidRequestError, match="empty string"):
        IncrementalDetokenizer(None, stop_regex=["x*"])


def test_catastrophic_stop_regex_ends_the_request_within_its_budget(real_tokenizer):
    """``(?:.*?,){11}P`` on 'a,a,...' without a P backtracks for minutes (``re`` did so holding
    the GIL); here the search times out at the request's budget: finished, the text released, an
    error naming stop_regex_timeout, and another thread ran meanwhile."""
    import threading
    import time

    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop_regex=[r"(?:.*?,){11}P"], stop_regex_timeout=0.3)
    ticks, done = [], threading.Event()

    def other_thread():  # runs while the search runs: the GIL is released
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.01)

    th = threading.Thread(target=other_thread)
    th.start()
    t0 = time.perf_counter()
    text = "a," * 400
    for i in tok.encode(text):
        detok.push([i])
        if detok.finished:
            break
    elapsed = time.perf_counter() - t0
    done.set()
    th.join()
    assert detok.finished and detok.matched_stop is None
    assert detok.error is not None and "stop_regex_timeout=0.3" in detok.error
    assert elapsed < 3.0
    assert text.startswith(detok.text) and detok.text
    assert len([t for t in ticks if t > t0]) >= 5  # the other thread ran during the searches
    assert detok.push(tok.encode(" x")) == ("", None)  # finished: later tokens are ignored


def test_hold_back_walks_share_the_budget(real_tokenizer):
    """A hold-back that would walk the lazy DFA from every start of a long held tail (``(a|b)*c``
    over 'abab...' then 'd': quadratic in the tail) stops at the budget instead."""
    import time

    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop_regex=[r"(a|b)*c"], stop_regex_timeout=0.2)
    detok.push(tok.encode("ab" * 4000))
    assert detok.text == "" and not detok.finished  # the whole tail could still become a match
    t0 = time.perf_counter()
    detok.push(tok.encode("d"))
    assert time.perf_counter() - t0 < 3.0
    assert detok.finished and "stop_regex_timeout" in detok.error


def test_stop_regex_budget_is_not_spent_by_ordinary_patterns(real_tokenizer):
    tok = real_tokenizer
    detok = IncrementalDetokenizer(tok, stop_regex=[r"Answer: \d+\."], stop_regex_timeout=0.5)
    for i in tok.encode("Thinking step by step. " * 40 + "Answer: 17."):
        detok.push([i])
    assert detok.error is None and detok.matched_stop == "Answer: 17."


def test_random_streams_with_stops_are_prefixes_of_full_decode(real_tokenizer):
    rng = random.Random(7)
    for _ in range(30):
        ids = _random_ids(real_tokenizer, rng, 50)
        full = real_tokenizer.decode(ids)
        stop = full[rng.randrange(len(full)):][:3] if full else "zz"
        detok = IncrementalDetokenizer(real_tokenizer, stop=[stop])
        deltas = _stream(detok, ids, rng)
        assert "".join(deltas) == detok.text
        if detok.matched_stop is not None:
            assert detok.text == full[: full.index(stop)]
        else:
            assert detok.text == full
