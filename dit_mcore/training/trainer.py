"""The training loop: :meth:`Trainer.train_step` (one optimizer step, top to bottom) and
:meth:`Trainer.fit` (steps, their metrics and the post-step hooks: :mod:`dit_mcore.training.hooks`).
The model is built and put in its parallel layout by :func:`dit_mcore.training.parallelize.parallelize`.

Randomness that shapes a step (noise levels, noise, label dropout) is drawn from generators seeded
by ``(seed, step, micro-batch within the global batch)``, and the data order by ``(seed, epoch)``; so a
resumed run replays exactly the steps an uninterrupted run would have taken.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dit_mcore.diffusion import drop_labels
from dit_mcore.errors import ConfigError
from dit_mcore.kernels.host_copy import to_device
from dit_mcore.kernels.planned_attention import forget_plans
from dit_mcore.models.flops import peak_tflops
from dit_mcore.models.moe import reset_moe_state
from dit_mcore.models.registry import get_family
from dit_mcore.models import specs
from dit_mcore.parallel import tp_comm_overlap
from dit_mcore.parallel.initialize import adopt_slurm_launch, initialize_distributed, on_any_rank, run_device
from dit_mcore.training import checkpoint as ckpt
from dit_mcore.training.config import RunConfig
from dit_mcore.training.data import build_builtin_source
from dit_mcore.training.divergence import DivergenceError, DivergenceGuard
from dit_mcore.training.ema import EMASchedule
from dit_mcore.training.init_from import InitialWeights, take_architecture
from dit_mcore.training.hooks import (Checkpoints, StepHook, StopOnDivergence, StopOnPreemption,
                                      config_reads_after, validation_due)
from dit_mcore.training.metrics import MetricsLogger, StepRate, device_memory
from dit_mcore.training.optim import (build_optimizer, grads_and_norm, load_schedule, per_sample_loss_scale,
                                     reload_offloaded_copies, step_if_finite)
from dit_mcore.training.parallelize import parallelize
from dit_mcore.training.preemption import PreemptionSignals
from dit_mcore.training.step_loss import StepLoss, counted
from dit_mcore.training.profiling import Profiling, enable_flight_recorder
from dit_mcore.training.data_fit import data_fields, describe as describe_fit, fit_model_to_data
from dit_mcore.training.validate import check_run_dir_writable, validate_run
from dit_mcore.training.val_loss import Validation
from energon_data.lifetime import forked_children_exit_with_parent

log = logging.getLogger("dit_mcore.train")


def _launched_world_size() -> int:
    """Processes in this run (torchrun's or srun's ``WORLD_SIZE``; 1 for plain ``python``)."""
    adopt_slurm_launch()
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def step_generator(seed: int, step: int, global_micro: int, device="cpu") -> torch.Generator:
    """Independent, reproducible stream per (step, micro-batch of the global batch) on ``device``.
    Keyed by the micro-batch's place in the global batch, not by rank, so any data-parallel layout
    draws the same noise for the same samples."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) * 65_537 + global_micro)


class Trainer:
    """Owns the model, optimizer, data and run directory of one training run; ``hooks`` run after
    each step, after the built-in stops and checkpoints (:mod:`dit_mcore.training.hooks`)."""

    def __init__(self, cfg: RunConfig, hooks: Sequence[StepHook] = ()):
        self.cfg = cfg
        validate_run(cfg, _launched_world_size())  # every field, the layout and the batch, before any compute
        forked_children_exit_with_parent()  # nothing this run forks outlives it, even after kill -9
        recorder = cfg.trainer.flight_recorder and enable_flight_recorder(Path(cfg.log.dir))  # (before the group)
        initialize_distributed(cfg.parallel, cfg.trainer.seed)
        check_run_dir_writable(cfg)  # (every rank, agreed: before the model is built)
        self.run_dir = Path(cfg.log.dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        resuming = next(ckpt.intact_checkpoints(self.ckpt_dir, quiet=True), None) is not None
        # trainer.init_from: a new run's first weights (and unset shape fields) from another checkpoint or library.
        initial = InitialWeights.prepare(cfg, self.run_dir) if cfg.trainer.init_from and not resuming else None
        # The shape fields left unset: a resumed run's from its checkpoint, a run started from other weights
        # from those (the fields its data fixes too: the record wins), else from the data.
        record = ckpt.recorded_architecture(self.ckpt_dir) if resuming else initial and initial.architecture()
        taken = take_architecture(cfg.model, record, "its checkpoint" if resuming else f"trainer.init_from={cfg.trainer.init_from}",
                                  leave=data_fields(cfg))
        fitted = fit_model_to_data(cfg, recorded=lambda: record)
        if dist.get_rank() == 0:
            written = self.run_dir / "run_config.json.tmp"  # (whole or not at all)
            written.write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
            written.replace(self.run_dir / "run_config.json")
            for line in (specs.fallbacks_line(), resuming and cfg.trainer.init_from and
                         f"trainer.init_from={cfg.trainer.init_from} is not used: the run resumes its own checkpoint",
                         initial and taken and "the model's shape from trainer.init_from: "
                         + " ".join(f"model.{k}={v}" for k, v in taken.items()),
                         fitted and describe_fit(fitted)):
                if line:
                    log.info("%s", line)
        self.device = run_device()
        self.profiling = Profiling(cfg.trainer, self.run_dir, dist.get_rank(), self.device)  # (the build included)
        if recorder and dist.get_rank() == 0:
            log.info("NCCL flight recorder on: a watchdog timeout dumps each rank's recent collectives to %s<rank>",
                     recorder)
        self.family = get_family(cfg.model.family)
        self.model_config = cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16)
        # Pipeline p2p sends each micro-batch's shape first when packed streams may vary in length.
        self.model_config.variable_seq_lengths = cfg.data.packs or cfg.data.uses_energon
        self.compute_dtype = torch.bfloat16 if cfg.trainer.bf16 else torch.float32
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = cfg.data.num_microbatches(self.dp_size)
        self.objective = cfg.diffusion.build()
        self.step_loss = StepLoss(self.model_config, self.objective, self.compute_dtype, cfg.model.family)
        if self.model_config.num_moe_experts:
            reset_moe_state()
        if cfg.parallel.tp_comm_overlap:  # TE's userbuffers, before the first forward
            tp_comm_overlap.initialize_userbuffers(
                tp_comm_overlap.userbuffer_shape(cfg.data, self.model_config, self.dp_size),
                cfg.parallel.tensor_model_parallel_size, self.compute_dtype)

        self.parallel_model = parallelize(cfg, self.model_config, self.family, self.device,
                                          initial=initial and (lambda chunks: initial.load(chunks, cfg, self.model_config)))
        if initial:
            line = initial.done()
            if dist.get_rank() == 0:
                log.info("%s", line)
        self.model, self.ddp_chunks = self.parallel_model.model, self.parallel_model.ddp_chunks
        self.ema, self.ema_sharded = self.parallel_model.ema, self.parallel_model.ema_sharded
        self.optimizer, self.scheduler = build_optimizer(self.ddp_chunks, cfg.optim, bf16=cfg.trainer.bf16,
                                                         max_steps=cfg.trainer.max_steps)
        self.sample_weight = torch.ones((), device=self.device)  # 1 / the global batch's samples, per step
        per_sample_loss_scale(self.ddp_chunks[0].config, self.optimizer, self.sample_weight)
        self.loader = self._build_data()
        self.validation = Validation(self) if cfg.trainer.val_interval else None  # (its samples read now)
        self.logger: Optional[MetricsLogger] = None  # (while fit runs: the hooks' way to the sinks)

        self.hooks = all_hooks = [StopOnDivergence(), StopOnPreemption(),
                                  Checkpoints(cfg.trainer.save_interval, cfg.trainer.max_steps), *hooks]
        if cfg.trainer.fid_interval and not any("eval/fid" in h.provides for h in all_hooks) and dist.get_rank() == 0:
            log.warning("trainer.fid_interval=%d without its hook: no FID is computed (the command line attaches it; "
                        "from Python: pretrain(cfg, hooks=[dit_mcore.evaluate.during_training.FIDDuringTraining(cfg)]))",
                        cfg.trainer.fid_interval)
        # (the schedule reads the hooks' list, not the trainer: a finished trainer is freed at once, with its
        # loader's threads and its process groups, without waiting for the cycle collector)
        self.ema_schedule = EMASchedule(self.ema, self.model, every=cfg.trainer.ema_every,
                                        read_after=lambda step: config_reads_after(cfg, step)
                                        or any(h.reads_after(step) for h in all_hooks),
                                        gather=self.parallel_model.gather_params,
                                        overlap_param_gather=self.parallel_model.overlap_param_gather)
        self.skipped_samples = 0
        self.divergence = DivergenceGuard(cfg.trainer.max_skipped_steps)
        self.signals = PreemptionSignals()
        self.last_saved: Optional[str] = None  # the newest checkpoint's name (kept if training diverges)
        self.async_saves = None
        if cfg.trainer.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
            self.async_saves = AsyncCallsQueue()
        self.step = 0
        self._maybe_resume()

    # ------------------------------------------------------------------ setup helpers
    def _build_data(self):
        cfg = self.cfg
        common = dict(dp_rank=self.dp_rank, dp_size=self.dp_size, seed=cfg.trainer.seed,
                      pad_multiple=cfg.data.pad_multiple)
        if cfg.data.uses_energon:
            from dit_mcore.training.energon_source import EnergonSource
            return EnergonSource(cfg.data, self.model_config, num_microbatches=self.num_microbatches, **common)
        return build_builtin_source(cfg.data, self.model_config, **common)

    def _data_per_rank(self) -> bool:
        return self.loader.per_rank_state

    def _common_state(self) -> dict:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "world_size": dist.get_world_size(),
                 "skipped_samples": self.skipped_samples, "model_arch": self._architecture(),
                 "divergence": self.divergence.state_dict(), "ema_unfolded_decay": self.ema.unfolded_decay,
                 "run_config": self.cfg.to_dict()}
        if self._data_per_rank():
            state["data_layout"] = self.loader.layout()
        else:
            state["data"] = self.loader.state_dict()
        return state

    def _architecture(self) -> dict:
        return ckpt.architecture(self.model_config, self.cfg.model.family, self.cfg.model.preset)

    def _maybe_resume(self) -> None:
        """Resume from the newest checkpoint that loads: one that passes the size check but fails
        to load (corrupt in place) is reported and the previous one is tried, on every rank alike."""
        from energon_data.loader import DataResumeError
        from torch.distributed.checkpoint.api import CheckpointException
        tried = []
        for path in ckpt.intact_checkpoints(self.ckpt_dir):
            try:
                self._resume_from(path)
                error = None
            except (ConfigError, DataResumeError):  # another model, another data layout: the user's call
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 -- any load failure falls back
                error = e  # (torch's CheckpointException, an unreadable shard, is a BaseException)
            if not on_any_rank(error is not None, self.device):
                return
            log.warning("checkpoint %s could not be loaded (%s); trying the previous one", path,
                        f"{type(error).__name__}: {error}" if error else "failed on another rank")
            tried.append(path.name)
        if tried:
            raise ckpt.CheckpointError(f"no checkpoint in {self.ckpt_dir} could be loaded (tried {', '.join(tried)}, "
                                       "see the warnings above); move them away to start over, or restore one")

    def _resume_from(self, path: Path) -> None:
        # The common state tells the saved world size before any per-rank object is requested:
        # those from a different world would fail deep inside dist_checkpointing.
        common = ckpt.load_common(path)
        same_world = common["world_size"] == dist.get_world_size()
        per_rank, common_data = {}, "data" in common
        if self._data_per_rank():
            if self.loader.check_layout(common.get("data_layout"), dist.get_world_size(), common["world_size"]):
                per_rank = {"data": self.loader.state_dict()}
        elif not common_data:  # per-rank loader states where this run keeps one: refused (or restarted) before any load
            self.loader.load_state_dict(None)
        if not same_world:
            log.info("checkpoint was written by %d ranks, this run has %d: weights and optimizer are "
                     "resharded, per-rank RNG states are not restored", common["world_size"], dist.get_world_size())
        with self.ema.loading() as shadow:
            loaded = ckpt.load_checkpoint(path, self.model, shadow, self.optimizer,
                                          extra=self._common_state(), per_rank=per_rank, restore_rng=same_world,
                                          saved_arch=common.get("model_arch"), arch=self._architecture(),
                                          ema_partial=self.ema_sharded)
        if self.cfg.optim.cpu_offload:  # (the main weights were loaded into the device's shards)
            reload_offloaded_copies(self.optimizer)
        state = loaded["extra"]
        self.step = int(state["step"])
        self.skipped_samples = int(state["skipped_samples"])
        self.divergence.load_state_dict(state["divergence"])
        self.ema.unfolded_decay = float(state.get("ema_unfolded_decay", 1.0))  # (older checkpoints: 1.0)
        self.last_saved = path.name
        schedule = load_schedule(self.scheduler, state["scheduler"], self.cfg.optim.resume_schedule, self.step)
        if schedule and dist.get_rank() == 0:
            log.warning("%s", schedule)
        if "data" in loaded["per_rank"]:
            self.loader.load_state_dict(loaded["per_rank"]["data"])
        elif not self._data_per_rank() and common_data:
            self.loader.load_state_dict(state["data"])
        log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        per_rank = {"data": self.loader.state_dict()} if self._data_per_rank() else {}
        self.parallel_model.gather_params()  # the model weights of the last update (overlap_param_gather)
        try:
            self.finish_saves()  # one save in flight at a time
        except ckpt.SaveFailed as e:  # the one in flight failed: said, and this one is written all the same
            log.error("%s; %s stays the latest; saving step %d now", e, self.last_saved or "no checkpoint", self.step)
        with self.ema.saving() as shadow:  # (sharded: what this rank writes, gathered into host memory)
            path = ckpt.save_checkpoint(self.ckpt_dir, self.step, self.model, shadow, self.optimizer,
                                        extra=self._common_state(), per_rank=per_rank,
                                        keep=self.cfg.trainer.keep_checkpoints,
                                        protect=frozenset(self.divergence.protected), async_queue=self.async_saves,
                                        ema_partial=self.ema_sharded)
        self.last_saved = path.name
        return path

    def finish_saves(self, blocking: bool = True) -> None:
        """Publish an asynchronous save in flight once written (``blocking``: wait for it; no-op for synchronous
        saves). A write that failed on any rank raises :class:`~dit_mcore.training.checkpoint.SaveFailed` on
        every rank, its partial files removed, and the newest published checkpoint stays ``last_saved``."""
        if self.async_saves is None:
            return
        try:
            ckpt.finalize_async_saves(self.async_saves, self.ckpt_dir, blocking=blocking)
        except ckpt.SaveFailed:
            latest = self.ckpt_dir / "latest"
            self.last_saved = latest.read_text().strip() if latest.exists() else None
            raise

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator: Iterator, model):
        """One micro-batch, dense or packed alike: one noise level per *sample*, broadcast to its
        tokens; the loss is averaged per sample over its real tokens."""
        micro, batch = next(data_iterator)
        mc = self.model_config
        g = step_generator(self.cfg.trainer.seed, self.step, self.dp_rank * self.num_microbatches + micro,
                           self.device)
        n = batch.num_samples
        level = self.objective.sample_level(n, generator=g, device=self.device)
        noise = torch.randn(batch.tokens.shape, generator=g, device=self.device)
        labels = drop_labels(self.step_loss.labels_of(batch), mc.class_dropout_prob, mc.num_classes, generator=g)
        keep = torch.rand(n, generator=g, device=self.device) >= mc.text_dropout_prob if mc.text_dim else None
        return self.step_loss.forward(model, batch, level, noise, labels, text_keep=keep)  # (keep: CFG's null text)

    def train_step(self) -> dict:
        """One optimizer step, top to bottom: zero the gradients; the global batch's micro-batches forward
        and backward (megatron's schedule, each sample weighing 1 / the batch's samples); the step's
        metrics and the preemption vote reduced; the gradient norm (the step's one host wait); clip and
        update, skipped if the loss or the norm is not finite, with the EMA's schedule around it; the
        LR schedule. Returns the step's metrics."""
        forget_plans()  # the last step's packed-attention plans: its backward passes are done
        for chunk in self.ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.signals.begin(self.step + 1)
        microbatches = [b.to(self.device) for b in self.loader.next_global_batch()]
        self._weigh_samples(microbatches)
        rows, seq = microbatches[0].tokens.shape[:2]
        reduced = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=[iter(enumerate(microbatches)) for _ in self.ddp_chunks],
            model=self.ddp_chunks, num_microbatches=len(microbatches), seq_length=self.model.token_shard.padded(seq),
            micro_batch_size=rows, forward_only=False)
        self.signals.start_vote(self.device)
        totals = self._reduce_metrics(reduced, microbatches)  # queued: read below, after the wait
        moe = self._moe_metrics(len(microbatches))
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = grads_and_norm(self.optimizer)  # the host waits for the backward here
        values = torch.cat([totals, *(v.float().reshape(1) for v in moe.values())]).tolist()  # done by now
        loss_sum, samples, skipped_samples, tokens, gflops, ballot = values[:6]
        loss = loss_sum / max(samples, 1.0)
        self.step += 1  # the update, the EMA's schedule and the hooks see the number of the step it completes
        updated = self.ema_schedule.around_update(self.step, lambda: self._update(math.isfinite(loss), grad_norm))
        self.signals.settle(ballot, dist.get_world_size(parallel_state.get_data_parallel_group()))
        self.divergence.record(updated, self.step, self.last_saved)
        self.skipped_samples += int(skipped_samples)
        return {"loss": loss, "samples": samples, "tokens": tokens, "model_flops": gflops * 1e9,
                "skipped_samples": float(self.skipped_samples), "grad_norm": grad_norm, "lr": lr,
                "skipped": 0.0 if updated else 1.0, "skipped_steps": float(self.divergence.skipped_steps),
                **dict(zip(moe, values[6:]))}

    def train_steps(self, n: int) -> list[dict]:
        """``n`` steps, as :meth:`fit` runs them (without its hooks and logs)."""
        return [self.train_step() for _ in range(n)]

    def _update(self, loss_is_finite: bool, grad_norm: float) -> bool:
        """Clip and update (skipped if the loss or the norm is not finite); the LR schedule and the
        parameter gather (``overlap_param_gather``) follow an applied update. True if applied."""
        if not step_if_finite(self.optimizer, loss_is_finite, grad_norm):
            return False
        self.scheduler.step(increment=1)
        self.parallel_model.mark_updated()
        return True

    def _reduce_metrics(self, reduced: list, microbatches) -> torch.Tensor:
        """``[loss sum, samples, skipped samples, real tokens, GFLOPs, preemption ballot]`` summed over the
        data-parallel ranks, queued on the device (the losses live on the last pipeline stage)."""
        flops = sum(self.family.flops(self.model_config, b.seqlens, b.text_seqlens, b.grids[:, 0].tolist()).model
                    for b in microbatches)  # host ints (grids stay on the host)
        counts = to_device([float(sum(b.num_skipped for b in microbatches)),
                            float(sum(b.num_real_tokens for b in microbatches)), flops / 1e9], self.device)
        totals = torch.stack([r["loss"] for r in reduced]).sum(0) if reduced else torch.zeros(2, device=self.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        totals = torch.cat([totals, counts, self.signals.ballot()])
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return totals

    def _weigh_samples(self, microbatches) -> None:
        """Every sample weighs 1 / the global batch's sample count, on the device: each stage holds
        its replica's micro-batches, so no stage waits for the last one's count."""
        samples = to_device([float(counted(sum(b.num_samples for b in microbatches)))], self.device)
        dist.all_reduce(samples, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        self.sample_weight.copy_(1.0 / samples.clamp(min=1.0)[0])

    def _moe_metrics(self, num_microbatches: int) -> dict:
        """The MoE router losses of this step (mean over layers and micro-batches, all ranks, device
        tensors read with the step's other metrics), as megatron's tracker collected them; empty
        for dense models."""
        if not self.model_config.num_moe_experts:
            return {}
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics
        losses = {}
        track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=self.step, total_loss_dict=losses,
                          num_layers=self.model_config.num_layers)
        return {name: torch.as_tensor(value, device=self.device) for name, value in losses.items()}

    # ------------------------------------------------------------------ loop
    def _evaluate(self, rate: StepRate) -> dict:
        """The step's evaluations: the validation loss at its interval, what hooks add (FID); not at a step where
        a preemption was agreed (its checkpoint is written at once instead); their time is not the steps'."""
        if self.signals.agreed is not None:
            return {}
        with rate.paused():
            extra = (self.validation.metrics(self) if self.validation and validation_due(self.cfg.trainer, self.step)
                     else {})
            for hook in self.hooks:
                extra.update(hook.metrics(self))
        return extra

    def fit(self) -> list[dict]:
        """Train to ``trainer.max_steps``: a step, its metrics logged, the post-step hooks; at the end the
        hooks' last work (the final checkpoint, then an attached preview). Returns the steps' metrics."""
        cfg, rank0 = self.cfg, dist.get_rank() == 0
        self.logger = logger = MetricsLogger(
            self.run_dir, enabled=rank0, max_steps=cfg.trainer.max_steps, start_step=self.step,
            tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar, wandb_config=cfg if cfg.log.wandb else None)
        rate = StepRate(dist.get_world_size(), peak_tflops(self.device, "bf16" if cfg.trainer.bf16 else "fp32",
                                                           cfg.trainer.peak_tflops))
        history, failed = [], True
        try:
            with self.signals:
                while self.step < cfg.trainer.max_steps:
                    with self.profiling.step(self.step + 1):
                        metrics = self.train_step()
                    history.append({"step": self.step, **metrics})
                    metrics = dict(metrics)
                    rate.add(metrics.pop("samples"), metrics.pop("tokens"), metrics["model_flops"])
                    extra = self._evaluate(rate)
                    history[-1].update(extra)
                    log_now = (self.step % cfg.log.log_interval == 0 or self.step == cfg.trainer.max_steps
                               or metrics["skipped"] or bool(extra))  # a skipped step is always shown
                    logger.step(self.step, {**metrics, **extra, **rate.flush(), **device_memory(self.device)}
                                if log_now else None)
                    for hook in self.hooks:
                        hook.after_step(self)
            for hook in self.hooks:
                hook.at_end(self)
            failed = False
        except DivergenceError:
            self.finish_saves()  # a save in flight holds weights from before the divergence
            raise
        finally:
            self.profiling.close()
            logger.close(failed=failed)  # (W&B marks a run that raised, a preemption too, as failed)
            self.logger = None
        return history


def pretrain(cfg: RunConfig, hooks: Sequence[StepHook] = ()) -> list[dict]:
    """Train (or resume) the run described by ``cfg`` (``hooks``: e.g. previews,
    :class:`dit_mcore.generate.preview.Previews`); returns the per-step metrics of this call."""
    return Trainer(cfg, hooks).fit()
