"""The MovieGen-style Llama DiT (``model.family=llama``): 3D RoPE against a float64 rotation, per
token (packed and context-parallel pieces get their own angles), GQA against repeated heads,
SwiGLU, the plain-residual cross-attention, packed == dense, presets counted on the meta device."""
import math

import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.models import Conditioning
from dit_mcore.models.dit.llama import PRESETS
from dit_mcore.models.embeddings import rope3d_freqs, rope_axis_pairs
from dit_mcore.models.registry import get_family
from dit_mcore.models.text import TextContext
from dit_mcore.models.token_shard import TokenShard
from dit_mcore.models.flops import dit_flops
from energon_data.batch import MicroBatch
from energon_data.tokens import grid_positions, patchify
from family_models import assert_flops_match, count_params, counted_flops, randomize
from megatron_env import single_process_world

FAMILY = get_family("llama")
TEXT_DIM = 32


@pytest.fixture(scope="module")
def world():
    single_process_world()


def _model(**overrides):
    cfg = FAMILY.make_config("llama-tiny", **overrides)
    return cfg, FAMILY.build(cfg, backend="local", init_seed=0)


def _rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """float64 3D RoPE written as complex rotations: channel pair ``(k, k + d/2)`` of axis ``a`` turns
    by ``pos_a * theta ** (-j / p_a)`` (``j``: the pair's index within its axis)."""
    d = x.shape[-1]
    angles = []
    for axis, pairs in enumerate(rope_axis_pairs(d)):
        for j in range(pairs):
            angles.append(positions[:, axis].double() * theta ** (-j / pairs))
    angle = torch.stack(angles, dim=-1)[:, None, None, :]  # [s, 1, 1, d/2]
    z = torch.complex(x[..., :d // 2].double(), x[..., d // 2:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope3d_matches_float64_rotation_and_is_relative(world):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    cfg = FAMILY.make_config("llama-tiny")
    positions = grid_positions((3, 4, 5))
    x = torch.randn(positions.shape[0], 2, 4, 16)
    ours = apply_rotary_pos_emb(x, rope3d_freqs(positions, 16, 10000.0), config=cfg)  # megatron's kernel
    torch.testing.assert_close(ours.double(), _rope_reference(x, positions, 10000.0), rtol=1e-5, atol=1e-5)
    assert rope_axis_pairs(128) == (22, 21, 21) and rope_axis_pairs(16) == (4, 2, 2)
    # Relative: q.k depends only on the offset, along each axis.
    q, k = torch.randn(16), torch.randn(16)

    def dot(pq, pk):
        fq, fk = rope3d_freqs(torch.tensor([pq]), 16), rope3d_freqs(torch.tensor([pk]), 16)
        rq = apply_rotary_pos_emb(q.view(1, 1, 1, 16), fq, config=cfg)
        rk = apply_rotary_pos_emb(k.view(1, 1, 1, 16), fk, config=cfg)
        return float((rq * rk).sum())
    assert dot((1, 2, 3), (0, 1, 1)) == pytest.approx(dot((5, 7, 9), (4, 6, 7)), rel=1e-5)
    assert dot((1, 2, 3), (0, 1, 1)) != pytest.approx(dot((1, 2, 3), (0, 1, 2)), rel=1e-3)


def test_rope_on_a_context_parallel_piece_is_the_slice_of_the_whole():
    positions = grid_positions((2, 3, 5))  # 30 tokens over 4 CP ranks: 8 each, the last padded
    whole = rope3d_freqs(positions, 16)
    pieces = [rope3d_freqs(TokenShard(size=4, index=i).attention_piece(positions), 16) for i in range(4)]
    torch.testing.assert_close(torch.cat(pieces)[:30], whole, rtol=0, atol=0)
    # Under SP the attention sees the whole CP piece, not the rank's sequence-parallel part.
    sp = TokenShard(size=4, index=3, tp=2).attention_piece(positions)
    assert torch.equal(sp[:7], positions[16:23]) and sp.shape[0] == 16


def test_layer_is_llama_shaped(world):
    cfg, model = _model()
    layer = model.layers[0]
    names = {n for n, _ in model.named_parameters()}
    assert layer.adaLN_modulation.chunks == 6  # self-attention and MLP modulated; cross-attention not
    assert isinstance(layer.norm, torch.nn.RMSNorm) and layer.norm.weight is None
    assert isinstance(layer.cross_norm, torch.nn.RMSNorm) and layer.cross_norm.weight is not None
    assert "layers.0.mlp.linear_fc1.weight" in names
    assert not [n for n in names if n.startswith("layers.") and n.endswith(".bias") and "adaLN" not in n]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert layer.self_attention.linear_qkv.weight.shape[0] == cfg.hidden_size + 2 * 2 * head_dim  # 2 KV heads
    assert layer.mlp.linear_fc1.weight.shape[0] == 2 * cfg.ffn_hidden_size  # SwiGLU: gate and up
    # Zero adaLN gates: self-attention and MLP are skipped, and the cross-attention output is added
    # to the residual as it is.
    h = torch.randn(16, 2, cfg.hidden_size)
    t = torch.tensor([3.0, 500.0])
    texts = TextContext.from_list([torch.randn(3, TEXT_DIM), torch.randn(5, TEXT_DIM)])
    ctx, params = model._text(texts, None, 16, 2, 2)
    out = layer(h, Conditioning(model.conditioning(t, None)), context=ctx, context_params=params)
    cross, _ = layer.cross_attention(layer.cross_norm(h), attention_mask=None, key_value_states=ctx,
                                     packed_seq_params=params)
    torch.testing.assert_close(out, h + cross)


def test_gqa_equals_attention_with_repeated_heads(world):
    from dit_mcore.models.core_attention import KernelsCoreAttention
    cfg, _ = _model(attention_backend_name="math64")
    core = KernelsCoreAttention(cfg, layer_number=1)
    q, k, v = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8)
    out = core(q, k, v).view(6, 2, 4, 8)
    for head in range(4):
        group = head // 2  # megatron's order: consecutive query heads share a group
        scores = torch.einsum("sbd,tbd->bst", q[:, :, head], k[:, :, group]) / math.sqrt(8)
        ref = torch.einsum("bst,tbd->sbd", scores.softmax(-1), v[:, :, group])
        torch.testing.assert_close(out[:, :, head], ref, rtol=1e-5, atol=1e-5)


def _inputs(n=3, lens=(3, 1, 5)):
    g = torch.Generator().manual_seed(1)
    tokens, grid = patchify(torch.randn(n, 4, 2, 8, 8, generator=g), 2)  # 2-frame videos: 2x4x4 tokens
    t = torch.tensor([3.0, 400.0, 900.0])[:n]
    texts = [torch.randn(k, TEXT_DIM, generator=g) for k in lens[:n]]
    return tokens, grid, t, texts


def test_dense_batch_equals_each_sample_alone_and_packed(world):
    _, model = _model(attention_backend_name="math64")
    randomize(model)
    tokens, grid, t, texts = _inputs()
    dense = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    for i in range(3):
        alone = model(tokens[i:i + 1].transpose(0, 1), t[i:i + 1], grid=grid,
                      context=TextContext.from_list([texts[i]]))
        torch.testing.assert_close(alone[:, 0], dense[:, i], rtol=1e-5, atol=1e-5)
    # Packed with padding and an image of another grid between the videos: RoPE restarts per sample.
    image, igrid = patchify(torch.randn(1, 4, 4, 8), 2)
    pad = torch.zeros(3, tokens.shape[-1])
    stream = torch.cat([tokens[0], pad, image[0], tokens[2], pad])
    n = tokens.shape[1]
    batch = MicroBatch.packed(stream, torch.tensor([0, n, n + 8, 2 * n + 8], dtype=torch.int32),
                              torch.tensor([grid, igrid, grid]), torch.zeros(3),
                              torch.tensor([0, n + 3, n + 11, 2 * n + 14], dtype=torch.int32))
    out = model(stream[:, None], t, batch=batch, context=TextContext.from_list(texts))[:, 0]
    torch.testing.assert_close(out[:n], dense[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[n + 11:2 * n + 11], dense[:, 2], rtol=1e-5, atol=1e-5)
    image_alone = model(image.transpose(0, 1), t[1:2], grid=igrid, context=TextContext.from_list([texts[1]]))[:, 0]
    torch.testing.assert_close(out[n + 3:n + 11], image_alone, rtol=1e-5, atol=1e-5)


def test_positions_come_from_rope_only(world):
    """No additive table: moving a token's content to another place changes its output only
    through the attention (a 1-token sample has nothing to attend to but itself)."""
    _, model = _model(attention_backend_name="math64")
    randomize(model)
    tok = torch.randn(1, 1, model.config.patch_dim)
    t = torch.tensor([10.0])
    text = TextContext.from_list([torch.randn(2, TEXT_DIM)])
    outs = []
    for pos in ((0, 0, 0), (3, 2, 1)):
        batch = MicroBatch.packed(tok[:, 0], torch.tensor([0, 1], dtype=torch.int32), torch.tensor([[1, 1, 1]]),
                                  torch.zeros(1), positions=torch.tensor([pos]))
        outs.append(model(tok, t, batch=batch, context=text))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_flops_match_torch_flop_counter(world):
    cfg, model = _model(attention_backend_name="math64")
    randomize(model)
    tokens, grid, _, _ = _inputs(2)
    text = TextContext.from_list([torch.randn(40, TEXT_DIM), torch.randn(24, TEXT_DIM)])
    counted = counted_flops(lambda: model(tokens.transpose(0, 1), torch.tensor([1.0, 2.0]), grid=grid,
                                          context=text))
    f = dit_flops(cfg, [32, 32], text.lens)
    assert_flops_match(counted, f)


@pytest.mark.parametrize("name, billions", [("MovieGen-1B", 1.10), ("MovieGen-3B", 3.31), ("MovieGen-5B", 6.29),
                                            ("MovieGen-30B", 37.0)])
def test_preset_sizes(world, name, billions):
    cfg = FAMILY.make_config(name)
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    kv = cfg.num_query_groups * cfg.kv_channels
    # Per layer: GQA self-attention (Q and output h^2 each, K and V h*kv each), MHA cross-attention
    # 4h^2, SwiGLU 3*h*ffn, six adaLN chunks 6h^2 (+ bias), the cross-attention RMSNorm's h.
    count, counted_per_layer = count_params(FAMILY, name)
    assert counted_per_layer == (2 * h * h + 2 * h * kv) + 4 * h * h + 3 * h * ffn + 6 * h * h + 6 * h + h
    # 1B and 3B are sized to their names; 5B and 30B are NeMo's / MovieGen's dims, whose headline
    # counts leave out the per-layer adaLN (6h^2 a layer: 10.9B of the 30B's 37.0B).
    assert count == pytest.approx(billions * 1e9, rel=0.01)


def test_presets_and_config_errors():
    big = PRESETS["MovieGen-30B"]
    assert (big["num_layers"], big["hidden_size"], big["ffn_hidden_size"], big["num_attention_heads"],
            big["num_query_groups"]) == (48, 6144, 16384, 48, 8)
    with pytest.raises(ConfigError, match="model.text_dim=0"):
        FAMILY.make_config("llama-tiny", text_dim=0)
    with pytest.raises(ConfigError, match="even head dim"):
        FAMILY.make_config("llama-tiny", hidden_size=60, num_attention_heads=12)
    with pytest.raises(ConfigError, match="model.position_embedding='alibi'"):
        FAMILY.make_config("llama-tiny", position_embedding="alibi")


def test_moe_variant_routes_each_token_alone(world):
    """``model.num_moe_experts`` swaps the SwiGLU MLP for megatron's MoE layer (SwiGLU experts):
    routing is per token, so a sample's output does not depend on its batch."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    _, model = _model(attention_backend_name="math64", num_moe_experts=4, moe_router_topk=2,
                      moe_token_dispatcher_type="alltoall")
    assert isinstance(model.layers[0].mlp, MoELayer)
    randomize(model)
    tokens, grid, t, texts = _inputs()
    dense = model(tokens.transpose(0, 1), t, grid=grid, context=TextContext.from_list(texts))
    alone = model(tokens[1:2].transpose(0, 1), t[1:2], grid=grid, context=TextContext.from_list([texts[1]]))
    torch.testing.assert_close(alone[:, 0], dense[:, 1], rtol=1e-5, atol=1e-5)
    dense.square().mean().backward()
    assert model.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.grad is not None


def test_rope3d_angles_equal_diffusers_wan_rotary_embedding():
    """Interleaved 3D RoPE = diffusers' ``WanRotaryPosEmbed`` (the same t/h/w split of each head, the
    same frequencies), so Wan-style checkpoints see the angles they were trained with."""
    wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    head_dim, grid = 48, (3, 4, 5)
    rope = wan.WanRotaryPosEmbed(head_dim, (1, 1, 1), max_seq_len=16)
    cos, sin = rope(torch.zeros(1, 1, *grid))  # [1, t*h*w, 1, head_dim], pairs interleaved
    ours = rope3d_freqs(grid_positions(grid), head_dim, 10000.0, interleaved=True)[:, 0, 0].double()
    torch.testing.assert_close(ours.cos(), cos[0, :, 0].double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin(), sin[0, :, 0].double(), rtol=1e-6, atol=1e-6)
