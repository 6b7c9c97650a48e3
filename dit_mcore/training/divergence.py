"""Divergence guard: a step whose loss or gradient norm is not finite is skipped (the optimizer
never applies it: ``optim.step_if_finite``) and counted; after ``max_consecutive`` skips in a
row the run stops, without writing a checkpoint of the diverged state, and the last checkpoint
taken before the first skip is protected from rotation."""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("dit_mcore.train")


class DivergenceError(RuntimeError):
    """The run stopped because training diverged (the message says where and what to do)."""


class DivergenceGuard:
    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        self.consecutive = 0
        self.protected: set[str] = set()
        self.first_bad_step: Optional[int] = None

    def record(self, updated: bool, step: int, last_saved: Optional[str]) -> None:
        """Note the outcome of ``step`` (1-based); ``last_saved`` is the newest checkpoint's name."""
        if updated:
            self.consecutive = 0
            return
        self.skipped_steps += 1
        self.consecutive += 1
        if self.consecutive == 1:
            self.first_bad_step = step
        if last_saved:
            self.protected.add(last_saved)
        log.warning("step %d: loss or gradient norm is not finite; the update is skipped (%d in a row, the run "
                    "stops at %d)", step, self.consecutive, self.max_consecutive)

    def raise_if_diverged(self, step: int, last_saved: Optional[str]) -> None:
        if self.consecutive < self.max_consecutive:
            return
        kept = f"checkpoint {last_saved} is kept" if last_saved else "no checkpoint was written yet"
        raise DivergenceError(
            f"training diverged: loss or gradient norm not finite for {self.consecutive} steps in a row "
            f"(steps {self.first_bad_step}..{step}); stopped without saving the diverged state; {kept}. "
            "Lower optim.lr or raise optim.warmup_steps / lower optim.clip_grad, and resume; "
            "trainer.max_skipped_steps sets how many non-finite steps in a row are tolerated")

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "protected": sorted(self.protected)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        self.protected = set(state["protected"])
