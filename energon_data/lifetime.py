"""Helper processes that end with their parent, even after a ``kill -9`` of the parent.

A trainer killed with SIGKILL runs no cleanup, so anything it started that waits for work or for
it (loader workers, the resource tracker they keep alive, megatron's checkpoint writers and their
result-queue manager) would wait forever. Such processes call :func:`exit_with_parent` first
thing; :func:`forked_children_exit_with_parent` does it for every process the caller forks.
"""
from __future__ import annotations

import os
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
