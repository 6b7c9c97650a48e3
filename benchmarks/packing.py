"""Packing efficiency and loader throughput on a mixed image/video latent dataset.

    python benchmarks/packing.py [--data DIR] --max-seq-len 1024 4096 [--buffer 32 256] [--batches 50]

For every (max_seq_len, packing_buffer_size) pair prints one JSON line with ``efficiency`` (real
tokens / rows incl. padding), ``samples_per_s``, ``tokens_per_s`` (real tokens) and ``skipped``,
and writes all lines to ``--out`` (default ``benchmarks/results/packing_cpu.json``). Without
``--data`` a synthetic mixed dataset (60% images, 40% videos) is generated in a temp dir.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic_dataset(out: Path, num: int, seed: int = 0) -> Path:
    """Latents [16, T, H, W]: images 8..32 px, videos of 2..8 frames at 8..24 px (16..1152 tokens at 1x2x2)."""
    import json as _json

    import torch
    import webdataset as wds
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

    rng = random.Random(seed)
    shards, per_shard = [], 100
    for start in range(0, num, per_shard):
        name = f"shard-{start // per_shard:04d}.tar"
        shards.append(name)
        with wds.TarWriter(str(out / name)) as tw:
            for i in range(start, min(start + per_shard, num)):
                if rng.random() < 0.6:
                    t, h, w = 1, rng.choice(range(8, 33, 4)), rng.choice(range(8, 33, 4))
                else:
                    t, h, w = rng.choice(range(2, 9, 2)), rng.choice(range(8, 25, 4)), rng.choice(range(8, 25, 4))
                tw.write({"__key__": f"b{i:06d}",
                          "latent.pth": torch.randn(16, t, h, w).to(torch.bfloat16),
                          "text.pth": torch.randn(rng.randint(4, 32), 64).to(torch.bfloat16),
                          "json": _json.dumps({"kind": "video" if t > 1 else "image", "frames": t, "height": h,
                                               "width": w, "fps": 8.0, "caption": "", "source": "synthetic"}).encode()})
    BaseWebdatasetFactory.prepare_dataset(out, shards, split_parts_ratio=[("train", 1.0)], workers=1)
    (out / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type: {__module__: energon_data.samples, __class__: LatentSample}\n"
        "field_map: {latent: latent.pth, text_emb: text.pth, meta: json}\n")
    return out


def run_config(data: str, max_seq_len: int, buffer: int, args) -> dict:
    from energon_data.loader import DataConfig, build_train_loader

    cfg = DataConfig(path=data, max_seq_len=max_seq_len, pad_multiple=args.pad_multiple, packing_buffer_size=buffer,
                     micro_batch_size=args.micro_batch_size, num_workers=args.num_workers,
                     patch_size=tuple(args.patch_size))
    it = iter(build_train_loader(cfg, dp_rank=0, dp_size=1, seed=0))
    skipped = sum(b.num_skipped for b in itertools.islice(it, args.warmup))
    samples = real = rows = 0
    start = time.perf_counter()
    for batch in itertools.islice(it, args.batches):
        samples += batch.num_samples
        real += int(batch.cu_seqlens[-1])
        rows += batch.tokens.shape[0]
        skipped += batch.num_skipped
    elapsed = time.perf_counter() - start
    return {"max_seq_len": max_seq_len, "packing_buffer_size": buffer, "pad_multiple": args.pad_multiple,
            "micro_batch_size": args.micro_batch_size, "num_workers": args.num_workers, "batches": args.batches,
            "efficiency": round(real / rows, 4), "samples_per_s": round(samples / elapsed, 1),
            "tokens_per_s": round(real / elapsed, 1), "skipped": skipped,
            "device": f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="prepared latent dataset (default: synthetic, generated)")
    p.add_argument("--max-seq-len", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--buffer", type=int, nargs="+", default=[32, 256])
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--pad-multiple", type=int, default=8)
    p.add_argument("--patch-size", type=int, nargs=3, default=[1, 2, 2])
    p.add_argument("--synthetic-samples", type=int, default=1500)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "packing_cpu.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(synthetic_dataset(Path(tmp), args.synthetic_samples))
        lines = []
        for max_seq_len, buffer in itertools.product(args.max_seq_len, args.buffer):
            result = run_config(data, max_seq_len, buffer, args)
            result["data"] = args.data or f"synthetic({args.synthetic_samples})"
            print(json.dumps(result), flush=True)
            lines.append(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
