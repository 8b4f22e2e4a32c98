"""Reasoning parsers: ``<think>...</think>`` split from the answer, whole and streamed for every
chunking (every split point, every character, random cuts)."""
from __future__ import annotations

import random

import pytest

from sglite.server.reasoning import (REASONING_FORMATS, ReasoningStreamer, get_reasoning_format, split_reasoning,
                                     thinking_on)

R1, QWEN3 = REASONING_FORMATS["deepseek-r1"], REASONING_FORMATS["qwen3"]
CASES = [
    (R1, "Let me think.\nStep 1 < 2.\n</think>\n\nThe answer is 4.", "Let me think.\nStep 1 < 2.\n", "The answer is 4."),
    (R1, "<think>\nhmm</think>{\"a\": 1}", "hmm", '{"a": 1}'),
    (R1, "still thinking when cut", "still thinking when cut", ""),
    (R1, "</think>answer", None, "answer"),
    (R1, "a </thin b</think> c", "a </thin b", "c"),
    (QWEN3, "<think>\nI should add.\n</think>\n\n2 + 2 = 4", "I should add.\n", "2 + 2 = 4"),
    (QWEN3, "  <think>x</think>", "x", ""),
    (QWEN3, "No thinking here.", None, "No thinking here."),
    (QWEN3, "<thinking is not the tag", None, "<thinking is not the tag"),
    (QWEN3, "<think>never closed", "never closed", ""),
    (QWEN3, "<thi", None, "<thi"),
    (R1, "<thi", "<thi", ""),
]


def _stream(fmt, pieces, thinking=True):
    s, r, a = ReasoningStreamer(fmt, thinking), "", ""
    for p in pieces:
        dr, da = s.feed(p)
        r, a = r + dr, a + da
    dr, da = s.finish()
    return (r + dr) or None, a + da


@pytest.mark.parametrize("fmt,text,reasoning,answer", CASES)
def test_split_whole(fmt, text, reasoning, answer):
    assert split_reasoning(text, fmt) == (reasoning, answer)


@pytest.mark.parametrize("fmt,text,reasoning,answer", CASES)
def test_streamed_for_every_chunking(fmt, text, reasoning, answer):
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    rng = random.Random(1)
    for _ in range(30):
        cuts = sorted(rng.choices(range(len(text) + 1), k=3))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        assert _stream(fmt, pieces) == (reasoning, answer), pieces


def test_enable_thinking_false_means_no_reasoning():
    kw = {"enable_thinking": False}
    assert not thinking_on(QWEN3, kw) and thinking_on(QWEN3, {}) and thinking_on(R1, kw)
    text = "<think>x</think>y"
    assert split_reasoning(text, QWEN3, thinking=False) == (None, text)
    assert _stream(QWEN3, list(text), thinking=False) == (None, text)


def test_unknown_parser_names_the_field():
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'nope'"):
        get_reasoning_format("nope")
