"""Profiling hooks (trainer.profile_steps, trainer.memory_snapshot, trainer.flight_recorder): a trace of exactly
the steps asked for, per rank, that parses as Chrome trace JSON; the CUDA-only ones refuse on CPU with one line
(and write their files on a GPU, when one is lent)."""
import json
import pickle

import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.training.config import DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dit_mcore.training.trainer import pretrain
from dit_mcore.training.validate import validate_run
from energon_data.config import DataConfig


def _run(run_dir, max_steps=4, **trainer) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", input_size=8, in_channels=1, num_classes=10, backend="local"),
        data=DataConfig(name="digits", image_size=8, global_batch_size=8, micro_batch_size=8),
        optim=OptimConfig(lr=1e-3, warmup_steps=1), diffusion=DiffusionConfig(objective="flow", sample_steps=2),
        trainer=TrainerConfig(max_steps=max_steps, save_interval=1000, **trainer),
        log=LogConfig(dir=str(run_dir), log_interval=1, sample_interval=0, progress_bar=False, tensorboard=False))


def _steps_in(trace) -> list[int]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({int(e["name"].split()[1]) for e in events if e.get("name", "").startswith("train_step ")})


def test_a_profiler_trace_holds_exactly_the_steps_asked_for(tmp_path, caplog):
    with caplog.at_level("INFO", logger="dit_mcore.train"):
        pretrain(_run(tmp_path, profile_steps="2-3"))
    trace = tmp_path / "profile" / "rank0_steps2-3.json"
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [trace.name]
    assert _steps_in(trace) == [2, 3]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the step's operators
    assert sum(str(trace) in r.getMessage() for r in caplog.records) == 1


def test_a_run_that_ends_inside_the_window_writes_what_it_profiled(tmp_path):
    pretrain(_run(tmp_path, max_steps=2))
    pretrain(_run(tmp_path, profile_steps="2-9"))  # resumed at step 2: steps 3 and 4 profiled, then the end
    assert _steps_in(tmp_path / "profile" / "rank0_steps3-4.json") == [3, 4]


@pytest.mark.parametrize("field, value, match", [
    ("profile_steps", "3-1", r"trainer.profile_steps='3-1': must be 'A-B' with 1 <= A <= B"),
    ("profile_steps", "ten", r"trainer.profile_steps='ten': must be 'A-B'"),
    pytest.param("memory_snapshot", True, r"trainer.memory_snapshot=True: records CUDA's caching allocator; this "
                 "machine has no GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
    pytest.param("flight_recorder", True, r"trainer.flight_recorder=True: records NCCL's collectives; this machine "
                 "has no GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
])
def test_bad_profiling_settings_fail_with_one_line(tmp_path, field, value, match):
    cfg = _run(tmp_path)
    setattr(cfg.trainer, field, value)
    with pytest.raises(ConfigError, match=match) as raised:
        validate_run(cfg, 1)
    assert "\n" not in str(raised.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's history needs a GPU")
def test_a_memory_snapshot_covers_the_first_steps_on_a_gpu(tmp_path):
    pretrain(_run(tmp_path, memory_snapshot=True))
    snapshot = pickle.loads((tmp_path / "profile" / "memory_snapshot_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
