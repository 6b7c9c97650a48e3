"""``model.fuse_wgrad_accumulation``: the aten-path linears add their weight gradients into megatron
DDP's fp32 ``main_grad`` inside their backward (``kernels.wgrad_accumulation``), instead of DDP's
hook adding a separate gradient after."""
import pytest
import torch

from kernels.wgrad_accumulation import accumulate_wgrad, mixed_addmm_accumulates
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


@pytest.mark.parametrize("compile_, bf16", [(False, False), (True, False), (False, True)])
def test_fused_wgrad_accumulation_trains_as_ddps_hook(tmp_path, monkeypatch, compile_, bf16):
    """Same losses with the accumulation in the linears as with megatron DDP's hook, over two
    micro-batches per step. The placeholder the fused backward returns for each weight is filled
    with NaN here: were it added (the weight not flagged for DDP), the loss would be NaN; were the
    weight flagged but its gradient not accumulated, the updates would differ."""
    import dit_mcore.models.aten_linear as aten_linear
    from dit_mcore.training.trainer import Trainer

    def run(name, fuse):
        cfg = tiny_run(tmp_path / name, max_steps=3)  # 16 samples per step, micro-batches of 8
        cfg.model.fuse_wgrad_accumulation, cfg.model.compile, cfg.trainer.bf16 = fuse, compile_, bf16
        trainer = Trainer(cfg)
        fused = trainer.ddp_chunks[0].wgrad_fused_params
        return [trainer.train_step()["loss"] for _ in range(3)], fused, trainer

    monkeypatch.setattr(aten_linear, "_dummy_wgrad", lambda weight: torch.full_like(weight, float("nan")))
    fused_losses, fused, trainer = run("fused", True)
    hook_losses, none, _ = run("hook", False)
    linears = {name.rsplit(".", 1)[0] for name, p in trainer.model[0].named_parameters()
               if any(p is q for q in fused)}
    assert len(fused) == 8 and all(name.rsplit(".", 1)[-1] in ("linear_qkv", "linear_proj", "linear_fc1",
                                                                "linear_fc2") for name in linears), linears
    assert none == []
    assert all(p.grad_added_to_main_grad for p in fused)  # set again after the step's zero_grad_buffer
    if bf16:  # on the CPU the bf16 product is added, as the hook adds it: bit for bit
        assert fused_losses == hook_losses
    else:
        torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(hook_losses), rtol=1e-6, atol=0)

