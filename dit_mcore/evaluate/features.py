"""Feature extractors for FID: each maps uint8 images ``[N, 3, H, W]`` to ``[N, num_features]`` (what
torchmetrics' ``FrechetInceptionDistance`` takes as ``feature``).

- ``digits``: :class:`DigitFeatures`, a small CNN trained on the built-in digits' training scans (never the
  held-out ones) to read their class, shipped as ``digits_features.pt`` (fp16, 76 KB;
  :func:`train_digit_features` made it, seeded, in seconds); its 64 pre-activation features. FID on the digits
  demo is then a real number on a CPU, the same on every machine.
- ``inception``: torchmetrics' InceptionV3 (2,048 pool features, the published FID's), which needs
  ``torch-fidelity`` and its weights: downloaded on first use where a network exists, else
  ``--inception-weights FILE``.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dit_mcore.errors import ConfigError
from dit_mcore.generate.grid import to_uint8

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



WEIGHTS = Path(__file__).with_name("digits_features.pt")
"""The shipped weights (fp16, 76 KB) of :func:`train_digit_features`'s network: FID numbers compare across
machines only with the same features, and a network trained anew differs with the CPU and its thread count."""


def train_digit_features(seed: int = 0, epochs: int = 8) -> DigitFeatures:
    """The digits feature network trained on the 1,618 training scans (seconds on a CPU; one thread). To refresh
    the shipped weights: ``torch.save(half_state(train_digit_features()), WEIGHTS)``."""
    from dit_mcore.training.data import digits_split
    images, labels = digits_split(DIGITS_SIZE, held_out=False)
    x = to_uint8(images).expand(-1, 3, -1, -1)
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):  # (the network trains on the CPU)
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            net = DigitFeatures()
            opt = torch.optim.Adam(net.parameters(), lr=3e-3)
            g = torch.Generator().manual_seed(seed)
            for _ in range(epochs):
                for idx in torch.randperm(len(x), generator=g).split(64):
                    loss = F.cross_entropy(net.head(net(x[idx])), labels[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        finally:
            torch.set_num_threads(threads)
    return net.eval().requires_grad_(False)


def half_state(net: DigitFeatures) -> dict:
    return {k: v.half() for k, v in net.state_dict().items()}


@functools.lru_cache(maxsize=1)
def digit_features() -> DigitFeatures:
    """The digits feature network, from the shipped weights."""
    net = DigitFeatures()
    net.load_state_dict({k: v.float() for k, v in torch.load(WEIGHTS, map_location="cpu").items()})
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
