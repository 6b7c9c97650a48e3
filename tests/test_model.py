"""The adaLN-Zero DiT: shapes, identity at init, patching, packing invariance, config errors."""
import pytest
import torch

from dit_mcore.errors import ConfigError

from dit_mcore.models.dit.config import PRESETS, preset
from dit_mcore.models import build_model
from energon_data.batch import MicroBatch
from energon_data.tokens import patchify, unpatchify
from dit_mcore.models.embeddings import sincos_pos_embed, timestep_features
from megatron_env import single_process_world


@pytest.fixture(scope="module")
def world():
    single_process_world()


def _randomize(model, std=0.05):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def test_presets_match_dit_paper():
    for size, (layers, hidden, heads) in {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16),
                                           "XL": (28, 1152, 16)}.items():
        for patch in (2, 4, 8):
            cfg = preset(f"DiT-{size}/{patch}")
            assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.patch_size) == \
                (layers, hidden, heads, patch)
            assert cfg.ffn_hidden_size == 4 * hidden
    assert "tiny" in PRESETS


def test_xl2_parameter_count_matches_paper(world):
    # DiT-XL/2 at 256px: 675M parameters in the reference, whose count includes its fixed
    # positional table (256 x 1152, a frozen nn.Parameter); ours computes positions on the fly.
    cfg = preset("DiT-XL/2", num_layers=1)
    one_layer = sum(p.numel() for p in build_model(cfg).parameters())
    cfg2 = preset("DiT-XL/2", num_layers=2)
    two_layers = sum(p.numel() for p in build_model(cfg2).parameters())
    total = one_layer + 27 * (two_layers - one_layer)
    assert abs(total + 256 * 1152 - 675.1e6) < 0.1e6, total


def test_patchify_roundtrip_and_order():
    x = torch.randn(2, 3, 4, 8, 6)
    tokens, grid = patchify(x, patch=2, patch_t=2)
    assert grid == (2, 4, 3) and tokens.shape == (2, 24, 3 * 2 * 2 * 2)
    assert torch.equal(unpatchify(tokens, grid, 3, 2, 2), x)
    # token 0 holds the top-left patch of frames 0..1, ordered (C, pt, ph, pw)
    assert torch.equal(tokens[0, 0], x[0, :, 0:2, 0:2, 0:2].reshape(-1))
    img = torch.randn(2, 4, 8, 8)
    t, g = patchify(img, 2)
    assert torch.equal(unpatchify(t, g, 4, 2), img)


def test_shapes_and_identity_at_init(world):
    cfg = preset("tiny")
    model = build_model(cfg)
    x = torch.randn(3, 4, 8, 8)
    tokens, grid = patchify(x, cfg.patch_size)
    t, y = torch.tensor([1.0, 500.0, 999.0]), torch.tensor([0, 3, 10])  # 10 = null class
    out = model(tokens.transpose(0, 1), t, y, grid=grid)
    assert out.shape == (16, 3, cfg.out_patch_dim)
    assert torch.count_nonzero(out) == 0  # zero-initialised final layer
    # adaLN-Zero: with zero modulation every layer returns its input exactly.
    h = torch.randn(16, 3, cfg.hidden_size)
    cond = model.conditioning(t, y)
    from dit_mcore.models import Conditioning
    for layer in model.layers:
        assert torch.equal(layer(h, Conditioning(cond)), h)


def test_packed_equals_dense_per_sample(world):
    cfg = preset("tiny")
    model = build_model(cfg)
    _randomize(model)
    x = torch.randn(3, 4, 8, 8)
    t, y = torch.tensor([3.0, 400.0, 900.0]), torch.tensor([1, 2, 3])
    tokens, grid = patchify(x, 2)
    dense = model(tokens.transpose(0, 1), t, y, grid=grid).transpose(0, 1)
    # Pack samples of different sizes: 8x8 (16 tokens), 4x8 crop (8 tokens), 8x8, plus 5 padding tokens.
    crop, cgrid = patchify(x[1:2, :, :4], 2)
    packed = torch.cat([tokens[0], crop[0], tokens[2], torch.zeros(5, tokens.shape[-1])])[:, None]
    cu = torch.tensor([0, 16, 24, 40], dtype=torch.int32)
    batch = MicroBatch.packed(packed[:, 0], cu, torch.tensor([grid, cgrid, grid]), y)
    out = model(packed, t, y, batch=batch).squeeze(1)
    torch.testing.assert_close(out[:16], dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[24:40], dense[2], rtol=1e-5, atol=1e-6)
    alone = model(crop.transpose(0, 1), t[1:2], y[1:2], grid=cgrid).transpose(0, 1)[0]
    torch.testing.assert_close(out[16:24], alone, rtol=1e-5, atol=1e-6)


def test_timestep_features_formula():
    t = torch.tensor([0.0, 10.0, 999.0])
    f = timestep_features(t, 8)
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(4) / 4)
    torch.testing.assert_close(f, torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], 1))


def test_sincos_positions_reference_formula():
    import numpy as np
    dim, h, w = 16, 3, 4
    pos = sincos_pos_embed(dim, (1, h, w)).numpy()

    def one_d(d, p):
        omega = 1.0 / 10000 ** (np.arange(d // 2) / (d / 2.0))
        out = np.einsum("m,d->md", p.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    grid = np.meshgrid(np.arange(w), np.arange(h))  # reference: w first
    ref = np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)
    np.testing.assert_allclose(pos, ref, atol=1e-6)
    video = sincos_pos_embed(dim, (3, h, w))
    torch.testing.assert_close(video[: h * w], torch.from_numpy(ref).float())  # frame 0 == image positions
    assert not torch.allclose(video[h * w: 2 * h * w], video[: h * w])


@pytest.mark.parametrize("overrides, field", [
    (dict(hidden_size=66, num_attention_heads=4), "hidden_size"),
    (dict(patch_size=3), "patch_size"),
    (dict(class_dropout_prob=1.5), "class_dropout_prob"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        preset("tiny", **overrides)


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ConfigError, match="DiT-XL/2"):
        preset("DiT-XXL/2")
    with pytest.raises(ConfigError, match="num_layerz"):
        preset("tiny", num_layerz=3)


def test_grid_mismatch_is_clear(world):
    cfg = preset("tiny")
    model = build_model(cfg)
    with pytest.raises(ValueError, match="grid"):
        model(torch.randn(10, 1, cfg.patch_dim), torch.ones(1), torch.zeros(1, dtype=torch.long))


def test_per_sample_padding_changes_nothing(world):
    # TE-style layout: each sample padded to a multiple of 8 (what CP/TP layouts need).
    cfg = preset("tiny")
    model = build_model(cfg)
    _randomize(model)
    x = torch.randn(2, 4, 8, 8)
    t, y = torch.tensor([3.0, 700.0]), torch.tensor([4, 5])
    crop, cgrid = patchify(x[:1, :, :6, :4], 2)  # 6 tokens, padded to 8
    full, grid = patchify(x[1:], 2)  # 16 tokens
    packed = torch.cat([crop[0], torch.full((2, cfg.patch_dim), 7.0), full[0], torch.full((8, cfg.patch_dim), -3.0)])
    batch = MicroBatch.packed(packed, torch.tensor([0, 6, 22], dtype=torch.int32), torch.tensor([cgrid, grid]), y,
                              torch.tensor([0, 8, 32], dtype=torch.int32))
    out = model(packed[:, None], t, y, batch=batch).squeeze(1)
    alone0 = model(crop.transpose(0, 1), t[:1], y[:1], grid=cgrid).transpose(0, 1)[0]
    alone1 = model(full.transpose(0, 1), t[1:], y[1:], grid=grid).transpose(0, 1)[0]
    torch.testing.assert_close(out[:6], alone0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[8:24], alone1, rtol=1e-5, atol=1e-6)


def _graph_nodes(tensor) -> set:
    """Names of the autograd nodes behind ``tensor``."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def _producer(tensor) -> str:
    """The autograd node that made ``tensor``, past reshapes and megatron's TP reduction (an identity
    at TP=1)."""
    node = tensor.grad_fn
    while type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                                  "_ReduceFromModelParallelRegionBackward"):
        node = node.next_functions[0][0]
    return type(node).__name__


def test_aten_linears_equal_megatrons_and_leave_its_autograd_function(world):
    """``model.aten_linears`` (opt-in): the same outputs and gradients as megatron's own linear
    path on the same weights; at TP=1 every spec linear is one aten matmul (the QKV and fc1 biases in
    it: fc1 returns no separate bias), and no megatron linear autograd function is left."""
    import dataclasses

    x = torch.randn(2, 4, 8, 8)
    tokens, grid = patchify(x, 2)
    t, y = torch.tensor([3.0, 400.0]), torch.tensor([1, 2])
    runs, weights = {}, None
    for aten in (True, False):
        model = build_model(dataclasses.replace(preset("tiny"), aten_linears=aten))
        if weights is None:
            _randomize(model)
            weights = model.state_dict()
        model.load_state_dict(weights)
        made = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                module.register_forward_hook(
                    lambda mod, args, out, name=name: made.__setitem__(name, (_producer(out[0]), out[1] is None)))
        out = model(tokens.transpose(0, 1), t, y, grid=grid)
        out.square().mean().backward()
        runs[aten] = out, {n: p.grad for n, p in model.named_parameters()}, _graph_nodes(out), made
    (out_a, grads_a, nodes_a, made_a), (out_m, grads_m, nodes_m, made_m) = runs[True], runs[False]
    megatron_fn = "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    assert megatron_fn in nodes_m and megatron_fn not in nodes_a
    assert len(made_a) == 8  # 2 layers x 4 linears
    for name, (producer, no_bias) in made_a.items():
        kind = name.rsplit(".", 1)[-1]
        # row-parallel linears return their bias apart (the layer adds it before the gate)
        assert (producer, no_bias) == (("AddmmBackward0", True) if kind in ("linear_qkv", "linear_fc1")
                                       else ("MmBackward0", False)), name
        assert made_m[name] == (megatron_fn, kind == "linear_qkv"), name
    torch.testing.assert_close(out_a, out_m, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_m.keys()
    for name in grads_m:
        torch.testing.assert_close(grads_a[name], grads_m[name], rtol=1e-5, atol=1e-6, msg=name)
