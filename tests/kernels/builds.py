"""The one check every C++ kernel test module makes before it uses its extension."""
import shutil

import pytest


def built(load):
    """``load()`` (a kernel module's loader: compiles once per machine, cached) or a skip naming the
    missing tool (a C++ compiler, ninja); with both present a failed build fails the test."""
    from torch.utils.cpp_extension import is_ninja_available

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on PATH: the C++ CPU kernel cannot be built")
    if not is_ninja_available():
        pytest.skip("ninja is not installed: torch cannot build the C++ CPU kernel")
    mod = load()
    assert mod is not None, "a compiler and ninja are present but the C++ kernel failed to build"
    return mod


def amx_extend_ops():
    """The extend-attention ops with their AMX path, or a skip (no AMX on this CPU or build)."""
    from sglite.kernels import cpu_attention

    ops = built(cpu_attention.load_extend)
    if not cpu_attention.amx_ready():
        pytest.skip("no AMX attention on this CPU / build")
    return ops
