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
