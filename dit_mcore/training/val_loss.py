"""The validation loss (``trainer.val_interval``): the model and its EMA on the same validation samples,
at the same noise levels, with the same noise, every time, so that the number compares across steps,
runs and parallel layouts (a training loss depends on the levels each step happened to draw).

- **Samples**: whole global batches of the validation data (``data.val_path``, the val split of
  ``data.path``, or a built-in dataset's held-out split: :func:`dit_mcore.training.data.builtin_validation_batches`),
  read once, the same on every rank; each data-parallel rank evaluates its micro-batches of each global batch,
  as in training.
- **Levels**: the objective's :meth:`~dit_mcore.diffusion.objective.Objective.validation_levels` (the
  training distribution's quantile midpoints); the mean over them is ``val/loss``.
- **Noise**: drawn per sample from a generator keyed by the run's seed and the sample's place in the
  validation data, so neither the micro-batch size nor the layout changes what a sample receives.

The forward passes go through megatron's schedule, forward only, as training's do, so every layout that
trains validates; the per-level sums are reduced once per validation (its one host wait).
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.fsdp import forward_view
from energon_data.batch import MicroBatch

log = logging.getLogger("dit_mcore.train")

NOISE_KEY = 0x7A11D  # validation noise streams apart from the training steps' (trainer.step_generator)


def sample_noise(batch: MicroBatch, seed: int, first: int) -> torch.Tensor:
    """Standard-normal noise shaped like ``batch.tokens`` (zero on padding): sample ``i`` of the batch gets the
    stream of validation sample ``first + i``."""
    flat = torch.zeros(batch.tokens.shape[0] * batch.tokens.shape[1], batch.tokens.shape[-1])
    for i, (start, length) in enumerate(zip(batch.starts, batch.seqlens)):
        g = torch.Generator().manual_seed((seed * 1_000_003 + NOISE_KEY) * 65_537 + first + i)
        flat[start:start + length] = torch.randn(length, flat.shape[1], generator=g)
    return flat.view(batch.tokens.shape)


class ValidationSet:
    """This rank's validation micro-batches (with their noise), per global batch, on the host."""

    def __init__(self, global_batches: list[list[MicroBatch]], *, dp_rank: int, num_microbatches: int, seed: int):
        self.global_batches: list[list[tuple[MicroBatch, torch.Tensor]]] = []
        first = 0
        mine = range(dp_rank * num_microbatches, (dp_rank + 1) * num_microbatches)
        for micro in global_batches:
            kept = []
            for i, batch in enumerate(micro):
                if i in mine:
                    kept.append((batch, sample_noise(batch, seed, first)))
                first += batch.num_samples
            self.global_batches.append(kept)
        self.num_samples = first
        """Samples in the whole validation set (every rank's)."""

    @classmethod
    def of_run(cls, trainer, levels: list) -> "ValidationSet":
        """The validation set of ``trainer``'s run: ``trainer.val_samples`` in whole global batches."""
        cfg = trainer.cfg
        data, per_rank = cfg.data, trainer.num_microbatches
        micro_size = data.micro_batch(trainer.dp_size)
        wanted = max(1, math.ceil(cfg.trainer.val_samples / data.global_batch_size))
        pad = cfg.data.pad_multiple
        if data.uses_energon:
            from dit_mcore.training.energon_source import validation_batches
            batches = validation_batches(data, trainer.model_config, global_batches=wanted,
                                         per_global_batch=per_rank * trainer.dp_size, micro_batch_size=micro_size,
                                         pad_multiple=pad)
            if not batches:
                where = data.val_path or f"the val split of {data.path}"
                raise ConfigError(f"trainer.val_interval: the validation data ({where}) holds less than one global "
                                  "batch; give it more samples or lower data.global_batch_size")
        else:
            from dit_mcore.training.data import builtin_validation_batches
            batches = builtin_validation_batches(data, trainer.model_config, global_batches=wanted,
                                                 micro_batch_size=micro_size, seed=cfg.trainer.seed, pad_multiple=pad)
        out = cls(batches, dp_rank=trainer.dp_rank, num_microbatches=per_rank, seed=cfg.trainer.seed)
        if dist.get_rank() == 0:
            log.info("validation loss every %d steps: %d samples (%d global batch%s), %d noise levels %s",
                     cfg.trainer.val_interval, out.num_samples, len(batches), "es" * (len(batches) != 1), len(levels),
                     [float(f"{v:.4g}") for v in levels])
        return out


class Validation:
    """A run's validation losses (:meth:`metrics`); the samples are read when it is made (the trainer makes it
    at its start, so a validation set that cannot be read stops the run before its first step)."""

    def __init__(self, trainer):
        k = trainer.cfg.trainer.val_levels
        self.levels = trainer.objective.validation_levels(k).tolist()
        if len(set(self.levels)) < k:
            raise ConfigError(f"trainer.val_levels={k}: the objective ({trainer.objective.name}) has only "
                              f"{len(set(self.levels))} distinct levels at that spacing; lower trainer.val_levels")
        self.data = ValidationSet.of_run(trainer, self.levels)

    def metrics(self, trainer) -> dict:
        """``val/loss`` (the trained weights), ``val/ema_loss`` (the EMA) and each level's, as logged."""
        trainer.parallel_model.gather_params()  # (overlap_param_gather: the last update's weights)
        model = self._sums(trainer, list(trainer.ddp_chunks), trainer.compute_dtype)
        trainer.ema_schedule.fold()
        with trainer.ema.placed(trainer.device) as shadow, forward_view(shadow):
            ema = self._sums(trainer, list(shadow), next(shadow.parameters()).dtype)
        sums = torch.stack([model, ema])
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # the losses live on the last stage
            dist.broadcast(sums, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        per_level = (sums[..., 0] / sums[..., 1].clamp(min=1)).tolist()  # [model | ema][level]
        out = {}
        for name, losses in (("loss", per_level[0]), ("ema_loss", per_level[1])):
            out[f"val/{name}"] = sum(losses) / len(losses)
            out.update({f"val/{name}_t{level:.4g}": value for level, value in zip(self.levels, losses)})
        return out

    @torch.no_grad()
    def _sums(self, trainer, chunks: list, dtype: torch.dtype) -> torch.Tensor:
        """``[levels, 2]``: this replica's loss sums and sample counts per level (on the last pipeline stage), from
        one pass of megatron's schedule, forward only, over every level's micro-batches (one pipeline flush)."""
        micro = [(b.to(trainer.device), noise.to(trainer.device)) for part in self.data.global_batches
                 for b, noise in part]
        work = [(level, batch, noise) for level in self.levels for batch, noise in micro]

        def forward_step(data_iterator, model):
            level, batch, noise = next(data_iterator)
            at = torch.full((batch.num_samples,), level, device=trainer.device)
            return trainer.step_loss.forward(model, batch, at, noise, trainer.step_loss.labels_of(batch), dtype=dtype)

        config = chunks[0].config
        saved, config.pipeline_dtype = config.pipeline_dtype, dtype  # (an fp32 EMA of a bf16 run sends fp32)
        rows, seq = micro[0][0].tokens.shape[:2]
        try:
            reduced = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=[iter(work) for _ in chunks], model=chunks,
                num_microbatches=len(work), seq_length=trainer.model.token_shard.padded(seq), micro_batch_size=rows,
                forward_only=True)
        finally:
            config.pipeline_dtype = saved
        if not reduced:  # (not the last stage: its sums come by broadcast)
            return torch.zeros(len(self.levels), 2, device=trainer.device)
        # the last stage's store holds one pair per micro-batch, in the order they ran
        return torch.stack([r["loss"] for r in reduced]).view(len(self.levels), len(micro), 2).sum(1)
