"""``python -m dit_mcore.evaluate --checkpoint RUN --reference digits|IMAGE_DIR --num-samples N``: FID of a
class-conditional image checkpoint's samples against real images, written with its settings to JSON.

The samples are made by the generation command's code (:func:`dit_mcore.generate.job.generate`: the run's
sampler, steps and guidance unless given; every class alike, item ``i``'s noise from ``(seed, i)``), then read
back as the PNGs it wrote. The reference is the built-in ``digits`` (all 1,797 real scans), a folder of
images (searched recursively; resized to the samples' size), or their feature statistics in an ``.npz`` file
(``mu`` and ``sigma``, as pytorch-fid and torch-fidelity write them; ``--save-reference-stats FILE.npz`` writes
one from images, recording ``n`` and the extractor's name). Features: ``digits`` (default for the digits
reference) or ``inception`` (:mod:`dit_mcore.evaluate.features`).

Under ``torchrun`` the samples are generated in the layout given as ``parallel.FIELD=VALUE`` (the generation
command's: CFG-parallel, sequence, tensor, pipeline parallel, PipeFusion, items over ranks), written to
``<out>_samples/`` beside the JSON (a folder every rank sees), and rank 0 alone scores them and writes the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from dit_mcore.errors import ConfigError
from dit_mcore.evaluate.features import FEATURES, build_extractor
from dit_mcore.evaluate.fid import fid, min_samples, statistics
from dit_mcore.generate.grid import to_uint8

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dit_mcore.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/ or one step_* folder")
    p.add_argument("--reference", required=True,
                   help="'digits' (the built-in scans), a folder of real images, or their statistics (.npz: mu, sigma)")
    p.add_argument("--save-reference-stats", metavar="FILE.npz", help="also write the reference images' statistics")
    p.add_argument("--num-samples", type=int, default=1000, help="images to generate (rounded up to every class alike)")
    p.add_argument("--features", choices=FEATURES, default=None,
                   help="feature extractor (default: digits for --reference digits, else inception)")
    p.add_argument("--inception-weights", default=None, help="torch-fidelity's InceptionV3 weights file (offline)")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--weights", default="ema", choices=("ema", "model"))
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's)")
    p.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (default: the run's)")
    p.add_argument("--sampler", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default="fid.json", help="the JSON file written")
    p.add_argument("overrides", nargs="*", metavar="parallel.FIELD=VALUE",
                   help="under torchrun: the generation layout (python -m dit_mcore.generate's)")
    return p


def per_class(num_samples: int, classes: int) -> int:
    """Images per class for ``num_samples`` (every class alike, rounded up)."""
    return math.ceil(num_samples / classes)


def _reference_stats(path: str) -> dict:
    """``{"mu", "sigma"[, "n", "features"]}`` of a statistics file (one line naming what is missing)."""
    import numpy as np
    if not Path(path).is_file():
        raise ConfigError(f"--reference={path!r}: no such statistics file")
    try:
        with np.load(path) as data:
            stats = {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise ConfigError(f"--reference={path!r}: not a readable .npz ({e})") from None
    if "mu" not in stats or "sigma" not in stats:
        raise ConfigError(f"--reference={path!r}: holds {sorted(stats)}; FID statistics need 'mu' and 'sigma'")
    if "n" in stats:
        stats["n"] = int(stats["n"])
    return stats


def reference_images(reference: str, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[M, 3, H, W]`` real images at the samples' ``size``."""
    if reference == "digits":
        from energon_data.datasets import load_digits
        images, _ = load_digits(size=size[0])
        return to_uint8(images).expand(-1, 3, -1, -1).contiguous()
    folder = Path(reference)
    files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"--reference={reference!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return torch.stack([_read(f, size) for f in files])


def _read(path: Path, size: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """uint8 ``[3, H, W]``; with ``size``, centre-cropped to its aspect ratio, then resized to it."""
    from PIL import Image
    with Image.open(path) as im:
        im = im.convert("RGB")
        if size is not None and im.size != (size[1], size[0]):
            w, h = im.size
            cw, ch = min(w, round(h * size[1] / size[0])), min(h, round(w * size[0] / size[1]))
            im = im.crop(((w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch))
            im = im.resize((size[1], size[0]), Image.BICUBIC)
        return torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.size[1], im.size[0], 3).permute(2, 0, 1)


def evaluate(args: argparse.Namespace) -> Optional[dict]:
    """The FID result (rank 0; None on the other ranks of a ``torchrun`` launch)."""
    import torch.distributed as dist

    from dit_mcore.generate.job import GenerateRequest, generate, layout_from_overrides
    layout = layout_from_overrides(getattr(args, "overrides", None) or [])
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    from dit_mcore.training.weights import find_checkpoint, read_run
    stats = _reference_stats(args.reference) if args.reference.endswith(".npz") else None
    recorded = str(stats.pop("features")) if stats is not None and "features" in stats else None
    features = args.features or recorded or ("digits" if args.reference == "digits" else "inception")
    if recorded is not None and recorded != features:
        raise ConfigError(f"--reference={args.reference!r}: statistics of {recorded} features; --features {features} "
                          "measures others (give the same --features, or statistics made with it)")
    if stats is None and args.reference != "digits" and not Path(args.reference).is_dir():
        raise ConfigError(f"--reference={args.reference!r}: neither 'digits', a folder of images nor an .npz of "
                          "their statistics")
    if stats is not None and args.save_reference_stats:
        raise ConfigError("--save-reference-stats: the reference is statistics already; give images to save theirs")
    extractor = build_extractor(features, args.inception_weights)
    path = find_checkpoint(Path(args.checkpoint), args.step)
    run = read_run(path)
    classes = run.model.num_classes or 0
    if run.model.text_dim or not classes:
        raise ConfigError(f"--checkpoint: FID is computed for class-conditional image models here; this run "
                          f"(model.family={run.model.family}) is conditioned on "
                          f"{'text' if run.model.text_dim else 'nothing'}")
    if args.num_samples < min_samples(extractor):
        raise ConfigError(f"--num-samples={args.num_samples}: FID on {extractor.num_features} {features} features "
                          f"needs at least {min_samples(extractor)}")
    each = per_class(args.num_samples, classes)
    out = Path(args.out)
    with (tempfile.TemporaryDirectory(prefix="dit_mcore_eval_") if ranks == 1 else
          contextlib.nullcontext(str(out.with_name(out.stem + "_samples")))) as tmp:
        generate(GenerateRequest(checkpoint=str(path), labels=["all"], num_per_prompt=each, out=tmp,
                                 weights=args.weights, steps=args.steps, cfg_scale=args.cfg_scale, sampler=args.sampler,
                                 seed=args.seed, batch_size=args.batch_size, progress=False, dtype="fp32"), layout)
        if ranks > 1 and dist.get_rank() != 0:  # (rank 0 has gathered every item's entry and scores them)
            return None
        index = json.loads((Path(tmp) / "index.json").read_text())
        if any(e["file"].endswith(".gif") for e in index):
            raise ConfigError("--checkpoint: FID is computed for image models; this run generates clips")
        fake = torch.stack([_read(Path(tmp) / e["file"]) for e in index])
        first = index[0]
    real = stats if stats is not None else reference_images(args.reference, tuple(fake.shape[-2:]))
    if args.save_reference_stats:
        import numpy as np
        saved = {k: v.numpy() if torch.is_tensor(v) else v for k, v in statistics(real, extractor).items()}
        Path(args.save_reference_stats).parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.save_reference_stats, **saved, features=features)
    value = fid(real, fake, extractor)
    return {"fid": value, "features": features, "feature_dim": int(extractor.num_features),
            "num_samples": len(fake), "per_class": each, "reference": args.reference,
            "reference_samples": real.get("n") if stats is not None else len(real), "checkpoint": str(path),
            "weights": args.weights,
            "steps": first["steps"], "sampler": first["sampler"], "cfg_scale": first["cfg_scale"], "seed": args.seed,
            "image_size": list(fake.shape[-2:])}


def main(argv: Optional[list] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from dit_mcore.parallel.initialize import destroy_distributed
    args = parser().parse_args(argv)
    try:
        result = evaluate(args)
    except ConfigError as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    if result is None:  # another rank of a torchrun launch: rank 0 writes
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"FID {result['fid']:.3f} ({result['features']} features, {result['num_samples']} samples against "
          f"{result['reference_samples'] or 'the statistics'} of {result['reference']}) -> {args.out}")
    return 0
