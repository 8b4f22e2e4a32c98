"""Which model class runs a HF config: the Llama family (:mod:`.llama`: Llama, Mistral, Qwen2,
Qwen3), a family on the shared :class:`~.family.FamilyModel` layer (OLMo 2, Granite, Gemma 2,
Gemma 3, SmolLM3) or a mixture of experts on :class:`~.moe.MoeModel` (Mixtral, Qwen2-MoE, Qwen3-MoE). The model runner asks here; unsupported values raise InvalidRequestError before any
weight is read.
"""
from __future__ import annotations

from sglite.errors import InvalidRequestError

from . import gemma, granite, mixtral, olmo2, qwen2_moe, qwen3_moe, smollm3
from .llama import SUPPORTED_ARCHS, LlamaArch, LlamaModel
from .moe import MoeModel

_FAMILIES = {name: mod for mod in (olmo2, granite, gemma, smollm3, mixtral, qwen2_moe, qwen3_moe) for name in mod.ARCHS}
#: every architecture name a model class here runs
ARCHITECTURES = tuple(SUPPORTED_ARCHS) + tuple(_FAMILIES)


def _name(cfg) -> str:
    return (list(getattr(cfg, "architectures", None) or []) or ["LlamaForCausalLM"])[0]


def architecture(cfg) -> str:
    """The HF architecture name ``cfg`` is run as (its first ``architectures`` entry; Llama without one)."""
    return _name(cfg)


def arch_from_hf_config(cfg) -> LlamaArch:
    """The model shape of ``cfg``: a :class:`~.family.FamilyArch` for the families of this module,
    else :meth:`LlamaArch.from_hf_config` (which refuses what it does not know)."""
    mod = _FAMILIES.get(_name(cfg))
    return mod.arch_from_hf_config(cfg) if mod is not None else LlamaArch.from_hf_config(cfg)


def model_class(arch: LlamaArch) -> type:
    """The class whose ``(arch, state_dict, dtype, device, batch_invariant=)`` builds the model."""
    return {"olmo2": olmo2.Olmo2Model, "granite": granite.GraniteModel, "smollm3": smollm3.SmolLM3Model,
            "gemma2": gemma.GemmaModel,
            "gemma3": gemma.GemmaModel, "mixtral": MoeModel, "qwen2_moe": MoeModel,
            "qwen3_moe": MoeModel}.get(getattr(arch, "family", "llama"), LlamaModel)


#: families whose layer shards over tensor-parallel ranks (attention heads, MLP / expert widths)
TP_ARCHS = granite.ARCHS + gemma.ARCHS + smollm3.ARCHS + mixtral.ARCHS + qwen2_moe.ARCHS + qwen3_moe.ARCHS
QUANT_KV = ("fp8_e4m3", "int8", "int4")  # quantized pools: no sliding window / soft-capping in their attention


def check_engine_config(engine_cfg, hf_config) -> None:
    """Refuse, before weights load, what the families of this module do not run: tensor
    parallelism for the families outside :data:`TP_ARCHS` (OLMo 2: its QK-norm normalises q and
    k across all heads, so a rank holding some heads cannot compute it) and, for sliding windows
    or soft-capping (Gemma 2/3), a quantized KV cache. Raises InvalidRequestError naming
    ``tp_size`` / ``kv_cache_dtype``."""
    name = _name(hf_config)
    if name not in _FAMILIES:
        return
    tp = getattr(engine_cfg, "tp_size", 1) or 1
    if tp > 1 and name not in TP_ARCHS:
        raise InvalidRequestError(f"tp_size={tp}: {name} runs on one device only (tp_size=1): its QK-norm "
                                  "normalises q and k across all attention heads, which no rank holds; tensor "
                                  f"parallelism supports {list(SUPPORTED_ARCHS) + list(TP_ARCHS)}", field="tp_size")
    arch = arch_from_hf_config(hf_config)
    kvd = getattr(engine_cfg, "kv_cache_dtype", "auto")
    if kvd in QUANT_KV and (any(getattr(arch, "local_layers", ())) or getattr(arch, "attn_softcap", 0) > 0):
        raise InvalidRequestError(f"kv_cache_dtype={kvd!r}: {name}'s sliding-window / soft-capped attention "
                                  "runs on a float KV cache only; supported: ['auto', 'bfloat16']",
                                  field="kv_cache_dtype")
