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
``tests/test_pipefusion.py`` and ``benchmarks/generate_speed.py``).
"""
from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dit_mcore.models.adapter import prediction, to_model_layout
from dit_mcore.models.displaced_attention import DisplacedKV
from dit_mcore.parallel.token_shard import TokenShard
from energon_data.tokens import patchify, unpatchify

_ACTIVATION, _PREDICTION = 11, 12  # p2p tags


@dataclass(frozen=True)
class PatchShard(TokenShard):
    """Patch ``index`` of ``size`` equal contiguous pieces of the token stream, seen by one model
    call: the model embeds, positions and predicts only these tokens (:meth:`gather` keeps them)."""

    def gather(self, x: torch.Tensor, total: int, dim: int = 0) -> torch.Tensor:
        return x


class _Stopped(BaseException):
    """Ends a patch's sampler thread when the driver gives up."""


class _PatchRun:
    """One patch's sampler, run in a thread that takes turns with the driver: :meth:`next` hands it
    the reply to its last network call and blocks until it makes the next call (returned as
    ``("call", (x, timestep, labels, text))``) or finishes (``("done", tokens)``)."""

    def __init__(self, run: Callable[[Callable], torch.Tensor]):
        self._inbox: queue.Queue = queue.Queue(1)
        self._outbox: queue.Queue = queue.Queue(1)
        self._thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self.request: Optional[tuple] = None
        self.result: Optional[torch.Tensor] = None

    def _main(self, run) -> None:
        try:
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


class PipeFusion:
    """The displaced patch pipeline of this rank's stage (``chunks``: its one model chunk).
    ``patches``: M; ``warmup``: synchronous evaluations before the patches run displaced;
    ``on_evaluation``: called once per network evaluation (a progress bar)."""

    def __init__(self, chunks, config, *, patches: int, warmup: int, on_evaluation: Callable = lambda: None):
        if len(chunks) != 1:
            raise ValueError("PipeFusion runs one model chunk per stage (no virtual pipeline stages)")
        if warmup < 1:
            raise ValueError("PipeFusion needs at least one warm-up evaluation to fill the key/value buffers")
        self.chunk, self.config, self.patches, self.warmup = chunks[0], config, patches, warmup
        self.on_evaluation = on_evaluation
        self.kv = DisplacedKV()
        if not self.kv.install(self.chunk):
            raise ValueError("PipeFusion found no self-attention to displace in this model chunk")
        group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(group) if dist.is_initialized() else [0]
        self.stage = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.first, self.last = self.stage == 0, self.stage == len(self.ranks) - 1
        self.dtype = next(self.chunk.parameters()).dtype

    def sample(self, run: Callable[[Callable, torch.Tensor], torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """``run(model_fn, noise)``: one sampler call, e.g. ``sample(objective, model_fn, noise, ...)``
        with ``model_fn(x, timestep, labels=None, text=None)`` on tokens; ``noise``: latents
        ``[N, C, (T,) H, W]``. Returns the latents the sampler ends with, patch by patch."""
        tokens, self.grid = patchify(noise, self.config.patch_size, self.config.patch_size_t)
        total = tokens.shape[1]
        if total % self.patches:
            raise ValueError(f"{total} tokens do not split into {self.patches} equal patches")
        self.total, size = total, total // self.patches
        self.bounds = [(j * size, (j + 1) * size) for j in range(self.patches)]
        runs = [_PatchRun(lambda fn, x=tokens[:, a:b]: run(fn, x)) for a, b in self.bounds]
        self.kv.reset()
        self._sends, self._outputs, self._uses, self._outputs_seen = [], {}, {}, []
        self._units: list[tuple] = []  # per unit: (patch or None for the whole stream, batch, device)
        try:
            for r in runs:
                r.start()
            self._drive(runs)
        finally:
            for r in runs:
                r.stop()
            for work in self._sends:
                work.wait()
        out = torch.cat([r.result for r in runs], dim=1)
        return unpatchify(out, self.grid, self.config.in_channels, self.config.patch_size,
                          self.config.patch_size_t, squeeze_time=noise.dim() == 4)

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
                waits = [self._unit(None, [r.request for r in runs])] * self.patches
            else:  # patch j of this evaluation enters as soon as its previous one came back
                for j in range(self.patches):
                    self._reply(runs, waits, j)
                    if runs[j].result is not None:
                        for rest in range(j + 1, self.patches):
                            self._reply(runs, waits, rest)
                        if self._finished(runs):
                            return
                    waits[j] = self._unit(j, [runs[j].request])
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

    def _unit(self, patch: Optional[int], requests: list) -> int:
        """Run this stage's part of one unit (``patch`` None: the whole stream); returns its index."""
        x = torch.cat([req[0] for req in requests], dim=1)  # [n, the unit's tokens, D]
        _, timestep, labels, text = requests[0]
        if patch is None:
            self._stream, shard, self.kv.patch = x, TokenShard(), None
            rows = self.total
        else:  # the model takes the whole stream and embeds only the patch's tokens
            start, end = self.bounds[patch]
            self._stream[:, start:end] = x
            shard, self.kv.patch = PatchShard(size=self.patches, index=patch), (start, end)
            rows = end - start
        if not self.first:
            hidden = torch.empty((rows, x.shape[0], self.config.hidden_size), dtype=self.dtype, device=x.device)
            dist.recv(hidden, src=self.ranks[self.stage - 1], tag=_ACTIVATION)
            self.chunk.set_input_tensor(hidden)
        with _shard(self.chunk, shard):
            out = self.chunk(to_model_layout(self._stream).to(self.dtype), timestep, labels, grid=self.grid,
                             context=text)
        unit = len(self._units)
        self._units.append((patch, x.shape[0], x.device))
        self._uses[unit] = self.patches if patch is None else 1
        if not self.last:
            self._send(out, self.ranks[self.stage + 1], _ACTIVATION)
        else:
            pred = prediction(out, self.config).contiguous()
            self._outputs[unit] = pred
            for rank in self.ranks[:-1]:
                self._send(pred, rank, _PREDICTION)
        return unit

    def _prediction(self, unit: int, patch: int) -> torch.Tensor:
        """Patch ``patch``'s part of unit ``unit``'s prediction (the other stages receive the last
        stage's predictions in unit order)."""
        while unit not in self._outputs:
            received = len(self._outputs_seen)
            whole, n, device = self._units[received]
            rows = self.total if whole is None else self.total // self.patches
            pred = torch.empty((n, rows, self.config.patch_dim), dtype=self.dtype, device=device)
            dist.recv(pred, src=self.ranks[-1], tag=_PREDICTION)
            self._outputs[received] = pred
            self._outputs_seen.append(received)
        pred = self._outputs[unit]
        self._uses[unit] -= 1
        if not self._uses[unit]:
            del self._outputs[unit]
        if self._units[unit][0] is None:
            start, end = self.bounds[patch]
            return pred[:, start:end]
        return pred

    def _send(self, tensor: torch.Tensor, rank: int, tag: int) -> None:
        self._sends.append(dist.isend(tensor.contiguous(), dst=rank, tag=tag))
        while len(self._sends) > 4 * self.patches * len(self.ranks):
            self._sends.pop(0).wait()


@contextlib.contextmanager
def _shard(chunk, shard: TokenShard):
    saved, chunk.token_shard = chunk.token_shard, shard
    try:
        yield
    finally:
        chunk.token_shard = saved
