"""Run a function on N gloo processes (CPU) and collect what each rank returns.

Used by every multi-process test: fresh processes per call, tiny shapes, results come back to the
pytest process so assertions run there (a failed assertion in a child would only hang).

The ranks are forked from a fork server that imported torch and megatron-core once per pytest process
(``multiprocessing``'s ``forkserver`` start method with preloaded modules), instead of each spawned rank
importing them again (about 4.5 s of CPU per rank on the 2-core CI machine). Each rank takes
the calling process's environment at the call (a fork server's children would otherwise inherit the
server's, from when it started).
"""
from __future__ import annotations

import faulthandler
import gc
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What every rank imports anyway (multiprocessing skips one that raises ImportError; any other error stops the server).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state", "dit_mcore.training.trainer"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, out_dir, environ):
    gc.freeze()  # the preloaded modules' objects: the collector's passes (and the layout cases' gc.collect) skip them
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    faulthandler.enable()  # a rank that crashes in native code prints where (the parent sees only a signal)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:  # noqa: BLE001 - shipped back to the parent as text
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        if dist.is_initialized():  # (a command's main may have ended the group itself, as a launched one does)
            dist.destroy_process_group()


def thread_count() -> int:
    """This process's threads (Linux): gloo runs a few for every process group alive."""
    return len(os.listdir("/proc/self/task"))


def run_distributed(fn, world_size: int, *args):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    ``fn`` must be a module-level function (picklable). Returns the list of per-rank return
    values; raises ``RuntimeError`` carrying the child's traceback if any rank failed.
    """
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts (first call)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, dict(os.environ)),
                           nprocs=world_size, join=True, start_method="forkserver")
        results = [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
                   for r in range(world_size)]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if not res["ok"]]
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [res["result"] for res in results]
