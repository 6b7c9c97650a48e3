"""log.wandb: an offline W&B run (WANDB_MODE=offline, no network) holds the run's config once, every logged
metric at its step (the validation losses too) and the preview grids as images; a resumed run continues the same
W&B run. Read back from the run file W&B writes (its records in LevelDB's log format, each a W&B protobuf)."""
import json
import struct

import pytest

wandb = pytest.importorskip("wandb")

from dit_mcore.errors import ConfigError  # noqa: E402
from dit_mcore.generate.preview import Previews  # noqa: E402
from dit_mcore.training.config import (DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig,  # noqa: E402
                                       TrainerConfig)
from dit_mcore.training.trainer import pretrain  # noqa: E402
from dit_mcore.training.validate import validate_run  # noqa: E402
from energon_data.config import DataConfig  # noqa: E402

BLOCK, HEADER = 32768, 7


def records(path) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte file header, then LevelDB log records (crc 4, length 2,
    type 1: full / first / middle / last) in 32 KiB blocks whose tails too short for a header are padding."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, out, pos, parts = path.read_bytes(), [], HEADER, b""
    assert data[:4] == b":W&B"
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def history(path) -> list[dict]:
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def _run(run_dir, max_steps) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", input_size=8, in_channels=1, num_classes=10, class_dropout_prob=0.1,
                          backend="local"),
        data=DataConfig(name="digits", image_size=8, global_batch_size=8, micro_batch_size=8),
        optim=OptimConfig(lr=1e-3, warmup_steps=1), diffusion=DiffusionConfig(objective="flow", sample_steps=2),
        trainer=TrainerConfig(max_steps=max_steps, save_interval=2, val_interval=2, val_samples=8, val_levels=2),
        log=LogConfig(dir=str(run_dir), log_interval=1, sample_interval=2, samples_per_class=1, progress_bar=False,
                      tensorboard=False, wandb=True, wandb_project="tests"))


def test_an_offline_wandb_run_holds_the_config_the_metrics_and_the_previews(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    first = pretrain(_run(run_dir, 2), hooks=[Previews(2)])
    second = pretrain(_run(run_dir, 4), hooks=[Previews(2)])  # resumed: the same W&B run continues
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    rows = [row for f in files for row in history(f)]
    losses = {row["trainer/step"]: row["loss"] for row in rows if "loss" in row}  # (W&B's x axis: trainer/step)
    assert losses == {h["step"]: pytest.approx(h["loss"]) for h in first + second}
    val = {row["trainer/step"]: row["val/ema_loss"] for row in rows if "val/ema_loss" in row}
    assert val == {2: pytest.approx(first[-1]["val/ema_loss"]), 4: pytest.approx(second[-1]["val/ema_loss"])}
    images = {row["trainer/step"]: row["samples/_type"] for row in rows if "samples/_type" in row}  # (its fields)
    assert images == {2: "image-file", 4: "image-file"}
    runs = [r.run for r in records(files[0]) if r.WhichOneof("record_type") == "run"]  # (the config: sent with the run)
    sent = {i.key: json.loads(i.value_json) for r in runs for i in r.config.update}
    assert sent["model"]["preset"] == "tiny" and sent["trainer"]["val_interval"] == 2
    # a new run in the same folder (from step 0) is a new W&B run
    import shutil
    shutil.rmtree(run_dir / "checkpoints")
    pretrain(_run(run_dir, 2))
    assert (run_dir / "wandb_run_id").read_text().strip() != run_id


def test_wandb_online_without_credentials_is_refused_before_training(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    with pytest.raises(ConfigError, match=r"log.wandb=True: no W&B credentials here \(WANDB_API_KEY, or `wandb login`\)"):
        validate_run(_run(tmp_path, 2), 1)
    monkeypatch.setenv("WANDB_MODE", "offline")
    validate_run(_run(tmp_path, 2), 1)


def test_wandb_without_the_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb=True: needs the wandb package: pip install wandb") as raised:
        validate_run(_run(tmp_path, 2), 1)
    assert "\n" not in str(raised.value)
