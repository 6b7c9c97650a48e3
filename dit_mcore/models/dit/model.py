"""The adaLN-Zero DiT (Peebles & Xie, 2023) on megatron-core building blocks.

The model consumes token sequences in megatron's ``[s, b, hidden]`` layout with one conditioning
vector per sample. Dense batches are ``[s, b, patch_dim]`` with a shared grid; packed batches are
``[t, 1, patch_dim]`` described by an ``energon_data.batch.MicroBatch`` (per-sample grids, token
positions, ``cu_seqlens``), and attention is block-diagonal, so a sample's output does not depend on
what it is packed with.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import nn

from dit_mcore.models.dit.config import DiTConfig
from dit_mcore.models.core_attention import KernelsPackedSeqParams, packed_seq_params
from dit_mcore.models.dit.spec import dit_layer_spec
from dit_mcore.models.embeddings import (LabelEmbedder, TimestepEmbedder, rope3d_freqs, sincos_from_positions,
                                        sincos_pos_embed)
from dit_mcore.models.aten_linear import MainGradLinear
from dit_mcore.models.layer_stack import LayerStack
from dit_mcore.models.modulation import AdaLNModulation, Conditioning
from dit_mcore.models.recompute import over_chunks
from dit_mcore.models.seeding import draw_base_seed, init_stream
from dit_mcore.models import te_fp8
from dit_mcore.models.st_attention import STPattern, mesh_order, st_plans
from dit_mcore.models.text import TextContext, TextEmbedder, cross_segments
from energon_data.tokens import grid_positions
from dit_mcore.models.token_shard import TokenShard, mark_sequence_parallel_params
from dit_mcore.kernels.host_copy import to_device


def _xavier_linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class FinalLayer(nn.Module):
    """adaLN-modulated norm (the layers' kind) + zero-initialised projection to the output patch values."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        norm = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
        self.norm = norm(config.hidden_size, eps=config.layernorm_epsilon, elementwise_affine=False)
        self.adaLN_modulation = AdaLNModulation(config.hidden_size, chunks=2, lora_rank=config.adaln_lora_rank)
        self.linear = nn.Linear(config.hidden_size, config.out_patch_dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, cond: Conditioning, chunk: Optional[int] = None, config=None) -> torch.Tensor:
        """``chunk``: over that many tokens at a time, each recomputed in the backward (``model.chunk_tokens``)."""
        shift, scale = self.adaLN_modulation(cond)
        if chunk:
            return over_chunks(self.project, x, cond, shift, scale, chunk=chunk, config=config)
        return self.project(x, cond, shift, scale)

    def project(self, x: torch.Tensor, cond: Conditioning, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(cond.modulate(self.norm(x), shift, scale))


class DiT(MegatronModule):
    """adaLN-Zero DiT. ``forward`` maps noisy tokens + per-sample (timestep, label) to per-token
    predictions ``[s, b, out_patch_dim]``. With ``config.text_dim`` set it is the cross-attention DiT:
    every layer also attends to its sample's text (``context``)."""

    model_type = ModelType.encoder_or_decoder  # read by megatron's pipeline schedules
    share_embeddings_and_output_weights = False  # read by finalize_model_grads under PP

    def __init__(self, config: DiTConfig, layer_spec: Optional[ModuleSpec] = None,
                 pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                 init_seed: Optional[int] = None):
        super().__init__(config)
        self.config: DiTConfig = config
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.input_tensor = None
        h = config.hidden_size
        # Every part from its own stream: the same weights on any layout (pass one init_seed to all
        # pipeline chunks of a rank; the default draws it from the caller's RNG).
        seed = draw_base_seed() if init_seed is None else init_seed
        if pre_process:
            with init_stream(seed, "x_embedder"):
                self.x_embedder = _xavier_linear(config.patch_dim, h)
        # Conditioning is cheap: every pipeline stage computes it rather than receiving it.
        with init_stream(seed, "t_embedder"):
            self.t_embedder = TimestepEmbedder(h, config.frequency_embedding_size, config.timestep_freq_shift)
        with init_stream(seed, "y_embedder"):
            self.y_embedder = LabelEmbedder(config.num_classes, h, config.use_cfg_embedding) \
                if config.num_classes > 0 else None
        with init_stream(seed, "text_embedder"):
            self.text_embedder = TextEmbedder(config.text_dim, h) if config.text_dim else None
        self.adaln_shared = None
        if config.adaln_lora_rank:  # AdaLN-LoRA's modulation shared by every sub-block, zero at the start
            with init_stream(seed, "adaln_shared"):
                self.adaln_shared = MainGradLinear(h, 3 * h)
            nn.init.zeros_(self.adaln_shared.weight)
            nn.init.zeros_(self.adaln_shared.bias)
        self.layers = LayerStack(config, layer_spec or dit_layer_spec(), vp_stage=vp_stage, init_seed=seed)
        if post_process:
            with init_stream(seed, "final_layer"):
                self.final_layer = FinalLayer(config)
        self.token_shard = TokenShard.from_config(config)
        if config.sequence_parallel:
            mark_sequence_parallel_params(self, exclude=(self.text_embedder,))
        for param in self.conditioning_parameters():
            param.pipeline_parallel = True  # gradients summed over pipeline stages (config.has_cond_embedder)
            param.shared = not self.holds_main_conditioning  # counted once in the global grad norm
            # Known risk (PP x DP>1 with the distributed optimizer): megatron sums these gradients over
            # the stages after the DP reduce-scatter, which is right only while the same DP rank owns
            # them on every stage (true for the DiT's parameter order: they sit at the same end of
            # every stage's buffer; tests/test_parallel_layouts.py::pp2_dp2_distopt). megatron's fix,
            # ``shared_embedding`` buckets, breaks fully-reshardable optimizer checkpoints in 0.16.1.

    @property
    def holds_main_conditioning(self) -> bool:
        """Whether this chunk's conditioning embedders are the main copy (first stage, first chunk)."""
        return parallel_state.get_pipeline_model_parallel_rank() == 0 and not self.vp_stage

    def conditioning_parameters(self):
        """Parameters of the conditioning embedders, which every pipeline stage holds a copy of."""
        for module in (self.t_embedder, self.y_embedder, self.text_embedder, self.adaln_shared):
            if module is not None:
                yield from module.parameters()

    def compile_layers(self, mode: Optional[str] = None, options: Optional[dict] = None) -> None:
        """Compile each transformer layer (``model.compile``, ``model.compile_mode``,
        ``model.compile_options``)."""
        self.layers.compile_layers(mode, options)

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

    @staticmethod
    def _check_grid(grid: tuple, s: int) -> None:
        if grid[0] * grid[1] * grid[2] != s:
            raise ValueError(f"grid {grid} has {grid[0] * grid[1] * grid[2]} tokens but the input has {s}; "
                             "pass grid=(t, h, w) of the patchified latent")

    def _dense_positions(self, grid: tuple, s: int, device) -> torch.Tensor:
        self._check_grid(grid, s)
        return to_device(sincos_pos_embed(self.config.hidden_size, grid), device)

    def _grid_positions(self, grid: tuple, s: int) -> torch.Tensor:
        self._check_grid(grid, s)
        return grid_positions(grid)

    def _st_params(self, params, batch, grid, total: int, rows: int, device) -> KernelsPackedSeqParams:
        """The frames of every sample in the stream this rank's attention sees (ST-DiT), with their
        plans on one rank (compiled layers hold the attention without a break)."""
        start, end = self.token_shard.attention_range(total)
        cp = self.config.context_parallel_size
        if batch is not None:  # packed: without CP one rank's attention sees the whole stream
            grids = tuple((int(t), int(h) * int(w)) for t, h, w in batch.grids.tolist())
            if cp > 1:
                if self.config.st_attention == "mesh":
                    raise ValueError("model.st_attention=mesh takes dense video batches (one grid per micro-batch); "
                                     "use model.st_attention=dsp for packed data")
                pattern = STPattern(tuple(batch.starts), grids, self.token_shard.padded(total),
                                    cp_group=parallel_state.get_context_parallel_group(), query_range=(start, end))
            else:
                pattern = STPattern(tuple(batch.starts), grids, end - start)
            return dataclasses.replace(params, qkv_format="sbhd", st=pattern, st_plans=st_plans(pattern, device))
        frames, positions = grid[0], grid[1] * grid[2]
        if cp > 1:
            outer, inner = self._st_mesh_sizes()
            if frames % outer or positions % inner:
                raise ValueError(f"the ST-DiT under context parallel shards whole frames over {outer} ranks"
                                 + (f" and each frame's positions over {inner}" if inner > 1 else "")
                                 + f": a {frames}-frame sample of {positions} positions does not split; use frame "
                                 f"(and position) counts divisible by them (images: context_parallel_size=1, or "
                                 f"model.st_attention=mesh with hierarchical_context_parallel_sizes=[{cp}, 1])")
            if inner > 1:
                inner_group, outer_group = parallel_state.get_hierarchical_context_parallel_groups()
            else:
                inner_group, outer_group = None, parallel_state.get_context_parallel_group()
            pattern = STPattern((0,), ((frames, positions),), end - start, cp_group=outer_group,
                                inner_group=inner_group)
        else:
            pattern = STPattern(tuple(i * total for i in range(rows)), ((frames, positions),) * rows, rows * total)
        return KernelsPackedSeqParams(qkv_format="sbhd", st=pattern, st_plans=st_plans(pattern, device))

    def _st_mesh_sizes(self) -> tuple[int, int]:
        """``(outer, inner)``: ranks over which an ST-DiT row's frames and each frame's positions split."""
        config = self.config
        if config.spatial_temporal and config.st_attention == "mesh" and config.context_parallel_size > 1:
            inner, outer = config.hierarchical_context_parallel_sizes
            return outer, inner
        return config.context_parallel_size, 1

    def _mesh_order(self, grid: tuple) -> Optional[torch.Tensor]:
        """The two-level mesh's token order of a dense row (None for every other layout)."""
        outer, inner = self._st_mesh_sizes()
        if inner == 1:
            return None
        return mesh_order(grid[0], grid[1] * grid[2], outer, inner)

    def _rotary(self, positions: torch.Tensor, device) -> torch.Tensor:
        """3D RoPE angles ``[s, 1, 1, head_dim]`` of the tokens this rank's attention sees (every
        stage computes them: cheaper than sending them down the pipeline)."""
        config = self.config  # megatron's __post_init__ sets kv_channels (the head dim)
        return rope3d_freqs(self.token_shard.attention_piece(to_device(positions, device)), config.kv_channels,
                            config.rope_theta, config.rotary_interleaved)

    def forward(self, tokens: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor] = None,
                *, batch=None, grid: Optional[Sequence[int]] = None,
                context: Optional[TextContext] = None) -> torch.Tensor:
        """Run the DiT.

        Args:
            tokens: ``[s, b, patch_dim]`` (packed: ``[t, 1, patch_dim]``); ignored on pipeline stages
                after the first, which take ``set_input_tensor``.
            timesteps: ``[n]`` per-sample diffusion timestep values.
            labels: ``[n]`` class labels (``num_classes`` = null class).
            batch: the ``MicroBatch`` whose layout ``tokens`` follow (per-sample grids, positions,
                ``cu_seqlens``); required for packed input.
            grid: dense input without ``batch``: the shared token grid ``(t, h, w)``; default: the
                config's image grid.
            context: the samples' text (cross-attention DiT, ``config.text_dim > 0``); None otherwise.
        """
        shard = self.token_shard
        packed = batch if batch is not None and batch.is_packed else None
        if packed is None:
            grid = self._grid(batch, grid)
        cond_emb = self.conditioning(timesteps, labels)
        shared = self.adaln_shared(nn.functional.silu(cond_emb)) if self.adaln_shared is not None else None
        if packed is not None:  # tokens outside every sample (padding) point at sample 0: masked out of the loss
            cond = Conditioning(cond_emb, shard.scatter(packed.token_to_sample, pad_value=-1).clamp(min=0), shared)
        else:
            cond = Conditioning(cond_emb, shared=shared)
        params, rotary, order = self._attention_layout(packed, grid, tokens)
        hidden = self._embed(tokens, packed, grid, order) if self.pre_process else self.input_tensor
        text, text_params = self._text(context, batch, tokens.shape[0], tokens.shape[1], cond_emb.shape[0])
        hidden = self.layers(hidden, cond, context=text, context_params=text_params, rotary_pos_emb=rotary,
                             packed_seq_params=params)
        if not self.post_process:
            return hidden
        # Every stage is called with the whole stream's tokens, so its length is known on the last.
        chunk = self.config.chunk_tokens if self.training and torch.is_grad_enabled() else None
        out = shard.gather(self.final_layer(hidden, cond, chunk, self.config), tokens.shape[0])
        return out if order is None else out[to_device(torch.argsort(order), out.device)]

    def _grid(self, batch, grid) -> tuple:
        """The token grid ``(t, h, w)`` every row of a dense batch shares."""
        if batch is not None:
            grid = batch.grids[0].tolist()
        side = self.config.input_size // self.config.patch_size
        return tuple(int(g) for g in grid) if grid is not None else (1, side, side)

    def _attention_layout(self, packed, grid: tuple, tokens: torch.Tensor):
        """``(packed_seq_params, rotary angles, token order)`` of the self-attention: the samples'
        boundaries (packed) or frames (ST-DiT), the 3D RoPE angles of the tokens this rank's
        attention sees, and the two-level ST mesh's reorder of dense rows (None: stream order)."""
        params = packed_seq_params(packed) if packed is not None else None
        order = None
        if self.config.spatial_temporal:
            params = self._st_params(params, packed, grid, tokens.shape[0], tokens.shape[1], tokens.device)
            order = None if packed is not None else self._mesh_order(grid)
        rotary = None
        if self.config.position_embedding == "rope3d":
            positions = packed.positions if packed is not None else self._grid_positions(grid, tokens.shape[0])
            rotary = self._rotary(positions if order is None else positions[order], tokens.device)
            if params is not None:
                # Per-token angles: megatron's THD RoPE would restart each sample at position 0 and
                # slice its own CP layout; as "sbhd" it applies our angles one to one (the kernels
                # take the sample boundaries from the segments either way).
                params = dataclasses.replace(params, qkv_format="sbhd")
        return params, rotary, order

    def _embed(self, tokens: torch.Tensor, packed, grid: tuple, order: Optional[torch.Tensor]) -> torch.Tensor:
        """Patch embedding of this rank's tokens, plus the sin-cos positions unless RoPE carries them."""
        shard = self.token_shard
        if shard.active and packed is None and tokens.shape[0] % shard.size:
            raise ValueError(f"a dense batch of {tokens.shape[0]} tokens per sample cannot be split evenly "
                             f"over {shard.size} context/sequence-parallel ranks; use an image size whose "
                             f"token count is a multiple of {shard.size}, or packed data")
        hidden = self.x_embedder(shard.scatter(tokens if order is None else tokens[to_device(order, tokens.device)]))
        if self.config.position_embedding != "sincos":
            return hidden
        if packed is not None:
            pos = sincos_from_positions(shard.scatter(packed.positions), self.config.hidden_size,
                                        int(packed.grids.max()))
        else:
            pos = self._dense_positions(grid, tokens.shape[0], tokens.device)
            pos = shard.scatter(pos if order is None else pos[to_device(order, pos.device)])
        return hidden + pos.unsqueeze(1).to(tokens.dtype)

    def _text(self, context: Optional[TextContext], batch, total: int, rows: int, samples: int):
        """The embedded text ``[L, 1, hidden]`` and the cross-attention pattern from the query tokens
        this rank's attention sees (its context-parallel piece) to each sample's text."""
        if self.text_embedder is None:
            if context is not None:
                raise ValueError("this model has no cross-attention (model.text_dim=0); pass no text, or "
                                 "use model.family=dit_xattn")
            return None, None
        if context is None:
            raise ValueError(f"this model cross-attends to text (model.text_dim={self.config.text_dim}); pass "
                             "context=TextContext(...) (drop it with keep=False for unconditional samples)")
        if context.num_samples != samples:
            raise ValueError(f"text for {context.num_samples} samples, but the batch has {samples}")
        start, end = self.token_shard.attention_range(total)
        if batch is not None and batch.is_packed:
            ranges = [(min(max(a, start), end) - start, min(max(a + n, start), end) - start)
                      for a, n in zip(batch.starts, batch.seqlens)]
        else:  # dense rows of one sample each, all cut at the same place: rows in stream order
            piece = end - start
            ranges = [(i * piece, (i + 1) * piece) for i in range(rows)]
        segments = cross_segments(ranges, context.lens)
        return self.text_embedder(context), KernelsPackedSeqParams(qkv_format="sbhd", segments=segments)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Layers are keyed by their global index so checkpoints reshard across pipeline layouts."""
        sharded = {}
        # Replicated (non-megatron) children must name the TP group, or megatron marks every TP
        # rank as the main replica of them.
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for name, child in self.named_children():
            if name == "layers":
                continue
            part = sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                              tp_group=tp_group)
            if name in ("t_embedder", "y_embedder", "text_embedder", "adaln_shared") and not self.holds_main_conditioning:
                # Every pipeline stage holds the conditioning embedders: only the first stage's
                # first chunk is their main replica.
                for item in part.values():
                    item.replica_id = (1, *tuple(item.replica_id)[1:])
            sharded.update(part)
        for local_idx, layer in enumerate(self.layers):
            # Local module names as dict keys (what load_state_dict expects on this stage), global
            # layer indices as checkpoint keys (what makes checkpoints reshard across stages).
            local, global_ = f"{prefix}layers.{local_idx}.", f"{prefix}layers.{layer.layer_number - 1}."
            part = layer.sharded_state_dict(local, sharded_offsets, metadata)
            replace_prefix_for_sharding(part, local, global_)
            sharded.update(part)
        return sharded


def build_model(config: DiTConfig, *, backend: str = "local", pre_process: bool = True,
                post_process: bool = True, vp_stage: Optional[int] = None, init_seed: Optional[int] = None) -> DiT:
    """Build a DiT for this rank (its pipeline stage's layers, tensor-parallel shards)."""
    spec = dit_layer_spec(backend, norm="rmsnorm" if config.normalization == "RMSNorm" else "layernorm",
                          num_moe_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                          cross_attention=config.text_dim > 0, qk_norm=config.qk_layernorm,
                          cross_attention_adaln=config.cross_attention_adaln,
                          spatial_temporal=config.spatial_temporal, float8_recipe=config.float8_recipe,
                          te_fp8=te_fp8.enabled(config))
    return DiT(config, spec, pre_process=pre_process, post_process=post_process, init_seed=init_seed,
               vp_stage=vp_stage)
