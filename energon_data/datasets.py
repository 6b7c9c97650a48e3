"""Built-in datasets small enough to ship with the package and train on a CPU.

``load_digits`` gives scikit-learn's bundled handwritten digits (1797 real 8x8 scans, no
download) upscaled to a chosen size; ``moving_digits`` animates those digits into short
videos with a caption that names the digit and its direction of motion. Both return pixels
in [-1, 1] so they can be fed to the identity (pixel-space) encoder directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

DIGITS_NATIVE_SIZE = 8
DIGITS_MAX_VALUE = 16.0  # sklearn's digits are integer ink counts in [0, 16]
NUM_DIGIT_CLASSES = 10

# Unit steps (dy, dx) in image coordinates (y grows downwards) and their caption words.
DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (0, -1),
    "right": (0, 1),
    "up": (-1, 0),
    "down": (1, 0),
}


@lru_cache(maxsize=1)
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return bunch.images.astype(np.float32), bunch.target.astype(np.int64)


def load_digits(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images, labels)``: float32 ``[1797, 1, size, size]`` in [-1, 1] and int64 ``[1797]``.

    The native 8x8 scans are resized with bicubic interpolation (antialiased when shrinking)
    and clamped, because bicubic overshoots the [-1, 1] range near strokes.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"load_digits: size must be a positive int, got {size!r}")
    raw, labels = _raw_digits()
    images = torch.from_numpy(raw).unsqueeze(1) / DIGITS_MAX_VALUE * 2.0 - 1.0
    if size != DIGITS_NATIVE_SIZE:
        images = F.interpolate(
            images, size=(size, size), mode="bicubic", align_corners=False, antialias=size < DIGITS_NATIVE_SIZE
        ).clamp_(-1.0, 1.0)
    return images.contiguous(), torch.from_numpy(labels.copy())


@dataclass
class MovingDigits:
    """Videos of a digit sliding across a dark canvas and bouncing off its edges."""

    videos: torch.Tensor
    """float32 ``[N, 1, frames, size, size]`` in [-1, 1]; background is -1."""
    labels: torch.Tensor
    """int64 ``[N]``: the digit class shown in each video."""
    captions: list[str]
    """e.g. ``"a 3 moving left"``: the direction of motion until the first bounce (frame 0 -> 1 always moves that way)."""
    directions: list[str]
    """Direction word of each video (a key of ``DIRECTIONS``)."""
    positions: torch.Tensor
    """int64 ``[N, frames, 2]``: top-left ``(y, x)`` of the digit sprite in every frame."""
    sprite_size: int
    """Side of the square digit sprite in pixels."""


def _bounce(pos: int, vel: int, limit: int) -> tuple[int, int]:
    """Advance one step inside [0, limit], reflecting off the walls."""
    nxt = pos + vel
    if nxt < 0:
        return -nxt, -vel
    if nxt > limit:
        return 2 * limit - nxt, -vel
    return nxt, vel


def moving_digits(
    num_videos: int, frames: int = 8, size: int = 32, seed: int = 0, *, sprite_size: int | None = None,
    max_speed: int = 3, scans: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> MovingDigits:
    """Generate ``num_videos`` videos of a real handwritten digit drifting over ``frames`` frames.

    Each video picks a digit scan, a start position, one of four directions and a speed in
    ``[1, max_speed]`` pixels per frame; the sprite bounces off the canvas edges so it always
    stays fully inside. Pixels are composited with ``max`` so the digit is drawn over the -1
    background. Deterministic for a given ``seed``. ``scans``: ``(images [n, 1, sprite, sprite] in
    [-1, 1], labels [n])`` to draw from (default: every scan, :func:`load_digits` at the sprite size).
    """
    sprite = size // 2 if sprite_size is None else sprite_size
    if num_videos < 0 or frames < 1:
        raise ValueError(f"moving_digits: need num_videos >= 0 and frames >= 1, got {num_videos}, {frames}")
    if not 1 <= sprite <= size:
        raise ValueError(f"moving_digits: sprite_size must be in [1, size={size}], got {sprite}")
    limit = size - sprite  # largest top-left coordinate that keeps the sprite on the canvas
    if max_speed < 1 or (limit < max_speed and frames > 1):
        raise ValueError(
            f"moving_digits: canvas size {size} leaves only {limit} px of travel for a {sprite}px sprite; "
            f"use a larger size or smaller sprite_size than max_speed={max_speed} allows"
        )

    digits, digit_labels = load_digits(sprite) if scans is None else scans
    if digits.shape[-2:] != (sprite, sprite):
        raise ValueError(f"moving_digits: scans of {tuple(digits.shape[-2:])} for a {sprite}px sprite")
    rng = np.random.default_rng(seed)
    names = list(DIRECTIONS)
    videos = torch.full((num_videos, 1, frames, size, size), -1.0)
    labels = torch.empty(num_videos, dtype=torch.int64)
    positions = torch.empty(num_videos, frames, 2, dtype=torch.int64)
    captions, directions = [], []
    for n in range(num_videos):
        idx = int(rng.integers(len(digits)))
        direction = names[int(rng.integers(len(names)))]
        speed = int(rng.integers(1, max_speed + 1))
        vel = [d * speed for d in DIRECTIONS[direction]]
        # Start far enough from the wall ahead that the first step goes the captioned way.
        lo = [max(0, -v) for v in vel]
        hi = [limit - max(0, v) for v in vel]
        pos = [int(rng.integers(lo[a], hi[a] + 1)) for a in range(2)]
        for t in range(frames):
            y, x = pos
            positions[n, t] = torch.tensor(pos)
            region = videos[n, 0, t, y : y + sprite, x : x + sprite]
            torch.maximum(region, digits[idx, 0], out=region)
            for axis in range(2):
                pos[axis], vel[axis] = _bounce(pos[axis], vel[axis], limit)
        label = int(digit_labels[idx])
        labels[n] = label
        directions.append(direction)
        captions.append(f"a {label} moving {direction}")
    return MovingDigits(videos, labels, captions, directions, positions, sprite)


@lru_cache(maxsize=1)
def moving_digits_text_encoder():
    """The text encoder of the built-in ``moving_digits`` captions (``tiny_text``: deterministic, 32
    wide), built once per process for the data, the config check, previews and generation."""
    from energon_data.encoders import build_text_encoder
    return build_text_encoder("tiny_text")
