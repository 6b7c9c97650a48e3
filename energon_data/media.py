"""Reading images and videos from disk into float pixels ``[C, T, H, W]`` in [-1, 1].

Images go through PIL; videos through PyAV (``pip install av``), imported only when a
video is read. Animated GIFs are read with PIL, so they work without PyAV. Anything that
cannot be turned into 1- or 3-channel pixels raises ``MediaError`` with the reason; the
prepare tool counts and lists those files instead of stopping.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".gif"})
# Files that live beside media (captions, notes) and are not media themselves.
SIDECAR_EXTENSIONS = frozenset({".txt", ".jsonl", ".json", ".md", ".yaml", ".yml"})

# PIL modes we convert losslessly (or by dropping alpha) to 1 or 3 channels.
_GRAY_MODES = {"1", "L"}
_COLOR_MODES = {"RGB", "RGBA", "RGBX", "P", "CMYK", "YCbCr", "LAB", "HSV"}


class MediaError(Exception):
    """A file that cannot be used as a sample; the message is the reason shown in the summary."""


@dataclass
class Media:
    pixels: torch.Tensor
    """float32 ``[C, T, H, W]`` in [-1, 1]."""
    kind: str
    """"image" or "video"."""
    fps: float | None
    """Frames per second of the kept frames (after striding); None for images."""
    source_size: tuple[int, int]
    """(height, width) of the file before resizing or cropping."""


def to_unit_range(array: np.ndarray) -> torch.Tensor:
    """uint8 ``[..., H, W, C]`` -> float32 in [-1, 1] (x / 127.5 - 1)."""
    return torch.from_numpy(np.ascontiguousarray(array)).float().div_(127.5).sub_(1.0)


def _pil_to_array(img, channels: int | None, path: Path) -> np.ndarray:
    mode = img.mode
    if mode in ("LA", "PA") or len(img.getbands()) == 2:
        raise MediaError(f"2-channel image (mode {mode}); only 1 (gray) or 3 (RGB) channels are supported")
    if mode not in _GRAY_MODES | _COLOR_MODES:
        raise MediaError(f"unsupported image mode {mode} (high bit depth?); convert to 8-bit L or RGB")
    target = {1: "L", 3: "RGB"}.get(channels) or ("L" if mode in _GRAY_MODES else "RGB")
    array = np.asarray(img.convert(target))
    return array[..., None] if array.ndim == 2 else array  # [H, W, C]


def read_image(path: str | Path, channels: int | None = None) -> Media:
    """Read a still image; ``channels`` 1 or 3 forces gray/RGB, None keeps the file's own."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    try:
        with Image.open(path) as img:
            img.load()
            array = _pil_to_array(img, channels, path)
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"unreadable image: {type(e).__name__}: {e}") from e
    pixels = to_unit_range(array).permute(2, 0, 1).unsqueeze(1)  # [C, 1, H, W]
    return Media(pixels, "image", None, tuple(array.shape[:2]))


def _read_gif(path: Path, max_frames: int | None, stride: int, channels: int | None) -> Media:
    from PIL import Image, ImageSequence, UnidentifiedImageError

    frames, durations = [], []
    try:
        with Image.open(path) as img:
            for i, frame in enumerate(ImageSequence.Iterator(img)):
                if i % stride:
                    continue
                durations.append(frame.info.get("duration", 0))
                frames.append(_pil_to_array(frame, channels, path))
                if max_frames and len(frames) >= max_frames:
                    break
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
        raise MediaError(f"unreadable GIF: {type(e).__name__}: {e}") from e
    mean_ms = float(np.mean(durations)) * stride if durations else 0.0
    return _frames_to_media(frames, 1000.0 / mean_ms if mean_ms > 0 else None)


def _frames_to_media(frames: list[np.ndarray], fps: float | None) -> Media:
    if not frames:
        raise MediaError("zero frames decoded")
    if len({f.shape for f in frames}) > 1:
        raise MediaError(f"frames change size mid-video: {sorted({f.shape for f in frames})}")
    pixels = to_unit_range(np.stack(frames)).permute(3, 0, 1, 2)  # [T, H, W, C] -> [C, T, H, W]
    return Media(pixels, "video", fps, tuple(frames[0].shape[:2]))


def read_video(
    path: str | Path, max_frames: int | None = None, frame_stride: int = 1, channels: int | None = None
) -> Media:
    """Decode up to ``max_frames`` frames (every ``frame_stride``-th) of a video.

    Videos are decoded as RGB unless ``channels == 1``. Needs PyAV except for GIFs.
    """
    path = Path(path)
    if frame_stride < 1:
        raise ValueError(f"frame_stride must be >= 1, got {frame_stride}")
    if path.suffix.lower() == ".gif":
        return _read_gif(path, max_frames, frame_stride, channels)
    try:
        import av
    except ImportError as e:
        raise ImportError(
            f"reading video {path.name} needs PyAV: pip install av (or convert the videos to GIF)"
        ) from e
    fmt = "gray" if channels == 1 else "rgb24"
    frames: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError("no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) / frame_stride if rate else None
            for i, frame in enumerate(container.decode(stream)):
                if i % frame_stride:
                    continue
                array = frame.to_ndarray(format=fmt)
                frames.append(array[..., None] if array.ndim == 2 else array)
                if max_frames and len(frames) >= max_frames:
                    break
    except MediaError:
        raise
    except Exception as e:  # PyAV raises many FFmpeg error types for corrupt or odd files
        raise MediaError(f"unreadable video: {type(e).__name__}: {e}") from e
    return _frames_to_media(frames, fps)


def read_media(
    path: str | Path, max_frames: int | None = None, frame_stride: int = 1, channels: int | None = None
) -> Media:
    """Dispatch on the file extension; a single-frame GIF counts as an image."""
    suffix = Path(path).suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        return read_image(path, channels)
    if suffix in VIDEO_EXTENSIONS:
        media = read_video(path, max_frames, frame_stride, channels)
        if suffix == ".gif" and media.pixels.shape[1] == 1:
            media.kind, media.fps = "image", None
        return media
    raise MediaError(f"unsupported file type {suffix or '(no extension)'}")


def fit_size(pixels: torch.Tensor, image_size: tuple[int, int] | None, multiple: int) -> torch.Tensor:
    """Resize so the frame covers ``image_size`` (bicubic, antialiased), then center-crop to it.

    Without ``image_size`` the frame is only center-cropped down to multiples of ``multiple``
    (what the latent encoder and patch size need). Identity when nothing has to change, so
    pixels stay bit-exact.
    """
    _, _, h, w = pixels.shape
    if image_size is not None:
        th, tw = image_size
        if (th, tw) != (h, w):
            scale = max(th / h, tw / w)
            rh, rw = max(th, round(h * scale)), max(tw, round(w * scale))
            if (rh, rw) != (h, w):
                frames = pixels.transpose(0, 1)  # [T, C, H, W]
                frames = F.interpolate(frames, size=(rh, rw), mode="bicubic", align_corners=False,
                                       antialias=True).clamp_(-1.0, 1.0)
                pixels, h, w = frames.transpose(0, 1), rh, rw
    else:
        th, tw = h // multiple * multiple, w // multiple * multiple
        if th == 0 or tw == 0:
            raise MediaError(f"{h}x{w} frame is smaller than the required multiple of {multiple} pixels")
    if th % multiple or tw % multiple:
        raise ValueError(f"--image-size {th}x{tw} must be a multiple of {multiple} (encoder downsampling x patch)")
    top, left = (h - th) // 2, (w - tw) // 2
    return pixels[:, :, top : top + th, left : left + tw].contiguous()
