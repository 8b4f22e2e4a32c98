"""Reasoning parsers (``--reasoning-parser``, SGLang's names): split a reasoning model's
``<think>...</think>`` from its answer, whole or streamed.

* ``deepseek-r1``: DeepSeek-R1's template ends the prompt with ``<think>\\n``, so the output
  starts *inside* the reasoning (a ``<think>`` the model repeats is dropped); everything up to
  ``</think>`` is reasoning; output with no ``</think>`` is all reasoning (cut by ``max_tokens``).
* ``qwen3``: the output is reasoning only when it starts with ``<think>``; with
  ``chat_template_kwargs: {"enable_thinking": false}`` the template closes an empty think block
  in the prompt and nothing is reasoning.

The reasoning text has its leading whitespace dropped; the answer starts at its first
non-whitespace character after ``</think>``. :class:`ReasoningStreamer` gives the same split for
every chunking of the output (a partial tag at a chunk's end is held until it resolves).
``max_tokens`` counts reasoning and answer tokens together (as vLLM and SGLang do).
Sources: SGLang ``srt/reasoning_parser.py`` (DeepSeekR1Detector, Qwen3Detector); vLLM's
reasoning parsers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's reasoning markers.

    Attributes:
        name: the ``--reasoning-parser`` name.
        start: the opening tag (``<think>``); end: the closing tag (``</think>``).
        starts_inside: the output begins inside the reasoning (the opener is in the prompt).
        thinking_kwarg: the ``chat_template_kwargs`` key that turns thinking off when false (or None).
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False
    thinking_kwarg: Optional[str] = None


REASONING_FORMATS = {f.name: f for f in (
    ReasoningFormat("deepseek-r1", starts_inside=True),
    ReasoningFormat("qwen3", thinking_kwarg="enable_thinking"),
)}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format of a ``--reasoning-parser`` name.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in REASONING_FORMATS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; known: {sorted(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]


def thinking_on(fmt: ReasoningFormat, template_kwargs: Optional[dict]) -> bool:
    """False when the request's ``chat_template_kwargs`` turn this family's thinking off."""
    if fmt.thinking_kwarg is None or not template_kwargs:
        return True
    return template_kwargs.get(fmt.thinking_kwarg, True) is not False


def split_reasoning(text: str, fmt: ReasoningFormat, thinking: bool = True) -> tuple[Optional[str], str]:
    """``(reasoning, answer)`` of a whole output; reasoning None when there is none."""
    if not thinking:
        return None, text
    head = text.lstrip()
    if head.startswith(fmt.start):
        rest = head[len(fmt.start):]
    elif fmt.starts_inside:
        rest = text
    else:
        return None, text
    j = rest.find(fmt.end)
    if j < 0:
        return rest.lstrip() or None, ""
    return rest[:j].lstrip() or None, rest[j + len(fmt.end):].lstrip()


def _held_suffix(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class ReasoningStreamer:
    """``feed(delta) -> (reasoning_delta, answer_delta)``; ``finish() -> (...)`` flushes what is held.

    States: ``start`` (leading whitespace, maybe a partial ``<think>``), ``lead`` (whitespace at
    the start of the reasoning), ``reasoning``, ``after`` (whitespace after ``</think>``), ``answer``.
    """

    def __init__(self, fmt: ReasoningFormat, thinking: bool = True):
        self.fmt = fmt
        self.state = "start" if thinking else "answer"
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = answer = ""
        while True:
            b, st = self.buf, self.state
            if st == "answer":
                answer, self.buf = answer + b, ""
                return reasoning, answer
            if st == "start":
                head = b.lstrip()
                if head.startswith(self.fmt.start):
                    self.buf, self.state = head[len(self.fmt.start):], "lead"
                elif not head or self.fmt.start.startswith(head):
                    return reasoning, answer  # undecided: wait
                else:
                    self.state = "lead" if self.fmt.starts_inside else "answer"
                continue
            if st in ("lead", "after"):
                self.buf = b.lstrip()
                if not self.buf:
                    return reasoning, answer
                self.state = "reasoning" if st == "lead" else "answer"
                continue
            j = b.find(self.fmt.end)  # reasoning
            if j >= 0:
                reasoning += b[:j]
                self.buf, self.state = b[j + len(self.fmt.end):], "after"
                continue
            k = _held_suffix(b, self.fmt.end)
            reasoning, self.buf = reasoning + b[:len(b) - k], b[len(b) - k:]
            return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """Flush at the end of the output (a held partial tag is text after all)."""
        b, self.buf = self.buf, ""
        if self.state == "start":
            return (b.lstrip(), "") if self.fmt.starts_inside else ("", b)
        if self.state == "reasoning":
            return b, ""
        return "", b if self.state == "answer" else ""
