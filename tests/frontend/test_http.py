"""RuntimeEndpoint against a live sglite server backed by the server's FakeEngine (no model)."""
import pytest

import sglite
from sglite.errors import InvalidRequestError
from sglite.frontend import RuntimeEndpoint

runner = pytest.importorskip("sglite.server.runner")
fake = pytest.importorskip("sglite.server.testing")

METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


@pytest.fixture(scope="module")
def endpoint():
    with runner.ServerThread(fake.FakeEngine()) as srv:
        ep = RuntimeEndpoint(srv.url)
        yield ep
        ep.close()


@sglite.function
def chat(s, question, method="token_length_normalized"):
    s += sglite.user(question)
    with s.assistant():
        s += sglite.select("pick", choices=["apple", "apple pie", "banana"], choices_method=method)
    s += sglite.user("Say something.")
    s += sglite.assistant(sglite.gen("answer", max_tokens=12, temperature=0))


def test_model_info_gives_chat_template(endpoint):
    tpl = endpoint.get_chat_template()
    assert tpl.prefix("user") == "<|im_start|>user\n" and tpl.end_of_turn == "<|im_end|>"


def test_program_over_http_all_select_methods(endpoint):
    for m in METHODS:
        st = chat.run(question="Pick a fruit.", method=m, backend=endpoint)
        assert st.error() is None
        assert st["pick"] in ("apple", "apple pie", "banana")
        meta = st.get_meta_info("pick")
        assert len(meta["normalized_prompt_logprobs"]) == 3
        assert st.get_meta_info("answer")["completion_tokens"] <= 12
        assert [m["role"] for m in st.messages()] == ["user", "assistant", "user", "assistant"]


def test_score_counts_only_choice_tokens(endpoint):
    # byte-level fake tokenizer: one token per character of the continuation
    out = endpoint.score("Pick: ", ["apple", "kiwi"])
    assert [len(r["token_ids"]) for r in out] == [5, 4]
    assert out[1]["token_ids"] == list(b"kiwi")


def test_stream_over_http_joins(endpoint):
    st = chat.run(question="Stream it.", backend=endpoint, stream=True)
    chunks = list(st.text_iter())
    assert len(chunks) > 5 and "".join(chunks) == st.text()
    st = chat.run(question="Stream it.", backend=endpoint, stream=True)
    assert "".join(st.text_iter("answer")) == st["answer"]


def test_fork_and_batch_over_http_report_cached_tokens(endpoint):
    prefix = "A long shared context sentence. " * 12

    @sglite.function
    def tot(s):
        s += prefix
        f = s.fork(3)
        f += lambda i: f"Idea {i}:" + sglite.gen("idea", max_tokens=4, temperature=0)
        f.join()

    st = tot.run(backend=endpoint)
    n_prefix = len(prefix.encode())
    assert all(m["cached_tokens"] >= n_prefix - 2 for m in st.get_meta_info("idea"))
    states = chat.run_batch([("Q1",), ("Q2",), ("Q3",)], backend=endpoint, num_threads=3)
    assert [s.messages()[0]["content"] for s in states] == ["Q1", "Q2", "Q3"]
    assert endpoint.flush_cache() is True
    assert "max_total_tokens" in endpoint.get_server_info()


def test_bad_request_raises_invalid_request(endpoint):
    with pytest.raises(InvalidRequestError):
        endpoint.generate("x", {"max_new_tokens": -3})
