"""Messages on the tensor-parallel control channel, as typed records (nothing is unpickled).

The scheduler (control rank 0) broadcasts a command to every worker: :class:`Forward` (run one
step), :class:`LoadLora` / :class:`UnloadLora` (LoRA adapters, answered by a status all-reduce) or
:class:`Stop`; after a ``Forward`` the worker of tensor-parallel rank 0 answers
:class:`StepDone` (and, when the step succeeded, the logits as a raw float32 tensor).

Wire format of one message (:func:`encode` / :func:`decode`), a flat uint8 tensor::

    [H: 8 bytes, little-endian] [header: H bytes of UTF-8 JSON] [payload: the tensors' raw bytes]

The header is ``{"type": <name in MESSAGES>, "fields": {JSON values}, "tensors": [[name, dtype,
shape, offset, nbytes], ...]}``; each tensor starts at an 8-byte aligned payload offset. Only the
types in :data:`MESSAGES` and the dtypes in :data:`DTYPES` decode; anything else raises ValueError.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Union

import torch

from ..forward_batch import ForwardBatch

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool,
                                                     torch.float32, torch.float16, torch.bfloat16)}
_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class Forward:
    """Run one step on every rank.

    Attributes:
        batch: the step's :class:`~sglite.runtime.forward_batch.ForwardBatch` on the CPU, its slot
            table compacted to the step's rows (``req_to_token`` [B, Lmax_step] int32; see
            :func:`sglite.runtime.parallel.tp_worker.compact_batch`).
        lora_lens, lora_uids: the step's LoRA row runs when a row has an adapter (``[G]`` int64
            each: rows of the run, and the adapter's uid, 0 for the base model; see
            ``ForwardBatch.lora_segments``), else None.
    """

    batch: ForwardBatch
    lora_lens: Optional[torch.Tensor] = None
    lora_uids: Optional[torch.Tensor] = None

    def to_wire(self) -> tuple[dict, dict]:
        tensors = {f.name: getattr(self.batch, f.name) for f in dataclasses.fields(ForwardBatch)}
        if self.lora_lens is not None:
            tensors.update(lora_lens=self.lora_lens, lora_uids=self.lora_uids)
        return {}, tensors

    @classmethod
    def from_wire(cls, fields: dict, tensors: dict) -> "Forward":
        names = [f.name for f in dataclasses.fields(ForwardBatch)]
        lens, uids = tensors.pop("lora_lens", None), tensors.pop("lora_uids", None)
        if sorted(tensors) != sorted(names) or (lens is None) != (uids is None):
            raise ValueError(f"forward: tensors {sorted(tensors)}, expected {sorted(names)} (+ lora_lens, lora_uids)")
        if lens is not None and (lens.dtype != torch.int64 or uids.dtype != torch.int64 or lens.shape != uids.shape):
            raise ValueError("forward: lora_lens and lora_uids must be int64 tensors of one shape")
        return cls(ForwardBatch(**tensors), lens, uids)


@dataclasses.dataclass(frozen=True)
class LoadLora:
    """Every rank: load its shard of the PEFT adapter at ``path`` as ``name`` with radix uid
    ``uid`` (the scheduler's; steps name adapters by it). Every rank then joins one MAX all-reduce
    of its status (0: loaded, 1: failed, the cause in its log)."""

    name: str
    path: str
    uid: int

    def to_wire(self) -> tuple[dict, dict]:
        return {"name": self.name, "path": self.path, "uid": self.uid}, {}

    @classmethod
    def from_wire(cls, fields: dict, tensors: dict) -> "LoadLora":
        name, path, uid = fields.get("name"), fields.get("path"), fields.get("uid")
        if not (isinstance(name, str) and isinstance(path, str) and isinstance(uid, int)):
            raise ValueError("load_lora: name and path must be strings, uid an integer")
        return cls(name, path, uid)


@dataclasses.dataclass(frozen=True)
class UnloadLora:
    """Every rank: drop adapter ``name`` (then the status all-reduce, as :class:`LoadLora`)."""

    name: str

    def to_wire(self) -> tuple[dict, dict]:
        return {"name": self.name}, {}

    @classmethod
    def from_wire(cls, fields: dict, tensors: dict) -> "UnloadLora":
        if not isinstance(fields.get("name"), str):
            raise ValueError("unload_lora: name must be a string")
        return cls(fields["name"])


@dataclasses.dataclass(frozen=True)
class Stop:
    """Leave the command loop (the worker process then exits)."""

    def to_wire(self) -> tuple[dict, dict]:
        return {}, {}

    @classmethod
    def from_wire(cls, fields: dict, tensors: dict) -> "Stop":
        return cls()


@dataclasses.dataclass(frozen=True)
class StepDone:
    """Tensor-parallel rank 0's answer to :class:`Forward`.

    Attributes:
        error: None when the step ran (the [M, V] float32 logits follow as a raw tensor), else
            ``"<ExceptionType>: <message>"`` of the failure (no logits follow).
    """

    error: Optional[str] = None

    def to_wire(self) -> tuple[dict, dict]:
        return {"error": self.error}, {}

    @classmethod
    def from_wire(cls, fields: dict, tensors: dict) -> "StepDone":
        err = fields.get("error")
        if err is not None and not isinstance(err, str):
            raise ValueError(f"step_done: error must be a string or null, got {type(err).__name__}")
        return cls(err)


Message = Union[Forward, Stop, StepDone, LoadLora, UnloadLora]
MESSAGES: dict[str, type] = {"forward": Forward, "stop": Stop, "step_done": StepDone, "load_lora": LoadLora,
                             "unload_lora": UnloadLora}
_NAMES = {cls: name for name, cls in MESSAGES.items()}


def encode(msg: Message) -> torch.Tensor:
    """``msg`` as one flat uint8 CPU tensor (the wire format above). Tensors are copied to the CPU
    (made contiguous). Raises TypeError for a type not in :data:`MESSAGES` or a dtype not in
    :data:`DTYPES`."""
    name = _NAMES.get(type(msg))
    if name is None:
        raise TypeError(f"not a control-channel message: {type(msg).__name__}")
    fields, tensors = msg.to_wire()
    table, chunks, off = [], [], 0
    for key, t in tensors.items():
        dt = str(t.dtype).removeprefix("torch.")
        if dt not in DTYPES:
            raise TypeError(f"{name}.{key}: dtype {t.dtype} cannot travel on the control channel")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        pad = -off % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
            off += pad
        table.append([key, dt, list(t.shape), off, raw.numel()])
        chunks.append(raw)
        off += raw.numel()
    header = json.dumps({"type": name, "fields": fields, "tensors": table}, separators=(",", ":")).encode()
    head = torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)  # 8 bytes, host (little) endian
    return torch.cat([head, torch.frombuffer(bytearray(header), dtype=torch.uint8), *chunks])


def decode(buf: torch.Tensor) -> Message:
    """The message :func:`encode` wrote into ``buf`` (flat uint8 CPU tensor). Its tensors are fresh
    CPU tensors (not views of ``buf``). Raises ValueError for a malformed buffer, an unknown
    message type or dtype, or a tensor that does not fit the payload."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < 8:
        raise ValueError("control message: expected a flat uint8 buffer of at least 8 bytes")
    n = int(buf[:8].clone().view(torch.int64))
    if not 0 < n <= buf.numel() - 8:
        raise ValueError(f"control message: header length {n} does not fit a {buf.numel()}-byte buffer")
    try:
        header = json.loads(buf[8:8 + n].numpy().tobytes().decode())
        cls = MESSAGES[header["type"]]
        fields, table = header["fields"], header["tensors"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"control message: bad header ({type(exc).__name__}: {exc})") from None
    payload = buf[8 + n:]
    tensors = {}
    for key, dt, shape, off, nbytes in table:
        dtype = DTYPES.get(dt)
        if dtype is None:
            raise ValueError(f"control message: {key}: unknown dtype {dt!r}")
        if off % _ALIGN or off < 0 or off + nbytes > payload.numel():
            raise ValueError(f"control message: {key}: bytes [{off}, {off + nbytes}) outside the payload")
        try:
            tensors[key] = payload[off:off + nbytes].clone().view(dtype).reshape(shape)
        except RuntimeError as exc:  # bytes that do not make this dtype / shape
            raise ValueError(f"control message: {key}: {exc}") from None
    return cls.from_wire(fields, tensors)
