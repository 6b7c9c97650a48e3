"""The DDPM objective (the original DiT's) and its DDIM and DDPM samplers, against a float64 formula
and diffusers' own schedulers and ``DiTPipeline``: imported DiT weights sample as they do in diffusers."""
import types

import pytest
import torch

from dit_mcore.diffusion import build_objective
from dit_mcore.diffusion.samplers import sample


def test_ddpm_training_inputs_match_a_float64_formula():
    obj = build_objective("ddpm", beta_dtype="float64")
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)  # DiT's numpy schedule
    abar = torch.cumprod(1 - betas, 0)
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(5, 3, 4, generator=g, dtype=torch.float64), torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([0.0, 1.0, 500.0, 998.0, 999.0], dtype=torch.float64)
    inputs = obj.prepare(x0, eps, t)
    a = abar[t.long()].view(-1, 1, 1)
    torch.testing.assert_close(inputs.model_input, a.sqrt() * x0 + (1 - a).sqrt() * eps, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inputs.target, eps, rtol=0, atol=0)
    assert torch.equal(inputs.timestep, t) and torch.equal(inputs.weight, torch.ones(5, dtype=torch.float64))
    pred = eps + 0.1
    torch.testing.assert_close(obj.loss(pred, inputs), torch.full_like(eps, 0.01), rtol=1e-12, atol=1e-12)
    draws = obj.sample_level(10_000, generator=torch.Generator().manual_seed(1))
    assert draws.min() >= 0 and draws.max() <= 999 and torch.equal(draws, draws.round())
    assert abs(draws.mean().item() - 499.5) < 10


def _toy_eps(x, timestep, **_):
    """A deterministic stand-in network: depends on x and t, O(1) output."""
    return torch.tanh(x * 0.7 + (timestep.view(-1, *[1] * (x.dim() - 1)) / 1000.0) - 0.3)


def _diffusers_loop(scheduler, noise, steps, **step_kwargs):
    scheduler.set_timesteps(steps)
    x = noise.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(_toy_eps(x, t.float().expand(x.shape[0])), t, x, **step_kwargs).prev_sample
    return x


@pytest.mark.parametrize("spacing, offset, clip, to_one",
                         [("leading", 0, False, True), ("leading", 1, True, False), ("trailing", 0, False, True),
                          ("linspace", 0, False, True)])
def test_ddim_equals_diffusers_ddim_scheduler(spacing, offset, clip, to_one):
    from diffusers import DDIMScheduler
    noise = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                              clip_sample=clip, set_alpha_to_one=to_one, steps_offset=offset, timestep_spacing=spacing)
    want = _diffusers_loop(scheduler, noise, 25)
    obj = build_objective("ddpm", timestep_spacing=spacing, steps_offset=offset, clip_sample=clip,
                          set_alpha_to_one=to_one)
    assert obj.sampling_steps(25) == scheduler.timesteps.tolist()
    got = sample(obj, _toy_eps, noise, 25, sampler="ddim")
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_ddpm_sampler_equals_diffusers_ddpm_scheduler_with_its_noise():
    from diffusers import DDPMScheduler
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                              clip_sample=False, variance_type="fixed_small")
    want = _diffusers_loop(scheduler, noise, 20, generator=torch.Generator().manual_seed(9))
    got = sample(build_objective("ddpm"), _toy_eps, noise, 20, sampler="ddpm", noise_seed=9)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


class _RecordingVAE(torch.nn.Module):
    """A VAE stand-in for ``DiTPipeline``: records the latents it is asked to decode."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(scaling_factor=1.0)
        self.recorded = []
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def decode(self, z):
        self.recorded.append(z.clone())
        return types.SimpleNamespace(sample=torch.zeros_like(z))


def test_imported_diffusers_dit_samples_as_diffusers_dit_pipeline(tmp_path):
    """diffusers' ``DiTPipeline`` with its ``DDIMScheduler`` and our DDIM sampler on the same weights
    (a small random ``DiTTransformer2DModel`` with the 1,000 ImageNet classes the pipeline assumes),
    noise, labels, steps and guidance: the same latents (the VAE is a stub that records them)."""
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    from dit_mcore.models.dit.interop import load_diffusers
    from megatron_env import single_process_world
    from dit_mcore.models.adapter import image_model_fn
    from test_interop import _fill_random
    single_process_world()
    d = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                              num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
                              norm_eps=1e-6)
    _fill_random(d.parameters(), seed=4)
    for block in d.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(d.transformer_blocks[0].norm1.emb.state_dict())
    d.eval().save_pretrained(tmp_path)
    vae = _RecordingVAE()
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False)
    pipe = DiTPipeline(transformer=d, vae=vae, scheduler=scheduler)
    labels = [3, 999, 0]
    pipe(class_labels=labels, guidance_scale=4.0, num_inference_steps=12, generator=torch.Generator().manual_seed(5),
         output_type="pt")
    want = vae.recorded[0]
    noise = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))  # the pipeline's draw
    model = load_diffusers(str(tmp_path))
    got = sample(build_objective("ddpm"), image_model_fn(model, model.config), noise, 12, sampler="ddim",
                 labels=torch.tensor(labels), null_label=1000, cfg_scale=4.0)
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


def _variational_reference(x0, eps, t, eps_pred, v):
    """DiT's ``vb`` term per element in bits, in float64 from the textbook Gaussians: the KL of the true
    posterior from the model's reverse step (t > 0), the discretised decoder's negative log-likelihood (t = 0)."""
    from torch.distributions import Normal, kl_divergence
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0)
    out = torch.empty_like(x0)
    for row, step in enumerate(t.long().tolist()):
        a, b = abar[step], betas[step]
        a_prev = abar[step - 1] if step else torch.tensor(1.0, dtype=torch.float64)
        x_t = a.sqrt() * x0[row] + (1 - a).sqrt() * eps[row]
        posterior_var = betas[max(step, 1)] * (1 - abar[max(step, 1) - 1]) / (1 - abar[max(step, 1)])

        def mean(start):
            return a_prev.sqrt() * b / (1 - a) * start + (1 - b).sqrt() * (1 - a_prev) / (1 - a) * x_t
        x0_model = (x_t - (1 - a).sqrt() * eps_pred[row]) / a.sqrt()
        frac = (v[row] + 1) / 2
        model = Normal(mean(x0_model), (0.5 * (frac * b.log() + (1 - frac) * posterior_var.log())).exp())
        if step:
            out[row] = kl_divergence(Normal(mean(x0[row]), posterior_var.sqrt()), model)
        else:
            x = x0[row]
            upper = torch.where(x > 0.999, torch.ones_like(x), model.cdf(x + 1 / 255))
            lower = torch.where(x < -0.999, torch.zeros_like(x), model.cdf(x - 1 / 255))
            out[row] = -(upper - lower).log()
    return out / torch.log(torch.tensor(2.0, dtype=torch.float64))


def test_ddpm_learned_variance_loss_is_l_simple_plus_the_variational_bound_in_bits():
    """``L_hybrid`` of a learned-sigma output (``2C`` channels) against float64 Gaussians, at t = 0 (the
    decoder, with data in and beyond the outer bins), 1, mid and last; the variational term trains the
    variance channels only (epsilon's gradient is L_simple's)."""
    obj = build_objective("ddpm", beta_dtype="float64")
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(4, 3, 5, generator=g, dtype=torch.float64) * 0.6
    x0[0, 0, :2] = torch.tensor([-1.2, 1.1], dtype=torch.float64)  # the decoder's open-ended outer bins
    eps = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    t = torch.tensor([0.0, 1.0, 500.0, 999.0], dtype=torch.float64)
    eps_pred = (eps + 0.2 * torch.randn(4, 3, 5, generator=g, dtype=torch.float64)).requires_grad_()
    v = (torch.rand(4, 3, 5, generator=g, dtype=torch.float64) * 2 - 1).requires_grad_()
    inputs = obj.prepare(x0, eps, t)
    loss = obj.loss(torch.cat([eps_pred, v], dim=1), inputs)
    want = (eps_pred - eps).square() + _variational_reference(x0, eps, t, eps_pred.detach(), v.detach())
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    loss.sum().backward()
    torch.testing.assert_close(eps_pred.grad, 2 * (eps_pred - eps).detach(), rtol=1e-12, atol=1e-12)
    assert v.grad.abs().min() > 0
    plain = build_objective("ddpm", beta_dtype="float64", variance="fixed_small")
    torch.testing.assert_close(plain.loss(torch.cat([eps_pred, v], dim=1)[:, :3], inputs),
                               (eps_pred - eps).detach().square(), rtol=1e-12, atol=1e-12)


def _toy_eps_and_variance(x, timestep, variance=False, **_):
    """``_toy_eps`` and, for ``variance=True``, variance channels in [-1, 1] that depend on x and t."""
    eps = _toy_eps(x, timestep)
    return torch.cat([eps, torch.tanh(x - timestep.view(-1, *[1] * (x.dim() - 1)) / 500.0)], 1) if variance else eps


def test_ddpm_sampler_with_learned_variance_equals_diffusers_learned_range_scheduler():
    from diffusers import DDPMScheduler
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                              clip_sample=False, variance_type="learned_range")
    scheduler.set_timesteps(20)
    want, gen = noise.clone(), torch.Generator().manual_seed(9)
    for t in scheduler.timesteps:
        out = _toy_eps_and_variance(want, t.float().expand(2), variance=True)
        want = scheduler.step(out, t, want, generator=gen).prev_sample
    got = sample(build_objective("ddpm"), _toy_eps_and_variance, noise, 20, sampler="ddpm", noise_seed=9)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    fixed = sample(build_objective("ddpm", variance="fixed_small"), _toy_eps_and_variance, noise, 20,
                   sampler="ddpm", noise_seed=9)
    assert ((fixed - want).norm() / want.norm()).item() > 1e-3  # the variance made a difference


def test_imported_learned_sigma_dit_samples_with_ddpm_as_dit_does_with_guidance(tmp_path):
    """A diffusers ``DiTTransformer2DModel`` with learned sigma, our DDPM sampler against diffusers' model
    and ``DDPMScheduler(variance_type="learned_range")`` in a guided loop as DiT's ``sample.py`` runs it
    (epsilon guided, the variance channels the conditional half's)."""
    from diffusers import DDPMScheduler

    from dit_mcore.models.dit.interop import load_diffusers
    from megatron_env import single_process_world
    from dit_mcore.models.adapter import image_model_fn
    from test_interop import _tiny_diffusers
    single_process_world()
    d = _tiny_diffusers(seed=8)
    d.save_pretrained(tmp_path)
    labels, scale = torch.tensor([3, 7]), 3.0
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False,
                              variance_type="learned_range")
    scheduler.set_timesteps(8)
    want, gen = noise.clone(), torch.Generator().manual_seed(6)
    with torch.no_grad():
        for t in scheduler.timesteps:
            both = d(torch.cat([want, want]), timestep=t.expand(4), class_labels=torch.cat([labels, labels * 0 + 10]))
            cond, uncond = both.sample.chunk(2)
            eps = uncond[:, :4] + scale * (cond[:, :4] - uncond[:, :4])
            want = scheduler.step(torch.cat([eps, cond[:, 4:]], 1), t, want, generator=gen).prev_sample
    model = load_diffusers(str(tmp_path))
    got = sample(build_objective("ddpm"), image_model_fn(model, model.config), noise, 8, sampler="ddpm",
                 labels=labels, null_label=10, cfg_scale=scale, noise_seed=6)
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


def test_the_training_loss_reads_the_variance_channels_of_each_token_as_the_image_layout_does():
    """The trainer's per-token loss on a learned-sigma output ``[s, b, 2 * patch_dim]`` equals the objective's
    loss on the same output unpatchified to ``[b, 2C, H, W]`` (the variance channels follow the prediction
    channel-major in each token), averaged per sample and summed."""
    from energon_data.batch import MicroBatch
    from energon_data.tokens import patchify, unpatchify
    from dit_mcore.models.dit.config import preset
    from dit_mcore.training.step_loss import StepLoss
    from megatron_env import single_process_world
    single_process_world()
    config = preset("tiny", input_size=4)
    obj = build_objective("ddpm")
    g = torch.Generator().manual_seed(2)
    images, noise = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    tokens, grid = patchify(images, 2)
    batch = MicroBatch.dense(tokens, grid, torch.tensor([1, 2]))
    level = torch.tensor([0.0, 321.0])
    inputs = obj.prepare(tokens.flatten(0, 1), patchify(noise, 2)[0].flatten(0, 1), level[batch.token_to_sample])
    output = torch.randn(4, 2, config.out_patch_dim, generator=g).tanh()
    got, _, _ = StepLoss(config, obj, torch.float32, "dit").loss(inputs, batch, output)
    image_out = unpatchify(output.transpose(0, 1), grid, 8, 2)
    want = obj.loss(image_out, obj.prepare(images, noise, level)).mean((1, 2, 3)).sum()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = obj.loss(image_out[:, :4], obj.prepare(images, noise, level)).mean((1, 2, 3)).sum()
    assert (got - plain).abs() > 1e-2  # the variational term is in it


def test_the_runs_ddpm_variance_setting_reaches_its_objective():
    """``diffusion.ddpm_variance``: DiT's learned range by default, the posterior's on request (a run whose
    variance channels were never trained samples as it did)."""
    from dit_mcore.training.config import DiffusionConfig
    assert DiffusionConfig(objective="ddpm").build().learns_variance
    assert not DiffusionConfig(objective="ddpm", ddpm_variance="fixed_small").build().learns_variance
    assert DiffusionConfig(objective="flow", ddpm_variance="fixed_small").build().name == "flow"
