"""EAGLE and Medusa draft heads (issue 29): greedy output with them is token for token what the
engine without speculation gives (fp32, random untrained heads: verification, not the heads, makes
the output), with grammars and stop strings too; mismatched heads are refused naming both sizes;
``sglite train-draft`` runs end to end on a tiny model.

Oracle: the same engine without speculation, and the KV manager's invariants after every step
(``check_invariants``)."""
import json
import math

import pytest
import torch

from sglite import Engine
from sglite.errors import InvalidRequestError
from sglite.runtime.speculative.heads import EagleHead, MedusaHeads, load_heads, save_heads
from tests.speculative.prompts import COPY_PROMPTS

KW = dict(dtype="float32", device="cpu", max_total_tokens=2048, check_invariants=True)


def _eagle(hidden, vocab, **extra):
    return EagleHead(dict(hidden_size=hidden, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0, **extra))


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_model_dir):
    """Random EAGLE heads (full vocabulary) and Medusa heads (a draft vocabulary) for the tiny model."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    save_heads(_eagle(h, v), root / "eagle")
    medusa = MedusaHeads(dict(hidden_size=h, vocab_size=v, medusa_num_heads=3))
    save_heads(medusa, root / "medusa", draft_vocab=torch.arange(0, v, 3))
    return {"EAGLE": root / "eagle", "MEDUSA": root / "medusa"}


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    e = Engine(str(tiny_model_dir), **KW)
    yield e
    e.shutdown()


def _spec(tiny_model_dir, heads, alg, **kw):
    return Engine(str(tiny_model_dir), speculative_algorithm=alg, speculative_draft_model_path=str(heads[alg]),
                  **{**KW, **kw})


@pytest.mark.parametrize("alg", ["EAGLE", "MEDUSA"])
def test_greedy_identical_with_heads(alg, tiny_model_dir, heads, base):
    sps = [{"max_new_tokens": 40, "temperature": 0},
           {"max_new_tokens": 24, "temperature": 0, "stop": [" lazy", "ab"], "frequency_penalty": 0.3},
           {"max_new_tokens": 30, "temperature": 0, "regex": r"(ab ){2,8}(abab|ba)"}]
    prompts = COPY_PROMPTS[:2] + ["abab abab abab ab"]
    want = base.generate(prompts, sps)
    spec = _spec(tiny_model_dir, heads, alg)
    try:
        got = spec.generate(prompts, sps)
        info = spec.get_server_info()
    finally:
        spec.shutdown()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert [g["meta_info"]["finish_reason"] for g in got] == [w["meta_info"]["finish_reason"] for w in want]
    assert info["spec_verify_steps"] > 0 and info["spec_draft_tokens"] > info["spec_verify_steps"]
    assert info["available_tokens"] == info["max_total_tokens"]  # rejected drafts' slots went back


def test_eagle_json_schema_and_sampling_run(tiny_model_dir, heads, base):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"],
              "additionalProperties": False}
    sp = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}
    want = base.generate("name tags", sp)
    spec = _spec(tiny_model_dir, heads, "EAGLE", speculative_eagle_topk=2, speculative_num_steps=3)
    try:
        got = spec.generate("name tags", sp)
        sampled = spec.generate(COPY_PROMPTS[0], {"max_new_tokens": 16, "temperature": 0.8, "sampling_seed": 7})
    finally:
        spec.shutdown()
    assert got["output_ids"] == want["output_ids"]
    if got["meta_info"]["finish_reason"]["type"] == "stop":
        json.loads(got["text"])
    assert len(sampled["output_ids"]) == 16


def test_loader_refuses_mismatched_heads_naming_both_sizes(tmp_path):
    save_heads(_eagle(32, 1000), tmp_path / "e")
    with pytest.raises(InvalidRequestError) as ei:
        load_heads(tmp_path / "e", 64, 1000)
    assert "hidden_size" in str(ei.value) and "32" in str(ei.value) and "64" in str(ei.value)
    assert ei.value.field == "speculative_draft_model_path"
    with pytest.raises(InvalidRequestError, match=r"vocab_size \(1000\).*\(2000\)"):
        load_heads(tmp_path / "e", 32, 2000)
    with pytest.raises(InvalidRequestError, match="eagle heads, not medusa"):
        load_heads(tmp_path / "e", 32, 1000, "medusa")
    module, vocab = load_heads(tmp_path / "e", 32, 1000, "eagle")
    assert isinstance(module, EagleHead) and vocab is None


def test_engine_refuses_mismatched_heads(tiny_model_dir, tmp_path):
    save_heads(MedusaHeads(dict(hidden_size=48, vocab_size=10, medusa_num_heads=2)), tmp_path / "m")
    with pytest.raises(InvalidRequestError, match=r"hidden_size \(48\).*\(64\)"):
        Engine(str(tiny_model_dir), speculative_algorithm="MEDUSA", speculative_draft_model_path=str(tmp_path / "m"),
               **KW)


def test_published_eagle_layout_round_trips(tmp_path):
    """The file names are EAGLE's (``fc``, ``layers.0.*``); an input norm is read when present."""
    from safetensors.torch import load_file

    m = _eagle(32, 100, input_norm=True)
    save_heads(m, tmp_path / "e")
    names = set(load_file(str(tmp_path / "e" / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight", "layers.0.input_layernorm.weight"} <= names
    back, _ = load_heads(tmp_path / "e", 32, 100)
    x = torch.randn(1, 5, 32)
    pos = torch.arange(5)[None]
    torch.testing.assert_close(back(x, x, pos)[0], m(x, x, pos)[0])


def test_eagle_tree_rows_match_a_causal_pass():
    """The tree drafter's masked rows (cache + ancestors) equal a plain causal pass over the path."""
    torch.manual_seed(1)
    m = _eagle(32, 100).eval()
    emb, feat = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    pos = torch.arange(6)[None]
    full, _ = m(emb, feat, pos)
    out, (k, v) = m(emb[:, :4], feat[:, :4], pos[:, :4])
    # two siblings at position 4 (one is the real path), then the real path's child at 5
    sib = torch.cat((emb[:, 4:5], torch.randn(1, 1, 32)), 1)
    mask = torch.tensor([[True] * 4 + [True, False], [True] * 4 + [False, True]])
    o2, (k2, v2) = m(sib, feat[:, 4:5].expand(1, 2, 32), torch.tensor([[4, 4]]), (k, v), mask)
    mask3 = torch.tensor([[True] * 4 + [True, False, True]])
    o3, _ = m(emb[:, 5:6], feat[:, 5:6], torch.tensor([[5]]), (torch.cat((k, k2), 1), torch.cat((v, v2), 1)), mask3)
    torch.testing.assert_close(o2[0, 0], full[0, 4])
    torch.testing.assert_close(o3[0, 0], full[0, 5])


def _train_draft(tiny_model_dir, out, held_out):
    from sglite.cli import main

    assert main(["train-draft", "--method", "medusa", "--model-path", str(tiny_model_dir), "--output", str(out),
                 "--num-prompts", "4", "--held-out", str(held_out), "--new-tokens", "8", "--steps", "3", "--batch", "2",
                 "--window", "8", "--accept-tokens", "6", "--prompt-tokens", "8", "--no-chat"]) == 0
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "train_report.json").read_text())
    assert report["args"]["steps"] == 3 and report["loss_first"] > 0 and report["tokens"] > 4 * 8
    module, vocab = load_heads(out, 64, json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"], "medusa")
    assert isinstance(module, MedusaHeads) and 0 < vocab.numel()
    return report


def test_train_draft_end_to_end(tiny_model_dir, tmp_path):
    """Generations, teacher labels, training, the heads folder and the loss PNG (no acceptance
    check: that starts two engines, see the slow test below)."""
    assert _train_draft(tiny_model_dir, tmp_path / "heads", 0)["acceptance"] == {}


@pytest.mark.slow  # two more engines for the acceptance check
def test_train_draft_measures_acceptance_on_held_back_prompts(tiny_model_dir, tmp_path):
    acc = _train_draft(tiny_model_dir, tmp_path / "heads", 1)["acceptance"]
    assert acc["accept_length"] >= 1.0 and acc["verify_steps"] > 0 and acc["plain"]["tokens"] == 6


def test_runner_hidden_states_are_hfs_last_hidden_state(tiny_model_dir):
    """The seam the heads read: every position's final-normed hidden state, prefill and decode
    rows alike, equals HF's ``hidden_states[-1]`` (float32)."""
    from transformers import AutoModelForCausalLM

    from sglite.train_draft import generate, make_runner

    runner, _ = make_runner(str(tiny_model_dir), 256, dtype="float32")
    prompt = [17, 300, 2041, 9, 77, 5000, 12]
    (tokens, feats), = generate(runner, [prompt], 5, 1, set())
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        want = hf(tokens[None], output_hidden_states=True).hidden_states[-1][0]
    assert feats.shape == (len(tokens) - 1, want.shape[1])
    torch.testing.assert_close(feats, want[:-1], atol=2e-4, rtol=1e-4)
    assert tokens[len(prompt):].tolist() == want.matmul(hf.lm_head.weight.T)[len(prompt) - 1:-1].argmax(-1).tolist()


def test_shipped_heads_fit_the_default_model():
    """The heads in the package load against the default model's sizes (SmolLM2-135M: hidden 576,
    vocabulary 49152) with a draft vocabulary; no model is loaded."""
    from sglite.runtime.speculative.heads import default_heads_dir

    module, vocab = load_heads(default_heads_dir("eagle"), 576, 49152, "eagle")
    assert isinstance(module, EagleHead) and 0 < vocab.numel() <= 49152
    assert (default_heads_dir("eagle") / "README.md").exists() or (default_heads_dir("eagle").parent / "README.md").exists()


@pytest.mark.slow  # the real default model
def test_engine_eagle_with_no_other_argument_uses_the_shipped_heads():
    e = Engine(speculative_algorithm="EAGLE")
    metas = []
    try:  # a few prompts: one prompt's acceptance moves with the prefill's GEMM path (AMX or int8)
        for q in ("Why is the sky blue?", "Explain how a bicycle stays upright.", "What is photosynthesis?"):
            prompt = e.apply_chat_template([{"role": "user", "content": q}])
            metas.append(e.generate(prompt, {"max_new_tokens": 48, "temperature": 0})["meta_info"])
    finally:
        e.shutdown()
    verifies = sum(m["spec_verify_ct"] for m in metas)
    accepted = sum(m["spec_verify_ct"] * m["spec_accept_length"] for m in metas)
    assert all(m["spec_verify_ct"] > 0 for m in metas) and accepted / verifies > 1.0


def test_training_passes_match_the_proposers_path():
    """``train-draft --ttt-steps``: pass ``d`` of a window computes, for every row, what the
    proposer's tree computes for that row's path at depth ``d + 1`` (its own predicted feature in,
    the real rows up to the row and the path's earlier draft rows attended to)."""
    from sglite.train_draft import draft_passes

    torch.manual_seed(0)
    m = EagleHead({"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "vocab_size": 100, "rope_theta": 10000.0}).eval()
    n = 5
    embs, feat, pos = [torch.randn(1, n, 32) for _ in range(3)], torch.randn(1, n, 32), torch.arange(3, 3 + n)[None]
    with torch.no_grad():
        outs = draft_passes(m, embs, feat, pos)
        for j in range(n):
            g, (k, v) = m(embs[0][:, :j + 1], feat[:, :j + 1], pos[:, :j + 1])  # the catch-up's rows
            g = g[:, -1:]
            for d in (1, 2):
                g, (k2, v2) = m(embs[d][:, j:j + 1], g, pos[:, j:j + 1] + d, (k, v))  # one path: all attended
                k, v = torch.cat((k, k2), 1), torch.cat((v, v2), 1)
                torch.testing.assert_close(outs[d][0, j], g[0, 0])


def test_train_draft_eagle_soft_ttt_and_several_data_files(tiny_model_dir, tmp_path):
    """EAGLE with the soft loss and two training-time-test passes trains (finite losses, heads that
    load), and ``--data A B`` trains on both saved generations (twice the tokens)."""
    from sglite.cli import main

    common = ["train-draft", "--method", "eagle", "--model-path", str(tiny_model_dir), "--num-prompts", "3",
              "--held-out", "0", "--new-tokens", "8", "--steps", "2", "--batch", "2", "--window", "6",
              "--prompt-tokens", "8", "--no-chat", "--labels", "soft", "--ttt-steps", "2"]
    data = tmp_path / "d.pt"
    assert main(common + ["--output", str(tmp_path / "a"), "--data", str(data)]) == 0
    one = json.loads((tmp_path / "a" / "train_report.json").read_text())
    assert main(common + ["--output", str(tmp_path / "b"), "--data", str(data), str(data)]) == 0
    two = json.loads((tmp_path / "b" / "train_report.json").read_text())
    assert two["tokens"] == 2 * one["tokens"] and all(math.isfinite(r["loss_last"]) for r in (one, two))
    module, _ = load_heads(tmp_path / "b", 64, json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"],
                           "eagle")
    assert isinstance(module, EagleHead)
