"""Rectified flow / flow matching (Liu et al. 2022; Esser et al. 2024, "SD3").

``x_t = (1 - t) x0 + t eps`` with t=0 data and t=1 noise; the network predicts the velocity
``v = dx_t/dt = eps - x0`` with unit loss weight. Sampling integrates ``dx/dt = v`` from t=1 to t=0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dit_mcore.diffusion import timesteps as ts
from dit_mcore.diffusion.objective import (ModelFn, Objective, TrainInputs, as_level, broadcast_level,
                                           check_batch, compute_dtype)


@dataclass
class FlowConfig:
    """Rectified-flow objective settings."""

    sampling: str = "logit_normal"
    """Training distribution of t: "logit_normal" (SD3 default) or "uniform"."""
    logit_mean: float = 0.0
    """Mean of logit(t) for "logit_normal" sampling; > 0 spends more steps near noise."""
    logit_std: float = 1.0
    """Std of logit(t) for "logit_normal" sampling (> 0)."""
    shift: float = 1.0
    """SD3 resolution shift applied to drawn t and to the sampling schedule (1 = none; SD3 uses 3 at 1024px)."""
    timestep_scale: float = 1000.0
    """The network sees ``timestep_scale * t``: 1000 matches the original DiT's 0..999 timestep range."""

    def __post_init__(self):
        if self.sampling not in ts.FLOW_TIME_DISTRIBUTIONS:
            raise ValueError(f"FlowConfig.sampling={self.sampling!r} is not one of {ts.FLOW_TIME_DISTRIBUTIONS}")
        if self.logit_std <= 0:
            raise ValueError(f"FlowConfig.logit_std must be > 0, got {self.logit_std}")
        if self.shift <= 0:
            raise ValueError(f"FlowConfig.shift must be > 0 (1 disables it), got {self.shift}")


class FlowObjective(Objective):
    """Velocity-prediction rectified flow. The noise level is the flow time t in [0, 1]."""

    name = "flow"

    def __init__(self, config: Optional[FlowConfig] = None):
        self.config = config or FlowConfig()

    def sample_level(self, n: int, *, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        c = self.config
        if c.sampling == "logit_normal":
            t = ts.logit_normal(n, c.logit_mean, c.logit_std, generator=generator, device=device)
        else:
            t = ts.uniform(n, generator=generator, device=device)
        return ts.shift_time(t, c.shift)

    def level_quantile(self, q: torch.Tensor) -> torch.Tensor:
        c = self.config
        t = torch.sigmoid(c.logit_mean + c.logit_std * torch.special.ndtri(q)) if c.sampling == "logit_normal" else q
        return ts.shift_time(t, c.shift).float()

    def timestep(self, level: torch.Tensor) -> torch.Tensor:
        return self.config.timestep_scale * level

    def prepare(self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor) -> TrainInputs:
        check_batch(x0, noise, level)
        dtype = compute_dtype(x0, level)
        x0c, eps = x0.to(dtype), noise.to(dtype)
        t = broadcast_level(level.to(dtype), x0c)
        x_t = (1.0 - t) * x0c + t * eps
        return TrainInputs(model_input=x_t.to(x0.dtype), timestep=self.timestep(level),
                           target=eps - x0c, weight=torch.ones_like(level, dtype=dtype))

    def velocity(self, model_fn: ModelFn, x: torch.Tensor, t, **cond) -> torch.Tensor:
        """Predicted velocity at flow time ``t`` (float or ``[N]``) for the state ``x [N, ...]``."""
        t = as_level(t, x.shape[0], x)
        return model_fn(x, self.timestep(t), **cond)
