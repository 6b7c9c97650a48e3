"""GPU checks: run only where CUDA is present (skipped on the CPU CI, which has none)."""
import importlib.util

import pytest
import torch

from kernels.local_attention import local_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_BACKENDS = ["sdpa"] + (["flash_attn"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_attention_backends_match_float64(backend, packed):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 96, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 40, 90], dtype=torch.int32, device="cuda") if packed else None
    out, lse = local_attention(q, k, v, cu_seqlens_q=cu, backend=backend, return_lse=True)
    ref, ref_lse = local_attention(q.double(), k.double(), v.double(), cu_seqlens_q=cu, backend="math64",
                                   return_lse=True)
    rows = slice(0, 90) if packed else slice(None)
    torch.testing.assert_close(out[:, rows].double(), ref[:, rows], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[..., rows].double(), ref_lse[..., rows], atol=2e-2, rtol=2e-2)
