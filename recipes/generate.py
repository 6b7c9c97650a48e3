"""Generation from a trained checkpoint as a nemo-run CLI: launched exactly as training is.

    # in-process, one process
    python recipes/generate.py --yes --factory generate_digits
    # any request field and the layout as overrides
    python recipes/generate.py --yes --factory generate request.checkpoint=runs/t2v_digits \\
        'request.prompts=["a 3 moving left"]' request.out=out/t2v
    # one process per GPU/CPU rank, CFG-parallel x sequence parallel
    torchrun --nproc-per-node 4 recipes/generate.py --yes --factory generate_digits \\
        parallel.cfg_parallel=2 parallel.context_parallel_size=2 parallel.cp_comm_type=a2a
    # nemo-run executors, as for training (add --dryrun to print the sbatch script)
    python recipes/generate.py --yes --factory generate_digits run.executor=local run.executor.ntasks_per_node=2
    python recipes/generate.py --yes --factory generate request.checkpoint=/ckpt/run 'request.labels=["all"]' \\
        run.executor=slurm run.executor.nodes=1 run.executor.gpus_per_node=8

The same job as ``python -m dit_mcore.generate`` (whose flags are ``request``'s fields); see
``dit_mcore/generate/job.py`` for every field.
"""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the checkout importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dit_mcore.startup import imports_uncollected

with imports_uncollected():  # (start-up: dit_mcore/startup.py)
    import nemo_run as run

    import dit_mcore.recipes.executors  # noqa: F401  (registers run.executor=local|slurm)
    from dit_mcore.generate.job import GenerateRequest
    from dit_mcore.generate.layout import GenerateParallel
    from dit_mcore.recipes.entry import generate as generate_task
    from dit_mcore.recipes.launch import main


@run.cli.factory(target=generate_task)
def generate() -> run.Partial[generate_task]:
    """Generate from ``request.checkpoint`` (required) with the run's sampling settings."""
    return run.Partial(generate_task, request=run.Config(GenerateRequest, checkpoint=""),
                       parallel=run.Config(GenerateParallel))


@run.cli.factory(target=generate_task)
def generate_digits() -> run.Partial[generate_task]:
    """The digits demo's checkpoint (``bash recipes/run_demo.sh``): four images of every class into
    ``runs/digits/generated``."""
    return run.Partial(generate_task, request=run.Config(GenerateRequest, checkpoint="runs/digits", labels=["all"],
                                                         num_per_prompt=4, out="runs/digits/generated"),
                       parallel=run.Config(GenerateParallel))


if __name__ == "__main__":  # nemo-run re-executes this file in its workers; launch only from the CLI
    sys.exit(main(generate_task))
