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
from dit_mcore.plan.memory import MemoryPrediction, RankModel, gpu_optimizer, rank_memory
from dit_mcore.plan.step_time import StepTime, step_time
from dit_mcore.plan.trace import layer_profile
from dit_mcore.plan.world import traced_world
from dit_mcore.training.memory import GiB

RECOMPUTE = {"none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}


@dataclass(frozen=True)
class Layout:
    """One way to lay a run over the cluster (the fields the planner chooses)."""

    tp: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"
    pp: int = 1
    ep: int = 1
    fsdp: str = "none"
    distopt: bool = False
    recompute: str = "none"
    micro_batch: int = 1

    def overrides(self) -> dict:
        """The fields of ``recipes/pretrain_xl.py`` this layout sets."""
        out = {"parallel.tensor_model_parallel_size": self.tp, "parallel.sequence_parallel": self.tp > 1,
               "parallel.context_parallel_size": self.cp, "parallel.pipeline_model_parallel_size": self.pp,
               "parallel.virtual_pipeline_model_parallel_size": None,
               "parallel.expert_model_parallel_size": self.ep, "parallel.fsdp": self.fsdp,
               "parallel.overlap_grad_reduce": self.fsdp == "none", "parallel.overlap_param_gather": self.distopt,
               "optim.use_distributed_optimizer": self.distopt, "data.micro_batch_size": self.micro_batch}
        if self.cp > 1:
            out["parallel.cp_comm_type"] = self.cp_comm_type
        out.update({f"model.{k}": v for k, v in RECOMPUTE[self.recompute].items()})
        return out

    def apply(self, cfg):
        cfg = copy.deepcopy(cfg)
        for key, value in self.overrides().items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
        return cfg

    def describe(self, world: int) -> str:
        dp = world // (self.tp * self.cp * self.pp)
        parts = [f"TP{self.tp}" + ("+SP" if self.tp > 1 else "")]
        parts += [f"CP{self.cp}({self.cp_comm_type})"] if self.cp > 1 else []
        parts += [f"PP{self.pp}"] if self.pp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"DP{dp}" + ("/FSDP" if self.fsdp != "none" else "/distopt" if self.distopt else "")]
        parts += [f"mb{self.micro_batch}"] + (["recompute"] if self.recompute != "none" else [])
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """``tp=2,cp=4,cp_comm_type=a2a,recompute=full,...`` (the names of this class's fields)."""
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

    def record(self, world: int) -> dict:
        """One line of ``--json``."""
        return {"layout": self.layout.describe(world), "overrides": self.layout.overrides(), "fits": self.fits,
                "memory_gib": self.memory.parts_gib(),
                "step_s": round(self.step.total, 4),
                "step_parts_s": {k: round(getattr(self.step, k), 4) for k in ("compute", "exposed_comm", "bubble",
                                                                              "optimizer")},
                "tflops_per_gpu": round(self.tflops_per_gpu, 1), "mfu": round(self.mfu, 4),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1)}


def candidate_layouts(cfg, world: int, gpus_per_node: int) -> Iterator[Layout]:
    """Layouts of ``world`` ranks: TP up to a node (always with SP), CP up to 16 over ring or all-to-all,
    up to 8 pipeline stages dividing the layers, experts, FSDP or the distributed optimizer, full recompute
    or none, and micro-batches of 1, 2, 4 or 8 samples dividing a data-parallel rank's share of the
    global batch."""
    mc = cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16)
    powers = [2 ** i for i in range(12) if 2 ** i <= world]
    for tp, cp, pp in itertools.product([t for t in powers if t <= gpus_per_node], powers[:5], powers[:4]):
        if world % (tp * cp * pp) or mc.num_layers % pp:
            continue
        dp = world // (tp * cp * pp)
        experts = [e for e in powers if mc.num_moe_experts and mc.num_moe_experts % e == 0] or [1]
        per_rank = cfg.data.global_batch_size // dp if cfg.data.global_batch_size % dp == 0 else 0
        micro = [m for m in (1, 2, 4, 8) if per_rank % m == 0] if per_rank else []
        methods = ["p2p", "a2a"] if cp > 1 else ["p2p"]
        shards = [("none", False), ("none", True), ("torch", False)] if dp * cp > 1 else [("none", False)]
        for ep, method, (fsdp, distopt), recompute, mb in itertools.product(experts, methods, shards,
                                                                          RECOMPUTE, micro):
            yield Layout(tp, cp, method, pp, ep, fsdp, distopt, recompute, mb)


def accepted(cfg, layout: Layout, world: int) -> Optional[str]:
    """None if the layout check accepts ``layout`` for ``cfg``, else its message."""
    run = layout.apply(cfg)
    try:  # (the model's sizes: megatron's own checks of the layout would raise first)
        check_layout(run.parallel, run.model.build(ParallelConfig(), bf16=run.trainer.bf16), run.data, world,
                     use_distributed_optimizer=run.optim.use_distributed_optimizer)
    except ConfigError as e:
        return str(e)
    return None


class Planner:
    """Predicts layouts of the run ``cfg`` (its model, data and optimizer; the planner sets the layout
    fields) on ``world`` GPUs like ``gpu``, ``gpus_per_node`` to a node; ``batch(micro_batch_size)``
    makes one data-parallel rank's micro-batch."""

    def __init__(self, cfg, world: int, gpu: GPU, gpus_per_node: int, batch: Callable):
        self.cfg, self.world, self.gpu, self.gpus_per_node, self.batch = gpu_optimizer(cfg), world, gpu, gpus_per_node, batch
        self._profiles: dict = {}
        self._models: dict = {}

    def evaluate(self, layout: Layout) -> Evaluation:
        cfg = layout.apply(self.cfg)
        p = cfg.parallel
        profile = self._profile(layout) * layout.micro_batch  # (traced in a world of its own, once per split)
        with traced_world(p, self.world):
            model_key = (layout.tp, layout.pp, layout.ep)
            if model_key not in self._models:
                self._models[model_key] = RankModel.build(cfg)
            model = self._models[model_key]
            memory = rank_memory(cfg, [profile], model, self.gpu.workspace_gib * GiB)
        dp = self.world // (layout.tp * layout.cp * layout.pp)
        micro = cfg.data.num_microbatches(dp)
        s = memory.state
        stepped = (s.main_weights / 4 if cfg.trainer.bf16 else s.weights / 4)
        grad_bytes = model.numel * (2 if cfg.optim.main_grads_dtype == "bf16" else 4)
        step = step_time(profile.at(memory.stage_layers), parallel=p, microbatches=micro, gpu=self.gpu,
                         gpus_per_node=self.gpus_per_node, world=self.world,
                         grad_bytes=grad_bytes, weight_bytes=model.weight_bytes, stepped_elements=stepped,
                         ema_elements=s.ema / 4, distributed_optimizer=cfg.optim.use_distributed_optimizer)
        batch = self.batch(1)
        per_sample = dit_flops(model.config, batch.seqlens, batch.text_seqlens,
                               [int(g[0]) for g in batch.grids]).model
        samples = cfg.data.global_batch_size
        tflops = per_sample * samples / step.total / self.world / 1e12
        tokens = sum(batch.seqlens) * samples / step.total / self.world
        fits = memory.total <= self.gpu.memory_gib * GiB
        return Evaluation(layout, memory, step, fits, tokens, tflops, tflops / self.gpu.bf16_tflops)

    def _profile(self, layout: Layout):
        """One sample's trace for ``layout``, shared by the layouts that split a micro-batch alike. Traced
        without pipeline stages (a stage's layers cost what they cost anywhere; its outside part is taken
        whole, embeddings and final layer both: an over-count of the first stage's by the final layer),
        and for one sample: every part of a dense micro-batch's cost is per sample (checked against the
        whole micro-batch's trace in ``tests/test_plan.py``)."""
        key = (layout.tp, layout.cp, layout.cp_comm_type, layout.ep, layout.recompute)
        if key not in self._profiles:
            one = dataclasses.replace(layout, pp=1, micro_batch=1).apply(self.cfg)
            with traced_world(one.parallel, self.world):
                self._profiles[key] = layer_profile(one, self.batch(1))
        return self._profiles[key]

    def plan(self, on_each: Optional[Callable[[Evaluation], None]] = None) -> tuple[list[Evaluation], int]:
        """Every accepted layout evaluated, best first (those that fit, by tokens/s per GPU, then the larger
        micro-batch, then less memory); and how many candidates the layout check refused."""
        done, refused = [], 0
        for layout in candidate_layouts(self.cfg, self.world, self.gpus_per_node):
            if accepted(self.cfg, layout, self.world) is not None:
                refused += 1
                continue
            done.append(self.evaluate(layout))
            if on_each:
                on_each(done[-1])
        # (a tie, which the per-sample trace makes of micro-batch sizes: the larger one, fewer kernel launches)
        done.sort(key=lambda e: (not e.fits, -float(f"{e.tokens_per_s_per_gpu:.4g}"), -e.layout.micro_batch,
                                 e.memory.total))
        return done, refused

    def resized(self, world: int) -> "Planner":
        """The same run on ``world`` GPUs, sharing the traces (they do not depend on the data-parallel size)."""
        other = Planner(self.cfg, world, self.gpu, self.gpus_per_node, self.batch)
        other._profiles, other._models = self._profiles, self._models
        return other

    def smallest_fitting(self, factors=(2, 4, 8, 16, 32, 64)) -> Optional[tuple[int, Evaluation]]:
        """The smallest cluster ``factor`` times larger where a layout fits, and there the layout that needs the
        least memory among the frugal ones (full recompute, one sample per micro-batch, state sharded)."""
        for factor in factors:
            bigger = self.resized(self.world * factor)
            frugal = [layout for layout in candidate_layouts(self.cfg, bigger.world, self.gpus_per_node)
                      if layout.recompute == "full" and layout.micro_batch == 1
                      and (layout.distopt or layout.fsdp != "none" or bigger.world == layout.tp * layout.cp * layout.pp)
                      and accepted(self.cfg, layout, bigger.world) is None]
            fitting = [e for e in map(bigger.evaluate, frugal) if e.fits]
            if fitting:
                return bigger.world, min(fitting, key=lambda e: e.memory.total)
        return None
