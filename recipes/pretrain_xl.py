"""Pre-training recipes for class-conditional DiT, as a nemo-run CLI.

    # in-process, one process (the default without torchrun)
    python recipes/pretrain_xl.py --yes --factory pretrain_digits
    # one process per GPU/CPU rank; every rank runs the task in-process
    torchrun --nproc-per-node 8 recipes/pretrain_xl.py --yes --factory pretrain_xl data.path=/data/in1k
    # nemo-run executors: local torchrun, or an sbatch job (add --dryrun to print the script)
    python recipes/pretrain_xl.py --yes --factory pretrain_digits run.executor=local run.executor.ntasks_per_node=2
    python recipes/pretrain_xl.py --yes --factory pretrain_xl data.path=/data/in1k \\
        run.executor=slurm run.executor.account=abc run.executor.nodes=4 run.executor.gpus_per_node=8

Any config field is overridable as ``section.field=value`` (sections: model, data, optim, diffusion,
trainer, log, parallel; see ``dit_mcore/training/config.py``). ``--yes`` is required without a
terminal: nemo-run asks for confirmation otherwise and, unanswered, runs nothing. ``--to-yaml
FILE`` writes the resolved config. The exit code is non-zero when the run fails (``recipes.launch``).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the checkout importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dit_mcore.startup import imports_uncollected

with imports_uncollected():  # (start-up: dit_mcore/startup.py)
    import nemo_run as run

    import dit_mcore.recipes.executors  # noqa: F401  (registers run.executor=local|slurm)
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                           TrainerConfig)
    from dit_mcore.recipes.entry import train
    from dit_mcore.recipes.launch import main


@run.cli.factory(target=train)
def pretrain_xl() -> run.Partial[train]:
    """DiT-XL/2 on 256px images as 32x32x4 VAE latents, 1000 classes, with the DiT paper's settings:
    AdamW lr 1e-4 constant, no weight decay, global batch 256, EMA 0.9999, 400k steps, learned
    sigma, label dropout 0.1 for CFG. Needs ``data.path`` (a prepared energon dataset).

    The objective is rectified flow, as SiT trains the same network and hyper-parameters;
    ``diffusion.objective=ddpm`` trains the paper's own (epsilon and the learned-range variance with
    ``L_simple + L_vlb``). The paper clips no gradients, so neither do we.
    """
    return run.Partial(
        train,
        model=run.Config(ModelConfig, preset="DiT-XL/2", input_size=32, in_channels=4, num_classes=1000,
                         learn_sigma=True, class_dropout_prob=0.1),
        # name=None: no built-in fallback; the run stops early until data.path is given.
        data=run.Config(DataConfig, name=None, path=None, image_size=32, global_batch_size=256,
                        micro_batch_size=32, num_workers=4),
        optim=run.Config(OptimConfig, lr=1e-4, weight_decay=0.0, decay_style="constant", warmup_steps=0,
                         clip_grad=0.0),
        diffusion=run.Config(DiffusionConfig, objective="flow", sample_steps=50, cfg_scale=4.0),
        trainer=run.Config(TrainerConfig, max_steps=400_000, ema_decay=0.9999, bf16=True, save_interval=10_000),
        log=run.Config(LogConfig, dir="runs/dit_xl_2", log_interval=100, sample_interval=10_000,
                       samples_per_class=4),
        parallel=run.Config(ParallelConfig),
    )


@run.cli.factory(target=train)
def pretrain_digits() -> run.Partial[train]:
    """The CPU demo: a small DiT on scikit-learn's 8x8 digits upscaled to 16x16, trained with
    rectified flow in a few minutes on 2 cores; preview grids (one row per class) land in
    ``runs/digits/samples``."""
    return run.Partial(
        train,
        model=run.Config(ModelConfig, preset="digits"),
        data=run.Config(DataConfig, name="digits", image_size=16, global_batch_size=128, micro_batch_size=None),
        optim=run.Config(OptimConfig, lr=1e-3, min_lr=1e-5, warmup_steps=100, decay_style="cosine",
                         weight_decay=0.0),
        diffusion=run.Config(DiffusionConfig, objective="flow", sample_steps=32, cfg_scale=3.0),
        trainer=run.Config(TrainerConfig, max_steps=3000, ema_decay=0.998, save_interval=1000, val_interval=500,
                           val_samples=128, fid_interval=1000, fid_samples=500),
        log=run.Config(LogConfig, dir="runs/digits", log_interval=50, sample_interval=1000, samples_per_class=10),
        parallel=run.Config(ParallelConfig),
    )


@run.cli.factory(target=train)
def pretrain_t2v_digits() -> run.Partial[train]:
    """The CPU text-to-video demo: a small cross-attention DiT on the built-in ``moving_digits`` clips
    (4 frames of 16x16, captions like "a 3 moving left" encoded by the tiny text encoder), trained with
    rectified flow on 2 cores; previews (a GIF per prompt, a PNG strip, ``index.json``) land in
    ``runs/t2v_digits/samples/step_XXXXXX/``."""
    return run.Partial(
        train,
        model=run.Config(ModelConfig, family="dit_xattn", preset="xattn-moving-digits"),
        data=run.Config(DataConfig, name="moving_digits", image_size=16, video_frames=4, num_videos=4096,
                        global_batch_size=64, micro_batch_size=None),
        optim=run.Config(OptimConfig, lr=1e-3, min_lr=1e-5, warmup_steps=100, decay_style="cosine",
                         weight_decay=0.0),
        diffusion=run.Config(DiffusionConfig, objective="flow", sample_steps=32, cfg_scale=3.0),
        trainer=run.Config(TrainerConfig, max_steps=2400, ema_decay=0.998, save_interval=800, val_interval=400,
                           val_samples=128),
        log=run.Config(LogConfig, dir="runs/t2v_digits", log_interval=50, sample_interval=800),
        parallel=run.Config(ParallelConfig),
    )


@run.cli.factory(target=train)
def pretrain_tiny() -> run.Partial[train]:
    """Smoke test: the tiny preset on 8x8 digits for a few steps (seconds on a CPU)."""
    return run.Partial(
        train,
        model=run.Config(ModelConfig, preset="tiny"),  # (channels, size, classes: the data's)
        data=run.Config(DataConfig, name="digits", image_size=8, global_batch_size=32, micro_batch_size=16),
        optim=run.Config(OptimConfig, lr=1e-3),
        diffusion=run.Config(DiffusionConfig, objective="flow", sample_steps=4),
        trainer=run.Config(TrainerConfig, max_steps=4, ema_decay=0.9, save_interval=1000),
        log=run.Config(LogConfig, dir="runs/tiny", log_interval=1, sample_interval=0, samples_per_class=2,
                       tensorboard=False, progress_bar=False),
        parallel=run.Config(ParallelConfig),
    )


if __name__ == "__main__":  # nemo-run re-executes this file in its workers; launch only from the CLI
    sys.exit(main(train))
