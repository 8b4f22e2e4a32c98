"""Tensor parallelism (``tp_size > 1``): the scheduler's runner client, the worker processes, their
parallel state, the control channel and its commands. Submodules import torch.distributed lazily;
import them directly."""
