"""The layout planner (dit_mcore.plan): the collectives its trace counts against the analytic volumes,
its shortcuts (one sample's trace, no pipeline stages) against the whole micro-batch's trace, and the
command: every layout it prints passes the layout check, the best one's overrides train, bad input
gets one line."""
import collections
import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_env import single_process_world
from test_parallel_layouts import layout_run
from test_recipes import resolve
from dit_mcore.parallel.layout import check_layout
from dit_mcore.plan import cli
from dit_mcore.plan.gpus import GB, gpu
from dit_mcore.plan.memory import predict_memory
from dit_mcore.plan.search import Layout, Planner, lighter_first, pipeline_splits
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.plan.op_costs import group_names
from dit_mcore.plan.step_time import BUS_FACTOR, on_wire, operator_times, placement, span
from dit_mcore.plan.trace import trace_microbatch
from dit_mcore.plan.world import traced_world
from dit_mcore.recipes.pretrain_xl import pretrain_tiny
from energon_data.batch import MicroBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from attention_comm import CommBenchConfig, analytic  # noqa: E402

ROWS, SEQ = 4, 16  # a dense micro-batch of 4 samples of 4x4 tokens


def _batch(rows=ROWS):
    return MicroBatch.dense(torch.zeros(rows, SEQ, 16), (1, 4, 4), torch.arange(rows))


def _per_layer_wire_bytes(cfg, world=2) -> float:
    with traced_world(cfg.parallel, world):
        one, two = (trace_microbatch(cfg, _batch(), num_layers=n) for n in (1, 2))
    return sum(BUS_FACTOR[kind](n) * b for kind, _, n, b in (two + one * -1).comm)


@pytest.mark.parametrize("method", ["tp_sp", "p2p", "a2a", "ep2"])
def test_the_traced_collectives_are_the_analytic_volumes(tmp_path, method):
    """Per layer and micro-batch, what a rank puts on the wire (fp32): TP2 + SP, 4 all-gathers and
    reduce-scatters forward and 6 backward of a ``[tokens, hidden]`` activation (benchmarks/parallel_step.py);
    CP2, the ring's and Ulysses' volumes of benchmarks/attention_comm.py; EP2, top-2 routing: each token's two
    copies of ``[hidden]`` dispatched and combined, forward and backward (4 all-to-alls; the dispatcher's token
    counts add under 2%)."""
    parallel = dict(tensor_model_parallel_size=2, sequence_parallel=True) if method == "tp_sp" else \
        dict(expert_model_parallel_size=2) if method == "ep2" else dict(context_parallel_size=2, cp_comm_type=method)
    cfg = layout_run(tmp_path, "dense", moe=method == "ep2", **parallel)
    traced = _per_layer_wire_bytes(cfg)
    h = cfg.model.hidden_size
    if method == "ep2":
        assert traced == pytest.approx(4 * (2 - 1) / 2 * ROWS * SEQ * cfg.model.moe_router_topk * h * 4, rel=0.02)
        return
    if method == "tp_sp":
        want = 10 * (2 - 1) / 2 * ROWS * SEQ * h * 4
    else:
        heads = cfg.model.num_attention_heads
        want = analytic(method, CommBenchConfig(seq=SEQ * ROWS, heads=heads, head_dim=h // heads, degree=2,
                                                dtype="float32"))[1]
    assert traced == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("world, parallel", [
    (32, dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=4, cp_comm_type="a2a+p2p",
              hierarchical_context_parallel_sizes=[2, 2])),
    (32, dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, pipeline_model_parallel_size=2)),
    (16, dict(context_parallel_size=2, pipeline_model_parallel_size=4)),
    (24, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),  # (stages of 12 ranks, nodes of 8)
])
def test_each_group_is_priced_on_the_link_megatron_puts_it(world, parallel):
    """A collective goes over NVLink when all of its group's ranks are in one node, and between nodes through as
    many network ports as its group has ranks in the node with the fewest: the step-time model's placement of
    each named group (and of the data-parallel reductions' group, data x context) against the ranks megatron's
    parallel state gives every rank, for every node size."""
    from megatron.core import parallel_state

    p = ParallelConfig(**parallel)
    dp_cp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    found = collections.defaultdict(list)  # (name, size, span): every group's ranks
    for rank in range(world):
        with traced_world(p, world, rank=rank):
            named = {**group_names(), parallel_state.get_data_parallel_group(with_context_parallel=True): "dp_cp"}
            for group, name in named.items():
                ranks = tuple(torch.distributed.get_process_group_ranks(group))
                spread = p.tensor_model_parallel_size * dp_cp if name == "dp_cp" else span(name, len(ranks), p, world)
                found[name, len(ranks), spread].append(ranks)
    assert {"tp", "cp", "pp", "dp", "dp_cp"} <= {name for name, *_ in found}
    for (name, size, spread), groups in found.items():
        for per_node in (1, 2, 4, 8, 16, 32):
            nodes = [collections.Counter(r // per_node for r in ranks) for ranks in set(groups)]
            want = (all(len(n) == 1 for n in nodes), min(min(n.values()) for n in nodes))
            assert placement(spread, size, per_node, world) == want, (name, groups, per_node)
    single_process_world()


def test_collectives_between_nodes_use_a_port_per_rank_in_a_node():
    """Between nodes each GPU has its own port (H100: 50 GB/s): a ring over 16 ranks, 8 in each of two nodes,
    moves 8 ports' worth (nccl-tests' ~400 GB/s bus bandwidth on DGX H100 nodes), one rank a node moves one port's,
    and a ring over the 12 ranks of a pipeline stage of 24 GPUs in nodes of 8 (8 + 4 or 4 + 8) four ports' worth;
    an all-to-all sends the other node's half of each rank's data out of its own port; a send between nodes
    goes out of one port."""
    h100, size = gpu("H100-80GB"), 16
    bus = BUS_FACTOR["all_reduce"](size) * 1e9

    def bandwidth(*where):
        return bus / on_wire("all_reduce", size, *where) / GB
    assert bandwidth(16, 1e9, h100, 8, 16) == pytest.approx(8 * h100.network_gbs)
    assert bandwidth(16 * 8, 1e9, h100, 8, 16 * 8) == pytest.approx(h100.network_gbs)
    assert bandwidth(16, 1e9, h100, 16, 16) == pytest.approx(h100.nvlink_gbs)
    assert BUS_FACTOR["all_reduce"](12) * 1e9 / on_wire("all_reduce", 12, 12, 1e9, h100, 8, 24) / GB == \
        pytest.approx(4 * h100.network_gbs)
    assert on_wire("all_to_all", size, 16, 1e9, h100, 8, 16) == pytest.approx(0.5e9 / (h100.network_gbs * GB))
    assert on_wire("p2p", 2, 16, 1e9, h100, 8, 16) == pytest.approx(1e9 / (h100.network_gbs * GB))


@pytest.mark.parametrize("world, parallel", [
    (4, dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    (8, dict(pipeline_model_parallel_size=2, context_parallel_size=2, tensor_model_parallel_size=2,
             virtual_pipeline_model_parallel_size=2)),
])
def test_pipeline_stages_wait_for_the_tensors_megatrons_schedule_sends(tmp_path, world, parallel):
    """Each micro-batch's exchanges between pipeline stages, each a send and a receive at once (one at two stages,
    where every stage is the first or the last; the interleaved schedule's two per model chunk), priced on the link
    between the stages, of the tensors megatron's schedule sends (``schedules.get_tensor_shapes``: the sequence over
    CP, and over TP under sequence parallelism)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes
    from dit_mcore.plan.step_time import stage_send_bytes, step_time
    from dit_mcore.plan.trace import MicroBatchTrace
    cfg = layout_run(tmp_path, "dense", **parallel)
    p, config = cfg.parallel, cfg.model.build(cfg.parallel)
    with traced_world(p, world):
        (shape,) = get_tensor_shapes(seq_length=SEQ * 4, micro_batch_size=ROWS, decoder_seq_length=None, config=config,
                                     tp_group=ps.get_tensor_model_parallel_group(),
                                     cp_group=ps.get_context_parallel_group())
    sent = stage_send_bytes(p, SEQ * 4, ROWS, config.hidden_size, 2)
    assert sent == shape[0] * shape[1] * shape[2] * 2
    h100, chunks = gpu("H100-80GB"), parallel.get("virtual_pipeline_model_parallel_size", 1)
    step = step_time(MicroBatchTrace(0.0, 0.0), parallel=p, microbatches=3, gpu=h100, gpus_per_node=8, world=world,
                     grad_bytes=0.0, weight_bytes=0.0, stepped_elements=0.0, ema_elements=0.0,
                     distributed_optimizer=False, stage_send_bytes=sent)
    exchanges = 2 * chunks if chunks > 1 else 1
    assert step.exposed_comm == pytest.approx(3 * exchanges * sent / (h100.nvlink_gbs * GB))


def test_one_sample_without_stages_predicts_the_whole_micro_batch(tmp_path):
    """The planner traces one sample without pipeline stages and scales; the memory it predicts for 4
    samples per micro-batch on two stages is within 5% of the whole micro-batch's trace on stage 0 (which
    holds the embeddings, not the final layer the shortcut also counts: 7% more activations here)."""
    cfg = layout_run(tmp_path, "dense")
    cfg.model.input_size, cfg.data.image_size = 8, 8
    layout = Layout(pp=2, micro_batch=ROWS)
    planner = Planner(cfg, 2, gpu("H100-80GB", workspace_gib=0.0), 8, lambda rows: _batch(rows))
    shortcut = planner.evaluate(layout).memory
    whole = predict_memory(layout.apply(cfg), 2, _batch(), on_gpu=True)
    assert shortcut.total == pytest.approx(whole.total, rel=0.05), (shortcut.activations, whole.activations)
    assert whole.activations <= shortcut.activations <= 1.1 * whole.activations  # (the final layer: an over-count)
    single_process_world()


def test_layers_that_do_not_divide_over_the_stages_split_unevenly_and_a_lighter_first_stage_holds_less(tmp_path):
    """Where the stages do not divide the layers, the search tries megatron's uneven splits whose largest stage is
    the least possible (28 layers over 8 stages: 1 or 2 on the first, 3 or 2 on the last, 4 on each other); a
    layer moved from the first stage (which holds the most micro-batches in flight) to the last lowers the peak,
    and the step waits for the longer last stage. Each split passes the layout check."""
    assert pipeline_splits(28, 8) == [(1, 3), (2, 2)]
    assert pipeline_splits(5, 2) == [(2, 3)] and pipeline_splits(8, 4) == [(0, 0)] and pipeline_splits(3, 4) == []
    assert pipeline_splits(12, 8) == [(3, 3)]  # (one layer on each middle stage)
    cfg = layout_run(tmp_path, "dense")  # (rows of 16 x 16 tokens: activations outweigh the tiny model's state)
    cfg.model.num_layers, cfg.model.input_size, cfg.data.image_size, cfg.data.global_batch_size = 5, 32, 32, 8
    planner = Planner(cfg, 2, gpu("H100-80GB", workspace_gib=0.0), 8,
                      lambda rows: MicroBatch.dense(torch.zeros(rows, 256, 16), (1, 16, 16), torch.arange(rows)))
    done, _ = planner.plan()
    staged = {e.layout.describe(2) for e in done if e.layout.pp == 2}
    assert staged and all("PP2(first 2, last 3)" in d for d in staged), staged
    for e in done:
        if e.layout.pp == 2:
            run = e.layout.apply(cfg)
            check_layout(run.parallel, cfg.model.build(ParallelConfig()), run.data, 2)
            if e.layout.recompute == "none":  # the peak with 2 micro-batches in flight: the first stage's 2 layers
                in_flight = min(2, run.data.num_microbatches(1))  # (with one: the last stage's 3)
                assert (e.memory.stage, e.memory.stage_layers) == ((0, 2) if in_flight == 2 else (1, 3)), e.layout
    cfg.model.num_layers = 6
    planner = Planner(cfg, 2, planner.gpu, 8, planner.batch)
    even = Layout(pp=2, micro_batch=2)
    lighter = lighter_first(even, 6)
    assert (lighter.first_stage, lighter.last_stage) == (2, 4)
    even, lighter = planner.evaluate(even), planner.evaluate(lighter)  # (4 micro-batches: 2 in flight on stage 0)
    assert lighter.memory.total < even.memory.total and lighter.step.compute > even.step.compute
    single_process_world()


def test_explain_breaks_a_layer_down_operator_by_operator(tmp_path, capsys):
    """``--explain``'s operators: their matrix products are the layer's linears (6 FLOPs per weight per token
    forward and backward; adaLN's modulation per sample), and their times add up to the layer's compute as the
    step-time model prices it."""
    cfg = layout_run(tmp_path, "dense")
    cfg.model.input_size, cfg.data.image_size = 8, 8
    device = gpu("H100-80GB", workspace_gib=0.0)
    planner = Planner(cfg, 1, device, 8, lambda rows: _batch(rows))
    layer = planner.profile(Layout()).per_layer
    rows = operator_times(layer, device)
    h, ffn, tokens = cfg.model.hidden_size, cfg.model.build(ParallelConfig()).ffn_hidden_size, SEQ
    assert sum(f for name, _, f, _, _ in rows if "attention" not in name) == layer.gemm_flops == \
        6 * tokens * (4 * h * h + 2 * h * ffn) + 6 * 1 * (h * 6 * h)
    r = device.rates
    attention = sum(f / (r.attention_tflops(k) * 1e12) for k, f in layer.attention)
    kernels = layer.gemm_flops / (r.gemm_tflops * 1e12) + attention + layer.memory_bytes / (r.memory_gbs * 1e9)
    assert sum(row[4] for row in rows) == pytest.approx(kernels, rel=1e-9)
    single_process_world()
    assert cli.main(["--preset", "tiny", "--seq", "16", "--global-batch", "8", "--gpu", "H100-80GB", "--gpus", "2",
                     "--explain", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "operator by operator" in out and "reduce_scatter over tp (2 ranks)" in out
    single_process_world()


TINY = ["--preset", "tiny", "--seq", "16", "--global-batch", "32", "--gpu", "H100-80GB"]
# 4 layers (two chunks on each of two stages), 128 x 128 tokens: long enough for chunked MLPs
LONG = ["--preset", "tiny", "--seq", "16384", "--global-batch", "8", "--gpu", "H100-80GB", "model.num_layers=4"]


def test_every_layout_printed_passes_the_check_and_the_best_trains(tmp_path, capsys):
    """Every layout the search evaluates (among them interleaved stages, all-to-all groups inside a ring,
    chunked MLPs and selective recompute) passes the layout check and is priced as its mechanism says: the
    interleaved schedule halves the bubble, chunking and selective recompute lower the activations, the
    latter for more compute; the best layout's overrides train."""
    out = tmp_path / "layouts.jsonl"
    assert cli.main([*LONG, "--gpus", "4", "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and {"overrides", "fits", "memory_gib", "step_s", "tflops_per_gpu", "mfu",
                        "tokens_per_s_per_gpu"} <= set(records[0])
    base = cli.run_config(cli.parse_args([*LONG, "--gpus", "4"]))[0]
    by_layout = {}
    for record in records:
        layout = Layout.of(record["overrides"])
        assert layout.overrides() == record["overrides"]
        by_layout[layout] = record
        cfg = layout.apply(base)
        check_layout(cfg.parallel, cfg.model.build(cfg.parallel), cfg.data, 4,
                     use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    assert {"a2a+p2p", "a2a", "p2p"} <= {layout.cp_comm_type for layout in by_layout}
    twins = lambda field, value: [(by_layout[layout.__class__(**{**vars(layout), field: value})], by_layout[layout])  # noqa: E731
                                  for layout in by_layout if getattr(layout, field) != value]
    interleaved, chunked, selective = twins("vpp", 1), twins("chunk_tokens", 0), twins("recompute", "none")
    for fsdp, hsdp in twins("fsdp_shard", 0):  # (HSDP: the state sharded over fewer ranks)
        assert hsdp["memory_gib"]["optimizer"] == pytest.approx(2 * fsdp["memory_gib"]["optimizer"], rel=0.05)
    assert interleaved and chunked and twins("fsdp_shard", 0) and any(r["overrides"]["model.recompute_granularity"] == "selective" for _, r in selective)
    for plain, other in interleaved:
        assert other["step_parts_s"]["bubble"] == pytest.approx(plain["step_parts_s"]["bubble"] / 2, rel=0.02)
    for pairs in (chunked, [t for t in selective if t[1]["overrides"]["model.recompute_granularity"] == "selective"]):
        # (never more; less wherever the peak is in the layers, not in the parts outside them)
        assert all(other["memory_gib"]["activations"] <= plain["memory_gib"]["activations"] for plain, other in pairs)
        assert any(other["memory_gib"]["activations"] < plain["memory_gib"]["activations"] for plain, other in pairs)
    for plain, other in selective:
        assert other["step_parts_s"]["compute"] > plain["step_parts_s"]["compute"]
    fitting = [float(f"{r['tokens_per_s_per_gpu']:.4g}") for r in records if r["fits"]]
    assert fitting == sorted(fitting, reverse=True)  # best first (to 4 digits: ties go to larger micro-batches)
    assert records[0]["memory_gib"]["total"] == pytest.approx(sum(v for k, v in records[0]["memory_gib"].items()
                                                                  if k != "total"), abs=0.01)
    # one GPU: the best layout's overrides, as --emit prints them, train the recipe's tiny run
    capsys.readouterr()
    assert cli.main([*TINY, "--gpus", "1", "--emit"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    emitted = printed[-1].split()
    assert "parallel.tensor_model_parallel_size=1" in emitted and "data.micro_batch_size=8" in emitted
    assert printed[-2].startswith("    GiB: weights ") and "activations" in printed[-2] and "workspace" in printed[-2]
    from dit_mcore.training.trainer import pretrain
    history = pretrain(resolve(pretrain_tiny, [*emitted, "trainer.max_steps=1", f"log.dir={tmp_path / 'run'}"]))
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))


def test_where_nothing_fits_the_device_the_search_offloads_the_least_optimizer_state_that_fits(tmp_path, capsys):
    """Elixir's way out on a small cluster: one GPU too small for every layout takes the optimizer state of
    the least share (of 0.25 ... 1) that frees what it lacks into host memory (megatron's offload, under
    its distributed optimizer); the host step is priced, the layout passes the offload check, and the
    best one's overrides, as --emit prints them, train."""
    from dit_mcore.plan.search import accepted
    small = [*TINY, "--gpus", "1", "--workspace-gib", "0", "--gpu-memory-gib", "0.003"]
    out = tmp_path / "layouts.jsonl"
    assert cli.main([*small, "--json", str(out)]) == 0
    records = {Layout.of(r["overrides"]): r for r in map(json.loads, out.read_text().splitlines())}
    offloaded = {layout: r for layout, r in records.items() if layout.offload}
    best = next(iter(records))
    assert best.offload and records[best]["fits"] and not any(r["fits"] for layout, r in records.items()
                                                             if not layout.offload)
    base = cli.run_config(cli.parse_args(small))[0]
    planner = cli.planner_of(cli.parse_args(small))
    for layout, record in offloaded.items():
        assert accepted(base, layout, 1) is None
        twin = records[Layout(**{**vars(layout), "offload": 0.0, "distopt": False})]
        assert record["memory_gib"]["optimizer"] < twin["memory_gib"]["optimizer"] and record["host_gib"] > 0
        assert record["step_parts_s"]["optimizer"] > twin["step_parts_s"]["optimizer"]  # (the host's step)
        less = [f for f in (0.25, 0.5, 0.75) if f < layout.offload]
        if less:  # the least share that fits: the next smaller one does not
            assert not planner.evaluate(Layout(**{**vars(layout), "offload": less[-1]})).fits
    capsys.readouterr()
    assert cli.main([*small, "--emit"]) == 0
    emitted = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert "optim.cpu_offload=True" in emitted and "trainer.bf16=True" in emitted
    from dit_mcore.training.trainer import pretrain
    history = pretrain(resolve(pretrain_tiny, [*emitted, "trainer.max_steps=1", f"log.dir={tmp_path / 'run'}"]))
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))


def test_the_search_offers_fsdp_with_experts_where_the_layout_check_takes_it():
    """An MoE model on 4 GPUs: Megatron-FSDP with EP2 (experts over two expert-data-parallel ranks) is among
    the accepted candidates; FSDP2 with EP, and EP with no rank sharing an expert under FSDP, are not."""
    from dit_mcore.plan.search import accepted, candidate_layouts
    moe = ["model.num_moe_experts=4", "model.moe_router_topk=2"]
    base = cli.run_config(cli.parse_args([*TINY, "--gpus", "4", *moe]))[0]
    taken = [layout for layout in candidate_layouts(base, 4, 8) if accepted(base, layout, 4) is None]
    assert any(layout.fsdp == "megatron" and layout.ep == 2 for layout in taken)
    assert not any(layout.fsdp == "torch" and layout.ep > 1 for layout in taken)
    assert not any(layout.fsdp != "none" and layout.ep * layout.tp * layout.pp == 4 and layout.ep > 1 for layout in taken)


def test_the_search_takes_only_layouts_the_runs_own_settings_allow():
    """A run's optimizer, EMA and precision settings rule out some layouts (FSDP shards the EMA itself and steps
    torch's AdamW; a split EMA needs the distributed optimizer): for a run with each such setting, every layout
    the search accepts passes the trainer's whole check of that run, and the layouts the setting rules out are
    refused."""
    from dit_mcore.plan.search import accepted, candidate_layouts
    from dit_mcore.training.validate import run_problems
    base = cli.run_config(cli.parse_args([*TINY, "--gpus", "4"]))[0]
    settings = {"trainer.ema_offload": True, "optim.main_grads_dtype": "bf16", "optim.exp_avg_dtype": "bf16",
                "optim.split_main_params": True, "trainer.ema_shard": True}
    candidates = list(candidate_layouts(base, 4, 8))
    for key, value in settings.items():
        run = copy.deepcopy(base)
        section, name = key.split(".")
        setattr(getattr(run, section), name, value)
        taken = [layout for layout in candidates if accepted(run, layout, 4) is None]
        assert taken and all(not run_problems(layout.apply(run), 4) for layout in taken), key
        ruled_out = [layout for layout in candidates
                     if layout.fsdp != "none" or (key == "trainer.ema_shard" and not layout.distopt)]
        assert ruled_out and not set(ruled_out) & set(taken), key


def test_the_search_takes_only_layouts_te_fp8_can_split(monkeypatch):
    """TE's FP8 GEMMs need each rank's token count a multiple of 16: a run with them (its GPU and TE version are
    the run's machine's, not the planner's) of 16-token samples is offered no layout that splits a one-sample
    micro-batch over two ranks (TP2 + SP, CP2), and every layout offered passes TE's whole layout check."""
    from dit_mcore.models import specs, te_fp8
    from dit_mcore.plan.search import accepted, candidate_layouts
    monkeypatch.setattr(specs, "te_installed", lambda: True)
    base = cli.run_config(cli.parse_args([*TINY, "--gpus", "2", "model.fp8='tensorwise'", "model.backend='te'"]))[0]
    candidates = list(candidate_layouts(base, 2, 8))
    taken = [layout for layout in candidates if accepted(base, layout, 2) is None]
    assert taken and all(layout.micro_batch % (layout.tp * layout.cp) == 0 for layout in taken)
    assert any(layout.cp == 2 for layout in taken)  # (two samples over two ranks: 16 tokens each)
    assert "TE's FP8 GEMMs need each rank's token count" in accepted(base, Layout(cp=2), 2)
    for layout in taken:
        run = layout.apply(base)
        te_fp8.check_layout(run, run.model.build(run.parallel), 2)


def test_a_run_with_layout_auto_trains_on_the_planners_first_choice(tmp_path, caplog, capsys):
    """``parallel.layout=auto`` through the recipes' ``train``: the run trains on the layout the planner
    ranks first for it (its model, its data's samples, its global batch, this world), logs it with its
    prediction and writes ``plan.json`` beside ``metrics.jsonl``; ``python -m dit_mcore.plan --run`` of the
    recorded run (its directory, its checkpoint) chooses the same."""
    import fiddle as fdl
    from nemo_run.cli.cli_parser import parse_cli_args
    from dit_mcore.plan.samples import Samples, batch_maker, run_samples, text_tokens
    from dit_mcore.recipes.auto_layout import choose_layout
    from dit_mcore.recipes.entry import train
    from dit_mcore.training.data_fit import fit_model_to_data

    run_dir = tmp_path / "run"
    args = ["parallel.layout=auto", "parallel.layout_gpu=H100-80GB", "trainer.max_steps=1", f"log.dir={run_dir}"]
    cfg = resolve(pretrain_tiny, args)
    fit_model_to_data(cfg)
    side = 8 // cfg.model.build(ParallelConfig()).patch_size  # (the recipe's 8x8 digits)
    assert run_samples(cfg, fix="") == Samples([(1, side, side)])
    samples = Samples([(1, side, side)])
    done, _ = Planner(cfg, 1, gpu("H100-80GB"), 1, batch_maker(cfg, samples, text_tokens(cfg))).plan()
    want = done[0].layout
    task = pretrain_tiny()
    parse_cli_args(task, args, task)
    with caplog.at_level("INFO", logger="recipes"):
        train(**fdl.build(task).keywords)
    record = json.loads((run_dir / "plan.json").read_text())
    assert Layout.of(record["prediction"]["overrides"]) == want and record["world"] == 1
    assert record["replaced"]["data.micro_batch_size"] == 16  # (the recipe's, replaced by the planner's)
    assert f"parallel.layout=auto chose {want.describe(1)}" in caplog.text
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["step"] == 1
    chosen = choose_layout(resolve(pretrain_tiny, args), world=1)
    assert chosen.data.micro_batch_size == want.micro_batch and chosen.parallel.layout is None
    for recorded in (run_dir, run_dir / "checkpoints"):
        capsys.readouterr()
        assert cli.main(["--run", str(recorded), "--gpus", "1", "--gpu", "H100-80GB", "--emit"]) == 0
        emitted = capsys.readouterr().out.strip().splitlines()[-1]
        assert emitted == " ".join(f"{k}={v}" for k, v in want.overrides().items())


def test_layout_auto_plans_the_world_slurm_or_torchrun_launched(tmp_path, monkeypatch):
    """A task ``srun`` started itself (no torchrun variables yet): the world comes from Slurm's, the layout chosen
    fits 4 ranks, and only rank 0 writes ``plan.json``."""
    from dit_mcore.recipes.auto_layout import PLAN_FILE, choose_layout
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # (so that monkeypatch restores what adopting Slurm's variables sets)
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    cfg = choose_layout(resolve(pretrain_tiny, ["parallel.layout=auto", "parallel.layout_gpu=H100-80GB",
                                                f"log.dir={tmp_path}"]))
    check_layout(cfg.parallel, cfg.model.build(cfg.parallel), cfg.data, 4,
                 use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    assert cfg.parallel.data_parallel_size(4) * cfg.parallel.model_parallel_size() == 4
    assert not (tmp_path / PLAN_FILE).exists()  # (rank 1)


@pytest.mark.parametrize("args, message", [
    (["parallel.layout=auto"], "parallel.layout=auto plans for a GPU and this job has none: set parallel.layout_gpu"),
    (["parallel.layout=auto", "parallel.layout_gpu=H100-80GB", "parallel.context_parallel_size=2"],
     "parallel.layout=auto chooses the layout, and parallel.context_parallel_size=2 is set too"),
    (["parallel.layout=best"], "parallel.layout='best' is unknown; use parallel.layout=auto"),
    (["parallel.layout_gpu=H200"], "parallel.layout_gpu='H200' is read only with parallel.layout=auto"),
    (["parallel.layout=auto", "parallel.layout_gpu=V100"], "parallel.layout_gpu='V100' is not in the planner's table"),
])
def test_layout_auto_bad_input_gets_one_line(args, message):
    from dit_mcore.errors import ConfigError
    from dit_mcore.recipes.auto_layout import choose_layout
    if torch.cuda.is_available() and args == ["parallel.layout=auto"]:
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError) as e:
        choose_layout(resolve(pretrain_tiny, args), world=1)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--gpu", "V100"], "--gpu 'V100' is not in the table; use one of"),
    (["--seq", "15"], "--seq 15 / --frames 1 = 15 tokens per frame is not a square grid"),
    (["--explain", "tp=3"], "--explain 'tp=3': the layout check refuses it:"),
    (["--explain", "pipes=2"], "'pipes=2' is not name=value with a name among"),
    (["--explain", "tp=two"], "tp takes int values, not 'two'"),
    (["--explain", "recompute=some"], "recompute is one of ['full', 'none', 'selective', 'selective_mlp']"),
    (["model.depth=3"], "model.depth=3: give model.<field>=<value> with a field of ModelConfig"),
])
def test_bad_input_gets_one_line(args, message, capsys):
    argv = [*TINY, "--gpus", "2"]
    for flag, value in zip(args[::2], args[1::2]):  # (replace a flag's value, or add the flag)
        argv = argv[:argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2:] if flag in argv else [*argv, flag, value]
    if len(args) == 1:
        argv.append(args[0])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--seq", "16", "model.input_size=8"], "model.input_size=8: the samples' size comes from --seq"),
    (["--mix", "1x4x4,2x4x4"], "--mix '1x4x4,2x4x4' packs its samples: give --pack TOKENS"),
    (["--mix", "1x4", "--pack", "64"], "'1x4' is not a token grid TxHxW"),
    (["--mix", "1x4x4:0", "--pack", "64"], "with an optional positive :weight"),
    (["--pack", "8", "--mix", "1x4x4"], "a sample of 1x4x4 = 16 tokens is longer than a pack of 8"),
    (["--seq", "16", "--mix", "1x4x4", "--pack", "64"], "--mix gives the samples' grids: drop --seq"),
    (["--seq", "16", "--pack", "0"], "--pack 0: tokens per packed sequence must be >= 1"),
    (["--seq", "16", "optim.use_distributed_optimizer=True"], "the planner chooses optim.use_distributed_optimizer"),
    (["--run", "/nonexistent/run", "--preset", "tiny"], "fixes its model: drop --family / --preset"),
    (["--seq", "16", "trainer.bf16=False", "optim.main_grads_dtype=bf16"],
     "data parallel over all of them: optim.main_grads_dtype='bf16' needs trainer.bf16=True"),
    ([], "--seq is needed (tokens per sample), or --mix with --pack, or --run a recorded run"),
    (["--seq", "16", "optim.lr=1e-3", "parallel.fsdp=torch"], "parallel.fsdp=torch: give model.<field>=<value>"),
    (["--run", "/nonexistent/run"], "--run /nonexistent/run: no such directory"),
])
def test_bad_samples_get_one_line(args, message, capsys):
    argv = ["--preset", "tiny", "--global-batch", "8", "--gpus", "2", *args]
    if "--run" in args:  # (a recorded run brings its own model)
        argv = argv[2:]
    assert cli.main(argv) == (1 if "data parallel over all" in message else 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_packed_samples_attend_each_to_itself():
    """``--pack`` with ``--mix``: the planner traces the packs the loader's packer makes of a round of samples
    drawn with the mix's weights, each sample attending to its own tokens, their costs averaged per pack: a pack
    of four 16-token images costs what a dense micro-batch of four such images costs; three images to one 32-token
    clip (a round of 48 and 16: 20 packs of 64 tokens) cost 5.6 images' attention per pack, and the memory of
    their heaviest pack (four images)."""
    from dit_mcore.plan.samples import packing_round
    base = ["--preset", "tiny", "--global-batch", "8", "--gpus", "1"]

    def per_layer(*flags, micro_batch=1):
        planner = cli.planner_of(cli.parse_args([*base, *flags]))
        return planner.tokens, planner.profile(Layout(micro_batch=micro_batch)).per_layer
    packed_tokens, packed = per_layer("--pack", "64", "--mix", "1x4x4")
    _, dense = per_layer("--seq", "16", micro_batch=4)
    assert packed_tokens == 64 and [keys for keys, _ in packed.attention] == [16]
    assert packed.attention_flops == pytest.approx(dense.attention_flops, rel=1e-9)
    assert packed.gemm_flops == pytest.approx(dense.gemm_flops, rel=1e-9)
    image = dense.attention_flops / 4
    packs = packing_round([(1, 4, 4), (2, 4, 4)], 64, [3, 1])
    assert len(packs) == 20 and sum(len(p) for p in packs) == 64
    assert sorted(len(p) for p in packs) == [2] * 8 + [4] * 12  # (two clips, or four images)
    mixed_tokens, mixed = per_layer("--pack", "64", "--mix", "1x4x4:3,2x4x4:1")
    assert mixed_tokens == 64 and [keys for keys, _ in mixed.attention] == [16, 32]
    assert mixed.attention_flops == pytest.approx(5.6 * image, rel=1e-9)
    # memory: the heaviest pack's (four images), whole, not the round's average
    assert (mixed.saved, mixed.peak) == (packed.saved, packed.peak)


def test_a_prepared_datasets_packs_are_planned_from_its_record(tmp_path):
    """A packed run on a prepared dataset: its record's latent shapes, weighted by their shards' samples, those
    longer than a pack left out (the loader skips them); without a record, one sample filling the pack."""
    import dataclasses
    from dit_mcore.plan.samples import run_samples
    from energon_data.prepare import STATE_FILE
    cfg = layout_run(tmp_path / "run", "energon:" + str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    shards = [{"samples": 30, "latent_shapes": [[1, 1, 8, 8], [1, 2, 8, 8]]},
              {"samples": 10, "latent_shape": [1, 1, 8, 8]}, {"samples": 5, "latent_shape": [1, 16, 16, 16]}]
    (tmp_path / "data" / STATE_FILE).write_text(json.dumps({"shards": shards}))
    p = cfg.model.build(ParallelConfig()).patch_size
    samples = run_samples(cfg, fix="")  # (16 and 32 tokens; 1,024 do not fit a pack of 62)
    assert samples == ([(1, 8 // p, 8 // p), (2, 8 // p, 8 // p)], cfg.data.max_seq_len, [25.0, 15.0])
    (tmp_path / "data" / STATE_FILE).unlink()
    assert run_samples(cfg, fix="").grids == [(1, 2, 31)]  # (62 tokens: the nearest to square)
    with pytest.raises(Exception, match="no prepare record"):
        run_samples(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packing=False)), fix="x")


def test_a_model_that_fits_nowhere_says_what_it_needs(capsys):
    """Nothing fits one GPU whose memory is under the tiny run's need, even with its optimizer state in host
    memory; the message names the smallest cluster that fits (its state sharded over more ranks), or says
    that 64x more GPUs do not; run as a user runs it, the line is all it prints on stderr (the warnings of the
    runs it traces are its own business)."""
    import subprocess
    done = subprocess.run([sys.executable, "-m", "dit_mcore.plan", *TINY, "--gpus", "1", "--workspace-gib", "0",
                           "--gpu-memory-gib", "0.002"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "no layout fits 1 x H100-80GB; the smallest needs" in err[0], err
    assert "; 4 GPUs fit it (" in err[0] and " MiB per GPU)" in err[0], err
    assert cli.main([*TINY, "--gpus", "1", "--workspace-gib", "0", "--gpu-memory-gib", "0.00001"]) == 1
    assert "64 times more GPUs do not fit it either" in capsys.readouterr().err
