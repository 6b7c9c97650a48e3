"""``model.compile``: each layer compiled as one graph (no breaks), training as eager does."""
import torch

from dit_mcore.training.trainer import Trainer
from test_training import losses, tiny_run


def test_a_layer_compiles_to_one_graph():
    import torch._dynamo

    from dit_mcore.config import preset
    from dit_mcore.models import build_model
    from dit_mcore.models.layer_stack import _quiet_default_tp_group
    from dit_mcore.models.modulation import Conditioning
    from megatron_env import single_process_world

    single_process_world()
    _quiet_default_tp_group()
    cfg = preset("tiny")
    layer = build_model(cfg).layers[0]
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # fused GPU kernels need half
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = layer.to(device, dtype)  # built outside a trainer: megatron's linears on the GPU, the rest on the host
    explained = torch._dynamo.explain(layer)(
        torch.randn(16, 2, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True),
        Conditioning(torch.randn(2, cfg.hidden_size, device=device, dtype=dtype)))
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def test_compiled_training_equals_eager(tmp_path):
    eager = losses(Trainer(tiny_run(tmp_path / "eager", max_steps=3)).fit())
    cfg = tiny_run(tmp_path / "compiled", max_steps=3)
    cfg.model.compile = True
    trainer = Trainer(cfg)
    compiled = losses(trainer.fit())
    assert all(hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None
               for layer in trainer.model[0].layers)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)
