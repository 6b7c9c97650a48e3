"""PipeFusion (Wang et al. 2024, arXiv 2405.14430): the model's layers in N pipeline stages, the
latent's tokens in M patches that stream through them, so that after the first step the pipeline
has no bubble.

Schedule. A sampler's network evaluations are *units*: the first ``warmup`` evaluations run the
whole token stream through the stages (synchronously: every layer's key/value buffer is filled
fresh, :mod:`dit_mcore.models.displaced_attention`); every later evaluation is M units, one per
patch, in patch order. In a patch unit each self-attention layer attends from the patch's queries
to the whole stream's keys and values, fresh for this patch, from this evaluation for the patches
before it and from the previous evaluation for the ones after it (PipeFusion's displaced patch
parallelism). Stage ``s`` receives a unit's activations from stage ``s-1`` and sends its own to
``s+1`` without waiting (``isend``); the last stage sends the unit's prediction to every stage.

Samplers stay what they are. Everything a sampler does between two network calls (guidance's
combination, Euler/Heun/DDIM updates) is per token, so each patch gets its own run of the unchanged
sampler on that patch's tokens; the runs are coroutines (threads in strict turn with the driver,
exactly one running at a time), and the driver feeds patch ``j`` of evaluation ``k+1`` into stage 0
as soon as its evaluation ``k`` came back, while later stages still work on evaluation ``k``. Every
rank of the pipeline runs the same sampler runs on the same predictions, so every stage knows each
unit's timesteps and conditioning, and the first stage ends with the latents.

With ``warmup`` covering every evaluation the result is the one-process sampler's; with fewer
warm-up steps it differs by the staleness the method accepts (measured in
``tests/test_generate.py`` and ``benchmarks/generate_speed.py``).

Messages. A non-last stage posts the receive of a unit's prediction right after it sends the unit's
activations, so every pair of stages sees its sends and receives in one order (NCCL runs a pair's
messages in issue order on one stream; gloo does not care).
"""
from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dit_mcore.errors import ConfigError
from dit_mcore.models.adapter import prediction, to_model_layout
from dit_mcore.models.displaced_attention import DisplacedKV
from dit_mcore.models.token_shard import TokenShard
from energon_data.tokens import patchify, unpatchify

_ACTIVATION, _PREDICTION, _DECISION = 11, 12, 13  # p2p tags


@dataclass(frozen=True)
class PatchShard(TokenShard):
    """This rank's tokens of one patch, seen by one model call: piece ``index`` of ``size`` equal
    contiguous pieces of the stream, ``parts`` consecutive pieces per patch (the ranks of ``group`` that
    split each patch: context parallel, and TP under sequence parallel, as :class:`TokenShard`). The model
    embeds, positions and attends from these tokens only; :meth:`gather` returns the whole patch."""

    parts: int = 1

    @classmethod
    def of(cls, patch: int, patches: int, within: TokenShard) -> "PatchShard":
        """Patch ``patch`` of ``patches``, split over the ranks of ``within`` (the model's own shard)."""
        return cls(size=patches * within.size, index=patch * within.size + within.index, group=within.group,
                   tp=within.tp, parts=within.size)

    def gather(self, x: torch.Tensor, total: int, dim: int = 0) -> torch.Tensor:
        if self.parts == 1:
            return x
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * self.parts, *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=self.group)
        return out.movedim(0, dim)


class _Stopped(BaseException):
    """Ends a patch's sampler thread when the driver gives up."""


class _PatchRun:
    """One patch's sampler, run in a thread that takes turns with the driver: :meth:`reply` hands it
    the prediction for its last network call and blocks until it makes the next call (then
    ``request`` is ``(x, timestep, labels, text)``) or finishes (then ``result`` holds its tokens)."""

    def __init__(self, run: Callable[[Callable], torch.Tensor]):
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._inbox: queue.Queue = queue.Queue(1)
        self._outbox: queue.Queue = queue.Queue(1)
        self._thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self.request: Optional[tuple] = None
        self.result: Optional[torch.Tensor] = None

    def _main(self, run) -> None:
        try:
            if self._device is not None:  # (the current device is per thread)
                torch.cuda.set_device(self._device)
            with torch.no_grad():
                self._outbox.put(("done", run(self._call)))
        except _Stopped:
            pass
        except BaseException as e:  # handed to the driver, which raises it
            self._outbox.put(("error", e))

    def _call(self, x, timestep, labels=None, text=None):
        self._outbox.put(("call", (x, timestep, labels, text)))
        kind, value = self._inbox.get()
        if kind == "stop":
            raise _Stopped
        return value

    def _wait(self) -> None:
        kind, value = self._outbox.get()
        if kind == "error":
            raise value
        self.request, self.result = (value, None) if kind == "call" else (None, value)

    def start(self) -> None:
        self._thread.start()
        self._wait()

    def reply(self, prediction: torch.Tensor) -> None:
        self._inbox.put(("reply", prediction))
        self._wait()

    def stop(self) -> None:
        if self._thread.is_alive() and self.result is None:
            self._inbox.put(("stop", None))
            self._thread.join()


@dataclass
class _Call:
    """What one :meth:`PipeFusion.sample` call tracks."""

    grid: tuple
    total: int
    bounds: list
    stream: Optional[torch.Tensor] = None
    """The network input of the whole stream, patch by patch the newest (the model embeds one patch)."""
    units: list = field(default_factory=list)
    """Per unit: its patch (None: the whole stream)."""
    uses: dict = field(default_factory=dict)
    """Per unit whose prediction is here or on its way: the patches still to read it."""
    predictions: dict = field(default_factory=dict)
    """Per unit: its prediction, or (non-last stages) ``(work, buffer)`` of its receive."""
    sends: list = field(default_factory=list)
    """``(unit, work)`` of sends not yet known to be received."""


class PipeFusion:
    """The displaced patch pipeline of this rank's stage (``chunks``: its one model chunk).
    ``patches``: M; ``warmup``: synchronous network evaluations before the patches run displaced
    (:func:`warmup_evaluations`); ``on_evaluation``: called once per evaluation (a progress bar); ``cache``: a
    step cache; ``probe``: the redundancy analysis's probe."""

    def __init__(self, chunks, config, *, patches: int, warmup: int, on_evaluation: Callable = lambda: None,
                 cache=None, probe=None):
        if len(chunks) != 1:
            raise ValueError("PipeFusion runs one model chunk per stage (no virtual pipeline stages)")
        if warmup < 1:
            raise ValueError("PipeFusion needs at least one warm-up evaluation to fill the key/value buffers")
        self.chunk, self.config, self.patches, self.warmup = chunks[0], config, patches, warmup
        self.within = self.chunk.token_shard  # the ranks that split every unit's tokens (CP; TP under SP)
        self.on_evaluation = on_evaluation
        self.cache = cache
        """A :class:`~dit_mcore.generate.cache.StepCache` on this stage's layers: told each unit's evaluation and
        patch (each patch caches apart, a patch unit counts 1/M of an evaluation); a run-time decision (TeaCache,
        First-Block-Cache: the first stage's first layer, from the unit's own tokens) goes down the stages with
        the unit's activations."""
        self.probe = probe
        """A :class:`~dit_mcore.analysis.probe.StepProbe` on this stage's layers, told each unit (the redundancy
        analysis: a patch's sums add to its evaluation's)."""
        self.kv = DisplacedKV()
        if not self.kv.install(self.chunk):
            raise ValueError("PipeFusion found no self-attention to displace in this model chunk")
        group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(group) if dist.is_initialized() else [0]
        self.stage = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.first, self.last = self.stage == 0, self.stage == len(self.ranks) - 1
        self.dtype = next(self.chunk.parameters()).dtype
        self._call: Optional[_Call] = None

    def sample(self, run: Callable[[Callable, torch.Tensor], torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """``run(model_fn, noise)``: one sampler call, e.g. ``sample(objective, model_fn, noise, ...)``
        with ``model_fn(x, timestep, labels=None, text=None)`` on tokens; ``noise``: latents
        ``[N, C, (T,) H, W]``. Returns the latents the sampler ends with, patch by patch."""
        tokens, grid = patchify(noise, self.config.patch_size, self.config.patch_size_t)
        total = tokens.shape[1]
        if total % self.patches:
            raise ValueError(f"{total} tokens do not split into {self.patches} equal patches")
        size = total // self.patches
        self._call = _Call(grid=grid, total=total, bounds=[(j * size, (j + 1) * size) for j in range(self.patches)])
        runs = [_PatchRun(lambda fn, x=tokens[:, a:b]: run(fn, x)) for a, b in self._call.bounds]
        finished = False
        try:
            for r in runs:
                r.start()
            self._drive(runs)
            finished = True
        finally:
            for r in runs:
                r.stop()
            if finished:  # (after a failure the peers may never receive: do not wait for them)
                self._settle(len(self._call.units))
            self.kv.reset()
            self._call = None
        out = torch.cat([r.result for r in runs], dim=1)
        return unpatchify(out, grid, self.config.in_channels, self.config.patch_size, self.config.patch_size_t,
                          squeeze_time=noise.dim() == 4)

    # -- the schedule ---------------------------------------------------------------------------

    def _drive(self, runs: list) -> None:
        waits = [None] * self.patches  # per patch: the unit whose prediction its run waits for
        evaluation = 0
        while True:
            if evaluation < self.warmup:  # synchronous: the whole stream in one unit
                for j in range(self.patches):
                    self._reply(runs, waits, j)
                if self._finished(runs):
                    return
                waits = [self._unit(None, [r.request for r in runs], evaluation)] * self.patches
            else:  # patch j of this evaluation enters as soon as its previous one came back
                for j in range(self.patches):
                    self._reply(runs, waits, j)
                    if runs[j].result is not None:
                        for rest in range(j + 1, self.patches):
                            self._reply(runs, waits, rest)
                        if self._finished(runs):
                            return
                    waits[j] = self._unit(j, [runs[j].request], evaluation)
            self.on_evaluation()
            evaluation += 1

    def _reply(self, runs: list, waits: list, patch: int) -> None:
        if waits[patch] is not None:
            runs[patch].reply(self._prediction(waits[patch], patch))
            waits[patch] = None

    @staticmethod
    def _finished(runs: list) -> bool:
        done = sum(r.result is not None for r in runs)
        if done not in (0, len(runs)):
            raise RuntimeError("the patches' sampler runs made different numbers of network calls")
        return done == len(runs)

    def _unit(self, patch: Optional[int], requests: list, evaluation: int) -> int:
        """Run this stage's part of one unit (``patch`` None: the whole stream) of ``evaluation``; returns its
        index."""
        call = self._call
        deciding = self.cache is not None and self.cache.decides
        if self.cache is not None:
            self.cache.evaluation(evaluation, patch, 1.0 if patch is None else 1 / self.patches)
        if self.probe is not None:
            self.probe.unit(evaluation, requests[0][1], patch, None if patch is None else call.bounds[patch],
                            self.within)
        x = torch.cat([req[0] for req in requests], dim=1)  # [n, the unit's tokens, D]
        _, timestep, labels, text = requests[0]
        if patch is None:
            call.stream, shard, self.kv.patch = x, self.within, None
            rows = call.total
        else:  # the model takes the whole stream and embeds only the patch's tokens (this rank's piece)
            start, end = call.bounds[patch]
            call.stream[:, start:end] = x
            shard, self.kv.patch = PatchShard.of(patch, self.patches, self.within), (start, end)
            rows = end - start
        if not self.first:
            hidden = torch.empty((rows // self.within.size, x.shape[0], self.config.hidden_size), dtype=self.dtype,
                                 device=x.device)
            dist.recv(hidden, src=self.ranks[self.stage - 1], tag=_ACTIVATION)
            self.chunk.set_input_tensor(hidden)
            if deciding:  # (sent right after the activations)
                flag = torch.empty(1, dtype=torch.uint8, device=x.device)
                dist.recv(flag, src=self.ranks[self.stage - 1], tag=_DECISION)
                self.cache.skip = bool(flag.item())
        with _shard(self.chunk, shard):
            out = self.chunk(to_model_layout(call.stream).to(self.dtype), timestep, labels, grid=call.grid,
                             context=text)
        unit = len(call.units)
        call.units.append(patch)
        call.uses[unit] = self.patches if patch is None else 1
        if not self.last:
            self._send(unit, out, self.ranks[self.stage + 1], _ACTIVATION)
            if deciding:
                flag = torch.tensor([int(self.cache.skip)], dtype=torch.uint8, device=x.device)
                self._send(unit, flag, self.ranks[self.stage + 1], _DECISION)
            pred = torch.empty((x.shape[0], rows, self.config.patch_dim), dtype=self.dtype, device=x.device)
            call.predictions[unit] = (dist.irecv(pred, src=self.ranks[-1], tag=_PREDICTION), pred)
        else:
            pred = prediction(out, self.config).contiguous()
            call.predictions[unit] = pred
            if self.probe is not None:
                self.probe.output(pred)  # [n, the unit's tokens, D]
            for rank in self.ranks[:-1]:
                self._send(unit, pred, rank, _PREDICTION)
            self._settle(unit - 2 * self.patches)  # every stage has read these long since
        return unit

    def _prediction(self, unit: int, patch: int) -> torch.Tensor:
        """Patch ``patch``'s part of unit ``unit``'s prediction."""
        call = self._call
        pred = call.predictions[unit]
        if isinstance(pred, tuple):  # its receive, posted with the unit's send
            work, pred = pred
            work.wait()
            call.predictions[unit] = pred
            self._settle(unit + 1)  # the last stage has computed it: the unit's activations arrived
        call.uses[unit] -= 1
        if not call.uses[unit]:
            del call.predictions[unit], call.uses[unit]
        if call.units[unit] is None:
            start, end = call.bounds[patch]
            return pred[:, start:end]
        return pred

    def _send(self, unit: int, tensor: torch.Tensor, rank: int, tag: int) -> None:
        self._call.sends.append((unit, dist.isend(tensor.contiguous(), dst=rank, tag=tag)))

    def _settle(self, before: int) -> None:
        """Complete (and free the buffers of) the sends of units before ``before``."""
        sends = self._call.sends
        while sends and sends[0][0] < before:
            sends.pop(0)[1].wait()


def check_sampler(sampler: Optional[str]) -> None:
    """PipeFusion runs one copy of the sampler per patch: refuse a sampler whose fresh noise is drawn
    per whole latent (each patch would draw the same)."""
    if sampler == "ddpm":
        raise ConfigError("--sampler ddpm with parallel.pipefusion: DDPM draws its fresh noise per whole latent and "
                          "PipeFusion samples patch by patch; use --sampler ddim")


def warmup_evaluations(steps: int, evaluations: int, warmup_steps: int) -> int:
    """Network evaluations in the first ``warmup_steps`` of a sampler making ``evaluations`` calls over
    ``steps`` steps: one per step (Euler, DDIM), two (Heun), and EDM's Heun skips the last step's
    second call (``2 * steps - 1``)."""
    per_step = -(-evaluations // steps)
    return min(warmup_steps * per_step, evaluations)


@contextlib.contextmanager
def _shard(chunk, shard: TokenShard):
    saved, chunk.token_shard = chunk.token_shard, shard
    try:
        yield
    finally:
        chunk.token_shard = saved
