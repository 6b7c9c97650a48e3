"""Deterministic ODE samplers: Euler for rectified flow, Heun (2nd order) for EDM.

Both take standard-normal ``noise [N, ...]`` and return data-space samples of the same shape and
dtype; equal noise gives equal samples. The state is integrated in >= float32 (a bf16 state would
round away small late steps). The network is reached only through the objective's
``velocity``/``denoise``, i.e. through the training-time calling convention.
"""
from __future__ import annotations

from typing import Optional

import torch

from dit_mcore.diffusion import timesteps as ts
from dit_mcore.diffusion.edm import EDMObjective
from dit_mcore.diffusion.flow import FlowObjective
from dit_mcore.diffusion.guidance import guided
from dit_mcore.diffusion.objective import ModelFn, Objective, compute_dtype


def _with_labels(model_fn: ModelFn, cfg_scale: float, labels: Optional[torch.Tensor],
                 null_label: Optional[int], text=None) -> ModelFn:
    """Bind labels and text (and guidance) so the integrators only see ``fn(x, timestep, **cond)``."""
    if labels is None and text is None:
        if cfg_scale != 1.0:
            raise ValueError(f"cfg_scale={cfg_scale} needs labels (and null_label) or text; pass cfg_scale=1 "
                             "for unconditional sampling")
        return model_fn
    fn = guided(model_fn, cfg_scale, null_label, text=text is not None)
    per_sample = {} if text is None else {"text": text}
    return lambda x, timestep, **cond: fn(x, timestep, labels=labels, **per_sample, **cond)


@torch.no_grad()
def euler_flow(model_fn: ModelFn, noise: torch.Tensor, steps: int, *, objective: Optional[FlowObjective] = None,
               cfg_scale: float = 1.0, labels: Optional[torch.Tensor] = None, null_label: Optional[int] = None,
               shift: Optional[float] = None, text=None, **cond) -> torch.Tensor:
    """Integrate ``dx/dt = v(x, t)`` from t=1 (``x = noise``) to t=0 with ``steps`` Euler steps on
    ``flow_schedule(steps, shift)``. ``shift`` defaults to the objective's training shift; ``text``:
    a ``TextContext`` of the samples' prompts for text models (guidance drops it to the null text)."""
    objective = objective or FlowObjective()
    fn = _with_labels(model_fn, cfg_scale, labels, null_label, text)
    times = ts.flow_schedule(steps, objective.config.shift if shift is None else shift).tolist()
    x = noise.to(compute_dtype(noise))
    for t_cur, t_next in zip(times[:-1], times[1:]):
        x = x + (t_next - t_cur) * objective.velocity(fn, x, t_cur, **cond).to(x.dtype)
    return x.to(noise.dtype)


@torch.no_grad()
def heun_edm(model_fn: ModelFn, noise: torch.Tensor, steps: int, *, objective: Optional[EDMObjective] = None,
             cfg_scale: float = 1.0, labels: Optional[torch.Tensor] = None, null_label: Optional[int] = None,
             sigma_min: Optional[float] = None, sigma_max: Optional[float] = None, rho: Optional[float] = None,
             text=None, **cond) -> torch.Tensor:
    """Karras et al. Algorithm 1 (deterministic): start at ``sigma_max * noise`` and take ``steps``
    Heun steps down the Karras schedule, without the 2nd-order correction on the last step to
    sigma=0 (``2*steps - 1`` network evaluations). Schedule parameters default to the objective's."""
    objective = objective or EDMObjective()
    c = objective.config
    sigmas = ts.karras_sigmas(steps, c.sigma_min if sigma_min is None else sigma_min,
                              c.sigma_max if sigma_max is None else sigma_max,
                              c.rho if rho is None else rho).tolist()
    fn = _with_labels(model_fn, cfg_scale, labels, null_label, text)

    def slope(x: torch.Tensor, sigma: float) -> torch.Tensor:
        return ((x - objective.denoise(fn, x, sigma, **cond)) / sigma).to(x.dtype)

    x = noise.to(compute_dtype(noise)) * sigmas[0]
    for s_cur, s_next in zip(sigmas[:-1], sigmas[1:]):
        d = slope(x, s_cur)
        x_next = x + (s_next - s_cur) * d
        if s_next > 0:
            x_next = x + (s_next - s_cur) * 0.5 * (d + slope(x_next, s_next))
        x = x_next
    return x.to(noise.dtype)


def sample(objective: Objective, model_fn: ModelFn, noise: torch.Tensor, steps: int, **kwargs) -> torch.Tensor:
    """The objective's default sampler: ``euler_flow`` for flow, ``heun_edm`` for EDM."""
    if isinstance(objective, FlowObjective):
        return euler_flow(model_fn, noise, steps, objective=objective, **kwargs)
    if isinstance(objective, EDMObjective):
        return heun_edm(model_fn, noise, steps, objective=objective, **kwargs)
    raise ValueError(f"no sampler for objective {type(objective).__name__}")
