"""Attention kernels for dit-mcore: local (dense + packed) and context-parallel attention.

Pure torch + torch.distributed (gloo on CPU, NCCL on GPU); nothing here imports the model,
megatron or energon, so the package is usable and testable on its own.
"""
from .collectives import all_gather_dim, all_to_all, reduce_scatter_dim
from .local_attention import Segments, attention_backward, attention_forward, local_attention, segment_attention

# ---- context-parallel attention (dense + packed) --------------------------------------------
from .context_parallel import CP_METHODS, build_hybrid_groups, context_parallel_attention, cross_attention
from .packing import CPPackedLayout, split_packed_for_cp

# ---- other modules append their imports below this line (spatial_temporal, comm_counter) ----
from .comm_counter import CommCounter, CommEvent, count_comm
from .spatial_temporal import (STLayout, make_st_mesh, spatial_attention, st_attention, st_qkv_attention,
                               temporal_attention)
from .st_switch import switch_shard
