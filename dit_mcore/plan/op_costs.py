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


def group_names() -> dict:
    """``{process group: name}`` for the groups of megatron's parallel state a rank's work can talk over
    ("tp", "cp", "cp_inner" and "cp_outer" (a2a+p2p's levels), "tp_cp", "ep", "etp", "tp_ep", "pp", "dp"); empty
    outside an initialised state."""
    from megatron.core import parallel_state as ps
    if not ps.is_initialized():
        return {}
    getters = [("tp", ps.get_tensor_model_parallel_group), ("cp", ps.get_context_parallel_group),
               ("tp_cp", ps.get_tensor_and_context_parallel_group), ("ep", ps.get_expert_model_parallel_group),
               ("etp", ps.get_expert_tensor_parallel_group), ("tp_ep", ps.get_expert_tensor_and_model_parallel_group),
               ("pp", ps.get_pipeline_model_parallel_group),
               ("dp", ps.get_data_parallel_group)]
    names = {}
    for name, get in getters:
        try:
            group = get()
        except (AssertionError, RuntimeError):  # (a group this layout does not have)
            group = None
        if group is not None and group not in names:
            names[group] = name
    for name, group in zip(("cp_inner", "cp_outer"), ps.get_hierarchical_context_parallel_groups(False) or ()):
        names.setdefault(group, name)
    return names


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


class OpCosts(TorchDispatchMode):
    """``with OpCosts() as c: work()``; then ``c.gemm_flops``, ``c.attention`` (``{s_k: FLOPs}`` by the length
    of the keys each query attends to, forward ``4 s_q s_k d`` per head, backward twice that), ``c.memory_bytes`` (read + written by the other operators; views cost
    nothing) and ``c.comm``
    (``{(collective, group name, group size): bytes}``: the whole gathered or reduced buffer, an all-to-all's
    local part, what a rank sends; the group's name from :func:`group_names`, "other" for a group of its own)."""

    def __init__(self):
        super().__init__()
        self.gemm_flops = 0.0
        self.attention: dict = collections.defaultdict(float)
        self.memory_bytes = 0.0
        self.comm: dict = collections.defaultdict(float)
        self.ops: dict = collections.defaultdict(float)
        """``{(operator, "calls" | "flops" | "bytes"): amount}``: the same work, operator by operator."""
        self._names = group_names()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet, name = func.overloadpacket, func.overloadpacket.__name__
        if func.namespace == "c10d":
            if name in COLLECTIVES:  # (a receive is its sender's send)
                kind, index = COLLECTIVES[name]
                groups = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.ScriptObject)]
                group = dist.ProcessGroup.unbox(groups[0]) if groups else None
                name = self._names.get(group, "other") if group is not None else "other"
                self.comm[kind, name, group.size() if group is not None else 0] += _nbytes(args[index])
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            if "attention" in name:
                self.attention[_keys_length(name, args)] += flops
            else:
                self.gemm_flops += flops
            self._count(name, "flops", flops)
        elif name in _CPU_FLASH:
            q, k = (args[0], args[1]) if name.endswith("cpu") else (args[1], args[2])
            b, h, s_q, d = q.shape
            flops = _CPU_FLASH[name] * 4 * b * h * s_q * k.shape[2] * d
            self.attention[int(k.shape[2])] += flops
            self._count(name, "flops", flops)
        elif _moves_data(func, args, out):  # (an in-place operator reads and writes its input: counted twice)
            moved = _nbytes((args, kwargs)) + _nbytes(out)
            self.memory_bytes += moved
            self._count(name, "bytes", moved)
        return out

    def _count(self, name: str, measure: str, amount: float) -> None:
        self.ops[name, "calls"] += 1
        self.ops[name, measure] += amount


def _keys_length(name: str, args) -> int:
    """How many keys each query of an attention operator in torch's FLOP registry attends to: SDPA's
    operators take q, k, v as ``[b, h, s, d]`` (a backward's after the output's gradient); the others
    (``[b, s, h, d]`` or varlen ``[t, h, d]``) are counted as length 0, priced at the shortest length's rate."""
    if not name.startswith("_scaled_dot_product"):
        return 0
    return int(args[2 if name.endswith("backward") else 1].shape[-2])


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
