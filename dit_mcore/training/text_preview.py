"""Previews of text-conditioned models: one clip per prompt, from the EMA weights with fixed seeds.

Each preview is a folder ``samples/step_XXXXXX/`` holding one animated GIF per prompt (grey frames
at the dataset's frame size), ``strip.png`` (one row per prompt, its frames left to right) and
``index.json``, a list of ``{"prompt": ..., "file": ...}`` so tools can read what was generated.
Prompts are encoded by the dataset's own text encoder: the one ``energon_data.prepare`` recorded, or
the tiny encoder of the built-in ``moving_digits`` captions.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from PIL import Image

from dit_mcore.diffusion import sample
from dit_mcore.models.text import TextContext
from dit_mcore.training.sample_grid import save_grid, to_uint8

log = logging.getLogger(__name__)


def moving_digits_prompts() -> list[str]:
    """Ten prompts covering every digit and every direction of the ``moving_digits`` captions."""
    from energon_data.datasets import DIRECTIONS
    names = list(DIRECTIONS)
    return [f"a {d} moving {names[d % len(names)]}" for d in range(10)]


def preview_text_encoder(data) -> Optional[Callable]:
    """``encode(prompts) -> [L_i, D] tensors`` with the dataset's text encoder, or None if unknown."""
    from energon_data.encoders import build_text_encoder
    if data.path:
        from energon_data.prepare import prepare_record
        record = prepare_record(data.path)
        if record is None:
            return None
        config = record.get("config", {})
        try:
            return build_text_encoder(config.get("text_encoder", "tiny"), config.get("text_encoder_path"),
                                      **config.get("text_encoder_opts", {})).encode
        except Exception as exc:  # an encoder we cannot build here must not stop training
            log.warning("preview: cannot build the dataset's text encoder (%s); previews skipped", exc)
            return None
    if data.name == "moving_digits":
        from dit_mcore.training.data import moving_digits_text_encoder
        return moving_digits_text_encoder().encode
    return None


def _slug(prompt: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", prompt.lower()).strip("_")[:48] or "prompt"


def _grey_frames(video: torch.Tensor) -> list[Image.Image]:
    """``[C, T, H, W]`` in [-1, 1] -> T grey PIL frames (channel 0 for latents of other widths)."""
    return [Image.fromarray(frame.numpy(), mode="L") for frame in to_uint8(video[0])]


@torch.no_grad()
def draw_text_preview(ema_model, model_config, family, objective, cfg, step: int, out_dir: Path, *, write: bool,
                      encode: Callable, prompts: list[str], device=None, seed: int = 0) -> Optional[Path]:
    """Sample one clip per prompt with the run's sampler and CFG scale (text dropped to the null
    text for the unconditional half). Every rank computes; only ``write`` ranks save."""
    text = TextContext.from_list([e.float() for e in encode(prompts)]).to(device)
    labels = null_label = None
    if model_config.num_classes:  # conditioned on labels too: prompts name no class, so the null class
        if not model_config.use_cfg_embedding:
            log.warning("text previews of a model that also takes class labels need its null class "
                        "(model.class_dropout_prob > 0); previews skipped")
            return None
        null_label = model_config.num_classes
        labels = torch.full((len(prompts),), null_label, dtype=torch.long, device=device)
    frames, side = max(1, cfg.data.video_frames), model_config.input_size
    noise = torch.randn(len(prompts), model_config.in_channels, frames, side, side,
                        generator=torch.Generator().manual_seed(seed)).to(device)
    clips = sample(objective, family.image_model_fn(ema_model, model_config), noise, steps=cfg.diffusion.sample_steps,
                   text=text, labels=labels, null_label=null_label, cfg_scale=cfg.diffusion.cfg_scale).float().cpu()
    if not write:
        return None
    folder = out_dir / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (prompt, clip) in enumerate(zip(prompts, clips)):
        name = f"{i:02d}_{_slug(prompt)}.gif"
        first, *rest = _grey_frames(clip)
        first.save(folder / name, save_all=True, append_images=rest, duration=250, loop=0)
        index.append({"prompt": prompt, "file": name})
    # Rows = prompts, columns = frames: [N*T, 1, H, W] laid out T per row.
    strip = clips[:, :1].transpose(1, 2).reshape(-1, 1, side, side)
    save_grid(strip.clamp(-1, 1), folder / "strip.png", nrow=frames, upscale=4)
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    return folder
