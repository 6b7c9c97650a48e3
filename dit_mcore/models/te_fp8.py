"""FP8 training through Transformer Engine (``model.fp8`` with ``model.backend=te``).

TE's linears quantize inside their own fused kernels while TE's ``fp8_autocast`` is active. It is
entered the way megatron's ``TransformerBlock`` enters it, through megatron's own
``fp8_utils.get_fp8_context`` (the recipe from megatron's ``fp8`` / ``fp8_recipe`` fields, the amax
reduction group from its parallel state):

- delayed scaling (``"delayed"``, an amax history per tensor): one context around the stage's
  layers, so TE reduces the amaxes once per forward;
- current scaling (``"tensorwise"``), MXFP8 (``"mxfp8"``, Blackwell) and block scaling
  (``"blockwise"``): one context per layer, keyed by its global index (entering it is free);
- full-layer recompute and the MLP's selective recompute go through megatron's ``te_checkpoint``:
  TE's checkpoint recomputes inside the forward's FP8 state (recipe and scaling factors); torch's would
  recompute in bf16, outside every context, or update the amax history a second time.

Only the transformer linears quantize (they come from the layer spec as TE's classes): the adaLN
modulation, the embedders, the norms, attention (this project's kernels) and the final layer are
torch modules and keep the run's precision. The EMA/preview shadow is built without FP8.

Not run here: neither the CPU machines nor the lent GPUs have TE. The wiring (contexts, layer
indices, the recompute path, the config mapping and the refusals) is tested with megatron's context
stood in (``tests/test_te_fp8.py``).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from packaging.version import Version
from megatron.core import fp8_utils, parallel_state, tensor_parallel

from dit_mcore.errors import ConfigError
from dit_mcore.models.float8 import ALIGNMENT, misaligned_dims

RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""megatron's ``fp8_recipe`` values this project offers with TE (``model.fp8``)."""
FORMATS = ("hybrid", "e4m3")
"""megatron's ``fp8`` values: E4M3 forward and E5M2 gradients, or E4M3 for both."""


def enabled(config) -> bool:
    """Whether ``config`` (megatron's) trains with TE's FP8."""
    return bool(getattr(config, "fp8", None))


def _delayed(config) -> bool:
    return config.fp8_recipe == "delayed"


def stage_context(config):
    """The context around one stage's layers: delayed scaling's (one amax reduction per forward)."""
    return fp8_utils.get_fp8_context(config) if enabled(config) and _delayed(config) else nullcontext()


def layer_context(config, layer):
    """The context around one layer: every recipe but delayed scaling's, by the layer's global index."""
    if enabled(config) and not _delayed(config):
        return fp8_utils.get_fp8_context(config, layer.layer_number - 1)
    return nullcontext()


def checkpoint(config, function, *args, distribute: Optional[bool] = None):
    """megatron's recompute of ``function(*args)`` (whole layers, or a layer's MLP), through TE's
    checkpoint under FP8; ``distribute``: shard the saved input over TP (None: the config's
    ``distribute_saved_activations``, as megatron's full recompute; its MLP recompute passes False)."""
    if distribute is None:
        distribute = config.distribute_saved_activations
    if enabled(config):
        from megatron.core.extensions.transformer_engine import te_checkpoint
        return te_checkpoint(function, distribute, tensor_parallel.random.get_cuda_rng_tracker,
                             parallel_state.get_tensor_model_parallel_group(), *args)
    return tensor_parallel.checkpoint(function, distribute, *args)


def alignment(recipe: str) -> int:
    """What both dims of every FP8 GEMM operand must be a multiple of (megatron's
    ``get_fp8_align_size``: 32 for MXFP8's blocks, else 16)."""
    return 32 if recipe == "mxfp8" else ALIGNMENT


NEEDS = {"delayed": ((8, 9), "Ada, Hopper or newer", None),
         "tensorwise": ((8, 9), "Ada, Hopper or newer", "2.2.0.dev0"),
         "blockwise": ((9, 0), "Hopper or newer", "2.3.0.dev0"),
         "mxfp8": ((10, 0), "Blackwell or newer", None)}
"""Per recipe: the GPU's compute capability, its name, and the least TE version that has the recipe
(what megatron's ``get_fp8_recipe`` asks of it; None: no check there)."""


def _refusal(m):
    return lambda why: ConfigError(f"model.fp8={m.fp8!r} with model.backend=te{why}")


def check_run(cfg, model, world_size: int) -> None:
    """What TE's FP8 needs of the whole run before compute (``cfg``: the run config; ``model``: the
    model config built from it): :func:`check_machine` and :func:`check_layout`. (TE's presence, the format and
    the recompute modules are checked with the model section's fields.)"""
    check_machine(cfg)
    check_layout(cfg, model, world_size)


def check_machine(cfg) -> None:
    """TE of the recipe's version on a GPU of its generation: this machine's."""
    from megatron.core.utils import get_te_version
    m = cfg.model
    refuse = _refusal(m)
    fix = "or set model.backend=auto for torchao's FP8 (model.fp8 in tensorwise, rowwise, rowwise_with_gw_hp)"
    capability, generation, version = NEEDS[m.fp8]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < capability:
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        raise refuse(f" needs a GPU with that recipe's FP8 tensor cores ({generation}); this machine has {where}: "
                     f"pick another recipe {fix}")
    if version is not None and get_te_version() < Version(version):
        raise refuse(f" needs Transformer Engine >= {version}; this machine has {get_te_version()}: upgrade TE or "
                     "pick another recipe")


def check_layout(cfg, model, world_size: int) -> None:
    """What TE's FP8 needs of the run's layout and data, on any machine (a planner's too): bf16, weight dims and
    each rank's token count the FP8 GEMMs accept, no ST-DiT under context parallel."""
    m, data, parallel = cfg.model, cfg.data, cfg.parallel
    refuse = _refusal(m)
    if not cfg.trainer.bf16:
        raise refuse(" runs the layers around TE's GEMMs in bf16: set trainer.bf16=True")
    if getattr(model, "spatial_temporal", False) and parallel.context_parallel_size > 1:
        raise refuse(": the ST-DiT's frame/position switch under context parallel re-cuts the rows its projections "
                     "see (positions padded per rank), which the alignment rules here do not cover; set "
                     "parallel.context_parallel_size=1 or use torchao's FP8 (model.backend=auto)")
    align = alignment(m.fp8)
    bad = misaligned_dims(model, model.kv_channels or model.hidden_size // model.num_attention_heads, alignment=align,
                          tp=parallel.tensor_model_parallel_size)
    if bad:
        raise refuse(f": TE's FP8 GEMMs need every weight dim of the transformer linears divisible by {align}, but "
                     f"{', '.join(bad)}; choose widths that are multiples of {align} x TP or set model.fp8=None")
    # TE quantizes each rank's own rows: its piece of the micro-batch's stream (under sequence parallel,
    # before the all-gather), so the stream must split into multiples of the alignment.
    shards = parallel.token_shards()
    split = (f"{shards} ranks (context_parallel_size x tensor_model_parallel_size under sequence parallel)"
             if shards > 1 else "one rank")
    need = f": TE's FP8 GEMMs need each rank's token count to be a multiple of {align}"
    micro = data.micro_batch(parallel.data_parallel_size(world_size))
    if data.packs:  # packs are filled to max_seq_len
        if (micro * data.max_seq_len) % (align * shards):
            raise refuse(f"{need}, but {micro} pack(s) of data.max_seq_len={data.max_seq_len} tokens over {split} "
                         f"are not; set data.max_seq_len to a multiple of {align * shards}")
        return
    if data.uses_energon:  # one sample per row, each padded to pad_multiple
        if data.pad_multiple % (align * shards):
            raise refuse(f"{need}, and unpacked samples come in any length; set data.pad_multiple to a multiple "
                         f"of {align * shards} ({align} x the {split} a micro-batch is split over)")
        return
    tokens = data.dense_tokens_per_sample(model.patch_size, model.patch_size_t)
    if (micro * tokens) % (align * shards):
        raise refuse(f"{need}, but a micro-batch of {micro} x {tokens} tokens over {split} is not; change "
                     "data.micro_batch_size or data.image_size")
