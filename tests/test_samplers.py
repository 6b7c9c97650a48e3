"""Samplers on analytic toy problems and classifier-free guidance, against closed forms.

Data is Gaussian N(mu, s^2) per dimension (s = 0: a point mass), for which the exact flow velocity,
EDM denoiser and the exact noise -> data transport map are known in closed form. The model_fns
below take the network's calling convention ``(model_input, timestep, **cond)`` and invert the
objective's input/timestep conventions themselves, so the tests also pin those conventions.
"""
import math

import pytest
import torch

from dit_mcore.diffusion import (EDMObjective, FlowObjective, drop_labels, euler_flow, flow_schedule, guided,
                                 heun_edm, sample)

SD = 0.5


def flow_velocity(mu, s):
    """Exact E[eps - x0 | x_t] for x0 ~ N(mu, s^2), x_t = (1-t) x0 + t eps."""
    def model_fn(x, timestep, labels=None):
        m = mu if labels is None else mu[labels].view(-1, *[1] * (x.dim() - 1))
        t = (timestep / 1000).view(-1, *[1] * (x.dim() - 1))
        var = (1 - t) ** 2 * s ** 2 + t ** 2
        r = x - (1 - t) * m
        return t / var * r - (m + (1 - t) * s ** 2 / var * r)
    return model_fn


def edm_network(mu, s):
    """Raw network F whose preconditioned denoiser is the exact E[x0 | x] for x0 ~ N(mu, s^2)."""
    def model_fn(x_in, timestep, labels=None):
        m = mu if labels is None else mu[labels].view(-1, *[1] * (x_in.dim() - 1))
        sig = torch.exp(4 * timestep).view(-1, *[1] * (x_in.dim() - 1))
        tot = sig ** 2 + SD ** 2
        x = x_in * tot.sqrt()
        D = m + s ** 2 / (s ** 2 + sig ** 2) * (x - m)
        return (D - SD ** 2 / tot * x) / (sig * SD / tot.sqrt())
    return model_fn


def _noise(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_euler_flow_gaussian_matches_moments_and_exact_map_first_order():
    mu, s = 1.5, 0.5
    z = _noise((2500, 1, 2, 2))
    out = euler_flow(flow_velocity(mu, s), z, 256)
    assert out.shape == z.shape
    assert abs(out.mean().item() - mu) < 0.02 and abs(out.std().item() - s) < 0.02
    # the exact ODE maps noise z to mu + s z; Euler is first order: error halves as steps double
    zs = _noise((2000, 3), seed=1)
    errs = [(euler_flow(flow_velocity(mu, s), zs, n) - (mu + s * zs)).abs().max().item() for n in (32, 64, 128)]
    assert errs[-1] < 0.03
    for a, b in zip(errs, errs[1:]):
        assert 1.8 < a / b < 2.2, errs


def test_heun_edm_gaussian_matches_moments_and_is_second_order():
    mu, s = 1.5, 0.5
    obj = EDMObjective()
    smin, smax = obj.config.sigma_min, obj.config.sigma_max
    z = _noise((10_000, 1))
    out = heun_edm(edm_network(mu, s), z, 64)
    assert abs(out.mean().item() - mu) < 0.03 and abs(out.std().item() - s) < 0.02
    # Exact ODE: x(sigma) = mu + sqrt(s^2 + sigma^2) z' from x(sigma_max) = sigma_max z. The schedule
    # always ends ..., sigma_min, 0 with a plain Euler step, so the reference is the exact state at
    # sigma_min followed by that step (= D(x, sigma_min)); the rest is Heun's O(h^2) error.
    zp = (smax * z - mu) / math.sqrt(s ** 2 + smax ** 2)
    x_min = mu + math.sqrt(s ** 2 + smin ** 2) * zp
    ref = mu + s ** 2 / (s ** 2 + smin ** 2) * (x_min - mu)
    z, ref = z[:2000], ref[:2000]
    errs = [(heun_edm(edm_network(mu, s), z, n) - ref).abs().max().item() for n in (32, 64, 128)]
    assert errs[-1] < 3e-3
    for a, b in zip(errs, errs[1:]):
        assert 3.5 < a / b < 4.7, errs


def test_point_mass_is_hit_exactly():
    mu = 0.75
    z = _noise((16, 3, 4, 4))
    for steps in (1, 3, 10):
        torch.testing.assert_close(euler_flow(flow_velocity(mu, 0.0), z, steps), torch.full_like(z, mu),
                                   rtol=0, atol=1e-12)
    for steps in (2, 5, 18):
        torch.testing.assert_close(heun_edm(edm_network(mu, 0.0), z, steps), torch.full_like(z, mu),
                                   rtol=0, atol=1e-12)
    # low-precision noise: integrated in float32, returned in the noise dtype
    out = heun_edm(edm_network(mu, 0.0), z.bfloat16(), 5)
    assert out.dtype == torch.bfloat16 and bool((out == torch.tensor(mu, dtype=torch.bfloat16)).all())


def test_samplers_are_deterministic_and_count_evaluations():
    calls = []

    def counting(fn):
        def wrapped(x, timestep, **cond):
            calls.append(timestep.clone())
            return fn(x, timestep, **cond)
        return wrapped

    z = _noise((8, 2))
    a = euler_flow(counting(flow_velocity(0.3, 0.4)), z, 7, shift=3.0)
    assert len(calls) == 7
    # the network sees 1000 * t on the shifted schedule, starting from pure noise (t=1)
    expected = (1000 * flow_schedule(7, 3.0))[:-1]
    torch.testing.assert_close(torch.stack([c[0] for c in calls]), expected)
    assert all(c.shape == (8,) for c in calls)
    torch.testing.assert_close(euler_flow(flow_velocity(0.3, 0.4), z, 7, shift=3.0), a, rtol=0, atol=0)

    calls.clear()
    b = heun_edm(counting(edm_network(0.3, 0.4)), z, 6)
    assert len(calls) == 2 * 6 - 1
    assert calls[0][0].item() == pytest.approx(math.log(80.0) / 4)
    torch.testing.assert_close(heun_edm(edm_network(0.3, 0.4), z, 6), b, rtol=0, atol=0)
    torch.testing.assert_close(sample(EDMObjective(), edm_network(0.3, 0.4), z, 6), b, rtol=0, atol=0)
    torch.testing.assert_close(sample(FlowObjective(), flow_velocity(0.3, 0.4), z, 7, shift=3.0), a, rtol=0, atol=0)


def _toy_conditional(x, timestep, labels):
    """A nonlinear label-dependent 'network' (unconditional row = label 3)."""
    return torch.tanh(x * (labels.double() + 1).view(-1, 1)) + 0.01 * timestep.view(-1, 1) * labels.view(-1, 1)


def test_guided_equals_formula_with_one_batched_call():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    t = torch.rand(5, generator=g, dtype=torch.float64) * 1000
    labels = torch.tensor([0, 1, 2, 1, 0])
    calls = []

    def net(x_, timestep, labels):
        calls.append(x_.shape[0])
        return _toy_conditional(x_, timestep, labels)

    torch.testing.assert_close(guided(net, 1.0, null_label=3)(x, t, labels=labels), _toy_conditional(x, t, labels),
                               rtol=0, atol=0)
    assert calls == [5]
    calls.clear()
    out = guided(net, 4.0, null_label=3)(x, t, labels=labels)
    assert calls == [10]  # cond and uncond in one doubled batch
    cond = _toy_conditional(x, t, labels)
    uncond = _toy_conditional(x, t, torch.full_like(labels, 3))
    torch.testing.assert_close(out, uncond + 4.0 * (cond - uncond), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="null_label"):
        guided(net, 2.0)


def test_cfg_sampling_lands_on_extrapolated_point_masses():
    """Per-class point masses: guided velocity/denoiser are those of the point mass at
    mu_u + w (mu_c - mu_u), so both samplers must land exactly there."""
    mu = torch.tensor([-1.0, 2.0, 0.5], dtype=torch.float64)  # class 2 is the null class
    labels = torch.tensor([0, 1, 0, 1])
    z = _noise((4, 6))
    w = 2.5
    expected = (mu[2] + w * (mu[labels] - mu[2]))[:, None].expand(4, 6)
    out = euler_flow(flow_velocity(mu, 0.0), z, 5, cfg_scale=w, labels=labels, null_label=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out = heun_edm(edm_network(mu, 0.0), z, 5, cfg_scale=w, labels=labels, null_label=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out = euler_flow(flow_velocity(mu, 0.0), z, 5, labels=labels)
    torch.testing.assert_close(out, mu[labels][:, None].expand(4, 6), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="needs labels"):
        euler_flow(flow_velocity(mu, 0.0), z, 5, cfg_scale=w)


def test_drop_labels_rate_and_determinism():
    labels = torch.arange(100_000) % 10
    a = drop_labels(labels, 0.1, 10, generator=torch.Generator().manual_seed(0))
    b = drop_labels(labels, 0.1, 10, generator=torch.Generator().manual_seed(0))
    c = drop_labels(labels, 0.1, 10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    dropped = a == 10
    assert abs(dropped.double().mean().item() - 0.1) < 0.003  # ~3.3 standard errors
    assert torch.equal(a[~dropped], labels[~dropped])  # kept labels are untouched
    assert torch.equal(drop_labels(labels, 0.0, 10), labels)
    assert bool((drop_labels(labels, 1.0, 10) == 10).all())
    with pytest.raises(ValueError, match="probability"):
        drop_labels(labels, 1.5, 10)


def test_heun_on_flow_is_second_order_and_euler_on_edm_first_order():
    """``sample(..., sampler=)``: Heun on the rectified-flow ODE quarters its error as steps double
    (Euler's halves, above); Euler on the EDM schedule halves it; a sampler of another objective is refused."""
    mu, s = 1.5, 0.5
    zs = _noise((2000, 3), seed=1)
    flow = FlowObjective()
    errs = [(sample(flow, flow_velocity(mu, s), zs, n, sampler="heun") - (mu + s * zs)).abs().max().item()
            for n in (16, 32, 64)]
    assert errs[-1] < 1e-3
    for a, b in zip(errs, errs[1:]):
        assert 3.5 < a / b < 4.7, errs
    edm = EDMObjective()
    smin, smax = edm.config.sigma_min, edm.config.sigma_max
    zp = (smax * zs - mu) / math.sqrt(s ** 2 + smax ** 2)
    ref = mu + s ** 2 / (s ** 2 + smin ** 2) * (mu + math.sqrt(s ** 2 + smin ** 2) * zp - mu)
    errs = [(sample(edm, edm_network(mu, s), zs, n, sampler="euler") - ref).abs().max().item() for n in (64, 128, 256)]
    for a, b in zip(errs, errs[1:]):
        assert 1.6 < a / b < 2.4, errs
    with pytest.raises(ValueError, match="does not sample the 'flow' objective"):
        sample(flow, flow_velocity(mu, s), zs, 4, sampler="ddim")
