"""Bin packing: the algorithm against references, and a whole epoch through energon with packing."""
import math
import random

import pytest
import torch

from energon_data.loader import DataConfig, build_val_loader
from energon_data.packing import pack_lengths
from energon_data.task_encoder import patchify_latent
from fixtures import SampleSpec, key_for, latent_for, mixed_specs, write_dataset


def _first_fit_decreasing_bins(lengths, capacity):
    bins = []
    for n in sorted(lengths, reverse=True):
        for b in bins:
            if sum(b) + n <= capacity:
                b.append(n)
                break
        else:
            bins.append([n])
    return len(bins)


@pytest.mark.parametrize("seed", range(5))
def test_pack_lengths_places_each_item_once_within_capacity(seed):
    rng = random.Random(seed)
    cap = 256
    lengths = [rng.choice([rng.randint(1, 64), rng.randint(64, cap)]) for _ in range(rng.randint(1, 300))]
    bins = pack_lengths(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert math.ceil(sum(lengths) / cap) <= len(bins) <= _first_fit_decreasing_bins(lengths, cap)
    assert bins == pack_lengths(lengths, cap)  # deterministic


def test_pack_lengths_rejects_items_it_cannot_place():
    with pytest.raises(ValueError, match="item 1 has length 9"):
        pack_lengths([3, 9], 8)


def test_efficiency_target_with_reasonable_buffer():
    # Mixed workload: 60% images of 64..1024 tokens, 40% videos of 1024..4096 tokens, packed into 8192.
    rng = random.Random(0)
    cap, buffer = 8192, 256
    lengths = [rng.randint(64, 1024) if rng.random() < 0.6 else rng.randint(1024, 4096) for _ in range(20 * buffer)]
    real = rows = 0
    for start in range(0, len(lengths), buffer):
        chunk = lengths[start:start + buffer]
        real += sum(chunk)
        rows += cap * len(pack_lengths(chunk, cap))
    assert real / rows >= 0.97


@pytest.fixture(scope="module")
def epoch_dataset(tmp_path_factory):
    specs = mixed_specs(90, seed=3)
    specs[7] = SampleSpec(1, 8, 8, 4, corrupt="nan")
    specs[11] = SampleSpec(6, 16, 16, 4)  # 384 tokens > max_seq_len
    return write_dataset(tmp_path_factory.mktemp("epoch"), specs, samples_per_shard=20), specs


@pytest.mark.parametrize("dp_size", [1, 2])
def test_one_epoch_every_sample_exactly_once(epoch_dataset, dp_size):
    path, specs = epoch_dataset
    cfg = DataConfig(path=str(path), val_path=str(path), max_seq_len=192, pad_multiple=8, micro_batch_size=2,
                     num_workers=0, packing_buffer_size=16)
    seen, skipped = [], 0
    for rank in range(dp_size):
        for batch in build_val_loader(cfg, dp_rank=rank, dp_size=dp_size):
            seen += batch.keys
            skipped += batch.num_skipped
            assert batch.tokens.shape[0] == 192 * len(batch.samples_per_pack)
            for i, key in enumerate(batch.keys):  # tokens are the patchified latent of that key
                idx = int(key[1:])
                start, n = int(batch.cu_seqlens_padded[i]), int(batch.seqlens[i])
                ref, _ = patchify_latent(latent_for(idx, specs[idx], 4), (1, 2, 2))
                assert torch.equal(batch.tokens[start:start + n], ref)
    too_long = {i for i, sp in enumerate(specs) if sp.frames * sp.height * sp.width // 4 > 192}
    assert 11 in too_long
    expected = sorted(key_for("s", i) for i in range(len(specs)) if i not in too_long | {7})
    assert sorted(seen) == expected  # none lost, none duplicated, ranks disjoint
    assert skipped == len(too_long) + 1
