"""Preemption on a real Slurm: the time-limit warning (or ``scancel --signal=USR1``) makes a 2-task
CPU job save and requeue itself; the requeued job resumes from that checkpoint and ends where an
uninterrupted run of the same command ends -- bitwise.

Both jobs are submitted through the project's own launch path (``recipes/pretrain_xl.py ...
run.executor=slurm``, i.e. nemo-run's SlurmExecutor sbatch script with ``--requeue --signal=USR1@S``
and ``srun`` starting one task per "GPU"), on the single-node cluster of ``setup_local_slurm.sh``.
Only what a CPU box lacks is overridden: no container image, 2 fake GPUs, a short time limit.

    bash benchmarks/slurm/setup_local_slurm.sh
    python benchmarks/slurm/preempt_requeue.py                     # Slurm's own warning, ~12 minutes
    python benchmarks/slurm/preempt_requeue.py --trigger scancel   # scancel --signal=USR1 mid-run

Checks: the preempted job restarted (``Restarts>=1``); in each cut incarnation both ranks logged the
preemption and the checkpoint was published before rank 0's ``scontrol requeue`` ended the step
(Slurm then reports the tasks Terminated: the exit code 75 is not what it records); each restart
resumed from the step the previous one saved (never from 0); the job COMPLETED at ``max_steps``; and
per-step losses and final tensors (weights, EMA, optimizer) equal the uninterrupted job's. Writes
``benchmarks/results/slurm_preemption_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: soak's helpers
from soak import REPO, SCRIPT, final_tensors, losses  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "slurm_preemption_cpu.json"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def command(name: str, args, time_limit: str, workdir: Path) -> list[str]:
    """The project's CLI submitting the tiny recipe as a Slurm job (nemo-run's sbatch script)."""
    home = workdir / "nemorun_home"  # not ".../nemo_run": nemo-run rewrites "/nemo_run" in the sbatch script
    return [sys.executable, str(SCRIPT), "--yes", "--detach", "--factory", "pretrain_tiny",
            f"log.dir={workdir / name}", f"trainer.max_steps={args.steps}", "log.log_interval=1",
            "run.executor=slurm", f"run.executor.account={name}", f"run.executor.partition={args.partition}",
            "run.executor.gpus_per_node=2",  # -> 2 tasks (srun starts one per GPU); the lab's GPUs are fake
            f"run.executor.time={time_limit}", f"run.executor.signal=USR1@{args.signal_s}",
            "run.executor.container_image=None",  # no pyxis here: run on the host
            # nemo-run writes the sbatch script under $NEMORUN_HOME/experiments; a LocalTunnel must point
            # there (the factory's job_dir=nemo_slurm_jobs is never filled: sbatch finds no script).
            f"run.executor.tunnel.job_dir={home / 'experiments'}"]


def submit(name: str, args, time_limit: str, workdir: Path) -> tuple[list[str], int]:
    """Submit through the project's CLI; returns (command, job id)."""
    cmd, home = command(name, args, time_limit, workdir), workdir / "nemorun_home"
    env = {**os.environ, "NEMORUN_HOME": str(home), "PYTHONWARNINGS": "ignore", "COLUMNS": "200",
           "OMP_NUM_THREADS": "1"}
    (workdir / name).mkdir(parents=True, exist_ok=True)
    out = subprocess.run(cmd, cwd=workdir / name, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=300)
    (workdir / f"{name}_submit.log").write_text(out.stdout + out.stderr)
    # The CLI's exit code is 1 here: with --detach it asks sacct for the state, and the lab has no
    # accounting database. The job id is in its log either way.
    match = re.search(r"Launched app: slurm_tunnel://\S+/(\d+)", out.stdout + out.stderr)
    if not match:
        sys.exit(f"submission failed, see {workdir / f'{name}_submit.log'}")
    return cmd, int(match.group(1))


def job_info(job: int) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def progress(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    except (OSError, ValueError, IndexError, KeyError):
        return 0


def wait(job: int, run_dir: Path, trigger_at: int | None = None, timeout_s: float = 1200) -> tuple[dict, list]:
    """Poll the job until it ends; returns its final record and the states it went through. With
    ``trigger_at``, send the warning signal by hand (to the steps only, as ``--signal=USR1`` does)
    once the first incarnation has logged that step."""
    states, sent, deadline = [], False, time.time() + timeout_s
    while time.time() < deadline:
        info = job_info(job)
        state = f"{info.get('JobState')}(restarts={info.get('Restarts')})"
        if not states or states[-1][1] != state:
            states.append((round(time.time()), state))
            print(f"  job {job}: {state}", flush=True)
        if trigger_at and not sent and info.get("Restarts") == "0" and progress(run_dir) >= trigger_at:
            subprocess.run(["scancel", "--signal=USR1", str(job)], check=True)
            sent = True
        if info.get("JobState") in DONE:
            return info, states
        time.sleep(0.5)
    sys.exit(f"job {job} did not end within {timeout_s}s")


def incarnations(info: dict, job: int) -> list[dict]:
    """What each run of the job logged: nemo-run's srun log is per restart (``..._<job>_<restart>.out``);
    srun's own messages and the batch script's echo go to the sbatch log, appended run after run."""
    folder = Path(info["StdOut"]).parent
    batch = Path(info["StdOut"]).read_text(errors="replace").split("# Command 1")[1:]  # one part per run
    runs = []
    for restart in range(int(info["Restarts"]) + 1):
        log = next(folder.glob(f"log-*_{job}_{restart}.out")).read_text(errors="replace")
        cut = re.findall(r"preempted by (\w+) after step (\d+)", log)
        resumed = re.search(r"resumed from \S+ at step (\d+)", log)
        saved, killed = log.rfind("saved checkpoint"), log.find("DUE TO JOB REQUEUE")
        srun = re.findall(r"srun: error: \S+: tasks? [\d-]+: (.+)", batch[restart])
        exited = re.search(r"^job exited with code (\d+)", batch[restart], re.M)
        runs.append({"restart": restart, "resumed_from": int(resumed.group(1)) if resumed else 0,
                     "preempted": sorted({(s, int(n)) for s, n in cut}), "ranks_preempted": len(cut),
                     "requeued_by_rank0": f"requeued Slurm job {job}" in log,
                     "saved_before_requeue_ended_step": 0 <= saved < killed,
                     "srun_task_status": srun or ["ok"],
                     "batch_exit": int(exited.group(1)) if exited else None})
    return runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trigger", choices=("timelimit", "scancel"), default="timelimit",
                   help="timelimit: Slurm's own warning, --signal=USR1@S before --time; scancel: by hand")
    p.add_argument("--steps", type=int, default=6000,
                   help="max_steps: the tiny model steps 15-35/s on 2 cores; the run must outlast the warning")
    p.add_argument("--time", default="00:04:00", help="time limit of the job that gets preempted")
    p.add_argument("--signal-s", type=int, default=120, help="warning this many seconds before the limit")
    p.add_argument("--partition", default="debug")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/slurm_lab/preempt"))
    p.add_argument("--out", type=Path, default=RESULT)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.workdir / args.trigger
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)

    print("uninterrupted reference job (time limit far away)")
    ref_cmd, ref_job = submit("reference", args, "00:30:00", work)
    ref_info, _ = wait(ref_job, work / "reference")
    print(f"preempted job ({args.trigger})")
    cmd, job = submit("preempted", args, args.time if args.trigger == "timelimit" else "00:30:00", work)
    info, states = wait(job, work / "preempted", trigger_at=args.steps // 3 if args.trigger == "scancel" else None)
    return summarize(args, work, (ref_cmd, ref_job, ref_info), (cmd, job, info), states)


def summarize(args, work: Path, reference: tuple, preempted: tuple, states: list) -> int:
    """Check the finished jobs, print the table, write the JSON; returns the exit code."""
    (ref_cmd, ref_job, ref_info), (cmd, job, info) = reference, preempted
    runs = incarnations(info, job)
    ref_losses, cut_losses = losses(work / "reference"), losses(work / "preempted")
    tensors_equal = False
    if info["JobState"] == ref_info["JobState"] == "COMPLETED":
        a, b = final_tensors(work / "reference", args.steps), final_tensors(work / "preempted", args.steps)
        tensors_equal = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    saved = [r["preempted"][0][1] for r in runs if r["preempted"]]
    checks = {
        "requeued": int(info["Restarts"]) >= 1,
        "every_cut_run_logged_preemption_on_both_ranks": all(r["ranks_preempted"] == 2 for r in runs[:-1]),
        # rank 0's `scontrol requeue` ends the step itself (the tasks are Terminated, not exit 75); what
        # matters is that the checkpoint was published before, and that rank 0 did requeue.
        "cut_runs_saved_then_requeued": all(r["requeued_by_rank0"] and r["saved_before_requeue_ended_step"]
                                            for r in runs[:-1]),
        "last_run_exited_0": runs[-1]["batch_exit"] == 0 and runs[-1]["srun_task_status"] == ["ok"],
        "resumed_where_saved": [r["resumed_from"] for r in runs] == [0] + saved,
        "completed": info["JobState"] == "COMPLETED" and ref_info["JobState"] == "COMPLETED",
        "losses_equal": ref_losses == cut_losses and max(cut_losses, default=0) == args.steps,
        "final_tensors_bitwise_equal": tensors_equal,
    }
    slurm = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.strip()
    result = {"slurm": slurm, "trigger": args.trigger, "steps": args.steps, "time_limit": args.time,
              "signal": f"USR1@{args.signal_s}", "command": " ".join(cmd), "reference_command": " ".join(ref_cmd),
              "job_id": job, "reference_job_id": ref_job, "restarts": int(info["Restarts"]),
              "final_state": info["JobState"], "exit_code": info["ExitCode"], "states": states,
              "incarnations": runs, "saved_at_steps": saved, "steps_compared": len(ref_losses), "checks": checks,
              "ok": all(checks.values())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{slurm}, job {job}, trigger {args.trigger}, max_steps {args.steps}")
    print(f"{'run':>4} {'resumed from':>12} {'preempted after':>16} {'requeued':>8}  srun tasks / batch exit")
    for r in runs:
        cut = ",".join(f"{s}@{n}" for s, n in r["preempted"]) or "-"
        print(f"{r['restart']:>4} {r['resumed_from']:>12} {cut:>16} {str(r['requeued_by_rank0']):>8}  "
              f"{'; '.join(r['srun_task_status'])} / {r['batch_exit']}")
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
