"""The MoE MLP of the DiT families: megatron's ``MoELayer`` with a router whose load-balancing
loss has the same weight on any layout and under the trainer's per-sample loss normalisation.

megatron multiplies each rank's part of the switch load-balancing loss by the rank's *own* token
count, expecting the trainer to divide all gradients by the global token count
(``calculate_per_token_loss``). The DiT trainer divides by the global *sample* count instead, and
under sequence/context parallelism the loss is a sum of per-rank parts. This router multiplies
every part by the micro-batch's sample count (set by the layer before each forward), so the loss
enters the gradient averaged over micro-batches, as megatron intends, whatever the token split.
"""
from __future__ import annotations

from typing import Optional

import megatron.core.transformer.moe.moe_utils as moe_utils
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

# megatron 0.16's router gating reads this module global, defined only when Transformer Engine
# imports: without TE every router forward fails with a NameError (on any device).
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

LOAD_BALANCING = ("aux_loss", "none")


class LayoutInvariantRouter(TopKRouter):
    """``TopKRouter`` whose aux-loss gradient is the same on any token split (see module doc)."""

    def __init__(self, config, pg_collection=None):
        if config.moe_router_load_balancing_type not in LOAD_BALANCING:
            raise ValueError(f"moe_router_load_balancing_type={config.moe_router_load_balancing_type!r}: the DiT "
                             f"MoE supports {LOAD_BALANCING}")
        if config.moe_z_loss_coeff:
            raise ValueError("moe_z_loss_coeff is not supported by the DiT MoE router yet; set it to None")
        super().__init__(config=config, pg_collection=pg_collection)

    samples: Optional[int] = None
    """Samples in the micro-batch being routed (set by the owning layer)."""

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                           reduce_group, reduce_group_has_dp=False, valid_token_count=None):
        if self.samples is None:
            raise RuntimeError("LayoutInvariantRouter.samples is unset: the layer owning the MoE MLP must set "
                               "it to the micro-batch's sample count before the forward")
        return super().attach_and_log_load_balancing_loss(
            activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
            reduce_group_has_dp=reduce_group_has_dp, valid_token_count=self.samples)


def reset_moe_state() -> None:
    """Forget megatron's process-global MoE state left by an earlier model in this process: the
    router-loss tracker (sized by the first MoE model that logged into it; a deeper model would
    index past it) and the aux-loss gradient scale (a 0-d tensor after a backward outside
    megatron's schedules, which the schedules' ``copy_`` of a 1-element scale then rejects)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker
    get_moe_layer_wise_logging_tracker().clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def moe_spec(column_linear, num_experts: int, *, grouped_gemm: bool = False) -> ModuleSpec:
    """megatron's ``MoELayer`` spec for the backend of ``column_linear`` (local experts run one
    after another; Transformer Engine's grouped GEMM with ``grouped_gemm``)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    if issubclass(column_linear, ColumnParallelLinear):  # local linears (float8 ones too: experts stay unscaled)
        provider = LocalSpecProvider()
    else:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        provider = TESpecProvider()
    spec = get_moe_module_spec_for_backend(provider, num_experts=num_experts, moe_grouped_gemm=grouped_gemm)
    spec.submodules.router = LayoutInvariantRouter
    return spec


def mark_expert_params(module) -> None:
    """Tag every expert parameter ``allreduce=False``, as megatron does only when EP > 1: the expert
    weights then always live in megatron's expert gradient buffer and expert optimizer, so the
    optimizer (a ``ChainedOptimizer`` of dense and expert parts) and its checkpoints have the same
    structure on every expert layout, and an EP>1 checkpoint resumes on EP = 1 and back. At EP = 1
    the expert data-parallel group is the DP x CP group, so the gradients are reduced as before."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            for param in layer.experts.parameters():
                param.allreduce = False
