"""The cross-attention DiT (``model.family=dit_xattn``): text reaches each sample's tokens and
nothing else, packed == dense, text dropout is the null text, guidance, presets, FLOPs, errors."""
import json

import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.diffusion.samplers import euler_flow
from dit_mcore.models.dit.xattn import PRESETS
from dit_mcore.models.registry import get_family
from dit_mcore.models.text import TextContext
from dit_mcore.models.flops import dit_flops
from energon_data.batch import MicroBatch
from energon_data.tokens import patchify
from family_models import assert_flops_match, count_params, counted_flops, randomize
from megatron_env import single_process_world

FAMILY = get_family("dit_xattn")
TEXT_DIM = 32


@pytest.fixture(scope="module")
def world():
    single_process_world()


def _model(**overrides):
    cfg = FAMILY.make_config("xattn-tiny", **overrides)
    model = FAMILY.build(cfg, backend="local", init_seed=0)
    return cfg, model


def _inputs(n=3, lens=(3, 1, 5)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, 8, 8, generator=g)
    tokens, grid = patchify(x, 2)
    t = torch.tensor([3.0, 400.0, 900.0])[:n]
    texts = [torch.randn(k, TEXT_DIM, generator=g) for k in lens[:n]]
    return tokens, grid, t, texts


def test_identity_at_init_and_text_reaches_only_its_sample(world):
    cfg, model = _model()
    tokens, grid, t, texts = _inputs()
    h = torch.randn(16, 3, cfg.hidden_size)
    from dit_mcore.models import Conditioning
    ctx, params = model._text(TextContext.from_list(texts), None, 16, 3, 3)
    for layer in model.layers:  # nine zero-initialised adaLN chunks: every layer is the identity
        assert layer.adaLN_modulation.chunks == 9
        assert torch.equal(layer(h, Conditioning(model.conditioning(t, None)), context=ctx, context_params=params), h)
    randomize(model)
    base = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    changed = list(texts)
    changed[1] = torch.randn(4, TEXT_DIM)  # another caption, another length, for sample 1 only
    out = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(changed))
    assert (out[:, 1] - base[:, 1]).abs().max() > 1e-3
    torch.testing.assert_close(out[:, [0, 2]], base[:, [0, 2]], rtol=1e-5, atol=1e-5)


def test_dense_batch_equals_each_sample_alone_and_packed(world):
    _, model = _model(attention_backend_name="math64")
    randomize(model)
    tokens, grid, t, texts = _inputs()
    dense = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    for i in range(3):
        alone = model(tokens[i:i + 1].transpose(0, 1), t[i:i + 1], grid=grid, context=TextContext.from_list([texts[i]]))
        torch.testing.assert_close(alone[:, 0], dense[:, i], rtol=1e-5, atol=1e-5)
    # Packed with padding after each sample, and a cropped sample of another size.
    crop, cgrid = patchify(torch.randn(1, 4, 4, 8), 2)
    pad = torch.zeros(3, tokens.shape[-1])
    stream = torch.cat([tokens[0], pad, crop[0], tokens[2], pad])
    batch = MicroBatch.packed(stream, torch.tensor([0, 16, 24, 40], dtype=torch.int32),
                              torch.tensor([grid, cgrid, grid]), torch.zeros(3),
                              torch.tensor([0, 19, 27, 46], dtype=torch.int32))
    out = model(stream[:, None], t, batch=batch, context=TextContext.from_list(texts))[:, 0]
    torch.testing.assert_close(out[:16], dense[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[27:43], dense[:, 2], rtol=1e-5, atol=1e-5)
    crop_alone = model(crop.transpose(0, 1), t[1:2], grid=cgrid, context=TextContext.from_list([texts[1]]))[:, 0]
    torch.testing.assert_close(out[19:27], crop_alone, rtol=1e-5, atol=1e-5)


def test_dropped_text_is_the_learned_null_text(world):
    _, model = _model(attention_backend_name="math64")
    randomize(model)
    tokens, grid, t, texts = _inputs()
    keep = torch.tensor([True, False, True])
    dropped = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext(torch.cat(texts), (3, 1, 5), keep))
    # Whatever the caption and its length, a dropped text is one null token.
    null = TextContext(torch.zeros(1, TEXT_DIM), (1,), torch.tensor([False]))
    alone = model(tokens[1:2].transpose(0, 1), t[1:2], grid=grid, context=null)
    torch.testing.assert_close(dropped[:, 1], alone[:, 0], rtol=1e-5, atol=1e-5)
    kept = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    torch.testing.assert_close(dropped[:, [0, 2]], kept[:, [0, 2]], rtol=1e-6, atol=1e-6)
    # The null embedding is learned: it gets a gradient only from dropped samples.
    model.zero_grad()
    dropped.square().sum().backward()
    assert model.text_embedder.null.grad.abs().sum() > 0


def test_text_guidance_is_one_doubled_call_with_the_null_text(world):
    _, model = _model(attention_backend_name="math64")
    randomize(model)
    fn = FAMILY.image_model_fn(model, model.config)
    _, _, _, texts = _inputs(2)
    text = TextContext.from_list(texts)
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    calls = []

    def counted(x, timestep, labels=None, text=None):
        calls.append(x.shape[0])
        return fn(x, timestep, labels, text=text)

    guided = euler_flow(counted, noise, 1, cfg_scale=3.0, text=text, shift=1.0)
    assert calls == [4]
    null = TextContext(text.emb, text.lens, torch.zeros(2, dtype=torch.bool))
    t1 = torch.ones(2)
    cond, uncond = fn(noise, t1 * 1000, text=text), fn(noise, t1 * 1000, text=null)
    v = uncond + 3.0 * (cond - uncond)  # the flow model's output is the velocity
    torch.testing.assert_close(guided, noise - v, rtol=1e-5, atol=1e-5)


def test_qk_norm_in_self_and_cross_attention(world):
    _, model = _model()
    names = {n for n, _ in model.named_parameters()}
    for part in ("self_attention", "cross_attention"):
        assert f"layers.0.{part}.q_layernorm.weight" in names and f"layers.0.{part}.k_layernorm.weight" in names
    _, plain = _model(qk_layernorm=False)
    assert not any("layernorm" in n for n, _ in plain.named_parameters())


def test_flops_match_torch_flop_counter(world):
    cfg, model = _model(attention_backend_name="math64", input_size=16)
    randomize(model)
    x = torch.randn(2, 4, 16, 16)
    tokens, grid = patchify(x, 2)
    text = TextContext.from_list([torch.randn(40, TEXT_DIM), torch.randn(24, TEXT_DIM)])
    counted = counted_flops(lambda: model(tokens.transpose(0, 1), torch.tensor([1.0, 2.0]), grid=grid,
                                          context=text))
    f = dit_flops(cfg, [64, 64], text.lens)
    assert_flops_match(counted, f)
    assert f.attention > dit_flops(cfg, [64, 64], [1, 1]).attention  # text length counts
    with pytest.raises(ValueError, match="context_lens"):
        dit_flops(cfg, [64])


@pytest.mark.parametrize("name, billions", [("DiT-XAttn-7B", 7.0), ("DiT-XAttn-28B", 28.0)])
def test_preset_sizes(world, name, billions):
    cfg = FAMILY.make_config(name)
    h, layers = cfg.hidden_size, cfg.num_layers
    # Per layer: self-attention 4h^2, cross-attention 4h^2, MLP 8h^2, nine adaLN chunks 9h^2 (+ bias).
    per_layer = 25 * h * h + 9 * h + 4 * cfg.kv_channels
    count = count_params(FAMILY, name)[0]
    assert count == pytest.approx(layers * per_layer, rel=0.02)
    assert count == pytest.approx(billions * 1e9, rel=0.1)


def test_presets_and_config_errors():
    assert PRESETS["DiT-XAttn-7B"]["num_layers"] == 32 and PRESETS["DiT-XAttn-7B"]["hidden_size"] == 3072  # NeMo
    assert FAMILY.make_config("DiT-XAttn-XL/2").text_dim == 4096
    with pytest.raises(ConfigError, match="model.text_dim=0"):
        FAMILY.make_config("xattn-tiny", text_dim=0)
    with pytest.raises(ConfigError, match="model.family=dit_xattn"):
        get_family("dit").make_config("tiny", text_dim=32)
    with pytest.raises(ConfigError, match="unknown preset 'DiT-XL/2' for model.family=dit_xattn"):
        FAMILY.make_config("DiT-XL/2")


def test_text_family_needs_text_data(tmp_path):
    from dit_mcore.training.config import DataConfig, ModelConfig, RunConfig
    from dit_mcore.training.validate import run_problems
    cfg = RunConfig(model=ModelConfig(family="dit_xattn", preset="xattn-tiny", in_channels=1),
                    data=DataConfig(name="digits", image_size=8))
    cfg.log.dir = str(tmp_path)
    assert any("has no captions" in p and "model.family=dit_xattn" in p for p in run_problems(cfg, 1))


def test_text_previews_of_a_model_with_labels_and_text(world, tmp_path):
    """A model conditioned on labels and text samples its prompt clips with the null class."""
    from types import SimpleNamespace

    from dit_mcore.diffusion import build_objective
    from dit_mcore.training.config import DiffusionConfig
    from dit_mcore.generate.preview import draw_text_preview
    cfg, model = _model(num_classes=10, class_dropout_prob=0.1)
    run = SimpleNamespace(data=SimpleNamespace(video_frames=2), diffusion=DiffusionConfig(sample_steps=2, cfg_scale=3.0))
    g = torch.Generator().manual_seed(0)
    folder = draw_text_preview(model, cfg, FAMILY, build_objective("flow"), run, 7, tmp_path, write=True,
                               encode=lambda prompts: [torch.randn(2, TEXT_DIM, generator=g) for _ in prompts],
                               prompts=["a", "b"])
    assert [e["prompt"] for e in json.loads((folder / "index.json").read_text())] == ["a", "b"]
