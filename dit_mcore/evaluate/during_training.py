"""FID while training (``trainer.fid_interval``, small runs): every interval and after the last step, the EMA
samples ``trainer.fid_samples`` images (every class alike, the evaluate command's items and seeds, the run's
sampler, steps and guidance; the previews' path: every rank samples under the training layout) and rank 0 scores
them against the built-in digits with the digits features; ``eval/fid`` joins that step's metrics in every sink.
A post-step hook of the evaluation layer (the trainer cannot import it), attached by the command line as the
previews are. A failure to score (e.g. guidance the model cannot do) is said once and training goes on."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError
from dit_mcore.evaluate.cli import per_class, reference_images
from dit_mcore.evaluate.features import build_extractor
from dit_mcore.evaluate.fid import fid
from dit_mcore.generate.grid import to_uint8
from dit_mcore.generate.items import batches, make_items
from dit_mcore.generate.preview import ema_forward
from dit_mcore.generate.sampling import latent_shape, sample_items
from dit_mcore.training.hooks import StepHook, fid_due

log = logging.getLogger("dit_mcore.train")

BATCH = 64  # items per sampler call (the command's default --batch-size)


class FIDDuringTraining(StepHook):
    provides = frozenset({"eval/fid"})

    def __init__(self, cfg):
        self.cfg = cfg
        self.reference = None
        self.failed = False

    def reads_after(self, step: int) -> bool:
        return fid_due(self.cfg.trainer, step)

    def metrics(self, trainer) -> dict:
        if not self.reads_after(trainer.step) or self.failed:
            return {}
        cfg, config = self.cfg, trainer.model_config
        items = make_items(labels=list(range(config.num_classes)),
                           num_per_prompt=per_class(cfg.trainer.fid_samples, config.num_classes))
        try:
            with ema_forward(trainer) as ema_model:  # (every rank: the layout's collectives)
                model_fn = trainer.family.image_model_fn(ema_model, config)
                latents = torch.cat([
                    sample_items(model_fn, config, trainer.objective, part, shape=latent_shape(config), seed=0,
                                 steps=cfg.diffusion.sample_steps, cfg_scale=cfg.diffusion.cfg_scale,
                                 device=trainer.device).float().cpu() for part in batches(items, BATCH)])
            if dist.get_rank() != 0:
                return {}
            if self.reference is None:
                self.reference = reference_images("digits", tuple(latents.shape[-2:]))
            return {"eval/fid": fid(self.reference, to_uint8(latents).expand(-1, 3, -1, -1), build_extractor("digits"))}
        except ConfigError as e:  # (the same on every rank: sampling's checks; scoring's are rank 0's alone)
            self.failed = True
            log.warning("FID during training skipped from now on: %s", e)
            return {}
