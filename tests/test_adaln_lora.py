"""AdaLN-LoRA (``model.adaln_lora_rank``, Cosmos): each adaLN modulation factored through a rank, plus one
modulation shared by every layer. Both are linear in ``SiLU(c)``, so a LoRA model equals the full-adaLN model
whose per-layer weights are the product of the factors plus the shared weights tiled over the sub-blocks: the
reference here, in float64."""
import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.models import Conditioning, build_model
from dit_mcore.models.dit.config import preset
from dit_mcore.models.flops import dit_flops
from dit_mcore.models.modulation import AdaLNModulation
from energon_data.batch import MicroBatch
from energon_data.tokens import patchify
from megatron_env import single_process_world
from test_model import _randomize

world = pytest.fixture(scope="module")(lambda: single_process_world())


def _tiled(shared: torch.Tensor, rows: int) -> torch.Tensor:
    """The shared modulation's weight (or bias) rows repeated over ``rows`` outputs, as each layer adds it."""
    return shared.repeat(-(-rows // shared.shape[0]), *(1,) * (shared.dim() - 1))[:rows]


def _full_equivalent(lora, full) -> None:
    """Load ``full`` (rank 0) with ``lora``'s weights, each modulation composed into one linear."""
    state = {k: v for k, v in lora.state_dict().items() if "adaLN_modulation" not in k and "adaln_shared" not in k}
    shared_w, shared_b = lora.adaln_shared.weight, lora.adaln_shared.bias
    for name, module in full.named_modules():
        if isinstance(module, AdaLNModulation):
            mine = lora.get_submodule(name)
            rows = mine.linear.weight.shape[0]
            state[f"{name}.linear.weight"] = mine.linear.weight @ mine.down.weight + _tiled(shared_w, rows)
            state[f"{name}.linear.bias"] = mine.linear.bias + _tiled(shared_b, rows)
    full.load_state_dict(state, strict=True)


def test_lora_model_equals_its_composed_full_model(world):
    lora = build_model(preset("tiny", adaln_lora_rank=8)).double()
    full = build_model(preset("tiny")).double()
    _randomize(lora)
    _full_equivalent(lora, full)
    x = torch.randn(3, 4, 8, 8, dtype=torch.float64)
    tokens, grid = patchify(x, 2)
    t, y = torch.tensor([3.0, 400.0, 900.0], dtype=torch.float64), torch.tensor([1, 2, 10])
    dense = lora(tokens.transpose(0, 1), t, y, grid=grid)
    torch.testing.assert_close(dense, full(tokens.transpose(0, 1), t, y, grid=grid), rtol=1e-10, atol=1e-12)
    assert dense.abs().max() > 1e-3  # (the test is not comparing zeros)
    # packed: each token takes its sample's shared modulation
    cu = torch.tensor([0, 16, 32, 48], dtype=torch.int32)
    packed = tokens.reshape(-1, tokens.shape[-1])[:, None]
    batch = MicroBatch.packed(packed[:, 0], cu, torch.tensor([grid] * 3), y)
    torch.testing.assert_close(lora(packed, t, y, batch=batch).squeeze(1), dense.transpose(0, 1).reshape(48, -1),
                               rtol=1e-10, atol=1e-12)


def test_full_recompute_passes_the_shared_modulation(world):
    """Under full recompute the layers run inside a checkpoint whose inputs must carry the shared modulation."""
    cfg = dict(adaln_lora_rank=4, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    plain, recomputed = (build_model(preset("tiny", **o)) for o in (dict(adaln_lora_rank=4), cfg))
    recomputed.load_state_dict(plain.state_dict())
    _randomize(plain), _randomize(recomputed)
    tokens, grid = patchify(torch.randn(2, 4, 8, 8), 2)
    t, y = torch.tensor([5.0, 700.0]), torch.tensor([0, 1])
    grads = []
    for model in (plain, recomputed):
        model.zero_grad()
        model(tokens.transpose(0, 1), t, y, grid=grid).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0]["adaln_shared.weight"].abs().max() > 0
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_starts_as_the_identity(world):
    model = build_model(preset("tiny", adaln_lora_rank=4))
    t, y = torch.tensor([1.0, 999.0]), torch.tensor([0, 10])
    cond = Conditioning(model.conditioning(t, y), shared=model.adaln_shared(torch.nn.functional.silu(
        model.conditioning(t, y))))
    h = torch.randn(16, 2, 64)
    for layer in model.layers:
        assert torch.equal(layer(h, cond), h)


def test_cosmos_7b_parameter_count(world):
    """NeMo's ``cosmos_7b_text2world`` shape (28 x 4096, rank 256): 7.9B where full adaLN linears give 11.8B.
    Counted from one- and two-layer builds on the meta device. (Its text keys and values project from the
    embedded text, 4096 wide, where Cosmos's project from the 1024-wide text: 0.7B more than Cosmos's 7.2B.)"""
    def count(**overrides):
        from dit_mcore.models.dit.xattn import preset as xattn
        sizes = []
        for layers in (1, 2):
            with torch.device("meta"):
                sizes.append(sum(p.numel() for p in build_model(xattn("DiT-XAttn-7B-Cosmos", num_layers=layers,
                                                                       **overrides)).parameters()))
        return sizes[0] + 27 * (sizes[1] - sizes[0])
    lora, full = count(), count(adaln_lora_rank=0)
    assert 7.7e9 < lora < 8.0e9 and 11.6e9 < full < 12.0e9, (lora, full)
    h, r = 4096, 256
    assert full - lora == pytest.approx(28 * (9 * h * h - (h * r + r * 9 * h)) + 2 * h * h - (h * r + r * 2 * h)
                                        - (h * 3 * h + 3 * h), rel=1e-6)


def test_flops_count_the_factors():
    """The FLOPs function against torch's counter on the adaLN part: the LoRA model's per-sample modulation."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = preset("tiny", adaln_lora_rank=8)
    full = preset("tiny")
    rank_part = dit_flops(cfg, [16]).embed - dit_flops(full, [16]).embed
    h, r, layers = cfg.hidden_size, 8, cfg.num_layers
    per_layer = [AdaLNModulation(h, 6, r) for _ in range(layers)] + [AdaLNModulation(h, 2, r)]
    per_layer_full = [AdaLNModulation(h, 6) for _ in range(layers)] + [AdaLNModulation(h, 2)]
    shared = torch.nn.Linear(h, 3 * h)
    c = torch.randn(1, h)
    with FlopCounterMode(display=False) as lora_count:
        cond = Conditioning(c, shared=shared(c))  # (once per forward, for every layer)
        for m in per_layer:
            m(cond)
    with FlopCounterMode(display=False) as full_count:
        for m in per_layer_full:
            m(Conditioning(c))
    assert rank_part == lora_count.get_total_flops() - full_count.get_total_flops()


def test_bad_rank_names_the_field():
    with pytest.raises(ConfigError, match="adaln_lora_rank"):
        preset("tiny", adaln_lora_rank=64)
    with pytest.raises(ConfigError, match="adaln_lora_rank"):
        preset("tiny", adaln_lora_rank=-1)


def test_interop_refuses_it_in_one_line(world):
    """facebookresearch/DiT and diffusers have a full adaLN linear per layer: an AdaLN-LoRA model is refused by
    name, not written with its factors' shapes."""
    from dit_mcore.models.dit.interop import export_facebookresearch
    from dit_mcore.models.dit.interop.mapping import InteropError
    with pytest.raises(InteropError, match="adaln_lora_rank"):
        export_facebookresearch(build_model(preset("tiny", adaln_lora_rank=4)))
