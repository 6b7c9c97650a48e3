"""``python -m dit_mcore.plan``: the layouts of a run on a cluster, predicted and ranked.

    python -m dit_mcore.plan --family dit_xattn --preset DiT-XAttn-7B --seq 8192 --text-len 256 \\
        --global-batch 256 --gpus 256 --gpu H100-80GB [--top 5] [--json layouts.jsonl] [--emit]
    python -m dit_mcore.plan --family llama --preset MovieGen-3B --pack 8192 --mix 1x32x32,16x32x32 \
        --global-batch 64 --gpus 64                                  # packed images and clips
    python -m dit_mcore.plan --run runs/my_run --gpus 64             # a recorded run (directory or checkpoint)
    python -m dit_mcore.plan ... --explain "tp=2,recompute=full"    # one layout, part by part

Model fields the preset does not fix go as ``model.<field>=<value>`` (e.g. ``model.num_layers=28``), optimizer and
trainer fields as ``optim.<field>=...`` and ``trainer.<field>=...``.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path


from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.plan.gpus import GPUS, gpu as gpu_entry
from dit_mcore.plan.samples import Samples, batch_maker, run_samples, text_tokens
from dit_mcore.plan.search import Layout, Planner, accepted
from dit_mcore.plan.step_time import on_wire, operator_times, span
from dit_mcore.training.memory import GiB, size


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dit_mcore.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", metavar="PATH", help="plan a recorded run: its directory (its run_config.json), a "
                    "checkpoint, or a run_config.json; its model, optimizer, trainer and data (the data flags below "
                    "replace its samples, overrides its fields; its layout is the planner's to choose)")
    ap.add_argument("--family", help="model family (dit, dit_xattn, llama, stdit; default dit)")
    ap.add_argument("--preset", help="a preset of the family (default DiT-XL/2)")
    ap.add_argument("--seq", type=int, help="tokens per sample (after patching)")
    ap.add_argument("--frames", type=int, default=1, help="latent frames per sample (the token grid's t)")
    ap.add_argument("--frame-width", type=int, help="tokens across a frame (default: a square frame); the height is "
                    "the frame's tokens over it")
    ap.add_argument("--pack", type=int, metavar="TOKENS", help="pack the samples into sequences of this many tokens "
                    "(data.max_seq_len); the global batch then counts packs")
    ap.add_argument("--mix", metavar="TxHxW[:W],...", help="samples of several token grids, packed (with --pack), "
                    "drawn evenly or by weight: e.g. three images to a clip, 1x32x32:3,16x32x32")
    ap.add_argument("--text-len", type=int, help="text tokens per sample (text families; default 256, or the "
                    "recorded run's captions)")
    ap.add_argument("--global-batch", type=int, help="samples (packs) per optimizer step (default: the recorded run's)")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="H100-80GB", help=f"one of {sorted(GPUS)}")
    ap.add_argument("--gpu-memory-gib", type=float, help="override the table's memory")
    ap.add_argument("--peak-tflops", type=float, help="override the table's dense bf16 peak (MFU's reference; "
                    "the step time comes from the table's measured rates)")
    ap.add_argument("--nvlink-gbs", type=float, help="override the intra-node bandwidth (GB/s per direction)")
    ap.add_argument("--network-gbs", type=float, help="override the inter-node bandwidth (GB/s per direction per GPU)")
    ap.add_argument("--pcie-gbs", type=float, help="override the host link (GB/s per direction per GPU), what "
                    "optimizer offload moves")
    ap.add_argument("--host-gbs", type=float, help="override the host memory bandwidth a GPU's offloaded AdamW has "
                    "(GB/s)")
    ap.add_argument("--workspace-gib", type=float, help="override what the device holds outside a step's tensors "
                    "(CUDA context, cuBLAS and NCCL workspaces, allocator slack; the table's: 3)")
    ap.add_argument("--top", type=int, default=5, help="layouts to print")
    ap.add_argument("--json", metavar="FILE", help="write every evaluated layout, one JSON object per line")
    ap.add_argument("--emit", action="store_true", help="print the best layout's fields as overrides to add to the "
                    "run's recipe command (the layout only: the run's own model and data fields stay the user's)")
    ap.add_argument("--explain", metavar="LAYOUT", help="break one layout down instead of ranking (e.g. "
                    "'tp=2,cp=4,recompute=full'; fields: tp cp cp_comm_type cp_a2a pp vpp ep fsdp distopt "
                    "recompute (none, selective, selective_mlp, full) chunk_tokens micro_batch)")
    ap.add_argument("overrides", nargs="*", help="model.<field>=<value>, optim.<field>=<value> or "
                    "trainer.<field>=<value>")
    return ap.parse_args(argv)


OVERRIDDEN = ("model", "optim", "trainer")
"""The run's sections a command line may set fields of (the planner chooses the layout; the flags give the data)."""
CHOSEN = {k for k in Layout(offload=0.5).overrides() if k.startswith(("model.", "optim."))} - {"optim.adam_impl"}
"""The model and optimizer fields the planner sets with each layout: recompute, chunking, the distributed
optimizer, offload (an offloading layout also sets bf16 and the AdamW megatron's offload steps, which a run may
set itself)."""


def recorded_run(path: str):
    """The run recorded at ``path``: a run directory's ``run_config.json`` (written when the run starts), a
    ``run_config.json`` itself, or a checkpoint (the run it records)."""
    from dit_mcore.training.config import RunConfig
    from dit_mcore.training.weights import find_checkpoint, read_run
    where = Path(path)
    recorded = where if where.is_file() else where / "run_config.json"
    if recorded.is_file():
        try:
            values = json.loads(recorded.read_text())
            if not isinstance(values, dict) or not isinstance(values.get("model"), dict):
                raise ValueError("no model section")
            return RunConfig.from_dict(values)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--run {path}: {recorded} is not a run's configuration ({e}); give a run directory, "
                              "its run_config.json or a checkpoint") from None
    return read_run(find_checkpoint(where, flag="--run"), flag="--run")


def _new_run(args):
    """A run of ``--family`` / ``--preset`` with the default optimizer, bf16 (the rates are bf16 runs'), on mock
    data."""
    from dit_mcore.models.registry import get_family
    from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                           RunConfig, TrainerConfig)
    family, preset = args.family or "dit", args.preset or "DiT-XL/2"
    if family not in ("dit", "dit_xattn", "llama", "stdit") or preset not in get_family(family).presets():
        raise ConfigError(f"--family {family} --preset {preset}: unknown; see --help of "
                          "recipes/pretrain_xl.py for the families and their presets")
    if args.global_batch is None:
        raise ConfigError("--global-batch is needed (samples, or packs, per optimizer step), or --run a recorded run")
    return RunConfig(model=ModelConfig(family=family, preset=preset),
                     data=DataConfig(name="mock", micro_batch_size=1), optim=OptimConfig(),
                     diffusion=DiffusionConfig(objective="flow"), trainer=TrainerConfig(bf16=True),
                     log=LogConfig(dir=str(Path(tempfile.gettempdir()) / "dit_plan"), tensorboard=False,
                                   progress_bar=False),  # (never written: nothing trains)
                     parallel=ParallelConfig())


def _set_fields(cfg, items: list[str]) -> None:
    for item in items:
        key, sep, raw = item.partition("=")
        section, _, name = key.partition(".")
        if not sep or section not in OVERRIDDEN or not hasattr(getattr(cfg, section), name):
            raise ConfigError(f"{item}: give model.<field>=<value> with a field of ModelConfig (or optim.<field>, "
                              "trainer.<field>); the layout is the planner's, the data the flags'")
        if key == "model.input_size":
            raise ConfigError(f"{item}: the samples' size comes from --seq / --frames / --frame-width (or --mix); "
                              "drop it (the families compute their positions from the grid: no length limit)")
        if key in CHOSEN:
            raise ConfigError(f"{item}: the planner chooses {key} with the layout; drop it (--explain prices one "
                              "layout of your choosing)")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        setattr(getattr(cfg, section), name, value)


def _grid_of(args) -> tuple[int, int, int]:
    """The one token grid of ``--seq`` / ``--frames`` / ``--frame-width``."""
    if args.seq < 1 or args.frames < 1 or args.seq % args.frames:
        raise ConfigError(f"--seq {args.seq} must be a positive multiple of --frames {args.frames}")
    per_frame = args.seq // args.frames
    width = args.frame_width or math.isqrt(per_frame)
    if width < 1 or per_frame % width or (not args.frame_width and width * width != per_frame):
        raise ConfigError(f"--seq {args.seq} / --frames {args.frames} = {per_frame} tokens per frame "
                          + (f"do not split into rows of --frame-width {args.frame_width}" if args.frame_width else
                             "is not a square grid; give a square number of tokens per frame or --frame-width"))
    return args.frames, per_frame // width, width


def _mix_of(text: str) -> tuple[list, list]:
    """``--mix``'s token grids and their sample weights (``TxHxW[:weight]``, 1 by default)."""
    grids, weights = [], []
    for item in filter(None, (part.strip() for part in text.split(","))):
        shape, _, weight = item.partition(":")
        try:
            t, h, w = (int(x) for x in shape.lower().split("x"))
            share = float(weight or 1)
        except ValueError:
            t = share = 0
        if t < 1 or h < 1 or w < 1 or not share > 0:
            raise ConfigError(f"--mix {text!r}: {item!r} is not a token grid TxHxW (frames x rows x columns) with an "
                              "optional positive :weight (samples drawn), e.g. 1x32x32:3,16x32x32:1")
        grids.append((t, h, w))
        weights.append(share)
    return grids, weights


def run_config(args):
    """The run to plan and its :class:`~dit_mcore.plan.samples.Samples`: a recorded run (``--run``) with its own
    model, optimizer, trainer and data (its layout, offload included, left to the planner), or a ``--family`` /
    ``--preset`` run with the default optimizer, bf16, on mock data; ``--seq`` (``--frames``, ``--frame-width``),
    ``--mix`` and ``--pack`` give its samples (a recorded run's own where none is given; packed to its packs'
    length where it packs); overrides set its fields. Also the text tokens per sample a text model reads."""
    if args.run and (args.family or args.preset):
        raise ConfigError(f"--run {args.run} fixes its model: drop --family / --preset (model.<field>=<value> "
                          "changes a field)")
    if args.pack is not None and args.pack < 1:
        raise ConfigError(f"--pack {args.pack}: tokens per packed sequence must be >= 1")
    if args.mix and (args.seq is not None or args.frames != 1 or args.frame_width):
        raise ConfigError("--mix gives the samples' grids: drop --seq / --frames / --frame-width")
    cfg = recorded_run(args.run) if args.run else _new_run(args)
    if args.run:  # (the layout the run took, offload included, is the planner's to choose anew)
        cfg = Layout().apply(cfg)
        cfg.optim.cpu_offload = False
    _set_fields(cfg, args.overrides)
    text_len = args.text_len if args.text_len is not None else text_tokens(cfg)
    if args.global_batch is not None:
        cfg.data.global_batch_size = args.global_batch
    recorded_packs = cfg.data.max_seq_len if args.run and cfg.data.packs else None
    if args.mix and not (args.pack or recorded_packs):
        raise ConfigError(f"--mix {args.mix!r} packs its samples: give --pack TOKENS (tokens per packed sequence)")
    if args.mix or args.seq is not None:
        grids, weights = _mix_of(args.mix) if args.mix else ([_grid_of(args)], None)
        samples = Samples(grids, args.pack or recorded_packs, weights)
    elif args.run:  # (the run's own samples; --pack packs them)
        if args.pack and cfg.data.uses_energon:
            cfg.data.max_seq_len, cfg.data.packing = args.pack, True
        samples = run_samples(cfg, fix="give the samples' shape with --seq (--frames), or --mix with --pack")
        if args.pack:
            samples = Samples(samples.grids, args.pack, samples.weights)
    else:
        raise ConfigError("--seq is needed (tokens per sample), or --mix with --pack, or --run a recorded run")
    if args.mix or args.seq is not None or (args.pack and not cfg.data.uses_energon):
        _mock_data(cfg, samples.grids, samples.pack_len)
    return cfg, samples, text_len


def _mock_data(cfg, grids: list, pack_len) -> None:
    """``cfg``'s data made mock samples of ``grids`` (tokens), packed ``pack_len`` to a sequence or dense; the
    model's preview size from the largest frame (the families compute positions from the grid: no length limit)."""
    built = cfg.model.build(ParallelConfig())
    pt, p = built.patch_size_t or 1, built.patch_size
    cfg.model.input_size = max(max(h, w) for _, h, w in grids) * p
    cfg.data.path = cfg.data.blend = cfg.data.val_path = None
    cfg.data.name, cfg.data.image_size = "mock", cfg.model.input_size
    cfg.data.mock_latent_shapes = [[t * pt, h * p, w * p] for t, h, w in grids] if pack_len else None
    if pack_len:
        cfg.data.max_seq_len = pack_len


def _row(e, world: int) -> str:
    m, s = e.memory, e.step
    return (f"{e.layout.describe(world):<44} {'yes' if e.fits else 'NO ':>4} {m.total / GiB:7.1f} "
            f"{e.headroom_gib:7.1f} "
            f"{s.total:8.3f} {s.compute:7.3f} {s.exposed_comm:7.3f} {s.bubble:7.3f} {e.tflops_per_gpu:7.1f} "
            f"{e.mfu:6.1%} {e.tokens_per_s_per_gpu:9.0f}")


def _parts(e) -> str:
    """A printed layout's memory per GPU by part (GiB), under its row."""
    return "    GiB: " + ", ".join(f"{name} {gib:.3g}" for name, gib in e.memory.parts_gib().items() if name != "total")


HEADER = (f"{'layout':<44} {'fits':>4} {'GiB':>7} {'free':>7} {'step s':>8} {'compute':>7} {'comm':>7} {'bubble':>7} "
          f"{'TFLOPS':>7} {'MFU':>6} {'tok/s/GPU':>9}")


OPERATORS = 12
"""The operators ``--explain`` lists by name (the longest; the rest summed)."""


def _operators(planner: Planner, e, world: int) -> list[str]:
    """One layer's forward and backward on one micro-batch, operator by operator, then its collectives."""
    # (traced for one sample: its calls are the micro-batch's, its work scales with the samples)
    mb = e.layout.micro_batch
    layer = planner.profile(dataclasses.replace(e.layout, micro_batch=1)).per_layer
    rows = [(name, calls, flops * mb, moved * mb, took * mb)
            for name, calls, flops, moved, took in operator_times(layer, planner.gpu) if took > 0]
    total = sum(row[4] for row in rows) or 1.0
    lines = ["", "one layer, one micro-batch (forward, backward and recompute), operator by operator:",
             f"  {'operator':<52} {'calls':>5} {'GFLOP':>10} {'MB moved':>10} {'ms':>8} {'share':>6}"]
    for name, calls, flops, moved, took in rows[:OPERATORS]:
        lines.append(f"  {name:<52} {calls:>5} {flops / 1e9:10.2f} {moved / 1e6:10.1f} {took * 1e3:8.3f} "
                     f"{took / total:6.1%}")
    rest = rows[OPERATORS:]
    if rest:
        lines.append(f"  {f'{len(rest)} other operators':<52} {sum(r[1] for r in rest):>5} "
                     f"{sum(r[2] for r in rest) / 1e9:10.2f} {sum(r[3] for r in rest) / 1e6:10.1f} "
                     f"{sum(r[4] for r in rest) * 1e3:8.3f} {sum(r[4] for r in rest) / total:6.1%}")
    p = e.layout.apply(planner.cfg).parallel
    for kind, name, group, nbytes in (layer * mb).comm:
        wire = on_wire(kind, group, span(name, group, p, world), nbytes, planner.gpu, planner.gpus_per_node, world)
        lines.append(f"  {f'{kind} over {name} ({group} ranks)':<52} {'':>5} {'':>10} {nbytes / 1e6:10.1f} "
                     f"{wire * 1e3:8.3f}   (on the wire)")
    return lines


def explain(planner: Planner, e, world: int) -> str:
    m, s = e.memory, e.step
    lines = [HEADER, _row(e, world), "", "memory per GPU (GiB): " + ", ".join(f"{k} {v}" for k, v in m.parts_gib().items()),
             f"  the peak on {f'pipeline stage {m.stage}' if e.layout.pp > 1 else 'every rank'}: {m.stage_layers} "
             f"layers, {m.microbatches_in_flight} micro-batch(es) in flight; "
             f"the device holds {planner.gpu.memory_gib:.1f} GiB: "
             + (f"{planner.gpu.memory_gib - m.total / GiB:.1f} GiB left" if e.fits else
                f"short by {m.total / GiB - planner.gpu.memory_gib:.1f} GiB"),
             f"step (s): compute {s.compute:.4f}, exposed communication {s.exposed_comm:.4f}, bubble {s.bubble:.4f}, "
             f"optimizer and EMA {s.optimizer:.4f}",
             f"  compute: matrix products {s.gemm:.4f}, attention {s.attention:.4f}, other operators {s.memory_bound:.4f}",
             f"  rates from {planner.gpu.rates.source}"]
    return "\n".join(lines + _operators(planner, e, world))


def planner_of(args) -> Planner:
    """The planner of the parsed command line ``args`` (:func:`parse_args`)."""
    device = gpu_entry(args.gpu, memory_gib=args.gpu_memory_gib, bf16_tflops=args.peak_tflops,
                       nvlink_gbs=args.nvlink_gbs, network_gbs=args.network_gbs, workspace_gib=args.workspace_gib,
                       pcie_gbs=args.pcie_gbs, host_gbs=args.host_gbs)
    cfg, samples, text_len = run_config(args)
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ConfigError("--gpus and --gpus-per-node must be >= 1")
    return Planner(cfg, args.gpus, device, args.gpus_per_node, batch_maker(cfg, samples, text_len))


def explained(planner: Planner, text: str):
    """``--explain``'s layout evaluated (refused in one line if the layout check refuses it)."""
    layout = Layout.parse(text)
    problem = accepted(planner.cfg, layout, planner.world)
    if problem:
        raise ConfigError(f"--explain {text!r}: the layout check refuses it: {problem}")
    return planner.evaluate(layout)


def main(argv=None) -> int:
    args = parse_args(argv)
    with warnings.catch_warnings():  # (torch's and megatron's warnings about the fake runs the planner traces)
        warnings.simplefilter("ignore")
        return _main(args)


def _main(args) -> int:
    try:
        planner = planner_of(args)
        device = planner.gpu
        if args.explain:
            print(explain(planner, explained(planner, args.explain), args.gpus))
            return 0
        done, refused = planner.plan()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            for e in done:
                f.write(json.dumps(e.record(args.gpus)) + "\n")
    if not done:  # (the plainest layout's refusal: data parallel over every GPU)
        why = accepted(planner.cfg, Layout(), args.gpus) or (
            f"--global-batch {planner.cfg.data.global_batch_size} must divide over the data-parallel ranks")
        print(f"error: no layout of {args.gpus} GPUs passes the layout check ({refused} refused); data parallel over "
              f"all of them: {why}", file=sys.stderr)
        return 1
    fitting = [e for e in done if e.fits]
    print(f"{len(done)} layouts evaluated ({refused} refused by the layout check), {len(fitting)} fit "
          f"{device.name} ({device.memory_gib:.1f} GiB); rates: {device.rates.source}")
    print(HEADER)
    for e in (fitting or done)[:args.top]:
        print(_row(e, args.gpus))
        print(_parts(e))
    if not fitting:
        smallest = min(done, key=lambda e: e.memory.total)
        bigger = planner.smallest_fitting()
        fix = (f"{bigger[0]} GPUs fit it ({bigger[1].layout.describe(bigger[0])}, {size(bigger[1].memory.total)} per GPU)"
               if bigger else "64 times more GPUs do not fit it either")
        print(f"error: no layout fits {args.gpus} x {device.name}; the smallest needs "
              f"{size(smallest.memory.total)} per GPU ({smallest.layout.describe(args.gpus)}); {fix}; or use a "
              "larger device or a shorter sequence", file=sys.stderr)
        return 1
    if args.emit:
        print(" ".join(f"{k}={v}" for k, v in fitting[0].layout.overrides().items()))
    return 0
