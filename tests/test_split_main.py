"""fp32 main weights kept as the bf16 model weights plus an int16 remainder (``optim.split_main_params``,
``dit_mcore/training/split_main.py``): exact, half the memory, checkpoints in fp32 as any run's."""
import pytest
import torch

from dit_mcore.training import flat_adam, split_main
from dit_mcore.training.flat_adam import FlatAdamW
from dit_mcore.training.split_main import join, split
from dit_mcore.training.trainer import Trainer
from test_config_validation import run_problems
from test_training import losses, tiny_run

BETAS, EPS = (0.9, 0.999), 1e-8


def _values() -> torch.Tensor:
    """fp32 values of every kind: normal of many magnitudes, both signs, zeros, subnormals, the
    largest finite, infinities, and ties (lower half exactly 0x8000) on both sides of an even upper half."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(1 << 16, generator=gen) * torch.logspace(-30, 30, 1 << 16)
    ties = (torch.randint(0, 1 << 15, (64,), generator=gen, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf")])
    return torch.cat([normal, ties, -ties, special])


CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("compiled", [False, True])
def test_split_and_join_are_exact_and_round_to_nearest(compiled, device):
    """``join(split(x))`` is ``x`` bit for bit; the upper half is ``x`` rounded to bf16 as megatron's copy
    rounds it except at exact ties, which it rounds away from zero (megatron: to even); eager and
    generated code (C++ on the CPU, Triton on a GPU) agree."""
    x = _values().to(device)
    cut = torch.compile(split, fullgraph=True) if compiled else split
    glue = torch.compile(join, fullgraph=True) if compiled else join
    upper, remainder = cut(x)
    assert upper.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(glue(upper, remainder).view(torch.int32), x.view(torch.int32))
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert int(tie.sum()) >= 128
    assert torch.equal(upper[~tie], x[~tie].to(torch.bfloat16))
    assert bool((upper[tie].float().abs() > x[tie].abs()).all())  # away from zero
    assert int(remainder[tie].min()) == -0x8000
    # the chunked forms outside the step (split_main.CHUNK at a time), into views
    split_main.CHUNK, chunk = 1000, split_main.CHUNK
    try:
        hi, lo, back = torch.empty_like(upper), torch.empty_like(remainder), torch.empty_like(x)
        split_main.split_into(x, hi, lo)
        split_main.join_into(hi, lo, back)
    finally:
        split_main.CHUNK = chunk
    assert torch.equal(hi, upper) and torch.equal(lo, remainder) and torch.equal(back.view(torch.int32),
                                                                                 x.view(torch.int32))


def _step(kernel, param, out, rem, grad, m, v, group, step, scale, skip):
    on = dict(device=grad.device)
    with flat_adam.variants():
        kernel(param, grad, m, v, group, torch.tensor([[1e-3, 0.1], [3e-3, 0.0]], **on),
               torch.tensor(float(step), **on), torch.tensor(scale, **on), torch.tensor(float(skip), **on), out,
               torch.tensor(0, **on), rem, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("moments, grads", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_the_kernel_steps_split_weights_as_fp32_ones_bit_for_bit(moments, grads, device):
    """Five steps of the compiled kernel (C++ on the CPU, Triton on a GPU; two groups, gradient scales,
    one skipped step) over split weights and over fp32 weights from the same start: the split weights
    joined are the fp32 ones bit for bit after every step, the model weights their upper halves, the
    moments equal; a skipped step changes nothing."""
    n = 4096
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen).to(device)
    group = (torch.arange(n) % 3 == 0).to(device=device, dtype=torch.uint8)
    kernel = flat_adam._kernel()
    fp32 = dict(param=p0.clone(), out=torch.zeros(n, dtype=torch.bfloat16, device=device), rem=None)
    upper, rem = split(p0)
    halves = dict(param=None, out=upper, rem=rem)
    for state in (fp32, halves):
        state.update(m=torch.zeros(n, dtype=moments, device=device), v=torch.zeros(n, dtype=moments, device=device))
    step = 0
    for k, (scale, skip) in enumerate(zip([1.0, 2.0, 4.0, 1.0, 0.5], [False, False, True, False, False])):
        grad = (torch.randn(n, generator=gen) * 10 ** -k).to(device=device, dtype=grads)
        before = halves["out"].clone(), halves["rem"].clone(), halves["m"].clone()
        step += not skip
        for s in (fp32, halves):
            _step(kernel, s["param"], s["out"], s["rem"], grad, s["m"], s["v"], group, max(step, 1), scale, skip)
        if skip:
            assert all(torch.equal(a, b) for a, b in zip(before, (halves["out"], halves["rem"], halves["m"])))
        assert torch.equal(join(halves["out"], halves["rem"]).view(torch.int32), fp32["param"].view(torch.int32))
        assert torch.equal(halves["out"], split(fp32["param"])[0])
        assert torch.equal(halves["m"], fp32["m"]) and torch.equal(halves["v"], fp32["v"])
    assert not torch.equal(fp32["param"], p0)


def _inners(trainer):
    return [part.optimizer for part in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]


def _cfg(path, *, split_mains=True, distopt=False, moe=False, steps=4):
    cfg = tiny_run(path, distopt=distopt, max_steps=steps)
    if moe:  # dense and expert parameters: megatron chains two optimizers, each split
        cfg.model.num_moe_experts, cfg.model.moe_router_topk, cfg.model.moe_aux_loss_coeff = 4, 2, 0.1
    cfg.trainer.bf16, cfg.optim.adam_impl, cfg.optim.weight_decay = True, "flat", 0.1
    cfg.optim.split_main_params = split_mains
    return cfg


def _mains(trainer) -> list:
    """Every main weight's fp32 value (split ones joined)."""
    with split_main.whole_main_weights(trainer.optimizer):
        return [m.main.detach().clone() for inner in _inners(trainer) for r in inner.ranges for m in r.members]


def _held(trainer) -> bool:
    """Whether any split main weight holds more than its one-element stand-in."""
    return any(m.main.untyped_storage().nbytes() > 4 for inner in _inners(trainer) for r in inner.ranges
               for m in r.members)


@pytest.mark.parametrize("distopt", [False, True])
def test_split_main_weights_train_as_fp32_ones_in_half_the_memory(tmp_path, distopt):
    """Through the trainer (megatron's mixed-precision optimizer; the distributed one): no fp32 main
    weight is held (each is a one-element stand-in; the remainders weigh 2 bytes per element, as the
    state count says); the model weights are the main weights' upper halves; and the run trains as
    the flat AdamW over fp32 main weights: the same losses, main weights within one rounding tie."""
    ref = Trainer(_cfg(tmp_path / "fp32", split_mains=False, distopt=distopt))  # (one trainer at a time)
    ref_budget, want = ref.parallel_model.budget, losses(ref.fit())
    ref_mains = _mains(ref)
    run = Trainer(_cfg(tmp_path / "split", distopt=distopt))
    assert all(isinstance(i, FlatAdamW) and i.splits for i in _inners(run)) and not _held(run)
    ranges = [r for inner in _inners(run) for r in inner.ranges]
    assert all(r.main is None and r.rem.dtype == torch.int16 for r in ranges)
    assert run.parallel_model.budget.main_weights == pytest.approx(sum(r.rem.nbytes for r in ranges), rel=0.01)
    assert run.parallel_model.budget.main_weights == pytest.approx(ref_budget.main_weights / 2)
    got = losses(run.fit())
    assert not _held(run)  # the final checkpoint joined them for its duration only
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    mains = _mains(run)
    for main, ref_main in zip(mains, ref_mains):
        torch.testing.assert_close(main, ref_main, rtol=1e-3, atol=1e-6)
    models = [m.model_view() for r in ranges for m in r.members]
    assert all(torch.equal(model, split(main.view(-1))[0]) for model, main in zip(models, mains))


@pytest.mark.parametrize("distopt, moe", [(False, False), (True, False), (False, True)])
def test_split_runs_resume_bit_for_bit_and_checkpoint_fp32_main_weights(tmp_path, distopt, moe):
    """Stopped and resumed, a split run continues bit for bit (an MoE's chained optimizers too). Its
    checkpoint holds fp32 main weights: a run keeping fp32 main weights loads exactly the split ones
    joined, and a split run loads an fp32 run's main weights exactly (their model weights re-rounded
    from them)."""
    full = losses(Trainer(_cfg(tmp_path / "full", distopt=distopt, moe=moe)).fit())
    cut = Trainer(_cfg(tmp_path / "cut", distopt=distopt, moe=moe))
    assert len(_inners(cut)) == (2 if moe else 1) and all(i.splits for i in _inners(cut))
    first = [cut.train_step()["loss"] for _ in range(2)]
    cut.save()
    resumed = Trainer(_cfg(tmp_path / "cut", distopt=distopt, moe=moe))
    assert resumed.step == 2 and not _held(resumed)
    assert first + losses(resumed.fit()) == full

    for writes_split in (True, False):
        path = tmp_path / f"from_split_{writes_split}"
        writer = Trainer(_cfg(path, split_mains=writes_split, distopt=distopt, moe=moe))
        for _ in range(2):
            writer.train_step()
        writer.save()
        reader = Trainer(_cfg(path, split_mains=not writes_split, distopt=distopt, moe=moe))
        assert reader.step == 2 and not _held(writer if writes_split else reader)
        for a, b in zip(_mains(writer), _mains(reader)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_megatrons_model_to_main_copy_sets_the_remainders_to_zero(tmp_path):
    """``reload_model_params`` (the model weights changed outside the optimizer): each main weight
    becomes its model weight exactly."""
    trainer = Trainer(_cfg(tmp_path))
    trainer.train_step()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.25)
    trainer.optimizer.reload_model_params()
    models = [m.model_view().float() for inner in _inners(trainer) for r in inner.ranges for m in r.members]
    assert all(torch.equal(main.view(-1), model) for main, model in zip(_mains(trainer), models))
    assert all(not bool(r.rem.any()) for inner in _inners(trainer) for r in inner.ranges)


@pytest.mark.parametrize("change, expected", [
    (dict(bf16=False), "optim.split_main_params=True needs trainer.bf16=True"),
    (dict(adam_impl="fused"), "needs the flat AdamW, not optim.adam_impl='fused'"),
    (dict(fsdp="torch"), "is not for parallel.fsdp='torch'"),
])
def test_split_main_weights_are_refused_where_the_flat_step_cannot_keep_them(tmp_path, change, expected):
    cfg = _cfg(tmp_path)
    cfg.trainer.bf16 = change.get("bf16", True)
    cfg.optim.adam_impl = change.get("adam_impl", "flat")
    cfg.parallel.fsdp = change.get("fsdp", "none")
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and expected in problems[0] and "optim.split_main_params=False" in problems[0], problems


def test_an_async_save_writes_the_main_weights_of_its_step(tmp_path):
    """``trainer.async_save``: the fp32 main weights joined for the save are what the asynchronous writer
    writes, though they are split and freed, and the run steps on, before the write finishes; a run
    keeping fp32 main weights loads them bit for bit."""
    cfg = _cfg(tmp_path, steps=6)
    cfg.trainer.async_save = True
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    saved = _mains(trainer)
    trainer.save()
    assert not _held(trainer)
    for _ in range(2):
        trainer.train_step()
    assert not all(torch.equal(a, b) for a, b in zip(saved, _mains(trainer)))  # it moved on
    trainer.finish_saves()
    reader = Trainer(_cfg(tmp_path, split_mains=False, steps=6))
    assert reader.step == 2
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(saved, _mains(reader)))


def test_a_model_weight_moved_off_its_slot_steps_each_parameter_bit_for_bit(tmp_path):
    """A model weight that no longer lies in the flat buffer (something re-pointed it): the step runs the
    kernel per parameter over the model weights and remainders where they are, and the run stays bit for
    bit the untouched one's."""
    runs = []
    for moved in (False, True):
        trainer = Trainer(_cfg(tmp_path / str(moved)))
        trainer.train_step()
        inner = _inners(trainer)[0]
        if moved:
            slot = inner.ranges[0].members[0]
            slot.model.data = slot.model.data.clone()
        runs.append([trainer.train_step()["loss"] for _ in range(2)] + [_mains(trainer)])
        assert inner.wrote_model_weights  # (no megatron copy from the stand-ins)
    (*a, mains_a), (*b, mains_b) = runs
    assert a == b
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(mains_a, mains_b))


def test_an_fp32_checkpoint_loads_with_its_model_weights_rounded_ties_away_from_zero(tmp_path):
    """A main weight of an fp32 run's checkpoint at an exact tie that rounds to even downwards (its model
    weight below it): the split run loads the main weight exactly and rounds its model weight away from
    zero, one bf16 unit above the checkpoint's."""
    writer = Trainer(_cfg(tmp_path, split_mains=False))
    writer.train_step()
    slot = _inners(writer)[0].ranges[0].members[0]
    tie = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)  # 1.00390625: halfway, even below
    with torch.no_grad():
        slot.main.view(-1)[0] = tie
        slot.model_view()[0] = tie.to(torch.bfloat16)  # (megatron's copy: to even, i.e. down to 1.0)
    assert float(slot.model_view()[0]) == 1.0
    writer.save()
    reader = Trainer(_cfg(tmp_path))
    main = _mains(reader)[0].view(-1)[0]
    assert main.view(torch.int32) == tie.view(torch.int32)
    model = _inners(reader)[0].ranges[0].members[0].model_view()[0]
    assert float(model) == 1.0078125  # one bf16 unit above: away from zero
