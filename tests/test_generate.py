"""Generation from checkpoints (``dit_mcore.generate``): every layout gives the one-process latents,
item for item; an item's noise is the same whatever the batch; bad input gives one line.

The checkpoints are tiny models with random weights keyed by name (as the layout tests use: an
adaLN-Zero model fresh from init would predict zeros under any layout). Layouts of one world size run
one after another inside one spawn; the one-process references run in the pytest process.
"""
import json
import math
from dataclasses import replace as dataclasses_replace

import pytest
import torch

from dist_utils import run_distributed
from dit_mcore.errors import ConfigError
from dit_mcore.generate.job import GenerateRequest, generate, layout_from_overrides, plan
from dit_mcore.generate.layout import GenerateParallel

STEPS = 3
LABELS = ["1", "4", "7"]
PROMPTS = ["a 1 moving left", "a 6 moving up"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{"dit": run dir, "xattn": run dir, "ddpm": run dir, ...}``: a class-conditional DiT on 8x8x4 latents,
    a cross-attention DiT on moving-digit clips (4 frames of 8x8, labels and text), the first with the DDPM
    objective (its stochastic sampler draws fresh noise each step), an unconditional one and an ST-DiT on
    the clips; one saved step each."""
    from dit_mcore.parallel.initialize import destroy_distributed
    from dit_mcore.training.trainer import Trainer
    from test_parallel_layouts import _randomize, layout_run
    root = tmp_path_factory.mktemp("generate")
    runs = {}
    for name, data, family in (("dit", "dense", "dit"), ("xattn", "video", "dit_xattn"), ("ddpm", "dense", "dit"),
                               ("uncond", "dense", "dit"), ("stdit", "video", "stdit")):
        cfg = layout_run(root / name, data, family=family)
        if name == "ddpm":
            cfg.diffusion.objective = "ddpm"
        if name == "uncond":  # no classes: no guidance either
            cfg.model.num_classes, cfg.model.class_dropout_prob, cfg.diffusion.cfg_scale = 0, 0.0, 1.0
        trainer = Trainer(cfg)
        _randomize(trainer)
        trainer.save()
        destroy_distributed()
        runs[name] = str(root / name)
    runs["diffusers"] = str(_diffusers_dir(root / "diffusers"))
    from dit_mcore.convert import import_weights  # the same weights as a checkpoint: any layout samples them
    import_weights(runs["diffusers"], root / "imported")
    destroy_distributed()
    runs["imported"] = str(root / "imported")
    return runs


def _diffusers_dir(path):
    """A small random diffusers ``DiTTransformer2DModel`` (10 classes, learned sigma) saved at ``path``."""
    from diffusers import DiTTransformer2DModel

    from test_interop import _fill_random
    d = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8,
                              num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_eps=1e-6)
    _fill_random(d.parameters(), seed=6)
    for block in d.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(d.transformer_blocks[0].norm1.emb.state_dict())
    d.eval().save_pretrained(path)
    return path


def _request(source: str, out, case: str, **kwargs) -> GenerateRequest:
    text = case.split("_")[0] in ("xattn", "stdit")
    conditioning = dict(prompts=PROMPTS) if text else dict(labels=LABELS, num_per_prompt=2)
    if case.startswith("ddpm"):
        conditioning["sampler"] = "ddpm"
    settings = dict(steps=STEPS, cfg_scale=2.0, seed=5, progress=False, save_latents=True, mp4=False)
    where = {"diffusers": source} if case.startswith("diffusers") else {"checkpoint": source}
    return GenerateRequest(out=str(out), **where, **{**settings, **conditioning, **kwargs})


def _run_cases(rank, world, cases):
    for ckpt, out, case, kwargs, layout in cases:
        generate(_request(ckpt, out, case, **kwargs), GenerateParallel(**layout))


def _reference(checkpoints, tmp_path, case, out_name=None, **kwargs) -> torch.Tensor:
    out = tmp_path / f"one_{out_name or case}"
    generate(_request(checkpoints[case.split("_")[0]], out, case, **kwargs))
    return torch.load(out / "latents.pt")


LAYOUTS_2 = {
    "dit_cfg2": {"cfg_parallel": 2},
    "dit_items2": {},
    "dit_cp2_p2p": {"context_parallel_size": 2, "cp_comm_type": "p2p"},
    "dit_tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "dit_pp2": {"pipeline_model_parallel_size": 2},
    "xattn_cfg2": {"cfg_parallel": 2},
    "xattn_cp2_a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
    "ddpm_cfg2": {"cfg_parallel": 2},
    "diffusers_cfg2": {"cfg_parallel": 2},
    "imported_tp2": {"tensor_model_parallel_size": 2},
    "imported_pp2": {"pipeline_model_parallel_size": 2},
    "dit_pf2_sync": {"pipefusion": 2, "pipefusion_warmup_steps": STEPS},
    "dit_pf2": {"pipefusion": 2},
    "xattn_pf2x4": {"pipefusion": 2, "pipefusion_patches": 4},
    "dit_pfx2_cp2": {"pipefusion_patches": 2, "context_parallel_size": 2, "cp_comm_type": "a2a"},  # (one stage)
    "xattn_pfx2_tp2_sp": {"pipefusion_patches": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
    "stdit_pf2x8": {"pipefusion": 2, "pipefusion_patches": 8},  # spatial/temporal, patches of half a frame
    "stdit_pfx4_cp2": {"pipefusion_patches": 4, "context_parallel_size": 2, "cp_comm_type": "a2a"},  # half frames
    "stdit_mesh_cp2": {"context_parallel_size": 2, "hierarchical_context_parallel_sizes": [2, 1]},  # positions split
    # step caching: the ranks sharing a batch take one decision (TeaCache, First-Block-Cache), or none
    "dit_cfg2_tea": {"cfg_parallel": 2},
    "dit_cp2_a2a_fb": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
    "xattn_tp2_sp_tea": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "dit_pp2_fora": {"pipeline_model_parallel_size": 2},
    "dit_pf2_fora": {"pipefusion": 2},  # each patch its own cache
    "dit_pf2_tea": {"pipefusion": 2},  # each patch decides; the decision goes down with the activations
    "xattn_pf2x4_fb": {"pipefusion": 2, "pipefusion_patches": 4},
}
CACHES = {"tea": {"cache": "teacache", "steps": 6}, "fb": {"cache": "fbcache", "steps": 6},
          "fora": {"cache": "fora:2", "steps": 6}}
"""The cache cases' generation settings (by the case name's last part); TeaCache's and First-Block-Cache's
thresholds are chosen in one process (:func:`_deciding`)."""


def _deciding(checkpoints, tmp_path, name, kwargs, layout) -> dict:
    """``kwargs`` with a threshold at which the one-process run (PipeFusion's: its patches on one stage, each
    deciding for itself) both reuses and computes in the middle evaluations (a random model's changes are large),
    so the ranks' agreement decides something."""
    if ":" in kwargs["cache"]:
        return kwargs
    p = GenerateParallel(**layout)
    one = GenerateParallel(pipefusion_patches=p.patches(), pipefusion_warmup_steps=p.pipefusion_warmup_steps) \
        if p.patches() > 1 else None
    for threshold in (0.25, 0.5, 1, 2, 4, 8, 16, 32):
        out = tmp_path / f"threshold_{name}_{threshold}"
        summary = generate(_request(checkpoints[name.split("_")[0]], out, name,
                                    **{**kwargs, "cache": f"{kwargs['cache']}:{threshold}"}), one)
        if 0 < summary["cache"]["skipped"] < summary["cache"]["layer_evaluations"] * (kwargs["steps"] - 2) / kwargs["steps"]:
            return {**kwargs, "cache": f"{kwargs['cache']}:{threshold}"}
    raise AssertionError(f"{name}: no threshold both reuses and computes")
LAYOUTS_4 = {
    "dit_cfg2_cp2_a2a": {"cfg_parallel": 2, "context_parallel_size": 2, "cp_comm_type": "a2a"},
    "dit_cfg2_items2_bs1": {"cfg_parallel": 2},
    "dit_cp4_usp": {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]},
    "xattn_tp2_cfg2": {"tensor_model_parallel_size": 2, "cfg_parallel": 2},
    "ddpm_items4": {},
    "dit_pf2_cfg2": {"pipefusion": 2, "cfg_parallel": 2},
    "xattn_pf2_tp2": {"pipefusion": 2, "tensor_model_parallel_size": 2},
    "dit_pf4x2": {"pipefusion": 4, "pipefusion_patches": 2},  # middle stages; fewer patches than stages
    "xattn_pf2_cp2": {"pipefusion": 2, "context_parallel_size": 2, "cp_comm_type": "p2p"},
    "stdit_pf2_cp2": {"pipefusion": 2, "context_parallel_size": 2},  # DSP under CP: q|k|v displaced instead
}


def test_pipefusion_warms_up_whole_steps_of_every_sampler():
    """Warm-up steps in network evaluations: one per Euler/DDIM step, two per Heun step, and EDM's Heun
    makes no second call on its last step."""
    from dit_mcore.generate.pipefusion import warmup_evaluations
    assert warmup_evaluations(steps=3, evaluations=3, warmup_steps=2) == 2  # Euler, DDIM
    assert warmup_evaluations(steps=3, evaluations=6, warmup_steps=2) == 4  # flow's Heun
    assert warmup_evaluations(steps=3, evaluations=5, warmup_steps=2) == 4  # EDM's Heun
    assert warmup_evaluations(steps=3, evaluations=5, warmup_steps=3) == 5
    assert warmup_evaluations(steps=1, evaluations=1, warmup_steps=1) == 1


def _displaced(layout: dict) -> bool:
    """Whether a layout runs PipeFusion with fewer warm-up steps than steps (not the one-process latents)."""
    p = GenerateParallel(**layout)
    return p.patches() > 1 and p.pipefusion_warmup_steps < STEPS


def _psnr(got: torch.Tensor, want: torch.Tensor) -> float:
    mse = ((got - want) ** 2).mean().item()
    return 10 * math.log10((want.max() - want.min()).item() ** 2 / max(mse, 1e-30))


def _check_displaced(checkpoints, tmp_path, name, layout, got, want, kwargs) -> None:
    """PipeFusion after its warm-up: equal to the patches run displaced on one process (so the stages,
    sends and coroutines change nothing; with a cache, each patch's own), and within a measured distance of the
    one-process latents (3 steps of a random model: each step changes the latents far more than a trained
    sampler's)."""
    p = GenerateParallel(**layout)
    out = tmp_path / f"{name}_one_stage"
    summary = generate(_request(checkpoints[name.split("_")[0]], out, name, **kwargs),
                       GenerateParallel(pipefusion_patches=p.patches(), pipefusion_warmup_steps=p.pipefusion_warmup_steps))
    if "cache" in kwargs:  # (the patches reused something: 1/M of a layer evaluation each)
        assert 0 < summary["cache"]["skipped"] < summary["cache"]["layer_evaluations"], summary["cache"]
    one_stage = torch.load(out / "latents.pt")
    rel = ((got - one_stage).norm() / one_stage.norm()).item()
    assert rel <= 1e-5, f"{name}: relative error {rel:.2e} against the same patches on one process"
    psnr = _psnr(got, want)
    print(f"{name}: PSNR {psnr:.1f} dB against one process ({kwargs.get('steps', STEPS)} steps, warm-up "
          f"{p.pipefusion_warmup_steps}, "
          f"{p.patches()} patches)")
    assert 20 < psnr < 100, f"{name}: PSNR {psnr:.1f} dB against one process"


@pytest.mark.parametrize("world,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["world2", "world4"])
def test_every_generation_layout_gives_the_one_process_latents(checkpoints, tmp_path, world, layouts):
    """CFG-parallel, data parallel over items, sequence parallel (ring, Ulysses, USP), tensor and
    pipeline parallel, PipeFusion synchronised over every step, and their products: the one-process
    latents within fp32 rounding, item for item (diffusers weights brought in as a checkpoint, under
    tensor and pipeline parallel too, and they sample as the direct diffusers path does)
    (the 4-rank CFG x items case also with one item per batch: noise is per item, not per batch; so
    is the DDPM sampler's fresh noise at every step, with the items shared over 4 ranks). PipeFusion
    with one warm-up step: :func:`_check_displaced`."""
    cases = [(checkpoints[name.split("_")[0]], tmp_path / name, name,
              {"batch_size": 1} if name.endswith("bs1") else CACHES.get(name.split("_")[-1], {}), layout)
             for name, layout in layouts.items()]
    cases = [(c, o, n, _deciding(checkpoints, tmp_path, n, k, lay) if "cache" in k else k, lay)
             for c, o, n, k, lay in cases]
    run_distributed(_run_cases, world, cases)
    references = {}
    for _, out, name, kwargs, layout in cases:
        family, cache = name.split("_")[0], kwargs.get("cache")
        if (family, cache) not in references:
            references[family, cache] = _reference(checkpoints, tmp_path, family,
                                                   **({**kwargs, "out_name": name} if cache else {}))
            if cache:  # the cache changed the latents (it reused something), in one process as under the layout
                uncached = _reference(checkpoints, tmp_path, family, steps=kwargs["steps"], out_name=f"{name}_off")
                assert (references[family, cache] - uncached).abs().max() > 1e-4, name
        got, want = torch.load(out / "latents.pt"), references[family, cache]
        assert got.shape == want.shape
        if _displaced(layout):
            _check_displaced(checkpoints, tmp_path, name, layout, got, want, kwargs)
            continue
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
        index = json.loads((out / "index.json").read_text())
        assert [e["index"] for e in index] == list(range(len(want)))
        assert all(e["layout"] != "1 process" for e in index)
    if ("imported", None) in references:  # diffusers weights brought in as a checkpoint sample as they do directly
        torch.testing.assert_close(references["imported", None], _reference(checkpoints, tmp_path, "diffusers"))


def _error(argv, capsys) -> str:
    """The one line ``python -m dit_mcore.generate`` prints for ``argv`` (status 2)."""
    from dit_mcore.generate.cli import main
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate: error: "), lines
    return lines[0]


def test_bad_input_gets_one_line_naming_the_argument_before_any_model(checkpoints, tmp_path, capsys, monkeypatch):
    import dit_mcore.generate.job as job
    monkeypatch.setattr(job, "initialize_distributed", lambda *a, **k: pytest.fail("a process group was built"))
    dit, xattn, out = checkpoints["dit"], checkpoints["xattn"], str(tmp_path / "out")
    assert "no such directory" in _error(["--checkpoint", str(tmp_path / "nope"), "--labels", "1", "--out", out], capsys)
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    line = _error(["--checkpoint", str(empty), "--labels", "1", "--out", out], capsys)
    assert "no checkpoint there" in line and "notes/" in line  # lists what is there
    line = _error(["--checkpoint", dit, "--step", "7", "--labels", "1", "--out", out], capsys)
    assert "--step 7" in line and "it has steps 0" in line
    assert "--prompts" in _error(["--checkpoint", dit, "--prompts", "a cat", "--out", out], capsys)
    assert "--labels" in _error(["--checkpoint", xattn, "--labels", "1", "--out", out], capsys)
    assert "classes 0..9" in _error(["--checkpoint", dit, "--labels", "10", "--out", out], capsys)
    assert "nothing to generate" in _error(["--checkpoint", dit, "--out", out], capsys)
    assert "--height 7" in _error(["--checkpoint", dit, "--labels", "1", "--height", "7", "--out", out], capsys)
    assert "--sampler" in _error(["--checkpoint", dit, "--labels", "1", "--sampler", "ddim", "--out", out], capsys)
    line = _error(["--checkpoint", dit, "--labels", "1", "--out", out, "parallel.tensor_model_parallel_size=3"], capsys)
    assert "world size 1" in line
    assert "did you mean" in _error(["--checkpoint", dit, "--labels", "1", "--out", out, "parallel.cfg_paralel=2"], capsys)
    assert "parallel.cfg_parallel=2" in _error(["--checkpoint", dit, "--labels", "1", "--cfg-scale", "1", "--out", out,
                                                "parallel.cfg_parallel=2"], capsys)
    assert "no label given" in _error(["--checkpoint", dit, "--labels", ",", "--out", out], capsys)
    assert "an integer" in _error(["--checkpoint", dit, "--labels", "1", "--out", out,
                                   "parallel.tensor_model_parallel_size=two"], capsys)
    assert "experts whole" in _error(["--checkpoint", dit, "--labels", "1", "--out", out,
                                      "parallel.expert_model_parallel_size=2"], capsys)
    assert "--steps 1001" in _error(["--checkpoint", checkpoints["ddpm"], "--labels", "1", "--steps", "1001",
                                     "--out", out], capsys)
    line = _error(["--checkpoint", dit, "--labels", "1", "--out", out, "parallel.pipefusion_patches=3"], capsys)
    assert "16 tokens" in line and "3 patches" in line
    assert "plain pipeline" in _error(["--checkpoint", dit, "--labels", "1", "--out", out, "parallel.pipefusion=2",
                                       "parallel.pipefusion_patches=1"], capsys)
    assert "one chunk per stage" in _error(["--checkpoint", dit, "--labels", "1", "--out", out, "parallel.pipefusion=2",
                                            "parallel.virtual_pipeline_model_parallel_size=2"], capsys)
    assert "pipefusion_patches=2" in _error(["--diffusers", checkpoints["diffusers"], "--labels", "1", "--out", out,
                                             "parallel.pipefusion_patches=2"], capsys)
    line = _error(["--checkpoint", checkpoints["ddpm"], "--labels", "1", "--sampler", "ddpm", "--out", out,
                   "parallel.pipefusion_patches=2"], capsys)
    assert "--sampler ddim" in line
    with pytest.raises(ConfigError, match="16 equal patches of 2 ranks' pieces each"):  # 16 tokens, CP2
        plan(GenerateRequest(checkpoint=dit, labels=["1"], out=out),
             GenerateParallel(pipefusion_patches=16, context_parallel_size=2), world_size=2)
    assert "set parallel.pipefusion only" in _error(["--checkpoint", dit, "--labels", "1", "--out", out,
                                                     "parallel.pipefusion=2", "parallel.pipeline_model_parallel_size=4"],
                                                    capsys)
    assert "unconditional" in _error(["--checkpoint", checkpoints["uncond"], "--labels", "1", "--out", out], capsys)
    from dit_mcore.training import checkpoint as ckpt
    load_common = ckpt.load_common
    monkeypatch.setattr(ckpt, "load_common", lambda path: {k: v for k, v in load_common(path).items()
                                                           if k != "run_config"})
    assert "resume its training" in _error(["--checkpoint", dit, "--labels", "1", "--out", out], capsys)
    monkeypatch.setattr(ckpt, "load_common", load_common)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "--out" in _error(["--checkpoint", dit, "--labels", "1", "--out", str(blocker / "sub")], capsys)


def test_the_same_request_gives_the_same_items_whatever_the_batch_and_writes_its_index(checkpoints, tmp_path):
    """Batch size 1 and 4 give the same latents (noise per item); one PNG per item, a grid and
    index.json with what made each item; the run's sampling defaults apply when not given."""
    one = _request(checkpoints["dit"], tmp_path / "b1", "dit", batch_size=1)
    four = _request(checkpoints["dit"], tmp_path / "b4", "dit", batch_size=4, steps=None, cfg_scale=None)
    generate(one)
    summary = generate(dataclasses_replace(four, steps=STEPS, cfg_scale=2.0))
    a, b = torch.load(tmp_path / "b1" / "latents.pt"), torch.load(tmp_path / "b4" / "latents.pt")
    assert ((a - b).norm() / a.norm()).item() <= 1e-5  # fp32 rounding of other GEMM shapes only
    index = json.loads((tmp_path / "b4" / "index.json").read_text())
    assert [e["label"] for e in index] == [1, 1, 4, 4, 7, 7] and summary["items"] == 6
    assert all((tmp_path / "b4" / e["file"]).is_file() for e in index) and (tmp_path / "b4" / "grid.png").is_file()
    assert {e["steps"] for e in index} == {STEPS} and {e["sampler"] for e in index} == {"euler"}
    defaults = plan(four, world_size=1)  # the run's diffusion.sample_steps and cfg_scale
    assert (defaults.steps, defaults.cfg_scale) == (2, 1.5)


def test_clips_of_a_text_model_are_gifs_and_mp4s_with_a_strip(checkpoints, tmp_path):
    import av
    request = _request(checkpoints["xattn"], tmp_path / "clips", "xattn", mp4=True, num_per_prompt=1)
    generate(request)
    index = json.loads((tmp_path / "clips" / "index.json").read_text())
    assert [e["prompt"] for e in index] == PROMPTS
    for entry in index:
        gif, mp4 = entry["files"]
        assert gif.endswith(".gif") and mp4.endswith(".mp4")
        with av.open(str(tmp_path / "clips" / mp4)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 4  # the model's 4 frames
    assert (tmp_path / "clips" / "strip.png").is_file()
    assert torch.load(tmp_path / "clips" / "latents.pt").shape == (2, 1, 4, 8, 8)


def test_diffusers_weights_generate_as_the_imported_model_samples_with_ddim(checkpoints, tmp_path, capsys):
    """``--diffusers``: the DDPM objective's DDIM on the interop-loaded model (which equals diffusers'
    own ``DiTPipeline``, ``tests/test_ddpm.py``), with each item's noise; model parallel layouts are
    refused with the way round."""
    from dit_mcore.diffusion import build_objective
    from dit_mcore.diffusion.samplers import sample
    from dit_mcore.convert import load_diffusers
    from dit_mcore.generate.items import item_noise, make_items
    from dit_mcore.models.adapter import image_model_fn
    request = _request(checkpoints["diffusers"], tmp_path / "d", "diffusers", steps=None, cfg_scale=None)
    p = plan(request, world_size=1)
    assert (p.steps, p.cfg_scale, p.sampler, p.run.diffusion.objective) == (50, 4.0, "ddim", "ddpm")
    generate(dataclasses_replace(request, steps=6))
    got = torch.load(tmp_path / "d" / "latents.pt")
    model = load_diffusers(checkpoints["diffusers"])
    items = make_items(labels=[int(y) for y in LABELS], num_per_prompt=2)
    want = sample(build_objective("ddpm"), image_model_fn(model, model.config), item_noise(items, 5, (4, 8, 8)), 6,
                  labels=torch.tensor([it.label for it in items]), null_label=10, cfg_scale=4.0)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    line = _error(["--diffusers", checkpoints["diffusers"], "--labels", "1", "--out", str(tmp_path / "x"),
                   "parallel.context_parallel_size=2"], capsys)
    assert "--to checkpoint" in line


def test_facebookresearch_weights_generate_as_the_imported_model_samples(tmp_path):
    """``--facebookresearch FILE --preset``: the state dict (a training checkpoint's ``ema`` too) loads
    through the interop and samples with DDIM (frequency shift 0, as the reference DiT)."""
    from dit_mcore.models.dit.config import preset
    from dit_mcore.diffusion import build_objective
    from dit_mcore.diffusion.samplers import sample
    from dit_mcore.generate.items import item_noise, make_items
    from dit_mcore.models.dit.interop import export_facebookresearch
    from dit_mcore.models.dit.interop.mapping import build_model
    from dit_mcore.models.adapter import image_model_fn
    from dit_mcore.parallel.initialize import whole_model_world
    from test_interop import _fill_random
    whole_model_world()
    model = build_model(preset("tiny", timestep_freq_shift=0.0)).eval()
    _fill_random(model.parameters(), seed=7)
    torch.save({"ema": export_facebookresearch(model), "args": None}, tmp_path / "dit.pt")
    generate(GenerateRequest(facebookresearch=str(tmp_path / "dit.pt"), preset="tiny", labels=["0", "9"], steps=4,
                             seed=2, save_latents=True, progress=False, out=str(tmp_path / "out")))
    items = make_items(labels=[0, 9])
    want = sample(build_objective("ddpm"), image_model_fn(model, model.config), item_noise(items, 2, (4, 8, 8)), 4,
                  labels=torch.tensor([0, 9]), null_label=10, cfg_scale=4.0)
    got = torch.load(tmp_path / "out" / "latents.pt")
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_an_unconditional_model_generates_num_per_prompt_items(checkpoints, tmp_path):
    generate(GenerateRequest(checkpoint=checkpoints["uncond"], num_per_prompt=3, steps=2, progress=False,
                             save_latents=True, out=str(tmp_path / "u")))
    index = json.loads((tmp_path / "u" / "index.json").read_text())
    assert [e["index"] for e in index] == [0, 1, 2] and all("label" not in e and "prompt" not in e for e in index)
    assert torch.load(tmp_path / "u" / "latents.pt").shape == (3, 4, 8, 8)
    # guidance needs a condition: an unconditional model with a null-class embedding still refuses a scale
    from types import SimpleNamespace

    from dit_mcore.generate.sampling import check_guidance
    with pytest.raises(ConfigError, match="--cfg-scale 2.0: this model is unconditional"):
        check_guidance(SimpleNamespace(text_dim=0, num_classes=0, use_cfg_embedding=True), 2.0)


@pytest.mark.parametrize("trained", ["mesh", "dsp_overlap"])
def test_the_st_dits_attention_path_is_the_generation_layouts(checkpoints, tmp_path, monkeypatch, trained):
    """A checkpoint trained on the two-level mesh samples on one process (the mesh needs context parallel) and
    under PipeFusion (whose displaced layers gather the keys and values: DSP's token order); a layout with
    hierarchical context parallel sizes samples on the mesh (equal to one process: ``stdit_mesh_cp2``)."""
    from dit_mcore.generate import job
    read_run = job.read_run

    def trained_on(path, *args):
        run = read_run(path, *args)
        run.model.st_attention = trained
        return run
    monkeypatch.setattr(job, "read_run", trained_on)
    request = GenerateRequest(checkpoint=checkpoints["stdit"], prompts=PROMPTS, out=str(tmp_path))
    mesh = dict(context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 1])
    dsp = "dsp" if trained == "mesh" else trained
    for layout, world, path in ((GenerateParallel(), 1, dsp), (GenerateParallel(**mesh), 2, "mesh"),
                                (GenerateParallel(pipefusion_patches=4, context_parallel_size=2), 2, dsp),
                                (GenerateParallel(context_parallel_size=2), 2, dsp)):
        assert plan(request, layout, world_size=world).run.model.st_attention == path, (layout, world)
    with pytest.raises(ConfigError, match="unset it: PipeFusion with context_parallel_size samples the ST-DiT on"):
        plan(request, GenerateParallel(pipefusion_patches=4, **mesh), world_size=2)


def test_overrides_are_the_generation_layout():
    layout = layout_from_overrides(["parallel.cfg_parallel=2", "parallel.cp_comm_type=a2a"])
    assert layout.cfg_parallel == 2 and layout.cp_comm_type == "a2a"
    with pytest.raises(ConfigError, match="parallel.<field>=<value>"):
        layout_from_overrides(["model.num_layers=2"])


@pytest.mark.slow
def test_the_nemo_run_factory_under_torchrun_gives_the_one_process_latents(checkpoints, tmp_path):
    """``recipes/generate.py --factory generate`` launched by torchrun (2 ranks, CFG-parallel) as
    training is launched: the in-process one-process latents."""
    from test_recipes import REPO, cli
    rc, out = cli(["--factory", "generate", f"request.checkpoint={checkpoints['dit']}", 'request.labels=["1","4","7"]',
                   "request.num_per_prompt=2", f"request.steps={STEPS}", "request.cfg_scale=2.0", "request.seed=5",
                   "request.save_latents=True", "request.progress=False", f"request.out={tmp_path / 'tr'}",
                   "parallel.cfg_parallel=2"], tmp_path, nproc=2, script=REPO / "recipes" / "generate.py")
    assert rc == 0, out
    assert "on cfg2 (2 processes)" in out
    want = _reference(checkpoints, tmp_path, "dit")
    got = torch.load(tmp_path / "tr" / "latents.pt")
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def _tiny_vae(path, latent_channels=4):
    """A small random diffusers ``AutoencoderKL`` (8x8 latents -> 16x16 RGB) saved at ``path``."""
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8, sample_size=16).eval()
    vae.save_pretrained(path)
    return vae


def test_imported_latents_are_decoded_by_the_pipelines_vae(checkpoints, tmp_path, capsys):
    """``--diffusers PIPELINE/transformer`` decodes through the ``vae/`` beside it (a ``DiTPipeline``'s layout),
    as diffusers decodes: ``vae.decode(latents / scaling_factor)``; ``--vae`` names one; a folder without a
    VAE and a VAE of other latent channels are refused in one line."""
    import shutil

    import numpy as np
    from PIL import Image
    pipe = tmp_path / "pipe"
    shutil.copytree(checkpoints["diffusers"], pipe / "transformer")
    vae = _tiny_vae(pipe / "vae")
    out = tmp_path / "out"
    generate(GenerateRequest(diffusers=str(pipe / "transformer"), labels=["1", "4"], steps=2, seed=3,
                             save_latents=True, progress=False, out=str(out)))
    latents = torch.load(out / "latents.pt")
    with torch.no_grad():
        want = (vae.decode(latents / vae.config.scaling_factor).sample.clamp(-1, 1) + 1) * 127.5
    index = json.loads((out / "index.json").read_text())
    for row, entry in enumerate(index):
        got = torch.from_numpy(np.array(Image.open(out / entry["file"]).convert("RGB"))).permute(2, 0, 1).float()
        assert got.shape == (3, 16, 16) and (got - want[row]).abs().max() <= 1.0
    assert plan(GenerateRequest(checkpoint=checkpoints["dit"], labels=["1"], vae=str(pipe), out=str(tmp_path / "o")),
                world_size=1).vae == pipe / "vae"  # a pipeline folder names its vae/
    line = _error(["--diffusers", str(pipe / "transformer"), "--labels", "1", "--vae", str(tmp_path), "--out",
                   str(tmp_path / "o")], capsys)
    assert f"--vae {tmp_path}: no diffusers VAE there" in line
    _tiny_vae(tmp_path / "vae8", latent_channels=8)
    line = _error(["--diffusers", str(pipe / "transformer"), "--labels", "1", "--vae", str(tmp_path / "vae8"),
                   "--out", str(tmp_path / "o")], capsys)
    assert "8 channels but the model's have 4" in line
