"""sglite.kernels: public ops (paged attention, KV store, token bitmask, sampling) behind one dispatcher."""
from .dispatch import (apply_token_bitmask, decode_attention, extend_attention, resolve_impl,  # noqa: F401
                       sample, store_kv)
from .reference import bitmask_to_bool  # noqa: F401
