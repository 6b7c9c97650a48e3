"""The training loop: megatron-core forward/backward schedule, DDP, optimizer, EMA, checkpoints,
metrics and preview grids.

Randomness that shapes a step (noise levels, noise, label dropout) is drawn from generators seeded
by ``(seed, step, micro-batch within the global batch)``, and the data order by ``(seed, epoch)``; so a
resumed run replays exactly the steps an uninterrupted run would have taken.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
import signal
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dit_mcore.errors import ConfigError
from dit_mcore.diffusion import build_objective, drop_labels
from dit_mcore.generate.media import dataset_decoder
from dit_mcore.generate.sampling import dataset_text_encoder
from dit_mcore.kernels.host_copy import HostRead, to_device
from dit_mcore.kernels.planned_attention import forget_plans
from dit_mcore.models.adapter import prediction, to_model_layout
from dit_mcore.models.flops import peak_tflops
from dit_mcore.models.moe import reset_moe_state
from dit_mcore.models.registry import get_family
from dit_mcore.models.seeding import materialize_parts, on_each_part
from dit_mcore.models.text import TextContext
from dit_mcore.parallel import tp_comm_overlap
from dit_mcore.parallel.fsdp import copy_into, forward_view, local, publish_weights
from dit_mcore.parallel.initialize import adopt_slurm_launch, initialize_distributed, run_device
from dit_mcore.parallel.pipeline import ModelChunks, PipelinedForward
from dit_mcore.training import checkpoint as ckpt, ema_shards, memory
from dit_mcore.training.config import RunConfig
from dit_mcore.training.data import build_builtin_source
from dit_mcore.training.ema import EMA
from dit_mcore.training.metrics import MetricsLogger, StepRate
from dit_mcore.training.divergence import DivergenceError, DivergenceGuard
from dit_mcore.training.preemption import Preempted, PreemptionSignals, requeue_if_slurm
from dit_mcore.training.optim import (build_optimizer, device_grad_norm, grads_and_norm, moment_dtypes,
                                     per_sample_loss_scale, prefers_flat, resolve_adam_impl, shard_fully,
                                     step_if_finite, step_on_device, steps_on_device, wrap_data_parallel)
from dit_mcore.training.preview import draw_preview, draw_text_preview, moving_digits_prompts
from dit_mcore.training.torch_optimizer import builds_torch_adam
from dit_mcore.training.validate import validate_run
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
    """Owns the model, optimizer, data and run directory of one training run."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        validate_run(cfg, _launched_world_size())  # every field, the layout and the batch, before any compute
        forked_children_exit_with_parent()  # nothing this run forks outlives it, even after kill -9
        initialize_distributed(cfg.parallel, cfg.trainer.seed)
        self.device = run_device()
        self.family = get_family(cfg.model.family)
        self.model_config = cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16)
        # Pipeline p2p sends each micro-batch's shape first when packed streams may vary in length.
        self.model_config.variable_seq_lengths = cfg.data.packs or cfg.data.uses_energon
        self.compute_dtype = torch.bfloat16 if cfg.trainer.bf16 else torch.float32
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = cfg.data.num_microbatches(self.dp_size)
        self.objective = build_objective(cfg.diffusion.objective)
        if self.model_config.num_moe_experts:
            reset_moe_state()
        if cfg.parallel.tp_comm_overlap:  # TE's userbuffers, before the first forward
            tp_comm_overlap.initialize_userbuffers(
                tp_comm_overlap.userbuffer_shape(cfg.data, self.model_config, self.dp_size),
                cfg.parallel.tensor_model_parallel_size, self.compute_dtype)

        # This rank's pipeline chunks (one without VPP) and the EMA shadow; with
        # model.init_model_with_meta_device both start on the meta device and are filled part by
        # part after FSDP has sharded them (each rank allocates only its shards).
        parts = []
        with on_each_part(lambda key, owned: parts.append((key, owned))) if self.meta_init else contextlib.nullcontext():
            self.model = self._build_model()
        self.ema_sharded = self._ema_sharded()
        self._check_state_fits()  # before the EMA, the optimizer and any compile allocate or take time
        if cfg.model.compile:
            for chunk in self.model:
                chunk.compile_layers(cfg.model.compile_mode, cfg.model.compile_options)
        rng = torch.get_rng_state()  # the shadow's random init is overwritten; keep the stream
        # The EMA shadow (fp32, previews) multiplies in full precision: float8 is a training speed-up,
        # and fp32-output float8 GEMMs are not supported on every GPU. Same parameters and keys.
        # Sharded (trainer.ema_shard), it is only ever allocated whole for a preview or a checkpoint.
        shadow = self._build_model(device="meta" if self.ema_sharded else None,
                                   config=_shadow_config(self.model_config, unallocated=self.ema_sharded,
                                                         te=_holds_te(self.model))).float()
        torch.set_rng_state(rng)
        fsdp = cfg.parallel.fsdp != "none"
        if not fsdp:
            self._materialize(parts, None if self.ema_sharded else shadow)
        self.ddp_chunks = wrap_data_parallel(self.model, self.model_config, cfg.parallel,
                                             use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
                                             grad_reduce_in_fp32=cfg.optim.main_grads_dtype == "fp32")
        if fsdp:  # the EMA shadow is sharded like the model
            self.shadow_chunks = shard_fully(shadow, self.model_config, self.ddp_chunks[0].ddp_config,
                                             cfg.parallel.fsdp)
            self._materialize(parts, shadow)
        self.ema = EMA(self.model, shadow, cfg.trainer.ema_decay, offload=cfg.trainer.ema_offload,
                       shard_over=self.ddp_chunks if self.ema_sharded else None)
        self.optimizer, self.scheduler = build_optimizer(self.ddp_chunks, cfg.optim, bf16=cfg.trainer.bf16,
                                                         max_steps=cfg.trainer.max_steps)
        self.sample_weight = torch.ones((), device=self.device)  # 1 / the global batch's samples, per step
        per_sample_loss_scale(self.ddp_chunks[0].config, self.optimizer, self.sample_weight)
        self.loader = self._build_data()
        self.skipped_samples = 0
        self._params_gathered = True  # every rank's model weights are whole (overlap_param_gather)
        self.divergence = DivergenceGuard(cfg.trainer.max_skipped_steps)
        self.signals = PreemptionSignals()
        self.last_saved: Optional[str] = None  # the newest checkpoint's name (kept if training diverges)
        self.async_saves = None
        if cfg.trainer.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
            self.async_saves = AsyncCallsQueue()
        self.run_dir = Path(cfg.log.dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.step = 0
        self._maybe_resume()

    # ------------------------------------------------------------------ setup helpers
    @property
    def meta_init(self) -> bool:
        return bool(self.cfg.model.init_model_with_meta_device)

    def _build_model(self, device=None, seed: Optional[int] = None, config=None) -> ModelChunks:
        config = config or self.model_config

        def chunk(**stage):
            return self.family.build(config, backend=self.cfg.model.backend, **stage)
        device = device or ("meta" if self.meta_init else self.device)
        with torch.device(device):
            model = ModelChunks.build(chunk, self.model_config.virtual_pipeline_model_parallel_size, seed=seed)
        # bf16 parameters and compute; the optimizer keeps fp32 main weights (megatron mixed precision).
        return model.to(self.compute_dtype)

    def _materialize(self, parts: list, shadow: Optional[ModelChunks]) -> None:
        """Allocate a meta-built model (its shards only, under FSDP) and fill it part by part with
        the values a direct build gives; the shadow (None: a sharded EMA's, left on the meta device)
        is only allocated (the EMA copies the model)."""
        if not self.meta_init:
            return
        modules = (self.model,) if shadow is None else (self.model, shadow)
        if self.cfg.parallel.fsdp != "megatron":  # (Megatron-FSDP allocated its shards when it wrapped)
            for module in modules:
                module.to_empty(device=self.device)
        with torch.random.fork_rng(devices=[]):
            materialize_parts(lambda: self._build_model(device="cpu", seed=self.model.init_seed), parts,
                              copy_into=copy_into)
        publish_weights(modules)
        left = [name for module in modules for name, t in (*module.named_parameters(),
                                                                         *module.named_buffers()) if local(t).is_meta]
        if left:
            raise RuntimeError(f"the meta-device build left {len(left)} tensors unallocated (first: {left[0]}); "
                               "a module the sharding wrapper does not allocate needs a reset_parameters method")

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
            failed = torch.tensor([error is not None], dtype=torch.int32, device=self.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not failed.item():
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
        per_rank = {}
        if self._data_per_rank():
            if self.loader.check_layout(common["data_layout"], dist.get_world_size(), common["world_size"]):
                per_rank = {"data": self.loader.state_dict()}
        if not same_world:
            log.info("checkpoint was written by %d ranks, this run has %d: weights and optimizer are "
                     "resharded, per-rank RNG states are not restored", common["world_size"], dist.get_world_size())
        with self.ema.loading() as shadow:
            loaded = ckpt.load_checkpoint(path, self.model, shadow, self.optimizer,
                                          extra=self._common_state(), per_rank=per_rank, restore_rng=same_world,
                                          saved_arch=common.get("model_arch"), arch=self._architecture(),
                                          ema_partial=self.ema_sharded)
        state = loaded["extra"]
        self.step = int(state["step"])
        self.skipped_samples = int(state["skipped_samples"])
        self.divergence.load_state_dict(state["divergence"])
        self.ema.unfolded_decay = float(state.get("ema_unfolded_decay", 1.0))  # (older checkpoints: 1.0)
        self.last_saved = path.name
        self.scheduler.load_state_dict(state["scheduler"])
        if "data" in loaded["per_rank"]:
            self.loader.load_state_dict(loaded["per_rank"]["data"])
        elif not self._data_per_rank():
            self.loader.load_state_dict(state["data"])
        log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        per_rank = {"data": self.loader.state_dict()} if self._data_per_rank() else {}
        self._sync_params()  # the model weights of the last update (overlap_param_gather)
        self.finish_saves()  # one save in flight at a time
        with self.ema.saving() as shadow:  # (sharded: what this rank writes, gathered into host memory)
            path = ckpt.save_checkpoint(self.ckpt_dir, self.step, self.model, shadow, self.optimizer,
                                        extra=self._common_state(), per_rank=per_rank,
                                        keep=self.cfg.trainer.keep_checkpoints,
                                        protect=frozenset(self.divergence.protected), async_queue=self.async_saves,
                                        ema_partial=self.ema_sharded)
        self.last_saved = path.name
        return path

    def finish_saves(self) -> None:
        """Wait for an asynchronous save in flight and publish it (no-op for synchronous saves)."""
        if self.async_saves is not None:
            self.async_saves.maybe_finalize_async_calls(blocking=True)

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator: Iterator, model):
        """One micro-batch, dense or packed alike: one noise level per *sample*, broadcast to its
        tokens; the loss is averaged per sample over its real tokens."""
        micro, batch = next(data_iterator)
        mc = self.model_config
        if batch.tokens.shape[-1] != mc.patch_dim:
            raise ConfigError(f"data tokens have {batch.tokens.shape[-1]} values but the model expects "
                              f"in_channels x patch volume = {mc.patch_dim}; set model.in_channels / patch sizes "
                              "to match the data")
        g = step_generator(self.cfg.trainer.seed, self.step, self.dp_rank * self.num_microbatches + micro,
                           self.device)
        x0 = batch.tokens.float()
        n = batch.num_samples
        level = self.objective.sample_level(n, generator=g, device=self.device)
        noise = torch.randn(x0.shape, generator=g, device=self.device)
        labels = torch.where(batch.labels >= 0, batch.labels, torch.full_like(batch.labels, mc.num_classes))
        labels = drop_labels(labels, mc.class_dropout_prob, mc.num_classes, generator=g)
        text = None
        if mc.text_dim:
            if not batch.has_text:
                raise ConfigError(f"model.family={self.cfg.model.family} is conditioned on text but the data has "
                                  "none; use a prepared energon dataset (it carries text embeddings)")
            keep = torch.rand(n, generator=g, device=self.device) >= mc.text_dropout_prob  # CFG: drop to null text
            text = TextContext.from_batch(batch, keep)
        sample_of = batch.token_to_sample.clamp(min=0)
        inputs = self.objective.prepare(x0.flatten(0, 1), noise.flatten(0, 1), level[sample_of])
        x_in = to_model_layout(inputs.model_input.view_as(x0).to(self.compute_dtype))
        out = model(x_in, self.objective.timestep(level), labels, batch=batch, context=text)
        return out, partial(self._loss, inputs, batch)

    def _loss(self, inputs, batch, output):
        """(sum of per-sample losses, sample count, logged pair). The gradient is divided by the
        global sample count through the loss scale (:meth:`_weigh_samples`), so every sample weighs
        the same whatever its micro-batch, pack or rank; megatron's schedule, in its per-token mode
        (``calculate_per_token_loss``: no division by the micro-batch count, a sum over DP), sums the
        counts, which :func:`optim.finalize_grads` then leaves unused. Context-parallel ranks other
        than the first report a count of 0 (they compute the same loss); the logged pair always
        carries the real count."""
        pred = prediction(output, self.model_config).reshape(-1, self.model_config.patch_dim)
        real = batch.token_to_sample >= 0
        per_token = self.objective.loss(pred, inputs).mean(-1) * real
        n, sample_of = batch.num_samples, batch.token_to_sample.clamp(min=0)
        sums = per_token.new_zeros(n).index_add_(0, sample_of, per_token)
        counts = per_token.new_zeros(n).index_add_(0, sample_of, real.float())
        loss_sum = (sums / counts.clamp(min=1)).sum()
        count = loss_sum.new_full((), self._counted(n), dtype=torch.int)  # a fill kernel: no host-to-device copy
        return loss_sum, count, {"loss": torch.stack([loss_sum.detach(), loss_sum.new_full((), float(n))])}

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (the host reads them once the step is queued)."""
        return self._settle(self._run_step())

    def train_steps(self, n: int) -> list[dict]:
        """``n`` steps, as :meth:`fit` runs them (without its saves, previews and logs)."""
        return [self.train_step() for _ in range(n)]

    def _run_step(self) -> "_Step":
        """Queue one step: forward/backward, the reductions of its metrics, then the update.

        Where the optimizer steps on the device, the clip and the skip of a non-finite step are
        decided there (:func:`optim.step_on_device`) and the metrics are copied back behind the
        update (:class:`dit_mcore.kernels.host_copy.HostRead`): the host queues the whole step
        before it first waits, in :meth:`_settle`. Elsewhere (apex/TE or foreach Adam) the host
        reads the gradient norm and decides, as megatron does. (Reading step k while step k+1 ran
        measured 1.01x, eager only, and was removed: issue 39.)"""
        forget_plans()  # the last step's packed-attention plans: its backward passes are done
        for chunk in self.ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        microbatches = [b.to(self.device) for b in self.loader.next_global_batch()]
        flops = sum(self.family.flops(self.model_config, b.seqlens, b.text_seqlens, b.grids[:, 0].tolist()).model
                    for b in microbatches)  # host ints (grids stay on the host)
        counts = to_device([float(sum(b.num_skipped for b in microbatches)),
                            float(sum(b.num_real_tokens for b in microbatches)), flops / 1e9], self.device)
        self._weigh_samples(microbatches)
        fwd_bwd = get_forward_backward_func()
        rows, seq = microbatches[0].tokens.shape[:2]
        reduced = fwd_bwd(forward_step_func=self._forward_step,
                          data_iterator=[iter(enumerate(microbatches)) for _ in self.ddp_chunks],
                          model=self.ddp_chunks, num_microbatches=len(microbatches),
                          seq_length=self.model.token_shard.padded(seq), micro_batch_size=rows,
                          forward_only=False)
        self.signals.start_vote(self.device)  # overlaps the metrics below; read with the loss
        step = _Step(self.step + 1, moe=self._moe_metrics(len(microbatches)))
        totals = torch.stack([r["loss"] for r in reduced]).sum(0) if reduced else torch.zeros(2, device=self.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # losses live on the last stage
            dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        totals = torch.cat([totals, counts, self.signals.ballot()])
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        moe = list(step.moe.values())
        step.lr = self.optimizer.param_groups[0]["lr"]
        self.ema.fence()  # an offloaded EMA's copies of the weights (a side stream) before the update writes them
        if self.steps_on_device:
            grad_norm = device_grad_norm(self.optimizer, self.device)
            step.read = HostRead(torch.cat([totals, grad_norm.reshape(1), *(v.float().reshape(1) for v in moe)]))
            step_on_device(self.optimizer, totals[0] / totals[1].clamp(min=1.0), grad_norm)
        else:
            grad_norm = grads_and_norm(self.optimizer)  # the host waits for the backward here
            step.values = totals.tolist() + [grad_norm] + [float(v) for v in moe]  # done by now
            step.updated = step_if_finite(self.optimizer, math.isfinite(step.values[0] / max(step.values[1], 1.0)),
                                          grad_norm)
        if self._ema_folds_after(step.index) and (self.ema_sharded or not self.cfg.parallel.overlap_param_gather):
            self.ema.stage(self.model)  # offloaded: its copies queued now run beside the next forward
            # (a sharded EMA reads this rank's own slices, written by this update, which the next forward's
            # gather leaves as they are; a replicated one under overlap_param_gather needs that gather: the
            # fold copies the weights itself)
        self.step += 1
        return step

    def _settle(self, step: "_Step") -> dict:
        """Read ``step``'s metrics and do what its outcome decides on the host (once per step): the LR
        schedule and the EMA advance only after an update, the divergence guard counts a skip,
        the preemption vote is tallied. The updated parameters are gathered
        (``overlap_param_gather``) only for a reader: a replicated EMA's fold here, a save."""
        values = step.values if step.values is not None else step.read.get()
        loss_sum, samples, skipped_samples, tokens, gflops, ballot, grad_norm = values[:7]
        loss = loss_sum / max(samples, 1.0)
        ok = step.updated if step.updated is not None else math.isfinite(loss) and math.isfinite(grad_norm)
        self.signals.settle(ballot, dist.get_world_size(parallel_state.get_data_parallel_group()))
        if ok:
            self.scheduler.step(increment=1)
            self._params_gathered = False  # no forward has gathered this update yet
            self.ema.note(step.index - 1)
        if self._ema_folds_after(step.index):
            self._fold_ema()
        self.divergence.record(ok, step.index, self.last_saved)
        self.skipped_samples += int(skipped_samples)
        step.metrics = {"loss": loss, "samples": samples, "tokens": tokens, "model_flops": gflops * 1e9,
                        "skipped_samples": float(self.skipped_samples), "grad_norm": grad_norm, "lr": step.lr,
                        "skipped": 0.0 if ok else 1.0, "skipped_steps": float(self.divergence.skipped_steps),
                        **dict(zip(step.moe, values[7:]))}
        return step.metrics

    @functools.cached_property
    def steps_on_device(self) -> bool:
        """Whether the optimizer clips and skips on the device (no host read inside the step)."""
        return steps_on_device(self.optimizer)

    @staticmethod
    def _counted(samples: int) -> int:
        """Samples this rank counts: every context-parallel rank computes the same loss on the
        gathered output (each one's gradients cover its own tokens), and the counts are summed over
        DP x CP, so only the first CP rank counts them."""
        return samples if parallel_state.get_context_parallel_rank() == 0 else 0

    def _weigh_samples(self, microbatches) -> None:
        """Every sample weighs 1 / the global batch's sample count, on the device: each stage holds
        its replica's micro-batches, so no stage waits for the last one's count."""
        samples = to_device([float(self._counted(sum(b.num_samples for b in microbatches)))], self.device)
        dist.all_reduce(samples, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        self.sample_weight.copy_(1.0 / samples.clamp(min=1.0)[0])

    def _check_state_fits(self) -> None:
        """Count this rank's per-parameter state for the run (:mod:`dit_mcore.training.memory`): fail
        now, naming the fixes, if it alone exceeds the device; log the room left for activations."""
        try:
            memory.check_state_fits(self.state_budget(), memory.device_memory(self.device),
                                    fsdp=self.cfg.parallel.fsdp != "none")
            problem = None
        except ConfigError as e:
            problem = e
        # ranks hold different parameters (pipeline stages, experts): all of them stop if one must
        failed = to_device([float(problem is not None)], self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if problem is not None:
            raise problem
        if failed.item():
            raise ConfigError("another rank's per-parameter state does not fit its device (its error names the fix)")

    def state_budget(self) -> memory.StateBudget:
        """This rank's per-parameter state for the run, counted from its parameters."""
        cfg = self.cfg
        dense = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        if cfg.parallel.fsdp != "none" and cfg.parallel.fsdp_shard_size:
            dense = min(dense, cfg.parallel.fsdp_shard_size)
        expert = parallel_state.get_expert_data_parallel_world_size() if self.model_config.num_moe_experts else dense
        adam = resolve_adam_impl(cfg.optim.adam_impl, self.model, prefers_flat(cfg.optim))
        return memory.state_budget(
            ((p.numel(), dense if getattr(p, "allreduce", True) else expert)
             for chunk in self.model for p in chunk.parameters()),
            bf16=cfg.trainer.bf16, distributed_optimizer=cfg.optim.use_distributed_optimizer,
            fsdp=cfg.parallel.fsdp != "none", ema_offload=cfg.trainer.ema_offload, ema_sharded=self.ema_sharded,
            flat_adam=cfg.parallel.fsdp == "none" and adam == "flat",
            moment_bytes=sum(torch.finfo(d).bits // 8 for d in moment_dtypes(cfg.optim)),
            lowerable_moments=builds_torch_adam(cfg.optim.adam_impl), grad_bytes=2 if cfg.optim.main_grads_dtype == "bf16" else 4,
            main_bytes=2 if cfg.optim.split_main_params else 4)

    def _fold_ema(self) -> None:
        """Average the weights into the EMA (a no-op with no step noted), gathered first (a sharded
        EMA reads only this rank's shard, which its optimizer wrote); an offloaded EMA from the copies
        :meth:`_run_step` queued right after the update, where it did."""
        if self.ema.unfolded_decay != 1.0:
            if not self.ema_sharded:
                self._sync_params()
            self.ema.fold(self.model)

    def _ema_sharded(self) -> bool:
        """``trainer.ema_shard`` resolved: automatically, sharded wherever the distributed optimizer
        shards the main weights over more than one rank (megatron DDP, a model it fits; offloaded too)."""
        t = self.cfg.trainer
        if t.ema_shard is not None:
            return t.ema_shard
        return (self.cfg.optim.use_distributed_optimizer and self.cfg.parallel.fsdp == "none"
                and parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1
                and ema_shards.unshardable(self.model) is None)

    def _sync_params(self) -> None:
        """With ``overlap_param_gather`` the updated parameter shards are gathered during the next
        forward; gather them now for a reader outside the forward (an EMA fold, a checkpoint), once
        per update: with ``trainer.ema_every`` k the steps between folds leave the gather to the
        next forward, overlapped."""
        if self.cfg.parallel.overlap_param_gather and not self._params_gathered:
            for chunk in self.ddp_chunks:
                chunk.start_param_sync(force_sync=True)
            self._params_gathered = True

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
    def fit(self) -> list[dict]:
        cfg, rank0 = self.cfg, dist.get_rank() == 0
        logger = MetricsLogger(self.run_dir, enabled=rank0, max_steps=cfg.trainer.max_steps, start_step=self.step,
                               tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar)
        rate = StepRate(dist.get_world_size(), peak_tflops(self.device, "bf16" if cfg.trainer.bf16 else "fp32",
                                                           cfg.trainer.peak_tflops))
        history = []

        def record(step: _Step) -> None:
            metrics = dict(step.metrics)
            history.append({"step": step.index, **metrics})
            rate.add(metrics.pop("samples"), metrics.pop("tokens"), metrics["model_flops"])
            log_now = (step.index % cfg.log.log_interval == 0 or step.index == cfg.trainer.max_steps
                       or metrics["skipped"])  # a skipped step is always shown
            if log_now:
                metrics.update(rate.flush())
            logger.step(step.index, metrics if log_now else None)

        try:
            with self.signals:
                while self.step < cfg.trainer.max_steps:
                    step = self._run_step()
                    self._settle(step)
                    record(step)
                    self._after_step()
            if not (self.ckpt_dir / f"step_{self.step:08d}").exists():
                self.save()
            self.finish_saves()
            if not self._previews_after(self.step):
                self.preview()
        except DivergenceError:
            self.finish_saves()  # a save in flight holds weights from before the divergence
            raise
        finally:
            logger.close()
        return history

    def _previews_after(self, step: int) -> bool:
        """Whether ``log.sample_interval`` draws a preview after ``step``."""
        return bool(self.cfg.log.sample_interval and step % self.cfg.log.sample_interval == 0)

    def _scheduled_read_after(self, step: int) -> bool:
        """Whether the state after ``step`` is read at a step number fixed by the config: a periodic
        save, a preview, the end of the run."""
        cfg = self.cfg
        return step == cfg.trainer.max_steps or step % cfg.trainer.save_interval == 0 or self._previews_after(step)

    def _ema_folds_after(self, step: int) -> bool:
        """Whether the EMA averages the weights in after ``step`` (1-based): every
        ``trainer.ema_every`` steps and where the state is read (:meth:`_scheduled_read_after`).
        Fixed step numbers, so a resumed run folds where an uninterrupted one does;
        a checkpoint in between (a preemption's) carries the steps not yet folded (``ema_unfolded_decay``)."""
        return step % self.cfg.trainer.ema_every == 0 or self._scheduled_read_after(step)

    def _after_step(self) -> None:
        """After each step, in order: publish a finished asynchronous save (never waits); stop on
        divergence (no save) or on a preemption signal (save, requeue under Slurm, exit 75);
        previews; the periodic save, held back while the latest step was skipped as non-finite."""
        cfg = self.cfg
        if self.async_saves is not None and self.async_saves.get_num_unfinalized_calls():
            self.async_saves.maybe_finalize_async_calls(blocking=False)
        self.divergence.raise_if_diverged(self.step, self.last_saved)
        signum = self.signals.agreed
        if signum is not None:
            path = self.save()
            self.finish_saves()
            requeue_if_slurm(signum)
            raise Preempted(self.step, signal.Signals(signum).name, path)
        if self._previews_after(self.step):
            self.preview()
        if (self.step % cfg.trainer.save_interval == 0 and self.step < cfg.trainer.max_steps
                and not self.divergence.consecutive):
            self.save()

    @functools.cached_property
    def preview_decoder(self):
        """The dataset's latent decoder for previews, built on first use (rank 0 only draws)."""
        return dataset_decoder(self.cfg.data.path) if dist.get_rank() == 0 else None

    @functools.cached_property
    def preview_text(self):
        """``(encode, prompts)`` for text-model previews: the dataset's text encoder and the run's
        prompts (``log.preview_prompts``, or prompts covering the ``moving_digits`` captions)."""
        encode = dataset_text_encoder(self.cfg.data)
        prompts = self.cfg.log.preview_prompts or (moving_digits_prompts() if self.cfg.data.name == "moving_digits"
                                                   and not self.cfg.data.path else None)
        return encode, prompts

    def preview(self) -> Optional[Path]:
        # (fit folds at its preview steps already; this covers other callers -- none noted: a no-op)
        self._fold_ema()
        # trainer.ema_offload: the shadow samples on the GPU; Megatron-FSDP: called without its wrapper
        with self.ema.placed(self.device) as shadow, forward_view(shadow):
            return self._draw_preview(shadow)

    def _draw_preview(self, shadow: ModelChunks) -> Optional[Path]:
        if self.model_config.text_dim:
            encode, prompts = self.preview_text
            if encode is None or not prompts:
                log.warning("text previews need the dataset's text encoder and log.preview_prompts; skipped")
                return None
            return draw_text_preview(PipelinedForward(shadow), self.model_config, self.family, self.objective,
                                     self.cfg, self.step, self.run_dir / "samples", write=dist.get_rank() == 0,
                                     encode=encode, prompts=prompts, device=self.device, decoder=self.preview_decoder)
        if self.model_config.num_classes == 0:
            log.warning("preview grids need a class-conditional model; skipped")
            return None
        return draw_preview(PipelinedForward(shadow), self.model_config, self.family, self.objective, self.cfg, self.step,
                            self.run_dir / "samples", write=dist.get_rank() == 0, device=self.device,
                            decoder=self.preview_decoder)


@dataclass(eq=False)
class _Step:
    """One queued optimizer step (1-based ``index``) until the host has read it (:meth:`Trainer._settle`)."""

    index: int
    moe: dict
    """MoE router losses by name, device tensors until read."""
    lr: float = math.nan
    read: Optional[HostRead] = None
    """The step's metrics on their way to the host (steps decided on the device)."""
    values: Optional[list] = None
    """The same, already on the host (steps decided on the host)."""
    updated: Optional[bool] = None
    """Whether the host applied the update (steps decided on the host; else read from the values)."""
    metrics: Optional[dict] = None


def _shadow_config(config, *, unallocated: bool = False, te: bool = False):
    """``config`` for the EMA shadow: full-precision linears (neither torchao's nor TE's FP8) and no
    TP userbuffers (previews run other batch shapes than the buffers were sized for); ``unallocated`` (a sharded EMA's shadow,
    built under the meta device): not initialised, and every layer on the meta device -- megatron's
    local layers follow the device context only with ``use_cpu_initialization`` (else they allocate
    on the GPU), Transformer Engine's (``te``) take the meta device only without it. A copy, since
    re-running megatron's ``__post_init__`` (``dataclasses.replace``) is not idempotent."""
    if config.float8_recipe is None and not config.fp8 and not config.tp_comm_overlap and not unallocated:
        return config
    config = copy.copy(config)
    config.float8_recipe = None
    config.fp8 = None  # (Transformer Engine's FP8)
    config.tp_comm_overlap = False
    if unallocated:
        config.perform_initialization = False
        config.init_model_with_meta_device = True
        config.use_cpu_initialization = not te
    return config


def _holds_te(model: torch.nn.Module) -> bool:
    """Whether ``model`` has Transformer Engine layers."""
    return any(c.__module__.startswith("transformer_engine") for m in model.modules() for c in type(m).__mro__)


def pretrain(cfg: RunConfig) -> list[dict]:
    """Train (or resume) the run described by ``cfg``; returns the per-step metrics of this call."""
    return Trainer(cfg).fit()
