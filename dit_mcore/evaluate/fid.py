"""Fréchet distance between two image sets, through torchmetrics' ``FrechetInceptionDistance`` on any of
:mod:`dit_mcore.evaluate.features`' extractors (float64 statistics, torchmetrics' matrix square root)."""
from __future__ import annotations

import torch
from torch import nn

from dit_mcore.errors import ConfigError


def min_samples(extractor: nn.Module) -> int:
    """The fewest images per set that give each set's feature covariance full rank: features + 1."""
    return int(extractor.num_features) + 1


def _metric(extractor: nn.Module):
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance
    except ModuleNotFoundError:
        raise ConfigError("FID is computed by torchmetrics: pip install torchmetrics") from None
    # (one process computes it: no sync over a process group the others are not in)
    return FrechetInceptionDistance(feature=extractor, reset_real_features=False, sync_on_compute=False,
                                    distributed_available_fn=lambda: False)


def _enough(name: str, count: int, extractor: nn.Module) -> None:
    need = min_samples(extractor)
    if count < need:
        raise ConfigError(f"{name}: {count} images; FID on {extractor.num_features} features needs at least {need} "
                          "per set (a full-rank covariance)")


def statistics(real: torch.Tensor, extractor: nn.Module, *, batch_size: int = 256) -> dict:
    """The reference's feature statistics, as FID uses them: ``{"mu": [d], "sigma": [d, d], "n"}`` (float64;
    ``sigma`` the unbiased covariance, as pytorch-fid's and torch-fidelity's ``.npz`` files hold it)."""
    _enough("the reference's images", len(real), extractor)
    metric = _metric(extractor)
    with torch.no_grad():
        for part in real.split(batch_size):
            metric.update(part, real=True)
    n = int(metric.real_features_num_samples)
    mu = metric.real_features_sum / n
    sigma = (metric.real_features_cov_sum - n * torch.outer(mu, mu)) / (n - 1)
    return {"mu": mu, "sigma": sigma, "n": n}


def fid(real, fake: torch.Tensor, extractor: nn.Module, *, batch_size: int = 256) -> float:
    """FID of uint8 images ``fake [N, 3, H, W]`` against ``real``: uint8 images ``[M, 3, H', W']``, or their
    :func:`statistics` (``mu`` and ``sigma`` suffice: the distance depends on nothing else)."""
    _enough("--num-samples (generated images)", len(fake), extractor)
    metric = _metric(extractor)
    with torch.no_grad():
        if isinstance(real, dict):  # the metric's own states, rebuilt from mu and sigma
            mu, sigma = (torch.as_tensor(real[k], dtype=torch.float64) for k in ("mu", "sigma"))
            if mu.shape != (extractor.num_features,) or sigma.shape != (extractor.num_features,) * 2:
                raise ConfigError(f"--reference: statistics of {mu.shape[-1]} features; the extractor has "
                                  f"{extractor.num_features}: give statistics made with the same --features")
            n = int(real.get("n", 2))
            metric.real_features_num_samples = torch.tensor(n)
            metric.real_features_sum = mu * n
            metric.real_features_cov_sum = sigma * (n - 1) + n * torch.outer(mu, mu)
        else:
            _enough("the reference's images", len(real), extractor)
            for part in real.split(batch_size):
                metric.update(part, real=True)
        for part in fake.split(batch_size):
            metric.update(part, real=False)
        return float(metric.compute())
