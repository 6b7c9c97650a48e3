"""Fully sharded data parallelism: FSDP2 through megatron-core's ``TorchFullyShardedDataParallel``,
and HSDP (shard inside groups of ``parallel.fsdp_shard_size`` ranks, replicate across them).

Parameters, gradients and optimizer state are sharded along dim 0 over the data x context parallel
ranks (of one HSDP group); each transformer layer is gathered just in time for its forward and
backward. Three things megatron's wrapper leaves to its caller are done here:

- the loss is a sum over samples that megatron divides by the global sample count
  (``calculate_per_token_loss``), so the gradient reduce-scatter must sum, not average;
- under HSDP the reduce-scattered shards are summed across the replica groups (megatron's
  ``num_distributed_optimizer_instances`` groups: the intra-instance group shards, the
  inter-instance group replicates);
- checkpoints stay megatron ``dist_checkpointing`` checkpoints with global keys, so an FSDP run
  resumes under any other layout and the other way round: while a checkpoint is written or read
  the model and optimizer are viewed whole (:func:`whole_checkpoint_view`); a save writes each
  rank's rows of those whole tensors (never gathered), a load reads whole tensors and cuts them back
  to this rank's shards. (megatron's own FSDP2 checkpoint path writes the
  shards directly but assumes every dim 0 divides evenly and matches optimizer states to
  parameters by the identity of ``to_local()`` views, which are new objects each call.)
"""
from __future__ import annotations

import collections
import contextlib
import sys
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dit_mcore.parallel.adam_step import step_device
from dit_mcore.parallel.initialize import on_any_rank


class FailedOnAnotherRank(RuntimeError):
    """A collective load that failed on another rank (whose own error names the cause)."""


def fsdp_groups() -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    """(shard group, replicate group or None): megatron's partial data-parallel groups when the run
    was initialised with ``num_distributed_optimizer_instances > 1`` (HSDP), else DP x CP."""
    shard = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    full = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if shard.size() == full.size():
        return shard, None
    replicate = parallel_state.get_inter_distributed_optimizer_instance_group()
    ranks = [set(dist.get_process_group_ranks(g)) for g in (shard, replicate, full)]
    if ranks[0] & ranks[1] != {dist.get_rank()} or not ranks[1] <= ranks[2] \
            or shard.size() * replicate.size() != full.size():
        raise RuntimeError(f"HSDP groups do not tile the data x context parallel group {sorted(ranks[2])}: "
                           f"shard {sorted(ranks[0])}, replicate {sorted(ranks[1])}")
    return shard, replicate


class FSDPChunk(TorchFullyShardedDataParallel):
    """One model chunk under FSDP2 (HSDP when ``replicate_group`` is given); the same hooks as
    megatron's DDP for the schedule and ``finalize_model_grads``."""

    def __init__(self, config, ddp_config, module: torch.nn.Module, *, shard_group: dist.ProcessGroup,
                 replicate_group: Optional[dist.ProcessGroup] = None):
        # Each transformer layer is its own FSDP unit; embedders and the final layer go with the root.
        super().__init__(config, ddp_config, module, sub_modules_to_wrap={TransformerLayer},
                         process_group=shard_group)
        for unit in module.modules():
            if isinstance(unit, FSDPModule):  # megatron divides by the global sample count itself:
                unit.set_gradient_divide_factor(1.0)  # reduce-scatter with a plain sum
                unit.set_force_sum_reduction_for_comms(True)
        self.replicate_group = replicate_group

    def _local_grads(self) -> list[torch.Tensor]:
        return [local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """FSDP2 reduce-scattered every gradient inside the shard group during backward; under HSDP
        sum the shards across the replica groups (one flat all-reduce)."""
        if self.replicate_group is None or self.replicate_group.size() == 1:
            return
        grads = self._local_grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.replicate_group)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)

    def scale_gradients(self, scaling_factor: float) -> None:
        torch._foreach_mul_(self._local_grads(), scaling_factor)

    def load_state_dict(self, state_dict, strict: bool = True):
        self.module.load_state_dict(state_dict, strict=strict)


def shard_module(module: torch.nn.Module, config, ddp_config, groups) -> FSDPChunk:
    """Shard ``module`` in place (its parameters become ``DTensor`` shards) and wrap it."""
    shard_group, replicate_group = groups
    return FSDPChunk(config, ddp_config, module, shard_group=shard_group, replicate_group=replicate_group)


def _megatron_fsdp(modules) -> list:
    """The Megatron-FSDP engines (``MegatronFSDP``) sharding ``modules`` (a module or an iterable)."""
    modules = [modules] if isinstance(modules, torch.nn.Module) else modules
    return [m.__dict__["_megatron_fsdp"] for module in modules for m in module.modules()
            if "_megatron_fsdp" in m.__dict__]


def to_shards(modules) -> None:
    """Before reading or writing parameters outside a forward (EMA, checkpoints), make them the
    sharded ones. Megatron-FSDP swaps a module's parameters for views of its gathered weight buffer
    for the forward and leaves them so after the optimizer step (the buffer released);
    ``synchronize_param_gather`` swaps its sharded (main) parameters back. FSDP2: a no-op."""
    for engine in _megatron_fsdp(modules):
        engine.synchronize_param_gather()


def publish_weights(modules) -> None:
    """After writing into the sharded parameters outside the optimizer (loading, initialisation),
    make the forward see them: Megatron-FSDP computes with a buffer of model weights that its
    optimizer step refreshes from the sharded (main) parameters. FSDP2 computes with the shards
    themselves (a no-op)."""
    for engine in _megatron_fsdp(modules):
        engine.install_optimized_model_weights()


@contextlib.contextmanager
def forward_view(modules):
    """Inside, ``modules`` can be called directly, not through their data-parallel wrapper (the EMA
    shadow drawing previews): Megatron-FSDP's weight buffers are refreshed from the sharded (main)
    parameters (the EMA writes only those) and its ``forward``'s first step, swapping in the
    parameters its hooks gather, is taken (a private step of megatron's, with no public equivalent
    short of its forward); they are the sharded ones again on exit. No-op otherwise."""
    engines = _megatron_fsdp(modules)
    publish_weights(modules)
    for engine in engines:
        engine._replace_param_with_raw_if_needed()
    try:
        yield
    finally:
        errors = []
        for engine in engines:  # each engine restored, even if another one fails
            try:
                engine.synchronize_param_gather()
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
        if errors and sys.exc_info()[1] is None:  # never mask the error that ended the block
            raise errors[0]


def sharded_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters in order, as this rank's local shards: under Megatron-FSDP its sharded
    (main) weights, whatever the module shows now (gathered views from the forward until
    :func:`to_shards`); under FSDP2 the ``DTensor``s' local parts; otherwise the tensors themselves."""
    mains = {}
    for prefix, m in module.named_modules():
        engine = m.__dict__.get("_megatron_fsdp")
        if engine is not None:
            for name, p in engine.param_and_grad_buffer.optimizer_named_parameters:
                mains[f"{prefix}.{name}" if prefix else name] = p
    return [local(mains.get(name, p)) for name, p in module.named_parameters()]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (the tensor itself when it is not sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_OPTIMIZER_GROUPS = ("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups")


@contextlib.contextmanager
def whole_checkpoint_view(modules, optimizer, *, loading: bool):
    """Inside, FSDP-sharded ``modules`` and ``optimizer`` look like their unsharded selves, so
    megatron builds (and loads into) the same sharded state dict as under any other layout: every
    ``DTensor`` among the modules' parameters and the optimizer's parameters, main weights and
    states is swapped for a whole-shape stand-in (one object per tensor, so megatron still matches
    optimizer states to parameters). Saving, the stand-ins are placeholders on the meta device, and
    :meth:`CheckpointView.localize` turns the state dict built over them into this rank's rows (no
    memory beyond the shards). With ``loading`` they are gathered whole copies, and whatever was
    loaded into them is cut back into this rank's shards on exit (one unsharded model and optimizer
    state per rank while open). ``optimizer`` None: the modules alone (``trainer.init_from`` reads its
    weights into the whole copies, then loads them with :func:`shard_like`). A no-op without FSDP. Yields a
    :class:`CheckpointView`.

    Megatron-FSDP's module parameters are its fp32 main weights; when it computes in bf16 the
    modules show bf16 copies instead and the optimizer is checkpointed as megatron's mixed-precision
    optimizer (main weights as ``fp32_param``), as a DDP run writes it."""
    to_shards(modules)
    if not any(isinstance(p, DTensor) for module in modules for p in module.parameters()):
        yield CheckpointView(optimizer)
        return
    copies, pairs = {}, []  # id(shard) -> whole copy; (shard, whole) for the write-back
    sources = {}  # saving: id(placeholder) -> (shard, dtype to write it in, or None)
    model_dtypes = _model_weight_dtypes(modules)  # Megatron-FSDP: main weight id -> compute dtype
    casts = {}  # id(shard) -> whole copy in the compute dtype, shown by the module

    def module_copy(x):
        full = swap(x)
        dtype = model_dtypes.get(id(x), full.dtype)
        if dtype == full.dtype:
            return full
        if id(x) not in casts:
            cast = torch.nn.Parameter(full.detach().to(dtype), requires_grad=full.requires_grad)
            for attr, value in vars(full).items():
                setattr(cast, attr, value)
            casts[id(x)] = cast
            if not loading:
                sources[id(cast)] = (x, dtype)
        return casts[id(x)]

    def swap(x):
        if not isinstance(x, DTensor):
            return x
        if id(x) not in copies:
            # Loading gathers the whole tensor to load into; saving needs only its shape (a
            # placeholder on the meta device, written as this rank's rows by CheckpointView.localize).
            full = whole(x) if loading else torch.empty(unsharded_shape(x), dtype=x.dtype, device="meta")
            if isinstance(x, torch.nn.Parameter):
                full = torch.nn.Parameter(full, requires_grad=x.requires_grad)
                for attr, value in vars(x).items():  # megatron's tensor/pipeline-parallel tags
                    if not attr.startswith("_"):
                        setattr(full, attr, value)
            copies[id(x)] = full
            if loading:
                pairs.append((x, full))
            else:
                sources[id(full)] = (x, None)
        return copies[id(x)]

    # Module parameters, swapped in place: FSDP2's state-dict hook only reshards an unsharded
    # group, and these groups stay sharded, so state_dict() sees the whole copies.
    owners = [(m, name, p) for module in modules for m in module.modules()
              for name, p in m._parameters.items() if isinstance(p, DTensor)]
    for m, name, p in owners:
        m._parameters[name] = module_copy(p)
    saved = []
    for opt in [] if optimizer is None else getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        _same_state_everywhere(opt)
        params = [group["params"] for group in inner.param_groups]
        groups = {name: getattr(opt, name) for name in _OPTIMIZER_GROUPS if hasattr(opt, name)}
        saved.append((opt, inner, params, groups, inner.state))
        for group in inner.param_groups:
            group["params"] = [swap(p) for p in group["params"]]
        # Gathered in parameter order, not in the order states were created (which differs by rank
        # when some ranks hold no rows of a parameter).
        ordered = [p for group in params for p in group if p in inner.state]
        seen = {id(p) for p in ordered}
        ordered += [p for p in inner.state if id(p) not in seen]
        inner.state = collections.defaultdict(dict, {swap(p): {k: swap(v) for k, v in sorted(inner.state[p].items())}
                                                     for p in ordered})
        for name, value in groups.items():
            setattr(opt, name, [[swap(p) for p in group] for group in value])
    failed = False
    experts = {id(copies[key]) for key in _expert_weights(modules) if key in copies}
    checkpointable, merge_loaded = _checkpointable(optimizer, {id(copies[key]): cast for key, cast in casts.items()},
                                                   experts)
    try:
        yield CheckpointView(checkpointable, restored_by_optimizer=set(casts), sources=sources)
    except BaseException:
        failed = True
        raise
    finally:
        # A load that failed on any rank leaves every rank's shards as they were (cutting would
        # gather on some ranks only); the ranks agree on it first.
        cut = loading and not on_any_rank(failed, owners[0][2].to_local().device)
        if cut:
            merge_loaded()
        for m, name, p in owners:
            m._parameters[name] = p
        for opt, inner, params, groups, sharded_state in saved:
            if cut:  # the loaded whole states, cut to this rank's shards
                back = {id(copies[id(p)]): p for group in params for p in group}
                inner.state = collections.defaultdict(dict, {
                    back.get(id(p), p): {k: _shard_as(v, back[id(p)]) if id(p) in back else v
                                         for k, v in state.items()}
                    for p, state in inner.state.items()})
            else:  # the sharded states as they were (training goes on with them)
                inner.state = sharded_state
            for group, original in zip(inner.param_groups, params):
                group["params"] = original
            for name, value in groups.items():
                setattr(opt, name, value)
        if cut:
            with torch.no_grad():
                for shard, full in pairs:
                    shard.to_local().copy_(_shard_as(full.detach(), shard).to_local())
        elif loading and not failed:
            raise FailedOnAnotherRank("the checkpoint failed to load on another rank (see its error); nothing was "
                                      "loaded")


def _same_state_everywhere(opt) -> None:
    """Megatron-FSDP may give a rank no rows of a parameter; torch's Adam then never sees a gradient
    for it there and keeps no state, so ranks would gather different optimizer states. Give every
    parameter the state megatron's ``init_state_fn`` gives a fresh one, and torch's Adam ``step``
    (where a parameter's shard is empty or has none) the latest step any rank took; nothing before
    the first step (no rank has state then)."""
    inner = opt.optimizer
    shards = [p for group in inner.param_groups for p in group["params"] if isinstance(p, DTensor)]
    if not shards:
        return
    steps = [state["step"] for state in inner.state.values() if torch.is_tensor(state.get("step"))]
    latest = torch.tensor([max((float(s) for s in steps), default=-1.0)], device=shards[0].to_local().device)
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)  # on the shards' device: NCCL reduces no host tensors
    latest = latest.item()
    if latest < 0:
        return
    if getattr(opt, "init_state_fn", None) is not None:
        opt.init_state_fn(inner, opt.config)
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if isinstance(p, DTensor) and (p.to_local().numel() == 0 or "step" not in state):
                state["step"] = torch.tensor(latest, dtype=torch.float32, device=step_device(group, p))
            for key in ("exp_avg", "exp_avg_sq"):
                state.setdefault(key, torch.zeros_like(p))


class CheckpointView:
    """What :func:`whole_checkpoint_view` yields: the optimizer to checkpoint, and how to load a
    module's state after the view (cut to the shards, leaving out parameters whose fp32 main
    weights the optimizer already restored)."""

    def __init__(self, optimizer, restored_by_optimizer: frozenset = frozenset(), sources: Optional[dict] = None):
        self.optimizer = optimizer
        self._restored = restored_by_optimizer
        self._sources = sources or {}

    def localize(self, state: dict) -> dict:
        """Saving: every ``ShardedTensor`` of ``state`` built over a whole-shape placeholder becomes the
        rows this rank holds (no rank gathers a whole tensor): fragments of a common row count,
        placed at their global offsets, written once per HSDP replica group. The exception is a
        ``ShardedTensorFactory`` (megatron's split of a SwiGLU ``fc1``), which is given the gathered
        tensor to cut. Returns ``state``."""
        if not self._sources:
            return state
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        _, replicate = fsdp_groups()
        replica = replicate.rank() if replicate is not None else 0

        def localized(value):
            if not isinstance(value, (ShardedTensor, ShardedTensorFactory)) or value.data is None \
                    or not value.data.is_meta:
                return value
            if id(value.data) not in self._sources:
                raise RuntimeError(f"checkpoint key {value.key}: a placeholder with no FSDP shard behind it")
            shard, dtype = self._sources[id(value.data)]
            if isinstance(value, ShardedTensorFactory):  # megatron cuts the whole tensor itself (SwiGLU's
                data = whole(shard)  # fc1 into its two halves): that tensor alone is gathered
                value.data = data if dtype is None else data.to(dtype)
                return value
            return _row_fragments(value, shard, dtype, replica)
        return dict_list_map_inplace(localized, state)

    def load_module(self, module: torch.nn.Module, state_dict: dict) -> None:
        own = dict(module.named_parameters())
        kept = {name: own[name] if name in own and id(own[name]) in self._restored else value
                for name, value in state_dict.items()}
        module.load_state_dict(shard_like(kept, module))


def _row_fragments(tensor, shard: DTensor, dtype, replica: int):
    """``tensor`` (a ``ShardedTensor`` of the whole, FSDP-unsharded shape) as the rows ``shard``
    holds here. FSDP cuts dim 0 anywhere (Megatron-FSDP) or as ``torch.chunk`` does, and megatron's
    checkpoints describe a tensor as a grid of equal chunks, so the rows go out in chunks of the
    greatest common divisor of all ranks' boundaries (one chunk per rank when the rows divide evenly)."""
    import dataclasses
    import math
    layout = _fsdp_rows(shard)
    if layout is None:  # not row shards: gathered, as a whole copy
        data = whole(shard)
        return dataclasses.replace(tensor, data=data if dtype is None else data.to(dtype))
    offsets, _, rank, shape = layout
    rows, axis = shape[0], tensor.prepend_axis_num
    if tensor.local_shape[0] != rows:
        raise RuntimeError(f"checkpoint key {tensor.key}: {tensor.local_shape[0]} rows, the shards hold {rows}")
    step = math.gcd(*offsets)
    local = shard.to_local().detach()
    local = local if dtype is None else local.to(dtype)
    grid = list(tensor.axis_fragmentations)
    grid[axis] *= rows // step

    def chunk(data, row: int, replica_rank: int):  # ``step`` rows at ``row`` of this TP slice
        offset = list(tensor.global_offset)
        offset[axis] += row
        replica_id = (*tensor.replica_id[:-1], replica_rank) if isinstance(tensor.replica_id, tuple) else replica_rank
        return dataclasses.replace(tensor, data=data, local_shape=(step, *tensor.local_shape[1:]), global_offset=tuple(offset),
                                   axis_fragmentations=tuple(grid), replica_id=replica_id)
    start, end = offsets[rank], offsets[rank + 1]
    fragments = [chunk(local[row - start: row - start + step], row, replica) for row in range(start, end, step)]
    if not fragments:  # no rows here (Megatron-FSDP): a copy of the first chunk that is never written,
        # since an empty entry would be saved as this key's (common) value
        fragments.append(chunk(local.new_zeros((step, *tensor.local_shape[1:])), 0, replica + 1))
    return fragments[0] if len(fragments) == 1 else fragments


def _model_weight_dtypes(modules) -> dict:
    """id(sharded main weight) -> dtype the forward computes in, for Megatron-FSDP modules."""
    return {id(main): engine.raw_param[name].dtype for engine in _megatron_fsdp(modules)
            for name, main in engine.param_and_grad_buffer.optimizer_named_parameters if name in engine.raw_param}


def _expert_weights(modules) -> set:
    """id(sharded main weight) of the experts' weights under Megatron-FSDP (megatron tags the module's
    own expert-parallel parameters ``allreduce=False``; the optimizer's groups do not tell them apart)."""
    return {id(main) for engine in _megatron_fsdp(modules)
            for name, main in engine.param_and_grad_buffer.optimizer_named_parameters
            if getattr(engine.raw_param.get(name), "allreduce", True) is False}


def _checkpointable(optimizer, model_copies: dict, experts: set):
    """Megatron-FSDP's distributed optimizer checkpoints only in torch DCP's ``fsdp_dtensor`` format;
    what it optimizes is torch's Adam over the sharded (fp32 main) parameters, whole inside the view:
    exactly what megatron's ``FP32Optimizer`` checkpoints in one process, or, with ``model_copies``
    (id(whole main weight) -> the module's bf16 copy), its mixed-precision optimizer (same keys as
    a DDP run, any layout). With experts (``experts``: their whole main weights' ids), the dense and the
    expert weights are two such optimizers chained, as megatron's DDP chains them (``chained_0.*``,
    ``chained_1.*``, the expert groups tagged ``is_expert_parallel``), so that checkpoints load across
    the two. Returns the optimizer to checkpoint and what puts a load into the real one."""
    if not getattr(getattr(optimizer, "ddp_config", None), "use_megatron_fsdp", False):
        return optimizer, lambda: None
    inner = optimizer.optimizer
    parts = [[(i, [p for p in group["params"] if (id(p) in experts) is expert])
              for i, group in enumerate(inner.param_groups)] for expert in (False, True)]
    parts = [[(i, params) for i, params in part if params] for part in parts]
    if not parts[1]:
        return _mixed_precision_view(optimizer, inner, model_copies), lambda: None
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    pieces = [_groups_of(inner, part, expert) for part, expert in zip(parts, (False, True))]

    def merge_loaded():  # what each piece loaded (its groups' settings, its states), into the whole optimizer
        settings = {}
        for piece, part in zip(pieces, parts):
            for (i, _), group in zip(part, piece.param_groups):
                loaded = {k: v for k, v in group.items() if k not in ("params", "is_expert_parallel")}
                if settings.setdefault(i, loaded) != loaded:  # (one group here, two in the checkpoint)
                    raise RuntimeError(f"the checkpoint's dense and expert parameter groups differ ({settings[i]} vs "
                                       f"{loaded}) where Megatron-FSDP steps them as one group")
                inner.param_groups[i].update(loaded)
            inner.state.update(piece.state)
    return ChainedOptimizer([_mixed_precision_view(optimizer, piece, model_copies) for piece in pieces]), merge_loaded


def _groups_of(inner: torch.optim.Optimizer, part: list, expert: bool) -> torch.optim.Optimizer:
    """The torch optimizer ``inner`` over some of its parameters (``part``: (group index, its parameters
    here)): same class, settings and per-parameter states, each group tagged as megatron tags a DDP
    run's (``is_expert_parallel``); a load replaces groups and states here only."""
    piece = object.__new__(type(inner))
    piece.__dict__.update(inner.__dict__)
    piece.param_groups = [{**inner.param_groups[i], "params": params, "is_expert_parallel": expert}
                          for i, params in part]
    own = {id(p) for _, params in part for p in params}
    piece.state = collections.defaultdict(dict, {p: s for p, s in inner.state.items() if id(p) in own})
    return piece


def _mixed_precision_view(optimizer, inner: torch.optim.Optimizer, model_copies: dict):
    """Megatron's ``FP32Optimizer`` over ``inner``, or, with ``model_copies``, its mixed-precision
    optimizer (the modules' bf16 copies as its float16 groups)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params, MegatronOptimizer
    if not model_copies:
        return FP32Optimizer(inner, optimizer.config, optimizer.init_state_fn)
    # The mixed-precision optimizer's state-dict methods over these groups; its constructor would
    # make new main weights, so only the base class is initialised.
    view = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    MegatronOptimizer.__init__(view, inner, optimizer.config, optimizer.init_state_fn)
    view.grad_scaler = None
    view.fp32_from_float16_groups = [list(group["params"]) for group in inner.param_groups]
    view.float16_groups = [[model_copies[id(p)] for p in group] for group in view.fp32_from_float16_groups]
    return view


def shard_like(state_dict: dict, module: torch.nn.Module) -> dict:
    """Cut the whole tensors of a loaded state dict to the shards ``module``'s ``DTensor``
    parameters hold (load it with ``module.load_state_dict`` outside ``whole_checkpoint_view``)."""
    own = dict(module.named_parameters())
    return {name: _shard_as(value, own.get(name)) for name, value in state_dict.items()}


@torch.no_grad()
def copy_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` into ``target``, or into this rank's shard of it when it is a ``DTensor``."""
    if isinstance(target, DTensor):
        target.to_local().copy_(_shard_as(whole, target).to_local())
    else:
        target.copy_(whole)


@torch.no_grad()
def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The value of a tensor unsharded by FSDP, on every rank of its mesh (detached). A
    tensor-parallel weight stays this rank's tensor-parallel slice."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    layout = _fsdp_rows(tensor)
    if layout is None:
        return tensor.full_tensor()
    offsets, group, _, shape = layout
    piece = tensor.to_local().detach()
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    padded = piece.new_zeros((longest, *shape[1:]))
    padded[: piece.shape[0]] = piece
    gathered = piece.new_empty((longest * group.size(), *shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([part[: b - a] for part, a, b in zip(gathered.chunk(group.size()), offsets, offsets[1:])])


def unsharded_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of :func:`whole` (Megatron-FSDP's tensor-parallel ``DTensor``s report the shape of
    all tensor-parallel ranks together)."""
    if not isinstance(tensor, DTensor):
        return tensor.shape
    shape = list(tensor.shape)
    for dim, placement in _tensor_parallel_dims(tensor):
        shape[placement.dim] //= tensor.device_mesh.size(dim)
    return torch.Size(shape)


def _tensor_parallel_dims(tensor: DTensor) -> list:
    names = tensor.device_mesh.mesh_dim_names or ()
    return [(dim, placement) for dim, placement in enumerate(tensor.placements)
            if dim < len(names) and names[dim] == "tp" and placement.is_shard()]


def _fsdp_rows(tensor: DTensor):
    """For a tensor FSDP shards along dim 0 over one mesh dimension (replicated over the others,
    but for Megatron-FSDP's ``tp`` dimension, which keeps its tensor-parallel split): where each
    rank's rows start (and, last, the row count), the group it is sharded over, this rank's place
    in it and the unsharded shape, from the shards' actual sizes. Megatron-FSDP cuts its flat
    buffers at any row (a shard may be empty), FSDP2 as ``torch.chunk`` does; the sizes cover both.
    None for other layouts, which DTensor's even sharding describes."""
    tensor_parallel = {dim for dim, _ in _tensor_parallel_dims(tensor)}
    sharded = [dim for dim, placement in enumerate(tensor.placements)
               if dim not in tensor_parallel and placement == Shard(0)]
    if len(sharded) != 1 or not all(placement.is_replicate() for dim, placement in enumerate(tensor.placements)
                                    if dim not in tensor_parallel and dim != sharded[0]):
        return None
    group, shape = tensor.device_mesh.get_group(sharded[0]), unsharded_shape(tensor)
    local = tensor.to_local()
    rows = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    sizes = rows.new_empty(group.size())
    dist.all_gather_into_tensor(sizes, rows, group=group)
    sizes = sizes.tolist()
    if sum(sizes) != shape[0]:
        raise RuntimeError(f"shards of {sizes} rows do not add up to the {shape[0]} of a {tuple(shape)} tensor")
    offsets = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
    return offsets, group, tensor.device_mesh.get_local_rank(sharded[0]), shape


def _shard_as(value, reference):
    if not isinstance(reference, DTensor) or isinstance(value, DTensor) or not torch.is_tensor(value) \
            or value.shape != unsharded_shape(reference):
        return value
    layout = _fsdp_rows(reference)
    if layout is None:
        piece = distribute_tensor(value.to(reference.device), reference.device_mesh, reference.placements,
                                  src_data_rank=None).to_local()
    else:
        offsets, _, rank, _ = layout
        piece = value[offsets[rank]: offsets[rank + 1]].to(reference.device)
    return DTensor.from_local(piece.clone(), reference.device_mesh, reference.placements,
                              shape=reference.shape, stride=reference.stride())
