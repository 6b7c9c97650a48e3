"""Patchify / unpatchify between latents ``[B, C, T, H, W]`` (or images ``[B, C, H, W]``) and tokens:
the one home of the token layout, shared by the loaders, the model, previews and interop.

Token layout: tokens are ordered frame-major, then row, then column (``t, h, w``); the values of one
token are ordered ``(C, pt, ph, pw)`` — the flattening of a Conv3d/Conv2d patch-embedding weight
``[hidden, C, pt, ph, pw]``, so a Linear on tokens equals the reference convolution. The energon
task encoder uses the same order.
"""
from __future__ import annotations

import torch


def _hw(patch) -> tuple[int, int]:
    return (patch, patch) if isinstance(patch, int) else (int(patch[0]), int(patch[1]))


def patchify(x: torch.Tensor, patch, patch_t: int = 1) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[B, C, T, H, W]`` or ``[B, C, H, W]`` -> tokens ``[B, t*h*w, C*pt*ph*pw]`` and grid ``(t, h, w)``.
    ``patch`` is the spatial patch side, or ``(ph, pw)``."""
    ph, pw = _hw(patch)
    if x.dim() == 4:
        x = x.unsqueeze(2)
    b, c, T, H, W = x.shape
    if T % patch_t or H % ph or W % pw:
        raise ValueError(f"latent of shape {tuple(x.shape[2:])} (T, H, W) is not divisible by the "
                         f"patch sizes (pt={patch_t}, ph={ph}, pw={pw}); resize or crop the input")
    t, h, w = T // patch_t, H // ph, W // pw
    x = x.reshape(b, c, t, patch_t, h, ph, w, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # b, t, h, w, C, pt, ph, pw
    return x.reshape(b, t * h * w, c * patch_t * ph * pw), (t, h, w)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], channels: int, patch,
               patch_t: int = 1, squeeze_time: bool = True) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, t*h*w, C*pt*ph*pw]`` -> ``[B, C, T, H, W]`` (``[B, C, H, W]``
    when ``T == 1`` and ``squeeze_time``)."""
    ph, pw = _hw(patch)
    t, h, w = (int(g) for g in grid)
    b = tokens.shape[0]
    x = tokens.reshape(b, t, h, w, channels, patch_t, ph, pw)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, channels, t * patch_t, h * ph, w * pw)
    return x.squeeze(2) if squeeze_time and x.shape[2] == 1 else x


def grid_positions(grid) -> torch.Tensor:
    """``[t*h*w, 3]`` int64 ``(t, h, w)`` coordinates of a grid's tokens, in token order."""
    t, h, w = (int(g) for g in grid)
    idx = torch.arange(t * h * w)
    return torch.stack([idx // (h * w), (idx // w) % h, idx % w], dim=1)
