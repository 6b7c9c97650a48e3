"""The validation loss (trainer.val_interval): its levels are the training distribution's quantile
midpoints, it equals a direct float64 recomputation from the held-out digits, it is the same after a
resume, it reaches every sink, and bad settings fail with one line. Its equality under every parallel
layout is checked in test_parallel_layouts."""
import json
import math

import pytest
import torch
from scipy import stats

from dit_mcore.diffusion import build_objective
from dit_mcore.diffusion.ddpm import DDPMConfig, DDPMObjective
from dit_mcore.diffusion.edm import EDMConfig, EDMObjective
from dit_mcore.diffusion.flow import FlowConfig, FlowObjective
from dit_mcore.errors import ConfigError
from dit_mcore.models.adapter import image_model_fn
from dit_mcore.training.config import (DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig,
                                       TrainerConfig)
from dit_mcore.training.data import HELD_OUT_EVERY, digits_split
from dit_mcore.training.trainer import Trainer, pretrain
from dit_mcore.training.validate import validate_run
from dit_mcore.training.val_loss import sample_noise
from energon_data.batch import MicroBatch
from energon_data.config import DataConfig
from energon_data.tokens import patchify, unpatchify

K = 5
MID = (torch.arange(K, dtype=torch.float64) + 0.5) / K


@pytest.mark.parametrize("objective, expected", [
    (FlowObjective(FlowConfig(sampling="logit_normal", logit_mean=0.3, logit_std=0.8)),
     lambda q: 1 / (1 + torch.exp(-torch.tensor(stats.norm.ppf(q, loc=0.3, scale=0.8))))),
    (FlowObjective(FlowConfig(sampling="uniform", shift=3.0)), lambda q: 3 * q / (1 + 2 * q)),
    (EDMObjective(EDMConfig(p_mean=-1.2, p_std=1.2)),
     lambda q: torch.tensor(stats.lognorm.ppf(q, s=1.2, scale=math.exp(-1.2)))),
    (DDPMObjective(DDPMConfig(num_train_timesteps=1000)), lambda q: torch.floor(q * 1000)),
], ids=["flow_logit_normal", "flow_uniform_shift3", "edm", "ddpm"])
def test_validation_levels_are_the_training_distributions_quantile_midpoints(objective, expected):
    levels = objective.validation_levels(K)
    torch.testing.assert_close(levels.double(), expected(MID).double(), rtol=1e-6, atol=1e-6)
    # ... of the distribution training draws from: the empirical quantiles of 200k draws agree.
    drawn = objective.sample_level(200_000, generator=torch.Generator().manual_seed(0)).double()
    empirical = torch.quantile(drawn[:100_000], MID)  # (torch.quantile's size limit)
    torch.testing.assert_close(levels.double(), empirical, rtol=0.02, atol=1.0 if isinstance(objective, DDPMObjective)
                               else 0.01)


def _run(run_dir, max_steps=4, **trainer) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", input_size=8, in_channels=1, num_classes=10, backend="local"),
        data=DataConfig(name="digits", image_size=8, global_batch_size=16, micro_batch_size=8),
        optim=OptimConfig(lr=1e-3, warmup_steps=1), diffusion=DiffusionConfig(objective="flow", sample_steps=2),
        trainer=TrainerConfig(max_steps=max_steps, save_interval=2, ema_decay=0.9, val_interval=2, val_samples=40,
                              val_levels=3, **trainer),
        log=LogConfig(dir=str(run_dir), log_interval=1, sample_interval=0, progress_bar=False, tensorboard=True))


def test_the_digits_hold_every_tenth_scan_out_of_training():
    train, _ = digits_split(8, held_out=False)
    held, _ = digits_split(8, held_out=True)
    assert len(held) == 1797 // HELD_OUT_EVERY and len(train) + len(held) == 1797
    assert not (train.flatten(1)[:, None] == held.flatten(1)[None]).all(-1).any()  # no held-out scan is trained on


@torch.no_grad()
def _direct(model, config, objective, levels, seed: int, n: int) -> float:
    """The validation loss of the first ``n`` held-out digits recomputed without the trainer: images
    noised in float64 at each level with each sample's own noise, the velocity error averaged per sample,
    then over samples and levels."""
    images, labels = digits_split(8, held_out=True)
    images, labels = images[:n], labels[:n]
    tokens, grid = patchify(images, config.patch_size)
    noise = unpatchify(sample_noise(MicroBatch.dense(tokens, grid, labels), seed, 0), grid, 1, config.patch_size)
    x0, eps, per_level = images.double(), noise.double(), []
    for t in levels:
        xt = (1 - t) * x0 + t * eps
        v = image_model_fn(model, config)(xt.float(), objective.timestep(torch.full((n,), t)), labels).double()
        per_level.append((v - (eps - x0)).square().flatten(1).mean(1).mean().item())
    return sum(per_level) / len(per_level)


def test_validation_loss_equals_a_direct_float64_recomputation(tmp_path):
    cfg = _run(tmp_path)
    trainer = Trainer(cfg)
    trainer.train_steps(2)
    got = trainer.validation.metrics(trainer)
    levels = trainer.validation.levels
    assert trainer.validation.data.num_samples == 48  # val_samples=40 in whole global batches of 16
    objective = build_objective(cfg.diffusion.objective)
    want = _direct(trainer.model[0], trainer.model_config, objective, levels, cfg.trainer.seed, 48)
    want_ema = _direct(trainer.ema.module[0], trainer.model_config, objective, levels, cfg.trainer.seed, 48)
    assert got["val/loss"] == pytest.approx(want, rel=1e-5)
    assert got["val/ema_loss"] == pytest.approx(want_ema, rel=1e-5)
    assert abs(want - want_ema) > 1e-4  # (the two are told apart)
    per_level = [got[f"val/loss_t{t:.4g}"] for t in levels]
    assert sum(per_level) / 3 == pytest.approx(got["val/loss"])
    # The same weights give the same number: nothing random is drawn anew.
    assert trainer.validation.metrics(trainer) == got


def test_validating_changes_nothing_in_training(tmp_path):
    """Steps 3 and 4 after a validation at step 2 train as without one, to the last weight of model and EMA."""
    runs = {}
    for interval in (0, 2):
        cfg = _run(tmp_path / str(interval))
        cfg.trainer.val_interval = interval
        trainer = Trainer(cfg)
        history = trainer.fit()
        runs[interval] = (history, torch.cat([p.detach().flatten() for p in trainer.model.parameters()]),
                          torch.cat([p.flatten() for p in trainer.ema.module.parameters()]))
    (plain, weights, ema), (validated, weights_v, ema_v) = runs[0], runs[2]
    assert [h["loss"] for h in plain] == [h["loss"] for h in validated]
    assert [h["grad_norm"] for h in plain] == [h["grad_norm"] for h in validated]
    assert torch.equal(weights, weights_v) and torch.equal(ema, ema_v)
    assert "val/loss" in validated[1] and "val/loss" not in plain[1]


def test_turning_validation_on_keeps_an_energon_stream_and_a_digits_checkpoint_of_all_scans_is_refused():
    assert DataConfig(path="/d").stream_fields() == DataConfig(path="/d", val_path="/v").stream_fields()
    from dit_mcore.training.data import InMemoryImageLoader
    from energon_data.loader import DataResumeError
    images, labels = digits_split(8, held_out=False)
    loader = InMemoryImageLoader(images, labels, patch_size=2, held_out_every=HELD_OUT_EVERY, global_batch_size=8,
                                 micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    state = loader.state_dict()
    loader.load_state_dict(state)
    del state["held_out_every"]  # (a checkpoint from before the split)
    with pytest.raises(DataResumeError, match="trained on every digit scan; training now leaves every 10th out"):
        loader.load_state_dict(state)


def test_validation_loss_is_logged_everywhere_and_the_same_after_a_resume(tmp_path):
    whole = pretrain(_run(tmp_path / "whole"))
    assert [h["step"] for h in whole if "val/loss" in h] == [2, 4]
    pretrain(_run(tmp_path / "resumed", max_steps=2))
    resumed = pretrain(_run(tmp_path / "resumed"))
    assert resumed[-1]["val/loss"] == whole[-1]["val/loss"] and resumed[-1]["val/ema_loss"] == whole[-1]["val/ema_loss"]
    lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "val/loss" in line] == [2, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "whole" / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("val/ema_loss")] == [2, 4]
    assert "train/loss" in events.Tags()["scalars"]


@pytest.mark.parametrize("field, value, match", [
    ("trainer.val_interval", -1, r"trainer.val_interval=-1: must be >= 0"),
    ("trainer.val_samples", 0, r"trainer.val_samples=0: must be >= 1"),
    ("trainer.val_levels", 0, r"trainer.val_levels=0: must be >= 1"),
    ("data.val_path", "/nowhere", r"data.val_path='/nowhere' is for prepared energon datasets"),
])
def test_bad_validation_settings_fail_with_one_line(tmp_path, field, value, match):
    cfg = _run(tmp_path)
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=match) as raised:
        validate_run(cfg, 1)
    assert "\n" not in str(raised.value)


def test_a_dataset_without_a_val_split_is_refused_before_training(tmp_path):
    from energon_data.prepare import prepare_dataset
    out = tmp_path / "digits"
    prepare_dataset("digits", str(out), encoder="identity", image_size=(8, 8), samples_per_shard=600,
                    progress=False, workers=1)
    cfg = _run(tmp_path / "run")
    cfg.data = DataConfig(path=str(out), max_seq_len=64, global_batch_size=2, micro_batch_size=1)
    with pytest.raises(ConfigError, match=r"the val split of data.path=.* is empty; prepare it with --split-ratio"):
        validate_run(cfg, 1)
    cfg.data.val_path = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"data.val_path=.*missing' is not a prepared energon dataset"):
        validate_run(cfg, 1)
