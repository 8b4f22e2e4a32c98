"""Every C++ CPU kernel of sglite builds on a machine that has the tools (a C++ compiler and
ninja: CI's): many kernel test modules skip when their extension is unavailable, so a source that
stops compiling would otherwise leave their tests skipped and the suite green (it happened once in
review: an include line the splicer did not match). The AVX-512 VNNI GEMM is checked where the CPU
has its features."""
import pytest

from sglite.kernels import (cpu_attention, cpu_elementwise, cpu_gemv, cpu_lora, decode_fused, kv_quant_cpu, quant_cpu,
                            quant_gemm)
from sglite.kernels.device import cpu_flags
from tests.kernels.builds import built

LOADERS = {
    "cpu_attention": cpu_attention.load,
    "cpu_extend_attention": cpu_attention.load_extend,
    "cpu_elementwise": cpu_elementwise.load,
    "cpu_gemv": cpu_gemv.load,
    "cpu_lora": cpu_lora.load,
    "decode_layer": decode_fused.load,
    "kv_quant_attention": kv_quant_cpu.load,
    "quant_gemv": quant_cpu.load,
}
# (quant_amx is left to its own tests: its loader also returns None when Linux refuses the tile state)
FEATURED = {"quant_gemm": (quant_gemm.load, quant_gemm.REQUIRED_FLAGS)}


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_extension_builds(name):
    built(LOADERS[name])


@pytest.mark.parametrize("name", sorted(FEATURED))
def test_feature_extension_builds_where_the_cpu_has_the_features(name):
    load, flags = FEATURED[name]
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    built(load)
