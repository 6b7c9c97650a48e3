"""Patchify / unpatchify between latents ``[B, C, T, H, W]`` (or images ``[B, C, H, W]``) and tokens.

Token layout: tokens are ordered frame-major, then row, then column (``t, h, w``); the values of one
token are ordered ``(C, pt, ph, pw)`` — the flattening of a Conv3d/Conv2d patch-embedding weight
``[hidden, C, pt, ph, pw]``, so a Linear on tokens equals the reference convolution. The energon
task encoder uses the same order.
"""
from __future__ import annotations

import torch


def patchify(x: torch.Tensor, patch: int, patch_t: int = 1) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[B, C, T, H, W]`` or ``[B, C, H, W]`` -> tokens ``[B, t*h*w, C*pt*p*p]`` and grid ``(t, h, w)``."""
    if x.dim() == 4:
        x = x.unsqueeze(2)
    b, c, T, H, W = x.shape
    if T % patch_t or H % patch or W % patch:
        raise ValueError(f"latent of shape {tuple(x.shape[2:])} (T, H, W) is not divisible by the "
                         f"patch sizes (pt={patch_t}, p={patch}); resize or crop the input")
    t, h, w = T // patch_t, H // patch, W // patch
    x = x.reshape(b, c, t, patch_t, h, patch, w, patch)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # b, t, h, w, C, pt, ph, pw
    return x.reshape(b, t * h * w, c * patch_t * patch * patch), (t, h, w)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], channels: int, patch: int,
               patch_t: int = 1, squeeze_time: bool = True) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, t*h*w, C*pt*p*p]`` -> ``[B, C, T, H, W]`` (``[B, C, H, W]``
    when ``T == 1`` and ``squeeze_time``)."""
    t, h, w = grid
    b = tokens.shape[0]
    x = tokens.reshape(b, t, h, w, channels, patch_t, patch, patch)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, channels, t * patch_t, h * patch, w * patch)
    return x.squeeze(2) if squeeze_time and x.shape[2] == 1 else x
