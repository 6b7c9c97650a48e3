"""benchmarks/fusion_traffic.py: the bytes Inductor's fused kernels would move on an H100, counted on
the CPU. A kernel whose traffic follows from the layer's shapes is checked against that formula, and
torchao's float8 linears must show the casts they add (the reason FP8 did not speed DiT-XL/2 up)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fusion_traffic  # noqa: E402

pytest.importorskip("torchao")


def test_fused_kernel_bytes_follow_the_layer_shapes_and_float8_adds_its_casts(tmp_path):
    from dit_mcore.models.dit.config import preset

    result = fusion_traffic.main(["--preset", "DiT-S/8", "--size", "32", "--batches", "1,2",
                                  "--models", "ours,ours_fp8_tensorwise", "--out", str(tmp_path / "t.json")])
    cfg, tokens = preset("DiT-S/8"), 2 * (32 // 8) ** 2  # the larger batch's tokens
    ours = result["models"]["ours"]
    gelu = [k["bytes"] for k in ours["kernels"]
            if k["fused"] and not k["backward"] and "sigmoid" in k["ops"] and "mm" not in k["ops"]]
    assert gelu == [2 * 2 * cfg.ffn_hidden_size * tokens]  # reads fc1's bf16 output, writes the GELU's
    per_token = ours["bytes_per_token"]
    assert per_token["forward_bytes"] > 0 and per_token["backward_bytes"] > per_token["forward_bytes"]
    fp8 = result["models"]["ours_fp8_tensorwise"]
    assert any("_scaled_mm" in k["ops"] for k in fp8["kernels"])  # the float8 GEMMs were scheduled
    assert result["ratios"]["ours_fp8_tensorwise_over_bf16"] > 1.5  # amax, scale and cast passes
