"""Operators a GPU runs as one kernel where the CPU, on which the planner traces, runs a chain of them.

torch's RMSNorm (``F.rms_norm``, every RMSNorm of the models: the Llama DiT's, Cosmos's and the per-head QK
norms) is one CUDA kernel forward and one backward (``aten._fused_rms_norm``, torch >= 2.8), saving the input
and the fp32 reciprocal RMS. On the CPU it decomposes into casts, powers, means and products: about five
times the memory traffic, and fp32 copies of the input saved for the backward. A trace for a GPU
(:func:`gpu_kernels`) runs the kernel's twin instead, an operator with the same inputs, outputs and saved
tensors (:func:`rms_norm`), so what the dispatcher sees is what the GPU reads, writes and keeps. LayerNorm
needs nothing: it is one operator on both (``native_layer_norm``)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

_LIB = "dit_mcore_plan"


def _reduced(x: torch.Tensor, dims: int) -> tuple:
    return (*x.shape[:x.dim() - dims], *(1,) * dims)


def _acc(x: torch.Tensor) -> torch.dtype:
    """The kernel's accumulation type: fp32 for bf16/fp16/fp32, fp64 for fp64."""
    return torch.promote_types(x.dtype, torch.float32)


@torch.library.custom_op(f"{_LIB}::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], dims: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    axes, acc = tuple(range(-dims, 0)), _acc(x)
    rstd = torch.rsqrt(x.to(acc).pow(2).mean(axes, keepdim=True) + eps)
    y = x.to(acc) * rstd
    y = (y * weight.to(acc) if weight is not None else y).to(x.dtype)
    return y, rstd


@_rms_norm.register_fake
def _(x, weight, dims, eps):
    return torch.empty_like(x), x.new_empty(_reduced(x, dims), dtype=_acc(x))


@torch.library.custom_op(f"{_LIB}::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor],
                       dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    axes, acc = tuple(range(-dims, 0)), _acc(x)
    x_hat = x.to(acc) * rstd
    g = dy.to(acc) * (weight.to(acc) if weight is not None else 1.0)
    dx = rstd * (g - x_hat * (g * x_hat).mean(axes, keepdim=True))
    lead = tuple(range(x.dim() - dims))
    dw = (dy.to(acc) * x_hat).sum(lead) if weight is not None else x.new_empty(0)
    return dx.to(x.dtype), dw.to(weight.dtype) if weight is not None else dw


@_rms_norm_backward.register_fake
def _(dy, x, rstd, weight, dims):
    return torch.empty_like(x), torch.empty_like(weight) if weight is not None else x.new_empty(0)


def _setup(ctx, inputs, output):
    x, weight, dims, _ = inputs
    ctx.dims = dims
    ctx.set_materialize_grads(False)  # (the reciprocal RMS's gradient is never used: no zeros for it)
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, rstd, weight, ctx.dims)
    return dx, (dw if weight is not None else None), None, None


_rms_norm.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None) -> torch.Tensor:
    """``F.rms_norm`` as the GPU's one fused kernel (same values; one operator forward, one backward)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _rms_norm(x, weight, len(normalized_shape), eps)[0]


@contextlib.contextmanager
def gpu_kernels():
    """Inside it, ``F.rms_norm`` (what ``nn.RMSNorm`` calls) runs as the GPU's fused kernel."""
    original = F.rms_norm
    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = original
