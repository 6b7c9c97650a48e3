"""The Weights & Biases sink (``log.wandb``), beside TensorBoard and ``metrics.jsonl``: the run's whole config
once, every logged metric against the training step (``trainer/step``, W&B's x axis for them), preview grids (and
text previews' strips) as images. Rank 0 only.

A resumed training run continues its W&B run (the id is kept in ``<log.dir>/wandb_run_id``; a run that starts
from step 0 gets a new one). The metrics are logged against ``trainer/step``, not W&B's own step, so a run resumed
from an earlier checkpoint than its last logged step loses nothing: W&B drops a ``step=`` below its last one, while
``trainer/step`` may repeat (the re-run steps show twice). Files under ``<log.dir>/wandb/``; ``WANDB_MODE=offline``
works with no network (``wandb sync`` uploads later), as every other ``WANDB_*`` variable does. A run that raised
(a preemption too) is finished with exit code 1. At the end W&B is torn down (``wandb.teardown``), so the run's
files are complete when training returns; this also finishes any other W&B run left open in the process.
"""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("dit_mcore.train")

STEP = "trainer/step"


def credentials_problem() -> str:
    """Why ``wandb.init`` would fail for want of credentials here (empty: it would not): checked before any process
    group exists, since only rank 0 logs and a failing init there would leave the others waiting."""
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return ""
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return ""
    if os.environ.get("WANDB_BASE_URL"):  # (a self-hosted server: its own login; wandb says what is missing)
        return ""
    return ("no W&B credentials here (WANDB_API_KEY, or `wandb login`); log in, or set WANDB_MODE=offline and "
            "`wandb sync` the run later, or set log.wandb=False")


class WandbSink:
    def __init__(self, cfg, run_dir: Path, *, fresh: bool):
        import wandb
        self.wandb = wandb
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() and not fresh else secrets.token_hex(4)
        id_file.write_text(run_id)
        g = cfg.log
        self.run = wandb.init(project=g.wandb_project, entity=g.wandb_entity, name=g.wandb_name or run_dir.resolve().name,
                              id=run_id, resume="allow", dir=str(run_dir), config=cfg.to_dict(),
                              settings=wandb.Settings(console="off"))  # (our log lines stay ours)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        log.info("W&B run %s (%s, id %s), files in %s", self.run.name, self.run.settings.mode, run_id, run_dir / "wandb")

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({STEP: step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})

    def image(self, step: int, name: str, path: Path) -> None:
        self.run.log({STEP: step, name: self.wandb.Image(str(path))})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() returns before W&B's service has written the last records to disk; its teardown waits for
        # them, so the run's files are complete when training returns (and its next run starts a service anew).
        self.wandb.teardown()
