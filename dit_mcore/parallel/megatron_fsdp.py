"""Megatron-FSDP (``parallel.fsdp="megatron"``): megatron-core's own fully sharded data parallelism,
through its ``FullyShardedDataParallel`` adapter and distributed optimizer.

Each transformer layer is one FSDP unit (parameters, gradients and optimizer state sharded over the
data x context parallel ranks, gathered just in time); the embedders and final layer go with the
root. Sharding follows megatron's flat buffers, so a parameter's shard may be any run of its rows,
of any length (zero included): the helpers in :mod:`dit_mcore.parallel.fsdp` read the offsets of
each shard instead of assuming ``torch.chunk``'s. Made for GPUs (NCCL, its own streams and
buffers); on CPU it runs through :mod:`dit_mcore.parallel.cpu_shims` for the tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from dit_mcore.parallel.fsdp import fsdp_groups
from dit_mcore.parallel.initialize import at_release, run_device

_WRAPPED: weakref.WeakSet = weakref.WeakSet()
"""The Megatron-FSDP modules this process made (see :func:`release_hooks`)."""


def release_hooks() -> None:
    """Remove the hooks of every Megatron-FSDP module this process made. Its gradient hooks sit on the
    parameters, where Python's collector cannot follow them (a tensor shared with C++ is not traversed),
    and close over the module, so a finished model would live, with its process groups (gloo: threads
    per group), as long as the process. Runs when the groups are destroyed; the modules are dead after."""
    for fsdp in list(_WRAPPED):
        for hooks in (fsdp.forward_pre_hooks, fsdp.forward_hooks, fsdp.backward_pre_hooks, fsdp.grad_acc_hooks):
            for handle in hooks.values():
                handle.remove()
            hooks.clear()
        root = getattr(fsdp, "_root_pre_backward_hook_handle", None)
        if root is not None:
            root.remove()
    _WRAPPED.clear()


at_release(release_hooks)


class _NoTELinear:
    """Stands for Transformer Engine's linear where TE is absent: megatron's adapter asks
    ``isinstance(m, TELinear)`` under tensor parallelism, and without TE ``TELinear`` is a mock."""


def shard_module(module: torch.nn.Module, config, ddp_config):
    """Shard ``module`` in place and return megatron's wrapper (``ddp_config`` switched to
    Megatron-FSDP: ``optim_grads_params`` sharding, megatron's distributed optimizer)."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    if not isinstance(mcore_fsdp_adapter.TELinear, type):
        mcore_fsdp_adapter.TELinear = _NoTELinear
    device = run_device()
    _, replicate = fsdp_groups()
    ddp_config = dataclasses.replace(
        ddp_config, use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy="optim_grads_params",
        # HSDP: shard inside the partial data-parallel groups, replicate across them.
        num_distributed_optimizer_instances=replicate.size() if replicate is not None else 1,
        outer_dp_sharding_strategy="no_shard",
        # Averaging fused into the reduce-scatter needs NCCL's PREMUL_SUM; gloo has none.
        gradient_reduce_div_fusion=device.type == "cuda" and ddp_config.gradient_reduce_div_fusion)
    with _allocated_on_wrap(module, config):
        wrapper = mcore_fsdp_adapter.FullyShardedDataParallel(config, ddp_config, module,
                                                              fsdp_unit_modules=[TransformerLayer], device=device)
    module.__dict__["_megatron_fsdp"] = wrapper.module  # found by fsdp.publish_weights / forward_view
    _WRAPPED.add(wrapper.module)
    return wrapper


@contextlib.contextmanager
def _allocated_on_wrap(module: torch.nn.Module, config):
    """A model built on the meta device (``model.init_model_with_meta_device``) is allocated by
    Megatron-FSDP shard by shard, through each module's ``reset_parameters``; the values are
    written afterwards, part by part, by the trainer (layout-independent, as without FSDP). So
    here modules only need to be allocated: those without a reset method get one that leaves them
    uninitialised, for the duration of the wrap."""
    if not any(p.is_meta for p in module.parameters()):
        yield
        return
    patched = [m for m in module.modules() if any(p.is_meta for p in m.parameters(recurse=False))
               and not hasattr(m, "reset_parameters") and not hasattr(m, "_reset_parameters")]
    for m in patched:
        m._reset_parameters = _allocated_only
    saved, config.init_model_with_meta_device = config.init_model_with_meta_device, True
    try:
        yield
    finally:
        config.init_model_with_meta_device = saved
        for m in patched:
            del m._reset_parameters


def _allocated_only() -> None:
    pass
