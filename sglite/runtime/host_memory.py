"""Huge-page host buffers: the allocator lives in :mod:`sglite.kernels.host_memory` (one for the KV
pool and the packed weights); re-exported here for the runtime's KV pool."""
from sglite.kernels.host_memory import HUGE_PAGE, empty_hugepage, zeros_hugepage  # noqa: F401
