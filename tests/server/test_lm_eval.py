"""``/v1/completions`` as lm-evaluation-harness's ``local-completions`` model uses it to score
log-likelihoods: the exact request body it sends (``lm_eval/models/openai_completions.py``,
``_create_payload(generate=False)``: token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``,
``temperature: 0``, ``seed``), parsed the way it parses it (``token_logprobs[ctxlen:-1]``, greedy
check against ``top_logprobs``), against ``Engine.score`` on the same engine (tiny model, CPU)."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from sglite.server.runner import ServerThread

PAIRS = [("The capital of France is", " Paris"), ("Water boils at", " one hundred degrees"),
         ("Once upon a time", " there was a king")]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    with ServerThread(eng) as srv:
        model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield eng, srv, model
    eng.shutdown()


def _encode_pair(tok, context, continuation):
    """lm-eval's ``_encode_pair``: the continuation is what encoding the whole adds to the context."""
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return ctx, whole[len(ctx):]


def _parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs``, restated."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        assert ctxlen > 0
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops))
        res.append((sum(lps), greedy))
    return res


def test_lm_eval_loglikelihood_request_matches_engine_score(served):
    eng, srv, model = served
    tok = eng.tokenizer
    encoded = [_encode_pair(tok, c, x) for c, x in PAIRS]
    payload = {"model": model, "prompt": [c + x for c, x in encoded], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(srv.url + "/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    for choice, (c, x) in zip(sorted(out["choices"], key=lambda ch: ch["index"]), encoded):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(c) + len(x) + 1  # every prompt token, then the one generated
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
        assert all(isinstance(t, dict) and len(t) >= 1 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    parsed = _parse_logprobs(out, [len(c) for c, _ in encoded])
    for (total, greedy), (context, continuation), (c, x) in zip(parsed, PAIRS, encoded):
        want = eng.score(context, [continuation])[0]
        assert want["token_ids"] == x
        assert math.isclose(total, sum(want["logprobs"]), abs_tol=1e-3), (total, want["logprobs"])
        assert isinstance(greedy, bool)


def test_echo_with_max_tokens_zero_returns_only_the_prompt(served):
    eng, srv, model = served
    context, continuation = PAIRS[0]
    c, x = _encode_pair(eng.tokenizer, context, continuation)
    body = {"model": model, "prompt": c + x, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(c) + len(x) and lps[0] is None
    assert choice["text"] == eng.tokenizer.decode(c + x) and r.json()["usage"]["completion_tokens"] == 0
    want = eng.score(context, [continuation])[0]["logprobs"]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(lps[len(c):], want))
    # a text prompt works the same way (lm-eval's tokenized_requests=False)
    r = httpx.post(srv.url + "/v1/completions", json=dict(body, prompt=context + continuation), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(eng.tokenizer.encode(context + continuation))


def test_max_tokens_zero_without_echo_is_400(served):
    _, srv, model = served
    r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]


def test_streamed_echo_logprobs_equal_the_full_response(served):
    eng, srv, model = served
    c, x = _encode_pair(eng.tokenizer, *PAIRS[1])
    body = {"model": model, "prompt": c + x, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    full = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lps, text = [], ""
    with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                lps += (ch["logprobs"] or {}).get("token_logprobs") or []
    assert text == full["text"]
    assert len(lps) == len(full["logprobs"]["token_logprobs"]) == len(c) + len(x) + 3
    assert lps[0] is None and all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lps[1:], full["logprobs"]["token_logprobs"][1:]))
