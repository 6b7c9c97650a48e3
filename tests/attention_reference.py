"""float64 attention with an explicit block-diagonal mask: the reference the kernel tests compare against."""
import torch


def reference_attention(q, k, v, segments, scale=None):
    """``(out, lse)`` in float64; rows without keys -> out 0, lse -inf. GQA by repeating k/v heads."""
    q, k, v = q.double(), k.double(), v.double()
    h, d = q.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or d ** -0.5)
    if segments is not None:
        mask = torch.zeros(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)
        for a, e, c, f in segments.nonempty():
            mask[a:e, c:f] = True
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse
