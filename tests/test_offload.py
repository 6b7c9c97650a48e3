"""Optimizer offload (``optim.cpu_offload``) through megatron's own HybridDeviceOptimizer under its distributed
optimizer: the same steps as without it (bf16, CPU: the ``hybrid_optimizer`` CPU shim lets megatron split the
parameters as on a GPU, copying the offloaded share to host tensors and back each step), an exact resume, its
host state counted; bad settings refused in one line. Over DP2:
``tests/test_parallel_layouts.py::test_offloaded_optimizer_over_dp2_steps_as_one_process``."""
import pytest
import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from dit_mcore.errors import ConfigError
from dit_mcore.training.optim import HostAdamW, reload_offloaded_copies
from dit_mcore.training.trainer import Trainer
from test_parallel_layouts import _randomize, layout_run

STEPS = 3


def _run(tmp_path, name, **optim) -> Trainer:
    cfg = layout_run(tmp_path / name, "dense", distopt=True)  # (megatron's offload runs under it, over the
    cfg.trainer.save_interval, cfg.trainer.bf16 = STEPS, True  # distributed optimizer's fp32 copies of bf16 weights)
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return Trainer(cfg)


def _hybrid(trainer) -> HybridDeviceOptimizer:
    (part,) = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    assert isinstance(part.optimizer, HybridDeviceOptimizer)
    return part.optimizer


def _steps(trainer, steps=STEPS):
    _randomize(trainer)  # (then the host copies are refreshed: reload_offloaded_copies)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _steps(_run(tmp_path_factory.mktemp("plain"), "plain"))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offload_equals_no_offload(tmp_path, plain, fraction):
    trainer = _run(tmp_path, "offload", cpu_offload=True, offload_fraction=fraction)
    hybrid = _hybrid(trainer)
    offloaded = sum(p.numel() for p in hybrid.gpu_params_map_cpu_copy)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert 0 < offloaded <= total and (offloaded == total) == (fraction == 1.0)
    assert all(c.data_ptr() != p.data_ptr() for p, c in hybrid.gpu_params_map_cpu_copy.items())  # (real copies)
    # torch's AdamW on both sides (not TE's or apex's where installed), the host one told apart by its class
    assert {type(o) for o in hybrid.cpu_optimizers} == {HostAdamW}
    assert hybrid.gpu_optimizer is None or type(hybrid.gpu_optimizer) is torch.optim.AdamW
    losses, weights = _steps(trainer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain[0]), rtol=1e-6, atol=0)
    for got, want in zip(weights, plain[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_offloaded_run_resumes_exactly(tmp_path):
    """Saved after 3 steps (the host state in the checkpoint through megatron's hooks), resumed: the 4th step
    is the uninterrupted run's."""
    whole = _run(tmp_path, "whole", cpu_offload=True)
    _steps(whole, STEPS + 1)
    straight = whole.train_step()["loss"]
    first = _run(tmp_path, "resumed", cpu_offload=True)
    _steps(first, STEPS)
    first.save()
    del first
    resumed = _run(tmp_path, "resumed", cpu_offload=True)
    assert resumed.step == STEPS
    resumed.train_step()  # step 4
    torch.testing.assert_close(torch.tensor(resumed.train_step()["loss"]), torch.tensor(straight), rtol=1e-6, atol=0)


def test_the_state_count_knows_the_host_share(tmp_path):
    """The budget moves the offloaded share's moments off the device and counts its host state: fp32 main
    weights, both moments and a gradient copy, 16 bytes per offloaded element, as the host tensors hold."""
    trainer = _run(tmp_path, "count", cpu_offload=True)
    _steps(trainer, 1)
    hybrid = _hybrid(trainer)
    host = 0
    for copy in hybrid.gpu_params_map_cpu_copy.values():
        state = hybrid.state[hybrid.cpu_copys_map_gpu_param[copy]]
        host += sum(t.numel() * t.element_size() for t in (copy, state["exp_avg"], state["exp_avg_sq"],
                                                           hybrid.cpu_copy_map_grad[copy]))
    budget = trainer.parallel_model.budget
    assert budget.host == host
    assert budget.adam == 0  # (all of it on the host)
    plain = _run(tmp_path, "count_plain").parallel_model.budget
    assert plain.host == 0 and plain.adam == host / 2


@pytest.mark.parametrize("optim, message", [
    (dict(offload_fraction=0.0), "offload_fraction"),
    (dict(adam_impl="flat"), "flat AdamW"),
    (dict(use_distributed_optimizer=False), "use_distributed_optimizer"),
])
def test_bad_settings_get_one_line(tmp_path, optim, message):
    with pytest.raises(ConfigError, match=message):
        _run(tmp_path, "bad", cpu_offload=True, **optim)


def test_refreshing_copies_is_a_no_op_without_offload(tmp_path):
    reload_offloaded_copies(_run(tmp_path, "none").optimizer)  # (no HybridDeviceOptimizer: nothing to do)
