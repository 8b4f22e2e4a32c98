"""The fused CPU decode over an int8 / int4 KIVI KV pool (sglite.kernels.decode_fused,
``FusedDecode.quant_pool_args``): every fused step's logits against the per-op path on the same
batch (float32, a tiny random Llama quantized to 32-groups, key groups of 16 so that requests
cross several groups), greedy tokens identical to the per-op path, and the steps it declines."""
import pytest
import torch

from sglite.kernels import decode_fused, kv_quant_cpu, quant_cpu
from tests.kernels.test_decode_fused import PROMPTS, check_fused_steps

pytestmark = pytest.mark.skipif(not (quant_cpu.available() and kv_quant_cpu.available()),
                                reason="the C++ quant kernels did not build here")
GROUP = 16
SP = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def quantized_4bit(tiny_model_dir, tmp_path_factory):
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    return quantize(str(tiny_model_dir), tmp_path_factory.mktemp("fused_kvq") / "rtn4",
                    QuantOptions(method="rtn", bits=4, group_size=32), n_samples=1, seq_len=16)


def _engine(model_dir, kind):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, kv_cache_dtype=kind,
                  kv_cache_quant_group_size=GROUP)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fused_steps_over_a_quantized_pool_match_per_op(quantized_4bit, kind):
    e = _engine(quantized_4bit, kind)
    try:
        model = e.runner.model
        seen, declined = [], []
        fused = check_fused_steps(model, 1e-5, seen)
        checked = model.decode_fused

        class Counting:  # the steps the fused path declined (a row completing its key group)
            def forward(self, fb, kb, vb):
                got = checked.forward(fb, kb, vb)
                if got is None and not fb.num_extend_tokens:
                    declined.append(fb.dec_seq_lens.clone())
                return got

        model.decode_fused = Counting()
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert 3 in seen and len(seen) > 20  # three-row steps over the int pool took the fused path
        assert declined and all(bool((lens % GROUP == 0).any()) for lens in declined)
        model.decode_fused = None  # the per-op path alone
        ref = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert got == ref
        assert fused.quant_kv
    finally:
        e.shutdown()


def test_quant_pool_args_decline(quantized_4bit, monkeypatch):
    e = _engine(quantized_4bit, "int8")
    try:
        fused = e.runner.model.decode_fused
        layers = list(e.runner.token_to_kv_pool.k_buffers)

        class FB:  # two decode rows: request rows 0 and 1 at lengths 5 and 7
            dec_req_pool_indices = torch.tensor([0, 1])
            dec_seq_lens = torch.tensor([5, 7])

        kb, vb, loc, (kvq, sealed, bits, group) = fused.quant_pool_args(FB, layers)
        assert (bits, group, len(kvq), len(kb)) == (8, GROUP, 6 * len(layers), len(layers))
        assert loc.tolist() == [0 * GROUP + 4, 1 * GROUP + 6] and sealed.tolist() == [0, 0]
        assert kb[0].shape == (layers[0].res_k.shape[0] * GROUP, *layers[0].res_k.shape[2:])
        FB.dec_seq_lens = torch.tensor([5, 2 * GROUP])  # row 1 completes its second key group
        assert fused.quant_pool_args(FB, layers) is None
        FB.dec_seq_lens = torch.tensor([5, 7])
        monkeypatch.setattr(type(fused), "quant_kv", False)  # a family layer's decode
        assert fused.quant_pool_args(FB, layers) is None
        monkeypatch.setattr(type(fused), "quant_kv", True)
        monkeypatch.setattr(kv_quant_cpu, "available", lambda: False)  # no C++ attention: per-op
        assert fused.quant_pool_args(FB, layers) is None
    finally:
        e.shutdown()


def test_fp8_pool_takes_the_per_op_path(quantized_4bit):
    e = _engine(quantized_4bit, "fp8_e4m3")
    try:
        fused = e.runner.model.decode_fused
        assert isinstance(fused, decode_fused.FusedDecode)
        seen = []
        check_fused_steps(e.runner.model, 1e-5, seen)
        out = e.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4 and not seen
    finally:
        e.shutdown()
