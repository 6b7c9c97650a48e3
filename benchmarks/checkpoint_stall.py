"""Training stall per checkpoint: synchronous save vs ``trainer.async_save`` (megatron
dist_checkpointing's async save), side by side in one run on the same model and state.

The stall is the wall time the training loop loses to a save: for a synchronous save the whole
``Trainer.save()``; for an asynchronous one the snapshot and fork inside ``save()`` plus the
finalisation the next steps pay. Each mode trains ``--warmup`` steps, then times ``--saves`` saves,
each followed by ``--steps-between`` training steps (the async writer runs during them); the stall
of one save is ``(time of save + steps) - steps * median plain step``. Both the blocking time of
the save call and that total are reported: where the writer shares the training's CPU cores (a
2-core CPU), the steps it overlaps slow down and eat the gain; on a GPU node the writer uses
otherwise idle host cores.

    python benchmarks/checkpoint_stall.py                               # CPU, ~60M-parameter DiT
    python benchmarks/checkpoint_stall.py --hidden 1152 --layers 28     # DiT-XL/2 size, one GPU
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from results_io import device_name, write_result  # noqa: E402  (benchmarks/ is the script folder)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run_config(run_dir, args, async_save: bool):
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                           RunConfig, TrainerConfig)
    return RunConfig(
        model=ModelConfig(preset="tiny", num_layers=args.layers, hidden_size=args.hidden,
                          num_attention_heads=args.heads, input_size=8, in_channels=4, num_classes=10),
        data=DataConfig(name="mock", image_size=8, global_batch_size=args.batch, micro_batch_size=args.batch),
        optim=OptimConfig(lr=1e-4), diffusion=DiffusionConfig(sample_steps=2),
        trainer=TrainerConfig(max_steps=10_000, save_interval=10_000, keep_checkpoints=1, async_save=async_save,
                              bf16=torch.cuda.is_available()),
        log=LogConfig(dir=str(run_dir), tensorboard=False, progress_bar=False), parallel=ParallelConfig())


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(args, async_save: bool, root: Path) -> dict:
    from dit_mcore.training.trainer import Trainer
    trainer = Trainer(_run_config(root / ("async" if async_save else "sync"), args, async_save))
    for _ in range(args.warmup):
        trainer.train_step()
    plain = []
    for _ in range(args.steps_between):
        _sync()
        t0 = time.perf_counter()
        trainer.train_step()
        _sync()
        plain.append(time.perf_counter() - t0)
    step_s = statistics.median(plain)
    stalls, save_calls, published = [], [], []
    for _ in range(args.saves):
        _sync()
        t0 = time.perf_counter()
        trainer.save()
        save_calls.append(time.perf_counter() - t0)
        for _ in range(args.steps_between):
            trainer.train_step()
            if trainer.async_saves is not None and trainer.async_saves.get_num_unfinalized_calls():
                trainer.async_saves.maybe_finalize_async_calls(blocking=False)
        trainer.finish_saves()
        _sync()
        total = time.perf_counter() - t0
        stalls.append(max(total - args.steps_between * step_s, 0.0))
        published.append(trainer.last_saved)
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"stall_s": statistics.median(stalls), "stalls_s": stalls, "save_call_s": statistics.median(save_calls),
            "step_s": step_s, "params": params, "published": published}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--steps-between", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from dit_mcore.parallel.initialize import destroy_distributed

    root = Path(tempfile.mkdtemp(prefix="ckpt_stall_"))
    try:
        results = {}
        for mode, async_save in (("sync", False), ("async", True)):
            results[mode] = measure(args, async_save, root)
            destroy_distributed()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    name = device_name()
    ratio = results["sync"]["stall_s"] / max(results["async"]["stall_s"], 1e-9)
    blocking = results["sync"]["save_call_s"] / max(results["async"]["save_call_s"], 1e-9)
    result = {"device": name, "command": "python benchmarks/checkpoint_stall.py " + " ".join(argv or sys.argv[1:]),
              "params": results["sync"]["params"], "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
              **results, "ratio_sync_stall_over_async_stall": ratio,
              "ratio_sync_save_call_over_async_save_call": blocking}
    print(f"{result['params'] / 1e6:.1f}M params on {name}: the save call blocks {results['sync']['save_call_s']:.2f} s "
          f"sync vs {results['async']['save_call_s']:.2f} s async ({blocking:.1f}x); total stall per save "
          f"(incl. steps slowed by the writer) {results['sync']['stall_s']:.2f} s vs {results['async']['stall_s']:.2f} s "
          f"({ratio:.2f}x); plain step {results['sync']['step_s']:.2f} s")
    write_result("checkpoint_stall", result, args.out)
    return result


if __name__ == "__main__":
    main()
