"""sglite.lora: many LoRA adapters over one base model (SGLang's ``--lora-paths``; S-LoRA,
Sheng et al. 2023; Punica, Chen et al. 2023): PEFT adapters loaded and checked (:mod:`.adapter`),
held in device slots and applied per row segment in one batch (:mod:`.pool`, through
:func:`sglite.kernels.lora_add`), served by name (:mod:`.manager`)."""
from .adapter import LoraAdapter, load_adapter  # noqa: F401
from .manager import LoraManager, LoraMirror, initial_max_rank, parse_lora_paths, resolve_lora_dtype  # noqa: F401
from .pool import LoraBatch, LoraPool  # noqa: F401
