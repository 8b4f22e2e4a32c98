"""The tensor-parallel group's backend is chosen in one place (parallel_state.tp_backend): NCCL for
CUDA devices, gloo otherwise. Checked without a GPU: the choice, and that make_tp_group builds
that backend's process group."""
import pytest
import torch
import torch.distributed as dist

from sglite.runtime.parallel import parallel_state
from sglite.runtime.parallel.parallel_state import make_tp_group, tp_backend


def test_backend_per_device():
    assert tp_backend("cpu") == "gloo"
    assert tp_backend(torch.device("cpu")) == "gloo"
    assert tp_backend("cuda") == "nccl"
    assert tp_backend("cuda:3") == "nccl"
    assert tp_backend(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(RuntimeError):
        tp_backend("tpu:0")


def test_make_tp_group_builds_gloo_on_cpu_and_nccl_on_cuda(monkeypatch):
    store = dist.HashStore()
    pg = make_tp_group(store, 0, 1, "cpu")
    assert isinstance(pg, dist.ProcessGroupGloo)
    x = torch.arange(4.0)
    pg.allreduce([x]).wait()  # a 1-rank group works
    assert torch.equal(x, torch.arange(4.0))

    made = []

    class FakeNCCL:
        def __init__(self, store, rank, size):
            made.append((rank, size))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    assert isinstance(make_tp_group(dist.HashStore(), 1, 2, "cuda:1"), FakeNCCL) and made == [(1, 2)]


def test_no_other_module_picks_a_backend():
    """Only parallel_state names NCCL: every other group (control, P/D transfer) is gloo."""
    from pathlib import Path

    import sglite

    root = Path(sglite.__file__).parent
    hits = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
            if "ProcessGroupNCCL" in p.read_text() or '"nccl"' in p.read_text()]
    assert hits == ["runtime/parallel/parallel_state.py"], hits
    assert Path(parallel_state.__file__).name == "parallel_state.py"
