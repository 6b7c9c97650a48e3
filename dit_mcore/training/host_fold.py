"""The EMA's fold with the shadow in host memory (``trainer.ema_offload``): the weights are copied
into one pinned host buffer per dtype on a side CUDA stream, and a thread lerps them into the fp32
shadow while training goes on.

The trainer queues the copies right after the update that wrote the weights (:meth:`HostFold.stage`),
before the next step's forward and backward, so they run beside that work instead of in the compute
stream's way (MovieGen-3B: 6.6 GB, ~140 ms on an H100 per fold on the compute stream); queued later,
under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue, as the Docker image sets) they would start
only once the work queued before them had been dispatched. The fold (:meth:`HostFold.start`) then lerps
from those copies. Whoever writes the weights next first makes the compute stream wait for the copies
(:meth:`HostFold.fence`: the trainer before each update); a fence, or a reader's :meth:`HostFold.wait`,
also drops copies no fold used, so a fold never reads weights older than the last write. The next
fold, and every reader of the shadow, waits for the thread (:meth:`HostFold.wait`)."""
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
        """The side stream of the device-to-host copies (CUDA weights; made at the first copies)."""
        self._copied: tuple[torch.cuda.Event, torch.device] | None = None
        """The copies queued last and their device, until a :meth:`fence` or :meth:`wait` has ordered them."""
        self._staged = False
        """Whether the staged buffers hold (or will, once ``_copied`` is done) the weights as they are now."""
        self._failure: BaseException | None = None
        self._stall_said = False

    def stage(self, params: list[torch.Tensor], block: bool = True) -> None:
        """Queue the copies of ``params`` into the pinned buffers (CUDA weights: on the side stream, from
        this point of the current stream; elsewhere at once), for the next :meth:`start`. Nothing may
        write the weights before :meth:`fence`. Waits first for the fold before (it reads the buffers);
        with ``block=False`` (the trainer, right after an update: the device has little queued then)
        stages nothing while that fold still runs, and :meth:`start` copies at the fold instead."""
        if not block and self._pending is not None and self._pending.is_alive():
            return
        begin = time.perf_counter()
        self.wait()
        self._note_stall(time.perf_counter() - begin)
        cuda = [p.device for p in params if p.is_cuda]
        if cuda:
            device = cuda[0]
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for staged, p in zip(self.staged, params):
                    staged.copy_(p, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            self._copied = copied, device
        else:
            for staged, p in zip(self.staged, params):
                staged.copy_(p)
        self._staged = True

    def start(self, shadow: list[torch.Tensor], params: list[torch.Tensor], weight: float) -> None:
        """Lerp the staged copies of ``params`` into the host ``shadow`` in a thread, staging them first
        unless :meth:`stage` did since the last write (:meth:`fence`); returns without waiting."""
        if not self._staged:
            self.stage(params)
        self._staged = False
        copied, device = self._copied if self._copied is not None else (None, None)
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
        """Before the weights are written: the current CUDA stream waits for the copies in flight (the
        host does not), and staged copies no fold used are dropped (they would be stale)."""
        self._staged = False
        if self._copied is not None:
            copied, device = self._copied
            torch.cuda.current_stream(device).wait_event(copied)
            self._copied = None

    def wait(self) -> None:
        """Finish the fold in flight (its copies first), raising what it raised; staged copies no fold
        used are dropped (a reader may write the weights next, e.g. a checkpoint load)."""
        self._staged = False
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._copied is not None:
            self._copied[0].synchronize()
            self._copied = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError("the EMA's host fold failed") from failure

    def _note_stall(self, seconds: float) -> None:
        if seconds > 0.05 and not self._stall_said:
            self._stall_said = True
            log.warning("the EMA's host fold (trainer.ema_offload) outlasted trainer.ema_every steps: training "
                        "waited %.2f s for it; raise trainer.ema_every", seconds)
