"""FP8 training of the transformer linears with torchao's dynamic float8 scaling (``model.fp8``).

megatron-core has FP8 only through Transformer Engine, and torchao's own module swap
(``convert_to_float8_training``) only replaces ``nn.Linear``; the DiT's attention and MLP projections
are megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``. Both route their local matmul
through ``_forward_impl`` (with the tensor/sequence-parallel communication as arguments), so the
classes here override only that: the communication megatron does inside its autograd function is
done with megatron's own mappings, and the matmul goes through torchao's float8 autograd function
(inputs, weights and output gradients cast to float8 with dynamic scales, the product in the
input's dtype). Parameters, their attributes, state-dict keys and sharded checkpoints are the
plain classes', so an FP8 run resumes without FP8 and the other way round.

Only the transformer linears are swapped (they come from the layer spec): the adaLN modulation,
the embedders, the final layer and the norms are built outside the spec and keep the run's
precision; MoE experts, built by megatron's own spec provider, do too.

Known cost under sequence parallel: torchao saves the sequence-gathered input of a column-parallel
linear for its weight gradient, where megatron saves the local piece and gathers it again in the
backward, so FP8 with SP keeps TP times that activation (and the all-gather does not overlap the
weight-gradient GEMM). At TP=1, the usual single-node H100 layout, nothing changes.

Speed needs ``model.compile=True`` (the casts and amax reductions fuse only under Inductor) and a
GPU with float8 tensor cores (H100 and newer). On the CPU torch's ``_scaled_mm`` computes the same
float8 products, so the numerics are tested here; it does not enforce the GPU kernels' alignment,
which :func:`misaligned_dims` checks instead.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ALIGNMENT = 16
"""float8 GEMMs on the GPU need both dims of every weight divisible by this."""


class Float8LocalMatmul:
    """Mixin for megatron's parallel linears: the local matmul in float8 (torchao)."""

    float8_config = None  # torchao Float8LinearConfig, set per recipe by float8_linears()
    float8_mm_config = None  # torchao LinearMMConfig for the forward and both backward GEMMs

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, **_):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if gradient_accumulation_fusion or grad_output_buffer is not None:
            raise NotImplementedError("model.fp8 does not combine with gradient_accumulation_fusion or deferred "
                                      "weight gradients")
        group = tp_group if tp_group is not None else self.tp_group
        # What megatron's LinearWithGradAccumulationAndAsyncCommunication does around the matmul
        # (a row-parallel linear passes neither flag: its reduction happens outside).
        if sequence_parallel:  # all-gather the sequence; reduce-scatter the input gradient
            input = gather_from_sequence_parallel_region(input, True, group=group)
        elif allreduce_dgrad:  # all-reduce the input gradient over TP
            input = copy_to_tensor_model_parallel_region(input, group=group)
        out = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.float8_mm_config, self.float8_config)
        return out if bias is None else out + bias


@functools.lru_cache(maxsize=None)
def float8_linears(recipe: str) -> tuple[type, type]:
    """``(column_parallel, row_parallel)`` classes whose local matmul runs in float8 with torchao's
    ``recipe`` ("tensorwise": one scale per tensor; "rowwise": one per row, more accurate;
    "rowwise_with_gw_hp": rowwise, the weight gradient in the run's precision -- none of the
    column-wise casts its float8 GEMM needs)."""
    if recipe not in RECIPES:
        raise ValueError(f"model.fp8={recipe!r} is unknown; use one of {RECIPES}")
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    # Packed sequences and ragged text make token counts (the weight gradient's inner dim) arbitrary.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    mm = LinearMMConfig(*(ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                          for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                       config.gemm_config_grad_weight)))
    attrs = {"float8_config": config, "float8_mm_config": mm, "__module__": __name__}
    return (type(f"Float8ColumnParallelLinear_{recipe}", (Float8LocalMatmul, ColumnParallelLinear), attrs),
            type(f"Float8RowParallelLinear_{recipe}", (Float8LocalMatmul, RowParallelLinear), attrs))


def float8_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose matmul runs in float8."""
    return [name for name, m in model.named_modules() if isinstance(m, Float8LocalMatmul)]


def misaligned_dims(config, head_dim: int, *, alignment: int = ALIGNMENT, tp: Optional[int] = None) -> list[str]:
    """The float8 weight dims of ``config``'s transformer linears (local to a tensor-parallel rank of
    ``tp``, by default ``config``'s) that the GPU's float8 GEMMs reject, one ``what = size`` item each;
    empty when all are multiples of ``alignment``."""
    tp = tp or config.tensor_model_parallel_size
    heads = head_dim * config.num_attention_heads
    groups = head_dim * (config.num_query_groups or config.num_attention_heads)
    dims = {"hidden_size": config.hidden_size, "ffn_hidden_size / TP": config.ffn_hidden_size // tp,
            "attention width (heads x head dim) / TP": heads // tp,
            "key/value width (query groups x head dim) / TP": groups // tp}
    return [f"{what} = {size}" for what, size in dims.items() if size % alignment]
