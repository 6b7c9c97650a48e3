"""Faults a long run meets: broken or missing checkpoint pointers, a checkpoint of another model,
non-finite steps. Each case fails without its fix."""
import json
import logging

import pytest
import torch

from dit_mcore.config import ConfigError
from dit_mcore.training.checkpoint import CheckpointError
from dit_mcore.training.divergence import DivergenceError
from dit_mcore.training.trainer import Trainer
from test_training import tiny_run


def _weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}


def _saved_run(tmp_path, steps=(1, 2), **kw):
    trainer = Trainer(tiny_run(tmp_path, max_steps=4, **kw))
    for _ in range(max(steps)):
        trainer.train_step()
        if trainer.step in steps:
            trainer.save()
    return trainer


def test_deleted_latest_pointer_resumes_from_the_newest_intact_checkpoint(tmp_path, caplog):
    _saved_run(tmp_path)
    (tmp_path / "checkpoints" / "latest").unlink()
    with caplog.at_level(logging.WARNING):
        assert Trainer(tiny_run(tmp_path, max_steps=4)).step == 2
    assert "newest intact checkpoint is step_00000002" in caplog.text


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    _saved_run(tmp_path)
    newest = tmp_path / "checkpoints" / "step_00000002"
    shard = max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy that died midway
    with caplog.at_level(logging.WARNING):
        resumed = Trainer(tiny_run(tmp_path, max_steps=4))
    assert resumed.step == 1
    assert str(newest) in caplog.text and shard.name in caplog.text and "truncated" in caplog.text


def test_only_broken_checkpoints_is_an_error_not_a_fresh_start(tmp_path):
    _saved_run(tmp_path, steps=(1,))
    (tmp_path / "checkpoints" / "step_00000001" / "manifest.json").unlink()
    (tmp_path / "checkpoints" / "step_00000001" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        Trainer(tiny_run(tmp_path, max_steps=4))


def test_manifest_lists_every_file_with_its_size(tmp_path):
    trainer = _saved_run(tmp_path, steps=(1,))
    path = tmp_path / "checkpoints" / trainer.last_saved
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {f.name for f in path.iterdir()} - {"manifest.json"}
    assert set(files) == on_disk and all(files[f] == (path / f).stat().st_size for f in files)


@pytest.mark.parametrize("field, value, listed", [
    ("num_layers", 1, "model.num_layers: checkpoint 2, this run 1"),
    ("num_layers", 3, "model.num_layers: checkpoint 2, this run 3"),
    ("hidden_size", 64, "model.hidden_size: checkpoint 32, this run 64"),
])
def test_resuming_another_model_refuses_and_names_the_fields(tmp_path, field, value, listed):
    _saved_run(tmp_path, steps=(1,))
    cfg = tiny_run(tmp_path, max_steps=4)
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match="holds another model") as err:
        Trainer(cfg)
    assert listed in str(err.value) and "log.dir" in str(err.value)
    assert (tmp_path / "checkpoints" / "step_00000001").exists()  # nothing pruned


def _poison_loss(trainer, bad_steps):
    """Make the loss of the given (1-based) steps infinite, as a diverging step would be."""
    loss = trainer.objective.loss

    def poisoned(pred, inputs):
        out = loss(pred, inputs)
        return out * float("inf") if trainer.step + 1 in bad_steps else out
    trainer.objective.loss = poisoned


def test_a_non_finite_step_is_skipped_and_training_goes_on(tmp_path):
    trainer = Trainer(tiny_run(tmp_path, max_steps=4))
    trainer.train_step()
    _poison_loss(trainer, {2})
    before, sched = _weights(trainer), trainer.scheduler.num_steps
    bad = trainer.train_step()
    assert bad["skipped"] == 1.0 and bad["skipped_steps"] == 1.0 and not torch.isfinite(torch.tensor(bad["loss"]))
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the update was not applied
    assert trainer.scheduler.num_steps == sched
    good = trainer.train_step()
    assert good["skipped"] == 0.0 and torch.isfinite(torch.tensor(good["loss"]))
    assert any(not torch.equal(before[k], v) for k, v in _weights(trainer).items())


def test_persistent_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = tiny_run(tmp_path, max_steps=10, save_interval=2)
    cfg.trainer.keep_checkpoints = 1
    trainer = Trainer(cfg)
    _poison_loss(trainer, {5, 6, 7, 8, 9, 10})
    with pytest.raises(DivergenceError, match=r"3 steps in a row \(steps 5\.\.7\).*step_00000004 is kept"):
        trainer.fit()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["skipped"] for x in lines][-3:] == [1.0, 1.0, 1.0]  # every sink sees the bad steps


def test_rotation_keeps_the_checkpoint_taken_before_a_skipped_step(tmp_path):
    cfg = tiny_run(tmp_path, max_steps=8, save_interval=2)
    cfg.trainer.keep_checkpoints = 1
    trainer = Trainer(cfg)
    _poison_loss(trainer, {3})
    trainer.fit()
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_00000002", "step_00000008"]
    assert Trainer(tiny_run(tmp_path, max_steps=8)).divergence.protected == {"step_00000002"}
