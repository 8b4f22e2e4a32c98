"""``/tokenize`` and ``/detokenize`` (vLLM's shapes, also under ``/v1/``): prompt and chat messages,
round trips, limits as 400s naming the field, off the event loop (the preparation pool)."""
from __future__ import annotations

import httpx
import pytest

from sglite.server.runner import ServerThread
from sglite.server.testing import FakeEngine


@pytest.fixture(scope="module")
def url():
    with ServerThread(FakeEngine(context_length=777)) as srv:
        yield srv.url


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_prompt_and_back(url, prefix):
    r = httpx.post(url + prefix + "/tokenize", json={"prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6 and body["max_model_len"] == 777
    assert len(body["token_strs"]) == 6
    back = httpx.post(url + prefix + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "héllo"}


def test_tokenize_messages_renders_the_template(url):
    msgs = [{"role": "user", "content": "hi"}]
    body = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_gen = httpx.post(url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"]


@pytest.mark.parametrize("route,body,field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": []}, "tokens"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
])
def test_limits_name_the_field(url, route, body, field):
    r = httpx.post(url + route, json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_real_tokenizer_round_trip_and_special_tokens(tiny_model_dir):
    """The real tokenizer behind the routes' functions: add_special_tokens, chat messages, ids back."""
    from types import SimpleNamespace

    from sglite.runtime.tokenizer import Tokenizer
    from sglite.server.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

    tok = Tokenizer.from_dir(tiny_model_dir)
    engine = SimpleNamespace(tokenizer=tok, apply_chat_template=tok.apply_chat_template)
    vocab = len(tok.hf)

    def check_ids(ids, field):
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"{field}: bad ids")
    client = SimpleNamespace(engine=engine, context_length=2048, check_ids=check_ids)
    out = tokenize(client, TokenizeRequest(prompt="Hello world", return_token_strs=True))
    assert out["tokens"] == tok.encode("Hello world", add_special_tokens=True) and out["count"] == len(out["tokens"])
    assert len(out["token_strs"]) == out["count"]
    assert detokenize(client, DetokenizeRequest(tokens=out["tokens"]))["prompt"].endswith("Hello world")
    chat = tokenize(client, TokenizeRequest(messages=[{"role": "user", "content": "Hi"}]))
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat["tokens"] == tok.encode(rendered)


def test_a_lone_surrogate_is_a_400_in_our_words(url):
    """Not the tokenizers library's internal text ("TextEncodeInput must be Union[...]")."""
    r = httpx.post(url + "/tokenize", content=b'{"prompt": "a\\ud800b"}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "not valid Unicode text" in err["message"]
    assert "TextEncodeInput" not in err["message"] and "surrogates not allowed" in err["message"]
