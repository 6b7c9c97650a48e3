"""What the training loop does between steps, as post-step hooks run in order after every step and
once at the end of the run: stop on divergence, stop on a preemption signal, save checkpoints, then
the hooks a caller attaches (the generation layer's previews:
:class:`dit_mcore.generate.preview.Previews`, attached by the command line).

The EMA is averaged in after the steps whose state the run's config reads (:func:`config_reads_after`:
the saves, the previews, the end), attached hooks or not, so a run's EMA does not depend on how it was
launched; a hook that reads the weights after other steps says so (:meth:`StepHook.reads_after`)
(:class:`dit_mcore.training.ema.EMASchedule`)."""
from __future__ import annotations

import logging
import signal

from dit_mcore.training.checkpoint import SaveFailed
from dit_mcore.training.preemption import Preempted, requeue_if_slurm

log = logging.getLogger("dit_mcore.train")


def previews_after(sample_interval: int, step: int) -> bool:
    """Whether a preview is drawn after ``step`` (``log.sample_interval``; 0: only at the end)."""
    return bool(sample_interval and step % sample_interval == 0)


def every(interval: int, step: int, max_steps: int) -> bool:
    """Whether an ``interval``-step job (a validation loss, an FID) runs after ``step`` (1-based): every
    ``interval`` steps and after the last one; never when ``interval`` is 0."""
    return bool(interval) and (step % interval == 0 or step == max_steps)


def validation_due(trainer_cfg, step: int) -> bool:
    """``trainer.val_interval``'s steps."""
    return every(trainer_cfg.val_interval, step, trainer_cfg.max_steps)


def fid_due(trainer_cfg, step: int) -> bool:
    """``trainer.fid_interval``'s steps."""
    return every(trainer_cfg.fid_interval, step, trainer_cfg.max_steps)


def config_reads_after(cfg, step: int) -> bool:
    """Whether the run's config reads the state after ``step`` (1-based): a periodic save
    (``trainer.save_interval``), a preview (``log.sample_interval``), a validation loss
    (``trainer.val_interval``), an FID (``trainer.fid_interval``), the end of the run."""
    t = cfg.trainer
    return (step == t.max_steps or step % t.save_interval == 0 or previews_after(cfg.log.sample_interval, step)
            or validation_due(t, step) or fid_due(t, step))


class StepHook:
    """Runs after each training step (:meth:`after_step`) and at the end of the run (:meth:`at_end`), given
    the :class:`~dit_mcore.training.trainer.Trainer` (its ``step`` is the step just completed)."""

    provides: frozenset = frozenset()
    """The metric names :meth:`metrics` adds (the trainer warns when a configured one has no hook)."""

    def reads_after(self, step: int) -> bool:
        """Whether this hook reads the model or its EMA after ``step`` (1-based), at a step number
        fixed by the config."""
        return False

    def metrics(self, trainer) -> dict:
        """Metrics this hook adds to the step just completed, before it is logged (e.g. FID); every rank calls it."""
        return {}

    def after_step(self, trainer) -> None:
        pass

    def at_end(self, trainer) -> None:
        pass


class StopOnDivergence(StepHook):
    """``trainer.max_skipped_steps`` non-finite steps in a row: stop, without a save (the newest
    checkpoint from before them is kept)."""

    def after_step(self, trainer):
        trainer.divergence.raise_if_diverged(trainer.step, trainer.last_saved)


class StopOnPreemption(StepHook):
    """A signal every rank has agreed on (SIGTERM, Slurm's SIGUSR1): save, requeue under Slurm and stop
    (exit code 75 from the command line)."""

    def after_step(self, trainer):
        signum = trainer.signals.agreed
        if signum is not None:
            try:
                path = trainer.save()
                trainer.finish_saves()
            except SaveFailed as e:  # stop for the signal all the same: the restart resumes the newest one
                log.error("%s; the run stops for the signal and resumes from %s", e, trainer.last_saved or "step 0")
                path = trainer.ckpt_dir / trainer.last_saved if trainer.last_saved else None
            requeue_if_slurm(signum)
            raise Preempted(trainer.step, signal.Signals(signum).name, path)


class Checkpoints(StepHook):
    """Every ``trainer.save_interval`` steps and at the end: a checkpoint (publishing a finished
    asynchronous save first, never waiting for it), held back while the latest step was skipped as
    non-finite. It runs before the attached hooks, so a failing preview never costs a checkpoint."""

    def __init__(self, save_interval: int, max_steps: int):
        self.save_interval, self.max_steps = save_interval, max_steps

    def after_step(self, trainer):
        if trainer.async_saves is not None and trainer.async_saves.get_num_unfinalized_calls():
            self._trying(trainer, lambda: trainer.finish_saves(blocking=False))
        if (trainer.step % self.save_interval == 0 and trainer.step < self.max_steps
                and not trainer.divergence.consecutive):
            self._trying(trainer, trainer.save)

    def _trying(self, trainer, save) -> None:
        try:
            save()
        except SaveFailed as e:  # training goes on; the next interval (or the end) saves again
            log.error("%s; %s stays the latest, training goes on and saves again at step %d", e,
                      trainer.last_saved or "no checkpoint",
                      min((trainer.step // self.save_interval + 1) * self.save_interval, self.max_steps))

    def at_end(self, trainer):
        if not (trainer.ckpt_dir / f"step_{trainer.step:08d}").exists():
            trainer.save()
        trainer.finish_saves()
