import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits as sk_load_digits

from energon_data.datasets import DIRECTIONS, load_digits, moving_digits


def test_load_digits_native_size_is_exact_rescale():
    images, labels = load_digits(8)
    ref = sk_load_digits()
    expected = torch.from_numpy(ref.images.astype(np.float64) / 16.0 * 2.0 - 1.0).unsqueeze(1)
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32
    torch.testing.assert_close(images.double(), expected, rtol=0, atol=1e-7)
    assert torch.equal(labels, torch.from_numpy(ref.target))


def test_load_digits_upscaled():
    images, labels = load_digits(16)
    assert images.shape == (1797, 1, 16, 16) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.shape == (1797,)
    assert set(labels.tolist()) == set(range(10))
    assert torch.bincount(labels).min() >= 170  # every class is well represented
    assert images.min() == -1.0 and images.max() == 1.0
    # reference: float64 bicubic from the raw scans, clamped
    raw = torch.from_numpy(sk_load_digits().images).double().unsqueeze(1) / 16.0 * 2.0 - 1.0
    ref = F.interpolate(raw, size=(16, 16), mode="bicubic", align_corners=False).clamp(-1, 1)
    torch.testing.assert_close(images.double(), ref, rtol=0, atol=1e-5)


def test_load_digits_rejects_bad_size():
    with pytest.raises(ValueError, match="size"):
        load_digits(0)


def test_moving_digits_motion_bounds_and_captions():
    size, frames = 24, 6
    data = moving_digits(20, frames=frames, size=size, seed=3)
    sprite = data.sprite_size
    assert data.videos.shape == (20, 1, frames, size, size) and data.videos.dtype == torch.float32
    assert data.videos.min() >= -1 and data.videos.max() <= 1
    assert data.positions.min() >= 0 and data.positions.max() <= size - sprite  # always fully on the canvas
    for n in range(20):
        video, pos = data.videos[n, 0], data.positions[n]
        # frames differ (the digit moves) while the sprite content is the same in every frame
        assert not torch.equal(video[0], video[1])
        y0, x0 = pos[0].tolist()
        first = video[0, y0 : y0 + sprite, x0 : x0 + sprite]
        for t in range(frames):
            y, x = pos[t].tolist()
            torch.testing.assert_close(video[t, y : y + sprite, x : x + sprite], first, rtol=0, atol=0)
            outside = video[t].clone()
            outside[y : y + sprite, x : x + sprite] = -1
            assert torch.all(outside == -1)
        # the caption names the label and the direction of the first step
        label, direction = int(data.labels[n]), data.directions[n]
        assert data.captions[n] == f"a {label} moving {direction}"
        step = (pos[1] - pos[0]).tolist()
        dy, dx = DIRECTIONS[direction]
        assert np.sign(step[0]) == dy and np.sign(step[1]) == dx and step != [0, 0]
    assert set(data.labels.tolist()) <= set(range(10))


def test_moving_digits_bounces_and_is_deterministic():
    a = moving_digits(8, frames=30, size=16, seed=1)
    b = moving_digits(8, frames=30, size=16, seed=1)
    assert torch.equal(a.videos, b.videos) and a.captions == b.captions
    assert not torch.equal(a.videos, moving_digits(8, frames=30, size=16, seed=2).videos)
    # 30 frames on a 16px canvas: every video reverses direction at least once
    for n in range(8):
        steps = (a.positions[n, 1:] - a.positions[n, :-1]).sign()
        assert (steps[1:] * steps[:-1] < 0).any()


def test_moving_digits_rejects_tiny_canvas():
    with pytest.raises(ValueError, match="size"):
        moving_digits(2, frames=4, size=8, sprite_size=7)
