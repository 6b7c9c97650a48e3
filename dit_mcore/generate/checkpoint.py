"""A trained run's checkpoint as a model to sample from: build the model for the generation layout (the
checkpoint is found, its run read and its weights loaded by :mod:`dit_mcore.training.weights`, resharded by
megatron's dist_checkpointing: any training layout into any generation layout; nothing is gathered to one
file first).
"""
from __future__ import annotations

import torch

from dit_mcore.models.registry import get_family
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.pipeline import ModelChunks
from dit_mcore.training.config import ModelConfig


def build_model(model: ModelConfig, parallel: ParallelConfig, *, dtype: torch.dtype, device) -> tuple:
    """``(chunks, model_config)``: this rank's pipeline chunks of the run's model under ``parallel``
    (megatron's groups already initialised), on ``device`` in ``dtype``."""
    family = get_family(model.family)
    config = model.build(parallel, bf16=dtype == torch.bfloat16)
    chunks = ModelChunks.of_family(family, config, backend=model.backend, device=device, dtype=dtype, seed=0)
    return chunks.eval(), config
