"""Helper processes that end with their parent, even after a ``kill -9`` of the parent.

A trainer killed with SIGKILL runs no cleanup, so anything it started that waits for work or for
it (loader workers, the resource tracker they keep alive, megatron's checkpoint writers and their
result-queue manager) would wait forever. Such processes call :func:`exit_with_parent` first
thing; :func:`forked_children_exit_with_parent` does it for every process the caller forks.

Under Slurm a preemption signal (SIGUSR1 at the time-limit warning, SIGTERM on ``scancel``) reaches
every process of the job step, helpers included. The trainer handles it (finish the step, save); a
helper that died of it would take the save down with it, so helpers ignore these signals
(:func:`helper_init`, and :func:`preemption_signals_blocked` while one is being started).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

PARENT_POLL_S = 0.5
_watching_pid = None  # the process whose watcher runs (a forked child inherits the variable, not the thread)
_hooked = False


def exit_with_parent() -> None:
    """Exit this process as soon as its parent is gone (idempotent).

    A thread polling ``getppid`` rather than ``prctl(PR_SET_PDEATHSIG)``: the latter fires when the
    forking *thread* ends, and the loader starts its workers from a short-lived thread.
    """
    global _watching_pid
    if _watching_pid == os.getpid():
        return
    _watching_pid = os.getpid()
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def forked_children_exit_with_parent() -> None:
    """Every process this one forks from now on (loader workers, megatron's checkpoint writers,
    which hang forever in a queue handshake when the trainer dies mid-save) exits with it."""
    global _hooked
    if not _hooked:
        os.register_at_fork(after_in_child=exit_with_parent)
        _hooked = True


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def helper_init() -> None:
    """First thing in a helper process: end with the parent, ignore preemption signals (the trainer
    acts on them), then accept signals again (see :func:`preemption_signals_blocked`)."""
    exit_with_parent()
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)


@contextlib.contextmanager
def preemption_signals_blocked():
    """Hold preemption signals back while a helper process starts: the mask is inherited, so a
    signal that arrives before :func:`helper_init` ran waits instead of killing the helper; this
    process gets it when the block ends.

    multiprocessing's resource tracker, which a spawned helper's start launches when it is not running
    yet, unblocks SIGTERM in the launching thread on its way out: the helper would then be spawned with
    SIGTERM open (a SIGTERM to the process group killed the checkpoint writers' result manager while its
    interpreter was still starting, and the save with it). So the tracker is launched inside the block
    (it inherits SIGUSR1 blocked; it ignores SIGTERM itself) and the block is made again after it."""
    from multiprocessing import resource_tracker
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
