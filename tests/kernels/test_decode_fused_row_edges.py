"""The fused bf16 decode's row-count edges (sglite/kernels/decode_fused.py) where many-row steps
run (AMX, or the int8 VNNI GEMM on VNNI CPUs without AMX): the last GEMV-only count and the first
GEMM one (FUSED_VNNI_MIN_ROWS - 1 / itself), the most a fused step takes (MAX_ROWS_AMX) and one
more (the per-op path). Each fused step stays close to the per-op path on the same batch, and at
MAX_ROWS_AMX rows every row's final hidden state is bit for bit the same in reverse order."""
import pytest
import torch

from sglite.kernels import decode_fused, gemm_paths, quant_cpu
from tests.kernels.test_decode_fused import check_fused_steps, quantized_tiny, spy_hidden  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")


def test_row_counts_at_the_gemm_threshold_and_the_fused_maximum(quantized_tiny):
    from sglite import Engine

    e = Engine(model_path=str(quantized_tiny[4]), dtype="bfloat16", max_total_tokens=4096,
               max_running_requests=decode_fused.MAX_ROWS_AMX + 8, chunked_prefill_size=4096)
    model = e.runner.model
    fused = model.decode_fused
    try:
        if fused is None or fused.max_rows() != decode_fused.MAX_ROWS_AMX:
            pytest.skip("many-row fused steps run only with AMX or the VNNI GEMM")
        top, lo = decode_fused.MAX_ROWS_AMX, gemm_paths.FUSED_VNNI_MIN_ROWS
        sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        prompts = lambda n: [[100 + 37 * i, 7 + i, 2000 + 3 * i] for i in range(n)]  # noqa: E731
        seen: list = []
        check_fused_steps(model, 0.1, seen)
        for n in (lo - 1, lo, top, top + 1):
            seen.clear()
            e.generate(input_ids=prompts(n), sampling_params=sp)
            e.flush_cache()
            assert (n in seen) == (n <= top), (n, seen)  # top + 1 rows: no fused step, no error
        model.decode_fused = fused  # unchecked: the per-op comparison rewrites the KV slots
        steps: list = []
        spy_hidden(fused, steps)
        first = [o["output_ids"] for o in e.generate(input_ids=prompts(top), sampling_params=sp)]
        m = len(steps)
        e.flush_cache()
        second = [o["output_ids"] for o in e.generate(input_ids=prompts(top)[::-1], sampling_params=sp)]
    finally:
        e.shutdown()
    assert second == first[::-1]
    a, b = steps[:m], steps[m:]
    assert len(a) == len(b) and sum(ids.shape[0] == top for ids, _ in a) >= 2
    for (ids1, h1), (ids2, h2) in zip(a, b):
        assert torch.equal(ids2, ids1.flip(0)) and torch.equal(h2, h1.flip(0))
