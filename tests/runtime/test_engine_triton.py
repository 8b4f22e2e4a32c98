"""The engine with SGLITE_KERNEL=triton (Triton interpreter on CPU) gives the torch path's greedy tokens."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, sys
    from sglite import Engine
    e = Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=4096, chunked_prefill_size=8)
    outs = e.generate(input_ids=[[5, 17, 300, 42, 9, 11, 12, 13, 14, 15, 16, 99], [7, 8, 9]],
                      sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    again = e.generate(input_ids=[5, 17, 300, 42, 9, 11, 12, 13, 14, 15, 16, 99, 1000],
                       sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    print(json.dumps([o["output_ids"] for o in outs] + [again["output_ids"], again["meta_info"]["cached_tokens"]]))
    e.shutdown()
""")


def _run(model_dir, kernel):
    env = dict(os.environ, SGLITE_KERNEL=kernel, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # an engine in a child process, under the Triton interpreter
def test_triton_path_matches_torch_path(tiny_model_dir):
    torch_res = _run(tiny_model_dir, "torch")
    triton_res = _run(tiny_model_dir, "triton")
    assert triton_res == torch_res
    assert torch_res[-1] > 0  # the third request used the cached prefix (extend over a prefix)
