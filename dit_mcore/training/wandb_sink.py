"""The Weights & Biases sink (``log.wandb``), beside TensorBoard and ``metrics.jsonl``: the run's whole config
once, every logged metric at its step, preview grids (and text previews' strips) as images. Rank 0 only.

The W&B run's id is kept in ``<log.dir>/wandb_run_id``, so a resumed training run continues the same W&B run;
its files go under ``<log.dir>/wandb/``. ``WANDB_MODE=offline`` works with no network (``wandb sync`` uploads
later), as every other ``WANDB_*`` variable does.
"""
from __future__ import annotations

import logging
import secrets
from pathlib import Path

log = logging.getLogger("dit_mcore.train")


class WandbSink:
    def __init__(self, cfg, run_dir: Path):
        import wandb
        self.wandb = wandb
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        g = cfg.log
        self.run = wandb.init(project=g.wandb_project, entity=g.wandb_entity, name=g.wandb_name or run_dir.resolve().name,
                              id=run_id, resume="allow", dir=str(run_dir), config=cfg.to_dict(),
                              settings=wandb.Settings(console="off"))  # (our log lines stay ours)
        log.info("W&B run %s (%s, id %s), files in %s", self.run.name, self.run.settings.mode, run_id, run_dir / "wandb")

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def image(self, step: int, name: str, path: Path) -> None:
        self.run.log({name: self.wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()
