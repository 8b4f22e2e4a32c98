"""Kernel dispatcher: implementation choice, overrides, errors, and import without triton."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sglite import kernels
from sglite.kernels import dispatch, reference


def test_cpu_tensors_default_to_torch(monkeypatch):
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    assert dispatch.resolve_impl(None, torch.zeros(1)) == "torch"
    assert dispatch.resolve_impl(None, None) == "torch"


def test_env_and_argument_override(monkeypatch):
    monkeypatch.setenv("SGLITE_KERNEL", "triton")
    assert dispatch.resolve_impl(None, torch.zeros(1)) == "triton"
    assert dispatch.resolve_impl("torch", torch.zeros(1)) == "torch"  # argument beats environment
    monkeypatch.setenv("SGLITE_KERNEL", "torch")
    assert dispatch.resolve_impl(None, torch.zeros(1)) == "torch"


def test_unknown_implementation_lists_known_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"'cuda'.*torch.*triton"):
        dispatch.resolve_impl("cuda", None)
    monkeypatch.setenv("SGLITE_KERNEL", "numba")
    with pytest.raises(ValueError, match="numba"):
        kernels.sample(torch.zeros(1, 4), torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def test_public_ops_route_to_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    logits = torch.randn(3, 70)
    mask = torch.zeros(3, 3, dtype=torch.int32)
    mask[:, 1] = 1 << 5  # only token 37 allowed
    a = logits.clone()
    kernels.apply_token_bitmask(a, mask)
    assert torch.isfinite(a).sum().item() == 3 and torch.isfinite(a[:, 37]).all()
    args = (torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.long), torch.zeros(3),
            torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert kernels.sample(logits, *args, bitmask=mask).tolist() == [37, 37, 37]
    assert torch.equal(kernels.sample(logits, *args, bitmask=mask, impl="torch"),
                       reference.sample(logits, *args, bitmask=mask))


def test_import_works_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any import of triton now raises ImportError
        import sglite, sglite.kernels as k
        import torch
        assert k.resolve_impl(None, torch.zeros(1)) == "torch"
        assert not k.device.triton_available()
        x = torch.randn(2, 40)
        args = (torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long), torch.zeros(2),
                torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
        assert k.sample(x, *args).tolist() == x.argmax(-1).tolist()
        try:
            k.sample(x, *args, impl="triton")
        except ImportError:
            print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "SGLITE_KERNEL"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_matmul_is_the_one_registry_of_linear_impls():
    """Every implementation name a weight can carry is registered in matmul.IMPLS, and nowhere else:
    the weight modules hold no registry (the kernels' imports run one way)."""
    from sglite.kernels import matmul, quant_linear, w8_linear

    assert set(quant_linear.QUANT_IMPLS) <= set(matmul.IMPLS)
    assert not hasattr(quant_linear, "IMPLS") and not hasattr(w8_linear, "IMPLS")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    weights = {"fp8_ref": w8_linear.Fp8LinearWeight.quantize(w), "w8a8_ref": w8_linear.Int8LinearWeight.quantize(w),
               "fp8_block_ref": w8_linear.Fp8BlockLinearWeight.from_tiles(
                   w.to(torch.float8_e4m3fn), torch.full((1, 2), 0.5), (32, 32))}
    for ref_name, q in weights.items():
        ref = kernels.linear(x, q.use(ref_name))
        for name in ("torch", "invariant"):  # the float names a model runner picks, mapped by use()
            q.use(name)
            assert q.impl in matmul.IMPLS and q.impl != ref_name
            assert torch.allclose(kernels.linear(x, q), ref, rtol=1e-4, atol=1e-4), (ref_name, q.impl)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepare_cpu_builds_every_kernel_a_step_calls(monkeypatch, dtype):
    """Engine start builds the attention, elementwise and (bf16) GEMV extensions, so a fresh
    machine does not compile them inside its first request; SGLITE_KERNEL=torch builds none of the
    dispatched ones (bf16 SiLU * up takes the GEMV module whatever SGLITE_KERNEL says)."""
    from sglite.kernels import cpu_attention, cpu_elementwise, cpu_gemv

    asked = []
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    monkeypatch.setattr(cpu_attention, "available", lambda: asked.append("decode_attention") or True)
    monkeypatch.setattr(cpu_attention, "extend_available", lambda: asked.append("extend_attention") or True)
    monkeypatch.setattr(cpu_elementwise, "available", lambda: asked.append("elementwise") or True)
    monkeypatch.setattr(cpu_gemv, "available", lambda: asked.append("gemv") or True)
    pool = torch.zeros(4, 1, 8, dtype=dtype)
    kernels.prepare_cpu(pool, dtype)
    want = ["decode_attention", "extend_attention", "elementwise"] + (["gemv"] if dtype == torch.bfloat16 else [])
    assert asked == want
    asked.clear()
    monkeypatch.setenv("SGLITE_KERNEL", "torch")
    kernels.prepare_cpu(pool, dtype)
    assert asked == ([] if dtype == torch.float32 else ["gemv"])
