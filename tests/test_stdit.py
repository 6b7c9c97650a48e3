"""The spatial-temporal DiT (``model.family=stdit``): spatial and temporal attention against
per-frame / per-position attention, the layer at init, packed == dense with mixed grids, FLOPs,
presets and the layouts it refuses."""
import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.models import Conditioning
from dit_mcore.models.registry import get_family
from dit_mcore.models.st_attention import STPattern, st_attention, st_plans
from dit_mcore.models.text import TextContext
from dit_mcore.models.flops import dit_flops
from energon_data.batch import MicroBatch
from energon_data.tokens import patchify
from family_models import assert_flops_match, count_params, counted_flops, randomize
from megatron_env import single_process_world

FAMILY = get_family("stdit")
TEXT_DIM = 32


@pytest.fixture(scope="module")
def world():
    single_process_world()


def _model(**overrides):
    cfg = FAMILY.make_config("stdit-tiny", **overrides)
    return cfg, FAMILY.build(cfg, backend="local", init_seed=0)


def _attend64(q, k, v):
    """float64 softmax attention of ``[n, h, d]`` tensors."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_spatial_and_temporal_attention_equal_per_frame_and_per_position_attention():
    # A packed stream: a 3-frame video of 4 positions, 2 padding tokens, an image of 6 positions.
    pattern = STPattern(starts=(0, 14), grids=((3, 4), (1, 6)), length=20)
    q, k, v = (torch.randn(20, 1, 2, 8) for _ in range(3))
    for kind in ("spatial", "temporal"):
        out = st_attention(q, k, v, kind=kind, pattern=pattern, backend="math64").view(20, 2, 8)
        ref = torch.zeros(20, 2, 8, dtype=torch.float64)
        for start, (frames, positions) in zip(pattern.starts, pattern.grids):
            idx = torch.arange(start, start + frames * positions).view(frames, positions)
            groups = idx if kind == "spatial" else idx.t()  # rows: one frame / one position
            for rows in groups:
                ref[rows] = _attend64(q[rows, 0], k[rows, 0], v[rows, 0])
        real = torch.cat([torch.arange(0, 12), torch.arange(14, 20)])
        torch.testing.assert_close(out[real].double(), ref[real], rtol=1e-5, atol=1e-5)
    # The image's temporal attention is over one frame: its output is v.
    img = st_attention(q, k, v, kind="temporal", pattern=pattern, backend="math64").view(20, 2, 8)[14:]
    torch.testing.assert_close(img, v[14:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_planned_spatial_and_temporal_attention_equal_the_autograd_path(compiled):
    """The ST attention as planned operators (what compiled layers run): the same outputs and
    gradients as the autograd path, eagerly and compiled as one graph (``fullgraph``), whose inputs
    the plans are, so another packing reuses it."""
    import torch._dynamo

    torch._dynamo.reset()

    def attend(q, k, v, kind, pattern, plans):
        return st_attention(q, k, v, kind=kind, pattern=pattern, plans=plans)
    planned = torch.compile(attend, fullgraph=True, dynamic=False) if compiled else attend
    patterns = (STPattern(starts=(0, 14), grids=((3, 4), (1, 6)), length=20),  # video, padding, image
                STPattern(starts=(0, 8), grids=((2, 4), (3, 4)), length=20))  # another packing, same length
    for pattern in patterns:
        q, k, v = (torch.randn(20, 1, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        dout = torch.randn(20, 1, 16, dtype=torch.float64)
        for kind in ("spatial", "temporal"):
            want = torch.autograd.grad((attend(q, k, v, kind, pattern, None) * dout).sum(), (q, k, v))
            with torch._dynamo.config.patch(error_on_recompile=pattern is patterns[1]):
                out = planned(q, k, v, kind, pattern, st_plans(pattern, q.device))
            torch.testing.assert_close(out, attend(q, k, v, kind, pattern, None), rtol=1e-10, atol=1e-12)
            for got, ref in zip(torch.autograd.grad((out * dout).sum(), (q, k, v)), want):
                torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_planned_spatial_and_temporal_attention_on_the_gpu_in_bf16():
    """On CUDA the planned ST attention (varlen kernels, the temporal reorders as device tensors) in
    one compiled graph equals the autograd path's bf16 values."""
    import torch._dynamo

    torch._dynamo.reset()
    pattern = STPattern(starts=(0, 96), grids=((3, 32), (1, 24)), length=128)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(128, 1, 4, 64, generator=g).cuda().bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn(128, 1, 256, generator=g).cuda().bfloat16()

    def attend(q, k, v, kind, plans):
        return st_attention(q, k, v, kind=kind, pattern=pattern, plans=plans)
    compiled = torch.compile(attend, fullgraph=True)
    for kind in ("spatial", "temporal"):
        ref = attend(q, k, v, kind, None)
        ref_grads = torch.autograd.grad((ref * dout).sum(), (q, k, v))
        out = compiled(q, k, v, kind, st_plans(pattern, q.device))
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for got, want in zip(torch.autograd.grad((out * dout).sum(), (q, k, v)), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the same kernels, summed in another order


def test_plans_under_context_parallel():
    """Dense video under CP switches frames and positions (traced all-to-alls, no plans); a packed
    stream's piece attends to keys gathered over the CP group, which the plans name."""
    group = object()
    assert st_plans(STPattern((0,), ((2, 4),), 4, cp_group=group), "cpu") is None
    plans = st_plans(STPattern((0,), ((2, 4),), 8, cp_group=group, query_range=(0, 4)), "cpu")
    assert plans.group is not None and plans.q_order.numel() == 4 and plans.kv_order.numel() == 8


def _gathered_child(rank, world):
    """A packed stream's piece under CP: the planned form (the all-gather operator, the functional
    gather and the reorders as plans) compiled as one graph against the eager gathered path."""
    import torch._dynamo
    import torch.distributed as dist

    pattern = STPattern(starts=(0, 12), grids=((3, 4), (2, 3)), length=20, cp_group=dist.group.WORLD,
                        query_range=(rank * 10, (rank + 1) * 10))  # samples straddle the pieces; 2 padding tokens
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(20, 1, h, 8, generator=g, dtype=torch.float64)[rank * 10:(rank + 1) * 10]
                     for h in (4, 4, 4, 4))
    dout = dout.flatten(2)
    errors = {}
    for kind in ("spatial", "temporal"):
        def attend(q, k, v, plans):
            return st_attention(q, k, v, kind=kind, pattern=pattern, plans=plans)
        torch._dynamo.reset()
        compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
        results = []
        for fn, plans in ((attend, None), (compiled, st_plans(pattern, "cpu"))):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, plans)
            results.append([out.detach(), *torch.autograd.grad((out * dout).sum(), leaves)])
        errors[kind] = [(a - b).abs().max().item() for a, b in zip(*results)]
    return errors


def test_planned_attention_of_a_packed_piece_under_context_parallel_equals_the_gathered_path():
    from dist_utils import run_distributed

    for rank, errors in enumerate(run_distributed(_gathered_child, 2)):
        for kind, err in errors.items():
            assert max(err) < 1e-12, (rank, kind, err)


def test_layer_has_spatial_temporal_cross_and_is_identity_at_init(world):
    cfg, model = _model()
    layer = model.layers[0]
    assert layer.adaLN_modulation.chunks == 12
    assert layer.self_attention.core_attention.st_kind == "spatial"
    assert layer.temporal_attention.core_attention.st_kind == "temporal"
    x, grid = patchify(torch.randn(2, 4, 3, 8, 8), 2)
    h = torch.randn(x.shape[1], 2, cfg.hidden_size)
    text = TextContext.from_list([torch.randn(3, TEXT_DIM), torch.randn(2, TEXT_DIM)])
    ctx, cparams = model._text(text, None, x.shape[1], 2, 2)
    params = model._st_params(None, None, grid, x.shape[1], 2, x.device)
    cond = Conditioning(model.conditioning(torch.tensor([1.0, 2.0]), None))
    out = layer(h, cond, context=ctx, context_params=cparams, packed_seq_params=params)
    assert torch.equal(out, h)


def test_dense_batch_equals_each_sample_alone_and_packed(world):
    _, model = _model(attention_backend_name="math64")
    randomize(model)
    g = torch.Generator().manual_seed(1)
    tokens, grid = patchify(torch.randn(3, 4, 3, 8, 8, generator=g), 2)  # 3 frames of 4x4 tokens
    t = torch.tensor([3.0, 400.0, 900.0])
    texts = [torch.randn(n, TEXT_DIM, generator=g) for n in (3, 1, 5)]
    dense = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    for i in range(3):
        alone = model(tokens[i:i + 1].transpose(0, 1), t[i:i + 1], grid=grid,
                      context=TextContext.from_list([texts[i]]))
        torch.testing.assert_close(alone[:, 0], dense[:, i], rtol=1e-5, atol=1e-5)
    image, igrid = patchify(torch.randn(1, 4, 4, 8, generator=g), 2)  # one frame of 2x4 tokens
    n, pad = tokens.shape[1], torch.zeros(3, tokens.shape[-1])
    stream = torch.cat([tokens[0], pad, image[0], tokens[2], pad])
    batch = MicroBatch.packed(stream, torch.tensor([0, n, n + 8, 2 * n + 8], dtype=torch.int32),
                              torch.tensor([grid, igrid, grid]), torch.zeros(3),
                              torch.tensor([0, n + 3, n + 11, 2 * n + 14], dtype=torch.int32))
    out = model(stream[:, None], t, batch=batch, context=TextContext.from_list(texts))[:, 0]
    torch.testing.assert_close(out[:n], dense[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[n + 11:2 * n + 11], dense[:, 2], rtol=1e-5, atol=1e-5)
    image_alone = model(image.transpose(0, 1), t[1:2], grid=igrid, context=TextContext.from_list([texts[1]]))
    torch.testing.assert_close(out[n + 3:n + 11], image_alone[:, 0], rtol=1e-5, atol=1e-5)


def test_flops_match_torch_flop_counter(world):
    cfg, model = _model(attention_backend_name="math64")
    randomize(model)
    tokens, grid = patchify(torch.randn(2, 4, 4, 8, 8), 2)  # 4 frames x 16 positions
    text = TextContext.from_list([torch.randn(6, TEXT_DIM), torch.randn(4, TEXT_DIM)])
    counted = counted_flops(lambda: model(tokens.transpose(0, 1), torch.tensor([1.0, 2.0]), grid=grid,
                                          context=text))
    f = dit_flops(cfg, [64, 64], text.lens, frames=[4, 4])
    assert_flops_match(counted, f)
    full = dit_flops(FAMILY.make_config("stdit-tiny", spatial_temporal=True), [64], [6], frames=[1])
    assert f.attention < 2 * full.attention  # 4 frames split: cheaper than one 64-token attention each
    with pytest.raises(ValueError, match="frames"):
        dit_flops(cfg, [64], [6])


def test_preset_sizes(world):
    cfg = FAMILY.make_config("ST-DiT-XL/2")
    h = cfg.hidden_size
    count, per_layer = count_params(FAMILY, "ST-DiT-XL/2")
    # Per layer: spatial, temporal and cross-attention 4h^2 each (+ biases, QK norms), MLP 8h^2, 12 adaLN
    # chunks 12h^2. (OpenSora's STDiT-XL/2 counts 0.72B: it shares one adaLN over all layers.)
    assert per_layer == pytest.approx(32 * h * h, rel=0.01)
    assert count == pytest.approx(1.21e9, rel=0.01)


def test_config_errors(world):
    with pytest.raises(ConfigError, match="spatial_temporal=False"):
        FAMILY.make_config("stdit-tiny", spatial_temporal=False)
    assert FAMILY.make_config("ST-DiT-B/2").text_dim == 4096


def _switch_worker(rank, world):
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.initialize import initialize_distributed
    from dit_mcore.kernels.comm_counter import count_comm
    initialize_distributed(ParallelConfig(context_parallel_size=2), seed=0)
    g = torch.Generator().manual_seed(0)
    tokens, grid = patchify(torch.randn(2, 4, 4, 8, 8, generator=g), 2)  # 4 frames x 16 positions
    text = TextContext.from_list([torch.randn(3, TEXT_DIM, generator=g), torch.randn(2, TEXT_DIM, generator=g)])
    results = {}
    for mode in ("dsp", "dsp_overlap"):
        cfg = FAMILY.make_config("stdit-tiny", context_parallel_size=2, st_attention=mode,
                                 attention_backend_name="math64")
        model = randomize(FAMILY.build(cfg, backend="local", init_seed=0))
        with count_comm() as comm:
            out = model(tokens.transpose(0, 1), torch.tensor([5.0, 700.0]), grid=grid, context=text)
        results[mode] = {"out": out.detach(), "a2a_calls": comm.calls("all_to_all_single"),
                         "a2a_bytes": comm.bytes_sent("all_to_all_single"), "layers": cfg.num_layers,
                         "hidden_bytes": 32 * 2 * cfg.hidden_size * 4}  # this rank's 2 frames x 16 positions x 2 rows
    return results


def test_context_parallel_switch_is_dsp_two_hidden_all_to_alls_per_layer():
    """CP2: each rank holds 2 of 4 frames; per layer, the temporal attention's switch moves the hidden
    states there and back (half of them leave the rank each way); the overlapped variant cuts each
    into two all-to-alls with the same bytes and the same result."""
    from dist_utils import run_distributed
    per_rank = run_distributed(_switch_worker, 2)
    for rank, res in enumerate(per_rank):
        dsp, overlap = res["dsp"], res["dsp_overlap"]
        assert dsp["a2a_calls"] == 2 * dsp["layers"], rank
        assert dsp["a2a_bytes"] == 2 * dsp["layers"] * dsp["hidden_bytes"] // 2, rank
        assert overlap["a2a_calls"] == 4 * dsp["layers"] and overlap["a2a_bytes"] == dsp["a2a_bytes"], rank
        torch.testing.assert_close(overlap["out"], dsp["out"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(per_rank[0]["dsp"]["out"], per_rank[1]["dsp"]["out"], rtol=0, atol=0)


@pytest.mark.parametrize("parallel, model, data, match", [
    (dict(context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 1]), dict(st_attention="mesh"),
     dict(name="mock", image_size=8, mock_latent_shapes=[[2, 8, 8]], max_seq_len=64), "dense video"),
    (dict(context_parallel_size=4), {}, dict(name="moving_digits", video_frames=2), "do not split over 4"),
    (dict(context_parallel_size=2), dict(st_attention="mesh"), dict(name="moving_digits"),
     "hierarchical_context_parallel_sizes=\\[inner, outer\\]"),
    (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[4, 1]), dict(st_attention="mesh"),
     dict(name="moving_digits", image_size=8), "heads over 4 inner ranks"),
])
def test_bad_spatial_temporal_layouts_fail_before_compute(parallel, model, data, match):
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.layout import check_layout
    from energon_data.config import DataConfig
    cfg = FAMILY.make_config("stdit-tiny", num_attention_heads=2, **model)
    with pytest.raises(ConfigError, match=match):
        check_layout(ParallelConfig(**parallel), cfg, DataConfig(**data), world_size=4)
    assert FAMILY.make_config("stdit-tiny", st_attention="mesh").st_attention == "mesh"
    with pytest.raises(ConfigError, match="model.st_attention='ring'"):
        FAMILY.make_config("stdit-tiny", st_attention="ring")


@pytest.mark.parametrize("family, preset", [("stdit", "stdit-tiny"), ("dit_xattn", "xattn-tiny")])
def test_moe_variant_of_text_families(world, family, preset):
    """``model.num_moe_experts`` gives each text family megatron's MoE MLP; routing is per token, so a
    sample's output does not depend on its batch, and the experts train."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    fam = get_family(family)
    cfg = fam.make_config(preset, attention_backend_name="math64", num_moe_experts=4, moe_router_topk=2,
                          add_bias_linear=False, moe_token_dispatcher_type="alltoall")
    model = randomize(fam.build(cfg, backend="local", init_seed=0))
    assert isinstance(model.layers[0].mlp, MoELayer)
    g = torch.Generator().manual_seed(2)
    tokens, grid = patchify(torch.randn(2, 4, 2, 8, 8, generator=g), 2)
    texts = [torch.randn(3, TEXT_DIM, generator=g), torch.randn(2, TEXT_DIM, generator=g)]
    t = torch.tensor([5.0, 600.0])
    both = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    alone = model(tokens[1:].transpose(0, 1), t[1:], grid=grid, context=TextContext.from_list(texts[1:]))
    torch.testing.assert_close(alone[:, 0], both[:, 1], rtol=1e-5, atol=1e-5)
    both.square().mean().backward()
    assert model.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.grad.abs().sum() > 0
