"""Where a trained model repeats itself: ``python -m dit_mcore.analysis.redundancy``.

Runs the generation command's sampler (:func:`dit_mcore.generate.sampling.sample_items`, the same items,
noise and guidance) with :class:`~dit_mcore.analysis.probe.StepProbe` on every layer, for every seed and
every ``(sampler, steps)`` run asked for, and writes to ``--out``: ``redundancy.json`` (every number),
one heatmap and one curve plot per run, and ``summary.md`` with the stability statistics
(:mod:`dit_mcore.analysis.stability`) and, with ``--compare`` another analysis's folder, how far the two
models' maps lie apart.

    python -m dit_mcore.analysis.redundancy --checkpoint runs/digits --labels 0,3,7 --seeds 0,1,2,3 \\
        --steps 16,32 --samplers euler,heun --out runs/digits/redundancy

Under ``torchrun`` with a generation layout (``parallel.cfg_parallel``, tensor, context and pipeline parallel,
and the ranks left over sharing the items), each rank probes its layers and its part of the tokens and guidance
halves, the sums are added over the ranks of its model replica, and the replicas' shares of the items are
gathered in item order: the numbers equal the one-process run's. Under PipeFusion each stage probes its layers
patch by patch (each patch against its own previous unit, the first against the warm-up's stream, gathered
where a sequence split cuts it) and a patch's sums add to its evaluation's: the numbers equal those of the same
patches on one process.

    torchrun --nproc-per-node 2 -m dit_mcore.analysis.redundancy --checkpoint runs/digits --labels 0,3,7 \
        --out runs/digits/redundancy parallel.cfg_parallel=2
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dit_mcore.analysis import report
from dit_mcore.analysis.cache_plan import KINDS, derive_plan
from dit_mcore.analysis.probe import KEYS, StepProbe, cosine, rel_l1
from dit_mcore.analysis.stability import map_difference, curve_correlation, stability
from dit_mcore.errors import ConfigError
from dit_mcore.generate.items import batches, share


@dataclass
class AnalysisRequest:
    checkpoint: str
    out: str
    step: Optional[int] = None
    weights: str = "ema"
    labels: Optional[list[str]] = None
    prompts: Optional[list[str]] = None
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    steps: Optional[list[int]] = None
    """Sampler steps per run (default: the run's ``diffusion.sample_steps``)."""
    samplers: Optional[list[str]] = None
    """Samplers (default: the objective's first)."""
    cfg_scale: Optional[float] = None
    frames: Optional[int] = None
    height: Optional[int] = None
    width: Optional[int] = None
    num_per_prompt: int = 1
    """Items per label or prompt (an unconditional model: the number of items)."""
    batch_size: int = 8
    """Items per sampler call: the probe keeps every layer's activations of the last evaluation (and float64
    copies of one at a time), so memory grows with it."""
    compare: Optional[str] = None
    """Another analysis's ``--out`` (its ``redundancy.json``): how far the two models' maps lie apart."""
    derive_plan: bool = False
    """Also write ``plan.json``, a static cache plan (:mod:`dit_mcore.analysis.cache_plan`) for the one run."""
    parallel: Optional[object] = None
    """The generation layout (:class:`~dit_mcore.generate.layout.GenerateParallel`; None: one process)."""
    budget: float = 0.5
    """With ``derive_plan``: the fraction of layer evaluations the plan reuses."""
    plan_kind: str = "evaluations"
    """With ``derive_plan``: "evaluations" (whole evaluations reused; on the digits demo it kept 0.6-5 dB more
    PSNR than per-layer plans at equal speed-up) or "layers" (each layer its own schedule)."""


def _generate_request(r: AnalysisRequest, steps, sampler):
    from dit_mcore.generate.job import GenerateRequest
    return GenerateRequest(checkpoint=r.checkpoint, out=r.out, step=r.step, weights=r.weights, labels=r.labels,
                           prompts=r.prompts, num_per_prompt=r.num_per_prompt, steps=steps, sampler=sampler,
                           cfg_scale=r.cfg_scale, seed=r.seeds[0],
                           batch_size=r.batch_size, frames=r.frames, height=r.height, width=r.width, dtype="fp32",
                           progress=False)


def plans(r: AnalysisRequest) -> list:
    """One generation plan per ``(sampler, steps)`` run, every check done before any model exists."""
    from dit_mcore.generate.job import _world_size, plan
    world = _world_size()
    if not r.seeds:
        raise ConfigError("--seeds: give at least one seed (e.g. --seeds 0,1,2,3)")
    if len(set(r.seeds)) != len(r.seeds):
        raise ConfigError(f"--seeds {','.join(map(str, r.seeds))}: a seed given twice would count as two")
    theirs = _other_runs(r.compare) if r.compare else None
    out = []
    for sampler in r.samplers or [None]:
        for steps in r.steps or [None]:
            p = plan(_generate_request(r, steps, sampler), r.parallel, world_size=world)
            replicas = p.parallel.items_parallel_size(world)
            if replicas > len(p.items):
                raise ConfigError(f"{world} processes share {len(p.items)} item(s) over {replicas} model replicas: "
                                  "give at least as many items as replicas (--num-per-prompt) or fewer processes")
            if out:
                p.encode = out[0].encode  # one text encoder for every run
            if p.steps < 2:
                raise ConfigError(f"--steps {p.steps}: the analysis compares evaluations with the one before; "
                                  "give at least 2")
            out.append(p)
    if r.derive_plan and len(out) != 1:
        raise ConfigError("--derive-plan: a plan is for one sampler and one step count; give one --steps and one --samplers")
    if r.derive_plan and r.plan_kind not in KINDS:
        raise ConfigError(f"--plan-kind {r.plan_kind}: use one of {', '.join(KINDS)}")
    if r.derive_plan and not 0.0 < r.budget < 1.0:
        raise ConfigError(f"--budget {r.budget}: give the fraction of layer evaluations to reuse, between 0 and 1")
    names = [f"{p.sampler}_{p.steps}" for p in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"--steps/--samplers: runs repeat ({', '.join(names)})")
    if theirs is not None and not set(names) & set(theirs):
        raise ConfigError(f"--compare {r.compare}: no run of the same sampler and steps there ({', '.join(theirs)}); "
                          "use the same --samplers and --steps")
    return out


def _other_runs(where: str) -> dict:
    """The runs of another analysis (``--compare``), checked before any model is built."""
    path = Path(where) / "redundancy.json"
    try:
        other = json.loads(path.read_text())
        runs = {run["name"]: run for run in other["runs"]}
        for run in runs.values():
            run["rel_l1"]["residual"]
    except OSError:
        raise ConfigError(f"--compare {where}: no redundancy.json there; give the --out of another analysis") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--compare {where}: its redundancy.json is not an analysis's (unreadable or another "
                          "format); run the analysis there again") from None
    return runs


def _replica_group(groups):
    """The ranks of this rank's model replica (tensor, context, pipeline and CFG-parallel: the ranks sampling the
    same items); None when there is one replica (the whole world). Every rank takes part in creating every group."""
    import torch.distributed as dist
    if groups.items_size == 1:
        return None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups.items_rank)
    mine = None
    for items_rank in sorted(set(everyone)):
        group = dist.new_group([rank for rank, i in enumerate(everyone) if i == items_rank])
        if items_rank == groups.items_rank:
            mine = group
    return mine


def _merge(evaluations: list[dict], groups, cfg_size: int, replica=None) -> list[dict]:
    """Every rank's sums as one process's: added over the ranks of a guidance half in this model replica (their
    tokens, their pipeline stages' layers), the halves' rows stacked (conditional first)."""
    import torch.distributed as dist
    if dist.get_world_size(replica) == 1:
        return evaluations
    everyone = [None] * dist.get_world_size(replica)
    dist.all_gather_object(everyone, (groups.cfg_rank, evaluations), group=replica)
    merged = []
    for e in range(len(evaluations)):
        halves = []
        for half in range(cfg_size):
            sums = {}
            for rank_half, evs in everyone:
                if rank_half == half:
                    for k, v in evs[e].items():
                        sums[k] = sums[k] + v if k in sums else v.clone()
            halves.append(sums)
        merged.append({k: torch.cat([h[k] for h in halves]) for k in halves[0]})
    return merged


def _probe_run(p, model, model_config, model_fn, seeds: list[int], groups, replica=None) -> dict:
    """``{"sums": {key: [seeds, items, branches, E-1, layers, 5]}, "indicators": {name: [..., E-1, 5]},
    "timesteps": [E]}`` for one run: this replica's share of the items, then every replica's in item order."""
    from dit_mcore.generate.sampling import sample_items
    objective = p.run.diffusion.build()
    probe, guided = StepProbe(model), p.cfg_scale != 1.0
    depth, per_seed, timesteps = model_config.num_layers, [], None

    def probed(x, timestep, **kwargs):
        probe.evaluation(timestep)
        out = model_fn(x, timestep, **kwargs)
        probe.output(out[:, :x.shape[1]])  # the prediction, without DDPM's learned-variance channels
        return out

    pipefusion = None
    if p.parallel.patches() > 1:  # each patch's changes, added up per evaluation (sums over tokens)
        from dit_mcore.generate.job import sampler_evaluations
        from dit_mcore.generate.pipefusion import PipeFusion, warmup_evaluations
        evaluations = sampler_evaluations(p.sampler, objective.name, p.steps)
        pipefusion = PipeFusion(model, model_config, patches=p.parallel.patches(), probe=probe,
                                warmup=warmup_evaluations(p.steps, evaluations, p.parallel.pipefusion_warmup_steps))
    for seed in seeds:
        per_item = []
        for batch in batches(share(p.items, groups.items_rank, groups.items_size), p.request.batch_size):
            probe.start()
            try:
                sample_items(probed, model_config, objective, batch, shape=p.shape, seed=seed, steps=p.steps,
                             cfg_scale=p.cfg_scale, sampler=p.sampler, encode=p.encode,
                             device=next(model.parameters()).device, cfg_group=groups.cfg_group, pipefusion=pipefusion)
            finally:
                evaluations = probe.stop()
            evaluations = _merge(evaluations, groups, p.parallel.cfg_parallel, replica)
            timesteps = probe.timesteps
            n = len(batch)
            branches = [slice(0, n), slice(n, 2 * n)] if guided else [slice(0, n)]
            keys = sorted({name.split(".", 1)[1] for name in evaluations[0] if "." in name}, key=KEYS.index)
            sums = {k: torch.stack([torch.stack([e[f"{i}.{k}"] for i in range(depth)]) for e in evaluations])
                    for k in keys}  # [E-1, layers, rows, 5]
            # -> [items, branches, E-1, layers, 5]
            sums = {k: torch.stack([v[:, :, b] for b in branches]).permute(3, 0, 1, 2, 4) for k, v in sums.items()}
            ind = {k: torch.stack([torch.stack([e[k] for e in evaluations])[:, b] for b in branches]).permute(2, 0, 1, 3)
                   for k in ("teacache", "fbcache", "model_output") if k in evaluations[0]}  # [items, branches, E-1, 5]
            per_item.append((sums, ind))
        per_seed.append(({k: torch.cat([s[k] for s, _ in per_item]) for k in per_item[0][0]},
                         {k: torch.cat([i[k] for _, i in per_item]) for k in per_item[0][1]}))
    sums = {k: torch.stack([s[k] for s, _ in per_seed]).numpy() for k in per_seed[0][0]}
    indicators = {k: torch.stack([i[k] for _, i in per_seed]).numpy() for k in per_seed[0][1]}
    if groups.items_size > 1:  # the replicas' shares (contiguous blocks of the items), in item order
        import torch.distributed as dist
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (groups.items_rank, sums, indicators))
        shares = {items_rank: (s, i) for items_rank, s, i in everyone}
        ordered = [shares[items_rank] for items_rank in sorted(shares)]
        sums = {k: np.concatenate([s[k] for s, _ in ordered], axis=1) for k in sums}
        indicators = {k: np.concatenate([i[k] for _, i in ordered], axis=1) for k in indicators}
    return {"sums": sums, "indicators": indicators, "timesteps": timesteps}


def _finite(value):
    """Non-finite floats as None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _metrics(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.from_numpy(sums)
    return rel_l1(t).numpy(), cosine(t).numpy()


def _rounded(a: np.ndarray):
    return np.vectorize(lambda v: float(f"{v:.6g}") if np.isfinite(v) else None, otypes=[object])(a).tolist()


def analyse(r: AnalysisRequest) -> dict:
    """Plan, load the model once, probe every run, write the report; returns ``redundancy.json``'s content."""
    import torch.distributed as dist

    from dit_mcore.generate.job import load_model, model_function
    from dit_mcore.generate.layout import sampling_groups
    from dit_mcore.parallel.initialize import initialize_distributed, release_model_parallel_groups, run_device
    all_plans = plans(r)
    first = all_plans[0]
    initialize_distributed(first.parallel, seed=0)
    try:
        groups = sampling_groups(first.parallel)
        replica = _replica_group(groups)
        model, model_config = load_model(first, run_device())
        model_fn = model_function(first, model, model_config)
        runs = []
        for p in all_plans:
            probed = _probe_run(p, model, model_config, model_fn, r.seeds, groups, replica)
            rel = {k: _metrics(v)[0] for k, v in probed["sums"].items()}  # [seeds, items, branches, E-1, layers]
            cos = {k: _metrics(v)[1] for k, v in probed["sums"].items()}
            ind_rel = {k: _metrics(v)[0] for k, v in probed["indicators"].items()}  # [seeds, items, branches, E-1]
            ind_cos = {k: _metrics(v)[1] for k, v in probed["indicators"].items()}
            ts = probed["timesteps"]
            # changes into an evaluation at a new time (Heun's next step starts at the time its corrector just
            # ran: that change is near zero whatever the model, and is left out of maps, curves and statistics)
            moved = [e for e in range(1, len(ts)) if ts[e] != ts[e - 1]]
            maps = rel["residual"][:, :, 0][:, :, [e - 1 for e in moved]].transpose(0, 1, 3, 2)  # [S, I, layers, changes]
            runs.append({"name": f"{p.sampler}_{p.steps}", "sampler": p.sampler, "steps": p.steps,
                         "evaluations": len(ts), "timesteps": ts, "moved": moved,
                         "branches": ["cond", "uncond"] if p.cfg_scale != 1.0 else ["cond"],
                         "items": [{"index": it.index, "label": it.label, "prompt": it.prompt} for it in p.items],
                         "maps": maps, "curves": maps.mean(axis=2), "rel": rel, "cos": cos,
                         "ind_rel": ind_rel, "ind_cos": ind_cos})
    finally:
        release_model_parallel_groups()
    stats = stability(runs)
    result = {"checkpoint": str(first.path), "family": first.run.model.family, "layers": int(runs[0]["maps"].shape[2]),
              "weights": r.weights, "cfg_scale": first.cfg_scale, "seeds": r.seeds,
              "definitions": {"rel_l1": "sum|A_t - A_t-1| / sum|A_t-1| over a row's tokens and channels",
                              "cosine": "<A_t, A_t-1> / (|A_t| |A_t-1|)",
                              "index": "[seed][item][branch][layer][evaluation - 1] (indicators without layer)",
                              "curve": "the conditional branch's residual rel_l1 averaged over layers, over the changes "
                                       "into an evaluation at a new time (same_time false)",
                              "teacache": "the first layer's modulated input (its self-attention's input)",
                              "fbcache": "the first layer's residual"},
              "runs": [{**{k: run[k] for k in ("name", "sampler", "steps", "evaluations", "timesteps", "branches", "items")},
                        "same_time": [e not in run["moved"] for e in range(1, run["evaluations"])],
                        "rel_l1": {k: _rounded(v.transpose(0, 1, 2, 4, 3)) for k, v in run["rel"].items()},
                        "cosine": {k: _rounded(v.transpose(0, 1, 2, 4, 3)) for k, v in run["cos"].items()},
                        "indicators": {k: {"rel_l1": _rounded(run["ind_rel"][k]), "cosine": _rounded(run["ind_cos"][k])}
                                       for k in run["ind_rel"]}}
                       for run in runs],
              "stability": stats}
    if r.compare:
        result["compare"] = compare(runs, json.loads((Path(r.compare) / "redundancy.json").read_text()), r.compare)
    result = _finite(result)
    if dist.is_initialized() and dist.get_rank() != 0:  # (every rank holds the same merged numbers)
        return result
    out = Path(r.out)
    out.mkdir(parents=True, exist_ok=True)
    fit = teacache_fit(runs)
    if fit is not None:
        fit = {**fit, "layers": result["layers"], "checkpoint": result["checkpoint"]}
        (out / "teacache_fit.json").write_text(json.dumps(fit, indent=1))
        result["teacache_fit"] = {k: fit[k] for k in ("coefficients", "points", "r2")}
    if r.derive_plan:
        run = runs[0]
        changes = np.nanmean(run["rel"]["residual"], axis=(0, 1, 2)).T  # [layers, E-1], both branches
        plan = {**derive_plan(changes, r.budget, r.plan_kind), "checkpoint": result["checkpoint"], "sampler": run["sampler"],
                "steps": run["steps"]}
        (out / "plan.json").write_text(json.dumps(plan, indent=1))
        result["plan"] = {k: plan[k] for k in ("reused", "threshold", "budget")}
        print(f"a static cache plan reusing {plan['reused']:.1%} of the layer evaluations -> {out}/plan.json "
              f"(python -m dit_mcore.generate ... --steps {run['steps']} --sampler {run['sampler']} "
              f"--cache static:{out}/plan.json)", flush=True)
    (out / "redundancy.json").write_text(json.dumps(_finite(result)))
    report.write(out, result, runs)
    print(f"analysed {len(runs)} run(s) x {len(r.seeds)} seed(s) x {len(first.items)} item(s) of "
          f"{result['family']} ({result['layers']} layers) -> {out}/summary.md", flush=True)
    return result


def teacache_fit(runs: list[dict], degree: int = 4) -> Optional[dict]:
    """TeaCache's per-model rescaling: the model output's relative L1 change as a polynomial of the first
    layer's modulated input's (``np.polyfit``, ``degree``), over every item, seed, branch and change into an
    evaluation at a new time of every run; None without enough points (or no output probed)."""
    xs, ys = [], []
    for run in runs:
        if "model_output" not in run["ind_rel"]:
            continue
        cols = [e - 1 for e in run["moved"]]
        xs.append(run["ind_rel"]["teacache"][..., cols].ravel())
        ys.append(run["ind_rel"]["model_output"][..., cols].ravel())
    if not xs:
        return None
    x, y = np.concatenate(xs), np.concatenate(ys)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size <= degree or np.ptp(x) == 0:
        return None
    coefficients = np.polyfit(x, y, degree)
    residual = y - np.polyval(coefficients, x)
    r2 = 1.0 - float((residual ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-300))
    return {"coefficients": coefficients.tolist(), "degree": degree, "points": int(x.size), "r2": r2,
            "fit": "the model output's relative L1 change on the first layer's modulated input's (TeaCache)"}


def compare(runs: list[dict], other: dict, where: str) -> dict:
    """Per run name present in both analyses: the mean maps' :func:`map_difference` and the mean curves'
    correlation (the other model may have another depth)."""
    out = {"other": where, "other_checkpoint": other.get("checkpoint"), "other_family": other.get("family"), "runs": {}}
    theirs = {run["name"]: run for run in other["runs"]}
    for run in runs:
        if run["name"] not in theirs:
            continue
        other_run = theirs[run["name"]]
        rel = np.array(other_run["rel_l1"]["residual"], dtype=np.float64)  # [S, I, B, L, E-1] (None: NaN)
        moved = [i for i, same in enumerate(other_run.get("same_time", [False] * rel.shape[-1])) if not same]
        their_map = np.nanmean(rel[:, :, 0][..., moved], axis=(0, 1))
        mine = run["maps"].mean(axis=(0, 1))
        out["runs"][run["name"]] = {"map": map_difference(mine, their_map),
                                    "curve_correlation": curve_correlation(mine.mean(axis=0), their_map.mean(axis=0))}
    if not out["runs"]:
        raise ConfigError(f"--compare {where}: no run of the same sampler and steps there "
                          f"({', '.join(theirs)}); use the same --samplers and --steps")
    return out


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text}: give integers separated by commas (e.g. {flag} 0,1,2,3)") from None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_mcore.analysis.redundancy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/ or one step_* folder")
    ap.add_argument("--out", required=True, help="folder for redundancy.json, the plots and summary.md")
    ap.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    ap.add_argument("--weights", default="ema", help="ema (default) or model")
    ap.add_argument("--labels", help="class labels, e.g. 0,3,7 or all")
    ap.add_argument("--prompts", nargs="+", help="prompts (text models)")
    ap.add_argument("--prompt-file", help="one prompt per line")
    ap.add_argument("--seeds", default="0,1,2,3", help="noise seeds; each item is sampled once per seed")
    ap.add_argument("--steps", help="sampler steps per run, e.g. 16,32 (default: the run's)")
    ap.add_argument("--samplers", help="samplers, e.g. euler,heun (default: the objective's first)")
    ap.add_argument("--cfg-scale", type=float, help="guidance scale (default: the run's)")
    ap.add_argument("--frames", type=int)
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--num-per-prompt", type=int, default=1,
                    help="items per label or prompt (an unconditional model: the number of items)")
    ap.add_argument("--batch-size", type=int, default=8, help="items per sampler call (the probe's memory grows with it)")
    ap.add_argument("--compare", help="another analysis's --out: how far the two models' maps lie apart")
    ap.add_argument("--derive-plan", action="store_true",
                    help="also write plan.json, a static cache plan for generate --cache static:PLAN.json")
    ap.add_argument("--budget", type=float, default=0.5, help="with --derive-plan: the fraction of layer "
                                                              "evaluations to reuse (default 0.5)")
    ap.add_argument("--plan-kind", default="evaluations", help="with --derive-plan: evaluations (whole evaluations "
                                                               "reused, default) or layers (each its own schedule)")
    ap.add_argument("overrides", nargs="*", metavar="parallel.FIELD=VALUE",
                    help="the generation layout of one model replica (under torchrun)")
    a = ap.parse_args(argv)
    from dit_mcore.generate.cli import read_prompt_file
    from dit_mcore.generate.job import layout_from_overrides
    from dit_mcore.parallel.initialize import destroy_distributed
    try:
        prompts = read_prompt_file(a.prompt_file) if a.prompt_file else a.prompts
        request = AnalysisRequest(
            checkpoint=a.checkpoint, out=a.out, step=a.step, weights=a.weights,
            labels=a.labels.split(",") if a.labels else None, prompts=prompts, seeds=_ints("--seeds", a.seeds),
            steps=_ints("--steps", a.steps) if a.steps else None,
            samplers=[s.strip() for s in a.samplers.split(",") if s.strip()] if a.samplers else None,
            cfg_scale=a.cfg_scale, frames=a.frames, height=a.height, width=a.width, batch_size=a.batch_size,
            num_per_prompt=a.num_per_prompt,
            compare=a.compare, derive_plan=a.derive_plan, budget=a.budget, plan_kind=a.plan_kind,
            parallel=layout_from_overrides(a.overrides))
        analyse(request)
    except ConfigError as e:
        print(f"redundancy: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
