"""Shards are untrusted and may be damaged: reading one must never run code, and a broken one
must cost its samples, not the run.

* Decoding: energon decodes members with webdataset's handlers, which by default load ``.pth`` with
  ``torch.load(weights_only=False)`` and ``.pkl``/``.pickle``/``.pyd`` with ``pickle.loads`` -- either
  runs code from a crafted dataset. :func:`harden` switches ``.pth`` to ``weights_only=True``
  (tensors and plain containers: what ``prepare`` writes) and refuses pickle members.
* Reading: energon reads a sample's members straight from the tar at the offsets of its index; a
  truncated or overwritten shard raises there, outside the stages energon guards with its error
  handler, and stops the run. :func:`harden` makes such a read return a placeholder sample that
  names the shard and the error, which then fails where energon's handler catches it, so it is
  skipped like any corrupt sample (``energon_data.loader.error_handler`` logs one line and counts it).
* Bounding: energon stops a reader after a fixed 100 failures in a row; :func:`harden` lifts that
  limit so the run's own bound applies instead (``data.max_consecutive_skips``, counted here per
  process by :func:`note_failure` and reset by every accepted sample, see ``loader.error_handler``).

Both are applied when ``energon_data.loader`` is imported, so in loader workers too.
"""
from __future__ import annotations

import tarfile
from collections import Counter

PICKLE_EXTENSIONS = ("pkl", "pickle", "pyd")
UNREADABLE = "__unreadable__"
"""Key of the placeholder sample's error text."""

failed_samples: Counter = Counter()
"""Samples this process's loader skipped on read or decode errors, by shard (drained into batches)."""

_failure_run: Counter = Counter()
"""Read or decode failures since this process's loader last accepted a sample, by shard."""


def note_failure(shard: str) -> Counter:
    """Count one failed sample of ``shard``; returns the failures in a row so far, by shard."""
    failed_samples[shard] += 1
    _failure_run[shard] += 1
    return _failure_run


def note_success() -> None:
    """A sample was read and accepted: the run of failures is over."""
    if _failure_run:
        _failure_run.clear()


def reset_counts() -> None:
    """A new loader starts with no failures (without workers its reads share this process's counts)."""
    failed_samples.clear()
    _failure_run.clear()


class UnsafeMemberError(ValueError):
    """A shard member whose decoding could run code."""


def _refuse_pickle(data: bytes):
    raise UnsafeMemberError("pickle members are not decoded (unpickling untrusted data can run code); "
                            "store arrays as .pth (tensors) or .npy")


def _tolerant(read):
    from megatron.energon.flavors.webdataset.structs import FilteredSample
    from megatron.energon.source_info import SourceInfo

    def read_or_placeholder(self, sample_pointer, restore_index, entry_match_fn=None):
        try:
            return read(self, sample_pointer, restore_index, entry_match_fn)
        except (tarfile.TarError, EOFError, OSError, ValueError) as e:
            shard = self.tar_filenames[sample_pointer.tar_file_id]
            return FilteredSample(
                __key__=f"{shard}@{sample_pointer.byte_offset}", __shard__=shard,
                __restore_key__=("Webdataset", restore_index),
                __sources__=(SourceInfo(dataset_path=self.base_path, index=restore_index, shard_name=shard,
                                        file_names=()),),
                **{UNREADABLE: f"{type(e).__name__}: {e}"})
    read_or_placeholder.__wrapped__ = read
    return read_or_placeholder


def _unbounded_reads(build):
    """energon's reader gives up after 100 failures in a row whatever the run says; the run's
    ``data.max_consecutive_skips`` (enforced by ``loader.error_handler``) bounds them instead."""

    def build_without_energon_bound(self, *args, **kwargs):
        dataset = build(self, *args, **kwargs)
        dataset._map_failure_handler.tolerance = 0  # energon: 0 = no limit
        return dataset
    build_without_energon_bound.__wrapped__ = build
    return build_without_energon_bound


def _raw_parts(sample) -> tuple:
    parts = getattr(sample, "data", None)
    return parts if isinstance(parts, tuple) else (sample,)


def unreadable_reason(sample) -> str | None:
    """The read error a placeholder sample (or a raw sample wrapping one) carries, else None."""
    return next((p[UNREADABLE] for p in _raw_parts(sample) if isinstance(p, dict) and UNREADABLE in p), None)


def shard_of(sample, sources=None) -> str:
    """The shard a failed sample came from, as far as energon tells."""
    names = [getattr(s, "shard_name", None) for s in sources or ()]
    names += [p.get("__shard__") for p in _raw_parts(sample) if isinstance(p, dict)]
    names += [getattr(sample, "__shard__", None)]
    return next((str(n) for n in names if n), "unknown shard")


def harden() -> None:
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
    from megatron.energon.flavors.webdataset.itar_reader import ITarReader
    from webdataset import autodecode
    autodecode.pytorch_weights_only = True
    for ext in PICKLE_EXTENSIONS:
        autodecode.decoders[ext] = _refuse_pickle
    if not hasattr(ITarReader._get_item_by_sample_pointer, "__wrapped__"):
        ITarReader._get_item_by_sample_pointer = _tolerant(ITarReader._get_item_by_sample_pointer)
    if not hasattr(BaseWebdatasetFactory.build, "__wrapped__"):
        BaseWebdatasetFactory.build = _unbounded_reads(BaseWebdatasetFactory.build)
