"""The one data configuration: what the command line sets (``data.field=value``) and what the
energon loaders, the built-in datasets and the mock source read.

Sources, in order of precedence: ``blend`` (several prepared datasets), ``path`` (one prepared
dataset or a metadataset yaml), else the built-in source ``name`` (``digits`` images in memory, or
``mock`` random latents of the model's shape).
"""

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Literal, Optional

from dit_mcore.errors import ConfigError

BUILTIN_SOURCES = ("digits", "moving_digits", "mock")


NOT_STREAM_FIELDS = frozenset({
    "restart_data_on_mismatch", "num_workers", "max_consecutive_skips", "first_batch_timeout_s",
    "shard_over_ranks",  # (the split over ranks: checked by the trainer)
    "val_path", "blend_dir", "name", "image_size", "mock_latent_shapes", "global_batch_size"})
"""DataConfig fields that do not decide an energon loader's sample stream (a resume may change them)."""


@dataclass
class DataConfig:
    """Where training samples come from and how they are batched and packed."""

    name: Optional[str] = "digits"
    """Built-in source used when neither ``path`` nor ``blend`` is set: ``"digits"`` (scikit-learn's
    handwritten digits, in memory: 1,618 of the 1,797; every 10th is held out for the validation loss), ``"moving_digits"`` (short videos of those digits with
    captions like "a 3 moving left", encoded by the tiny text encoder) or ``"mock"`` (random latents
    of the model's shape and random labels, plus random text for text models, for smoke tests and
    benchmarks). None for recipes that require ``path``."""
    image_size: int = 16
    """Side length of built-in images and video frames (``digits``, ``moving_digits``) and of mock latents."""
    video_frames: int = 4
    """``moving_digits``: frames per video."""
    num_videos: int = 4096
    """``moving_digits``: videos generated (in memory, deterministic)."""
    mock_latent_shapes: Optional[list[list[int]]] = None
    """Mock source only: latent ``(T, H, W)`` shapes drawn uniformly per sample. Unset: images of
    ``image_size`` in dense batches. Set (e.g. ``[[1,16,16],[4,16,16]]``): samples are packed into
    sequences of ``max_seq_len`` tokens, like a mixed image/video dataset."""
    path: Optional[str] = None
    """A prepared energon dataset (``python -m energon_data.prepare``) or a metadataset yaml.
    Samples are then packed into sequences of ``max_seq_len`` tokens and the batch sizes below
    count packed sequences."""
    blend: Optional[dict[str, float]] = None
    """``{dataset_dir: weight, ...}`` to mix several prepared datasets (on the command line:
    ``data.blend="{'/data/a':1,'/data/b':2}"``); overrides ``path``. A list of ``(dir, weight)``
    pairs is accepted too."""
    blend_mode: Literal["weight", "epoch"] = "weight"
    """``weight``: sample datasets randomly by weight, forever. ``epoch``: each epoch holds every
    dataset ``weight`` times over (weights are repetitions, e.g. 2 = twice per epoch)."""
    blend_by: Literal["samples", "tokens"] = "samples"
    """Whether ``blend`` weights are shares of samples or of (unpadded) tokens."""
    blend_dir: Optional[str] = None
    """Where the generated metadataset yaml goes; default: ``$TMPDIR/dit_mcore_blends``."""
    val_path: Optional[str] = None
    """Dataset for validation; default: the ``val`` split of ``path``."""
    global_batch_size: int = 256
    """Samples (packed sequences when packing) per optimizer step, over all data-parallel ranks
    and micro-batches."""
    micro_batch_size: Optional[int] = 64
    """Samples (packed sequences when packing) per forward/backward on one rank; None: the rank's
    whole share of the global batch in one micro-batch."""
    num_workers: int = 0
    """Loader worker processes per rank (energon datasets). Must stay the same across a resume."""
    shard_over_ranks: bool = False
    """Energon datasets under data parallelism. False: every data-parallel rank reads the whole sample stream and
    keeps its micro-batches of each global batch, so the global batches depend only on the seed, the data and the
    batch sizes: the same under any layout (given ``micro_batch_size``), and a run resumes on any number of
    data-parallel ranks without repeating or skipping a sample. Each rank decodes every sample of a global batch
    (latents: cheap for a few ranks; at many, watch the step's data time). True: energon shards the stream over the
    ranks (each reads its share; the global batches depend on the data-parallel size, which a resume must keep)."""
    max_seq_len: int = 1024
    """Tokens per packed sequence (rows, including padding). Longer samples are skipped and counted."""
    packing: bool = True
    """Pack several samples per sequence (energon datasets). Off: each sample is its own (padded)
    sequence."""
    packing_buffer_size: int = 64
    """Samples gathered per packing round; larger packs tighter."""
    shuffle_buffer_size: Optional[int] = 100
    """Sample-level shuffle buffer of the energon loader (None: shards are still shuffled)."""
    max_samples_per_sequence: Optional[int] = 100
    """Samples read consecutively from one shard before jumping to another (None: whole shards)."""
    max_abs_value: Optional[float] = None
    """Skip latents with a value above this magnitude (corrupt encodes); None: no check."""
    restart_data_on_mismatch: bool = False
    """On resume with a changed worker count, data config or split over ranks (with ``shard_over_ranks``: also
    the data-parallel size), which energon cannot restore exactly, restart the data stream from its beginning
    (warning) instead of failing."""
    patch_size: tuple = (1, 2, 2)
    """Model patch sizes ``(pt, ph, pw)``. Derived from the model by the trainer; set it only when
    using the loaders on their own."""
    pad_multiple: int = 1
    """Every sample is padded to a multiple of this many rows. Derived from the parallel layout by
    the trainer (context/sequence parallel need even splits); set it only for standalone loaders."""
    max_consecutive_skips: Optional[int] = 1000
    """Stop with an error naming the reason and the fix once a loader worker has skipped more than
    this many samples in a row (e.g. every sample longer than ``max_seq_len``), or failed to read or
    decode more than this many in a row (truncated or damaged shards, named), instead of spinning
    forever without a batch. None: no limit."""
    first_batch_timeout_s: Optional[float] = 600.0
    """Stop with an error naming the likely causes when the train loader yields no first batch
    within this many seconds (the trainer iterates through ``energon_data.loader.iterate_with_timeout``).
    None: wait forever."""

    def __post_init__(self):
        if isinstance(self.patch_size, (list, tuple)):
            self.patch_size = tuple(int(p) for p in self.patch_size)
        if isinstance(self.blend, dict):
            self.blend = [(path, float(weight)) for path, weight in self.blend.items()]
        if isinstance(self.mock_latent_shapes, (list, tuple)):
            self.mock_latent_shapes = [list(s) if isinstance(s, (list, tuple)) else s for s in self.mock_latent_shapes]

    def problems(self) -> list[str]:
        """Every invalid value, one line each (``data.field=value: rule; fix``); the trainer checks
        them with the rest of the run config, standalone loaders through :meth:`validate`."""
        out = []

        def need(ok: bool, name: str, rule: str):
            if not ok:
                out.append(f"data.{name}={getattr(self, name)!r}: {rule}")

        need(self.blend_mode in ("weight", "epoch"), "blend_mode", "use 'weight' or 'epoch'")
        need(self.blend_by in ("samples", "tokens"), "blend_by", "use 'samples' or 'tokens'")
        for name in ("packing_buffer_size", "max_seq_len", "pad_multiple", "global_batch_size", "image_size"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        need(self.micro_batch_size is None or self.micro_batch_size >= 1, "micro_batch_size",
             "must be >= 1, or None for one micro-batch per rank")
        need(self.num_workers >= 0, "num_workers", "must be >= 0 (0: load in the training process)")
        if self.mock_latent_shapes is not None:
            shapes = self.mock_latent_shapes
            need(bool(shapes) and all(isinstance(s, list) and len(s) == 3 and all(isinstance(v, int) and v >= 1
                                                                                  for v in s) for s in shapes),
                 "mock_latent_shapes", "must be a non-empty list of [T, H, W] positive ints, e.g. [[1,16,16],[4,16,16]]")
        need(self.max_consecutive_skips is None or self.max_consecutive_skips >= 0, "max_consecutive_skips",
             "must be >= 0, or None for no limit")
        need(self.first_batch_timeout_s is None or self.first_batch_timeout_s > 0, "first_batch_timeout_s",
             "must be > 0, or None to wait forever")
        need(self.max_abs_value is None or self.max_abs_value > 0, "max_abs_value", "must be > 0, or None for no check")
        if self.blend is not None:
            need(all(float(w) > 0 for _, w in self.blend), "blend", "every weight must be > 0")
        return out

    def validate(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def check_source(self) -> None:
        """Fail before any compute when no source is named (checked once the command line has set
        every field: a recipe may leave ``path`` to the command line)."""
        if self.uses_energon:
            return
        if self.name is None:
            raise ConfigError("data.path is required by this recipe: set data.path=<prepared energon dataset or "
                              "metadataset yaml> (see `python -m energon_data.prepare`), or data.name=mock")
        if self.name not in BUILTIN_SOURCES:
            raise ConfigError(f"data.name={self.name!r} is not a built-in source and no data.path is set; "
                              f"use data.name in {BUILTIN_SOURCES} or set data.path to a prepared "
                              "energon dataset (python -m energon_data.prepare)")

    @property
    def uses_energon(self) -> bool:
        """True when samples come from prepared energon datasets (``path`` or ``blend``)."""
        return bool(self.path or self.blend)

    @property
    def packs(self) -> bool:
        """Whether micro-batches are packed THD sequences (energon with packing, or mixed mock shapes)."""
        if self.uses_energon:
            return self.packing
        return self.name == "mock" and self.mock_latent_shapes is not None

    def dense_tokens_per_sample(self, patch_size: int, patch_size_t: int = 1) -> int:
        """Tokens of one sample of a dense built-in source (digits' and mock images, moving_digits'
        videos): latent frames x rows x columns after patching."""
        frames = self.video_frames // patch_size_t if self.name == "moving_digits" else 1
        side = self.image_size // patch_size
        return frames * side * side

    def micro_batch(self, dp_size: int) -> int:
        """The micro-batch size in effect with ``dp_size`` data-parallel ranks."""
        if self.micro_batch_size is None:
            if self.global_batch_size % dp_size:
                raise ConfigError(f"data.global_batch_size ({self.global_batch_size}) must be a multiple "
                                  f"of the data-parallel size ({dp_size})")
            return self.global_batch_size // dp_size
        return self.micro_batch_size

    def num_microbatches(self, dp_size: int) -> int:
        per_step = self.micro_batch(dp_size) * dp_size
        if self.global_batch_size % per_step:
            raise ConfigError(f"data.global_batch_size ({self.global_batch_size}) must be a multiple of "
                              f"data.micro_batch_size x data-parallel size ({self.micro_batch(dp_size)} x "
                              f"{dp_size}); set data.micro_batch_size=None to use one micro-batch per rank")
        return self.global_batch_size // per_step

    def stream_fields(self) -> dict:
        """The fields that decide the sample stream of an energon loader; a restore with other values
        would not continue the same stream."""
        return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(self), default=str)).items()
                if k not in NOT_STREAM_FIELDS}


def config_hash(cfg: DataConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.stream_fields(), sort_keys=True).encode()).hexdigest()[:16]
