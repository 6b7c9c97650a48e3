"""What one micro-batch computes in training: the noisy input for the objective, the model's output,
and the loss megatron's schedule calls on it. The trainer, the validation loss and the planner's
trace (:mod:`dit_mcore.plan.trace`) all run this one piece of code."""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state

from dit_mcore.errors import ConfigError
from dit_mcore.models.adapter import prediction, to_model_layout
from dit_mcore.models.text import TextContext


def counted(samples: int) -> int:
    """Samples this rank counts: every context-parallel rank computes the same loss on the gathered
    output (each one's gradients cover its own tokens), and the counts are summed over DP x CP, so
    only the first CP rank counts them."""
    return samples if parallel_state.get_context_parallel_rank() == 0 else 0


class StepLoss:
    """``model``'s forward and loss on a micro-batch for a model config, an objective and a compute dtype."""

    def __init__(self, model_config, objective, compute_dtype: torch.dtype, family: str):
        self.model_config, self.objective, self.compute_dtype, self.family = \
            model_config, objective, compute_dtype, family

    def labels_of(self, batch) -> torch.Tensor:
        """The batch's class labels, the null class where a sample has none."""
        return torch.where(batch.labels >= 0, batch.labels, torch.full_like(batch.labels, self.model_config.num_classes))

    def forward(self, model, batch, level: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, *,
                text_keep: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None) -> tuple:
        """``model``'s output on ``batch`` noised with ``noise`` at ``level`` (one per sample), and the loss
        function megatron's schedule calls on it (:meth:`loss`); ``text_keep``: the samples whose text is
        kept (else the null text); ``dtype``: of the model's input (default: the run's compute dtype)."""
        mc = self.model_config
        if batch.tokens.shape[-1] != mc.patch_dim:
            raise ConfigError(f"data tokens have {batch.tokens.shape[-1]} values but the model expects "
                              f"in_channels x patch volume = {mc.patch_dim}; set model.in_channels / patch sizes "
                              "to match the data")
        text = None
        if mc.text_dim:
            if not batch.has_text:
                raise ConfigError(f"model.family={self.family} is conditioned on text but the data has "
                                  "none; use a prepared energon dataset (it carries text embeddings)")
            text = TextContext.from_batch(batch, text_keep)
        x0 = batch.tokens.float()
        sample_of = batch.token_to_sample.clamp(min=0)
        inputs = self.objective.prepare(x0.flatten(0, 1), noise.flatten(0, 1), level[sample_of])
        x_in = to_model_layout(inputs.model_input.view_as(x0).to(dtype or self.compute_dtype))
        out = model(x_in, self.objective.timestep(level), labels, batch=batch, context=text)
        return out, partial(self.loss, inputs, batch)

    def loss(self, inputs, batch, output) -> tuple:
        """(sum of per-sample losses, sample count, logged pair). The gradient is divided by the
        global sample count through the loss scale (the trainer's ``_weigh_samples``), so every sample
        weighs the same whatever its micro-batch, pack or rank; megatron's schedule, in its per-token
        mode (``calculate_per_token_loss``: no division by the micro-batch count, a sum over DP), sums
        the counts, which :func:`optim.finalize_grads` then leaves unused. Context-parallel ranks other
        than the first report a count of 0 (they compute the same loss); the logged pair always
        carries the real count."""
        mc = self.model_config
        if self.objective.learns_variance and mc.learn_sigma:  # the prediction and its variance channels
            pred = output.transpose(0, 1).reshape(-1, 2 * mc.patch_dim)
        else:
            pred = prediction(output, mc).reshape(-1, mc.patch_dim)
        real = batch.token_to_sample >= 0
        per_token = self.objective.loss(pred, inputs).mean(-1) * real
        n, sample_of = batch.num_samples, batch.token_to_sample.clamp(min=0)
        sums = per_token.new_zeros(n).index_add_(0, sample_of, per_token)
        counts = per_token.new_zeros(n).index_add_(0, sample_of, real.float())
        loss_sum = (sums / counts.clamp(min=1)).sum()
        count = loss_sum.new_full((), counted(n), dtype=torch.int)  # a fill kernel: no host-to-device copy
        return loss_sum, count, {"loss": torch.stack([loss_sum.detach(), loss_sum.new_full((), float(n))])}

