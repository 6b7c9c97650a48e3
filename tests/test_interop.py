"""Interop with the reference DiTs: our outputs equal diffusers' ``DiTTransformer2DModel`` and a
float64 re-implementation of facebookresearch/DiT's math, for random (non-zero everywhere) weights."""
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from dit_mcore.errors import ConfigError

from dit_mcore.models.dit.config import preset
from dit_mcore.models.dit.interop import (InteropError, export_diffusers, export_facebookresearch, load_diffusers,
                               load_facebookresearch, reference_forward)
from dit_mcore.models import build_model
from megatron_env import single_process_world

# Matches the "tiny" preset: 2 layers, 4 heads x 16, patch 2, 8x8x4 latents, 10 classes.
TINY = dict(layers=2, hidden=64, heads=4, patch=2, size=8, channels=4, classes=10)


@pytest.fixture(scope="module")
def world():
    single_process_world()


class _NoInteropWarnings(warnings.catch_warnings):
    """Fails if the interop code warns that outputs will differ (megatron's own warnings are fine)."""

    def __init__(self):
        super().__init__(record=True)

    def __enter__(self):
        self.log = super().__enter__()
        warnings.simplefilter("always")
        return self.log

    def __exit__(self, *exc):
        super().__exit__(*exc)
        ours = [str(w.message) for w in self.log if "differ" in str(w.message)]
        assert not ours, ours


def _close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert err <= tol * scale, f"max abs error {err:.3g} (reference max {scale:.3g})"


def _inputs(channels=4, size=8, batch=3, classes=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.tensor([0.0, 37.5, 999.0])[:batch]  # ends of the range and a fractional step
    y = torch.tensor([1, classes, 7])[:batch]  # includes the null class
    return x, t, y


def _fill_random(params, seed=0):
    """Weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2): everything non-zero, activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            std = p.shape[1:].numel() ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)


# ----------------------------------------------------------------------------------------------
# diffusers


def _tiny_diffusers(norm_eps=1e-6, same_embedders=True, seed=0):
    from diffusers import DiTTransformer2DModel
    d = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                              num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_eps=norm_eps)
    _fill_random(d.parameters(), seed)
    if same_embedders:  # as in every diffusers DiT checkpoint: one embedder, stored per block
        for block in d.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(d.transformer_blocks[0].norm1.emb.state_dict())
    return d.eval()


def _diffusers_forward(d, x, t, y):
    with torch.no_grad():
        return d(hidden_states=x, timestep=t, class_labels=y).sample


def test_load_diffusers_matches_diffusers_forward(world, tmp_path):
    d = _tiny_diffusers()
    d.save_pretrained(tmp_path)
    with _NoInteropWarnings():  # norm_eps 1e-6: nothing to warn about
        model = load_diffusers(str(tmp_path))
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.patch_size, cfg.input_size,
            cfg.in_channels, cfg.learn_sigma, cfg.num_classes, cfg.timestep_freq_shift) == \
        (2, 64, 4, 2, 8, 4, True, 10, 1.0)
    x, t, y = _inputs()
    with torch.no_grad():
        ours = reference_forward(model, x, t, y)
    ref = _diffusers_forward(d, x, t, y)
    assert ours.shape == ref.shape == (3, 8, 8, 8)
    _close(ours, ref)


def test_load_diffusers_warns_on_numerics_it_cannot_match(world, tmp_path):
    _tiny_diffusers(norm_eps=1e-5).save_pretrained(tmp_path / "eps")
    with pytest.warns(UserWarning, match="norm_eps=1e-05"):
        load_diffusers(str(tmp_path / "eps"))
    _tiny_diffusers(same_embedders=False).save_pretrained(tmp_path / "emb")
    with pytest.warns(UserWarning, match="transformer_blocks.1.norm1.emb"):
        load_diffusers(str(tmp_path / "emb"))


def test_export_diffusers_roundtrip(world, tmp_path):
    from diffusers import DiTTransformer2DModel
    model = build_model(preset("tiny", timestep_freq_shift=1.0))
    _fill_random(model.parameters(), seed=3)
    with _NoInteropWarnings():
        export_diffusers(model, str(tmp_path))
    d = DiTTransformer2DModel.from_pretrained(str(tmp_path), local_files_only=True).eval()
    emb0 = d.transformer_blocks[0].norm1.emb.state_dict()
    assert all(torch.equal(v, d.transformer_blocks[1].norm1.emb.state_dict()[k]) for k, v in emb0.items())
    x, t, y = _inputs(seed=4)
    with torch.no_grad():
        ours = reference_forward(model, x, t, y)
    _close(_diffusers_forward(d, x, t, y), ours)
    back = load_diffusers(str(tmp_path))
    for (name, p), (name2, q) in zip(model.named_parameters(), back.named_parameters()):
        assert name == name2 and torch.equal(p, q), name


# ----------------------------------------------------------------------------------------------
# facebookresearch/DiT: a float64 re-implementation of the original module's math


def _sincos_1d(dim, pos):
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = pos.reshape(-1).double()[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def _fb_pos_embed(dim, gh, gw):
    # np.meshgrid(grid_w, grid_h): grid[0] holds the column (w) coordinate and fills the first half.
    grid_w, grid_h = torch.meshgrid(torch.arange(gw), torch.arange(gh), indexing="xy")
    return torch.cat([_sincos_1d(dim // 2, grid_w), _sincos_1d(dim // 2, grid_h)], dim=1)


def _fb_reference(sd, x, t, y, heads, patch, freq_shift=0.0):
    sd = {k: v.double() for k, v in sd.items()}
    lin = lambda h, name: F.linear(h, sd[f"{name}.weight"], sd[f"{name}.bias"])  # noqa: E731
    ln = lambda h: F.layer_norm(h, h.shape[-1:], eps=1e-6)  # noqa: E731
    mod = lambda h, shift, scale: h * (1 + scale[:, None]) + shift[:, None]  # noqa: E731

    h = F.conv2d(x.double(), sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=patch)
    b, hid, gh, gw = h.shape
    h = h.flatten(2).transpose(1, 2) + _fb_pos_embed(hid, gh, gw)
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / (half - freq_shift))
    args = t.double()[:, None] * freqs[None]
    t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    c = lin(F.silu(lin(t_freq, "t_embedder.mlp.0")), "t_embedder.mlp.2") + sd["y_embedder.embedding_table.weight"][y]
    d = hid // heads
    i = 0
    while f"blocks.{i}.attn.qkv.weight" in sd:
        blk = f"blocks.{i}"
        s_msa, sc_msa, g_msa, s_mlp, sc_mlp, g_mlp = lin(F.silu(c), f"{blk}.adaLN_modulation.1").chunk(6, dim=1)
        qkv = lin(mod(ln(h), s_msa, sc_msa), f"{blk}.attn.qkv").reshape(b, -1, 3, heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = torch.softmax(q @ k.transpose(-2, -1) * d ** -0.5, dim=-1) @ v
        h = h + g_msa[:, None] * lin(attn.transpose(1, 2).reshape(b, -1, hid), f"{blk}.attn.proj")
        m = lin(F.gelu(lin(mod(ln(h), s_mlp, sc_mlp), f"{blk}.mlp.fc1"), approximate="tanh"), f"{blk}.mlp.fc2")
        h = h + g_mlp[:, None] * m
        i += 1
    shift, scale = lin(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    out = lin(mod(ln(h), shift, scale), "final_layer.linear")
    c_out = out.shape[-1] // patch ** 2
    out = torch.einsum("nhwpqc->nchpwq", out.reshape(b, gh, gw, patch, patch, c_out))
    return out.reshape(b, c_out, gh * patch, gw * patch)


def _fb_state_dict(layers=2, hidden=64, heads=4, patch=2, size=8, channels=4, classes=10, learn_sigma=True,
                   seed=0):
    """A random facebookresearch/DiT ``DiT`` state dict (shapes as in the original module)."""
    c_out = channels * (2 if learn_sigma else 1)
    shapes = {"x_embedder.proj.weight": (hidden, channels, patch, patch), "x_embedder.proj.bias": (hidden,),
              "t_embedder.mlp.0.weight": (hidden, 256), "t_embedder.mlp.0.bias": (hidden,),
              "t_embedder.mlp.2.weight": (hidden, hidden), "t_embedder.mlp.2.bias": (hidden,),
              "y_embedder.embedding_table.weight": (classes + 1, hidden)}
    for i in range(layers):
        for name, out_f, in_f in (("attn.qkv", 3 * hidden, hidden), ("attn.proj", hidden, hidden),
                                  ("mlp.fc1", 4 * hidden, hidden), ("mlp.fc2", hidden, 4 * hidden),
                                  ("adaLN_modulation.1", 6 * hidden, hidden)):
            shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = (out_f, in_f), (out_f,)
    for name, out_f in (("final_layer.linear", patch * patch * c_out), ("final_layer.adaLN_modulation.1", 2 * hidden)):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (out_f, hidden), (out_f,)
    sd = {k: torch.empty(s) for k, s in shapes.items()}
    _fill_random(sd.values(), seed)
    side = size // patch
    sd["pos_embed"] = _fb_pos_embed(hidden, side, side).float().unsqueeze(0)
    return sd


@pytest.mark.parametrize("learn_sigma,size", [(True, 8), (False, 16)])
def test_load_facebookresearch_matches_float64_reference(world, learn_sigma, size):
    sd = _fb_state_dict(learn_sigma=learn_sigma, size=size)
    with _NoInteropWarnings():
        model = load_facebookresearch(sd, "tiny")
    assert (model.config.input_size, model.config.learn_sigma, model.config.timestep_freq_shift) == \
        (size, learn_sigma, 0.0)
    x, t, y = _inputs(size=size)
    with torch.no_grad():
        ours = reference_forward(model, x, t, y)
    _close(ours, _fb_reference(sd, x, t, y, heads=4, patch=2))
    back = export_facebookresearch(model)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd if k != "pos_embed")
    torch.testing.assert_close(back["pos_embed"], sd["pos_embed"])


def test_facebookresearch_through_diffusers_agrees(world, tmp_path):
    """fb weights -> ours -> diffusers directory -> ours again: the two loaders agree, and diffusers'
    own forward on the export equals the float64 reference run with diffusers' timestep shift."""
    from diffusers import DiTTransformer2DModel
    sd = _fb_state_dict(seed=5)
    fb_model = load_facebookresearch(sd, "tiny")
    with pytest.warns(UserWarning, match="timestep_freq_shift"):  # fb uses shift 0, diffusers 1
        export_diffusers(fb_model, str(tmp_path))
    via_diffusers = load_diffusers(str(tmp_path))
    for (name, p), (_, q) in zip(fb_model.named_parameters(), via_diffusers.named_parameters()):
        assert torch.equal(p, q), name
    shifted = load_facebookresearch(sd, "tiny", timestep_freq_shift=1.0)
    x, t, y = _inputs(seed=6)
    with torch.no_grad():
        a, b = reference_forward(shifted, x, t, y), reference_forward(via_diffusers, x, t, y)
    assert torch.equal(a, b)
    d = DiTTransformer2DModel.from_pretrained(str(tmp_path), local_files_only=True).eval()
    ref = _fb_reference(sd, x, t, y, heads=4, patch=2, freq_shift=1.0)
    _close(_diffusers_forward(d, x, t, y), ref)
    _close(a, ref)


# ----------------------------------------------------------------------------------------------
# bad inputs


def test_facebookresearch_bad_inputs(world):
    sd = _fb_state_dict()
    with pytest.raises(ConfigError, match="unknown preset 'DiT-Q/2'"):
        load_facebookresearch(sd, "DiT-Q/2")
    missing = {k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"}
    with pytest.raises(InteropError, match=r"missing keys \['blocks.1.mlp.fc2.bias'\]"):
        load_facebookresearch(missing, "tiny")
    with pytest.raises(InteropError, match=r"unexpected keys \['blocks.2.attn.qkv.weight'\]"):
        load_facebookresearch({**sd, "blocks.2.attn.qkv.weight": sd["blocks.0.attn.qkv.weight"]}, "tiny")
    bad = {**sd, "blocks.0.attn.proj.weight": torch.zeros(64, 32)}
    shape_msg = r"blocks.0.attn.proj.weight: checkpoint \(64, 32\), model expects \(64, 64\)"
    with pytest.raises(InteropError, match=shape_msg):
        load_facebookresearch(bad, "tiny")
    with pytest.raises(InteropError, match="missing keys.*blocks.11"):  # wrong preset: DiT-S has 12 blocks
        load_facebookresearch(sd, "DiT-S/2", hidden_size=64, num_attention_heads=4, num_classes=10)
    with pytest.raises(InteropError, match="final_layer.linear.weight has 32 rows"):
        load_facebookresearch(sd, "tiny", in_channels=3)
    with pytest.raises(InteropError, match=r"nested dicts \['ema', 'model'\].*checkpoint\['ema'\]"):
        load_facebookresearch({"model": sd, "ema": sd, "args": None}, "tiny")
    with pytest.warns(UserWarning, match="pos_embed differs"):
        load_facebookresearch({**sd, "pos_embed": sd["pos_embed"] * 2}, "tiny")
    no_pos = {k: v for k, v in sd.items() if k != "pos_embed"}
    with pytest.raises(InteropError, match=r"lacks \['pos_embed'\]"):
        load_facebookresearch(no_pos, "tiny")


def test_diffusers_bad_inputs(world, tmp_path):
    with pytest.raises(InteropError, match="config.json not found"):
        load_diffusers(str(tmp_path))
    _tiny_diffusers().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_layers": 3}))
    with pytest.raises(InteropError, match=r"missing keys \[.*transformer_blocks.2.attn1.to_k.bias"):
        load_diffusers(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "_class_name": "UNet2DModel"}))
    with pytest.raises(InteropError, match="_class_name"):
        load_diffusers(str(tmp_path))
    with pytest.raises(InteropError, match="patch_size_t must be 1"):
        export_diffusers(build_model(preset("tiny", patch_size_t=2)), str(tmp_path / "video"))
