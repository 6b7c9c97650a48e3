"""AdamW over flat buffers aligned with megatron DDP's gradient buffer, writing the bf16 model
weights in the same pass (``optim.adam_impl=flat``, ``dit_mcore/training/flat_adam.py``)."""
import pytest
import torch

from dit_mcore.training import flat_adam
from dit_mcore.training.flat_adam import FlatAdamW
from dit_mcore.training.trainer import Trainer
from test_training import _run_with_clipping_and_a_bad_step, losses, tiny_run

BETAS, EPS = (0.9, 0.999), 1e-8
# Run on a GPU (benchmarks/gpu_session.sh) the trainer tests use CUDA, whose attention backward and
# reductions need not repeat bit for bit: there runs are compared closely, not exactly.
CUDA = torch.cuda.is_available()


def _close(got, want, rtol, atol, **kw):
    torch.testing.assert_close(got, want, rtol=max(rtol, 1e-3) if CUDA else rtol,
                               atol=max(atol, 1e-3) if CUDA else atol, **kw)


def _reference_adamw(p0, grads, groups, scales, skips, dtype):
    """torch's AdamW (fused in float32, for-loop in float64) over the same steps, one tensor per group
    element set; a skipped step is not taken."""
    params = [torch.nn.Parameter(p0[idx].to(dtype).clone()) for idx, _ in groups]
    opt = torch.optim.AdamW([{"params": [p], "lr": lr, "weight_decay": wd} for p, (_, (lr, wd)) in zip(params, groups)],
                            betas=BETAS, eps=EPS, fused=dtype == torch.float32, foreach=False)
    for grad, scale, skip in zip(grads, scales, skips):
        if skip:
            continue
        for p, (idx, _) in zip(params, groups):
            p.grad = (grad[idx] / scale).to(dtype)
        opt.step()
    out = torch.empty_like(p0, dtype=dtype)
    for p, (idx, _) in zip(params, groups):
        out[idx] = p.detach()
    return out


def test_flat_kernel_steps_as_torchs_adamw_to_float64_accuracy():
    """The compiled kernel over two interleaved groups (their own lr and weight decay), a gradient
    scale and a skipped (non-finite) step: as close to float64 AdamW as torch's fused kernel is, the
    skipped step changes nothing, and the bf16 output is the updated weight rounded."""
    n = 4096
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    group = (torch.arange(n) % 3 == 0).to(torch.uint8)
    groups = [(group == 0, (1e-3, 0.1)), (group == 1, (3e-3, 0.0))]
    grads = [torch.randn(n, generator=gen) * 10 ** -k for k in range(5)]
    scales, skips = [1.0, 2.0, 4.0, 1.0, 0.5], [False, False, True, False, False]
    want = _reference_adamw(p0, grads, groups, scales, skips, torch.float64)
    fused = _reference_adamw(p0, grads, groups, scales, skips, torch.float32)

    param, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.zeros(n, dtype=torch.bfloat16)
    hyper = torch.tensor([[1e-3, 0.1], [3e-3, 0.0]])
    kernel, step = flat_adam._kernel(), 0
    for grad, scale, skip in zip(grads, scales, skips):
        before = (param.clone(), m.clone(), v.clone(), out.clone())
        with flat_adam.variants():
            kernel(param, grad, m, v, group, hyper, torch.tensor(float(step + 1)), torch.tensor(scale),
                   torch.tensor(float(skip)), out, torch.tensor(0), beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        if skip:
            assert all(torch.equal(a, b) for a, b in zip(before, (param, m, v, out)))
        else:
            step += 1
            assert torch.equal(out, param.to(torch.bfloat16))
    assert not torch.equal(param, p0)
    ours, torchs = (param.double() - want).abs().max(), (fused.double() - want).abs().max()
    assert ours <= 2 * torchs + 1e-7, (ours, torchs)


def _inners(trainer):
    return [part.optimizer for part in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]


def _run(tmp_path, impl, *, bf16=False, distopt=False, steps=2, overlap=False, bucket_size=None):
    cfg = tiny_run(tmp_path, distopt=distopt)
    cfg.trainer.bf16, cfg.optim.adam_impl, cfg.optim.weight_decay = bf16, impl, 0.1
    cfg.parallel.overlap_grad_reduce = overlap  # megatron buckets only then
    cfg.parallel.ddp_bucket_size = bucket_size
    trainer = Trainer(cfg)
    _perturb(trainer)
    history = [trainer.train_step() for _ in range(steps)]
    return trainer, history


@torch.no_grad()
def _perturb(trainer):
    """Move every weight off adaLN-Zero's start (whose zero gates leave most gradients zero), the same
    way in every run, and tell the optimizer (its fp32 main weights are copies)."""
    gen = torch.Generator().manual_seed(1)
    for p in trainer.model.parameters():
        p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
    trainer.optimizer.reload_model_params()


@pytest.mark.parametrize("bf16, distopt", [(False, False), (True, False), (True, True)])
def test_trainer_steps_flat_as_torchs_fused_adamw(tmp_path, bf16, distopt):
    """Through the trainer (fp32; bf16 with megatron's mixed-precision optimizer; bf16 with the
    distributed one): every part steps flat, its states and main weights are views of the flat
    buffers, the step wrote the model weights (the bf16 ones are the fp32 main weights rounded: the
    copy megatron would do next was done by the kernel), and the weights equal torch's fused AdamW
    followed by megatron's copy to float rounding."""
    fused, _ = _run(tmp_path / "fused", "fused", bf16=bf16, distopt=distopt)
    flat, history = _run(tmp_path / "flat", "flat", bf16=bf16, distopt=distopt)
    assert all(isinstance(inner, FlatAdamW) and inner.wrote_model_weights for inner in _inners(flat))
    for inner in _inners(flat):
        for r in inner.ranges:
            for slot in r.members:
                main, state = slot.main, inner.state[slot.main]
                assert main.data_ptr() == r.main[slot.start:].data_ptr()
                assert state["exp_avg"].data_ptr() == r.exp_avg[slot.start:].data_ptr()
                assert float(state["step"]) == 2.0
                if bf16:
                    model = slot.model.detach().reshape(-1)[slot.model_offset:slot.model_offset + main.numel()]
                    assert torch.equal(model, main.detach().reshape(-1).to(torch.bfloat16))
    for (name, a), b in zip(fused.model.named_parameters(), flat.model.parameters()):
        _close(b, a, 1e-5, 1e-6 if not bf16 else 8e-3, msg=name)
    assert all(h["grad_norm"] > 0 for h in history)


@pytest.mark.parametrize("distopt", [False, True])
def test_flat_resume_is_bit_identical_and_reads_a_fused_checkpoint(tmp_path, distopt):
    """A flat run stopped and resumed continues bit for bit (the loaded states go back into their
    slots of the flat buffers); a checkpoint of a fused run resumes flat with the fused run's Adam
    state (same step count, moments in the slots)."""
    def run(path, impl, steps=4):
        cfg = tiny_run(path, distopt=distopt, max_steps=steps)
        cfg.trainer.bf16, cfg.optim.adam_impl, cfg.optim.weight_decay = True, impl, 0.1
        return cfg

    full = losses(Trainer(run(tmp_path / "full", "flat")).fit())
    cut = Trainer(run(tmp_path / "cut", "flat"))
    first = [cut.train_step()["loss"] for _ in range(2)]
    cut.save()
    resumed = Trainer(run(tmp_path / "cut", "flat"))
    assert resumed.step == 2 and all(isinstance(i, FlatAdamW) for i in _inners(resumed))
    rest = losses(resumed.fit())
    if CUDA:
        _close(torch.tensor(first + rest), torch.tensor(full), 0, 0)
    else:
        assert first + rest == full

    fused = Trainer(run(tmp_path / "fused", "fused"))
    for _ in range(2):
        fused.train_step()
    fused.save()
    # the states are views of flat buffers; a checkpoint holds their elements, not the buffers
    def size(run):
        return sum(f.stat().st_size for f in (tmp_path / run / "checkpoints" / "step_00000002").rglob("*")
                   if f.is_file())
    assert size("cut") <= 1.02 * size("fused")
    moments = {k: v["exp_avg"].clone() for k, v in enumerate(_inners(fused)[0].state.values())}
    into_flat = Trainer(run(tmp_path / "fused", "flat"))
    inner = _inners(into_flat)[0]
    inner._rehome_states()
    assert isinstance(inner, FlatAdamW) and float(inner._steps.min()) == float(inner._steps.max()) == 2.0
    got = [inner.state[slot.main]["exp_avg"] for r in inner.ranges for slot in r.members]
    assert sorted(float(t.abs().sum()) for t in got) == pytest.approx(
        sorted(float(t.abs().sum()) for t in moments.values()), rel=1e-6)
    rest = losses(into_flat.fit())
    assert len(rest) == 2 and all(abs(a - b) < 1e-3 * abs(b) for a, b in zip(rest, full[2:]))


def test_a_skipped_step_changes_and_counts_nothing(tmp_path):
    """Clipped every step, a non-finite step 2 skipped: the same losses, weights and EMA as torch's
    fused AdamW, and every parameter's Adam step count says 4 updates, not 5."""
    host = _run_with_clipping_and_a_bad_step(tmp_path / "host")
    flat = _run_with_clipping_and_a_bad_step(tmp_path / "flat", adam_impl="flat")
    assert [h["skipped"] for h in flat[0]] == [0.0, 1.0, 0.0, 0.0, 0.0] and flat[3] == 4
    inner = _inners(flat[4])[0]
    assert isinstance(inner, FlatAdamW) and {float(s["step"]) for s in inner.state.values()} == {4.0}
    _close(torch.tensor([h["loss"] for h in flat[0]]), torch.tensor([h["loss"] for h in host[0]]), 1e-5, 1e-7)
    for got, ref in zip(flat[1] + flat[2], host[1] + host[2]):
        _close(got, ref, 1e-5, 1e-6)


def test_states_stay_in_their_slots_across_loads_and_buckets(tmp_path, monkeypatch):
    """Under the distributed optimizer with several buckets (overlapped reduction: one flat range per
    bucket): the weights
    equal torch's fused AdamW's; after a round trip through ``load_state_dict`` (torch's load assigns
    new state tensors) the next step puts every state back into its slot and steps from the loaded
    values; megatron's main-to-model copy never runs after a flat step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    copies = []
    original = DistributedOptimizer._copy_main_params_to_model_params
    monkeypatch.setattr(DistributedOptimizer, "_copy_main_params_to_model_params",
                        lambda self: (copies.append(1), original(self))[1])
    fused, _ = _run(tmp_path / "fused", "fused", bf16=True, distopt=True, overlap=True, bucket_size=4000)
    assert copies and fused.ddp_chunks[0].buffers[0].buckets[1:]  # several buckets
    copies.clear()
    flat, _ = _run(tmp_path / "flat", "flat", bf16=True, distopt=True, overlap=True, bucket_size=4000)
    inner = _inners(flat)[0]
    assert len(inner.ranges) == len(flat.ddp_chunks[0].buffers[0].buckets) > 1 and not copies
    buffer = flat.ddp_chunks[0].buffers[0]  # each range's place (rounding_bits) is where it starts in the buffer
    assert [int(r.place) for r in inner.ranges] == [
        (r.grad.data_ptr() - buffer.grad_data.data_ptr()) // 4 for r in inner.ranges] != [0] * len(inner.ranges)
    for a, b in zip(fused.model.parameters(), flat.model.parameters()):
        _close(b, a, 1e-5, 8e-3)
    import copy
    saved = copy.deepcopy(inner.state_dict())
    inner.load_state_dict(saved)
    assert any(inner.state[slot.main]["exp_avg"].data_ptr() != inner.ranges[0].exp_avg[slot.start:].data_ptr()
               for slot in inner.ranges[0].members)  # torch's load replaced them
    flat.train_step()
    assert not copies
    for r in inner.ranges:
        for slot in r.members:
            state = inner.state[slot.main]
            assert state["exp_avg"].data_ptr() == r.exp_avg[slot.start:].data_ptr()
            assert state["exp_avg_sq"].data_ptr() == r.exp_avg_sq[slot.start:].data_ptr()
    assert {float(s["step"]) for s in inner.state.values()} == {3.0}


def test_a_weight_moved_off_its_slot_falls_back_to_megatrons_copy(tmp_path):
    """A bf16 model weight that no longer lies in the flat buffer (something re-pointed it) still
    receives its update: the step notices, leaves the model weights to megatron's copy, and the
    weights still equal the rounded main weights."""
    trainer, _ = _run(tmp_path, "flat", bf16=True, steps=1)
    inner = _inners(trainer)[0]
    slot = inner.ranges[0].members[0]
    slot.model.data = slot.model.data.clone()
    trainer.train_step()
    assert not inner.wrote_model_weights
    assert torch.equal(slot.model.detach(), slot.main.detach().to(torch.bfloat16))
    assert not torch.equal(inner.ranges[0].out[slot.start:slot.end].view(slot.main.shape),
                           slot.model.detach())  # the kernel did not write where nobody reads


@pytest.mark.parametrize("distopt", [False, True])
def test_bf16_gradient_buffers_step_in_the_kernel_as_megatrons_fp32_copies_do(tmp_path, distopt):
    """``optim.main_grads_dtype=bf16``: megatron DDP's gradient buffers are bf16 (2 bytes per parameter,
    as the state count says). The flat AdamW reads them in its kernel: after a step no main weight
    holds an fp32 copy of its gradient and the kernel wrote the model weights; the gradient norm is
    read from the bf16 buffers too. It trains as torch's fused AdamW stepping megatron's fp32 copies
    of the same gradients (same losses and norms to rounding, same weights), and differently from fp32
    buffers (the micro-batches' gradients accumulate in bf16), by under 1%."""
    def run(name, grads, impl, steps=4):
        cfg = tiny_run(tmp_path / name, distopt=distopt)
        cfg.trainer.bf16, cfg.optim.adam_impl, cfg.optim.weight_decay = True, impl, 0.1
        cfg.optim.main_grads_dtype = grads
        trainer = Trainer(cfg)
        _perturb(trainer)
        return trainer, [trainer.train_step() for _ in range(steps)]

    flat, history = run("flat", "bf16", "flat")
    buffers = [b for chunk in flat.ddp_chunks for b in chunk.buffers]
    assert {b.grad_data.dtype for b in buffers} == {torch.bfloat16}
    assert flat.parallel_model.budget.gradients == pytest.approx(sum(b.grad_data.nbytes for b in buffers), rel=0.01)
    inner = _inners(flat)[0]
    assert isinstance(inner, FlatAdamW) and inner.reads_buffers() and inner.wrote_model_weights
    assert all(m.main.grad is None for r in inner.ranges for m in r.members)
    with pytest.raises(RuntimeError, match="step_if_finite, which clips there"):  # megatron's would clip nothing
        flat.optimizer.step()
    fused, fused_history = run("fused", "bf16", "fused")
    assert type(_inners(fused)[0]) is torch.optim.AdamW
    # (the two fp32 updates round differently; a bf16 weight whose fp32 main sits at a rounding boundary then
    # differs by one bf16 step, which moves the later losses by ~1e-5 relative)
    for key in ("loss", "grad_norm"):
        _close(torch.tensor([h[key] for h in history]), torch.tensor([h[key] for h in fused_history]), 2e-4, 1e-7)
    for a, b in zip(fused.model.parameters(), flat.model.parameters()):
        _close(b, a, 1e-5, 8e-3)
    _, fp32_history = run("fp32", "fp32", "flat")
    norms = [(h["grad_norm"], f["grad_norm"]) for h, f in zip(history, fp32_history)]
    assert any(a != b for a, b in norms) and all(abs(a - b) < 1e-2 * b for a, b in norms)


def test_bf16_gradient_buffers_clip_through_the_kernels_gradient_scale_as_megatron_clips(tmp_path):
    """No main weight holds a gradient to scale when the flat step reads bf16 buffers, so the clip goes
    through the kernel's gradient scale: every step clipped (clip 1e-3), the non-finite step skipped,
    the same losses, norms and weights as megatron's clip of torch's fused AdamW on the same buffers."""
    flat = _run_with_clipping_and_a_bad_step(tmp_path / "flat", adam_impl="flat", grads="bf16")
    fused = _run_with_clipping_and_a_bad_step(tmp_path / "fused", adam_impl="fused", grads="bf16")
    assert isinstance(_inners(flat[4])[0], FlatAdamW) and getattr(_inners(flat[4])[0], "grad_scale", None) is None
    for run in (flat, fused):
        assert [h["skipped"] for h in run[0]] == [0.0, 1.0, 0.0, 0.0, 0.0] and run[3] == 4
        assert all(h["grad_norm"] > 1e-2 for h in run[0] if not h["skipped"])  # clipping was active
    for key in ("loss", "grad_norm"):
        _close(torch.tensor([h[key] for h in flat[0] if not h["skipped"]]),
               torch.tensor([h[key] for h in fused[0] if not h["skipped"]]), 1e-5, 1e-7)
    for got, ref in zip(flat[1] + flat[2], fused[1] + fused[2]):
        _close(got, ref, 1e-5, 8e-3)


def test_parts_it_does_not_fit_keep_torchs_fused_adamw(tmp_path, caplog):
    """FSDP has no megatron gradient buffer: the part keeps torch's fused AdamW, and says why."""
    cfg = tiny_run(tmp_path)
    cfg.optim.adam_impl, cfg.parallel.fsdp = "flat", "torch"
    with caplog.at_level("INFO", logger="dit_mcore.training.flat_adam"):
        trainer = Trainer(cfg)
    assert all(type(inner) is torch.optim.AdamW and all(g["fused"] for g in inner.param_groups)
               for inner in _inners(trainer))
    assert "FSDP" in caplog.text
    trainer.train_step()


def test_auto_steps_flat_on_a_gpu_and_fused_elsewhere(tmp_path):
    """The default, optim.adam_impl=auto: the flat step where the weights are on a GPU (measured
    faster on an H100), torch's fused AdamW on the CPU (where the generated kernel is slower)."""
    from types import SimpleNamespace
    from dit_mcore.training.optim import resolve_adam_impl
    gpu, cpu = (SimpleNamespace(parameters=lambda on=on: [SimpleNamespace(is_cuda=on)]) for on in (True, False))
    assert resolve_adam_impl("auto", [cpu, gpu]) == "flat" and resolve_adam_impl("auto", [cpu]) == "fused"
    assert resolve_adam_impl("foreach", [gpu]) == "foreach"
    # where the state is one only the flat step keeps (bf16 moments) or keeps without copies (bf16 gradients)
    assert resolve_adam_impl("auto", [cpu], True) == "flat"
    trainer = Trainer(tiny_run(tmp_path))
    assert trainer.cfg.optim.adam_impl == "auto"
    assert all(type(inner) is torch.optim.AdamW and all(g["fused"] for g in inner.param_groups)
               for inner in _inners(trainer))


@pytest.mark.skipif(torch.cuda.is_available(), reason="pretends to be an H100 on a machine without one")
def test_on_an_h100_the_flat_step_is_one_triton_kernel():
    """What Inductor schedules for the step on an H100 (counted on the CPU): one Triton kernel moving
    33 bytes per parameter (gradient, weight and moments read; weight, moments and the bf16 copy
    written; the group byte) — the two passes it replaces move 34 (torch's fused AdamW, then a
    casting copy per tensor); 25 with both moments in bf16, 31 with bf16 gradients; split main weights
    (``optim.split_main_params``) 4 fewer by its count (the bf16 and int16 halves read and written where
    the fp32 weight was, and the bf16 copy counted read too): 29, and 19 with bf16 moments and gradients."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from optimizer_step import flat_step_traffic
    kernels = flat_step_traffic(1 << 16)
    assert len(kernels) == 1 and kernels[0][0], kernels
    assert kernels[0][1] == pytest.approx(33, abs=0.01)
    # both moments in bf16: still one kernel (the rounding's bits are arithmetic in it), 8 bytes fewer
    kernels = flat_step_traffic(1 << 16, moments=torch.bfloat16)
    assert len(kernels) == 1 and kernels[0][0], kernels
    assert kernels[0][1] == pytest.approx(25, abs=0.01)
    # bf16 gradient buffers (optim.main_grads_dtype): read in the same kernel, 2 bytes fewer
    kernels = flat_step_traffic(1 << 16, grads=torch.bfloat16)
    assert len(kernels) == 1 and kernels[0][0], kernels
    assert kernels[0][1] == pytest.approx(31, abs=0.01)
    for kw, per_param in ((dict(), 29), (dict(moments=torch.bfloat16, grads=torch.bfloat16), 19)):
        kernels = flat_step_traffic(1 << 16, split=True, **kw)
        assert len(kernels) == 1 and kernels[0][0], kernels
        assert kernels[0][1] == pytest.approx(per_param, abs=0.01)


def test_a_range_holding_another_parts_weights_is_refused(tmp_path):
    """The kernel writes its whole range; a part whose weights have another part's between them in a
    gradient buffer (here: one weight taken out of the part) would overwrite those: refused."""
    trainer, _ = _run(tmp_path, "fused", steps=1)
    part = trainer.optimizer.chained_optimizers[0]
    assert flat_adam._unfit(part, trainer.ddp_chunks) is None
    group = part.optimizer.param_groups[0]
    group["params"] = group["params"][:3] + group["params"][4:]
    assert "another optimizer part's weights" in flat_adam._unfit(part, trainer.ddp_chunks)


# ---- moments kept in bf16 (optim.exp_avg_dtype / exp_avg_sq_dtype)


def test_bf16_moments_round_stochastically_so_the_second_moment_still_decays():
    """A second moment that starts 100x the squared gradient must decay towards it by beta2 per step.
    In bf16 rounded to nearest, 0.1% less rounds back to the old value and it would stay at 100 for
    ever; stochastically rounded it follows float64 on average, and so does the first moment. The
    weights: with the first moment in bf16 as with fp32 moments (to 1e-4); with both, the same on
    average, each weight's path within a few percent."""
    n, steps = 1 << 15, 1500
    place = torch.tensor(flat_adam.place(12345, 1))
    gen = torch.Generator().manual_seed(0)
    grads = [1 + torch.randn(n, generator=gen) for _ in range(8)]  # noisy, mean 1
    group, hyper = torch.zeros(n, dtype=torch.uint8), torch.tensor([[1e-3, 0.0]])
    kernel = flat_adam._kernel()
    runs = {}
    for dtypes in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        param, m, v = torch.zeros(n), torch.zeros(n, dtype=dtypes[0]), torch.full((n,), 100.0, dtype=dtypes[1])
        with flat_adam.variants():
            for step in range(1, steps + 1):
                kernel(param, grads[step % 8], m, v, group, hyper, torch.tensor(float(step)), None, None, None, place,
                       beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        runs[dtypes[0], dtypes[1]] = param, m, v
    fp32, m_bf16, both = (runs[k] for k in runs)
    assert both[1].dtype == both[2].dtype == torch.bfloat16
    for got in (both, m_bf16):  # elementwise means over the 8 gradients: E[g] = 1 and E[g^2] = 2
        assert float(got[2].double().mean()) == pytest.approx(float(fp32[2].double().mean()), rel=2e-3)
        assert float(got[1].double().mean()) == pytest.approx(float(fp32[1].double().mean()), rel=2e-3)
    assert float(fp32[2].double().mean()) == pytest.approx(2 + 98 * BETAS[1] ** steps, rel=0.02)  # float64's 23.6
    _close(m_bf16[0], fp32[0], 3e-3, 5e-5)  # weights of about 0.15
    before = [t.clone() for t in both]  # a skipped step leaves bf16 moments as they were, bit for bit
    with flat_adam.variants():
        kernel(both[0], grads[0], both[1], both[2], group, hyper, torch.tensor(float(steps + 1)), torch.tensor(1.0),
               torch.tensor(1.0), None, place, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    assert all(torch.equal(a, b) for a, b in zip(before, both))
    rel = ((both[0] - fp32[0]) / fp32[0]).abs()
    # the price of the second moment in bf16: rounding noise that lasts its ~1/(1 - beta2) steps of
    # memory, a few percent on each weight's step size (the first moment's lasts ~10 steps)
    assert float(rel.median()) < 0.03 and float(both[0].mean()) == pytest.approx(float(fp32[0].mean()), rel=5e-3)


def test_the_rounding_is_unbiased_and_a_function_of_place_and_step():
    """The stored bf16 is the fp32 value on average; the random bits depend on nothing but an
    element's place (its position in which gradient buffer) and the step, so a shard of a buffer
    rounds as the whole buffer does at the same places."""
    x = torch.full((1 << 16,), 1.0 + 2 ** -10)  # a quarter of a bf16 step above 1
    bits = flat_adam.rounding_bits(x.numel(), torch.tensor(flat_adam.place(0, 0)), torch.tensor(7.0))
    stored = flat_adam._stored(x, torch.bfloat16, bits & 0xFFFF)
    assert set(stored.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert float(stored.double().mean()) == pytest.approx(1.0 + 2 ** -10, abs=2e-5)
    assert float(flat_adam._stored(-x, torch.bfloat16, bits >> 16).double().mean()) == pytest.approx(
        -(1.0 + 2 ** -10), abs=2e-5)
    inf = torch.tensor([float("inf"), -float("inf"), float("nan")])
    got = flat_adam._stored(inf, torch.bfloat16, torch.full((3,), 0xFFFF))
    assert got[0] == float("inf") and got[1] == -float("inf") and got[2].isnan()

    whole = flat_adam.rounding_bits(1000, torch.tensor(flat_adam.place(5000, 2)), torch.tensor(3.0))
    piece = flat_adam.rounding_bits(400, torch.tensor(flat_adam.place(5600, 2)), torch.tensor(3.0))
    assert torch.equal(whole[600:], piece)
    for other in (flat_adam.rounding_bits(1000, torch.tensor(flat_adam.place(5000, 2)), torch.tensor(4.0)),
                  flat_adam.rounding_bits(1000, torch.tensor(flat_adam.place(5000, 3)), torch.tensor(3.0))):
        assert (other == whole).float().mean() < 0.01
    assert int(whole.min()) >= 0 and int(whole.max()) < 2 ** 32


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_the_generated_rounding_equals_torchs_eager_bit_for_bit(device):
    """The rounding as Inductor generates it (C++ on the CPU, Triton on a GPU: the int64 hash and the
    fp32/int32 reinterpretation) against eager torch on the CPU: the same bits and the same bf16."""
    def rounded(x, first, step):
        bits = flat_adam.rounding_bits(x.numel(), first, step)
        return bits, flat_adam._stored(x, torch.bfloat16, bits & 0xFFFF), flat_adam._stored(-x, torch.bfloat16, bits >> 16)

    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[:3] = torch.tensor([float("inf"), float("nan"), 3.0e38])
    first, step = torch.tensor(flat_adam.place(2 ** 31 + 17, 3)), torch.tensor(123456.0)
    want = rounded(x, first, step)
    got = torch.compile(rounded, fullgraph=True, dynamic=True)(x.to(device), first.to(device), step.to(device))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("distopt", [False, True])
def test_bf16_moments_train_resume_exactly_and_checkpoint_in_fp32(tmp_path, distopt):
    """Through the trainer, bf16 model, both moments in bf16 (picked by auto on the CPU too): the
    states are bf16 views of the flat buffers, 4 bytes per parameter as the state count says, and
    the losses follow the fp32 moments' run closely. Stopped and resumed it continues bit for bit;
    its checkpoint resumes with fp32 moments, and an fp32-moment checkpoint resumes in bf16."""
    def run(path, moments="bf16", steps=4):
        cfg = tiny_run(path, distopt=distopt, max_steps=steps)
        cfg.trainer.bf16, cfg.optim.weight_decay = True, 0.1
        cfg.optim.exp_avg_dtype = cfg.optim.exp_avg_sq_dtype = moments
        return cfg

    full = Trainer(run(tmp_path / "full"))
    inner = _inners(full)[0]
    assert isinstance(inner, FlatAdamW)
    for r in inner.ranges:
        assert r.exp_avg.dtype == r.exp_avg_sq.dtype == torch.bfloat16
        for slot in r.members:
            assert inner.state[slot.main]["exp_avg_sq"].data_ptr() == r.exp_avg_sq[slot.start:].data_ptr()
    held = sum(r.exp_avg.nbytes + r.exp_avg_sq.nbytes + r.group.nbytes for i in _inners(full) for r in i.ranges)
    assert full.parallel_model.budget.adam == pytest.approx(held, rel=0.01)  # the distributed optimizer's padding
    full_losses = losses(full.fit())
    fp32 = losses(Trainer(run(tmp_path / "fp32", "fp32")).fit())
    assert full_losses != fp32 and all(abs(a - b) < 2e-2 * abs(b) for a, b in zip(full_losses, fp32))

    cut = Trainer(run(tmp_path / "cut"))
    first = [cut.train_step()["loss"] for _ in range(2)]
    cut.save()
    resumed = Trainer(run(tmp_path / "cut"))
    assert resumed.step == 2
    _close(torch.tensor(first + losses(resumed.fit())), torch.tensor(full_losses), 0, 0)

    for saved, loaded in (("bf16", "fp32"), ("fp32", "bf16")):
        path = tmp_path / f"{saved}_to_{loaded}"
        writer = Trainer(run(path, saved))
        for _ in range(2):
            writer.train_step()
        writer.save()
        want = {k: [s[k].float() for s in _inners(writer)[0].state.values()] for k in ("exp_avg", "exp_avg_sq")}
        reader = Trainer(run(path, loaded))
        reader_inner = _inners(reader)[0]  # fp32 moments: torch's fused AdamW on the CPU (auto)
        if isinstance(reader_inner, FlatAdamW):
            reader_inner._rehome_states()
        for key, tensors in want.items():
            got = [s[key] for s in reader_inner.state.values()]
            assert {t.dtype for t in got} == {torch.float32 if loaded == "fp32" else torch.bfloat16}
            assert sorted(float(t.float().abs().sum()) for t in got) == pytest.approx(
                sorted(float(t.abs().sum()) for t in tensors), rel=1e-2 if loaded == "bf16" else 1e-6)
        rest = losses(reader.fit())
        assert len(rest) == 2 and all(abs(a - b) < 2e-2 * abs(b) for a, b in zip(rest, fp32[2:]))


@pytest.mark.parametrize("grads", ["fp32", "bf16"])
def test_bf16_moments_step_each_parameter_where_the_layout_no_longer_holds(tmp_path, grads):
    """A main weight moved off its slot (something re-pointed it): torch's fused AdamW cannot step bf16
    moments (nor read bf16 gradients), so the kernel steps each parameter over its own views, at the
    same places: the weights and moments equal an untouched run's bit for bit, and megatron copies the
    weights."""
    runs = []
    for moved in (False, True):
        cfg = tiny_run(tmp_path / str(moved))
        cfg.trainer.bf16, cfg.optim.weight_decay, cfg.optim.main_grads_dtype = True, 0.1, grads
        cfg.optim.exp_avg_dtype = cfg.optim.exp_avg_sq_dtype = "bf16"
        trainer = Trainer(cfg)
        _perturb(trainer)
        trainer.train_step()
        inner = _inners(trainer)[0]
        if moved:
            slot = inner.ranges[0].members[0]
            slot.main.data = slot.main.data.clone()
        trainer.train_step()
        assert inner.wrote_model_weights is not moved
        runs.append((trainer, inner))
    (a, inner_a), (b, inner_b) = runs
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    for r, s in zip(inner_a.ranges, inner_b.ranges):
        assert torch.equal(r.exp_avg, s.exp_avg) and torch.equal(r.exp_avg_sq, s.exp_avg_sq)
