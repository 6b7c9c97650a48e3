"""Generation's quality, judged by a reader that is not the model: a digits DiT trained for 600 steps
(about half a minute on 2 cores), sampled by ``dit_mcore.generate`` for every class, its images read
by the nearest-neighbour digit reader of ``dit_mcore.evaluate.clip_check`` (over the dataset's scans).
One process, 2-rank CFG-parallel and 2-rank PipeFusion (one warm-up step, 2 patches: stale
activations) must read as the requested class at least 95% of the time, the issue's bar (chance: 10%).
When the test was written, this run read 100% for three training seeds x six generation seeds but one
(98%); 500 steps read 86-98%, and the demo's checkpoint reads 500 of 500 (``docs/generate.md``)."""
import json

import pytest
import torch

from dist_utils import run_distributed
from dit_mcore.generate.job import GenerateRequest, generate
from dit_mcore.generate.layout import GenerateParallel
from dit_mcore.evaluate.clip_check import check_images

AGREEMENT = 0.95
PER_CLASS = 5
STEPS = 16


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A 4-layer DiT (hidden 64) trained 600 steps on the 8x8 digits with rectified flow; its run dir."""
    from dit_mcore.parallel.initialize import destroy_distributed
    from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                           ParallelConfig, RunConfig, TrainerConfig)
    from dit_mcore.training.trainer import Trainer
    run_dir = tmp_path_factory.mktemp("quality") / "digits"
    cfg = RunConfig(
        model=ModelConfig(preset="digits", input_size=8, patch_size=2, hidden_size=64, num_layers=4,
                          num_attention_heads=4),
        data=DataConfig(name="digits", image_size=8, global_batch_size=64, micro_batch_size=None),
        optim=OptimConfig(lr=3e-3, min_lr=1.5e-4, warmup_steps=50, decay_style="cosine", weight_decay=0.0),
        diffusion=DiffusionConfig(objective="flow", sample_steps=STEPS, cfg_scale=3.0),
        trainer=TrainerConfig(max_steps=600, ema_decay=0.98, save_interval=600),
        log=LogConfig(dir=str(run_dir), log_interval=100, sample_interval=0),
        parallel=ParallelConfig())
    Trainer(cfg).fit()
    destroy_distributed()
    return str(run_dir)


def _request(run_dir, out) -> GenerateRequest:
    return GenerateRequest(checkpoint=run_dir, labels=["all"], num_per_prompt=PER_CLASS, seed=11, progress=False,
                           save_latents=True, out=str(out))


def _agreement(out) -> float:
    checks = check_images(out)
    assert len(checks) == 10 * PER_CLASS
    return sum(c.ok for c in checks) / len(checks)


def _two_rank_runs(rank, world, run_dir, outs):
    for out, layout in outs:
        generate(_request(run_dir, out), GenerateParallel(**layout))


def test_generated_digits_read_as_the_requested_class_in_one_process_and_on_two_ranks(digits_run, tmp_path):
    from dit_mcore.parallel.initialize import destroy_distributed
    generate(_request(digits_run, tmp_path / "one"))
    destroy_distributed()
    one = _agreement(tmp_path / "one")
    layouts = {"cfg2": {"cfg_parallel": 2}, "pipefusion2": {"pipefusion": 2, "pipefusion_warmup_steps": 1}}
    run_distributed(_two_rank_runs, 2, digits_run, [(tmp_path / name, layout) for name, layout in layouts.items()])
    reads = {"one process": one, **{name: _agreement(tmp_path / name) for name in layouts}}
    print("digits read as requested:", json.dumps(reads))
    assert all(value >= AGREEMENT for value in reads.values()), reads
    cfg2, want = torch.load(tmp_path / "cfg2" / "latents.pt"), torch.load(tmp_path / "one" / "latents.pt")
    assert ((cfg2 - want).norm() / want.norm()).item() <= 1e-5
