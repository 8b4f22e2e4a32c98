"""sglite.kernels: public ops (linear, paged attention, KV store, RMSNorm, SwiGLU activation, token
bitmask, sampling, mixture-of-experts routing and experts) behind one dispatcher (:mod:`.dispatch`)."""
from .dispatch import (apply_token_bitmask, decode_attention, extend_attention, gelu_tanh_mul, greedy,  # noqa: F401
                       linear, lora_add, prepare_cpu, resolve_impl, rms_norm, sample, silu_mul, store_kv,
                       add_rms_norm, rope_store_kv, moe_experts, moe_topk)
from . import decode_fused  # noqa: F401  (fused CPU decode of quantized models)
from . import decode_family  # noqa: F401  (its layer for the Llama-like families)
from .matmul import LinearWeight, choose_impl, linear_silu, make_linear  # noqa: F401
from .quant_linear import QuantLinearWeight  # noqa: F401
from .w8_linear import Fp8LinearWeight, Int8LinearWeight  # noqa: F401
from .reference import bitmask_to_bool  # noqa: F401
from .w8_linear import Fp8BlockLinearWeight  # noqa: F401  (block-wise fp8 checkpoints)
from .device import serial_torch  # noqa: F401  (torch glue on the calling thread only)
