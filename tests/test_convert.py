"""``python -m dit_mcore.convert``: a trained run's checkpoint out as a diffusers ``DiTTransformer2DModel``
folder that diffusers loads and runs as our model does, a facebookresearch/DiT state dict or a safetensors
file of our own tensors, with the EMA or the trained weights; bad input gets one line naming the
argument and the fix."""
import json

import pytest
import torch

from dit_mcore.training.trainer import Trainer
from test_interop import _close, _diffusers_forward
from test_training import tiny_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny class-conditional DiT trained 3 steps (checkpoint at step 3), with its EMA and weights."""
    run_dir = tmp_path_factory.mktemp("run")
    trainer = Trainer(tiny_run(run_dir, max_steps=3))
    trainer.fit()
    ema = {k: v.detach().clone() for k, v in trainer.ema.module[0].state_dict().items() if torch.is_tensor(v)}
    model = {k: v.detach().clone() for k, v in trainer.model[0].state_dict().items() if torch.is_tensor(v)}
    assert any(not torch.equal(ema[k], model[k].float()) for k in ema)  # (so the two exports tell them apart)
    return run_dir, ema, model


@pytest.mark.parametrize("weights", ["ema", "model"])
def test_a_checkpoint_exports_to_diffusers_which_runs_it_as_we_do(trained, tmp_path, weights):
    from diffusers import DiTTransformer2DModel

    from dit_mcore.convert import load_diffusers
    from dit_mcore.convert.__main__ import main
    from dit_mcore.models.dit.interop import reference_forward
    run_dir, ema, model = trained
    out = tmp_path / "exported"
    assert main([str(run_dir), str(out), "--to", "diffusers", "--weights", weights]) == 0
    source = json.loads((out / "dit_mcore_source.json").read_text())
    assert source["weights"] == weights and source["checkpoint"].endswith("step_00000003")
    back = load_diffusers(str(out))  # our model from the exported folder: exactly the checkpoint's weights
    want = ema if weights == "ema" else model
    assert set(want) <= set(back.state_dict())
    for name, tensor in back.state_dict().items():
        if name in want:
            assert torch.equal(tensor, want[name].float()), name
    d = DiTTransformer2DModel.from_pretrained(str(out), local_files_only=True).eval()
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(3, 1, 8, 8, generator=g), torch.tensor([0.0, 37.5, 999.0]), torch.tensor([1, 10, 7])
    with torch.no_grad():
        ours = reference_forward(back, x, t, y)
    _close(ours, _diffusers_forward(d, x, t, y))


def test_facebookresearch_export_writes_a_state_dict_that_loads_back(trained, tmp_path):
    from dit_mcore.convert import export_checkpoint, load_facebookresearch
    run_dir, ema, _ = trained
    written = export_checkpoint(str(run_dir), str(tmp_path / "fb"), to="facebookresearch")
    state = torch.load(written)
    assert written.name == "dit.pt" and "x_embedder.proj.weight" in state and "pos_embed" in state
    m = tiny_run(tmp_path).model  # the architecture the run trained
    back = load_facebookresearch(state, m.preset, num_layers=m.num_layers, hidden_size=m.hidden_size,
                                 num_attention_heads=m.num_attention_heads, input_size=m.input_size,
                                 patch_size=m.patch_size)
    assert set(ema) <= set(back.state_dict())
    for name, tensor in back.state_dict().items():
        if name in ema:
            assert torch.equal(tensor, ema[name].float()), name


def test_bad_input_names_the_flag_and_the_fix(trained, tmp_path, capsys):
    from dit_mcore.convert.__main__ import main
    run_dir, _, _ = trained
    assert main([str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main([str(run_dir), str(tmp_path / "o"), "--step", "2"]) == 2
    assert "--step 2: no such checkpoint" in capsys.readouterr().err
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    assert main([str(run_dir), str(full)]) == 2
    assert "--out" in capsys.readouterr().err and (full / "x").read_text() == "keep me"


def test_safetensors_export_holds_the_whole_model_under_our_names(trained, tmp_path):
    from safetensors.torch import load_file

    from dit_mcore.convert.__main__ import main
    run_dir, _, model = trained
    assert main([str(run_dir), str(tmp_path / "st"), "--to", "safetensors", "--weights", "model"]) == 0
    tensors = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert set(tensors) == set(model)
    assert all(torch.equal(tensors[k], model[k]) for k in model)
    source = json.loads((tmp_path / "st" / "dit_mcore_source.json").read_text())
    assert source["model"]["family"] == "dit" and source["model"]["num_layers"] == 2


def test_a_missing_optional_package_is_one_line_with_the_install_command(monkeypatch, tmp_path, capsys):
    import dit_mcore.convert.__main__ as cli

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'diffusers'", name="diffusers")
    monkeypatch.setattr(cli, "export_checkpoint", missing)
    assert cli.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "needs the diffusers package: pip install 'dit-mcore[encoders]'" in capsys.readouterr().err
