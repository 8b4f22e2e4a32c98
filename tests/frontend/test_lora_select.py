"""``select`` with a LoRA adapter (issue 30): ``select(..., lora_path=)`` and ``run(lora_path=)``
score the choices with the adapter. Oracle: each choice's token logprobs equal PEFT-in-transformers'
(float32) for the adapter, the base model's without it, and an adapter picked to flip the choice
flips it. The HTTP and OpenAI backends send the adapter as ``lora_path`` / ``model``."""
import pytest

import sglite

pytest.importorskip("peft", reason="peft (dev extra) builds and runs the reference adapters")
pytestmark = pytest.mark.slow  # PEFT's reference and an engine: ~4 s of set-up

PROMPT = "The capital of the country is"
WORDS = [" Paris", " London", " blue", " seven", " running", " the", " a", " water", " Berlin", " cat"]


def _peft_choice_logprobs(model_dir, adapter_dir, prompt: str, choices: list) -> list:
    """Per choice, PEFT's float32 logprobs of its tokens after ``prompt`` (the tokens of
    ``tokenize(prompt + choice)`` past its common prefix with ``tokenize(prompt)``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    p_ids = tok(prompt)["input_ids"]
    out = []
    for c in choices:
        ids = tok(prompt + c)["input_ids"]
        k = next((i for i, (a, b) in enumerate(zip(ids, p_ids)) if a != b), min(len(ids), len(p_ids)))
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        out.append([float(logp[i - 1, ids[i]]) for i in range(k, len(ids))])
    return out


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """An adapter over all projections, and two choices the base model and the adapter rank apart
    (chosen from PEFT's scores of ``WORDS``: the base's best word and the adapter's best word)."""
    from sglite import Engine
    from sglite.lora.testing import make_tiny_lora

    root = tmp_path_factory.mktemp("lora_select")
    for seed in range(4):
        a = make_tiny_lora(tiny_model_dir, root / f"a{seed}", r=8, seed=seed, std=0.3,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        base = _peft_choice_logprobs(tiny_model_dir, None, PROMPT, WORDS)
        lora = _peft_choice_logprobs(tiny_model_dir, a, PROMPT, WORDS)
        b_best = max(range(len(WORDS)), key=lambda i: _mean(base[i]))
        a_best = max(range(len(WORDS)), key=lambda i: _mean(lora[i]))
        if b_best != a_best:
            break
    else:
        pytest.fail("no adapter of seeds 0-3 changes the choice among WORDS")
    choices = [WORDS[b_best], WORDS[a_best]]
    ref = {None: [base[b_best], base[a_best]], "a": [lora[b_best], lora[a_best]]}
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=4096, lora_paths={"a": str(a)}) as e:
        yield e, choices, ref


def _check(state, choices, ref, adapter):
    meta = state.get_meta_info("c")
    got = [[e[0] for e in entries] for entries in meta["input_token_logprobs"]]
    assert [len(g) for g in got] == [len(r) for r in ref[adapter]]
    for g, r in zip(got, ref[adapter]):
        assert g == pytest.approx(r, abs=1e-4)
    assert state["c"] == choices[0 if adapter is None else 1]


def test_select_scores_with_the_adapter_like_peft(setup):
    engine, choices, ref = setup

    @sglite.function
    def per_call(s, lora=None):
        s += PROMPT
        s += sglite.select("c", choices=choices, lora_path=lora)

    @sglite.function
    def via_gen(s):
        s += PROMPT
        s += sglite.gen("c", choices=choices, lora_path="a")

    _check(per_call.run(backend=engine), choices, ref, None)
    _check(per_call.run(backend=engine, lora="a"), choices, ref, "a")
    _check(per_call.run(backend=engine, lora_path="a"), choices, ref, "a")  # run's adapter reaches select
    _check(via_gen.run(backend=engine), choices, ref, "a")
    # the base model's cached prefix is not reused by the adapter (and back)
    _check(per_call.run(backend=engine), choices, ref, None)


def test_select_over_http_and_openai_sends_the_adapter(setup):
    from sglite.frontend.runtime_endpoint import RuntimeEndpoint
    from sglite.server.runner import ServerThread
    from sglite.server.settings import ServerConfig

    engine, choices, ref = setup

    @sglite.function
    def prog(s):
        s += PROMPT
        s += sglite.select("c", choices=choices)

    with ServerThread(engine, ServerConfig(port=0)) as srv:
        be = RuntimeEndpoint(srv.url)
        try:
            _check(prog.run(backend=be, lora_path="a"), choices, ref, "a")
            _check(prog.run(backend=be), choices, ref, None)
            base_id = be._get("/v1/models")["data"][0]["id"]
        finally:
            be.close()
        oa = sglite.OpenAI(base_id, base_url=srv.url + "/v1", is_chat_model=False)  # the adapter as `model`
        _check(prog.run(backend=oa, lora_path="a"), choices, ref, "a")
        _check(prog.run(backend=oa), choices, ref, None)

