"""ModuleSpecs for DiT layers: the local (pure torch) path and, where installed, Transformer Engine.

The choice is made once when the spec is built; a missing TE falls back to the local path with a
log line, never silently.
"""
from __future__ import annotations

import logging

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from dit_mcore.models.core_attention import KernelsCoreAttention
from dit_mcore.models.dit_layer import DiTLayer, DiTLayerSubmodules

log = logging.getLogger(__name__)


def _linears(backend: str):
    if backend == "auto":
        import torch
        backend = "te" if torch.cuda.is_available() else "local"
    if backend == "te":
        try:
            from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear,
                                                                     TERowParallelLinear)
            return TEColumnParallelLinear, TERowParallelLinear
        except Exception as exc:  # ImportError, or TE present but broken for this device
            log.warning("Transformer Engine unavailable (%s); using local megatron linears", exc)
    elif backend != "local":
        raise ValueError(f"unknown layer backend {backend!r}; use 'local', 'te' or 'auto'")
    return ColumnParallelLinear, RowParallelLinear


def dit_layer_spec(backend: str = "local") -> ModuleSpec:
    """Spec of one adaLN-Zero DiT layer. ``backend``: ``"local"`` or ``"te"`` (falls back to local)."""
    column, row = _linears(backend)
    log.info("DiT layer spec: %s linears, kernels core attention", column.__name__)
    return ModuleSpec(
        module=DiTLayer,
        submodules=DiTLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(linear_qkv=column, core_attention=KernelsCoreAttention,
                                                   linear_proj=row)),
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
        ),
    )
