"""Helpers for tests that build a model family outside a trainer (next to ``megatron_env``'s
one-process world): random weights, meta-device parameter counts, and the FLOPs formula held
against torch's FLOP counter."""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode


def randomize(model, std: float = 0.1):
    """Add seeded noise to every parameter, so zero-init adaLN gates and projections show in outputs."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * std)  # the same noise on any device
    return model


def count_params(family, name: str) -> tuple[int, int]:
    """``(total, per layer)`` parameters of preset ``name`` of ``family``, from one- and two-layer
    builds on the meta device (nothing allocated)."""
    counts = []
    for layers in (1, 2):
        with torch.device("meta"):
            model = family.build(family.make_config(name, num_layers=layers, use_cpu_initialization=True),
                                 backend="local", init_seed=0)
        counts.append(sum(p.numel() for p in model.parameters()))
    per_layer = counts[1] - counts[0]
    return counts[0] + (family.make_config(name).num_layers - 1) * per_layer, per_layer


def counted_flops(run) -> float:
    """FLOPs torch's counter sees for ``run().square().sum().backward()``."""
    with FlopCounterMode(display=False) as counter:
        run().square().sum().backward()
    return float(counter.get_total_flops())


def assert_flops_match(counted: float, flops) -> None:
    """``flops`` (a ``DiTFlops``) within 2% of what the counter saw. Attention runs on the float64
    math kernel, whose backward recomputes ``QK^T``: the counter sees attention at 3.5x its
    forward, the rest at 3x."""
    expected = 3 * (flops.forward - flops.attention) + 3.5 * flops.attention
    assert abs(counted - expected) <= 0.02 * counted, (counted, expected)
