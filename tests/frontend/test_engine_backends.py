"""The DSL on the real default model (SmolLM2-135M-Instruct), through the in-process engine and
through HTTP (RuntimeEndpoint on a ServerThread serving the same engine). Short outputs only."""
import json

import pytest

import sglite

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(sglite, "Engine"), reason="sglite.Engine is still the interface stub"),
]

METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


@pytest.fixture(scope="module")
def backends(real_engine):
    """The shared session engine, wrapped in-process and served over HTTP."""
    from sglite.frontend import EngineBackend, RuntimeEndpoint
    from sglite.server.runner import ServerThread

    with ServerThread(real_engine) as srv:
        ep = RuntimeEndpoint(srv.url)
        yield {"engine": EngineBackend(real_engine), "http": ep}
        ep.close()


@sglite.function
def capital(s, country, method="token_length_normalized"):
    s += sglite.user("What is the capital of " + country + "? Answer with one city.")
    with s.assistant():
        s += sglite.select("city", choices=["Paris", "Paris, France", "London", "Berlin"], choices_method=method)


@pytest.mark.parametrize("kind", ["engine", "http"])
def test_select_all_methods_return_a_choice(backends, kind):
    for m in METHODS:
        st = capital.run(country="France", method=m, backend=backends[kind])
        assert st.error() is None, st.error()
        assert st["city"] in ("Paris", "Paris, France", "London", "Berlin")
        assert len(st.get_meta_info("city")["normalized_prompt_logprobs"]) == 4
        assert st.messages()[-1]["content"] == st["city"]


@pytest.mark.parametrize("kind", ["engine", "http"])
def test_int_and_json_schema_gen(backends, kind):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    @sglite.function
    def extract(s):
        s += sglite.user("Alice is 31 years old. How old is Alice? Reply with a number.")
        s += sglite.assistant(sglite.gen_int("age", max_tokens=6))
        s += sglite.user("Give Alice's name and age as JSON.")
        s += sglite.assistant(sglite.gen("info", max_tokens=40, json_schema=schema))

    st = extract.run(backend=backends[kind], temperature=0)
    assert st.error() is None, st.error()
    int(st["age"])
    import jsonschema
    jsonschema.validate(json.loads(st["info"]), schema)


@pytest.mark.parametrize("kind", ["engine", "http"])
def test_fork_branches_hit_the_cached_prefix(backends, kind):
    tok = backends["engine"].engine.tokenizer
    sentence = "The quick brown fox jumps over the lazy dog near the river bank. "
    prefix = sentence * 22
    n_prefix = len(tok.encode(prefix))
    assert n_prefix >= 300

    @sglite.function
    def tot(s):
        s += prefix
        forks = s.fork(3)
        forks += lambda i: f"Thought {i}:" + sglite.gen("t", max_tokens=3)
        forks.join()

    backends[kind].flush_cache()
    st = tot.run(backend=backends[kind], temperature=0)
    cached = [m["cached_tokens"] for m in st.get_meta_info("t")]
    assert all(c >= n_prefix - 2 for c in cached), (cached, n_prefix)


@pytest.mark.parametrize("kind", ["engine", "http"])
def test_stream_chunks_join(backends, kind):
    st = capital.run(country="Spain", backend=backends[kind])  # warm path, no stream
    assert st["city"]

    @sglite.function
    def story(s):
        s += sglite.user("Say hello in five words.")
        s += sglite.assistant(sglite.gen("hello", max_tokens=10))

    st = story.run(backend=backends[kind], stream=True, temperature=0)
    chunks = list(st.text_iter())
    assert len(chunks) > 3 and "".join(chunks) == st.text()
    st = story.run(backend=backends[kind], stream=True, temperature=0)
    assert "".join(st.text_iter("hello")) == st["hello"]


def test_run_batch_same_outputs_any_thread_count(backends):
    @sglite.function
    def fact(s, thing):
        s += "Fact about " + thing + ":" + sglite.gen("f", max_tokens=4, stop="\n")

    items = [{"thing": t} for t in ("cats", "dogs", "tea", "rain", "iron", "salt", "moon", "bread",
                                    "paper", "glass", "snow", "wind")]
    runs = [fact.run_batch(items, backend=backends["engine"], temperature=0, num_threads=n) for n in (1, 4, "auto")]
    outs = [[s["f"] for s in r] for r in runs]
    assert outs[0] == outs[1] == outs[2]
    assert all(s.error() is None for r in runs for s in r)
