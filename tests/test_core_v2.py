"""Core contracts: memory-lean packed modulation, recompute equals no recompute, the one batch type
from every source, the family registry, previews for latent models and many classes."""
import json

import pytest
import torch

from dit_mcore.models.dit.config import preset
from dit_mcore.models import Conditioning, families, get_family
from dit_mcore.training.config import ModelConfig
from dit_mcore.generate.media import to_pixels
from dit_mcore.generate.preview import Previews, preview_classes
from dit_mcore.training.trainer import Trainer
from energon_data.batch import MicroBatch
from energon_data.config import DataConfig
from energon_data.tokens import patchify
from megatron_env import single_process_world
from test_training import tiny_run


@pytest.fixture(scope="module")
def world():
    single_process_world()


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _saved_bytes(fn) -> int:
    """Bytes of distinct storages autograd keeps for backward while running ``fn``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def _packed_layer_inputs(cfg, samples, tokens_per_sample):
    t = samples * tokens_per_sample
    idx = torch.arange(samples).repeat_interleave(tokens_per_sample)
    hidden = torch.randn(t, 1, cfg.hidden_size, requires_grad=True)
    emb = torch.randn(samples, cfg.hidden_size, requires_grad=True)
    return hidden, emb, idx


def test_packed_modulation_keeps_per_sample_rows_not_per_token(world):
    """One layer on a pack of many samples saves no more than on one sample of the same length
    (where modulation is a broadcast) plus O(samples x hidden): the gathered [tokens, 6*hidden]
    modulation is never kept."""
    cfg = preset("tiny", hidden_size=64, num_attention_heads=4)
    layer = get_family("dit").build(cfg).layers[0]
    _randomize(layer)
    samples, per = 64, 16
    hidden, emb, idx = _packed_layer_inputs(cfg, samples, per)
    from dit_mcore.models.core_attention import packed_seq_params
    batch = MicroBatch.packed(torch.zeros(samples * per, 1), torch.arange(samples + 1, dtype=torch.int32) * per,
                              torch.tensor([[1, 4, 4]] * samples), torch.zeros(samples))
    packed = _saved_bytes(lambda: layer(hidden, Conditioning(emb, idx), packed_seq_params=packed_seq_params(batch)))
    dense = _saved_bytes(lambda: layer(hidden.detach().view(per, samples, -1).requires_grad_(), Conditioning(emb)))
    per_sample_rows = samples * cfg.hidden_size * 4
    tokens_x_hidden = samples * per * cfg.hidden_size * 4
    assert packed <= dense + 16 * per_sample_rows, (packed, dense)
    assert packed < dense + tokens_x_hidden  # the per-token gather would cost >= 6x this


def test_packed_modulation_gradients_match_autograd(world):
    cfg = preset("tiny")
    hidden, emb, idx = _packed_layer_inputs(cfg, 3, 5)
    shift, scale, gate = (torch.randn(3, cfg.hidden_size, dtype=torch.float64, requires_grad=True) for _ in range(3))
    x = hidden.detach().double().requires_grad_()
    y = torch.randn_like(x)
    cond = Conditioning(emb, idx)
    out = cond.gated_add(x, gate, cond.modulate(x, shift, scale))
    ref = x + gate[idx].unsqueeze(1) * (x * (1 + scale[idx].unsqueeze(1)) + shift[idx].unsqueeze(1))
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad((out * y).sum(), (x, shift, scale, gate))
    ref_grads = torch.autograd.grad((ref * y).sum(), (x, shift, scale, gate))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1),
                                       dict(recompute_granularity="full", recompute_method="block",
                                            recompute_num_layers=1),
                                       dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
                                       dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
                                       dict(recompute_granularity="selective",
                                            recompute_modules=["core_attn", "layernorm"])])
def test_recompute_equals_no_recompute(world, recompute):
    torch.manual_seed(0)
    base = preset("tiny", num_layers=3)
    torch.manual_seed(0)
    model = get_family("dit").build(base)
    _randomize(model)
    torch.manual_seed(0)
    ckpt = get_family("dit").build(preset("tiny", num_layers=3, **recompute))
    ckpt.load_state_dict(model.state_dict())
    x = torch.randn(16, 3, base.patch_dim)
    t, y = torch.tensor([1.0, 300.0, 900.0]), torch.tensor([1, 2, 3])
    results = []
    for m in (model, ckpt):
        m.train()
        out = m(x, t, y)
        m.zero_grad()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # reentrant checkpoint: no .grad()
        results.append((out.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_recompute_config_errors_name_the_field():
    with pytest.raises(ValueError, match="recompute_method"):
        from dit_mcore.models.layer_stack import check_recompute_config
        check_recompute_config(preset("tiny", recompute_granularity="full", recompute_method=None,
                                      recompute_num_layers=1))


def test_registry_lists_dit_and_builds_through_the_entry(world):
    assert "dit" in families()
    family = get_family("dit")
    assert "DiT-XL/2" in family.presets()
    assert set(family.interop()) == {"diffusers", "facebookresearch"}
    with pytest.raises(ValueError, match="registered families: dit"):
        get_family("nope")
    with pytest.raises(ValueError, match="registered families"):
        ModelConfig(family="nope", preset="tiny").build(__import__("dit_mcore.parallel.config").parallel.config
                                                       .ParallelConfig())


def test_dense_and_packed_batches_share_one_contract():
    images = torch.randn(3, 4, 8, 8)
    tokens, grid = patchify(images, 2)
    dense = MicroBatch.dense(tokens, grid, torch.tensor([1, 2, 3]))
    assert not dense.is_packed and dense.seqlens == (16,) * 3 and dense.starts == (0, 16, 32)
    assert dense.token_to_sample.tolist() == sum([[i] * 16 for i in range(3)], [])
    flat = tokens.reshape(1, 48, -1)
    packed = MicroBatch.packed(flat, torch.tensor([0, 16, 32, 48], dtype=torch.int32), dense.grids, dense.labels)
    assert packed.is_packed and torch.equal(packed.token_to_sample, dense.token_to_sample)
    assert torch.equal(packed.positions, dense.positions)
    padded = MicroBatch.packed(torch.cat([flat[0], torch.zeros(4, flat.shape[-1])]),
                               torch.tensor([0, 16, 32, 48], dtype=torch.int32), dense.grids, dense.labels,
                               torch.tensor([0, 16, 32, 52], dtype=torch.int32))
    assert padded.real_mask.sum() == 48 and padded.token_to_sample[-4:].tolist() == [-1] * 4


def _mock_run(tmp_path, **data):
    cfg = tiny_run(tmp_path, max_steps=2)
    cfg.model.in_channels = 4
    cfg.model.num_classes = 1000
    cfg.data = DataConfig(name="mock", image_size=8, global_batch_size=4, micro_batch_size=2, **data)
    cfg.log.samples_per_class = 1
    return cfg


def test_mock_source_dense_and_packed_train_and_4_channel_preview(tmp_path):
    cfg = _mock_run(tmp_path / "dense")
    trainer = Trainer(cfg, hooks=[Previews(cfg.log.sample_interval)])
    batches = trainer.loader.next_global_batch()
    assert len(batches) == 2 and not batches[0].is_packed and batches[0].tokens.shape == (2, 16, 16)
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert (tmp_path / "dense" / "samples" / "step_000002.png").is_file()  # 4-channel latents preview

    packed = Trainer(_mock_run(tmp_path / "packed", mock_latent_shapes=[[1, 8, 8], [2, 8, 8]], max_seq_len=64))
    b = packed.loader.next_global_batch()[0]
    assert b.is_packed and b.tokens.shape[:2] == (1, 128) and {g[0] for g in b.grids.tolist()} <= {1, 2}
    assert b.real_mask.sum() == b.num_real_tokens
    assert torch.isfinite(torch.tensor(packed.train_step()["loss"]))


def test_the_mock_source_draws_the_next_batch_ahead_and_stays_exact():
    """The next global batch is drawn on a thread while this one trains; each batch is still a
    function of its index alone: equal to a fresh source's at that position, after a resume (a jump
    back) and a skip ahead, whatever was drawn ahead."""
    from dit_mcore.training.data import MockLatentSource

    def source():
        return MockLatentSource(channels=4, image_size=8, num_classes=10, patch_size=(1, 2, 2),
                                shapes=[[1, 8, 8], [2, 8, 8]], max_seq_len=64, global_batch_size=4,
                                micro_batch_size=2, dp_rank=0, dp_size=1, seed=3)

    def tokens(batches):
        return [b.tokens for b in batches]
    reference = [tokens(source().global_batch(k)) for k in range(5)]
    src = source()
    first = src.next_global_batch()
    assert src._ahead is not None and src._ahead[0] == 1  # batch 1 is being drawn already
    drawn = src._ahead[1]
    second = src.next_global_batch()
    assert drawn.done() and src.consumed_batches == 2
    for got, k in ((first, 0), (second, 1)):
        assert all(torch.equal(a, b) for a, b in zip(tokens(got), reference[k]))
    state = src.state_dict()
    assert src._ahead[1].done()  # no draw runs while a checkpoint is taken (an asynchronous save forks)
    src.next_global_batch()
    src.load_state_dict(state)  # back to batch 2 (batch 3 was drawn ahead: not used)
    assert all(torch.equal(a, b) for a, b in zip(tokens(src.next_global_batch()), reference[2]))
    src.consumed_batches = 4  # a skip: the batch drawn ahead (3) is not the one asked for
    assert all(torch.equal(a, b) for a, b in zip(tokens(src.next_global_batch()), reference[4]))


def test_preview_spreads_many_classes_and_shows_latents_in_grey():
    assert preview_classes(10).tolist() == list(range(10))
    spread = preview_classes(1000)
    assert len(spread) == 16 and spread[0] == 0 and spread[-1] == 999 and bool((spread.diff() > 0).all())
    latents = torch.randn(2, 4, 8, 8)
    assert torch.equal(to_pixels(latents), latents[:, :1].clamp(-1, 1))
    assert to_pixels(latents, decoder=lambda z: z[:3]).shape == (2, 3, 8, 8)  # one [c, t, h, w] item per call


def test_bf16_mixed_precision_tracks_fp32(tmp_path):
    """trainer.bf16: bf16 parameters and compute, fp32 main weights in megatron's optimizer; the loss
    follows the fp32 run closely (and is not secretly the fp32 run)."""
    from test_training import losses
    fp32 = losses(Trainer(tiny_run(tmp_path / "fp32", max_steps=6)).fit())
    cfg = tiny_run(tmp_path / "bf16", max_steps=6)
    cfg.trainer.bf16 = True
    trainer = Trainer(cfg)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    main_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert main_params and all(p.dtype == torch.float32 for p in main_params)
    bf16 = losses(trainer.fit())
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=0)
    assert bf16 != fp32


def test_layernorm_recompute_frees_the_normed_input_of_every_sublayer(world):
    """Selective recompute of ``"layernorm"``: the modulated norm's output, saved by the first linear
    of the attention and the MLP, is freed after the forward and recomputed in the backward, so
    autograd keeps at least one ``[tokens, hidden]`` activation less per sublayer."""
    def kept_bytes(model, x, t, y) -> int:
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(x, t, y)
        kept = sum(s.nbytes() for s in storages.values())  # storages freed for recompute count 0
        out.sum().backward()
        return kept

    layers, tokens, samples = 3, 16, 4
    x = torch.randn(tokens, samples, preset("tiny").patch_dim)
    t, y = torch.tensor([1.0, 300.0, 600.0, 900.0]), torch.tensor([1, 2, 3, 4])
    plain = get_family("dit").build(preset("tiny", num_layers=layers)).train()
    lean = get_family("dit").build(preset("tiny", num_layers=layers, recompute_granularity="selective",
                                          recompute_modules=["layernorm"])).train()
    lean.load_state_dict(plain.state_dict())
    activation = tokens * samples * plain.config.hidden_size * 4
    assert kept_bytes(plain, x, t, y) - kept_bytes(lean, x, t, y) >= 2 * layers * activation


def test_reinitialising_destroys_the_previous_process_groups():
    """megatron's ``destroy_model_parallel`` only forgets its groups: a process that builds trainer after
    trainer must not keep the old ones alive (each holds threads and connections)."""
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.initialize import initialize_distributed

    initialize_distributed(ParallelConfig(), seed=0)
    live, old = len(c10d._world.pg_map), parallel_state.get_tensor_model_parallel_group()
    initialize_distributed(ParallelConfig(), seed=0)
    assert len(c10d._world.pg_map) == live
    assert old not in c10d._world.pg_map
