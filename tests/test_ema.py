"""EMA.update (one foreach lerp) equals the per-parameter formula exactly, with an fp32 shadow."""
import pytest
import torch

from dit_mcore.training.ema import EMA


def _net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_matches_per_parameter_lerp(dtype):
    model = _net(dtype)
    ema = EMA(model, _net(dtype, seed=1), decay=0.9)
    reference = [p.detach().float().clone() for p in model.parameters()]
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in ema.module.parameters())
    for step in range(15):  # through the warm-up (decay_at < decay) and past it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model, step)
        weight = 1.0 - min(0.9, (1.0 + step) / (10.0 + step))
        for r, p in zip(reference, model.parameters()):
            r.lerp_(p.detach().float(), weight)
        for r, e in zip(reference, ema.module.parameters()):
            assert torch.equal(r, e)


def test_update_refuses_another_model():
    ema = EMA(_net(), _net(seed=1), decay=0.9)
    with pytest.raises(ValueError, match="model has 2 parameters but the EMA shadow 4"):
        ema.update(torch.nn.Linear(5, 7), 0)
