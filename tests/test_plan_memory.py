"""The planner's memory prediction (dit_mcore.plan.memory) against a real training step's peak, on
CPU: the step's live memory measured by :class:`LiveMemory` (every storage an operator creates,
counted until freed) on top of the state the trainer holds (every distinct storage reachable from
its model, DDP buffers, optimizer and EMA), and predicted by a fake-tensor trace of one and two
layers in a fake process group of the layout. Each family, dense and packed, recompute on and off, and a
paper preset (DiT-S/2) in one process; TP+SP, context parallel, pipeline (even and uneven, each stage at its
own rank), FSDP, the distributed optimizer and expert parallelism on two ranks (one spawn), every family among
them (ST-DiT's video under CP, its packs under TP+SP)."""
import functools
import gc
import shutil
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from dist_utils import run_distributed
from megatron_env import single_process_world
from test_parallel_layouts import layout_run
from dit_mcore.parallel.initialize import release_model_parallel_groups
from dit_mcore.plan import trace
from dit_mcore.plan.live_memory import LiveMemory
from dit_mcore.plan.memory import predict_memory
from dit_mcore.plan.trace import layer_profile, layer_saved_bytes
from dit_mcore.plan.world import traced_world
from dit_mcore.training.trainer import Trainer

TOLERANCE = 0.05  # (the goal is 10%; every case is within 1.5%: docs/planning.md)


# Not followed: functions and methods reach every module's globals (through ``__globals__``), and with them
# whatever earlier work in the process left in caches; the run's state is reachable through its objects.
# Fake tensors (a planner's trace elsewhere in the process) hold no memory.
_NOT_FOLLOWED = (type, type(sys), str, bytes, int, float, types.FunctionType, types.MethodType,
                 types.BuiltinFunctionType, functools.partial, functools._lru_cache_wrapper, FakeTensor)


def held_bytes(*roots) -> int:
    """Bytes of the distinct storages reachable from ``roots`` (FSDP's DTensors: their local shards)."""
    seen, storages, stack = set(), {}, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)
            if local.device.type != "meta":
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            stack.extend(t for t in (getattr(obj, "main_grad", None), obj.grad) if t is not None)
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def measured_step(cfg) -> dict:
    """A second training step's peak (the first made Adam's state) and the micro-batches it trained on."""
    shutil.rmtree(cfg.log.dir, ignore_errors=True)
    trainer = Trainer(cfg)
    trainer.train_step()
    state = held_bytes(trainer.model, trainer.ddp_chunks, trainer.optimizer, trainer.ema)
    batches, read = [], trainer.loader.next_global_batch
    trainer.loader.next_global_batch = lambda: batches.extend(read()) or batches
    with LiveMemory(base=state) as live:
        trainer.train_step()
    return {"state": state, "peak": live.peak, "batches": batches}


def _run(tmp, family="dit", data="dense", recompute=False, moe=False, chunk=None, **parallel):
    cfg = layout_run(f"{tmp}/{family}_{data}", data, family=family, moe=moe, **parallel)
    cfg.data.micro_batch_size = 4 if data == "dense" else 1  # (activations the larger part of the peak)
    cfg.model.chunk_tokens = chunk
    if recompute:
        cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "uniform", 1
    return cfg


def check(cfg, measured: dict, world: int, stage: int = 0) -> None:
    predicted = predict_memory(cfg, world, measured["batches"], stage=stage)
    # the state counted from the parameters (megatron pads each gradient bucket; the model keeps a few
    # small caches of the last batch: KiBs here)
    assert predicted.state.total == pytest.approx(measured["state"], rel=0.05)
    activations = measured["peak"] - measured["state"]
    assert predicted.activations + predicted.gathered == pytest.approx(activations, rel=0.10), \
        f"activations predicted {predicted.activations:.0f} + {predicted.gathered:.0f} gathered, measured {activations:.0f}"
    assert predicted.total == pytest.approx(measured["peak"], rel=TOLERANCE), \
        f"predicted {predicted.parts_gib()} (activations {predicted.activations:.0f}), measured {measured['peak']:.0f} " \
        f"(activations {activations:.0f})"


ONE = [("dit", "dense", False), ("dit", "packed", True), ("dit_xattn", "dense", True), ("dit_xattn", "packed", False),
       ("llama", "dense", False), ("llama", "packed", True), ("stdit", "dense", True), ("stdit", "dense", False)]


@pytest.mark.parametrize("family, data, recompute", ONE)
def test_one_process_peak_is_predicted(tmp_path, family, data, recompute):
    single_process_world()
    cfg = _run(tmp_path, family, data, recompute)
    measured = measured_step(cfg)
    check(cfg, measured, 1)


def test_a_small_presets_peak_is_predicted(tmp_path):
    """A paper preset as well as the tiny ones: DiT-S/2 (12 layers of 384, 33M parameters), its state the larger
    part of the peak."""
    single_process_world()
    cfg = _run(tmp_path, "dit", "dense")
    cfg.model.preset, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = \
        "DiT-S/2", None, None, None
    measured = measured_step(cfg)
    assert cfg.model.build(cfg.parallel).num_layers == 12
    check(cfg, measured, 1)


def test_the_planner_knows_chunked_execution(tmp_path):
    """``model.chunk_tokens``: the trace runs the chunked code, so the prediction follows the measured
    peak down (rows of 16 tokens in chunks of 4)."""
    single_process_world()
    peaks = {}
    for chunk in (None, 4):
        cfg = _run(tmp_path / str(chunk), "dit", "dense", chunk=chunk)
        measured = measured_step(cfg)
        check(cfg, measured, 1)
        peaks[chunk] = measured["peak"] - measured["state"]
    assert peaks[4] < 0.9 * peaks[None]


@pytest.mark.parametrize("family, data, moe", [("dit", "dense", False), ("llama", "packed", False),
                                             ("dit", "dense", True)])
def test_the_planner_counts_what_a_compiled_layer_keeps(tmp_path, monkeypatch, family, data, moe):
    """``model.compile``: what the planner counts a compiled layer keeping for its backward (AOTAutograd's min-cut
    partition over Inductor's decompositions, on fake tensors, no code generated) is, byte for byte, what an
    Inductor-compiled layer keeps on real tensors (CPU), and less than the eager layer keeps; the planner's
    activations per layer drop by the difference. An MoE layer too (its experts read their token counts on the
    host, where dynamo breaks the graph)."""
    cfg = _run(tmp_path, family, data, moe=moe)
    cfg.model.compile = True
    single_process_world()
    trainer = Trainer(cfg)
    batch = trainer.loader.next_global_batch()[0]
    del trainer
    release_model_parallel_groups()
    with traced_world(cfg.parallel, 1):
        kept = {}
        for backends, fake in (((None, "inductor"), False), ((None, "aot_eager_decomp_partition"), True)):
            kept.update({(backend, fake): saved for backend, saved in
                         zip(backends, layer_saved_bytes(cfg, batch, backends=backends, fake=fake))})
        assert kept["aot_eager_decomp_partition", True] == kept["inductor", False] < kept[None, False] == \
            kept[None, True], kept
        saved = kept[None, True] - kept["aot_eager_decomp_partition", True]
        if moe:  # (the partition just measured, not run again: MoE's graph breaks make it ~10 s)
            monkeypatch.setattr(trace, "compiled_layer_savings", lambda *args, **kwargs: saved)
        eager = layer_profile(cfg.__class__(**{**vars(cfg), "model": cfg.model.__class__(
            **{**vars(cfg.model), "compile": False})}), batch)
        compiled = layer_profile(cfg, batch)
    assert compiled.outside.saved == pytest.approx(eager.outside.saved)  # (the embeddings and final layer: eager)
    assert eager.at(3).saved - compiled.at(3).saved == pytest.approx(3 * saved)
    assert eager.at(3).peak - compiled.at(3).peak == pytest.approx(3 * saved)
    single_process_world()


TWO = {
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "tp2_sp_packed_xattn": dict(family="dit_xattn", data="packed", tensor_model_parallel_size=2, sequence_parallel=True),
    "cp2_p2p_packed": dict(data="packed", context_parallel_size=2, cp_comm_type="p2p"),
    "cp2_a2a_llama": dict(family="llama", context_parallel_size=2, cp_comm_type="a2a"),
    "pp2": dict(pipeline_model_parallel_size=2),
    # uneven: 1 layer on the first stage (2 micro-batches in flight), 3 on the last (1 in flight, the final layer)
    "pp2_uneven": dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
    "fsdp": dict(fsdp="torch"),
    "dp2_distopt_recompute": dict(distopt=True, recompute=True),
    "ep2": dict(moe=True, expert_model_parallel_size=2),
    "cp2_p2p_stdit_video": dict(family="stdit", data="video", context_parallel_size=2, cp_comm_type="p2p"),
    "tp2_sp_stdit_packed": dict(family="stdit", data="packed", tensor_model_parallel_size=2, sequence_parallel=True),
}


def _two_worker(rank, world, tmp):
    out = {}
    for name, kw in TWO.items():
        out[name] = measured_step(_run(f"{tmp}/{name}", **kw))
        release_model_parallel_groups()
        gc.collect()
    return out


def test_two_rank_layouts_peak_is_predicted(tmp_path):
    ranks = run_distributed(_two_worker, 2, str(tmp_path))
    failures = []
    for name, kw in TWO.items():
        cfg = _run(f"{tmp_path}/{name}", **kw)
        for stage in (0, 1) if name.startswith("pp") else (0,):  # (each pipeline stage: its own rank)
            try:
                check(cfg, ranks[stage][name], 2, stage)
            except AssertionError as e:
                failures.append(f"{name} (rank {stage}): {e}")
    assert not failures, "\n".join(failures)
