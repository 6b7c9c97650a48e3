"""Task encoder unit tests, driven directly (no loader): patchify, skips, pack layout, THD batch."""
import random
import zlib

import pytest
import torch
from megatron.energon import SkipSample

from energon_data.samples import EncodedSample, LatentSample
from energon_data.task_encoder import LatentTaskEncoder, patchify_latent


def _latent_sample(key, c, t, h, w, *, label=None, text_len=3, fill=None):
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    x = torch.randn(c, t, h, w, generator=g)
    if fill is not None:
        x.view(-1)[0] = fill
    meta = {"kind": "video" if t > 1 else "image"}
    if label is not None:
        meta["label"] = label
    return LatentSample(__key__=key, __restore_key__=(), latent=x.to(torch.bfloat16),
                        text_emb=torch.randn(text_len, 5, generator=g).to(torch.bfloat16), meta=meta)


def test_patchify_matches_elementwise_reference():
    c, (pt, ph, pw) = 3, (2, 2, 3)
    x = torch.randn(c, 4, 6, 9, dtype=torch.float64)
    tokens, grid = patchify_latent(x, (pt, ph, pw))
    t, h, w = grid
    assert grid == (2, 3, 3) and tokens.shape == (t * h * w, c * pt * ph * pw)
    ref = torch.empty_like(tokens)
    for ti in range(t):
        for hi in range(h):
            for wi in range(w):
                row = (ti * h + hi) * w + wi
                for ci in range(c):
                    for a in range(pt):
                        for b in range(ph):
                            for d in range(pw):
                                col = ((ci * pt + a) * ph + b) * pw + d
                                ref[row, col] = x[ci, ti * pt + a, hi * ph + b, wi * pw + d]
    assert torch.equal(tokens, ref)
    # The within-token order (C, pt, ph, pw) is that of a flattened Conv3d weight [hidden, C, pt, ph, pw].
    weight = torch.randn(7, c, pt, ph, pw, dtype=torch.float64)
    conv = torch.nn.functional.conv3d(x[None], weight, stride=(pt, ph, pw))[0]  # [7, t, h, w]
    assert torch.allclose(tokens @ weight.reshape(7, -1).T, conv.permute(1, 2, 3, 0).reshape(-1, 7))


@pytest.mark.parametrize("fill,reason", [(float("nan"), "nonfinite"), (float("inf"), "nonfinite"),
                                         (5e4, "too_large")])
def test_bad_values_are_skipped_and_counted(fill, reason):
    te = LatentTaskEncoder(patch_size=(1, 2, 2), max_seq_len=64, max_abs_value=1e3)
    with pytest.raises(SkipSample):
        te.encode_sample(_latent_sample("bad", 2, 1, 4, 4, fill=fill))
    assert te.skipped[reason] == 1 and sum(te.skipped.values()) == 1


def test_too_long_and_bad_shape_are_skipped_never_truncated():
    te = LatentTaskEncoder(patch_size=(1, 2, 2), max_seq_len=16, pad_multiple=4)
    te.encode_sample(_latent_sample("fits", 2, 1, 8, 8))  # exactly 16 tokens
    with pytest.raises(SkipSample):
        te.encode_sample(_latent_sample("long", 2, 2, 8, 6))  # 24 tokens
    with pytest.raises(SkipSample):
        te.encode_sample(_latent_sample("odd", 2, 1, 5, 4))  # H not divisible by ph
    assert dict(te.skipped) == {"too_long": 1, "bad_shape": 1}
    # The counter travels in the next batch and is reset.
    batch = te.batch([te.encode_sample(_latent_sample("a", 2, 1, 4, 4))])
    assert batch.num_skipped == 2 and batch.skipped_by_reason["too_long"] == 1 and not te.skipped
    assert te.batch([te.encode_sample(_latent_sample("b", 2, 1, 4, 4))]).num_skipped == 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_seq_len .* multiple of pad_multiple"):
        LatentTaskEncoder(max_seq_len=100, pad_multiple=8)
    with pytest.raises(ValueError, match="patch_size"):
        LatentTaskEncoder(patch_size=(2, 2))


def _check_batch(batch, encoded: dict[str, EncodedSample], pad_multiple: int):
    """THD invariants against the individually encoded samples."""
    n = len(batch.keys)
    T = batch.tokens.shape[0]
    cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens_padded.dtype == torch.int32
    assert len(cu) == len(cup) == n + 1 and cu[0] == cup[0] == 0 and cup[-1] == T
    expect_ids = torch.full((T,), -1, dtype=torch.int64)
    for i, key in enumerate(batch.keys):
        s = encoded[key]
        length, start = cu[i + 1] - cu[i], cup[i]
        assert length == len(s.tokens) == int(batch.grids[i].prod())
        assert tuple(batch.grids[i].tolist()) == s.grid and int(batch.labels[i]) == s.label
        assert (cup[i + 1] - start) % pad_multiple == 0 and cup[i + 1] - start >= length
        assert torch.equal(batch.tokens[start:start + length], s.tokens)
        assert not batch.tokens[start + length:cup[i + 1]].any()  # padding rows are zero
        expect_ids[start:start + length] = i
        t, h, w = s.grid
        pos = batch.positions[start:start + length]
        assert torch.equal(pos[:, 0] * h * w + pos[:, 1] * w + pos[:, 2], torch.arange(length))
        text = batch.text_emb[batch.cu_seqlens_text[i]:batch.cu_seqlens_text[i + 1]]
        assert torch.equal(text, s.text_emb)
    assert torch.equal(batch.sample_ids, expect_ids)
    assert torch.equal(batch.loss_mask, expect_ids >= 0)
    assert int(batch.samples_per_pack.sum()) == n


def test_packed_batch_layout_and_no_sample_lost():
    rng = random.Random(0)
    max_len, pad = 96, 8
    te = LatentTaskEncoder(patch_size=(1, 2, 2), max_seq_len=max_len, pad_multiple=pad)
    samples = [_latent_sample(f"k{i}", 3, rng.choice([1, 1, 2, 3]), rng.choice([2, 4, 8]), rng.choice([4, 8, 10]),
                              label=rng.choice([None, 3]), text_len=rng.randint(1, 4)) for i in range(40)]
    encoded = {s.__key__: te.encode_sample(s) for s in samples}
    groups = te.select_samples_to_pack(list(encoded.values()))
    assert sorted(k for g in groups for k in (s.__key__ for s in g)) == sorted(encoded)  # each exactly once
    packs = [te.pack_selected_samples(g) for g in groups]
    assert all(p.tokens.shape == (max_len, 12) for p in packs)
    batch = te.batch(packs[:3])
    assert batch.tokens.shape[0] == 3 * max_len
    assert batch.samples_per_pack.tolist() == [len(g) for g in groups[:3]]
    # Pack boundaries are sample boundaries: pack j ends at row (j+1)*max_len.
    ends = batch.samples_per_pack.cumsum(0)
    assert batch.cu_seqlens_padded[ends].tolist() == [max_len, 2 * max_len, 3 * max_len]
    _check_batch(batch, encoded, pad)


def test_unpacked_batch_is_one_thd_sequence():
    te = LatentTaskEncoder(patch_size=(1, 2, 2), max_seq_len=None, pad_multiple=4, packing=False)
    samples = [_latent_sample("a", 2, 1, 2, 6, label=1), _latent_sample("b", 2, 3, 4, 4), _latent_sample("c", 2, 1, 2, 2)]
    encoded = {s.__key__: te.encode_sample(s) for s in samples}
    batch = te.batch(list(encoded.values()))
    assert batch.cu_seqlens.tolist() == [0, 3, 15, 16]
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 16, 20]
    assert batch.labels.tolist() == [1, -1, -1] and batch.samples_per_pack.tolist() == [1, 1, 1]
    _check_batch(batch, encoded, 4)
