"""KV pool sizing without ``max_total_tokens``: what the configuration can use, capped by memory."""
from sglite.config import EngineConfig
from sglite.runtime.model_runner import MAX_POOL_TOKENS, pool_tokens

BPT = 23040  # SmolLM2-135M, bf16: 2 x 30 layers x 3 KV heads x 64 x 2 bytes
GIB = 1 << 30


def test_one_request_config_gets_one_context():
    cfg = EngineConfig(max_running_requests=1)
    assert pool_tokens(cfg, 8192, BPT, 24 * GIB) == 8192 + 16


def test_many_requests_are_capped_by_the_memory_fraction():
    cfg = EngineConfig(max_running_requests=64, mem_fraction_static=0.2)
    n = pool_tokens(cfg, 8192, BPT, 24 * GIB)
    assert n == int(0.2 * 24 * GIB) // BPT and n < 64 * 8192
    assert n * BPT <= 0.2 * 24 * GIB


def test_never_below_one_full_context_and_never_above_the_cap():
    tiny_mem = pool_tokens(EngineConfig(max_running_requests=64), 8192, BPT, 1 << 20)
    assert tiny_mem >= 8192 + 16
    huge = pool_tokens(EngineConfig(max_running_requests=1024, mem_fraction_static=1.0), 8192, 64, 1 << 50)
    assert huge == MAX_POOL_TOKENS


def test_page_size_headroom():
    cfg = EngineConfig(max_running_requests=2, page_size=16)
    assert pool_tokens(cfg, 1000, BPT, 24 * GIB) == 2 * 1000 + 16 * 16
