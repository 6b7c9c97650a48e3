"""python -m dit_mcore.plot: a real run's curves, and two runs overlaid, as PNGs showing exactly what
metrics.jsonl holds; bad input is one line."""
import json
import shutil

import pytest
import torch
from PIL import Image

from dit_mcore.plot import main, plot_runs
from dit_mcore.training.config import DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dit_mcore.training.trainer import pretrain
from energon_data.config import DataConfig


def _run(run_dir, lr: float) -> None:
    pretrain(RunConfig(
        model=ModelConfig(preset="tiny", input_size=8, in_channels=1, num_classes=10, backend="local"),
        data=DataConfig(name="digits", image_size=8, global_batch_size=8, micro_batch_size=8),
        optim=OptimConfig(lr=lr, warmup_steps=1), diffusion=DiffusionConfig(objective="flow", sample_steps=2),
        trainer=TrainerConfig(max_steps=4, save_interval=1000, val_interval=2, val_samples=8, val_levels=2),
        log=LogConfig(dir=str(run_dir), log_interval=1, sample_interval=0, progress_bar=False, tensorboard=False)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot_runs")
    _run(root / "slow", 1e-4)
    _run(root / "fast", 3e-3)
    return root


def test_a_run_is_plotted_as_its_metrics_say(runs, tmp_path):
    shown = plot_runs([runs / "fast"], tmp_path)
    records = [json.loads(line) for line in (runs / "fast" / "metrics.jsonl").read_text().splitlines()]
    always = {"loss", "val_by_level", "grad_norm", "lr", "throughput", "tflops"}
    assert set(shown) == always if not torch.cuda.is_available() else always <= set(shown)  # (GPUs: memory, MFU)
    assert shown["loss"]["fast: loss"] == ([1, 2, 3, 4], [r["loss"] for r in records])
    assert shown["loss"]["fast: val/ema_loss"] == ([2, 4], [records[1]["val/ema_loss"], records[3]["val/ema_loss"]])
    levels = sorted(k for k in records[1] if k.startswith("val/loss_t"))
    assert len(shown["val_by_level"]) == 2 and all(f"fast: {k[4:]}" in shown["val_by_level"] for k in levels)
    for stem in shown:
        with Image.open(tmp_path / f"{stem}.png") as png:
            assert png.format == "PNG" and png.size[0] > 400


def test_two_runs_are_overlaid(runs, tmp_path):
    shown = plot_runs([runs / "slow", runs / "fast"], tmp_path)
    assert set(shown["grad_norm"]) == {"slow", "fast"}
    assert shown["lr"]["slow"][1][-1] == pytest.approx(1e-4) and shown["lr"]["fast"][1][-1] == pytest.approx(3e-3)
    # runs of the same folder name are told apart by their paths
    twin = tmp_path / "other" / "fast"
    shutil.copytree(runs / "fast", twin)
    assert set(plot_runs([runs / "fast", twin], tmp_path / "twins")["lr"]) == {str(runs / "fast"), str(twin)}


def test_a_torn_last_line_is_left_out_and_bad_input_is_one_line(runs, tmp_path, capsys):
    torn = tmp_path / "torn"
    shutil.copytree(runs / "fast", torn)
    with (torn / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')
    assert plot_runs([torn], tmp_path / "out")["loss"]["torn: loss"][0] == [1, 2, 3, 4]
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "nowhere/metrics.jsonl not found" in err and "\n" not in err
