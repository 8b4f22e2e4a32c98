"""Tensor parallelism (``tp_size > 1``): the scheduler's runner client, the worker processes, the
shard layout and collectives, and the control channel between them. Submodules import torch
lazily; import them directly."""
