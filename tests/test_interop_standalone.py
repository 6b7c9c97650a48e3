"""Conversion needs no setup: a fresh interpreter converts diffusers weights in and out through
``dit_mcore.convert`` without first initialising megatron's parallel state; the models layer's interop
names the way when that state is missing, and model-parallel worlds are refused."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_env import single_process_world

TESTS = Path(__file__).resolve().parent

_FRESH_INTERPRETER = """
import os, sys
from diffusers import DiTTransformer2DModel
import torch
from dit_mcore.convert import export_diffusers, load_diffusers
from dit_mcore.models.dit.interop import reference_forward
from test_interop import _close, _diffusers_forward, _inputs, _tiny_diffusers

root = sys.argv[1]
d = _tiny_diffusers()
d.save_pretrained(f"{root}/in")
model = load_diffusers(f"{root}/in")
x, t, y = _inputs()
with torch.no_grad():
    ours = reference_forward(model, x, t, y)
ref = _diffusers_forward(d, x, t, y)
_close(ours, ref)
export_diffusers(model, f"{root}/out")
back = DiTTransformer2DModel.from_pretrained(f"{root}/out", local_files_only=True).eval()
_close(_diffusers_forward(back, x, t, y), ref)
leaked = sorted({"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} & set(os.environ))
assert not leaked, f"interop set environment variables {leaked}"
print("interop ok")
"""


def test_load_and_export_diffusers_in_a_fresh_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    run = subprocess.run([sys.executable, "-c", _FRESH_INTERPRETER, str(tmp_path)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "interop ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_model_parallel_worlds_are_refused(monkeypatch):
    from megatron.core import parallel_state

    from dit_mcore.models.dit.interop import InteropError
    from dit_mcore.models.dit.interop.mapping import require_whole_model_world
    single_process_world()
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(InteropError, match="tensor/pipeline parallel sizes are 2/1; convert in a single-process"):
        require_whole_model_world()


def test_the_models_layer_names_the_way_when_megatron_has_no_parallel_state(monkeypatch):
    from megatron.core import parallel_state

    from dit_mcore.models.dit.interop import InteropError
    from dit_mcore.models.dit.interop.mapping import require_whole_model_world
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(InteropError, match="use the same functions from dit_mcore.convert"):
        require_whole_model_world()
