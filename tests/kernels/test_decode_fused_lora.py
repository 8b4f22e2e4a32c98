"""LoRA adapters inside the fused C++ decode (sglite.kernels.decode_fused, csrc/lora_fused.h): on a
tiny random Llama quantized to 32-groups, every fused step of a batch that mixes base rows and
several adapters (different ranks and targets, q/k/v split and fused) is checked against the
per-op LoRA path on the same step (float32: logits within 1e-5 relative; greedy tokens equal),
the same step is bitwise the same on 1 and 2 threads, both builds (AVX-512 and portable) match, and a step without adapters passes no LoRA
arguments. The PEFT oracle on the dequantized base is in tests/runtime/test_lora_fused_peft.py."""
import json

import pytest
import torch
from safetensors.torch import save_file

from sglite.kernels import decode_fused, quant_cpu

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")

PROMPTS = [[504, 3458, 3502, 314, 253, 5426], [1314, 28, 5248, 11633, 28, 690, 9095, 30, 378], [357, 12, 99],
           [100, 137, 2000], [7, 8, 9, 10], [2001, 2002]]
ADAPTERS = {  # name: (rank, targets)
    "all4": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "qv8": (8, ("q_proj", "v_proj")),
    "mlp2": (2, ("o_proj", "gate_up_proj", "down_proj")),
    "qkv3": (3, ("qkv_proj",)),
}


def write_adapter(path, cfg: dict, r: int, modules, seed: int):
    """A PEFT-layout adapter for the checkpoint config ``cfg`` written by hand (random A and B)."""
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    shapes = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "qkv_proj": (H, q + 2 * kv), "o_proj": (q, H),
              "gate_proj": (H, I), "up_proj": (H, I), "gate_up_proj": (H, 2 * I), "down_proj": (I, H)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(L):
        for m in modules:
            fin, fout = shapes[m]
            part = "mlp" if "gate" in m or "up" in m or "down" in m else "self_attn"
            pre = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[pre + ".lora_A.weight"] = torch.randn(r, fin, generator=g) * 0.3
            tensors[pre + ".lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 2 * r, "target_modules": list(modules)}))
    return path


@pytest.fixture(scope="module")
def quantized_lora(tiny_model_dir, tmp_path_factory):
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    root = tmp_path_factory.mktemp("fused_lora")
    qdir = quantize(str(tiny_model_dir), root / "rtn4", QuantOptions(method="rtn", bits=4, group_size=32),
                    n_samples=1, seq_len=16)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    paths = {n: str(write_adapter(root / n, cfg, r, mods, seed)) for seed, (n, (r, mods)) in enumerate(ADAPTERS.items())}
    return qdir, paths


def _engine(qdir, paths, seen, threads=None, portable=False, lora_dtype="auto"):
    """A float32 engine whose fused steps are checked against the per-op path on the same step
    (and, with ``threads``, against the fused step on that many threads, bitwise). ``lora_dtype``:
    the adapters' A / B storage (bfloat16: both paths read bf16 weights under float32 activations)."""
    from sglite import Engine

    e = Engine(model_path=str(qdir), dtype="float32", max_total_tokens=2048, lora_paths=paths, max_loras_per_batch=4,
               lora_dtype=lora_dtype)
    model = e.runner.model
    fused = model.decode_fused
    assert fused is not None and not fused.q8
    if portable:  # the build without AVX-512: lora_fused.h's scalar loops
        fused = decode_fused.FusedDecode(model, q8=False, portable=True)

    class Checked:
        def forward(self, fb, kb, vb):
            got = fused.forward(fb, kb, vb)
            if got is not None:
                if threads is not None:
                    fused.threads, fused.lora_split_min = threads, 0  # split every LoRA phase
                    again = fused.forward(fb, kb, vb)
                    fused.threads, fused.lora_split_min = None, decode_fused.LORA_SPLIT_MIN
                    assert torch.equal(got, again)
                ref = model._forward(fb, kb, vb)  # rewrites the same KV slots
                err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                assert err <= 1e-5, err
                seen.append((fb.input_ids.shape[0], fb.lora is not None))
            return got

    model.decode_fused = Checked()
    return e


@pytest.mark.parametrize("portable,lora_dtype", [(False, "auto"), (False, "bfloat16"),  # portable: a second build
                                                 pytest.param(True, "auto", marks=pytest.mark.slow),
                                                 pytest.param(True, "bfloat16", marks=pytest.mark.slow)])
def test_mixed_adapters_match_per_op_path(quantized_lora, portable, lora_dtype):
    qdir, paths = quantized_lora
    names = ["all4", None, "qv8", "mlp2", "qkv3", "all4"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    seen = []
    e = _engine(qdir, paths, seen, portable=portable, lora_dtype=lora_dtype)
    try:
        assert e.lora.pool.dtype == (torch.bfloat16 if lora_dtype == "bfloat16" else torch.float32)
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp, lora_path=names)]
        assert (6, True) in seen  # a 6-row step of 4 adapters and a base row went through the fused path
        base = [o["output_ids"] for o in e.generate(input_ids=PROMPTS[:2], sampling_params=sp)]
        assert any(n == 2 and not lo for n, lo in seen)  # and a base-only step
        e.runner.model.decode_fused = None  # the per-op path alone
        e.flush_cache()
        assert got == [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp, lora_path=names)]
        assert base == [o["output_ids"] for o in e.generate(input_ids=PROMPTS[:2], sampling_params=sp)]
        assert len({tuple(g) for g in got[:4]}) > 1  # the adapters change the tokens
    finally:
        e.shutdown()


def test_threads_do_not_change_fused_lora_steps(quantized_lora):
    qdir, paths = quantized_lora
    seen = []
    e = _engine(qdir, paths, seen, threads=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the checked step runs on 1 thread, then again on 2
        sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        e.generate(input_ids=PROMPTS[:4], sampling_params=sp, lora_path=["qv8", "all4", None, "mlp2"])
        assert any(lo for _, lo in seen)
    finally:
        torch.set_num_threads(before)
        e.shutdown()


def test_fused_args_of_a_step(quantized_lora):
    """The LoRA arguments the C++ call gets: each row's slot per matmul (-1 for base rows and
    matmuls an adapter leaves alone), the spans of the rank blocks in use, empty a / b where no
    row is adapted; a segment count that disagrees with the step is refused."""
    qdir, paths = quantized_lora
    from sglite import Engine

    with Engine(model_path=str(qdir), dtype="float32", max_total_tokens=1024, lora_paths=paths) as e:
        m = e.lora
        qv, mlp = m.resolve("qv8"), m.resolve("mlp2")
        batch = m.batch([(2, qv), (1, None), (1, mlp)])
        ab, rows, spans = batch.fused_args(decode_fused.LINEAR_KEYS, 4)
        sq, sm = m.pool.resident[qv.uid], m.pool.resident[mlp.uid]
        assert rows.tolist() == [[sq, sq, -1, -1], [-1, -1, -1, sm], [-1, -1, -1, sm], [-1, -1, -1, sm]]
        a = e.runner.model.arch
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        assert spans[0][sq].tolist() == [[8, 0, q], [0, 0, 0], [8, q + kv, q + 2 * kv]]
        assert spans[2][sm].tolist() == [[2, 0, 2 * a.intermediate_size], [0, 0, 0]]  # fused gate_up: one block
        assert len(ab) == 8 * a.num_layers and ab[2].shape[0] == m.max_loras_per_batch
        ab, rows, spans = m.batch([(1, qv)]).fused_args(decode_fused.LINEAR_KEYS, 1)  # q and v only: o not adapted
        assert ab[0].numel() > 0 and ab[2].numel() == 0 and spans[1].numel() == 0 and rows[1].tolist() == [-1]
        with pytest.raises(ValueError, match="cover 4 rows"):
            batch.fused_args(decode_fused.LINEAR_KEYS, 5)
