"""Preview grids drawn from the EMA weights with fixed seeds: one row per class, in label order."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dit_mcore.diffusion import sample
from dit_mcore.models import patchify, unpatchify
from dit_mcore.training.sample_grid import class_grid_labels, save_grid


def image_model_fn(model, config):
    """Wrap a token-level DiT as ``model_fn(x [N, C, H, W], timestep [N], labels) -> [N, C, H, W]``,
    the calling convention of the diffusion objectives and samplers."""

    def model_fn(x, timestep, labels):
        tokens, grid = patchify(x, config.patch_size)
        out = model(tokens.transpose(0, 1).contiguous(), timestep, labels, grid=grid).transpose(0, 1)
        out = unpatchify(out, grid, config.out_channels, config.patch_size)
        return out[:, : config.in_channels]

    return model_fn


@torch.no_grad()
def draw_preview(ema_model, model_config, objective, cfg, step: int, out_dir: Path, *, write: bool,
                 seed: int = 0) -> Optional[Path]:
    """Sample ``samples_per_class`` images per class with the run's sampler and CFG scale. Every
    rank computes (tensor-parallel layers need all of them); only ``write`` ranks save the PNG."""
    labels = class_grid_labels(model_config.num_classes, cfg.log.samples_per_class)
    side = model_config.input_size
    noise = torch.randn(len(labels), model_config.in_channels, side, side,
                        generator=torch.Generator().manual_seed(seed))
    images = sample(objective, image_model_fn(ema_model, model_config), noise, steps=cfg.diffusion.sample_steps,
                    labels=labels, null_label=model_config.num_classes, cfg_scale=cfg.diffusion.cfg_scale)
    if not write:
        return None
    path = out_dir / f"step_{step:06d}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    save_grid(images.clamp(-1, 1), path, nrow=cfg.log.samples_per_class)
    return path
