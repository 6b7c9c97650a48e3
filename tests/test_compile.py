"""``model.compile``: each layer compiled as one graph (no breaks), training as eager does."""
import sys
from pathlib import Path

import pytest
import torch

from dit_mcore.training.trainer import Trainer
from test_training import losses, tiny_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compile_breaks import layer_graph_breaks  # noqa: E402


def test_a_layer_compiles_to_one_graph():
    from megatron_env import single_process_world

    single_process_world()
    explained = layer_graph_breaks("tiny", tokens=16, samples=2)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def test_a_layer_recomputing_its_mlp_compiles_to_one_graph_keeps_less_and_computes_the_same():
    """Selective recompute of the MLP (``recompute_modules=["mlp"]``) inside a compiled layer: still one
    graph (megatron's checkpoint, used eagerly, broke it on its RNG-state save), the same output and
    gradients as the compiled layer without recompute, and fewer bytes saved for the backward (the
    MLP's hidden activations are recomputed, not kept)."""
    from megatron_env import single_process_world
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models import build_model
    from dit_mcore.models.modulation import Conditioning

    single_process_world()
    explained = layer_graph_breaks("tiny", tokens=16, samples=2, recompute_granularity="selective",
                                   recompute_modules=["mlp"])
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    torch.manual_seed(0)
    plain = build_model(preset("tiny", num_layers=1)).layers[0]
    kept = build_model(preset("tiny", num_layers=1, recompute_granularity="selective",
                              recompute_modules=["mlp"])).layers[0]
    kept.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for p in (*plain.parameters(), *kept.parameters()):  # off adaLN-Zero's zero start, alike
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    hidden = torch.randn(64, 2, plain.config.hidden_size)
    emb = torch.randn(2, plain.config.hidden_size)
    results = []
    for layer in (plain, kept):
        torch.compiler.reset()
        compiled = torch.compile(layer)
        saved = []
        x = hidden.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = compiled(x, Conditioning(emb))
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, [p.grad for p in layer.parameters()], sum(saved)))
    (out_a, dx_a, grads_a, saved_a), (out_b, dx_b, grads_b, saved_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_b, dx_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert saved_b < saved_a, (saved_b, saved_a)


def test_a_compiled_moe_layer_recomputing_its_mlp_counts_its_router_metrics_once(tmp_path):
    """An MoE MLP is recomputed through megatron's checkpoint even in a compiled layer: megatron's router
    tells the first forward from the recompute by grad being off in the first, which torch's
    non-reentrant checkpoint does not do (its load-balancing metric then read 2.0 for 1.0). The reference is
    the eager layer without recompute (compiled, it only cost the suite a second MoE compile)."""
    def run(name, recompute):
        cfg = tiny_run(tmp_path / name, max_steps=2)
        cfg.model.num_moe_experts, cfg.model.moe_router_topk, cfg.model.moe_aux_loss_coeff = 2, 2, 0.01
        cfg.model.compile = recompute
        if recompute:
            cfg.model.recompute_granularity, cfg.model.recompute_modules = "selective", ["mlp"]
        return Trainer(cfg).train_steps(2)
    plain, recomputed = run("plain", False), run("recomputed", True)
    for a, b in zip(plain, recomputed):
        assert b["load_balancing_loss"] == pytest.approx(a["load_balancing_loss"], rel=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_compiled_training_equals_eager(tmp_path):
    eager = losses(Trainer(tiny_run(tmp_path / "eager", max_steps=3)).fit())
    cfg = tiny_run(tmp_path / "compiled", max_steps=3)
    cfg.model.compile = True
    trainer = Trainer(cfg)
    compiled = losses(trainer.fit())
    assert all(hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None
               for layer in trainer.model[0].layers)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


@pytest.mark.parametrize("family, preset", [("llama", "llama-tiny"), ("stdit", "stdit-tiny")])
def test_compiled_text_families_train_as_eager(tmp_path, family, preset):
    """3D RoPE (llama) and the spatial/temporal reorders (stdit) compile too, each layer one graph
    (the ST-DiT's frames and positions are plans, ``st_attention.st_plans``): same losses as eager."""
    import torch._dynamo.utils
    from energon_data.config import DataConfig

    def run(name, compile_):
        cfg = tiny_run(tmp_path / name, max_steps=3)
        cfg.model.family, cfg.model.preset, cfg.model.compile = family, preset, compile_
        cfg.model.in_channels, cfg.model.num_classes = 1, 10
        cfg.data = DataConfig(name="moving_digits", image_size=8, video_frames=2, num_videos=64, global_batch_size=8,
                              micro_batch_size=4)
        return losses(Trainer(cfg).fit())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run("compiled", True)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0, dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(run("eager", False)), rtol=1e-5, atol=0)


def test_a_compiled_layer_takes_a_new_packing_without_recompiling():
    """Packed micro-batches differ in their sample boundaries (host ints) and counts: the attention
    operator reads them from a plan tensor, and the stack marks the sample count dynamic before the
    first call, so every new packing reuses the layer compiled for the first (traced, each new packing
    would recompile it until dynamo's limit, then run eager; seen on an H200 at a third of the speed;
    unmarked, the second packing recompiled every layer once). A pack of one sample compiles its own
    graph once (dynamo specialises a size of 1)."""
    import torch._dynamo

    from megatron_env import single_process_world
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models import build_model
    from dit_mcore.models.core_attention import KernelsPackedSeqParams
    from dit_mcore.models.modulation import Conditioning
    from dit_mcore.kernels.local_attention import Segments

    single_process_world()
    torch._dynamo.reset()
    cfg = preset("tiny")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stack = build_model(cfg).layers.to(device)  # outside a trainer some parts are built on the host
    stack.compile_layers()
    tokens = 24

    def step(lens):
        starts = [sum(lens[:i]) for i in range(len(lens))]
        ends = [a + n for a, n in zip(starts, lens)]
        cu = torch.tensor([0, *ends], dtype=torch.int32, device=device)
        params = KernelsPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                                        max_seqlen_kv=max(lens), segments=Segments(tuple(starts), tuple(ends),
                                                                                   tuple(starts), tuple(ends)))
        to_sample = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
        hidden = torch.randn(tokens, 1, cfg.hidden_size, device=device, requires_grad=True)
        cond = Conditioning(torch.randn(len(lens), cfg.hidden_size, device=device), to_sample)
        stack(hidden, cond, packed_seq_params=params).sum().backward()

    step([8, 8, 8])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lens in ([4, 8, 4, 8], [12, 6, 6], [2, 20, 2], [6, 6, 6, 6], [4, 4, 4, 4, 8], [12, 12]):
            step(lens)


def test_max_autotune_compile_mode_trains_as_eager(tmp_path, monkeypatch):
    """``model.compile_mode="max-autotune-no-cudagraphs"`` reaches every layer's torch.compile
    (Inductor then benchmarks GEMM templates; on the CPU its C++ ones) and trains as eager."""
    eager = losses(Trainer(tiny_run(tmp_path / "eager", max_steps=2)).fit())
    cfg = tiny_run(tmp_path / "autotuned", max_steps=2)
    cfg.model.compile, cfg.model.compile_mode = True, "max-autotune-no-cudagraphs"
    seen = []
    original = torch.nn.Module.compile

    def record(module, *args, **kwargs):
        seen.append(kwargs.get("mode"))
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", record)
    trainer = Trainer(cfg)
    assert seen == ["max-autotune-no-cudagraphs"] * len(trainer.model[0].layers)
    torch.testing.assert_close(torch.tensor(losses(trainer.fit())), torch.tensor(eager), rtol=1e-5, atol=0)


def test_compile_options_reach_every_layer_over_the_modes(monkeypatch):
    """``model.compile_options`` reach each layer's torch.compile as Inductor options, over the
    compile mode's own (torch.compile takes a mode or options, not both)."""
    from megatron_env import single_process_world
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models import build_model

    single_process_world()
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, *args, **kwargs: seen.append((args, kwargs)))
    stack = build_model(preset("tiny")).layers
    stack.compile_layers("max-autotune-no-cudagraphs", {"triton.multi_kernel": 1, "coordinate_descent_tuning": False})
    assert seen == [((), {"options": {"max_autotune": True, "coordinate_descent_tuning": False,
                                      "triton.multi_kernel": 1}})] * len(stack)
    seen.clear()
    stack.compile_layers(None, {"triton.multi_kernel": 1})
    assert seen == [((), {"options": {"triton.multi_kernel": 1}})] * len(stack)


def test_compiled_gelu_is_the_sigmoid_form_of_the_same_function():
    """Traced, the DiT MLP's tanh-GELU is written ``x * sigmoid(2z)`` (Inductor lowers ``sigmoid`` to
    a fast exponential, ``tanh`` to libdevice's accurate one): the same values and gradients as
    torch's ``F.gelu(approximate="tanh")`` in float64; eager keeps torch's kernel."""
    import torch.nn.functional as F

    from dit_mcore.models.dit.config import gelu_tanh

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.linspace(-12, 12, 100_001, dtype=torch.float64, requires_grad=True)
    traced = torch.compile(gelu_tanh, backend=capture, fullgraph=True)(x)
    called = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert torch.sigmoid in called and F.gelu not in called, called
    reference = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(traced, reference, rtol=0, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(traced.sum(), x)[0], torch.autograd.grad(reference.sum(), x)[0],
                               rtol=0, atol=1e-13)
    assert torch.equal(gelu_tanh(x), reference)  # eager: torch's kernel


@pytest.mark.parametrize("family, preset", [("llama", "llama-tiny"), ("stdit", "stdit-tiny")])
def test_a_packed_text_layer_compiles_to_one_graph_and_trains_as_eager(tmp_path, family, preset):
    """MovieGen's and the ST-DiT's layers on packed video with text: self- (spatial, temporal) and
    cross-attention on packed segments are operators inside the compiled layer
    (kernels.planned_attention), not breaks. Called outside the graph, they cut each layer into
    pieces, and the break inside megatron's attention (its offloading context) left the rest of it
    eager: an H100's host then took ~12 ms per layer and the device waited for it."""
    import torch._dynamo.utils
    from energon_data.config import DataConfig

    def run(name, compile_):
        cfg = tiny_run(tmp_path / name, max_steps=3)
        cfg.model.family, cfg.model.preset, cfg.model.compile = family, preset, compile_
        cfg.model.in_channels = 4
        cfg.data = DataConfig(name="mock", image_size=8, mock_latent_shapes=[[1, 8, 8], [2, 8, 8]], max_seq_len=64,
                              global_batch_size=2, micro_batch_size=1)
        return losses(Trainer(cfg).fit())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run("compiled", True)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0, dict(torch._dynamo.utils.counters["graph_break"])
    from dit_mcore.kernels.planned_attention import _PLANS
    # each step forgets the step before's: the last step's (2 micro-batches, each a plan per attention pattern) and
    # the final preview's are kept, not all 3 steps'
    per_micro_batch = 2 if family == "llama" else 4  # packed self-attention and text; stdit adds frames and positions
    assert 0 < len(_PLANS) < 3 * 2 * per_micro_batch, len(_PLANS)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(run("eager", False)), rtol=1e-5, atol=0)
