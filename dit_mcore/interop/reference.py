"""Call our token-space ``DiT`` with the reference implementations' image-space signature."""
from __future__ import annotations

from typing import Optional

import torch

from dit_mcore.models import DiT, patchify, unpatchify


def reference_forward(model: DiT, x: torch.Tensor, t: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``DiT.forward(x, t, y)`` of facebookresearch/diffusers: latents ``x [B, C, H, W]``, timesteps
    ``t [B]`` on the reference scale (0..999, integer or float), labels ``y [B]`` ->
    ``[B, C_out, H, W]`` (``C_out = 2C`` when ``learn_sigma``; the first ``C`` are the prediction)."""
    cfg = model.config
    if x.dim() != 4 or x.shape[1] != cfg.in_channels:
        raise ValueError(f"x must be [B, {cfg.in_channels}, H, W] (in_channels={cfg.in_channels}), "
                         f"got {tuple(x.shape)}")
    tokens, grid = patchify(x, cfg.patch_size)
    out = model(tokens.transpose(0, 1), t, y, grid=grid)
    return unpatchify(out.transpose(0, 1), grid, cfg.out_channels, cfg.patch_size)
