"""``sglite quantize``: write an HF-format quantized checkpoint from a float model and calibration text.

The algorithms are :mod:`sglite.quant`'s, on what this entry point hands them: the float model
(transformers, float32) and the calibration text (``--calib-file``, default the end of CPython's
``pydoc_data`` topics text, :func:`sglite.eval.perplexity.topics_text`).

Methods: ``rtn`` (round to nearest; written in GPTQ format, no act-order), ``gptq``
(:mod:`sglite.quant.gptq`), ``awq`` (:mod:`sglite.quant.awq`; AutoAWQ GEMM format, 4-bit);
``--format fp8`` with rtn / gptq: FP8 E4M3 weights (:mod:`sglite.quant.fp8`; ``quant_method: fp8``, ``weight`` float8_e4m3fn [N, K] and ``weight_scale``
float32 [N, 1] per output channel, or with ``--weight-block-size bn,bk`` ``weight_scale_inv``
[ceil(N/bn), ceil(K/bk)] and ``weight_block_size`` in the config, DeepSeek-V3 / SGLang's
block-wise layout); ``smoothquant`` (W8A8: :mod:`sglite.quant.calibrate`'s
SmoothQuant smoothing + per-channel int8 weights; SGLang's ``w8a8_int8`` format: ``weight`` int8
[N, K] and ``weight_scale`` float32 [N, 1]; activations are quantized per token at run time).

Output folder: ``config.json`` (the source config plus ``quantization_config`` as AutoGPTQ /
AutoAWQ write it, ``torch_dtype`` float16), ``model.safetensors`` (quantized linears as
``<prefix>.qweight/.qzeros/.scales[/.g_idx]``; embeddings, norms and the LM head in float16, the
LM head left out when tied), the tokenizer files of the source. Every flag is checked (and the
group size against every layer's input width) before the model is loaded or calibrated.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch

from .quant.calibrate import METHODS, QuantOptions, calibration_ids, quantize_model
from .quant.hf_formats import GroupQuant, pack_awq, pack_gptq, quantization_config

log = logging.getLogger("sglite.quant")

_SKIP = ("config.json", "model.safetensors.index.json", "generation_config.json")


def check_options(opts: QuantOptions, hf_config) -> None:
    """Validate ``opts`` against the model's config before any work.

    Raises:
        ValueError: naming the option: method, bits (gptq/rtn 4|8, awq 4, smoothquant 8),
            group size (32|64|128|-1, and it must divide every linear's input width: hidden_size,
            intermediate_size, heads x head_dim)."""
    if opts.method not in METHODS:
        raise ValueError(f"--method: must be one of {'|'.join(METHODS)}, got {opts.method!r}")
    if opts.weight_format not in ("int", "fp8"):
        raise ValueError(f"--format: must be int or fp8, got {opts.weight_format!r}")
    if opts.weight_block_size is not None and opts.weight_format != "fp8":
        raise ValueError("--weight-block-size: only with --format fp8")
    if opts.weight_format == "fp8":
        if opts.method not in ("rtn", "gptq"):
            raise ValueError(f"--format fp8: methods rtn|gptq, got --method {opts.method}")
        blk = opts.weight_block_size
        if blk is not None and (len(blk) != 2 or min(blk) < 1):
            raise ValueError(f"--weight-block-size: two positive sizes (bn,bk), got {blk}")
        if blk is not None and opts.desc_act:
            raise ValueError("--desc-act: act-order needs per-channel scales, not --weight-block-size")
        return
    allowed = {"awq": (4,), "smoothquant": (8,)}.get(opts.method, (4, 8))
    if opts.bits not in allowed:
        raise ValueError(f"--bits: {opts.method} supports {allowed}, got {opts.bits}")
    if opts.method == "smoothquant":
        if not 0.0 <= opts.smooth_alpha <= 1.0:
            raise ValueError(f"--smooth-alpha: must be in [0, 1], got {opts.smooth_alpha}")
        return
    if opts.group_size not in (32, 64, 128, -1):
        raise ValueError(f"--group-size: must be 32, 64, 128 or -1, got {opts.group_size}")
    if opts.method == "awq" and opts.desc_act:
        raise ValueError("--desc-act: act-order is GPTQ's (AWQ checkpoints have no g_idx)")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    widths = {"hidden_size (q/k/v/gate/up_proj)": hf_config.hidden_size,
              "intermediate_size (down_proj)": hf_config.intermediate_size,
              "num_attention_heads x head_dim (o_proj)": heads * head_dim}
    for what, k in widths.items():
        if opts.group_size != -1 and k % opts.group_size:
            raise ValueError(f"--group-size: {opts.group_size} does not divide {what} = {k}; "
                             f"use a group size that divides it (e.g. 32 or 64) or -1")


def write_checkpoint(out_dir, model, quantized: dict, opts: QuantOptions, src_dir) -> Path:
    """Write the quantized checkpoint (module docstring) into ``out_dir``; returns its path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        if prefix in quantized and name.endswith(".weight"):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensors[name] = t.detach().to(torch.float16).contiguous() if t.is_floating_point() else t.contiguous()
    for prefix, q in quantized.items():
        if opts.format == "fp8":
            w8, s = q
            scale_name = ".weight_scale" if opts.weight_block_size is None else ".weight_scale_inv"
            tensors[prefix + ".weight"] = w8.contiguous()
            tensors[prefix + scale_name] = (s.view(-1, 1) if opts.weight_block_size is None else s).float().contiguous()
            continue
        if opts.format == "w8a8_int8":
            wq, s = q
            tensors[prefix + ".weight"] = wq.contiguous()
            tensors[prefix + ".weight_scale"] = s.float().view(-1, 1).contiguous()
            continue
        assert isinstance(q, GroupQuant)
        packed = pack_awq(q) if opts.format == "awq" else pack_gptq(q)
        for k, v in packed.items():
            tensors[f"{prefix}.{k}"] = v
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = "float16"
    cfg.pop("dtype", None)
    if opts.format == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "sglite_method": opts.method}
        if opts.weight_block_size is not None:
            cfg["quantization_config"]["weight_block_size"] = list(opts.weight_block_size)
        else:
            cfg["quantization_config"]["weight_scheme"] = "per_channel"
    elif opts.format == "w8a8_int8":
        cfg["quantization_config"] = {"quant_method": "w8a8_int8", "bits": 8,
                                      "activation_scheme": "dynamic_per_token",
                                      "weight_scheme": "per_channel_symmetric",
                                      "smoothquant_alpha": opts.smooth_alpha}
    else:
        cfg["quantization_config"] = quantization_config(opts.format, opts.bits, opts.group_size,
                                                         opts.desc_act, opts.sym, opts.damp_percent)
        cfg["quantization_config"]["sglite_method"] = opts.method
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in Path(src_dir).iterdir():
        if f.is_file() and f.name not in _SKIP and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    return out


def quantize(model_path, out_dir, opts: QuantOptions, n_samples: int = 32, seq_len: int = 256,
             calib_text: str | None = None) -> Path:
    """Load the float model, calibrate and quantize it (:func:`sglite.quant.calibrate.quantize_model`),
    write the checkpoint. ``model_path`` None = the default model (its float32 conversion);
    ``calib_text`` None = the topics text (module docstring).

    Raises:
        ValueError: bad options (see :func:`check_options`) or too short a calibration text."""
    from transformers import AutoModelForCausalLM

    from .runtime.model_loader import load_checkpoint
    from .runtime.tokenizer import Tokenizer

    ckpt = load_checkpoint(model_path)
    check_options(opts, ckpt.hf_config)
    tok = Tokenizer.from_dir(ckpt.model_dir, ckpt.hf_config)
    if calib_text is None:
        from .eval.perplexity import topics_text

        calib_text = topics_text()
    ids = calibration_ids(tok, n_samples, seq_len, calib_text)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt.model_dir), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    quantized = quantize_model(model, ids, opts)
    log.info("%s: %d linears quantized in %.1f s", opts.method, len(quantized), time.perf_counter() - t0)
    return write_checkpoint(out_dir, model, quantized, opts, ckpt.model_dir)


def build_parser():
    from .flags import FlagParser

    p = FlagParser(prog="sglite quantize",
                   description="Write an HF-format quantized checkpoint (GPTQ / AWQ / RTN in AutoGPTQ / "
                   "AutoAWQ layouts, SmoothQuant W8A8) from a float model and a calibration text; every "
                   "flag is checked before the model loads.")
    p.add_argument("--model-path", default=None, help="float HF folder or .gguf file (default: the default model)")
    p.add_argument("--output", required=True, help="folder to write the checkpoint into")
    p.add_argument("--method", default="gptq", help=f"{'|'.join(METHODS)} (default: gptq)")
    p.add_argument("--bits", type=int, default=None, help="4 or 8 (default: 4; smoothquant: 8)")
    p.add_argument("--group-size", type=int, default=64, help="32|64|128|-1 (default: 64)")
    p.add_argument("--sym", action="store_true", help="symmetric grid (default: asymmetric)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order (default: off)")
    p.add_argument("--damp-percent", type=float, default=0.01, help="GPTQ dampening (default: 0.01)")
    p.add_argument("--smooth-alpha", type=float, default=0.5, help="SmoothQuant migration strength (default: 0.5)")
    p.add_argument("--format", default="int", dest="weight_format",
                   help="int (GPTQ/AWQ/W8A8 integer formats) | fp8 (E4M3 weights; methods rtn|gptq) (default: int)")
    p.add_argument("--weight-block-size", default=None,
                   help="fp8 only: bn,bk tile scales, e.g. 128,128 (default: one scale per output channel)")
    p.add_argument("--calib-file", default=None,
                   help="UTF-8 calibration text (default: the end of CPython's pydoc_data topics text)")
    p.add_argument("--n-samples", type=int, default=32, help="calibration sequences (default: 32)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (default: 256)")
    return p


def main(argv=None) -> int:
    from .logging_setup import configure
    from .runtime.model_loader import load_checkpoint

    p = build_parser()
    a = p.parse_args(argv)
    bits = a.bits if a.bits is not None else (8 if a.method == "smoothquant" or a.weight_format == "fp8" else 4)
    try:
        blk = None if a.weight_block_size is None else tuple(int(v) for v in a.weight_block_size.split(","))
    except ValueError:
        p.error(f"--weight-block-size: two integers bn,bk, got {a.weight_block_size!r}")
    opts = QuantOptions(method=a.method, bits=bits, group_size=a.group_size, sym=a.sym, desc_act=a.desc_act,
                        damp_percent=a.damp_percent, smooth_alpha=a.smooth_alpha,
                        weight_format=a.weight_format, weight_block_size=blk)
    try:
        if a.n_samples < 1 or a.seq_len < 2:
            raise ValueError(f"--n-samples / --seq-len: must be >= 1 / >= 2, got {a.n_samples} / {a.seq_len}")
        check_options(opts, load_checkpoint(a.model_path).hf_config)
        text = Path(a.calib_file).read_text(encoding="utf-8") if a.calib_file else None
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    configure("info")
    out = quantize(a.model_path, a.output, opts, a.n_samples, a.seq_len, text)
    print(f"wrote {out}")
    return 0
