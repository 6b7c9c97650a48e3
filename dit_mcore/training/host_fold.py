"""The EMA's fold with the shadow in host memory (``trainer.ema_offload``): the weights are copied
into one pinned host buffer per dtype on a side CUDA stream, from the point where the update that
wrote them was queued (an event), so the copies run beside the next step's forward and backward
instead of in the compute stream's queue (MovieGen-3B: 6.6 GB, ~140 ms on an H100 per fold); a
thread then lerps them into the fp32 shadow while training goes on. Whoever writes the weights next
first makes the compute stream wait for the copies (:meth:`HostFold.fence`: the trainer before each
update). The next fold, and every reader of the shadow, waits for the thread (:meth:`HostFold.wait`)."""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

CHUNK = 1 << 22
"""Elements per task of the host lerp (16 MiB of fp32): a bounded temporary per task, and tasks enough
to spread over the workers."""


def host_workers() -> int:
    """Threads for the host lerp: one when torch's own intra-op threads parallelise each op; under
    torchrun (one intra-op thread per process) the node's cores shared by its local ranks, at most 8."""
    if torch.get_num_threads() > 1:
        return 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // max(local, 1)))


class HostFold:
    """``shadow += weight * (param - shadow)`` for host ``shadow`` tensors from ``params`` anywhere."""

    def __init__(self, params: list[torch.Tensor]):
        pin = torch.cuda.is_available()
        by_dtype: dict[torch.dtype, int] = {}
        for p in params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        # one flat buffer per dtype (pinned buffers are rounded up to a power of two each: not one per tensor)
        flat = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in by_dtype.items()}
        offsets = dict.fromkeys(flat, 0)
        self.staged = []
        for p in params:
            start = offsets[p.dtype]
            self.staged.append(flat[p.dtype][start:start + p.numel()].view(p.shape))
            offsets[p.dtype] = start + p.numel()
        self.workers = host_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ema-host-fold") if self.workers > 1 else None
        self._pending: threading.Thread | None = None
        self._stream: torch.cuda.Stream | None = None
        """The side stream of the device-to-host copies (CUDA weights; made at the first fold)."""
        self._copied: tuple[torch.cuda.Event, torch.device] | None = None
        """The copies in flight and their device, until a :meth:`fence` or :meth:`wait` has ordered them."""
        self._failure: BaseException | None = None
        self._stall_said = False

    def start(self, shadow: list[torch.Tensor], params: list[torch.Tensor], weight: float,
              ready: torch.cuda.Event | None = None) -> None:
        """Queue the copies of ``params`` and start the host lerp; returns without waiting for either.
        CUDA weights are copied on a side stream from ``ready`` (an event recorded where they were
        final: after the update that wrote them; none: now, on the current stream); nothing may write
        them before :meth:`fence`. Waits first for the fold before (its buffers are refilled here) and
        names a stall once."""
        begin = time.perf_counter()
        self.wait()
        self._note_stall(time.perf_counter() - begin)
        copied, device = None, None
        if any(p.is_cuda for p in params):
            device = next(p.device for p in params if p.is_cuda)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            if ready is None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
            self._stream.wait_event(ready)
            with torch.cuda.stream(self._stream):
                for staged, p in zip(self.staged, params):
                    staged.copy_(p, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            self._copied = copied, device
        else:
            for staged, p in zip(self.staged, params):
                staged.copy_(p)
        tasks = [(s.view(-1), staged.view(-1), i) for s, staged in zip(shadow, self.staged)
                 for i in range(0, s.numel(), CHUNK)]

        def lerp(task):
            s, staged, i = task
            s[i:i + CHUNK].lerp_(staged[i:i + CHUNK].float(), weight)

        def fold():
            try:
                if copied is not None:
                    torch.cuda.set_device(device)  # a new thread is on device 0: no context on another rank's GPU
                    copied.synchronize()
                if self._pool is None:
                    for task in tasks:
                        lerp(task)
                else:
                    list(self._pool.map(lerp, tasks))
            except BaseException as e:  # raised again by wait()
                self._failure = e

        self._pending = threading.Thread(target=fold, name="ema-host-fold", daemon=True)
        self._pending.start()

    def fence(self) -> None:
        """Make the current CUDA stream wait for the copies in flight (without the host waiting):
        called before anything there writes the weights they read."""
        if self._copied is not None:
            copied, device = self._copied
            torch.cuda.current_stream(device).wait_event(copied)
            self._copied = None

    def wait(self) -> None:
        """Finish the fold in flight (its copies first), raising what it raised."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
            self._copied = None  # the thread saw them done
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError("the EMA's host fold failed") from failure

    def _note_stall(self, seconds: float) -> None:
        if seconds > 0.05 and not self._stall_said:
            self._stall_said = True
            log.warning("the EMA's host fold (trainer.ema_offload) outlasted trainer.ema_every steps: training "
                        "waited %.2f s for it; raise trainer.ema_every", seconds)
