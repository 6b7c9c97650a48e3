"""Deterministic ODE samplers: Euler or Heun steps down the objective's schedule (rectified flow:
``flow_schedule``; EDM: the Karras sigmas), with classifier-free guidance batched in one call or
split over two ranks (CFG-parallel).

Every sampler takes standard-normal ``noise [N, ...]`` and returns data-space samples of the same
shape and dtype; equal noise gives equal samples. The state is integrated in >= float32 (a bf16 state
would round away small late steps). The network is reached only through the objective's
``velocity``/``denoise``, i.e. through the training-time calling convention.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dit_mcore.diffusion import timesteps as ts
from dit_mcore.diffusion.ddpm import DDPMObjective, ddim, ddpm
from dit_mcore.diffusion.edm import EDMObjective
from dit_mcore.diffusion.flow import FlowObjective
from dit_mcore.diffusion.guidance import bind_guidance
from dit_mcore.diffusion.objective import ModelFn, Objective, compute_dtype

SAMPLERS = {"flow": ("euler", "heun"), "edm": ("heun", "euler"), "ddpm": ("ddim", "ddpm")}
"""Samplers by objective name, the objective's default first."""


def _solve(slope: Callable, x: torch.Tensor, times: list, heun: bool, *, defined_at_zero: bool) -> torch.Tensor:
    """Integrate ``dx/dtime = slope(x, time)`` along ``times`` with Euler steps, or Heun's (Euler
    plus the trapezoid correction, skipped on a step that ends at 0 unless ``defined_at_zero``:
    EDM's slope divides by sigma)."""
    for a, b in zip(times[:-1], times[1:]):
        d = slope(x, a)
        x_next = x + (b - a) * d
        if heun and (b != 0 or defined_at_zero):
            x_next = x + (b - a) * 0.5 * (d + slope(x_next, b))
        x = x_next
    return x


@torch.no_grad()
def euler_flow(model_fn: ModelFn, noise: torch.Tensor, steps: int, *, objective: Optional[FlowObjective] = None,
               cfg_scale: float = 1.0, labels: Optional[torch.Tensor] = None, null_label: Optional[int] = None,
               shift: Optional[float] = None, text=None, heun: bool = False, cfg_group=None,
               **cond) -> torch.Tensor:
    """Integrate ``dx/dt = v(x, t)`` from t=1 (``x = noise``) to t=0 with ``steps`` Euler steps on
    ``flow_schedule(steps, shift)`` (``heun``: Heun steps, ``2*steps`` network evaluations).
    ``shift`` defaults to the objective's training shift; ``text``: a ``TextContext`` of the
    samples' prompts for text models (guidance drops it to the null text); ``cfg_group``: CFG-parallel."""
    objective = objective or FlowObjective()
    fn = bind_guidance(model_fn, cfg_scale, labels, null_label, text, cfg_group)
    times = ts.flow_schedule(steps, objective.config.shift if shift is None else shift).tolist()
    x = noise.to(compute_dtype(noise))
    x = _solve(lambda x, t: objective.velocity(fn, x, t, **cond).to(x.dtype), x, times, heun, defined_at_zero=True)
    return x.to(noise.dtype)


@torch.no_grad()
def heun_edm(model_fn: ModelFn, noise: torch.Tensor, steps: int, *, objective: Optional[EDMObjective] = None,
             cfg_scale: float = 1.0, labels: Optional[torch.Tensor] = None, null_label: Optional[int] = None,
             sigma_min: Optional[float] = None, sigma_max: Optional[float] = None, rho: Optional[float] = None,
             text=None, heun: bool = True, cfg_group=None, **cond) -> torch.Tensor:
    """Karras et al. Algorithm 1 (deterministic): start at ``sigma_max * noise`` and take ``steps``
    Heun steps down the Karras schedule, without the 2nd-order correction on the last step to
    sigma=0 (``2*steps - 1`` network evaluations); ``heun=False``: Euler steps. Schedule parameters
    default to the objective's."""
    objective = objective or EDMObjective()
    c = objective.config
    sigmas = ts.karras_sigmas(steps, c.sigma_min if sigma_min is None else sigma_min,
                              c.sigma_max if sigma_max is None else sigma_max,
                              c.rho if rho is None else rho).tolist()
    fn = bind_guidance(model_fn, cfg_scale, labels, null_label, text, cfg_group)

    def slope(x: torch.Tensor, sigma: float) -> torch.Tensor:
        return ((x - objective.denoise(fn, x, sigma, **cond)) / sigma).to(x.dtype)

    x = _solve(slope, noise.to(compute_dtype(noise)) * sigmas[0], sigmas, heun, defined_at_zero=False)
    return x.to(noise.dtype)


def sample(objective: Objective, model_fn: ModelFn, noise: torch.Tensor, steps: int, *,
           sampler: Optional[str] = None, **kwargs) -> torch.Tensor:
    """Sample with ``sampler`` (a name from ``SAMPLERS[objective.name]``; None: the objective's
    default, Euler for flow, Heun for EDM, DDIM for DDPM)."""
    names = SAMPLERS.get(objective.name)
    if names is None:
        raise ValueError(f"no sampler for objective {type(objective).__name__}")
    sampler = sampler or names[0]
    if sampler not in names:
        raise ValueError(f"sampler {sampler!r} does not sample the {objective.name!r} objective; use one of {names}")
    if isinstance(objective, DDPMObjective):
        return (ddim if sampler == "ddim" else ddpm)(model_fn, noise, steps, objective=objective, **kwargs)
    heun = sampler == "heun"
    if isinstance(objective, FlowObjective):
        return euler_flow(model_fn, noise, steps, objective=objective, heun=heun, **kwargs)
    return heun_edm(model_fn, noise, steps, objective=objective, heun=heun, **kwargs)
