"""Quantized KV pool (``EngineConfig.kv_cache_dtype``): int8 / int4 after KIVI, FP8 E4M3.

Design (KIVI, Liu et al. 2024, §3-4: keys per channel, values per token, a full-precision
residual of the newest tokens):

* **Key groups are page-aligned runs of a request's positions.** Keys are quantized per channel
  over ``kv_cache_quant_group_size`` (G) consecutive positions ``[j*G, (j+1)*G)``; the pool's page
  size is a multiple of G (``page_size 1`` is raised to G by ``EngineConfig``, which refuses
  other non-multiples), and a
  request's position ``p`` sits at offset ``p % page_size`` of its pages, so a group's G slots are
  contiguous and ``slot // G`` indexes its scales (``[S/G, Hkv, 2, D]`` float16 scale and min
  per channel). Values are quantized per token (one float16 scale and min per token and head).
* **Residual window**: the newest ``row_len % G`` tokens of each request (its incomplete group)
  live in a side buffer ``[R, G, Hkv, D]`` in the model dtype, indexed by request row and
  ``position % G``; the attention kernels read positions below ``row_len // G * G`` from the pool
  and the rest from the residual. When a step stores the last token of a group, the group is
  quantized at once (residual + the step's tokens) and written into its pages.
* **Radix cache, retraction, chunked prefill** need no change: the tree holds whole pages only,
  i.e. complete (quantized, immutable) groups; a request admitted on a cached prefix starts its
  own residual at a page boundary; a retracted or finished request's incomplete page is freed with
  its residual, and a re-admitted request recomputes it. Chunked prefill just stores more tokens.
  The cost: prefix reuse is rounded down to whole pages of at least G tokens.
* **Decode-equivalent prefill**: a token at position p attends to keys below ``(p + 1) // G * G``
  as stored (quantized) and to the rest of its group in full precision, whether it runs in a
  prefill chunk (the store keeps the groups it sealed in a per-step stash for extend attention)
  or is decoded; so chunk sizes and cache hits do not change what a token sees, and prompt
  logprobs (perplexity) measure what generation sees.
* Refused combination (``EngineConfig``): ``enable_deterministic_inference`` (a group's scales
  come from whichever step sealed it, not bitwise batch-invariant). With ``speculative_algorithm``
  a verify step's drafts stop short of their key group's last position
  (``speculative.decoder.SpecDecoder.key_group``): only accepted tokens seal a group or write past
  it into the residual window.
* **FP8 E4M3**: every token stored at once as ``float8_e4m3fn`` with a static per-(layer, head)
  scale (1.0: no calibration data in GGUF checkpoints), no residual and no page constraint.

Bytes per token (scales included): see :func:`sglite.runtime.kv_pool.kv_bytes_per_token`; e.g. the default model
(30 layers, 3 KV heads, D = 64) with the default G = 128 (KIVI's residual length): bfloat16
23,040, int8 12,060 (1.91x), int4 6,300 (3.66x), fp8 11,520 (2.0x). The residual windows
(``rows x G`` tokens in the model dtype) are a fixed cost reported beside the pool.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from sglite.kernels.kv_quant import INT_KINDS, QuantKVLayer, QuantStep

from ..errors import InvalidRequestError
from .kv_pool import TokenToKVPool, kv_bytes_per_token

log = logging.getLogger("sglite.kv_quant")



def check_kv_cache_dtype(kv_cache_dtype: str, hf_config, device: str) -> None:
    """Whether the model (a transformers config) and device can use this KV dtype, checked before
    the weights load; raises InvalidRequestError naming ``kv_cache_dtype`` otherwise (int4 needs an
    even head dim; fp8 a torch with float8 on the device)."""
    heads = getattr(hf_config, "num_attention_heads", 1) or 1
    head_dim = getattr(hf_config, "head_dim", None) or getattr(hf_config, "hidden_size", 0) // heads
    if kv_cache_dtype == "int4" and head_dim % 2:
        raise InvalidRequestError(f"kv_cache_dtype: int4 packs two channels per byte and needs an even head "
                                  f"dim; this model's head dim is {head_dim}", field="kv_cache_dtype")
    if kv_cache_dtype == "fp8_e4m3":
        try:
            torch.zeros(2, device=device).to(torch.float8_e4m3fn).float()
        except Exception as e:  # noqa: BLE001 - any failure means the device cannot hold fp8
            raise InvalidRequestError(f"kv_cache_dtype: fp8_e4m3 is not usable on device {device!r} ({e})",
                                      field="kv_cache_dtype") from None


class QuantTokenToKVPool(TokenToKVPool):
    """:class:`TokenToKVPool` whose layers are :class:`~sglite.kernels.kv_quant.QuantKVLayer`
    (``k_buffers[i] is v_buffers[i]``); allocation, freeing and paging are the parent's.

    Args: as :class:`TokenToKVPool`, plus ``kind`` (``int8`` | ``int4`` | ``fp8_e4m3``), ``group``
    (key group, tokens; the page size must be a multiple for int kinds) and ``max_reqs`` (request
    rows of the slot table: residual windows). ``dtype`` is the model dtype (residual windows).
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu", *, kind: str, group: int, max_reqs: int):
        if kind in INT_KINDS and page_size % group:
            raise ValueError(f"page_size {page_size} is not a multiple of the key group {group}")
        self.kind, self.group, self.step = kind, (group if kind in INT_KINDS else 1), QuantStep()
        self.page_size = page_size
        self.num_pages = max(1, num_tokens // page_size)
        self.capacity = self.num_pages * page_size
        S, H, D, G = (self.num_pages + 1) * page_size, n_kv_heads, head_dim, self.group
        self.max_reqs = max_reqs
        layers = []
        for _ in range(num_layers):
            if kind == "fp8_e4m3":
                z = lambda: torch.zeros(S, H, D, dtype=torch.float8_e4m3fn, device=device)  # noqa: E731
                one = lambda: torch.ones(H, dtype=torch.float32, device=device)  # noqa: E731
                layers.append(QuantKVLayer(kind, 1, z(), z(), one(), one(), None, None, self.step, D))
                continue
            dq = D if kind == "int8" else D // 2
            # head-major storage seen as [S, Hkv, .]: one head's rows are one contiguous stream
            # (the C++ kernel's task reads one head), as in TokenToKVPool
            codes = lambda: torch.zeros(H, S, dq, dtype=torch.uint8, device=device).transpose(0, 1)  # noqa: E731
            res = lambda: torch.zeros(max_reqs, G, H, D, dtype=dtype, device=device)  # noqa: E731
            layers.append(QuantKVLayer(kind, G, codes(), codes(),
                                       torch.zeros(S // G, H, 2, D, dtype=torch.float16, device=device),
                                       torch.zeros(H, S, 2, dtype=torch.float16, device=device).transpose(0, 1),
                                       res(), res(), self.step, D))
        self.k_buffers = layers
        self.v_buffers = layers
        self.bytes_per_token = kv_bytes_per_token(kind, num_layers, H, D, group=G)
        elt = torch.finfo(dtype).bits // 8
        self.residual_bytes = 0 if kind == "fp8_e4m3" else 2 * num_layers * max_reqs * G * H * D * elt
        self.device = device
        self._reset_free()

    def begin_step(self, fb) -> None:
        """Record the step's token rows / positions and each row's length after it (from a
        :class:`~sglite.runtime.forward_batch.ForwardBatch` on the pool's device); the KV ops of
        every layer read it."""
        rows = torch.cat((fb.ext_req_pool_indices.repeat_interleave(fb.ext_extend_lens),
                          fb.dec_req_pool_indices)).to(torch.int64)  # [N]
        pos = fb.positions.to(torch.int64)
        row_len = torch.zeros(self.max_reqs, dtype=torch.int64, device=pos.device)
        row_len.scatter_reduce_(0, rows, pos + 1, "amax")
        self.step.tok_rows, self.step.positions, self.step.row_len = rows, pos, row_len


def make_pool(kv_cache_dtype: str, num_tokens: int, page_size: int, num_layers: int, n_kv_heads: int,
              head_dim: int, model_dtype: torch.dtype, device, group: int, max_reqs: int) -> TokenToKVPool:
    """The pool for ``kv_cache_dtype``: a plain :class:`TokenToKVPool` for ``auto`` (model dtype)
    and ``bfloat16``, a :class:`QuantTokenToKVPool` otherwise."""
    if kv_cache_dtype in ("auto", "bfloat16"):
        dt = model_dtype if kv_cache_dtype == "auto" else torch.bfloat16
        return TokenToKVPool(num_tokens, page_size, num_layers, n_kv_heads, head_dim, dt, device)
    return QuantTokenToKVPool(num_tokens, page_size, num_layers, n_kv_heads, head_dim, model_dtype, device,
                              kind=kv_cache_dtype, group=group, max_reqs=max_reqs)


def residual_bytes(kv_cache_dtype: str, num_layers: int, n_kv_heads: int, head_dim: int,
                   model_dtype: torch.dtype, group: int, max_reqs: int) -> int:
    """Bytes of the residual windows of an int8 / int4 pool (0 otherwise)."""
    if kv_cache_dtype not in INT_KINDS:
        return 0
    return 2 * num_layers * max_reqs * group * n_kv_heads * head_dim * (torch.finfo(model_dtype).bits // 8)


def describe(kv_cache_dtype: str, bytes_per_token: int, extra: Optional[int] = None) -> str:
    """``"<dtype>: <B> bytes per token, <T> tokens per GiB"`` (+ residual windows when given)."""
    s = f"{kv_cache_dtype}: {bytes_per_token} bytes per token, {(1 << 30) // bytes_per_token} tokens per GiB"
    if extra:
        s += f", residual windows {extra / 2**20:.1f} MiB"
    return s
