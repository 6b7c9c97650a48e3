"""FID while training (``trainer.fid_interval``, small runs): every interval and after the last step, the EMA
samples ``trainer.fid_samples`` images (every class alike, fixed seeds, the run's sampler, steps and guidance:
the previews' path, under the training layout, every rank computing) and rank 0 scores them against the built-in
digits with the digits features; ``fid`` joins that step's metrics in every sink. A post-step hook of the
evaluation layer (the trainer cannot import it), attached by the command line as the previews are."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dit_mcore.evaluate.features import build_extractor, to_uint8
from dit_mcore.evaluate.fid import fid
from dit_mcore.generate.items import make_items
from dit_mcore.generate.sampling import latent_shape, sample_items
from dit_mcore.parallel.fsdp import forward_view
from dit_mcore.parallel.pipeline import PipelinedForward
from dit_mcore.training.hooks import StepHook, fid_due


class FIDDuringTraining(StepHook):
    def __init__(self, cfg):
        self.cfg = cfg
        self.reference = None

    def reads_after(self, step: int) -> bool:
        return fid_due(self.cfg.trainer, step)

    def metrics(self, trainer) -> dict:
        if not self.reads_after(trainer.step):
            return {}
        cfg, config = self.cfg, trainer.model_config
        items = make_items(labels=list(range(config.num_classes)),
                           num_per_prompt=math.ceil(cfg.trainer.fid_samples / config.num_classes))
        trainer.ema_schedule.fold()
        with torch.no_grad(), trainer.ema.placed(trainer.device) as shadow, forward_view(shadow):
            latents = sample_items(trainer.family.image_model_fn(PipelinedForward(shadow), config), config,
                                   trainer.objective, items, shape=latent_shape(config), seed=0,
                                   steps=cfg.diffusion.sample_steps, cfg_scale=cfg.diffusion.cfg_scale,
                                   device=trainer.device)
        if dist.get_rank() != 0:
            return {}
        fake = to_uint8(latents.float().cpu()).expand(-1, 3, -1, -1)
        if self.reference is None:
            from energon_data.datasets import load_digits
            self.reference = to_uint8(load_digits(size=cfg.data.image_size)[0]).expand(-1, 3, -1, -1)
        return {"fid": fid(self.reference, fake, build_extractor("digits"))}
