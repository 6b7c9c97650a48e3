"""megatron-core's pure-torch optimizer fallbacks (no apex/TE), fixed on any device
(``dit_mcore/training/torch_optimizer.py``): a grad norm without host reads, and Adam state a
distributed-optimizer checkpoint can be read into."""
import torch

from dit_mcore.training import torch_optimizer
from dit_mcore.training.torch_optimizer import foreach_l2_norm, init_adam_state
from dit_mcore.training.trainer import Trainer
from test_training import _HostReads, tiny_run


def test_grad_norm_kernel_reads_nothing_to_the_host(tmp_path):
    """megatron's stand-in l2 kernel syncs the host per parameter; the foreach kernel put in its
    place returns the norm on the device and equals float64."""
    from megatron.core.optimizer import clip_grads
    trainer = Trainer(tiny_run(tmp_path))
    assert torch_optimizer.uses_torch_optimizer() and clip_grads.l2_norm_impl is foreach_l2_norm
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3, 64, 1000)]
    with _HostReads() as reads:
        norm, _ = foreach_l2_norm(2048, None, [grads], False)
    assert reads.count == 0 and norm.shape == (1,)
    expected = torch.cat([g.double() for g in grads]).norm()
    torch.testing.assert_close(norm.double()[0], expected, rtol=1e-6, atol=0)
    trainer.train_step()
    with _HostReads() as reads:
        trainer.optimizer.get_grad_norm()
    assert reads.count == 1  # megatron's own final .item() of the norm


def test_init_adam_state_lets_a_fresh_distributed_optimizer_describe_its_state(tmp_path):
    trainer = Trainer(tiny_run(tmp_path, distopt=True))
    assert not trainer.optimizer.optimizer.state
    init_adam_state(trainer.optimizer)
    state = trainer.optimizer.optimizer.state
    assert state and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state.values())
    sharded = trainer.optimizer.sharded_state_dict(trainer.model.sharded_state_dict(), is_loading=True,
                                                   metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    assert sharded



def test_foreach_copy_and_scale_match_megatrons_per_tensor_stand_ins(tmp_path):
    """The main fp32 -> model bf16 weight copy and ``dst = src * scale`` over lists (in-place
    clipping by a tensor coefficient) as megatron's per-tensor loops compute them."""
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import local_multi_tensor_scale
    Trainer(tiny_run(tmp_path))  # installs the fixes
    assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is torch_optimizer.foreach_scale
    assert optimizer._multi_tensor_copy_this_to_that is torch_optimizer.foreach_copy
    main = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (7, 500)]
    model = [torch.zeros(n, dtype=torch.bfloat16) for n in (7, 500)]
    torch_optimizer.foreach_copy(main, model)
    assert all(torch.equal(b, a.to(torch.bfloat16)) for a, b in zip(main, model))
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g) for n in (5, 300)]
    for scale in (1.0, 0.25, torch.tensor(0.3)):
        got = [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
        want = [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
        torch_optimizer.foreach_scale(2048, None, [src, got], scale)
        local_multi_tensor_scale(2048, None, [src, want], scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    inplace, want = [t.clone() for t in src], [t.clone() for t in src]
    torch_optimizer.foreach_scale(2048, None, [inplace, inplace], torch.tensor(0.5))
    local_multi_tensor_scale(2048, None, [want, want], torch.tensor(0.5))
    assert all(torch.equal(a, b) for a, b in zip(inplace, want))


def _adam_groups(trainer):
    return [g for inner in torch_optimizer.torch_adams(trainer.optimizer) for g in inner.param_groups]


def test_fused_adam_trains_as_foreach_and_stays_fused_across_a_foreach_checkpoint(tmp_path):
    """optim.adam_impl=fused (what the default, auto, picks off a GPU) steps torch's fused AdamW kernel: the same weights as the
    foreach kernel to float rounding, and a checkpoint written by a foreach run (whose groups say
    foreach) loads into a fused run that stays fused (torch's load takes the saved groups' flags)."""
    runs = {}
    for impl in ("foreach", "fused"):
        cfg = tiny_run(tmp_path / impl, distopt=True)
        cfg.optim.adam_impl = impl
        trainer = Trainer(cfg)
        assert all(g["fused"] == (impl == "fused") and g["foreach"] == (impl == "foreach")
                   for g in _adam_groups(trainer))
        for _ in range(3):
            trainer.train_step()
        runs[impl] = trainer
        if impl == "foreach":
            trainer.save()
            params = [p.detach().clone() for p in trainer.model.parameters()]
    fused = [p.detach() for p in runs["fused"].model.parameters()]
    for a, b in zip(params, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    cfg = tiny_run(tmp_path / "foreach", distopt=True)  # resume the foreach run's checkpoint, fused
    resumed = Trainer(cfg)
    assert resumed.step == 3 and all(g["fused"] and not g["foreach"] for g in _adam_groups(resumed))
    state = torch_optimizer.torch_adams(resumed.optimizer)[0].state
    assert state and all(float(s["step"]) == 3.0 for s in state.values())
    resumed.train_step()


class _StandInFusedAdam(torch.optim.AdamW):
    """TE's FusedAdam as megatron builds it (``adam_w_mode``), stepping as torch's AdamW."""

    def __init__(self, params, adam_w_mode=True, **kwargs):
        super().__init__(params, **kwargs)


def test_megatron_builds_torch_adamw_where_te_or_apex_is_installed_unless_asked_for_its_own(tmp_path, monkeypatch):
    """megatron picks TE's or apex's FusedAdam at import where installed (the NGC image), which would turn
    off the flat AdamW and the step decided on the device; ``choose_adam`` makes it build torch's AdamW
    (its flags as without TE and apex) for every ``optim.adam_impl`` but "megatron". Here megatron's
    import-time pick is made TE's, with a stand-in FusedAdam."""
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer as dist
    from dit_mcore.training.flat_adam import FlatAdamW
    baseline = [h["loss"] for h in Trainer(tiny_run(tmp_path / "cpu", max_steps=3)).fit()]
    te_pick = {(optimizer, "USING_PYTORCH_OPTIMIZER"): False, (dist, "HAVE_APEX_OR_TE"): True,
               (dist, "USING_TE_OPTIMIZER"): True, (dist, "USING_APEX_OPTIMIZER"): False}
    for (module, name), value in te_pick.items():
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(optimizer, "Adam", _StandInFusedAdam)
    monkeypatch.setattr(torch_optimizer, "_MEGATRONS_PICK", te_pick)
    for impl, inner_type, torch_adam in [("flat", FlatAdamW, True), ("megatron", _StandInFusedAdam, False)]:
        cfg = tiny_run(tmp_path / impl, max_steps=3)
        cfg.optim.adam_impl = impl
        trainer = Trainer(cfg)
        assert torch_optimizer.builds_torch_adam(impl) is torch_adam
        assert torch_optimizer.uses_torch_optimizer() is torch_adam and dist.HAVE_APEX_OR_TE is not torch_adam
        assert {type(inner) for inner in _inner_optimizers(trainer.optimizer)} == {inner_type}
        losses = [h["loss"] for h in trainer.fit()]
        torch.testing.assert_close(losses, baseline, rtol=1e-5, atol=0)  # AdamW either way, to rounding
        del trainer


def _inner_optimizers(optimizer):
    return [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
