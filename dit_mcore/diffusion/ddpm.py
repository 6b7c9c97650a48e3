"""DDPM (Ho et al. 2020) as the original DiT trains it: the variance-preserving process with a linear
beta schedule over 1,000 steps, and an epsilon-predicting network.

``x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps`` with ``abar_t = prod_{s<=t} (1 - beta_s)`` and integer
``t`` in ``0..T-1``, which is also what the network's timestep embedder sees (DiT's convention). The
loss is DiT's ``L_simple``, ``(eps_pred - eps)^2`` with unit weight.

A learned-sigma DiT (``learn_sigma``: ``2C`` output channels) also predicts its reverse-step variance, as
Nichol & Dhariwal's "learned range" (``variance="learned_range"``, the default): the second ``C``
channels ``v`` in ``[-1, 1]`` interpolate the log-variance between the posterior's (``v = -1``) and
``beta_t`` (``v = 1``). Training adds DiT's variational term (``L_hybrid = L_simple + L_vlb``, as DiT's
``training_losses`` with its MSE loss type: the KL of the true posterior ``q(x_{t-1} | x_t, x_0)`` from
the model's Gaussian in bits, the decoder's discretised Gaussian log-likelihood at ``t = 0``, the mean
built from the detached epsilon so that only the variance channels learn from it); the DDPM sampler
draws its noise with the learned variance (``variance="fixed_small"``: the posterior variance, the
variance channels untrained and unused). DDIM needs no variance.

Samplers, on ``num_sampling_steps`` of the 1,000 training steps:

- :func:`ddim`: Song et al.'s DDIM (``eta = 0``: deterministic), with diffusers' ``DDIMScheduler``
  conventions (``timestep_spacing`` "leading"/"trailing"/"linspace", ``steps_offset``,
  ``set_alpha_to_one``, ``clip_sample``), so imported weights sample as diffusers' ``DiTPipeline``;
- :func:`ddpm`: ancestral sampling on the same respaced steps (as DiT's ``space_timesteps``) with the
  learned or the posterior variance; its noise comes from ``noise_seed`` (one generator, or one per row).

The betas are built in float64 from float32 ``linspace`` values as diffusers builds them in float32
(``beta_dtype``="float32", the default: diffusers' numbers) or in float64 as DiT's numpy code does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import math

import torch

from dit_mcore.diffusion.guidance import bind_guidance
from dit_mcore.diffusion.objective import ModelFn, Objective, TrainInputs, broadcast_level, check_batch, compute_dtype
from dit_mcore.kernels.host_copy import to_device

TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")
VARIANCES = ("learned_range", "fixed_small")


@dataclass
class DDPMConfig:
    """The DDPM objective and its samplers' settings (defaults: DiT's and diffusers' DDIMScheduler's)."""

    num_train_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    beta_dtype: str = "float32"
    """"float32" (diffusers' ``torch.linspace`` in float32) or "float64" (DiT's numpy)."""
    timestep_spacing: str = "leading"
    """Which training steps a K-step sampler visits: "leading" (``arange(K) * (T // K)``, diffusers'
    default), "trailing" or "linspace"."""
    steps_offset: int = 0
    """Added to every sampled step (diffusers' field; Stable Diffusion uses 1)."""
    set_alpha_to_one: bool = True
    """DDIM's last step lands on ``abar = 1`` (else on ``abar_0``)."""
    clip_sample: bool = False
    """Clip the predicted x0 to ``[-1, 1]`` (pixel-space models; latents are not bounded); the
    epsilon stepped with stays the model's (diffusers' ``use_clipped_model_output=False``)."""
    eta: float = 0.0
    """DDIM's stochasticity (0: deterministic); the noise then comes from ``noise_seed``."""
    variance: str = "learned_range"
    """The reverse step's variance: "learned_range" (a model with variance channels learns them with DiT's
    variational term and the DDPM sampler uses them; a model without them gets "fixed_small") or
    "fixed_small" (the posterior variance ``beta~_t``; variance channels neither trained nor used)."""

    def __post_init__(self):
        if self.num_train_timesteps < 2 or not 0 < self.beta_start < self.beta_end < 1:
            raise ValueError(f"DDPMConfig needs num_train_timesteps >= 2 and 0 < beta_start < beta_end < 1, got "
                             f"{self.num_train_timesteps}, {self.beta_start}, {self.beta_end}")
        if self.beta_dtype not in ("float32", "float64"):
            raise ValueError(f"DDPMConfig.beta_dtype={self.beta_dtype!r}: use 'float32' or 'float64'")
        if self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ValueError(f"DDPMConfig.timestep_spacing={self.timestep_spacing!r}: use one of {TIMESTEP_SPACINGS}")
        if self.variance not in VARIANCES:
            raise ValueError(f"DDPMConfig.variance={self.variance!r}: use one of {VARIANCES}")


class DDPMObjective(Objective):
    """Epsilon prediction on the linear-beta VP process. The noise level is the integer step t."""

    name = "ddpm"

    def __init__(self, config: Optional[DDPMConfig] = None):
        self.config = config or DDPMConfig()
        c = self.config
        dtype = torch.float32 if c.beta_dtype == "float32" else torch.float64
        self.betas = torch.linspace(c.beta_start, c.beta_end, c.num_train_timesteps, dtype=dtype).double()
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, 0)
        if c.beta_dtype == "float32":  # diffusers keeps abar in float32
            self.alphas_cumprod = self.alphas_cumprod.float().double()
        # the true posterior q(x_{t-1} | x_t, x_0) per training step (float64): its mean's coefficients on
        # x_0 and x_t and its log-variance, clipped at t = 0 (where it is 0) to step 1's as DiT's tables
        abar, abar_prev = self.alphas_cumprod, torch.cat([self.alphas_cumprod.new_ones(1), self.alphas_cumprod[:-1]])
        variance = self.betas * (1 - abar_prev) / (1 - abar)
        self._posterior = torch.stack([self.betas * abar_prev.sqrt() / (1 - abar),
                                       (1 - abar_prev) * (1 - self.betas).sqrt() / (1 - abar),
                                       torch.cat([variance[1:2], variance[1:]]).log(), self.betas.log()])

    @property
    def learns_variance(self) -> bool:
        return self.config.variance == "learned_range"

    def sample_level(self, n: int, *, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        draw_device = generator.device if generator is not None else (device or "cpu")
        t = torch.randint(0, self.config.num_train_timesteps, (n,), generator=generator, device=draw_device)
        t = t.float()
        return to_device(t, device) if device is not None else t

    def level_quantile(self, q: torch.Tensor) -> torch.Tensor:
        n = self.config.num_train_timesteps  # uniform over the integer steps 0 .. n-1
        return (q * n).floor().clamp(0, n - 1).float()

    def timestep(self, level: torch.Tensor) -> torch.Tensor:
        return level

    def abar(self, level: torch.Tensor) -> torch.Tensor:
        """``abar_t`` for integer levels ``[N]`` (float64, on the levels' device)."""
        return to_device(self.alphas_cumprod, level.device)[level.long()]

    def prepare(self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor) -> TrainInputs:
        check_batch(x0, noise, level)
        dtype = compute_dtype(x0, noise)
        abar = broadcast_level(self.abar(level).to(dtype), x0)
        x_t = abar.sqrt() * x0.to(dtype) + (1 - abar).sqrt() * noise.to(dtype)
        return TrainInputs(model_input=x_t.to(x0.dtype), timestep=self.timestep(level), target=noise.to(dtype),
                           weight=torch.ones_like(level, dtype=dtype), x0=x0, level=level)

    def loss(self, model_output: torch.Tensor, inputs: TrainInputs) -> torch.Tensor:
        """``L_simple``; with the variance channels after the prediction (``2C`` on dim 1, see
        :attr:`learns_variance`) plus DiT's variational term in bits, elementwise (their per-sample means
        add up to DiT's ``mse + vb``)."""
        if not self.learns_variance or model_output.shape[1] != 2 * inputs.target.shape[1]:
            return super().loss(model_output, inputs)
        eps, v = model_output.chunk(2, dim=1)
        return super().loss(eps, inputs) + self.variational_term(eps.detach(), v, inputs)

    def variational_term(self, eps: torch.Tensor, v: torch.Tensor, inputs: TrainInputs) -> torch.Tensor:
        """``L_{t-1}`` of the variational bound per element, in bits: ``KL(q(x_{t-1} | x_t, x_0) ||
        p(x_{t-1} | x_t))`` for t > 0 and the decoder's ``-log p(x_0 | x_1)`` (a Gaussian discretised to 256
        levels on [-1, 1]) at t = 0. The model's mean is the posterior mean at its x0 estimate from ``eps``
        and its log-variance ``(v + 1) / 2 * log beta_t + (1 - v) / 2 * log beta~_t`` (Nichol & Dhariwal, eq. 15)."""
        if inputs.x0 is None or inputs.level is None:
            raise ValueError("the variational term needs the x0 and level that DDPMObjective.prepare records")
        dtype = compute_dtype(eps, v, inputs.target)
        x0, noise = inputs.x0.to(dtype), inputs.target.to(dtype)
        t = inputs.level.long()
        abar = broadcast_level(self.abar(inputs.level).to(dtype), x0)
        c0, c1, log_q, log_beta = (broadcast_level(row.to(dtype), x0)
                                   for row in to_device(self._posterior, t.device)[:, t])
        x0_model = ((1 - abar).sqrt() * (noise - eps)) / abar.sqrt() + x0  # (x_t - sqrt(1 - abar) eps) / sqrt(abar)
        frac = (v.to(dtype) + 1) / 2
        log_p = frac * log_beta + (1 - frac) * log_q
        mean_gap = c0 * (x0 - x0_model)  # posterior mean at x0 minus at the model's x0 (the x_t terms cancel)
        kl = 0.5 * (log_p - log_q - 1 + (log_q - log_p).exp() + mean_gap.square() * (-log_p).exp())
        mean = c0 * x0_model + c1 * (abar.sqrt() * x0 + (1 - abar).sqrt() * noise)
        nll = -_discretised_gaussian_log_likelihood(x0, mean, 0.5 * log_p)
        return torch.where(broadcast_level(t == 0, x0), nll, kl) / math.log(2.0)

    def sampling_steps(self, steps: int) -> list[int]:
        """The training steps a ``steps``-step sampler visits, from noisiest down (diffusers' spacings)."""
        c, T = self.config, self.config.num_train_timesteps
        if not 1 <= steps <= T:
            raise ValueError(f"sampling steps must be in 1..{T}, got {steps}")
        if c.timestep_spacing == "leading":
            ts = [i * (T // steps) for i in range(steps)]
            ts = [t + c.steps_offset for t in ts]
        elif c.timestep_spacing == "trailing":
            ratio = T / steps
            ts = [int(round(T - i * ratio)) - 1 for i in range(steps)][::-1]
        else:
            ts = torch.linspace(0, T - 1, steps, dtype=torch.float64).round().long().tolist()
        return sorted(ts, reverse=True)

    def abar_at(self, t: int) -> float:
        """``abar_t``; 1 (``set_alpha_to_one``) or ``abar_0`` below step 0."""
        if t < 0:
            return 1.0 if self.config.set_alpha_to_one else float(self.alphas_cumprod[0])
        return float(self.alphas_cumprod[t])

    def x0_from_eps(self, x: torch.Tensor, eps: torch.Tensor, abar: float) -> torch.Tensor:
        x0 = (x - (1 - abar) ** 0.5 * eps) / abar ** 0.5
        return x0.clamp(-1, 1) if self.config.clip_sample else x0


def _discretised_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """``log P(x)`` of data on [-1, 1] quantised to 256 levels (bin half-width 1/255) under ``N(mean, scale^2)``;
    the outer bins reach to -inf and +inf (Ho et al.'s decoder). Exact normal CDFs (``ndtr``), so the tails
    keep their precision."""
    inv_scale = (-log_scale).exp()
    upper, lower = inv_scale * (x - mean + 1 / 255), inv_scale * (x - mean - 1 / 255)
    bin_mass = (torch.special.ndtr(upper) - torch.special.ndtr(lower)).clamp(min=1e-12).log()
    return torch.where(x < -0.999, torch.special.log_ndtr(upper),
                       torch.where(x > 0.999, torch.special.log_ndtr(-lower), bin_mass))


NoiseSeed = Union[int, Sequence[int]]
"""The seed of a stochastic sampler's noise: one generator for the batch (diffusers' convention), or
one per row (so a row's noise does not depend on the batch it is in)."""


def _fresh_noise(gens: list, like: torch.Tensor) -> torch.Tensor:
    if len(gens) == 1:
        noise = torch.randn(like.shape, generator=gens[0], dtype=like.dtype)
    else:
        noise = torch.stack([torch.randn(like.shape[1:], generator=g, dtype=like.dtype) for g in gens])
    return noise.to(like.device)


def _generators(noise_seed: NoiseSeed, rows: int) -> list:
    seeds = [noise_seed] if isinstance(noise_seed, int) else list(noise_seed)
    if len(seeds) not in (1, rows):
        raise ValueError(f"noise_seed: one seed, or one per row ({rows}), got {len(seeds)}")
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def _eps_call(model_fn: ModelFn, x: torch.Tensor, t: int, cond: dict) -> torch.Tensor:
    timestep = torch.full((x.shape[0],), float(t), dtype=torch.float32, device=x.device)
    return model_fn(x, timestep, **cond)


def _eps_and_variance(model_fn: ModelFn, x: torch.Tensor, t: int, cond: dict, learned: bool) -> tuple:
    """Epsilon, and the variance channels ``v`` when ``learned`` and the model predicts them (else None)."""
    out = _eps_call(model_fn, x, t, {**cond, "variance": True} if learned else cond).to(x.dtype)
    return out.chunk(2, dim=1) if out.shape[1] == 2 * x.shape[1] else (out, None)


@torch.no_grad()
def ddim(model_fn: ModelFn, noise: torch.Tensor, steps: int, *, objective: DDPMObjective,
         noise_seed: NoiseSeed = 0, cfg_scale: float = 1.0, labels: Optional[torch.Tensor] = None,
         null_label: Optional[int] = None, text=None, cfg_group=None, **cond) -> torch.Tensor:
    """DDIM from ``x_T = noise`` down ``objective.sampling_steps(steps)``; ``model_fn`` returns epsilon
    (with learned-sigma channels dropped by the adapter), guided as in every sampler
    (:func:`~dit_mcore.diffusion.guidance.bind_guidance`). ``eta`` from the objective's config."""
    model_fn = bind_guidance(model_fn, cfg_scale, labels, null_label, text, cfg_group)
    c = objective.config
    times = objective.sampling_steps(steps)
    ratio = c.num_train_timesteps // steps
    x = noise.to(compute_dtype(noise))
    gens = _generators(noise_seed, x.shape[0]) if c.eta else None
    for t in times:
        eps = _eps_call(model_fn, x, t, cond).to(x.dtype)
        abar, abar_prev = objective.abar_at(t), objective.abar_at(t - ratio)
        x0 = objective.x0_from_eps(x, eps, abar)
        var = (1 - abar_prev) / (1 - abar) * (1 - abar / abar_prev)
        sigma = c.eta * var ** 0.5
        x = abar_prev ** 0.5 * x0 + (1 - abar_prev - sigma ** 2) ** 0.5 * eps
        if sigma:
            x = x + sigma * _fresh_noise(gens, x)
    return x.to(noise.dtype)


@torch.no_grad()
def ddpm(model_fn: ModelFn, noise: torch.Tensor, steps: int, *, objective: DDPMObjective, noise_seed: NoiseSeed = 0,
         cfg_scale: float = 1.0, labels: Optional[torch.Tensor] = None, null_label: Optional[int] = None, text=None,
         cfg_group=None, **cond) -> torch.Tensor:
    """Ancestral sampling down the respaced steps (DiT's ``space_timesteps``: the betas of the visited
    steps recomputed from their ``abar``); its noise from a generator seeded with ``noise_seed``. The
    variance: the model's learned range (``objective.learns_variance`` and a model that returns its
    variance channels for ``variance=True``: DiT's sampling, diffusers' ``variance_type="learned_range"``),
    else the posterior's ("fixed small"). ``model_fn`` returns epsilon, guided as :func:`ddim`'s (the
    variance channels are the conditional pass's)."""
    model_fn = bind_guidance(model_fn, cfg_scale, labels, null_label, text, cfg_group)
    times = objective.sampling_steps(steps)
    x = noise.to(compute_dtype(noise))
    gens = _generators(noise_seed, x.shape[0])
    for i, t in enumerate(times):
        abar = objective.abar_at(t)
        abar_prev = objective.abar_at(times[i + 1]) if i + 1 < len(times) else 1.0
        beta = 1 - abar / abar_prev
        eps, v = _eps_and_variance(model_fn, x, t, cond, objective.learns_variance)
        x0 = objective.x0_from_eps(x, eps, abar)
        x = (abar_prev ** 0.5 * beta / (1 - abar)) * x0 + ((1 - beta) ** 0.5 * (1 - abar_prev) / (1 - abar)) * x
        if i + 1 < len(times):
            log_var = math.log(beta * (1 - abar_prev) / (1 - abar))
            if v is not None:  # interpolated in log space between the posterior's variance and beta
                frac = (v + 1) / 2
                std = (0.5 * (frac * math.log(beta) + (1 - frac) * log_var)).exp()
            else:
                std = math.exp(0.5 * log_var)
            x = x + std * _fresh_noise(gens, x)
    return x.to(noise.dtype)
