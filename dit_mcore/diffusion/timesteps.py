"""Noise levels: per-sample training draws and the deterministic sampling schedules.

Training draws are made on the generator's device and then moved, so a seeded generator yields the
same levels whatever device the batch lives on (CPU/GPU runs and resumed runs stay comparable).
"""
from __future__ import annotations

from typing import Optional

import torch

from dit_mcore.kernels.host_copy import to_device

# Flow-time sampling distributions accepted by ``FlowConfig.sampling``.
FLOW_TIME_DISTRIBUTIONS = ("logit_normal", "uniform")


def _draw(kind: str, n: int, generator: Optional[torch.Generator], device) -> torch.Tensor:
    if n < 0:
        raise ValueError(f"number of noise levels n must be >= 0, got {n}")
    draw_device = generator.device if generator is not None else (device or "cpu")
    fn = torch.randn if kind == "normal" else torch.rand
    out = fn(n, generator=generator, device=draw_device, dtype=torch.float32)
    return to_device(out, device) if device is not None else out


def logit_normal(n: int, mean: float = 0.0, std: float = 1.0, *, generator: Optional[torch.Generator] = None,
                 device=None) -> torch.Tensor:
    """``n`` times ``t = sigmoid(u)``, ``u ~ N(mean, std^2)`` (SD3's logit-normal), float32 in (0, 1)."""
    return torch.sigmoid(mean + std * _draw("normal", n, generator, device))


def uniform(n: int, *, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
    """``n`` times ``t ~ U[0, 1)``, float32."""
    return _draw("uniform", n, generator, device)


def log_normal(n: int, mean: float, std: float, *, generator: Optional[torch.Generator] = None,
               device=None) -> torch.Tensor:
    """``n`` values ``sigma = exp(u)``, ``u ~ N(mean, std^2)`` (EDM's training distribution), float32."""
    return torch.exp(mean + std * _draw("normal", n, generator, device))


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 resolution shift ``t' = shift*t / (1 + (shift-1)*t)``: shift > 1 moves mass toward noise
    (t=1), which larger images need because more pixels carry the same information. shift=1 is the
    identity; 0 and 1 are fixed points."""
    if shift == 1.0:
        return t
    return shift * t / (1.0 + (shift - 1.0) * t)


def flow_schedule(steps: int, shift: float = 1.0, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """``steps+1`` flow times from 1 (noise) to 0 (data): uniform in t, then ``shift_time``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return shift_time(torch.linspace(1.0, 0.0, steps + 1, dtype=dtype, device=device), shift)


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0, *,
                  dtype=torch.float64, device=None) -> torch.Tensor:
    """Karras et al. (2022) eq. 5: ``steps`` levels from ``sigma_max`` to ``sigma_min`` spaced
    uniformly in ``sigma^(1/rho)``, followed by a final 0 (``steps+1`` values in all)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got sigma_min={sigma_min}, sigma_max={sigma_max}")
    frac = torch.arange(steps, dtype=dtype, device=device) / max(steps - 1, 1)
    lo, hi = sigma_min ** (1.0 / rho), sigma_max ** (1.0 / rho)
    sigmas = (hi + frac * (lo - hi)) ** rho
    return torch.cat([sigmas, sigmas.new_zeros(1)])
