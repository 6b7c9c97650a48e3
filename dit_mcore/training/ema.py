"""Exponential moving average of the model weights (a frozen copy of the module)."""
from __future__ import annotations

import contextlib

import torch

from dit_mcore.parallel.fsdp import publish_weights, sharded_parameters, to_shards
from dit_mcore.training import ema_shards
from dit_mcore.training.host_fold import HostFold


FOLD_GROUP = 1 << 26
"""Parameters per foreach lerp of a fold: the fp32 casts of one group (256 MiB at most, besides the largest
tensor) are the fold's only temporary."""


class EMA:
    """``ema = decay * ema + (1 - decay) * param`` after every optimizer step (or, with
    ``trainer.ema_every`` k, the same decay per step folded in every k steps: :meth:`note`,
    :meth:`fold`). The shadow is a full module (same tensor-parallel shards as the model), so it
    samples and checkpoints like one (sharded, inside :meth:`placed`, :meth:`saving`, :meth:`loading`).

    ``shadow`` is a freshly built module of the same architecture (megatron modules hold process
    groups and cannot be deep-copied); it starts as a copy of ``model``'s weights.

    ``offload`` (``trainer.ema_offload``) keeps the shadow in host memory, 4 bytes per parameter
    off the GPU (a 3.3B model's 13 GiB): a fold queues one copy of the weights into pinned host
    buffers behind the step that wrote them and averages them in on the host, in a thread, while
    training goes on; :attr:`module` waits for it. Previews run the shadow on the GPU
    (:meth:`placed`).

    ``shard_over`` (``trainer.ema_shard``: megatron DDP chunks with the distributed optimizer) keeps
    only this data-parallel rank's shard of the average, the one its optimizer updates
    (:class:`~dit_mcore.training.ema_shards.ShadowShards`); ``shadow`` is then built on the meta device
    and the whole average exists only inside :meth:`placed` (for a checkpoint, :meth:`saving` and
    :meth:`loading`: the tensors this rank writes or reads). With ``offload`` too, the shards are in
    host memory and fold there in a thread, from copies of this rank's slices of the weights.
    """

    def __init__(self, model: torch.nn.Module, shadow: torch.nn.Module, decay: float, *, offload: bool = False,
                 shard_over=None):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"trainer.ema_decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.unfolded_decay = 1.0
        """Product of the decays of the steps noted since the last fold (1.0: none); checkpointed."""
        self.offload = offload
        self.host_fold = None
        self.shards = None
        if shard_over is not None:
            self.shards = ema_shards.ShadowShards(shard_over, model, shadow, on_host=offload)
            ema_shards.release(shadow)
            self._module = shadow.eval().requires_grad_(False)
            self.host_fold = HostFold(self.shards.owned) if offload else None
            return
        to_shards((model, shadow))
        shadow.load_state_dict(model.state_dict())
        publish_weights(shadow)
        self._module = shadow.eval()
        for p in self._module.parameters():
            p.requires_grad_(False)
            if p.dtype != torch.float32:  # (an FSDP-sharded shadow is made fp32 before sharding)
                p.data = p.data.float()
        self.host_fold = HostFold(sharded_parameters(model)) if offload else None
        if offload:
            self._module.to("cpu")

    @property
    def module(self) -> torch.nn.Module:
        """The shadow module, any fold in flight on the host finished first (a sharded EMA has none
        whole: :meth:`placed`)."""
        if self.shards is not None:
            raise RuntimeError("the EMA is sharded over the data-parallel ranks (trainer.ema_shard): "
                               "read it whole inside EMA.placed(device), on every rank")
        self.wait()
        return self._module

    def wait(self) -> None:
        """Finish the host fold in flight (``offload``), raising what it raised."""
        if self.host_fold is not None:
            self.host_fold.wait()

    def stage(self, model: torch.nn.Module) -> None:
        """Offloaded: queue the copies of ``model``'s weights for the next :meth:`fold` now, right after
        the update that wrote them, on a side stream (they then run beside the work queued next; not
        while the fold before still runs on the host: the fold copies them then); elsewhere nothing to do."""
        if self.host_fold is not None:
            self.host_fold.stage(self._weights(model), block=False)

    def _weights(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """What a fold reads: this rank's slices of the weights (sharded), else every (local) weight."""
        return self.shards.owned if self.shards is not None else [p.detach() for p in sharded_parameters(model)]

    def fence(self) -> None:
        """Before the weights are written again (the next update): the current CUDA stream waits for
        an offloaded fold's copies of them, which run on a side stream (the host does not wait)."""
        if self.host_fold is not None:
            self.host_fold.fence()

    @contextlib.contextmanager
    def placed(self, device: torch.device):
        """The whole shadow for the ``with`` block (previews on ``device``): offloaded, moved to
        ``device`` and back to host memory after it; sharded, gathered from every rank (a collective:
        every data-parallel rank enters) into parameters allocated on ``device`` and freed after it;
        otherwise where it is."""
        if self.shards is not None:
            self.wait()
            try:
                with ema_shards.allocated(self._module, device) as params:
                    self.shards.gather_into(params)
                    yield self._module
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the 4 bytes per parameter back to training
            return
        module = self.module
        if not self.offload:
            yield module
            return
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the shadow takes its 4 bytes per parameter back for the preview
            module.to(device)
            yield module
        finally:
            module.to("cpu")

    @contextlib.contextmanager
    def saving(self):
        """The shadow to checkpoint in the ``with`` block: sharded, in host memory, and only the tensors
        this rank writes (every data-parallel rank enters; the others stay unallocated)."""
        if self.shards is None:
            yield self.module
            return
        self.wait()
        with ema_shards.allocated(self._module, torch.device("cpu"), only=self.shards.written_here()) as params:
            self.shards.gather_into(params)
            yield self._module

    @contextlib.contextmanager
    def loading(self):
        """The shadow to load a checkpoint into in the ``with`` block; sharded, in host memory, only the
        tensors with elements in this rank's shards, which take their slices when the block succeeds."""
        if self.shards is None:
            yield self.module
            return
        self.wait()
        with ema_shards.allocated(self._module, torch.device("cpu"), only=self.shards.overlapping()) as params:
            yield self._module
            self.shards.scatter_from(params)

    @torch.no_grad()
    def restart(self, model: torch.nn.Module) -> None:
        """The average set to ``model``'s current weights (nothing folded pending; sharded, read from
        the parameter buffers of the DDP wrappers the EMA was built over, which hold them)."""
        self.unfolded_decay = 1.0
        if self.shards is not None:
            self.wait()
            self.shards.restart()
            return
        self.module.load_state_dict(model.state_dict())
        publish_weights(self._module)

    def decay_at(self, step: int) -> float:
        """Warmed-up decay ``min(decay, (1 + step) / (10 + step))``: early on the average follows the
        model closely instead of remembering the (zero-output) initialisation for thousands of
        steps, which matters for short runs and changes nothing for long ones."""
        return min(self.decay, (1.0 + step) / (10.0 + step))

    def update(self, model: torch.nn.Module, step: int) -> None:
        """Average in the weights after optimizer step ``step`` (0-based): :meth:`note` it, then
        :meth:`fold`."""
        self.note(step)
        self.fold(model)

    def note(self, step: int) -> None:
        """Count optimizer step ``step`` (0-based) without reading the weights: its decay joins
        :attr:`unfolded_decay`, and the next :meth:`fold` averages the weights of that moment in for
        every step noted since the last one. That is per-step averaging exactly when the weights did not change
        in between, and close to it when they changed little (``trainer.ema_every``)."""
        self.unfolded_decay *= self.decay_at(step)

    @torch.no_grad()
    def fold(self, model: torch.nn.Module) -> None:
        """``shadow = d * shadow + (1 - d) * weights``, ``d`` the :attr:`unfolded_decay` of the steps
        noted since the last fold (none noted: nothing to do), in fp32: torch's foreach lerp over the
        parameters cast to fp32, in groups of :data:`FOLD_GROUP` (:func:`_lerp`); with ``offload``
        on the host, in a thread (:class:`~dit_mcore.training.host_fold.HostFold`: from the copies
        :meth:`stage` queued since the last write, else copied now, on a side stream; :meth:`fence`
        before anything writes the weights again); sharded, the same (on the device or offloaded)
        over this rank's shards of megatron's parameter buffer (``model`` is then not read: the shards
        read the buffers of the DDP wrappers the EMA was built over).
        Under FSDP on this rank's shards; Megatron-FSDP's shadow weight buffers are refreshed only
        when the shadow is called (``fsdp.forward_view``), not every step."""
        if self.unfolded_decay == 1.0:
            return
        # sharded: this rank's shards, from the weights its optimizer just wrote
        shadow = self.shards.shards if self.shards is not None else sharded_parameters(self._module)
        params = self._weights(model)
        if len(params) != len(shadow):
            raise ValueError(f"EMA.fold: the model has {len(params)} parameters but the EMA shadow {len(shadow)}; "
                             "pass the model the EMA was built for")
        weight, self.unfolded_decay = 1.0 - self.unfolded_decay, 1.0
        if self.host_fold is not None:
            self.host_fold.start(shadow, params, weight)
        else:
            _lerp(shadow, params, weight)


def _lerp(shadow: list[torch.Tensor], params: list[torch.Tensor], weight: float) -> None:
    """``shadow += weight * (params - shadow)`` for fp32 ``shadow`` tensors: torch's foreach lerp over the
    parameters cast to fp32, a group of at most :data:`FOLD_GROUP` parameters at a time (18 bytes per bf16
    parameter). A fold compiled per tensor (10 bytes) was the CUDA path until an H200 ran it at 66 GB/s inside the
    trainer: DiT-XL/2's fold took 102 ms against foreach's 5 ms (``benchmarks/results/h200_2026-11-29.md``)."""
    group, size = [], 0
    for i, p in enumerate(params):
        group.append(i)
        size += p.numel()
        if size >= FOLD_GROUP or i == len(params) - 1:
            torch._foreach_lerp_([shadow[j] for j in group], [params[j].float() for j in group], weight)
            group, size = [], 0


class EMASchedule:
    """The EMA as the training step drives it, behind one call (:meth:`around_update`): the weights are
    averaged in after every ``every``-th step and after each step whose state is read (``read_after``: a
    save, a preview, the end of the run), at fixed step numbers, so a resumed run folds where an
    uninterrupted one does (a checkpoint in between, a preemption's, carries the steps not yet folded:
    :attr:`EMA.unfolded_decay`).

    ``gather`` gathers the updated weights for a reader outside the forward (``overlap_param_gather``);
    a sharded EMA reads this rank's own slices, which its optimizer wrote, and needs no gather."""

    def __init__(self, ema: EMA, model: torch.nn.Module, *, every: int, read_after, gather,
                 overlap_param_gather: bool = False):
        self.ema, self.model, self.every = ema, model, every
        self.read_after, self.gather, self.overlap_param_gather = read_after, gather, overlap_param_gather

    def folds_after(self, step: int) -> bool:
        """Whether the weights are averaged in after ``step`` (1-based)."""
        return step % self.every == 0 or self.read_after(step)

    def around_update(self, step: int, update) -> bool:
        """Run optimizer step ``step`` (1-based; ``update()`` returns whether it applied) with the EMA around
        it: an offloaded fold's copies of the weights (a side stream) are waited for before the update
        writes them; where a fold follows, the copies of the new weights are queued right after it
        (:meth:`EMA.stage`: they run beside the work queued next; a replicated EMA under
        ``overlap_param_gather`` needs the gather first, and the fold copies them itself); an applied
        update is noted; the fold, where scheduled. Returns what ``update`` returned."""
        self.ema.fence()
        updated = update()
        folds = self.folds_after(step)
        if folds and (self.ema.shards is not None or not self.overlap_param_gather):
            self.ema.stage(self.model)
        if updated:
            self.ema.note(step - 1)
        if folds:
            self.fold()
        return updated

    def fold(self) -> None:
        """Average the weights in now (a no-op with no step noted since the last fold), gathered first
        unless sharded."""
        if self.ema.unfolded_decay != 1.0:
            if self.ema.shards is None:
                self.gather()
            self.ema.fold(self.model)
