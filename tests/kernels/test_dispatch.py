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
        assert not k.dispatch._triton_available()
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
