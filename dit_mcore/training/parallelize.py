"""Build this rank's model and put it in the run's parallel layout, as torchtitan's ``parallelize_*``:
build the pipeline chunks (on the meta device with ``model.init_model_with_meta_device``), check that
the per-parameter state fits the device, compile the layers, wrap them in megatron DDP or shard them
(FSDP), fill a meta-built model part by part, and build the EMA shadow the same way.

The trainer calls :func:`parallelize` once and then only trains what it returns (:class:`ParallelModel`).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from megatron.core import parallel_state

from dit_mcore.errors import ConfigError
from dit_mcore.models.seeding import materialize_parts, on_each_part
from dit_mcore.parallel.fsdp import copy_into, local, publish_weights
from dit_mcore.parallel.initialize import on_any_rank
from dit_mcore.parallel.pipeline import ModelChunks
from dit_mcore.training import ema_shards, memory
from dit_mcore.training.config import RunConfig
from dit_mcore.training.ema import EMA
from dit_mcore.training.optim import moment_dtypes, prefers_flat, resolve_adam_impl, shard_fully, wrap_data_parallel
from dit_mcore.training.torch_optimizer import builds_torch_adam


@dataclass(eq=False)
class ParallelModel:
    """What :func:`parallelize` built: this rank's chunks, their data-parallel wrappers and the EMA."""

    model: ModelChunks
    """This rank's pipeline chunks (one without VPP), the modules the wrappers hold."""
    ddp_chunks: list
    """The same chunks wrapped in megatron DDP or sharded by FSDP: what the schedule and the optimizer use."""
    ema: EMA
    ema_sharded: bool
    """``trainer.ema_shard`` resolved (:func:`shards_ema`)."""
    budget: memory.StateBudget
    """This rank's per-parameter state, counted from its parameters (checked against the device)."""
    overlap_param_gather: bool
    shadow_wrappers: list
    """FSDP's wrappers of the EMA shadow (kept alive with it); empty otherwise."""
    _gathered: bool = field(default=True, init=False)

    def mark_updated(self) -> None:
        """The optimizer wrote new weight shards; under ``overlap_param_gather`` the next forward gathers them."""
        self._gathered = False

    def gather_params(self) -> None:
        """With ``overlap_param_gather`` the updated parameter shards are gathered during the next
        forward; gather them now for a reader outside the forward (an EMA fold, a checkpoint), once
        per update: with ``trainer.ema_every`` k the steps between folds leave the gather to the next
        forward, overlapped."""
        if self.overlap_param_gather and not self._gathered:
            for chunk in self.ddp_chunks:
                chunk.start_param_sync(force_sync=True)
            self._gathered = True


def build_chunks(cfg: RunConfig, model_config, family, device, seed: Optional[int] = None) -> ModelChunks:
    """This rank's pipeline chunks of ``family`` for ``model_config`` on ``device``, in the run's compute
    dtype (bf16 parameters and compute with ``trainer.bf16``; the optimizer keeps fp32 main weights)."""
    return ModelChunks.of_family(family, model_config, backend=cfg.model.backend, device=device,
                                 dtype=torch.bfloat16 if cfg.trainer.bf16 else torch.float32, seed=seed)


def parallelize(cfg: RunConfig, model_config, family, device: torch.device,
                initial: Optional[Callable[[ModelChunks], None]] = None) -> ParallelModel:
    """Build, check, compile and wrap this rank's model and its EMA shadow for the run ``cfg``. ``initial``
    loads the run's first weights (``trainer.init_from``) where the random init would have put them: into the
    plain chunks before the wrapper (a model built on the meta device under FSDP: into its shards once FSDP has
    allocated them), before the EMA and the optimizer copy them."""
    meta = bool(cfg.model.init_model_with_meta_device)
    fsdp = cfg.parallel.fsdp != "none"

    def build(config=model_config, on=None, seed=None):
        return build_chunks(cfg, config, family, on or ("meta" if meta else device), seed)

    # With model.init_model_with_meta_device the model and the shadow start on the meta device and
    # are filled part by part after FSDP has sharded them (each rank allocates only its shards).
    parts = []
    with on_each_part(lambda key, owned: parts.append((key, owned))) if meta else contextlib.nullcontext():
        model = build()
    if initial and not meta:
        initial(model)
    ema_sharded = shards_ema(cfg, model)
    budget = state_budget(cfg, model, model_config, ema_sharded)
    _check_state_fits(budget, device, fsdp)  # before the EMA, the optimizer and any compile allocate or take time
    if cfg.model.compile:
        for chunk in model:
            chunk.compile_layers(cfg.model.compile_mode, cfg.model.compile_options)
    rng = torch.get_rng_state()  # the shadow's random init is overwritten; keep the stream
    # The EMA shadow (fp32, previews) multiplies in full precision: float8 is a training speed-up,
    # and fp32-output float8 GEMMs are not supported on every GPU. Same parameters and keys.
    # Sharded (trainer.ema_shard), it is only ever allocated whole for a preview or a checkpoint.
    shadow = build(_shadow_config(model_config, unallocated=ema_sharded, te=_holds_te(model)),
                   on="meta" if ema_sharded else None).float()
    torch.set_rng_state(rng)

    def fill(shadow_to_allocate):
        if meta:
            _materialize(cfg, device, parts, model, shadow_to_allocate,
                         lambda: build(on="cpu", seed=model.init_seed))
    if not fsdp:
        fill(None if ema_sharded else shadow)
        if initial and meta:
            initial(model)
    ddp_chunks = wrap_data_parallel(model, model_config, cfg.parallel,
                                    use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
                                    grad_reduce_in_fp32=cfg.optim.main_grads_dtype == "fp32")
    shadow_wrappers = []
    if fsdp:  # the EMA shadow is sharded like the model
        shadow_wrappers = shard_fully(shadow, model_config, ddp_chunks[0].ddp_config, cfg.parallel.fsdp)
        fill(shadow)
        if initial and meta:  # (into the shards FSDP allocated)
            initial(model)
            publish_weights((model,))
    ema = EMA(model, shadow, cfg.trainer.ema_decay, offload=cfg.trainer.ema_offload,
              shard_over=ddp_chunks if ema_sharded else None)
    return ParallelModel(model, ddp_chunks, ema, ema_sharded, budget, cfg.parallel.overlap_param_gather,
                         shadow_wrappers)


def _materialize(cfg: RunConfig, device, parts: list, model: ModelChunks, shadow: Optional[ModelChunks],
                 build_direct) -> None:
    """Allocate a meta-built model (its shards only, under FSDP) and fill it part by part with the
    values a direct build (``build_direct``) gives; the shadow (None: a sharded EMA's, left on the
    meta device) is only allocated (the EMA copies the model)."""
    modules = (model,) if shadow is None else (model, shadow)
    if cfg.parallel.fsdp != "megatron":  # (Megatron-FSDP allocated its shards when it wrapped)
        for module in modules:
            module.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        materialize_parts(build_direct, parts, copy_into=copy_into)
    publish_weights(modules)
    left = [name for module in modules for name, t in (*module.named_parameters(), *module.named_buffers())
            if local(t).is_meta]
    if left:
        raise RuntimeError(f"the meta-device build left {len(left)} tensors unallocated (first: {left[0]}); "
                           "a module the sharding wrapper does not allocate needs a reset_parameters method")


def shards_ema(cfg: RunConfig, model: ModelChunks) -> bool:
    """``trainer.ema_shard`` resolved: automatically, sharded wherever the distributed optimizer
    shards the main weights over more than one rank (megatron DDP, a model it fits; offloaded too)."""
    if cfg.trainer.ema_shard is not None:
        return cfg.trainer.ema_shard
    return (cfg.optim.use_distributed_optimizer and cfg.parallel.fsdp == "none"
            and parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1
            and ema_shards.unshardable(model) is None)


def state_budget(cfg: RunConfig, model: ModelChunks, model_config, ema_sharded: bool) -> memory.StateBudget:
    """This rank's per-parameter state for the run, counted from its parameters."""
    dense = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if cfg.parallel.fsdp != "none" and cfg.parallel.fsdp_shard_size:
        dense = min(dense, cfg.parallel.fsdp_shard_size)
    expert = parallel_state.get_expert_data_parallel_world_size() if model_config.num_moe_experts else dense
    offload = cfg.optim.offload_fraction if cfg.optim.cpu_offload else 0.0
    adam = "fused" if offload else resolve_adam_impl(cfg.optim.adam_impl, model, prefers_flat(cfg.optim))
    return memory.state_budget(
        ((p.numel(), dense if getattr(p, "allreduce", True) else expert) for chunk in model for p in chunk.parameters()),
        bf16=cfg.trainer.bf16, distributed_optimizer=cfg.optim.use_distributed_optimizer,
        fsdp=cfg.parallel.fsdp != "none", ema_offload=cfg.trainer.ema_offload, ema_sharded=ema_sharded,
        flat_adam=cfg.parallel.fsdp == "none" and adam == "flat",
        moment_bytes=sum(torch.finfo(d).bits // 8 for d in moment_dtypes(cfg.optim)),
        lowerable_moments=builds_torch_adam(cfg.optim.adam_impl),
        grad_bytes=2 if cfg.optim.main_grads_dtype == "bf16" else 4,
        main_bytes=2 if cfg.optim.split_main_params else 4, offload_fraction=offload)


def _check_state_fits(budget: memory.StateBudget, device, fsdp: bool) -> None:
    """Fail now, naming the fixes, if this rank's per-parameter state alone exceeds the device
    (:mod:`dit_mcore.training.memory`); log the room left for activations. Ranks hold different
    parameters (pipeline stages, experts): all of them stop if one must."""
    try:
        memory.check_state_fits(budget, memory.device_memory(device), fsdp=fsdp)
        problem = None
    except ConfigError as e:
        problem = e
    failed = on_any_rank(problem is not None, device)
    if problem is not None:
        raise problem
    if failed:
        raise ConfigError("another rank's per-parameter state does not fit its device (its error names the fix)")


def _shadow_config(config, *, unallocated: bool = False, te: bool = False):
    """``config`` for the EMA shadow: full-precision linears (neither torchao's nor TE's FP8) and no
    TP userbuffers (previews run other batch shapes than the buffers were sized for); ``unallocated``
    (a sharded EMA's shadow, built under the meta device): not initialised, and every layer on the meta
    device -- megatron's local layers follow the device context only with ``use_cpu_initialization``
    (else they allocate on the GPU), Transformer Engine's (``te``) take the meta device only without
    it. A copy, since re-running megatron's ``__post_init__`` (``dataclasses.replace``) is not idempotent."""
    if config.float8_recipe is None and not config.fp8 and not config.tp_comm_overlap and not unallocated:
        return config
    config = copy.copy(config)
    config.float8_recipe = None
    config.fp8 = None  # (Transformer Engine's FP8)
    config.tp_comm_overlap = False
    if unallocated:
        config.perform_initialization = False
        config.init_model_with_meta_device = True
        config.use_cpu_initialization = not te
    return config


def _holds_te(model: torch.nn.Module) -> bool:
    """Whether ``model`` has Transformer Engine layers."""
    return any(c.__module__.startswith("transformer_engine") for m in model.modules() for c in type(m).__mro__)
