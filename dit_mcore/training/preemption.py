"""Preemption as routine: SIGTERM or SIGUSR1 (what Slurm sends before a kill or at the time limit,
``--signal=USR1@<s>``) makes the run finish its step, save, and exit with
:data:`EXIT_PREEMPTED`; running the same command again resumes from that checkpoint.

The signal only sets a flag. After each step's forward and backward an asynchronous all-reduce
(max) of every rank's flag over the world starts, and its result is read with the step's other
metrics (the logged loss), so the vote adds no synchronisation and every rank stops after the same
step (a signal that arrives after the vote started waits for the next vote). No rank-dependent
world collective may run between :meth:`PreemptionSignals.start_vote` and
:meth:`PreemptionSignals.ballot`. After SIGUSR1 under Slurm, rank 0 also
requeues the job (``scontrol requeue``), as the time-limit warning means "continue later";
SIGTERM (``scancel``, scheduler preemption) leaves requeueing to Slurm's own policy.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Optional

import torch
import torch.distributed as dist

from energon_data.lifetime import PREEMPTION_SIGNALS

log = logging.getLogger("dit_mcore.train")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "temporary failure; retry" (sysexits.h)
SIGNALS = PREEMPTION_SIGNALS  # energon_data.lifetime's helpers ignore the same ones


class Preempted(SystemExit):
    """Raised after the checkpoint of a preempted run is written; exits with EXIT_PREEMPTED."""

    def __init__(self, step: int, signame: str, checkpoint):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.signame, self.checkpoint = step, signame, checkpoint

    def __str__(self) -> str:
        saved = f"saved {self.checkpoint}" if self.checkpoint else "no checkpoint saved"
        return (f"preempted by {self.signame} after step {self.step}; {saved}; "
                f"run the same command to resume (exit code {EXIT_PREEMPTED})")


class PreemptionSignals:
    """Context manager: while active, SIGTERM/SIGUSR1 request a stop instead of killing the process.
    Child processes forked meanwhile (loader workers, checkpoint writers) ignore them: they end with
    the trainer."""

    def __init__(self):
        self.received: Optional[int] = None
        self.agreed: Optional[int] = None
        self._ballot: Optional[torch.Tensor] = None
        self._vote = None  # the all-reduce in flight
        self._previous: dict = {}
        self._owner = os.getpid()
        self.step_in_progress = 1  # the step the trainer is in (or starts next), for the message
        self._voted = False  # whether that step's vote has started (a later signal counts at the next one)

    def __enter__(self) -> "PreemptionSignals":
        if os.getpid() == self._owner and _in_main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._owner:
            # A forked child (loader worker, checkpoint writer). Slurm signals every process of the
            # step; the trainer saves and stops, and the child ends with it (energon_data.lifetime).
            signal.signal(signum, signal.SIG_IGN)
            return
        if self.received is None:
            saves_after = self.step_in_progress + self._voted
            log.warning("received %s at step %d: saving after step %d at the latest, then exiting",
                        signal.Signals(signum).name, self.step_in_progress, saves_after)
        self.received = signum

    def begin(self, step: int) -> None:
        """The trainer starts ``step``: a signal from now until this step's vote stops the run after it."""
        self.step_in_progress, self._voted = step, False

    def start_vote(self, device) -> None:
        """Start combining every rank's flag (max over the world) without waiting for it; call
        once per step on every rank, before :meth:`ballot`."""
        # A fill kernel, not a copy from pageable host memory (which would sync the stream).
        self._ballot = torch.full((1,), float(self.received or 0), device=device)
        self._voted = True
        self._vote = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._vote = dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, async_op=True)

    def ballot(self) -> torch.Tensor:
        """The vote started by :meth:`start_vote`: a one-element device tensor holding the signal any
        rank had received (0: none), the same on every rank; waits for the all-reduce (on a GPU
        the stream waits, the host does not)."""
        if self._vote is not None:
            self._vote.wait()
            self._vote = None
        return self._ballot

    def settle(self, ballot_sum: float, replicas: int) -> None:
        """Record the vote's outcome from the ballot summed over ``replicas`` ranks (each holding the
        same world-wide vote) as :attr:`agreed`: the signal to act on after this step, or None."""
        self.agreed = round(ballot_sum / replicas) or None


def requeue_if_slurm(signum: int) -> None:
    """After the time-limit warning (SIGUSR1), put the Slurm job back in the queue (rank 0 only)."""
    job = os.environ.get("SLURM_JOB_ID")
    if signum != signal.SIGUSR1 or not job or (dist.is_initialized() and dist.get_rank() != 0):
        return
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, text=True, timeout=60)
        log.info("requeued Slurm job %s", job)
    except (OSError, subprocess.SubprocessError) as e:
        log.error("could not requeue Slurm job %s (%s); resubmit the same command to resume", job, e)


def _in_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
