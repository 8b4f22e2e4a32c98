"""``/openapi.json`` tells the truth: for every route it publishes, real responses (OK and errors,
JSON and each streamed ``data:`` event) validate against the schema it publishes for that status
and content type; every route of the schema is exercised here. Also: ``max_tokens: null`` on
``/v1/completions`` means the documented default, and a text part without ``text`` is named."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]

# (method, schema path, concrete path, body, expected status)
CASES = [
    ("post", "/generate", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}}, 200),
    ("post", "/generate", "/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2},
                                        "return_logprob": True}, 200),
    ("post", "/generate", "/generate", {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}, 200),
    ("post", "/generate", "/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400),
    ("post", "/generate", "/generate", {"text": 5}, 400),
    ("post", "/generate", "/generate", {"text": "hi", "separate_reasoning": True}, 400),  # no --reasoning-parser
    ("get", "/health", "/health", None, 200),
    ("get", "/health_generate", "/health_generate", None, 200),
    ("get", "/get_model_info", "/get_model_info", None, 200),
    ("get", "/get_server_info", "/get_server_info", None, 200),
    ("post", "/flush_cache", "/flush_cache", None, 200),
    ("post", "/load_lora_adapter", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, 400),  # no LoRA here
    ("post", "/unload_lora_adapter", "/unload_lora_adapter", {"lora_name": "a"}, 400),
    ("post", "/start_profile", "/start_profile", None, 400),  # the fake engine has no model to profile
    ("post", "/stop_profile", "/stop_profile", None, 400),  # none started
    ("post", "/abort_request", "/abort_request", {"rid": "nope"}, 200),
    ("post", "/abort_request", "/abort_request", {}, 400),
    ("get", "/metrics", "/metrics", None, 200),
    ("post", "/separate_reasoning", "/separate_reasoning", {"text": "<think>a</think>b", "reasoning_parser": "qwen3"},
     200),
    ("post", "/separate_reasoning", "/separate_reasoning", {"text": "x"}, 400),
    ("get", "/v1/models", "/v1/models", None, 200),
    ("get", "/v1/models/{model_id}", "/v1/models/fake-model", None, 200),
    ("get", "/v1/models/{model_id}", "/v1/models/nope", None, 404),
    ("post", "/v1/completions", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2}, 200),
    ("post", "/v1/completions", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}}, 200),
    ("post", "/v1/completions", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("post", "/v1/completions", "/v1/completions", {"prompt": "hi", "model": "nope"}, 404),
    ("post", "/v1/chat/completions", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, 200),
    ("post", "/v1/chat/completions", "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 200,
                                                              "tools": TOOLS, "tool_choice": "required",
                                                              "stream_options": {"include_usage": True}}, 200),
    ("post", "/v1/chat/completions", "/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required",
                                                              "max_tokens": 200}, 200),
    ("post", "/v1/chat/completions", "/v1/chat/completions", {"messages": []}, 400),
    ("post", "/v1/chat/completions", "/v1/chat/completions", {"messages": "x"}, 400),
    ("post", "/v1/responses", "/v1/responses", {"input": "hi", "max_output_tokens": 8}, 200),
    ("post", "/v1/responses", "/v1/responses", {"input": "hi", "max_output_tokens": 8, "stream": True}, 200),
    ("post", "/v1/responses", "/v1/responses", {"input": "hi", "background": True, "stream": True}, 400),
    ("post", "/v1/responses", "/v1/responses", {"input": "hi", "background": True, "max_output_tokens": 4}, 200),
    ("post", "/v1/responses/{response_id}/cancel", "/v1/responses/resp_nope/cancel", None, 404),
    ("get", "/v1/responses/{response_id}", "/v1/responses/resp_nope", None, 404),
    ("delete", "/v1/responses/{response_id}", "/v1/responses/resp_nope", None, 404),
    ("get", "/v1/responses/{response_id}/input_items", "/v1/responses/resp_nope/input_items", None, 404),
    ("post", "/tokenize", "/tokenize", {"prompt": "hi", "return_token_strs": True}, 200),
    ("post", "/tokenize", "/tokenize", {}, 400),
    ("post", "/detokenize", "/detokenize", {"tokens": [104, 105]}, 200),
    ("post", "/detokenize", "/detokenize", {"tokens": [-1]}, 400),
    ("post", "/v1/tokenize", "/v1/tokenize", {"messages": [{"role": "user", "content": "x"}]}, 200),
    ("post", "/v1/detokenize", "/v1/detokenize", {"tokens": []}, 400),
]


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeEngine(context_length=4096), ServerConfig(port=0, enable_metrics=True)) as srv:
        schema = httpx.get(srv.url + "/openapi.json").json()
        yield srv.url, schema


def _validate(schema: dict, sub: dict, instance) -> None:
    jsonschema.validate(instance, {**sub, "components": schema["components"]},
                        cls=jsonschema.Draft202012Validator)


def _check(schema: dict, method: str, path: str, r: httpx.Response) -> None:
    op = schema["paths"][path][method]
    status = str(r.status_code)
    assert status in op["responses"], f"{method} {path} answered {status}, not in the schema"
    content = op["responses"][status].get("content", {})
    ctype = r.headers.get("content-type", "").split(";")[0]
    assert ctype in content, f"{method} {path} {status}: content type {ctype} not published"
    sub = content[ctype]["schema"]
    if ctype == "text/event-stream":
        events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]" or path == "/v1/responses"
        for e in events:
            if e != "[DONE]":
                _validate(schema, sub, json.loads(e))
    elif ctype == "application/json":
        _validate(schema, sub, r.json())
    else:
        assert isinstance(r.text, str)


@pytest.mark.parametrize("method,path,url_path,body,status", CASES)
def test_response_validates_against_published_schema(server, method, path, url_path, body, status):
    url, schema = server
    r = httpx.request(method.upper(), url + url_path, json=body, timeout=30)
    assert r.status_code == status, r.text
    _check(schema, method, path, r)


def test_every_published_route_is_exercised(server):
    _, schema = server
    published = {(m, p) for p, ops in schema["paths"].items() for m in ops}
    assert published == {(m, p) for m, p, *_ in CASES}


def test_no_422_and_error_statuses_have_the_error_body(server):
    _, schema = server
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            for code in ("401", "404", "500"):
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorResponse"), (method, path, code)


def test_401_and_413_validate_too():
    with ServerThread(FakeEngine(), ServerConfig(port=0, api_key="k", max_request_bytes=1024)) as srv:
        schema = httpx.get(srv.url + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 401
        _check(schema, "post", "/v1/chat/completions", r)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 5000}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 413
        _check(schema, "post", "/v1/completions", r)


def test_completions_max_tokens_null_is_the_documented_default(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_text_part_without_text_names_the_missing_field(server):
    url, _ = server
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].text" and "text" in err["message"] and "required" in err["message"]


@pytest.mark.slow
def test_fuzzed_responses_conform_to_the_schema():
    """Schema-generated requests (valid and invalid, 80 derandomized cases): every answer's status,
    content type and body are the ones the schema publishes (schemathesis' conformance checks)."""
    import schemathesis
    import schemathesis.specs.openapi.checks as oc
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    from sglite.server.app import create_app

    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(FakeEngine(context_length=96)))
    ops = [r.ok() for r in schema.get_all_operations()]
    cases = st.one_of(*[op.as_strategy(generation_mode=mode) for op in ops
                        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    checks = [oc.status_code_conformance, oc.content_type_conformance, oc.response_schema_conformance]

    @settings(max_examples=80, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case):
        case.call_and_validate(checks=checks)
    run()
