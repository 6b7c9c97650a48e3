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
    """3D RoPE (llama) and the spatial/temporal reorders (stdit) compile too: same losses as eager."""
    from energon_data.config import DataConfig

    def run(name, compile_):
        cfg = tiny_run(tmp_path / name, max_steps=3)
        cfg.model.family, cfg.model.preset, cfg.model.compile = family, preset, compile_
        cfg.model.in_channels, cfg.model.num_classes = 1, 10
        cfg.data = DataConfig(name="moving_digits", image_size=8, video_frames=2, num_videos=64, global_batch_size=8,
                              micro_batch_size=4)
        return losses(Trainer(cfg).fit())
    torch.testing.assert_close(torch.tensor(run("compiled", True)), torch.tensor(run("eager", False)), rtol=1e-5,
                               atol=0)
