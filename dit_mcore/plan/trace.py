"""A training micro-batch traced, not a hand formula: the run's own model and training micro-batch
(:class:`dit_mcore.training.step_loss.StepLoss`) run forward and backward under ``FakeTensorMode``, where
nothing is allocated and no arithmetic is done, while :class:`LiveMemory` follows every storage autograd
and the kernels create and free, and :class:`OpCosts` adds up each operator's FLOPs, memory traffic
and collectives. Two traces, one and two layers deep,
give what the parts outside the layer stack hold and what each layer adds, for the run's recompute
mode, attention kernel, packing and dtype; any depth is then a sum. Whatever the code saves for
backward (adaLN's normalised inputs, gated branches, the text keys and values, an ST-DiT's second
attention, an MoE's routing) is counted because it is saved, not because a formula lists it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import sys
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from dit_mcore.diffusion import drop_labels
from dit_mcore.models.layer_stack import quiet_default_tp_group
from dit_mcore.models.moe import reset_moe_state
from dit_mcore.models.registry import get_family
from dit_mcore.parallel.pipeline import ModelChunks
from dit_mcore.plan.device_kernels import gpu_kernels
from dit_mcore.plan.live_memory import LiveMemory
from dit_mcore.plan.op_costs import OpCosts
from dit_mcore.training.step_loss import StepLoss


@dataclass(frozen=True)
class MicroBatchTrace:
    """What one micro-batch's forward and backward cost its rank, beyond the run's per-parameter state."""

    saved: float
    """Bytes live once its forward is done: what autograd keeps for the backward, and the loss."""
    peak: float
    """The most bytes live at once through its forward and backward, alone in flight."""
    gemm_flops: float = 0.0
    """Matrix products, forward, backward and recomputed (:class:`OpCosts`)."""
    attention: tuple = ()
    """``((s_k, FLOPs), ...)``: attention kernels' work by the length of the keys each query attends to."""
    memory_bytes: float = 0.0
    """Read and written by every other operator."""
    comm: tuple = ()
    """``((collective, group name, group size, bytes), ...)`` sent inside the micro-batch (TP/SP, CP, EP; the
    names of :func:`~dit_mcore.plan.op_costs.group_names`)."""
    ops: tuple = ()
    """``((operator, "calls" | "flops" | "bytes", amount), ...)``: the work above, operator by operator."""

    @property
    def attention_flops(self) -> float:
        return sum(f for _, f in self.attention)

    def __add__(self, other: "MicroBatchTrace") -> "MicroBatchTrace":
        return MicroBatchTrace(self.saved + other.saved, self.peak + other.peak, self.gemm_flops + other.gemm_flops,
                               _merged(self.attention, other.attention), self.memory_bytes + other.memory_bytes,
                               _merged(self.comm, other.comm), _merged(self.ops, other.ops))

    def __mul__(self, x: float) -> "MicroBatchTrace":
        return MicroBatchTrace(self.saved * x, self.peak * x, self.gemm_flops * x,
                               tuple((*key, f * x) for *key, f in self.attention), self.memory_bytes * x,
                               tuple((*key, b * x) for *key, b in self.comm),
                               tuple((*key, a * x) for *key, a in self.ops))


def _merged(a: tuple, b: tuple) -> tuple:
    """Two ``((*key, amount), ...)`` tables as one, amounts of a key summed, sorted by key."""
    out: dict = {}
    for *key, amount in (*a, *b):
        out[tuple(key)] = out.get(tuple(key), 0.0) + amount
    return tuple((*key, amount) for key, amount in sorted(out.items()))


@dataclass(frozen=True)
class LayerProfile:
    """A micro-batch as ``outside + layers x per_layer``: the embeddings, conditioning, final layer,
    inputs and loss (``outside``), and what each layer of the stack adds (``per_layer``)."""

    outside: MicroBatchTrace
    per_layer: MicroBatchTrace

    def at(self, layers: int) -> MicroBatchTrace:
        return self.outside + self.per_layer * layers

    def __mul__(self, samples: float) -> "LayerProfile":
        return LayerProfile(self.outside * samples, self.per_layer * samples)

    def in_flight(self, layers: int, microbatches: float) -> float:
        """The peak bytes of ``microbatches`` micro-batches in flight on ``layers`` layers (a pipeline
        stage under 1F1B holds several forwards' saved tensors while the oldest runs its backward)."""
        one = self.at(layers)
        return (microbatches - 1) * one.saved + one.peak


def run_parts(cfg, num_layers: int) -> tuple:
    """The model config of ``cfg`` made ``num_layers`` deep, its objective and compute dtype."""
    cfg = copy.deepcopy(cfg)
    cfg.model.num_layers = num_layers
    model_config = cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16)
    if model_config.num_moe_experts:  # balanced routing, in static shapes (see balanced_experts)
        model_config.moe_expert_capacity_factor, model_config.moe_pad_expert_input_to_capacity = 1.0, True
    return model_config, cfg.diffusion.build(), torch.bfloat16 if cfg.trainer.bf16 else torch.float32


def fake_chunks(cfg, model_config) -> ModelChunks:
    """This rank's chunks of the run's model for ``model_config``, built under the caller's
    ``FakeTensorMode`` in the compute dtype."""
    family = get_family(cfg.model.family)
    with torch.device("cpu"):
        chunks = ModelChunks.build(lambda **stage: family.build(model_config, backend=cfg.model.backend, **stage),
                                   model_config.virtual_pipeline_model_parallel_size, seed=0)
    dtype = torch.bfloat16 if cfg.trainer.bf16 else torch.float32
    for p in chunks.parameters():
        p.data = p.data.to(dtype)  # (ModelChunks.of_family's cast, which cannot swap fake parameters)
    return chunks


class _RealHostTensors(TorchDispatchMode):
    """Operators on real tensors alone (the batch's host-side grids and offsets, which the model reads as
    integers) run for real, and so do factories of small integer tensors (counts and offsets, such as
    megatron's tokens per expert); everything that touches a fake tensor, and every other factory,
    stays fake."""

    SMALL = 1 << 16

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not tensors and isinstance(out, torch.Tensor) and not out.is_floating_point() and out.numel() <= self.SMALL:
            with _disable_current_modes():
                return func(*args, **kwargs)
        return out


@contextlib.contextmanager
def _host_counts():
    """An MoE layer compiled on fake tensors: the token dispatcher's counts (tokens per expert, the capacity's
    under the trace's balanced routing) made real, as :class:`_RealHostTensors` makes them in an eager trace, by a
    dispatch mode around megatron's ``preprocess`` alone, which dynamo leaves uncompiled (a mode around the whole
    layer would keep dynamo from compiling it). The counts come back real, so the experts' host read of them,
    where dynamo breaks the graph as it does in a run, reads numbers. ``preprocess`` makes integers only: nothing
    in it is saved for the backward, compiled or not."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as dispatcher

    preprocess = dispatcher.preprocess

    @torch.compiler.disable
    def real_counts(self, routing_map):
        with _RealHostTensors():
            return preprocess(self, routing_map)
    dispatcher.preprocess = real_counts
    try:
        yield
    finally:
        dispatcher.preprocess = preprocess


def forget_cached_tables() -> None:
    """Empty every ``functools.lru_cache`` of the project's, its kernels' and megatron's modules: the
    tables they keep (positions, rotary frequencies, attention plans) were built from fake tensors
    during a trace, and a real run after it must not find them."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(("dit_mcore", "energon_data", "megatron.core")):
            continue
        for value in list(vars(module).values()):
            for fn in (value, *vars(value).values()) if isinstance(value, type) else (value,):
                if isinstance(fn, functools._lru_cache_wrapper):
                    fn.cache_clear()


def trace_microbatch(cfg, batch, *, num_layers: int, forget: bool = True, on_gpu: bool = False) -> MicroBatchTrace:
    """One training micro-batch of ``batch`` through this rank's part of the run ``cfg``'s model (the tables
    its modules cache are built from fake tensors and forgotten after it, unless ``forget`` is False),
    ``num_layers`` deep in all, traced (in megatron's parallel state of the layout, e.g.
    :func:`dit_mcore.plan.world.traced_world`); on a pipeline stage before the last, the backward
    starts from the gradient the next stage would send. Gradients go where megatron DDP's hooks put them
    (a buffer that is part of the state), so each parameter's ``.grad`` is dropped once accumulated.
    ``on_gpu``: operators a GPU fuses run as its kernels (:func:`~dit_mcore.plan.device_kernels.gpu_kernels`);
    otherwise as the CPU runs them."""
    model_config, objective, dtype = run_parts(cfg, num_layers)
    step = StepLoss(model_config, objective, dtype, cfg.model.family)
    reset_moe_state()  # (megatron's router-loss tracker is sized by the last model's depth)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = fake_chunks(cfg, model_config)[0]
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            if not model.pre_process:
                model.register_forward_pre_hook(_received_hidden)
            kernels = gpu_kernels() if on_gpu else contextlib.nullcontext()
            with kernels, _RealHostTensors(), OpCosts() as costs, LiveMemory() as live:
                n, g = batch.num_samples, torch.Generator().manual_seed(0)
                level = objective.sample_level(n, generator=g)
                noise = torch.randn(batch.tokens.shape, generator=g)
                labels = drop_labels(step.labels_of(batch), model_config.class_dropout_prob, model_config.num_classes,
                                     generator=g)
                keep = torch.rand(n, generator=g) >= model_config.text_dropout_prob if model_config.text_dim else None
                out, loss_fn = step.forward(model, batch, level, noise, labels, text_keep=keep)
                loss = loss_fn(out)[0] if model.post_process else out  # (else: a later stage computes it)
                del out, level, noise, labels, keep
                saved = live.live
                # on a stage before the last, the backward starts from the gradient the next stage sends
                loss.backward(None if model.post_process else torch.ones_like(loss))
    finally:
        reset_moe_state()  # (the tracker holds fake tensors now)
        if forget:
            forget_cached_tables()
    return MicroBatchTrace(saved, live.peak, costs.gemm_flops, tuple(sorted(costs.attention.items())),
                           costs.memory_bytes, tuple((*key, b) for key, b in sorted(costs.comm.items())),
                           tuple((*key, a) for key, a in sorted(costs.ops.items())))


def _received_hidden(model, args) -> None:
    """On a pipeline stage after the first: the hidden states the stage before would send (received into a new
    buffer, kept for this stage's backward), this rank's piece of the tokens, hidden wide."""
    piece = model.token_shard.scatter(args[0])
    dtype = next(model.parameters()).dtype
    model.set_input_tensor(torch.zeros(*piece.shape[:-1], model.config.hidden_size, dtype=dtype, requires_grad=True))


class _Captured(Exception):
    """Raised by a hook that has what it came for (a layer's inputs): the rest of the forward is not needed."""


def compiled_layer_savings(cfg, batch, *, on_gpu: bool = False) -> float:
    """How many fewer bytes a layer compiled by ``model.compile`` saves for its backward than the same layer run
    eagerly as the trace ran it, on this rank's inputs of a micro-batch like ``batch`` (in the caller's traced
    world). Inductor recomputes cheap elementwise work in the backward rather than keep its results: what it keeps
    is decided by AOTAutograd's min-cut partitioner over Inductor's decompositions, which torch's
    ``aot_eager_decomp_partition`` backend runs without generating code, here on fake tensors."""
    eager, compiled = layer_saved_bytes(cfg, batch, backends=(None, "aot_eager_decomp_partition"), on_gpu=on_gpu,
                                        forget=False)
    return float(eager - compiled)


def layer_saved_bytes(cfg, batch, *, backends=(None,), fake: bool = True, on_gpu: bool = False,
                      forget: bool = True) -> list[int]:
    """The bytes autograd saves for the backward of this rank's first layer on its inputs of a micro-batch like
    ``batch`` (distinct storages; parameters not: they are state), for each of ``backends`` on the same inputs:
    eager (None) or compiled by ``torch.compile`` with that backend as ``model.compile`` compiles it (graph
    breaks allowed, each piece partitioned; dynamo's caches are reset before and after: call it before a run
    compiles anything); on fake tensors (the planner, in the caller's traced world; the tables the model caches
    from them are forgotten after, unless ``forget`` is False) or on real ones (``fake=False``: what a run keeps,
    the planner's check in ``tests/test_plan_memory.py``)."""
    stages = cfg.parallel.pipeline_model_parallel_size
    model_config, objective, dtype = run_parts(evenly_staged(cfg), stages)
    step = StepLoss(model_config, objective, dtype, cfg.model.family)
    got = {}

    def capture(module, args, kwargs):
        got["args"], got["kwargs"] = args, kwargs
        raise _Captured

    reset_moe_state()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            model = fake_chunks(cfg, model_config)[0]
            if not model.pre_process:
                model.register_forward_pre_hook(_received_hidden)
            layer = model.layers[0]
            hook = layer.register_forward_pre_hook(capture, with_kwargs=True)
            with _RealHostTensors() if fake else contextlib.nullcontext():
                n, g = batch.num_samples, torch.Generator().manual_seed(0)
                try:
                    step.forward(model, batch, objective.sample_level(n, generator=g),
                                 torch.randn(batch.tokens.shape, generator=g), step.labels_of(batch))
                except _Captured:
                    pass
            hook.remove()
            (hidden, *args), kwargs = got["args"], got["kwargs"]
            state = {p.untyped_storage()._cdata for p in layer.parameters()}
            kept = []
            for backend in backends:
                storages = {}  # (each storage held, so that no other takes its address)

                def pack(t):
                    storage = t.untyped_storage()
                    if storage._cdata not in state:
                        storages[storage._cdata] = storage
                    return t
                compiled = backend is not None
                if compiled:
                    torch.compiler.reset()  # (a layer compiled afresh: dynamo's recompile limit never reached)
                    quiet_default_tp_group()  # (as model.compile does: no warning for dynamo to break on)
                # (on fake tensors the counts the model reads on the host made real: the whole layer's operators
                # eagerly, the dispatcher's alone where dynamo compiles the rest)
                host = (_host_counts() if compiled else _RealHostTensors()) if fake else contextlib.nullcontext()
                try:
                    run = torch.compile(layer, backend=backend) if compiled else layer
                    with gpu_kernels() if on_gpu and not compiled else contextlib.nullcontext(), host, \
                            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        run(hidden.detach().requires_grad_(), *args, **kwargs)
                finally:
                    if compiled:
                        torch.compiler.reset()
                kept.append(sum(storage.nbytes() for storage in storages.values()))
    finally:
        reset_moe_state()
        if fake and forget:  # (tables cached from fake tensors: a real run after it must not find them)
            forget_cached_tables()
    return kept


def evenly_staged(cfg):
    """``cfg`` with its layers split evenly over the pipeline stages: a profile is per layer (an uneven split's
    stage takes its own count of them), and its traces are one and two layers per stage deep."""
    p = cfg.parallel
    if p.num_layers_in_first_pipeline_stage is None and p.num_layers_in_last_pipeline_stage is None:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.parallel.num_layers_in_first_pipeline_stage = cfg.parallel.num_layers_in_last_pipeline_stage = None
    return cfg


def layer_profile(cfg, batch, *, on_gpu: bool = False) -> LayerProfile:
    """The run ``cfg``'s cost per micro-batch like ``batch`` on this rank's pipeline stage, from traces
    one and two layers per stage deep (``on_gpu``: see :func:`trace_microbatch`)."""
    return layer_profiles([cfg], batch, on_gpu=on_gpu)[0]


def layer_profiles(cfgs: list, batch, *, on_gpu: bool = False) -> list[LayerProfile]:
    """:func:`layer_profile` of each of ``cfgs``, runs that split a micro-batch alike (the same layout of
    ranks; their recompute or chunking may differ): the tables the model caches are built once, by a
    warm-up trace of the first. A run that compiles its layers (``model.compile``) has each layer's saved bytes
    and peak lowered by what compiling it saves (:func:`compiled_layer_savings`; MoE layers too); not under full
    recompute (a layer keeps its input alone)."""
    stages = cfgs[0].parallel.pipeline_model_parallel_size
    cfgs = [evenly_staged(cfg) for cfg in cfgs]
    out = []
    try:  # a step after the first: the model's cached tables (positions, plans) are built already
        trace_microbatch(cfgs[0], batch, num_layers=stages, forget=False, on_gpu=on_gpu)
        for cfg in cfgs:
            one, two = (trace_microbatch(cfg, batch, num_layers=n * stages, forget=False, on_gpu=on_gpu)
                        for n in (1, 2))
            per_layer = two + one * -1
            outside = one + per_layer * -1
            if cfg.model.compile and cfg.model.recompute_granularity != "full":
                kept = compiled_layer_savings(cfg, batch, on_gpu=on_gpu)
                per_layer = per_layer + MicroBatchTrace(-kept, -kept, 0.0, (), 0.0, ())
            out.append(LayerProfile(outside, per_layer))
    finally:
        forget_cached_tables()
    return out
