"""Structural tags (issue 34): free text that switches into a constrained tool call at the opener,
the reasoning gate, and the union of calls and a schema.

Oracles: Python's ``in`` for the free-text automaton (random strings over a small alphabet, stop
strings with borders); hand-written sentences in and out of the language; a fake runner that
writes free text token by token (tokens straddling the opener included), then samples from the
grammar's masks; every call it produces must parse with the server's Hermes parser and validate
with ``jsonschema`` against the tool's parameters, over the JSON-Schema-Bench schemas used as tool
parameters (30 in the fast tier, all 310 marked slow), read with a JSON decoder and also with the
server's parser where no argument string holds the closer (that parser cuts a block at the first
``</tool_call>``, even inside a string). Speculative decoding's use of the matcher
(accept a draft, roll back the rejected tail) is checked against a fresh matcher replaying the kept
tokens. The runtime end to end (tiny random model, NGRAM speculation) is in
``test_structural_tag_engine.py``.
"""
import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from sglite.constrained import GrammarBackend, TokenizerInfo
from sglite.constrained.free_text import text_without
from sglite.constrained.structural_tag import reasoning_gated
from sglite.errors import GrammarError
from sglite.server.tool_calls import ToolPlan, parse_tool_calls
from sglite.server.tool_constraint import auto_tools_format, calls_only_format
from sglite.server.tool_parsers.formats import get_format

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench" / "maskbench_sample.jsonl"
HERMES = get_format("qwen25")
# multi-byte tokens: pieces of the opener (some straddling its end into the call), JSON fragments
PIECES = ["<tool_call>", "<tool", "_call", "call>", "ool_call>\n{\"", "call>\n", ">\n{\"name\": \"", "\"name\"",
          ": \"", "\", \"arguments\": {", "}\n</tool_call>", "</tool_call>", "\n</", "{\"", "\":", "\",\"", "\"}",
          "true", "false", "null", "[]", "{}", "},", "],", "</think>", "</th", "ink>", "<think>", " the", " a", "> x", "ink>\n\n{\""]
EOS = 256 + len(PIECES)
VOCAB = [bytes([b]) for b in range(256)] + [p.encode() for p in PIECES] + [None]


@pytest.fixture(scope="module")
def backend():
    return GrammarBackend(TokenizerInfo(list(VOCAB), {EOS}))


def _tool(name, params):
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _tag(tools, parallel=True):
    return {"type": "structural_tag", "format": auto_tools_format(tools, HERMES, parallel)}


def _accepts(compiled, text: str) -> bool:
    m = compiled.matcher()
    return all(m.accept_token(b) for b in text.encode()) and m.accept_token(EOS)


def _allowed(m) -> list[int]:
    mask = torch.zeros(1, (len(VOCAB) + 31) // 32, dtype=torch.int32)
    m.fill_next_token_bitmask(mask)
    bits = mask[0].numpy().view("uint8")
    import numpy as np
    return np.flatnonzero(np.unpackbits(bits, bitorder="little")[:len(VOCAB)]).tolist()


# ---------------------------------------------------------------------- free text automaton
@pytest.mark.parametrize("stops", [["ab"], ["abab"], ["aa", "bab"], ["a"], ["</think>"], ["abc", "bcd", "cab"]])
def test_free_text_dfa_is_text_without_the_stops(stops):
    dfa, rng = text_without(stops), random.Random(0)
    alphabet = sorted(set("".join(stops)) | {"x"})
    for _ in range(400):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        assert dfa.accepts(s.encode()) == (not any(w in s for w in stops)), (stops, s)


def test_free_text_rejects_empty_stop():
    with pytest.raises(GrammarError, match="must not be empty"):
        text_without(["x", ""])


# ---------------------------------------------------------------------- language
WEATHER = _tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"], "additionalProperties": False})
TIME = _tool("get_time", {"type": "object", "properties": {}})
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("text,ok", [
    ("", True), ("just text <tool but no call", True), (CALL_W, True), ("Sure. " + CALL_W + "\nDone.", True),
    (CALL_W + "\n" + CALL_T, True), ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"town":"Paris"}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}', False),  # no closer: not complete
    ("<tool_call>oops", False), ("<<tool_call" + CALL_W[len("<tool_call"):], True),
])
def test_auto_tools_language(backend, text, ok):
    assert _accepts(backend.compile("structural_tag", _tag([WEATHER, TIME])), text) == ok


def test_one_call_without_parallel_tool_calls(backend):
    g = backend.compile("structural_tag", _tag([WEATHER, TIME], parallel=False))
    assert _accepts(g, "x " + CALL_T) and not _accepts(g, CALL_W + "\n" + CALL_T) and not _accepts(g, CALL_T + " more")


def test_union_of_calls_and_a_schema(backend):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [
        calls_only_format([WEATHER, TIME], HERMES, True), {"type": "json_schema", "json_schema": schema}]}}
    g = backend.compile("structural_tag", tag)
    for text, ok in [('{"answer":4}', True), (CALL_W, True), (CALL_W + "\n" + CALL_T, True),
                     ("free text", False), ('pre ' + CALL_W, False), ('{"answer":"x"}', False)]:
        assert _accepts(g, text) == ok, text


def test_legacy_sglang_form_and_errors_name_the_field(backend):
    legacy = {"structures": [{"begin": "<f=w>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f="]}
    g = backend.compile("structural_tag", json.dumps(legacy))
    assert _accepts(g, "a <f=w>12</f> b") and not _accepts(g, "<f=w>x</f>")
    for bad, needle in [({"format": {"type": "nope"}}, "structural_tag.format.type"),
                        ({"format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [
                            {"type": "tag", "begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}]}},
                         "structural_tag.format.tags[0].begin"),
                        ({"format": {"type": "sequence", "elements": [{"type": "json_schema", "json_schema": 5}]}},
                         "structural_tag.format.elements[0].json_schema"),
                        ({"structures": []}, "structural_tag.structures"), ("{bad json", "not valid JSON")]:
        with pytest.raises(GrammarError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            backend.compile("structural_tag", bad)


def test_tokens_straddling_the_opener(backend):
    g = backend.compile("structural_tag", _tag([WEATHER]))
    m = g.matcher()
    for b in b"hi <t":
        assert m.accept_token(b)
    straddle = 256 + PIECES.index("ool_call>\n{\"")
    assert straddle in _allowed(m)  # ends the opener and starts the call's JSON
    assert m.accept_token(straddle)
    assert m.find_jump_forward_string() == 'name": "get_weather", "arguments": {"city":"'
    m2 = g.matcher()
    for b in b"hi <tool":
        assert m2.accept_token(b)
    allowed = _allowed(m2)
    assert 256 + PIECES.index("_call") in allowed and 256 + PIECES.index("> x") in allowed  # "<tool> x": text
    assert EOS in allowed  # "<tool" is still free text
    assert m2.accept_token(256 + PIECES.index("_call"))
    assert 256 + PIECES.index("> x") not in _allowed(m2)  # would complete the opener, then break the call
    assert m2.accept_token(ord(">"))
    assert EOS not in _allowed(m2) and 256 + PIECES.index(" the") not in _allowed(m2)


def test_reasoning_gate_leaves_the_thinking_free(backend):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    g = backend.compile("structural_tag", reasoning_gated("</think>", {"type": "json_schema", "json_schema": schema}))
    m = g.matcher()
    thinking = '<think>\nMaybe {"a": 1}? Or </thin k>... "quotes", <tool_call> even.\n'
    for b in thinking.encode():  # every byte of the thinking is allowed, JSON-looking or not
        assert len(_allowed(m)) >= 255 and m.accept_token(b)
    assert m.accept_token(256 + PIECES.index("</th")) and m.accept_token(256 + PIECES.index("ink>"))
    for b in b'\n\n{"a":"x"}':
        assert m.accept_token(b)
    assert m.is_accepting() and _allowed(m) == [EOS]
    assert not _accepts(g, '<think>x</think>\n\nnot json') and not _accepts(g, '{"a":"x"}')


# ---------------------------------------------------------------------- fake runner over real schemas
def _weights(allowed: list[int]) -> list[float]:
    out = []
    for t in allowed:
        if t == EOS:
            out.append(200.0)
            continue
        b = VOCAB[t]
        out.append(30.0 if set(b) <= set(b'"}],') else 3.0 if b.isdigit() else 1.0)
    return out


OPENER_SCRIPT = [ord(c) for c in "Let me look that up. <t"] + [256 + PIECES.index("ool_call>\n{\"")]


def _fake_run(compiled, rng, max_tokens=3000, spec_rollbacks=False, script=OPENER_SCRIPT):
    """Script free text (with a token straddling the opener), then sample from the masks."""
    m = compiled.matcher()
    toks = []
    for t in script:
        assert t in _allowed(m) and m.accept_token(t), "free text must stay free"
        toks.append(t)
    while len(toks) < max_tokens and not m.is_terminated():
        allowed = _allowed(m)
        t = rng.choices(allowed, _weights(allowed))[0]
        if spec_rollbacks and rng.random() < 0.3:  # a speculative step: accept a draft, reject its tail
            draft = [t]
            probe = m.fork()
            probe.accept_token(t)
            while len(draft) < 4 and not probe.is_terminated():
                nxt = rng.choices(_allowed(probe), _weights(_allowed(probe)))[0]
                probe.accept_token(nxt)
                draft.append(nxt)
            for d in draft:
                assert m.accept_token(d)
            m.rollback(len(draft) - 1)
            fresh = compiled.matcher()
            assert all(fresh.accept_token(x) for x in toks + [t])
            assert _allowed(fresh) == _allowed(m) and fresh.is_terminated() == m.is_terminated()
        else:
            assert m.accept_token(t)
        toks.append(t)
        if t == EOS:
            break
    text = b"".join(VOCAB[t] for t in toks if t != EOS).decode("utf-8", errors="replace")
    return text, m.is_terminated()


def _schemas(n=None):
    if not SAMPLE.exists():
        pytest.skip("JSON-Schema-Bench sample absent")
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    return rows if n is None else random.Random(34).sample(rows, n)


def _as_parameters(schema):
    """Tool parameters are an object schema: any other schema becomes the one property ``value``
    (its ``$defs`` / ``definitions`` stay at the root, where its references point)."""
    if isinstance(schema, dict) and schema.get("type") == "object":
        return schema
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}
    inner = {k: v for k, v in schema.items() if k not in defs} if isinstance(schema, dict) else schema
    return {"type": "object", "properties": {"value": inner}, "required": ["value"], **defs}


def _run_schemas(backend, rows, spec_rollbacks=False):
    done = unsupported = cut = 0
    for i, row in enumerate(rows):
        schema = _as_parameters(row["schema"])
        tools = [_tool("lookup", schema), TIME]
        try:
            compiled = backend.compile("structural_tag", _tag(tools))
        except GrammarError:
            unsupported += 1  # the schema compiler refuses what it cannot enforce (its own tests)
            continue
        text, finished = _fake_run(compiled, random.Random(i), spec_rollbacks=spec_rollbacks)
        if not finished:
            cut += 1
            continue
        calls = _hermes_calls(text)
        assert len(calls) >= 1, (row["id"], text)
        for c in calls:
            target = schema if c["name"] == "lookup" else TIME["function"]["parameters"]
            jsonschema.validators.validator_for(target)(target).validate(c["arguments"])
        if not any("</tool_call>" in json.dumps(c, ensure_ascii=False) for c in calls):
            # the server's parser agrees (it cuts at the first closer, even one inside a JSON string)
            content, parsed = parse_tool_calls(text, ToolPlan("auto", tools))
            assert content == "Let me look that up." and len(parsed) == len(calls), (row["id"], text)
        done += 1
    return done, unsupported, cut


def _hermes_calls(text: str) -> list[dict]:
    """Every ``<tool_call>`` block's JSON, read with a JSON decoder (a closer inside a string
    value does not end the block); each block must be complete: JSON, then the closer."""
    dec, out, pos = json.JSONDecoder(), [], 0
    while (i := text.find("<tool_call>", pos)) >= 0:
        j = i + len("<tool_call>")
        j += len(text[j:]) - len(text[j:].lstrip())
        obj, j = dec.raw_decode(text, j)
        j += len(text[j:]) - len(text[j:].lstrip())
        assert text.startswith("</tool_call>", j), text
        out.append(obj)
        pos = j + len("</tool_call>")
    return out


def test_every_call_parses_and_validates_fast_sample(backend):
    rows = _schemas(30)
    done, unsupported, cut = _run_schemas(backend, rows)
    assert done >= 0.8 * len(rows), (done, unsupported, cut)


def test_speculative_rollbacks_keep_the_masks_exact(backend):
    done, _, _ = _run_schemas(backend, _schemas(8), spec_rollbacks=True)
    assert done >= 6


@pytest.mark.slow
def test_every_call_parses_and_validates_all_schemas(backend):
    rows = _schemas()
    done, unsupported, cut = _run_schemas(backend, rows)
    assert done >= 0.85 * len(rows), (done, unsupported, cut)


def test_compiled_once_per_tool_set(backend):
    from sglite.constrained import structural_tag as st

    tool = _tool("only_here", {"type": "object", "properties": {"q": {"type": "string", "maxLength": 7}}})
    def schemas():
        return sum(1 for kind, _ in st._PIECES._items if kind.startswith("json_schema"))

    before = schemas()
    g = backend.compile("structural_tag", _tag([tool]))
    assert schemas() == before + 1
    assert backend.compile("structural_tag", json.loads(json.dumps(_tag([tool])))) is g  # same tools: same grammar
    gated = reasoning_gated("</think>", auto_tools_format([tool], HERMES, True))
    backend.compile("structural_tag", gated)  # a new grammar, but the tool's schema is not converted again
    assert schemas() == before + 1


THINKING = '<think>\nThe user wants {"a": 1}? No: "quotes", </thin, <tool_call>, [1,2,...\n</th'


@pytest.mark.parametrize("seed", range(3))
def test_json_after_reasoning_validates_and_the_thinking_is_untouched(backend, seed):
    """A fake runner writes the thinking (JSON-like text, a near-miss of the end marker), ends it
    with a token straddling the marker into the answer, then samples the answer from the masks."""
    script = [ord(c) for c in THINKING] + [256 + PIECES.index('ink>\n\n{"')]
    rows = [r for r in _schemas(40) if r["schema"].get("type") == "object"]  # the answer starts with {"
    done = 0
    for i, row in enumerate(rows[seed * 4:seed * 4 + 4]):
        try:
            g = backend.compile("structural_tag", reasoning_gated(
                "</think>", {"type": "json_schema", "json_schema": row["schema"]}))
        except GrammarError:
            continue
        text, finished = _fake_run(g, random.Random(i), script=script)  # asserts every thinking token is allowed
        if not finished:
            continue
        thinking, answer = text.split("</think>", 1)
        assert thinking == THINKING[:-len("</th")]  # the thinking is exactly what the runner wrote
        jsonschema.validators.validator_for(row["schema"])(row["schema"]).validate(json.loads(answer))
        done += 1
    assert done >= 2
