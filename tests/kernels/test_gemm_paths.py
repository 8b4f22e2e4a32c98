"""Float batches on a oneDNN weight packed once (sglite.kernels.matmul ``cpp`` / ``onednn`` impls) and
the dispatcher's path table (sglite.kernels.gemm_paths): packed products equal F.linear on the plain
weight (random shapes, with and without bias), the GEMV keeps 1..8 rows, SGLITE_GEMM forces the
paths and rejects unknown values, and ONEDNN_VERBOSE shows no reorder of the weight per call."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglite.kernels import cpu_gemv, gemm_paths
from sglite.kernels.matmul import LinearWeight, linear

packable = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not packable, reason="oneDNN without bf16 here")
@pytest.mark.parametrize("impl", ["cpp", "onednn"])
@pytest.mark.parametrize("m,n,k,bias", [(9, 48, 64, False), (33, 100, 72, True), (200, 96, 1536, False), (1, 40, 64, True)])
def test_packed_equals_f_linear(impl, m, n, k, bias, monkeypatch):
    monkeypatch.delenv("SGLITE_GEMM", raising=False)
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    lw = LinearWeight(w, b).use(impl)
    assert lw.packed is not None and lw.weight is w
    x = torch.randn(m, k, generator=g).bfloat16()
    y = linear(x, lw)
    want = F.linear(x, w, b)
    if impl == "cpp" and m <= 8 and cpu_gemv.available():  # the C++ GEMV: same products, its own order
        assert (y.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    else:
        assert torch.equal(y, want)  # same oneDNN kernel, weight reordered once instead of per call
    assert linear(x[:0], lw).shape == (0, n)
    assert LinearWeight(w).use("torch").packed is None  # only the batch impls keep the copy


def test_paths_and_forcing(monkeypatch):
    monkeypatch.delenv("SGLITE_GEMM", raising=False)
    assert gemm_paths.float_path(4, True, True) == "gemv" and gemm_paths.float_path(9, False, True) == "onednn_packed"
    assert gemm_paths.float_path(9, False, False) == "torch"
    assert [gemm_paths.quant_path(r, True, True) for r in (1, 8, 9, 300)] == ["gemv_q8"] * 2 + ["vnni_gemm"] * 2
    assert gemm_paths.quant_path(300, True, False) == "dequant_gemm" and gemm_paths.quant_path(9, False, True) == "gemv"
    monkeypatch.setenv("SGLITE_GEMM", "torch")
    assert gemm_paths.float_path(9, False, True) == "torch" and gemm_paths.quant_path(300, True, True) == "dequant_gemm"
    assert gemm_paths.quant_path(20, True, True) == "gemv_q8"
    monkeypatch.setenv("SGLITE_GEMM", "cpp")
    assert gemm_paths.float_path(2, True, True) == "onednn_packed" and gemm_paths.quant_path(2, True, True) == "vnni_gemm"
    assert "SGLITE_GEMM=cpp" in gemm_paths.describe(True, True, True)
    monkeypatch.setenv("SGLITE_GEMM", "amx")
    with pytest.raises(ValueError, match="SGLITE_GEMM must be one of auto|torch|cpp"):
        gemm_paths.mode()


def test_fused_amx_threshold_per_weight(monkeypatch):
    """The fused decode's AMX threshold by rows x weight: today 9 rows for every weight (the K loop on
    the codes); with the constants set apart (as they were for the repacked bf16 copy), an LM head of
    >= FUSED_LARGE_BYTES of codes from the large threshold (its 8-row GEMV blocks would stream it
    again), 8-bit codes from theirs, 4-bit from the general one; one threshold for a model's layers:
    the one holding most weight elements; printed."""
    monkeypatch.delenv("SGLITE_GEMM", raising=False)
    gemma_head, smol_head = (262144, 640, 8), (49152, 576, 8)
    gemma_layer = [(1536, 640, 8), (640, 1024, 4), (4096, 640, 8), (640, 2048, 8)]
    smol_layer = [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4)]
    assert gemm_paths.AMX_MIN_ROWS == gemm_paths.Q8_GEMV_MAX_ROWS + 1
    assert {gemm_paths.fused_amx_min(*w) for w in (gemma_head, smol_head, (4096, 640, 8), (3072, 576, 4))} == {9}
    assert gemm_paths.fused_layers_amx_min(gemma_layer * 18) == gemm_paths.fused_layers_amx_min(smol_layer * 30) == 9
    monkeypatch.setattr(gemm_paths, "AMX_MIN_ROWS", 16)
    monkeypatch.setattr(gemm_paths, "FUSED_AMX_MIN_ROWS_8BIT", 12)
    assert [gemm_paths.fused_amx_min(*w) for w in (gemma_head, smol_head)] == [9, 9]
    assert gemm_paths.fused_amx_min(4096, 640, 8) == 12 and gemm_paths.fused_amx_min(3072, 576, 4) == 16
    assert gemm_paths.fused_amx_min(49152, 576, 4) == 9  # 14 MB of 4-bit codes: large too
    assert gemm_paths.fused_layers_amx_min(gemma_layer * 18) == 12
    assert gemm_paths.fused_layers_amx_min(smol_layer * 30) == 16
    assert gemm_paths.fused_layers_amx_min([(64, 64, 8), (64, 64, 4)]) == 16  # a tie: the larger
    with pytest.raises(ValueError, match="weights must not be empty"):
        gemm_paths.fused_layers_amx_min([])
    monkeypatch.setattr(gemm_paths, "AMX_MIN_ROWS", 4)  # never later than the general threshold
    assert gemm_paths.fused_amx_min(*gemma_head) == 4 and gemm_paths.fused_amx_min(4096, 640, 8) == 4
    monkeypatch.setattr(gemm_paths, "AMX_MIN_ROWS", 16)
    line = gemm_paths.describe(True, True, True, amx_ok=True)
    assert "fused decode (bf16): amx_gemm from 9 rows for codes >= 8 MiB, 12 for 8-bit codes, 16 else" in line
    monkeypatch.setenv("SGLITE_GEMM", "vnni")
    assert "fused decode" not in gemm_paths.describe(True, True, True, amx_ok=True)


@pytest.mark.skipif(not packable, reason="oneDNN without bf16 here")
def test_no_reorder_per_call():
    code = ("import torch\nfrom sglite.kernels.matmul import LinearWeight, linear\n"
            "lw = LinearWeight(torch.randn(256, 128).bfloat16()).use('onednn')\nprint('CALLS', flush=True)\n"
            "for m in (9, 48, 48, 300):\n    linear(torch.randn(m, 128).bfloat16(), lw)\n")
    env = dict(os.environ, ONEDNN_VERBOSE="1", SGLITE_GEMM="auto")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    calls = out.split("CALLS", 1)[1].splitlines()
    execs = [ln for ln in calls if ",exec," in ln]
    assert len(execs) == 4, out[-2000:]  # one matmul per call
    assert not any(",reorder," in ln for ln in execs), execs  # and no weight reorder among them


def test_bench_quant_gemm_args():
    from sglite.bench import quant

    p = quant.build_parser()
    quant.check_args(p.parse_args(["--parts", "gemm", "--gemm-rows", "1,48"]))
    for bad in (["--parts", "gemm", "--gemm-rows", "0,8"], ["--parts", "gemm", "--gemm-rows", "a"], ["--parts", "gemms"]):
        with pytest.raises(ValueError, match="--gemm-rows|--parts"):
            quant.check_args(p.parse_args(bad))
