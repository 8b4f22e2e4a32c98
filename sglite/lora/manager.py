"""LoraManager: the adapters one engine serves, by name (SGLang's ``--lora-paths`` /
``lora_path`` terms), and their device slots (:class:`~.pool.LoraPool`).

Threads: :meth:`LoraManager.read` (file IO, checks) runs on the caller's thread; :meth:`add`,
:meth:`remove` and :meth:`batch` on the engine loop's thread; :meth:`resolve` (a dict read) on
request-building threads.
"""
from __future__ import annotations

import itertools
import threading
from typing import Optional, Protocol, Union

import torch

from ..config import LORA_DTYPES, parse_lora_paths  # noqa: F401  (parse_lora_paths re-exported)
from ..errors import InvalidRequestError
from .adapter import LoraAdapter, ModelShape, load_adapter, read_config
from .pool import LoraBatch, LoraPool

DEFAULT_MAX_RANK = 16


def resolve_lora_dtype(lora_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The adapters' A / B storage dtype (vLLM's ``--lora-dtype``): ``bfloat16`` / ``float32`` as
    named; ``auto`` = bfloat16 when the model's activations (``model_dtype``) are bfloat16, else
    float32. Raises InvalidRequestError naming ``lora_dtype`` for another value."""
    if lora_dtype == "auto":
        return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32
    if lora_dtype in LORA_DTYPES[1:]:
        return getattr(torch, lora_dtype)
    raise InvalidRequestError(f"lora_dtype: must be one of {LORA_DTYPES}, got {lora_dtype!r}", field="lora_dtype")


def initial_max_rank(max_lora_rank: Optional[int], lora_paths: tuple) -> int:
    """``max_lora_rank`` when given, else the largest ``r`` of the start-up adapters, else
    :data:`DEFAULT_MAX_RANK`."""
    if max_lora_rank is not None:
        return int(max_lora_rank)
    ranks = [read_config(n, p).get("r", 0) for n, p in lora_paths]
    return max([r for r in ranks if isinstance(r, int)] or [DEFAULT_MAX_RANK])


class LoraMirror(Protocol):
    """Where a manager's loads and unloads are repeated: the tensor-parallel workers, each holding
    its shard (:class:`sglite.runtime.parallel.tp_client.TPRunnerClient`). Both raise
    RuntimeError when a worker failed."""

    def load_lora(self, name: str, path: str, uid: int) -> None: ...

    def unload_lora(self, name: str) -> None: ...


class LoraManager:
    """Adapters by name plus their slots on ``device``. ``max_loras_per_batch``: slots (adapters
    in one step); ``max_lora_rank``: the largest rank accepted; ``dtype``: the adapters' A / B
    storage (:func:`resolve_lora_dtype`), whatever the model's activation dtype; ``mirror``: a
    :class:`LoraMirror` that :meth:`add` and :meth:`remove` repeat to (tensor parallelism: the
    model, and so the slots, live in the workers; this manager's pool then stays empty)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device, max_loras_per_batch: int, max_lora_rank: int,
                 mirror: Optional[LoraMirror] = None):
        self.shape, self.dtype, self.mirror = shape, dtype, mirror
        self.max_loras_per_batch, self.max_lora_rank = max_loras_per_batch, max_lora_rank
        self.pool = LoraPool(shape, dtype, device, max_loras_per_batch, max_lora_rank)
        self.adapters: dict[str, LoraAdapter] = {}
        self._uids = itertools.count(1)
        self._lock = threading.Lock()

    def read(self, name: str, path: str) -> LoraAdapter:
        """Load and check adapter ``name`` from ``path`` (not served until :meth:`add`). Raises
        InvalidRequestError (see :mod:`.adapter`), or naming ``lora_name`` when the name is taken."""
        if not isinstance(name, str) or not name or "=" in name:
            raise InvalidRequestError(f"lora_name: must be a non-empty name without '=', got {name!r}", field="lora_name")
        if name in self.adapters:
            raise InvalidRequestError(f"lora_name: adapter {name!r} is already loaded (unload it first)", field="lora_name")
        with self._lock:
            uid = next(self._uids)
        return load_adapter(name, path, self.shape, self.max_lora_rank, self.dtype, uid)

    def add(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` under its name (loaded by the mirror first, when there is one). Raises
        InvalidRequestError when the name is taken; RuntimeError when the mirror failed."""
        with self._lock:
            if adapter.name in self.adapters:
                raise InvalidRequestError(f"lora_name: adapter {adapter.name!r} is already loaded", field="lora_name")
            if self.mirror is not None:
                self.mirror.load_lora(adapter.name, adapter.path, adapter.uid)
            self.adapters = {**self.adapters, adapter.name: adapter}

    def remove(self, name: str) -> LoraAdapter:
        """Stop serving ``name`` and free its slot; returns it. Raises InvalidRequestError when
        unknown."""
        with self._lock:
            if name not in self.adapters:
                raise InvalidRequestError(f"lora_name: no adapter {name!r} is loaded; loaded: {self.names()}",
                                          field="lora_name")
            adapters = dict(self.adapters)
            adapter = adapters.pop(name)
            self.adapters = adapters
        self.pool.drop(adapter)
        if self.mirror is not None:
            self.mirror.unload_lora(name)
        return adapter

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def resolve(self, lora_path: Union[str, None]) -> Optional[LoraAdapter]:
        """The adapter a request names (None or "": the base model). Raises InvalidRequestError
        naming ``lora_path`` for an unknown name."""
        if lora_path is None or lora_path == "":
            return None
        adapter = self.adapters.get(lora_path) if isinstance(lora_path, str) else None
        if adapter is None:
            raise InvalidRequestError(f"lora_path: no adapter {lora_path!r} is loaded; loaded: {self.names()}",
                                      field="lora_path")
        return adapter

    def batch(self, segments: list) -> Optional[LoraBatch]:
        """One step's :class:`~.pool.LoraBatch` (see :meth:`.pool.LoraPool.batch`)."""
        return self.pool.batch(segments)

    @classmethod
    def start(cls, config, shape: ModelShape, dtype: torch.dtype, device,
              mirror: Optional[LoraMirror] = None) -> "LoraManager":
        """The manager of an engine with ``config`` (``lora_paths``, ``max_loras_per_batch``,
        ``max_lora_rank``, ``lora_dtype``) over a model of activation ``dtype``, its start-up
        adapters loaded (and mirrored). Raises InvalidRequestError as :meth:`read`."""
        paths = tuple(config.lora_paths or ())
        m = cls(shape, resolve_lora_dtype(config.lora_dtype, dtype), device,
                config.max_loras_per_batch, initial_max_rank(config.max_lora_rank, paths), mirror)
        for name, path in paths:
            m.add(m.read(name, path))
        return m

    def unload(self, name: str, scheduler) -> int:
        """On the engine loop's thread: stop serving ``name`` and drop its radix-cache entries
        (``scheduler.kv.cache.drop_namespace``); returns the KV tokens freed. Raises
        InvalidRequestError naming ``lora_name`` when unknown or still used by a waiting or
        running request."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidRequestError(f"lora_name: no adapter {name!r} is loaded; loaded: {self.names()}",
                                      field="lora_name")
        users = [r.rid for r in (*scheduler.waiting, *scheduler.running) if r.lora is adapter]
        if users:
            raise InvalidRequestError(f"lora_name: adapter {name!r} is used by {len(users)} unfinished request(s) "
                                      f"(e.g. {users[0]!r}); unload it when they are done", field="lora_name")
        self.remove(name)
        return scheduler.kv.cache.drop_namespace(adapter.uid)
