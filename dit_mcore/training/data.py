"""Built-in data sources: in-memory images (the digits demo) and mock latents. Both yield the same
``MicroBatch`` as the energon source, and both have an exact position for resume.

The sample order (images) or content (mock) of global batch ``k`` is a function of
``(seed, k)``; the whole state is the number of global batches consumed, so resuming replays
exactly the same batches.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Optional

import torch

from dit_mcore.errors import ConfigError
from energon_data.batch import MicroBatch, cumsum0
from energon_data.config import DataConfig
from energon_data.packing import round_up
from energon_data.tokens import patchify


class _GlobalBatchCounter:
    """State shared by the built-in sources: global batches consumed, checked on restore."""

    per_rank_state = False  # the position is the same on every rank: it lives in the common state

    def __init__(self, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.consumed_batches = 0

    def state_dict(self) -> dict:
        return {"consumed_batches": self.consumed_batches, "dp_size": self.dp_size,
                "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("global_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint was written with data {key}={state[key]} but this run uses "
                                 f"{getattr(self, key)}; resume with the same value")
        self.consumed_batches = state["consumed_batches"]


class InMemoryImageLoader(_GlobalBatchCounter):
    """Dense micro-batches of patchified images (or videos) for one data-parallel rank; every rank sees
    a disjoint slice of each global batch, and a global batch never straddles an epoch boundary (the
    tail is dropped). ``texts``: one ``[L_i, D]`` text embedding per sample, for text models."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, patch_size: int, patch_size_t: int = 1,
                 texts=None, held_out_every: Optional[int] = None, **kw):
        super().__init__(**kw)
        self.held_out_every = held_out_every  # (the digits: every k-th scan left out of training)
        if self.global_batch_size > len(images):
            raise ConfigError(f"data.global_batch_size ({self.global_batch_size}) exceeds the dataset size "
                              f"({len(images)}); lower it")
        self.tokens, self.grid = patchify(images, patch_size, patch_size_t)
        self.labels, self.texts = labels, texts
        self.batches_per_epoch = len(images) // self.global_batch_size

    def state_dict(self) -> dict:
        return {**super().state_dict(), **({"held_out_every": self.held_out_every} if self.held_out_every else {})}

    def load_state_dict(self, state: dict) -> None:
        if state.get("held_out_every") != self.held_out_every:
            from energon_data.loader import DataResumeError
            raise DataResumeError(f"this checkpoint's run trained on every digit scan; training now leaves every "
                                  f"{self.held_out_every}th out for the validation loss, so its data order cannot "
                                  "continue: start a new run (another log.dir)")
        super().load_state_dict(state)

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.tokens), generator=g)

    def next_global_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch."""
        epoch, index = divmod(self.consumed_batches, self.batches_per_epoch)
        order = self._order(epoch)[index * self.global_batch_size:(index + 1) * self.global_batch_size]
        per_rank = self.global_batch_size // self.dp_size
        mine = order[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        self.consumed_batches += 1
        return self.micro_batches(mine)

    def micro_batches(self, samples: torch.Tensor) -> list[MicroBatch]:
        """The samples at ``samples`` (indices), in that order, as micro-batches of ``micro_batch_size``."""
        return [MicroBatch.dense(self.tokens[idx], self.grid, self.labels[idx], **self._text(idx))
                for idx in samples.split(self.micro_batch_size)]

    def _text(self, idx: torch.Tensor) -> dict:
        if self.texts is None:
            return {}
        texts = [self.texts[i] for i in idx.tolist()]
        return dict(text_emb=torch.cat(texts), cu_seqlens_text=cumsum0([len(t) for t in texts]))


class MockLatentSource(_GlobalBatchCounter):
    """Random latents and labels (as NeMo's mock recipes), for smoke tests and benchmarks without a
    dataset. Without ``shapes``: dense batches of ``(1, image_size, image_size)`` latents. With
    ``shapes``: each micro-batch is ``micro_batch_size`` packs of ``max_seq_len`` tokens filled with
    samples of shapes drawn from the list (video-like packed sequences)."""

    def __init__(self, *, channels: int, image_size: int, num_classes: int, patch_size: tuple, shapes=None,
                 max_seq_len: int = 1024, pad_multiple: int = 1, text_dim: int = 0, max_text_len: int = 8, **kw):
        super().__init__(**kw)
        self.text_dim, self.max_text_len = text_dim, max_text_len
        self.channels, self.num_classes = channels, num_classes
        self.patch_t, self.patch = patch_size[0], tuple(patch_size[1:])
        self.shapes = [tuple(s) for s in shapes] if shapes else [(1, image_size, image_size)]
        self.packed = shapes is not None
        self.max_seq_len, self.pad_multiple = max_seq_len, pad_multiple
        self._pool, self._ahead = None, None  # the next global batch, drawn on a thread (next_global_batch)
        for shape in self.shapes:
            n = self._tokens(shape)
            if round_up(n, pad_multiple) > max_seq_len and self.packed:
                raise ConfigError(f"data.mock_latent_shapes entry {list(shape)} has {n} tokens, more than "
                                  f"data.max_seq_len={max_seq_len}; raise data.max_seq_len or use smaller shapes")

    def _tokens(self, shape) -> int:
        t, h, w = shape
        if t % self.patch_t or h % self.patch[0] or w % self.patch[1]:
            raise ConfigError(f"mock latent shape {list(shape)} is not divisible by the model's patch sizes "
                              f"(pt={self.patch_t}, p={self.patch}); change data.mock_latent_shapes/image_size")
        return (t // self.patch_t) * (h // self.patch[0]) * (w // self.patch[1])

    def _sample(self, g: torch.Generator) -> tuple[torch.Tensor, tuple, int]:
        shape = self.shapes[int(torch.randint(len(self.shapes), (1,), generator=g))]
        latent = torch.randn(1, self.channels, *shape, generator=g)
        tokens, grid = patchify(latent, self.patch, self.patch_t)
        return tokens[0], grid, int(torch.randint(max(self.num_classes, 1), (1,), generator=g))

    def _pack(self, g: torch.Generator) -> list:
        """Samples filled in order until the next one does not fit (at least one per pack)."""
        samples, used = [], 0
        while True:
            tokens, grid, label = self._sample(g)
            need = round_up(len(tokens), self.pad_multiple)
            if samples and used + need > self.max_seq_len:
                return samples
            samples.append((tokens, grid, label))
            used += need

    def _packed_batch(self, g: torch.Generator) -> MicroBatch:
        chunks, seqlens, starts, grids, labels, offset = [], [], [], [], [], 0
        for _ in range(self.micro_batch_size):
            pack_start = offset
            for tokens, grid, label in self._pack(g):
                starts.append(offset)
                seqlens.append(len(tokens))
                grids.append(grid)
                labels.append(label)
                padded = round_up(len(tokens), self.pad_multiple)
                chunks.append(torch.nn.functional.pad(tokens, (0, 0, 0, padded - len(tokens))))
                offset += padded
            tail = pack_start + self.max_seq_len - offset  # the pack's padding goes to its last sample
            chunks.append(chunks[-1].new_zeros(tail, chunks[-1].shape[1]))
            offset += tail
        cu = torch.tensor([0] + seqlens, dtype=torch.int64).cumsum(0).int()
        cu_padded = torch.tensor(starts + [offset], dtype=torch.int32)
        return MicroBatch.packed(torch.cat(chunks), cu, torch.tensor(grids), torch.tensor(labels), cu_padded,
                                 **self._text(len(labels), g))

    def _text(self, n: int, g: torch.Generator) -> dict:
        """Random text of 1..max_text_len tokens per sample (text families), drawn after the latents so
        the latents are the same with or without text."""
        if not self.text_dim:
            return {}
        lens = torch.randint(1, self.max_text_len + 1, (n,), generator=g).tolist()
        return dict(text_emb=torch.randn(sum(lens), self.text_dim, generator=g), cu_seqlens_text=cumsum0(lens))

    def next_global_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch. The one after it is drawn on a thread
        meanwhile, while the device trains on this one: a batch is a function of its index alone, so
        the position stays exact (a resume or a skip just draws anew), and the host, when it sets the
        pace, does not spend its step on random numbers (an H100's host spent 43-61 ms per
        MovieGen-3B step drawing 8k-token packs)."""
        step, self.consumed_batches = self.consumed_batches, self.consumed_batches + 1
        ahead, self._ahead = self._ahead, None
        out = ahead[1].result() if ahead is not None and ahead[0] == step else self.global_batch(step)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mock-batches")
        self._ahead = (step + 1, self._pool.submit(self.global_batch, step + 1))
        return out

    def state_dict(self) -> dict:
        if self._ahead is not None:  # no draw running while a checkpoint is taken: an asynchronous save forks
            self._ahead[1].result()
        return super().state_dict()

    def global_batch(self, step: int) -> list[MicroBatch]:
        per_rank = self.global_batch_size // self.dp_size
        out, n_micro = [], per_rank // self.micro_batch_size
        for micro in range(n_micro):
            # Keyed by the micro-batch's place in the global batch: any data-parallel split of the
            # same global batch draws the same samples.
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 65_537 + self.dp_rank * n_micro + micro)
            if self.packed:
                out.append(self._packed_batch(g))
            else:
                b = self.micro_batch_size
                latents = torch.randn(b, self.channels, *self.shapes[0], generator=g)
                tokens, grid = patchify(latents, self.patch, self.patch_t)
                labels = torch.randint(max(self.num_classes, 1), (b,), generator=g)
                out.append(MicroBatch.dense(tokens, grid, labels, **self._text(b, g)))
        return out


HELD_OUT_EVERY = 10
"""The built-in digits keep every 10th scan (179 of 1,797) out of training, for the validation loss."""


def digits_split(size: int, *, held_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The built-in digits' training scans, or (``held_out``) the ones kept for validation."""
    from energon_data.datasets import load_digits
    images, labels = load_digits(size=size)
    keep = (torch.arange(len(images)) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out
    return images[keep], labels[keep]


def builtin_validation_batches(data: DataConfig, model_config, *, global_batches: int, micro_batch_size: int,
                               seed: int, pad_multiple: int = 1) -> list[list[MicroBatch]]:
    """The validation data of a built-in source as ``global_batches`` global batches (fewer when the held-out
    split holds fewer), each its micro-batches in one-process order: the digits' held-out scans, new
    ``moving_digits`` clips (seed 1; training's are seed 0), or ``mock`` latents of another seed."""
    g = data.global_batch_size
    if data.name == "mock":
        source = build_builtin_source(dataclasses.replace(data, micro_batch_size=micro_batch_size), model_config,
                                      dp_rank=0, dp_size=1, seed=seed + 1, pad_multiple=pad_multiple)
        return [source.global_batch(k) for k in range(global_batches)]
    texts = None
    if data.name == "digits":
        images, labels = digits_split(data.image_size, held_out=True)
        patch_t = 1
    elif data.name == "moving_digits":
        from energon_data.datasets import moving_digits, moving_digits_text_encoder
        videos = moving_digits(global_batches * g, frames=data.video_frames, size=data.image_size, seed=1, max_speed=2)
        images, labels, patch_t = videos.videos, videos.labels, model_config.patch_size_t
        texts = moving_digits_text_encoder().encode(list(videos.captions))
    else:
        raise ConfigError(f"unknown built-in dataset data.name={data.name!r}")
    global_batches = min(global_batches, len(images) // g)
    if global_batches < 1:
        raise ConfigError(f"trainer.val_samples: the held-out split of data.name={data.name!r} has {len(images)} "
                          f"samples, fewer than one global batch (data.global_batch_size={g}); lower "
                          "data.global_batch_size or set trainer.val_interval=0")
    n = global_batches * g
    held_out = InMemoryImageLoader(images[:n], labels[:n], patch_size=model_config.patch_size, patch_size_t=patch_t,
                                   texts=texts and texts[:n], global_batch_size=g, micro_batch_size=micro_batch_size,
                                   dp_rank=0, dp_size=1, seed=seed)
    return [held_out.micro_batches(torch.arange(k * g, (k + 1) * g)) for k in range(global_batches)]


def build_builtin_source(data: DataConfig, model_config, *, dp_rank: int, dp_size: int, seed: int,
                         pad_multiple: int = 1):
    """The in-memory source named by ``data.name``."""
    common = dict(global_batch_size=data.global_batch_size, micro_batch_size=data.micro_batch(dp_size),
                  dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    if data.name == "digits":
        images, labels = digits_split(data.image_size, held_out=False)
        return InMemoryImageLoader(images, labels, patch_size=model_config.patch_size, held_out_every=HELD_OUT_EVERY,
                                   **common)
    if data.name == "moving_digits":
        from energon_data.datasets import moving_digits, moving_digits_text_encoder
        videos = moving_digits(data.num_videos, frames=data.video_frames, size=data.image_size, seed=0,
                               max_speed=2)  # a fixed dataset, like the digits
        captions = sorted(set(videos.captions))  # 40 distinct ones: encode each once
        encoded = dict(zip(captions, moving_digits_text_encoder().encode(captions)))
        return InMemoryImageLoader(videos.videos, videos.labels, patch_size=model_config.patch_size,
                                   patch_size_t=model_config.patch_size_t,
                                   texts=[encoded[c] for c in videos.captions], **common)
    if data.name == "mock":
        p = model_config.patch_size
        return MockLatentSource(channels=model_config.in_channels, image_size=data.image_size,
                                num_classes=model_config.num_classes, patch_size=(model_config.patch_size_t, p, p),
                                shapes=data.mock_latent_shapes, max_seq_len=data.max_seq_len,
                                pad_multiple=pad_multiple, text_dim=model_config.text_dim, **common)
    raise ConfigError(f"unknown built-in dataset data.name={data.name!r}; use 'digits', 'moving_digits' or 'mock', or set "
                      "data.path to a prepared energon dataset")
