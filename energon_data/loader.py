"""Train / val loaders over prepared energon datasets, and exact save/restore of the train loader.

Rank mapping: loaders are built per DATA-PARALLEL rank (``WorkerConfig(rank=dp_rank,
world_size=dp_size)``), so the TP/CP/PP ranks of one model replica read the same micro-batches and
different DP ranks read disjoint data. Get ``dp_rank``/``dp_size`` from megatron's
``parallel_state.get_data_parallel_rank()`` / ``get_data_parallel_world_size()``, not from the global rank.

Resume: ``save_state(loader, cfg)`` returns a per-rank dict for the checkpoint; every rank stores its
own. ``restore_state(loader, state, cfg)`` checks, before calling into energon, that the things
energon cannot change on restore (number of workers, DP world size, DP rank, dataset and data
config) are unchanged, and raises :class:`DataResumeError` naming the old and new value otherwise;
with ``cfg.restart_data_on_mismatch`` it logs the mismatch and leaves the loader at the start of
its (seeded) stream instead.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron.energon import WorkerConfig, get_loader, get_savable_loader, get_train_dataset, get_val_dataset

from energon_data.task_encoder import LatentTaskEncoder

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class DataConfig:
    """Everything that decides which micro-batches a rank sees."""

    path: str = ""
    """Prepared energon dataset directory, or a metadataset yaml (see ``energon_data.blend``).
    Ignored when ``blend`` is set."""
    blend: Optional[list[tuple[str, float]]] = None
    """``[(dataset_dir, weight), ...]`` to mix several datasets; a metadataset yaml is written for it."""
    blend_mode: Literal["weight", "epoch"] = "weight"
    """``weight``: sample datasets randomly by weight, forever. ``epoch``: each epoch holds every
    dataset ``weight`` times over (weights are repetitions, e.g. 2 = twice per epoch)."""
    blend_by: Literal["samples", "tokens"] = "samples"
    """Whether ``blend`` weights are shares of samples or of (unpadded) tokens; see ``energon_data.blend``."""
    blend_dir: Optional[str] = None
    """Where the generated metadataset yaml goes; default: ``$TMPDIR/dit_mcore_blends``."""
    val_path: Optional[str] = None
    """Dataset for validation; default: the ``val`` split of ``path``."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """Model patch sizes ``(pt, ph, pw)``."""
    max_seq_len: int = 4096
    """Tokens per packed sequence (rows, including padding). Longer samples are skipped and counted."""
    pad_multiple: int = 1
    """Pad every sample to a multiple of this (the trainer sets ``2 * CP * TP``); must divide ``max_seq_len``."""
    packing: bool = True
    """Pack several samples per sequence. Off: each sample is its own (padded) sequence."""
    micro_batch_size: int = 1
    """Packs per micro-batch (samples per micro-batch without packing); all are concatenated into one THD sequence."""
    num_workers: int = 2
    """Data worker processes per rank (0 = load in the training process). Fixed across a resume."""
    packing_buffer_size: int = 256
    """Samples collected per packing round; larger packs tighter (the last bin of a round is partial)."""
    shuffle_buffer_size: Optional[int] = 100
    """Sample-level shuffle buffer (``None``: shards are still shuffled, samples in a shard are not)."""
    max_samples_per_sequence: Optional[int] = 100
    """Samples read consecutively from one shard before jumping to another (``None``: whole shards)."""
    max_abs_value: Optional[float] = None
    """Skip latents with a value above this magnitude (corrupt encodes); ``None``: no check."""
    restart_data_on_mismatch: bool = False
    """On resume with a changed worker count / DP size / data config, restart the data stream from
    its beginning (warning) instead of raising. The run will then revisit samples it already saw."""

    def __post_init__(self):
        self.patch_size = tuple(self.patch_size)
        if self.blend_mode not in ("weight", "epoch"):
            raise ValueError(f"data.blend_mode must be 'weight' or 'epoch', got {self.blend_mode!r}")
        if self.blend_by not in ("samples", "tokens"):
            raise ValueError(f"data.blend_by must be 'samples' or 'tokens', got {self.blend_by!r}")
        if not self.path and not self.blend:
            raise ValueError("data.path is empty; set it to a prepared energon dataset (or set data.blend)")
        for name in ("micro_batch_size", "packing_buffer_size", "max_seq_len", "pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")

    def stream_fields(self) -> dict:
        """The fields that change the sample stream (everything except the restart policy, workers
        and the val dataset); a restore with different values would not continue the same stream."""
        skip = {"restart_data_on_mismatch", "num_workers", "val_path", "blend_dir"}
        return {k: v for k, v in _jsonable(dataclasses.asdict(self)).items() if k not in skip}


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def config_hash(cfg: DataConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.stream_fields(), sort_keys=True).encode()).hexdigest()[:16]


def task_encoder_for(cfg: DataConfig) -> LatentTaskEncoder:
    return LatentTaskEncoder(patch_size=cfg.patch_size, max_seq_len=cfg.max_seq_len,
                             pad_multiple=cfg.pad_multiple, packing=cfg.packing,
                             max_abs_value=cfg.max_abs_value)


def dataset_path(cfg: DataConfig) -> str:
    """The path energon reads: ``cfg.path``, or the metadataset yaml generated for ``cfg.blend``."""
    if not cfg.blend:
        return cfg.path
    from energon_data.blend import write_blend

    out_dir = cfg.blend_dir or os.path.join(tempfile.gettempdir(), "dit_mcore_blends")
    yaml_path = os.path.join(out_dir, f"blend-{config_hash(cfg)}.yaml")
    write_blend(yaml_path, cfg.blend, mode=cfg.blend_mode, by=cfg.blend_by,
                patch_size=cfg.patch_size, pad_multiple=cfg.pad_multiple)
    return yaml_path


def _check_rank(dp_rank: int, dp_size: int):
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


def build_train_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, seed: int = 0):
    """Infinite, shuffled, savable train loader of :class:`~energon_data.samples.LatentBatch` for one DP rank."""
    _check_rank(dp_rank, dp_size)
    wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=cfg.num_workers, seed_offset=seed)
    ds = get_train_dataset(
        dataset_path(cfg), worker_config=wc, batch_size=cfg.micro_batch_size,
        packing_buffer_size=cfg.packing_buffer_size if cfg.packing else None,
        shuffle_buffer_size=cfg.shuffle_buffer_size, max_samples_per_sequence=cfg.max_samples_per_sequence,
        task_encoder=task_encoder_for(cfg))
    return get_savable_loader(ds)


def build_val_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, limit: Optional[int] = None):
    """One pass over the validation data (``cfg.val_path``, else the ``val`` split of ``cfg.path``),
    split across DP ranks, in a fixed order; ``limit`` caps the number of batches per rank."""
    _check_rank(dp_rank, dp_size)
    path = cfg.val_path or cfg.path
    wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=cfg.num_workers)
    ds = get_val_dataset(
        path, split_part="val" if cfg.val_path is None else "train", worker_config=wc,
        batch_size=cfg.micro_batch_size, packing_buffer_size=cfg.packing_buffer_size if cfg.packing else None,
        limit=limit, task_encoder=task_encoder_for(cfg))
    return get_loader(ds)


class DataResumeError(RuntimeError):
    """The saved loader state cannot continue the same data stream under the current setup."""


def save_state(loader, cfg: DataConfig) -> dict:
    """This rank's loader state plus what a restore must check; put it into every checkpoint."""
    wc = loader.worker_config
    return {
        "version": STATE_VERSION,
        "energon": loader.save_state_rank(),
        "num_workers": wc.num_workers,
        "dp_size": wc.world_size,
        "dp_rank": wc.rank,
        "dataset": cfg.path,
        "config": cfg.stream_fields(),
        "config_hash": config_hash(cfg),
    }


def _mismatches(loader, state: dict, cfg: DataConfig) -> list[str]:
    wc = loader.worker_config
    out = []
    if state.get("version") != STATE_VERSION:
        return [f"loader state version {state.get('version')} != {STATE_VERSION} (not written by this code)"]
    if state["num_workers"] != wc.num_workers:
        out.append(f"data.num_workers was {state['num_workers']} in the checkpoint but is {wc.num_workers} "
                   "now (energon restores per worker); set data.num_workers back")
    if state["dp_size"] != wc.world_size:
        out.append(f"data-parallel size was {state['dp_size']} in the checkpoint but is {wc.world_size} now; "
                   "keep the DP size")
    elif state["dp_rank"] != wc.rank:
        out.append(f"this state belongs to DP rank {state['dp_rank']} but is being restored on DP rank "
                   f"{wc.rank}; load each rank's own loader state")
    old, new = state["config"], cfg.stream_fields()
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"data.{key} was {old.get(key)!r} in the checkpoint but is {new.get(key)!r} now")
    return out


def restore_state(loader, state: Optional[dict], cfg: DataConfig) -> bool:
    """Restore ``state`` (from :func:`save_state`) into a freshly built, not yet iterated loader.

    Returns True if restored, False if ``state`` is None or the stream was restarted because of a
    mismatch and ``cfg.restart_data_on_mismatch``. Raises :class:`DataResumeError` otherwise.
    """
    if state is None:
        return False
    if getattr(loader, "_has_workers", False):
        raise DataResumeError("restore_state must be called before iterating the loader")
    problems = _mismatches(loader, state, cfg)
    if problems:
        msg = "cannot resume the data loader exactly:\n  - " + "\n  - ".join(problems)
        if not cfg.restart_data_on_mismatch:
            raise DataResumeError(msg + "\nor set data.restart_data_on_mismatch=True to restart the data stream")
        log.warning("%s\nrestarting the data stream from its beginning (data.restart_data_on_mismatch=True)", msg)
        return False
    loader.restore_state_rank(state["energon"])
    return True
