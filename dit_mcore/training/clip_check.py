"""Does a generated moving-digits clip show the prompted digit moving the prompted way? Does a
generated digit image show the requested class?

Reads a text-preview folder (``samples/step_XXXXXX/index.json`` and its GIFs, see
:mod:`dit_mcore.generate.preview`) whose prompts are ``moving_digits`` captions ("a 3 moving
left") and checks each clip:

- **direction**: the centroid of the ink (pixels brighter than mid-grey, so faint noise does not pull
  it to the centre) moves the prompted way on the first step, frame 0 -> 1 (the dataset's sprites
  bounce off the walls later, never on the first step);
- **digit**: each frame is read by a nearest-neighbour classifier over the dataset's digit scans
  (cosine similarity, best sprite-sized window of the frame); the clip's digit is the majority.
  Leave-one-out on real ``moving_digits`` clips it reads 99% of them right (tests/test_clip_check.py).

Digit images (``dit_mcore.generate`` of a digits model: ``index.json`` entries with a ``label``) are
read by the same classifier over the whole image (the scans at the image's size).

``python -m dit_mcore.training.clip_check runs/t2v_digits/samples/step_002400`` (or a generation
folder) prints one line per clip or image and a summary, and writes ``check.json``.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from energon_data.datasets import DIRECTIONS, load_digits

_CAPTION = re.compile(r"\ba (\d) moving (left|right|up|down)\b")


@dataclass(frozen=True)
class ClipCheck:
    prompt: str
    digit: int
    """The prompted digit."""
    direction: str
    read_digits: tuple
    """The classifier's digit for each frame."""
    first_step: float
    """Centroid shift (pixels) of frame 0 -> 1 along the prompted direction; > 0 goes the right way."""

    @property
    def digit_ok(self) -> bool:
        return Counter(self.read_digits).most_common(1)[0][0] == self.digit

    @property
    def direction_ok(self) -> bool:
        return self.first_step > 0


@lru_cache(maxsize=4)
def _exemplars(sprite: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_digits(sprite)
    return F.normalize(((images[:, 0] + 1) / 2).flatten(1), dim=1), labels


def read_digit(frame: torch.Tensor, sprite: int, exclude_exact: bool = False) -> int:
    """The digit in ``frame [H, W]`` (0 = background, 1 = ink): the label of the scan most similar
    to some ``sprite``-sized window. ``exclude_exact``: ignore a scan identical to the window
    (leave-one-out evaluation on the dataset's own clips)."""
    exemplars, labels = _exemplars(sprite)
    windows = F.normalize(F.unfold(frame.clamp(min=0)[None, None], sprite)[0].t(), dim=1)
    best = (windows @ exemplars.t()).max(0).values
    if exclude_exact:
        best = best.masked_fill(best > 0.9999, -1.0)
    return int(labels[best.argmax()])


def check_clip(frames: torch.Tensor, prompt: str, *, sprite: int | None = None,
               exclude_exact: bool = False) -> ClipCheck:
    """Check ``frames [T, H, W]`` (0 = background, 1 = ink) against a ``moving_digits`` caption.
    ``sprite``: the digit's size (the dataset's default: half the frame)."""
    match = _CAPTION.search(prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} is not a moving_digits caption ('a <digit> moving <direction>')")
    if frames.dim() != 3 or frames.shape[0] < 2:
        raise ValueError(f"need [T >= 2, H, W] frames, got {tuple(frames.shape)}")
    digit, direction = int(match.group(1)), match.group(2)
    sprite = sprite or frames.shape[-1] // 2
    if sprite < 1 or min(frames.shape[-2:]) < sprite:
        raise ValueError(f"frames of {tuple(frames.shape[-2:])} cannot hold a {sprite}-pixel digit; pass sprite=")
    ink = frames * (frames > 0.5)
    mass = ink.sum((1, 2)).clamp(min=1e-6)
    ys, xs = (torch.arange(n, dtype=frames.dtype) for n in frames.shape[1:])
    cy, cx = (ink.sum(2) * ys).sum(1) / mass, (ink.sum(1) * xs).sum(1) / mass
    dy, dx = DIRECTIONS[direction]
    step = float((cy[1] - cy[0]) * dy + (cx[1] - cx[0]) * dx)
    read = tuple(read_digit(f, sprite, exclude_exact) for f in frames)
    return ClipCheck(prompt, digit, direction, read, step)


def load_gif(path) -> torch.Tensor:
    """``[T, H, W]`` float frames in [0, 1] of a grey GIF."""
    with Image.open(path) as image:
        frames = []
        for i in range(image.n_frames):
            image.seek(i)
            frames.append(torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255.0))
    return torch.stack(frames)


def check_preview(folder) -> list[ClipCheck]:
    """Check every clip of a text-preview folder (its ``index.json``)."""
    folder = Path(folder)
    index = json.loads((folder / "index.json").read_text())
    return [check_clip(load_gif(folder / entry["file"]), entry["prompt"]) for entry in index]


@dataclass(frozen=True)
class ImageCheck:
    label: int
    """The requested class."""
    read: int
    """The classifier's digit."""

    @property
    def ok(self) -> bool:
        return self.read == self.label


def load_png(path) -> torch.Tensor:
    """``[H, W]`` float pixels in [0, 1] of a grey PNG."""
    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255.0)


def check_image(image: torch.Tensor, label: int, exclude_exact: bool = False) -> ImageCheck:
    """Read the digit of ``image [H, W]`` (0 = background, 1 = ink), a whole-image digit."""
    return ImageCheck(int(label), read_digit(image, min(image.shape[-2:]), exclude_exact))


def check_images(folder) -> list[ImageCheck]:
    """Check every image of a generation folder whose ``index.json`` entries carry a ``label``."""
    folder = Path(folder)
    index = json.loads((folder / "index.json").read_text())
    return [check_image(load_png(folder / entry["file"]), entry["label"]) for entry in index if "label" in entry]


def _main_images(folder: Path, checks: list[ImageCheck]) -> int:
    for c in checks:
        print(f"class {c.label}: read {c.read} {'ok' if c.ok else 'NO'}")
    summary = {"images": len(checks), "read_right": sum(c.ok for c in checks),
               "agreement": round(sum(c.ok for c in checks) / max(1, len(checks)), 4)}
    print(json.dumps(summary))
    (folder / "check.json").write_text(json.dumps({"summary": summary, "images": [asdict(c) for c in checks]},
                                                  indent=1))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dit_mcore.training.clip_check <samples/step_XXXXXX | generation folder>",
              file=sys.stderr)
        return 2
    index = json.loads((Path(argv[0]) / "index.json").read_text())
    if index and "label" in index[0]:
        return _main_images(Path(argv[0]), check_images(argv[0]))
    checks = check_preview(argv[0])
    for c in checks:
        print(f"{c.prompt:<22} digit {'ok ' if c.digit_ok else 'NO '} read {list(c.read_digits)}  "
              f"direction {'ok ' if c.direction_ok else 'NO '} first step {c.first_step:+.2f} px")
    summary = {"clips": len(checks), "digit_ok": sum(c.digit_ok for c in checks),
               "direction_ok": sum(c.direction_ok for c in checks),
               "frames_read_right": sum(d == c.digit for c in checks for d in c.read_digits),
               "frames": sum(len(c.read_digits) for c in checks)}
    print(json.dumps(summary))
    (Path(argv[0]) / "check.json").write_text(json.dumps({"summary": summary, "clips": [
        {**asdict(c), "digit_ok": c.digit_ok, "direction_ok": c.direction_ok} for c in checks]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
