"""GGUF helpers for tests: random valid blocks of every type sglite keeps quantized
(:func:`random_gguf_blocks`) and a tiny random Llama ``.gguf`` writer with per-tensor types
(:func:`make_tiny_gguf`; llama.cpp's Q4_K_M / Q5_K_M-like mixes in :data:`MIXES`), and writers of
HF checkpoints in llama.cpp's layout (:func:`write_llama_gguf`, :func:`write_family_gguf`,
:func:`write_qwen3_moe_gguf`)."""
from __future__ import annotations

# per-tensor type mixes in the spirit of llama.cpp's presets (its Q4_K_M keeps attn_v / ffn_down of
# some layers in Q6_K; older / smaller conversions fall back to Q5_0 / Q5_1 / Q8_0 for some tensors)
MIXES = {
    "Q4_K_M": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
    "Q5_K_M": {"attn_q": "Q5_K", "attn_k": "Q5_1", "attn_v": "Q6_K", "attn_output": "Q5_K",
               "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K"},
}


def random_gguf_blocks(type_name: str, n: int, k: int, seed: int = 0, scale: float = 1e-4):
    """Random valid GGUF blocks of ``type_name`` (any of
    :data:`sglite.runtime.gguf_blocks.NATIVE_TYPES`) for a weight [n, k]: uint8 [n, k / block
    weights * block bytes]. Every code / high-bit / packed 6-bit scale byte is uniform random; the
    float16 super-scales are ``scale * U(0.5, 1.5)`` times a per-type factor (``dmin`` of
    Q4_K / Q5_K, ``m`` of Q4_1 / Q5_1 sized so the weights are roughly zero-mean), so the
    dequantized weights are finite, of magnitude ~``scale * 1000`` (K-quants) or ~``scale * 100 *
    8..16`` (32-weight blocks) -- gguf-py cannot quantize to K-quants, so tests build them this way."""
    import numpy as np

    from .runtime.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

    rng = np.random.default_rng(seed)
    nb, qk = BLOCK_BYTES[type_name], BLOCK_WEIGHTS[type_name]
    b = rng.integers(0, 256, size=(n, k // qk, nb), dtype=np.uint8)

    def f16(at, factor=1.0):
        v = (scale * factor * rng.uniform(0.5, 1.5, size=(n, k // qk))).astype(np.float16)
        b[:, :, at:at + 2] = v.view(np.uint8).reshape(n, k // qk, 2)

    if type_name in ("Q4_K", "Q5_K"):
        f16(0, 1.0 if type_name == "Q4_K" else 0.5)
        f16(2, 7.5)  # dmin * m ~ d * sc * 7.5 (Q4_K) / 2 * 7.5 (Q5_K) on average: zero-mean weights
    elif type_name == "Q6_K":
        f16(208)
    else:  # 32-weight blocks: d ~ 1e-2 (5-bit codes: half that)
        f16(0, 50.0 if type_name.startswith("Q5") else 100.0)
        if type_name in ("Q4_1", "Q5_1"):
            f16(2, -800.0)  # m ~ -8 d (Q4_1) / -16 d (Q5_1)
    return b.reshape(n, -1)


def make_tiny_gguf(path, types: dict | None = None, *, seed: int = 0, hidden: int = 256,
                   intermediate: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    """Write a tiny random Llama GGUF file with the default model's tokenizer (its GGUF tokenizer
    fields copied) and return its path.

    Matmul tensors get random valid blocks (:func:`random_gguf_blocks`) of the type ``types``
    gives their GGUF name suffix (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``,
    ``ffn_up``, ``ffn_down``; default Q4_K, ``ffn_down`` Q6_K as in llama.cpp's Q4_K_M mixes;
    :data:`MIXES` has fuller ones); the token embedding (tied LM head) is Q8_0 (gguf-py's quantizer)
    of N(0, 0.1) weights, norms 1. K-quants need ``hidden`` and ``intermediate`` multiples of 256.
    """
    import gguf
    import numpy as np

    from .runtime.model_loader import default_model_path

    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_K",
             "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", **(types or {})}
    src = gguf.GGUFReader(str(default_model_path()))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    vocab = 0
    for key, f in src.fields.items():
        if key.startswith("tokenizer."):
            vt = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), vt, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(f.contents())
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    emb = (0.1 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    hd = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (intermediate, hidden),
              "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for j, (name, (n, k)) in enumerate(shapes.items()):
            t = types[name]
            w.add_tensor(f"blk.{i}.{name}.weight", random_gguf_blocks(t, n, k, seed=seed * 1000 + i * 10 + j),
                         raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(rope: dict, head_dim: int) -> list[float]:
    """The ``rope_freqs.weight`` values llama.cpp's converter writes for a ``llama3`` ``rope_parameters``
    dict (Llama 3.1 report's scaling; transformers' ``_compute_llama3_parameters``): per frequency
    ``i`` of a head of ``head_dim`` (wavelength ``w = 2 pi theta ** (2i / D)``), the divisor of its
    frequency: 1 for ``w < Lo / high_freq_factor``, ``factor`` for ``w > Lo / low_freq_factor``, and
    between them ``1 / ((1 - s) / factor + s)`` with ``s = (Lo / w - low) / (high - low)``."""
    import math

    theta, f = float(rope["rope_theta"]), float(rope["factor"])
    lo = float(rope["original_max_position_embeddings"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    out = []
    for i in range(head_dim // 2):
        wl = 2 * math.pi * theta ** (2 * i / head_dim)
        if wl < lo / high:
            out.append(1.0)
        elif wl > lo / low:
            out.append(f)
        else:
            s = (lo / wl - low) / (high - low)
            out.append(1.0 / ((1 - s) / f + s))
    return out


def _matrix_writer(w, tensor_type: str):
    """``mat(name, arr)``: add float32 ``arr`` to writer ``w`` as ``tensor_type`` (``F32`` as is, else
    quantized by gguf-py, e.g. ``Q8_0``)."""
    import gguf
    import numpy as np

    qt = gguf.GGMLQuantizationType[tensor_type]

    def mat(name, arr):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if tensor_type == "F32":
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    return mat


def _interleave(arr, heads: int):
    """HF rotate-half rows -> GGML's interleaved pairs, per head (llama.cpp's Llama converter)."""
    return arr.reshape(heads, 2, arr.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(arr.shape)


def _write_layers_and_close(w, cfg, sd, mat, norms: dict, permute: bool) -> None:
    """Each layer's ``norms`` (``{HF module: GGUF name}``, F32), attention (Q / K rows interleaved when
    ``permute``) and SwiGLU matrices through ``mat``, then the file written and ``w`` closed."""
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in norms.items():
            w.add_tensor(b + gg + ".weight", sd[p + hf + ".weight"])
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        mat(b + "attn_q.weight", _interleave(q, cfg.num_attention_heads) if permute else q)
        mat(b + "attn_k.weight", _interleave(k, cfg.num_key_value_heads) if permute else k)
        mat(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        mat(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            mat(b + gg + ".weight", sd[p + f"mlp.{hf}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_PRE_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(path, hf_dir, *, rope_freqs="auto", tensor_type: str = "F32", metadata: dict | None = None):
    """Write the HF Llama checkpoint ``hf_dir`` (e.g. :func:`sglite.testing.make_tiny_llama`) as the
    GGUF file ``path`` the way llama.cpp's converter lays it out: ``llama`` architecture, Q / K rows
    of each head reordered to GGML's interleaved RoPE layout, ``output.weight`` only when the
    embeddings are untied, the default model's GGUF tokenizer fields, and ``rope_freqs.weight``:
    ``"auto"`` = :func:`llama3_rope_freqs` of a ``llama3`` config (none otherwise), a list = those
    values as is (e.g. inconsistent with the config), None = no tensor. Matmul weights in
    ``tensor_type`` (``F32`` or a type gguf-py quantizes, e.g. ``Q8_0``); ``metadata``: extra
    ``{key: value}`` pairs (ints, floats, strings). Returns ``path``."""
    import gguf
    import numpy as np

    cfg, sd, w = open_gguf_writer(path, hf_dir, "llama")
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    w.add_rope_dimension_count(hd)
    for key, value in (metadata or {}).items():
        vt = {str: gguf.GGUFValueType.STRING, int: gguf.GGUFValueType.UINT32}.get(type(value),
                                                                                 gguf.GGUFValueType.FLOAT32)
        w.add_key_value(key, value, vt)
    copy_default_tokenizer(w)
    w.add_vocab_size(cfg.vocab_size)
    mat = _matrix_writer(w, tensor_type)
    if rope_freqs == "auto":
        rope_freqs = llama3_rope_freqs(rope, hd) if rope.get("rope_type") == "llama3" else None
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        mat("output.weight", sd["lm_head.weight"])
    _write_layers_and_close(w, cfg, sd, mat, _PRE_NORMS, permute=True)
    return path


def write_family_gguf(path, hf_dir, arch: str, *, tensor_type: str = "F32", tokenizer: bool = True):
    """Write the HF Granite, SmolLM3 or OLMo 2 checkpoint ``hf_dir`` (:func:`sglite.testing.make_tiny_family`)
    as the GGUF file ``path`` in the layout of llama.cpp's converter (``convert_hf_to_gguf.py``;
    checked field for field and tensor for tensor against its output for each, float32 and Q8_0):
    ``arch`` ``"granite"`` (Llama's tensors and Q / K row reorder, the four multipliers as
    ``attention.scale`` / ``embedding_scale`` / ``residual_scale`` / ``logit_scale``), ``"smollm3"``
    (Llama's layout; its NoPE layers are llama.cpp's fixed every-4th, not in the file) or ``"olmo2"``
    (QK-norms over all heads, post-norms, rows as HF's, ``attention.key_length`` /
    ``value_length``). Matmul weights and the token embedding in ``tensor_type`` (``F32`` or a type
    gguf-py quantizes, e.g. ``Q8_0``), norms F32; the default model's tokenizer fields unless
    ``tokenizer`` is False (reading them back is most of a small file's load time). Returns ``path``."""
    cfg, sd, w = open_gguf_writer(path, hf_dir, arch)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    from .runtime.gguf_native import PERMUTED_ARCHS

    llama_like = arch in PERMUTED_ARCHS  # llama.cpp's Llama converter
    if llama_like:
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(hd)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch != "granite":  # (llama.cpp's Granite converter drops head_dim)
        w.add_key_length(hd)
        w.add_value_length(hd)
    if tokenizer:
        copy_default_tokenizer(w)
    mat = _matrix_writer(w, tensor_type)
    mat("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        mat("output.weight", sd["lm_head.weight"])
    norms = _PRE_NORMS if llama_like else {
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    _write_layers_and_close(w, cfg, sd, mat, norms, permute=llama_like)
    return path


def open_gguf_writer(path, hf_dir, arch: str):
    """Read the HF checkpoint ``hf_dir`` (``config.json`` + ``model.safetensors``) and open a
    ``gguf.GGUFWriter`` on ``path`` for architecture ``arch`` with the fields every converted
    decoder has (block count, context, embedding and feed-forward lengths, head counts, RoPE base,
    RMSNorm eps). Returns ``(cfg, sd, w)``: the transformers config, the state dict as float32
    numpy arrays by HF name, and the writer (the caller adds its own fields and tensors)."""
    from pathlib import Path

    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return cfg, sd, w


def copy_default_tokenizer(w) -> None:
    """Copy the default model's ``tokenizer.*`` GGUF fields into the open ``GGUFWriter`` ``w``."""
    import gguf

    from .runtime.model_loader import default_model_path

    for key, f in gguf.GGUFReader(str(default_model_path())).fields.items():
        if key.startswith("tokenizer."):
            vt = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), vt, sub_type=sub)


def write_qwen3_moe_gguf(path, hf_dir, *, expert_type: str = "F32", tokenizer: bool = True):
    """Write the HF Qwen3-MoE checkpoint ``hf_dir`` (every layer sparse: ``mlp_only_layers`` empty,
    ``decoder_sparse_step`` 1, as llama.cpp's ``qwen3moe`` graph runs) as the GGUF file ``path``
    in llama.cpp's layout: ``qwen3moe`` architecture with ``expert_feed_forward_length``,
    ``attention.key_length``, per-head ``attn_q_norm`` / ``attn_k_norm``, the router
    ``ffn_gate_inp`` and the experts stacked ``ffn_{gate,up,down}_exps`` [E, N, K] in
    ``expert_type`` (F32 or a type gguf-py quantizes); other tensors F32, the default model's GGUF
    tokenizer (``tokenizer=False``: none, for tests that only read the header or tensors; parsing
    that vocabulary takes ~20 s). Returns ``path``."""
    import gguf
    import numpy as np
    from transformers import AutoConfig

    if (c := AutoConfig.from_pretrained(str(hf_dir))).mlp_only_layers or c.decoder_sparse_step != 1:
        raise ValueError("write_qwen3_moe_gguf: qwen3moe GGUF layers are all sparse (mlp_only_layers=[], "
                         "decoder_sparse_step=1)")
    cfg, sd, w = open_gguf_writer(path, hf_dir, "qwen3moe")
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if tokenizer:
        copy_default_tokenizer(w)
    w.add_vocab_size(cfg.vocab_size)
    qt = gguf.GGMLQuantizationType[expert_type]
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for n in "qk":
            w.add_tensor(b + f"attn_{n}_norm.weight", sd[p + f"self_attn.{n}_norm.weight"])
        for n, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            w.add_tensor(b + g + ".weight", sd[p + f"self_attn.{n}_proj.weight"])
        m = p + "mlp."
        w.add_tensor(b + "ffn_gate_inp.weight", sd[m + "gate.weight"])
        for hf, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            arr = np.ascontiguousarray(np.stack([_expert(sd, m, e, hf, cfg) for e in range(cfg.num_experts)]))
            if expert_type == "F32":
                w.add_tensor(b + f"ffn_{gg}_exps.weight", arr)
            else:
                w.add_tensor(b + f"ffn_{gg}_exps.weight", gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _expert(sd: dict, m: str, e: int, proj: str, cfg):
    """Expert ``e``'s ``proj`` weight [N, K] from per-expert tensors or transformers' stacked ones
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    name = m + f"experts.{e}.{proj}.weight"
    if name in sd:
        return sd[name]
    if proj == "down_proj":
        return sd[m + "experts.down_proj"][e]
    gate_up, inter = sd[m + "experts.gate_up_proj"][e], cfg.moe_intermediate_size
    return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]
