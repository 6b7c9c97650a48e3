"""PipeFusion's displaced patch attention (``dit_mcore.models.displaced_attention``) against its
definition in float64: a patch's queries attend to the keys and values of the whole stream, fresh
for the patches already run in this step and for itself, one step stale for the patches after it."""
import pytest
import torch

from dit_mcore.models.displaced_attention import DisplacedKV


class _Dense:
    """Plain softmax attention of ``[s, b, h, d]`` inputs, output ``[s, b, h*d]`` (the core attention's)."""

    cp_groups, st_kind = {}, None  # one rank, not the ST-DiT

    def _attend(self, q, k, v, params, local=False):
        weights = torch.softmax(torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5, dim=-1)
        return torch.einsum("bhst,tbhd->sbhd", weights, v).flatten(-2)


def test_a_patch_sees_fresh_keys_before_it_and_the_previous_steps_after_it():
    gen = torch.Generator().manual_seed(0)
    step = [[torch.randn(8, 2, 2, 4, generator=gen, dtype=torch.float64) for _ in "qkv"] for _ in range(2)]
    (q0, k0, v0), (q1, k1, v1) = step
    dense, kv = _Dense(), DisplacedKV()
    assert torch.equal(kv.attend(dense, 0, q0, k0, v0), dense._attend(q0, k0, v0, None))  # warm-up: whole stream
    kv.patch = (0, 4)
    got = kv.attend(dense, 0, q1[:4], k1[:4], v1[:4])
    want = dense._attend(q1[:4], torch.cat([k1[:4], k0[4:]]), torch.cat([v1[:4], v0[4:]]), None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    kv.patch = (4, 8)
    got = kv.attend(dense, 0, q1[4:], k1[4:], v1[4:])
    torch.testing.assert_close(got, dense._attend(q1[4:], k1, v1, None), rtol=1e-12, atol=1e-12)
    kv.reset()
    kv.patch = (0, 4)
    with pytest.raises(RuntimeError, match="warm-up"):
        kv.attend(dense, 0, q1[:4], k1[:4], v1[:4])


@pytest.mark.parametrize("kind", ["spatial", "temporal"])
@pytest.mark.parametrize("start, end", [(0, 6), (5, 11), (6, 12)])
def test_displaced_st_attention_is_the_whole_rows_attention_at_the_patchs_queries(kind, start, end):
    """The ST-DiT's displaced attention (queries of tokens [start, end) of every frame-major row, keys of
    the whole rows) equals the rows' spatial / temporal attention read at those queries, in float64;
    ranges that cut frames (5..11 of 3 frames x 4 positions) too."""
    from dit_mcore.models.st_attention import STPattern, displaced_st_attention, st_attention
    frames, positions, rows = 3, 4, 2
    total = frames * positions
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(total, rows, 2, 4, generator=gen, dtype=torch.float64) for _ in "qkv")
    pattern = STPattern(tuple(i * total for i in range(rows)), ((frames, positions),) * rows, rows * total)
    want = st_attention(q, k, v, kind=kind, pattern=pattern)[start:end]
    got = displaced_st_attention(q[start:end], k, v, kind=kind, frames=frames, positions=positions, start=start)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
