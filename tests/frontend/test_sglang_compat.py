"""SGLang programs run unchanged (issue 13): star export, module paths, global_config, run/run_batch
options, Runtime, fork reads without join, fork before any text."""
import json
import re
import subprocess
import sys
import threading
import time

import pytest

import sglite
from sglite.errors import InvalidRequestError
from sglite.frontend.testing import FakeBackend


def _py(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout


# ------------------------------------------------------------------ 1. exports
def test_star_import_exports_the_dsl_without_torch():
    out = _py("import sys\nfrom sglite import *\n"
              "import json\n"
              "names = ['function', 'gen', 'gen_int', 'gen_string', 'select', 'system', 'user', 'assistant',"
              " 'user_begin', 'assistant_end', 'set_default_backend', 'RuntimeEndpoint', 'Runtime', 'OpenAI',"
              " 'global_config', 'greedy_token_selection', 'token_length_normalized',"
              " 'unconditional_likelihood_normalized', 'REGEX_INT', 'REGEX_FLOAT', 'REGEX_STR', 'REGEX_BOOL',"
              " 'flush_cache', 'get_server_info']\n"
              "g = globals()\n"
              "print(json.dumps({'missing': [n for n in names if n not in g], 'torch': 'torch' in sys.modules,"
              " 'int': REGEX_INT}))")
    res = json.loads(out)
    assert res == {"missing": [], "torch": False, "int": r"[-+]?[0-9]+[ \n]*"}


def test_choice_methods_and_regexes_at_top_level_and_sglang_paths():
    from sglite.frontend.choices import ChoicesMethod
    for name in ("greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized"):
        assert isinstance(getattr(sglite, name), ChoicesMethod)
        assert name in sglite.__all__
    from sglite.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
    assert (sglite.REGEX_INT, sglite.REGEX_FLOAT, sglite.REGEX_BOOL, sglite.REGEX_STR) == (
        REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR)
    import re
    assert re.fullmatch(REGEX_FLOAT, "-3.25\n") and re.fullmatch(REGEX_INT, "+17 ")
    assert re.fullmatch(REGEX_STR, '"New York 2"') and not re.fullmatch(REGEX_STR, '"a,b"')
    assert re.fullmatch(REGEX_BOOL, "True") and not re.fullmatch(REGEX_BOOL, "true")
    assert "Engine" not in sglite.__all__  # star import stays torch-free; sglite.Engine still works lazily


def test_global_config_attributes_and_default_backend():
    from sglite import global_config
    assert global_config.verbosity == 0
    assert global_config.skip_special_tokens_in_output is True
    assert global_config.spaces_between_special_tokens_in_out is True
    assert global_config.enable_precache_with_tracing is True
    assert global_config.enable_parallel_encoding is True
    fb = FakeBackend()
    old = global_config.default_backend
    try:
        sglite.set_default_backend(fb)
        assert global_config.default_backend is fb
        global_config.default_backend = None
        with pytest.raises(InvalidRequestError, match="no backend"):
            _qa.run(q="x")
        global_config.default_backend = fb  # assignment works as SGLang programs do it
        assert _qa.run(q="hi")["a"].startswith("ans")
        with pytest.raises(TypeError, match="not a backend"):
            global_config.default_backend = 42
    finally:
        global_config.default_backend = old


@sglite.function
def _qa(s, q):
    s += "Q: " + q + "\nA:" + sglite.gen("a", max_tokens=8)


# ------------------------------------------------------------------ 3. run / run_batch options
def test_run_accepts_sglang_run_options_and_sends_them():
    fb = FakeBackend()
    st = _qa.run(q="x", backend=fb, stop_regex=r"\d+", return_text_in_logprobs=True, return_logprob=True, n=1)
    assert st.error() is None
    req = fb.calls("generate")[-1]
    assert req["sampling_params"]["stop_regex"] == r"\d+"
    assert req["return_text_in_logprobs"] is True and req["return_logprob"] is True
    with pytest.raises(InvalidRequestError, match="stop_regex"):
        _qa.run(q="x", backend=fb, stop_regex="(")


def test_run_batch_generator_style_yields_in_order_while_later_items_run():
    gate = threading.Event()

    def respond(prompt, sp):
        if "q3" in prompt:
            gate.wait(10)  # the last item is held until the first states have been yielded
        return re.search(r"q\d", prompt).group()

    fb = FakeBackend(respond=respond)
    gen = _qa.run_batch([{"q": f"q{i}"} for i in range(4)], backend=fb, generator_style=True, num_threads="auto",
                        progress_bar=False)
    assert not isinstance(gen, list)
    first = next(gen)
    assert first["a"] == "q0" and not gate.is_set()  # yielded while the last item is still held
    gate.set()
    rest = list(gen)
    assert [s.text().split("Q: ")[1][:2] for s in [first] + rest] == ["q0", "q1", "q2", "q3"]
    assert _qa.run_batch([], backend=fb, generator_style=True) == []


def test_run_batch_progress_bar_and_auto_threads(capsys):
    fb = FakeBackend()
    states = _qa.run_batch([("a",), ("b",)], backend=fb, num_threads="auto", progress_bar=True)
    assert [s["a"] for s in states] and "2/2" in capsys.readouterr().err
    with pytest.raises(InvalidRequestError, match="num_threads"):
        _qa.run_batch([("a",)], backend=fb, num_threads=0)


def test_gen_return_text_in_logprobs_reaches_the_backend():
    fb = FakeBackend()

    @sglite.function
    def p(s):
        s += "x" + sglite.gen("v", max_tokens=3, return_logprob=True, return_text_in_logprobs=False)
    p.run(backend=fb)
    assert fb.calls("generate")[-1]["return_text_in_logprobs"] is False


def test_verbosity_2_prints_the_text(capsys):
    from sglite import global_config
    try:
        global_config.verbosity = 2
        st = _qa.run(q="loud", backend=FakeBackend())
    finally:
        global_config.verbosity = 0
    assert st.text() in capsys.readouterr().out


def test_text_async_iter_streams_without_blocking_the_loop():
    import asyncio

    @sglite.function
    def story(s):
        s += sglite.user("Tell a story.")
        s += sglite.assistant(sglite.gen("story", max_tokens=40))

    async def main():
        st = story.run(backend=FakeBackend(respond=lambda p, sp: "once upon a time there was a fox"),
                       stream=True)
        ticks = []

        async def ticker():
            for _ in range(3):
                ticks.append(1)
                await asyncio.sleep(0)
        t = asyncio.ensure_future(ticker())
        pieces = [c async for c in st.text_async_iter("story")]
        metas = [m async for _, m in story.run(backend=FakeBackend(), stream=True).text_async_iter(
            "story", return_meta_data=True)]
        await t
        return st, pieces, metas, ticks

    st, pieces, metas, ticks = asyncio.run(main())
    assert len(pieces) > 3 and "".join(pieces) == st["story"] == "once upon a time there was a fox"
    assert metas[-1]["completion_tokens"] > 0 and all(m == {} for m in metas[:-1]) and ticks == [1, 1, 1]


# ------------------------------------------------------------------ 5. forks
def test_reading_a_fork_variable_without_join_waits_for_the_branch():
    def respond(prompt, sp):
        time.sleep(0.2)
        return "branch" + prompt[-1]

    @sglite.function
    def no_join(s):
        s += "Start "
        forks = s.fork(2)
        forks += lambda i: str(i)
        forks += sglite.gen("x", max_tokens=8)
        return forks  # never joined

    st = no_join.run(backend=FakeBackend(respond=respond))
    forks = st.ret_value
    assert [forks[i]["x"] for i in range(2)] == ["branch0", "branch1"]


def test_fork_before_any_text_starts_from_bos():
    from sglite.frontend.backend import EngineBackend
    from sglite.server.testing import EOS, FakeEngine

    eng = FakeEngine()
    eng.score = lambda *a, **k: []  # EngineBackend asks for it; select is not used here

    @sglite.function
    def fork_first(s):
        forks = s.fork(2)
        forks += sglite.gen("x", max_tokens=5, temperature=0)
        forks.join()

    st = fork_first.run(backend=EngineBackend(eng))
    assert st.error() is None and len(st["x"]) == 2
    assert eng.calls[-1]["input_ids"] == [EOS] and eng.calls[-1]["prompt"] is None


def test_fork_before_any_text_over_http():
    runner = pytest.importorskip("sglite.server.runner")
    from sglite.server.testing import FakeEngine

    @sglite.function
    def gen_first(s):
        s += sglite.gen("x", max_tokens=4, temperature=0)

    with runner.ServerThread(FakeEngine()) as srv:
        ep = sglite.RuntimeEndpoint(srv.url)
        st = gen_first.run(backend=ep)
        assert st.error() is None and st["x"] == "Hell"
        ep.close()


# ------------------------------------------------------------------ 2. Runtime
def test_runtime_checks_server_args_before_starting():
    from sglite.frontend.runtime import server_argv
    argv = server_argv("m", {"disable_radix_cache": True, "chunked_prefill_size": 64, "log_level": "error",
                             "enable_jump_forward": False, "dtype": "float32"})
    assert argv[:2] == ["--model-path", "m"] and "--disable-radix-cache" in argv and "--disable-jump-forward" in argv
    assert argv[argv.index("--chunked-prefill-size") + 1] == "64"
    with pytest.raises(InvalidRequestError, match="no_such_flag"):
        sglite.Runtime(model_path="m", no_such_flag=1)
    with pytest.raises(InvalidRequestError, match="dtype"):
        sglite.Runtime(model_path="m", dtype="float7")
    assert server_argv(None, {"tp_size": 1}) == ["--tp-size", "1"]  # SGLang's flag, its no-op value
    with pytest.raises(InvalidRequestError, match="speculative-algorithm"):  # choices checked before starting
        sglite.Runtime(model_path="m", speculative_algorithm="LOOKAHEAD")


@pytest.mark.slow
def test_runtime_serves_programs_from_a_child_process(tiny_model_dir):
    rt = sglite.Runtime(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=2048, launch_timeout=300)
    try:
        assert rt.alive and rt.url.startswith("http://127.0.0.1:")
        assert isinstance(rt.endpoint, sglite.RuntimeEndpoint)
        out = json.loads(rt.generate("Hello", {"max_new_tokens": 3, "temperature": 0}))
        assert out["meta_info"]["completion_tokens"] == 3
        old = sglite.global_config.default_backend
        try:
            sglite.set_default_backend(rt)
            assert sglite.global_config.default_backend is rt.endpoint
            st = _qa.run(q="hi", temperature=0, max_new_tokens=4)
            assert st.error() is None and st.get_meta_info("a")["completion_tokens"] <= 8  # the gen's max_tokens wins
        finally:
            sglite.global_config.default_backend = old
    finally:
        rt.shutdown()
    assert not rt.alive
    rt.shutdown()  # idempotent


@pytest.mark.slow
def test_generation_before_any_text_on_the_default_model(real_engine):
    assert real_engine.model_info()["bos_token_id"] == 1  # <|im_start|> of SmolLM2

    @sglite.function
    def fork_first(s):
        forks = s.fork(2)
        forks += sglite.gen("x", max_tokens=4, temperature=0)
        forks.join()

    st = fork_first.run(backend=real_engine)
    assert st.error() is None and st["x"][0] == st["x"][1] and st["x"][0]
