"""Exact resume of the train loader, DP disjointness, and clear errors for unsupported resume changes."""
import gc
import io
import itertools

import pytest
import torch

from energon_data.blend import write_blend
from energon_data.loader import DataConfig, DataResumeError, build_train_loader, restore_state, save_state
from fixtures import mixed_specs, write_dataset


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    a = write_dataset(root / "a", mixed_specs(60, seed=1), prefix="a", samples_per_shard=15)
    b = write_dataset(root / "b", mixed_specs(40, seed=2, video_fraction=0.8), prefix="b", samples_per_shard=10)
    return a, b


def _cfg(path, **kw):
    base = dict(path=str(path), max_seq_len=128, pad_multiple=4, micro_batch_size=2, num_workers=0,
                packing_buffer_size=12, shuffle_buffer_size=10, max_samples_per_sequence=5)
    return DataConfig(**{**base, **kw})


def _keys(loader, n):
    return [tuple(b.keys) for b in itertools.islice(loader, n)]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _check_resume(cfg, stop, extra=6, dp_rank=0, dp_size=1):
    """Save after ``stop`` batches and keep reading (the uninterrupted run); a fresh loader restored
    from the saved state must yield the same next ``extra`` batches. Returns all keys read."""
    first = build_train_loader(cfg, dp_rank=dp_rank, dp_size=dp_size, seed=7)
    it = iter(first)
    head = _keys(it, stop)
    state = _roundtrip(save_state(first, cfg))
    reference = _keys(it, extra)
    resumed = build_train_loader(cfg, dp_rank=dp_rank, dp_size=dp_size, seed=7)
    assert restore_state(resumed, state, cfg)
    assert _keys(resumed, extra) == reference, f"diverged after resuming at batch {stop}"
    return head + reference


def test_exact_resume_packed_no_workers_past_epoch(datasets):
    a, _ = datasets
    # ~60 samples at ~4.5 per 2-pack batch: batch 25 lies in the second epoch.
    for stop in (0, 3):
        _check_resume(_cfg(a), stop)
    reference = _check_resume(_cfg(a), 25)
    valid = {f"a{i:06d}" for i, sp in enumerate(mixed_specs(60, seed=1)) if sp.frames * sp.height * sp.width // 4 <= 128}
    read = [k for ks in reference[:25] for k in ks]
    assert len(read) > len(valid) and set(read) == valid  # stop 25 lies past the first epoch


def test_exact_resume_unpacked_and_blended(datasets, tmp_path):
    a, b = datasets
    _check_resume(_cfg(a, packing=False, micro_batch_size=3), 23)
    blend = write_blend(tmp_path / "w.yaml", [(str(a), 0.6), (str(b), 0.4)])
    _check_resume(_cfg(blend), 17)
    epoch = write_blend(tmp_path / "e.yaml", [(str(a), 1), (str(b), 2)], mode="epoch")
    _check_resume(_cfg(epoch), 30, dp_rank=1, dp_size=2)


def test_exact_resume_with_two_workers(datasets, monkeypatch):
    a, _ = datasets
    # torch joins each worker with this timeout at teardown (default 5 s, and energon's workers
    # never exit by themselves); shorten it so the test does not idle.
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    _check_resume(_cfg(a, num_workers=2), 13, extra=8)
    gc.collect()  # tear the worker loaders down here, under the short timeout


def test_dp_ranks_read_disjoint_data(datasets):
    a, _ = datasets
    cfg = _cfg(a)
    per_rank = [{k for ks in _keys(build_train_loader(cfg, dp_rank=r, dp_size=2), 5) for k in ks} for r in range(2)]
    assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1]
    # Same DP rank (e.g. another TP/CP rank of the replica) gets identical batches.
    assert _keys(build_train_loader(cfg, dp_rank=1, dp_size=2), 5) == _keys(build_train_loader(cfg, dp_rank=1, dp_size=2), 5)


def test_unsupported_resume_changes_fail_early_and_clearly(datasets, caplog):
    a, _ = datasets
    cfg = _cfg(a)
    loader = build_train_loader(cfg, dp_rank=0, dp_size=2)
    _keys(loader, 2)
    state = save_state(loader, cfg)
    cases = [
        (_cfg(a, num_workers=2), dict(dp_rank=0, dp_size=2), r"num_workers was 0 .* is 2"),
        (cfg, dict(dp_rank=0, dp_size=4), r"data-parallel size was 2 .* is 4"),
        (cfg, dict(dp_rank=1, dp_size=2), r"DP rank 0 .* DP rank 1"),
        (_cfg(a, max_seq_len=256), dict(dp_rank=0, dp_size=2), r"max_seq_len was 128 .* is 256"),
    ]
    for new_cfg, ranks, pattern in cases:
        # Built but never iterated: no worker processes are started.
        with pytest.raises(DataResumeError, match=pattern):
            restore_state(build_train_loader(new_cfg, **ranks), state, new_cfg)
    # Opt-in: the stream restarts from its beginning instead.
    restart = _cfg(a, pad_multiple=8, restart_data_on_mismatch=True)
    fresh = build_train_loader(restart, dp_rank=0, dp_size=2)
    assert restore_state(fresh, state, restart) is False
    assert "pad_multiple was 4" in caplog.text
    assert _keys(fresh, 3) == _keys(build_train_loader(restart, dp_rank=0, dp_size=2), 3)
