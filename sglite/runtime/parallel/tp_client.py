"""The scheduler's side of tensor parallelism: a runner that drives ``tp_size`` worker processes.

:class:`TPRunnerClient` stands where a :class:`~sglite.runtime.model_runner.ModelRunner` stands
for the :class:`~sglite.runtime.scheduler.Scheduler`: it owns the slot table and the page allocator
(every rank's KV pool shard has the same pages, so one allocator plans for all), and its
:meth:`forward` broadcasts the step's :class:`~sglite.runtime.forward_batch.ForwardBatch` on the
control channel; every worker runs it, rank 0 returns the logits. Node 0 hosts the rendezvous
(a ``TCPStore`` at ``dist_init_addr``) and starts its own workers; other nodes start theirs with
``sglite serve --node-rank k`` (:func:`run_node_workers`).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import threading
import weakref

import torch

from ...config import EngineConfig
from ...errors import InvalidRequestError
from ..kv_pool import ReqToTokenPool, TokenToKVPool, kv_bytes_per_token
from ..models.registry import arch_from_hf_config
from ..quant_loader import resolve_quantization as _resolve_q
from .commands import Forward, LoadLora, StepDone, Stop, UnloadLora
from .parallel_state import TPLayout
from .tp_worker import BIG, compact_batch, worker_main

log = logging.getLogger("sglite.tp")


MAIN_GUARD_EXIT = 86  # a worker's exit code: it re-ran the main script's engine creation (no main guard)
MAIN_GUARD_HELP = ("tp_size > 1 starts worker processes with multiprocessing's \"spawn\", which re-imports the "
                   "main script in each of them; create the engine under `if __name__ == \"__main__\":` "
                   "in that script (the module-level code then runs only in the parent)")


def refuse_spawn_reimport() -> None:
    """In a worker that multiprocessing is still bootstrapping (it re-imports the parent's main
    script, and that script creates a ``tp_size > 1`` engine at module level): print
    :data:`MAIN_GUARD_HELP` and exit with :data:`MAIN_GUARD_EXIT`, which the parent turns into a
    RuntimeError saying the same, instead of multiprocessing's generic error."""
    if getattr(mp.current_process(), "_inheriting", False):
        import sys

        print(f"sglite: {MAIN_GUARD_HELP}", file=sys.stderr, flush=True)
        raise SystemExit(MAIN_GUARD_EXIT)


def start_workers(config: EngineConfig, addr: str, ranks) -> list:
    """Spawn one worker process per tensor-parallel rank in ``ranks`` (daemonic, "spawn" start).
    ``addr``: the rendezvous, ``host:port`` or ``file:<path>`` (see
    :func:`~sglite.runtime.parallel.control.open_store`)."""
    refuse_spawn_reimport()
    ctx = mp.get_context("spawn")
    cfg = dataclasses.asdict(config)
    procs = []
    for r in ranks:
        p = ctx.Process(target=worker_main, args=(cfg, r, addr, config.log_level), daemon=True,
                        name=f"sglite-tp{r}")
        p.start()
        procs.append(p)
    return procs


def run_node_workers(config: EngineConfig) -> int:
    """``sglite serve --node-rank k`` (k > 0): run this node's workers until they exit. Returns
    the first non-zero exit code (0 when all stopped cleanly)."""
    n = config.tp_size // config.nnodes
    procs = start_workers(config, config.dist_init_addr, range(config.node_rank * n, (config.node_rank + 1) * n))
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode), 0)


def _stop(ctrl, procs, lock, addr=None) -> None:
    from .control import remove_store_dir

    with lock:
        if ctrl[0] is not None:
            try:
                if all(p.is_alive() for p in procs):
                    ctrl[0].broadcast_msg(Stop())
            except Exception:  # a worker is gone: terminate below
                log.warning("could not send stop to the tensor-parallel workers")
            ctrl[0] = None
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        remove_store_dir(addr)


class TPRunnerClient:
    """Runner of a tensor-parallel engine (``tp_size > 1``), the scheduler's side; implements
    :class:`~sglite.runtime.runner_protocol.RunnerProtocol`.

    Attributes: the protocol's ``req_to_token_pool``, ``token_to_kv_pool`` (allocator only: its K/V
    buffers live in the workers), ``vocab_size``, ``device`` (``cpu``: logits arrive on the host),
    ``dtype``, ``context_length``, ``max_total_tokens``, ``bytes_per_token`` (all ranks together),
    ``measure_forward`` (False), plus ``tp_size`` and ``worker_device``.

    The rendezvous: on one machine (``nnodes`` 1) a ``FileStore`` in a private temporary folder
    (removed at :meth:`close`) and gloo on the loopback interface, so nothing listens on the
    network; with ``nnodes > 1`` a ``TCPStore`` on ``dist_init_addr`` that listens on that host only.

    Raises:
        InvalidRequestError: the heads / MLP width do not split over ``tp_size`` (field tp_size),
            or the context is longer than the model's.
        RuntimeError: a worker failed to start or load (its log has the cause), or the workers
            re-ran the engine creation because the main script has no
            ``if __name__ == "__main__":`` guard (the message says so).
    """

    measure_forward = False  # speculative decoding is refused with tp_size > 1: nothing to measure for

    def __init__(self, config: EngineConfig, checkpoint):
        refuse_spawn_reimport()
        if config.node_rank != 0:
            raise InvalidRequestError(f"node_rank={config.node_rank}: the engine (scheduler) runs on node 0; "
                                      "start the other nodes' workers with `sglite serve --node-rank k`",
                                      field="node_rank")
        q = config.quantization
        if q not in (None, "none", "auto") or (q == "auto" and _resolve_q(q, checkpoint) not in (None, "gguf")):
            raise InvalidRequestError(f"quantization={q!r}: tensor parallelism runs dense weights (use "
                                      "quantization=none; a .gguf model is dequantized)", field="quantization")
        hf = checkpoint.hf_config
        self.arch = arch = arch_from_hf_config(hf)  # Llama, or a family that shards (registry)
        self.tp_size = tp = config.tp_size
        layout = TPLayout.make(hf, 0, tp)  # checks the split before anything starts
        from ..model_runner import resolve_device, resolve_dtype

        self.worker_device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.worker_device)
        self.device = "cpu"
        self.vocab_size = arch.vocab_size
        self.context_length = config.context_length or arch.max_position_embeddings
        if self.context_length > arch.max_position_embeddings:
            raise InvalidRequestError(f"context_length={self.context_length} exceeds the model's "
                                      f"max_position_embeddings ({arch.max_position_embeddings})", field="context_length")
        import torch.distributed as dist

        from .control import FILE_STORE, LOOPBACK, ControlChannel, open_store, private_store_dir, remove_store_dir

        if config.nnodes == 1:  # one machine: a private file store, gloo on loopback (no port open)
            addr, local = FILE_STORE + os.path.join(private_store_dir(), "store"), LOOPBACK
        else:
            addr, local = config.dist_init_addr, None
        try:
            store = open_store(addr, tp + 1, True)
        except Exception:
            remove_store_dir(addr)
            raise
        wcfg = dataclasses.replace(config, model_path=str(checkpoint.model_dir),
                                   dist_init_addr=None if addr.startswith(FILE_STORE) else addr)
        per_node = tp // config.nnodes
        self._lock = threading.Lock()
        self._ctrl = [None]
        self._procs = []
        self._finalizer = weakref.finalize(self, _stop, self._ctrl, self._procs, self._lock, addr)
        self._procs.extend(start_workers(wcfg, addr, range(per_node)))
        box: dict = {}

        def join():
            try:
                box["ctrl"] = ControlChannel(store, 0, tp + 1, host=local)
            except Exception as exc:
                box["error"] = exc

        t = threading.Thread(target=join, daemon=True)
        t.start()
        while t.is_alive():
            self._alive()
            t.join(0.05)
        if "error" in box:
            raise RuntimeError(f"tensor-parallel rendezvous at {addr} failed: {box['error']}")
        self._ctrl[0] = ctrl = box["ctrl"]
        self._store = store
        tokens = ctrl.all_reduce_int(BIG, dist.ReduceOp.MIN, self._alive)
        if ctrl.all_reduce_int(0, dist.ReduceOp.MAX, self._alive):
            self.close()
            raise RuntimeError("a tensor-parallel worker failed to load the model (see its log above)")
        kv_bytes = torch.finfo(self.dtype).bits // 8
        self.bytes_per_token = kv_bytes_per_token("auto", arch.num_layers, layout.num_kv_heads * tp, arch.head_dim, kv_bytes)
        self.token_to_kv_pool = TokenToKVPool(tokens, config.page_size, 0, layout.num_kv_heads, arch.head_dim,
                                              self.dtype, "cpu")  # no layers: pages only
        self.token_to_kv_pool.bytes_per_token = self.bytes_per_token
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests + 8, self.context_length + 8, "cpu")
        self.max_total_tokens = self.token_to_kv_pool.capacity
        log.info("tensor parallel: %d workers (%s) ready; KV pool %d tokens per rank", tp, self.worker_device,
                 self.max_total_tokens)

    def _alive(self) -> None:
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                if p.exitcode == MAIN_GUARD_EXIT:
                    raise RuntimeError(f"tensor-parallel worker rank {i} stopped: {MAIN_GUARD_HELP}")
                raise RuntimeError(f"tensor-parallel worker rank {i} exited (code {p.exitcode})")

    def forward(self, fb) -> torch.Tensor:
        """Run one step on every rank. Returns [M, V] float32 logits on the CPU.

        Raises RuntimeError when a worker's step failed or a worker process is gone."""
        ctrl = self._ctrl[0]
        if ctrl is None:
            raise RuntimeError("tensor-parallel workers are stopped")
        lens = uids = None
        if fb.lora_segments is not None:  # the rows' adapters by uid (0: the base model)
            lens = torch.tensor([n for n, _ in fb.lora_segments], dtype=torch.int64)
            uids = torch.tensor([0 if a is None else a.uid for _, a in fb.lora_segments], dtype=torch.int64)
        with self._lock:
            ctrl.broadcast_msg(Forward(compact_batch(fb), lens, uids), self._alive)
            done = ctrl.recv_msg(1, self._alive)
            if not isinstance(done, StepDone):
                raise RuntimeError(f"tensor-parallel rank 0 answered {type(done).__name__}, not StepDone")
            if done.error is not None:
                raise RuntimeError(f"tensor-parallel step failed on rank 0: {done.error}")
            out = torch.empty(fb.logits_indices.shape[0], self.vocab_size, dtype=torch.float32)
            return ctrl.recv(out, 1, self._alive)

    def load_lora(self, name: str, path: str, uid: int) -> None:
        """Every worker loads its shard of adapter ``name`` (:mod:`.lora_tp`) under radix ``uid``
        (the :class:`~sglite.lora.LoraMirror` of the scheduler's manager). Raises RuntimeError
        when a worker failed (its log has the cause; the ranks that loaded it drop it again)."""
        if self._command(LoadLora(name, path, uid)):
            self._command(UnloadLora(name))  # the ranks without it log a failure and go on
            raise RuntimeError(f"LoRA adapter {name!r}: a tensor-parallel worker failed to load it (see its log)")

    def unload_lora(self, name: str) -> None:
        """Every worker drops adapter ``name``. Raises RuntimeError when a worker failed."""
        if self._command(UnloadLora(name)):
            raise RuntimeError(f"LoRA adapter {name!r}: a tensor-parallel worker failed to unload it (see its log)")

    def _command(self, msg) -> int:
        """Broadcast a LoRA command; the MAX of the ranks' statuses (0: all done)."""
        import torch.distributed as dist

        ctrl = self._ctrl[0]
        if ctrl is None:
            raise RuntimeError("tensor-parallel workers are stopped")
        with self._lock:
            ctrl.broadcast_msg(msg, self._alive)
            return ctrl.all_reduce_int(0, dist.ReduceOp.MAX, self._alive)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()
