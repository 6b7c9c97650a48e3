"""Call our token-space ``DiT`` with the reference implementations' image-space signature."""
from __future__ import annotations

from typing import Optional

import torch

from dit_mcore.models.adapter import image_forward
from dit_mcore.models.dit.model import DiT


def reference_forward(model: DiT, x: torch.Tensor, t: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``DiT.forward(x, t, y)`` of facebookresearch/diffusers: latents ``x [B, C, H, W]``, timesteps
    ``t [B]`` on the reference scale (0..999, integer or float), labels ``y [B]`` ->
    ``[B, C_out, H, W]`` (``C_out = 2C`` when ``learn_sigma``; the first ``C`` are the prediction)."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, C, H, W], got {tuple(x.shape)}")
    return image_forward(model, model.config, x, t, y, keep_sigma=True)
