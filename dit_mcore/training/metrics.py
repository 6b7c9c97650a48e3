"""Rank-0 run logging: a console line per interval, a progress bar, TensorBoard and
``metrics.jsonl`` (one JSON object per logged step)."""
from __future__ import annotations

import contextlib
import json
import sys
import logging
import math
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("dit_mcore.train")


class StepRate:
    """Throughput over the steps since the last log line: samples/s, tokens/s (and per GPU), achieved
    model TFLOPS per GPU and, when the device's peak is known, MFU."""

    def __init__(self, world_size: int, peak_tflops: Optional[float]):
        self.world, self.peak = world_size, peak_tflops
        self._reset()

    def _reset(self) -> None:
        self.start, self.samples, self.tokens, self.flops = time.perf_counter(), 0.0, 0.0, 0.0

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (a validation, an FID: outside the steps) is left out of the interval's."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began

    def add(self, samples: float, tokens: float, flops: float) -> None:
        self.samples, self.tokens, self.flops = self.samples + samples, self.tokens + tokens, self.flops + flops

    def flush(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tflops = self.flops / elapsed / self.world / 1e12
        out = {"samples_per_s": self.samples / elapsed, "tokens_per_s": self.tokens / elapsed,
               "tokens_per_s_per_gpu": self.tokens / elapsed / self.world, "tflops_per_gpu": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        self._reset()
        return out


def device_memory(device) -> dict:
    """``max_memory_gib``: the peak the CUDA caching allocator handed out since the last call (the log
    interval's), then reset; empty on other devices."""
    import torch
    if getattr(device, "type", None) != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"max_memory_gib": peak}


def format_line(step: int, max_steps: int, m: dict) -> str:
    line = (f"step {step:>7d}/{max_steps} | loss {m['loss']:.4f} | grad_norm {m['grad_norm']:.3f} | "
            f"lr {m['lr']:.3e} | {m['samples_per_s']:.1f} samples/s | {m['tokens_per_s']:.0f} tokens/s")
    if "tflops_per_gpu" in m:
        line += f" | {m['tflops_per_gpu']:.3g} TFLOPS/GPU"
    if "mfu" in m:
        line += f" | MFU {100 * m['mfu']:.1f}%"
    if "max_memory_gib" in m:
        line += f" | {m['max_memory_gib']:.1f} GiB"
    if "eval/fid" in m:
        line += f" | FID {m['eval/fid']:.3f}"
    if "val/loss" in m:
        line += f" | val {m['val/loss']:.4f} (EMA {m['val/ema_loss']:.4f})"
    if m.get("skipped"):
        line += " | SKIPPED (not finite)"
    return line


class MetricsLogger:
    """No-op on ranks other than 0. ``metrics.jsonl`` is appended to, so a resumed run keeps its
    history; lines past the resume step (from a run that died after its last checkpoint) are
    dropped on open so each step appears once."""

    def __init__(self, run_dir: Path, *, enabled: bool, max_steps: int, start_step: int,
                 tensorboard: bool, progress_bar: bool, wandb_config=None):
        """``wandb_config``: the run's config when ``log.wandb`` is on (:class:`~dit_mcore.training.wandb_sink.WandbSink`)."""
        self.enabled, self.max_steps = enabled, max_steps
        self.writer = self.bar = self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if wandb_config is not None:
            from dit_mcore.training.wandb_sink import WandbSink
            self.wandb = WandbSink(wandb_config, run_dir, fresh=start_step == 0)
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if progress_bar and sys.stderr.isatty():  # (redrawn lines would interleave with the log in a file)
            from tqdm import tqdm
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True,
                            leave=False)

    def step(self, step: int, metrics: Optional[dict]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
        if metrics is None:
            return
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):
                    self.writer.add_scalar(key if "/" in key else f"train/{key}", value, step)  # (val/...)
                else:  # TensorBoard's charts drop NaN/inf points: mark them on a chart of their own
                    self.writer.add_scalar(f"nonfinite/{key}", 1.0, step)
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        line = format_line(step, self.max_steps, metrics)
        if self.bar is not None:
            self.bar.write(line)
        else:
            log.info(line)

    def image(self, step: int, name: str, path: Path) -> None:
        """An image file of ``step`` (a preview) to the sinks that take images (W&B)."""
        if self.enabled and self.wandb is not None:
            self.wandb.image(step, name, path)

    def close(self, failed: bool = False) -> None:
        if not self.enabled:
            return
        try:
            if self.wandb is not None:
                self.wandb.close(failed)
        finally:
            self.file.close()
            if self.writer is not None:
                self.writer.close()
            if self.bar is not None:
                self.bar.close()
