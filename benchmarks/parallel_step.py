"""Training-step time and communication per parallel layout, beside the analytic volumes.

Each layout trains the same small DiT on the same mock packed batches (CPU/gloo here; NCCL on a GPU
node) for a few warm-up steps, then a few timed steps with ``kernels.comm_counter`` counting every
``torch.distributed`` call megatron and our kernels make (DP gradient reduction, TP/SP activations,
CP attention, PP point-to-point, MoE all-to-all, the output gather, loss reductions). Bytes are
the most any rank sends per step; the analytic column models the bulk traffic:

- DP (and DP x CP) gradients: ``2 (D-1)/D x grad bytes`` (all-reduce, or reduce-scatter + all-gather
  with the distributed optimizer); FSDP over S ranks: ``3 (S-1)/S x param bytes`` per micro-batch
  (gather for forward, again for backward, reduce-scatter), plus under HSDP the all-reduce of each
  shard's gradients across the R replica groups, ``2 (R-1)/R x grad bytes / S`` per step;
- TP without SP: ``8 (T-1)/T x activation bytes`` per layer (2 all-reduces of ``[tokens/CP, hidden]``
  forward, 2 backward); with SP ``10 (T-1)/T x``: 4 all-gathers/reduce-scatters forward, 6 backward
  (megatron gathers each column-parallel input again for its weight gradient), plus the TP
  all-reduce of the gradients of replicated parameters (adaLN, embedders) that see only a rank's tokens;
- CP attention: ``benchmarks.attention_comm.analytic`` per layer (K/V ring, Ulysses a2a, …);
- PP: one activation (and its gradient) per micro-batch across each stage boundary, plus the
  all-reduce of the conditioning embedders' gradients over the stages;
- the model's output gather over the token shards; EP's token all-to-all is measured only (the
  ratio of an EP layout shows its share).

Wall times on a shared 2-core CPU only rank layouts against each other roughly; bytes are exact.

    python benchmarks/parallel_step.py            # writes benchmarks/results/parallel_step_<device>.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


from results_io import device_name, result_path  # noqa: E402  (benchmarks/ is the script folder)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

HIDDEN, HEADS, LAYERS, SEQ, MICRO = 128, 4, 4, 256, 4
LAYOUTS = {
    2: {"dp2": {}, "tp2": {"tensor_model_parallel_size": 2},
        "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        "cp2_p2p": {"context_parallel_size": 2, "cp_comm_type": "p2p"},
        "cp2_a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
        "cp2_all_gather": {"context_parallel_size": 2, "cp_comm_type": "all_gather"},
        "pp2": {"pipeline_model_parallel_size": 2}, "ep2": {"expert_model_parallel_size": 2},
        "fsdp2": {"fsdp": "torch"}},
    4: {"dp4": {}, "tp2_sp_cp2_a2a": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                      "context_parallel_size": 2, "cp_comm_type": "a2a"},
        "cp4_a2a_p2p": {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                        "hierarchical_context_parallel_sizes": [2, 2]},
        "pp2_dp2": {"pipeline_model_parallel_size": 2},
        "hsdp_2x2": {"fsdp": "torch", "fsdp_shard_size": 2}},
}


def run_config(run_dir: str, moe: bool, parallel: dict):
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                           RunConfig, TrainerConfig)
    return RunConfig(
        model=ModelConfig(preset="tiny", num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          input_size=16, in_channels=4, num_classes=10, backend="local",
                          num_moe_experts=4 if moe else None),
        data=DataConfig(name="mock", image_size=16, mock_latent_shapes=[[1, 16, 16], [2, 16, 16], [1, 8, 8]],
                        max_seq_len=SEQ, global_batch_size=MICRO, micro_batch_size=1),
        optim=OptimConfig(lr=1e-4), diffusion=DiffusionConfig(objective="flow"),
        trainer=TrainerConfig(max_steps=100, save_interval=10_000),
        log=LogConfig(dir=run_dir, sample_interval=0, progress_bar=False, tensorboard=False),
        parallel=ParallelConfig(**parallel))


def analytic_bytes(trainer) -> dict:
    """Bulk bytes one rank sends per step, by source (see the module doc)."""
    from megatron.core import parallel_state as ps

    from attention_comm import CommBenchConfig, analytic
    p, mc = trainer.cfg.parallel, trainer.model_config
    micro = trainer.num_microbatches
    cp, tp, pp = p.context_parallel_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = ps.get_data_parallel_world_size()
    act = SEQ // cp * mc.hidden_size * 4  # one [tokens/CP, hidden] fp32 activation
    layers = sum(len(chunk.layers) for chunk in trainer.model)
    experts = [q for q in trainer.model.parameters() if not getattr(q, "allreduce", True)]
    grads = (sum(q.numel() for q in trainer.model.parameters()) - sum(q.numel() for q in experts)) * 4
    edp = ps.get_expert_data_parallel_world_size() if experts else 1
    if p.fsdp == "torch":  # per micro-batch: gather for forward and again for backward, reduce-scatter
        shard = p.fsdp_shard_size or dp * cp
        replicas = dp * cp // shard
        dp_traffic = 3 * (shard - 1) / shard * grads * micro + 2 * (replicas - 1) / replicas * grads / shard
    else:
        dp_traffic = 2 * (dp * cp - 1) / (dp * cp) * grads
    out = {"dp_grads": dp_traffic,
           "expert_dp_grads": 2 * (edp - 1) / edp * 4 * sum(q.numel() for q in experts),
           "tp": (10 if p.sequence_parallel else 8) * (tp - 1) / tp * act * layers * micro,
           "sp_replicated_grads": 2 * (tp - 1) / tp * 4 * sum(
               q.numel() for q in trainer.model.parameters() if getattr(q, "sequence_parallel", False))
           * p.sequence_parallel,
           "pp": act * micro * (pp > 1),
           "pp_conditioning_grads": 2 * (pp - 1) / pp * 4 * sum(
               q.numel() for chunk in trainer.model for q in chunk.conditioning_parameters()),
           "output_gather": (p.token_shards() - 1) * SEQ // p.token_shards() * mc.out_patch_dim * 4 * micro}
    if cp > 1:
        cfg = CommBenchConfig(seq=SEQ, heads=mc.num_attention_heads // tp, head_dim=mc.kv_channels, degree=cp,
                              a2a_size=(p.hierarchical_context_parallel_sizes or [None])[0])
        out["cp_attention"] = analytic(p.cp_comm_type, cfg)[1] * layers * micro
    out["total"] = sum(out.values())
    return out


def _route_megatron_collectives_through_torch_distributed() -> None:
    """megatron binds ``all_gather_into_tensor``/``reduce_scatter_tensor`` to module aliases at import
    (its SP and TP gathers call those), which the counter, wrapping ``torch.distributed``, cannot
    see; call them through the public namespace instead (same collectives, now counted)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings
    for module in (layers, mappings):
        module.dist_all_gather_func = lambda *a, **k: dist.all_gather_into_tensor(*a, **k)
        module.dist_reduce_scatter_func = lambda *a, **k: dist.reduce_scatter_tensor(*a, **k)


def measure(rank: int, world: int, run_dir: str, warmup: int, steps: int) -> dict:
    from dit_mcore.training.trainer import Trainer
    from dit_mcore.kernels.comm_counter import count_comm
    _route_megatron_collectives_through_torch_distributed()
    results = {}
    for name, parallel in LAYOUTS[world].items():
        trainer = Trainer(run_config(f"{run_dir}/{name}", name.startswith("ep"), dict(parallel)))
        for _ in range(warmup):
            trainer.train_step()
        times, sent, by_op = [], [], {}
        for _ in range(steps):
            with count_comm() as comm:
                start = time.perf_counter()
                trainer.train_step()
                times.append(time.perf_counter() - start)
            sent.append(comm.bytes_sent())
            by_op = comm.summary()
        results[name] = {"step_s": statistics.median(times), "bytes_sent": statistics.median(sent),
                         "bytes_by_op": by_op, "analytic": analytic_bytes(trainer)}
    return results


def main(argv=None) -> list[dict]:
    from dist_utils import run_distributed
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in LAYOUTS:
            per_rank = run_distributed(measure, world, f"{tmp}/w{world}", args.warmup, args.steps)
            for name in LAYOUTS[world]:
                ranks = [r[name] for r in per_rank]
                rows.append({"layout": name, "world": world, "step_s": max(r["step_s"] for r in ranks),
                             "bytes_sent_max_rank": max(r["bytes_sent"] for r in ranks),
                             "analytic_bulk_bytes_max_rank": max(r["analytic"]["total"] for r in ranks),
                             "analytic_by_source_rank0": ranks[0]["analytic"],
                             "measured_by_op_rank0": ranks[0]["bytes_by_op"]})
    print(f"{'layout':16s} {'world':>5s} {'step s':>8s} {'sent MB':>9s} {'analytic MB':>12s} {'ratio':>6s}")
    for r in rows:
        ratio = r["bytes_sent_max_rank"] / r["analytic_bulk_bytes_max_rank"] if r["analytic_bulk_bytes_max_rank"] else 0
        print(f"{r['layout']:16s} {r['world']:5d} {r['step_s']:8.3f} {r['bytes_sent_max_rank'] / 1e6:9.3f} "
              f"{r['analytic_bulk_bytes_max_rank'] / 1e6:12.3f} {ratio:6.2f}")
    device = device_name()
    out = result_path("parallel_step", args.out)
    out.write_text(json.dumps({"device": device, "command": "python benchmarks/parallel_step.py "
                               + " ".join(argv if argv is not None else sys.argv[1:]),
                               "model": {"hidden": HIDDEN, "heads": HEADS, "layers": LAYERS, "tokens_per_micro": SEQ,
                                         "micro_batches": MICRO}, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
