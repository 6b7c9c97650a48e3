"""The contract every diffusion objective meets, shared by the trainer and the samplers.

Shapes: data ``x0`` is ``[N, ...]`` and noise levels are ``[N]``, one per leading row. N is the
batch size for dense batches, or the token count for packed sequences (the trainer expands a
per-sample level to tokens with ``level[sample_ids]``), so the math never needs to know about packing.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# ``model_fn(model_input [N, ...], timestep [N], **cond) -> raw network output [N, ...]``: the same
# call in training and sampling, so the two cannot disagree on input scaling or timestep units. A sampler
# that uses a learned variance calls it with ``variance=True``: a model that predicts one returns it after
# the prediction on dim 1 (``2C`` channels), any other returns its ``C`` (so ``**_`` in a model_fn is enough).
ModelFn = Callable[..., torch.Tensor]


@dataclass
class TrainInputs:
    """What one training step feeds the network and regresses it onto."""

    model_input: torch.Tensor
    """``[N, ...]`` network input (noisy data, preconditioned where the objective says so), in x0's dtype."""
    timestep: torch.Tensor
    """``[N]`` value for the DiT's timestep embedder, ``objective.timestep(level)``. For packed
    batches N counts tokens; the model wants one per sample, so pass ``objective.timestep(per_sample_level)``."""
    target: torch.Tensor
    """``[N, ...]`` regression target for the raw network output, in >= float32."""
    weight: torch.Tensor
    """``[N]`` loss weight per leading row, in >= float32."""
    x0: Optional[torch.Tensor] = None
    level: Optional[torch.Tensor] = None
    """The clean data and ``[N]`` levels, kept by objectives whose loss needs them (DDPM's variational term)."""


def broadcast_level(level: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View ``level [N]`` as ``[N, 1, ..., 1]`` so it broadcasts over ``like [N, ...]``."""
    return level.reshape(level.shape[0], *([1] * (like.dim() - 1)))


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32: bf16 coefficients and targets would add error the model cannot fit."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_batch(x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor) -> None:
    if x0.dim() < 1:
        raise ValueError("x0 must have a leading sample/token dimension [N, ...], got a scalar")
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} must equal x0 shape {tuple(x0.shape)}")
    if level.shape != (x0.shape[0],):
        raise ValueError(f"level must have shape [N] = ({x0.shape[0]},) (one per leading row of x0), "
                         f"got {tuple(level.shape)}; expand per-sample levels to tokens with level[sample_ids]")


def as_level(level, n: int, like: torch.Tensor) -> torch.Tensor:
    """Accept a python float or ``[N]`` tensor level at sampling time."""
    if not torch.is_tensor(level):
        return torch.full((n,), float(level), dtype=compute_dtype(like), device=like.device)
    if level.shape != (n,):
        raise ValueError(f"level must be a float or have shape ({n},), got {tuple(level.shape)}")
    return level


class Objective(abc.ABC):
    """A training objective: how to draw noise levels, corrupt data, and score the network."""

    name: str
    config: object
    learns_variance: bool = False
    """Whether :meth:`loss` trains a learned variance: it then takes the model's variance channels after the
    prediction on dim 1 (``2C``; ``C`` trains the prediction alone)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    @abc.abstractmethod
    def sample_level(self, n: int, *, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        """``n`` independent training noise levels (float32 ``[n]``), one per sample."""

    @abc.abstractmethod
    def level_quantile(self, q: torch.Tensor) -> torch.Tensor:
        """The training distribution's noise level at probability ``q`` (its inverse CDF), float32."""

    def validation_levels(self, k: int) -> torch.Tensor:
        """``k`` fixed noise levels (float32 ``[k]``, increasing) spread as the training draws are: the
        training distribution's ``(i + 1/2) / k`` quantiles, so their mean loss weighs the levels as
        training does, and a validation loss at them is comparable across steps, runs and layouts."""
        if k < 1:
            raise ValueError(f"the number of validation levels must be >= 1, got {k}")
        return self.level_quantile((torch.arange(k, dtype=torch.float64) + 0.5) / k).float()

    @abc.abstractmethod
    def timestep(self, level: torch.Tensor) -> torch.Tensor:
        """Map noise levels ``[N]`` to the value fed to the network's timestep embedder."""

    @abc.abstractmethod
    def prepare(self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor) -> TrainInputs:
        """Corrupt ``x0`` with standard-normal ``noise`` at ``level`` and build the regression problem."""

    def loss(self, model_output: torch.Tensor, inputs: TrainInputs) -> torch.Tensor:
        """Elementwise ``weight * (output - target)^2`` with x0's shape, unreduced (the trainer masks
        padding and averages per sample); computed in >= float32 whatever the output dtype."""
        if model_output.shape != inputs.target.shape:
            raise ValueError(f"model output shape {tuple(model_output.shape)} must equal the target shape "
                             f"{tuple(inputs.target.shape)}")
        dtype = compute_dtype(model_output, inputs.target)
        diff = model_output.to(dtype) - inputs.target.to(dtype)
        return broadcast_level(inputs.weight.to(dtype), diff) * diff.square()
