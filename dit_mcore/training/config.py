"""Run configuration: plain dataclasses, one per concern, so nemo-run factories can build them with
``run.Config`` and the CLI can override any field (``trainer.max_steps=20 log.dir=/tmp/run``)."""
import dataclasses
import logging
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from dit_mcore.models.dit.config import DiTConfig
from dit_mcore.models.registry import get_family
from dit_mcore.parallel.config import ParallelConfig
from energon_data.config import DataConfig  # noqa: F401  (the run's ``data`` section)


@dataclass
class ModelConfig:
    """Which model to build: a family, a named preset and the fields runs commonly change."""

    family: str = "dit"
    """Model family from ``dit_mcore.models.registry`` (``dit``: the adaLN-Zero DiT; ``dit_xattn``: the
    DiT with cross-attention to text; ``llama``: the MovieGen-style Llama DiT with 3D RoPE; ``stdit``:
    the spatial-temporal DiT)."""
    preset: str = "DiT-XL/2"
    """A preset of the family (``dit``: ``DiT-S/2`` … ``DiT-XL/8``, ``tiny``, ``digits``; ``dit_xattn``:
    ``DiT-XAttn-XL/2``, ``DiT-XAttn-7B``, ``DiT-XAttn-28B``, ``xattn-tiny`` …; ``llama``:
    ``MovieGen-1B`` … ``MovieGen-30B``, ``llama-tiny``, ``llama-moving-digits``; ``stdit``: ``ST-DiT-S/2``,
    ``ST-DiT-B/2``, ``ST-DiT-XL/2``, ``stdit-tiny``)."""
    num_layers: Optional[int] = None
    """Override the preset's depth."""
    hidden_size: Optional[int] = None
    """Override the preset's width (the FFN width keeps the preset's ratio to it unless
    ``ffn_hidden_size`` is set)."""
    ffn_hidden_size: Optional[int] = None
    """Override the MLP's inner width (per gate with SwiGLU)."""
    num_attention_heads: Optional[int] = None
    """Override the preset's head count."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention (megatron's field; None: the preset's)."""
    patch_size: Optional[int] = None
    """Override the preset's patch size."""
    input_size: Optional[int] = None
    """Latent/image side length the model is trained on (unset: the data's, :mod:`dit_mcore.training.data_fit`;
    with data that does not say, e.g. ``mock``, the preset's)."""
    in_channels: Optional[int] = None
    """Latent/image channels (unset: the data's, else the preset's)."""
    num_classes: Optional[int] = None
    """Class count (the null class is added for CFG; unset: the data's labels, 0 for a dataset without labels,
    else the preset's)."""
    learn_sigma: Optional[bool] = None
    """Predict the extra variance channels (unused by flow/EDM losses; kept for interop)."""
    timestep_freq_shift: Optional[float] = None
    """The timestep sinusoid's frequency shift: 0 as facebookresearch/DiT (the presets'), 1 as diffusers'
    ``DiTTransformer2DModel`` (weights imported from diffusers keep theirs)."""
    class_dropout_prob: Optional[float] = None
    """Label-dropout probability for classifier-free guidance."""
    text_dim: Optional[int] = None
    """Text-conditioned families: width of the dataset's text embeddings (its text encoder's; unset: the
    data's, else the preset's)."""
    text_dropout_prob: Optional[float] = None
    """Text-dropout probability for classifier-free guidance on text."""
    st_attention: Optional[str] = None
    """ST-DiT under context parallel: "dsp" (all-to-all of hidden states around the temporal
    attention) or "dsp_overlap" (the same in two pipelined all-to-alls)."""
    qk_layernorm: Optional[bool] = None
    """Per-head RMSNorm of queries and keys in every attention (megatron's field)."""
    adaln_lora_rank: Optional[int] = None
    """AdaLN-LoRA (Cosmos): every adaLN modulation factored through this rank, plus one modulation shared by all
    layers (``DiTConfig.adaln_lora_rank``); 0: a full adaLN linear per layer; None: the preset's."""
    cross_attention_adaln: Optional[bool] = None
    """Text families: the cross-attention's input adaLN-modulated and its output gated (NeMo's DiT), or False: an
    affine norm's output, added ungated (MovieGen, Wan); None: the preset's."""
    backend: str = "auto"
    """The transformer linears: "auto" or "local" (megatron's local linears, as aten linears: the
    measured path, one compiled graph per layer) or "te" (Transformer Engine's, through megatron's
    wrappers; only when asked for, since this project has not run them: TE is on none of its machines;
    untested with ``compile``)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute (megatron's field): None, "full" (whole layers, see
    ``recompute_method``) or "selective" (core attention, plus the MLP when "mlp" is in
    ``recompute_modules``)."""
    recompute_method: Optional[str] = None
    """With full recompute: "uniform" (checkpoint chunks of ``recompute_num_layers`` layers) or
    "block" (checkpoint the first ``recompute_num_layers`` layers of each stage)."""
    recompute_num_layers: Optional[int] = None
    """Layers per chunk ("uniform") or checkpointed layers ("block")."""
    recompute_modules: Optional[list[str]] = None
    """With selective recompute: which parts ("core_attn", "mlp", "layernorm": each sublayer's
    modulated norm output freed after the forward and recomputed; not with ``compile``); None:
    megatron's default."""

    num_moe_experts: Optional[int] = None
    """MoE variant: experts per layer (megatron's ``MoELayer`` replaces each MLP); None: dense."""
    moe_router_topk: Optional[int] = None
    """Experts each token is routed to (megatron's default: 2)."""
    moe_aux_loss_coeff: Optional[float] = None
    """Load-balancing loss weight (default 1e-2; logged as ``load_balancing_loss``)."""
    moe_grouped_gemm: Optional[bool] = None
    """Run the local experts as one grouped GEMM (Transformer Engine on GPU)."""
    fp8: Optional[str] = None
    """FP8 training of the attention and MLP linears; the adaLN modulation, embedders, norms,
    attention and final layer keep the run's precision. None: off.

    - With ``backend="local"`` or ``"auto"``: torchao's dynamic float8 scaling on megatron's local
      linears, "tensorwise" (one scale per tensor), "rowwise" (one per row, more accurate) or
      "rowwise_with_gw_hp" (rowwise, weight gradients in the run's precision: fewer casts); MoE
      experts keep the run's precision. Pays off with ``compile=True`` on GPUs with float8 tensor
      cores (H100 and newer).
    - With ``backend="te"``: Transformer Engine's ``fp8_autocast`` with megatron's recipe (its
      ``fp8_recipe``): "delayed" (amax history), "tensorwise" (current scaling), "mxfp8"
      (Blackwell) or "blockwise"; TE's fused casts, no ``compile`` needed (``dit_mcore.models.te_fp8``)."""
    fp8_format: Optional[str] = None
    """With ``fp8`` on ``backend="te"``: megatron's ``fp8``, "hybrid" (E4M3 forward, E5M2
    gradients; None means this) or "e4m3"."""
    fp8_amax_history_len: Optional[int] = None
    """With ``fp8="delayed"`` on ``backend="te"``: steps of amax history (megatron's field; None: its 1)."""
    fp8_amax_compute_algo: Optional[str] = None
    """With ``fp8="delayed"`` on ``backend="te"``: "most_recent" or "max" over the history (megatron's
    field; None: its "most_recent")."""
    attention_backend: Optional[str] = None
    """The local attention kernel (``kernels.attention_kernels.BACKENDS``); None: "auto", the fastest
    for the device, dtype and call (on Hopper and Blackwell cuDNN for dense batches, flash varlen for packed
    ones). E.g. "sdpa_flash" to pin torch's flash kernel, "math64" for the float64 reference."""
    aten_linears: Optional[bool] = None
    """megatron's local linears multiply with one aten ``linear`` where no tensor-parallel
    communication runs inside the matmul, biases in the GEMM epilogue (less memory traffic under
    ``compile``; ``dit_mcore.models.aten_linear``). Experimental: None means off (megatron's autograd
    function) until a GPU measurement shows it pays."""
    fuse_wgrad_accumulation: Optional[bool] = None
    """Under megatron DDP the aten-path linears accumulate their weight gradients into the
    ``main_grad`` buffers (fp32, or bf16: ``optim.main_grads_dtype``) inside the backward (the GEMM
    adds, no extra pass per parameter; megatron's gradient-accumulation fusion without apex).
    Experimental: None means off (DDP's hook adds them) until a GPU measurement shows it pays."""
    chunk_tokens: Optional[int] = None
    """Chunked execution for very long sequences (AutoChunk's idea, for training): each layer's MLP
    branch (modulated norm, MLP, gated residual) and the final layer run over ``chunk_tokens`` tokens of
    this rank's stream at a time, each chunk's activations recomputed in the backward, so their peak is
    a chunk's, not the sequence's; attention is not recomputed. None: off. Not with MoE layers (their
    load-balancing loss is over the whole sequence)."""
    compile: bool = False
    """Compile each transformer layer with ``torch.compile`` (regional, as torchtitan does): the
    elementwise chains around the GEMMs (norm + modulate, gate + residual, GELU) fuse. The first
    steps are slower while the layer graph compiles."""
    compile_mode: Optional[str] = None
    """With ``compile``: torch.compile's mode, ``"default"`` (None) or ``"max-autotune-no-cudagraphs"``
    (Inductor benchmarks Triton GEMM templates against cuBLAS, with the elementwise work around a
    GEMM fused into its epilogue where a template wins, and tunes every fused kernel's block sizes:
    minutes more compile). The CUDA-graph modes are not offered: untested with megatron's gradient
    hooks."""
    compile_options: Optional[dict] = None
    """With ``compile``: Inductor options for every layer's torch.compile, over ``compile_mode``'s
    (names as ``torch._inductor.list_options()`` gives them), e.g. ``{"triton.multi_kernel": 1}``
    (reductions also generated persistent, the faster picked on the device: DiT-XL/2's LayerNorm
    over 1152 channels is past Inductor's 1024 limit for persistent reductions) or
    ``{"coordinate_descent_tuning": True}`` (block sizes tuned on the device). Unknown names and CUDA
    graphs are refused before compute."""
    init_model_with_meta_device: Optional[bool] = None
    """Build the model on the meta device, let FSDP shard it, then fill each rank's shards part by
    part (initialised on the host, the same values as a direct build): for models bigger than one
    device's memory. Parameters are then initialised on the CPU also on a GPU."""

    _NOT_CONFIG_FIELDS = ("family", "preset", "backend", "compile", "compile_mode", "compile_options", "fp8",
                          "fp8_format", "attention_backend")

    def build(self, parallel: ParallelConfig, *, bf16: bool = False) -> DiTConfig:
        overrides = {f.name: getattr(self, f.name) for f in fields(self)
                     if f.name not in self._NOT_CONFIG_FIELDS and getattr(self, f.name) is not None}
        family = get_family(self.family)
        if self.hidden_size is not None and self.ffn_hidden_size is None:
            base = family.presets().get(self.preset, {})
            ratio = base.get("ffn_hidden_size", 4 * base.get("hidden_size", 1)) / base.get("hidden_size", 1)
            overrides["ffn_hidden_size"] = int(round(ratio * self.hidden_size))
        if self.init_model_with_meta_device:  # layers then follow the meta device context
            overrides["use_cpu_initialization"] = True
        if self.fp8 is not None and self.backend == "te":  # Transformer Engine's, megatron's fields
            overrides.update(fp8=self.fp8_format or "hybrid", fp8_recipe=self.fp8)
        elif self.fp8 is not None:  # torchao's on the local linears
            overrides["float8_recipe"] = self.fp8
        if self.attention_backend is not None:
            overrides["attention_backend_name"] = self.attention_backend
        return family.make_config(self.preset, **overrides,
                      tensor_model_parallel_size=parallel.tensor_model_parallel_size,
                      pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
                      virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
                      num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
                      num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
                      # At PP=2 the previous and next stage are one peer: megatron's batched p2p
                      # then pairs sends with the wrong receives under VPP (silently wrong grads).
                      batch_p2p_comm=not (parallel.pipeline_model_parallel_size == 2
                                          and (parallel.virtual_pipeline_model_parallel_size or 1) > 1),
                      context_parallel_size=parallel.context_parallel_size,
                      cp_comm_type=parallel.cp_comm_type,
                      hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
                      sequence_parallel=parallel.sequence_parallel,
                      tp_comm_overlap=parallel.tp_comm_overlap,
                      expert_model_parallel_size=parallel.expert_model_parallel_size,
                      expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
                      bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                      pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
                      calculate_per_token_loss=True)


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (megatron's optimizer and scheduler)."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the cosine decay."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to ``lr``."""
    decay_style: str = "constant"
    """"cosine", "linear" or "constant" after warmup."""
    resume_schedule: str = "checkpoint"
    """On resume, when the checkpoint's learning-rate schedule (lr, min_lr, warmup, decay horizon =
    ``trainer.max_steps``, style) differs from this config's: "checkpoint" keeps the checkpoint's, "config"
    re-plans with this config's, evaluated from the resumed step on (so a longer ``max_steps`` stretches
    the decay). Either way the run logs both schedules and the choice."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks."""
    adam_impl: str = "auto"
    """The AdamW step (torch's AdamW under megatron, also where Transformer Engine or apex is installed:
    ``dit_mcore.training.torch_optimizer.choose_adam``): "flat" (main weights and
    moments in flat buffers laid out like megatron DDP's gradient buffer, one generated kernel that
    also writes the bf16 model weights: :mod:`dit_mcore.training.flat_adam`; parts it does not fit,
    e.g. under FSDP, step "fused"; on an H100 1.24x "fused"'s optimizer step), "fused" (torch's fused
    kernel, then megatron's main-to-model weight copy; torchtitan's default), "foreach" (torch's
    multi-tensor default, a dozen passes over the state), "auto" (the default: "flat" on a GPU,
    "fused" elsewhere) or "megatron" (megatron's own pick: TE's or apex's FusedAdam where installed,
    with fp32 moments; else torch's foreach AdamW)."""
    exp_avg_dtype: str = "fp32"
    """Adam's first moment: "fp32", or "bf16" (2 bytes per parameter less on the rank holding it:
    6.2 GiB of a 3.3B model without the distributed optimizer). Kept below fp32 only by the flat step
    (``adam_impl`` "flat", or "auto", which then picks it on any device), which computes in fp32 and
    stores with stochastic rounding (its noise moves the weights by ~1e-4 relative); checkpoints
    resume with either setting (megatron's field name)."""
    exp_avg_sq_dtype: str = "fp32"
    """Adam's second moment: "fp32" or "bf16", as ``exp_avg_dtype``. Its stochastic rounding is what
    lets it shrink (rounded to nearest, a decay of ``1 - adam_beta2`` = 0.1% per step is under bf16's
    half-step and the moment would only ever grow); its noise lasts the moment's ~1/(1 - beta2)
    steps of memory and gives each weight's step size a few percent of unbiased noise."""
    main_grads_dtype: str = "fp32"
    """The gradient buffers' dtype under megatron DDP (megatron's field name; its DDP's
    ``grad_reduce_in_fp32``): "fp32", or "bf16" with ``trainer.bf16`` (the micro-batches' weight
    gradients accumulate in bf16 and the data-parallel reduction moves half the bytes). The flat
    AdamW (``adam_impl`` "flat", or "auto", which then picks it on any device) reads the bf16
    gradients in its kernel: 2 bytes per parameter less on every rank. torch's fused and foreach
    AdamW (and TE's or apex's) step megatron's fp32 copies of them, made each step and held until
    the next zeroing: more memory, not less. Not with FSDP."""
    cpu_offload: bool = False
    """Experimental (not yet run on a GPU): megatron's optimizer offload (``optimizer_cpu_offload``,
    ``HybridDeviceOptimizer``): the fp32 main weights and Adam moments of ``offload_fraction`` of the
    parameters live in host memory and step there (torch's AdamW), their gradients copied down and weights
    copied back each step. Frees the offloaded share's Adam moments (8 bytes per element) of device memory; a
    bf16 run's fp32 main weights stay on the device too (``dit_mcore.training.memory.state_budget``)."""
    offload_fraction: float = 1.0
    """With ``cpu_offload``: the share of the parameters (by count, in the optimizer's order) whose state is
    offloaded (megatron's ``optimizer_offload_fraction``)."""
    split_main_params: bool = False
    """Keep each fp32 main weight as its bf16 model weight plus a 16-bit remainder, exactly
    (:mod:`dit_mcore.training.split_main`): 2 bytes per parameter of the optimizer's state instead of 4
    (6.2 GiB of a 3.3B model without the distributed optimizer), and 2 fewer for the step to move. Needs
    ``trainer.bf16`` and the flat AdamW (``adam_impl`` "flat", or "auto", which then picks it on any
    device); not with FSDP. The model weights are then rounded ties away from zero, not to even.
    Checkpoints hold fp32 main weights as any run's (joined for a save or a load: 4 more bytes per
    parameter of the optimizer's state for its duration)."""


@dataclass
class DiffusionConfig:
    """Training objective and the sampler used for preview grids."""

    objective: str = "flow"
    """"flow" (rectified flow, logit-normal t), "edm" (Karras preconditioning) or "ddpm" (the original
    DiT's linear-beta epsilon prediction, sampled with DDIM or DDPM)."""
    sample_steps: int = 32
    """Sampler steps for preview grids."""
    cfg_scale: float = 1.5
    """Classifier-free guidance scale for preview grids."""
    ddpm_variance: str = "learned_range"
    """With ``objective="ddpm"``: "learned_range" (DiT's: a model with variance channels, ``model.learn_sigma``,
    learns them with the variational term and the DDPM sampler uses them) or "fixed_small" (the posterior
    variance; the variance channels neither trained nor used)."""

    def build(self):
        """The objective these settings describe (:func:`dit_mcore.diffusion.build_objective`)."""
        from dit_mcore.diffusion import build_objective
        return build_objective(self.objective, **({"variance": self.ddpm_variance} if self.objective == "ddpm" else {}))


@dataclass
class TrainerConfig:
    """Loop length, precision, EMA and checkpoint cadence."""

    max_steps: int = 400_000
    """Optimizer steps to train."""
    seed: int = 1234
    """Seed of weights, data order and noise (each derived per step/rank, so resume is exact)."""
    init_from: Optional[str] = None
    """Start from these weights instead of a random init (fine-tuning: the optimizer, schedule and step start
    fresh): another run's directory, its ``checkpoints/`` or one ``step_*`` folder; a diffusers
    ``DiTTransformer2DModel`` folder; a facebookresearch/DiT ``.pt`` state dict (architecture: ``model.preset``
    and the fields set); or a ``.safetensors`` file written by ``python -m dit_mcore.convert --to safetensors``.
    The model's shape fields left unset come from the source. Ignored once the run has a checkpoint of its
    own (a restart resumes it)."""
    init_weights: str = "ema"
    """With ``init_from`` a dit_mcore checkpoint: start from its "ema" (the average previews draw from) or
    its "model" (the trained) weights."""
    bf16: bool = False
    """bf16 mixed precision: bf16 parameters and compute, fp32 main weights in the optimizer and
    fp32 gradient reduction unless ``optim.main_grads_dtype="bf16"`` (megatron's mixed-precision
    optimizer). Meant for GPUs."""
    ema_decay: float = 0.9999
    """EMA decay of the weights used for sampling (per optimizer step)."""
    ema_every: int = 1
    """Optimizer steps between the EMA's passes over the weights. k > 1 folds k steps' decay in at
    once (``decay^k``: the same average when the weights change little in k steps), so the
    per-parameter pass (10 bytes per parameter; under megatron DDP on every data-parallel rank, under
    FSDP on each rank's shards) runs once every k steps; it also runs at preview steps, periodic
    saves and the last step. A preemption's checkpoint in between holds the EMA as of the last pass
    and the decay still to fold (resume stays exact)."""
    ema_offload: bool = False
    """Keep the EMA shadow (fp32, 4 bytes per parameter: 13 GiB of a 3.3B model) in host memory
    instead of on the GPU. A fold copies the weights to pinned host buffers behind the optimizer step
    and averages them in on the host in a thread while training goes on (the next fold, a checkpoint
    or a preview waits for it); previews move the shadow to the GPU for their duration (a sharded one
    is gathered there). Choose ``ema_every`` so that k steps outlast a host fold: 6-8 ns per
    parameter on two CPU cores (``benchmarks/optimizer_step.py``), seconds for billions of
    parameters; the log names a fold training had to wait for. Under megatron DDP only (FSDP shards
    the shadow already); with ``ema_shard`` each rank keeps and folds only its shard in host memory
    (4 bytes per parameter / DP per rank: a node's hosts hold one shadow, not one per GPU)."""
    ema_shard: Optional[bool] = None
    """Split the EMA shadow over the data-parallel ranks like the distributed optimizer's state: each
    rank keeps the fp32 average of the buffer shard its optimizer updates (4 bytes per parameter / DP
    instead of 4), folds it from the weights the optimizer just wrote (no parameter gather, a 1/DP
    pass), and the whole average is gathered only for previews and checkpoints (bucket by bucket;
    checkpoints hold whole tensors under the same keys, loadable into any layout; a save gathers on
    each rank only what it writes, a load only what its shards need); with ``ema_offload`` the shards
    are in host memory. None: on with ``optim.use_distributed_optimizer`` over more than one data x
    context-parallel rank, unless the model has frozen parameters or buffers; True needs the
    distributed optimizer under megatron DDP. A preview still holds the whole EMA on the GPU while it
    samples."""
    save_interval: int = 1000
    """Steps between checkpoints (a final one is always written)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints to keep (plus the last one before a non-finite step)."""
    async_save: bool = False
    """Write checkpoints from a forked process while training goes on (megatron dist_checkpointing's
    async save): the step stalls only for the snapshot; the checkpoint is published once every rank
    has written it. See ``benchmarks/checkpoint_stall.py`` for the measured stall."""
    val_interval: int = 0
    """Steps between validation losses (0: none): the model and its EMA are evaluated on the same
    validation samples at ``val_levels`` fixed noise levels with fixed noise, so the numbers compare
    across steps, runs and layouts (``val/loss``, ``val/ema_loss`` and one per level, in every sink); also
    after the last step. The samples: ``data.val_path``, else the ``val`` split of ``data.path``; the
    built-in ``digits`` hold every 10th scan out of training for it, ``moving_digits`` draws new clips
    (another seed), ``mock`` another seed's latents. Skipped at a preemption."""
    val_samples: int = 256
    """Validation samples, in whole global batches of ``data.global_batch_size`` (rounded up, or down to
    what the validation data holds; the log names the count)."""
    val_levels: int = 8
    """Noise levels of the validation loss: the training distribution's ``(i + 1/2) / val_levels``
    quantiles (``Objective.validation_levels``)."""
    fid_interval: int = 0
    """Steps between FIDs of the EMA's samples (0: none; also after the last step), logged as ``fid``: the built-in
    ``digits`` only so far (its feature network; other data: ``python -m dit_mcore.evaluate``). Needs the
    command line's hooks (``recipes/pretrain_xl.py``) or ``dit_mcore.evaluate.during_training.FIDDuringTraining``."""
    fid_samples: int = 500
    """Images sampled for each FID during training (every class alike; at least 65)."""
    profile_steps: Optional[str] = None
    """``"A-B"``: a torch profiler trace of steps A to B (1-based, inclusive) per rank, written to
    ``<log.dir>/profile/rank<r>_steps<A>-<B>.json`` (Chrome / Perfetto JSON with shapes, stacks and memory)."""
    memory_snapshot: bool = False
    """CUDA: record the caching allocator's history from the start through step 3 and dump it to
    ``<log.dir>/profile/memory_snapshot_rank<r>.pickle`` (read by https://pytorch.org/memory_viz)."""
    flight_recorder: bool = False
    """NCCL: keep the flight recorder's ring of recent collectives and dump it on a watchdog timeout to
    ``<log.dir>/profile/nccl_trace_rank_<r>`` (for a hang: which rank waits in which collective)."""
    max_skipped_steps: int = 3
    """Steps in a row whose loss or gradient norm is not finite (each skipped, not applied) after
    which the run stops with an error instead of saving diverged weights."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOPS per device for the logged MFU. Default: the data-sheet value of a known GPU
    (H100/H200, B200, A100, L40S) for the run's precision; on other devices (CPU) MFU is logged
    only when this is set."""


@dataclass
class LogConfig:
    """Run directory and what goes into it."""

    dir: str = "runs/dit"
    """Run directory: metrics.jsonl, samples/, tensorboard/, checkpoints/."""
    log_interval: int = 10
    """Steps between console/metrics lines."""
    sample_interval: int = 1000
    """Steps between preview grids (0: only a final grid). Previews are drawn by the generation layer's
    hook, which the command line attaches (``dit_mcore.generate.preview.Previews``; from Python:
    ``pretrain(cfg, hooks=[Previews(cfg.log.sample_interval)])``); the EMA is averaged in at these steps
    either way, so a run's EMA does not depend on how it was launched."""
    samples_per_class: int = 8
    """Grid columns: one row per class (row 0 = class 0)."""
    preview_prompts: Optional[list[str]] = None
    """Text models: the prompts of each preview (one clip each); unset with ``data.name=moving_digits``:
    one prompt per digit, covering every direction."""
    tensorboard: bool = True
    """Also write TensorBoard event files."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0, when its stderr is a terminal (never into a log file)."""
    wandb: bool = False
    """Also log to Weights & Biases (``pip install wandb``): the config once, every metric, preview images; a
    resumed run continues its W&B run; ``WANDB_MODE=offline`` works without a network."""
    wandb_project: str = "dit-mcore"
    """W&B project."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user); default: the logged-in user's."""
    wandb_name: Optional[str] = None
    """W&B run name; default: the run directory's name."""


@dataclass
class RunConfig:
    """Everything a training run needs (what the recipes build)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        """Plain values by section (what every checkpoint records, so that generation, evaluation and
        export read the run from its checkpoint: no model flag is repeated)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """The inverse of :meth:`to_dict`. Fields this version does not know (a checkpoint of a newer
        one) are dropped with a warning; fields it added since take their defaults."""
        sections = {}
        for f in fields(cls):
            section_cls = f.type if dataclasses.is_dataclass(f.type) else f.default_factory
            known = {g.name for g in fields(section_cls)}
            given = dict(values.get(f.name) or {})
            unknown = sorted(set(given) - known)
            if unknown:
                logging.getLogger(__name__).warning("the recorded run config's %s.%s are unknown here; ignored",
                                                    f.name, ", ".join(unknown))
            sections[f.name] = section_cls(**{k: v for k, v in given.items() if k in known})
        return cls(**sections)
