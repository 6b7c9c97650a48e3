"""Fixes to megatron-core's pure-torch optimizer fallbacks, on any device.

Without apex or Transformer Engine (a plain ``pip install`` on a GPU box, or the CPU) megatron-core
0.16.1 steps with torch's Adam and replaces apex's multi-tensor kernels by its own stand-ins. Six
of those break or slow a run, on a GPU as much as on the CPU:

- **Grad norm.** Its stand-in for apex's ``multi_tensor_l2norm`` builds the norm from host floats:
  one device sync per parameter tensor, every step. :func:`foreach_l2_norm` takes its place (two
  foreach kernels, no host read).
- **Copies and scaling.** The bf16 optimizer copies its fp32 main weights into the bf16 model
  weights after every step one tensor at a time (its multi-tensor path needs apex), and the
  stand-in for ``multi_tensor_scale`` (gradient clipping) launches a multiply and a copy per tensor:
  hundreds of small launches per step while the GPU waits. :func:`foreach_copy` and
  :func:`foreach_scale` do them with foreach kernels (per tensor where DTensors are involved: the
  foreach copy has no DTensor rule).
- **Adam state before a load.** torch's Adam state is empty until the first step, but the
  distributed optimizer's ``sharded_state_dict(is_loading=True)`` asserts one ``step`` value:
  :func:`init_adam_state` fills a fresh optimizer's state before a checkpoint is read, and before
  one is written (a checkpoint taken before the first step, e.g. on preemption, would otherwise
  hold no Adam state and fail to load).
- **Adam state on load.** The ``fully_reshardable`` load copies a ``step`` key that checkpoints
  never hold (the step comes back through ``param_groups``; copying the template's 0 would reset
  Adam's bias correction), and ``load_state_dict`` hands every parameter the same ``step`` tensor,
  which torch's Adam then increments once per parameter. The load skips absent keys and gives each
  parameter its own ``step``.
- **Adam kernel.** megatron builds torch's AdamW with torch's default, the foreach kernels (a dozen
  passes over parameters and moments per step); :func:`set_adam_impl` switches it to the fused
  kernel (one pass), and keeps it so across checkpoint loads (torch's ``load_state_dict`` takes the
  saved groups' flags and leaves a foreach checkpoint's ``step`` tensors on the host).
- **Adam step 0.** megatron writes the shared ``step`` of its non-distributed optimizers only when
  it is nonzero (``if step:``), so the states of a checkpoint taken before the first step come
  back without one, and torch's Adam refuses them. The load gives them step 0.

:func:`apply_fixes` installs them (idempotent) where megatron fell back to its own stand-ins, and
leaves apex's and TE's kernels alone.

**Which Adam.** megatron picks its Adam when it is imported: Transformer Engine's or apex's FusedAdam
where installed (the NGC image), else torch's AdamW. This project's steps (the flat AdamW, bf16 moments,
split main weights) are torch's AdamW, so :func:`choose_adam`
makes megatron build torch's AdamW for every ``optim.adam_impl`` but ``"megatron"`` (its own pick),
setting megatron's module flags as its import sets them without TE and apex (TE's and apex's
multi-tensor kernels stay in use for clipping, norms and copies).
"""
from __future__ import annotations

from typing import Optional

import torch

from dit_mcore.parallel.adam_step import step_device

_applied = False


def uses_torch_optimizer() -> bool:
    """Whether megatron-core builds torch's Adam now (no apex or Transformer Engine, or
    :func:`choose_adam`)."""
    from megatron.core import optimizer
    return bool(optimizer.USING_PYTORCH_OPTIMIZER)


_MEGATRONS_PICK: Optional[dict] = None  # megatron's Adam flags as its import set them


def _megatrons_pick() -> dict:
    global _MEGATRONS_PICK
    if _MEGATRONS_PICK is None:
        from megatron.core import optimizer
        from megatron.core.optimizer import distrib_optimizer as dist
        _MEGATRONS_PICK = {(optimizer, "USING_PYTORCH_OPTIMIZER"): optimizer.USING_PYTORCH_OPTIMIZER,
                           (dist, "HAVE_APEX_OR_TE"): dist.HAVE_APEX_OR_TE,
                           (dist, "USING_TE_OPTIMIZER"): dist.USING_TE_OPTIMIZER,
                           (dist, "USING_APEX_OPTIMIZER"): dist.USING_APEX_OPTIMIZER}
    return _MEGATRONS_PICK


def builds_torch_adam(impl: str) -> bool:
    """Whether megatron builds torch's AdamW for ``optim.adam_impl=impl`` (:func:`choose_adam`)."""
    from megatron.core import optimizer
    return impl != "megatron" or _megatrons_pick()[(optimizer, "USING_PYTORCH_OPTIMIZER")]


def choose_adam(impl: str) -> None:
    """Make megatron build torch's AdamW for ``optim.adam_impl=impl`` (every value but "megatron"),
    else the Adam it picked at import; process-wide, before its optimizer is built (its checkpoint
    code reads the same flags)."""
    pick = _megatrons_pick()
    torch_adam = builds_torch_adam(impl)
    for (module, name), value in pick.items():
        setattr(module, name, (name == "USING_PYTORCH_OPTIMIZER") if torch_adam else value)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """apex's ``multi_tensor_l2norm`` contract (``(norm of all tensors, per-tensor norms)``) in two
    foreach kernels and no host read; per-tensor norms in fp32, as apex's (of bf16 gradients too)."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)  # megatron norms only gradients with it
    total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1)
    return total, None


def _has_dtensor(tensors) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(t, DTensor) for t in tensors)


def foreach_copy(this, that, overflow_buf=None) -> None:
    """megatron's ``_multi_tensor_copy_this_to_that`` (``that[i] = this[i]``, any dtypes) as one
    foreach copy instead of a ``copy_`` per tensor."""
    if not this:
        return
    if _has_dtensor(this) or _has_dtensor(that):
        for src, dst in zip(this, that):
            dst.copy_(src)
    else:
        torch._foreach_copy_(list(that), list(this))


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """apex's ``multi_tensor_scale`` contract (``dst = src * scale``, any dtypes) with foreach
    kernels: in place when the two lists are the same tensors (clipping), else a multiply and one
    foreach copy."""
    src, dst = tensor_lists
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif isinstance(scale, (int, float)) and scale == 1.0:
        foreach_copy(src, dst)
    else:
        foreach_copy(torch._foreach_mul(src, scale), dst)


def torch_adams(optimizer) -> list:
    """The torch Adam/AdamW instances inside a megatron (possibly chained) optimizer."""
    inners = (getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer]))
    return [inner for inner in inners if isinstance(inner, torch.optim.Adam)]


def init_adam_state(optimizer) -> None:
    """Give every parameter of a fresh torch-Adam-backed megatron optimizer an empty Adam state, so
    its ``sharded_state_dict(is_loading=True)`` can describe the tensors to load."""
    for inner in torch_adams(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
        place_steps(inner)


def set_adam_impl(optimizer, impl: str) -> None:
    """Step megatron's torch AdamW with ``impl``: "fused" (torch's fused kernel), "flat" (the parts
    :func:`dit_mcore.training.flat_adam.install` flattened step flat, every part is flagged fused:
    the flat optimizer is torch's fused AdamW where its layout does not hold) or "foreach", now and
    after every ``load_state_dict`` (which takes the flags of the checkpoint's groups). No-op where
    megatron uses apex's or TE's FusedAdam."""
    if impl not in ("flat", "fused", "foreach"):
        raise ValueError(f"optim.adam_impl={impl!r}: use 'flat', 'fused' or 'foreach'")
    fused = impl != "foreach"

    def apply(inner, *_):
        for group in inner.param_groups:
            group["fused"], group["foreach"] = fused, not fused
        place_steps(inner)

    for inner in torch_adams(optimizer):
        apply(inner)
        inner.register_load_state_dict_post_hook(apply)


def place_steps(inner) -> None:
    """Each ``step`` where torch's Adam kernel wants it (:func:`~dit_mcore.parallel.adam_step.step_device`, in
    float32). torch creates them so; a load (e.g. from a checkpoint of a fused run) or :func:`init_adam_state`
    may not."""
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p)
            if not state or not torch.is_tensor(state.get("step")):
                continue
            where = step_device(group, p)
            if state["step"].device != where:
                state["step"] = state["step"].to(device=where, dtype=torch.float32)


def apply_fixes() -> bool:
    """Install the fixes (idempotent): the l2 kernel wherever megatron fell back to its stand-in,
    the Adam-state fixes when it uses torch's optimizer; True if the latter are in place."""
    global _applied
    _norm_without_host_reads()  # gated by the kernel megatron picked, which the apex/TE checks decide apart
    _scale_with_foreach()
    _copy_with_foreach()
    if _applied or not uses_torch_optimizer():
        return _applied
    _load_adam_state_per_parameter()
    _load_step_zero()
    _offloaded_state_at_load()
    _applied = True
    return True


def _norm_without_host_reads() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm
    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm


def _scale_with_foreach() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import local_multi_tensor_scale
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def _copy_with_foreach() -> None:
    from megatron.core.optimizer import optimizer
    from megatron.core.utils import local_multi_tensor_applier
    if optimizer.multi_tensor_applier is local_multi_tensor_applier:  # no apex/TE multi-tensor kernels
        optimizer._multi_tensor_copy_this_to_that = foreach_copy


def _load_adam_state_per_parameter() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_set = DistributedOptimizer._set_main_param_and_optimizer_states
    original_load = DistributedOptimizer.load_state_dict

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors and key != "step":  # the step comes back through param_groups
                dst.copy_(tensors[key])

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():  # un-share the one step tensor megatron handed out
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer.load_state_dict = load_state_dict


def _offloaded_state_at_load() -> None:
    """``optim.cpu_offload`` (megatron's HybridDeviceOptimizer under its distributed optimizer): megatron gives
    the hybrid optimizer no state initialiser, and with torch's AdamW (no TE, no apex) its ``state_dict``
    wants a step in every state, so a checkpoint's template cannot be made before the first step. Loading,
    the states are first made with megatron's own dummy step (its values are replaced by the checkpoint's).
    And its state loading assumes low-precision parameters (see ``update_fp32_params_by_new_state``)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, *args, **kwargs):
        if is_loading and isinstance(self.optimizer, HybridDeviceOptimizer) and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict

    def update_fp32_params_by_new_state(self):
        # megatron indexes every state's parameter among its fp32 copies, which only low-precision parameters have
        # (the distributed optimizer hands it fp32 main weights: KeyError); those are their own master weights
        for param, state in self.state.items():
            copy = self.param_to_fp32_param.get(param) if self.param_update_in_fp32 else None
            if copy is not None:
                copy.data.copy_(state["master_param"])

    HybridDeviceOptimizer._update_fp32_params_by_new_state = update_fp32_params_by_new_state


def _load_step_zero() -> None:
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    def patched(original, optimizer_keys):
        def load_state_dict(self, state_dict):
            inner = next((state_dict[key] for key in optimizer_keys if key in state_dict), state_dict)
            if "common_step" not in inner["state"] and isinstance(self.optimizer, torch.optim.Adam):
                # Written at step 0 (megatron's ``if step:``), or by TE's/apex's FusedAdam, which keeps the
                # step in each param group: take it from there, else 0.
                group_step = {i: g.get("step") or 0 for g in inner.get("param_groups", []) for i in g.get("params", [])}
                for key, state in inner["state"].items():
                    if isinstance(state, dict) and state and "step" not in state:
                        state["step"] = torch.tensor(float(group_step.get(key, 0)))
            return original(self, state_dict)
        return load_state_dict

    FP32Optimizer.load_state_dict = patched(FP32Optimizer.load_state_dict, ())
    Float16OptimizerWithFloat16Params.load_state_dict = patched(
        Float16OptimizerWithFloat16Params.load_state_dict, ("optimizer", "optimizer_state_dict"))
