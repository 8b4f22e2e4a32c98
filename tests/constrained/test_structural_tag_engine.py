"""Structural tags through the runtime (issue 34): a tiny random model steered into the trigger by a
logit bias writes free text and tool calls; every complete call parses and validates; greedy output
is token for token the same with NGRAM speculation (drafts taken from the plain run's output, so
draft tokens are accepted and rejected inside the tags), alone and batched, streamed and not.

The trigger is ``<`` (one token of the SmolLM2 vocabulary; a logit bias on it steers the random
model), the tag's begin ``<call>``, so after the trigger the rest of the begin is forced text
(jump-forward) and the arguments follow the tool's schema."""
import json
import re

import jsonschema
import pytest

from sglite.testing import oracle_drafts

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days", "metric"],
          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9}, "metric": {"type": "boolean"}}}
TAG = json.dumps({"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<"], "tags": [
        {"type": "tag", "begin": '<call>{"name": "get_weather", "arguments": ',
         "content": {"type": "json_schema", "json_schema": PARAMS}, "end": "}</call>"}]}})
LT = 44  # "<" in the SmolLM2 vocabulary


def _calls(text: str) -> list[dict]:
    out = []
    for m in re.finditer(r"<call>(.*?)</call>", text, re.S):
        obj = json.loads(m.group(1))
        assert obj["name"] == "get_weather"
        jsonschema.validate(obj["arguments"], PARAMS)
        out.append(obj)
    return out


def test_steered_calls_parse_and_speculation_is_greedy_identical(ngram_pair):
    base, spec = ngram_pair
    prompts = ["What is the weather in Paris? Answer:", "Tell me about Rome and Oslo, please."]
    sps = [{"max_new_tokens": 100, "temperature": 0, "structural_tag": TAG, "logit_bias": {LT: b}}
           for b in (30.0, 6.0)]
    outs = base.generate(prompts, sps)
    n_calls = 0
    for o in outs:
        assert len(re.findall("<(?!/)", o["text"])) == o["text"].count("<call>")  # the trigger opens a call
        n_calls += len(_calls(o["text"]))
    assert n_calls >= 2
    want = [o["output_ids"] for o in outs]
    with oracle_drafts(spec, {tuple(spec.tokenizer.encode(p)): w for p, w in zip(prompts, want)}, 6):
        assert [o["output_ids"] for o in spec.generate(prompts, sps)] == want
        assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want
    # NGRAM's own drafts too (no oracle), streamed
    got = [list(spec.generate(p, s, stream=True))[-1]["output_ids"] for p, s in zip(prompts, sps)]
    assert got == want
    spec.check_invariants()


def test_sampled_calls_always_parse(ngram_pair):
    _, spec = ngram_pair
    sp = {"max_new_tokens": 120, "temperature": 1.0, "structural_tag": TAG, "logit_bias": {LT: 20.0}}
    texts = [o["text"] for o in spec.generate(["Weather please:"] * 6, [dict(sp, sampling_seed=s) for s in range(6)])]
    assert sum(len(_calls(t)) for t in texts) >= 1  # _calls validates every complete call
    for t in texts:
        assert len(re.findall("<(?!/)", t)) == t.count("<call>")
        assert t.count("<call>") - t.count("</call>") in (0, 1)  # only the last call may be cut by max_new_tokens
