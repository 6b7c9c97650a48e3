"""Raw media or a built-in dataset -> latents + text embeddings -> an energon dataset.

    python -m energon_data.prepare INPUT OUT [--encoder identity] [--text-encoder tiny_text] ...

INPUT is a folder of images/videos (searched recursively; captions from a sidecar
``<name>.txt`` or a ``captions.jsonl`` of ``{"file": relative/path, "caption": ...}``, the
sidecar winning; class sub-folders become labels, torchvision's ``ImageFolder`` convention, see
``--labels``) or a built-in dataset name (``digits``, ``moving_digits``). OUT receives
``shard-000000.tar`` ... with ``latent.pth`` (bf16 ``[C, T, H, W]``), ``text.pth`` (bf16
``[L, D]``) and ``json`` per sample, plus ``.nv-meta/`` so that
``megatron.energon.get_train_dataset(OUT, ...)`` loads it as ``energon_data.samples.LatentSample``.

Re-runs are idempotent: progress is recorded in ``OUT/prepare_state.json`` after every
shard, a complete output with the same options and sources is left untouched, an interrupted
one continues after its last finished shard, and ``--overwrite`` redoes everything. Sources are
known by content (file bytes, caption, label), not by name: when some changed, were added or were
removed, a re-run encodes just those and takes every other sample from the previous shards. A
file that cannot be read or encoded is skipped and listed with its reason; it never stops the
run. A run that fails before writing a shard leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from energon_data import media as media_lib
from energon_data import shards as shard_lib
from energon_data.encoders import EncodeError

STATE_FILE = "prepare_state.json"
STATE_VERSION = 2  # 2: sources known by content, the label map (a version-1 output is prepared again)
BUILTIN_DATASETS = ("digits", "moving_digits")
CAPTIONS_JSONL = "captions.jsonl"
LABEL_MODES = ("auto", "folders", "none")
RACY_NS = 2_000_000_000  # a file modified this close to when its digest was recorded is read again (as git)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class PrepareConfig:
    """Everything that decides the content of a prepared dataset (plus a few run-time knobs)."""

    encoder: str = "identity"
    """Latent encoder name (see ``energon_data.encoders.LATENT_ENCODERS``)."""
    text_encoder: str = "tiny"
    """Text encoder name (see ``energon_data.encoders.TEXT_ENCODERS``)."""
    encoder_path: str | None = None
    """Local model folder for encoders that load weights (diffusers_vae, diffusers_video_vae)."""
    text_encoder_path: str | None = None
    """Local model folder for text encoders that load weights (t5)."""
    encoder_opts: dict = field(default_factory=dict)
    """Extra keyword options for the latent encoder builder (e.g. ``{"downsample": 2}`` for tiny_vae)."""
    text_encoder_opts: dict = field(default_factory=dict)
    """Extra keyword options for the text encoder builder (e.g. ``{"dim": 64}`` for tiny_text)."""
    split_ratio: tuple[float, float, float] = (1.0, 0.0, 0.0)
    """train, val, test ratios; energon splits whole shards, so use enough shards for small splits."""
    samples_per_shard: int = 1000
    """Samples written per tar shard."""
    image_size: tuple[int, int] | None = None
    """(height, width) to resize (cover) and center-crop to; None keeps sizes, cropping to ``size_multiple``.
    For built-in datasets: the side of the generated images (default 16 for digits, 32 for moving_digits)."""
    size_multiple: int | None = None
    """Frames are cropped so H and W are multiples of this; default encoder downsampling x 2 (the patch size)."""
    frames: int | None = None
    """Max frames kept per video (the first ones after striding); None keeps all. moving_digits: frames per video (8)."""
    frame_stride: int = 1
    """Keep every n-th frame of a video."""
    channels: int | None = None
    """Force 1 (gray) or 3 (RGB) channels; None keeps each file's own, and a file whose channel count
    differs from the dataset's first sample is skipped."""
    latent_dtype: str = "bfloat16"
    """Storage dtype of ``latent.pth`` and ``text.pth``: bfloat16 (the contract), float16 or float32."""
    num_videos: int = 1024
    """moving_digits: how many videos to generate."""
    seed: int = 0
    """moving_digits: generator seed."""
    labels: str = "auto"
    """Class labels from INPUT's sub-folders (torchvision's ``ImageFolder`` convention: the sorted
    names of the folders directly under INPUT are the classes 0, 1, ...; each sample's json gets
    ``label``, the dataset's record the names): "auto" when every media file lies in one of at least
    two such folders, "folders" always (a file directly under INPUT is then skipped), "none" never.
    Built-in datasets carry their own labels."""
    fps: float = 8.0
    """moving_digits: frame rate written to the metadata."""
    text_batch_size: int = 32
    """Captions encoded per text-encoder call."""
    workers: int = 2
    """Processes energon uses to index the shards."""
    progress: bool = True
    """Show a tqdm progress bar."""

    # Knobs that do not change the written samples; excluded from the fingerprint.
    _RUNTIME = ("split_ratio", "text_batch_size", "workers", "progress")

    def fingerprint(self, source: str) -> str:
        """What decides how each source is encoded (the sources themselves are fingerprinted one by one)."""
        content = {k: v for k, v in asdict(self).items() if k not in self._RUNTIME}
        content["source"] = source
        return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class PrepareSummary:
    """What a prepare run produced; also printed at the end of the CLI."""

    out: str
    samples: int = 0
    shards: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(source, reason) for every input that was not written."""
    splits: dict[str, int] = field(default_factory=dict)
    """Samples per split (train/val/test)."""
    status: str = "prepared"
    """"prepared", "resumed" (continued an interrupted run), "updated" (some sources changed), "resplit"
    (only the split changed) or "up-to-date"."""
    resumed_shards: int = 0
    """Shards kept from an earlier interrupted run."""
    changes: dict[str, int] = field(default_factory=dict)
    """With "updated": how many sources were ``changed``, ``added`` and ``removed``, and how many samples
    were ``reused`` from the previous shards without encoding."""
    labels: list[str] | None = None
    """The class names, label 0 first (None: the samples carry no labels)."""
    label_mode: str = "auto"
    """``--labels`` as given."""
    latent_shape_example: tuple[int, ...] | None = None
    text_dim: int | None = None
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"energon_data.prepare: {self.status} {self.out}",
            f"  samples: {self.samples} in {self.shards} shards  splits: {self.splits}",
            f"  latent e.g. {self.latent_shape_example}, text dim {self.text_dim}, {self.seconds:.1f}s",
        ]
        if self.status == "up-to-date":
            lines.append("  nothing to do: the output is complete for these options and sources "
                         "(pass --overwrite to redo)")
        if self.status == "updated":
            c = self.changes
            lines.append(f"  sources changed {c['changed']}, added {c['added']}, removed {c['removed']}; "
                         f"{c['reused']} samples reused without encoding")
        if self.labels:
            shown = ", ".join(f"{i}={name}" for i, name in enumerate(self.labels[:12]))
            lines.append(f"  labels ({len(self.labels)}): {shown}" + (", ..." if len(self.labels) > 12 else "")
                         + (" (the sub-folders; --labels none if they are not classes)" if self.label_mode == "auto"
                            and self.labels != [str(d) for d in range(10)] else ""))
        if self.resumed_shards:
            lines.append(f"  continued after {self.resumed_shards} shards from an interrupted run")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines.append(f"  skipped: {len(self.skipped)}")
        lines += [f"    {src}: {reason}" for src, reason in self.skipped]
        return "\n".join(lines)


# --------------------------------------------------------------------------- inputs


@dataclass
class Item:
    """One input sample before encoding."""

    source: str
    """Relative path, or ``<dataset>[index]`` for built-ins; stored in the json as ``source``."""
    load: Callable[[], media_lib.Media]
    caption: str = ""
    extra: dict = field(default_factory=dict)
    """Extra json fields (e.g. ``label``)."""
    path: Path | None = None
    """The file a folder item reads (its bytes are part of the item's content key)."""


def _read_captions_jsonl(root: Path, warnings: list[str]) -> dict[str, str]:
    path = root / CAPTIONS_JSONL
    captions: dict[str, str] = {}
    if not path.is_file():
        return captions
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            captions[Path(entry["file"]).as_posix()] = str(entry["caption"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            warnings.append(f"{CAPTIONS_JSONL}:{n}: ignored ({type(e).__name__}: {e}); expected "
                            '{"file": ..., "caption": ...}')
    return captions


def class_folders(media: list[Path], mode: str) -> list[str] | None:
    """The class names (sorted first-level folder names of the media's relative paths) ``mode`` asks
    for, or None for no labels."""
    if mode not in LABEL_MODES:
        raise ValueError(f"--labels must be one of {LABEL_MODES}, got {mode!r}")
    classes = sorted({rel.parts[0] for rel in media if len(rel.parts) > 1})
    if mode == "folders" and not classes:
        raise ValueError("--labels folders: INPUT has no sub-folder holding media (one per class); use --labels auto "
                         "or none")
    if mode == "none" or not classes:
        return None
    if mode == "auto" and (len(classes) < 2 or any(len(rel.parts) == 1 for rel in media)):
        return None
    return classes


def folder_items(root: Path, cfg: PrepareConfig, warnings: list[str],
                 skipped: list[tuple[str, str]]) -> tuple[list[Item], list[str] | None]:
    """Media files under ``root`` in sorted order, and the class names when they are labelled (see
    ``PrepareConfig.labels``); unknown file types go to ``skipped``."""
    jsonl = _read_captions_jsonl(root, warnings)
    items, seen = [], set()
    files = sorted(p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(root).parts))
    media_suffixes = media_lib.IMAGE_EXTENSIONS | media_lib.VIDEO_EXTENSIONS
    classes = class_folders([p.relative_to(root) for p in files if p.suffix.lower() in media_suffixes], cfg.labels)
    for path in files:
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        suffix = path.suffix.lower()
        if suffix in media_lib.SIDECAR_EXTENSIONS:
            continue
        if suffix not in media_lib.IMAGE_EXTENSIONS | media_lib.VIDEO_EXTENSIONS:
            skipped.append((rel.as_posix(), f"unsupported file type {suffix or '(no extension)'}"))
            continue
        sidecar = path.with_suffix(".txt")
        caption = sidecar.read_text().strip() if sidecar.is_file() else jsonl.get(rel.as_posix(), "")
        seen.add(rel.as_posix())
        if classes and len(rel.parts) == 1:
            skipped.append((rel.as_posix(), "not in a class sub-folder (--labels folders)"))
            continue

        def load(path=path):
            return media_lib.read_media(path, cfg.frames, cfg.frame_stride, cfg.channels)

        extra = {"label": classes.index(rel.parts[0])} if classes else {}
        items.append(Item(rel.as_posix(), load, caption, extra, path))
    missing = sorted(set(jsonl) - seen)
    if missing:
        warnings.append(f"{CAPTIONS_JSONL} names {len(missing)} files that are not media here, e.g. {missing[:3]}")
    return items, classes


def builtin_items(name: str, cfg: PrepareConfig) -> list[Item]:
    """The built-in dataset's samples (labelled by the generator)."""
    from energon_data import datasets

    if name == "digits":
        size = cfg.image_size[0] if cfg.image_size else 16
        if cfg.image_size and cfg.image_size[0] != cfg.image_size[1]:
            raise ValueError(f"--image-size for digits must be square, got {cfg.image_size}")
        images, labels = datasets.load_digits(size)
        return [
            Item(f"digits[{i}]", lambda i=i: media_lib.Media(images[i].unsqueeze(1), "image", None, (8, 8)),
                 f"a handwritten {int(labels[i])}", {"label": int(labels[i])})
            for i in range(len(labels))
        ]
    size = cfg.image_size[0] if cfg.image_size else 32
    data = datasets.moving_digits(cfg.num_videos, frames=cfg.frames or 8, size=size, seed=cfg.seed)
    return [
        Item(f"moving_digits[{i}]", lambda i=i: media_lib.Media(data.videos[i], "video", cfg.fps, (size, size)),
             data.captions[i], {"label": int(data.labels[i]), "direction": data.directions[i]})
        for i in range(cfg.num_videos)
    ]


# --------------------------------------------------------------------------- content keys


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_keys(items: list[Item], known: dict) -> tuple[dict[str, str], dict]:
    """Each item's content key (its file's bytes, caption and json fields) by source, and the stat
    record to keep for the next run: a file whose size, modification and change times and inode are
    those ``known`` records is not read again, unless it was modified within ``RACY_NS`` of when they
    were recorded (a rewrite in the same clock tick; git's index guards the same way)."""
    keys, stats, now = {}, {}, time.time_ns()
    for item in items:
        key = hashlib.sha256(json.dumps([item.source, item.caption, item.extra], sort_keys=True).encode())
        if item.path is not None:
            st = item.path.stat()
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            cached = known.get(item.source)
            trusted = cached and len(cached) == 6 and cached[:4] == stamp and cached[5] - st.st_mtime_ns > RACY_NS
            stats[item.source] = cached if trusted else stamp + [_file_digest(item.path), now]
            key.update(stats[item.source][4].encode())
        keys[item.source] = key.hexdigest()[:24]
    return keys, stats


class _PreviousShards:
    """Samples of the shards an update set aside (``.previous-shard-*.tar``), read by shard and key."""

    def __init__(self, out: Path):
        self.out, self.tars = out, {}

    def read(self, shard: str, key: str) -> dict[str, Any]:
        if shard not in self.tars:
            tar = tarfile.open(self.out / shard)
            self.tars[shard] = (tar, {m.name: m for m in tar.getmembers()})
        return shard_lib.read_sample(*self.tars[shard], key)

    def close(self) -> None:
        for tar, _ in self.tars.values():
            tar.close()


# --------------------------------------------------------------------------- state


def prepare_record(out) -> dict | None:
    """What ``prepare`` recorded for the dataset at ``out`` (its config, shards with their latent
    shape and text width), or None when there is no readable record (e.g. a blend file)."""
    try:
        return json.loads((Path(out) / STATE_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _load_state(out: Path) -> dict | None:
    state = prepare_record(out)
    return state if state is not None and state.get("version") == STATE_VERSION else None


def _save_state(out: Path, state: dict) -> None:
    tmp = out / f".{STATE_FILE}.partial"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out / STATE_FILE)


def _check_out_dir(out: Path) -> None:
    """Refuse to write into a non-empty folder this tool did not create (we only ever delete our own files)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"OUT {out} exists and is not a folder")
    if (out / STATE_FILE).exists():
        return
    foreign = [p.name for p in out.iterdir() if not (shard_lib.OUTPUT_RE.match(p.name) or p.name.startswith("."))]
    if foreign:
        raise FileExistsError(
            f"OUT {out} is not empty and was not written by energon_data.prepare (found {foreign[:3]}); "
            "choose a new or empty folder"
        )


# --------------------------------------------------------------------------- main loop


def _parse_size(value) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (int(value[0]), int(value[1]))
    parts = str(value).lower().replace(",", "x").split("x")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        return (int(parts[0]), int(parts[-1]))
    raise ValueError(f"--image-size must be N or HxW, got {value!r}")


def _parse_ratio(value) -> tuple[float, float, float]:
    parts = [float(x) for x in value.split(",")] if isinstance(value, str) else [float(x) for x in value]
    if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split-ratio must be train,val,test (3 non-negative numbers, positive sum), got {value!r}")
    return tuple(parts)  # type: ignore[return-value]


def _progress(iterable, total: int, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="sample", dynamic_ncols=True)


def _encode_items(
    items: list[Item], start: int, cfg: PrepareConfig, encoders: Callable[[], tuple], state: dict,
    previous: _PreviousShards,
) -> Iterator[tuple[list[dict], int]]:
    """Yield (samples of one shard, index of the next unread item), encoding latents and captions
    (``encoders()`` builds the two, first needed) or taking them from the previous shards
    (``state["reuse"]``: source -> [shard, key])."""
    dtype = _DTYPES[cfg.latent_dtype]
    pending: list[tuple[int, Item, torch.Tensor, dict, torch.Tensor | None]] = []
    built: list = []

    def encoder_pair():
        if not built:
            built.extend(encoders())
        return built

    # Built-in datasets repeat a handful of captions; encode each distinct caption once.
    text_cache: dict[str, torch.Tensor] = {}

    def flush(next_item: int):
        new = sorted({p[1].caption for p in pending if p[4] is None} - text_cache.keys())
        for b in range(0, len(new), cfg.text_batch_size):
            batch = new[b : b + cfg.text_batch_size]
            text_cache.update(zip(batch, encoder_pair()[1].encode(batch)))
        embeddings = [text_cache[p[1].caption] if p[4] is None else p[4] for p in pending]
        samples = [
            {"__key__": f"{idx:08d}", "latent.pth": latent.to(dtype), "text.pth": emb.to(dtype), "json": meta}
            for (idx, _, latent, meta, _), emb in zip(pending, embeddings)
        ]
        pending.clear()
        return samples, next_item

    for idx in _progress(range(start, len(items)), len(items) - start, cfg.progress, "encoding"):
        item = items[idx]
        if item.source in state["reuse"]:
            sample = previous.read(*state["reuse"][item.source])
            channels = sample["latent.pth"].shape[0]
            if state.setdefault("latent_channels", channels) != channels:  # as a fresh prepare would skip it
                state["skipped"].append((item.source, f"{channels} latent channels, the dataset has "
                                         f"{state['latent_channels']}; pass --channels to convert all files", idx))
                continue
            pending.append((idx, item, sample["latent.pth"], sample["json"], sample["text.pth"]))
            if len(pending) == cfg.samples_per_shard:
                yield flush(idx + 1)
            continue
        encoder = encoder_pair()[0]
        multiple = cfg.size_multiple or encoder.spatial_factor * 2
        try:
            m = item.load()
            frames = encoder.valid_frames(m.pixels.shape[1])
            if frames == 0:
                raise media_lib.MediaError("zero frames")
            pixels = media_lib.fit_size(m.pixels[:, :frames], cfg.image_size, multiple)
            latent = encoder.encode(pixels).cpu()
        except (media_lib.MediaError, EncodeError) as e:
            state["skipped"].append((item.source, str(e), idx))
            continue
        c = state.setdefault("latent_channels", latent.shape[0])
        if latent.shape[0] != c:
            state["skipped"].append((item.source, f"{pixels.shape[0]}-channel input gives {latent.shape[0]} latent "
                                     f"channels, the dataset has {c}; pass --channels to convert all files", idx))
            continue
        _, t, h, w = pixels.shape
        meta = {"kind": m.kind, "height": h, "width": w, "frames": t, "fps": m.fps, "caption": item.caption,
                "source": item.source, **item.extra}
        pending.append((idx, item, latent, meta, None))
        if len(pending) == cfg.samples_per_shard:
            yield flush(idx + 1)
    if pending:
        yield flush(len(items))


def prepare_dataset(
    input: str | os.PathLike,
    out: str | os.PathLike,
    *,
    encoder: str = "identity",
    text_encoder: str = "tiny",
    split_ratio=(1, 0, 0),
    samples_per_shard: int = 1000,
    overwrite: bool = False,
    **opts: Any,
) -> PrepareSummary:
    """Prepare ``input`` (folder or built-in name) into an energon dataset at ``out``.

    ``opts`` are the other :class:`PrepareConfig` fields (``image_size``, ``frames``,
    ``encoder_path``, ``encoder_opts``, ``num_videos``, ...). Returns the run's summary.
    """
    t0 = time.time()
    known = {f.name for f in fields(PrepareConfig)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise TypeError(f"prepare_dataset: unknown options {unknown}; valid: {sorted(known)}")
    cfg = PrepareConfig(encoder=encoder, text_encoder=text_encoder, split_ratio=_parse_ratio(split_ratio),
                        samples_per_shard=samples_per_shard, **opts)
    cfg.image_size = _parse_size(cfg.image_size)
    if cfg.samples_per_shard < 1:
        raise ValueError(f"--samples-per-shard must be >= 1, got {cfg.samples_per_shard}")
    if cfg.latent_dtype not in _DTYPES:
        raise ValueError(f"--latent-dtype must be one of {sorted(_DTYPES)}, got {cfg.latent_dtype!r}")
    if cfg.channels not in (None, 1, 3):
        raise ValueError(f"--channels must be 1 or 3, got {cfg.channels}")

    out = Path(out)
    summary = PrepareSummary(out=str(out), label_mode=cfg.labels)
    warnings, skipped = summary.warnings, []
    name = str(input)
    classes = None
    if name in BUILTIN_DATASETS:
        items, source = builtin_items(name, cfg), name
        classes = [str(digit) for digit in range(10)]
    elif Path(name).is_dir():
        items, classes = folder_items(Path(name), cfg, warnings, skipped)
        source = str(Path(name).resolve())
    else:
        raise FileNotFoundError(f"INPUT {name!r} is neither a folder nor a built-in dataset {BUILTIN_DATASETS}")
    options = cfg.fingerprint(source)

    _check_out_dir(out)
    existed = out.exists()
    state = None if overwrite else _load_state(out)
    keys, stats = content_keys(items, (state or {}).get("stats", {}))
    out.mkdir(parents=True, exist_ok=True)
    if state is not None and state["options"] != options:
        if state["complete"]:
            raise FileExistsError(f"OUT {out} holds a dataset prepared with other options or from another INPUT; "
                                  "pass --overwrite to redo it")
        warnings.append("an interrupted run with other options was found; starting over")
        state = None
    had_dataset = state is not None and (state["complete"] or bool(state["reuse"]))  # (kept if this run fails)
    if state is not None and state["complete"] and not items:
        raise FileNotFoundError(f"INPUT {name!r} holds no media now; the dataset in OUT {out} is kept (pass "
                                "--overwrite to replace it)")
    if state is not None and state["items"] != keys:  # sources changed, were added or were removed
        before, where = state["items"], state["where"]
        if state["complete"]:  # the unchanged sources' samples come from the previous shards
            shard_lib.set_aside(out, [s["name"] for s in state["shards"]])
            reuse = {src: [shard_lib.PREVIOUS_PREFIX + where[src][0], where[src][1]]
                     for src, key in keys.items() if before.get(src) == key and src in where}
        else:  # an interrupted run or update: what an update set aside stays usable where still the same
            shard_lib.remove_outputs(out, keep_previous=True)
            reuse = {src: at for src, at in state["reuse"].items() if before.get(src) == keys.get(src)}
        summary.changes = {"changed": sum(src in before and before[src] != key for src, key in keys.items()),
                           "added": sum(src not in before for src in keys),
                           "removed": sum(src not in keys for src in before), "reused": len(reuse)}
        state = _new_state(out, options, keys, stats, cfg, classes, reuse)
    if state is None:
        shard_lib.remove_outputs(out)
        state = _new_state(out, options, keys, stats, cfg, classes, {})
    if state["stats"] != stats:  # files read again (touched, racy): their new stamps, not read next time
        state["stats"] = stats
        _save_state(out, state)
    try:
        return _write(out, items, cfg, state, summary, skipped, name, t0)
    except BaseException:
        if not state["shards"] and not had_dataset and not state["complete"]:  # nothing worth keeping
            shard_lib.remove_outputs(out)
            (out / STATE_FILE).unlink(missing_ok=True)
            if not existed:
                shutil.rmtree(out, ignore_errors=True)
        raise


def _new_state(out: Path, options: str, keys: dict, stats: dict, cfg: PrepareConfig, classes, reuse: dict) -> dict:
    state = {"version": STATE_VERSION, "options": options, "items": keys, "stats": stats, "config": asdict(cfg),
             "labels": classes, "shards": [], "where": {}, "reuse": reuse, "skipped": [], "complete": False,
             "split_ratio": None}
    _save_state(out, state)
    return state


def _write(out: Path, items: list[Item], cfg: PrepareConfig, state: dict, summary: PrepareSummary,
           skipped: list, name: str, t0: float) -> PrepareSummary:
    """Encode what is left to encode, then split and index the shards (see :func:`prepare_dataset`)."""
    shards = state["shards"]
    if state["complete"] and tuple(state["split_ratio"]) == cfg.split_ratio:
        summary.status = "up-to-date"
        return _finish(summary, state, skipped, t0)
    if state["complete"]:
        summary.status = "resplit"
    else:
        summary.status = "updated" if summary.changes else "resumed" if shards else "prepared"
        summary.resumed_shards = len(shards)
        start = shards[-1]["next_item"] if shards else 0
        # Skips past the last finished shard are redone with the items they belong to.
        state["skipped"] = [s for s in state["skipped"] if s[2] < start]
        previous = _PreviousShards(out)
        try:
            for samples, next_item in _encode_items(items, start, cfg, lambda: _build_encoders(cfg), state, previous):
                shard = shard_lib.write_shard(out, len(shards), samples)
                shards.append({"name": shard, "samples": len(samples), "next_item": next_item,
                               "latent_shape": list(samples[0]["latent.pth"].shape),
                               "latent_shapes": sorted({tuple(x["latent.pth"].shape) for x in samples}),
                               "text_dim": samples[0]["text.pth"].shape[-1]})
                state["where"].update({s["json"]["source"]: [shard, s["__key__"]] for s in samples})
                _save_state(out, state)
        finally:
            previous.close()
        _save_state(out, state)
        if not shards:
            reasons = [f"{src}: {why}" for src, why, _ in state["skipped"][:5]] + [f"{a}: {b}" for a, b in skipped[:5]]
            raise RuntimeError(f"no sample could be prepared from {name!r}; e.g. {reasons}")

    splits = shard_lib.assign_splits(len(shards), cfg.split_ratio)
    for split, idx in splits.items():
        if cfg.split_ratio[shard_lib.SPLIT_NAMES.index(split)] > 0 and not idx:
            summary.warnings.append(f"split {split!r} has a positive ratio but 0 of {len(shards)} shards; "
                                    "use a smaller --samples-per-shard")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # energon prints progress lines we summarise ourselves
        shard_lib.prepare_energon(out, [s["name"] for s in shards], splits, cfg.workers)
    state.update(complete=True, split_ratio=list(cfg.split_ratio), reuse={},
                 splits={k: sum(shards[i]["samples"] for i in v) for k, v in splits.items()})
    _save_state(out, state)
    for previous_shard in out.glob(shard_lib.PREVIOUS_PREFIX + "*"):  # what the update took is in the new shards
        previous_shard.unlink()
    return _finish(summary, state, skipped, t0)


def _build_encoders(cfg: PrepareConfig):
    from energon_data.encoders import build_latent_encoder, build_text_encoder

    lat = build_latent_encoder(cfg.encoder, cfg.encoder_path, **cfg.encoder_opts)
    txt = build_text_encoder(cfg.text_encoder, cfg.text_encoder_path, **cfg.text_encoder_opts)
    return lat, txt


def _finish(summary: PrepareSummary, state: dict, folder_skips: list, t0: float) -> PrepareSummary:
    shards = state["shards"]
    summary.samples = sum(s["samples"] for s in shards)
    summary.shards = len(shards)
    summary.skipped = sorted(folder_skips + [(src, why) for src, why, _ in state["skipped"]])
    summary.splits = dict(state.get("splits") or {})
    summary.labels = state.get("labels")
    if shards:
        summary.latent_shape_example = tuple(shards[0]["latent_shape"])
        summary.text_dim = shards[0]["text_dim"]
    summary.seconds = time.time() - t0
    return summary


# --------------------------------------------------------------------------- CLI


def _opts_json(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"downsample\": 2}}': {e}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


def build_parser() -> argparse.ArgumentParser:
    from energon_data.encoders import LATENT_ENCODERS, TEXT_ENCODERS

    p = argparse.ArgumentParser(prog="python -m energon_data.prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("input", help=f"folder of images/videos, or a built-in dataset: {', '.join(BUILTIN_DATASETS)}")
    p.add_argument("out", help="output folder (created; must be empty or a previous output of this tool)")
    p.add_argument("--encoder", default="identity", choices=sorted(LATENT_ENCODERS),
                   help="latent encoder: identity (the pixels themselves, in [-1, 1]), tiny_vae (a small "
                        "random-init VAE for tests), diffusers_vae / diffusers_video_vae (a diffusers "
                        "AutoencoderKL or video VAE from --encoder-path); writes latent.pth, [C, T, H, W]")
    p.add_argument("--text-encoder", default="tiny", choices=sorted(TEXT_ENCODERS),
                   help="caption encoder: tiny / tiny_text (a small random-init transformer, 32 wide), t5 (a "
                        "T5 encoder from --text-encoder-path); writes text.pth, [tokens, width]")
    p.add_argument("--encoder-path", help="local folder of the latent encoder's weights (never downloaded)")
    p.add_argument("--text-encoder-path", help="local folder of the text encoder's weights (never downloaded)")
    p.add_argument("--encoder-opts", type=_opts_json, default={}, help="JSON options for the latent encoder")
    p.add_argument("--text-encoder-opts", type=_opts_json, default={}, help="JSON options for the text encoder")
    p.add_argument("--image-size", help="N or HxW: resize (cover) + center-crop; built-ins: generated size")
    p.add_argument("--size-multiple", type=int, help="crop H, W to multiples of this (default: encoder factor x 2)")
    p.add_argument("--frames", type=int, help="max frames per video (moving_digits: frames per video)")
    p.add_argument("--frame-stride", type=int, default=1, help="keep every n-th video frame")
    p.add_argument("--channels", type=int, choices=(1, 3), help="force gray (1) or RGB (3)")
    p.add_argument("--labels", default="auto", choices=LABEL_MODES,
                   help="class labels from INPUT's sub-folders (sorted names -> 0, 1, ...; ImageFolder's "
                        "convention): auto = when every file is in one of >= 2 sub-folders, folders = always, "
                        "none = never")
    p.add_argument("--split-ratio", default="1,0,0", help="train,val,test ratios over whole shards")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--latent-dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--num-videos", type=int, default=1024, help="moving_digits: number of videos")
    p.add_argument("--seed", type=int, default=0, help="moving_digits: generator seed")
    p.add_argument("--fps", type=float, default=8.0, help="moving_digits: frame rate in the metadata")
    p.add_argument("--workers", type=int, default=2, help="processes for energon's indexing")
    p.add_argument("--overwrite", action="store_true", help="delete this tool's previous output in OUT and redo")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = prepare_dataset(
            args.input, args.out, encoder=args.encoder, text_encoder=args.text_encoder,
            split_ratio=args.split_ratio, samples_per_shard=args.samples_per_shard, overwrite=args.overwrite,
            encoder_path=args.encoder_path, text_encoder_path=args.text_encoder_path,
            encoder_opts=args.encoder_opts, text_encoder_opts=args.text_encoder_opts,
            image_size=args.image_size, size_multiple=args.size_multiple, frames=args.frames,
            frame_stride=args.frame_stride, channels=args.channels, latent_dtype=args.latent_dtype,
            num_videos=args.num_videos, seed=args.seed, fps=args.fps, workers=args.workers, labels=args.labels,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (ValueError, FileNotFoundError, FileExistsError, ImportError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
