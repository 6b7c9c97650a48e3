"""Named executors for ``run.executor=<name>``; any field is then overridable as
``run.executor.<field>=...`` (e.g. ``run.executor.nodes=4 run.executor.account=abc``).

``local`` launches the task with torchrun; ``slurm`` has ``srun`` start one task per GPU itself (no
torchrun agent, which Slurm's preemption signal would kill). Without ``run.executor`` the recipes
run in-process (see ``recipes/pretrain_xl.py``)."""

from pathlib import Path

import nemo_run as run

REPO_ROOT = Path(__file__).resolve().parents[1]

# megatron-core overlaps TP/SP communication with compute only when kernels are queued in order.
_GPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@run.cli.factory
@run.autoconvert
def local(ntasks_per_node: int = 1) -> run.LocalExecutor:
    """torchrun on this machine with ``ntasks_per_node`` processes (gloo on CPU, NCCL on GPU)."""
    # The worker (nemo-run's fdl_runner) imports recipes.entry; the checkout need not be installed.
    return run.LocalExecutor(ntasks_per_node=ntasks_per_node, launcher="torchrun",
                             env_vars={**_GPU_ENV, "PYTHONPATH": str(REPO_ROOT)})


@run.cli.factory
@run.autoconvert
def slurm(account: str = "my_account", partition: str = "batch", nodes: int = 1, gpus_per_node: int = 8,
          time: str = "04:00:00", container_image: str = "dit-mcore:latest",
          preempt_signal_s: int = 120) -> run.SlurmExecutor:
    """An sbatch job: ``nodes`` x ``gpus_per_node`` tasks in ``container_image`` (pyxis), one per GPU,
    started by ``srun`` (``dit_mcore.parallel.initialize.adopt_slurm_launch`` turns Slurm's task ids
    into torch.distributed's ranks).

    The code comes from the image (see the Dockerfile), so nothing is packaged. The job is submitted
    from this machine (``sbatch`` on PATH); to submit over SSH, override
    ``run.executor.tunnel=...`` or build an executor with ``run.SSHTunnel`` in your own factory.
    The job's script and logs live under nemo-run's home (``$NEMORUN_HOME/experiments``): a local
    tunnel submits the script where nemo-run wrote it (a ``job_dir`` of its own made ``sbatch`` look
    for a file nemo-run copies there only over SSH).

    Preemption: Slurm sends SIGUSR1 ``preempt_signal_s`` seconds before the time limit to every
    process of the step (on the command line: ``run.executor.signal=USR1@<seconds>``); the run then
    saves, requeues the job (``--requeue``) and exits, and the requeued job resumes with the same
    command (see ``dit_mcore.training.preemption``). Tested on a one-node Slurm 22.05
    (``benchmarks/slurm/``). ``OMP_NUM_THREADS=1`` as torchrun would set it (srun sets nothing;
    a CPU run was 12x slower without it). No torchrun agent sits in between: its
    default action on SIGUSR1 is to die, and the step with it, while the trainers are still saving.
    """
    return run.SlurmExecutor(account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus_per_node,
                             gpus_per_node=gpus_per_node, time=time, container_image=container_image,
                             exclusive=True, mem="0", launcher=None, env_vars={**_GPU_ENV, "OMP_NUM_THREADS": "1"},
                             tunnel=run.LocalTunnel(job_dir=""), packager=run.Packager(),
                             signal=f"USR1@{preempt_signal_s}",
                             additional_parameters={"requeue": True})
