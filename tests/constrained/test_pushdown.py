"""Pushdown masks (recursive grammars) with multi-byte tokens that cross rule boundaries: the mask
must equal brute force (``accept_token`` on every token), at every nesting depth, including masks
served from the stack-suffix cache."""
import json
import random

import pytest
import torch

from sglite import grammars
from sglite.constrained import GrammarBackend, TokenizerInfo
from sglite.constrained.json_schema import FLEXIBLE_WS

FRAGMENTS = ['"', '",', '"}', '":', '": ', '":"', '"]', "},", "}]", "]}", "],", "]]", "}}", "},{", "[{", "[[",
             "{\"", ", \"", ",\"", "\n ", "\n  ", "\n    ", "  ", " {", " [", " \"", "1,", "12", "0.5", "1e3",
             "true", "true}", "null]", "false,", "-1", "a\"", "ab", "\\n", "\\\"", "x\":", "\": [", "\": {",
             "(", ")", "((", "))", "+(", ")*", "1+", "2)", ")+(", "a", "b", "é", "\u00e9\"", ":{", ":[",
             "value", "children", "\"value\":", "\"children\":[", "{\"value\":", "]}]", "}]}", ",\n"]
ARITH = r'''
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''
TREE = {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["value"],
                           "properties": {"value": {"type": "integer"},
                                          "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}


def _vocab():
    rng = random.Random(0)
    pieces = [bytes([b]) for b in range(256)] + [f.encode() for f in FRAGMENTS]
    for _ in range(300):  # random concatenations of structural fragments
        pieces.append(b"".join(rng.choice(FRAGMENTS).encode() for _ in range(rng.randint(2, 4))))
    pieces = list(dict.fromkeys(pieces))
    return TokenizerInfo(pieces + [None], {len(pieces)})


@pytest.fixture(scope="module")
def info():
    return _vocab()


def _tokenize(info, text: bytes):
    """Greedy longest-match tokenization (so multi-byte tokens are actually used)."""
    table = {b: i for i, b in enumerate(info.token_bytes) if b}
    out, i = [], 0
    while i < len(text):
        for n in range(min(16, len(text) - i), 0, -1):
            if text[i:i + n] in table:
                out.append(table[text[i:i + n]])
                i += n
                break
    return out


def _check_path(info, compiled, text: bytes):
    m, bm = compiled.matcher(), torch.zeros(1, info.mask_words, dtype=torch.int32)
    for tok in _tokenize(info, text) + [min(info.eos_token_ids)]:
        m.fill_next_token_bitmask(bm, 0)
        words = bm[0].tolist()
        for t in range(info.vocab_size):
            allowed = bool((words[t // 32] >> (t % 32)) & 1)
            assert m.fork().accept_token(t) == allowed, (text, info.token_bytes[tok], info.token_bytes[t])
        assert m.accept_token(tok), (text, info.token_bytes[tok])
    assert m.is_terminated()


def _nested(depth):
    return {"a": [1, {"b": "x"}, _nested(depth - 1) if depth else None], "c": {"d": True}}


def _tree(depth):
    return {"value": depth, "children": [_tree(depth - 1), {"value": 0}] if depth else []}


@pytest.mark.parametrize("kind,spec,text", [
    ("json_object", None, json.dumps(_nested(4), indent=1)),
    ("json_object", None, json.dumps(_nested(3))),
    ("lark", grammars.read("json"), json.dumps(_nested(1), indent=2)),
    ("json_schema", TREE, json.dumps(_tree(4))),
    ("ebnf", ARITH, "((1+2)*(3+(4)))+((5))"),
])
def test_pushdown_mask_equals_brute_force(info, kind, spec, text):
    # flexible whitespace, so the masks also cover the whitespace paths between tokens
    backend = GrammarBackend(info, whitespace_pattern=FLEXIBLE_WS)
    _check_path(info, backend.compile(kind, spec), text.encode())


def test_deep_nesting_hits_the_stack_cache(info):
    g = GrammarBackend(info).compile("json_schema", TREE)
    m = g.matcher()
    text = json.dumps(_tree(12), separators=(",", ":")).encode()
    for tok in _tokenize(info, text):
        g.mask(m.state)
        assert m.accept_token(tok)
    masker = g._stack_masks
    # far fewer cached stack masks than (stack, depth) combinations: deeper levels reuse shallower ones
    assert len(masker._cache) < 60, len(masker._cache)
