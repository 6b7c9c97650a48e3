"""The redundancy analysis's plots and ``summary.md`` (matplotlib, no display)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

HEATMAP_KEYS = ("input", "residual", "attention", "temporal", "mlp")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def heatmap(path: Path, run: dict, model: str) -> None:
    """Step x layer maps of the relative L1 change (conditional branch, mean over seeds and items), one
    panel per probed activation, on one log colour scale."""
    from matplotlib.colors import LogNorm
    plt = _plt()
    keys = [k for k in HEATMAP_KEYS if k in run["rel"]]
    maps = {k: np.nanmean(run["rel"][k][:, :, 0], axis=(0, 1)).T for k in keys}  # [layers, E-1]
    values = np.concatenate([m[np.isfinite(m) & (m > 0)].ravel() for m in maps.values()])
    norm = LogNorm(vmin=values.min(), vmax=max(values.max(), values.min() * 1.001)) if values.size else None
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys) + 1.2, 3.8), squeeze=False,
                             constrained_layout=True)
    for ax, k in zip(axes[0], keys):
        image = ax.imshow(maps[k], aspect="auto", origin="lower", norm=norm, cmap="viridis",
                          extent=(0.5, maps[k].shape[1] + 0.5, -0.5, maps[k].shape[0] - 0.5))
        ax.set_title(k)
        layers = maps[k].shape[0]
        ax.set_yticks(range(0, layers, max(1, layers // 8)))
    axes[0][0].set_ylabel("layer")
    fig.supxlabel("evaluation (its change from the previous one)", fontsize=9)
    bar = fig.colorbar(image, ax=axes[0].tolist())
    bar.set_label("relative L1 change (log scale)")
    fig.suptitle(f"{model}: {run['sampler']}, {run['steps']} steps (conditional, mean over seeds and items)", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(path: Path, run: dict, model: str) -> None:
    """Each item's and seed's per-evaluation curve (the residual's change averaged over layers) on one
    plot, beside the TeaCache and First-Block-Cache indicators."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    c, x = run["curves"], np.array(run["moved"])
    colours = plt.cm.tab10(np.linspace(0, 1, max(10, c.shape[1])))
    for i, item in enumerate(run["items"]):
        name = item["prompt"] if item["prompt"] is not None else f"class {item['label']}" if item["label"] is not None \
            else f"item {item['index']}"
        for s in range(c.shape[0]):
            left.plot(x, c[s, i], color=colours[i % len(colours)], alpha=0.7, lw=1, label=name if s == 0 else None)
    left.set_yscale("log")
    left.set_xlabel("evaluation")
    left.set_ylabel("residual's relative L1 change, mean over layers")
    left.set_title("one line per item and seed", fontsize=9)
    if c.shape[1] <= 12:
        left.legend(fontsize=7)
    for name, style in (("teacache", "-"), ("fbcache", "--")):
        values = run["ind_rel"][name][:, :, 0]  # [seeds, items, E-1]
        right.plot(np.arange(1, run["evaluations"]), np.nanmean(values, axis=(0, 1)), style, label=name)
    right.set_yscale("log")
    right.set_xlabel("evaluation")
    right.set_ylabel("relative L1 change (mean over items and seeds)")
    right.set_title("cache indicators", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(f"{model}: {run['sampler']}, {run['steps']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(v) -> str:
    return "—" if v is None else f"{v:.3f}"


def summary(result: dict, runs: list[dict]) -> str:
    s = result["stability"]
    lines = [f"# Step redundancy: {result['family']}, {result['layers']} layers", "",
             f"Checkpoint `{result['checkpoint']}` ({result['weights']} weights), guidance {result['cfg_scale']}, "
             f"seeds {', '.join(map(str, result['seeds']))}. Every number is in `redundancy.json`; "
             "definitions there too. A *curve*: the residual's relative L1 change from the previous evaluation, "
             "mean over layers (conditional branch), over the changes into an evaluation at a new time (Heun's "
             "change from its corrector to the next step, at the same time, is left out); a *map*: the same per "
             "layer. Correlations: Pearson, of log10 values; runs of different lengths on a normalised time axis.", "",
             "## Per run", "",
             "| run | evaluations | mean change (residual) | most redundant evaluations | most changing layer | "
             "curves: prompts / seeds | maps: prompts / seeds | variation across prompts |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        st = s["per_run"][run["name"]]
        mean_map = np.nanmean(run["maps"], axis=(0, 1))  # [layers, E-1]
        curve = mean_map.mean(axis=0)
        calm = ", ".join(str(run["moved"][int(e)]) for e in np.argsort(curve)[:3])
        lines.append(f"| {run['name']} | {run['evaluations']} | {np.nanmean(mean_map):.4f} | {calm} | "
                     f"{int(np.nanargmax(mean_map.mean(axis=1)))} | {_f(st['curves_between_prompts'])} / "
                     f"{_f(st['curves_between_seeds'])} | {_f(st['maps_between_prompts'])} / {_f(st['maps_between_seeds'])} "
                     f"| {_f(st['variation_across_prompts'])} |")
    for kind, title in (("between_step_counts", "Between step counts"), ("between_samplers", "Between samplers")):
        if s[kind]:
            lines += ["", f"## {title} (normalised time axis)", "", "| runs | curve correlation | map correlation | "
                      "mean abs log10 difference |", "|---|---|---|---|"]
            lines += [f"| {' vs '.join(e['runs'])} | {_f(e['curve_correlation'])} | {_f(e['map']['correlation'])} | "
                      f"{_f(e['map']['mean_abs_log10_difference'])} |" for e in s[kind]]
    if "compare" in result:
        c = result["compare"]
        lines += ["", f"## Against `{c['other']}` ({c['other_family']})", "",
                  "| run | curve correlation | map correlation | mean abs log10 difference |", "|---|---|---|---|"]
        lines += [f"| {name} | {_f(e['curve_correlation'])} | {_f(e['map']['correlation'])} | "
                  f"{_f(e['map']['mean_abs_log10_difference'])} |" for name, e in c["runs"].items()]
    if "teacache_fit" in result:
        t = result["teacache_fit"]
        lines += ["", "## TeaCache's rescaling", "", f"`teacache_fit.json`: the model output's change as a degree-"
                  f"{len(t['coefficients']) - 1} polynomial of the first layer's modulated input's, over {t['points']} "
                  f"changes (R² {t['r2']:.3f}); use it with `--cache teacache:T:teacache_fit.json` (T then bounds "
                  "the predicted change of the output)."]
    if "plan" in result:
        pl = result["plan"]
        lines += ["", "## Static cache plan", "", f"`plan.json` reuses {pl['reused']:.1%} of the layer evaluations "
                  f"(budget {pl['budget']}; each layer recomputed when its accumulated change reaches "
                  f"{pl['threshold']:.4g}); use it with `python -m dit_mcore.generate --cache static:plan.json`."]
    lines += ["", "Plots: " + ", ".join(f"`heatmap_{r['name']}.png`, `curves_{r['name']}.png`" for r in runs), ""]
    return "\n".join(lines)


def write(out: Path, result: dict, runs: list[dict]) -> None:
    model = f"{result['family']} ({result['layers']} layers)"
    for run in runs:
        heatmap(out / f"heatmap_{run['name']}.png", run, model)
        curves(out / f"curves_{run['name']}.png", run, model)
    (out / "summary.md").write_text(summary(result, runs))
