"""``python -m dit_mcore.convert``: a trained checkpoint out as a diffusers, facebookresearch/DiT or
safetensors model, or such weights in as a dit_mcore checkpoint.

    python -m dit_mcore.convert runs/digits exported/digits --to diffusers
    python -m dit_mcore.convert DiT-XL-2-256/transformer imported/xl --to checkpoint
"""
import argparse
import logging
import sys
from typing import Optional

from dit_mcore.convert import FORMATS, export_checkpoint, import_weights
from dit_mcore.errors import ConfigError


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dit_mcore.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="SOURCE", help="a run directory (log.dir), its checkpoints/ or one step_* folder; with "
                   "--to checkpoint: a diffusers DiTTransformer2DModel folder, a facebookresearch/DiT .pt state dict "
                   "or a .safetensors file this command wrote")
    p.add_argument("out", help="a new folder")
    p.add_argument("--step", type=int, default=None, help="that step's checkpoint (default: the newest intact one)")
    p.add_argument("--weights", default="ema", choices=("ema", "model"),
                   help="the EMA average (as the previews) or the trained weights")
    p.add_argument("--to", default="diffusers", choices=(*FORMATS, "checkpoint"),
                   help="diffusers: a DiTTransformer2DModel folder; facebookresearch: OUT/dit.pt; safetensors: "
                        "OUT/model.safetensors, our own tensor names, any family; checkpoint: the other way, "
                        "those weights in as a dit_mcore checkpoint (generate with any layout, or start a run "
                        "from it: trainer.init_from)")
    p.add_argument("--preset", default=None,
                   help="with --to checkpoint from a facebookresearch state dict: its DiT preset (default DiT-XL/2)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    from megatron.core import parallel_state

    from dit_mcore.models.dit.interop import InteropError
    from dit_mcore.parallel.initialize import destroy_distributed
    ours = not parallel_state.model_parallel_is_initialized()  # (a caller's world is left as it was)
    try:
        if args.to == "checkpoint":
            if args.step is not None or args.weights != "ema":
                raise ConfigError("--step/--weights pick weights out of a checkpoint; with --to checkpoint the "
                                  "source is another library's weights: drop them")
            written = import_weights(args.checkpoint, args.out, preset=args.preset, flag="SOURCE")
        else:
            if args.preset is not None:
                raise ConfigError("--preset describes a facebookresearch state dict brought in with --to checkpoint; "
                                  "a checkpoint records its model: drop --preset")
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
