"""split_packed_for_cp: the padded layout, its index maps and per-rank pieces (closed-form checks).

The distributed packed attention itself is checked in test_context_parallel.py (same spawn as
the dense cases, to pay for one spawn per world size).
"""
from __future__ import annotations

import pytest
import torch

from dit_mcore.kernels import Segments, split_packed_for_cp
from dit_mcore.kernels.local_attention import local_attention
from dit_mcore.kernels.local_attention import segment_attention


def test_layout_pads_each_sample_then_the_tail():
    layout = split_packed_for_cp(torch.tensor([0, 5, 6, 15, 18]), cp_size=4, multiple=3)
    assert layout.cu_seqlens_padded.tolist() == [0, 6, 9, 18, 21]
    assert layout.total_len == 24 and layout.shard_len == 6          # tail-padded 21 -> 24
    assert layout.real_index.tolist() == [0, 1, 2, 3, 4, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert layout.is_real().sum() == 18
    assert [layout.shard_range(r) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert layout.cu_seqlens.dtype == layout.cu_seqlens_padded.dtype == torch.int32


def test_default_multiple_is_cp_size():
    layout = split_packed_for_cp(torch.tensor([0, 5, 6]), cp_size=2)
    assert layout.cu_seqlens_padded.tolist() == [0, 6, 8] and layout.total_len == 8


def test_pad_unpad_roundtrip_and_shards():
    layout = split_packed_for_cp(torch.tensor([0, 5, 6, 15]), cp_size=4)
    x = torch.arange(15.0).reshape(1, 15, 1).requires_grad_()
    padded = layout.pad(x)
    assert padded.shape == (1, layout.total_len, 1)
    assert not padded[0, ~layout.is_real()].any()
    torch.testing.assert_close(layout.unpad(padded), x)
    shards = [layout.shard(padded, r) for r in range(4)]
    torch.testing.assert_close(torch.cat(shards, 1), padded)
    padded.sum().backward()  # pad is differentiable: every real token gets gradient 1
    assert torch.equal(x.grad, torch.ones_like(x))


def test_local_cu_seqlens_describe_each_ranks_pieces():
    layout = split_packed_for_cp(torch.tensor([0, 5, 6, 15, 18]), cp_size=4)  # padded [0, 8, 12, 24, 28]
    expect = {0: ([0, 5, 5, 5, 5], [0, 7, 7, 7, 7]), 1: ([0, 0, 1, 3, 3], [0, 1, 5, 7, 7]),
              2: ([0, 0, 0, 7, 7], [0, 0, 0, 7, 7]), 3: ([0, 0, 0, 0, 3], [0, 0, 0, 3, 7])}
    real_global = layout.is_real()
    for rank, (real, padded) in expect.items():
        cu, cu_padded = layout.local_cu_seqlens(rank)
        assert cu.tolist() == real and cu_padded.tolist() == padded
        # the local segments cover exactly this shard's real tokens
        seg = Segments.from_cu_seqlens(cu, cu, cu_padded, cu_padded)
        covered = torch.zeros(layout.shard_len, dtype=torch.bool)
        for a, e, _, _ in seg.nonempty():
            covered[a:e] = True
        assert torch.equal(covered, layout.shard(real_global, rank, dim=0))


def test_packing_never_changes_the_math():
    """Each sample's output in the padded pack equals that sample run alone."""
    lens = [5, 1, 9]
    layout = split_packed_for_cp(torch.tensor([0] + lens).cumsum(0), cp_size=4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, sum(lens), 4, 8, generator=g) for _ in range(3))
    seg = Segments.from_cu_seqlens(layout.cu_seqlens, layout.cu_seqlens, layout.cu_seqlens_padded,
                                   layout.cu_seqlens_padded)
    out, _ = segment_attention(layout.pad(q), layout.pad(k), layout.pad(v), segments=seg, backend="flash_cpu")
    out = layout.unpad(out)
    start = 0
    for n in lens:
        alone = local_attention(q[:, start:start + n], k[:, start:start + n], v[:, start:start + n],
                                backend="math64")
        torch.testing.assert_close(out[:, start:start + n], alone, rtol=1e-5, atol=1e-6)
        start += n


@pytest.mark.parametrize("args, match", [
    ((torch.tensor([1, 4]), 2), "starting at 0"),
    ((torch.tensor([0, 4, 2]), 2), "non-decreasing"),
    ((torch.tensor([0, 4]), 0), "cp_size"),
    ((torch.tensor([0, 0]), 2), "empty pack"),
])
def test_bad_cu_seqlens_raise(args, match):
    with pytest.raises(ValueError, match=match):
        split_packed_for_cp(*args)
