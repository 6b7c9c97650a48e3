"""Attention kernels for dit-mcore: local (dense + packed) and context-parallel attention.

Pure torch + torch.distributed (gloo on CPU, NCCL on GPU); nothing here imports the model,
megatron or energon, so the package is usable and testable on its own. It installs as
``dit_mcore.kernels`` (``setup.py``): a bare ``kernels`` is Hugging Face's package. Where a
checkout's root is on ``sys.path`` this folder is reachable as ``kernels`` too (``transformers``
imports it there, probing for Hugging Face's version); importing this file runs nothing, and its
names load from their modules on first use only as ``dit_mcore.kernels``, so the operators are
never registered twice.
"""
import importlib

_NAMES = {
    "collectives": ("all_gather_dim", "all_to_all", "reduce_scatter_dim"),
    # (the function local_attention is imported from its module, which has the same name)
    "local_attention": ("Segments", "attention_backward", "attention_forward", "segment_attention"),
    # context-parallel attention (dense + packed)
    "context_parallel": ("CP_METHODS", "build_hybrid_groups", "context_parallel_attention", "cross_attention"),
    "packing": ("CPPackedLayout", "split_packed_for_cp"),
    "comm_counter": ("CommCounter", "CommEvent", "count_comm"),
    "spatial_temporal": ("STLayout", "make_st_mesh", "spatial_attention", "st_attention", "st_qkv_attention",
                         "temporal_attention"),
    "st_switch": ("switch_shard",),
}
_HOME = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if __name__ != "dit_mcore.kernels":  # a bare `kernels` (a checkout on sys.path): not ours to load
        raise AttributeError(f"{name!r}: dit-mcore's kernels install as dit_mcore.kernels; import it from there")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
