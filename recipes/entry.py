"""The task nemo-run configures and launches: one keyword argument per config section, so CLI
overrides read like the config tree (``trainer.max_steps=20 log.dir=/tmp/run``)."""
import logging
from typing import Optional

from dit_mcore.generate.job import GenerateRequest  # noqa: F401  (the generate task's sections)
from dit_mcore.generate.layout import GenerateParallel  # noqa: F401

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig,
                                       TrainerConfig)


# Named so the `log` argument (a LogConfig) of train() does not shadow it.
_LOGGER = logging.getLogger("recipes")


def build_run_config(model: Optional[ModelConfig] = None, data: Optional[DataConfig] = None,
                     optim: Optional[OptimConfig] = None, diffusion: Optional[DiffusionConfig] = None,
                     trainer: Optional[TrainerConfig] = None, log: Optional[LogConfig] = None,
                     parallel: Optional[ParallelConfig] = None) -> RunConfig:
    """Assemble a ``RunConfig``; a section left as None takes its dataclass defaults. Fails before
    any process group or model exists when the data source is missing."""
    cfg = RunConfig(model=model or ModelConfig(), data=data or DataConfig(), optim=optim or OptimConfig(),
                    diffusion=diffusion or DiffusionConfig(), trainer=trainer or TrainerConfig(),
                    log=log or LogConfig(), parallel=parallel or ParallelConfig())
    # Recipes without a built-in fallback (e.g. pretrain_xl) set data.name=None.
    cfg.data.check_source()
    return cfg


def train(model: Optional[ModelConfig] = None, data: Optional[DataConfig] = None,
          optim: Optional[OptimConfig] = None, diffusion: Optional[DiffusionConfig] = None,
          trainer: Optional[TrainerConfig] = None, log: Optional[LogConfig] = None,
          parallel: Optional[ParallelConfig] = None) -> None:
    """Train the run described by the sections (see ``dit_mcore.training.config``). Raises on
    failure, so a direct or torchrun launch exits non-zero and a nemo-run job is marked FAILED."""
    from dit_mcore.generate.preview import Previews
    from dit_mcore.parallel.initialize import destroy_distributed
    from dit_mcore.training.divergence import DivergenceError
    from dit_mcore.training.preemption import Preempted
    from dit_mcore.training.trainer import pretrain

    cfg = build_run_config(model, data, optim, diffusion, trainer, log, parallel)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # its INFO lists every parameter
    try:
        if cfg.parallel.layout or cfg.parallel.layout_gpu:
            from dit_mcore.recipes.auto_layout import choose_layout
            cfg = choose_layout(cfg)
        hooks = [Previews(cfg.log.sample_interval)]  # (previews sample: the generation layer's)
        if cfg.trainer.fid_interval:
            from dit_mcore.evaluate.during_training import FIDDuringTraining
            hooks.append(FIDDuringTraining(cfg))
        pretrain(cfg, hooks=hooks)
    except (ConfigError, DivergenceError):
        raise  # the message names the field (or the steps) and the fix; a traceback adds nothing
    except Preempted as stop:
        _LOGGER.warning("%s", stop)
        raise
    except BaseException:
        # nemo-run's CLI prints only str(exception); keep the traceback for whoever debugs the run.
        _LOGGER.exception("training failed")
        raise
    finally:
        destroy_distributed()



def generate(request: Optional[GenerateRequest] = None, parallel: Optional[GenerateParallel] = None) -> None:
    """Generate from a trained checkpoint (see ``dit_mcore.generate``): ``request`` says what and from
    which checkpoint, ``parallel`` the generation layout. Raises on failure, as ``train`` does."""
    from dit_mcore.generate.job import generate as run_generation
    from dit_mcore.parallel.initialize import destroy_distributed

    if request is None or not (request.checkpoint or request.diffusers or request.facebookresearch):
        raise ConfigError("request.checkpoint: give the run directory or checkpoint to sample, e.g. "
                          "request.checkpoint=runs/digits (or request.diffusers / request.facebookresearch)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    try:
        run_generation(request, parallel)
    finally:
        destroy_distributed()
