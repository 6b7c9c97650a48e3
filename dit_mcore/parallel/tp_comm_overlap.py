"""Tensor-parallel communication overlap (``parallel.tp_comm_overlap``): Transformer Engine's
userbuffers split the sequence-parallel all-gather before each column-parallel GEMM and the
reduce-scatter after each row-parallel GEMM into chunks that overlap the GEMM itself.

megatron passes the flag to TE's linears (its ``qkv``, ``proj``, ``fc1`` and ``fc2`` buffers);
what a training script adds is one set of userbuffers per process, sized for one micro-batch's
tokens on this context-parallel rank (``[tokens // cp, hidden]``), made before the first forward.
The buffers fix that size, so the flag needs fixed-length (dense) micro-batches; the EMA shadow,
which draws previews at other batch sizes, is built without it.
"""
from __future__ import annotations

from typing import Optional

import torch

from dit_mcore.errors import ConfigError

_initialized: Optional[tuple] = None  # (shape, tp_size, dtype) of the userbuffers this process holds


def userbuffer_shape(data, model_config, dp_size: int) -> list[int]:
    """``[tokens of one micro-batch on this context-parallel rank, hidden size]`` for dense images
    (and videos: every frame's tokens)."""
    tokens = data.micro_batch(dp_size) * data.dense_tokens_per_sample(model_config.patch_size, model_config.patch_size_t)
    return [tokens // model_config.context_parallel_size, model_config.hidden_size]


def initialize_userbuffers(shape: list[int], tp_size: int, dtype: torch.dtype) -> None:
    """Make TE's userbuffers for ``shape`` (kept until another shape replaces them or the model-parallel
    groups they were bootstrapped over are released: ``initialize.release_model_parallel_groups``)."""
    global _initialized
    key = (tuple(shape), tp_size, dtype)
    if _initialized == key:
        return
    try:
        from transformer_engine.pytorch.module import base as te_base
    except ImportError as exc:  # validate_run refuses this before compute; kept for direct callers
        raise ConfigError("parallel.tp_comm_overlap=True needs Transformer Engine (its userbuffers); "
                          f"it does not import here ({exc}); set it to False") from exc
    if _initialized is not None:
        te_base.destroy_ub()
    te_base.initialize_ub(shape=list(shape), tp_size=tp_size, use_fp8=False, dtype=dtype, bootstrap_backend="nccl")
    _initialized = key


def release_userbuffers() -> None:
    """Free the userbuffers (no-op when none were made)."""
    global _initialized
    if _initialized is None:
        return
    from transformer_engine.pytorch.module import base as te_base
    te_base.destroy_ub()
    _initialized = None


def check_run(model, bf16: bool) -> None:
    """What ``tp_comm_overlap`` needs beyond the layout (``model``: the run's ``model`` section)."""
    from dit_mcore.models.specs import te_installed
    if model.backend != "te" or model.fp8 is not None:
        raise ConfigError("parallel.tp_comm_overlap=True runs in Transformer Engine's linears: set model.backend=te "
                          "and leave model.fp8 unset, or set tp_comm_overlap=False")
    if not bf16:
        raise ConfigError("parallel.tp_comm_overlap=True uses TE's bf16 userbuffers: set trainer.bf16=True")
    if not torch.cuda.is_available() or not te_installed():
        raise ConfigError("parallel.tp_comm_overlap=True needs Transformer Engine on a GPU (its userbuffers); "
                          "this machine has " + ("no GPU" if not torch.cuda.is_available() else "no transformer_engine")
                          + ": set it to False")
