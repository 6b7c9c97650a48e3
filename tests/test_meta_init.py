"""Building on the meta device and filling part by part gives the direct build's weights, and never
holds more than one part's freshly initialised tensors at a time."""
import weakref

import pytest
import torch

import dit_mcore.parallel.fsdp as fsdp
from dit_mcore.models.seeding import materialize_parts, on_each_part
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.initialize import initialize_distributed
from dit_mcore.parallel.pipeline import ModelChunks
from dit_mcore.training.config import ModelConfig
from dit_mcore.training.trainer import Trainer
from test_parallel_layouts import layout_run


@pytest.mark.parametrize("bf16", [False, True])
def test_meta_init_trainer_equals_direct_build(tmp_path, bf16):
    runs = []
    for meta in (False, True):
        cfg = layout_run(tmp_path / str(meta), "dense")
        cfg.model.init_model_with_meta_device = meta
        cfg.trainer.bf16 = bf16
        trainer = Trainer(cfg)
        assert not any(p.is_meta for p in trainer.model.parameters())
        runs.append((trainer.model.state_dict(), trainer.ema.module.state_dict(), trainer.train_step()["loss"]))
    (model_a, ema_a, loss_a), (model_b, ema_b, loss_b) = runs
    assert model_a.keys() == model_b.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a if torch.is_tensor(model_a[k]))
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a if torch.is_tensor(ema_a[k]))
    assert loss_a == loss_b


def test_materialize_holds_one_part_at_a_time():
    initialize_distributed(ParallelConfig(), seed=0)
    config = ModelConfig(preset="tiny", num_layers=6, hidden_size=64, num_attention_heads=4,
                         backend="local").build(ParallelConfig())
    from dit_mcore.models.registry import get_family
    family = get_family("dit")

    def build(seed):
        return ModelChunks.build(lambda **stage: family.build(config, backend="local", **stage), None, seed=seed)

    parts = []
    with on_each_part(lambda key, owned: parts.append((key, owned))), torch.device("meta"):
        model = build(seed=123)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")

    fresh, peaks, copy_into = [], [], fsdp.copy_into
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda m, n, p: fresh.append(weakref.ref(p)) if p is not None else None)

    def spy(target, whole):
        live = sum(p().numel() for p in fresh if p() is not None and p().numel() > 0)
        peaks.append(live)
        copy_into(target, whole)
    try:
        materialize_parts(lambda: build(seed=123), parts, copy_into=spy)
    finally:
        hook.remove()
    largest_part = max(sum(getattr(m, n).numel() for m, n in owned) for _, owned in parts)
    total = sum(p.numel() for p in model.parameters())
    assert max(peaks) <= largest_part < total / 3
    direct = build(seed=123)
    pairs = [(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()) if torch.is_tensor(a)]
    assert len(pairs) > 40 and all(torch.equal(a, b) for a, b in pairs)
