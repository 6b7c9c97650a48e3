"""The FLOPs formula against torch's FLOP counter on real forward + backward passes.

Attention runs on the float64 math kernel, whose matrix products the counter sees. Its backward
recomputes ``QK^T`` (as flash attention's does), so the counter sees attention at 3.5x its forward,
the rest at 3x: ``counted = 3 * (forward - attention) + 3.5 * attention`` (model FLOPs count 3x).
"""
import pytest
import torch

from dit_mcore.models.dit.config import preset
from dit_mcore.models import build_model
from dit_mcore.models.flops import DiTFlops, dit_flops, peak_tflops
from energon_data.batch import MicroBatch
from energon_data.tokens import patchify
from family_models import assert_flops_match, counted_flops
from megatron_env import single_process_world

CONFIGS = {
    "dit": dict(num_layers=2, hidden_size=64, num_attention_heads=4, input_size=16),
    "gqa_swiglu": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       gated_linear_unit=True, input_size=16),
    "moe_top2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, input_size=16, num_moe_experts=4,
                     moe_router_topk=2),
}


@pytest.fixture(scope="module")
def world():
    single_process_world()


def _counted(model, cfg, packed: bool) -> tuple[float, list[int]]:
    """FLOPs the counter sees for one forward + backward; the samples' token counts."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, cfg.in_channels, 16, 16, generator=g)
    t, y = torch.tensor([3.0, 400.0, 900.0]), torch.tensor([1, 2, 3])
    tokens, grid = patchify(x, cfg.patch_size)
    if packed:  # 64 + 24 + 40 tokens (crops of the images); no padding, which model FLOPs leave out
        parts = [tokens[0], patchify(x[1:2, :, :6], 2)[0][0], patchify(x[2:3, :, :10], 2)[0][0]]
        grids = torch.tensor([grid, (1, 3, 8), (1, 5, 8)])
        lens = [p.shape[0] for p in parts]
        stream = torch.cat(parts)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        batch = MicroBatch.packed(stream, cu, grids, y)
        run = lambda: model(stream[:, None], t, y, batch=batch)  # noqa: E731
    else:
        lens = [tokens.shape[1]] * 3
        run = lambda: model(tokens.transpose(0, 1), t, y, grid=grid)  # noqa: E731
    return counted_flops(run), lens


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_flops_match_torch_flop_counter(world, name, packed):
    cfg = preset("tiny", **CONFIGS[name], attention_backend_name="math64")
    model = build_model(cfg)
    counted, lens = _counted(model, cfg, packed)
    f = dit_flops(cfg, lens)
    assert f.attention > 0.05 * f.forward  # attention matters in these cases
    assert_flops_match(counted, f)


def test_packed_attention_is_per_sample_and_padding_is_free():
    cfg = preset("tiny", input_size=16)
    one = dit_flops(cfg, [64])
    two = dit_flops(cfg, [64, 64])
    pack = dit_flops(cfg, [128])
    assert two.attention == 2 * one.attention and pack.attention == 2 * two.attention
    assert two.linear == pack.linear == 2 * one.linear


def test_recompute_shows_in_hardware_flops_only():
    f = DiTFlops(embed=1.0, linear=10.0, mlp=20.0, attention=5.0)
    assert f.model == f.hardware == 3 * 36.0
    full = dit_flops(preset("tiny", recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1), [16])
    assert full.hardware == pytest.approx(full.model + full.forward - full.embed)
    sel = dit_flops(preset("tiny", recompute_granularity="selective", recompute_modules=["core_attn"]), [16])
    assert sel.hardware == pytest.approx(sel.model + sel.attention)


def test_peak_table_and_override():
    assert peak_tflops(torch.device("cpu"), "bf16") is None
    assert peak_tflops(torch.device("cpu"), "bf16", override=2.5) == 2.5


def test_trainer_logs_step_flops_tflops_and_mfu(tmp_path):
    import json

    from dit_mcore.training.trainer import pretrain
    from test_training import tiny_run

    cfg = tiny_run(tmp_path, max_steps=2)
    cfg.trainer.peak_tflops = 0.5
    pretrain(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    model_cfg = cfg.model.build(cfg.parallel)
    tokens = (cfg.data.image_size // model_cfg.patch_size) ** 2
    expected = dit_flops(model_cfg, [tokens] * cfg.data.global_batch_size).model
    for m in lines:  # one step per line: TFLOPS = step FLOPs x steps/s
        assert m["model_flops"] == pytest.approx(expected, rel=1e-6)
        steps_per_s = m["samples_per_s"] / cfg.data.global_batch_size
        assert m["tflops_per_gpu"] == pytest.approx(expected * steps_per_s / 1e12, rel=1e-6)
        assert m["mfu"] == pytest.approx(m["tflops_per_gpu"] / 0.5)
        assert m["tokens_per_s_per_gpu"] == pytest.approx(m["tokens_per_s"])
