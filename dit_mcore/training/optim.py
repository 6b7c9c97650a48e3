"""megatron-core DDP, optimizer and LR scheduler from the run config."""
from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dit_mcore.kernels.host_copy import to_device
from dit_mcore.kernels.wgrad_accumulation import gemm_accumulates
from dit_mcore.models.aten_linear import fuse_wgrad_accumulation
from dit_mcore.training import flat_adam, torch_optimizer

log = logging.getLogger(__name__)


class DataParallel(DistributedDataParallel):
    """megatron DDP whose aten-path linears add their weight gradients into ``main_grad`` in their
    own backward (``model.fuse_wgrad_accumulation``; :mod:`kernels.wgrad_accumulation`). megatron's
    backward hook adds a weight's gradient unless the weight is flagged ``grad_added_to_main_grad``,
    a flag its ``zero_grad_buffer`` clears every step (megatron's fused linears set it again in each
    backward); here the flag is set again right after each clear, for exactly the weights whose
    linears accumulate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wgrad_fused_params = fuse_wgrad_accumulation(self.module)
        # Whether the GEMM itself adds into main_grad (else the product, then an add); None: no fusion.
        self.wgrad_accumulates_in_gemm = None
        if self.wgrad_fused_params:  # probed here, before training holds the memory, and logged
            param = self.wgrad_fused_params[0]
            self.wgrad_accumulates_in_gemm = gemm_accumulates(param.device, param.dtype, param.main_grad.dtype)
            log.info("weight gradients of %d linears accumulate into main_grad %s", len(self.wgrad_fused_params),
                     "inside the GEMM" if self.wgrad_accumulates_in_gemm else "after the product (no in-place "
                     "mixed-dtype addmm on this device)")
        self._flag_fused_wgrads()

    def _make_backward_post_hook(self, param):
        # megatron's hook closes over ``self`` and is kept by the parameter's gradient accumulator, a C++
        # node that this wrapper's ``grad_accs`` holds: a cycle through C++ that Python's collector cannot
        # see, so a finished run's model, optimizer and process groups (gloo: threads) would live as long
        # as the process. The hook reaches the wrapper through a weak proxy instead.
        return DistributedDataParallel._make_backward_post_hook(weakref.proxy(self), param)

    def _flag_fused_wgrads(self) -> None:
        for param in self.wgrad_fused_params:
            param.grad_added_to_main_grad = True

    def zero_grad_buffer(self):
        super().zero_grad_buffer()
        self._flag_fused_wgrads()


def wrap_data_parallel(chunks, model_config, parallel, *, use_distributed_optimizer: bool,
                       grad_reduce_in_fp32: bool = True) -> list:
    """One data-parallel wrapper per pipeline chunk, with the schedule hooks megatron's own training
    loop installs: megatron DDP (only the first chunk bucketed, as megatron does), FSDP2 under
    ``parallel.fsdp="torch"`` or Megatron-FSDP under ``"megatron"`` (both shard the optimizer state
    themselves). ``grad_reduce_in_fp32=False`` (``optim.main_grads_dtype="bf16"``): megatron DDP's
    gradient buffers take the parameters' dtype."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                               overlap_grad_reduce=parallel.overlap_grad_reduce,
                                               overlap_param_gather=parallel.overlap_param_gather,
                                               use_distributed_optimizer=use_distributed_optimizer,
                                               bucket_size=parallel.ddp_bucket_size)
    if parallel.fsdp != "none":
        wrapped = shard_fully(chunks, model_config, ddp_config, parallel.fsdp)
    else:
        wrapped = [DataParallel(config=model_config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]

    def per_chunk(name):
        hooks = [getattr(c, name) for c in wrapped]
        return hooks[0] if len(hooks) == 1 else hooks

    model_config.finalize_model_grads_func = finalize_grads
    model_config.no_sync_func = per_chunk("no_sync")
    model_config.grad_sync_func = per_chunk("start_grad_sync") if parallel.overlap_grad_reduce else None
    model_config.param_sync_func = per_chunk("start_param_sync") if parallel.overlap_param_gather else None
    return wrapped


def finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False) -> None:
    """megatron's ``finalize_model_grads`` (the gradient all-reduces of every parallel layout)
    without its per-token scaling: the gradients arrive already divided by the global batch's
    sample count, because the loss was (:func:`per_sample_loss_scale`). megatron's scaling is one
    more pass over the fp32 gradient buffers (15 ms per step on a 3B model on an H200) behind
    ``if num_tokens > 0``, a host read that synced the device at the end of every backward."""
    finalize_model_grads(model, None, pg_collection, force_all_reduce)


def per_sample_loss_scale(config, optimizer, weight: torch.Tensor) -> None:
    """Scale the loss by ``weight`` (a device scalar: 1 / the global batch's sample count, set by
    the trainer each step) before backward, through megatron's ``grad_scale_func``, which scales
    the MoE auxiliary losses the same way: the gradients megatron would have divided by the count
    in ``finalize_model_grads`` come out divided already (see :func:`finalize_grads`)."""
    config.grad_scale_func = lambda loss: optimizer.scale_loss(loss) * weight


def shard_fully(chunks, model_config, ddp_config, kind: str) -> list:
    """Shard each chunk in place with FSDP2 (``kind="torch"``) or Megatron-FSDP (``"megatron"``),
    over the data x context parallel ranks (of one HSDP group when the run was initialised with
    replica groups). Used for the model and, the same way, for its EMA shadow."""
    if kind == "megatron":
        from dit_mcore.parallel.megatron_fsdp import shard_module
        return [shard_module(chunk, model_config, ddp_config) for chunk in chunks]
    from dit_mcore.parallel.fsdp import fsdp_groups, shard_module
    groups = fsdp_groups()
    return [shard_module(chunk, model_config, ddp_config, groups) for chunk in chunks]


STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtypes ``optim.exp_avg_dtype``, ``exp_avg_sq_dtype`` and ``main_grads_dtype`` name."""


def moment_dtypes(optim) -> tuple:
    """``(exp_avg, exp_avg_sq)`` torch dtypes of ``optim`` (an ``OptimConfig``)."""
    return STATE_DTYPES[optim.exp_avg_dtype], STATE_DTYPES[optim.exp_avg_sq_dtype]


def moments_below_fp32(optim) -> bool:
    """Whether ``optim`` keeps either Adam moment below fp32 (which only the flat step does)."""
    return moment_dtypes(optim) != (torch.float32, torch.float32)


def prefers_flat(optim) -> bool:
    """Whether ``optim``'s state is one that only the flat step keeps (moments below fp32, split main
    weights) or keeps without copies (bf16 gradient buffers, which megatron copies into fp32 for the
    other steps)."""
    return moments_below_fp32(optim) or optim.main_grads_dtype != "fp32" or optim.split_main_params


def resolve_adam_impl(impl: str, chunks, flat_state: bool = False) -> str:
    """``optim.adam_impl=auto``: "flat" where the weights are on a GPU (an H100 stepped DiT-XL/2's
    AdamW and weight copy 1.24x faster flat than fused, the whole step 1.02x:
    ``benchmarks/results/h100_2026-11-27.md``) or where ``flat_state`` (:func:`prefers_flat`), "fused"
    elsewhere (the CPU's generated kernel is half as fast as torch's fused one). Other values are
    returned as given."""
    if impl != "auto":
        return impl
    on_gpu = any(p.is_cuda for chunk in chunks for p in chunk.parameters())
    return "flat" if on_gpu or flat_state else "fused"


def clip_scale(grad_norm, clip: float):
    """What the gradients are divided by to clip them to norm ``clip``: megatron's clip coefficient
    inverted, ``max(1, (norm + 1e-6) / clip)`` (a float or a device tensor, as ``grad_norm``)."""
    if isinstance(grad_norm, torch.Tensor):
        return ((grad_norm + 1.0e-6) / clip).clamp(min=1.0)
    return max(1.0, (grad_norm + 1.0e-6) / clip)


def build_optimizer(ddp_chunks, optim, *, bf16: bool, max_steps: int):
    torch_optimizer.choose_adam(optim.adam_impl)  # torch's AdamW, also where TE/apex is installed
    torch_optimizer.apply_fixes()  # megatron's pure-torch fallbacks (no apex/TE), on any device
    config = OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                             adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                             clip_grad=optim.clip_grad, bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             # Megatron-FSDP's optimizer is megatron's distributed one over its shards
                             use_distributed_optimizer=optim.use_distributed_optimizer
                             or ddp_chunks[0].ddp_config.use_megatron_fsdp,
                             overlap_param_gather=ddp_chunks[0].ddp_config.overlap_param_gather,
                             optimizer_cpu_offload=optim.cpu_offload, optimizer_offload_fraction=optim.offload_fraction,
                             pin_cpu_grads=torch.cuda.is_available(), pin_cpu_params=torch.cuda.is_available())
    with offload_classes() if optim.cpu_offload else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(config, ddp_chunks)
    if optim.cpu_offload:  # megatron's HybridDeviceOptimizer steps its own sub-optimizers (torch's fused AdamWs)
        log.info("optim.cpu_offload: the optimizer state of %.0f%% of the parameters in host memory, stepped there",
                 100 * optim.offload_fraction)
        return optimizer, _scheduler(optimizer, optim, max_steps)
    impl = resolve_adam_impl(optim.adam_impl, ddp_chunks, prefers_flat(optim))
    if impl != optim.adam_impl:
        log.info("optim.adam_impl=%s: %s", optim.adam_impl, impl)
    moments = moment_dtypes(optim)
    if (impl == "flat" and not flat_adam.install(optimizer, ddp_chunks, moments, bf16 and optim.split_main_params)
            and optim.adam_impl == "flat"):
        log.warning("optim.adam_impl=flat: no part of the optimizer fits the flat step (reasons above); "
                    "every part steps torch's fused AdamW")
    if impl != "megatron":
        torch_optimizer.set_adam_impl(optimizer, impl)
    return optimizer, _scheduler(optimizer, optim, max_steps)  # the loss scale: per_sample_loss_scale


class HostAdamW(torch.optim.AdamW):
    """torch's AdamW as ``optim.cpu_offload``'s host-side optimizer: its own class, because megatron's offload
    tells its host and device optimizers apart by the host one's class (``_move_new_state_to_right_device``)."""


@contextlib.contextmanager
def offload_classes():
    """megatron builds its offload's device side from the Adam it imported (TE's or apex's FusedAdam where
    installed, which keep no per-parameter step and are no allowed global of a weights-only checkpoint load)
    and its host side from torch's AdamW: while it does, both are torch's AdamW, the host one as
    :class:`HostAdamW`."""
    import megatron.core.optimizer as megatron_optimizer
    saved = megatron_optimizer.Adam, megatron_optimizer.CPUAdam
    megatron_optimizer.Adam, megatron_optimizer.CPUAdam = torch.optim.AdamW, HostAdamW
    try:
        yield
    finally:
        megatron_optimizer.Adam, megatron_optimizer.CPUAdam = saved


def reload_offloaded_copies(optimizer) -> None:
    """The weights changed outside the optimizer: ``optim.cpu_offload``'s host copies take them (megatron's
    ``reload_model_params`` reaches the main weights, not HybridDeviceOptimizer's copies of them; each part of
    a chained optimizer)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer):
            with torch.no_grad():
                for on_device, on_host in inner.gpu_params_map_cpu_copy.items():
                    on_host.copy_(on_device)
                inner.update_fp32_param_by_new_param()


def _scheduler(optimizer, optim, max_steps: int) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=max(max_steps, 1), lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(max_steps, 1),
        wd_incr_style="constant")


RESUME_SCHEDULES = ("checkpoint", "config")
_SCHEDULE_FIELDS = (("max_lr", "lr"), ("min_lr", "min_lr"), ("lr_warmup_steps", "warmup steps"),
                    ("lr_decay_steps", "decay steps"), ("lr_decay_style", "decay style"))


def load_schedule(scheduler, saved: dict, choice: str, step: int) -> Optional[str]:
    """Load a checkpoint's learning-rate schedule into ``scheduler`` (built from this run's config):
    where the two differ, ``choice`` (``optim.resume_schedule``) picks the checkpoint's or the config's,
    the latter evaluated from the resumed ``step`` on. Returns the line saying what differed and what was
    chosen (None when nothing differed)."""
    def describe(values: dict) -> str:
        return ", ".join(f"{label} {values[key]}" for key, label in _SCHEDULE_FIELDS)
    ours = {key: getattr(scheduler, key) for key, _ in _SCHEDULE_FIELDS}
    theirs = {key: saved.get(key, ours[key]) for key, _ in _SCHEDULE_FIELDS}
    if ours["lr_decay_style"] == theirs["lr_decay_style"] == "constant":  # no horizon to keep or re-plan
        theirs["lr_decay_steps"] = ours["lr_decay_steps"]
    scheduler.override_opt_param_scheduler = choice == "config"
    scheduler.load_state_dict(saved)
    if ours == theirs:
        return None
    head = (f"resumed at step {step}: the checkpoint's learning-rate schedule ({describe(theirs)}) differs from "
            f"the config's ({describe(ours)}); ")
    if choice == "config":
        return head + (f"re-planned with the config's from step {step} (optim.resume_schedule=config; "
                       f"lr now {scheduler.get_lr(scheduler.optimizer.param_groups[0]):.3e})")
    return head + ("kept the checkpoint's (optim.resume_schedule=checkpoint); set optim.resume_schedule=config to "
                   f"re-plan with the config's from step {step}")


@torch.no_grad()
def grads_and_norm(optimizer) -> float:
    """The first half of megatron's optimizer step (``ChainedOptimizer.step``): the gradients into
    the optimizer (``prepare_grads``, with its own overflow check) and their global norm, the one
    clipping needs anyway (reduced over the model-parallel groups, identical on every rank); NaN on
    an overflow. Reading the norm is the step's one host sync: call it once the step's other device
    work (the loss reduction) is queued, so that the host waits once, for all of it. (Deciding the
    clip and the skip on the device instead, with no host read, measured 1.01x eager on an H200 and
    was removed until a compiled measurement shows it pays: issue 39.)"""
    if optimizer.prepare_grads():
        return math.nan
    return float(optimizer.get_grad_norm())


def _parts(optimizer) -> list:
    """The parts of a (possibly chained) megatron optimizer that step parameters (no stubs)."""
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if not getattr(part, "is_stub_optimizer", False)]


@torch.no_grad()
def step_if_finite(optimizer, loss_is_finite: bool, grad_norm: float) -> bool:
    """The second half: clip by ``grad_norm`` and update, skipped when the loss or the norm is not
    finite, so a diverging step never reaches the weights or the Adam moments. True if updated."""
    if not loss_is_finite or not math.isfinite(grad_norm):
        return False
    in_kernel = []  # flat steps on bf16 gradient buffers: no main weight holds a gradient to scale
    for part in _parts(optimizer):
        params = part.get_parameters()
        if not params or part.config.clip_grad <= 0.0:
            continue
        inner = part.optimizer
        if isinstance(inner, flat_adam.FlatAdamW) and inner.reads_buffers():
            inner.grad_scale = to_device(clip_scale(grad_norm, part.config.clip_grad), inner.ranges[0].grad.device,
                                         torch.float32)
            in_kernel.append(inner)
        else:
            clip_grad_by_total_norm_fp32(params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    try:
        return optimizer.step_with_ready_grads()
    finally:
        for inner in in_kernel:
            inner.grad_scale = None
