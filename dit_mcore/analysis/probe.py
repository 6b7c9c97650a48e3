"""Probes on a model's transformer layers: how much each layer's activations change from one model
evaluation to the next, as sums that add up over items, tokens and (later) ranks.

For every evaluation after the first, every layer and every batch row, and for each probed activation
``A`` (the layer's input, its output, its residual contribution ``output - input``, its self-attention's
output -- the spatial one in an ST-DiT --, the ST-DiT's temporal attention's output, and its MLP's
output), the probe keeps in float64, over the row's tokens and channels: ``sum|A_t - A_{t-1}|``,
``sum|A_{t-1}|``, ``sum A_t A_{t-1}``, ``sum A_t^2`` and ``sum A_{t-1}^2``. The relative L1 change
(``sum|A_t - A_{t-1}| / sum|A_{t-1}|``) and the cosine similarity follow from them (:func:`rel_l1`,
:func:`cosine`); as sums of parts they reduce over sequence shards with one all-reduce. Two indicators
of the cheap dynamic cache policies are probed too: ``teacache``, the first layer's modulated input
(what its self-attention reads, as TeaCache uses), and ``fbcache``, the first layer's residual
(First-Block-Cache's); and ``model_output``, the model's output (:meth:`StepProbe.output`).
"""
from __future__ import annotations

from typing import Optional

import torch

SUMS = ("abs_diff", "abs_prev", "dot", "sq", "sq_prev")
"""The five float64 sums kept per row, in this order."""

KEYS = ("input", "output", "residual", "attention", "temporal", "mlp")
"""The activations probed per layer (``temporal`` in an ST-DiT only)."""


def row_sums(now: torch.Tensor, prev: torch.Tensor, batch_dim: int = 1) -> torch.Tensor:
    """``[rows, 5]`` float64 :data:`SUMS` of two activations, one row per index of ``batch_dim``."""
    a = now.detach().double().movedim(batch_dim, 0).flatten(1)
    b = prev.detach().double().movedim(batch_dim, 0).flatten(1)
    return torch.stack([(a - b).abs().sum(1), b.abs().sum(1), (a * b).sum(1), (a * a).sum(1), (b * b).sum(1)], 1)


def rel_l1(sums: torch.Tensor) -> torch.Tensor:
    """``sum|A_t - A_{t-1}| / sum|A_{t-1}|`` from :data:`SUMS` (last dim)."""
    return sums[..., 0] / sums[..., 1]


def cosine(sums: torch.Tensor) -> torch.Tensor:
    """``<A_t, A_{t-1}> / (|A_t| |A_{t-1}|)`` from :data:`SUMS` (last dim)."""
    return sums[..., 2] / (sums[..., 3] * sums[..., 4]).sqrt()


def _first(output):
    """A module's output tensor (megatron's attention and MLP return ``(out, bias)``)."""
    if isinstance(output, tuple):
        out, bias = output[0], output[1] if len(output) > 1 else None
        return out if bias is None else out + bias
    return output


class StepProbe:
    """Forward hooks on every DiT layer of ``model`` (any module tree holding them). Between
    :meth:`start` and :meth:`stop` every forward pass is one evaluation; :attr:`evaluations` holds, per
    evaluation after the first, ``{name: [rows, 5] sums}`` with names ``"<layer>.<key>"`` (the layer's
    global index from 0) and ``"teacache"``/``"fbcache"``. A call of :meth:`start` forgets the previous
    activations, so nothing crosses sampler runs."""

    def __init__(self, model: torch.nn.Module):
        from dit_mcore.models.dit.layer import DiTLayer
        self.layers = [m for m in model.modules() if isinstance(m, DiTLayer)]
        if not self.layers:
            raise ValueError("no DiT layers in this model: the redundancy probe reads dit_mcore's DiTLayer")
        self.evaluations: list[dict[str, torch.Tensor]] = []
        self.timesteps: list[float] = []
        self._prev: dict[tuple, torch.Tensor] = {}
        self._now: Optional[dict[str, torch.Tensor]] = None
        self._handles = []
        self._scope, self._bounds, self._index = None, None, -1
        self._within = None

    def _record(self, name: str, value: torch.Tensor, batch_dim: int = 1, token_dim: int = 0,
                sharded: bool = True) -> None:
        """Add ``value``'s change from the previous evaluation of the same tokens (per scope: a PipeFusion patch's
        tokens; its first patch unit compares with the warm-up's whole stream there) to this evaluation's sums.
        ``sharded``: a layer's activation, this rank's piece of the unit's tokens under a sequence split."""
        if self._now is None:
            return
        prev = self._prev.get((self._scope, name))
        if prev is None and self._scope is not None and (None, name) in self._prev:
            prev, (start, end) = self._prev[None, name], self._bounds
            split = self._within if sharded and self._within is not None and self._within.active else None
            if split is not None:  # this rank's piece of the patch lay on other ranks in the whole stream's split
                piece = (end - start) // split.size
                prev = split.gather(prev, prev.shape[token_dim] * split.size, dim=token_dim)
                start, end = start + split.index * piece, start + (split.index + 1) * piece
            prev = prev.narrow(token_dim, start, end - start)
        if prev is not None and prev.shape == value.shape:
            sums = row_sums(value, prev, batch_dim).cpu()
            self._now[name] = self._now[name] + sums if name in self._now else sums
        self._prev[self._scope, name] = value.detach().clone()

    def start(self) -> "StepProbe":
        self.evaluations, self.timesteps, self._prev = [], [], {}
        self._scope, self._bounds, self._index = None, None, -1
        for layer in self.layers:
            i = layer.layer_number - 1
            self._handles.append(layer.register_forward_hook(
                lambda mod, args, out, i=i: self._on_layer(i, args[0], out)))
            for key, sub in (("attention", layer.self_attention), ("temporal", layer.temporal_attention),
                             ("mlp", layer.mlp)):
                if sub is not None:
                    self._handles.append(sub.register_forward_hook(
                        lambda mod, args, out, name=f"{i}.{key}": self._record(name, _first(out))))
            if i == 0:
                self._handles.append(layer.self_attention.register_forward_pre_hook(
                    lambda mod, args, kwargs: self._record("teacache", args[0] if args else kwargs["hidden_states"]),
                    with_kwargs=True))
        return self

    def _on_layer(self, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self._record(f"{i}.input", x)
        self._record(f"{i}.output", y)
        self._record(f"{i}.residual", y - x)
        if i == 0:
            self._record("fbcache", y - x)

    def output(self, out, token_dim: int = 1) -> None:
        """Call with each evaluation's model output ``[rows, ...]`` (``model_output``: what TeaCache's
        rescaling polynomial predicts from its indicator; ``token_dim``: where a patch's tokens lie)."""
        if isinstance(out, torch.Tensor):
            self._record("model_output", out, batch_dim=0, token_dim=token_dim, sharded=False)

    def evaluation(self, timestep: torch.Tensor) -> None:
        """Call before each model evaluation: closes the previous one's record."""
        self._close()
        self._now = {}
        self.timesteps.append(float(timestep.flatten()[0]))

    def unit(self, evaluation: int, timestep: torch.Tensor, patch: Optional[int], bounds: tuple,
             within=None) -> None:
        """PipeFusion's call before each unit it runs on this stage (in evaluation order): the whole stream
        (``patch`` None) or the tokens ``bounds`` of patch ``patch``; ``within``: the
        :class:`~dit_mcore.models.token_shard.TokenShard` that splits every unit's tokens over ranks (a patch's
        first unit then gathers the warm-up's whole stream to find its piece: every rank of the split runs the
        same units). The patches' sums of one evaluation add up to the evaluation's (sums over tokens)."""
        if evaluation != self._index:
            self.evaluation(timestep)
            self._index = evaluation
        self._scope, self._bounds, self._within = patch, bounds, within

    def _close(self) -> None:
        if self._now:  # (the first evaluation has nothing to compare with)
            self.evaluations.append(self._now)
        self._now = None

    def stop(self) -> list[dict[str, torch.Tensor]]:
        self._close()
        for h in self._handles:
            h.remove()
        self._handles, self._prev = [], {}
        return self.evaluations
