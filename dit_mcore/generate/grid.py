"""Sample grids: a batch of images written as one PNG of equal cells for eyeballing training progress.

Layout is row-major with ``nrow`` images per row. For class-conditional grids, sample with
``class_grid_labels(num_classes, per_class)`` and ``nrow=per_class``: row r then holds the
``per_class`` samples of class r (row 0 = class 0).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

MAX_PAD = 2
"""Borders wider than this waste pixels on small-image grids; the cells are what matter."""


def class_grid_labels(num_classes: int, per_class: int, device=None) -> torch.Tensor:
    """Labels ``[0]*per_class + [1]*per_class + ...`` (int64 ``[num_classes * per_class]``)."""
    if num_classes < 1 or per_class < 1:
        raise ValueError(f"num_classes and per_class must be >= 1, got {num_classes}, {per_class}")
    return torch.arange(num_classes, device=device).repeat_interleave(per_class)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Map [-1, 1] to [0, 255]: ``round((x + 1) * 127.5)`` after clamping; NaN is treated as 0 (mid-grey)."""
    x = torch.nan_to_num(images.detach().float().cpu(), nan=0.0).clamp(-1.0, 1.0)
    return ((x + 1.0) * 127.5).round().to(torch.uint8)


def grid_array(images: torch.Tensor, *, nrow: int, pad: int = 2, upscale: int = 1, pad_value: int = 0) -> np.ndarray:
    """The grid as a uint8 array ``[H, W]`` (C=1) or ``[H, W, 3]`` (C=3).

    ``images`` is ``[N, C, h, w]`` in [-1, 1] with C in {1, 3}: other channel counts (e.g. raw
    latents) raise, because showing an arbitrary channel as colour would mislead; decode first, or
    pass ``images[:, :1]`` to view one channel. Each cell is ``upscale`` times the image (nearest
    neighbour, so 8x8 digits stay crisp); ``pad`` pixels of ``pad_value`` surround every cell, so
    ``H = rows * h * upscale + (rows + 1) * pad``, likewise W with ``nrow`` columns. Empty cells of
    a short last row are ``pad_value``.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be [N, C, H, W], got shape {tuple(images.shape)}")
    n, c, h, w = images.shape
    if c not in (1, 3):
        raise ValueError(f"images must have 1 (grey) or 3 (RGB) channels, got C={c}; decode latents to "
                         "pixels first, or select channels (images[:, :1]) to view raw ones")
    if n < 1 or nrow < 1:
        raise ValueError(f"need at least one image and nrow >= 1, got N={n}, nrow={nrow}")
    if not 0 <= pad <= MAX_PAD:
        raise ValueError(f"pad must be in [0, {MAX_PAD}] pixels, got {pad}")
    if upscale < 1 or int(upscale) != upscale:
        raise ValueError(f"upscale must be a positive integer, got {upscale}")
    if not 0 <= pad_value <= 255:
        raise ValueError(f"pad_value must be in [0, 255], got {pad_value}")
    cells = to_uint8(images).repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    ch, cw = h * upscale, w * upscale
    cols, rows = min(nrow, n), math.ceil(n / nrow)
    grid = torch.full((c, rows * ch + (rows + 1) * pad, cols * cw + (cols + 1) * pad), pad_value, dtype=torch.uint8)
    for i in range(n):
        top, left = pad + (i // nrow) * (ch + pad), pad + (i % nrow) * (cw + pad)
        grid[:, top:top + ch, left:left + cw] = cells[i]
    return grid[0].numpy() if c == 1 else grid.permute(1, 2, 0).contiguous().numpy()


def save_grid(images: torch.Tensor, path: str | os.PathLike, *, nrow: int, pad: int = 2, upscale: int = 1,
              pad_value: int = 0) -> Path:
    """Write ``grid_array(images, ...)`` as a PNG at ``path`` (parent folders created); returns the path."""
    array = grid_array(images, nrow=nrow, pad=pad, upscale=upscale, pad_value=pad_value)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format="PNG")
    return path
