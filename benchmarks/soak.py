"""Soak: a run killed at random moments and restarted with the same command ends where an
uninterrupted run ends -- bitwise -- and sees every batch exactly once.

Two soaks on the tiny recipe (``recipes/pretrain_xl.py --factory pretrain_tiny``), each against a
reference run of the same command that is never interrupted:

* ``kills``: the run is stopped ``--faults`` times at random steps, alternately by ``kill -9`` and by
  SIGTERM (which saves first), sometimes in the middle of a checkpoint save, and restarted each time.
* ``faults``: the same, on a prepared energon dataset with one truncated shard, with a non-finite
  loss injected at one step, and with ``checkpoints/latest`` deleted after one of the kills (the
  reference run has the same shard and the same bad step).

Pass: the final checkpoints hold bitwise equal tensors (weights, EMA, optimizer state), and the
per-step losses in ``metrics.jsonl`` equal the reference's at every step -- a batch lost, repeated
or reordered by a restart would change them (the losses are keyed by the step's samples and noise).
Each restart must resume from the newest intact checkpoint present when it starts (never from step
0 over checkpoints), each SIGTERM must end in the preempted exit code (75), and the ``faults`` soak
must actually have met its faults (unreadable samples skipped, the non-finite step skipped).
Prints a table: faults injected, survived, steps (batches) lost and processes left behind by the
killed runs (loader workers, checkpoint writers: both must be 0).

    python benchmarks/soak.py                       # 8 faults per soak, ~3 minutes on 2 CPU cores
    python benchmarks/soak.py --faults 2 --steps 15  # the short variant CI runs (tests/test_soak.py)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "pretrain_xl.py"
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def command(run_dir: Path, steps: int, data_path: str | None, nan_step: int | None) -> list[str]:
    args = [f"log.dir={run_dir}", f"trainer.max_steps={steps}", "trainer.save_interval=3",
            "trainer.keep_checkpoints=2", "log.log_interval=1"]
    if data_path:
        args += [f"data.path={data_path}", "data.max_seq_len=16", "data.packing=False",
                 "data.global_batch_size=8", "data.micro_batch_size=8"]
    child = [sys.executable, __file__, "--child", f"--step-delay={STEP_DELAY_S}"] + \
        ([f"--nan-step={nan_step}"] if nan_step else []) + ["--"]
    return child + ["--yes", "--factory", "pretrain_tiny", *args]


STEP_DELAY_S = 0.1  # the tiny model steps in milliseconds: slow it so kills land mid-run, not after it
_STEP_LINE = re.compile(r"step\s+\d+/\d+ \|")


def _wait_until_training(proc, log_path: Path) -> None:
    """Until the run logs its first step (so it has resumed and rewritten metrics.jsonl) or ends."""
    while proc.poll() is None and not _STEP_LINE.search(log_path.read_text(errors="replace")):
        time.sleep(0.02)


def _env(workdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(NEMORUN_HOME=str(workdir / "nemo_run"), PYTHONWARNINGS="ignore")
    return env


def _progress(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, IndexError, KeyError):
        return 0


def newest_intact_step(run_dir: Path) -> int:
    """The step of the newest intact checkpoint (0 if none): what a restart must resume from."""
    sys.path.insert(0, str(REPO))
    from dit_mcore.training.checkpoint import checkpoint_problem
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if not checkpoint_problem(p)]
    return max(steps, default=0)


def resumed_step(log_path: Path) -> int:
    """The step a run's log says it resumed at (0: it started fresh)."""
    match = re.search(r"resumed from \S+ at step (\d+)", log_path.read_text(errors="replace"))
    return int(match.group(1)) if match else 0


def run_to_end(cmd, workdir, log_path: Path) -> int:
    with log_path.open("w") as out:
        return subprocess.run(cmd, cwd=workdir, env=_env(workdir), stdin=subprocess.DEVNULL,
                              stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode


def interrupted_run(cmd, workdir, run_dir: Path, steps: int, faults: int, rng: random.Random,
                    delete_latest_after: int | None = None) -> list[dict]:
    """Start ``cmd``, stop it at a random step ``faults`` times, then let it finish."""
    events = []
    for i in range(faults):
        expected_resume, log_path = newest_intact_step(run_dir), run_dir.with_name(f"{run_dir.name}_run{i}.log")
        with log_path.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=workdir, env=_env(workdir), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        _wait_until_training(proc, log_path)
        # A kill lands up to ~3 steps after its target (the random delay below): keep it inside the
        # loop, and leave room for the faults still to come.
        last = steps - 4
        span = max(1, (last - expected_resume) // (faults - i))
        target = min(rng.randint(expected_resume + 1, expected_resume + span), last)
        while proc.poll() is None and _progress(run_dir) < target:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # lands inside a save now and then
        sig = signal.SIGKILL if i % 2 == 0 else signal.SIGTERM
        delivered = proc.poll() is None
        if delivered:
            proc.send_signal(sig)
        rc = proc.wait(timeout=300)
        event = {"fault": signal.Signals(sig).name, "delivered": delivered, "at_step": _progress(run_dir), "exit": rc,
                 "resumed_at": resumed_step(log_path), "expected_resume": expected_resume}
        if delete_latest_after == i and (run_dir / "checkpoints" / "latest").exists():
            (run_dir / "checkpoints" / "latest").unlink()
            event["fault"] += "+deleted latest"
        events.append(event)
    expected_resume, log_path = newest_intact_step(run_dir), run_dir.with_name(f"{run_dir.name}_final.log")
    events.append({"fault": "none (final run)", "at_step": steps, "exit": run_to_end(cmd, workdir, log_path),
                   "resumed_at": resumed_step(log_path), "expected_resume": expected_resume})
    return events


def leftover_processes(workdir: Path, grace_s: float = 3.0) -> list[str]:
    """Processes still running in ``workdir`` (every run's cwd) once all runs have ended: helpers of
    a killed run that did not exit with it. Linux only (``/proc``); waits ``grace_s`` for them."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if proc.name != str(os.getpid()) and Path(os.readlink(proc / "cwd")).is_relative_to(workdir):
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
                    left.append(f"{proc.name}: {cmdline}")
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def final_tensors(run_dir: Path, step: int) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = run_dir / f"final_{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step_{step:08d}"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def losses(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}


def soak(name: str, workdir: Path, steps: int, faults: int, seed: int, *, data_path=None, nan_step=None,
         delete_latest_after=None) -> dict:
    import torch
    ref_dir, soak_dir = workdir / f"{name}_reference", workdir / f"{name}_soak"
    assert run_to_end(command(ref_dir, steps, data_path, nan_step), workdir,
                      workdir / f"{name}_reference.log") == 0, "reference run failed"
    events = interrupted_run(command(soak_dir, steps, data_path, nan_step), workdir, soak_dir, steps, faults,
                             random.Random(seed), delete_latest_after)
    ref, got = final_tensors(ref_dir, steps), final_tensors(soak_dir, steps)
    bitwise = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_loss, got_loss = losses(ref_dir), losses(soak_dir)
    lost = sum(1 for s in ref_loss if got_loss.get(s) != ref_loss[s] and not (ref_loss[s] != ref_loss[s]
                                                                              and got_loss.get(s) != got_loss.get(s)))
    injected = sum(e.get("delivered", False) for e in events) + (nan_step is not None) + (data_path is not None) \
        + (delete_latest_after is not None)
    orphans = leftover_processes(workdir.resolve())
    wrong_resumes = [e for e in events if e["resumed_at"] != e["expected_resume"]]
    sigterm_codes = [e["exit"] for e in events if e["fault"].startswith("SIGTERM") and e["delivered"]]
    last = json.loads((soak_dir / "metrics.jsonl").read_text().splitlines()[-1])
    faults_met = data_path is None or last.get("skipped_samples", 0) > 0
    faults_met &= nan_step is None or last.get("skipped_steps", 0) >= 1
    ok = (events[-1]["exit"] == 0 and bitwise and lost == 0 and not orphans and not wrong_resumes
          and all(code == 75 for code in sigterm_codes) and faults_met)
    return {"soak": name, "faults_injected": injected, "survived": injected if ok else 0,
            "final_exit": events[-1]["exit"], "bitwise_equal": bitwise, "steps_lost": lost,
            "processes_left": orphans, "wrong_resumes": wrong_resumes, "sigterm_exit_codes": sigterm_codes,
            "faults_met": faults_met, "skipped_samples": last.get("skipped_samples"),
            "skipped_steps": last.get("skipped_steps"), "events": events}


def corrupt_dataset(workdir: Path) -> str:
    """A prepared energon dataset of 8x8 digits whose second shard is cut short."""
    sys.path.insert(0, str(REPO))
    from energon_data.prepare import prepare_dataset
    out = workdir / "digits_energon"
    if not out.exists():
        prepare_dataset("digits", str(out), encoder="identity", image_size=(8, 8), samples_per_shard=200,
                        progress=False, workers=1)
        shard = sorted(out.glob("*.tar"))[1]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return str(out)


def child(argv) -> int:
    """The training command, with a non-finite loss injected at ``--nan-step`` (soak ``faults``)."""
    p = argparse.ArgumentParser()
    p.add_argument("--nan-step", type=int, default=None)
    p.add_argument("--step-delay", type=float, default=0.0)
    args, rest = p.parse_known_args(argv)
    sys.argv = [str(SCRIPT), *[a for a in rest if a != "--"]]
    sys.path.insert(0, str(REPO))
    from dit_mcore.training.trainer import Trainer
    if args.step_delay:
        train_step = Trainer.train_step

        def slowed(self, *a):
            time.sleep(args.step_delay)
            return train_step(self, *a)
        Trainer.train_step = slowed
    if args.nan_step:
        from dit_mcore.training.step_loss import StepLoss
        loss, stepping, current = StepLoss.loss, Trainer.train_step, {"step": 0}

        def counted(self, *a):  # (the step a micro-batch's loss belongs to)
            current["step"] = self.step + 1
            return stepping(self, *a)

        def poisoned(self, inputs, batch, output):
            loss_sum, count, logged = loss(self, inputs, batch, output)
            if current["step"] == args.nan_step:
                loss_sum = loss_sum * float("nan")
                logged = {"loss": logged["loss"] * float("nan")}
            return loss_sum, count, logged
        Trainer.train_step, StepLoss.loss = counted, poisoned
    from dit_mcore.recipes.entry import train
    from dit_mcore.recipes.launch import main
    import dit_mcore.recipes.pretrain_xl  # noqa: F401  (registers the factories)
    return main(train)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak_cpu.json"))
    args = p.parse_args(argv)
    import tempfile
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="soak_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [soak("kills", workdir, args.steps, args.faults, args.seed),
            soak("faults", workdir, args.steps, args.faults, args.seed + 1, data_path=corrupt_dataset(workdir),
                 nan_step=args.steps // 3, delete_latest_after=args.faults // 2)]
    print(f"{'soak':8} {'faults injected':>16} {'survived':>9} {'bitwise equal':>14} {'steps lost':>11} "
          f"{'processes left':>15}")
    for r in rows:
        print(f"{r['soak']:8} {r['faults_injected']:>16} {r['survived']:>9} {str(r['bitwise_equal']):>14} "
              f"{r['steps_lost']:>11} {len(r['processes_left']):>15}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python benchmarks/soak.py " + " ".join(argv or sys.argv[1:]),
                                              "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    main()
