"""The stack of transformer layers of one pipeline stage: what megatron's ``TransformerBlock`` owns,
for layers that take per-sample conditioning.

- Layer numbering: this stage (and virtual stage) builds its share of ``config.num_layers`` with
  global 1-based ``layer_number``s, so checkpoints key layers by global index and reshard across
  pipeline layouts; each layer is initialised from its own RNG stream (:mod:`.seeding`), so it
  starts with the same weights on any layout.
- Activation recompute from megatron's config: ``recompute_granularity="full"`` with
  ``recompute_method`` ``"uniform"`` (checkpoint chunks of ``recompute_num_layers`` layers) or
  ``"block"`` (checkpoint the first ``recompute_num_layers`` layers of the stage), through
  megatron's ``tensor_parallel.checkpoint`` (which restores the model-parallel RNG states; TE's
  checkpoint under TE's FP8).
  ``"selective"`` is handled inside the layers (megatron's attention checkpoints its core
  attention; DiT layers checkpoint their MLP branch when ``"mlp"`` is in ``recompute_modules``, and
  free and recompute each sublayer's modulated norm with ``"layernorm"``).
- Token sharding is not its concern: under sequence/context parallel the stack runs on this
  rank's piece of the token stream, which the model cuts before its patch embedding and
  reassembles after its final layer (:mod:`dit_mcore.models.token_shard`), so the per-token
  inputs (positions, token -> sample map) are sliced once, not per layer.
- Transformer Engine's FP8 (megatron's ``fp8`` / ``fp8_recipe``): its autocast around the stage or
  each layer, and TE's checkpoint for full recompute, as megatron's ``TransformerBlock`` does
  (:mod:`.te_fp8`).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import nn

from dit_mcore.models.modulation import Conditioning
from dit_mcore.models import te_fp8
from dit_mcore.models.moe import mark_expert_params
from dit_mcore.models.seeding import draw_base_seed, init_stream

RECOMPUTE_METHODS = ("uniform", "block")

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
"""torch.compile modes ``model.compile_mode`` offers (the CUDA-graph ones are not: untested with
megatron's gradient hooks)."""


def check_recompute_config(config) -> None:
    """Reject recompute settings this stack cannot honour, naming the field."""
    granularity = config.recompute_granularity
    if granularity not in (None, "full", "selective"):
        raise ValueError(f"model.recompute_granularity={granularity!r}; use None, 'full' or 'selective'")
    if granularity == "full":
        if config.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_granularity='full' needs recompute_method in {RECOMPUTE_METHODS}, "
                             f"got {config.recompute_method!r}")
        if not config.recompute_num_layers or config.recompute_num_layers < 1:
            raise ValueError("recompute_granularity='full' needs recompute_num_layers >= 1 (layers per "
                             "checkpointed chunk for 'uniform', checkpointed layers for 'block')")


def quiet_default_tp_group() -> None:
    """megatron 0.16's ``RowParallelLinear`` passes ``tp_group=None`` on every call, and the helper
    that substitutes the default group issues a ``DeprecationWarning`` each time; dynamo cannot
    trace ``warnings.warn`` and breaks the layer's graph there (twice per layer). Same group, no
    warning."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    original = getattr(layers.get_tensor_model_parallel_group_if_none, "__wrapped__",
                       layers.get_tensor_model_parallel_group_if_none)

    def default_group(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and parallel_state.is_initialized():
            return (parallel_state.get_expert_tensor_parallel_group if is_expert else
                    parallel_state.get_tensor_model_parallel_group)(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    default_group.__wrapped__ = original
    layers.get_tensor_model_parallel_group_if_none = default_group


def _mark_varying_sizes(cond: Conditioning, context: Optional[torch.Tensor]) -> None:
    """Tell dynamo, before a compiled layer first sees them, which sizes change from batch to batch: a
    packed stream's sample count (its conditioning rows) and the concatenated captions' token count.
    Otherwise every layer compiles once for the first batch's sizes and again, generalised, for the
    second's; now it compiles once, the generalised graph it would have run from the second batch on. A
    pack of one sample still compiles its own (dynamo specialises a size of 1). Under full recompute the
    checkpoint passes copies of the inputs, which do not carry the marks (the layers recompile as before)."""
    if cond.token_to_sample is not None:
        torch._dynamo.maybe_mark_dynamic(cond.emb, 0)
        if cond.shared is not None:
            torch._dynamo.maybe_mark_dynamic(cond.shared, 0)
    if context is not None:
        torch._dynamo.maybe_mark_dynamic(context, 0)


class LayerStack(nn.ModuleList):
    """This stage's layers, run in order with optional full-layer recompute. A ``ModuleList`` so
    parameters keep megatron's ``layers.<i>.`` names."""

    compiled = False
    """Whether :meth:`compile_layers` compiled the layers."""

    def __init__(self, config, spec: ModuleSpec, vp_stage: Optional[int] = None, init_seed: Optional[int] = None):
        check_recompute_config(config)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
        init_seed = draw_base_seed() if init_seed is None else init_seed
        layers = []
        for i in range(n_local):
            with init_stream(init_seed, f"layers.{offset + i}"):  # the same weights on any stage
                # megatron's TransformerLayer adds this stage's offset to the local layer number
                layers.append(build_module(spec, config=config, layer_number=i + 1, vp_stage=vp_stage))
        super().__init__(layers)
        self.config = config
        if config.num_moe_experts:
            mark_expert_params(self)
        numbers = [layer.layer_number for layer in layers]
        if numbers != list(range(offset + 1, offset + n_local + 1)):
            raise RuntimeError(f"layers got global numbers {numbers}, expected {offset + 1}..{offset + n_local}")

    def compile_layers(self, mode: Optional[str] = None, options: Optional[dict] = None) -> None:
        """Regional ``torch.compile``: each layer compiled in place (one graph per layer, reused by
        every layer of the same shape), so norms, modulation, gating and GELU fuse around the GEMMs.
        ``mode``: one of :data:`COMPILE_MODES` (None: torch's default); ``options``: Inductor options
        over the mode's (torch.compile takes one or the other, so the mode is expanded)."""
        if mode is not None and mode not in COMPILE_MODES:
            raise ValueError(f"model.compile_mode={mode!r}: use one of {COMPILE_MODES} or None")
        quiet_default_tp_group()
        if options:
            import torch._inductor
            merged = {**torch._inductor.list_mode_options(mode or "default"), **options}
        for layer in self:
            if options:
                layer.compile(options=merged)
            else:
                layer.compile(mode=mode)
        self.compiled = True

    def forward(self, hidden: torch.Tensor, cond: Conditioning, *, context: Optional[torch.Tensor] = None,
                context_params=None, rotary_pos_emb: Optional[torch.Tensor] = None,
                packed_seq_params=None) -> torch.Tensor:
        kwargs = dict(context=context, context_params=context_params, rotary_pos_emb=rotary_pos_emb,
                      packed_seq_params=packed_seq_params)
        if self.compiled:
            _mark_varying_sizes(cond, context)
        with te_fp8.stage_context(self.config):
            if self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
                return self._checkpointed(hidden, cond, kwargs)
            for layer in self:
                with te_fp8.layer_context(self.config, layer):
                    hidden = layer(hidden, cond, **kwargs)
        return hidden

    def _chunks(self) -> list[tuple[int, int, bool]]:
        """``(start, end, recompute)`` ranges of layers, per megatron's recompute_method."""
        n, k = len(self), self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        return [(i, i + 1, i < k) for i in range(n)]

    def _checkpointed(self, hidden, cond: Conditioning, kwargs) -> torch.Tensor:
        packed_seq_params, context_params = kwargs["packed_seq_params"], kwargs["context_params"]

        def run(start, end):
            # Tensors that may need gradients (conditioning, cross-attention memory, rotary tables) are
            # explicit arguments: the reentrant checkpoint returns their gradients instead of
            # backpropagating into their producers from inside the recomputation.
            def fn(h, emb, shared, context, rotary_pos_emb):
                c = Conditioning(emb, cond.token_to_sample, shared)
                for layer in list(self)[start:end]:
                    with te_fp8.layer_context(self.config, layer):
                        h = layer(h, c, context=context, context_params=context_params,
                                  rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
                return h
            return fn

        args = (cond.emb, cond.shared, kwargs["context"], kwargs["rotary_pos_emb"])
        for start, end, recompute in self._chunks():
            if recompute:
                hidden = te_fp8.checkpoint(self.config, run(start, end), hidden, *args)
            else:
                hidden = run(start, end)(hidden, *args)
        return hidden
