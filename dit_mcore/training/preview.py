"""Preview grids drawn from the EMA weights with fixed seeds: one row per previewed class.

Latent models are shown through the dataset's latent decoder when its prepare run recorded one
(``prepare_state.json``), otherwise as their first latent channel in grey (logged once). Models with
many classes preview at most :data:`MAX_ROWS` of them, spread evenly over the label range and
named in the log.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from dit_mcore.diffusion import sample
from dit_mcore.training.sample_grid import save_grid

log = logging.getLogger(__name__)

MAX_ROWS = 16


def preview_classes(num_classes: int, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """Every class when there are at most ``max_rows``, else ``max_rows`` evenly spread ones (first and
    last included), in increasing order."""
    if num_classes <= max_rows:
        return torch.arange(num_classes)
    return torch.linspace(0, num_classes - 1, max_rows).round().long()


def dataset_decoder(data_path: Optional[str]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The latent decoder recorded by ``energon_data.prepare`` for the dataset at ``data_path``, if
    any (None for in-memory sources or datasets without a record)."""
    from energon_data.prepare import prepare_record
    record = prepare_record(data_path) if data_path else None
    config = (record or {}).get("config", {})
    if not config.get("encoder"):
        return None
    from energon_data.encoders import build_latent_encoder
    try:
        encoder = build_latent_encoder(config["encoder"], config.get("encoder_path"), **config.get("encoder_opts", {}))
    except Exception as exc:  # a decoder we cannot build must not stop training
        log.warning("preview: cannot build the dataset's latent decoder %r (%s); showing raw latents",
                    config["encoder"], exc)
        return None
    return encoder.decode


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    log.info(message)


def viewable(latents: torch.Tensor, decoder: Optional[Callable] = None) -> torch.Tensor:
    """``[N, C, H, W]`` samples as ``[N, 1 or 3, H, W]`` images in [-1, 1]."""
    if decoder is not None:
        images = decoder(latents.float().cpu())
        if images.dim() == 5:  # [N, C, T, H, W]: show the first frame
            images = images[:, :, 0]
        return images
    if latents.shape[1] in (1, 3):
        return latents
    _log_once(f"preview: no latent decoder for {latents.shape[1]}-channel latents; showing channel 0 in grey")
    return latents[:, :1]


@torch.no_grad()
def draw_preview(ema_model, model_config, family, objective, cfg, step: int, out_dir: Path, *, write: bool,
                 device=None, decoder: Optional[Callable] = None, seed: int = 0) -> Optional[Path]:
    """Sample ``samples_per_class`` images for each previewed class with the run's sampler and CFG
    scale. Every rank computes (tensor-parallel layers need all of them); only ``write`` ranks save
    the PNG."""
    classes = preview_classes(model_config.num_classes)
    if len(classes) < model_config.num_classes:
        _log_once(f"preview: {model_config.num_classes} classes; rows show classes {classes.tolist()}")
    per_class = cfg.log.samples_per_class
    labels = classes.repeat_interleave(per_class).to(device)
    side = model_config.input_size
    noise = torch.randn(len(labels), model_config.in_channels, side, side,
                        generator=torch.Generator().manual_seed(seed)).to(device)
    latents = sample(objective, family.image_model_fn(ema_model, model_config), noise,
                     steps=cfg.diffusion.sample_steps, labels=labels, null_label=model_config.num_classes,
                     cfg_scale=cfg.diffusion.cfg_scale)
    if not write:
        return None
    path = out_dir / f"step_{step:06d}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    save_grid(viewable(latents, decoder).clamp(-1, 1), path, nrow=per_class)
    return path
