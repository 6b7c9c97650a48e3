"""Fréchet distance between two image sets, through torchmetrics' ``FrechetInceptionDistance`` on any of
:mod:`dit_mcore.evaluate.features`' extractors (float64 statistics, torchmetrics' matrix square root)."""
from __future__ import annotations

import torch
from torch import nn

from dit_mcore.errors import ConfigError


def min_samples(extractor: nn.Module) -> int:
    """The fewest images per set that give each set's feature covariance full rank: features + 1."""
    return int(extractor.num_features) + 1


def fid(real: torch.Tensor, fake: torch.Tensor, extractor: nn.Module, *, batch_size: int = 256) -> float:
    """FID of uint8 images ``fake [N, 3, H, W]`` against ``real [M, 3, H', W']``."""
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance
    except ModuleNotFoundError:
        raise ConfigError("FID is computed by torchmetrics: pip install torchmetrics") from None
    need = min_samples(extractor)
    for name, images in (("--num-samples (generated images)", fake), ("the reference's images", real)):
        if len(images) < need:
            raise ConfigError(f"{name}: {len(images)} images; FID on {extractor.num_features} features needs at "
                              f"least {need} per set (a full-rank covariance)")
    # (one process computes it: no sync over a process group the others are not in)
    metric = FrechetInceptionDistance(feature=extractor, reset_real_features=False, sync_on_compute=False,
                                      distributed_available_fn=lambda: False)
    with torch.no_grad():
        for images, is_real in ((real, True), (fake, False)):
            for part in images.split(batch_size):
                metric.update(part, real=is_real)
        return float(metric.compute())
