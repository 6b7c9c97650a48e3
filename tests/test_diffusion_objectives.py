"""Objectives and noise-level sampling against closed forms (float64 references)."""
import math

import pytest
import torch

from dit_mcore.diffusion import (EDMConfig, EDMObjective, FlowConfig, FlowObjective, build_objective,
                                 karras_sigmas, shift_time)

SD = 0.5  # EDM sigma_data default


def _flow_case():
    x0 = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [0.25, 4.0, 2.0]], dtype=torch.float64)
    eps = torch.tensor([[0.1, 0.2, -0.3], [-1.0, 2.0, 0.5], [0.7, -0.4, 1.5]], dtype=torch.float64)
    t = torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)
    return x0, eps, t


def test_flow_prepare_matches_closed_form():
    x0, eps, t = _flow_case()
    inputs = FlowObjective().prepare(x0, eps, t)
    # row 0 at t=0 is clean data, row 2 at t=1 is pure noise, row 1 is 3/4 data + 1/4 noise
    torch.testing.assert_close(inputs.model_input[0], x0[0], rtol=0, atol=0)
    torch.testing.assert_close(inputs.model_input[1], 0.75 * x0[1] + 0.25 * eps[1], rtol=0, atol=1e-15)
    torch.testing.assert_close(inputs.model_input[2], eps[2], rtol=0, atol=0)
    torch.testing.assert_close(inputs.target, eps - x0, rtol=0, atol=0)
    torch.testing.assert_close(inputs.weight, torch.ones(3, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(inputs.timestep, torch.tensor([0.0, 250.0, 1000.0], dtype=torch.float64))

    out = torch.randn(3, 3, dtype=torch.float64)
    loss = FlowObjective().loss(out, inputs)
    assert loss.shape == x0.shape
    torch.testing.assert_close(loss, (out - (eps - x0)) ** 2, rtol=0, atol=0)


def test_flow_packed_tokens_and_low_precision():
    """Packed layout: x0 [tokens, patch_dim] with a per-token level gathered from per-sample levels."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(7, 4, generator=g).to(torch.bfloat16)
    eps = torch.randn(7, 4, generator=g).to(torch.bfloat16)
    per_sample = torch.tensor([0.2, 0.9])
    sample_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    inputs = FlowObjective().prepare(x0, eps, per_sample[sample_ids])
    assert inputs.model_input.dtype == torch.bfloat16 and inputs.target.dtype == torch.float32
    t = per_sample[sample_ids].double()[:, None]
    ref = (1 - t) * x0.double() + t * eps.double()
    torch.testing.assert_close(inputs.model_input.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(inputs.target.double(), eps.double() - x0.double(), rtol=0, atol=0)
    assert FlowObjective().loss(torch.zeros(7, 4, dtype=torch.bfloat16), inputs).dtype == torch.float32


def test_edm_preconditioning_closed_form():
    obj = EDMObjective()
    sigmas = [0.002, 0.1, 0.5, 1.0, 80.0]
    pre = obj.preconditioning(torch.tensor(sigmas, dtype=torch.float64))
    for i, s in enumerate(sigmas):
        assert pre.c_skip[i].item() == pytest.approx(SD ** 2 / (s ** 2 + SD ** 2), rel=1e-14)
        assert pre.c_out[i].item() == pytest.approx(s * SD / math.sqrt(s ** 2 + SD ** 2), rel=1e-14)
        assert pre.c_in[i].item() == pytest.approx(1 / math.sqrt(s ** 2 + SD ** 2), rel=1e-14)
        assert pre.c_noise[i].item() == pytest.approx(math.log(s) / 4, rel=1e-14)
        lam = obj.loss_weight(torch.tensor([s], dtype=torch.float64)).item()
        assert lam == pytest.approx((s ** 2 + SD ** 2) / (s * SD) ** 2, rel=1e-14)
    # at sigma = sigma_data the skip and input scalings are symmetric
    assert pre.c_skip[2].item() == pytest.approx(0.5) and pre.c_out[2].item() == pytest.approx(SD / math.sqrt(2))
    # the network's timestep is c_noise (scaled by timestep_scale)
    s = torch.tensor(sigmas, dtype=torch.float64)
    torch.testing.assert_close(obj.timestep(s), torch.log(s) / 4)
    torch.testing.assert_close(EDMObjective(EDMConfig(timestep_scale=250.0)).timestep(s), 250 * torch.log(s) / 4)


def test_edm_loss_equals_weighted_x0_error_by_hand():
    g = torch.Generator().manual_seed(1)
    obj = EDMObjective()
    x0 = torch.randn(5, 3, 2, 2, generator=g, dtype=torch.float64)
    eps = torch.randn(5, 3, 2, 2, generator=g, dtype=torch.float64)
    sigma = torch.tensor([0.01, 0.3, 0.5, 2.0, 40.0], dtype=torch.float64)
    F = torch.randn(5, 3, 2, 2, generator=g, dtype=torch.float64)
    inputs = obj.prepare(x0, eps, sigma)
    loss = obj.loss(F, inputs)

    s = sigma.view(-1, 1, 1, 1)
    x = x0 + s * eps
    tot = s ** 2 + SD ** 2
    c_skip, c_out, c_in = SD ** 2 / tot, s * SD / tot.sqrt(), 1 / tot.sqrt()
    D = c_skip * x + c_out * F
    ref = (s ** 2 + SD ** 2) / (s * SD) ** 2 * (D - x0) ** 2
    assert loss.shape == x0.shape
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(inputs.model_input, c_in * x, rtol=1e-14, atol=0)
    torch.testing.assert_close(inputs.timestep, torch.log(sigma) / 4)
    torch.testing.assert_close(inputs.weight, torch.ones(5, dtype=torch.float64), rtol=1e-12, atol=0)


def test_edm_optimal_denoiser_has_zero_loss_and_denoises_exactly():
    """Single data point x0 = c: the F that makes D == x0 gives zero loss in training and, through
    the same calling convention, denoise() returns x0 exactly."""
    obj = EDMObjective()
    c = 0.7
    x0 = torch.full((4, 6), c, dtype=torch.float64)
    eps = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sigma = torch.tensor([0.05, 0.5, 3.0, 70.0], dtype=torch.float64)

    def optimal_F(x_in, timestep, **cond):
        s = torch.exp(4 * timestep)[:, None]  # invert c_noise
        x = x_in * (s ** 2 + SD ** 2).sqrt()  # invert c_in
        return (c - SD ** 2 / (s ** 2 + SD ** 2) * x) / (s * SD / (s ** 2 + SD ** 2).sqrt())

    inputs = obj.prepare(x0, eps, sigma)
    loss = obj.loss(optimal_F(inputs.model_input, inputs.timestep), inputs)
    assert loss.abs().max().item() < 1e-20
    x_noisy = x0 + sigma[:, None] * eps
    torch.testing.assert_close(obj.denoise(optimal_F, x_noisy, sigma), x0, rtol=0, atol=1e-12)
    # a wrong F costs exactly lambda * c_out^2 * (F - F*)^2 = (F - F*)^2
    off = obj.loss(optimal_F(inputs.model_input, inputs.timestep) + 0.1, inputs)
    torch.testing.assert_close(off, torch.full_like(off, 0.01), rtol=1e-9, atol=0)


def _logit(t):
    return torch.log(t) - torch.log1p(-t)


def test_flow_logit_normal_and_uniform_distributions():
    n = 100_000
    g = torch.Generator().manual_seed(3)
    t = FlowObjective(FlowConfig(logit_mean=0.5, logit_std=0.8)).sample_level(n, generator=g).double()
    assert t.shape == (n,)
    assert bool(((t > 0) & (t < 1)).all())
    u = _logit(t)
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 0.8) < 0.01

    t = FlowObjective(FlowConfig(sampling="uniform")).sample_level(n, generator=g).double()
    assert abs(t.mean().item() - 0.5) < 0.005 and abs(t.var().item() - 1 / 12) < 0.002

    # SD3 shift: closed form at a point, fixed ends, and it is applied on top of the same draws
    assert shift_time(torch.tensor([0.0, 0.5, 1.0]), 3.0).tolist() == pytest.approx([0.0, 0.75, 1.0])
    a = FlowObjective(FlowConfig(shift=3.0)).sample_level(1000, generator=torch.Generator().manual_seed(4))
    b = FlowObjective().sample_level(1000, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(a, 3 * b / (1 + 2 * b))


def test_edm_log_normal_sigma_distribution():
    n = 100_000
    sigma = EDMObjective().sample_level(n, generator=torch.Generator().manual_seed(5))
    assert sigma.shape == (n,) and sigma.dtype == torch.float32 and bool((sigma > 0).all())
    ln = sigma.double().log()
    assert abs(ln.mean().item() + 1.2) < 0.015 and abs(ln.std().item() - 1.2) < 0.015


@pytest.mark.parametrize("name", ["flow", "edm"])
def test_level_sampling_is_per_sample_and_deterministic(name):
    obj = build_objective(name)
    a = obj.sample_level(64, generator=torch.Generator().manual_seed(7))
    b = obj.sample_level(64, generator=torch.Generator().manual_seed(7))
    c = obj.sample_level(64, generator=torch.Generator().manual_seed(8))
    assert a.shape == (64,) and torch.equal(a, b) and not torch.equal(a, c)
    assert a.unique().numel() == 64  # one independent level per sample
    assert obj.sample_level(3, device="cpu").device.type == "cpu"


def test_karras_schedule_closed_form():
    s = karras_sigmas(4, 0.002, 80.0, 7.0)
    lo, hi = 0.002 ** (1 / 7), 80.0 ** (1 / 7)
    ref = [(hi + i / 3 * (lo - hi)) ** 7 for i in range(4)] + [0.0]
    assert s.tolist() == pytest.approx(ref, rel=1e-12)
    assert s[0].item() == pytest.approx(80.0) and s[3].item() == pytest.approx(0.002)


def test_registry_and_config_errors():
    assert isinstance(build_objective(), FlowObjective)
    edm = build_objective("edm", sigma_data=1.0, p_mean=0.0, p_std=1.0)
    assert isinstance(edm, EDMObjective) and edm.config.sigma_data == 1.0
    with pytest.raises(ValueError, match=r"valid names: \['ddpm', 'edm', 'flow'\]"):
        build_objective("vdm")
    with pytest.raises(ValueError, match="logit_std"):
        build_objective("flow", sigma_data=0.5)
    with pytest.raises(ValueError, match="FlowConfig.sampling"):
        FlowConfig(sampling="mode")
    with pytest.raises(ValueError, match="sigma_max"):
        EDMConfig(sigma_min=1.0, sigma_max=0.5)
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="sample_ids"):
        FlowObjective().prepare(x, x, torch.zeros(2))
    with pytest.raises(ValueError, match="noise shape"):
        FlowObjective().prepare(x, torch.zeros(4, 3), torch.zeros(4))
