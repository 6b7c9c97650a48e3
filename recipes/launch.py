"""``run.cli.main`` with the behaviour a launcher script needs: torchrun-aware, and an exit code that
reflects the run.

nemo-run 0.11.1's CLI returns normally (exit code 0) when an override does not parse, when the task
raises in-process, and when a launched job FAILS. ``main`` records what happened through a
``RunContext`` subclass and an experiment plugin, and returns the exit code:

* 0 when the command finished (a run that succeeded, ``--dryrun``, ``--to-yaml``, ``--help``,
  ``--help-config [SECTION]``: every field of the task's sections, ``dit_mcore.training.config_help``);
* 1 when the command stopped on an error (bad override, exception in an in-process run, no
  ``--yes`` without a terminal) or a launched job ended in any state other than SUCCEEDED
  (with ``--detach``: FAILED or CANCELLED).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import nemo_run as run

# What the last CLI command in this process did; one command runs per process.
_STATE: dict = {}
_FAILED_STATES = {"FAILED", "CANCELLED", "UNKNOWN"}


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any torchelastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


@dataclass(kw_only=True)
class RecordExperiment(run.Plugin):
    """Remembers the experiment each launched job belongs to, so the launcher can read its status."""

    def setup(self, task, executor) -> None:
        _STATE.setdefault("experiments", []).append(self.experiment_id)


@dataclass(kw_only=True)
class CheckedRunContext(run.cli.RunContext):
    """RunContext that records how far the command got, renders the scheduler request on
    ``--dryrun`` and derives Slurm's tasks per node (or torchrun's processes per node, under torchrun)
    from ``gpus_per_node``."""

    def __post_init__(self):
        _STATE.clear()
        _STATE.update(started=True, completed=False, context=self)

    def parse_args(self, args, lazy: bool = False):
        rest = super().parse_args(args, lazy)
        if isinstance(self.executor, run.SlurmExecutor) and self.executor.launcher is None:
            # srun starts one task per GPU (run.executor.gpus_per_node may be overridden after the factory).
            self.executor.ntasks_per_node = self.executor.gpus_per_node or 1
        elif isinstance(self.executor, run.SlurmExecutor) and not self.executor.torchrun_nproc_per_node:
            # nemo-run would otherwise set it from ntasks_per_node (1 under torchrun) on launch.
            self.executor.torchrun_nproc_per_node = self.executor.gpus_per_node or 1
        if self.executor is not None:
            self.plugins = [*self.plugins, RecordExperiment()]
        return rest

    def parse_fn(self, fn, args, **default_kwargs):
        _check_override_names(fn, args)
        task = super().parse_fn(fn, args, **default_kwargs)
        _STATE["task"] = task
        return task

    def cli_execute(self, fn, args, entrypoint_type="task"):
        from dit_mcore.errors import ConfigError
        try:
            with _no_config_table(quiet=not self.dryrun and (self.skip_confirmation or under_torchrun())):
                super().cli_execute(fn, args, entrypoint_type)
        except ConfigError as e:  # nemo-run prints "Error: ..." for these (others: "Unexpected error: ...")
            raise run.cli.api.RunContextError(str(e)) from e
        exporting = any([self.to_yaml, self.to_toml, self.to_json])
        if self.dryrun and not exporting and not self.direct and self.executor is not None:
            # The CLI's --dryrun only prints the config; show what would be submitted (the sbatch
            # script or the torchrun command) too. Needs no cluster.
            run.run(_STATE["task"], executor=self.executor, name=self.name, dryrun=True)
        _STATE["completed"] = True


@contextlib.contextmanager
def _no_config_table(quiet: bool):
    """nemo-run prints its table of resolved arguments before every launch; a training run writes its whole
    configuration to ``<log.dir>/run_config.json`` instead. Shown where it helps: with ``--dryrun``, and before the
    confirmation a run without ``--yes`` asks for."""
    if not quiet:
        yield
        return
    original = run.dryrun_fn
    run.dryrun_fn = lambda *args, **kwargs: None  # (nemo-run's CLI calls it as run.dryrun_fn)
    try:
        yield
    finally:
        run.dryrun_fn = original


def _check_override_names(fn: Callable, args) -> None:
    """A misspelt ``section.field=value`` fails with a did-you-mean instead of nemo-run's dump of
    the whole config."""
    from dit_mcore.errors import ConfigError
    from dit_mcore.training.validate import config_sections, override_problem
    sections = config_sections(fn)
    problems = [p for p in (override_problem(a, sections) for a in args) if p]
    if problems:
        raise ConfigError("; ".join(problems))


def _launched_jobs_ok(detach: bool) -> bool:
    ok = True
    for exp_id in _STATE.get("experiments", []):
        exp = run.Experiment.from_id(exp_id)
        for job, info in (exp.status(return_dict=True) or {}).items():
            state = str(info["status"])
            if (state in _FAILED_STATES) if detach else (state != "SUCCEEDED"):
                print(f"[recipes] job {job} of experiment {exp_id} ended {state}")
                ok = False
    return ok


def main(fn: Callable, default_executor: Optional[run.Config] = None) -> int:
    """Run the nemo-run CLI for ``fn`` and return the exit code (see the module docstring).

    Under torchrun every rank executes the task in-process and never asks for confirmation: the
    process is already one worker of the job, so launching another would nest launches.
    """
    argv = sys.argv[1:]
    asked = [i for i, a in enumerate(argv) if a == "--help-config" or a.startswith("--help-config=")]
    if asked:  # every section's fields, with type, default and docstring
        from dit_mcore.training.config_help import config_help
        from dit_mcore.training.validate import config_sections
        flag, after = argv[asked[0]], argv[asked[0] + 1:]
        only = (flag.split("=", 1)[1] if "=" in flag else
                after[0] if after and not after[0].startswith("-") else None)
        try:
            print(config_help(config_sections(fn), only))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    cmd_defaults = {"direct": True, "skip_confirmation": True} if under_torchrun() else None
    _STATE.clear()
    run.cli.main(fn, default_executor=default_executor, cmd_defaults=cmd_defaults, run_ctx_cls=CheckedRunContext)
    if not _STATE.get("started"):
        return 0  # --help and friends never start a command
    if not _STATE["completed"]:
        return 1  # nemo-run printed the error
    ctx = _STATE["context"]
    return 0 if _launched_jobs_ok(ctx.detach) else 1
