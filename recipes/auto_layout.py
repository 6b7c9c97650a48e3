"""``parallel.layout=auto``: a run takes the layout planner's first choice (``python -m dit_mcore.plan``) for
its own model, data and global batch on this job's GPUs, before anything is built.

Every rank plans alone, before torch.distributed starts (the planner traces in a fake world of its own;
it is deterministic, so every rank picks the same layout). The choice replaces the layout fields, the
micro-batch size, recompute and chunking; the parallel fields a user set beside ``layout=auto`` are refused,
the others are reported as replaced. Rank 0 logs the choice with its prediction and writes
``<log.dir>/plan.json``, next to the measured ``metrics.jsonl``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.layout import check_layout_request

_LOGGER = logging.getLogger("recipes")
PLAN_FILE = "plan.json"


def plan_gpu(parallel: ParallelConfig):
    """The planner's GPU: the table's ``parallel.layout_gpu``, or this job's CUDA device found by name in the
    table, with the memory the device reports."""
    from dit_mcore.plan.gpus import GPUS, gpu
    if parallel.layout_gpu:
        if parallel.layout_gpu not in GPUS:
            raise ConfigError(f"parallel.layout_gpu={parallel.layout_gpu!r} is not in the planner's table; use one of "
                              f"{sorted(GPUS)} (the nearest)")
        return gpu(parallel.layout_gpu)
    import torch
    if not torch.cuda.is_available():
        raise ConfigError(f"parallel.layout=auto plans for a GPU and this job has none: set parallel.layout_gpu to "
                          f"one of {sorted(GPUS)} to plan as if on it, or remove parallel.layout")
    device = int(os.environ.get("LOCAL_RANK", 0))
    name = torch.cuda.get_device_name(device)
    for entry in GPUS:
        if entry.split("-")[0] in name:  # (the table's rates and links; the memory this device has)
            return gpu(entry, memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
    raise ConfigError(f"parallel.layout=auto: this job's device {name!r} is not in the planner's table; set "
                      f"parallel.layout_gpu to the nearest of {sorted(GPUS)}")


def choose_layout(cfg, world: int | None = None, gpus_per_node: int | None = None):
    """``cfg`` (a ``RunConfig``) with its layout chosen by the planner when ``parallel.layout=auto`` (else
    unchanged); ``world`` / ``gpus_per_node``: torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` by default."""
    p = cfg.parallel
    check_layout_request(p)
    if p.layout is None:
        return cfg
    from dit_mcore.plan.samples import batch_maker, run_samples, text_tokens
    from dit_mcore.plan.search import Layout, Planner
    from dit_mcore.training.data_fit import fit_model_to_data

    from dit_mcore.parallel.initialize import adopt_slurm_launch
    adopt_slurm_launch()  # (tasks srun starts itself: torchrun's variables from Slurm's)
    world = world or int(os.environ.get("WORLD_SIZE", 1))
    gpus_per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    chosen_by_planner = set(Layout().overrides()) | {"parallel.cp_comm_type", "parallel.hierarchical_context_parallel_sizes"}
    defaults = ParallelConfig()
    set_here = [f"parallel.{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p)
                if f"parallel.{f.name}" in chosen_by_planner and getattr(p, f.name) != getattr(defaults, f.name)]
    if set_here:
        raise ConfigError(f"parallel.layout=auto chooses the layout, and {', '.join(set_here)} is set too: remove "
                          "it, or remove parallel.layout=auto to keep your own layout")
    device = plan_gpu(p)
    planned = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    fit_model_to_data(planned)  # (the shape the trainer will give the model)
    _LOGGER.info("parallel.layout=auto: planning %d x %s (%d per node) ...", world, device.name, gpus_per_node)
    samples = run_samples(planned, fix="pack the data (data.packing=true plans data.max_seq_len tokens) or set "
                          "the layout yourself")
    planner = Planner(planned, world, device, gpus_per_node, batch_maker(planned, samples, text_tokens(planned)))
    done, refused = planner.plan()
    fitting = [e for e in done if e.fits]
    if not fitting:
        raise ConfigError(f"parallel.layout=auto: no layout of this run fits {world} x {device.name} "
                          f"({len(done)} evaluated, {refused} refused by the layout check); run python -m "
                          "dit_mcore.plan for the smallest cluster that fits, or shorten the sequences")
    best = fitting[0]
    overrides = best.layout.overrides()
    replaced = {k: v for k, v in _current(cfg, overrides).items() if v != overrides[k] and not k.startswith("parallel.")}
    out = best.layout.apply(cfg)
    record = {"layout": best.layout.describe(world), "gpu": device.name, "world": world, "gpus_per_node": gpus_per_node,
              "evaluated": len(done), "fit": len(fitting), "replaced": replaced, "prediction": best.record(world)}
    _LOGGER.info("parallel.layout=auto chose %s of %d layouts that fit: predicted %.1f GiB per GPU, %.4g s per step, "
                 "%.1f TFLOPS/GPU, %.4g tokens/s/GPU on %s%s", record["layout"], len(fitting),
                 best.memory.total / 2**30, best.step.total, best.tflops_per_gpu, best.tokens_per_s_per_gpu,
                 device.name, "; replaced " + ", ".join(f"{k}={v!r} by {overrides[k]!r}" for k, v in replaced.items()) if replaced else "")
    if int(os.environ.get("RANK", 0)) == 0:
        run_dir = Path(cfg.log.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / PLAN_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return out


def _current(cfg, overrides: dict) -> dict:
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in overrides}
