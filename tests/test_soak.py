"""The short soak (``benchmarks/soak.py``): random kill -9 / SIGTERM restarts, a NaN step, a
truncated shard and a deleted ``latest`` pointer; the restarted run must end bitwise equal to an
uninterrupted one, with every step's batch seen exactly once, and no process of a killed run left."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402


def test_short_soak_loses_nothing(tmp_path):
    rows = soak.main(["--faults", "2", "--steps", "15", "--workdir", str(tmp_path), "--out", ""])
    for row in rows:
        assert row["final_exit"] == 0, row
        assert row["bitwise_equal"] and row["steps_lost"] == 0, row
        assert not row["processes_left"], row  # nothing of a killed run outlives it
        assert not row["wrong_resumes"], row  # every restart resumed from the newest intact checkpoint
        assert all(code == 75 for code in row["sigterm_exit_codes"]), row
        assert row["faults_met"], row  # the faults soak skipped unreadable samples and the NaN step
        assert row["survived"] == row["faults_injected"] >= 2, row  # (a kill -9 and a SIGTERM each)
