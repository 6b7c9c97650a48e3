"""Step caching in the sampler (``--cache POLICY``): reuse what the previous model evaluations computed
instead of running every layer at every evaluation.

- ``fora:N`` (FORA, arXiv 2407.01425): every layer's attention and MLP outputs are computed at
  evaluations ``0, N, 2N, ...`` and the last, and reused in between; the adaLN modulation, norms and
  gates are recomputed at every evaluation, so the reused outputs are gated by the current timestep.
- ``teacache:T`` (TeaCache, arXiv 2411.19108): the relative L1 change of the first layer's modulated
  input (what its self-attention reads) from the previous evaluation is accumulated; while the sum stays
  under ``T`` the whole layer stack is skipped and its cached residual (output - input at the last
  computed evaluation) is added instead; at or over ``T`` the stack runs and the sum restarts.
  ``teacache:T:FIT.json`` accumulates the change rescaled by the model's own polynomial (TeaCache's
  per-model fit of the output's change on the indicator's), which ``python -m dit_mcore.analysis.redundancy``
  writes as ``teacache_fit.json``.
- ``fbcache:T`` (First-Block-Cache): the first layer always runs; when its residual differs from the
  one of the last computed evaluation by a relative L1 under ``T``, the other layers are skipped and
  their cached residual added.
- ``static:PLAN.json``: ``{"evaluations": E, "layers": L, "compute": [[layer, ...] per evaluation]}``
  names the layers each evaluation runs; any other layer adds its own residual of the last evaluation
  that ran it. ``python -m dit_mcore.analysis.redundancy --derive-plan`` writes one from the analysis.

The first and the last evaluation always run every layer; a decision covers the whole batch (under
classifier-free guidance both halves, whose cached tensors stay separate rows). A cache lives for one
sampler call: nothing crosses items, batches or calls.

Layouts: the ranks that sample the same items (tensor, context/sequence and CFG-parallel) take the same
decision, from the indicator's two sums added over them (the one-process decision: a ratio of sums over every
token and both guidance halves); FORA and static plans decide nothing at run time and run under pipeline
stages too (each stage caching its own layers). Under PipeFusion every patch keeps its own cache (a unit's
scope: its patch, or the whole item in the warm-up) and a patch unit counts ``1 / M`` of an evaluation;
TeaCache and First-Block-Cache decide there per patch, from the patch's own tokens at the first stage's first
layer, and the decision goes down the stages with the unit's activations, each stage adding the residual of its
own layers. Under megatron's pipeline schedule (``pipeline_model_parallel_size`` without PipeFusion), which
carries only activations, they are refused.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError

POLICIES = ("fora", "teacache", "fbcache", "static")


@dataclass
class CachePolicy:
    kind: str
    threshold: float = 0.0
    """teacache / fbcache: the change under which evaluations are skipped."""
    interval: int = 1
    """fora: recompute every ``interval`` evaluations."""
    plan: Optional[list[set]] = None
    """static: the layers each evaluation computes."""
    coefficients: Optional[list[float]] = None
    """teacache: the rescaling polynomial's coefficients, highest power first (None: the change as measured)."""
    text: str = ""

    def rescaled(self, change: float) -> float:
        if self.coefficients is None:
            return change
        return max(0.0, sum(c * change ** k for k, c in enumerate(reversed(self.coefficients))))

    def computes(self, evaluation: int, layer: int) -> bool:
        return self.plan is None or layer in self.plan[evaluation]


def parse_cache(text: str, *, evaluations: int, depth: int, sampler: Optional[str] = None,
                steps: Optional[int] = None) -> CachePolicy:
    """``--cache`` checked against the sampler's ``evaluations`` (and, for a plan that records them, its
    ``sampler`` and ``steps``) and the model's ``depth`` (one line per problem, naming the argument)."""
    kind, sep, value = text.partition(":")
    if kind not in POLICIES:
        raise ConfigError(f"--cache {text}: unknown policy {kind!r}; use fora:N, teacache:T, fbcache:T or static:PLAN.json")
    if not sep or not value:
        raise ConfigError(f"--cache {text}: give the policy's value, e.g. {kind}:{ {'fora': '2', 'static': 'plan.json'}.get(kind, '0.1')}")
    if kind == "fora":
        try:
            interval = int(value)
        except ValueError:
            interval = 0
        if interval < 1:
            raise ConfigError(f"--cache {text}: FORA's interval must be an integer >= 1 (1: no reuse)")
        return CachePolicy(kind, interval=interval, text=text)
    if kind in ("teacache", "fbcache"):
        value, _, fit = value.partition(":")
        try:
            threshold = float(value)
        except ValueError:
            threshold = -1.0
        if not threshold >= 0:
            raise ConfigError(f"--cache {text}: the threshold must be a number >= 0 (0: no reuse)")
        coefficients = None
        if fit:
            if kind != "teacache":
                raise ConfigError(f"--cache {text}: only TeaCache takes a rescaling fit (teacache:T:FIT.json)")
            try:
                record = json.loads(Path(fit).read_text())
                coefficients = [float(c) for c in record["coefficients"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"--cache {text}: not a readable fit ({e}); the redundancy analysis writes "
                                  "teacache_fit.json") from None
            if record.get("layers", depth) != depth:
                raise ConfigError(f"--cache {text}: the fit is for a model of {record['layers']} layers, this one "
                                  f"has {depth}")
        return CachePolicy(kind, threshold=threshold, coefficients=coefficients, text=text)
    try:
        plan = json.loads(Path(value).read_text())
        compute = [set(int(i) for i in row) for row in plan["compute"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--cache {text}: not a readable plan ({e}); write one with "
                          "python -m dit_mcore.analysis.redundancy --derive-plan") from None
    if plan.get("layers") != depth:
        raise ConfigError(f"--cache {text}: the plan is for a model of {plan.get('layers')} layers, this one has {depth}")
    if any(not 0 <= i < depth for row in compute for i in row):
        raise ConfigError(f"--cache {text}: the plan names a layer outside 0..{depth - 1}")
    for name, want in (("sampler", sampler), ("steps", steps)):
        if want is not None and plan.get(name, want) != want:
            raise ConfigError(f"--cache {text}: the plan was derived for --{name} {plan[name]}, this run uses "
                              f"--{name} {want}; derive it with the same --steps and --sampler")
    if len(compute) != evaluations:
        raise ConfigError(f"--cache {text}: the plan covers {len(compute)} model evaluations, this sampler runs "
                          f"{evaluations}; derive it with the same --steps and --sampler")
    return CachePolicy(kind, plan=compute, text=text)


def check_cache_layout(parallel, policy: CachePolicy) -> None:
    """The layouts a policy runs under (the module's docstring)."""
    if policy.kind not in ("teacache", "fbcache"):  # FORA and static plans decide nothing at run time
        return
    if parallel.pipeline_model_parallel_size > 1 and parallel.patches() == 1:
        raise ConfigError(f"--cache {policy.text} with parallel.pipeline_model_parallel_size="
                          f"{parallel.pipeline_model_parallel_size}: not supported (its decision is taken at the first "
                          "stage's first layer, and megatron's pipeline schedule carries only activations to the "
                          "others); use tensor, sequence, CFG-parallel or PipeFusion, or fora:N / static plans here")


def layer_flops(model_config, shape, prompts, encode, *, guided: bool) -> float:
    """Forward FLOPs of one layer for one model evaluation of a batch (:func:`~dit_mcore.models.flops.dit_flops`:
    projections, attention and MLP; both halves under guidance)."""
    from dit_mcore.models.flops import dit_flops
    p, pt = model_config.patch_size, getattr(model_config, "patch_size_t", 1) or 1
    frames = shape[1] // pt if len(shape) == 4 else 1
    tokens = frames * (shape[-2] // p) * (shape[-1] // p)
    rows = len(prompts) * (2 if guided else 1)
    context = None
    if model_config.text_dim:
        lengths = [int(t.shape[0]) for t in encode([x or "" for x in prompts])]
        context = (lengths + [0] * len(lengths)) if guided else lengths  # the null text: no tokens
        context = [max(1, n) for n in context]
    f = dit_flops(model_config, [tokens] * rows, context_lens=context, frames=[frames] * rows)
    return (f.linear + f.mlp + f.attention) / model_config.num_layers


def _rel_l1(now: torch.Tensor, prev: torch.Tensor, groups=()) -> float:
    """``sum|now - prev| / sum|prev|``, summed in float64 over this rank's part and then over ``groups``
    (the ranks holding the rest of the batch's tokens or rows); a host read: the decision is the host's."""
    sums = torch.stack([(now - prev).abs().sum(dtype=torch.float64), prev.abs().sum(dtype=torch.float64)])
    for group in groups:
        dist.all_reduce(sums, group=group)
    return float(sums[0] / sums[1].clamp_min(1e-30))


@dataclass
class CacheStats:
    layer_evaluations: float = 0
    """Layers x evaluations the sampler asked for (a PipeFusion patch unit counts ``1 / M``)."""
    skipped: float = 0
    """Of those, the ones served from the cache (for FORA: layers whose attention and MLP were reused)."""
    evaluations_skipped: list = field(default_factory=list)

    def as_dict(self, layer_flops: float = 0.0) -> dict:
        return {"layer_evaluations": self.layer_evaluations, "skipped": self.skipped,
                "skipped_fraction": self.skipped / max(1, self.layer_evaluations),
                "flops_saved": self.skipped * layer_flops}


class StepCache:
    """A :class:`CachePolicy` on the DiT layers of ``model`` (one process's whole model): :meth:`installed`
    patches their forwards for the duration, :meth:`start` begins a sampler call, :meth:`evaluation`
    precedes each model evaluation (index from 0 of ``evaluations``)."""

    def __init__(self, policy: CachePolicy, model: torch.nn.Module, evaluations: int, groups=()):
        """``groups``: the process groups over which the ranks sampling the same items hold the rest of a batch
        (tensor, context and CFG-parallel), over which run-time decisions are agreed."""
        from dit_mcore.models.dit.layer import DiTLayer
        self.policy, self.evaluations, self.groups = policy, evaluations, tuple(groups)
        self.layers = sorted((m for m in model.modules() if isinstance(m, DiTLayer)), key=lambda m: m.layer_number)
        self.stats = CacheStats()
        self.start()

    @property
    def decides(self) -> bool:
        """Whether the policy decides at run time, at the model's first layer (TeaCache, First-Block-Cache):
        under PipeFusion the decision then travels down the stages with each unit's activations."""
        return self.policy.kind in ("teacache", "fbcache")

    def start(self) -> None:
        self.index = -1
        self.store: dict = {}
        self.accumulated: dict = {}
        self.skip = False
        """The current unit's decision (set by the first layer, or received from the previous stage)."""
        self.scope, self.weight = None, 1.0

    def evaluation(self, index: int, scope: Optional[int] = None, weight: float = 1.0) -> None:
        """Before evaluation ``index`` (of the whole item, or PipeFusion's unit of patch ``scope``, which counts
        ``weight`` of an evaluation and caches apart from the other patches)."""
        self.index, self.scope, self.weight = index, scope, weight
        self.stats.layer_evaluations += weight * len(self.layers)
        self.forced = index == 0 or index == self.evaluations - 1

    @contextlib.contextmanager
    def installed(self):
        patched = []  # (module, the instance's own forward before, if any)

        def patch(module, forward):
            patched.append((module, module.__dict__.get("forward")))
            module.forward = forward

        kind = self.policy.kind
        try:
            for layer in self.layers:
                i = layer.layer_number - 1  # the global index (a static plan's; pipeline stages hold a range)
                original = layer.forward
                if kind == "static":
                    patch(layer, self._static(i, original))
                elif kind in ("teacache", "fbcache"):
                    patch(layer, self._stack(i, original))
                else:
                    reused = [getattr(layer, n) for n in ("self_attention", "temporal_attention", "cross_attention", "mlp")]
                    for j, sub in enumerate(m for m in reused if m is not None and hasattr(m, "forward")
                                            and type(m).__name__ != "IdentityOp"):
                        patch(sub, self._fora(f"{i}.{j}", sub.forward))
                    patch(layer, self._fora_count(original))
            yield self
        finally:
            for module, before in reversed(patched):
                if before is None:
                    del module.forward  # back to the class's
                else:
                    module.forward = before

    # --- static plans: per layer, its own residual
    def _static(self, i: int, forward):
        def run(hidden, cond, **kwargs):
            key = (self.scope, i)
            if self.forced or self.policy.computes(self.index, i) or key not in self.store:
                out = forward(hidden, cond, **kwargs)
                self.store[key] = out - hidden
                return out
            self.stats.skipped += self.weight
            return hidden + self.store[key]
        return run

    # --- TeaCache and First-Block-Cache: the stack's residual, decided at the first layer
    def _stack(self, i: int, forward):
        """Layer ``i`` (global index) of this process's layers, which may be one PipeFusion stage's: the model's
        first layer decides; each process keeps the residual of its own layers (after the first layer, for
        First-Block-Cache on the first stage) per scope, and a skipped unit adds it."""
        first, last = self.layers[0].layer_number - 1, self.layers[-1].layer_number - 1
        tea, depth = self.policy.kind == "teacache", self.layers[0].config.num_layers

        def run(hidden, cond, **kwargs):
            store = self.store.setdefault(self.scope, {})
            if i == first:
                store["input"] = hidden
                if i != 0:  # a later stage: the decision came with the activations
                    if self.skip:
                        self.stats.skipped += self.weight * len(self.layers)
                        return hidden + store["residual"]
                elif tea:
                    modulated = self.layers[0].attention_input(hidden, cond)
                    prev = store.get("modulated")
                    store["modulated"] = modulated
                    accumulated = self.accumulated.get(self.scope, 0.0)
                    if prev is not None and prev.shape == modulated.shape:
                        accumulated += self.policy.rescaled(_rel_l1(modulated, prev, self.groups))
                    self.skip = not self.forced and "residual" in store and accumulated < self.policy.threshold
                    if self.skip:
                        self.accumulated[self.scope] = accumulated
                        self.stats.skipped += self.weight * len(self.layers)
                        return hidden + store["residual"]
                    self.accumulated[self.scope] = 0.0
                out = forward(hidden, cond, **kwargs)
                if i == 0 and not tea:  # First-Block-Cache: the first layer ran, its residual decides
                    first_residual = out - hidden
                    prev = store.get("first")
                    self.skip = not self.forced and depth > 1 and prev is not None and "residual" in store and \
                        _rel_l1(first_residual, prev, self.groups) < self.policy.threshold
                    if self.skip:
                        self.stats.skipped += self.weight * (len(self.layers) - 1)
                        return out + store["residual"]
                    store["first"], store["after_first"] = first_residual, out
                if i == last:  # (one layer here: its own residual; First-Block-Cache's first has nothing after it)
                    store["residual"] = out - (store["input"] if tea or i != 0 else out)
                return out
            if self.skip:
                return hidden
            out = forward(hidden, cond, **kwargs)
            if i == last:
                base = store["after_first"] if first == 0 and not tea else store["input"]
                store["residual"] = out - base
            return out
        return run

    # --- FORA: attention and MLP outputs reused between refreshes
    def _refresh(self) -> bool:
        return self.forced or self.index % self.policy.interval == 0

    def _fora(self, name: str, forward):
        def run(*args, **kwargs):
            key = (self.scope, name)
            if self._refresh() or key not in self.store:
                out = forward(*args, **kwargs)
                self.store[key] = out
                self.computed = True
                return out
            return self.store[key]
        return run

    def _fora_count(self, forward):
        def run(hidden, cond, **kwargs):
            self.computed = False
            out = forward(hidden, cond, **kwargs)
            if not self.computed:  # (a patch's first unit after the warm-up computes: it has nothing cached)
                self.stats.skipped += self.weight
            return out
        return run
