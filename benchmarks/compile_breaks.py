"""Where a DiT layer's compiled graph breaks on this device (bf16 on a GPU, fp32 on CPU).

    python benchmarks/compile_breaks.py            # DiT-S/2 layer, 256 tokens x 4 samples
    python benchmarks/compile_breaks.py --preset DiT-XL/2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def layer_graph_breaks(preset_name: str = "DiT-S/2", tokens: int = 256, samples: int = 4, **overrides):
    """``torch._dynamo.explain`` of one layer of ``preset_name`` (with ``overrides`` of its config, e.g.
    selective recompute) as ``model.compile`` compiles it, training (needs a megatron world:
    ``initialize_distributed``)."""
    import torch._dynamo

    from dit_mcore.models.dit.config import preset
    from dit_mcore.models import build_model
    from dit_mcore.models.layer_stack import quiet_default_tp_group
    from dit_mcore.models.modulation import Conditioning

    quiet_default_tp_group()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # fused GPU attention needs half
    cfg = preset(preset_name, **overrides)
    layer = build_model(cfg).layers[0].to(device, dtype)  # outside a trainer some parts are built on the host
    hidden = torch.randn(tokens, samples, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    return torch._dynamo.explain(layer)(hidden, Conditioning(torch.randn(samples, cfg.hidden_size, device=device,
                                                                         dtype=dtype)))


def main(argv=None) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.initialize import initialize_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="DiT-S/2")
    args = p.parse_args(argv)
    initialize_distributed(ParallelConfig(), 0)
    e = layer_graph_breaks(args.preset)
    print("graphs", e.graph_count, "breaks", e.graph_break_count)
    for b in e.break_reasons:
        fr = b.user_stack[-1] if b.user_stack else None
        where = f"{fr.filename.split('site-packages/')[-1]} {fr.lineno}" if fr else ""
        print(" -", str(b.reason)[:300].replace("\n", " "), "@", where)


if __name__ == "__main__":
    main()
