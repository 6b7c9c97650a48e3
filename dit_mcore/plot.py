"""``python -m dit_mcore.plot RUN_DIR [RUN_DIR ...] --out DIR``: a run's curves against steps, several runs
overlaid, one PNG per quantity (matplotlib), read from each run's ``metrics.jsonl``.

Written when a run logged the quantity: ``loss.png`` (training loss, and the validation losses of the trained
weights and of the EMA), ``val_by_level.png`` (the validation loss at each noise level), ``grad_norm.png``,
``lr.png``, ``throughput.png`` (tokens/s per GPU), ``tflops.png``, ``mfu.png``, ``memory.png`` (peak GiB
allocated per log interval, on GPUs), ``fid.png`` (``trainer.fid_interval``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

PANELS = {  # file stem: (title, y label, keys, log scale where the values span over 5x)
    "loss": ("Loss", "loss", ("loss", "val/loss", "val/ema_loss"), True),
    "grad_norm": ("Gradient norm", "grad norm", ("grad_norm",), True),
    "lr": ("Learning rate", "lr", ("lr",), False),
    "throughput": ("Throughput", "tokens/s per GPU", ("tokens_per_s_per_gpu",), False),
    "tflops": ("Model TFLOPS per GPU", "TFLOPS", ("tflops_per_gpu",), False),
    "mfu": ("MFU", "MFU", ("mfu",), False),
    "memory": ("Peak memory allocated", "GiB", ("max_memory_gib",), False),
    "fid": ("FID of the EMA's samples", "FID", ("eval/fid",), True),
}
LEVEL_PREFIX = "val/loss_t"


class PlotError(ValueError):
    """A run that cannot be plotted (one line naming the file and the fix)."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (a torn last line, from a run killed while writing, is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} not found: give run directories (a run's log.dir, which holds metrics.jsonl)")
    lines = path.read_text().splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise PlotError(f"{path}:{n} is not JSON; metrics.jsonl is written one JSON object per line") from None
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where logged (a step logged twice: its last record)."""
    last = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float))}
    pairs = sorted(last.items())
    return [s for s, _ in pairs], [v for _, v in pairs]


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's name: its folder's, or its path where two runs share a name."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def plot_runs(run_dirs: list, out: Path) -> dict[str, dict]:
    """Write the PNGs of ``run_dirs`` into ``out``; returns what each shows: ``{stem: {label: (steps, values)}}``."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("python -m dit_mcore.plot needs matplotlib: pip install matplotlib "
                        "(or pip install -e '.[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    runs = {label: read_metrics(d) for label, d in zip(_labels(run_dirs), run_dirs)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shown: dict[str, dict] = {}
    levels = sorted({k for records in runs.values() for r in records for k in r if k.startswith(LEVEL_PREFIX)},
                    key=lambda k: float(k[len(LEVEL_PREFIX):]))
    panels = {**PANELS, "val_by_level": ("Validation loss by noise level", "loss", tuple(levels), True)}
    for stem, (title, ylabel, keys, log_scale) in panels.items():
        lines = {}
        for label, records in runs.items():
            for key in keys:
                steps, values = series(records, key)
                if steps:
                    name = key[len("val/"):] if stem == "val_by_level" else key
                    lines[label if len(keys) == 1 else f"{label}: {name}"] = (steps, values)
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, (steps, values) in lines.items():
            ax.plot(steps, values, label=name, marker="o" if len(steps) < 20 else None, markersize=3)
        every = [v for _, values in lines.values() for v in values]
        if log_scale and min(every) > 0 and max(every) > 5 * min(every):  # (a wide range: else linear reads better)
            ax.set_yscale("log")
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # (0.2, not 2x10^-1)
                axis(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
        plt.close(fig)
        shown[stem] = lines
    return shown


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dit_mcore.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each a log.dir holding metrics.jsonl)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    args = parser.parse_args(argv)
    try:
        shown = plot_runs(args.runs, args.out)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(f'{stem}.png' for stem in shown)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
