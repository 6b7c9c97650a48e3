"""Building blocks every family's layer spec chooses from: the linear layers (local megatron or
Transformer Engine) and the norm.

The choice is made once when the spec is built. ``auto`` is the local path, the one measured and
compiled to one graph per layer; Transformer Engine's linears are taken only when asked for
(``model.backend=te``), and validation refuses that where TE is not installed.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from dit_mcore.models.aten_linear import AtenColumnParallelLinear, AtenRowParallelLinear

log = logging.getLogger(__name__)

BACKENDS = ("auto", "local", "te")
NORMS = ("layernorm", "rmsnorm")


def linears(backend: str, float8_recipe: Optional[str] = None, *, te_required: bool = False):
    """``(column_parallel, row_parallel)`` linear classes for ``backend``: Transformer Engine's ("te"), or
    ("local", "auto") megatron's local ones with the matmul as one aten linear where no TP communication
    runs inside it (:mod:`dit_mcore.models.aten_linear`; ``model.aten_linears``); with ``float8_recipe`` the local
    megatron linears with a float8 matmul (torchao, :mod:`dit_mcore.models.float8`).
    ``te_required`` (TE's FP8, :mod:`dit_mcore.models.te_fp8`): TE's or an error, never the local
    fallback."""
    if backend not in BACKENDS:
        raise ValueError(f"model.backend={backend!r} is unknown; use one of {BACKENDS}")
    if float8_recipe is not None:
        if backend == "te":
            raise ValueError("model.fp8 with model.backend=te is Transformer Engine's FP8 (megatron's fp8 / "
                             "fp8_recipe fields), not torchao's float8_recipe")
        from dit_mcore.models.float8 import float8_linears
        return float8_linears(float8_recipe)
    if te_required and backend != "te":
        raise ValueError(f"Transformer Engine's FP8 (config.fp8) runs in TE's linears: use backend='te', not {backend!r}")
    if backend == "te":
        try:
            return te_linears()
        except Exception as exc:  # ImportError, or TE present but broken for this device
            if te_required:
                raise ValueError(f"Transformer Engine's FP8 (config.fp8) needs TE's linears, which do not load here "
                                 f"({exc}); install Transformer Engine or turn FP8 off") from exc
            log.warning("Transformer Engine unavailable (%s); using local megatron linears", exc)
    return AtenColumnParallelLinear, AtenRowParallelLinear


def te_installed() -> bool:
    """Whether Transformer Engine is importable here (without importing it)."""
    if "transformer_engine" in sys.modules:
        return sys.modules["transformer_engine"] is not None
    return importlib.util.find_spec("transformer_engine") is not None


def fallbacks_line() -> Optional[str]:
    """One line naming what stands in for the optional GPU packages that are missing (megatron warns
    about each at import, five times; ``dit_mcore/__init__.py`` keeps those quiet), or None."""
    missing = []
    if not te_installed():
        missing.append("Transformer Engine (megatron's local linears stand in)")
    if importlib.util.find_spec("apex") is None:
        missing.append("apex (torch's norms, optimizers and multi-tensor kernels stand in)")
    return "not installed: " + "; ".join(missing) if missing else None


def te_linears():
    """Transformer Engine's ``(column_parallel, row_parallel)`` linears through megatron's wrappers;
    ImportError without TE."""
    # megatron's TE module imports without TE too (its classes are then mocks): ask TE itself.
    import transformer_engine  # noqa: F401
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
    return TEColumnParallelLinear, TERowParallelLinear


def norm_spec(kind: str, *, affine: bool) -> ModuleSpec:
    """A norm built as ``module(hidden_size, eps=...)``; ``affine=False`` for modulated norms."""
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is unknown; use one of {NORMS}")
    module = nn.LayerNorm if kind == "layernorm" else nn.RMSNorm
    return ModuleSpec(module=module, params={"elementwise_affine": affine})
