"""megatron's local linears with the matmul as one aten ``linear`` wherever no tensor-parallel
communication runs inside it (``model.aten_linears``, on by default).

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
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class AtenMatmul:
    """Mixin for megatron's parallel linears: the local matmul as ``F.linear`` when megatron's
    autograd function has no communication or fused accumulation to do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aten_matmul = getattr(self.config, "aten_linears", True)

    def _forward_impl(self, input, weight, *args, **kwargs):
        needs_megatron = (kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel")
                          or kwargs.get("gradient_accumulation_fusion") or kwargs.get("grad_output_buffer") is not None)
        if args or needs_megatron or not self.aten_matmul:
            return super()._forward_impl(input, weight, *args, **kwargs)
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


class AtenRowParallelLinear(AtenMatmul, RowParallelLinear):
    """``RowParallelLinear`` with the aten matmul (its reduction, and the bias after it, are
    megatron's as before)."""
