"""Loaders that can never yield a batch fail within seconds, naming the ``data.*`` field to change,
no loader worker outlives a killed training process, and none finalizes what it inherited from it."""
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from megatron.energon import SkipSample

from energon_data.loader import DataConfig, FirstBatchTimeoutError, build_train_loader, iterate_with_timeout
from energon_data.samples import LatentSample
from energon_data.task_encoder import LatentTaskEncoder, SkipStreakError
from fixtures import mixed_specs, write_dataset

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_only(tmp_path_factory):
    """30 images and videos of at least 8x8 latents: 16 or more tokens at patch 2x2."""
    specs = mixed_specs(30, seed=3, sizes=(8, 12))
    return write_dataset(tmp_path_factory.mktemp("long") / "ds", specs, prefix="L", samples_per_shard=10)


@pytest.fixture
def quick_worker_teardown(monkeypatch):
    """torch joins each worker with this timeout (default 5 s) when the loader goes away."""
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    yield
    gc.collect()  # tear worker loaders down here, under the short timeout


def _sample(key, t, h, w, fill=None):
    latent = torch.zeros(4, t, h, w)
    if fill is not None:
        latent.view(-1)[0] = fill
    return LatentSample(__key__=key, __restore_key__=(), latent=latent, text_emb=torch.zeros(2, 3),
                        meta={"kind": "image"})


def test_skip_streak_names_each_reason_and_its_fix():
    te = LatentTaskEncoder(max_seq_len=16, max_consecutive_skips=3)
    streak = [_sample("a", 1, 12, 8), _sample("b", 2, 8, 8), _sample("c", 1, 2, 2, fill=float("nan"))]
    for s in streak:  # up to the limit: ordinary skips
        with pytest.raises(SkipSample):
            te.encode_sample(s)
    te.encode_sample(_sample("ok", 1, 4, 4))  # an accepted sample ends the streak
    for s in streak:
        with pytest.raises(SkipSample):
            te.encode_sample(s)
    with pytest.raises(SkipStreakError) as err:
        te.encode_sample(_sample("d", 1, 4, 5))  # short enough, but 5 is not divisible by patch 2
    msg = str(err.value)
    assert "skipped the last 4 samples" in msg and "too_long: 2, nonfinite: 1, bad_shape: 1" in msg
    assert "data.max_seq_len=16 but these samples need 24 to 32 tokens" in msg
    assert "raise data.max_seq_len to at least 24 (32 fits them all)" in msg
    assert "NaN/Inf values (e.g. c:" in msg and "re-encode" in msg
    assert "d: latent T,H,W (1, 4, 5) not divisible" in msg
    assert "data.max_consecutive_skips=3" in msg


@pytest.mark.parametrize("num_workers", [0, 1])
def test_all_samples_too_long_fails_within_seconds(long_only, num_workers, quick_worker_teardown):
    # The limit exceeds the dataset: the streak runs across epochs of the infinite train stream.
    cfg = DataConfig(path=str(long_only), max_seq_len=8, micro_batch_size=2, num_workers=num_workers,
                     packing_buffer_size=4, max_consecutive_skips=50, first_batch_timeout_s=120)
    start = time.monotonic()
    with pytest.raises(SkipStreakError) as err:
        next(iterate_with_timeout(build_train_loader(cfg, dp_rank=0, dp_size=1), cfg))
    assert time.monotonic() - start < 20
    msg = str(err.value)
    assert "skipped the last 51 samples it read (too_long: 51)" in msg
    assert "data.max_seq_len=8 but these samples need 16 to" in msg
    assert "raise data.max_seq_len to at least 16" in msg and "data.max_consecutive_skips=50" in msg


def _config(timeout):
    return DataConfig(first_batch_timeout_s=timeout)


class _Stalled:
    """A loader whose first batch arrives only once ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()

    def __iter__(self):
        self.release.wait()
        yield "late"


def test_first_batch_timeout_names_the_likely_causes():
    loader = _Stalled()
    try:
        start = time.monotonic()
        with pytest.raises(FirstBatchTimeoutError) as err:
            next(iterate_with_timeout(loader, _config(0.3)))
        assert time.monotonic() - start < 5
    finally:
        loader.release.set()
    msg = str(err.value)
    assert "no batch within data.first_batch_timeout_s=0.3 s" in msg
    for field in ("data.max_consecutive_skips=1000", "data.max_seq_len=1024", "data.packing_buffer_size=64",
                  "data.first_batch_timeout_s=None"):
        assert field in msg


def test_iterate_with_timeout_is_transparent_otherwise():
    assert list(iterate_with_timeout([1, 2, 3], _config(5))) == [1, 2, 3]
    assert list(iterate_with_timeout([], _config(5))) == []
    assert list(iterate_with_timeout([1, 2], _config(None))) == [1, 2]

    def broken():
        raise KeyError("first batch")
        yield

    class Broken:
        __iter__ = staticmethod(broken)

    with pytest.raises(KeyError, match="first batch"):  # raised in the helper thread, re-raised here
        next(iterate_with_timeout(Broken(), _config(5)))


class _Witness:
    """One object in a reference cycle (only a collection frees it) that records which process finalized it."""

    def __init__(self, path):
        self.path, self.cycle = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_a_loader_worker_finalizes_none_of_the_garbage_it_inherits(long_only, tmp_path, quick_worker_teardown):
    # energon collects garbage in its workers at once; a cycle inherited from the training process would be
    # finalized there, where the threads and handles its destructors use (a process group's, a compiled
    # kernel's) do not exist: in the suite such a collection crashed a worker with a segmentation fault.
    witness = tmp_path / "finalized_by"
    cfg = DataConfig(path=str(long_only), micro_batch_size=1, num_workers=1)
    gc.collect()
    gc.disable()  # the cycle stays garbage until the worker has started
    try:
        _Witness(witness)
        loader = build_train_loader(cfg, dp_rank=0, dp_size=1)
        next(iter(loader))
        assert not witness.exists()  # still garbage here: a collection after the fork would finalize it
    finally:
        gc.enable()
    del loader
    gc.collect()
    assert witness.read_text().split() == [str(os.getpid())]  # this process alone


_SPINNING_TRAINER = """
import sys, threading, time
from multiprocessing import resource_tracker
from energon_data.loader import DataConfig, build_train_loader, iterate_with_timeout

resource_tracker.ensure_running()  # before the workers fork: they inherit its pipe
# Every sample is skipped and there is no limit: both workers stay busy inside energon.
cfg = DataConfig(path=sys.argv[1], max_seq_len=8, micro_batch_size=1, num_workers=2, packing_buffer_size=4,
                 max_consecutive_skips=None, first_batch_timeout_s=None)
loader = build_train_loader(cfg, dp_rank=0, dp_size=1)
threading.Thread(target=lambda: next(iterate_with_timeout(loader, cfg)), daemon=True).start()
time.sleep(600)
"""


def _stat(pid: int):
    """``(state, ppid)`` of ``pid`` from /proc, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and (_stat(int(d)) or ("", 0))[1] == pid]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
    return value


def _ours(pid: int, marker: str) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_busy_workers_and_resource_tracker_die_with_a_killed_trainer(long_only):
    trainer = subprocess.Popen([sys.executable, "-c", _SPINNING_TRAINER, str(long_only)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    children = []
    try:
        def tracker_and_workers():
            children[:] = _children(trainer.pid)
            return len(children) >= 3
        _wait_for(tracker_and_workers, 120, "the resource tracker and two loader workers")
        time.sleep(1.0)  # the workers are now deep inside energon, skipping
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()

        def all_gone():
            return all(_stat(pid) is None or _stat(pid)[0] == "Z" for pid in children)
        _wait_for(all_gone, 10, f"processes {children} (workers, resource tracker) to exit")
    finally:
        trainer.kill()
        for pid in children:  # only after a failure: leave no spinning worker behind
            if _ours(pid, str(long_only)):
                os.kill(pid, signal.SIGKILL)
