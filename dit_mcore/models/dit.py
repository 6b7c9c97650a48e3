"""The adaLN-Zero DiT (Peebles & Xie, 2023) on megatron-core building blocks.

The model consumes token sequences in megatron's ``[s, b, hidden]`` layout with one conditioning
vector per sample. Dense batches are ``[s, b, patch_dim]`` with a shared grid; packed batches are
``[t, 1, patch_dim]`` with ``cu_seqlens`` and per-sample grids, and attention is block-diagonal, so a
sample's output does not depend on what it is packed with.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import nn

from dit_mcore.config import DiTConfig
from dit_mcore.models.dit_layer import AdaLNModulation, Conditioning, modulate
from dit_mcore.models.embeddings import LabelEmbedder, TimestepEmbedder, sincos_pos_embed
from dit_mcore.models.specs import dit_layer_spec


def _xavier_linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm + zero-initialised projection to the output patch values."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, elementwise_affine=False)
        self.adaLN_modulation = AdaLNModulation(config.hidden_size, chunks=2)
        self.linear = nn.Linear(config.hidden_size, config.out_patch_dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(cond)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(MegatronModule):
    """adaLN-Zero DiT. ``forward`` maps noisy tokens + per-sample (timestep, label) to per-token
    predictions ``[s, b, out_patch_dim]``."""

    model_type = ModelType.encoder_or_decoder  # read by megatron's pipeline schedules
    share_embeddings_and_output_weights = False  # read by finalize_model_grads under PP

    def __init__(self, config: DiTConfig, layer_spec: Optional[ModuleSpec] = None,
                 pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None):
        super().__init__(config)
        self.config: DiTConfig = config
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.input_tensor = None
        h = config.hidden_size
        if pre_process:
            self.x_embedder = _xavier_linear(config.patch_dim, h)
        # Conditioning is cheap: every pipeline stage computes it rather than receiving it.
        self.t_embedder = TimestepEmbedder(h, config.frequency_embedding_size, config.timestep_freq_shift)
        self.y_embedder = LabelEmbedder(config.num_classes, h, config.use_cfg_embedding) \
            if config.num_classes > 0 else None
        spec = layer_spec or dit_layer_spec()
        n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
        self.layers = nn.ModuleList(build_module(spec, config=config, layer_number=i + 1, vp_stage=vp_stage)
                                    for i in range(n_local))
        if post_process:
            self.final_layer = FinalLayer(config)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline parallel: the previous stage's output replaces the patch embedding."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def conditioning(self, timesteps: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """Per-sample conditioning vector ``[n, hidden]`` = timestep embedding + label embedding."""
        c = self.t_embedder(timesteps)
        if self.y_embedder is not None:
            if labels is None:
                raise ValueError(f"this model is class-conditional (num_classes={self.config.num_classes}); "
                                 "pass labels (use the null class to sample unconditionally)")
            c = c + self.y_embedder(labels)
        return c

    def positions(self, grids: Sequence[Sequence[int]], starts: Sequence[int], total: int, device) -> torch.Tensor:
        """Position embeddings of samples with token ``grids`` whose tokens begin at ``starts``;
        rows belonging to no sample (padding) are zero."""
        pos = torch.zeros(total, self.config.hidden_size, device=device)
        for grid, start in zip(grids, starts):
            table = sincos_pos_embed(self.config.hidden_size, tuple(int(g) for g in grid))
            pos[start:start + table.shape[0]] = table.to(device)
        return pos

    def forward(self, tokens: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor] = None,
                *, grid: Optional[Sequence[int]] = None, cu_seqlens: Optional[torch.Tensor] = None,
                cu_seqlens_padded: Optional[torch.Tensor] = None, grids: Optional[torch.Tensor] = None,
                token_to_sample: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the DiT.

        Args:
            tokens: ``[s, b, patch_dim]`` dense, or ``[t, 1, patch_dim]`` packed (ignored on
                pipeline stages after the first, which take ``set_input_tensor``).
            timesteps: ``[n]`` per-sample diffusion timestep values (n = b, or samples in the pack).
            labels: ``[n]`` class labels (``num_classes`` = null class).
            grid: dense only, the shared token grid ``(t, h, w)``; default: the config's image grid.
            cu_seqlens: packed only, ``int32 [n+1]`` cumulative real lengths; tokens past the last
                are padding.
            cu_seqlens_padded: packed only, optional ``int32 [n+1]`` start offsets of samples padded
                individually (TE's convention: sample ``i``'s real tokens come first in
                ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``, the rest is padding).
            grids: packed only, ``[n, 3]`` per-sample token grids.
            token_to_sample: packed only, ``[t]`` sample index per token (-1 for padding); derived
                from ``cu_seqlens`` when omitted.
        """
        packed = cu_seqlens is not None
        cond_emb = self.conditioning(timesteps, labels)
        packed_seq_params = None
        if packed:
            if tokens.shape[1] != 1:
                raise ValueError(f"packed input must be [t, 1, patch_dim], got {tuple(tokens.shape)}")
            total = tokens.shape[0]
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            starts = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:-1].tolist()
            if token_to_sample is None:
                token_to_sample = torch.zeros(total, dtype=torch.long, device=tokens.device)
                for i, (start, n) in enumerate(zip(starts, lengths)):
                    token_to_sample[start:start + n] = i
            cond = Conditioning(cond_emb, token_to_sample.clamp(min=0))
            max_len = max(lengths) if lengths else 0
            packed_seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                                cu_seqlens_q_padded=cu_seqlens_padded,
                                                cu_seqlens_kv_padded=cu_seqlens_padded,
                                                max_seqlen_q=max_len, max_seqlen_kv=max_len)
            pos = self.positions(grids.tolist(), starts, total, tokens.device).unsqueeze(1)
        else:
            cond = Conditioning(cond_emb)
            s = tokens.shape[0] if self.pre_process else self.input_tensor.shape[0]
            side = self.config.input_size // self.config.patch_size
            grid = tuple(grid) if grid is not None else (1, side, side)
            if grid[0] * grid[1] * grid[2] != s:
                raise ValueError(f"grid {grid} has {grid[0] * grid[1] * grid[2]} tokens but the input has {s}; "
                                 "pass grid=(t, h, w) of the patchified latent")
            pos = self.positions([grid], [0], s, tokens.device if self.pre_process else self.input_tensor.device
                                 ).unsqueeze(1)

        if self.pre_process:
            hidden = self.x_embedder(tokens) + pos.to(tokens.dtype)
        else:
            hidden = self.input_tensor
        for layer in self.layers:
            hidden = layer(hidden, cond, packed_seq_params=packed_seq_params)
        if not self.post_process:
            return hidden
        return self.final_layer(hidden, cond)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Layers are keyed by their global index so checkpoints reshard across pipeline layouts."""
        sharded = {}
        # Replicated (non-megatron) children must name the TP group, or megatron marks every TP
        # rank as the main replica of them.
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for name, child in self.named_children():
            if name == "layers":
                continue
            sharded.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=tp_group))
        for layer in self.layers:
            global_idx = layer.layer_number - 1
            sharded.update(layer.sharded_state_dict(f"{prefix}layers.{global_idx}.", sharded_offsets, metadata))
        return sharded


def build_model(config: DiTConfig, *, backend: str = "local", pre_process: bool = True,
                post_process: bool = True, vp_stage: Optional[int] = None) -> DiT:
    """Build a DiT for this rank (its pipeline stage's layers, tensor-parallel shards)."""
    return DiT(config, dit_layer_spec(backend), pre_process=pre_process, post_process=post_process,
               vp_stage=vp_stage)
