"""Checkpoints with ``megatron.core.dist_checkpointing``: written to a temporary directory and
renamed into place only once every rank has finished, so a half-written checkpoint never replaces
a good one.

Layout: ``<dir>/step_00000100/`` (a dist-checkpoint whose ``manifest.json``, written last, lists
every file and its size) and ``<dir>/latest`` (name of the newest complete one, replaced
atomically). ``latest`` is only a hint: resuming scans the ``step_*`` directories for the newest
*intact* one, so a deleted pointer or a truncated newest checkpoint never restarts a run from step
0 over its own checkpoints. Rotation keeps the newest ``keep`` plus any ``protect``-ed ones (the
last checkpoint before a divergence).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import multiprocessing.managers
import os
from queue import Queue
import random
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import (dict_list_map_inplace, extract_matching_values, merge,
                                                         nested_values)
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, is_main_replica
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from torch.distributed.checkpoint.api import CheckpointException

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.fsdp import publish_weights, whole_checkpoint_view
from dit_mcore.parallel.initialize import on_any_rank, run_device
from dit_mcore.training import torch_optimizer
from dit_mcore.training.optim import HostAdamW
from dit_mcore.training.split_main import whole_main_weights
from energon_data.lifetime import helper_init, preemption_signals_blocked

log = logging.getLogger(__name__)

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# optim.cpu_offload: megatron's HybridDeviceOptimizer keeps its sub-optimizers' classes in its parameter groups,
# which a checkpoint's common state then holds; torch's weights-only load takes only allowed globals.
torch.serialization.add_safe_globals([torch.optim.AdamW, torch.optim.SGD, HostAdamW])


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


MANIFEST = "manifest.json"


class SaveFailed(OSError):
    """A checkpoint could not be written (disk full, permissions, ...), raised alike on every rank after
    its partial files are removed; the previous checkpoint stays ``latest``."""


def agreed_failure(error: Optional[BaseException]) -> Optional[str]:
    """The first rank's failure (as one line) if any rank failed, the same on every rank."""
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if error is None else f"{type(error).__name__}: {error}".splitlines()[0])
    return next((r for r in reasons if r is not None), None)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one is expected (the message names the path and the fix)."""


def write_manifest(path: Path) -> None:
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1))
    tmp.replace(path / MANIFEST)


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not an intact checkpoint, or None when it is: every file the manifest lists
    is there with its recorded size (checkpoints from before manifests: dist_checkpointing's
    ``metadata.json`` is present)."""
    manifest = path / MANIFEST
    if not manifest.exists():
        if (path / "metadata.json").exists():
            return None
        return "incomplete (no manifest.json: the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest.json ({e})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is truncated or altered ({f.stat().st_size} bytes, manifest says {size})"
    return None


def intact_checkpoints(root: str | os.PathLike, quiet: bool = False) -> Iterator[Path]:
    """The intact ``step_*`` checkpoints under ``root``, newest first (nothing when there are none).
    Broken ones are reported and passed over; only broken ones is an error (``quiet``: neither)."""
    root = Path(root)
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    found = False
    for path in reversed(steps):
        problem = checkpoint_problem(path)
        if problem is not None:
            if not quiet:
                log.warning("checkpoint %s is not usable: %s; trying the previous one", path, problem)
            continue
        if not found and not quiet:
            marker = root / "latest"
            hint = marker.read_text().strip() if marker.exists() else None
            if hint != path.name:
                log.warning("%s names %s, but the newest intact checkpoint is %s: resuming from it", marker,
                            hint or "nothing (missing)", path.name)
        found = True
        yield path
    if steps and not found and not quiet:
        raise CheckpointError(f"no intact checkpoint in {root} ({len(steps)} step_* directories, all broken, "
                              "see the warnings above); move them away to start over, or restore one")


def load_common(path: Path) -> dict:
    """The rank-0 (common) part of a checkpoint, without touching sharded tensors."""
    return dist_checkpointing.load_common_state_dict(str(path))


def recorded_architecture(root: str | os.PathLike) -> Optional[dict]:
    """The model architecture (:func:`architecture`) the newest intact checkpoint under ``root`` records,
    read quietly (the resume reports broken ones); None where there is none."""
    for path in intact_checkpoints(root, quiet=True):
        try:
            return load_common(path).get("model_arch")
        except Exception:  # noqa: BLE001 - unreadable: the resume falls back past it and says so
            continue
    return None


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _per_rank(key: str, data: Any) -> ShardedObject:
    return ShardedObject(key, data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _allocated(sharded: dict, *, saving: bool) -> dict:
    """``sharded`` without the tensors left on the meta device: a sharded EMA (``trainer.ema_shard``)
    gathers for a save only the tensors this rank writes (its main replicas) and loads only those its
    shards need. Saving, a main replica left unallocated is an error (nobody would write it)."""
    unallocated, allocated = extract_matching_values(
        sharded, lambda v: isinstance(v, ShardedTensor) and v.data is not None and v.data.is_meta)
    unwritten = [t.key for t in nested_values(unallocated) if is_main_replica(t.replica_id)] if saving else []
    if unwritten:
        raise CheckpointError(f"{len(unwritten)} EMA tensors this rank writes were not gathered here "
                              f"(e.g. {unwritten[0]}); set trainer.ema_shard=False and report the layout")
    return allocated


def sharded_state(model, ema_model, optimizer, *, extra: dict, per_rank: dict, is_loading: bool = False,
                  ema_partial: bool = False) -> dict:
    """What a checkpoint holds; ``ema_partial``: the EMA module holds only some tensors allocated (a
    sharded EMA's, :func:`_allocated`)."""
    model_sd = model.sharded_state_dict()
    ema = ema_model.sharded_state_dict(prefix="ema.")
    state = {
        "model": model_sd,
        "ema": _allocated(ema, saving=not is_loading) if ema_partial else ema,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA),
        **extra,
    }
    for key, value in per_rank.items():
        state[f"rank_{key}"] = _per_rank(f"rank_{key}", value)
    return state


_async_results = None
"""The asynchronous saves' results queue (:func:`write_results_queue`), started at the first one."""


@contextlib.contextmanager
def write_results_queue(asynchronous: bool):
    """Inside, megatron's checkpoint writer reports its results (``filesystem_async._get_write_results_queue``)
    where they are read. A synchronous save writes and reads them in this process: a plain queue, so no
    helper process starts (megatron's own is a spawned ``Manager``, which imports torch to unpickle the
    first results: seconds of CPU per process that saves). An asynchronous save writes them from a forked
    process: a queue served by a spawned ``Manager`` as megatron's, but ending with its parent (megatron's
    outlives a ``kill -9`` of the trainer and then waits forever) and deaf to the preemption signals Slurm
    sends the whole job step (it died of them mid-save); spawned, since a forked one held the trainer's
    sockets open as long as it lived, and a later process group could not bind its port. It lives as long
    as this process, for every later asynchronous save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    global _async_results
    if asynchronous:
        if _async_results is None:
            manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
            with preemption_signals_blocked():
                manager.start(initializer=helper_init)
            _async_results = manager.Queue()  # the proxy keeps the manager alive
        results = _async_results
    else:
        results = Queue()
    saved, filesystem_async._results_queue = filesystem_async._results_queue, results
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


def finalize_async_saves(queue, root: str | os.PathLike, *, blocking: bool) -> None:
    """Publish the asynchronous saves ``queue`` (megatron's ``AsyncCallsQueue``) has finished writing
    (``blocking``: wait for them). A write that failed on any rank, which megatron raises on every rank, or a
    failed publishing (rank 0's), becomes a :class:`SaveFailed` on every rank naming its step and reason, its
    partial files under ``root`` removed."""
    try:
        with _agreeing():  # (metadata.json is written in the finalization)
            finalized = queue.maybe_finalize_async_calls(blocking=blocking)
    except CheckpointException as e:
        partials = sorted(Path(root).glob(".partial_step_*"))  # (one save is in flight at a time)
        # (torch's wrapped failures: (exception, stack) per rank, known on the coordinator only)
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        reason = agreed_failure(failures[0] if failures else e)  # (every rank has looked before rank 0 deletes)
    else:
        if not finalized:
            return
        # Publishing (rank 0's work) ended the same finalization on every rank; its failure is agreed on here.
        failed = [error for _, error in _published if error is not None]
        reason = agreed_failure(failed[0] if failed else None)
        if reason is None:
            return
        partials = [Path(root) / f".partial_step_{step:08d}" for step, _ in _published]  # (maybe renamed already)
    finally:
        _published.clear()
    if dist.get_rank() == 0:
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
    steps = ", ".join(str(int(p.name.removeprefix(".partial_step_"))) for p in partials) or "?"
    raise SaveFailed(f"checkpoint of step {steps} not written ({reason}); its partial files are removed") from None


_published: list = []  # (step, publishing's error or None) of finalized asynchronous saves, until agreed on


_rank0_errors: list = []  # errors of megatron's rank-0 writes (common.pt, metadata.json), until a save agrees on them
_recording = [False]  # whether a save of ours is on, which agrees on them (else the recorders raise, as megatron would)


@contextlib.contextmanager
def _agreeing():
    """Keep megatron's rank-0 write errors for :func:`_rank0_error` while a save of ours runs."""
    _recording[0] = True
    try:
        yield
    finally:
        _recording[0] = False


class _AgreedCommonStrategy(TorchCommonSaveStrategy):
    """megatron's writer of the common state (``common.pt``, rank 0 alone, before the tensors), its error kept
    for every rank to agree on: raised on rank 0 alone, it would leave the others waiting in the sharded save's
    collectives."""

    def save_common(self, common_state_dict, checkpoint_dir):
        try:
            super().save_common(common_state_dict, checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - whatever it is, every rank learns it
            if not _recording[0]:
                raise
            _rank0_errors.append(e)


def _agreed_save_config(config, checkpoint_dir) -> None:
    """megatron's ``metadata.json`` write (rank 0 alone, at the end of a save, before a barrier every rank
    enters), its error kept for the save to agree on, so that rank 0 reaches the barrier too."""
    try:
        dist_checkpointing.core.save_config(config, checkpoint_dir)
    except Exception as e:  # noqa: BLE001
        if not _recording[0]:
            raise
        _rank0_errors.append(e)


def _agree_on_rank0_writes() -> None:
    """Route megatron's rank-0 writes through the recorders above. ``dist_checkpointing.save`` takes no common
    strategy of ours (only its default) and writes ``metadata.json`` through a module function, so both are
    swapped in its ``serialization`` module, where it looks them up at each save; outside our saves
    (:func:`_agreeing`) the recorders raise as megatron's own functions do."""
    serialization.get_default_save_common_strategy = lambda backend="torch", version=1: _AgreedCommonStrategy(
        backend, version)
    serialization.save_config = _agreed_save_config
    _rank0_errors.clear()


def _rank0_error() -> Optional[BaseException]:
    error = _rank0_errors[0] if _rank0_errors else None
    _rank0_errors.clear()
    return error


def _publish_recording(publish, step: int) -> None:
    """An asynchronous save's publishing, run by megatron inside a finalization every rank goes through (after
    its ``metadata.json``): an error raised here would leave rank 0 alone (the others waiting in the
    finalization's collective), so it, or the metadata's, is kept for :func:`finalize_async_saves` to agree on.
    (torch's ``.metadata`` is written inside DCP, which hands a failure to every rank.)"""
    error = _rank0_error()  # (metadata.json's, written just before)
    if error is None:
        try:
            publish()
        except Exception as e:  # noqa: BLE001 - whatever it is, every rank learns it
            error = e
    _published.append((step, error))


def save_checkpoint(root: str | os.PathLike, step: int, model, ema_model, optimizer, *, extra: dict,
                    per_rank: dict, keep: int = 2, protect: frozenset = frozenset(), ema_partial: bool = False,
                    async_queue=None) -> Path:
    """Save and publish ``step``. ``extra`` is common (rank-0) state; ``per_rank`` differs per rank.
    Rotation keeps the newest ``keep`` checkpoints and every one named in ``protect``.

    With ``async_queue`` (megatron's ``AsyncCallsQueue``) only the snapshot happens now: the tensors
    are written by a forked process while training goes on, and the checkpoint is published when
    ``async_queue.maybe_finalize_async_calls`` finds every rank done (call it each step, and with
    ``blocking=True`` before the run ends). Until then the previous checkpoint stays ``latest``."""
    root = Path(root)
    final, partial = _step_dir(root, step), root / f".partial_step_{step:08d}"

    def failed(error: Optional[BaseException]) -> None:  # every rank calls it at the same point
        reason = agreed_failure(error)
        if reason is not None:
            if dist.get_rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise SaveFailed(f"checkpoint of step {step} not written ({reason}); its partial files are removed")

    error = None
    if dist.get_rank() == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as e:
            error = e
    failed(error)
    if torch_optimizer.uses_torch_optimizer():  # before the first step: the (zero) state a load expects
        torch_optimizer.init_adam_state(optimizer)

    def publish():
        if dist.get_rank() == 0:
            write_manifest(partial)
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            tmp = root / "latest.tmp"
            try:
                tmp.write_text(final.name)
                tmp.replace(root / "latest")
            except BaseException:
                # unpublished: partial files again, which the failure removes, not a step folder newer than `latest`
                final.rename(partial)
                tmp.unlink(missing_ok=True)
                raise
            for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
                if old.name not in protect:
                    shutil.rmtree(old, ignore_errors=True)
            log.info("saved checkpoint %s", final)

    with whole_main_weights(optimizer):  # split main weights: fp32 until the tensors are snapshot
        with whole_checkpoint_view((model, ema_model), optimizer, loading=False) as view:  # FSDP: global keys
            state = view.localize(sharded_state(model, ema_model, view.optimizer, extra=extra,
                                                ema_partial=ema_partial, per_rank={**per_rank, "rng": rng_state()}))
            _agree_on_rank0_writes()  # (rank 0's own writes: their errors are agreed on too)
            try:  # (torch's DCP hands a rank's write error to every rank)
                with _agreeing(), write_results_queue(asynchronous=async_queue is not None):
                    request = dist_checkpointing.save(state, str(partial), async_sharded_save=async_queue is not None)
            except (OSError, CheckpointException) as e:  # agreed on below, then raised as SaveFailed
                error = e
        failed(error or _rank0_error())  # (an asynchronous save's metadata.json is written at its finalization)
        if async_queue is not None:
            # (runs on every rank once all have written, metadata.json first)
            request.add_finalize_fn(functools.partial(_publish_recording, publish, step))
            async_queue.schedule_async_request(request)  # (copies the tensors to the host now)
            return final
    error = None
    try:
        if dist.get_rank() == 0:
            publish()
    except OSError as e:
        error = e
    failed(error)
    return final


ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "patch_size", "patch_size_t", "in_channels", "input_size", "learn_sigma",
                       "num_classes", "frequency_embedding_size", "num_moe_experts", "timestep_freq_shift")


def architecture(model_cfg, family: str, preset: str) -> dict:
    """What a checkpoint records about its model, to explain a mismatch by config field."""
    return {"family": family, "preset": preset, **{f: getattr(model_cfg, f, None) for f in ARCHITECTURE_FIELDS}}


def _tensor_shapes(sharded: dict) -> dict:
    return {t.key: tuple(t.global_shape) for t in nested_values(sharded) if isinstance(t, ShardedTensor)}


def refuse_other_model(path: Path, template_ema: dict, saved_arch: Optional[dict], arch: dict,
                       fix: Optional[str] = None, metadata: Optional[dict] = None) -> None:
    """Fail before loading when the checkpoint's weights are not this model's: tensors missing,
    extra (e.g. a layer fewer) or of another shape. The message lists the config fields that
    differ. Compared on the EMA copy, which holds exactly the model's tensors. ``metadata``: the checkpoint's
    tensors' (``dist_checkpointing.load_tensors_metadata``) when the caller has read it already."""
    metadata = dist_checkpointing.load_tensors_metadata(str(path)) if metadata is None else metadata
    saved = {k: tuple(t.global_shape) for k, t in metadata.items() if k.startswith("ema.")}
    ours = {}  # every rank's tensors: a pipeline stage holds only its own layers
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, _tensor_shapes(template_ema))
    for shapes in per_rank:
        ours.update(shapes)
    missing, extra = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
    reshaped = [f"{k} {saved[k]} -> {ours[k]}" for k in sorted(ours.keys() & saved.keys())
                if ours[k] != saved[k]]
    fields = [f"model.{k}: checkpoint {saved_arch[k]!r}, this run {arch.get(k)!r}"
              for k in (saved_arch or {}) if saved_arch[k] != arch.get(k)]
    if not (missing or extra or reshaped):
        if fields:
            log.warning("checkpoint %s was written with other model settings but the same weights (%s)",
                        path, "; ".join(fields))
        return
    details = ([f"{len(missing)} tensors missing from the checkpoint (e.g. {missing[0].removeprefix('ema.')})"]
               if missing else []) + \
              ([f"{len(extra)} tensors not in this model (e.g. {extra[0].removeprefix('ema.')})"] if extra else []) + \
              ([f"{len(reshaped)} of another shape (e.g. {reshaped[0].removeprefix('ema.')})"] if reshaped else [])
    raise ConfigError(f"checkpoint {path} holds another model: "
                      f"{'; '.join(fields) or ('same recorded settings' if saved_arch else 'settings not recorded')}; "
                      f"{'; '.join(details)}. "
                      + (fix or "Resume with the checkpoint's model settings, or set log.dir to a new run directory"))


_MAIN_WEIGHT = re.compile(r"((?:chained_\d+\.)?optimizer\.state\.)(param|fp32_param)\.(.+)")


def _main_weights_as_saved(optimizer_state: dict, saved: dict) -> tuple[dict, dict]:
    """A checkpoint written with megatron's distributed optimizer loads without it, and the other way
    round: the fp32 main weights are ``optimizer.state.param.K`` with it (its ``fully_reshardable``
    format), ``optimizer.state.fp32_param.K`` in a mixed-precision run without it, and not saved at all
    in an fp32 run without it (the model's own ``K`` are its main weights). Each main weight requested
    under a name the checkpoint (``saved``: its tensors' metadata) lacks is read under the one it has.
    Returns the optimizer's requests and, apart, those for a model weight: a load reads a key once,
    so these are read by a load of their own."""
    from_model = set()

    def as_saved(value):
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)) or value.key in saved:
            return value
        match = _MAIN_WEIGHT.fullmatch(value.key)
        if match is None:
            return value
        prefix, name, key = match.groups()
        other = f"{prefix}{'fp32_param' if name == 'param' else 'param'}.{key}"
        if other in saved:
            return dataclasses.replace(value, key=other)
        if key in saved and saved[key].dtype == torch.float32:
            value = dataclasses.replace(value, key=key)
            from_model.add(id(value))
        return value
    dict_list_map_inplace(as_saved, optimizer_state)
    if not from_model:
        return optimizer_state, {}
    taken, rest = extract_matching_values(optimizer_state, lambda value: id(value) in from_model)
    return rest, taken


def _layout_of(optimizer) -> str:
    """How a megatron optimizer (not chained) lays out its checkpoint: ``distributed`` (its distributed
    optimizer's ``fully_reshardable`` format), ``fp32`` (``FP32Optimizer``: torch's state dict) or
    ``mixed`` (the mixed-precision optimizers: torch's under ``optimizer``, beside the main weights)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer
    return "distributed" if isinstance(optimizer, DistributedOptimizer) else \
        "fp32" if isinstance(optimizer, FP32Optimizer) else "mixed"


_PLACES = {"fp32": {"state", "param_groups"}, "mixed": {"optimizer", "fp32_from_fp16_params", "grad_scaler"},
           "distributed": {"optimizer", "param_state", "param_state_sharding_type", "grad_scaler"}}
"""What each layout's state dict holds at its top."""


def _saved_layout(common: dict) -> str:
    return "distributed" if "param_state_sharding_type" in common else "mixed" if "optimizer" in common else "fp32"


def _as_layout(loaded: dict, common: dict, layout: str) -> None:
    """Rearrange one optimizer's part of a load for ``layout`` when the checkpoint's optimizer (``common``:
    its part of the checkpoint's common state) was of another: ``loaded`` has the tensors where this one
    asked for them, but the parameter groups' settings and the step where the other kept them. The step:
    a group's ``step`` (the distributed optimizer's; TE's and apex's FusedAdam keep theirs there in any
    layout), else the state's ``common_step`` (torch's AdamW), else 0 (a checkpoint before the first step)."""
    from megatron.core.optimizer import distrib_optimizer
    was = _saved_layout(common)
    if was == layout:
        return
    saved_torch = common if was == "fp32" else common["optimizer"]
    groups = [{k: v for k, v in group.items() if k != "step"} for group in saved_torch["param_groups"]]
    steps = [group["step"] for group in saved_torch["param_groups"] if group.get("step") is not None]
    step = steps[0] if steps else saved_torch.get("state", {}).get("common_step", 0)
    step = int(step) if distrib_optimizer.HAVE_APEX_OR_TE else float(step)  # (as megatron writes it)
    for key in set(loaded) - _PLACES[layout]:
        del loaded[key]  # where the other layout keeps what this one keeps elsewhere
    torch_state = loaded if layout == "fp32" else loaded.setdefault("optimizer", {})
    if layout == "distributed":
        torch_state.pop("state", None)
        torch_state["param_groups"] = [{**group, "step": step} for group in groups]
        loaded["param_state_sharding_type"] = "fully_reshardable"
        return
    mine = torch_state.get("param_groups", [])  # this optimizer's own parameters (not saved)
    torch_state["param_groups"] = [{**group, "step": step, "params": own["params"]} for group, own in zip(groups, mine)]
    torch_state.setdefault("state", {})["common_step"] = torch.tensor(float(step))


def _as_this_optimizer(loaded: dict, common: dict, optimizer) -> None:
    """A checkpoint of a run with megatron's distributed optimizer loads into one without, and the other
    way round (with :func:`_main_weights_as_saved`): each (chained) optimizer's load rearranged."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) == 1:
        _as_layout(loaded, common, _layout_of(parts[0]))
        return
    if not all(i in common for i in range(len(parts))):
        raise CheckpointError(
            f"the checkpoint holds one optimizer where this run chains {len(parts)} (megatron's dense and expert "
            "optimizers): a Megatron-FSDP run with experts written before its checkpoints took megatron DDP's "
            "chained form (2026-12-01); start a new run from its weights with trainer.init_from=<its step folder>")
    for i, part in enumerate(parts):
        _as_layout(loaded[i], common[i], _layout_of(part))


def load_checkpoint(path: Path, model, ema_model, optimizer, *, extra: dict, per_rank: dict,
                    restore_rng: bool = True, saved_arch: Optional[dict] = None, arch: Optional[dict] = None,
                    ema_partial: bool = False) -> dict:
    """Load ``path`` into model, EMA and optimizer in place; returns the common ``extra`` values and
    this rank's ``per_rank`` values. RNG states are restored too unless ``restore_rng`` is False
    (a checkpoint from another world size: per-rank states do not map onto the new ranks).
    Refuses a checkpoint of another model before loading anything (``saved_arch`` and ``arch``
    name the differing fields)."""
    if torch_optimizer.uses_torch_optimizer():
        torch_optimizer.init_adam_state(optimizer)
    rank_keys = {**per_rank, "rng": None} if restore_rng else per_rank
    with whole_main_weights(optimizer, loading=True):  # split main weights: split again after the model's load
        with whole_checkpoint_view((model, ema_model), optimizer, loading=True) as view:  # FSDP: into whole copies
            template = sharded_state(model, ema_model, view.optimizer, extra=extra, per_rank=rank_keys,
                                     is_loading=True, ema_partial=ema_partial)
            metadata = dist_checkpointing.load_tensors_metadata(str(path))
            refuse_other_model(path, template["ema"], saved_arch, arch or {}, metadata=metadata)
            template["optimizer"], main_from_model = _main_weights_as_saved(template["optimizer"], metadata)
            partial = {"ema": template.pop("ema")} if ema_partial else None
            loaded = dist_checkpointing.load(template, str(path))
            if on_any_rank(bool(main_from_model), run_device()):  # (a collective load: every rank takes part)
                apart = dist_checkpointing.load({"main_from_model": main_from_model}, str(path),
                                                validate_access_integrity=False)
                merge(loaded["optimizer"], apart["main_from_model"])
            if partial is not None:  # each rank reads the tensors its shards cut: no cover of every tensor by
                loaded["ema"] = dist_checkpointing.load(  # one main replica to validate
                    partial, str(path), validate_access_integrity=False)["ema"]
            _as_this_optimizer(loaded["optimizer"], load_common(path)["optimizer"], view.optimizer)
            view.optimizer.load_state_dict(loaded.pop("optimizer"))
        view.load_module(model, loaded.pop("model"))
    ema = {k.removeprefix("ema."): v for k, v in loaded.pop("ema").items()}
    ema.update({k: v for k, v in ema_model.state_dict().items() if k not in ema and v.is_meta})  # (not loaded here)
    view.load_module(ema_model, ema)
    publish_weights((model, ema_model))  # Megatron-FSDP: the forward's weight buffers
    if restore_rng:
        set_rng_state(loaded.pop("rank_rng"))
    ranks = {key: loaded.pop(f"rank_{key}") for key in per_rank}
    return {"extra": loaded, "per_rank": ranks}
