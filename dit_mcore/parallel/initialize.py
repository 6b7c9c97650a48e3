"""Process groups and seeds: gloo on CPU, NCCL on GPU, megatron ``parallel_state`` on top."""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``node[01-04,07]`` -> ``node01``)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    match = re.match(r"([^\[,]+)(?:\[([^\],-]+))?", nodelist)
    return match.group(1) + (match.group(2) or "")


def adopt_slurm_launch() -> None:
    """Tasks started by ``srun`` itself (one per GPU, no torchrun agent in between: Slurm's
    preemption signal then reaches the trainers directly) get torchrun's variables from Slurm's:
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the step's task ids, the first node of the step as
    ``MASTER_ADDR`` and a port derived from the job id. Nothing changes when ``RANK`` is already set
    (torchrun) or outside an ``srun`` step."""
    env = os.environ
    if "RANK" in env or "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"), LOCAL_WORLD_SIZE=env.get("SLURM_STEP_TASKS_PER_NODE", "1")
               .split("(")[0].split(",")[0])
    env.setdefault("MASTER_ADDR", _first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def initialize_distributed(parallel: ParallelConfig, seed: int) -> None:
    """Initialise torch.distributed (a 1-process group when not launched by torchrun), apply the
    CPU shims when there is no GPU, build megatron's model-parallel groups and seed RNGs."""
    adopt_slurm_launch()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from dit_mcore.parallel.cpu_shims import apply_cpu_shims
        apply_cpu_shims()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if on_gpu else "gloo")
    parallel.data_parallel_size(dist.get_world_size())
    release_model_parallel_groups()
    initialize_model_parallel(parallel)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    log.info("distributed: world=%d backend=%s tp=%d pp=%d cp=%d ep=%d dp=%d", dist.get_world_size(),
             dist.get_backend(), parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
             parallel.context_parallel_size, parallel.expert_model_parallel_size,
             parallel_state.get_data_parallel_world_size())


def initialize_model_parallel(parallel: ParallelConfig, **megatron_options) -> None:
    """megatron's model-parallel groups of ``parallel`` over the current world (``megatron_options``:
    more of ``parallel_state.initialize_model_parallel``'s arguments)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=parallel.fsdp_replicas(dist.get_world_size()),
        **megatron_options)


def whole_model_world() -> None:
    """Megatron's parallel state for whole models (TP=PP=1), set up in a plain interpreter with as few
    side effects as possible: an in-memory store (no environment variables, no port) and the caller's
    RNG state left as it was; nothing to do where it is set up already. For converting weights
    (:mod:`dit_mcore.convert`): megatron's layers need its parallel state even at TP=PP=1, and on CPU
    the shims :func:`initialize_distributed` applies."""
    if parallel_state.model_parallel_is_initialized():
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(f"torch.distributed has {dist.get_world_size()} ranks but megatron's parallel state is "
                           "not initialised; call dit_mcore.parallel.initialize.initialize_distributed("
                           "ParallelConfig(), seed) on every rank first, or convert in a single process")
    on_gpu = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if on_gpu else []):
        initialize_distributed(ParallelConfig(), seed=0)
    log.info("set up a single-process megatron world (TP=PP=1) for whole models")


_AT_RELEASE: list = []


def at_release(fn) -> None:
    """Call ``fn()`` in :func:`release_model_parallel_groups`, before the groups are destroyed: for state
    a module below the trainer keeps that would otherwise hold the groups (see Megatron-FSDP's hooks)."""
    if fn not in _AT_RELEASE:
        _AT_RELEASE.append(fn)


def release_model_parallel_groups() -> None:
    """Drop megatron's model-parallel state and destroy every process group but the world's.

    megatron's ``destroy_model_parallel`` only forgets its groups; each one stays alive with its own
    threads and connections (gloo: a few threads per group). A process that builds trainer after
    trainer (tests, notebooks, sweeps) otherwise accumulates them by the hundred, and every later
    collective and context switch gets slower (seen: four gloo ranks on two cores went from ~2 s to
    ~90 s per run over 30 layouts). Trainers built before this call must not be used after it.

    DTensor's sharding caches go too: they key on ``DeviceMesh``es, which compare equal when they span
    the same ranks whatever groups they wrap, so the next FSDP model (either kind) would get output
    specs on the old model's meshes, whose groups are gone. So do the state that keeps groups for the
    process's life: TE's userbuffers (bootstrapped over the TP group; the next trainer makes new ones),
    megatron's MoE logging tracker (each entry holds its reduce group), the packed attention
    operator's group registry, and what modules registered with :func:`at_release`."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _forget_megatron_groups()
    if dist.is_initialized():
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        from dit_mcore.parallel.tp_comm_overlap import release_userbuffers
        from dit_mcore.kernels.planned_attention import release_groups
        release_userbuffers()
        release_groups()
        for fn in _AT_RELEASE:
            fn()
        get_moe_layer_wise_logging_tracker().clear()
        _clear_sharding_prop_cache()  # the python LRU and the C++ fast path's cache
        for group in list(c10d._world.pg_map):
            if group is not c10d.GroupMember.WORLD:
                dist.destroy_process_group(group)


def _forget_megatron_groups() -> None:
    """megatron 0.16's ``destroy_model_parallel`` leaves some groups in its module (the hierarchical
    context-parallel groups, the partial data-parallel groups with CP): drop every module-level group
    or list of groups it still holds."""
    def holds_groups(value) -> bool:
        if isinstance(value, (list, tuple)):
            return bool(value) and all(holds_groups(v) for v in value)
        return isinstance(value, dist.ProcessGroup)

    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and name.isupper() and holds_groups(value):
            setattr(parallel_state, name, None)


def run_device() -> torch.device:
    """The device this rank computes on: its CUDA device (set from ``LOCAL_RANK``) or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (every rank calls it: one rank's failure decided on by all, so that
    none is left waiting in its next collective; ``device``: where the process group reduces)."""
    flag = torch.tensor([int(flag)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def destroy_distributed() -> None:
    release_model_parallel_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
