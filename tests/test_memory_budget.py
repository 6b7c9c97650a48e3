"""The per-parameter state a rank holds (dit_mcore.training.memory): the arithmetic per layout, the
count against the tensors megatron and the trainer really allocate, and a run whose state cannot fit
the device refused before any compute."""
import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.training import memory
from dit_mcore.training.memory import state_budget
from dit_mcore.training.torch_optimizer import torch_adams
from dit_mcore.training.trainer import Trainer
from test_training import tiny_run

B = 3.31e9  # MovieGen-3B's parameters (tests/test_llama.py)


@pytest.mark.parametrize("layout, bytes_per_param", [
    (dict(bf16=True), 22),                                  # 2 + 4 + 4 + 8 + 4: the H100's 67.8 GiB
    (dict(bf16=True, ema_offload=True), 18),
    (dict(bf16=False), 20),                                 # fp32: the optimizer steps the weights themselves
    (dict(bf16=True, distributed_optimizer=True, shards=8), 2 + 4 + 12 / 8 + 4),
    (dict(bf16=True, distributed_optimizer=True, ema_sharded=True, shards=8), 2 + 4 + 16 / 8),
    (dict(bf16=True, fsdp=True, shards=8), 22 / 8),
    (dict(bf16=True, moment_bytes=4), 18),                  # optim.exp_avg(_sq)_dtype=bf16
    (dict(bf16=True, moment_bytes=6), 20),                  # one of them
    (dict(bf16=True, ema_offload=True, moment_bytes=4), 14),
    (dict(bf16=True, distributed_optimizer=True, moment_bytes=4, shards=8), 2 + 4 + 8 / 8 + 4),
    (dict(bf16=True, grad_bytes=2), 24),                    # optim.main_grads_dtype=bf16: + megatron's fp32 copies
    (dict(bf16=True, distributed_optimizer=True, grad_bytes=2, shards=8), 2 + 2 + 16 / 8 + 4),
    (dict(bf16=True, main_bytes=2), 20),                    # optim.split_main_params
    (dict(bf16=True, distributed_optimizer=True, main_bytes=2, shards=8), 2 + 4 + 10 / 8 + 4),
])
def test_bytes_per_parameter_by_layout(layout, bytes_per_param):
    shards = layout.pop("shards", 1)
    kw = dict(bf16=False, distributed_optimizer=False, fsdp=False, ema_offload=False) | layout
    budget = state_budget([(int(B), shards)], **kw)
    assert budget.total == pytest.approx(B * bytes_per_param)
    if kw == dict(bf16=True, distributed_optimizer=False, fsdp=False, ema_offload=False):
        assert budget.describe().startswith("67.8 GiB (weights 6.2 GiB, gradients 12.3 GiB")
    flat = state_budget([(int(B), shards)], **kw, flat_adam=True)  # the flat AdamW's group byte, no gradient copies
    state_shards = shards if kw["distributed_optimizer"] or kw["fsdp"] else 1
    copies = 4 * B / state_shards if kw.get("grad_bytes") == 2 else 0
    assert flat.total - budget.total == pytest.approx(B / state_shards - copies)
    # what bf16 moments would save, offered where they are fp32 and the flat step can keep them (not FSDP)
    saved = (kw.get("moment_bytes", 8) - 4) * B / state_shards
    assert budget.bf16_moments_save == (0 if kw["fsdp"] else pytest.approx(saved))
    assert state_budget([(int(B), shards)], **kw, lowerable_moments=False).bf16_moments_save == 0  # TE's/apex's Adam
    # what bf16 gradient buffers would save: megatron DDP's (not FSDP's) in bf16 runs, where they are fp32
    # and the flat AdamW reads them (any other step has megatron copy them into fp32: nothing saved)
    grads_saved = (kw.get("grad_bytes", 4) - 2) * B if kw["bf16"] and not kw["fsdp"] else 0
    assert flat.bf16_grads_save == pytest.approx(grads_saved) and budget.bf16_grads_save == 0
    # what split main weights would save: where the step is flat, in bf16 runs, not under FSDP
    mains_saved = (kw.get("main_bytes", 4) - 2) * B / state_shards if kw["bf16"] and not kw["fsdp"] else 0
    assert flat.split_mains_save == pytest.approx(mains_saved) and budget.split_mains_save == 0


@pytest.mark.parametrize("bf16, impl", [(False, "fused"), (True, "fused"), (True, "flat"), (True, "flat_bf16"),
                                       (True, "flat_bf16grads"), (True, "fused_bf16grads"), (True, "flat_split")])
def test_the_count_is_what_the_trainer_allocates(tmp_path, bf16, impl):
    """After a step (Adam's moments exist): the model's weights, megatron DDP's gradient buffers, the
    optimizer's fp32 main weights and moments (the flat AdamW's ranges: moments and a group byte per
    element) and the EMA shadow weigh what the budget says."""
    cfg = tiny_run(tmp_path)
    cfg.trainer.bf16, cfg.optim.adam_impl = bf16, impl.split("_")[0]
    if impl == "flat_bf16":  # both Adam moments in bf16
        cfg.optim.exp_avg_dtype = cfg.optim.exp_avg_sq_dtype = "bf16"
    if impl.endswith("bf16grads"):  # bf16 gradient buffers (fused: with megatron's fp32 copies of them)
        cfg.optim.main_grads_dtype = "bf16"
    cfg.optim.split_main_params = impl == "flat_split"  # main weights: the model's plus int16 remainders
    trainer = Trainer(cfg)
    trainer.train_step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    adams = torch_adams(trainer.optimizer)
    if impl.startswith("flat"):
        ranges = [r for inner in adams for r in inner.ranges]
        main = nbytes(r.rem if r.main is None else r.main for r in ranges)
        adam = nbytes(t for r in ranges for t in (r.exp_avg, r.exp_avg_sq, r.group))
    else:
        main = nbytes(p for inner in adams for g in inner.param_groups for p in g["params"])
        adam = nbytes(s[k] for inner in adams for s in inner.state.values() for k in ("exp_avg", "exp_avg_sq"))
    real = dict(weights=nbytes(p for chunk in trainer.model for p in chunk.parameters()),
                gradients=nbytes(b.grad_data for chunk in trainer.ddp_chunks for b in chunk.buffers)
                + nbytes(p.grad for inner in adams for g in inner.param_groups for p in g["params"]  # fp32 copies
                         if p.grad is not None and p.grad.dtype != b_dtype(trainer)),
                main_weights=main if bf16 else 0, adam=adam, ema=nbytes(trainer.ema.module.parameters()))
    budget = trainer.parallel_model.budget
    for kind, value in real.items():
        if kind == "gradients":  # megatron pads each bucket
            assert value >= budget.gradients and value == pytest.approx(budget.gradients, rel=0.05), kind
        else:
            assert value == getattr(budget, kind), kind


def b_dtype(trainer):
    """The gradient buffers' dtype (a main weight's gradient of another dtype is a copy)."""
    return trainer.ddp_chunks[0].buffers[0].grad_data.dtype


def test_the_sharded_ema_count_is_what_the_trainer_allocates(tmp_path, monkeypatch):
    """``trainer.ema_shard=True`` (one rank, distributed optimizer): the EMA is the fp32 shards of
    megatron's bucket shards (padded per bucket) and the shadow module allocates nothing, built so."""
    from dit_mcore.training import ema_shards
    built, release = [], ema_shards.release
    monkeypatch.setattr(ema_shards, "release", lambda m: (built.append([p.is_meta for p in m.parameters()]),
                                                          release(m)))
    cfg = tiny_run(tmp_path)
    cfg.trainer.bf16, cfg.optim.use_distributed_optimizer, cfg.trainer.ema_shard = True, True, True
    trainer = Trainer(cfg)
    assert built and all(built[0])  # (the shadow as built, before the first release)
    trainer.train_step()
    held = sum(s.numel() * s.element_size() for s in trainer.ema.shards.shards)
    assert held >= trainer.parallel_model.budget.ema and held == pytest.approx(trainer.parallel_model.budget.ema, rel=0.05)
    assert all(p.is_meta for p in trainer.ema._module.parameters())


def test_a_state_that_cannot_fit_is_refused_before_compute(tmp_path, monkeypatch):
    """The device is 'smaller' than the tiny model's state: the trainer stops once the model is built
    (before the EMA, the optimizer, the data and any compile), naming the settings that shrink the
    state; offloaded, the EMA is no longer offered, nor bf16 moments once taken; a device with room
    trains."""
    monkeypatch.setattr(memory, "device_memory", lambda device: 1024)
    with pytest.raises(ConfigError, match=r"needs .* KiB \(weights .* but the device has 1.0 KiB, before any "
                                          r"activation; set trainer.ema_offload=True \(-"):
        Trainer(tiny_run(tmp_path))
    cfg = tiny_run(tmp_path)
    cfg.trainer.ema_offload = True
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "ema_offload" not in str(err.value) and "optim.use_distributed_optimizer=True" in str(err.value)
    assert "optim.exp_avg_dtype=bf16 and optim.exp_avg_sq_dtype=bf16 (-" in str(err.value)
    cfg.optim.exp_avg_dtype = cfg.optim.exp_avg_sq_dtype = "bf16"  # taken: no longer offered
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "exp_avg" not in str(err.value)
    cfg.trainer.bf16 = True  # bf16 gradient buffers offered to a bf16 run, and no longer once taken
    with pytest.raises(ConfigError, match=r"optim.main_grads_dtype=bf16 \(-"):
        Trainer(cfg)
    cfg.optim.main_grads_dtype = "bf16"
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "main_grads_dtype" not in str(err.value)
    assert "optim.split_main_params=True (-" in str(err.value)  # offered to the flat step (auto picks it)
    cfg.optim.split_main_params = True
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "split_main_params" not in str(err.value)
    monkeypatch.setattr(memory, "device_memory", lambda device: 2 ** 30)
    Trainer(tiny_run(tmp_path)).train_step()


def test_the_count_under_fsdp2_is_what_the_trainer_allocates(tmp_path):
    """FSDP2 (one rank: what it keeps, not how it divides), bf16: bf16 weight shards, fp32 main weights
    and moments in the optimizer, an fp32 EMA shard."""
    from dit_mcore.parallel.fsdp import sharded_parameters
    cfg = tiny_run(tmp_path)
    cfg.trainer.bf16, cfg.parallel.fsdp = True, "torch"
    trainer = Trainer(cfg)
    trainer.train_step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    local = lambda ts: (t.to_local() if hasattr(t, "to_local") else t for t in ts)  # noqa: E731
    adams = torch_adams(trainer.optimizer)
    budget = trainer.parallel_model.budget
    assert nbytes(local(p for chunk in trainer.model for p in sharded_parameters(chunk))) == budget.weights
    assert nbytes(local(p for inner in adams for g in inner.param_groups for p in g["params"])) == budget.main_weights
    assert nbytes(local(s[k] for inner in adams for s in inner.state.values() for k in ("exp_avg", "exp_avg_sq"))) \
        == budget.adam
    assert nbytes(local(sharded_parameters(trainer.ema.module))) == budget.ema
