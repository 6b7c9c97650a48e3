"""``parallel.tp_comm_overlap``: the flag reaches megatron's config, TE's userbuffers are sized for one
micro-batch on this context-parallel rank and made once, the EMA shadow goes without them, and every
unsupported combination fails before compute naming the field. (The overlap itself runs in TE's
linears on a GPU; here TE's userbuffer API is a recording stand-in.)"""
import sys
import types

import pytest

from dist_utils import run_distributed

from dit_mcore.models import specs
from dit_mcore.parallel import tp_comm_overlap
from dit_mcore.training.parallelize import _shadow_config
from dit_mcore.training.validate import run_problems
from test_parallel_layouts import STEPS, layout_run
from dit_mcore.training.trainer import Trainer

OVERLAP = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "tp_comm_overlap": True}


def _fake_te_modules(calls: list) -> dict:
    """Stand-ins for ``transformer_engine.pytorch.module.base`` recording its userbuffer calls."""
    base = types.SimpleNamespace(initialize_ub=lambda **kw: calls.append(("init", kw)),
                                 destroy_ub=lambda: calls.append(("destroy", None)))
    module = types.SimpleNamespace(base=base)
    return {"transformer_engine": types.SimpleNamespace(pytorch=types.SimpleNamespace(module=module)),
            "transformer_engine.pytorch": types.SimpleNamespace(module=module),
            "transformer_engine.pytorch.module": module, "transformer_engine.pytorch.module.base": base}


@pytest.fixture
def te_userbuffers(monkeypatch):
    calls = []
    for name, value in _fake_te_modules(calls).items():
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setattr(tp_comm_overlap, "_initialized", None)
    return calls


def test_userbuffers_hold_one_micro_batch_per_context_rank_and_are_made_once(tmp_path, te_userbuffers):
    import torch
    cfg = layout_run(tmp_path, "dense", context_parallel_size=2, **OVERLAP)
    config = cfg.model.build(cfg.parallel, bf16=True)
    assert config.tp_comm_overlap and config.sequence_parallel
    shape = tp_comm_overlap.userbuffer_shape(cfg.data, config, dp_size=1)
    assert shape == [2 * (8 // 2) ** 2 // 2, 32]  # micro-batch 2 x 16 tokens, over CP 2; hidden 32
    tp_comm_overlap.initialize_userbuffers(shape, 2, torch.bfloat16)
    tp_comm_overlap.initialize_userbuffers(shape, 2, torch.bfloat16)  # asked again: kept
    assert te_userbuffers == [("init", {"shape": [16, 32], "tp_size": 2, "use_fp8": False, "dtype": torch.bfloat16,
                                        "bootstrap_backend": "nccl"})]
    tp_comm_overlap.initialize_userbuffers([32, 32], 2, torch.bfloat16)  # another shape replaces them
    tp_comm_overlap.release_userbuffers()
    assert [call for call, _ in te_userbuffers] == ["init", "destroy", "init", "destroy"]


def test_userbuffers_hold_every_frame_of_dense_videos(tmp_path):
    cfg = layout_run(tmp_path, "dense", context_parallel_size=2, **OVERLAP)
    cfg.data.name, cfg.data.video_frames = "moving_digits", 4
    config = cfg.model.build(cfg.parallel, bf16=True)
    assert tp_comm_overlap.userbuffer_shape(cfg.data, config, dp_size=1) == [2 * 4 * (8 // 2) ** 2 // 2, 32]


def test_the_ema_shadow_is_built_without_userbuffers(tmp_path):
    cfg = layout_run(tmp_path, "dense", **OVERLAP)
    config = cfg.model.build(cfg.parallel, bf16=True)
    shadow = _shadow_config(config)
    assert config.tp_comm_overlap and not shadow.tp_comm_overlap and shadow is not config


@pytest.mark.parametrize("data, family, parallel, model, bf16, match", [
    ("dense", "dit", {"tensor_model_parallel_size": 2, "tp_comm_overlap": True}, {}, True,
     "needs parallel.tensor_model_parallel_size > 1 and parallel.sequence_parallel=True"),
    ("packed", "dit", OVERLAP, {}, True, "packed streams vary in length"),
    ("video", "dit_xattn", OVERLAP, {}, True, "text cross-attention"),
    ("dense", "dit", OVERLAP, {"backend": "local"}, True, "set model.backend=te"),
    ("dense", "dit", OVERLAP, {"backend": "auto"}, True, "set model.backend=te"),  # (auto: the local linears)
    ("dense", "dit", OVERLAP, {"backend": "te"}, False, "set trainer.bf16=True"),
    ("dense", "dit", OVERLAP, {"backend": "te"}, True, "needs Transformer Engine on a GPU"),
])
def test_unsupported_overlap_fails_before_compute_naming_the_field(tmp_path, monkeypatch, data, family, parallel,
                                                                     model, bf16, match):
    monkeypatch.setattr(specs, "te_installed", lambda: True)  # (the backend's own rule: tested with the model's)
    if match.startswith("needs Transformer Engine"):  # a machine without a GPU (TE counts as installed above)
        import torch
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = layout_run(tmp_path, data, family=family, **dict(parallel))
    for name, value in model.items():
        setattr(cfg.model, name, value)
    cfg.trainer.bf16 = bf16
    problems = run_problems(cfg, 2)
    assert len(problems) == 1 and match in problems[0] and "tp_comm_overlap" in problems[0], problems


def _trainer_worker(rank, world, run_dir):
    calls = []  # the trainer's userbuffer requests (TE's side is tested above)
    tp_comm_overlap.initialize_userbuffers = lambda *args: calls.append(args)
    tp_comm_overlap.check_run = lambda model, bf16: None  # the local linears stand in for TE's here
    sp = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    overlapped = Trainer(layout_run(f"{run_dir}/overlap", "dense", tp_comm_overlap=True, **sp))
    made = list(calls)
    losses = [overlapped.train_step()["loss"] for _ in range(STEPS)]
    plain = Trainer(layout_run(f"{run_dir}/plain", "dense", **sp))
    return {"made": made, "losses": losses, "plain": [plain.train_step()["loss"] for _ in range(STEPS)],
            "config": (overlapped.model_config.tp_comm_overlap, overlapped.ema.module[0].config.tp_comm_overlap)}


def test_the_trainer_makes_the_userbuffers_before_its_first_step(tmp_path):
    """Through the trainer (TP2 + SP, dense micro-batches of 2 x 16 tokens): the userbuffers are made
    once, for those tokens and the hidden size, before any step; the model is built with the flag,
    the EMA shadow without; training is unchanged (the overlap only reorders communication)."""
    import torch
    for result in run_distributed(_trainer_worker, 2, str(tmp_path)):
        assert result["made"] == [([32, 32], 2, torch.float32)]
        assert result["config"] == (True, False)
        assert result["losses"] == result["plain"]
