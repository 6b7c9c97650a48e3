"""Step caching's speed against quality on a trained checkpoint, every policy side by side with the uncached
sampler of the same noise (the peer).

Per point (a policy and its setting): the layer evaluations served from the cache and the speed-up in them
(``1 / (1 - skipped)``), the FLOPs saved (``dit_mcore.models.flops``), the wall-time speed-up over the uncached run
(median of ``--repeats``), PSNR of the 8-bit images (a clip model's GIF frames) against the uncached ones, and
the readers of ``dit_mcore.evaluate.clip_check``: for a class model the digit readers' agreement with the
requested class; for a text-to-video model (its ``moving_digits`` prompts) the share of clips whose digit the
nearest-neighbour and the independent CNN reader read as prompted, and that move the prompted way. Static plans
are derived by the redundancy analysis on *other* seeds than the ones measured (``--calibration-seeds``), at
each ``--budgets``. Writes ``benchmarks/results/cache_tradeoff_<device>.json`` and a Pareto plot beside it.

    python benchmarks/cache_tradeoff.py --checkpoint runs/digits            # the digits demo, ~10 min on 2 cores
    python benchmarks/cache_tradeoff.py --checkpoint runs/t2v_digits --num-per-prompt 3 --out t2v.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results_io import device_name, write_result  # noqa: E402

POLICIES = ["fora:2", "fora:3", "fora:4", "teacache:0.05", "teacache:0.1", "teacache:0.2", "teacache:0.4",
            "fbcache:0.02", "fbcache:0.05", "fbcache:0.1", "fbcache:0.2"]
FITTED = "0.05,0.1,0.2,0.4"
"""TeaCache with the model's own rescaling (``teacache:T:teacache_fit.json``, the analysis's fit on the calibration
seeds) at these thresholds (``--fitted``; T then bounds the predicted change of the model's output)."""


def _pixels(folder: Path) -> dict:
    from dit_mcore.evaluate.clip_check import load_gif, load_png
    index = json.loads((folder / "index.json").read_text())
    return {e["index"]: (load_gif if e["file"].endswith(".gif") else load_png)(folder / e["file"]).numpy()
            for e in index}


def _conditioning(args) -> dict:
    """A text model's ``moving_digits`` prompts, else every class."""
    from dit_mcore.generate.preview import moving_digits_prompts
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.training.weights import find_checkpoint, read_run, weights_model_config
    model = weights_model_config(read_run(find_checkpoint(args.checkpoint, None)).model).build(ParallelConfig())
    return {"prompts": moving_digits_prompts()} if model.text_dim else {"labels": ["all"]}


def _quality(out: Path) -> dict:
    """What the readers say of a generation folder (clips: digit by both readers and direction; images: class)."""
    from dit_mcore.evaluate.clip_check import check_images, check_preview
    index = json.loads((out / "index.json").read_text())
    if "label" in index[0]:
        checks = check_images(out)
        return {"agreement": sum(c.ok for c in checks) / len(checks),
                "agreement_cnn": sum(c.ok_cnn for c in checks) / len(checks), "items": len(checks)}
    clips = check_preview(out)
    n = len(clips)
    return {"agreement": sum(c.digit_ok for c in clips) / n, "agreement_cnn": sum(c.digit_ok_cnn for c in clips) / n,
            "direction": sum(c.direction_ok for c in clips) / n, "items": n}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """dB of 8-bit images in [0, 1]; identical images count as 99 dB (JSON has no infinity)."""
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(1.0 / mse)


def run_point(args, out: Path, cache) -> dict:
    from dit_mcore.generate.job import GenerateRequest, generate
    seconds = []
    for _ in range(args.repeats):
        summary = generate(GenerateRequest(checkpoint=args.checkpoint, out=str(out), **_conditioning(args),
                                           num_per_prompt=args.num_per_prompt, steps=args.steps, seed=args.seed,
                                           batch_size=args.batch_size, progress=False, mp4=False, cache=cache))
        seconds.append(summary["sampling_seconds"])  # the sampler alone: no decoding or file writing
    point = {"policy": cache or "none", "sampling_seconds": statistics.median(seconds), **_quality(out)}
    if cache:
        point.update({k: summary["cache"][k] for k in ("layer_evaluations", "skipped", "skipped_fraction", "flops_saved")})
        point["layer_speedup"] = 1 / (1 - point["skipped_fraction"])
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--num-per-prompt", type=int, default=10, help="items per class")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibration-seeds", default="100,101", help="the analysis's seeds for the static plans")
    ap.add_argument("--budgets", default="0.3,0.5,0.6,0.7,0.8", help="static plans: fractions of layer evaluations reused")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--fitted", default=FITTED, help="thresholds of TeaCache rescaled by the analysis's fit ('' none)")
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    from dit_mcore.analysis.redundancy import AnalysisRequest, analyse
    from dit_mcore.analysis.cache_plan import KINDS, derive_plan
    from dit_mcore.errors import ConfigError
    work = Path(tempfile.mkdtemp(prefix="cache_tradeoff_"))
    analysis = analyse(AnalysisRequest(checkpoint=args.checkpoint, out=str(work / "analysis"), **_conditioning(args),
                                       seeds=[int(s) for s in args.calibration_seeds.split(",")], steps=[args.steps]))
    rel = np.array(analysis["runs"][0]["rel_l1"]["residual"], dtype=np.float64)  # [S, I, B, L, E-1]
    changes = np.nanmean(rel, axis=(0, 1, 2))
    plans = []
    for kind in KINDS:
        for budget in (float(b) for b in args.budgets.split(",")):
            try:
                plan = {**derive_plan(changes, budget, kind), "steps": args.steps}
            except ConfigError as e:
                print(f"skipped: {e}")
                continue
            path = work / f"plan_{kind}_{budget}.json"
            path.write_text(json.dumps(plan))
            plans.append(f"static:{path}")
    fit = work / "analysis" / "teacache_fit.json"
    fitted = [f"teacache:{t}:{fit}" for t in args.fitted.split(",") if t] if fit.is_file() else []
    reference = run_point(args, work / "none", None)
    ref_pixels = _pixels(work / "none")
    points = [reference]
    for i, cache in enumerate([p for p in args.policies.split(",") if p] + fitted + plans):
        folder = work / f"point_{i}"
        point = run_point(args, folder, cache)
        pixels = _pixels(folder)
        point["psnr_db"] = statistics.median(psnr(pixels[k], ref_pixels[k]) for k in ref_pixels)
        point["wall_speedup"] = reference["sampling_seconds"] / point["sampling_seconds"]
        if cache.startswith("static:"):
            plan = json.loads(Path(cache[7:]).read_text())
            point["policy"] = f"static {plan['kind']} (budget {plan['budget']})"
        elif cache in fitted:
            point["policy"] = f"teacache fitted:{cache.split(':')[1]}"
        points.append(point)
        motion = f"  direction {point['direction']:.2f}" if "direction" in point else ""
        print(f"{point['policy']:24s} layers x{point['layer_speedup']:.2f}  wall x{point['wall_speedup']:.2f}  "
              f"PSNR {point['psnr_db']:.1f} dB  reader {point['agreement']:.3f} (uncached {reference['agreement']:.3f})"
              f"  cnn {point['agreement_cnn']:.3f} ({reference['agreement_cnn']:.3f}){motion}", flush=True)
    result = {"device": device_name(), "checkpoint": args.checkpoint, "steps": args.steps, "seed": args.seed,
              "items": reference["items"], "calibration_seeds": args.calibration_seeds,
              "command": "python benchmarks/cache_tradeoff.py " + " ".join(sys.argv[1:]),
              "analysis_stability": analysis["stability"]["per_run"], "points": points}
    path = write_result("cache_tradeoff", result, args.out)
    plot(points, path.with_suffix(".png"))
    print(f"wrote {path}")


def plot(points: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for family, marker in (("fora", "o"), ("teacache:", "s"), ("teacache fitted", "P"), ("fbcache", "^"),
                           ("static layers", "D"), ("static evaluations", "v")):
        chosen = sorted((p for p in points if p["policy"].startswith(family)), key=lambda p: p["layer_speedup"])
        if chosen:
            x = [p["layer_speedup"] for p in chosen]
            left.plot(x, [100 * p["agreement"] for p in chosen], marker + "-", label=family.rstrip(":"), alpha=0.8)
            differ = [p for p in chosen if p["psnr_db"] < 99]  # (identical images: nothing reused)
            right.plot([p["layer_speedup"] for p in differ], [p["psnr_db"] for p in differ], marker + "-",
                       label=family.rstrip(":"), alpha=0.8)
    left.axhline(100 * points[0]["agreement"], color="grey", ls="--", label="uncached")
    left.set_xlabel("speed-up in layer evaluations")
    left.set_ylabel("digit read as requested (%, nearest-neighbour reader)")
    right.set_xlabel("speed-up in layer evaluations")
    right.set_ylabel("PSNR against uncached (dB, median)")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
