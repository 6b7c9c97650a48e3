"""EDM (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models").

``x = x0 + sigma eps``. The raw network F is preconditioned into the denoiser
``D(x, sigma) = c_skip x + c_out F(c_in x, c_noise)`` and trained with weight
``lambda = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2`` on ``(D - x0)^2``.

Since ``lambda c_out^2 = 1``, that loss equals ``(F - F_target)^2`` with the effective target
``F_target = (x0 - c_skip x) / c_out``; ``prepare`` builds exactly that, so the shared
``Objective.loss`` applies to the raw network output and no D needs materialising in training.

Timestep units: the network sees ``timestep_scale * c_noise`` with Karras' ``c_noise = ln(sigma)/4``
(about -1.6 .. 1.1 over the default sigma range). The DiT's sinusoidal embedder accepts any real
value; ``timestep_scale`` exists to spread it over more of the embedding's frequencies if wanted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from dit_mcore.diffusion import timesteps as ts
from dit_mcore.diffusion.objective import (ModelFn, Objective, TrainInputs, as_level, broadcast_level,
                                           check_batch, compute_dtype)


@dataclass
class EDMConfig:
    """EDM objective and sampler settings (defaults: Karras et al. 2022, Table 1)."""

    sigma_data: float = 0.5
    """Std of the data (latents should be scaled so this holds); sets the preconditioning."""
    p_mean: float = -1.2
    """Mean of ln(sigma) for training draws."""
    p_std: float = 1.2
    """Std of ln(sigma) for training draws (> 0)."""
    sigma_min: float = 0.002
    """Smallest non-zero sigma of the sampling schedule."""
    sigma_max: float = 80.0
    """Largest sigma of the sampling schedule; sampling starts from ``sigma_max * noise``."""
    rho: float = 7.0
    """Schedule curvature: levels are uniform in ``sigma^(1/rho)``."""
    timestep_scale: float = 1.0
    """The network sees ``timestep_scale * ln(sigma)/4``; 1 is Karras' convention."""

    def __post_init__(self):
        for field in ("sigma_data", "p_std", "sigma_min", "rho"):
            if getattr(self, field) <= 0:
                raise ValueError(f"EDMConfig.{field} must be > 0, got {getattr(self, field)}")
        if self.sigma_max <= self.sigma_min:
            raise ValueError(f"EDMConfig.sigma_max ({self.sigma_max}) must exceed sigma_min ({self.sigma_min})")


class Preconditioning(NamedTuple):
    """Karras' ``c_skip, c_out, c_in, c_noise`` for a batch of sigmas (each ``[N]``)."""

    c_skip: torch.Tensor
    c_out: torch.Tensor
    c_in: torch.Tensor
    c_noise: torch.Tensor


class EDMObjective(Objective):
    """x0-prediction with Karras preconditioning. The noise level is sigma > 0."""

    name = "edm"

    def __init__(self, config: Optional[EDMConfig] = None):
        self.config = config or EDMConfig()

    def sample_level(self, n: int, *, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        # Not clipped to [sigma_min, sigma_max], as in Karras: training covers the whole log-normal.
        return ts.log_normal(n, self.config.p_mean, self.config.p_std, generator=generator, device=device)

    def level_quantile(self, q: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.config.p_mean + self.config.p_std * torch.special.ndtri(q)).float()

    def preconditioning(self, sigma: torch.Tensor) -> Preconditioning:
        sd2 = self.config.sigma_data ** 2
        total = sigma.square() + sd2
        return Preconditioning(c_skip=sd2 / total, c_out=sigma * self.config.sigma_data / total.sqrt(),
                               c_in=total.rsqrt(), c_noise=0.25 * sigma.log())

    def loss_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """Karras' lambda(sigma) on the x0-space error ``(D - x0)^2``."""
        sd = self.config.sigma_data
        return (sigma.square() + sd ** 2) / (sigma * sd).square()

    def timestep(self, level: torch.Tensor) -> torch.Tensor:
        return self.config.timestep_scale * 0.25 * level.log()

    def prepare(self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor) -> TrainInputs:
        # sigma must be > 0 (sample_level guarantees it); not checked here, since that would cost a
        # device->host sync every step.
        check_batch(x0, noise, level)
        dtype = compute_dtype(x0, level)
        x0c, eps, sigma = x0.to(dtype), noise.to(dtype), level.to(dtype)
        pre = self.preconditioning(sigma)
        x = x0c + broadcast_level(sigma, x0c) * eps
        target = (x0c - broadcast_level(pre.c_skip, x) * x) / broadcast_level(pre.c_out, x)
        # lambda * c_out^2 == 1 analytically; written out so the x0-space weighting stays visible.
        weight = self.loss_weight(sigma) * pre.c_out.square()
        return TrainInputs(model_input=(broadcast_level(pre.c_in, x) * x).to(x0.dtype),
                           timestep=self.timestep(level), target=target, weight=weight)

    def denoise(self, model_fn: ModelFn, x: torch.Tensor, sigma, **cond) -> torch.Tensor:
        """Denoiser ``D(x, sigma)``: the x0 estimate for the noisy state ``x [N, ...]`` at ``sigma``
        (float or ``[N]``, > 0)."""
        sigma = as_level(sigma, x.shape[0], x)
        pre = self.preconditioning(sigma.to(compute_dtype(x, sigma)))
        out = model_fn((broadcast_level(pre.c_in, x) * x).to(x.dtype), self.timestep(sigma), **cond)
        return broadcast_level(pre.c_skip, x) * x + broadcast_level(pre.c_out, x) * out
