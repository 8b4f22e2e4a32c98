"""A tensor-parallel model worker process: one rank's weight shard and KV pool shard.

Started by :class:`~sglite.runtime.parallel.tp_client.TPRunnerClient` (node 0) or by
``sglite serve --node-rank k`` (other nodes). The loop: receive the scheduler's command on the
control channel (:class:`~sglite.runtime.parallel.control.ControlChannel`), run the same
:class:`~sglite.runtime.forward_batch.ForwardBatch` as every other rank (the collectives inside the
forward run on the tensor-parallel group: gloo on CPU, NCCL on CUDA), and on
rank 0 send the step's logits back to the scheduler.

Commands (:mod:`sglite.runtime.parallel.commands`, typed records: a JSON header and raw tensors):
:class:`~sglite.runtime.parallel.commands.Forward` with the step's ForwardBatch (``req_to_token``
compacted to the step's rows, see :func:`compact_batch`; the rows' LoRA adapters by uid), answered
by rank 0 with :class:`~sglite.runtime.parallel.commands.StepDone` (then the logits);
``LoadLora`` / ``UnloadLora`` (this rank's adapter shards, :mod:`.lora_tp`), answered by a status
all-reduce of every rank and the scheduler; ``Stop``.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

log = logging.getLogger("sglite.tp_worker")

BIG = 1 << 62


def compact_batch(fb):
    """The :class:`~sglite.runtime.forward_batch.ForwardBatch` ``fb`` with its slot table cut to the
    step's rows and longest sequence (``[B, Lmax_step]`` int32, row indices remapped), so a step
    ships kilobytes, not the table. Returns a new ForwardBatch (``fb`` is not changed)."""
    from sglite.runtime.forward_batch import ForwardBatch

    rows = torch.cat([fb.ext_req_pool_indices, fb.dec_req_pool_indices])
    uniq, inv = torch.unique(rows, return_inverse=True)
    need = torch.cat([fb.ext_prefix_lens + fb.ext_extend_lens, fb.dec_seq_lens])
    width = int(need.max()) if need.numel() else 1
    ne = fb.ext_req_pool_indices.shape[0]
    out = {f.name: getattr(fb, f.name) for f in dataclasses.fields(ForwardBatch)}  # not lora_segments / lora
    out["req_to_token"] = fb.req_to_token[uniq, :width].contiguous()
    out["ext_req_pool_indices"], out["dec_req_pool_indices"] = inv[:ne].long(), inv[ne:].long()
    return ForwardBatch(**out)


def worker_main(config_dict: dict, tp_rank: int, addr: str, log_level: str = "info") -> None:
    """Process entry point: join the rendezvous at ``addr`` (``"host:port"`` of a TCPStore, or
    ``"file:<path>"`` of a single machine's FileStore), load this rank's
    shard, size the KV pool with the others (the minimum over ranks), then serve commands until
    ``stop``. Errors in a step are logged and reported to the scheduler by rank 0."""
    import torch.distributed as dist

    from ...config import EngineConfig
    from ...logging_setup import configure
    from ..forward_batch import ForwardBatch
    from ..model_loader import load_checkpoint
    from ..model_runner import ModelRunner, available_memory_bytes, pool_tokens, resolve_device, resolve_dtype
    from ..models.registry import arch_from_hf_config
    from .commands import Forward, LoadLora, StepDone, Stop, UnloadLora
    from .lora_tp import WorkerLora
    from .control import DEFAULT_TIMEOUT, FILE_STORE, LOOPBACK, ControlChannel, open_store
    from .parallel_state import TPComm, TPLayout, load_shard, make_tp_group

    configure(log_level)
    cfg = EngineConfig(**config_dict)
    tp, local_n = cfg.tp_size, cfg.tp_size // cfg.nnodes
    store = open_store(addr, tp + 1, False, DEFAULT_TIMEOUT)
    local = LOOPBACK if addr.startswith(FILE_STORE) else None  # one machine: gloo on loopback only
    ctrl = ControlChannel(store, 1 + tp_rank, tp + 1, host=local)
    device = resolve_device(cfg.device)
    if device.startswith("cuda"):
        device = f"cuda:{tp_rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cfg.num_threads or max(1, ((os.cpu_count() or 2) - 1) // local_n))
    group = make_tp_group(store, tp_rank, tp, device, local)
    status = 0
    try:
        ckpt = load_checkpoint(cfg.model_path)
        layout = TPLayout.make(ckpt.hf_config, tp_rank, tp)
        dtype = resolve_dtype(cfg.dtype, device)
        sd = load_shard(ckpt, layout, dtype)
        hf_local = layout.local_hf_config(ckpt.hf_config)
        ctx = cfg.context_length or ckpt.hf_config.max_position_embeddings
        bpt = 2 * hf_local.num_hidden_layers * layout.num_kv_heads * hf_local.head_dim * torch.finfo(dtype).bits // 8
        share = local_n if device == "cpu" else 1  # the ranks of this node share its host memory
        tokens = cfg.max_total_tokens or pool_tokens(cfg, ctx, bpt, available_memory_bytes(device) // share)
    except Exception:
        log.exception("tensor-parallel rank %d failed to load", tp_rank)
        status, tokens = 1, BIG
    tokens = ctrl.all_reduce_int(tokens, dist.ReduceOp.MIN)
    runner = None
    if status == 0:
        try:
            local_cfg = dataclasses.replace(cfg, max_total_tokens=tokens, device=device, tp_size=1, nnodes=1,
                                            node_rank=0, dist_init_addr=None, quantization="none")
            runner = ModelRunner(local_cfg, hf_local, sd, hybrid_swa=False)  # the scheduler plans one slot space
            runner.model.tp = TPComm(layout, group)
            lora = WorkerLora(cfg, layout, arch_from_hf_config(ckpt.hf_config), runner.arch, runner.dtype,
                              runner.device)  # adapters come as LoadLora commands (start-up ones too)
            del sd
        except Exception:
            log.exception("tensor-parallel rank %d failed to build its model", tp_rank)
            status = 1
    if ctrl.all_reduce_int(status, dist.ReduceOp.MAX):
        return
    log.info("tensor-parallel rank %d/%d ready on %s (%d KV tokens)", tp_rank, tp, device, runner.max_total_tokens)
    pool = runner.token_to_kv_pool
    while True:
        cmd = ctrl.broadcast_msg()
        if isinstance(cmd, Stop):
            break
        if isinstance(cmd, (LoadLora, UnloadLora)):
            ctrl.all_reduce_int(_lora_command(lora, cmd, tp_rank), dist.ReduceOp.MAX)
            continue
        if not isinstance(cmd, Forward):
            raise RuntimeError(f"tensor-parallel rank {tp_rank}: unexpected command {type(cmd).__name__}")
        try:
            fb = ForwardBatch(**{k: v.to(device) for k, v in cmd.batch.__dict__.items()})
            lora.attach(fb, cmd.lora_lens, cmd.lora_uids)  # fb.lora: this rank's shard of the step's adapters
            pool.begin_step(fb)  # a no-op on the plain pool (the only kind tensor parallelism runs)
            logits = runner.model.forward(fb, pool.k_buffers, pool.v_buffers)  # [M, V] float32
            err = None
        except Exception as exc:  # report, keep serving
            log.exception("tensor-parallel rank %d: step failed", tp_rank)
            err = f"{type(exc).__name__}: {exc}"
        if tp_rank == 0:
            ctrl.send_msg(StepDone(err), 0)
            if err is None:
                ctrl.send(logits.cpu(), 0)


def _lora_command(lora, cmd, tp_rank: int) -> int:
    """Run a :class:`~.commands.LoadLora` / :class:`~.commands.UnloadLora` on this rank's
    :class:`~.lora_tp.WorkerLora`; returns its status for the all-reduce (0 done, 1 failed: logged)."""
    from .commands import LoadLora

    try:
        if isinstance(cmd, LoadLora):
            lora.load(cmd.name, cmd.path, cmd.uid)
        else:
            lora.unload(cmd.name)
        return 0
    except Exception:
        log.exception("tensor-parallel rank %d: %s of LoRA adapter %r failed", tp_rank, type(cmd).__name__, cmd.name)
        return 1
