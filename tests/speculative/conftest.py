"""Fixtures shared by the speculative-decoding tests."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add their wake-up cost (per call, ~10x on a busy box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
