"""The layouts a run could take on a cluster, each predicted (memory, step time) and ranked.

Every layout is put through the project's layout check (:func:`dit_mcore.parallel.layout.check_layout`)
first: the planner never offers one the trainer would refuse. A layout's trace depends only on what
splits a micro-batch (TP, SP, CP and its method, PP, EP, recompute, the micro-batch size), so layouts
that differ only in data parallelism, FSDP or the distributed optimizer share one trace.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from dit_mcore.errors import ConfigError
from dit_mcore.models.flops import dit_flops
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.layout import check_layout
from dit_mcore.plan.gpus import GPU
from dit_mcore.plan.memory import (MemoryPrediction, RankModel, cfg_layers, gpu_optimizer, rank_memory, rank_state,
                                   stage_rank, stage_split, stages_to_check)
from dit_mcore.plan.step_time import StepTime, stage_send_bytes, step_time
from dit_mcore.plan.trace import LayerProfile, MicroBatchTrace, layer_profiles
from dit_mcore.plan.world import traced_world
from dit_mcore.training.validate import check_settings_with_layout, model_problems
from dit_mcore.training.memory import GiB

_OFF = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None, recompute_modules=None)
RECOMPUTE = {"none": _OFF,
             "selective": _OFF | dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
             "selective_mlp": _OFF | dict(recompute_granularity="selective", recompute_modules=["mlp"]),
             "full": _OFF | dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
SEARCHED_RECOMPUTE = ("none", "selective_mlp", "full")
"""What the search tries (core attention alone is not: the fused attention kernels keep only their output
and log-sum-exp, so recomputing it buys little memory; ``--explain`` takes every mode)."""
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""The shares of the optimizer state the search offers to offload (``optim.offload_fraction``)."""
CHUNK_TOKENS = 4096
"""The chunk the search offers (``model.chunk_tokens``) where a micro-batch puts more than twice as many
tokens on a rank; ``--explain`` takes any."""


@dataclass(frozen=True)
class Layout:
    """One way to lay a run over the cluster (the fields the planner chooses)."""

    tp: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"
    cp_a2a: int = 1
    """With ``cp_comm_type="a2a+p2p"``: the Ulysses groups' size (inside a ring of ``cp / cp_a2a``)."""
    pp: int = 1
    vpp: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B)."""
    first_stage: int = 0
    last_stage: int = 0
    """An uneven pipeline split: the layers of the first and of the last stage (``parallel.num_layers_in_first/last_
    pipeline_stage``; 0: split evenly)."""
    ep: int = 1
    fsdp: str = "none"
    fsdp_shard: int = 0
    """HSDP (``parallel.fsdp_shard_size``): FSDP shards within groups of this many data x context parallel ranks
    and replicates across them (0: shards over all of them)."""
    distopt: bool = False
    recompute: str = "none"
    chunk_tokens: int = 0
    """``model.chunk_tokens`` (0: off)."""
    micro_batch: int = 1
    offload: float = 0.0
    """``optim.offload_fraction`` with ``optim.cpu_offload`` (0: off): the search offers it only where no layout
    fits on the device (experimental: megatron's offload has not run on a GPU here, and its host step is
    priced from data sheets)."""

    def overrides(self) -> dict:
        """The fields of ``recipes/pretrain_xl.py`` this layout sets."""
        out = {"parallel.tensor_model_parallel_size": self.tp, "parallel.sequence_parallel": self.tp > 1,
               "parallel.context_parallel_size": self.cp, "parallel.pipeline_model_parallel_size": self.pp,
               "parallel.virtual_pipeline_model_parallel_size": self.vpp if self.vpp > 1 else None,
               "parallel.num_layers_in_first_pipeline_stage": self.first_stage or None,
               "parallel.num_layers_in_last_pipeline_stage": self.last_stage or None,
               "parallel.expert_model_parallel_size": self.ep, "parallel.fsdp": self.fsdp,
               "parallel.fsdp_shard_size": self.fsdp_shard or None,
               "parallel.overlap_grad_reduce": self.fsdp == "none", "parallel.overlap_param_gather": self.distopt,
               "optim.use_distributed_optimizer": self.distopt, "data.micro_batch_size": self.micro_batch}
        out["parallel.cp_comm_type"] = self.cp_comm_type if self.cp > 1 else "p2p"
        out["parallel.hierarchical_context_parallel_sizes"] = \
            [self.cp_a2a, self.cp // max(self.cp_a2a, 1)] if self.cp_comm_type == "a2a+p2p" else None
        out.update({f"model.{k}": v for k, v in RECOMPUTE[self.recompute].items()})
        out["model.chunk_tokens"] = self.chunk_tokens or None
        if self.offload:  # (megatron's offload steps its own AdamW, not the flat one, of a bf16 run's main weights)
            out.update({"optim.cpu_offload": True, "optim.offload_fraction": self.offload, "optim.adam_impl": "auto",
                        "trainer.bf16": True})
        return out

    @classmethod
    def of(cls, overrides: dict) -> "Layout":
        """The layout whose :meth:`overrides` these are."""
        p = lambda name, default=None: overrides.get(f"parallel.{name}", default)  # noqa: E731
        model = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("model.")}
        recompute = next(name for name, fields in RECOMPUTE.items()
                         if all(model.get(k) == v for k, v in fields.items()))
        return cls(tp=p("tensor_model_parallel_size"), cp=p("context_parallel_size"),
                   cp_comm_type=p("cp_comm_type", "p2p"),
                   cp_a2a=(p("hierarchical_context_parallel_sizes") or [1])[0], pp=p("pipeline_model_parallel_size"),
                   vpp=p("virtual_pipeline_model_parallel_size") or 1,
                   first_stage=p("num_layers_in_first_pipeline_stage") or 0,
                   last_stage=p("num_layers_in_last_pipeline_stage") or 0, ep=p("expert_model_parallel_size"),
                   fsdp=p("fsdp"), fsdp_shard=p("fsdp_shard_size") or 0,
                   distopt=overrides["optim.use_distributed_optimizer"], recompute=recompute,
                   chunk_tokens=model.get("chunk_tokens") or 0, micro_batch=overrides["data.micro_batch_size"],
                   offload=overrides["optim.offload_fraction"] if overrides.get("optim.cpu_offload") else 0.0)

    def apply(self, cfg):
        cfg = copy.deepcopy(cfg)
        for key, value in self.overrides().items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
        cfg.parallel.layout = cfg.parallel.layout_gpu = None  # (a concrete layout now)
        return cfg

    def describe(self, world: int) -> str:
        dp = world // (self.tp * self.cp * self.pp)
        parts = [f"TP{self.tp}" + ("+SP" if self.tp > 1 else "")]
        method = f"a2a{self.cp_a2a}+p2p" if self.cp_comm_type == "a2a+p2p" else self.cp_comm_type
        parts += [f"CP{self.cp}({method})"] if self.cp > 1 else []
        split = ", ".join(f"{name} {n}" for name, n in (("first", self.first_stage), ("last", self.last_stage)) if n)
        split = f"({split})" if split else ""
        parts += [f"PP{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else "") + split] if self.pp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        kind = "/MFSDP" if self.fsdp == "megatron" else "/FSDP"
        sharding = (f"{kind}:HSDP{self.fsdp_shard}" if self.fsdp_shard else kind) if self.fsdp != "none" else \
            "/distopt" if self.distopt else ""
        parts += [f"DP{dp}" + sharding]
        parts += [f"mb{self.micro_batch}"] + ([f"recompute:{self.recompute}"] if self.recompute != "none" else [])
        parts += [f"chunk{self.chunk_tokens}"] if self.chunk_tokens else []
        parts += [f"offload:{self.offload:g}"] if self.offload else []
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """``tp=2,cp=4,cp_comm_type=a2a,recompute=full,...`` (the names of this class's fields; ``cp_comm_type=a2a+p2p``
        takes ``cp_a2a``)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in names:
                raise ConfigError(f"--explain {text!r}: {item!r} is not name=value with a name among {sorted(names)}")
            kind = type(getattr(cls(), key))
            try:
                values[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
            except ValueError:
                raise ConfigError(f"--explain {text!r}: {key} takes {kind.__name__} values, not {raw!r}") from None
        if values.get("recompute", "none") not in RECOMPUTE:
            raise ConfigError(f"--explain {text!r}: recompute is one of {sorted(RECOMPUTE)}")
        return cls(**values)


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    memory: MemoryPrediction
    step: StepTime
    fits: bool
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    headroom_gib: float = 0.0
    """The device's memory left over the predicted peak (negative: short by that much)."""

    def record(self, world: int) -> dict:
        """One line of ``--json``."""
        return {"layout": self.layout.describe(world), "overrides": self.layout.overrides(), "fits": self.fits,
                "memory_gib": self.memory.parts_gib(), "headroom_gib": round(self.headroom_gib, 2),
                "step_s": _digits(self.step.total),
                "step_parts_s": {k: _digits(getattr(self.step, k)) for k in ("compute", "exposed_comm", "bubble",
                                                                             "optimizer")},
                "tflops_per_gpu": round(self.tflops_per_gpu, 1), "mfu": round(self.mfu, 4),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
                **({"host_gib": _digits(self.memory.state.host / GiB)} if self.memory.state.host else {})}


def _digits(x: float) -> float:
    return float(f"{x:.5g}")


def candidate_layouts(cfg, world: int, gpus_per_node: int, tokens: int = 0) -> Iterator[Layout]:
    """Layouts of ``world`` ranks: TP up to a node (always with SP), CP up to 16 over ring, all-to-all or
    all-to-all groups inside a ring, up to 8 pipeline stages (the layers split evenly, in one or two model chunks
    per stage, or unevenly where they do not divide: :func:`pipeline_splits`), experts, FSDP (HSDP over every
    group size; Megatron-FSDP for MoE models, the FSDP that shards experts) or the distributed optimizer, no
    recompute, selective recompute of the MLP or full recompute, chunked MLPs where a micro-batch puts more than
    ``2 x CHUNK_TOKENS`` of its ``tokens`` per sample on a rank, and micro-batches of 1, 2, 4 or 8 samples
    dividing a data-parallel rank's share of the global batch."""
    mc = cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16)
    powers = [2 ** i for i in range(12) if 2 ** i <= world]
    for tp, cp, pp in itertools.product([t for t in powers if t <= gpus_per_node], powers[:5], powers[:4]):
        splits = pipeline_splits(mc.num_layers, pp)
        if world % (tp * cp * pp) or not splits:
            continue
        dp = world // (tp * cp * pp)
        experts = [e for e in powers if mc.num_moe_experts and mc.num_moe_experts % e == 0] or [1]
        per_rank = cfg.data.global_batch_size // dp if cfg.data.global_batch_size % dp == 0 else 0
        micro = [m for m in (1, 2, 4, 8) if per_rank % m == 0] if per_rank else []
        methods = [("p2p", 1), ("a2a", 1)] + [("a2a+p2p", a) for a in powers if 1 < a < cp and cp % a == 0] \
            if cp > 1 else [("p2p", 1)]
        chunks = [0, CHUNK_TOKENS] if not mc.num_moe_experts and tokens // (cp * tp) > 2 * CHUNK_TOKENS else [0]
        virtual = [1, 2] if pp > 1 and mc.num_layers % (2 * pp) == 0 else [1]  # (interleaved: even splits only)
        shards = [("none", False, 0), ("none", True, 0), ("torch", False, 0)] + \
            [("torch", False, s) for s in powers if 1 < s < dp * cp and (dp * cp) % s == 0] + \
            ([("megatron", False, 0)] if mc.num_moe_experts else []) if dp * cp > 1 else [("none", False, 0)]
        for ep, (method, a2a), vpp, (fsdp, distopt, shard), recompute, chunk, mb in itertools.product(
                experts, methods, virtual, shards, SEARCHED_RECOMPUTE, chunks, micro):
            if chunk and recompute == "selective_mlp":
                continue  # (a chunked MLP branch is recomputed already: the same run)
            for first, last in (splits if vpp == 1 else [(0, 0)]):
                yield Layout(tp, cp, method, a2a, pp, vpp, first, last, ep, fsdp, shard, distopt, recompute, chunk, mb)


def pipeline_splits(layers: int, pp: int) -> list[tuple[int, int]]:
    """The ``(first, last)`` stage sizes the search tries for ``layers`` over ``pp`` stages, the rest split evenly
    over the middle stages (at least one layer each): ``[(0, 0)]`` (even) where ``pp`` divides the layers;
    otherwise every split whose largest stage is the least possible (the step waits for it), the first stage no
    larger than the last (it holds the most micro-batches in flight); ``[]`` where no split exists (fewer layers
    than stages)."""
    if pp == 1 or layers % pp == 0:
        return [(0, 0)]
    middle, splits = pp - 2, {}
    for first, last in itertools.product(range(1, layers + 1), repeat=2):
        rest = layers - first - last
        if first <= last and (rest == 0 if middle == 0 else rest >= middle and rest % middle == 0):
            splits[first, last] = max(first, last, rest // middle if middle else 0)
    least = min(splits.values(), default=0)
    return [split for split, largest in splits.items() if largest == least]


def lighter_first(layout: Layout, layers: int) -> Optional[Layout]:
    """``layout``'s even pipeline split with a layer moved from the first stage to the last (the first holds the
    most micro-batches in flight: a way to fit at the price of a longer last stage); None where it has none."""
    each = layers // layout.pp if layout.pp > 1 else 0
    if each < 2 or layout.vpp > 1 or layout.first_stage or layout.last_stage:
        return None
    return dataclasses.replace(layout, first_stage=each - 1, last_stage=each + 1)


def _work_and_memory(work: LayerProfile, memory: LayerProfile, packs: int) -> LayerProfile:
    """A packed run's profile: the work of ``work`` (a round of ``packs`` packs, per pack; its operators' calls
    per pack, not divided) and the memory of ``memory`` (the heaviest pack: the micro-batches in flight are
    whole packs, and a pack with more samples keeps more of their conditioning and text)."""
    def one(w: MicroBatchTrace, m: MicroBatchTrace) -> MicroBatchTrace:
        ops = tuple((name, measure, amount * packs if measure == "calls" else amount)
                    for name, measure, amount in w.ops)
        return dataclasses.replace(w, saved=m.saved, peak=m.peak, ops=ops)
    return LayerProfile(one(work.outside, memory.outside), one(work.per_layer, memory.per_layer))


def accepted(cfg, layout: Layout, world: int) -> Optional[str]:
    """None if the trainer's rules of a layout accept ``layout`` for ``cfg`` (the layout check, the run's settings
    against the layout, the model's recompute against its compile), else the first refusal."""
    run = layout.apply(cfg)
    try:  # (the model's sizes: megatron's own checks of the layout would raise first)
        model = run.model.build(ParallelConfig(), bf16=run.trainer.bf16)
        check_layout(run.parallel, model, run.data, world,
                     use_distributed_optimizer=run.optim.use_distributed_optimizer)
        check_settings_with_layout(run, model, world)  # (the run's optimizer, EMA and precision against the layout)
    except ConfigError as e:
        return str(e)
    problems = model_problems(run.model)  # (the layout's recompute against the run's compile)
    return problems[0] if problems else None


class Planner:
    """Predicts layouts of the run ``cfg`` (its model, data and optimizer; the planner sets the layout
    fields) on ``world`` GPUs like ``gpu``, ``gpus_per_node`` to a node; ``batch(micro_batch_size)``
    makes one data-parallel rank's micro-batch, each of its samples standing for ``batch.packs`` rows (packs: a
    packing round's, their costs averaged; :func:`~dit_mcore.plan.samples.batch_maker`)."""

    def __init__(self, cfg, world: int, gpu: GPU, gpus_per_node: int, batch: Callable):
        self.cfg, self.world, self.gpu, self.gpus_per_node, self.batch = gpu_optimizer(cfg), world, gpu, gpus_per_node, batch
        self._profiles: dict = {}
        self._models: dict = {}
        self._states: dict = {}
        one = self._one = batch(1)  # (one sample, or a round of packs: what the FLOPs count reads)
        self.packs = getattr(batch, "packs", 1)
        self.tokens = sum(one.seqlens) / self.packs
        """Tokens per sample (a pack's real tokens, on average)."""
        self.row_tokens = one.tokens.shape[1] // self.packs
        """Tokens per row of a micro-batch, padding included (a sample, or a pack)."""
        self._wanted: set = set()
        """The trace keys of the layouts :meth:`plan` will evaluate (traced together by split)."""

    def _state(self, layout: Layout, cfg, stage: int = 0) -> tuple:
        """``(RankModel, its per-parameter state)`` of pipeline stage ``stage`` under ``layout`` (``cfg``: the run
        under it). The state depends on the split and the sharding, not on the CP method, micro-batches, recompute
        or chunking: its world (a hundred thousand fake groups at 256 GPUs) is set up once per such layout."""
        model_key = (layout.tp, layout.pp, layout.vpp, layout.first_stage, layout.last_stage, layout.ep, stage)
        state_key = (dataclasses.replace(layout, cp_comm_type="p2p", cp_a2a=1, recompute="none", chunk_tokens=0,
                                         micro_batch=1), stage)
        if state_key not in self._states:
            with traced_world(cfg.parallel, self.world, rank=stage_rank(cfg.parallel, self.world, stage)):
                if model_key not in self._models:
                    self._models[model_key] = RankModel.build(cfg)
                self._states[state_key] = rank_state(cfg, self._models[model_key])
        return self._models[model_key], self._states[state_key]

    def state_fits(self, layout: Layout) -> bool:
        """Whether ``layout``'s per-parameter state and the device's workspace leave room for activations: a
        layout without it cannot fit, and needs no trace to say so (its first stage's: a stage's is a lower
        bound of the peak)."""
        _, state = self._state(layout, layout.apply(self.cfg))
        return state.total + self.gpu.workspace_gib * GiB <= self.gpu.memory_gib * GiB

    def evaluate(self, layout: Layout) -> Evaluation:
        cfg = layout.apply(self.cfg)
        p = cfg.parallel
        profile = self.profile(layout)  # (traced in a world of its own, once per split)
        dp = self.world // (layout.tp * layout.cp * layout.pp)
        split = stage_split(cfg)
        stages = {stage: (rank_memory(cfg, [profile], model, state, dp, self.gpu.workspace_gib * GiB, stage), model)
                  for stage in stages_to_check(cfg) for model, state in [self._state(layout, cfg, stage)]}
        memory = max((m for m, _ in stages.values()), key=lambda m: m.total)  # (the first stage, split evenly)
        # the step waits for the stage with the most layers
        slowest, model = max(((m, model) for m, model in stages.values()), key=lambda pair: pair[0].stage_layers)
        micro = cfg.data.num_microbatches(dp)
        s = slowest.state
        stepped = (s.main_weights / 4 if cfg.trainer.bf16 else s.weights / 4)
        grad_bytes = model.numel * (2 if cfg.optim.main_grads_dtype == "bf16" else 4)
        offloaded = stepped * cfg.optim.offload_fraction if cfg.optim.cpu_offload else 0.0
        step = step_time(profile.at(max(split)), parallel=p, microbatches=micro, gpu=self.gpu,
                         gpus_per_node=self.gpus_per_node, world=self.world,
                         grad_bytes=grad_bytes, weight_bytes=model.weight_bytes, stepped_elements=stepped,
                         ema_elements=s.ema / 4, distributed_optimizer=cfg.optim.use_distributed_optimizer,
                         offloaded_elements=offloaded,
                         stage_send_bytes=stage_send_bytes(p, self.row_tokens, layout.micro_batch,
                                                           model.config.hidden_size, 2 if cfg.trainer.bf16 else 4))
        batch = self._one
        per_sample = dit_flops(model.config, batch.seqlens, batch.text_seqlens,
                               [int(g[0]) for g in batch.grids]).model / self.packs
        samples = cfg.data.global_batch_size
        tflops = per_sample * samples / step.total / self.world / 1e12
        tokens = self.tokens * samples / step.total / self.world
        fits = memory.total <= self.gpu.memory_gib * GiB
        return Evaluation(layout, memory, step, fits, tokens, tflops, tflops / self.gpu.bf16_tflops,
                          self.gpu.memory_gib - memory.total / GiB)

    def profile(self, layout: Layout):
        """A micro-batch of ``layout`` on its rank: ``outside + layers x per_layer`` (:class:`LayerProfile`)."""
        return self._profile(layout) * layout.micro_batch

    def _profile(self, layout: Layout):
        """One sample's trace for ``layout``, shared by the layouts that split a micro-batch alike. Traced
        without pipeline stages (a stage's layers cost what they cost anywhere; its outside part is taken
        whole, embeddings and final layer both: on the first stage an over-count by the final layer, on the last
        by the embeddings, where the hidden states it receives are not counted),
        and for one sample: every part of a dense micro-batch's cost is per sample (checked against the
        whole micro-batch's trace in ``tests/test_plan.py``). The search's recompute and chunking variants
        of the same split are traced together (one warm-up)."""
        if self._key(layout) not in self._profiles:
            variants = [layout] + [v for v in {dataclasses.replace(layout, recompute=r, chunk_tokens=c)
                                               for r in RECOMPUTE for c in (0, CHUNK_TOKENS)}
                                   if v != layout and self._key(v) in self._wanted and self._key(v) not in self._profiles]
            runs = [dataclasses.replace(v, pp=1, vpp=1, micro_batch=1).apply(self.cfg) for v in variants]
            with traced_world(runs[0].parallel, self.world):
                profiles = layer_profiles(runs, self.batch(1), on_gpu=True)
                if self.packs > 1:  # (memory: the heaviest pack's, in flight whole; the work: the round's, per pack)
                    heaviest = layer_profiles(runs, self.batch.heaviest(1), on_gpu=True)
                    profiles = [_work_and_memory(p * (1 / self.packs), h, self.packs)
                                for p, h in zip(profiles, heaviest)]
                for v, profile in zip(variants, profiles):
                    self._profiles[self._key(v)] = profile
        return self._profiles[self._key(layout)]

    @staticmethod
    def _key(layout: Layout) -> tuple:
        return (layout.tp, layout.cp, layout.cp_comm_type, layout.cp_a2a, layout.ep, layout.recompute,
                layout.chunk_tokens)

    def plan(self, on_each: Optional[Callable[[Evaluation], None]] = None) -> tuple[list[Evaluation], int]:
        """Every accepted layout evaluated, best first (those that fit, by tokens/s per GPU, then the larger
        micro-batch, then less memory); and how many candidates the layout check refused."""
        done, refused = [], 0
        candidates = list(candidate_layouts(self.cfg, self.world, self.gpus_per_node, self.row_tokens))
        self._wanted = {self._key(c) for c in candidates}
        for layout in candidates:
            if accepted(self.cfg, layout, self.world) is not None:
                refused += 1
                continue
            done.append(self.evaluate(layout))
            if on_each:
                on_each(done[-1])
        if not any(e.fits for e in done):  # a lighter first stage, where the layers split evenly over stages
            for lighter in self._lighter_firsts([e.layout for e in done]):
                done.append(self.evaluate(lighter))
                if on_each:
                    on_each(done[-1])
        if not any(e.fits for e in done):  # Elixir's way out: optimizer state in host memory
            for offloaded in filter(None, map(self._offloaded, list(done))):
                done.append(offloaded)
                if on_each:
                    on_each(offloaded)
        # (a tie, which the per-sample trace makes of micro-batch sizes: the larger one, fewer kernel launches)
        done.sort(key=lambda e: (not e.fits, -float(f"{e.tokens_per_s_per_gpu:.4g}"), -e.layout.micro_batch,
                                 e.memory.total))
        return done, refused

    def _offloaded(self, evaluation: Evaluation) -> Optional[Evaluation]:
        """``evaluation``'s layout with the least of :data:`OFFLOAD_FRACTIONS` of its optimizer state in host
        memory that fits, evaluated (None: none fits, or it cannot offload). Offload runs under the distributed
        optimizer only: a layout without it takes it (one data-parallel rank; with more, the search's twin with
        it is offloaded instead)."""
        layout = evaluation.layout
        single = self.world == layout.tp * layout.cp * layout.pp
        lacking = evaluation.memory.total - self.gpu.memory_gib * GiB
        if layout.fsdp != "none" or layout.offload or not (layout.distopt or single) \
                or lacking > evaluation.memory.state.adam:  # (more than all of its moments: no share fits)
            return None
        for fraction in OFFLOAD_FRACTIONS:
            offloaded = dataclasses.replace(layout, distopt=True, offload=fraction)
            if accepted(self.cfg, offloaded, self.world) is not None:
                return None
            offloaded = self.evaluate(offloaded)
            if offloaded.fits:
                return offloaded
        return None
    def _lighter_firsts(self, layouts: list) -> list:
        """The :func:`lighter_first` twins of ``layouts`` that the layout check accepts on this world."""
        layers = cfg_layers(self.cfg)
        return [lighter for lighter in (lighter_first(layout, layers) for layout in layouts)
                if lighter is not None and accepted(self.cfg, lighter, self.world) is None]

    def resized(self, world: int) -> "Planner":
        """The same run on ``world`` GPUs, sharing the traces (they do not depend on the data-parallel size)."""
        other = Planner(self.cfg, world, self.gpu, self.gpus_per_node, self.batch)
        other._profiles, other._models = self._profiles, self._models  # (not the states: they shard by world)
        return other

    def smallest_fitting(self, factors=(2, 4, 8, 16, 32, 64)) -> Optional[tuple[int, Evaluation]]:
        """The smallest cluster ``factor`` times larger where a layout fits, and there the layout that needs the
        least memory among the frugal ones (full recompute, one sample per micro-batch, state sharded over all the
        data-parallel ranks, one model chunk per stage, the first a layer lighter or not, the ring or Ulysses
        alone)."""
        for factor in factors:
            bigger = self.resized(self.world * factor)
            frugal = [layout for layout in
                      candidate_layouts(self.cfg, bigger.world, self.gpus_per_node, self.row_tokens)
                      if layout.recompute == "full" and layout.micro_batch == 1 and layout.vpp == 1
                      and not layout.fsdp_shard and layout.cp_comm_type != "a2a+p2p"
                      and (layout.distopt or layout.fsdp != "none" or bigger.world == layout.tp * layout.cp * layout.pp)
                      and accepted(self.cfg, layout, bigger.world) is None and bigger.state_fits(layout)]
            frugal += bigger._lighter_firsts(frugal)
            fitting = [e for e in map(bigger.evaluate, frugal) if e.fits]
            if fitting:
                return bigger.world, min(fitting, key=lambda e: e.memory.total)
        return None
