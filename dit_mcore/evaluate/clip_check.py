"""Does a generated moving-digits clip show the prompted digit moving the prompted way? Does a
generated digit image show the requested class?

Reads a text-preview folder (``samples/step_XXXXXX/index.json`` and its GIFs, see
:mod:`dit_mcore.generate.preview`) whose prompts are ``moving_digits`` captions ("a 3 moving
left") and checks each clip:

- **direction**: the centroid of the ink (pixels brighter than mid-grey, so faint noise does not pull
  it to the centre) moves the prompted way on the first step, frame 0 -> 1 (the dataset's sprites
  bounce off the walls later, never on the first step);
- **digit**, by two readers; the clip's digit is each one's majority over the frames:
  ``nearest``, a nearest-neighbour classifier over the dataset's digit scans (cosine similarity, best
  sprite-sized window of the frame), and ``cnn``, an independent one: the digits CNN of
  :mod:`dit_mcore.evaluate.features` (trained on the training scans only, never the held-out ones) on the
  sprite-sized window that holds the most ink.

Digit images (``dit_mcore.generate`` of a digits model: ``index.json`` entries with a ``label``) are
read by the same two readers over the whole image.

**Calibration** (:func:`calibration`), reported beside every score: each reader on real clips (or images) of
the held-out scans, against their true captions and against shuffled ones, i.e. what a right clip scores and
what chance scores. The nearest-neighbour reader is calibrated leave-one-out (its exemplars include the
held-out scans).

``python -m dit_mcore.evaluate.clip_check runs/t2v_digits/samples/step_002400`` (or a generation
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
    """The nearest-neighbour reader's digit for each frame."""
    first_step: float
    """Centroid shift (pixels) of frame 0 -> 1 along the prompted direction; > 0 goes the right way."""
    cnn_digits: tuple = ()
    """The independent CNN's digit for each frame."""

    @property
    def digit_ok(self) -> bool:
        return _majority(self.read_digits) == self.digit

    @property
    def digit_ok_cnn(self) -> bool:
        return _majority(self.cnn_digits) == self.digit

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


def _majority(reads: tuple) -> int:
    return Counter(reads).most_common(1)[0][0] if reads else -1


def read_digits_cnn(frames: torch.Tensor, sprite: int) -> list[int]:
    """The digit in each frame ``[T, H, W]`` (0 = background, 1 = ink) read by the digits CNN
    (:func:`~dit_mcore.evaluate.features.digit_features`) on the ``sprite``-sized window with the most ink (of
    several, the one centred nearest the ink's centroid: a thin digit fits many windows, the scans are centred)."""
    from dit_mcore.evaluate.features import DIGITS_SIZE, digit_features
    ink = frames.clamp(min=0)
    in_window = F.avg_pool2d(ink[:, None], sprite, stride=1)[:, 0]  # [T, H - s + 1, W - s + 1]
    rows, cols = (torch.arange(n, dtype=ink.dtype) for n in ink.shape[1:])
    mass = ink.sum((1, 2)).clamp(min=1e-6)
    centre_y, centre_x = (ink.sum(2) * rows).sum(1) / mass, (ink.sum(1) * cols).sum(1) / mass
    half = (sprite - 1) / 2
    windows = []
    for t, frame in enumerate(frames):
        best = (in_window[t] >= in_window[t].max() - 1e-6).nonzero()
        miss = (best[:, 0] + half - centre_y[t]) ** 2 + (best[:, 1] + half - centre_x[t]) ** 2
        y, x = best[int(miss.argmin())].tolist()
        windows.append(frame[y:y + sprite, x:x + sprite])
    windows = torch.stack(windows)[:, None] * 2 - 1
    if sprite != DIGITS_SIZE:  # resized as the CNN's training scans were (load_digits: bicubic)
        windows = F.interpolate(windows, size=(DIGITS_SIZE, DIGITS_SIZE), mode="bicubic", align_corners=False,
                                antialias=sprite > DIGITS_SIZE)
    images = ((windows.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return digit_features().classify(images).tolist()


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
    return ClipCheck(prompt, digit, direction, read, step, tuple(read_digits_cnn(frames, sprite)))


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
    """The nearest-neighbour reader's digit."""
    read_cnn: int = -1
    """The independent CNN's digit."""

    @property
    def ok(self) -> bool:
        return self.read == self.label

    @property
    def ok_cnn(self) -> bool:
        return self.read_cnn == self.label


def load_png(path) -> torch.Tensor:
    """``[H, W]`` float pixels in [0, 1] of a grey PNG."""
    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255.0)


def check_image(image: torch.Tensor, label: int, exclude_exact: bool = False) -> ImageCheck:
    """Read the digit of ``image [H, W]`` (0 = background, 1 = ink), a whole-image digit."""
    side = min(image.shape[-2:])
    return ImageCheck(int(label), read_digit(image, side, exclude_exact), read_digits_cnn(image[None], side)[0])


def check_images(folder) -> list[ImageCheck]:
    """Check every image of a generation folder whose ``index.json`` entries carry a ``label``."""
    folder = Path(folder)
    index = json.loads((folder / "index.json").read_text())
    return [check_image(load_png(folder / entry["file"]), entry["label"]) for entry in index if "label" in entry]


@lru_cache(maxsize=8)
def calibration(size: int, frames: int = 0, sprite: int = 0, count: int = 200, seed: int = 7) -> dict:
    """Each reader's score on ``count`` real samples made of the held-out scans (never the CNN's training
    scans), against their true labels and against shuffled ones: ``{"nearest": {"true": .., "shuffled": ..},
    "cnn": {...}}``. ``frames`` > 0: ``moving_digits`` clips of ``frames`` frames of ``size`` pixels with a
    ``sprite``-pixel digit (a clip counts when the majority over its frames is the label); else whole
    ``size``-pixel images. The nearest-neighbour reader leaves the exact scan out."""
    from dit_mcore.training.data import digits_split
    from energon_data.datasets import moving_digits
    if frames:
        clips = moving_digits(count, frames=frames, size=size, seed=seed, sprite_size=sprite,
                              scans=digits_split(sprite, held_out=True))
        samples, labels = (clips.videos[:, 0] + 1) / 2, clips.labels
        reads = {"nearest": [_majority(tuple(read_digit(f, sprite, True) for f in clip)) for clip in samples],
                 "cnn": [_majority(tuple(read_digits_cnn(clip, sprite))) for clip in samples]}
    else:
        images, labels = digits_split(size, held_out=True)
        images = ((images[:, 0] + 1) / 2)[:count]
        labels = labels[:count]
        reads = {"nearest": [read_digit(image, size, True) for image in images],
                 "cnn": read_digits_cnn(images, size)}
    shuffled = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]
    return {name: {"true": round(float((torch.tensor(r) == labels).float().mean()), 3),
                   "shuffled": round(float((torch.tensor(r) == shuffled).float().mean()), 3)}
            for name, r in reads.items()}


def _calibration_line(calibrated: dict) -> str:
    return "readers on real held-out samples, true / shuffled captions: " + ", ".join(
        f"{name} {c['true']:.2f} / {c['shuffled']:.2f}" for name, c in calibrated.items())


def _main_images(folder: Path, checks: list[ImageCheck]) -> int:
    for c in checks:
        print(f"class {c.label}: read {c.read} {'ok' if c.ok else 'NO'}, cnn {c.read_cnn} {'ok' if c.ok_cnn else 'NO'}")
    n = max(1, len(checks))
    calibrated = calibration(int(load_png(folder / json.loads((folder / "index.json").read_text())[0]["file"]).shape[-1]))
    summary = {"images": len(checks), "read_right": sum(c.ok for c in checks),
               "agreement": round(sum(c.ok for c in checks) / n, 4),
               "agreement_cnn": round(sum(c.ok_cnn for c in checks) / n, 4), "calibration": calibrated}
    print(_calibration_line(calibrated))
    print(json.dumps(summary))
    (folder / "check.json").write_text(json.dumps({"summary": summary, "images": [asdict(c) for c in checks]},
                                                  indent=1))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dit_mcore.evaluate.clip_check <samples/step_XXXXXX | generation folder>",
              file=sys.stderr)
        return 2
    index = json.loads((Path(argv[0]) / "index.json").read_text())
    if index and "label" in index[0]:
        return _main_images(Path(argv[0]), check_images(argv[0]))
    checks = check_preview(argv[0])
    for c in checks:
        print(f"{c.prompt:<22} digit {'ok ' if c.digit_ok else 'NO '} read {list(c.read_digits)}  "
              f"cnn {'ok ' if c.digit_ok_cnn else 'NO '} read {list(c.cnn_digits)}  "
              f"direction {'ok ' if c.direction_ok else 'NO '} first step {c.first_step:+.2f} px")
    first = load_gif(Path(argv[0]) / index[0]["file"])
    calibrated = calibration(first.shape[-1], frames=first.shape[0], sprite=first.shape[-1] // 2)
    summary = {"clips": len(checks), "digit_ok": sum(c.digit_ok for c in checks),
               "digit_ok_cnn": sum(c.digit_ok_cnn for c in checks),
               "direction_ok": sum(c.direction_ok for c in checks),
               "frames_read_right": sum(d == c.digit for c in checks for d in c.read_digits),
               "frames_read_right_cnn": sum(d == c.digit for c in checks for d in c.cnn_digits),
               "frames": sum(len(c.read_digits) for c in checks), "calibration": calibrated}
    print(_calibration_line(calibrated))
    print(json.dumps(summary))
    (Path(argv[0]) / "check.json").write_text(json.dumps({"summary": summary, "clips": [
        {**asdict(c), "digit_ok": c.digit_ok, "digit_ok_cnn": c.digit_ok_cnn, "direction_ok": c.direction_ok}
        for c in checks]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
