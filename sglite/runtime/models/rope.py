"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer") and its context-extension variants,
as data: a :class:`RopeSpec` read once from a HF config, turned into the per-position cos/sin
tables every layer (and the fused C++ decode, :mod:`sglite.kernels.decode_fused`) indexes by
absolute position. Every variant only changes those tables (inverse frequencies per position, and
an attention factor multiplied into cos and sin, as transformers does), so the attention math and
the KV cache are the same for all of them.

Variants (``rope_type``; the formulas are transformers' ``modeling_rope_utils``, checked against
``ROPE_INIT_FUNCTIONS`` in tests/runtime/test_rope.py):

* ``default``: ``inv_freq[i] = theta ** (-2i / D)``.
* ``linear`` (position interpolation, Chen et al. 2023): ``inv_freq / factor``.
* ``dynamic`` (dynamic NTK, /u/emozilla 2023): for a sequence of length ``L`` beyond the original
  length ``Lo`` (the config's ``max_position_embeddings``) the base becomes
  ``theta * (factor * L / Lo - (factor - 1)) ** (D / (D - 2))``.
* ``yarn`` (Peng et al. 2023, "YaRN", sec. 3.2-3.4): per-dimension blend of interpolated and
  extrapolated frequencies over the correction range of ``beta_fast`` / ``beta_slow``, attention
  factor ``0.1 * mscale * ln(factor) + 1`` (eq. 21; or ``attention_factor`` when given).
* ``llama3`` (Llama 3.1 report): wavelengths above ``Lo / low_freq_factor`` divided by
  ``factor``, below ``Lo / high_freq_factor`` kept, smoothly interpolated between.
* ``freq_factors`` (any variant, from a GGUF file's ``rope_freqs.weight`` tensor: llama.cpp's
  per-frequency divisors, which is how its converter stores Llama 3.1's ``llama3`` scaling):
  ``inv_freq[i] / freq_factors[i]``, carried in the converted folder's config as
  ``gguf_rope_freqs`` (:func:`sglite.runtime.model_loader.load_checkpoint`).
* ``longrope`` (Ding et al. 2024, "LongRoPE"; Phi-3's ``su`` is the same): per-dimension
  rescale factors, ``short_factor`` or ``long_factor``, and attention factor
  ``sqrt(1 + ln(factor) / ln(Lo))`` with ``factor = max_position_embeddings / Lo``.

Length-dependent variants and the KV cache. transformers recomputes the frequencies of
``dynamic`` and ``longrope`` on every forward from that forward's largest position
(``seq_len = max(position_ids) + 1``) and rotates all of its tokens with them; keys already in the
cache keep the rotation they were written with. Here the frequencies are fixed per *position*:
position ``p`` is rotated with the frequencies of a sequence of length ``p + 1`` (``dynamic``:
``L = max(p + 1, Lo)``; ``longrope``: ``long_factor`` iff ``p >= Lo``). That is exactly what
transformers does for every token of a prompt of at most ``Lo`` tokens and for every decode step
(one new token at the largest position), so greedy outputs match transformers for prompts within
the original length, however far generation then runs; KV entries stay valid whatever request or
prefix (radix cache) they are reused by. For a *prompt* longer than ``Lo`` transformers rotates
the whole prompt with the long-sequence frequencies (``seq_len`` = prompt length) while here
positions below ``Lo`` keep the short ones: the outputs then differ from transformers (as they do
between transformers runs that prefill the same text in one piece or in two). ``dynamic`` tables
are built up to ``factor * Lo`` positions (the length the scaling is meant for), which is then the
model's context limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglite.errors import InvalidRequestError

#: ``rope_type`` values accepted in ``rope_parameters`` / ``rope_scaling`` (``su`` = ``longrope``)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "su")
_ALIASES = {"su": "longrope", None: "default"}


@dataclass(frozen=True)
class RopeSpec:
    """One model's RoPE variant (immutable, hashable).

    Attributes:
        rope_type: one of ``default``, ``linear``, ``dynamic``, ``yarn``, ``llama3``, ``longrope``.
        theta: base wavelength.
        dim: rotary dimension R (the head dimension, or ``partial_rotary_factor`` of it).
        head_dim: the head dimension D when larger than ``dim`` (partial rotary), else 0.
        factor: scaling factor (``linear``, ``dynamic``, ``yarn``, ``llama3``; ``longrope``:
            ``max_position_embeddings / original_max_position_embeddings`` unless given).
        original_max_position_embeddings: the pre-training length Lo (``dynamic``: the config's
            ``max_position_embeddings``).
        max_position_embeddings: the config's ``max_position_embeddings``.
        low_freq_factor, high_freq_factor: ``llama3``.
        beta_fast, beta_slow, mscale, mscale_all_dim, truncate: ``yarn``.
        attention_factor: explicit attention factor (``yarn``, ``longrope``), else derived.
        short_factor, long_factor: ``longrope`` per-dimension factors, D/2 each.
        freq_factors: D/2 per-frequency divisors applied on top of the variant (a GGUF file's
            ``rope_freqs.weight``, llama.cpp's form of Llama 3.1 scaling), () for none.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 64
    head_dim: int = 0
    factor: Optional[float] = None
    original_max_position_embeddings: int = 2048
    max_position_embeddings: int = 2048
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True
    attention_factor: Optional[float] = None
    short_factor: tuple = ()
    long_factor: tuple = ()
    freq_factors: tuple = ()

    @property
    def table_positions(self) -> int:
        """Positions the cos/sin tables cover (the model's context limit): the config's
        ``max_position_embeddings``, ``dynamic``: ``factor`` times it."""
        if self.rope_type == "dynamic":
            return int(self.max_position_embeddings * max(self.factor or 1.0, 1.0))
        return self.max_position_embeddings


def _bad(msg: str, field: str = "rope_parameters"):
    return InvalidRequestError(msg, field=field)


def spec_from_hf_config(cfg, head_dim: int) -> RopeSpec:
    """Read ``cfg.rope_parameters`` (transformers 5) or ``cfg.rope_scaling`` (older configs) and
    ``rope_theta`` into a :class:`RopeSpec` for heads of ``head_dim``.

    Raises:
        InvalidRequestError: an unknown ``rope_type`` (naming the field and
            :data:`SUPPORTED_ROPE_TYPES`), a missing required parameter, a ``partial_rotary_factor``
            outside (0, 1] or giving an odd rotary dimension, or per-layer-type RoPE parameters.
    """
    field = "rope_parameters" if getattr(cfg, "rope_parameters", None) else "rope_scaling"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        raise _bad(f"{field}={rope!r} is not a dict", field)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise _bad(f"{field} per layer type ({sorted(rope)}) is not supported here", field)
    raw_type = rope.get("rope_type", rope.get("type"))
    rtype = _ALIASES.get(raw_type, raw_type)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise _bad(f"{field}.rope_type={raw_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}", field)
    partial = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None)) or 1.0)
    rot = int(head_dim * partial)
    if not 0.0 < partial <= 1.0 or rot < 2 or rot % 2:
        raise _bad(f"partial_rotary_factor={partial} gives a rotary dimension of {rot} for head_dim={head_dim}; "
                   "supported: a factor in (0, 1] giving an even dimension >= 2", "partial_rotary_factor")
    theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0
    max_pos = int(getattr(cfg, "max_position_embeddings", None) or 2048)
    orig = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    orig = int(max_pos if rtype == "dynamic" or not orig else orig)

    def need(key):
        if rope.get(key) is None:
            raise _bad(f"{field}.{key} is required for rope_type={rtype!r}", field)
        return rope[key]

    kw = {}
    if rtype in ("linear", "dynamic", "llama3"):
        kw["factor"] = float(need("factor"))
    if rtype == "llama3":
        kw.update(low_freq_factor=float(need("low_freq_factor")), high_freq_factor=float(need("high_freq_factor")))
    if rtype in ("yarn", "longrope"):
        f = rope.get("factor")
        kw["factor"] = float(f) if f is not None else max_pos / orig
        if rope.get("attention_factor") is not None:
            kw["attention_factor"] = float(rope["attention_factor"])
    if rtype == "yarn":
        kw.update(beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                  mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                  truncate=bool(rope.get("truncate", True)))
    if rtype == "longrope":
        short, long = tuple(float(x) for x in need("short_factor")), tuple(float(x) for x in need("long_factor"))
        if len(short) != rot // 2 or len(long) != rot // 2:
            raise _bad(f"{field}.short_factor/long_factor must have rotary_dim/2={rot // 2} entries, "
                       f"got {len(short)}/{len(long)}", field)
        kw.update(short_factor=short, long_factor=long)
    freqs = getattr(cfg, "gguf_rope_freqs", None)
    if freqs is not None:
        freqs = tuple(float(x) for x in freqs)
        if len(freqs) != rot // 2 or not all(math.isfinite(x) and x > 0 for x in freqs):
            raise _bad(f"rope_freqs: the GGUF rope_freqs.weight tensor must hold rotary_dim/2={rot // 2} "
                       f"positive finite factors, got {len(freqs)} (min {min(freqs, default=None)})", "rope_freqs")
        kw["freq_factors"] = freqs
    return RopeSpec(rope_type=rtype, theta=float(theta), dim=rot, head_dim=head_dim if rot < head_dim else 0,
                    original_max_position_embeddings=orig, max_position_embeddings=max_pos, **kw)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(spec: RopeSpec) -> float:
    """The factor transformers multiplies into cos and sin (1 except ``yarn`` / ``longrope``)."""
    if spec.attention_factor is not None:
        return spec.attention_factor
    if spec.rope_type == "yarn":
        if spec.mscale and spec.mscale_all_dim:
            return _yarn_mscale(spec.factor, spec.mscale) / _yarn_mscale(spec.factor, spec.mscale_all_dim)
        return _yarn_mscale(spec.factor)
    if spec.rope_type == "longrope" and spec.factor > 1.0:
        return math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_position_embeddings))
    return 1.0


def inv_freq(spec: RopeSpec, seq_len: Optional[int] = None) -> torch.Tensor:
    """[D/2] float64 inverse frequencies of ``spec`` for a sequence of ``seq_len`` tokens (used by
    ``dynamic`` and ``longrope`` only; None: the original length), ``freq_factors`` divided out."""
    inv = _variant_inv_freq(spec, seq_len)
    return inv / torch.tensor(spec.freq_factors, dtype=torch.float64) if spec.freq_factors else inv


def _variant_inv_freq(spec: RopeSpec, seq_len: Optional[int] = None) -> torch.Tensor:
    d, theta = spec.dim, spec.theta
    expo = torch.arange(0, d, 2, dtype=torch.float64) / d  # [D/2]
    base_inv = 1.0 / theta ** expo
    t = spec.rope_type
    if t == "default":
        return base_inv
    if t == "linear":
        return base_inv / spec.factor
    if t == "dynamic":
        lo = spec.original_max_position_embeddings
        L = max(seq_len or lo, lo)
        base = theta * ((spec.factor * L / lo) - (spec.factor - 1)) ** (d / (d - 2))
        return 1.0 / base ** expo
    if t == "longrope":
        long = seq_len is not None and seq_len > spec.original_max_position_embeddings
        ext = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float64)
        return 1.0 / (ext * theta ** expo)
    if t == "llama3":
        lo, f = spec.original_max_position_embeddings, spec.factor
        low_wl, high_wl = lo / spec.low_freq_factor, lo / spec.high_freq_factor
        wl = 2 * math.pi / base_inv
        out = torch.where(wl > low_wl, base_inv / f, base_inv)
        smooth = (lo / wl - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = (wl >= high_wl) & (wl <= low_wl)
        return torch.where(medium, smoothed, out)
    if t == "yarn":
        lo, f = spec.original_max_position_embeddings, spec.factor

        def corr_dim(rot):  # the dimension whose wavelength makes `rot` turns over lo tokens
            return (d * math.log(lo / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(spec.beta_fast), corr_dim(spec.beta_slow)
        if spec.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
        return base_inv / f * (1 - extrap) + base_inv * extrap
    raise _bad(f"rope_type={t!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")


def rope_cache(spec: RopeSpec, max_pos: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_pos, D/2] float32 (attention factor multiplied in): row ``p`` is
    what position ``p`` is rotated with (rotate-half form, the two halves share row ``p``).
    ``dynamic`` / ``longrope`` rows use the frequencies of a sequence of ``p + 1`` tokens (module
    docstring)."""
    t = torch.arange(max_pos, dtype=torch.float64)  # [P]
    if spec.rope_type == "default" and not spec.freq_factors and not spec.head_dim:  # bit-identical to old tables
        freqs = torch.outer(t, inv_freq(spec))
        return freqs.cos().float().to(device), freqs.sin().float().to(device)
    lo = spec.original_max_position_embeddings
    if spec.rope_type == "dynamic" and max_pos > lo:
        d, f = spec.dim, spec.factor
        L = (t + 1).clamp(min=lo)  # [P] the sequence length each position is rotated for
        base = spec.theta * ((f * L / lo) - (f - 1)) ** (d / (d - 2))  # [P] (== theta below lo)
        expo = torch.arange(0, d, 2, dtype=torch.float64) / d  # [D/2]
        freqs = t[:, None] / base[:, None] ** expo[None]  # [P, D/2]
        if spec.freq_factors:
            freqs = freqs / torch.tensor(spec.freq_factors, dtype=torch.float64)
    elif spec.rope_type == "longrope" and max_pos > lo:
        inv = torch.where((t >= lo)[:, None], inv_freq(spec, lo + 1)[None], inv_freq(spec)[None])  # [P, D/2]
        freqs = t[:, None] * inv
    else:
        freqs = torch.outer(t, inv_freq(spec))  # [P, D/2]
    a = attention_factor(spec)
    cos, sin = freqs.cos() * a, freqs.sin() * a
    if spec.head_dim > spec.dim:  # partial rotary: the pass-through pairs (rotary_row_order) turn by 0
        pad = spec.head_dim // 2 - spec.dim // 2
        cos = torch.cat((cos, cos.new_ones(max_pos, pad)), dim=1)
        sin = torch.cat((sin, sin.new_zeros(max_pos, pad)), dim=1)
    return cos.float().to(device), sin.float().to(device)


def rotary_row_order(n_rows: int, head_dim: int, rot_dim: int) -> torch.Tensor:
    """Partial rotary (``partial_rotary_factor`` < 1, e.g. Phi-4-mini; transformers rotates the first
    ``rot_dim`` dims of each head in rotate-half form and passes the rest through) as full-head
    rotate-half RoPE: the row order (``new = old[idx]``) of a Q or K projection of ``n_rows`` rows
    that moves, within each head, the rotary halves to ``[0, R/2)`` and ``[D/2, D/2 + R/2)`` and the
    pass-through dims into the remaining slots of each half, whose cos/sin table columns are 1/0
    (:func:`rope_cache`). Q.K is unchanged by the same order on both, so the attention kernels and
    the KV cache run partial rotary unchanged. Int64 [n_rows]."""
    d, r = head_dim, rot_dim
    pass_dims = list(range(r, d))
    half_pass = (d - r) // 2
    one = list(range(r // 2)) + pass_dims[:half_pass] + list(range(r // 2, r)) + pass_dims[half_pass:]
    within = torch.tensor(one, dtype=torch.int64)  # [D]
    heads = n_rows // d
    return (torch.arange(heads, dtype=torch.int64)[:, None] * d + within[None]).reshape(-1)
