import pytest
import torch

from energon_data.encoders import (
    LATENT_ENCODERS,
    TEXT_ENCODERS,
    EncodeError,
    EncoderConfigError,
    build_latent_encoder,
    build_text_encoder,
)


def _pixels(c=3, t=2, h=16, w=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(c, t, h, w, generator=g) * 2 - 1


def test_registry_names_and_errors():
    assert {"identity", "tiny_vae", "diffusers_vae", "diffusers_video_vae"} <= set(LATENT_ENCODERS)
    assert {"tiny", "tiny_text", "t5"} <= set(TEXT_ENCODERS)
    with pytest.raises(EncoderConfigError, match="--encoder.*choose one of"):
        build_latent_encoder("nope")
    with pytest.raises(EncoderConfigError, match="--text-encoder"):
        build_text_encoder("nope")
    with pytest.raises(EncoderConfigError, match="bad options.*downsampel"):
        build_latent_encoder("tiny_vae", downsampel=2)
    with pytest.raises(EncoderConfigError, match="--encoder-path"):
        build_latent_encoder("identity", path="/some/where")
    with pytest.raises(EncoderConfigError, match="downsample must be 2 or 4"):
        build_latent_encoder("tiny_vae", downsample=8)


@pytest.mark.parametrize("name,option", [("diffusers_vae", "--encoder-path"), ("diffusers_video_vae", "--encoder-path")])
def test_weight_encoders_need_a_local_folder(tmp_path, name, option):
    with pytest.raises(EncoderConfigError, match=f"pass {option}"):
        build_latent_encoder(name)
    with pytest.raises(EncoderConfigError, match=f"{option}.*not an existing, non-empty folder"):
        build_latent_encoder(name, path=str(tmp_path / "missing"))
    with pytest.raises(EncoderConfigError, match="not an existing, non-empty folder"):
        build_latent_encoder(name, path=str(tmp_path))  # empty
    (tmp_path / "readme").write_text("x")
    with pytest.raises(EncoderConfigError, match="no config.json"):
        build_latent_encoder(name, path=str(tmp_path))


def test_t5_needs_a_local_folder(tmp_path):
    with pytest.raises(EncoderConfigError, match="pass --text-encoder-path"):
        build_text_encoder("t5")
    with pytest.raises(EncoderConfigError, match="--text-encoder-path"):
        build_text_encoder("t5", path=str(tmp_path / "missing"))


def test_identity_is_exact_and_checks_input():
    enc = build_latent_encoder("identity")
    x = _pixels(c=1)
    assert torch.equal(enc.encode(x), x) and torch.equal(enc.decode(x), x)
    with pytest.raises(EncodeError, match="C, T, H, W"):
        enc.encode(x[0])


@pytest.mark.parametrize("downsample", [2, 4])
def test_tiny_vae_shapes_seed_and_per_frame(downsample):
    enc = build_latent_encoder("tiny_vae", downsample=downsample)
    x = _pixels(t=3)
    z = enc.encode(x)
    assert z.shape == (4, 3, 16 // downsample, 16 // downsample)
    assert enc.decode(z).shape == x.shape
    # same seed -> same weights; another seed -> different ones
    assert torch.equal(build_latent_encoder("tiny_vae", downsample=downsample).encode(x), z)
    assert not torch.allclose(build_latent_encoder("tiny_vae", downsample=downsample, seed=1).encode(x), z)
    # frames are coded independently
    for t in range(3):
        torch.testing.assert_close(enc.encode(x[:, t : t + 1]), z[:, t : t + 1])
    # gray input is replicated to the 3 RGB channels the VAE expects
    gray = _pixels(c=1, t=1)
    torch.testing.assert_close(enc.encode(gray), enc.encode(gray.expand(3, -1, -1, -1)))
    with pytest.raises(EncodeError, match="divisible by"):
        enc.encode(_pixels(h=16 + downsample // 2))  # 17 or 18: not a multiple
    with pytest.raises(EncodeError, match="expects 3 channels, got 2"):
        enc.encode(_pixels(c=2))


def test_tiny_text_encoder():
    enc = build_text_encoder("tiny", dim=24, heads=3)
    assert enc.dim == 24
    empty, cap, cap2 = enc.encode(["", "A red ball.", "a red ball."])
    assert empty.shape == (1, 24)  # BOS only: every sample has a text embedding
    assert cap.shape == (5, 24)  # BOS + a, red, ball, "."
    torch.testing.assert_close(cap, cap2)  # lower-cased tokens
    assert torch.equal(build_text_encoder("tiny_text", dim=24, heads=3).encode(["A red ball."])[0], cap)
    assert enc.token_ids("ball")[1] == enc.token_ids("red ball")[2]  # stable hashed ids
    with pytest.raises(EncoderConfigError, match="divisible"):
        build_text_encoder("tiny", dim=10, heads=3)


def _tiny_autoencoder_kl():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=16, scaling_factor=0.5, shift_factor=0.1,
    ).eval()


def test_diffusers_vae_loads_from_local_folder(tmp_path):
    vae = _tiny_autoencoder_kl()
    vae.save_pretrained(tmp_path / "vae_only")
    vae.save_pretrained(tmp_path / "pipeline" / "vae")  # a pipeline folder keeps the VAE in vae/
    x = _pixels(t=2)
    with torch.no_grad():
        ref = (vae.encode(x.transpose(0, 1)).latent_dist.mean - 0.1) * 0.5  # frames as the batch
    ref = ref.transpose(0, 1)
    for folder in ("vae_only", "pipeline"):
        enc = build_latent_encoder("diffusers_vae", path=str(tmp_path / folder), device="cpu")
        assert enc.spatial_factor == 2 and enc.temporal_factor == 1
        z = enc.encode(x)
        assert z.shape == (4, 2, 8, 8)
        torch.testing.assert_close(z, ref, rtol=1e-5, atol=1e-5)
        assert enc.decode(z).shape == x.shape


def _tiny_t5_folder(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "ball", "dog", "runs"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=len(words), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5EncoderModel(cfg).eval()
    model.save_pretrained(path)
    return model, fast


def test_t5_loads_from_local_folder_without_padding_effects(tmp_path):
    model, tok = _tiny_t5_folder(tmp_path / "t5")
    enc = build_text_encoder("t5", path=str(tmp_path / "t5"), device="cpu", max_length=8)
    assert enc.dim == 16
    outs = enc.encode(["a red ball", "dog", ""])
    assert [o.shape[0] for o in outs] == [4, 2, 1]  # tokens + </s>; the empty caption keeps </s>
    for caption, out in zip(["a red ball", "dog", ""], outs):
        ids = tok(caption, return_tensors="pt").input_ids  # alone: no padding at all
        with torch.no_grad():
            ref = model(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_diffusers_video_vae_class_from_config_and_latent_stats(tmp_path):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    mean, std = [0.1, -0.2, 0.0, 0.3], [1.5, 0.5, 1.0, 2.0]
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           latents_mean=mean, latents_std=std).eval()
    vae.save_pretrained(tmp_path / "wan")
    enc = build_latent_encoder("diffusers_video_vae", path=str(tmp_path / "wan"), device="cpu")
    assert type(enc.vae).__name__ == "AutoencoderKLWan"  # from config.json's _class_name
    assert (enc.spatial_factor, enc.temporal_factor) == (8, 4)
    assert enc.valid_frames(7) == 5 and enc.valid_frames(1) == 1
    x = _pixels(t=5)
    with torch.no_grad():
        raw = vae.encode(x.unsqueeze(0)).latent_dist.mean[0]
    ref = (raw - torch.tensor(mean).view(-1, 1, 1, 1)) / torch.tensor(std).view(-1, 1, 1, 1)
    z = enc.encode(x)
    assert z.shape == (4, 2, 2, 2)  # 1 + 4 frames -> 2 latent frames
    torch.testing.assert_close(z, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(EncodeError, match=r"1 \+ 4\*n frames"):
        enc.encode(_pixels(t=4))
