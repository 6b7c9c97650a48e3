"""Building blocks every family's layer spec chooses from: the linear layers (local megatron or
Transformer Engine) and the norm.

The choice is made once when the spec is built; a missing TE falls back to the local path with a
log line, never silently.
"""
from __future__ import annotations

import logging

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

log = logging.getLogger(__name__)

BACKENDS = ("auto", "local", "te")
NORMS = ("layernorm", "rmsnorm")


def linears(backend: str):
    """``(column_parallel, row_parallel)`` linear classes for ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"model.backend={backend!r} is unknown; use one of {BACKENDS}")
    if backend == "auto":
        backend = "te" if torch.cuda.is_available() else "local"
    if backend == "te":
        try:
            # megatron's TE module imports without TE too (its classes are then mocks): ask TE itself.
            import transformer_engine  # noqa: F401
            from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear,
                                                                     TERowParallelLinear)
            return TEColumnParallelLinear, TERowParallelLinear
        except Exception as exc:  # ImportError, or TE present but broken for this device
            log.warning("Transformer Engine unavailable (%s); using local megatron linears", exc)
    return ColumnParallelLinear, RowParallelLinear


def norm_spec(kind: str, *, affine: bool) -> ModuleSpec:
    """A norm built as ``module(hidden_size, eps=...)``; ``affine=False`` for modulated norms."""
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is unknown; use one of {NORMS}")
    module = nn.LayerNorm if kind == "layernorm" else nn.RMSNorm
    return ModuleSpec(module=module, params={"elementwise_affine": affine})
