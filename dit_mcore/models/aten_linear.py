"""megatron's local linears with the matmul as one aten ``linear`` wherever no tensor-parallel
communication runs inside it (``model.aten_linears``; experimental, off by default until a GPU measurement shows it pays).

megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` multiply through their own autograd
function (``LinearWithGradAccumulationAndAsyncCommunication``), which exists to overlap the
tensor-parallel all-reduce / all-gather of the input gradient with the weight-gradient GEMM. Where
there is no such communication -- every linear at TP=1, the usual single-node DiT layout, and every
row-parallel linear, whose reduction happens outside the matmul -- the function only adds its bias as
a separate op. Under ``torch.compile`` that costs memory traffic Inductor cannot fuse away:

- the QKV projection's bias is a pass of its own over the ``[tokens, 3 x hidden]`` output (its
  consumer, attention, is an extern kernel), where ``F.linear`` puts it in cuBLAS's GEMM epilogue;
- megatron's MLP takes ``fc1``'s bias apart (``skip_bias_add``) to add it before the activation;
  Inductor then fuses the bias-gradient reduction with the activation's backward by recomputing it
  from two saved ``[tokens, 4 x hidden]`` tensors instead of reading the one gradient it just wrote.
  Here ``fc1`` returns its output with the bias folded in (no separate bias), as diffusers' linears
  do.

Scheduled by Inductor for an H100 (``benchmarks/fusion_traffic.py``), a DiT-XL/2 layer's fused
(Triton) kernels move about 13% fewer bytes per token in forward plus backward. In fp32 the results
are the same products and sums; in bf16 the bias is added before the one rounding of the output
instead of after a rounding of the product (as ``nn.Linear`` and diffusers do). Column-parallel
linears with TP communication (TP > 1, sequence parallel), megatron's gradient-accumulation fusion
and deferred weight gradients keep megatron's function; parameters, their attributes and checkpoint
keys are megatron's.

Under megatron DDP (``model.fuse_wgrad_accumulation``; experimental, off by default) the aten path also accumulates
the weight gradient into the parameter's fp32 ``main_grad`` inside its backward, the GEMM doing the
add (:mod:`kernels.wgrad_accumulation`), instead of handing DDP's hook a bf16 gradient to add:
megatron's gradient-accumulation fusion, without apex. :func:`fuse_wgrad_accumulation` switches it
on per linear (and per adaLN modulation, whose plain linear takes the same path) once DDP has given
the weights their buffers. DDP then skips every other gradient that
reaches such a weight in a step, so its gradient must come through this linear's matmul alone (a
linear called with another weight refuses).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from dit_mcore.kernels.wgrad_accumulation import accumulate_wgrad


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """What the backward returns as the weight's gradient once it is in ``main_grad``: megatron
    DDP's hook must fire (it counts the gradient ready for the bucket's reduction) and skips the add
    for weights flagged ``grad_added_to_main_grad``; the values are never read."""
    return torch.empty_like(weight)


class _LinearIntoMainGrad(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient into ``main_grad`` itself (a custom op
    that ``torch.compile`` runs in place) and returns a placeholder for the weight."""

    @staticmethod
    def forward(ctx, input, weight, bias, main_grad):
        ctx.save_for_backward(input, weight)
        # Not a saved tensor: other linears add into the same buffer before this backward runs
        # (views of one buffer share a version counter, which saving would check).
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        accumulate_wgrad(ctx.main_grad, grad_output, input)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, _dummy_wgrad(weight), grad_bias, None


def linear_into_main_grad(input: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` whose weight gradient its backward adds into ``weight.main_grad``
    (the weight must be flagged ``grad_added_to_main_grad`` for DDP: :func:`fuse_wgrad_accumulation`)."""
    return _LinearIntoMainGrad.apply(input, weight, bias, weight.main_grad)


class MainGradLinear(torch.nn.Linear):
    """``nn.Linear`` whose weight gradient can be added into ``main_grad`` by its GEMM (the adaLN
    modulations' linear): called as a module, so megatron DDP's forward pre-hooks (the parameter
    gather under ``overlap_param_gather``) see its use."""

    wgrad_into_main_grad = False  # set by fuse_wgrad_accumulation()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.wgrad_into_main_grad and self.weight.requires_grad:
            return linear_into_main_grad(input, self.weight, self.bias)
        return super().forward(input)


class AtenMatmul:
    """Mixin for megatron's parallel linears: the local matmul as ``F.linear`` when megatron's
    autograd function has no communication or fused accumulation to do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aten_matmul = getattr(self.config, "aten_linears", False)
        self.wgrad_into_main_grad = False  # set by fuse_wgrad_accumulation()

    def _communicates(self) -> bool:
        """Whether megatron's forward hands ``_forward_impl`` work for its own autograd function
        (apex's accumulation fusion; in a column-parallel linear also TP communication and deferred
        weight gradients): the static twin of ``_forward_impl``'s test of its arguments."""
        return bool(self.gradient_accumulation_fusion)

    def _forward_impl(self, input, weight, *args, **kwargs):
        needs_megatron = (kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel")
                          or kwargs.get("gradient_accumulation_fusion") or kwargs.get("grad_output_buffer") is not None)
        if args or needs_megatron or not self.aten_matmul:
            if self.wgrad_into_main_grad:
                raise RuntimeError(f"{type(self).__name__}: the weight gradient is flagged as accumulated by the "
                                   "linear, but this call takes megatron's autograd function")
            return super()._forward_impl(input, weight, *args, **kwargs)
        if self.wgrad_into_main_grad and weight.requires_grad:
            if weight is not self.weight:  # DDP would skip this weight's gradient: refuse, never drop it
                raise RuntimeError(f"{type(self).__name__}: called with another weight while its own weight's "
                                   "gradient is accumulated by the linear (model.fuse_wgrad_accumulation=False "
                                   "allows it)")
            return linear_into_main_grad(input, weight, kwargs.get("bias"))
        return F.linear(input, weight, kwargs.get("bias"))


class AtenColumnParallelLinear(AtenMatmul, ColumnParallelLinear):
    """``ColumnParallelLinear`` with the aten matmul, and its bias folded into the output where
    megatron would return it apart (``skip_bias_add``: the MLP's ``fc1``, whose caller adds it
    before the activation and skips the add when it gets None)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (self.aten_matmul and self.skip_bias_add and self.bias is not None and not self.gather_output
                and not self.is_expert and not self.config.bias_activation_fusion):
            self.skip_bias_add = False  # megatron's forward now passes the bias to the matmul

    def _communicates(self) -> bool:
        comm = not self.explicit_expert_comm and (self.allreduce_dgrad or self.sequence_parallel)
        return bool(comm or self.config.defer_embedding_wgrad_compute or super()._communicates())


class AtenRowParallelLinear(AtenMatmul, RowParallelLinear):
    """``RowParallelLinear`` with the aten matmul (its reduction, and the bias after it, are
    megatron's as before)."""


def fuse_wgrad_accumulation(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Switch on the accumulation into ``main_grad`` for every aten-path linear and
    :class:`MainGradLinear` (the adaLN modulations') of ``module`` (``model.fuse_wgrad_accumulation``),
    once megatron DDP has given the weights their fp32 buffers; the weights whose gradients they now
    add themselves, for DDP to flag ``grad_added_to_main_grad`` after each ``zero_grad_buffer``."""
    def buffered(weight) -> bool:
        return weight is not None and weight.requires_grad and getattr(weight, "main_grad", None) is not None

    enabled = getattr(getattr(module, "config", None), "fuse_wgrad_accumulation", False)
    fused = []
    for linear in module.modules():
        if (isinstance(linear, AtenMatmul) and linear.aten_matmul and not linear._communicates()
                and getattr(linear.config, "fuse_wgrad_accumulation", False) and buffered(linear.weight)):
            linear.wgrad_into_main_grad = True
            fused.append(linear.weight)
        elif isinstance(linear, MainGradLinear) and enabled and buffered(linear.weight):
            linear.wgrad_into_main_grad = True
            fused.append(linear.weight)
    return fused
