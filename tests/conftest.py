"""Session-wide fixtures: the real default checkpoint (converted once into the default cache) and
tiny random-weight checkpoints that share its tokenizer.

Layout: one folder per feature (runtime, constrained, frontend, server, kernels, quant, router,
bench, speculative); files are named by the behaviour they check. The fast tier (``make test``:
``-m "not slow"``) is model-free units, tiny random models and fakes; a test that loads the real
default model (``real_engine``, the real weights, ``Engine()`` without a model path), starts
engines or servers in child processes, runs engines together (router, P/D, TP workers), or runs
long loops (stress runs, the longer Triton interpreter sweeps) is marked ``slow`` (``make
test-all`` and CI run both)."""
import os

import pytest


def pytest_configure(config):
    """Under pytest-xdist (``make test``: ``-n auto``, one worker per core) each worker starts with
    its share of the CPUs as torch's intra-op threads (1 on a 2-core machine), not torch's default
    of every core: two workers x two threads on two cores made each tiny-tensor op pay for waking
    threads that wait for a core (sampling loops ~10x slower on a busy machine). Tests that check
    several threads set the count themselves; an engine sets its own at start-up."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        torch.set_num_threads(max(1, cpus // workers))


@pytest.fixture(scope="session")
def real_checkpoint():
    """The default model (SmolLM2-135M-Instruct), converted from GGUF once into the default cache
    (``$SGLITE_CACHE_DIR`` or ``~/.cache/sglite``): ~25 s the first time, ~1 s after."""
    from sglite.runtime.model_loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def real_tokenizer(real_checkpoint):
    """:class:`sglite.runtime.tokenizer.Tokenizer` of the default model."""
    from sglite.runtime.tokenizer import Tokenizer

    return Tokenizer.from_dir(real_checkpoint.model_dir, real_checkpoint.hf_config)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_checkpoint):
    """Tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, SmolLM2 vocabulary)."""
    from sglite.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=0,
                           vocab_from=real_checkpoint.model_dir)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, real_checkpoint):
    """Tiny random Qwen2 (q/k/v biases), otherwise like ``tiny_model_dir``."""
    from sglite.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_qwen"), seed=1, qkv_bias=True,
                           vocab_from=real_checkpoint.model_dir)


@pytest.fixture(scope="session", autouse=True)
def _flat_speculative_step_costs():
    """On CPU, NGRAM drafting follows the step costs measured at engine start-up
    (:mod:`sglite.runtime.speculative.policy`), so which drafts a step carries depends on the
    machine's load at that moment. Tests must not: every engine of the session gets a flat curve
    (rows free: every candidate token with a positive keep estimate is drafted). The probe itself
    is tested by calling ``policy.probe_forward`` directly."""
    from sglite.runtime.speculative import decoder

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder, "probe_forward", lambda runner, kv: {1: 1.0, 32: 1.0})
        yield


@pytest.fixture(scope="session", autouse=True)
def _open_head_gate():
    """EAGLE / MEDUSA engines run their head only when its measured cost pays
    (:mod:`sglite.runtime.speculative.head_gate`): load-dependent again, and random test heads'
    drafts are never kept, so the gate would turn them off and leave the verify paths untested.
    Every engine of the session gets a gate that is always open; ``tests/speculative/test_head_gate.py``
    tests the real one (it sets ``SpecDecoder.gate`` itself)."""
    from sglite.runtime.speculative import decoder
    from sglite.runtime.speculative.head_gate import HeadGate

    class OpenGate(HeadGate):
        def pays(self, st) -> bool:
            return True

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder, "HeadGate", OpenGate)
        yield


@pytest.fixture(scope="session")
def real_engine(real_checkpoint):
    """ONE engine on the default model for the whole test session (float32: parity-grade)."""
    from sglite import Engine

    e = Engine(dtype="float32", max_total_tokens=65536)
    yield e
    e.shutdown()


@pytest.fixture(autouse=True)
def _triton_interpreter_gate(request):
    """Triton test files set ``IN_PROCESS = False`` when triton was imported before they could set
    ``TRITON_INTERPRET=1``: their tests skip here and run instead in a fresh interpreter through
    the file's ``test_file_in_fresh_interpreter`` (:func:`sglite.testing.rerun_in_triton_interpreter`)."""
    if getattr(request.module, "IN_PROCESS", True) is False and request.node.name != "test_file_in_fresh_interpreter":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; "
                    "this file's checks ran in a subprocess (test_file_in_fresh_interpreter)")


@pytest.fixture(scope="module")
def ngram_pair(tiny_model_dir):
    """Two float32 engines on the tiny random Llama: without and with NGRAM speculation (6 drafts)."""
    from sglite import Engine

    kw = dict(dtype="float32", device="cpu", max_total_tokens=4096, check_invariants=True)
    base = Engine(str(tiny_model_dir), **kw)
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, **kw)
    yield base, spec
    base.shutdown()
    spec.shutdown()
