"""Displaced patch attention (PipeFusion, Wang et al. 2024, arXiv 2405.14430): self-attention of one
patch of the token stream against keys and values of the whole stream, in which the other patches'
entries are the newest this layer computed, i.e. from the current diffusion step for the patches
before this one and from the previous step for those after it.

A :class:`DisplacedKV` holds, for each self-attention layer it is installed on, the keys and values
of the whole stream. With ``patch`` unset the layer sees the whole stream: it attends as usual and
(re)fills its buffer, which is how the synchronous warm-up steps run. With ``patch=(start, end)``
the layer sees only those tokens: their fresh keys and values overwrite that slice of the buffer,
and the patch's queries attend to the whole buffer (the ST-DiT's spatial layers to the frames the patch
meets, its temporal layers to the positions: :func:`~dit_mcore.models.st_attention.displaced_st_attention`).

Under context parallel each rank sees a piece of the unit's tokens (the whole stream's, or the
patch's): the layer all-gathers the pieces' keys and values over the CP group, so every rank keeps the
whole buffer, and attends from its own queries locally (whatever ``cp_comm_type`` says: the buffer
makes every method an all-gather of the fresh keys and values).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


class DisplacedKV:
    """Whole-stream keys and values of the self-attention layers of one model chunk."""

    def __init__(self):
        self.patch: Optional[tuple[int, int]] = None
        """``[start, end)`` of the tokens the layers see now; None: the whole stream."""
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def install(self, chunk: nn.Module) -> int:
        """Route every self-attention of ``chunk`` (the ST-DiT's spatial and temporal ones too) through this
        buffer; returns how many. Cross-attention to the text is unchanged (every patch attends to all of it
        anyway)."""
        from dit_mcore.models.core_attention import KernelsCoreAttention
        layers = [m for m in chunk.modules() if isinstance(m, KernelsCoreAttention) and not m.cross]
        for i, module in enumerate(layers):
            module.displaced = (self, i)
        return len(layers)

    def reset(self) -> None:
        """Forget every buffer (a new batch of items)."""
        self._kv.clear()
        self.patch = None

    def attend(self, attention, layer: int, query, key, value, packed_seq_params=None):
        """``attention``'s output for ``query`` (``[s, b, h, d]``), against this layer's buffer. The ST-DiT's
        layers take the frames of the whole dense rows from ``packed_seq_params.st``."""
        group = attention.cp_groups.get("cp_group")
        if attention.st_kind is not None:  # the ST-DiT's frames are split over the pattern's group
            group = packed_seq_params.st.cp_group
        offset = 0  # where this rank's queries start in the unit's tokens
        if group is not None:  # the unit's keys and values from every CP rank's piece
            key, value = (_gathered(x, group) for x in (key, value))
            offset = dist.get_rank(group) * query.shape[0]
        if self.patch is None:
            self._kv[layer] = (key.clone(), value.clone())
            keys, values, start = key, value, 0
        else:
            if layer not in self._kv:
                raise RuntimeError("displaced attention before the buffer was filled: run at least one "
                                   "whole-stream (warm-up) call first")
            keys, values = self._kv[layer]
            start, end = self.patch
            if keys.shape[1] != key.shape[1] or end - start != key.shape[0]:
                raise RuntimeError(f"patch [{start}, {end}) of {key.shape[1]} rows does not fit the buffer "
                                   f"{tuple(keys.shape[:2])}")
            keys[start:end] = key
            values[start:end] = value
        if attention.st_kind is not None:
            from dit_mcore.models.st_attention import displaced_st_attention
            frames, positions = packed_seq_params.st.grids[0]
            return displaced_st_attention(query, keys, values, kind=attention.st_kind, frames=frames,
                                          positions=positions, start=start + offset,
                                          softmax_scale=attention.softmax_scale, backend=attention.backend)
        return attention._attend(query, keys, values, None, local=True)


def _gathered(x: torch.Tensor, group) -> torch.Tensor:
    """The rows of ``x`` (``[s, ...]``) of every rank of ``group``, in rank order."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out
