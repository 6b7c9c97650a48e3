"""Train / val loaders over prepared energon datasets, and exact save/restore of the train loader.

Rank mapping: a loader is built for a DATA-PARALLEL rank (``WorkerConfig(rank=dp_rank,
world_size=dp_size)``) and reads its share of the data; the TP/CP/PP ranks of one model replica read the same
micro-batches. Get ``dp_rank``/``dp_size`` from megatron's ``parallel_state.get_data_parallel_rank()`` /
``get_data_parallel_world_size()``, not from the global rank. (The trainer builds every rank's loader as rank 0
of 1 by default and keeps each rank's micro-batches: ``dit_mcore.training.energon_source``.)

Resume: ``save_state(loader, cfg)`` returns the loader's state for the checkpoint.
``restore_state(loader, state, cfg)`` checks, before calling into energon, that the things
energon cannot change on restore (number of workers, the loader's DP world size and rank, dataset and data
config) are unchanged, and raises :class:`DataResumeError` naming the old and new value otherwise;
with ``cfg.restart_data_on_mismatch`` it logs the mismatch and leaves the loader at the start of
its (seeded) stream instead.

Failing loudly: a worker that skips more than ``cfg.max_consecutive_skips`` samples in a row raises
:class:`~energon_data.task_encoder.SkipStreakError` (passed through energon by :func:`error_handler`);
:func:`iterate_with_timeout` raises :class:`FirstBatchTimeoutError` when no first batch arrives within
``cfg.first_batch_timeout_s``; and every loader worker exits as soon as its training process is
gone, even after a SIGKILL (:func:`exit_with_parent`).
"""
from __future__ import annotations

import functools
import gc
import logging
import os
import pickle
import tempfile
import threading
from typing import Iterator, Optional

from megatron.energon import (WorkerConfig, get_loader, get_savable_loader, get_train_dataset, get_val_dataset,
                              log_exception)

from energon_data import shard_safety
from energon_data.lifetime import exit_with_parent
from energon_data.config import NOT_STREAM_FIELDS, DataConfig, config_hash
from energon_data.task_encoder import LatentTaskEncoder, SkipStreakError

shard_safety.harden()  # no code runs while decoding; unreadable samples are skipped, not fatal

log = logging.getLogger(__name__)

STATE_VERSION = 1


def task_encoder_for(cfg: DataConfig) -> LatentTaskEncoder:
    return LatentTaskEncoder(patch_size=cfg.patch_size, max_seq_len=cfg.max_seq_len,
                             pad_multiple=cfg.pad_multiple, packing=cfg.packing,
                             max_abs_value=cfg.max_abs_value, max_consecutive_skips=cfg.max_consecutive_skips)


def error_handler(exc: Exception, sample, sources=None, *, max_consecutive_skips: Optional[int] = None) -> None:
    """energon's handler for errors while loading, decoding or encoding a sample: re-raise the ones
    that mean no batch can ever be built, so they reach the training process (with workers too) at
    once; otherwise the sample is skipped, counted (``unreadable`` in the batch's skip counts) and
    logged -- one line naming the shard for unreadable ones (see ``shard_safety``), energon's full
    report for the rest. More than ``max_consecutive_skips`` (``data.max_consecutive_skips``;
    None: no limit) failures in a row raise :class:`SkipStreakError` naming the shards."""
    if isinstance(exc, SkipStreakError):
        raise exc
    shard = shard_safety.shard_of(sample, sources)
    in_a_row = shard_safety.note_failure(shard)
    reason = shard_safety.unreadable_reason(sample)
    if reason is not None:
        log.warning("skipped an unreadable sample of shard %s (%s); the shard is truncated or damaged: "
                    "copy it again or re-run energon_data.prepare", shard, reason)
    else:
        log_exception(exc, sample, sources)
    failures = sum(in_a_row.values())
    if max_consecutive_skips is not None and failures > max_consecutive_skips:
        shards = ", ".join(f"{name} ({n})" for name, n in in_a_row.most_common())
        raise SkipStreakError(
            f"a data loader worker could not read or decode the last {failures} samples it tried "
            f"(by shard: {shards}; last error: {reason or f'{type(exc).__name__}: {exc}'}): the shards are "
            "truncated, damaged or not written by energon_data.prepare; copy them again or re-run "
            f"energon_data.prepare. Stopped after more than data.max_consecutive_skips={max_consecutive_skips} "
            "failures in a row (None: no limit).")


_inherited: list = []  # in a loader worker: every object it inherited from the training process


def _init_worker(energon_init, worker_id: int) -> None:
    # A forked worker inherits the training process's heap, garbage cycles included, and energon collects
    # garbage in its workers at once: a collected cycle's destructors (a process group's, a compiled kernel's,
    # anything bound to threads the fork did not copy) would run here, and crashed a worker in the test suite
    # with a segmentation fault (faulthandler's trace: inside energon's GcDataset collection). Held here, no
    # inherited object is finalized in the worker, whatever energon freezes and unfreezes later; frozen, its
    # collections do not walk them. (Objects the parent had frozen are not listed until unfrozen.)
    gc.unfreeze()
    _inherited[:] = gc.get_objects()
    gc.freeze()
    exit_with_parent()
    if energon_init is not None:
        energon_init(worker_id)


def _workers_exit_with_parent(loader):
    """Add :func:`exit_with_parent` to ``loader``'s worker init (energon's seeds it; torch reads the
    attribute when it starts the workers, at the first ``next``)."""
    loader.worker_init_fn = functools.partial(_init_worker, loader.worker_init_fn)
    return loader


def _worker_config(cfg: DataConfig, dp_rank: int, dp_size: int, **kw) -> WorkerConfig:
    handler = functools.partial(error_handler, max_consecutive_skips=cfg.max_consecutive_skips)
    return WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=cfg.num_workers,
                        global_error_handler=handler, **kw)


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


def _start_loader(cfg: DataConfig, dp_rank: int, dp_size: int):
    """Check the arguments of a new loader; its failure counts start from none (loaders without
    workers read in this process and share its counts)."""
    if not cfg.uses_energon:
        raise ValueError("data.path is empty; set it to a prepared energon dataset (or set data.blend)")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    cfg.validate()
    shard_safety.reset_counts()


def build_train_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, seed: int = 0):
    """Infinite, shuffled, savable train loader of :class:`~energon_data.samples.LatentBatch` for one DP rank."""
    _start_loader(cfg, dp_rank, dp_size)
    ds = get_train_dataset(
        dataset_path(cfg), worker_config=_worker_config(cfg, dp_rank, dp_size, seed_offset=seed),
        batch_size=cfg.micro_batch(dp_size), packing_buffer_size=cfg.packing_buffer_size if cfg.packing else None,
        shuffle_buffer_size=cfg.shuffle_buffer_size, max_samples_per_sequence=cfg.max_samples_per_sequence,
        task_encoder=task_encoder_for(cfg))
    # energon's watchdog would dump every thread's stack (warning only) while a slow first batch
    # is still within data.first_batch_timeout_s; let it speak only when ours does.
    # Worker states are snapshot by sample count, not by time, so loaders that read the same stream hold the same
    # state at the same position (the trainer saves one state for every data-parallel rank).
    return _workers_exit_with_parent(get_savable_loader(ds, watchdog_initial_timeout_seconds=cfg.first_batch_timeout_s,
                                                        checkpoint_every_sec=0))


def build_val_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, limit: Optional[int] = None):
    """One pass over the validation data (``cfg.val_path``, else the ``val`` split of ``cfg.path``),
    split across DP ranks, in a fixed order; ``limit`` caps the number of batches per rank."""
    _start_loader(cfg, dp_rank, dp_size)
    path = cfg.val_path or cfg.path
    ds = get_val_dataset(
        path, split_part="val" if cfg.val_path is None else "train",
        worker_config=_worker_config(cfg, dp_rank, dp_size), batch_size=cfg.micro_batch(dp_size),
        packing_buffer_size=cfg.packing_buffer_size if cfg.packing else None, limit=limit,
        task_encoder=task_encoder_for(cfg))
    return _workers_exit_with_parent(get_loader(ds))


class FirstBatchTimeoutError(TimeoutError):
    """The loader yielded no batch within ``data.first_batch_timeout_s``."""


def iterate_with_timeout(loader, cfg: DataConfig) -> Iterator:
    """Iterate ``loader`` (e.g. from :func:`build_train_loader`) like ``iter(loader)``, but raise
    :class:`FirstBatchTimeoutError` naming the likely causes when the first batch takes longer than
    ``cfg.first_batch_timeout_s`` (None: wait forever).

    The first ``next`` runs in a helper thread so the wait can be bounded whatever blocks inside
    energon; later batches are read in the caller's thread, and nothing is read ahead, so
    :func:`save_state` between batches stays exact. After the error the loader is unusable (the
    helper thread may still be inside it): stop the run.
    """
    it = iter(loader)
    if cfg.first_batch_timeout_s is not None:
        first = _next_within(it, cfg)
        if first is _EXHAUSTED:
            return
        yield first
    yield from it


_EXHAUSTED = object()


def _next_within(it: Iterator, cfg: DataConfig):
    """``next(it)`` (or ``_EXHAUSTED``) within ``cfg.first_batch_timeout_s``; errors re-raised here."""
    result = {}

    def fetch():
        try:
            result["batch"] = next(it, _EXHAUSTED)
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=fetch, name="first-batch", daemon=True)
    thread.start()
    thread.join(cfg.first_batch_timeout_s)
    if thread.is_alive():
        raise FirstBatchTimeoutError(_timeout_message(cfg))
    if "error" in result:
        raise result["error"]
    return result["batch"]


def _timeout_message(cfg: DataConfig) -> str:
    return (
        f"the data loader yielded no batch within data.first_batch_timeout_s={cfg.first_batch_timeout_s} s. "
        "Likely causes:\n"
        f"  - most samples are skipped, but never more than data.max_consecutive_skips={cfg.max_consecutive_skips} "
        f"in a row (too long for data.max_seq_len={cfg.max_seq_len}, NaN/Inf, above data.max_abs_value): lower "
        "data.max_consecutive_skips to see the reasons, and check the dataset\n"
        f"  - slow storage with large buffers to fill first (data.packing_buffer_size={cfg.packing_buffer_size}, "
        f"data.shuffle_buffer_size={cfg.shuffle_buffer_size}): raise data.first_batch_timeout_s or "
        f"data.num_workers (now {cfg.num_workers})\n"
        "  - a stuck or crashed loader worker: energon's watchdog prints every thread's stack when this "
        "timeout passes\n"
        "Set data.first_batch_timeout_s=None to wait forever.")


class DataResumeError(RuntimeError):
    """The saved loader state cannot continue the same data stream under the current setup."""


def save_state(loader, cfg: DataConfig) -> dict:
    """This rank's loader state plus what a restore must check; put it into every checkpoint."""
    wc = loader.worker_config
    return {
        "version": STATE_VERSION,
        # (pickled: energon's state classes are no tensors, and a checkpoint's common part loads weights-only)
        "energon": pickle.dumps(loader.save_state_rank()),
        "num_workers": wc.num_workers,
        "dp_size": wc.world_size,
        "dp_rank": wc.rank,
        "dataset": cfg.path,
        "config": cfg.stream_fields(),
        "config_hash": config_hash(cfg),
    }


def layout(loader) -> dict:
    """What energon cannot change on restore: compare it before loading any per-rank state."""
    wc = loader.worker_config
    return {"dp_size": wc.world_size, "num_workers": wc.num_workers}


def layout_problems(saved: dict, loader) -> list[str]:
    """How the loader layout ``saved`` in a checkpoint differs from ``loader``'s, one line each."""
    now, out = layout(loader), []
    if saved["num_workers"] != now["num_workers"]:
        out.append(f"data.num_workers was {saved['num_workers']} in the checkpoint but is {now['num_workers']} "
                   "now (energon restores per worker); set data.num_workers back")
    if saved["dp_size"] != now["dp_size"]:
        out.append(f"data-parallel size was {saved['dp_size']} in the checkpoint but is {now['dp_size']} now; "
                   "keep the DP size")
    return out


def _mismatches(loader, state: dict, cfg: DataConfig) -> list[str]:
    if state.get("version") != STATE_VERSION:
        return [f"loader state version {state.get('version')} != {STATE_VERSION} (not written by this code)"]
    out = layout_problems(state, loader)
    if not out and state["dp_rank"] != loader.worker_config.rank:
        out.append(f"this state belongs to DP rank {state['dp_rank']} but is being restored on DP rank "
                   f"{loader.worker_config.rank}; load each rank's own loader state")
    old, new = state["config"], cfg.stream_fields()
    for key in sorted((set(old) | set(new)) - NOT_STREAM_FIELDS):  # (states that recorded more: not compared)
        if old.get(key) != new.get(key):
            out.append(f"data.{key} was {old.get(key)!r} in the checkpoint but is {new.get(key)!r} now")
    return out


def accept_mismatch(problems: list[str], cfg: DataConfig) -> bool:
    """The one resume policy: True when nothing differs; with differences, raise
    :class:`DataResumeError` naming them, or (``data.restart_data_on_mismatch``) warn and return
    False so the caller restarts the data stream."""
    if not problems:
        return True
    msg = "cannot resume the data loader exactly:\n  - " + "\n  - ".join(problems)
    if not cfg.restart_data_on_mismatch:
        raise DataResumeError(msg + "\nKeep them, or set data.restart_data_on_mismatch=True to restart the "
                                    "data stream")
    log.warning("%s\nrestarting the data stream from its beginning (data.restart_data_on_mismatch=True)", msg)
    return False


def restore_state(loader, state: Optional[dict], cfg: DataConfig) -> bool:
    """Restore ``state`` (from :func:`save_state`) into a freshly built, not yet iterated loader.

    Returns True if restored, False if ``state`` is None or the stream was restarted because of a
    mismatch and ``cfg.restart_data_on_mismatch``. Raises :class:`DataResumeError` otherwise.
    """
    if state is None:
        return False
    if getattr(loader, "_has_workers", False):
        raise DataResumeError("restore_state must be called before iterating the loader")
    if not accept_mismatch(_mismatches(loader, state, cfg), cfg):
        return False
    energon = state["energon"]
    loader.restore_state_rank(pickle.loads(energon) if isinstance(energon, bytes) else energon)
    return True
