"""``sglite quantize`` -> our writer -> our loader -> the engine: logits of the quantized engine
against HF transformers running the DEQUANTIZED checkpoint (fp32), for RTN / GPTQ (act-order) /
AWQ / SmoothQuant W8A8 and online FP8; and the load-time errors (group size, bits, shapes)."""
import json
import shutil

import pytest
import torch

from sglite.quant import hf_formats as hf
from sglite.quant.calibrate import QuantOptions
from sglite.quantize import check_options, quantize

PROMPT_IDS = [504, 3458, 3502, 314, 253, 5426, 1314, 28, 5248, 11633, 28, 690, 9095, 30, 378, 357] * 2

CASES = {
    "gptq4_g32_act": QuantOptions(method="gptq", bits=4, group_size=32, desc_act=True),
    "gptq8_g64": QuantOptions(method="gptq", bits=8, group_size=64, sym=True),
    "awq4_g32": QuantOptions(method="awq", bits=4, group_size=32, awq_grid=5),  # a 5-point alpha search: same path
    "rtn4_g64": QuantOptions(method="rtn", bits=4, group_size=64),
    "w8a8": QuantOptions(method="smoothquant", bits=8),
    "gptq_fp8": QuantOptions(method="gptq", bits=8, weight_format="fp8"),
    "gptq_fp8_act": QuantOptions(method="gptq", bits=8, weight_format="fp8", desc_act=True),
    "rtn_fp8_block": QuantOptions(method="rtn", bits=8, weight_format="fp8", weight_block_size=(48, 48)),
    "gptq_fp8_block": QuantOptions(method="gptq", bits=8, weight_format="fp8", weight_block_size=(32, 48)),
}
KINDS = {"w8a8": {"Int8LinearWeight"}, "gptq_fp8": {"Fp8LinearWeight"}, "gptq_fp8_act": {"Fp8LinearWeight"},
         "rtn_fp8_block": {"Fp8BlockLinearWeight"}, "gptq_fp8_block": {"Fp8BlockLinearWeight"}}


class _Quantized(dict):
    """name -> checkpoint dir, each written on first use (a worker quantizes only what its tests read)."""

    def __init__(self, src, root):
        super().__init__()
        self.src, self.root = src, root

    def __missing__(self, name):
        self[name] = quantize(str(self.src), self.root / name, CASES[name], n_samples=2, seq_len=48)
        return self[name]


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    return _Quantized(tiny_model_dir, tmp_path_factory.mktemp("quantized"))


def _dequantized_state(ckpt_dir):
    """Float32 state dict of a written checkpoint: every quantized linear dequantized by the
    GroupQuant formula (not by the engine's QuantLinearWeight)."""
    from safetensors.torch import load_file

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    sd = load_file(str(ckpt_dir / "model.safetensors"))
    out = {}
    for p in sorted({k[:-8] for k in sd if k.endswith(".qweight")}):
        t = {k: sd.pop(f"{p}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{p}.{k}" in sd}
        unpack = hf.unpack_gptq if qc["quant_method"] == "gptq" else hf.unpack_awq
        out[p + ".weight"] = unpack(t, qc["bits"], qc["group_size"], p).dequantize()
    for k in [k for k in sd if k.endswith(".weight_scale")]:
        p = k[:-13]
        out[p + ".weight"] = sd.pop(p + ".weight").float() * sd.pop(k).float()
    for k in [k for k in sd if k.endswith(".weight_scale_inv")]:  # block-wise fp8: one scale per tile
        p, (bn, bk) = k[:-17], qc["weight_block_size"]
        w = sd.pop(p + ".weight").float()
        full = sd.pop(k).float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        out[p + ".weight"] = w * full[:w.shape[0], :w.shape[1]]
    out.update({k: v.float() for k, v in sd.items()})
    return cfg, out


def _hf_logprobs(cfg, state, ids):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    m = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32).eval()
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    m.tie_weights()
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _engine_logprobs(model_dir, ids, **kw):
    from sglite import Engine

    with Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, **kw) as e:
        o = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                       logprob_start_len=0)
        kinds = {type(lw).__name__ for lw in e.runner.model.linear_weights()[:-1]}
    return [x[0] for x in o["meta_info"]["input_token_logprobs"][1:]], kinds


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_checkpoint_runs_like_its_dequantized_reference(quantized, name):
    d = quantized[name]
    cfg, state = _dequantized_state(d)
    want = _hf_logprobs(cfg, state, PROMPT_IDS)
    got, kinds = _engine_logprobs(d, PROMPT_IDS)
    assert kinds == KINDS.get(name, {"QuantLinearWeight"})
    # w8a8 also quantizes activations per token: close, not equal, to the weight-only reference
    tol = 0.15 if name == "w8a8" else 2e-3
    assert max(abs(a - b) for a, b in zip(got, want)) < tol


def test_fp8_online_matches_its_dequantized_weights(tiny_model_dir):
    from sglite.kernels import Fp8LinearWeight
    from safetensors.torch import load_file

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    sd = {k: v.float() for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    deq = {k: (Fp8LinearWeight.quantize(v).dequantize() if k.endswith("proj.weight") else v) for k, v in sd.items()}
    want = _hf_logprobs(cfg, deq, PROMPT_IDS)
    got, kinds = _engine_logprobs(tiny_model_dir, PROMPT_IDS, quantization="fp8")
    assert kinds == {"Fp8LinearWeight"}
    assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3


def test_auto_detects_and_refuses_a_mismatched_scheme(quantized):
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="is a gptq checkpoint"):
        Engine(model_path=str(quantized["rtn4_g64"]), quantization="awq")
    with pytest.raises(InvalidRequestError, match="is a gptq checkpoint"):
        Engine(model_path=str(quantized["rtn4_g64"]), quantization="none")


def _edited_copy(src, dst, cfg_edit=None, tensor_edit=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if cfg_edit:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"].update(cfg_edit)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        sd = load_file(str(dst / "model.safetensors"))
        tensor_edit(sd)
        save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_load_errors_name_the_tensor_and_option(quantized, tmp_path):
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    src = quantized["rtn4_g64"]
    bad_gs = _edited_copy(src, tmp_path / "gs", {"group_size": 128})
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.\S+: group_size=128 does not divide "
                       r"in_features=64 \(quantization_config\.group_size\)"):
        Engine(model_path=str(bad_gs))
    bad_bits = _edited_copy(src, tmp_path / "bits", {"bits": 3})
    with pytest.raises(InvalidRequestError, match=r"quantization_config\.bits: gptq checkpoints with 3-bit"):
        Engine(model_path=str(bad_bits))

    def cut(sd):
        sd["model.layers.1.mlp.up_proj.scales"] = sd["model.layers.1.mlp.up_proj.scales"][:, :8].contiguous()
    bad_shape = _edited_copy(src, tmp_path / "shape", tensor_edit=cut)
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.1\.mlp\.up_proj\.scales: shape \(1, 8\) disagrees"):
        Engine(model_path=str(bad_shape))
    bad_awq = _edited_copy(quantized["awq4_g32"], tmp_path / "awq8", {"bits": 8})
    with pytest.raises(InvalidRequestError, match=r"quantization_config\.bits: awq checkpoints with 8-bit"):
        Engine(model_path=str(bad_awq))


def test_quantize_rejects_options_before_work(real_checkpoint):
    cfg = real_checkpoint.hf_config  # SmolLM2: hidden 576 = 4.5 x 128
    with pytest.raises(ValueError, match=r"--group-size: 128 does not divide hidden_size .* = 576"):
        check_options(QuantOptions(method="gptq", group_size=128), cfg)
    with pytest.raises(ValueError, match=r"--bits: awq supports \(4,\), got 8"):
        check_options(QuantOptions(method="awq", bits=8), cfg)
    with pytest.raises(ValueError, match="--method"):
        check_options(QuantOptions(method="squeeze"), cfg)
    check_options(QuantOptions(method="gptq", group_size=64), cfg)  # 576 = 9 x 64
    with pytest.raises(ValueError, match=r"--format fp8: methods rtn\|gptq, got --method awq"):
        check_options(QuantOptions(method="awq", weight_format="fp8"), cfg)
    with pytest.raises(ValueError, match="--weight-block-size: only with --format fp8"):
        check_options(QuantOptions(method="gptq", weight_block_size=(128, 128)), cfg)
    with pytest.raises(ValueError, match="--desc-act: act-order needs per-channel scales"):
        check_options(QuantOptions(method="gptq", weight_format="fp8", desc_act=True,
                                   weight_block_size=(128, 128)), cfg)
    check_options(QuantOptions(method="gptq", group_size=128, weight_format="fp8"), cfg)  # no groups in fp8


def test_fp8_checkpoint_load_errors_name_the_tensor(quantized, tmp_path):
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    src = quantized["gptq_fp8"]

    def drop_scale(sd):
        del sd["model.layers.1.mlp.up_proj.weight_scale"]
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: float8 weight without its weight_scale"):
        Engine(model_path=str(_edited_copy(src, tmp_path / "noscale", tensor_edit=drop_scale)))

    def cut(sd):
        sd["model.layers.0.self_attn.k_proj.weight_scale"] = sd["model.layers.0.self_attn.k_proj.weight_scale"][:3].contiguous()
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight_scale: \(3, 1\) disagrees"):
        Engine(model_path=str(_edited_copy(src, tmp_path / "cut", tensor_edit=cut)))
    with pytest.raises(InvalidRequestError, match=r"weight_scale: a per-channel scale, but quantization_config\.weight_block_size"):
        Engine(model_path=str(_edited_copy(src, tmp_path / "blk", {"weight_block_size": [32, 32]})))
    with pytest.raises(InvalidRequestError, match=r"quantization_config\.weight_block_size: two positive integers"):
        Engine(model_path=str(_edited_copy(src, tmp_path / "blk0", {"weight_block_size": [0, 32]})))
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.\S+: fp8: weight_scale_inv \(2, \d\) disagrees with weight \(64, \d+\) "
                       r"and weight_block_size \[64, 48\]"):
        Engine(model_path=str(_edited_copy(quantized["rtn_fp8_block"], tmp_path / "blk2", {"weight_block_size": [64, 48]})))
    with pytest.raises(InvalidRequestError, match="is a fp8 checkpoint"):
        Engine(model_path=str(src), quantization="gptq")


def test_cli_quantize_usage_error(capsys):
    from sglite.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--output", "/nonexistent/x", "--method", "awq", "--bits", "8"])
    assert exc.value.code == 2 and "--bits" in capsys.readouterr().err


def _edit_config(src, dst, **top):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(top)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_config_disagreeing_with_tensors_is_named_before_serving(quantized, tmp_path):
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.mlp\.down_proj\.qweight: 128 input "
                       r"features, but the config says 96"):
        Engine(model_path=str(_edit_config(quantized["rtn4_g64"], tmp_path / "gptq", intermediate_size=96)))
    for name in ("gptq_fp8", "w8a8"):  # fp8 / int8 tensors against config.json
        with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: shape "
                           r"\(64, 128\) disagrees with the checkpoint's config \(expected \(64, 96\)"):
            Engine(model_path=str(_edit_config(quantized[name], tmp_path / name, intermediate_size=96)))


def test_w8a8_checkpoint_scale_errors_name_the_tensor(quantized, tmp_path):
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    def cut(sd):
        sd["model.layers.1.self_attn.q_proj.weight_scale"] = sd["model.layers.1.self_attn.q_proj.weight_scale"][:5].contiguous()
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight_scale: \(5, 1\) "
                       r"disagrees with model\.layers\.1\.self_attn\.q_proj\.weight \(64, 64\)"):
        Engine(model_path=str(_edited_copy(quantized["w8a8"], tmp_path / "cut", tensor_edit=cut)))

    def drop(sd):
        del sd["model.layers.0.mlp.down_proj.weight_scale"]
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: int8 weight without a weight_scale"):
        Engine(model_path=str(_edited_copy(quantized["w8a8"], tmp_path / "drop", tensor_edit=drop)))


def test_quantized_checkpoint_with_tensor_parallelism_is_refused_before_workers_start(quantized):
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    for name in ("rtn4_g64", "gptq_fp8"):
        with pytest.raises(InvalidRequestError, match=r"quantization='auto': tensor parallelism runs dense weights"):
            Engine(model_path=str(quantized[name]), tp_size=2)
