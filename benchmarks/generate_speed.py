"""Parallel sampling, measured side by side: seconds per item, items/s and the bytes each rank sends
per sampler step, for every generation method against one process, in one run.

Each case spawns its ranks on gloo (CPU) with ONE thread per rank, and the baseline is one process
with one thread, so ``efficiency = t(1 process) / (ranks x t(ranks))`` is a real strong-scaling
ratio (on a machine with at least as many cores as ranks). Every case samples the same items the
same way (Euler, classifier-free guidance on a batched or split pair) through the generation code
(``dit_mcore.generate``: ``sample_items``, ``PipelinedForward``, ``PipeFusion``) on a random model,
timed after one untimed call, with ``kernels.count_comm`` counting what each rank sends.

    python benchmarks/generate_speed.py                    # DiT-B/2 on 32x32x4 latents, 8 steps, 2 ranks
    python benchmarks/generate_speed.py --preset DiT-S/2 --steps 4 --methods "1 process,cfg2,pf2 (M=2)"

Analytic bytes per step and rank (N = tokens per item x the batch one rank's model call holds, C =
hidden size, L = layers, P = ranks, b = 4 bytes fp32, D = the model's output values per token, learned-sigma channels included):

=============  ===========================================================================
method         bytes sent per sampler step by the busiest rank
=============  ===========================================================================
items          0 (each rank its own items)
cfg2           all-gather of the guided prediction: items x C_in x H x W x b
cp2 a2a        Ulysses: L (2C + 2C) N b (P-1)/P^2, plus the output's all-gather (P-1) N D b / P
cp2 p2p        ring: L 2 N C b (P-1)/P, plus the prediction all-gather
pf2            PipeFusion: stage 0 sends every patch's activations once, N C b (independent of L);
               the last stage sends each patch's prediction to the other stages, N D/2 b
=============  ===========================================================================

Writes ``benchmarks/results/generate_speed_<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.results_io import device_name, write_result  # noqa: E402

METHODS = {
    "1 process": {},
    "items2": {},
    "cfg2": {"cfg_parallel": 2},
    "cp2 a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
    "cp2 p2p": {"context_parallel_size": 2, "cp_comm_type": "p2p"},
    "pf2 (M=2)": {"pipefusion": 2},
    "pf2 (M=4)": {"pipefusion": 2, "pipefusion_patches": 4},
}


@dataclass(frozen=True)
class Case:
    preset: str
    size: int
    items: int
    steps: int
    cfg_scale: float
    layout: dict = field(default_factory=dict)


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, case: Case, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _measure(case)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        from dit_mcore.parallel.initialize import release_model_parallel_groups
        release_model_parallel_groups()
        dist.destroy_process_group()


def _measure(case: Case) -> dict:
    from dit_mcore.diffusion import build_objective
    from dit_mcore.generate.checkpoint import build_model
    from dit_mcore.generate.items import make_items, share
    from dit_mcore.generate.layout import GenerateParallel, sampling_groups
    from dit_mcore.generate.pipefusion import PipeFusion
    from dit_mcore.generate.sampling import sample_items
    from dit_mcore.models.registry import get_family
    from dit_mcore.parallel.initialize import initialize_distributed
    from dit_mcore.parallel.pipeline import PipelinedForward
    from dit_mcore.training.config import ModelConfig
    from dit_mcore.kernels.comm_counter import count_comm

    parallel = GenerateParallel(**case.layout).staged()
    initialize_distributed(parallel, seed=0)
    model = ModelConfig(family="dit", preset=case.preset, input_size=case.size, in_channels=4, num_classes=10,
                        class_dropout_prob=0.1, backend="local")
    chunks, config = build_model(model, parallel, dtype=torch.float32, device="cpu")
    groups = sampling_groups(parallel)
    items = share(make_items(labels=[i % 10 for i in range(case.items)]), groups.items_rank, groups.items_size)
    pipefusion = None
    if parallel.patches() > 1:
        pipefusion = PipeFusion(chunks, config, patches=parallel.patches(), warmup=parallel.pipefusion_warmup_steps)

    def run(steps: int):
        return sample_items(get_family("dit").image_model_fn(PipelinedForward(chunks), config), config,
                            build_objective("flow"), items, shape=(4, case.size, case.size), seed=0, steps=steps,
                            cfg_scale=case.cfg_scale, device="cpu", cfg_group=groups.cfg_group, pipefusion=pipefusion)

    run(1)  # untimed: allocator and kernel warm-up
    dist.barrier()
    with count_comm() as comm:
        began = time.perf_counter()
        run(case.steps)
        dist.barrier()
        seconds = time.perf_counter() - began
    sent = sum(e.bytes_sent for e in comm.events if e.op != "barrier")
    return {"seconds": seconds, "bytes_per_step": sent / case.steps,
            "layers": config.num_layers, "hidden": config.hidden_size, "out_patch_dim": config.out_patch_dim,
            "tokens": (case.size // config.patch_size) ** 2}


def run_case(case: Case, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, _port(), case, out_dir), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


def analytic_bytes(method: str, r: dict, case: Case) -> float:
    """What the method must send per sampler step from its busiest rank (the table above)."""
    b, L, C, D, tokens = 4, r["layers"], r["hidden"], r["out_patch_dim"], r["tokens"]
    guided = 2 if case.cfg_scale != 1 else 1
    rows = case.items * guided  # rows in one model call (one process: the whole batch, both halves)
    if method == "items2":
        return 0
    if method == "cfg2":
        return case.items * 4 * case.size * case.size * b
    if method.startswith("cp2"):
        n, P = tokens * rows, 2
        gather = (P - 1) * n * D * b / P  # the output's all-gather (all out_patch_dim values, learned sigma too)
        if "a2a" in method:
            return L * 4 * C * n * b * (P - 1) / P ** 2 + gather
        return L * 2 * n * C * b * (P - 1) / P + gather
    if method.startswith("pf2"):
        return tokens * rows * C * b
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="DiT-B/2")
    ap.add_argument("--size", type=int, default=32, help="latent side (32: 256 px images, 256 tokens at patch 2)")
    ap.add_argument("--items", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, base = [], None
    for method in args.methods.split(","):
        case = Case(args.preset, args.size, args.items, args.steps, args.cfg_scale, METHODS[method])
        world = 1 if method == "1 process" else 2
        ranks = run_case(case, world)
        seconds = max(r["seconds"] for r in ranks)
        sent = max(r["bytes_per_step"] for r in ranks)
        if method == "1 process":
            base = seconds
        row = {"method": method, "ranks": world, "seconds": round(seconds, 3),
               "s_per_item": round(seconds / args.items, 3), "items_per_s": round(args.items / seconds, 3),
               "efficiency": round(base / (world * seconds), 3) if base else None,
               "bytes_per_step": int(sent), "analytic_bytes_per_step": int(analytic_bytes(method, ranks[0], case))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    ulysses = next((r for r in rows if r["method"] == "cp2 a2a"), None)
    for r in rows:
        if r["method"].startswith("pf2") and ulysses:
            r["bytes_vs_ulysses"] = round(r["bytes_per_step"] / ulysses["bytes_per_step"], 4)
    result = {"device": device_name(), "threads_per_rank": 1, "torch": torch.__version__,
              "command": "python benchmarks/generate_speed.py " + " ".join(sys.argv[1:]),
              "model": f"{args.preset}, {args.size}x{args.size}x4 latents", "items": args.items,
              "steps": args.steps, "cfg_scale": args.cfg_scale, "rows": rows}
    print("wrote", write_result("generate_speed", result, args.out))


if __name__ == "__main__":
    main()
