"""From latents to files: decoding through the dataset's latent decoder (or a diffusers VAE given to the
command), one PNG per image, a GIF (and an MP4) per clip, and the grid or strip of a whole call.

Pixels are ``[-1, 1]`` floats with 1 (grey) or 3 (RGB) channels. Latents of other widths without a
decoder are shown as their first channel in grey (logged once).
"""
from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from PIL import Image

from dit_mcore.generate.grid import save_grid, to_uint8

log = logging.getLogger(__name__)

Decoder = Callable[[torch.Tensor], torch.Tensor]
"""``decode(latent [c, t, h, w]) -> pixels [C, T, H, W]`` (``energon_data.encoders.LatentEncoder``)."""


def dataset_decoder(data_path: Optional[str]) -> Optional[Decoder]:
    """The latent decoder ``energon_data.prepare`` recorded for the dataset at ``data_path``, if any
    (None for in-memory sources or datasets without a record, or one that cannot be built here)."""
    from energon_data.prepare import prepare_record
    record = prepare_record(data_path) if data_path else None
    config = (record or {}).get("config", {})
    if not config.get("encoder"):
        return None
    from energon_data.encoders import build_latent_encoder
    try:
        encoder = build_latent_encoder(config["encoder"], config.get("encoder_path"), **config.get("encoder_opts", {}))
    except Exception as exc:  # a decoder we cannot build must not stop a run: raw latents are shown
        log.warning("cannot build the dataset's latent decoder %r (%s); showing raw latents", config["encoder"], exc)
        return None
    return encoder.decode


def vae_folder(path: Path) -> Optional[Path]:
    """The diffusers VAE at ``path``: the folder itself (its ``config.json``) or a pipeline's ``vae/``."""
    for folder in (path, path / "vae"):
        if (folder / "config.json").is_file():
            return folder
    return None


def vae_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def vae_decoder(folder: Path) -> Decoder:
    """Decode with the diffusers VAE in ``folder`` (latents scaled as its pipelines scale them: SD's
    ``scaling_factor``, or per-channel statistics); an ``AutoencoderKL`` codes frames one by one, any
    other class (a video VAE) the clip."""
    from energon_data.encoders import build_latent_encoder
    kind = "diffusers_vae" if vae_config(folder).get("_class_name", "AutoencoderKL") == "AutoencoderKL" \
        else "diffusers_video_vae"
    return build_latent_encoder(kind, str(folder)).decode


def slug(prompt: str) -> str:
    """A file-name fragment of ``prompt``."""
    return re.sub(r"[^a-z0-9]+", "_", prompt.lower()).strip("_")[:48] or "prompt"


@functools.lru_cache(maxsize=None)
def log_once(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time only (previews and generation repeat theirs every call)."""
    log.log(level, message)


def to_pixels(latents: torch.Tensor, decoder: Optional[Decoder] = None) -> torch.Tensor:
    """``[N, C, H, W]`` or ``[N, C, T, H, W]`` latents as pixels of the same rank with 1 or 3 channels,
    in [-1, 1], on the host; each item decoded alone (the decoder's contract is one ``[c, t, h, w]``)."""
    latents = latents.detach().float().cpu()
    if decoder is not None:
        clips = [decoder(x if x.dim() == 4 else x.unsqueeze(1)) for x in latents]
        pixels = torch.stack([c if latents.dim() == 5 else c[:, 0] for c in clips])
    elif latents.shape[1] in (1, 3):
        pixels = latents
    else:
        log_once(f"no latent decoder for {latents.shape[1]}-channel latents; showing channel 0 in grey")
        pixels = latents[:, :1]
    return pixels.clamp(-1, 1)


def frames_of(clip: torch.Tensor) -> list[Image.Image]:
    """``[C, T, H, W]`` pixels -> T PIL frames (grey for C=1, RGB for C=3)."""
    frames = to_uint8(clip).permute(1, 2, 3, 0).numpy()  # [T, H, W, C]
    return [Image.fromarray(f[..., 0], mode="L") if f.shape[-1] == 1 else Image.fromarray(f, mode="RGB")
            for f in frames]


def save_image(image: torch.Tensor, path: Path) -> Path:
    """``[C, H, W]`` pixels as a PNG."""
    frames_of(image.unsqueeze(1))[0].save(path, format="PNG")
    return path


def save_gif(clip: torch.Tensor, path: Path, fps: int = 4) -> Path:
    """``[C, T, H, W]`` pixels as a looping GIF."""
    first, *rest = frames_of(clip)
    first.save(path, save_all=True, append_images=rest, duration=int(1000 / fps), loop=0)
    return path


def save_mp4(clip: torch.Tensor, path: Path, fps: int = 4) -> Path:
    """``[C, T, H, W]`` pixels as an H.264 MP4 (PyAV's FFmpeg; sides padded to even, as yuv420p needs)."""
    import av
    frames = to_uint8(clip.expand(3, *clip.shape[1:]) if clip.shape[0] == 1 else clip).permute(1, 2, 3, 0)
    h, w = frames.shape[1] + frames.shape[1] % 2, frames.shape[2] + frames.shape[2] % 2
    frames = torch.nn.functional.pad(frames, (0, 0, 0, w - frames.shape[2], 0, h - frames.shape[1]))
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for f in frames.numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return path


def save_overview(pixels: torch.Tensor, path: Path, *, per_row: int, upscale: int = 1) -> Path:
    """One PNG of a whole call: images ``[N, C, H, W]`` in a grid of ``per_row`` columns, or clips
    ``[N, C, T, H, W]`` as a strip (a row per clip, its frames left to right)."""
    if pixels.dim() == 5:
        n, c, t, h, w = pixels.shape
        return save_grid(pixels.transpose(1, 2).reshape(n * t, c, h, w), path, nrow=t, upscale=upscale)
    return save_grid(pixels, path, nrow=per_row, upscale=upscale)
