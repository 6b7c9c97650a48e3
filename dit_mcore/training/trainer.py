"""The training loop: megatron-core forward/backward schedule, DDP, optimizer, EMA, checkpoints,
metrics and preview grids.

Randomness that shapes a step (noise levels, noise, label dropout) is drawn from generators seeded
by ``(seed, step, micro-batch within the global batch)``, and the data order by ``(seed, epoch)``; so a
resumed run replays exactly the steps an uninterrupted run would have taken.
"""
from __future__ import annotations

import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dit_mcore.config import ConfigError
from dit_mcore.diffusion import build_objective, drop_labels
from dit_mcore.models import build_model, patchify
from dit_mcore.parallel.initialize import initialize_distributed
from dit_mcore.training import checkpoint as ckpt
from dit_mcore.training.config import RunConfig
from dit_mcore.training.data import InMemoryImageLoader, builtin_dataset
from dit_mcore.training.ema import EMA
from dit_mcore.training.metrics import MetricsLogger
from dit_mcore.training.optim import build_optimizer, wrap_ddp
from dit_mcore.training.preview import draw_preview

log = logging.getLogger("dit_mcore.train")


def step_generator(seed: int, step: int, global_micro: int) -> torch.Generator:
    """Independent, reproducible stream per (step, micro-batch of the global batch). Keyed by the
    micro-batch's place in the global batch, not by rank, so any data-parallel layout draws the
    same noise for the same samples."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + global_micro)


def _refuse_untested_parallelism(cfg: RunConfig) -> None:
    """Model parallelism lands with its equivalence tests; until then refuse rather than train a
    layout nobody has checked (CP would, e.g., give every rank the whole sequence)."""
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported by the trainer yet; set it to False")
    for name in ("pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(cfg.parallel, name) > 1:
            raise ConfigError(f"parallel.{name} > 1 is not supported by the trainer yet (data and "
                              f"tensor parallelism are); set parallel.{name}=1")


class Trainer:
    """Owns the model, optimizer, data and run directory of one training run."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        _refuse_untested_parallelism(cfg)
        initialize_distributed(cfg.parallel, cfg.trainer.seed)
        self.model_config = cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = cfg.data.num_microbatches(self.dp_size)
        self._check_data_matches_model()
        self.objective = build_objective(cfg.diffusion.objective)

        self.model = self._build_model()
        rng = torch.get_rng_state()  # the shadow's random init is overwritten; keep the stream
        self.ema = EMA(self.model, self._build_model(), cfg.trainer.ema_decay)
        torch.set_rng_state(rng)
        self.ddp_model = wrap_ddp(self.model, self.model_config,
                                  use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        self.optimizer, self.scheduler = build_optimizer(self.ddp_model, cfg.optim, bf16=cfg.trainer.bf16,
                                                         max_steps=cfg.trainer.max_steps)
        self.loader = self._build_data()
        self.skipped_samples = 0
        self.run_dir = Path(cfg.log.dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.step = 0
        self._maybe_resume()

    # ------------------------------------------------------------------ setup helpers
    def _build_model(self):
        return build_model(self.model_config, backend=self.cfg.model.backend,
                           pre_process=parallel_state.is_pipeline_first_stage(),
                           post_process=parallel_state.is_pipeline_last_stage())

    def _build_data(self):
        cfg = self.cfg
        if cfg.data.path:
            from dit_mcore.training.energon_source import EnergonSource
            return EnergonSource(cfg.data, self.model_config, cfg.parallel, dp_rank=self.dp_rank,
                                 dp_size=self.dp_size, seed=cfg.trainer.seed, num_microbatches=self.num_microbatches)
        images, labels = builtin_dataset(cfg.data.name, cfg.data.image_size)
        return InMemoryImageLoader(images, labels, global_batch_size=cfg.data.global_batch_size,
                                   micro_batch_size=cfg.data.micro_batch(self.dp_size), dp_rank=self.dp_rank,
                                   dp_size=self.dp_size, seed=cfg.trainer.seed)

    def _check_data_matches_model(self) -> None:
        mc, data = self.model_config, self.cfg.data
        if data.path:
            if not Path(data.path).exists():
                raise ConfigError(f"data.path={data.path!r} does not exist; prepare a dataset with "
                                  "`python -m energon_data.prepare INPUT OUT` and point data.path at OUT")
        elif data.image_size != mc.input_size:
            raise ConfigError(f"data.image_size ({data.image_size}) must equal model input_size "
                              f"({mc.input_size}); set model.input_size={data.image_size}")

    def _data_per_rank(self) -> bool:
        return self.loader.per_rank_state

    def _common_state(self) -> dict:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "world_size": dist.get_world_size(),
                 "skipped_samples": self.skipped_samples}
        if self._data_per_rank():
            state["data_layout"] = self.loader.layout()
        else:
            state["data"] = self.loader.state_dict()
        return state

    def _maybe_resume(self) -> None:
        path = ckpt.latest_checkpoint(self.ckpt_dir) if self.ckpt_dir.exists() else None
        if path is None:
            return
        # The common state tells the saved world size before any per-rank object is requested:
        # those from a different world would fail deep inside dist_checkpointing.
        common = ckpt.load_common(path)
        same_world = common["world_size"] == dist.get_world_size()
        per_rank = {}
        if self._data_per_rank():
            if self.loader.check_layout(common["data_layout"], dist.get_world_size(), common["world_size"]):
                per_rank = {"data": self.loader.state_dict()}
        if not same_world:
            log.info("checkpoint was written by %d ranks, this run has %d: weights and optimizer are "
                     "resharded, per-rank RNG states are not restored", common["world_size"], dist.get_world_size())
        loaded = ckpt.load_checkpoint(path, self.model, self.ema.module, self.optimizer,
                                      extra=self._common_state(), per_rank=per_rank, restore_rng=same_world)
        state = loaded["extra"]
        self.step = int(state["step"])
        self.skipped_samples = int(state["skipped_samples"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "data" in loaded["per_rank"]:
            self.loader.load_state_dict(loaded["per_rank"]["data"])
        elif not self._data_per_rank():
            self.loader.load_state_dict(state["data"])
        log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        per_rank = {"data": self.loader.state_dict()} if self._data_per_rank() else {}
        return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.model, self.ema.module, self.optimizer,
                                    extra=self._common_state(), per_rank=per_rank,
                                    keep=self.cfg.trainer.keep_checkpoints)

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator: Iterator, model):
        micro, batch = next(data_iterator)
        g = step_generator(self.cfg.trainer.seed, self.step, self.dp_rank * self.num_microbatches + micro)
        if hasattr(batch, "cu_seqlens"):
            return self._forward_packed(batch, g, model)
        mc = self.model_config
        x0, grid = patchify(batch.images, mc.patch_size)  # [b, s, patch_dim]
        n = x0.shape[0]
        level = self.objective.sample_level(n, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        labels = drop_labels(batch.labels, mc.class_dropout_prob, mc.num_classes, generator=g)
        inputs = self.objective.prepare(x0, noise, level)
        out = model(inputs.model_input.transpose(0, 1).contiguous(), inputs.timestep, labels, grid=grid)
        pred = out.transpose(0, 1)[..., : mc.patch_dim]  # drops the learned-sigma channels, if any
        return out, partial(self._loss, pred, inputs, n)

    def _forward_packed(self, batch, g, model):
        """A packed THD micro-batch: one noise level per *sample*, broadcast to its tokens."""
        mc = self.model_config
        if batch.tokens.shape[-1] != mc.patch_dim:
            raise ConfigError(f"dataset tokens have {batch.tokens.shape[-1]} values but the model expects "
                              f"in_channels x patch volume = {mc.patch_dim}; set model.in_channels / patch sizes "
                              "to match the prepared latents")
        x0 = batch.tokens.float()
        n = batch.grids.shape[0]
        sample_ids = batch.sample_ids
        real = sample_ids >= 0
        level = self.objective.sample_level(n, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        labels = torch.where(batch.labels >= 0, batch.labels, torch.full_like(batch.labels, mc.num_classes))
        labels = drop_labels(labels, mc.class_dropout_prob, mc.num_classes, generator=g)
        inputs = self.objective.prepare(x0, noise, level[sample_ids.clamp(min=0)])
        out = model(inputs.model_input[:, None], self.objective.timestep(level), labels,
                    cu_seqlens=batch.cu_seqlens, cu_seqlens_padded=batch.cu_seqlens_padded, grids=batch.grids,
                    token_to_sample=sample_ids)
        pred = out[:, 0, : mc.patch_dim]
        return out, partial(self._loss_packed, pred, inputs, sample_ids, real, n)

    def _loss_packed(self, pred, inputs, sample_ids, real, n, _output):
        per_token = self.objective.loss(pred, inputs).mean(-1) * real
        sums = per_token.new_zeros(n).index_add_(0, sample_ids.clamp(min=0), per_token)
        counts = per_token.new_zeros(n).index_add_(0, sample_ids.clamp(min=0), real.float())
        return self._reduced(sums / counts.clamp(min=1), n)

    def _loss(self, pred, inputs, n, _output):
        return self._reduced(self.objective.loss(pred, inputs).flatten(1).mean(1), n)

    @staticmethod
    def _reduced(per_sample, n):
        """(sum of per-sample losses, sample count, logged pair): megatron divides by the global
        sample count (``calculate_per_token_loss``), so every sample weighs the same whatever its
        micro-batch, pack or rank."""
        loss_sum = per_sample.sum()
        return loss_sum, torch.tensor(n, dtype=torch.int), {"loss": torch.stack([loss_sum.detach(), torch.tensor(float(n))])}

    def _real_tokens(self, batch) -> int:
        if hasattr(batch, "cu_seqlens"):
            return int(batch.cu_seqlens[-1])
        return batch.images.shape[0] * (batch.images.shape[-1] // self.model_config.patch_size) ** 2

    def train_step(self) -> dict:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        microbatches = self.loader.next_global_batch()
        counts = torch.tensor([float(sum(getattr(b, "num_skipped", 0) for b in microbatches)),
                               float(sum(self._real_tokens(b) for b in microbatches))])
        fwd_bwd = get_forward_backward_func()
        s = (self.model_config.input_size // self.model_config.patch_size) ** 2
        reduced = fwd_bwd(forward_step_func=self._forward_step, data_iterator=iter(enumerate(microbatches)),
                          model=[self.ddp_model], num_microbatches=len(microbatches), seq_length=s,
                          micro_batch_size=self.cfg.data.micro_batch(self.dp_size), forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.ema.update(self.model, self.step)
        totals = torch.stack([r["loss"] for r in reduced]).sum(0) if reduced else torch.zeros(2)
        totals = torch.cat([totals, counts])
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        self.skipped_samples += int(totals[2])
        self.step += 1
        return {"loss": (totals[0] / totals[1].clamp(min=1)).item(), "samples": totals[1].item(),
                "tokens": totals[3].item(),
                "skipped_samples": float(self.skipped_samples),
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "lr": lr, "skipped": 0.0 if ok else 1.0}

    # ------------------------------------------------------------------ loop
    def fit(self) -> list[dict]:
        cfg, rank0 = self.cfg, dist.get_rank() == 0
        logger = MetricsLogger(self.run_dir, enabled=rank0, max_steps=cfg.trainer.max_steps, start_step=self.step,
                               tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar)
        history, window_start, window = [], time.perf_counter(), {"samples": 0.0, "tokens": 0.0}
        try:
            while self.step < cfg.trainer.max_steps:
                metrics = self.train_step()
                history.append({"step": self.step, **metrics})
                window = {k: window[k] + metrics.pop(k) for k in window}
                log_now = self.step % cfg.log.log_interval == 0 or self.step == cfg.trainer.max_steps
                if log_now:
                    elapsed = time.perf_counter() - window_start
                    metrics.update(samples_per_s=window["samples"] / elapsed, tokens_per_s=window["tokens"] / elapsed)
                    window_start, window = time.perf_counter(), {"samples": 0.0, "tokens": 0.0}
                logger.step(self.step, metrics if log_now else None)
                if cfg.log.sample_interval and self.step % cfg.log.sample_interval == 0:
                    self.preview()
                if self.step % cfg.trainer.save_interval == 0 and self.step < cfg.trainer.max_steps:
                    self.save()
            if not (self.ckpt_dir / f"step_{self.step:08d}").exists():
                self.save()
            if not cfg.log.sample_interval or self.step % cfg.log.sample_interval:
                self.preview()
        finally:
            logger.close()
        return history

    def preview(self) -> Optional[Path]:
        if self.model_config.num_classes == 0:
            log.warning("preview grids need a class-conditional model; skipped")
            return None
        return draw_preview(self.ema.module, self.model_config, self.objective, self.cfg, self.step,
                            self.run_dir / "samples", write=dist.get_rank() == 0)


def pretrain(cfg: RunConfig) -> list[dict]:
    """Train (or resume) the run described by ``cfg``; returns the per-step metrics of this call."""
    return Trainer(cfg).fit()
