"""Trainer: exact resume, data-parallel equivalence, checkpoint contents, run-directory outputs."""
import json
import math

import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from dit_mcore.errors import ConfigError
from dit_mcore.generate.preview import Previews, preview
from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                       RunConfig, TrainerConfig)
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.training.trainer import Trainer, pretrain


def tiny_run(run_dir, *, max_steps=4, objective="flow", distopt=False, save_interval=100, sample_interval=0):
    return RunConfig(
        model=ModelConfig(preset="digits", num_layers=2, hidden_size=32, num_attention_heads=2, input_size=8,
                          patch_size=2, class_dropout_prob=0.1),
        data=DataConfig(image_size=8, global_batch_size=16, micro_batch_size=8),
        optim=OptimConfig(lr=1e-3, warmup_steps=1, decay_style="cosine", use_distributed_optimizer=distopt),
        diffusion=DiffusionConfig(objective=objective, sample_steps=2),
        trainer=TrainerConfig(max_steps=max_steps, save_interval=save_interval, ema_decay=0.9),
        log=LogConfig(dir=str(run_dir), log_interval=1, sample_interval=sample_interval, samples_per_class=2,
                      progress_bar=False),
        parallel=ParallelConfig())


def losses(history):
    return [h["loss"] for h in history]


@pytest.mark.parametrize("objective, distopt", [("flow", False), ("edm", True)])
def test_resume_is_bit_identical(tmp_path, objective, distopt):
    full = losses(pretrain(tiny_run(tmp_path / "full", max_steps=5, objective=objective, distopt=distopt)))
    interrupted = Trainer(tiny_run(tmp_path / "cut", max_steps=5, objective=objective, distopt=distopt))
    first = [interrupted.train_step()["loss"] for _ in range(2)]
    interrupted.save()
    resumed = Trainer(tiny_run(tmp_path / "cut", max_steps=5, objective=objective, distopt=distopt))
    assert resumed.step == 2
    rest = losses(resumed.fit())
    assert first + rest == full  # exact float equality: same data, noise, weights and optimizer state


def test_a_resume_with_a_longer_run_says_what_it_does_with_the_learning_rate_horizon(tmp_path, caplog):
    """trainer.max_steps raised on resume: the cosine keeps the checkpoint's horizon unless the run asks to
    re-plan it (optim.resume_schedule=config: the new horizon from the resumed step on); both are said."""
    import logging

    def lrs(run_dir, max_steps, steps, choice="checkpoint"):
        trainer = Trainer(tiny_run(run_dir, max_steps=max_steps))
        trainer.cfg.optim.resume_schedule = choice
        return trainer, [trainer.train_step()["lr"] for _ in range(steps)]
    short, _ = lrs(tmp_path / "run", 4, 2)  # warmup 1, cosine to step 4
    short.save()
    _, kept_reference = lrs(tmp_path / "short", 4, 4)
    _, replanned_reference = lrs(tmp_path / "long", 8, 4)
    for choice, reference in (("checkpoint", kept_reference), ("config", replanned_reference)):
        cfg = tiny_run(tmp_path / "run", max_steps=8)
        cfg.optim.resume_schedule = choice
        with caplog.at_level(logging.WARNING, logger="dit_mcore.train"):
            caplog.clear()
            resumed = Trainer(cfg)
        assert resumed.step == 2
        assert [resumed.train_step()["lr"] for _ in range(2)] == pytest.approx(reference[2:4])
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "resumed at step 2: the checkpoint's learning-rate schedule (lr 0.001, min_lr 0.0, warmup steps 1, " \
               "decay steps 4, decay style cosine) differs from the config's (" in said and "decay steps 8" in said
        assert ("kept the checkpoint's" if choice == "checkpoint" else "re-planned with the config's from step 2") in said


@pytest.mark.parametrize("sharded_overlap", [False, True])
def test_an_offloaded_fold_uses_copies_queued_right_after_its_update_and_the_next_update_waits(tmp_path, monkeypatch,
                                                                                               sharded_overlap):
    """``trainer.ema_offload``: the weights' copies for a fold are queued right after the update that
    wrote them (on a GPU, a side stream: beside the next step's forward and backward), the fold lerps
    from them, and every later
    update is queued behind a fence. On the CPU the order of the calls is what is checked. Sharded
    (``trainer.ema_shard``) under ``overlap_param_gather`` too: the fold reads this rank's own slices,
    which the next forward's parameter gather does not change."""
    import dit_mcore.training.trainer as trainer_module
    cfg = tiny_run(tmp_path, max_steps=6, distopt=sharded_overlap)
    cfg.trainer.ema_offload, cfg.trainer.ema_every = True, 2
    if sharded_overlap:
        cfg.trainer.bf16, cfg.trainer.ema_shard = True, True
        cfg.parallel.overlap_grad_reduce = cfg.parallel.overlap_param_gather = True
    trainer = Trainer(cfg)
    assert trainer.ema_sharded == sharded_overlap
    calls, ema, host_fold = [], trainer.ema, trainer.ema.host_fold
    stage, fold, fence = ema.stage, ema.fold, ema.fence
    monkeypatch.setattr(ema, "stage", lambda model: (calls.append(("stage", trainer.step)), stage(model)))
    monkeypatch.setattr(ema, "fold", lambda model: (calls.append(("fold", host_fold._staged)), fold(model)))
    monkeypatch.setattr(ema, "fence", lambda: (calls.append(("fence",)), fence()))
    update = trainer_module.step_if_finite
    monkeypatch.setattr(trainer_module, "step_if_finite",
                        lambda *a, **k: (calls.append(("update", trainer.step)), update(*a, **k))[1])
    trainer.train_steps(6)
    assert [c[1] for c in calls if c[0] == "update"] == [1, 2, 3, 4, 5, 6]
    assert [c[1] for c in calls if c[0] == "stage"] == [2, 4, 6]  # only where a fold follows
    folds = [i for i, c in enumerate(calls) if c[0] == "fold"]
    assert len(folds) == 3 and all(calls[i][1] for i in folds)  # after steps 2, 4, 6: each from staged copies
    for i, step in zip(folds, (2, 4, 6)):
        before = [c for c in calls[:i] if c[0] in ("update", "stage", "fence")]
        assert before[-2:] == [("update", step), ("stage", step)]  # staged right after its update ...
        later = [c for c in calls[i:] if c[0] in ("fence", "update")]  # ... and the next update waits for it
        assert not later or later[0] == ("fence",)
    trainer.ema.wait()


def test_ema_every_k_steps_resumes_exactly(tmp_path):
    """``trainer.ema_every=3`` over 5 steps folds after steps 3 and 5 (the last); a checkpoint at
    step 2 carries the two decays not yet folded, so the resumed run's EMA equals the uninterrupted
    one bit for bit (without ``ema_unfolded_decay`` in the checkpoint the fold at step 3 would weigh one step)."""
    def run(name):
        cfg = tiny_run(tmp_path / name, max_steps=5)
        cfg.trainer.ema_every = 3
        return cfg

    full = Trainer(run("full"))
    folds = []
    fold = full.ema.fold
    full.ema.fold = lambda model: (folds.append((full.step, full.ema.unfolded_decay < 1.0)), fold(model))
    full.fit()
    assert [step for step, noted in folds if noted] == [3, 5]
    cut = Trainer(run("cut"))
    for _ in range(2):
        cut.train_step()
    assert cut.ema.unfolded_decay < 1.0
    cut.save()
    resumed = Trainer(run("cut"))
    assert resumed.ema.unfolded_decay == cut.ema.unfolded_decay
    resumed.fit()
    for (name, a), b in zip(full.ema.module.state_dict().items(), resumed.ema.module.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
    key = "0.final_layer.linear.weight"
    assert not full.ema.module.state_dict()[key].equal(cut.ema.module.state_dict()[key])  # it did fold


def test_an_offloaded_ema_trains_checkpoints_and_previews_as_the_one_on_the_device(tmp_path):
    """``trainer.ema_offload`` (host shadow, folded in a thread) with ``ema_every=2`` over 5 steps:
    the EMA equals the run without offload bit for bit (on the CPU both fold the same fp32 lerp), a
    checkpoint at step 3 resumes to the same EMA, and a preview samples from it."""
    def run(name, offload):
        cfg = tiny_run(tmp_path / name, max_steps=5)
        cfg.trainer.ema_every, cfg.trainer.ema_offload = 2, offload
        return cfg

    plain, offloaded = Trainer(run("plain", False)), Trainer(run("offloaded", True))
    plain.fit()
    for _ in range(3):
        offloaded.train_step()
    offloaded.save()
    resumed = Trainer(run("offloaded", True))
    assert resumed.step == 3 and resumed.ema.offload
    resumed.fit()
    for (name, a), b in zip(plain.ema.module.state_dict().items(), resumed.ema.module.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
    assert preview(resumed) is not None


def test_ema_every_k_steps_skips_a_non_finite_step_and_still_folds_on_schedule(tmp_path):
    """``trainer.ema_every=2`` over 5 steps with step 2 non-finite (skipped): the fold after step 2
    weighs only step 1's decay, the one after step 4 steps 3 and 4, the last one step 5 -- against a
    float64 replay of that rule on the weights seen after each fold step."""
    cfg = tiny_run(tmp_path, max_steps=5)
    cfg.trainer.ema_every = 2
    trainer = Trainer(cfg)
    loss = trainer.objective.loss
    trainer.objective.loss = lambda pred, inputs: loss(pred, inputs) * (float("inf") if trainer.step == 1 else 1.0)
    want = [p.detach().double().clone() for p in trainer.ema.module.parameters()]
    decay = trainer.ema.decay_at
    for step, applied in zip(range(1, 6), (1, 0, 1, 1, 1)):
        assert trainer.train_step()["skipped"] == (0.0 if applied else 1.0)
        keep = {2: decay(0), 4: decay(2) * decay(3), 5: decay(4)}.get(step)
        if keep is not None:
            for w, p in zip(want, trainer.model.parameters()):
                w.mul_(keep).add_(p.detach().double(), alpha=1.0 - keep)
    for w, e in zip(want, trainer.ema.module.parameters()):
        torch.testing.assert_close(e, w.float(), rtol=1e-6, atol=1e-7)
    assert trainer.ema.unfolded_decay == 1.0


def test_checkpoint_restores_model_ema_optimizer(tmp_path):
    trainer = Trainer(tiny_run(tmp_path, max_steps=3))
    for _ in range(2):
        trainer.train_step()
    trainer.save()
    restored = Trainer(tiny_run(tmp_path, max_steps=3))
    for a, b in [(trainer.model, restored.model), (trainer.ema.module, restored.ema.module)]:
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            if torch.is_tensor(p):
                assert torch.equal(p, q), name
    sa, sb = trainer.optimizer.optimizer.state, restored.optimizer.optimizer.state
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa.values(), sb.values()):
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
    assert restored.scheduler.num_steps == trainer.scheduler.num_steps
    key = "0.final_layer.linear.weight"  # the only weight with a gradient at step 1 (adaLN-Zero)
    assert trainer.model.state_dict()[key].abs().max() > 0
    assert not trainer.ema.module.state_dict()[key].equal(trainer.model.state_dict()[key])  # EMA lags


def test_half_written_checkpoint_never_replaces_a_good_one(tmp_path):
    trainer = Trainer(tiny_run(tmp_path, max_steps=3))
    trainer.train_step()
    good = trainer.save()
    (tmp_path / "checkpoints" / ".partial_step_00000002").mkdir()  # a save that died midway
    assert Trainer(tiny_run(tmp_path, max_steps=3)).step == 1
    assert (tmp_path / "checkpoints" / "latest").read_text() == good.name


def test_run_directory_outputs(tmp_path):
    pretrain(tiny_run(tmp_path, max_steps=2, sample_interval=2), hooks=[Previews(2)])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s"):
        assert all(isinstance(x[key], float) for x in lines), key
    grid = Image.open(tmp_path / "samples" / "step_000002.png")
    # 10 classes x 2 samples of 8x8, 2 px borders
    cell_w = (grid.width - 2) // 2 - 2
    cell_h = (grid.height - 2) // 10 - 2
    assert cell_w == cell_h and cell_w % 8 == 0
    assert any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002"


def test_bad_batch_config_fails_before_compute(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.data.global_batch_size = 12
    with pytest.raises(ConfigError, match="global_batch_size"):
        Trainer(cfg)
    assert not (tmp_path / "checkpoints").exists()


def _dp_worker(rank, world, run_dir, distopt):
    history = pretrain(tiny_run(f"{run_dir}/dp", max_steps=3, distopt=distopt))
    return losses(history)


@pytest.mark.parametrize("distopt", [False, True])
def test_data_parallel_matches_single_process(tmp_path, distopt):
    single = losses(pretrain(tiny_run(tmp_path / "single", max_steps=3)))
    per_rank = run_distributed(_dp_worker, 2, str(tmp_path), distopt)
    assert per_rank[0] == per_rank[1]
    torch.testing.assert_close(torch.tensor(per_rank[0]), torch.tensor(single), rtol=1e-5, atol=1e-6)


def _tp_worker(rank, world, run_dir):
    cfg = tiny_run(f"{run_dir}/tp", max_steps=4, sample_interval=3)
    cfg.parallel.tensor_model_parallel_size = 2
    trainer = Trainer(cfg)
    history = [trainer.train_step()["loss"] for _ in range(3)]
    preview(trainer)
    trainer.save()
    return history


def test_tensor_parallel_matches_single_process_and_reshards_to_one_rank(tmp_path):
    single = losses(pretrain(tiny_run(tmp_path / "single", max_steps=4)))
    per_rank = run_distributed(_tp_worker, 2, str(tmp_path))
    assert per_rank[0] == per_rank[1]
    torch.testing.assert_close(torch.tensor(per_rank[0]), torch.tensor(single[:3]), rtol=1e-5, atol=1e-6)
    # The TP=2 checkpoint (model, EMA, optimizer) resumes on one process and continues the same run.
    resumed = Trainer(tiny_run(tmp_path / "tp", max_steps=4))
    assert resumed.step == 3
    torch.testing.assert_close(torch.tensor(losses(resumed.fit())), torch.tensor(single[3:]), rtol=1e-5, atol=1e-6)


def test_an_moe_run_after_another_moe_model_in_the_same_process(tmp_path):
    """megatron keeps MoE state per process (router-loss tracker, aux-loss scale); a shallower MoE
    model run outside the trainer first must not break a deeper MoE run after it."""
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models import build_model

    Trainer(tiny_run(tmp_path / "init", max_steps=2))  # a megatron world for the bare model
    shallow = build_model(preset("tiny", num_layers=1, num_moe_experts=2, moe_router_topk=2))
    x = torch.randn(16, 2, preset("tiny").patch_dim)
    shallow(x, torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), grid=(1, 4, 4)).sum().backward()
    cfg = tiny_run(tmp_path / "deep", max_steps=2)
    cfg.model.num_layers, cfg.model.num_moe_experts, cfg.model.moe_router_topk = 3, 2, 2
    assert all(math.isfinite(h["loss"]) for h in Trainer(cfg).fit())


class _HostReads(TorchDispatchMode):
    """Counts scalar reads to the host (``.item()``, ``float(t)``, ``bool(t)``; each one a device
    sync on a GPU) and ops whose output size depends on the data (``nonzero`` and kin: a sync too),
    with the innermost frame outside torch that asked for each."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique",
               "aten.unique", "aten.repeat_interleave.Tensor")

    def __init__(self):
        super().__init__()
        self.count, self.callers = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.SYNCING):
            import traceback
            self.count += 1
            frames = [f for f in traceback.extract_stack()[:-1]  # the CPU shims only pass calls through
                      if "/torch/" not in f.filename and not f.filename.endswith("cpu_shims.py")]
            self.callers.append(f"{frames[-1].filename}:{frames[-1].name}" if frames else "?")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("adam", ["fused", "foreach"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_training_step_reads_to_the_host_only_for_the_gradient_norm(tmp_path, packed, adam):
    """Nothing in the model, the kernels or the trainer's step syncs the device with the host but the
    one read megatron's clip needs, the gradient norm's ``.item()`` (after it the step's metrics are
    read, computed by then); foreach Adam also reads its host-side ``step``. megatron's token-count
    read in ``finalize_model_grads`` is replaced (``optim.finalize_grads``); the packed sin-cos
    table's size comes from the batch's grids, which ``MicroBatch.to`` keeps on the host."""
    cfg = tiny_run(tmp_path)
    if packed:
        cfg.data = DataConfig(name="mock", mock_latent_shapes=[[1, 8, 8], [2, 4, 4]], max_seq_len=64,
                              global_batch_size=4, micro_batch_size=2)
        cfg.model.num_classes = 10
    cfg.optim.adam_impl = adam
    trainer = Trainer(cfg)
    trainer.train_step()
    batches = trainer.loader.next_global_batch()
    trainer.loader.next_global_batch = lambda: batches
    with _HostReads() as reads:
        trainer.train_step()
    allowed = (("dit/model.py:_embed",) if packed else ()) + ("clip_grads.py:get_grad_norm_fp32", "trainer.py:train_step") + (
        ("optimizer.py:step_with_ready_grads",) if adam == "foreach" else ())
    assert all(c.endswith(allowed) for c in reads.callers), sorted(set(reads.callers))
    assert sum(c.endswith("get_grad_norm_fp32") for c in reads.callers) == 1
    assert batches[0].to("meta").grids.device.type == "cpu"


def _run_with_clipping_and_a_bad_step(run_dir, *, adam_impl: str = "fused", grads: str = "fp32"):
    cfg = tiny_run(run_dir, max_steps=5)
    cfg.optim.clip_grad, cfg.optim.warmup_steps = 1e-3, 3  # every step clipped; the LR moves each step
    cfg.optim.adam_impl, cfg.optim.main_grads_dtype = adam_impl, grads
    cfg.trainer.bf16 = grads == "bf16"  # (bf16 gradient buffers: a bf16 model)
    trainer = Trainer(cfg)
    loss = trainer.objective.loss
    trainer.objective.loss = lambda pred, inputs: loss(pred, inputs) * (float("inf") if trainer.step == 1 else 1.0)
    history = trainer.train_steps(5)
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    ema = [p.detach().clone() for p in trainer.ema.module.parameters()]
    return history, weights, ema, trainer.scheduler.num_steps, trainer


def test_a_clipped_run_skips_a_non_finite_step_without_touching_anything(tmp_path):
    """Every step clipped (clip 1e-3), the loss of step 2 infinite: step 2 is skipped (no update, no
    LR step: the scheduler counts 4) and every other step is clipped and finite."""
    history, weights, ema, lr_steps, _ = _run_with_clipping_and_a_bad_step(tmp_path)
    assert [h["skipped"] for h in history] == [0.0, 1.0, 0.0, 0.0, 0.0] and lr_steps == 4
    assert all(h["grad_norm"] > 1e-2 for h in history if not h["skipped"])  # clipping was active
    assert all(torch.isfinite(t).all() for t in weights + ema)


def test_a_post_step_hook_runs_after_every_step_and_at_the_end_and_the_ema_folds_where_it_reads(tmp_path):
    """``Trainer(cfg, hooks=[...])``: a hook is called after each step (the trainer's ``step`` is the step
    just completed), after the built-in stops and the checkpoints, then once at the end; with
    ``trainer.ema_every`` far away, the EMA is averaged in exactly after the steps the hook says it reads."""
    from dit_mcore.training.hooks import Checkpoints, StepHook

    class Reader(StepHook):
        def __init__(self):
            self.calls = []

        def reads_after(self, step):
            return step == 2

        def after_step(self, trainer):
            self.calls.append((trainer.step, trainer.ema.unfolded_decay == 1.0))

        def at_end(self, trainer):
            self.calls.append(("end", trainer.step))

    cfg = tiny_run(tmp_path, max_steps=4)
    cfg.trainer.ema_every = 100
    reader = Reader()
    trainer = Trainer(cfg, hooks=[reader])
    assert trainer.hooks[-1] is reader and isinstance(trainer.hooks[-2], Checkpoints)
    trainer.fit()
    assert reader.calls == [(1, False), (2, True), (3, False), (4, True), ("end", 4)]  # step 4: the run's end


def test_a_finished_trainer_is_freed_without_the_cycle_collector(tmp_path):
    """No reference cycle holds a trainer: dropped, it is freed at once with its loader's threads and its
    process groups' users (the layout suites count threads right after each case)."""
    import gc
    import weakref
    trainer = Trainer(tiny_run(tmp_path, max_steps=2))
    trainer.train_step()
    gone = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert gone() is None
    finally:
        gc.enable()


def test_every_logged_step_reports_its_own_throughput_the_last_included(tmp_path, monkeypatch):
    """Each logged window's samples/s is its samples over its own steps' time, the last step's too (it
    once came out thousands of times too high, timed over nothing). A fake clock advances 2 s per step
    and not at all in the hooks (the final save) or the logging."""
    from types import SimpleNamespace

    from dit_mcore.training import metrics
    clock = [100.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    trainer = Trainer(tiny_run(tmp_path, max_steps=3))
    step = trainer.train_step

    def timed():
        clock[0] += 2.0
        return step()
    trainer.train_step = timed
    trainer.fit()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert [x["samples_per_s"] for x in lines] == [8.0, 8.0, 8.0]  # 16 samples per step, 2 s each


def test_the_progress_bar_draws_only_on_a_terminal(tmp_path, monkeypatch):
    """Redrawn bar lines would interleave with the log lines in a file (a job's output)."""
    import sys

    from dit_mcore.training.metrics import MetricsLogger

    def logger(tty):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
        return MetricsLogger(tmp_path / f"run_{tty}", enabled=True, max_steps=4, start_step=0, tensorboard=False,
                             progress_bar=True)
    assert logger(False).bar is None
    bar = logger(True).bar
    assert bar is not None
    bar.close()
