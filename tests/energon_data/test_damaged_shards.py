"""Untrusted or damaged shards cost their samples, never the run and never code execution: a
truncated shard's samples and a sample whose ``.pth`` holds a pickled callable are skipped,
counted (``unreadable``) and the shard named in the log; the callable never runs."""
import logging
import os
import pickle

import pytest

import fixtures
from energon_data.loader import DataConfig, build_train_loader
from energon_data.shard_safety import UnsafeMemberError, harden
from energon_data.task_encoder import SkipStreakError
from fixtures import SampleSpec, write_dataset

SAMPLES = 40


class RunsCode:
    """A pickle that would create ``path`` when loaded with ``weights_only=False``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _read(root, workers, batches=30, **kw):
    cfg = DataConfig(path=str(root), max_seq_len=64, global_batch_size=2, micro_batch_size=2, num_workers=workers,
                     packing=False, **kw)
    keys, skipped = [], {}
    loader = build_train_loader(cfg, dp_rank=0, dp_size=1)
    for i, batch in enumerate(loader):
        keys += list(batch.keys)
        for reason, n in batch.skipped_by_reason.items():
            skipped[reason] = skipped.get(reason, 0) + n
        if i + 1 == batches:
            break
    return keys, skipped


def _specs():
    return [SampleSpec(1, 8, 8, 4, label=i % 10) for i in range(SAMPLES)]


@pytest.mark.parametrize("workers", [0, 1])
def test_truncated_shard_is_skipped_counted_and_named(tmp_path, workers, caplog):
    root = write_dataset(tmp_path / "ds", _specs(), samples_per_shard=20)
    shard = root / "shard-0001.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with caplog.at_level(logging.WARNING, logger="energon_data.loader"):
        keys, skipped = _read(root, workers)
    assert len(keys) == 60 and all(int(k[1:]) < 20 or k in _intact(root) for k in keys)
    assert skipped["unreadable"] > 0 and set(skipped) >= {"unreadable"}
    if workers == 0:  # a worker's log goes to its own process
        assert "shard-0001.tar" in caplog.text and "truncated or damaged" in caplog.text


@pytest.mark.parametrize("bound", [5, 150])
def test_unreadable_samples_in_a_row_stop_at_the_configured_bound(tmp_path, bound):
    """Every shard truncated: the run stops after data.max_consecutive_skips failures in a row with
    the shards named -- also above energon's own fixed limit of 100, which is lifted."""
    root = write_dataset(tmp_path / "ds", _specs(), samples_per_shard=20)
    for shard in root.glob("shard-*.tar"):
        shard.write_bytes(shard.read_bytes()[:1024])
    with pytest.raises(SkipStreakError) as err:
        _read(root, workers=0, max_consecutive_skips=bound)
    message = str(err.value)
    assert f"the last {bound + 1} samples" in message and f"data.max_consecutive_skips={bound}" in message
    assert "shard-0000.tar" in message and "shard-0001.tar" in message and "Unexpected end of tar file" in message


def test_a_readable_sample_ends_the_run_of_failures(tmp_path):
    """The bound counts failures in a row, not in total: reading a third of a truncated shard (its
    unreadable samples come in runs of at most 43 here) passes a bound of 50 although more than 50
    samples fail in all."""
    root = write_dataset(tmp_path / "ds", _specs(), samples_per_shard=20)
    shard = root / "shard-0001.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    keys, skipped = _read(root, workers=0, max_consecutive_skips=50)
    assert len(keys) == 60 and skipped["unreadable"] > 50


def _intact(root):
    """Keys of shard 1 whose bytes survived the truncation (read before the cut)."""
    import tarfile
    out = set()
    try:
        with tarfile.open(root / "shard-0001.tar") as tar:
            for member in tar:
                out.add(member.name.split(".")[0])
    except (tarfile.TarError, EOFError):
        pass
    return out


def test_pickled_code_in_a_pth_member_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "code_ran"
    original = fixtures.latent_for
    monkeypatch.setattr(fixtures, "latent_for",
                        lambda i, spec, c: RunsCode(str(marker)) if i == 7 else original(i, spec, c))
    root = write_dataset(tmp_path / "ds", _specs(), samples_per_shard=20)
    keys, skipped = _read(root, workers=1, batches=25)
    assert not marker.exists()
    assert "s000007" not in keys and skipped["unreadable"] >= 1
    assert len(keys) == 50  # the batches still fill


def test_pickle_members_are_refused():
    harden()
    from webdataset import autodecode
    with pytest.raises(UnsafeMemberError, match="can run code"):
        autodecode.decoders["pickle"](pickle.dumps({"a": 1}))
    assert autodecode.pytorch_weights_only is True
