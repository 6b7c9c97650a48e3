"""``model.fuse_wgrad_accumulation``: the aten-path linears add their weight gradients into megatron
DDP's fp32 ``main_grad`` inside their backward (``kernels.wgrad_accumulation``), instead of DDP's
hook adding a separate gradient after."""
import dataclasses

import pytest
import torch

from dit_mcore.kernels.wgrad_accumulation import accumulate_wgrad, mixed_addmm_accumulates
from test_training import tiny_run


def _views(dtype=torch.float32):
    """A ``[3, 4]`` gradient view in the middle of a larger buffer, as megatron DDP hands them out."""
    buffer = torch.zeros(20, dtype=dtype)
    return buffer, buffer[4:16].view(3, 4)


@pytest.mark.parametrize("compiled", [False, True])
def test_accumulate_wgrad_adds_the_weight_gradient_in_place(compiled):
    torch.manual_seed(0)
    g = [torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(2)]  # [tokens..., out]
    x = [torch.randn(2, 5, 4, dtype=torch.float64) for _ in range(2)]  # [tokens..., in]
    expected = sum(gi.reshape(-1, 3).t() @ xi.reshape(-1, 4) for gi, xi in zip(g, x))
    op = torch.compile(accumulate_wgrad, fullgraph=True) if compiled else accumulate_wgrad

    buffer, main_grad = _views()
    for gi, xi in zip(g, x):  # two micro-batches accumulate
        op(main_grad, gi.float(), xi.float())
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-6)
    assert not buffer[:4].any() and not buffer[16:].any()  # the rest of the buffer untouched

    # bf16 gradients into an fp32 buffer on the CPU: the bf16 product, added (DDP hook's rounding)
    buffer, main_grad = _views()
    hook = torch.zeros(3, 4)
    for gi, xi in zip(g, x):
        op(main_grad, gi.bfloat16(), xi.bfloat16())
        hook += gi.bfloat16().reshape(-1, 3).t() @ xi.bfloat16().reshape(-1, 4)
    assert torch.equal(main_grad, hook)
    assert not mixed_addmm_accumulates(torch.device("cpu"), torch.bfloat16, torch.float32)


FUSION_CASES = {  # name -> RunConfig overrides (section, field, value)
    "eager": [],
    "compiled": [("model", "compile", True)],
    "bf16": [("trainer", "bf16", True)],
    "full_recompute": [("model", "recompute_granularity", "full"), ("model", "recompute_method", "uniform"),
                       ("model", "recompute_num_layers", 1)],
    "selective_recompute_compiled": [("model", "recompute_granularity", "selective"),
                                     ("model", "recompute_modules", ["mlp"]), ("model", "compile", True)],
    "overlap_distopt": [("parallel", "overlap_grad_reduce", True), ("optim", "use_distributed_optimizer", True)],
    "moe": [("model", "num_moe_experts", 2), ("model", "moe_router_topk", 2), ("model", "moe_aux_loss_coeff", 0.01)],
}


@pytest.mark.parametrize("case", list(FUSION_CASES))
def test_fused_wgrad_accumulation_leaves_the_gradients_of_ddps_hook(tmp_path, monkeypatch, case):
    """After each of two steps (two micro-batches each), every parameter's ``main_grad`` with the
    accumulation in the linears equals the one megatron DDP's hook accumulates, and the fused
    weights' gradients are not zero (the weights are moved off adaLN-Zero's start, where they
    would be). The placeholder gradient the fused backward returns is filled with NaN here: were it
    added (a weight not flagged again after ``zero_grad_buffer``), ``main_grad`` would be NaN."""
    import dit_mcore.models.aten_linear as aten_linear
    from dit_mcore.training.trainer import Trainer

    def run(fuse):
        cfg = tiny_run(tmp_path / f"{case}_{fuse}", max_steps=3)  # 16 samples per step, micro-batches of 8
        cfg.model.aten_linears = True  # the accumulation rides the aten-path linears (both opt-in)
        cfg.model.fuse_wgrad_accumulation = fuse
        for section, field, value in FUSION_CASES[case]:
            setattr(getattr(cfg, section), field, value)
        trainer = Trainer(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in trainer.model[0].parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
        trainer.optimizer.reload_model_params()  # into the fp32 main weights (bf16, distributed optimizer)
        fused = {id(p) for p in trainer.ddp_chunks[0].wgrad_fused_params}
        names = [n for n, p in trainer.model[0].named_parameters() if id(p) in fused]
        grads = []
        for _ in range(2):
            trainer.train_step()
            grads.append({n: p.main_grad.detach().clone() for n, p in trainer.model[0].named_parameters()})
        return grads, names, trainer

    monkeypatch.setattr(aten_linear, "_dummy_wgrad", lambda weight: torch.full_like(weight, float("nan")))
    fused_grads, names, trainer = run(True)
    hook_grads, none, _ = run(False)
    linears = 2 * (2 if case == "moe" else 4)  # MoE experts are megatron's own linears (the hook adds theirs)
    adaln = [n for n in names if "adaLN_modulation" in n]  # each layer's and the final layer's modulation
    assert len(names) == linears + 3 and len(adaln) == 3 and none == [], names
    assert all(n.rsplit(".", 2)[-2] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2") for n in names
               if n not in adaln)
    assert all(p.grad_added_to_main_grad for p in trainer.ddp_chunks[0].wgrad_fused_params)
    for step, (fused, hook) in enumerate(zip(fused_grads, hook_grads)):
        for name in names:
            assert hook[name].abs().max() > 0, (step, name)
        for name in hook:
            if case == "bf16":  # on the CPU the bf16 product is added, as the hook adds it: bit for bit
                assert torch.equal(fused[name], hook[name]), (step, name)
            else:
                torch.testing.assert_close(fused[name], hook[name], rtol=1e-5, atol=1e-7, msg=f"{step} {name}")


def test_a_fused_linear_refuses_another_weight():
    """DDP skips whatever else reaches a fused weight, so a fused linear called with another weight
    refuses instead of letting that gradient drop."""
    from megatron_env import single_process_world
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models import build_model
    from dit_mcore.models.aten_linear import fuse_wgrad_accumulation

    single_process_world()
    model = build_model(dataclasses.replace(preset("tiny"), aten_linears=True, fuse_wgrad_accumulation=True))
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
    assert len(fuse_wgrad_accumulation(model)) == 8 + 3  # two layers' four linears; three adaLN modulations
    fc1 = model.layers[0].mlp.linear_fc1
    x = torch.randn(3, 2, fc1.weight.shape[1])
    fc1(x)[0].sum().backward()
    assert fc1.weight.main_grad.abs().sum() > 0 and fc1.weight.grad is not None  # placeholder for DDP's hook
    with pytest.raises(RuntimeError, match="called with another weight"):
        fc1(x, weight=fc1.weight * 2)
