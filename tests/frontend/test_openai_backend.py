"""``sglite.OpenAI``: @function programs against an OpenAI-compatible server (our own, with the
FakeEngine; and a scripted transport for the logprob path)."""
import json

import httpx
import pytest

import sglite
from sglite.errors import InvalidRequestError
from sglite.frontend.testing import CHATML

runner = pytest.importorskip("sglite.server.runner")
fake = pytest.importorskip("sglite.server.testing")


@pytest.fixture(scope="module")
def server():
    eng = fake.FakeEngine()
    with runner.ServerThread(eng) as srv:
        yield srv, eng


def _backend(srv, **kw):
    return sglite.OpenAI("fake-model", base_url=srv.url + "/v1", api_key="EMPTY", **kw)


@sglite.function
def completion_prog(s):
    s += "The answer is" + sglite.gen("a", max_tokens=5, temperature=0, stop="!")


@sglite.function
def chat_prog(s, q):
    s += sglite.system("Be brief.")
    s += sglite.user(q)
    s += sglite.assistant(sglite.gen("a", max_tokens=11, temperature=0))


def test_gen_outside_roles_uses_completions_with_the_program_text(server):
    srv, eng = server
    be = _backend(srv)
    st = completion_prog.run(backend=be)
    assert st.error() is None and st["a"] == "Hello"
    assert eng.calls[-1]["prompt"] == "The answer is" and eng.calls[-1]["sampling_params"]["max_new_tokens"] == 5
    assert st.text() == "The answer isHello"
    assert be.token_usage.completion_tokens >= 5 and be.token_usage.prompt_tokens >= len("The answer is")


def test_gen_opening_an_assistant_turn_uses_chat_messages(server):
    srv, eng = server
    be = _backend(srv)
    st = chat_prog.run(q="Hi?", backend=be)
    assert st.error() is None and st["a"] == "Hello world"
    # the server rendered the program's messages with the model's template
    assert eng.calls[-1]["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                                       "<|im_start|>assistant\n")
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant"]
    assert st.messages()[-1]["content"] == "Hello world"
    # the program text uses the server's role markers (from /get_model_info)
    assert st.text().startswith("<|im_start|>system\nBe brief.")


def test_chat_model_refuses_a_gen_that_continues_text(server):
    srv, _ = server
    be = _backend(srv, is_chat_model=True)

    @sglite.function
    def partial(s):
        s += sglite.user("Q")
        s += sglite.assistant("Sure: " + sglite.gen("a", max_tokens=4, temperature=0))

    st = partial.run(backend=be)
    assert isinstance(st.error(), InvalidRequestError) and "assistant turn" in str(st.error())
    # auto mode: the same program continues the turn through /completions
    st = partial.run(backend=_backend(srv))
    assert st.error() is None and st["a"] == "Hell"


def test_regex_and_json_schema_reach_the_server(server):
    srv, eng = server
    be = _backend(srv)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    @sglite.function
    def constrained(s):
        s += "Number: " + sglite.gen("num", regex=r"\d+", max_tokens=4)
        s += sglite.user("JSON please")
        s += sglite.assistant(sglite.gen("obj", json_schema=schema, max_tokens=20))

    st = constrained.run(backend=be, temperature=0)
    assert st.error() is None and st["num"] == "42" and json.loads(st["obj"]) == {"n": 1}
    regex_call, json_call = eng.calls[-2:]
    assert regex_call["sampling_params"]["regex"] == r"\d+"
    assert json.loads(json_call["sampling_params"]["json_schema"]) == schema


def test_select_constrained_in_chat_and_scored_or_constrained_in_completions(server):
    srv, eng = server
    eng.regex_reply = "banana"
    try:
        @sglite.function
        def pick(s):
            s += sglite.user("Pick a fruit.")
            s += sglite.assistant(sglite.select("fruit", ["apple", "banana", "cherry"]))

        st = pick.run(backend=_backend(srv))
        assert st.error() is None and st["fruit"] == "banana"
        meta = st.get_meta_info("fruit")
        assert meta["method"] == "constrained" and meta["generated"] == "banana"
        assert eng.calls[-1]["sampling_params"]["regex"] == "(apple|banana|cherry)"

        @sglite.function
        def pick_text(s):
            s += "Fruit: " + sglite.select("fruit", ["apple", "banana"])

        st = pick_text.run(backend=_backend(srv))
        assert st.error() is None and st["fruit"] in ("apple", "banana")
        meta = st.get_meta_info("fruit")
        assert meta.get("method") == "constrained" or len(meta["normalized_prompt_logprobs"]) == 2
    finally:
        eng.regex_reply = "42"


def test_fork_and_run_batch_through_the_openai_api(server):
    srv, eng = server
    prefix = "A long shared context sentence for every branch and item. " * 3

    @sglite.function
    def ideas(s, topic):
        s += prefix + topic
        forks = s.fork(2)
        forks += lambda i: f" Idea {i}:" + sglite.gen("idea", max_tokens=4, temperature=0)
        forks.join()

    n0 = len(eng.calls)
    states = ideas.run_batch([{"topic": "cats"}, {"topic": "dogs"}], backend=_backend(srv), num_threads=2)
    assert all(st.error() is None and st["idea"] == ["Hell", "Hell"] for st in states)
    # one completion per branch, nothing else (no prefill-only request: the API has none)
    assert len(eng.calls) - n0 == 4 and all(c["sampling_params"]["max_new_tokens"] == 4 for c in eng.calls[n0:])


def test_api_speculative_execution_serves_later_gens_from_one_request(server):
    srv, eng = server

    def character(s):
        s += "Say:" + sglite.gen("a", stop="!") + "! The" + sglite.gen("b", stop=" fox") + " fox"
        s += sglite.gen("c", stop=".", max_tokens=40)

    spec, plain = sglite.function(num_api_spec_tokens=64)(character), sglite.function(character)
    be = _backend(srv)
    n0 = len(eng.calls)
    st = spec.run(backend=be, temperature=0)
    assert st.error() is None and len(eng.calls) - n0 == 1          # one request for three gens
    assert (st["a"], st["b"], st["c"]) == ("Hello world", " quick brown", " jumps over the lazy dog")
    assert eng.calls[-1]["sampling_params"]["max_new_tokens"] == 128 and not eng.calls[-1]["sampling_params"].get("stop")
    spec_prompt = be.token_usage.prompt_tokens
    be.token_usage.reset()
    st = plain.run(backend=be, temperature=0)
    assert st.error() is None and len(eng.calls) - n0 == 4 and be.token_usage.prompt_tokens > spec_prompt
    # a program that writes something else drops the speculated text and asks again
    other = sglite.function(num_api_spec_tokens=64)(
        lambda s: s.__iadd__("Say:" + sglite.gen("a", stop="!") + "? No." + sglite.gen("b", stop="!")))
    n1 = len(eng.calls)
    st = other.run(backend=be, temperature=0)
    assert st.error() is None and len(eng.calls) - n1 == 2 and st["b"] == "Hello world"
    with pytest.raises(InvalidRequestError, match="num_api_spec_tokens"):
        sglite.function(num_api_spec_tokens=0)(character)


def test_stream_joins_to_the_text(server):
    srv, _ = server
    st = chat_prog.run(q="Stream", backend=_backend(srv), stream=True)
    chunks = list(st.text_iter("a"))
    assert len(chunks) >= 2 and "".join(chunks) == st["a"] == "Hello world"


def test_server_errors_name_the_route(server):
    srv, _ = server
    st = completion_prog.run(backend=sglite.OpenAI("no-such-model", base_url=srv.url + "/v1"))
    assert isinstance(st.error(), InvalidRequestError) and "/completions" in str(st.error())
    with pytest.raises(ValueError, match="extra_body"):
        sglite.OpenAI("m", base_url=srv.url, extra_body="tgi")


def _scripted(handler):
    be = sglite.OpenAI("m", base_url="http://scripted/v1", chat_template=CHATML)
    be._client = httpx.Client(transport=httpx.MockTransport(handler))
    return be


def test_select_by_echo_logprobs_scores_only_the_choice_tokens():
    sent = []

    def handler(request):
        body = json.loads(request.content)
        sent.append(body)
        choices = []
        for i, text in enumerate(body["prompt"]):
            # tokens: "Fruit:" " " + the continuation's characters in one token each + a generated token
            toks = ["Fruit:", " "] + list(text[len("Fruit: "):]) + ["<gen>"] if text.startswith("Fruit") else \
                list(text) + ["<gen>"]
            offs, o = [], 0
            for t in toks[:-1]:
                offs.append(o)
                o += len(t)
            offs.append(len(text))
            lps = [None] + [-0.1 if t in "apple" else -2.0 for t in toks[1:]]
            choices.append({"index": i, "text": text + "x", "finish_reason": "length",
                            "logprobs": {"tokens": toks, "token_logprobs": lps, "text_offset": offs}})
        return httpx.Response(200, json={"choices": choices, "usage": {"prompt_tokens": 9, "completion_tokens": 1}})

    @sglite.function
    def pick(s):
        s += "Fruit: " + sglite.select("f", ["kiwi", "apple"])

    st = pick.run(backend=_scripted(handler))
    assert st.error() is None and st["f"] == "apple"
    meta = st.get_meta_info("f")
    assert meta["normalized_prompt_logprobs"] == [pytest.approx(-2.0), pytest.approx(-0.1)]
    assert [e[2] for e in meta["input_token_logprobs"][0]] == list("kiwi")
    assert sent[0]["echo"] is True and sent[0]["prompt"] == ["Fruit: kiwi", "Fruit: apple"]


def test_vllm_style_sends_guided_fields():
    sent = []

    def handler(request):
        body = json.loads(request.content)
        sent.append(body)
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "no"},
                                                      "finish_reason": "stop"}]})

    be = _scripted(handler)
    be.extra_body = "vllm"

    @sglite.function
    def prog(s):
        s += sglite.user("Yes or no?")
        s += sglite.assistant(sglite.select("v", ["yes", "no"]))
        s += sglite.user("Digits")
        s += sglite.assistant(sglite.gen("d", regex=r"\d+", top_k=5))

    st = prog.run(backend=be)
    assert st.error() is None and st["v"] == "no"
    assert sent[0]["guided_choice"] == ["yes", "no"]
    assert sent[1]["guided_regex"] == r"\d+" and sent[1]["top_k"] == 5 and "regex" not in sent[1]


@pytest.mark.slow
def test_select_scores_match_the_engine_on_the_default_model(real_engine):
    """Echo-logprob scores through /v1/completions equal the engine's own select scores."""
    @sglite.function
    def capital(s):
        s += "Q: What is the capital of France?\nA: The capital of France is" + sglite.select(
            "city", [" Paris", " London", " Berlin"])

    local = capital.run(backend=real_engine)
    with runner.ServerThread(real_engine) as srv:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        remote = capital.run(backend=sglite.OpenAI(model, base_url=srv.url + "/v1"))
    assert remote.error() is None and remote["city"] == local["city"] == " Paris"
    assert remote.get_meta_info("city")["normalized_prompt_logprobs"] == pytest.approx(
        local.get_meta_info("city")["normalized_prompt_logprobs"], abs=1e-3)
