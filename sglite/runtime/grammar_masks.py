"""Grammar masks overlapped with the model's forward (see :class:`MaskOverlap`)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from .req import Req
from .sampler import Sampler


class MaskOverlap:
    """Grammar masks of a step's sampling requests, computed on a second thread during the forward
    when one needs a vocabulary walk (ms; it reads only tokens already accepted, and the forward's
    ops release the GIL). Cached masks are filled after the forward instead: with every mask warm
    the hand-off cost more than it hid (JSON batch of 16: 21.1-21.8 vs 20.3-20.6 s)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._executor: Optional[ThreadPoolExecutor] = None

    def start(self, reqs: list[Req]) -> Callable[[], Optional[torch.Tensor]]:
        """Start the masks of ``reqs`` if worth overlapping; returns a function giving the
        ``int32 [B, ceil(V/32)]`` bitmask (waiting for it), or None to compute it at sampling."""
        if not any(r.grammar is not None and not r.grammar.mask_is_cached() for r in reqs):
            return lambda: None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglite-grammar-mask")
        return self._executor.submit(self.sampler.grammar_bitmask, reqs).result

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
