"""What a stretch of work asks of the device, operator by operator, read from the dispatcher like
:class:`~dit_mcore.plan.live_memory.LiveMemory` (and on fake tensors alike): the FLOPs of the matrix
products and attention kernels (torch's own FLOP formulas, ``torch.utils.flop_counter``), the bytes the
other operators read and write (the memory-bound work: norms, modulation, activations, casts, copies),
and every collective with its bytes and group size. The step-time model prices these."""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

# torch's c10d operators -> (the collective, which argument holds its whole buffer: the gathered output,
# the input to reduce-scatter, this rank's part of an all-to-all, what a rank sends)
COLLECTIVES = {"_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
               "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
               "allreduce_": ("all_reduce", 0), "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
               "send": ("p2p", 0), "broadcast_": ("broadcast", 0)}
# attention kernels with no FLOP formula in torch's registry: the CPU's flash operator (q, k, v first)
# (FLOPs per forward's, the backward's two products for each of the forward's: 2x)
_CPU_FLASH = {"_scaled_dot_product_flash_attention_for_cpu": 1, "_scaled_dot_product_flash_attention_for_cpu_backward": 2}


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


class OpCosts(TorchDispatchMode):
    """``with OpCosts() as c: work()``; then ``c.gemm_flops``, ``c.attention_flops`` (forward ``4 s_q s_k d``
    per head, backward twice that), ``c.memory_bytes`` (read + written by the other operators; views cost
    nothing) and ``c.comm``
    (``{(collective, group size): bytes}``: the whole gathered or reduced buffer, an all-to-all's local part,
    what a rank sends)."""

    def __init__(self):
        super().__init__()
        self.gemm_flops = 0.0
        self.attention_flops = 0.0
        self.memory_bytes = 0.0
        self.comm: dict = collections.defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet, name = func.overloadpacket, func.overloadpacket.__name__
        if func.namespace == "c10d":
            if name in COLLECTIVES:  # (a receive is its sender's send)
                kind, index = COLLECTIVES[name]
                groups = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.ScriptObject)]
                size = dist.ProcessGroup.unbox(groups[0]).size() if groups else 0
                self.comm[kind, size] += _nbytes(args[index])
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            attention = "attention" in name
            if attention:
                self.attention_flops += flops
            else:
                self.gemm_flops += flops
        elif name in _CPU_FLASH:
            q, k = (args[0], args[1]) if name.endswith("cpu") else (args[1], args[2])
            b, h, s_q, d = q.shape
            self.attention_flops += _CPU_FLASH[name] * 4 * b * h * s_q * k.shape[2] * d
        elif _moves_data(func, args, out):  # (an in-place operator reads and writes its input: counted twice)
            self.memory_bytes += _nbytes((args, kwargs)) + _nbytes(out)
        return out


def _moves_data(func, args, out) -> bool:
    """False for metadata queries (``prim::device``), views, and operators that hand back an input's
    storage without writing it (``_unsafe_view``)."""
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outs or func.namespace == "prim" or func.is_view or func.__name__.startswith("empty"):
        return False  # (an empty tensor is allocated, not written)
    if func._schema.is_mutable:
        return True
    inputs = {id(t.untyped_storage()) for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    return not all(id(t.untyped_storage()) in inputs for t in outs)
