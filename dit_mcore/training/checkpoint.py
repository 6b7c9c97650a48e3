"""Checkpoints with ``megatron.core.dist_checkpointing``: written to a temporary directory and
renamed into place only once every rank has finished, so a half-written checkpoint never replaces
a good one.

Layout: ``<dir>/step_00000100/`` (a dist-checkpoint) and ``<dir>/latest`` (name of the newest
complete one, replaced atomically).
"""
from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from dit_mcore.parallel.fsdp import shard_like, whole_checkpoint_view

log = logging.getLogger(__name__)

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    if not (path / "metadata.json").exists():
        raise RuntimeError(f"{marker} names {path.name}, which is missing or incomplete; "
                           f"point {marker} at an intact step_* directory or remove it to start over")
    return path


def load_common(path: Path) -> dict:
    """The rank-0 (common) part of a checkpoint, without touching sharded tensors."""
    return dist_checkpointing.load_common_state_dict(str(path))


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _per_rank(key: str, data: Any) -> ShardedObject:
    return ShardedObject(key, data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def sharded_state(model, ema_model, optimizer, *, extra: dict, per_rank: dict, is_loading: bool = False) -> dict:
    model_sd = model.sharded_state_dict()
    state = {
        "model": model_sd,
        "ema": ema_model.sharded_state_dict(prefix="ema."),
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA),
        **extra,
    }
    for key, value in per_rank.items():
        state[f"rank_{key}"] = _per_rank(f"rank_{key}", value)
    return state


def save_checkpoint(root: str | os.PathLike, step: int, model, ema_model, optimizer, *, extra: dict,
                    per_rank: dict, keep: int = 2) -> Path:
    """Save and publish ``step``. ``extra`` is common (rank-0) state; ``per_rank`` differs per rank."""
    root = Path(root)
    final, partial = _step_dir(root, step), root / f".partial_step_{step:08d}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    with whole_checkpoint_view((model, ema_model), optimizer, loading=False):  # FSDP: global keys and shapes
        state = sharded_state(model, ema_model, optimizer, extra=extra, per_rank={**per_rank, "rng": rng_state()})
        dist_checkpointing.save(state, str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        tmp = root / "latest.tmp"
        tmp.write_text(final.name)
        tmp.replace(root / "latest")
        for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model, ema_model, optimizer, *, extra: dict, per_rank: dict,
                    restore_rng: bool = True) -> dict:
    """Load ``path`` into model, EMA and optimizer in place; returns the common ``extra`` values and
    this rank's ``per_rank`` values. RNG states are restored too unless ``restore_rng`` is False
    (a checkpoint from another world size: per-rank states do not map onto the new ranks)."""
    from dit_mcore.parallel.cpu_shims import init_adam_state
    if not torch.cuda.is_available():
        init_adam_state(optimizer)
    rank_keys = {**per_rank, "rng": None} if restore_rng else per_rank
    with whole_checkpoint_view((model, ema_model), optimizer, loading=True):  # FSDP: loads into whole copies
        template = sharded_state(model, ema_model, optimizer, extra=extra, per_rank=rank_keys, is_loading=True)
        loaded = dist_checkpointing.load(template, str(path))
        optimizer.load_state_dict(loaded.pop("optimizer"))
    model.load_state_dict(shard_like(loaded.pop("model"), model))
    ema_model.load_state_dict(shard_like({k.removeprefix("ema."): v for k, v in loaded.pop("ema").items()}, ema_model))
    if restore_rng:
        set_rng_state(loaded.pop("rank_rng"))
    ranks = {key: loaded.pop(f"rank_{key}") for key in per_rank}
    return {"extra": loaded, "per_rank": ranks}
