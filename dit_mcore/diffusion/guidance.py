"""Classifier-free guidance (Ho & Salimans, 2021): label dropout in training, guided calls in sampling."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dit_mcore.diffusion.objective import ModelFn
from dit_mcore.kernels.host_copy import to_device


def drop_labels(labels: torch.Tensor, p: float, null_label: int,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Replace each label by ``null_label`` independently with probability ``p`` (returns a new tensor).

    The uniform draws are made on the generator's device, as for noise levels, so a seeded run drops
    the same labels on any device.
    """
    if labels.dim() != 1:
        raise ValueError(f"labels must be [N], got shape {tuple(labels.shape)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"label drop probability p must be in [0, 1], got {p}")
    draw_device = generator.device if generator is not None else labels.device
    drop = to_device(torch.rand(labels.shape[0], generator=generator, device=draw_device), labels.device) < p
    return torch.where(drop, torch.full_like(labels, null_label), labels)


def _combine(cond_out: torch.Tensor, uncond_out: torch.Tensor, scale: float, x: torch.Tensor,
             variance: bool) -> torch.Tensor:
    """``uncond + scale * (cond - uncond)``; for a ``variance=True`` call whose output carries learned
    variance channels after the prediction (``2C`` on dim 1), those are the conditional pass's, unguided
    (guidance extrapolates a mean, not a variance)."""
    if variance and cond_out.shape[1] == 2 * x.shape[1]:
        (cond_out, cond_var), uncond_out = cond_out.chunk(2, dim=1), uncond_out.chunk(2, dim=1)[0]
        return torch.cat([uncond_out + scale * (cond_out - uncond_out), cond_var], dim=1)
    return uncond_out + scale * (cond_out - uncond_out)


def guided(model_fn: ModelFn, scale: float, null_label: Optional[int] = None, *, text: bool = False) -> ModelFn:
    """Wrap ``model_fn(x, timestep, labels=..., [text=...], **cond)`` into its guided version with the
    same signature: ``uncond + scale * (cond - uncond)``. The unconditional half has the null label
    (``null_label``) and, for text models, every sample's text dropped to the null text.

    Conditional and unconditional halves run as ONE call on a doubled batch (concatenated along
    dim 0: conditional first), which keeps the two halves on the same kernels and halves launches.
    ``scale == 1`` is exactly the conditional model, called once. Extra ``**cond`` is forwarded
    unchanged to the doubled call, so it must not be per-sample (e.g. a shared token grid).

    Because the combination has weights summing to 1, guiding the raw network output equals
    guiding the denoiser or velocity built from it (they are affine in the output with the same x).
    ``text=True``: the calls carry text, so a text-only model needs no ``null_label``.
    """
    if scale != 1.0 and null_label is None and not text:
        raise ValueError(f"classifier-free guidance with scale={scale} needs null_label (the null class index)")
    if scale == 1.0:
        def conditional(x: torch.Tensor, timestep: torch.Tensor, labels: Optional[torch.Tensor] = None,
                        **cond) -> torch.Tensor:
            return model_fn(x, timestep, labels=labels, **cond)
        return conditional

    def guided_fn(x: torch.Tensor, timestep: torch.Tensor, labels: Optional[torch.Tensor] = None, text=None,
                  **cond) -> torch.Tensor:
        if labels is None and text is None:
            raise ValueError("guided sampling needs per-sample labels or text")
        if labels is not None:
            if null_label is None:
                raise ValueError(f"classifier-free guidance with scale={scale} on labels needs null_label "
                                 "(the null class index)")
            labels = torch.cat([labels, torch.full_like(labels, null_label)])
        if text is not None:
            cond["text"] = text.with_null()
        both = model_fn(torch.cat([x, x]), torch.cat([timestep, timestep]), labels=labels, **cond)
        cond_out, uncond_out = both.chunk(2)
        return _combine(cond_out, uncond_out, scale, x, cond.get("variance", False))
    return guided_fn


def guided_parallel(model_fn: ModelFn, scale: float, null_label: Optional[int] = None, *, group,
                    text: bool = False) -> ModelFn:
    """CFG-parallel (xDiT's ``cfg_parallel``): :func:`guided` split over the two ranks of ``group``.
    Rank 0 of the group calls the conditional half, rank 1 the unconditional half (null label, null
    text), each on the batch's own size; one all-gather of the two predictions per call, and both
    ranks return the same guided prediction, so their sampler states never diverge and need no
    broadcast. Per sample the math is :func:`guided`'s (attention and modulation are per sample)."""
    if dist.get_world_size(group) != 2:
        raise ValueError(f"CFG-parallel splits the two halves over 2 ranks, got a group of {dist.get_world_size(group)}")
    if scale == 1.0:
        raise ValueError("CFG-parallel with scale 1 would compute an unconditional half nobody uses; "
                         "use parallel.cfg_parallel=1")
    if null_label is None and not text:
        raise ValueError(f"classifier-free guidance with scale={scale} needs null_label (the null class index)")
    unconditional = dist.get_rank(group) == 1

    def guided_fn(x: torch.Tensor, timestep: torch.Tensor, labels: Optional[torch.Tensor] = None, text=None,
                  **cond) -> torch.Tensor:
        if labels is None and text is None:
            raise ValueError("guided sampling needs per-sample labels or text")
        if unconditional:
            if labels is not None:
                labels = torch.full_like(labels, null_label)
            if text is not None:
                text = text.dropped()
        if text is not None:
            cond["text"] = text
        out = model_fn(x, timestep, labels=labels, **cond).contiguous()
        halves = [torch.empty_like(out), torch.empty_like(out)]
        dist.all_gather(halves, out, group=group)
        cond_out, uncond_out = halves
        return _combine(cond_out, uncond_out, scale, x, cond.get("variance", False))
    return guided_fn


def bind_guidance(model_fn: ModelFn, cfg_scale: float, labels: Optional[torch.Tensor],
                 null_label: Optional[int], text=None, cfg_group=None) -> ModelFn:
    """Bind labels and text (and guidance) so a sampler's loop only sees ``fn(x, timestep, **cond)``;
    ``cfg_group``: the two ranks of CFG-parallel (None: both halves in one call here)."""
    if labels is None and text is None:
        if cfg_scale != 1.0:
            raise ValueError(f"cfg_scale={cfg_scale} needs labels (and null_label) or text; pass cfg_scale=1 "
                             "for unconditional sampling")
        return model_fn
    if cfg_group is not None:
        fn = guided_parallel(model_fn, cfg_scale, null_label, group=cfg_group, text=text is not None)
    else:
        fn = guided(model_fn, cfg_scale, null_label, text=text is not None)
    per_sample = {} if text is None else {"text": text}
    return lambda x, timestep, **cond: fn(x, timestep, labels=labels, **per_sample, **cond)
