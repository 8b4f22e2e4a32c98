"""Frontend DSL against the counting FakeBackend (no model): building, running, state, errors."""
import json
import re
import threading

import pytest

import sglite
from sglite.errors import GrammarError, InvalidRequestError
from sglite.frontend.chat_template import ChatTemplate
from sglite.frontend.testing import CHATML, FakeBackend


@pytest.fixture
def fb():
    return FakeBackend()


def test_sglite_reexports_frontend_names():
    for name in ("function", "gen", "select", "user", "assistant", "system", "user_begin", "set_default_backend",
                 "RuntimeEndpoint", "flush_cache", "get_server_info", "gen_int", "gen_string"):
        assert getattr(sglite, name) is getattr(sglite.frontend, name)


def test_gen_inherits_run_defaults_and_overrides(fb):
    @sglite.function
    def prog(s):
        s += "Q: hi\nA:" + sglite.gen("a", max_tokens=7) + "\n"
        s += "B:" + sglite.gen("b", temperature=0.5, stop=["x"])

    st = prog.run(backend=fb, temperature=0, max_new_tokens=33, top_k=5)
    a, b = (r["sampling_params"] for r in fb.calls("generate"))
    assert (a["max_new_tokens"], a["temperature"], a["top_k"]) == (7, 0, 5)
    assert (b["max_new_tokens"], b["temperature"], b["stop"]) == (33, 0.5, ["x"])
    assert "stop" not in a  # outside a role nothing is added
    assert st.text() == f"Q: hi\nA:{st['a']}\nB:{st['b']}"


def test_end_of_turn_is_a_stop_inside_roles_and_messages(fb):
    @sglite.function
    def chat(s, q):
        s += sglite.user(q)
        with s.assistant():
            s += sglite.gen("ans", max_tokens=8, stop="\n")
        s += sglite.user_begin() + "more" + sglite.user_end()
        s += sglite.assistant(sglite.gen("ans2", max_tokens=4))

    st = chat.run(q="  hello", backend=fb)
    stops = [r["sampling_params"]["stop"] for r in fb.calls("generate")]
    assert stops == [["\n", "<|im_end|>"], ["<|im_end|>"]]
    assert st.messages() == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": st["ans"]},
                             {"role": "user", "content": "more"}, {"role": "assistant", "content": st["ans2"]}]
    assert st.text().startswith("<|im_start|>user\n  hello<|im_end|>\n<|im_start|>assistant\n")


def test_default_system_prompt_is_inserted_once():
    tpl = ChatTemplate(CHATML.role_markers, "<|im_end|>", "Be brief.")
    fb = FakeBackend(template=tpl)

    @sglite.function
    def chat(s):
        s += sglite.user("a") + sglite.assistant("b") + sglite.user("c")

    msgs = chat.run(backend=fb).messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == "Be brief."


def test_nested_roles_fail_before_any_request(fb):
    @sglite.function
    def bad(s):
        s += sglite.user("first") + sglite.assistant(sglite.gen("x", max_tokens=4))
        with s.user():
            s += "q"
            with s.assistant():
                s += sglite.gen("y")

    with pytest.raises(InvalidRequestError, match="Nested roles"):
        bad.run(backend=fb)
    with pytest.raises(InvalidRequestError, match="Nested roles"):
        bad.run_batch([{}, {}], backend=fb)
    assert fb.requests == []


def test_bad_regex_schema_dtype_raise_at_build():
    with pytest.raises(GrammarError, match="regex"):
        sglite.gen("x", regex="[a-")
    with pytest.raises(GrammarError, match="json_schema"):
        sglite.gen("x", json_schema="{not json")
    with pytest.raises(GrammarError, match="json_schema"):
        sglite.gen("x", json_schema={"type": "objekt"})
    with pytest.raises(InvalidRequestError, match="dtype"):
        sglite.gen("x", dtype=list)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        sglite.gen("x", max_tokens=-1)
    with pytest.raises(InvalidRequestError, match="choices"):
        sglite.select("x", choices=[])
    with pytest.raises(ValueError):
        sglite.select("x", choices=["a"], temperature=0.7)


def test_bad_regex_inside_program_sends_nothing(fb):
    @sglite.function
    def prog(s):
        s += "a" + sglite.gen("x", max_tokens=2)
        s += "b" + sglite.gen("y", regex="(")

    with pytest.raises(GrammarError):
        prog.run(backend=fb)
    assert fb.requests == []


def test_dtype_and_json_schema_params(fb):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    @sglite.function
    def prog(s):
        s += "n=" + sglite.gen_int("n") + ";"
        s += sglite.gen("f", dtype=float, stop=";")
        s += sglite.gen("j", json_schema=schema)
        s += sglite.gen("b", dtype=bool)

    st = prog.run(backend=fb)
    calls = [r["sampling_params"] for r in fb.calls("generate")]
    assert calls[0]["regex"] == sglite.frontend.REGEX_INT and calls[0]["stop"] == [" ", "\n"]
    assert calls[1]["stop"] == [";", " ", "\n"]
    assert json.loads(calls[2]["json_schema"]) == schema
    assert calls[3]["regex"] == "(True|False)"
    assert int(st["n"]) == int(st["n"].strip())
    assert st["b"] in ("True", "False")


def test_gen_choices_is_select(fb):
    @sglite.function
    def prog(s):
        s += "Pick: " + sglite.gen("c", choices=["x", "y", "z"])

    st = prog.run(backend=fb)
    assert st["c"] in ("x", "y", "z") and st.text() == "Pick: " + st["c"]
    assert len(fb.calls("score")) == 1 and fb.calls("generate") == []


def test_arity_errors_send_nothing(fb):
    @sglite.function
    def prog(s, a, b="B"):
        s += a + b + sglite.gen("x", max_tokens=2)

    for bad in ([("1",), ("1", "2", "3")], [{"a": "1"}, {"b": "2"}], [{"a": "1", "c": 3}], [("1",), 5]):
        with pytest.raises(InvalidRequestError, match="arguments mismatch|must be a dict"):
            prog.run_batch(bad, backend=fb)
    with pytest.raises(InvalidRequestError):
        prog.run(backend=fb)
    with pytest.raises(InvalidRequestError):
        prog.run("1", "2", "3", backend=fb)
    with pytest.raises(InvalidRequestError, match="num_threads"):
        prog.run_batch([("1",)], backend=fb, num_threads=0)
    assert fb.requests == []
    assert prog.run_batch([], backend=fb) == []


def test_run_batch_order_tuples_threads_and_bar(fb, capsys):
    @sglite.function
    def prog(s, a, b="!"):
        s += "Item " + a + b + sglite.gen("x", max_tokens=8)

    items = [(str(i),) if i % 2 else {"a": str(i), "b": "?"} for i in range(10)]
    one = prog.run_batch(items, backend=fb, num_threads=1)
    four = prog.run_batch(items, backend=fb, num_threads=4, progress_bar=True)
    auto = prog.run_batch(items, backend=fb)
    assert [s.text() for s in one] == [s.text() for s in four] == [s.text() for s in auto]
    assert [s.text().split(" ")[1][:1] for s in one] == [str(i) for i in range(10)]
    assert "10/10" in capsys.readouterr().err


def test_run_batch_hoists_shared_prefix_once(fb):
    shots = "".join(f"Q: question number {i}?\nA: answer {i}.\n" for i in range(6))

    @sglite.function
    def fewshot(s, q):
        s += sglite.system("You answer questions.")
        s += shots + "Q: " + q + "\nA:" + sglite.gen("a", max_tokens=4, stop="\n")

    states = fewshot.run_batch([{"q": f"what is {i}"} for i in range(8)], backend=fb)
    cached = fb.calls("cache_prefix")
    assert len(cached) == 1
    prefix = cached[0]["prompt"]
    assert prefix.startswith("<|im_start|>system\nYou answer questions.")
    assert shots in prefix and "what is 0" not in prefix
    gens = fb.calls("generate")
    assert len(gens) == 8 and all(g["prompt"].startswith(prefix) for g in gens)
    assert fb.requests[0]["kind"] == "cache_prefix"
    assert all(f"what is {i}\nA:" + s["a"] in s.text() for i, s in enumerate(states))
    fb2 = FakeBackend()
    fewshot.run_batch([{"q": "x"}], backend=fb2)
    assert fb2.calls("cache_prefix") == []  # one program: nothing to share


def test_fork_caches_prefix_then_runs_branches_concurrently():
    started, release = [], threading.Event()

    def respond(prompt, sp):
        started.append(prompt)
        release.wait(5)
        return "tip"

    fb = FakeBackend(respond=respond)
    long = "Shared context. " * 20

    @sglite.function
    def tot(s):
        s += long
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}: " + sglite.gen("idea", max_tokens=4)
        forks += sglite.gen("more", max_tokens=2)
        forks.join()
        s += "Done."

    t = threading.Thread(target=lambda: results.append(tot.run(backend=fb)))
    results = []
    t.start()
    for _ in range(200):
        if len(started) == 3:
            break
        threading.Event().wait(0.01)
    assert len(started) == 3  # all three branches are in flight at once
    release.set()
    t.join(10)
    st = results[0]
    assert fb.requests[0]["kind"] == "cache_prefix" and fb.requests[0]["prompt"] == long
    assert st["idea"] == ["tip"] * 3 and st["more"] == ["ti"] * 3
    assert st.text() == long + "Done."
    gens = fb.calls("generate")
    assert all(g["prompt"].startswith(long) for g in gens)
    metas = st.get_meta_info("idea")
    assert all(m["cached_tokens"] >= len(long) - 2 for m in metas)


def test_join_concate_and_append_and_indexing(fb):
    @sglite.function
    def prog(s):
        s += "Start."
        f = s.fork(2)
        f += [" one", " two"]
        f[1] += sglite.gen("g", max_tokens=3)
        assert f[0].text() == "Start. one"
        f.join(mode="concate_and_append")

    st = prog.run(backend=fb)
    assert st.text().startswith("Start. one two") and "g" not in st.variables()


def test_streaming_chunks_join_to_final_text(fb):
    @sglite.function
    def prog(s, q):
        s += sglite.user(q)
        s += sglite.assistant(sglite.gen("a", max_tokens=40))
        s += "tail" + sglite.select("c", choices=["x", "yy"])

    st = prog.run(q="stream please", backend=fb, stream=True)
    chunks = list(st.text_iter())
    assert len(chunks) > 3 and "".join(chunks) == st.text()
    st2 = prog.run(q="stream please", backend=fb, stream=True)
    var_chunks = list(st2.text_iter("a"))
    assert len(var_chunks) > 1 and "".join(var_chunks) == st2["a"]
    assert "".join(st2.text_iter("c")) == st2["c"]
    st3 = prog.run(q="no stream", backend=fb)
    assert list(st3.text_iter()) == [st3.text()]


def test_backend_error_goes_to_state_error():
    def respond(prompt, sp):
        raise RuntimeError("backend exploded")

    @sglite.function
    def prog(s):
        s += "x" + sglite.gen("a", max_tokens=2) + sglite.gen("b", max_tokens=2)

    st = prog.run(backend=FakeBackend(respond=respond))
    assert isinstance(st.error(), RuntimeError)
    with pytest.raises(KeyError, match="backend exploded"):
        st["a"]


def test_var_scope_bind_call_and_default_backend(fb):
    @sglite.function
    def prog(s, topic, style):
        with s.var_scope("block"):
            s += style + " about " + topic + ": " + sglite.gen("x", max_tokens=5)

    st = prog.bind(style="A poem").run(topic="cats", backend=fb)
    assert st["block"] == "A poem about cats: " + st["x"]
    with pytest.raises(InvalidRequestError):
        prog.bind(colour="red")
    sglite.set_default_backend(fb)
    try:
        assert prog(topic="dogs", style="Haiku")["block"].startswith("Haiku about dogs")
        assert sglite.flush_cache() is True and sglite.get_server_info()["backend"] == "fake"
    finally:
        sglite.set_default_backend(None)
    with pytest.raises(InvalidRequestError, match="backend"):
        prog.run(topic="a", style="b")


def test_bad_run_options_and_first_param():
    with pytest.raises(InvalidRequestError):
        sglite.function(lambda x: None)

    @sglite.function
    def prog(s):
        s += "x"

    with pytest.raises(InvalidRequestError, match="temperature"):
        prog.run(backend=FakeBackend(), temperature=-1)
    with pytest.raises(InvalidRequestError, match="unknown run option"):
        prog.run_batch([{}], backend=FakeBackend(), temprature=0)
    with pytest.raises(InvalidRequestError):
        prog.run(backend=FakeBackend()).__iadd__(None)


def test_n_gives_list_and_first_continues(fb):
    @sglite.function
    def prog(s):
        s += "x" + sglite.gen("a", n=3, max_tokens=5)

    st = prog.run(backend=fb)
    assert isinstance(st["a"], list) and len(st["a"]) == 3
    assert st.text() == "x" + st["a"][0] and len(st.get_meta_info("a")) == 3
    assert re.fullmatch(r"ans\d+", st["a"][1])


def test_prefix_trace_survives_broad_except_and_stream_body_errors(fb):
    @sglite.function
    def prog(s):
        s += "a" + sglite.gen("x", max_tokens=3)
        try:
            value = s["x"]
        except Exception:  # must not swallow the tracer's stop
            value = "swallowed"
        s += "|" + value
        if value == "swallowed":
            raise AssertionError("the prefix trace leaked into the program")

    st = prog.run(backend=fb)
    assert st.text() == "a" + st["x"] + "|" + st["x"]

    @sglite.function
    def boom(s):
        s += "a" + sglite.gen("x", max_tokens=3)
        s["x"]
        raise RuntimeError("body failed")

    st = boom.run(backend=fb, stream=True)
    assert "".join(st.text_iter()) == st.text()
    assert isinstance(st.error(), RuntimeError)


def test_frontend_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, sglite, sglite.frontend, sglite.frontend.testing\n"
            "sglite.function; sglite.gen('x'); sglite.RuntimeEndpoint\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_fork_and_join_errors_are_sglite_errors(fb):
    """docs/dsl.md: every error sglite raises on purpose is an SgliteError (a breaker found bare
    ValueErrors from fork / join), and it names the call."""
    @sglite.function
    def bad_size(s, size):
        s.fork(size)

    @sglite.function
    def bad_exprs(s):
        forks = s.fork(2)
        forks += ["a", "b", "c"]

    @sglite.function
    def bad_mode(s):
        s.fork(2).join("nope")

    for prog, kw, word in ((bad_size, {"size": 0}, "fork"), (bad_size, {"size": -1}, "fork"),
                           (bad_exprs, {}, "fork"), (bad_mode, {}, "join")):
        with pytest.raises(sglite.SgliteError, match=word) as exc:
            prog.run(backend=fb, **kw)
        assert isinstance(exc.value, InvalidRequestError)


def test_gen_with_choices_warns_that_its_constraint_is_ignored():
    with pytest.warns(UserWarning, match="regex is ignored"):
        sglite.gen("x", regex="[0-9]+", choices=["a", "b"])
    with pytest.warns(UserWarning, match="json_schema, dtype is ignored"):
        sglite.gen("x", json_schema={"type": "string"}, dtype=int, choices=["a", "b"])
