"""``python -m dit_mcore.convert``: a trained checkpoint out as a diffusers, facebookresearch/DiT or
safetensors model.

    python -m dit_mcore.convert runs/digits exported/digits --to diffusers
"""
import argparse
import logging
import sys
from typing import Optional

from dit_mcore.convert import FORMATS, export_checkpoint
from dit_mcore.errors import ConfigError


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dit_mcore.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run directory (log.dir), its checkpoints/ or one step_* folder")
    p.add_argument("out", help="a new folder")
    p.add_argument("--step", type=int, default=None, help="that step's checkpoint (default: the newest intact one)")
    p.add_argument("--weights", default="ema", choices=("ema", "model"),
                   help="the EMA average (as the previews) or the trained weights")
    p.add_argument("--to", default="diffusers", choices=FORMATS,
                   help="diffusers: a DiTTransformer2DModel folder; facebookresearch: OUT/dit.pt; safetensors: "
                        "OUT/model.safetensors, our own tensor names, any family")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    from megatron.core import parallel_state

    from dit_mcore.models.dit.interop import InteropError
    from dit_mcore.parallel.initialize import destroy_distributed
    ours = not parallel_state.model_parallel_is_initialized()  # (a caller's world is left as it was)
    try:
        written = export_checkpoint(args.checkpoint, args.out, to=args.to, step=args.step, weights=args.weights)
    except (ConfigError, InteropError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # diffusers / safetensors are optional extras
        print(f"convert: error: --to {args.to} needs the {e.name} package: pip install 'dit-mcore[encoders]'",
              file=sys.stderr)
        return 2
    finally:
        if ours:
            destroy_distributed()
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
