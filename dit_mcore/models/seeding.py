"""Layout-independent initialisation: every part of a model is initialised from its own RNG stream,
keyed by a base seed and the part's global name (``layers.7``, ``t_embedder`` …).

A pipeline stage builds only some parts, and in another order than one process does; with one
stream per part, global layer 7 gets the same initial weights whatever the layout, and the
conditioning embedders every stage holds start identical on all of them.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from torch import nn

PartCallback = Callable[[str, list], None]
_on_part: Optional[PartCallback] = None


def draw_base_seed() -> int:
    """A base seed from the caller's RNG (the same on every rank after the same ``manual_seed``)."""
    return int(torch.randint(2 ** 31 - 1, (1,), device="cpu"))


@contextlib.contextmanager
def init_stream(base_seed: int, key: str):
    """Run the enclosed construction on the RNG stream of part ``key``; the caller's RNG states are
    restored afterwards.

    Two sources are seeded: torch's generators (CPU, where megatron initialises each whole weight
    and splits it, and the current CUDA device) and megatron's model-parallel RNG tracker, which
    megatron's GPU initialisation of tensor/expert-parallel weights draws from (reseeded the way
    ``model_parallel_cuda_manual_seed`` does, so those weights still differ per TP/EP rank, as in
    megatron, but no longer per pipeline stage)."""
    seed = (base_seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 31 - 1)
    owned = []  # (module, attribute) of every parameter and buffer the part registers
    hooks = [] if _on_part is None else [
        nn.modules.module.register_module_parameter_registration_hook(lambda m, n, t: owned.append((m, n))),
        nn.modules.module.register_module_buffer_registration_hook(lambda m, n, t: owned.append((m, n)))]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = tracker.get_states()
    with torch.random.fork_rng(devices=devices):
        # (without CUDA, torch.manual_seed still queues a CUDA seed with a formatted traceback: ~2-7 ms a part)
        (torch.manual_seed if devices else torch.default_generator.manual_seed)(seed)
        if parallel_state.model_parallel_is_initialized():
            tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        try:
            yield
            if _on_part is not None:
                for hook in hooks:
                    hook.remove()
                hooks.clear()
                _on_part(key, _dedup_tensors(owned))
        finally:
            for hook in hooks:
                hook.remove()
            tracker.reset()
            tracker.set_states(saved)


def _dedup_tensors(owned: list) -> list:
    """(module, name) pairs in registration order, once each, that still hold a tensor."""
    seen, out = set(), []
    for module, name in owned:
        if (id(module), name) not in seen and getattr(module, name, None) is not None:
            seen.add((id(module), name))
            out.append((module, name))
    return out


@contextlib.contextmanager
def on_each_part(callback: PartCallback):
    """Within, every :func:`init_stream` part, once built, calls ``callback(key, owned)`` with the
    ``(module, attribute)`` of each parameter and buffer it registered, in registration order (the
    same order on every build of the same model)."""
    global _on_part
    previous, _on_part = _on_part, callback
    try:
        yield
    finally:
        _on_part = previous


def materialize_parts(build: Callable[[], nn.Module], parts: list,
                      copy_into: Callable[[torch.Tensor, torch.Tensor], None] = torch.Tensor.copy_) -> None:
    """Fill a model built on the meta device (and allocated since, e.g. with ``to_empty``; FSDP2
    shards allowed) one part at a time: ``build()`` builds the same model again on the CPU, with
    the same init seed, and as each part is built its values are copied into the matching
    parameters and buffers of ``parts`` (the ``on_each_part`` record of the meta build) with
    ``copy_into(target, whole)`` (for FSDP2 shards: ``dit_mcore.parallel.fsdp.copy_into``) and freed.
    The whole model never exists at once; the values are bit-identical to a direct build."""
    remaining = iter(parts)

    def fill(key: str, owned: list) -> None:
        target_key, targets = next(remaining)
        if target_key != key or len(targets) != len(owned):
            raise RuntimeError(f"rebuilding part {key!r} does not match the meta build's {target_key!r}")
        for (module, name), (target_module, target_name) in zip(owned, targets):
            source = getattr(module, name)
            copy_into(getattr(target_module, target_name), source.detach())
            source.data = torch.empty(0, dtype=source.dtype)  # the part is done: free it

    with on_each_part(fill), torch.device("cpu"):
        build()
    if next(remaining, None) is not None:
        raise RuntimeError("the rebuild made fewer parts than the meta build")
