"""Recipes: factories resolve to the intended settings, CLI overrides reach the config, the Slurm
dry run renders a torchrun sbatch script, failed runs exit non-zero, and a torchrun launch of the
tiny recipe reproduces an in-process run of the same config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import fiddle as fdl
import pytest
from nemo_run.cli.cli_parser import parse_cli_args

from dist_utils import run_distributed
from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from energon_data.datasets import load_digits
from dit_mcore.recipes.pretrain_xl import pretrain_digits, pretrain_tiny, pretrain_xl
from dit_mcore.recipes.entry import build_run_config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "pretrain_xl.py"
# Variables a launcher sets; the pytest process may carry them from in-process training tests.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def resolve(factory, overrides=()):
    """The RunConfig a CLI call `--factory <factory> <overrides>` trains, parsed by nemo-run."""
    task = factory()
    parse_cli_args(task, list(overrides), task)
    return build_run_config(**fdl.build(task).keywords)


def cli(args, tmp_path, *, nproc=None, timeout=240, script=SCRIPT, warnings="ignore"):
    env = {k: v for k, v in os.environ.items() if k not in (*_LAUNCH_ENV, "PYTHONWARNINGS")}
    env.update(COLUMNS="200", NEMORUN_HOME=str(tmp_path / "nemo_run"), **({"PYTHONWARNINGS": warnings} if warnings else {}))
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, str(script), "--yes", *args], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_pretrain_xl_has_the_dit_paper_settings_and_needs_data():
    task = fdl.build(pretrain_xl()).keywords
    model = task["model"].build(ParallelConfig())
    # DiT paper, Table 1 (XL) at patch 2, on 256px images encoded to 32x32x4 latents.
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.patch_size) == (28, 1152, 16, 2)
    assert (model.input_size, model.in_channels, model.num_classes) == (32, 4, 1000)
    assert model.learn_sigma and model.class_dropout_prob == 0.1
    optim, trainer, data = task["optim"], task["trainer"], task["data"]
    assert (optim.lr, optim.decay_style, optim.warmup_steps, optim.weight_decay) == (1e-4, "constant", 0, 0.0)
    assert (data.global_batch_size, trainer.ema_decay, trainer.max_steps) == (256, 0.9999, 400_000)
    with pytest.raises(ConfigError, match="data.path"):
        build_run_config(**task)
    assert resolve(pretrain_xl, ["data.path=/data/in1k"]).data.path == "/data/in1k"


@pytest.mark.parametrize("factory", [pretrain_digits, pretrain_tiny])
def test_cpu_recipes_match_the_builtin_digits(factory):
    from dit_mcore.training.data_fit import fit_model_to_data
    cfg = resolve(factory)
    fit_model_to_data(cfg)  # (as the trainer does: the shape fields a recipe leaves unset are the data's)
    model = cfg.model.build(cfg.parallel)
    images, labels = load_digits(size=cfg.data.image_size)
    assert tuple(images.shape[1:]) == (model.in_channels, model.input_size, model.input_size)
    assert model.num_classes == int(labels.max()) + 1
    for dp in (1, 2):  # a plain run and `--nproc-per-node 2`
        assert cfg.data.num_microbatches(dp) >= 1
    assert cfg.data.global_batch_size <= len(images)


def test_the_digits_demo_logs_its_validation_loss_and_fid_through_the_command_line(tmp_path):
    """The demo's evaluations, a few steps of a smaller model: the validation loss and the FID (attached by the
    command line, as the previews are) at the last step, in metrics.jsonl."""
    run_dir = tmp_path / "run"
    rc, out = cli(["--factory", "pretrain_digits", "trainer.max_steps=2", "optim.warmup_steps=1", "model.num_layers=1",
                   "data.image_size=8",
                   "data.global_batch_size=16", "trainer.fid_samples=70", "diffusion.sample_steps=2",
                   "log.samples_per_class=1", "log.tensorboard=false", "log.progress_bar=false", f"log.dir={run_dir}"],
                  tmp_path)
    assert rc == 0, out[-3000:]
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and last["eval/fid"] > 0 and last["val/ema_loss"] > 0, last
    assert "validation loss every 500 steps: 128 samples (8 global batches)" in out


def test_overrides_reach_every_section():
    cfg = resolve(pretrain_digits, ["trainer.max_steps=20", "log.dir=/tmp/run", "optim.lr=0.002",
                                            "model.num_layers=3", "data.micro_batch_size=32",
                                            "diffusion.objective=edm", "parallel.context_parallel_size=2"])
    assert (cfg.trainer.max_steps, cfg.log.dir, cfg.optim.lr) == (20, "/tmp/run", 0.002)
    assert (cfg.model.num_layers, cfg.data.micro_batch_size, cfg.diffusion.objective) == (3, 32, "edm")
    assert cfg.parallel.context_parallel_size == 2
    # untouched fields keep the recipe's values
    assert (cfg.model.preset, cfg.optim.decay_style, cfg.trainer.ema_decay) == ("digits", "cosine", 0.998)


def test_slurm_dryrun_renders_an_srun_per_gpu_sbatch(tmp_path):
    rc, out = cli(["--dryrun", "--factory", "pretrain_tiny", f"log.dir={tmp_path / 'run'}", "run.executor=slurm",
                   "run.executor.nodes=2", "run.executor.gpus_per_node=4", "run.executor.account=acme"], tmp_path)
    assert rc == 0, out
    flat = " ".join(out.split())  # undo the console's line wrapping
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --account=acme", "--container-image dit-mcore:latest",
                 "python -m nemo_run.core.runners.fdl_runner", "#SBATCH --requeue", "#SBATCH --signal=USR1@120"):
        assert line in flat, line
    # No torchrun agent between Slurm and the trainers: SIGUSR1 would kill it (and the step) mid-save.
    script = flat[flat.index("#!/bin/bash"):]
    assert "torchrun" not in script
    assert not (tmp_path / "run").exists()  # nothing trained


@pytest.mark.parametrize("override, message", [
    ("model.preset=nope", "model.preset='nope': unknown preset"),
    ("trainer.max_step=1", "TrainerConfig has no field 'max_step'; did you mean 'max_steps'?"),
    ("optim.lr=-1", "optim.lr=-1.0: must be a finite number > 0"),
])
def test_failed_run_exits_nonzero(tmp_path, override, message):
    rc, out = cli(["--factory", "pretrain_tiny", override, f"log.dir={tmp_path / 'run'}"], tmp_path)
    assert rc != 0 and message in out, out
    error_lines = [line for line in out.splitlines() if line.startswith("Error: ")]
    assert error_lines and message in error_lines[0] and "Unexpected error" not in out, out  # expected: said as one


def test_a_clean_start_prints_the_projects_lines_and_no_known_third_party_warning(tmp_path):
    from dit_mcore.models import specs
    rc, out = cli(["--factory", "pretrain_tiny", "trainer.max_steps=1", f"log.dir={tmp_path / 'run'}"], tmp_path,
                  warnings=None)
    assert rc == 0, out
    assert "Warning" not in out, out  # megatron's Transformer Engine / apex import warnings, its deprecated default
    assert specs.fallbacks_line() is None or f"INFO {specs.fallbacks_line()}" in out, out  # said once instead
    assert "INFO the model's shape from its data: model.in_channels=1 model.input_size=8" in out, out
    assert "Resolved Arguments" not in out, out  # nemo-run's table: --dryrun prints it, a run writes run_config.json
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["trainer"]["max_steps"] == 1


def test_help_config_lists_every_field_of_a_section(tmp_path):
    rc, out = cli(["--help-config", "trainer"], tmp_path)
    assert rc == 0 and "  trainer.max_steps: int = " in out and "  model." not in out, out
    rc, out = cli(["--help-config=trainr"], tmp_path)
    assert rc == 2 and "--help-config trainr: no such section; use one of" in out, out


@pytest.mark.slow
def test_failed_run_exits_nonzero_under_torchrun(tmp_path):
    rc, out = cli(["--factory", "pretrain_tiny", "model.preset=nope", f"log.dir={tmp_path / 'run'}"], tmp_path,
                  nproc=2)
    assert rc != 0 and "model.preset='nope': unknown preset" in out, out


def _in_process_losses(rank, world_size, run_dir):
    from dit_mcore.training.trainer import pretrain
    return [h["loss"] for h in pretrain(resolve(pretrain_tiny, ["trainer.max_steps=2", f"log.dir={run_dir}"]))]


@pytest.mark.slow
def test_torchrun_tiny_run_matches_in_process_run(tmp_path):
    rc, out = cli(["--factory", "pretrain_tiny", "trainer.max_steps=2", "log.dir=tmp"], tmp_path, nproc=2)
    assert rc == 0, out
    metrics = [json.loads(line) for line in (tmp_path / "tmp" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # Data parallelism over 2 ranks must not change the math of the 1-process run.
    reference = run_distributed(_in_process_losses, 1, str(tmp_path / "reference"))[0]
    assert [m["loss"] for m in metrics] == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("family, preset", [("dit_xattn", "xattn-moving-digits"), ("llama", "llama-moving-digits"),
                                            ("stdit", "stdit-moving-digits")])
def test_t2v_digits_recipe_trains_and_writes_prompt_clips(tmp_path, family, preset):
    """The text-to-video demo through the CLI, a few steps, with each text family: a clip per prompt
    (GIF of the dataset's frames, sampled from the EMA weights with text CFG), a strip and an index
    of what was generated."""
    run_dir = tmp_path / "run"
    rc, out = cli(["--factory", "pretrain_t2v_digits", f"model.family={family}", f"model.preset={preset}",
                   "trainer.max_steps=2", "optim.warmup_steps=0", "data.num_videos=64",
                   "data.global_batch_size=8", "trainer.val_samples=16", "log.sample_interval=2",
                   "diffusion.sample_steps=2",
                   "log.tensorboard=false", "log.progress_bar=false", f"log.dir={run_dir}"], tmp_path, timeout=400)
    assert rc == 0, out[-3000:]
    from PIL import Image
    folder = run_dir / "samples" / "step_000002"
    index = json.loads((folder / "index.json").read_text())
    assert [e["prompt"] for e in index] == [f"a {d} moving {w}" for d, w in
                                            zip(range(10), ["left", "right", "up", "down"] * 3)]
    gif = Image.open(folder / index[3]["file"])
    assert gif.size == (16, 16) and gif.n_frames == 4
    strip = Image.open(folder / "strip.png")
    assert strip.size[1] > strip.size[0]  # ten rows of four frames
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 2 and metrics[-1]["model_flops"] > 0
    assert "val/loss" in metrics[-1]  # the recipe validates (on 16 samples here)


def test_the_launchers_import_with_the_collector_paused_then_freeze_what_they_imported():
    """``dit_mcore/startup.py``: the collector is off inside the block and on after it, with what the block made
    frozen (a full pass skips it); each launcher (the recipe scripts, ``python -m dit_mcore.evaluate|generate|plan``)
    imports the project, and nemo-run, inside the block."""
    import ast
    import gc
    from dit_mcore.startup import imports_uncollected
    before = gc.get_freeze_count()
    with imports_uncollected():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)

    def imported(statements):  # the modules the statements import
        return {alias.name if isinstance(node, ast.Import) else node.module for node in statements
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}

    launchers = ["recipes/pretrain_xl.py", "recipes/generate.py",
                 *(f"dit_mcore/{name}/__main__.py" for name in ("evaluate", "generate", "plan"))]
    for launcher in launchers:
        body = ast.parse((REPO / launcher).read_text()).body
        outside = imported(body)
        assert outside <= {"sys", "pathlib", "dit_mcore.startup"}, (launcher, outside)
        block = next(node for node in body if isinstance(node, ast.With))
        assert ast.unparse(block.items[0].context_expr) == "imports_uncollected()", launcher
        inside = imported(block.body)
        assert any(name.startswith("dit_mcore.") for name in inside), (launcher, inside)
        assert "nemo_run" in inside or not launcher.startswith("recipes/"), (launcher, inside)
