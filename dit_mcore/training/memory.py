"""The memory a rank holds for the whole run, counted from its parameters before the first step:
weights, megatron DDP's gradient buffer (fp32, or bf16), fp32 main weights and Adam moments (sharded by the
distributed optimizer or FSDP) and the EMA shadow. A run whose state alone exceeds the device fails
before it compiles anything, naming the settings that shrink it; otherwise the log says what is
left for activations (MovieGen-3B on an 80 GB H100: 67.8 of 79.2 GiB, less than one 8k-token
sample's ~21 GiB without recompute)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from dit_mcore.errors import ConfigError

log = logging.getLogger(__name__)
GiB = 2 ** 30


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or MiB / KiB below one GiB."""
    for unit, scale in (("GiB", GiB), ("MiB", 2 ** 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


@dataclass(frozen=True)
class StateBudget:
    """Bytes per kind of state on one rank."""

    weights: float
    gradients: float
    main_weights: float
    adam: float
    ema: float
    bf16_moments_save: float = 0.0
    """What keeping both Adam moments in bf16 would take off (0 where they are already, under FSDP, and
    where TE's or apex's FusedAdam steps)."""
    bf16_grads_save: float = 0.0
    """What bf16 gradient buffers (``optim.main_grads_dtype``) would take off (0 where they are already,
    in fp32 runs and under FSDP)."""
    split_mains_save: float = 0.0
    """What split main weights (``optim.split_main_params``) would take off (0 where they are already,
    in fp32 runs, under FSDP and where the step is not flat)."""
    host: float = 0.0
    """Offloaded optimizer state in host memory (``optim.cpu_offload``: fp32 main weights, moments and a
    gradient copy); not in :attr:`total`, which is the device's."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.main_weights + self.adam + self.ema

    def describe(self) -> str:
        parts = (("weights", self.weights), ("gradients", self.gradients), ("main weights", self.main_weights),
                 ("Adam", self.adam), ("EMA", self.ema))
        line = f"{size(self.total)} (" + ", ".join(f"{name} {size(b)}" for name, b in parts if b) + ")"
        return line + (f"; {size(self.host)} of optimizer state in host memory" if self.host else "")


def state_budget(params: Iterable[tuple[int, int]], *, bf16: bool, distributed_optimizer: bool, fsdp: bool,
                 ema_offload: bool, flat_adam: bool = False, ema_sharded: bool = False,
                 moment_bytes: int = 8, lowerable_moments: bool = True, grad_bytes: int = 4,
                 main_bytes: int = 4, offload_fraction: float = 0.0) -> StateBudget:
    """The state of a rank holding ``params``: ``(numel, ranks its optimizer state is sharded
    over)`` for each local parameter (its tensor/pipeline/expert share already). Megatron DDP keeps
    the weights and a gradient buffer (fp32, or bf16) whole on every data-parallel rank; the distributed
    optimizer shards the fp32 main weights (bf16 runs only) and both moments; FSDP shards all of it,
    the EMA too. ``ema_offload``: the EMA is in host memory; ``ema_sharded`` (``trainer.ema_shard``):
    the EMA sharded like the distributed optimizer's state; ``flat_adam`` (``optim.adam_impl=flat``):
    one more byte per element of the optimizer's ranges, each element's parameter group;
    ``moment_bytes``: both Adam moments' bytes per element (8 in fp32, 4 in bf16:
    ``optim.exp_avg_dtype`` / ``exp_avg_sq_dtype``); ``lowerable_moments``: whether the run's AdamW can
    keep them in bf16 (torch's under megatron, not TE's or apex's; not FSDP's), and the budget says what
    that would save; ``grad_bytes``: the gradient buffer's bytes per element (2: bf16,
    ``optim.main_grads_dtype``), which only the flat AdamW reads as they are: for any other step
    megatron copies them into fp32 tensors, held from the step to the next zeroing (counted with the
    gradients), so bf16 buffers are offered only where the step is flat; ``main_bytes``: a main
    weight's bytes per element (2: split, ``optim.split_main_params``, offered where the step is flat);
    ``offload_fraction`` (``optim.cpu_offload``): that share of the moments leaves the device for host memory,
    where an fp32 copy of its main weights and gradients joins them (a bf16 run's fp32 main weights stay on the
    device too: megatron's optimizer hands its offload those copies; megatron offloads whole parameters in
    order until the share is reached: per element here)."""
    w = g = m = a = e = saved = grads_saved = mains_saved = host = 0.0
    f = offload_fraction
    savable = lowerable_moments and not fsdp and not f  # (offload steps fp32 moments)
    reads_bf16 = flat_adam and lowerable_moments and not fsdp  # the flat AdamW reads bf16 buffers itself
    for numel, shards in params:
        shard_state = shards if (distributed_optimizer or fsdp) else 1
        shard_all = shards if fsdp else 1
        w += numel * (2 if bf16 else 4) / shard_all
        g += numel * (grad_bytes if not fsdp else 4) / shard_all
        g += numel * 4 / shard_state if grad_bytes == 2 and not fsdp and not reads_bf16 else 0.0  # megatron's copies
        grads_saved += numel * (grad_bytes - 2) if bf16 and reads_bf16 else 0.0
        m += numel * main_bytes / shard_state if bf16 else 0.0  # (megatron's fp32 copies stay: the device side)
        mains_saved += numel * (main_bytes - 2) / shard_state if bf16 and reads_bf16 else 0.0
        a += (1 - f) * numel * (moment_bytes + (1 if flat_adam else 0)) / shard_state
        host += f * numel * (4 + moment_bytes + 4) / shard_state
        e += 0.0 if ema_offload else numel * 4 / (shards if ema_sharded else shard_all)
        saved += numel * (moment_bytes - 4) / shard_state if savable else 0.0
    return StateBudget(w, g, m, a, e, saved, grads_saved, mains_saved, host)


def device_memory(device: torch.device) -> Optional[int]:
    """Total memory of a CUDA device in bytes; None elsewhere (host memory is not checked)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def check_state_fits(budget: StateBudget, total: Optional[int], *, fsdp: bool) -> None:
    """Raise a :class:`ConfigError` naming what shrinks the state when it alone exceeds ``total``
    bytes; log what is left for activations otherwise."""
    if total is None:
        log.info("per-parameter state on this rank: %s", budget.describe())
        return
    left = total - budget.total
    if left > 0:
        log.info("per-parameter state on this rank: %s of %s; %s left for activations",
                 budget.describe(), size(total), size(left))
        return
    fixes = ([f"trainer.ema_offload=True (-{size(budget.ema)})"] if budget.ema else []) + \
        ([f"optim.exp_avg_dtype=bf16 and optim.exp_avg_sq_dtype=bf16 (-{size(budget.bf16_moments_save)})"]
         if budget.bf16_moments_save else []) + \
        ([f"optim.main_grads_dtype=bf16 (-{size(budget.bf16_grads_save)})"] if budget.bf16_grads_save else []) + \
        ([f"optim.split_main_params=True (-{size(budget.split_mains_save)})"] if budget.split_mains_save else []) + \
        ([] if fsdp else ["optim.use_distributed_optimizer=True over more data-parallel ranks or parallel.fsdp=torch "
                          "(shard the main weights, moments and EMA)"]) + \
        ["parallel.tensor_model_parallel_size / pipeline_model_parallel_size (fewer parameters per rank)"]
    raise ConfigError(f"the per-parameter state of this rank needs {budget.describe()} but the device has "
                      f"{size(total)}, before any activation; set " + ", or ".join(fixes))
