"""The vocabulary as raw bytes, plus the padded byte matrix the vectorized mask walk uses."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from sglite.errors import GrammarError


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies (Radford et al.
    2019): printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _byte_decoder() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# Special tokens a structural tag may trigger on: the tool-call openers of Llama 3.x
# (``<|python_tag|>``), Mistral (``[TOOL_CALLS]``) and Granite (``<|tool_call|>``). In the grammar's
# vocabulary each is the bytes of :func:`special_trigger` (NUL + its text): a trigger or tag
# ``begin`` written with it matches the token id, and since NUL is not JSON text (nor in any
# other grammar that does not ask for it), the token can appear nowhere else.
TRIGGER_SPECIAL_TOKENS = ("<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>")
SPECIAL_MARK = "\x00"


def special_trigger(token: str) -> str:
    """The grammar text of a special token of :data:`TRIGGER_SPECIAL_TOKENS` (NUL + its text)."""
    return SPECIAL_MARK + token


@dataclass(eq=False)
class TokenizerInfo:
    """Per-model vocabulary facts for constrained decoding.

    Attributes:
        token_bytes: raw bytes of each token id, ``len == vocab_size``; ``None`` for special
            tokens and ids past the tokenizer (never allowed by a grammar, except EOS ids), but
            for the tool-call openers of :data:`TRIGGER_SPECIAL_TOKENS` (NUL + their text). Added
            tokens that are not special (Qwen's ``<tool_call>``, ``<think>``) are their text, so a
            structural tag's trigger or a reasoning end marker can be generated as one token.
            Where the vocabulary has such an opener, text tokens holding a NUL byte get ``None``:
            NUL then marks the openers alone, so a grammar that asks for one (a forced call's
            ``<|python_tag|>``) gets the token itself, never its text spelled out.
        eos_token_ids: ids allowed exactly in accepting states.
        vocab_size: model vocabulary size V (bitmask width is ``ceil(V / 32)`` int32 words).
    """

    token_bytes: list
    eos_token_ids: frozenset
    vocab_size: int = field(default=-1)

    def __post_init__(self):
        if self.vocab_size < 0:
            self.vocab_size = len(self.token_bytes)
        if len(self.token_bytes) != self.vocab_size:
            raise GrammarError(f"token_bytes has {len(self.token_bytes)} entries, vocab_size is {self.vocab_size}")
        self.eos_token_ids = frozenset(int(t) for t in self.eos_token_ids if 0 <= int(t) < self.vocab_size)

    @classmethod
    def from_hf(cls, hf_tokenizer, vocab_size: int, eos_token_ids,
                trigger_tokens=TRIGGER_SPECIAL_TOKENS) -> "TokenizerInfo":
        """Build from a Hugging Face tokenizer (byte-level BPE or SentencePiece-style byte fallback).

        Args:
            hf_tokenizer: a ``transformers`` tokenizer.
            vocab_size: the model's vocabulary size (may exceed ``len(hf_tokenizer)``).
            eos_token_ids: every id that ends generation (config, tokenizer and chat template).
            trigger_tokens: special tokens given the bytes of :func:`special_trigger` (the rest
                of the special tokens have none: no grammar allows them).
        """
        n = min(len(hf_tokenizer), vocab_size)
        pieces = hf_tokenizer.convert_ids_to_tokens(list(range(n)))
        special = set(getattr(hf_tokenizer, "all_special_ids", []) or [])
        added = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
        special.update(int(i) for i, tok in added.items() if getattr(tok, "special", True))
        dec = _byte_decoder()
        byte_level = sum(1 for p in pieces if p and "Ġ" in p) > 0.01 * max(n, 1)
        out: list = [None] * vocab_size
        eos = {int(t) for t in eos_token_ids}
        triggers: set[int] = set()
        for i, p in enumerate(pieces):
            tok = added.get(i)
            if i in special or p is None:
                if tok is not None and tok.content in trigger_tokens and i not in eos:
                    out[i] = special_trigger(tok.content).encode("utf-8")
                    triggers.add(i)
                continue
            # a non-special added token (Qwen's <tool_call>, <think>) is text the detokenizer keeps
            out[i] = tok.content.encode("utf-8") if tok is not None else _piece_bytes(p, dec, byte_level)
        if triggers:  # NUL marks the trigger tokens alone: a grammar cannot spell them out of text
            mark = SPECIAL_MARK.encode()
            out = [b if i in triggers or b is None or mark not in b else None for i, b in enumerate(out)]
        return cls(out, frozenset(eos_token_ids), vocab_size)

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    @cached_property
    def sorted_vocab(self) -> "SortedVocab":
        """Tokens with non-empty bytes as a length-sorted padded matrix (built once, ~50 ms at 49k)."""
        return SortedVocab(self.token_bytes)


def _piece_bytes(piece: str, dec: dict, byte_level: bool) -> bytes | None:
    if byte_level:
        try:
            return bytes(dec[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")
    m = _HEX_BYTE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


class SortedVocab:
    """Vocabulary matrix for the vectorized DFA walk (DESIGN §5 lead 1).

    Attributes:
        ids: int64 [N] token ids, sorted by byte length, longest first.
        matrix: uint8 [N, L] token bytes, zero padded (L = longest token).
        lengths: int64 [N].
        active: int64 [L]; ``active[j]`` = number of tokens longer than ``j`` (a prefix of ``ids``).
        columns: uint8 [L, N], the transposed matrix (``columns[j]`` contiguous: byte ``j`` of every row).
        first_byte_rows: 256 int64 arrays, ascending rows whose first byte is ``b``.
    """

    def __init__(self, token_bytes: list):
        pairs = [(i, b) for i, b in enumerate(token_bytes) if b]
        pairs.sort(key=lambda p: -len(p[1]))
        self.ids = np.array([i for i, _ in pairs], dtype=np.int64)
        self.lengths = np.array([len(b) for _, b in pairs], dtype=np.int64)
        width = int(self.lengths[0]) if pairs else 0
        self.matrix = np.zeros((len(pairs), width), dtype=np.uint8)
        for k, (_, b) in enumerate(pairs):
            self.matrix[k, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        self.active = np.array([int(np.sum(self.lengths > j)) for j in range(width)], dtype=np.int64)
        self.columns = np.ascontiguousarray(self.matrix.T)
        first = self.matrix[:, 0] if width else np.zeros(0, dtype=np.uint8)
        self.first_byte_rows = [np.nonzero(first == b)[0].astype(np.int64) for b in range(256)]


def decode_utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is complete UTF-8 text (drops at most 3 trailing bytes
    of a character cut in half; "" if none decodes). Used for jump-forward strings."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""
