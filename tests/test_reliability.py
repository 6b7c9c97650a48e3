"""Faults a long run meets: broken or missing checkpoint pointers, a checkpoint of another model,
non-finite steps, preemption signals. Each case fails without its fix."""
import json
import logging
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.training.checkpoint import MANIFEST, CheckpointError
from dit_mcore.training.divergence import DivergenceError
from dit_mcore.training.preemption import EXIT_PREEMPTED, Preempted
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
    # TensorBoard drops NaN points from its charts: they are marked on a chart of their own.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("nonfinite/loss")] == [5, 6, 7]
    assert all(e.step < 5 for e in events.Scalars("train/loss"))


def test_rotation_keeps_the_checkpoint_taken_before_a_skipped_step(tmp_path):
    cfg = tiny_run(tmp_path, max_steps=8, save_interval=2)
    cfg.trainer.keep_checkpoints = 1
    trainer = Trainer(cfg)
    _poison_loss(trainer, {3})
    trainer.fit()
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_00000002", "step_00000008"]
    assert Trainer(tiny_run(tmp_path, max_steps=8)).divergence.protected == {"step_00000002"}


def _signal_after(trainer, step, signum):
    train_step = trainer.train_step

    def stepped(*args):
        out = train_step(*args)
        if trainer.step == step:
            os.kill(os.getpid(), signum)  # arrives mid-run, as Slurm's warning would
        return out
    trainer.train_step = stepped


def test_preemption_signal_saves_requeues_and_the_rerun_continues_exactly(tmp_path, monkeypatch, caplog):
    full = [h["loss"] for h in Trainer(tiny_run(tmp_path / "full", max_steps=5)).fit()]
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    (fake_bin / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    trainer = Trainer(tiny_run(tmp_path / "cut", max_steps=5))
    _signal_after(trainer, 2, signal.SIGUSR1)
    with pytest.raises(Preempted) as stop:
        trainer.fit()
    # The signal arrived after step 2's vote (between steps): step 3's vote carries it, so the run
    # saves and stops after step 3.
    assert stop.value.code == EXIT_PREEMPTED and stop.value.step == 3
    assert "received SIGUSR1 at step 2: saving after step 3 at the latest, then exiting" in caplog.text
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers restored
    resumed = Trainer(tiny_run(tmp_path / "cut", max_steps=5))
    assert resumed.step == 3
    rest = [h["loss"] for h in resumed.fit()]
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == full and rest == full[3:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list:
    """The losses of a six-step run saving every two steps, no fault met: what a run whose save failed must train."""
    run = tiny_run(tmp_path_factory.mktemp("reference"), max_steps=6, save_interval=2)
    return [h["loss"] for h in Trainer(run).fit()]


def test_a_failed_save_is_reported_cleaned_up_and_retried_and_a_failed_last_save_fails_the_run(tmp_path, monkeypatch,
                                                                                                   caplog, reference):
    """A full disk at a periodic save: one line, no partial files left, the previous checkpoint stays the latest,
    training goes on exactly and the next save is written; a failing last save stops the run with the reason."""
    import dit_mcore.training.checkpoint as ckpt
    save, calls = ckpt.dist_checkpointing.save, []

    def disk_full_at(failing):
        def saving(state, path, **kwargs):
            calls.append(path)
            if len(calls) in failing:
                (Path(path) / "half_written.distcp").write_bytes(b"x")
                raise OSError(28, "No space left on device")
            return save(state, path, **kwargs)
        return saving
    monkeypatch.setattr(ckpt.dist_checkpointing, "save", disk_full_at({2}))
    losses = [h["loss"] for h in Trainer(tiny_run(tmp_path / "run", max_steps=6, save_interval=2)).fit()]
    assert losses == reference
    assert ("checkpoint of step 4 not written (OSError: [Errno 28] No space left on device); its partial files are "
            "removed; step_00000002 stays the latest, training goes on and saves again at step 6") in caplog.text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".writable")) == [
        "latest", "step_00000002", "step_00000006"]
    calls.clear()
    monkeypatch.setattr(ckpt.dist_checkpointing, "save", disk_full_at({1}))
    with pytest.raises(ckpt.SaveFailed, match="checkpoint of step 8 not written .*No space left on device"):
        Trainer(tiny_run(tmp_path / "run", max_steps=8, save_interval=100)).fit()
    assert (checkpoints / "latest").read_text() == "step_00000006" and not list(checkpoints.glob(".partial*"))


def test_a_save_whose_latest_pointer_cannot_be_written_is_not_left_as_a_step_folder(tmp_path, monkeypatch, caplog,
                                                                                    reference):
    """Step 4's files are written and renamed into place, then ``latest`` cannot be written: the save has failed,
    and says so; its folder goes back to partial files and is removed (left as ``step_00000004`` beside a ``latest``
    naming step 2, it was reported as not written, and a resume without ``latest`` would have started from it)."""
    write_text = Path.write_text

    def writing(self, text, *args, **kwargs):
        if self.name == "latest.tmp" and text == "step_00000004":
            raise OSError(28, "No space left on device")
        return write_text(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", writing)
    assert [h["loss"] for h in Trainer(tiny_run(tmp_path / "run", max_steps=6, save_interval=2)).fit()] == reference
    assert ("checkpoint of step 4 not written (OSError: [Errno 28] No space left on device); its partial files are "
            "removed; step_00000002 stays the latest") in caplog.text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".writable")) == [
        "latest", "step_00000002", "step_00000006"]


def test_a_failed_asynchronous_save_is_reported_cleaned_up_and_retried_and_a_failed_last_one_fails_the_run(
        tmp_path, monkeypatch, caplog, reference):
    """``trainer.async_save``: a full disk met by the forked writer of step 4's checkpoint is one line once the write
    is known to have failed, its partial files are removed, training goes on exactly and step 6 is written; the
    writer failing at the last save stops the run with the reason."""
    import dataclasses
    import functools

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    import dit_mcore.training.checkpoint as ckpt
    write = filesystem_async._write_item

    def disk_full_for(step):
        @functools.wraps(write)  # (megatron reads its signature)
        def writing(*args, **kwargs):  # (runs in the forked writer: the step is read off the file it writes)
            if any(f"partial_step_{step:08d}" in str(getattr(a, "name", "")) for a in args):
                raise OSError(28, "No space left on device")
            return write(*args, **kwargs)
        return writing

    def run(max_steps, save_interval):
        cfg = tiny_run(tmp_path / "run", max_steps=max_steps, save_interval=save_interval)
        cfg.trainer = dataclasses.replace(cfg.trainer, async_save=True)
        return [h["loss"] for h in Trainer(cfg).fit()]
    monkeypatch.setattr(filesystem_async, "_write_item", disk_full_for(4))
    assert run(6, 2) == reference
    assert re.search(r"checkpoint of step 4 not written \(.*\[Errno 28\] No space left on device\); its partial files "
                     r"are removed; step_00000002 stays the latest", caplog.text), caplog.text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".writable")) == [
        "latest", "step_00000002", "step_00000006"]
    monkeypatch.setattr(filesystem_async, "_write_item", disk_full_for(8))
    with pytest.raises(ckpt.SaveFailed, match="checkpoint of step 8 not written .*No space left on device"):
        run(8, 100)
    assert (checkpoints / "latest").read_text() == "step_00000006" and not list(checkpoints.glob(".partial*"))


def _denied_at_step_4(write_manifest):
    """``write_manifest`` refused for step 4's checkpoint: its publishing (rank 0's) fails."""
    def write(path):
        if path.name == ".partial_step_00000004":
            raise PermissionError(13, "Permission denied", str(path / MANIFEST))
        write_manifest(path)
    return write


def _async_run(run_dir):
    import dataclasses
    cfg = tiny_run(run_dir, max_steps=6, save_interval=2)
    cfg.trainer = dataclasses.replace(cfg.trainer, async_save=True)
    return cfg


def test_a_failed_asynchronous_publishing_is_agreed_on_reported_and_retried(tmp_path, monkeypatch, caplog, reference):
    """Publishing an asynchronous save (rank 0's manifest, rename and ``latest``) runs inside megatron's finalization,
    which every rank goes through: its failure is agreed on by every rank and reported once (raised on rank 0 alone,
    it would leave the others waiting in the finalization's collective), and training goes on to the next save."""
    import dit_mcore.training.checkpoint as ckpt
    monkeypatch.setattr(ckpt, "write_manifest", _denied_at_step_4(ckpt.write_manifest))
    assert [h["loss"] for h in Trainer(_async_run(tmp_path / "run")).fit()] == reference
    assert re.search(r"checkpoint of step 4 not written \(PermissionError: \[Errno 13\] Permission denied: .*manifest"
                     r"\.json'\); its partial files are removed; step_00000002 stays the latest", caplog.text), caplog.text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".writable")) == [
        "latest", "step_00000002", "step_00000006"]


def _megatron_rank0_writes_fail(common_at: str, metadata_at: str) -> None:
    """megatron's own rank-0 writes fail with a full disk: ``common.pt`` in the save folder named ``common_at``,
    ``metadata.json`` in ``metadata_at`` (this process only; rank 0 is the one that writes them)."""
    from megatron.core.dist_checkpointing import core
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    save_common, save_config = TorchCommonSaveStrategy.save_common, core.save_config

    def common(self, state, folder):
        if Path(folder).name == common_at and torch.distributed.get_rank() == 0:
            raise OSError(28, "No space left on device", str(Path(folder) / "common.pt"))
        return save_common(self, state, folder)

    def metadata(config, folder):
        if Path(folder).name == metadata_at:
            raise OSError(28, "No space left on device", str(Path(folder) / "metadata.json"))
        return save_config(config, folder)
    TorchCommonSaveStrategy.save_common, core.save_config = common, metadata


def _rank0_writes_fail_worker(rank, world, run_dir):
    import dataclasses

    import dit_mcore.training.checkpoint as ckpt
    ckpt.write_manifest = _denied_at_step_4(ckpt.write_manifest)  # (this rank's process only; rank 0 publishes)
    _megatron_rank0_writes_fail(".partial_step_00000002", ".partial_step_00000006")
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("dit_mcore").addHandler(handler)
    cfg = tiny_run(run_dir, max_steps=8, save_interval=2)
    cfg.trainer = dataclasses.replace(cfg.trainer, async_save=True)
    losses = [h["loss"] for h in Trainer(cfg).fit()]
    return losses, [m for m in heard if "not written" in m]


def test_rank_0s_failed_writes_reach_every_rank(tmp_path):
    """Two data-parallel ranks saving asynchronously, and rank 0's own writes failing: megatron's common.pt at
    step 2 (written before the tensors), the publishing of step 4 and megatron's metadata.json of step 6 (both
    inside the finalization). Each time both ranks learn it at the same point (before, rank 1 waited in a
    collective for rank 0, which had raised), train on and save step 8."""
    from dist_utils import run_distributed
    (losses0, heard0), (losses1, heard1) = run_distributed(_rank0_writes_fail_worker, 2, str(tmp_path))
    assert losses0 == losses1 and len(losses0) == 8
    for heard in (heard0, heard1):
        assert [m.split(" (")[0] for m in heard] == [f"checkpoint of step {s} not written" for s in (2, 4, 6)], heard
        assert "common.pt" in heard[0] and "PermissionError" in heard[1] and "metadata.json" in heard[2], heard
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000008"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_00000008"]


def test_megatron_s_rank_0_writes_failing_in_a_synchronous_save_are_reported_and_retried(tmp_path, caplog,
                                                                                        reference):
    """A synchronous save whose common.pt (step 2) and then metadata.json (step 4) cannot be written: reported in
    one line each, its partial files removed, training exactly as without the faults, step 6 written."""
    import dit_mcore.training.checkpoint as ckpt
    from megatron.core.dist_checkpointing import core
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    originals = TorchCommonSaveStrategy.save_common, core.save_config
    try:
        _megatron_rank0_writes_fail(".partial_step_00000002", ".partial_step_00000004")
        losses = [h["loss"] for h in Trainer(tiny_run(tmp_path / "run", max_steps=6, save_interval=2)).fit()]
        from megatron.core.dist_checkpointing import serialization
        with pytest.raises(OSError, match="No space left"):  # outside a save of ours the recorder raises, as megatron
            serialization.save_config(None, tmp_path / ".partial_step_00000004")
    finally:
        TorchCommonSaveStrategy.save_common, core.save_config = originals
    assert losses == reference
    for step, name in ((2, "common.pt"), (4, "metadata.json")):
        assert re.search(rf"checkpoint of step {step} not written \(OSError: \[Errno 28\] No space left on device: "
                         rf"'[^']*/\.partial_step_0000000{step}/{name}'\); its partial files are removed", caplog.text), \
            caplog.text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".writable")) == [
        "latest", "step_00000006"]
    assert ckpt._rank0_errors == []


def test_an_unwritable_run_directory_fails_in_one_line_before_the_model_is_built(tmp_path, monkeypatch):
    import dit_mcore.training.trainer as trainer_module
    (tmp_path / "a_file").write_text("not a folder")
    built = []
    monkeypatch.setattr(trainer_module, "parallelize", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_run(tmp_path / "a_file" / "run"))
    assert str(err.value) == (f"log.dir={str(tmp_path / 'a_file' / 'run')!r}: cannot write to "
                              f"{str(tmp_path / 'a_file' / 'run')!r} (Not a directory); choose another log.dir or "
                              "make it writable") and not built


@pytest.mark.parametrize("voted, saves_after", [(False, 5), (True, 6)])
def test_the_preemption_message_names_the_step_the_run_saves_after(caplog, voted, saves_after):
    """A signal before the step's vote stops the run after that step; one after it, after the next."""
    from dit_mcore.training.preemption import PreemptionSignals
    signals = PreemptionSignals()
    with signals:
        signals.begin(5)
        if voted:
            signals.start_vote(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received == signal.SIGTERM
    assert f"received SIGTERM at step 5: saving after step {saves_after} at the latest" in caplog.text


def _preempted_worker(rank, world, run_dir):
    cfg = tiny_run(run_dir, max_steps=6)
    cfg.parallel.tensor_model_parallel_size = 2  # one data-parallel replica: the vote must cross TP
    trainer = Trainer(cfg)
    if rank == 1:
        _signal_after(trainer, 2, signal.SIGTERM)
    try:
        trainer.fit()
    except Preempted as stop:
        return stop.step, stop.signame
    return trainer.step, None


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Only rank 1 is signalled; the world-wide vote (read with the step's loss, no extra sync) makes
    both ranks save the same step and exit preempted."""
    from dist_utils import run_distributed
    assert run_distributed(_preempted_worker, 2, str(tmp_path)) == [(3, "SIGTERM"), (3, "SIGTERM")]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000003"


def test_sigterm_to_the_clis_process_group_saves_and_exits_with_the_preempted_code(tmp_path):
    import subprocess
    import sys
    import time
    from test_recipes import SCRIPT, _LAUNCH_ENV
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(NEMORUN_HOME=str(tmp_path / "nemo_run"), PYTHONWARNINGS="ignore")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--yes", "--factory", "pretrain_tiny", f"log.dir={run_dir}",
                             "trainer.max_steps=1000", "log.log_interval=1", "trainer.save_interval=2"], cwd=tmp_path,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.time() < deadline:
        time.sleep(0.2)
    # As Slurm does: the whole process group, so the checkpoint helpers started by the periodic save
    # at step 2 get the signal too (they died of it mid-save before).
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out
    step = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert 2 <= step < 1000 and f"preempted by SIGTERM after step {step}" in out
    said = re.search(r"received SIGTERM at step (\d+): saving after step (\d+) at the latest", out)
    assert said and int(said.group(2)) == step, out  # the step it names is the step it saved


_SPAWNED_MASK = """
import multiprocessing, signal
from energon_data.lifetime import preemption_signals_blocked

def blocked(conn):
    conn.send(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()  # (a pipe, not a queue: a queue's lock would start the resource tracker here)
    with preemption_signals_blocked():  # (the resource tracker not yet running: this start would launch it)
        child = ctx.Process(target=blocked, args=(theirs,))
        child.start()
    print(ours.recv())
    child.join()
    from multiprocessing import resource_tracker
    status = open(f"/proc/{resource_tracker._resource_tracker._pid}/status").read()
    held = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
            if line.startswith(("SigBlk", "SigIgn"))}
    print(sorted(s for s in (int(signal.SIGTERM), int(signal.SIGUSR1))
                 if (held["SigBlk"] | held["SigIgn"]) >> (s - 1) & 1))
"""


def test_a_helper_spawned_with_preemption_signals_blocked_starts_with_them_blocked(tmp_path):
    """A spawned helper (the checkpoint writers' result manager) starts with SIGTERM and SIGUSR1 blocked, even
    when its start is the one that launches multiprocessing's resource tracker (which unblocks SIGTERM in the
    launching thread): a SIGTERM to the process group during its start killed it, and the save with it. The
    tracker, launched then, neither dies of them (blocked or ignored)."""
    import subprocess
    import sys
    script = tmp_path / "spawn_mask.py"
    script.write_text(_SPAWNED_MASK)
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=repo,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    helper, tracker = (set(eval(line)) for line in out.stdout.strip().splitlines()[-2:])
    assert {int(signal.SIGTERM), int(signal.SIGUSR1)} <= helper, helper
    assert tracker == {int(signal.SIGTERM), int(signal.SIGUSR1)}, tracker


def test_async_save_publishes_checkpoints_a_rerun_continues_from_exactly(tmp_path):
    def run(name, async_save, max_steps=6):
        cfg = tiny_run(tmp_path / name, max_steps=max_steps, save_interval=2)
        cfg.trainer.async_save, cfg.trainer.keep_checkpoints = async_save, 3
        return [h["loss"] for h in Trainer(cfg).fit()]

    sync = run("sync", False)
    assert run("async", True) == sync
    ckpts = tmp_path / "async" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert all((p / "manifest.json").exists() for p in ckpts.glob("step_*"))
    assert not list(ckpts.glob(".partial_*"))
    import shutil
    shutil.rmtree(ckpts / "step_00000006")  # resume from the asynchronously written step 4
    assert run("async", True) == sync[4:]


def test_an_async_save_writes_the_sharded_ema_of_its_step(tmp_path):
    """``trainer.ema_shard``: the whole EMA a save gathers into host memory is what the asynchronous
    writer writes, though the shadow is released and the shards fold on before the write finishes."""
    cfg = tiny_run(tmp_path, max_steps=6, save_interval=100)
    cfg.optim.use_distributed_optimizer, cfg.trainer.ema_shard, cfg.trainer.async_save = True, True, True
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    with trainer.ema.placed(torch.device("cpu")) as shadow:
        saved = [p.detach().clone() for p in shadow.parameters()]
    trainer.save()
    for _ in range(2):
        trainer.train_step()
    with trainer.ema.placed(torch.device("cpu")) as shadow:
        assert not all(torch.equal(a, b) for a, b in zip(saved, shadow.parameters()))  # it moved on
    trainer.finish_saves()
    resumed = Trainer(cfg)
    assert resumed.step == 2
    with resumed.ema.placed(torch.device("cpu")) as shadow:
        assert all(torch.equal(a, b) for a, b in zip(saved, shadow.parameters()))


def test_tasks_started_by_srun_form_the_world_without_torchrun(tmp_path):
    """The Slurm executor has srun start one task per GPU (no torchrun agent for SIGUSR1 to kill):
    Slurm's task ids become the ranks, the step's first node the rendezvous host."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import torch, torch.distributed as dist\n"
              "from dit_mcore.parallel.config import ParallelConfig\n"
              "from dit_mcore.parallel.initialize import initialize_distributed\n"
              "initialize_distributed(ParallelConfig(), 0)\n"
              "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t)\n"
              "print('world', dist.get_world_size(), 'rank', dist.get_rank(), 'sum', int(t.item()))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    base.update(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID=str(os.getpid()),
                SLURM_STEP_TASKS_PER_NODE="2", PYTHONWARNINGS="ignore",
                PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, out in enumerate(outs):
        assert f"world 2 rank {rank} sum 3" in out, out[-2000:]


def test_a_checkpoint_corrupt_in_place_falls_back_to_the_previous_one(tmp_path, caplog):
    """Same sizes as the manifest says, but unreadable: reported by path, the previous one is used."""
    trainer = Trainer(tiny_run(tmp_path, max_steps=6))
    trainer.train_step()
    trainer.train_step()
    trainer.save()
    trainer.train_step()
    trainer.train_step()
    newest = trainer.save()
    for f in (newest / ".metadata", newest / "common.pt"):  # garbage of the same size
        f.write_bytes(b"\x00" * f.stat().st_size)
    with caplog.at_level(logging.WARNING):
        resumed = Trainer(tiny_run(tmp_path, max_steps=6))
    assert resumed.step == 2
    assert f"checkpoint {newest} could not be loaded" in caplog.text


@pytest.mark.parametrize("distopt", [False, True])
def test_a_checkpoint_taken_before_the_first_step_resumes_exactly(tmp_path, distopt):
    """Preempted before its first step, a run saves an optimizer that holds no Adam state yet (and
    megatron writes no shared step for step 0); the rerun must load it, not fail over every
    checkpoint, and take the same two steps."""
    trainer = Trainer(tiny_run(tmp_path, max_steps=4, distopt=distopt))
    trainer.save()
    steps = [trainer.train_step() for _ in range(2)]
    resumed = Trainer(tiny_run(tmp_path, max_steps=4, distopt=distopt))
    assert resumed.step == 0 and resumed.last_saved == "step_00000000"
    assert [resumed.train_step()["loss"] for _ in range(2)] == [s["loss"] for s in steps]
