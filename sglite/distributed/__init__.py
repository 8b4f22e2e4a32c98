"""Beyond one process: tensor parallelism (``tp_size``), the data-parallel router, prefill/decode
disaggregation. Submodules import torch lazily; import them directly."""
