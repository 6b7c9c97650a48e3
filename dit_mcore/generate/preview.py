"""Training previews, drawn from the EMA weights with fixed seeds through the generation code
(:mod:`dit_mcore.generate.sampling`: one sampling home), as a post-step hook of the trainer
(:class:`Previews`: every ``log.sample_interval`` steps and at the end of the run).

- Class-conditional models: ``samples/step_XXXXXX.png``, one row per previewed class (every class up
  to :data:`MAX_ROWS`, else that many spread evenly over the label range, named in the log).
- Text-conditioned models: a folder ``samples/step_XXXXXX/`` holding one animated GIF per prompt,
  ``strip.png`` (one row per prompt, its frames left to right) and ``index.json``, a list of
  ``{"prompt": ..., "file": ...}`` so tools can read what was generated (``clip_check``).

Latent models are shown through the dataset's latent decoder when its prepare run recorded one,
otherwise as their first latent channel in grey (:func:`dit_mcore.generate.media.to_pixels`).
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError
from dit_mcore.generate.items import make_items
from dit_mcore.generate.media import dataset_decoder, log_once, save_gif, save_overview, slug, to_pixels
from dit_mcore.generate.sampling import dataset_text_encoder, latent_shape, sample_items
from dit_mcore.parallel.fsdp import forward_view
from dit_mcore.parallel.pipeline import PipelinedForward
from dit_mcore.training.hooks import StepHook, previews_after

log = logging.getLogger(__name__)

MAX_ROWS = 16


def preview_classes(num_classes: int, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """Every class when there are at most ``max_rows``, else ``max_rows`` evenly spread ones (first and
    last included), in increasing order."""
    if num_classes <= max_rows:
        return torch.arange(num_classes)
    return torch.linspace(0, num_classes - 1, max_rows).round().long()


def moving_digits_prompts() -> list[str]:
    """Ten prompts covering every digit and every direction of the ``moving_digits`` captions."""
    from energon_data.datasets import DIRECTIONS
    names = list(DIRECTIONS)
    return [f"a {d} moving {names[d % len(names)]}" for d in range(10)]


@torch.no_grad()
def draw_preview(ema_model, model_config, family, objective, cfg, step: int, out_dir: Path, *, write: bool,
                 device=None, decoder: Optional[Callable] = None, seed: int = 0) -> Optional[Path]:
    """Sample ``samples_per_class`` images for each previewed class with the run's sampler and CFG
    scale. Every rank computes (tensor-parallel layers need all of them); only ``write`` ranks save
    the PNG."""
    classes = preview_classes(model_config.num_classes)
    if len(classes) < model_config.num_classes:
        log_once(f"preview: {model_config.num_classes} classes; rows show classes {classes.tolist()}")
    per_class = cfg.log.samples_per_class
    items = make_items(labels=classes.tolist(), num_per_prompt=per_class)
    try:
        latents = sample_items(family.image_model_fn(ema_model, model_config), model_config, objective, items,
                               shape=latent_shape(model_config), seed=seed, steps=cfg.diffusion.sample_steps,
                               cfg_scale=cfg.diffusion.cfg_scale, device=device)
    except ConfigError as e:  # e.g. guidance without a null class: the run trains on, without previews
        log_once(f"previews skipped: {e}", logging.WARNING)
        return None
    if not write:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_overview(to_pixels(latents, decoder), out_dir / f"step_{step:06d}.png", per_row=per_class)


@torch.no_grad()
def draw_text_preview(ema_model, model_config, family, objective, cfg, step: int, out_dir: Path, *, write: bool,
                      encode: Callable, prompts: list[str], device=None, seed: int = 0,
                      decoder: Optional[Callable] = None) -> Optional[Path]:
    """Sample one clip per prompt with the run's sampler and CFG scale (text dropped to the null
    text for the unconditional half). Every rank computes; only ``write`` ranks save."""
    if model_config.num_classes and not model_config.use_cfg_embedding:
        log.warning("text previews of a model that also takes class labels need its null class "
                    "(model.class_dropout_prob > 0); previews skipped")
        return None
    items = make_items(prompts=prompts)
    try:
        shape = latent_shape(model_config, frames=max(1, cfg.data.video_frames))
        clips = sample_items(family.image_model_fn(ema_model, model_config), model_config, objective, items,
                             shape=shape, seed=seed, steps=cfg.diffusion.sample_steps,
                             cfg_scale=cfg.diffusion.cfg_scale, encode=encode, device=device)
    except ConfigError as e:
        log_once(f"previews skipped: {e}", logging.WARNING)
        return None
    if not write:
        return None
    folder = out_dir / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    pixels = to_pixels(clips, decoder)
    index = []
    for item, clip in zip(items, pixels):
        name = f"{item.index:02d}_{slug(item.prompt)}.gif"
        save_gif(clip, folder / name)
        index.append({"prompt": item.prompt, "file": name})
    save_overview(pixels, folder / "strip.png", per_row=len(items), upscale=4)
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    return folder


class Previews(StepHook):
    """Draws a preview from the EMA weights every ``log.sample_interval`` steps (0: only at the end) and
    at the end of the run, into ``<log.dir>/samples``; every rank computes, rank 0 writes. The dataset's
    decoder and text encoder are built on first use and kept while the hook is."""

    def __init__(self, sample_interval: int):
        self.sample_interval = sample_interval
        self.assets: dict = {}

    def reads_after(self, step):
        return previews_after(self.sample_interval, step)

    def after_step(self, trainer):
        if self.reads_after(trainer.step):
            self._draw(trainer)

    def at_end(self, trainer):
        if not self.reads_after(trainer.step):
            self._draw(trainer)

    def _draw(self, trainer) -> None:
        path = preview(trainer, self.assets)
        logger = getattr(trainer, "logger", None)
        if path is not None and logger is not None:  # (rank 0 wrote it) -> the image sinks (W&B)
            logger.image(trainer.step, "samples", path / "strip.png" if path.is_dir() else path)


@contextlib.contextmanager
def ema_forward(trainer):
    """Inside, ``trainer``'s EMA weights as of its current step, callable over every pipeline stage (every rank
    enters: the layout's collectives); what previews and FID during training sample with."""
    trainer.ema_schedule.fold()  # (the hooks' steps are folded already; other callers' may not be)
    # trainer.ema_offload: the shadow samples on the GPU; Megatron-FSDP: called without its wrapper
    with torch.no_grad(), trainer.ema.placed(trainer.device) as shadow, forward_view(shadow):
        yield PipelinedForward(shadow)


def preview(trainer, assets: Optional[dict] = None) -> Optional[Path]:
    """Draw ``trainer``'s preview for its current step from its EMA weights (every rank calls it);
    ``assets``: where the dataset's decoder and text encoder are kept between calls."""
    assets = {} if assets is None else assets
    with ema_forward(trainer) as ema_model:
        return _draw(trainer, ema_model, assets)


def _asset(assets: dict, name: str, build: Callable):
    if name not in assets:
        assets[name] = build()
    return assets[name]


def _draw(trainer, ema_model, assets: dict) -> Optional[Path]:
    cfg, config, write = trainer.cfg, trainer.model_config, dist.get_rank() == 0
    decoder = _asset(assets, "decoder", lambda: dataset_decoder(cfg.data.path)) if write else None
    common = dict(write=write, device=trainer.device, decoder=decoder)
    out_dir = trainer.run_dir / "samples"
    if config.text_dim:
        encode = _asset(assets, "encode", lambda: dataset_text_encoder(cfg.data))
        prompts = cfg.log.preview_prompts or (moving_digits_prompts() if cfg.data.name == "moving_digits"
                                              and not cfg.data.path else None)
        if encode is None or not prompts:
            log.warning("text previews need the dataset's text encoder and log.preview_prompts; skipped")
            return None
        return draw_text_preview(ema_model, config, trainer.family, trainer.objective, cfg, trainer.step, out_dir,
                                 encode=encode, prompts=prompts, **common)
    if config.num_classes == 0:
        log.warning("preview grids need a class-conditional model; skipped")
        return None
    return draw_preview(ema_model, config, trainer.family, trainer.objective, cfg, trainer.step, out_dir, **common)
