"""One check of a whole parallel layout against the model and the data, before any compute.

Every failure is a :class:`ConfigError` naming the field and the fix; megatron would otherwise fail
deep inside a collective, or worse, train a layout that silently differs from the one-process run.
"""
from __future__ import annotations

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import CP_COMM_TYPES, FSDP_KINDS, ParallelConfig


def check_layout_request(p: ParallelConfig) -> None:
    """``parallel.layout`` is None or "auto", and ``parallel.layout_gpu`` comes only with "auto"."""
    if p.layout not in (None, "auto"):
        raise ConfigError(f"parallel.layout={p.layout!r} is unknown; use parallel.layout=auto or leave it unset")
    if p.layout_gpu is not None and p.layout is None:
        raise ConfigError(f"parallel.layout_gpu={p.layout_gpu!r} is read only with parallel.layout=auto; set that "
                          "too or remove it")


def check_layout(parallel: ParallelConfig, model, data, world_size: int, *,
                 use_distributed_optimizer: bool = False) -> None:
    """Check ``parallel`` for ``world_size`` processes, the model config ``model`` (a ``DiTConfig``
    with the run's sizes; its parallel fields are ignored), ``data`` (a ``DataConfig``) and whether
    the optimizer is megatron's distributed one."""
    p = parallel
    check_layout_request(p)
    if p.layout == "auto":
        raise ConfigError("parallel.layout=auto is chosen before training, by the recipes' train() "
                          "(recipes/pretrain_xl.py); a direct pretrain() call takes a concrete layout: resolve it "
                          "first with dit_mcore.recipes.auto_layout.choose_layout(cfg)")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    if p.ddp_bucket_size is not None and (p.ddp_bucket_size < 1 or not p.overlap_grad_reduce):
        raise ConfigError(f"parallel.ddp_bucket_size={p.ddp_bucket_size} needs parallel.overlap_grad_reduce=True "
                          "(without it megatron reduces one bucket) and >= 1 parameters per bucket; or None "
                          "for megatron's choice")
    p.data_parallel_size(world_size)
    tp = p.tensor_model_parallel_size
    if p.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=True needs parallel.tensor_model_parallel_size > 1 "
                          "(it shards the activations TP leaves replicated); set it to False or raise TP")
    heads, kv_heads = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    if heads % tp or kv_heads % tp:
        raise ConfigError(f"the model's {heads} attention heads ({kv_heads} kv heads) must divide by "
                          f"parallel.tensor_model_parallel_size={tp}; change TP or model.num_attention_heads")
    mesh = getattr(model, "spatial_temporal", False) and model.st_attention == "mesh"
    _check_context_parallel(p, heads // tp, kv_heads // tp, st_mesh=mesh)
    _check_spatial_temporal(p, model, data, heads // tp)
    _check_pipeline(p, model.num_layers, data, world_size)
    _check_experts(p, model.num_moe_experts, world_size)
    _check_token_split(p, model, data)
    _check_tp_comm_overlap(p, model, data)
    _check_fsdp(p, world_size, use_distributed_optimizer)


def _check_context_parallel(p: ParallelConfig, local_heads: int, local_kv_heads: int, st_mesh: bool) -> None:
    cp, method, sizes = p.context_parallel_size, p.cp_comm_type, p.hierarchical_context_parallel_sizes
    if st_mesh:
        return  # the ST-DiT's attention does not use cp_comm_type; _check_spatial_temporal checks the mesh
    if method not in CP_COMM_TYPES:
        raise ConfigError(f"parallel.cp_comm_type={method!r} is unknown; use one of {CP_COMM_TYPES}")
    if method == "a2a+p2p":
        if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != cp:
            raise ConfigError(
                f"parallel.cp_comm_type='a2a+p2p' needs parallel.hierarchical_context_parallel_sizes="
                f"[a2a_size, p2p_size] with product context_parallel_size={cp}, got {sizes} (without it "
                "megatron-based stacks silently attend only to the local chunk)")
    elif sizes:
        raise ConfigError(f"parallel.hierarchical_context_parallel_sizes={sizes} is only used by "
                          f"cp_comm_type='a2a+p2p' (got {method!r}); remove it or switch the method")
    a2a = cp if method == "a2a" else (sizes[0] if method == "a2a+p2p" else 1)
    if a2a > 1 and local_heads % a2a:
        raise ConfigError(f"Ulysses (cp_comm_type={method!r}) splits each rank's {local_heads} attention heads "
                          f"over {a2a} ranks; make the heads per TP rank a multiple of {a2a}, or use "
                          "cp_comm_type='p2p' or 'all_gather'")
    if a2a > 1 and a2a % local_kv_heads and local_kv_heads % a2a:
        raise ConfigError(f"Ulysses over {a2a} ranks needs the {local_kv_heads} kv heads per TP rank to divide "
                          f"or be divided by {a2a}; change model.num_query_groups or the a2a degree")


def _check_spatial_temporal(p: ParallelConfig, model, data, local_heads: int) -> None:
    """The ST-DiT under context parallel: dense video whose frames (and, on a mesh, positions) split
    evenly over the ranks that hold them."""
    cp, sizes = p.context_parallel_size, p.hierarchical_context_parallel_sizes
    if not getattr(model, "spatial_temporal", False):
        return
    mesh = model.st_attention == "mesh"
    if mesh and (cp == 1 or not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != cp):
        raise ConfigError(f"model.st_attention='mesh' needs parallel.context_parallel_size > 1 and "
                          f"parallel.hierarchical_context_parallel_sizes=[inner, outer] with product {cp} "
                          f"(positions over inner ranks, frames over outer ranks), got {sizes}")
    if cp == 1:
        return
    if data.packs or data.uses_energon:  # packed streams: keys and values gathered, any grid works
        if mesh:
            raise ConfigError("model.st_attention='mesh' takes dense video batches (one grid per micro-batch); "
                              "packed data (data.max_seq_len, energon datasets) needs model.st_attention='dsp'")
        return
    inner, outer = (sizes[0], sizes[1]) if mesh else (1, cp)
    frames = data.video_frames if data.name == "moving_digits" else 1
    if frames % outer:
        raise ConfigError(f"the ST-DiT under context parallel shards whole frames: {frames} frame(s) per sample do "
                          f"not split over {outer} ranks; use data.video_frames divisible by {outer}"
                          + ("" if mesh else ", or model.st_attention='mesh' with "
                             "parallel.hierarchical_context_parallel_sizes=[positions, frames]"))
    positions = (model.input_size // model.patch_size) ** 2
    if mesh and (positions % inner or local_heads % inner):
        raise ConfigError(f"model.st_attention='mesh' splits each frame's {positions} positions and each rank's "
                          f"{local_heads} heads over {inner} inner ranks; choose an inner size dividing both")


def _check_pipeline(p: ParallelConfig, num_layers: int, data, world_size: int) -> None:
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if pp == 1:
        if vpp > 1 or first is not None or last is not None:
            raise ConfigError("parallel.virtual_pipeline_model_parallel_size and num_layers_in_first/last_"
                              "pipeline_stage need parallel.pipeline_model_parallel_size > 1")
        return
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or \
            (middle_stages and middle_layers % (middle_stages * vpp)):
        raise ConfigError(
            f"{num_layers} layers do not split over {pp} pipeline stages x {vpp} virtual chunks"
            + (f" with {first} on the first and {last} on the last stage" if first or last else "")
            + "; change model.num_layers, parallel.pipeline_model_parallel_size, "
              "virtual_pipeline_model_parallel_size or num_layers_in_first/last_pipeline_stage")
    for name, n in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if n is not None and (n < 1 or n % vpp):
            raise ConfigError(f"parallel.{name}={n} must be >= 1 and a multiple of the {vpp} virtual chunks")
    if vpp > 1:
        micro = data.num_microbatches(p.data_parallel_size(world_size))
        if micro < pp or micro % pp:
            raise ConfigError(f"the interleaved pipeline schedule needs the micro-batches per step ({micro}) to be "
                              f"a multiple of pipeline_model_parallel_size={pp}; change data.global_batch_size "
                              "or data.micro_batch_size")


def _check_experts(p: ParallelConfig, experts, world_size: int) -> None:
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_size()
    if ep < 1 or etp < 1:
        raise ConfigError(f"parallel.expert_model_parallel_size ({ep}) and expert_tensor_parallel_size ({etp}) "
                          "must be >= 1")
    if ep > 1 and not experts:
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} needs an MoE model: set model.num_moe_experts "
                          "(a multiple of it), or expert_model_parallel_size=1")
    if experts and experts % ep:
        raise ConfigError(f"model.num_moe_experts={experts} must be a multiple of "
                          f"parallel.expert_model_parallel_size={ep}")
    span = ep * etp * p.pipeline_model_parallel_size
    if world_size % span:
        raise ConfigError(f"world size {world_size} is not divisible by expert_model_parallel_size x "
                          f"expert_tensor_parallel_size x pipeline_model_parallel_size = {span}; change the "
                          "expert layout or the number of processes")


def _check_token_split(p: ParallelConfig, model, data) -> None:
    """Dense batches (one image per row) are split along each row, so every row must divide evenly:
    the data's images, and the model's ``input_size`` grid that previews sample on. Packed streams
    are padded at their tail (outside every sample) and split anywhere."""
    shards = p.token_shards()
    if shards == 1:
        return
    why = (f"the token stream is split over context_parallel_size x (tensor_model_parallel_size under "
           f"sequence_parallel) = {shards} ranks")
    sizes = [("model.input_size", model.input_size)]
    if not (data.packs or data.uses_energon):
        sizes.insert(0, ("data.image_size", data.image_size))
    for field, size in sizes:
        side = size // model.patch_size
        if (side * side) % shards:
            raise ConfigError(f"dense images of {field}={size} (patch {model.patch_size}) have {side * side} "
                              f"tokens, not a multiple of {shards}: {why}; change the image size or the layout")


def _check_tp_comm_overlap(p: ParallelConfig, model, data) -> None:
    """The layout side of ``tp_comm_overlap`` (TE and the GPU are checked with the rest of the run)."""
    if not p.tp_comm_overlap:
        return
    if p.tensor_model_parallel_size == 1 or not p.sequence_parallel:
        raise ConfigError("parallel.tp_comm_overlap=True overlaps sequence parallelism's all-gathers and "
                          "reduce-scatters: it needs parallel.tensor_model_parallel_size > 1 and "
                          "parallel.sequence_parallel=True; set them, or tp_comm_overlap=False")
    if data.packs or data.uses_energon:
        raise ConfigError("parallel.tp_comm_overlap=True sizes TE's userbuffers once for a fixed micro-batch, "
                          "and packed streams vary in length: train on dense images, or set it to False")
    if getattr(model, "text_dim", None):
        raise ConfigError("parallel.tp_comm_overlap=True covers the class-conditional DiT (model.family=dit): "
                          "TE has no userbuffer for the text cross-attention's projections; set it to False")


def _check_fsdp(p: ParallelConfig, world_size: int, use_distributed_optimizer: bool) -> None:
    if p.fsdp not in FSDP_KINDS:
        raise ConfigError(f"parallel.fsdp={p.fsdp!r} is unknown; use one of {FSDP_KINDS}")
    if p.fsdp == "none":
        if p.fsdp_shard_size is not None:
            raise ConfigError(f"parallel.fsdp_shard_size={p.fsdp_shard_size} needs parallel.fsdp='torch' or "
                              "'megatron' (it sets the HSDP shard group); remove it or turn FSDP on")
        return
    refusals = [
        (p.pipeline_model_parallel_size > 1, "pipeline_model_parallel_size > 1",
         "megatron-core 0.16's FSDP wrappers have no pipeline dimension (Megatron-FSDP builds its device mesh as "
         "data x expert x tensor parallel over the whole world; TorchFullyShardedDataParallel shards the whole model); "
         "use pipeline_model_parallel_size=1 or parallel.fsdp='none' with optim.use_distributed_optimizer=True"),
        (p.expert_model_parallel_size > 1 and p.fsdp == "torch", "expert_model_parallel_size > 1",
         "megatron's TorchFullyShardedDataParallel shards every parameter over one data-parallel mesh, and experts "
         "differ per expert-parallel rank; use parallel.fsdp='megatron' (it shards experts over the "
         "expert-data-parallel group) or parallel.fsdp='none' with optim.use_distributed_optimizer=True"),
        (p.expert_model_parallel_size > 1 and p.fsdp == "megatron" and p.expert_data_parallel_size(world_size) == 1,
         f"expert_model_parallel_size={p.expert_model_parallel_size} with no rank sharing an expert (expert data "
         "parallel size 1)",
         "Megatron-FSDP then leaves the experts' gradients unscaled (measured: the gradient norm off one process's); "
         "use fewer expert-parallel ranks than data x context parallel ones, or parallel.fsdp='none' with "
         "optim.use_distributed_optimizer=True"),
        (p.expert_model_parallel_size > 1 and p.fsdp == "megatron" and p.fsdp_shard_size is not None,
         f"expert_model_parallel_size={p.expert_model_parallel_size} and fsdp_shard_size={p.fsdp_shard_size} (HSDP)",
         "Megatron-FSDP's HSDP with experts crashed a rank on CPU/gloo (megatron-core 0.16.1); shard over all data x "
         "context parallel ranks (remove parallel.fsdp_shard_size)"),
        (use_distributed_optimizer, "optim.use_distributed_optimizer=True",
         "FSDP already shards the optimizer state; set optim.use_distributed_optimizer=False"),
        (p.overlap_grad_reduce or p.overlap_param_gather, "overlap_grad_reduce / overlap_param_gather",
         "FSDP overlaps its own gathers and reductions (Megatron-FSDP always); set both to False"),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"parallel.fsdp={p.fsdp!r} does not combine with {what}: {fix}")
    ranks = p.data_parallel_size(world_size) * p.context_parallel_size
    if p.fsdp_shard_size is not None and (p.fsdp_shard_size < 1 or ranks % p.fsdp_shard_size):
        raise ConfigError(f"parallel.fsdp_shard_size={p.fsdp_shard_size} must divide the {ranks} data x context "
                          f"parallel ranks that FSDP spans; use a divisor of {ranks}")
