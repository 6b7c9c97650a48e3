"""Profiling hooks, as torchtitan's users know them, each writing into ``<log.dir>/profile/`` and naming its file
in one log line:

- ``trainer.profile_steps="A-B"``: a torch profiler trace of steps A to B (1-based, inclusive) per rank,
  ``rank<r>_steps<A>-<B>.json`` (Chrome / Perfetto JSON, with shapes, stacks and memory events; each step a
  ``train_step <n>`` range);
- ``trainer.memory_snapshot=True`` (CUDA): the caching allocator's history from the trainer's start (the model's
  build included) through step :data:`MEMORY_SNAPSHOT_STEPS`, dumped as ``memory_snapshot_rank<r>.pickle``, which
  https://pytorch.org/memory_viz reads;
- ``trainer.flight_recorder=True`` (NCCL): the flight recorder's ring of recent collectives, dumped on a
  watchdog timeout to ``nccl_trace_rank_<r>`` (torch's ``TORCH_NCCL_*`` variables, set before the process
  group is created).
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("dit_mcore.train")

MEMORY_SNAPSHOT_STEPS = 3
"""Steps the allocator history covers: by step 3 the optimizer state and every buffer exist (steady state)."""
FLIGHT_RECORDER_ENTRIES = 2000


def parse_steps(value: Optional[str]) -> Optional[tuple[int, int]]:
    """``"A-B"`` (or ``"A"``) as ``(A, B)``; None for none. Raises ValueError naming the form."""
    if not value:
        return None
    first, _, last = str(value).partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ValueError("must be 'A-B' (1-based steps, inclusive), e.g. '10-12'") from None
    if not 1 <= a <= b:
        raise ValueError("must be 'A-B' with 1 <= A <= B, e.g. '10-12'")
    return a, b


def profile_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "profile"


def enable_flight_recorder(run_dir: Path) -> Path:
    """Switch NCCL's flight recorder on for the process group about to be created; returns the dump prefix."""
    prefix = profile_dir(run_dir) / "nccl_trace_rank_"  # (the folder is made with the run's, by Profiling)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(prefix))  # (torch appends the rank)
    return prefix


class Profiling:
    """The run's profiling windows, entered around each step by the trainer's loop (:meth:`step`)."""

    def __init__(self, trainer_cfg, run_dir: Path, rank: int, device: torch.device):
        self.window = parse_steps(trainer_cfg.profile_steps)
        self.dir, self.rank = profile_dir(run_dir), rank
        self.profiler = None
        self.first = self.last = 0
        if trainer_cfg.flight_recorder:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.snapshot = trainer_cfg.memory_snapshot and device.type == "cuda"
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def step(self, step: int):
        """Around training step ``step`` (1-based, the one about to run)."""
        if self.window and self.profiler is None and self.window[0] <= step <= self.window[1]:
            self._start(step)
        with torch.profiler.record_function(f"train_step {step}") if self.profiler else contextlib.nullcontext():
            yield
        self.last = step
        if self.profiler is not None and step >= self.window[1]:
            self._write_trace()
        if self.snapshot and step >= MEMORY_SNAPSHOT_STEPS:
            self._dump_snapshot()

    def _start(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                               with_stack=True)
        self.profiler.__enter__()
        self.first = step

    def close(self) -> None:
        """Write the trace of the window (at its last step, or as far as it got when the loop ends inside it) and
        a memory snapshot still recording (a run that ended, or failed: an out-of-memory, before step 3)."""
        if self.snapshot:
            self._dump_snapshot()
        if self.profiler is not None:
            self._write_trace()

    def _write_trace(self) -> None:
        profiler, self.profiler, self.window = self.profiler, None, None
        profiler.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}_steps{self.first}-{self.last}.json"
        profiler.export_chrome_trace(str(path))
        log.info("profiler trace of steps %d-%d written to %s (open in https://ui.perfetto.dev)", self.first,
                 self.last, path)

    def _dump_snapshot(self) -> None:
        self.snapshot = False
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"memory_snapshot_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        log.info("CUDA memory snapshot (through step %d) written to %s (open in https://pytorch.org/memory_viz)",
                 self.last, path)
