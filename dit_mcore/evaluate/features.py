"""Feature extractors for FID: each maps uint8 images ``[N, 3, H, W]`` to ``[N, num_features]`` (what
torchmetrics' ``FrechetInceptionDistance`` takes as ``feature``).

- ``digits``: :class:`DigitFeatures`, a small CNN trained on the built-in digits' training scans (never the
  held-out ones) to read their class, in a few seconds on first use, seeded (the same network every time); its
  64 penultimate activations are the features. FID on the digits demo is then a real number on a CPU.
- ``inception``: torchmetrics' InceptionV3 (2,048 pool features, the published FID's), which needs
  ``torch-fidelity`` and its weights: downloaded on first use where a network exists, else
  ``--inception-weights FILE``.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from dit_mcore.errors import ConfigError

log = logging.getLogger("dit_mcore.evaluate")

FEATURES = ("digits", "inception")
DIGITS_SIZE = 16


class DigitFeatures(nn.Module):
    """Two conv blocks and a 64-wide linear layer (the features), then the class head it was trained with."""

    num_features = 64

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                  nn.Linear(32 * (DIGITS_SIZE // 4) ** 2, self.num_features))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(self.num_features, 10))  # (features before the ReLU: no dead ones)

    @staticmethod
    def prepare(images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, C, H, W]`` -> grey float ``[N, 1, 16, 16]`` in [-1, 1]."""
        x = images.float() / 127.5 - 1.0
        x = x.mean(1, keepdim=True)
        if x.shape[-2:] != (DIGITS_SIZE, DIGITS_SIZE):
            x = F.interpolate(x, size=(DIGITS_SIZE, DIGITS_SIZE), mode="bilinear", antialias=True, align_corners=False)
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(self.prepare(images))

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        """The class it reads in each image (``[N]``)."""
        return self.head(self(images)).argmax(-1)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] as uint8 (what the extractors take)."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


@functools.lru_cache(maxsize=1)
def digit_features(seed: int = 0, epochs: int = 8) -> DigitFeatures:
    """The digits feature network, trained (once per process, seconds on a CPU) on the 1,618 training scans."""
    from dit_mcore.training.data import digits_split
    images, labels = digits_split(DIGITS_SIZE, held_out=False)
    x = to_uint8(images).expand(-1, 3, -1, -1)
    with torch.random.fork_rng(devices=[]):  # (the network trains on the CPU)
        torch.manual_seed(seed)
        net = DigitFeatures()
        opt = torch.optim.Adam(net.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for idx in torch.randperm(len(x), generator=g).split(64):
                loss = F.cross_entropy(net.head(net(x[idx])), labels[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return net.eval().requires_grad_(False)


def build_extractor(name: str, inception_weights=None) -> nn.Module:
    """The feature extractor ``name`` (:data:`FEATURES`)."""
    if name == "digits":
        return digit_features()
    if name != "inception":
        raise ConfigError(f"--features={name!r}: use one of {', '.join(FEATURES)}")
    try:
        from torchmetrics.image.fid import NoTrainInceptionV3
        net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                                 feature_extractor_weights_path=inception_weights)
        net.num_features = 2048
        return net
    except ModuleNotFoundError as e:
        raise ConfigError(f"--features=inception needs torch-fidelity ({e}); pip install torch-fidelity, or use "
                          "--features digits for the built-in digits") from None
    except (OSError, RuntimeError) as e:  # no network and no --inception-weights
        raise ConfigError(f"--features=inception: its weights could not be read or downloaded ({e}); pass "
                          "--inception-weights FILE (pt_inception-2015-12-05-6726825d.pth)") from None
