"""The extend (prefill) step with LoRA adapters (issue 30) is batched: one step's prompts of
different adapters (and the base model) go through one segmented ``kernels.lora_add`` call per
adapted matmul and layer — the C++ CPU kernel on CPU, never a per-request Python loop — and each
call equals the torch reference on the same inputs."""
import pytest
import torch

from sglite.kernels import cpu_lora, reference
from tests.server.test_lora_server import tiny_adapter


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from sglite import Engine

    root = tmp_path_factory.mktemp("lora_prefill")
    paths = {n: str(tiny_adapter(root / n, s)) for n, s in (("a", 1), ("b", 2))}
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=4096, lora_paths=paths,
                disable_radix_cache=True) as e:
        yield e


def test_prefill_of_many_adapters_is_one_segmented_cpp_call(engine, monkeypatch):
    if not cpu_lora.available():
        pytest.skip("the C++ LoRA kernel did not build here")
    calls = []
    cpp = cpu_lora.lora_add

    def spy(y, x, a, b, seg_lens, seg_slots, spans=None):
        assert spans is not None  # the pool's spans: the kernel skips the zero rank blocks
        want = reference.lora_add(y.clone(), x, a, b, seg_lens, seg_slots)
        out = cpp(y, x, a, b, seg_lens, seg_slots, spans)
        calls.append((x.shape[0], seg_lens.tolist(), seg_slots.tolist()))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        return out

    monkeypatch.setattr(cpu_lora, "lora_add", spy)
    prompts = ["The sea is calm and", "Once upon a time there", "A quick brown fox jumps", "Hello world, this is"]
    loras = ["a", "b", None, "a"]
    sp = {"max_new_tokens": 1, "temperature": 0}
    outs = engine.generate(prompt=prompts, sampling_params=sp, lora_path=loras)
    total = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    big = [c for c in calls if c[0] == total]  # the one extend step of all four prompts
    # 2 layers x the adapted matmuls (q/v adapters: the fused qkv matmul only)
    assert len(big) == 2, (total, calls)
    for n, lens, slots in big:
        assert sum(lens) == n and len(lens) == 4  # a | b | base | a: one call, four segments
        assert slots[2] == -1 and slots[0] == slots[3] != slots[1]
    # and the batched prefill gives each prompt what it gets alone with its adapter
    for p, lp, o in zip(prompts, loras, outs):
        assert engine.generate(prompt=p, sampling_params=sp, lora_path=lp)["output_ids"] == o["output_ids"]
