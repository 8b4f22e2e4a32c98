"""Triton implementations of the public kernel ops (imported lazily by :mod:`.dispatch`).

Signatures and semantics match :mod:`sglite.kernels.reference`; each function also accepts
keyword-only extras (``out=``, tile sizes) used by tests and benchmarks.
"""
from .triton_attention import decode_attention, extend_attention, store_kv  # noqa: F401
from .triton_sampling import apply_token_bitmask, sample  # noqa: F401
from .triton_utils import INTERPRETED  # noqa: F401

__all__ = ["store_kv", "decode_attention", "extend_attention", "apply_token_bitmask", "sample",
           "INTERPRETED"]
