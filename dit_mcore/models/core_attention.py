"""megatron-core ``core_attention`` module that runs attention through :mod:`kernels`.

megatron's local ``DotProductAttention`` calls ``torch.cuda`` and needs a mask tensor; DiT attention
is non-causal and block-diagonal over packed samples, which ``kernels.local_attention`` does from
``cu_seqlens``. Under context parallelism each rank holds a contiguous piece of the token stream
(:mod:`dit_mcore.models.token_shard`) and attention runs through
``kernels.context_parallel_attention`` with the config's ``cp_comm_type`` over megatron's CP groups.
Cross-attention (``attention_type="cross"``) attends from this rank's queries to the whole text,
which every rank holds, so it never communicates (``kernels.cross_attention``'s contract).
Inside a compiled layer the same attention runs as planned operators (``kernels.planned_attention``)
and traced functional collectives, so every layout compiles the layer to one graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from dit_mcore.kernels.context_parallel import context_parallel_attention, planned_context_parallel_attention
from dit_mcore.models.st_attention import STPattern, STPlans, st_attention
from dit_mcore.kernels.local_attention import Segments, segment_attention
from dit_mcore.kernels.planned_attention import NO_SEGMENTS, group_key, plan, planned_attention


@dataclass
class KernelsPackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` plus the block-diagonal pattern as host ints, built once per
    micro-batch so no layer syncs with the device to learn it."""

    segments: Optional[Segments] = None
    st: Optional[STPattern] = None
    """ST-DiT: where each sample's frames lie (spatial and temporal attention)."""
    st_plans: Optional[STPlans] = None
    """ST-DiT: ``st`` as plans (:func:`dit_mcore.models.st_attention.st_plans`), which compiled layers
    read, as ``plan`` below."""
    plan: Optional[torch.Tensor] = field(default=None, init=False)
    """``segments`` as a plan (:func:`kernels.planned_attention.plan`), made with the params (and made
    anew by ``dataclasses.replace``): compiled layers hold the attention as one operator that reads it."""

    def __post_init__(self):
        if self.segments is not None:
            self.plan = plan(self.segments)


def packed_seq_params(batch) -> KernelsPackedSeqParams:
    """THD params of a packed ``MicroBatch`` (self-attention: q and kv share the layout)."""
    starts, lens = batch.starts, batch.seqlens
    ends = tuple(a + n for a, n in zip(starts, lens))
    segments = Segments(starts, ends, starts, ends)
    return KernelsPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
        cu_seqlens_q_padded=batch.cu_seqlens_padded, cu_seqlens_kv_padded=batch.cu_seqlens_padded,
        max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen, segments=segments)


class KernelsCoreAttention(MegatronModule):
    """Accepts megatron's core-attention constructor and call signature.

    ``st_kind`` (class attribute of the subclasses below): ST-DiT spatial or temporal attention.
    Grouped-query attention passes through: the kernels take fewer key/value heads (``h % h_kv == 0``)
    and expand only where a kernel or a Ulysses split needs it, so a ring never sends repeated heads.

    Inputs are ``[s, b, h, d]`` (or ``[t, h, d]`` when megatron squeezed a THD batch); the output is
    ``[s, b, h*d]`` (``[t, h*d]``), as megatron's ``SelfAttention`` expects.
    """

    st_kind: Optional[str] = None
    displaced = None
    """``(DisplacedKV, layer index)`` while PipeFusion samples (:mod:`dit_mcore.models.displaced_attention`)."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 **_unused):
        super().__init__(config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("attention_dropout > 0 is not supported by the kernels attention path; "
                             "set attention_dropout=0.0 (DiT trains without it)")
        self.softmax_scale = softmax_scale
        self.cross = attention_type == "cross"
        self.backend = getattr(config, "attention_backend_name", "auto")
        self.cp_method = cp_comm_type or config.cp_comm_type or "p2p"
        if isinstance(self.cp_method, list):  # megatron allows one type per layer
            self.cp_method = self.cp_method[layer_number - 1]
        self.cp_groups = {}
        if config.context_parallel_size > 1 and not self.cross and self.st_kind is None:
            self.cp_groups["cp_group"] = parallel_state.get_context_parallel_group()
            if self.cp_method == "a2a+p2p":
                a2a, p2p = parallel_state.get_hierarchical_context_parallel_groups()
                self.cp_groups.update(a2a_group=a2a, p2p_group=p2p)
        self.cp_group_keys = {name: group_key(group) for name, group in self.cp_groups.items()}

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_unused):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("DiT attention takes no mask or bias: sample boundaries come from "
                             "packed_seq_params.cu_seqlens_q/kv")
        if self.displaced is not None:
            buffer, layer = self.displaced
            return buffer.attend(self, layer, query, key, value, packed_seq_params)
        # A packed pattern is host ints that change with every micro-batch: traced, each new packing
        # would recompile the layer (on an H200, a 3B DiT on 8k-token packs hit dynamo's recompile
        # limit and ran at a third of its speed); communication breaks a graph too. In a compiled
        # layer the attention is operators reading the pattern's plan (a tensor) and naming the
        # context-parallel group by a constant (kernels.planned_attention), and all-to-alls are
        # functional collectives (kernels.collectives): the layer is one graph.
        if torch.compiler.is_compiling() and self._plannable(packed_seq_params):
            return self._attend(query, key, value, packed_seq_params, planned=True)
        if packed_seq_params is None and not self.cross:
            return self._attend(query, key, value, None)
        return _attend_outside_graphs(self, query, key, value, packed_seq_params)

    def _plannable(self, packed_seq_params) -> bool:
        if self.st_kind is not None:  # plans, or dense video under CP: traced switches (functional all-to-alls)
            pattern = getattr(packed_seq_params, "st", None)
            return getattr(packed_seq_params, "st_plans", None) is not None or (
                pattern is not None and pattern.cp_group is not None)
        if self.cp_groups and packed_seq_params is None:  # dense input under context parallel
            return True
        return getattr(packed_seq_params, "plan", None) is not None

    def _local(self, q, k, v, packed_seq_params, segments, planned: bool):
        """Single-device attention of ``[b, s, h, d]`` inputs: the planned operator or the autograd op."""
        if planned:
            return planned_attention(q, k, v, packed_seq_params.plan, softmax_scale=self.softmax_scale,
                                     backend=self.backend)
        return segment_attention(q, k, v, segments=segments, softmax_scale=self.softmax_scale, backend=self.backend,
                                 return_lse=False)

    def _attend(self, query, key, value, packed_seq_params, planned: bool = False, local: bool = False):
        """``local``: attend this rank's queries to the keys and values given, without context parallel's
        exchange (PipeFusion's displaced attention gathers them itself)."""
        if self.cross:
            return self._cross(query, key, value, packed_seq_params, planned)
        if self.st_kind is not None:
            pattern = getattr(packed_seq_params, "st", None)
            if pattern is None:
                raise ValueError(f"{self.st_kind} attention needs packed_seq_params.st (the samples' frame "
                                 "grids, dit_mcore.models.st_attention.STPattern)")
            return st_attention(query, key, value, kind=self.st_kind, pattern=pattern,
                                softmax_scale=self.softmax_scale, backend=self.backend,
                                plans=packed_seq_params.st_plans if planned else None)
        thd = query.dim() == 3
        if thd:  # [t, h, d] -> [1, t, h, d]
            q, k, v = (x.unsqueeze(0) for x in (query, key, value))
        else:  # [s, b, h, d] -> [b, s, h, d]
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        segments = None
        if packed_seq_params is not None and not planned:
            p = packed_seq_params
            segments = getattr(p, "segments", None) or Segments.from_cu_seqlens(
                p.cu_seqlens_q, p.cu_seqlens_kv, p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded)
        if self.cp_groups and not local and planned:
            out = planned_context_parallel_attention(
                q, k, v, NO_SEGMENTS if packed_seq_params is None else packed_seq_params.plan, method=self.cp_method,
                group_keys=self.cp_group_keys, softmax_scale=self.softmax_scale, backend=self.backend,
                **self.cp_groups)
        elif self.cp_groups and not local:
            out = context_parallel_attention(q, k, v, method=self.cp_method, segments=segments,
                                             softmax_scale=self.softmax_scale, backend=self.backend,
                                             **self.cp_groups)
        else:
            out = self._local(q, k, v, packed_seq_params, segments, planned)
        if thd:
            return out.squeeze(0).flatten(-2)
        return out.transpose(0, 1).flatten(-2)

    def _cross(self, query, key, value, packed_seq_params, planned: bool = False):
        """Queries ``[s, b, h, d]`` (rows in the stream order ``b`` then ``s``) against the text stream
        ``[L, 1, h, d]``, with the block-diagonal pattern in ``packed_seq_params.segments``."""
        segments = None if planned else getattr(packed_seq_params, "segments", None)
        if segments is None and not planned:
            raise ValueError("cross-attention needs packed_seq_params.segments (which text each query "
                             "sample attends to); build it with dit_mcore.models.text.cross_segments")
        s, b = query.shape[:2]
        q = query.transpose(0, 1).reshape(1, b * s, *query.shape[2:])
        k, v = (x.reshape(1, -1, *x.shape[-2:]) for x in (key, value))
        out = self._local(q, k, v, packed_seq_params, segments, planned)
        return out.view(b, s, -1).transpose(0, 1)


@torch.compiler.disable
def _attend_outside_graphs(attention: KernelsCoreAttention, query, key, value, packed_seq_params):
    # contiguous: the kernels' output layout follows the packing, and a traced consumer guards on strides
    return attention._attend(query, key, value, packed_seq_params).contiguous()


class SpatialCoreAttention(KernelsCoreAttention):
    """ST-DiT: attention within each frame."""

    st_kind = "spatial"


class TemporalCoreAttention(KernelsCoreAttention):
    """ST-DiT: attention across the frames at each position."""

    st_kind = "temporal"
