"""A training step's time on one rank from the trace's work and the device's measured rates: the
stage's micro-batches (matrix products, attention and the other kernels' traffic at the rates of
:class:`~dit_mcore.plan.gpus.Rates`), the collectives inside them (the trace's own, over NVLink or the
network by where megatron's rank order puts each group), the data-parallel reductions and gathers
(overlapped as far as the run's settings overlap them), the pipeline bubble, and the optimizer and EMA.

Its rates come from one DiT-XL/2 profile per GPU and published attention kernel rates; ``docs/planning.md``
says how far it is off on the points it was not fitted to (NeMo's and Megatron-Bridge's published rows:
``tests/test_plan_published.py``)."""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

from dit_mcore.plan.gpus import GB, GPU
from dit_mcore.plan.trace import MicroBatchTrace

BUS_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0,
        "broadcast": lambda n: 1.0}
ADAM_BYTES = 30  # per stepped element: fp32 main and moments read and written, gradient read, bf16 weight written
EMA_BYTES = 10   # per element: the fp32 shadow read and written, the bf16 weight read
OFFLOAD_LINK_BYTES = 8  # per offloaded element: its fp32 gradient to the host, its fp32 main weight back
HOST_ADAM_BYTES = 28    # ... and on the host: the gradient read, the main weight and both moments read and written


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest (first) pipeline stage, by part."""

    compute: float
    """The kernels of this stage's micro-batches."""
    exposed_comm: float
    """Communication no computation hides."""
    bubble: float
    """Pipeline fill and drain."""
    optimizer: float
    """AdamW and the EMA fold."""
    gemm: float = 0.0
    attention: float = 0.0
    memory_bound: float = 0.0
    """:attr:`compute` by kind of kernel: matrix products, attention, the other (memory-bound) operators."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer


def seconds(kind: str, group: int, nbytes: float, gbs: float) -> float:
    """One collective's time: the bytes a rank puts on the wire over a link of ``gbs`` GB/s per direction."""
    return BUS_FACTOR[kind](group) * nbytes / (gbs * GB) if group > 1 else 0.0


@functools.lru_cache(maxsize=None)
def placement(span: int, size: int, gpus_per_node: int, world: int) -> tuple[bool, int]:
    """Where megatron's rank order puts the groups of ``size`` ranks evenly strided over blocks of ``span``
    consecutive ranks (every block of the ``world``): whether each group lies in one node, and the fewest of a
    group's ranks in any node it spans (a ring between nodes is as fast as its node with the fewest ports)."""
    stride, one_node, fewest = max(1, span // size), True, size
    for start in range(0, world, span):
        for base in range(start, start + stride):
            nodes = collections.Counter((base + i * stride) // gpus_per_node for i in range(size))
            one_node, fewest = one_node and len(nodes) == 1, min(fewest, *nodes.values())
    return one_node, fewest


def on_wire(kind: str, size: int, span: int, nbytes: float, gpu: GPU, gpus_per_node: int, world: int) -> float:
    """One collective's time in a group of ``size`` ranks spanning ``span`` consecutive ranks (of ``world``):
    over NVLink inside a node; between nodes, each GPU with its own network port (a DGX's rails). A ring
    collective crosses between nodes once every k hops (k of its ranks in a node, :func:`placement`), and NCCL
    runs one ring through each of those ranks' ports, so the group moves k ports' worth, NVLink the limit
    (nccl-tests' ~400 GB/s bus bandwidth over DGX H100 nodes is k = 8, 8 x 50 GB/s). An all-to-all sends each
    rank's share for the other nodes' ranks out of its own port (the node's share over NVLink, at the same time);
    a point-to-point send between nodes goes out of one port."""
    if size <= 1:
        return 0.0
    one_node, k = placement(span, size, gpus_per_node, world)
    if one_node:
        return seconds(kind, size, nbytes, gpu.nvlink_gbs)
    if kind == "p2p":
        return seconds(kind, size, nbytes, gpu.network_gbs)
    if kind == "all_to_all":
        return max(nbytes * (size - k) / size / (gpu.network_gbs * GB), nbytes * (k - 1) / size / (gpu.nvlink_gbs * GB))
    return seconds(kind, size, nbytes, min(gpu.nvlink_gbs, k * gpu.network_gbs))


def span(name: str, size: int, parallel, world: int) -> int:
    """How many consecutive ranks a group named ``name`` (:func:`~dit_mcore.plan.op_costs.group_names`) of
    ``size`` ranks spans in megatron's rank order (TP fastest, then CP, then data parallel, pipeline
    outermost; experts: expert TP, then EP): a group inside a node talks over NVLink."""
    if size <= 1:
        return 1
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    etp = parallel.expert_tensor_size()
    return {"tp": tp, "etp": etp, "cp_inner": tp * size, "ep": etp * size, "tp_ep": size, "pp": world,
            "dp": world // parallel.pipeline_model_parallel_size}.get(name, tp * cp)


def step_time(micro: MicroBatchTrace, *, parallel, microbatches: int, gpu: GPU, gpus_per_node: int,
              world: int, grad_bytes: float, weight_bytes: float, stepped_elements: float, ema_elements: float,
              distributed_optimizer: bool, offloaded_elements: float = 0.0, stage_send_bytes: float = 0.0) -> StepTime:
    """The step of a rank whose every micro-batch costs ``micro`` (its stage's layers), ``microbatches`` per
    step; ``grad_bytes`` / ``weight_bytes``: the whole gradient buffer and weights of its share of the model
    (TP/PP/EP), unsharded: what data parallelism reduces and gathers; ``stepped_elements``: the main
    weights its optimizer steps, ``offloaded_elements`` of them on the host (``optim.cpu_offload``:
    megatron's offload copies their gradients over, steps them and copies them back one after the other);
    ``ema_elements``: the EMA it folds (0: offloaded); ``stage_send_bytes``: what one pipeline stage sends the next
    per micro-batch and model chunk (:func:`stage_send_bytes`): megatron's 1F1B (no ``overlap_p2p_comm``) waits for
    each exchange, a send and a receive at once (batched): a middle stage's two per micro-batch (activations
    forward, their gradients back), the first and last stages' one (at two stages, every stage's), the interleaved
    schedule's two per micro-batch and chunk."""
    p, r = parallel, gpu.rates
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    dp = world // (tp * cp * pp)
    attention = sum(flops / (r.attention_tflops(keys) * 1e12) for keys, flops in micro.attention)
    gemm, memory_bound = micro.gemm_flops / (r.gemm_tflops * 1e12), micro.memory_bytes / (r.memory_gbs * GB)
    kernels = gemm + attention + memory_bound
    exposed = 0.0
    for kind, name, group, nbytes in micro.comm:
        t = on_wire(kind, group, span(name, group, parallel, world), nbytes, gpu, gpus_per_node, world)
        exposed += max(0.0, t - attention) if kind == "p2p" else t  # (ring attention overlaps its exchange)
    if pp > 1:  # (a stage boundary's exchanges: forward and backward, for each model chunk; 1F1B's first and last
        # stages skip one of the two, and at two stages every stage is one of them)
        chunks = p.virtual_pipeline_model_parallel_size or 1
        exposed += (2 * chunks if chunks > 1 or pp > 2 else 1) * on_wire(
            "p2p", pp, span("pp", pp, parallel, world), stage_send_bytes, gpu, gpus_per_node, world)
    per_micro = kernels + exposed
    # data parallel over DP x CP: gradients reduced (scattered under the distributed optimizer or FSDP), weights gathered
    replicas, spread = dp * cp, tp * cp * dp
    fsdp = p.fsdp != "none"

    def wire(kind, size, nbytes, over=spread):
        return on_wire(kind, size, over, nbytes, gpu, gpus_per_node, world)
    reduce = wire("reduce_scatter" if distributed_optimizer or fsdp else "all_reduce", replicas, grad_bytes)
    gather = wire("all_gather", replicas, weight_bytes) if distributed_optimizer or fsdp else 0.0
    if fsdp:  # every micro-batch gathers the weights twice (forward, backward) and scatters the gradients
        shard = p.fsdp_shard_size or replicas  # (HSDP: within groups of consecutive data x context ranks)
        if shard < replicas:
            gather, reduce = (wire(kind, shard, grad_bytes if kind == "reduce_scatter" else weight_bytes, tp * shard)
                              for kind in ("all_gather", "reduce_scatter"))
        # HSDP: each shard's gradients all-reduced across the replicas once a step
        across = wire("all_reduce", replicas // shard, grad_bytes / shard)
        # (the gathers and scatters hide behind the micro-batches' kernels; the all-reduce follows the last backward)
        dp_exposed = max(0.0, microbatches * (2 * gather + reduce) - microbatches * kernels) + across
    else:  # overlapped with the last micro-batch's backward (~2/3 of it) and the next forward (~1/3)
        dp_exposed = (max(0.0, reduce - 2 * kernels / 3) if p.overlap_grad_reduce else reduce) \
            + (max(0.0, gather - kernels / 3) if p.overlap_param_gather else gather)
    bubble = (pp - 1) / (p.virtual_pipeline_model_parallel_size or 1) * per_micro if pp > 1 else 0.0
    optimizer = (ADAM_BYTES * (stepped_elements - offloaded_elements) + EMA_BYTES * ema_elements) / (r.memory_gbs * GB)
    optimizer += offloaded_elements * (OFFLOAD_LINK_BYTES / gpu.pcie_gbs + HOST_ADAM_BYTES / gpu.host_gbs) / GB
    return StepTime(microbatches * kernels, microbatches * exposed + dp_exposed, bubble, optimizer,
                    microbatches * gemm, microbatches * attention, microbatches * memory_bound)


def stage_send_bytes(parallel, row_tokens: int, rows: int, hidden: int, element_bytes: int) -> int:
    """The bytes a pipeline stage sends the next per micro-batch of ``rows`` rows of ``row_tokens`` tokens: the
    hidden states of its share of the tokens, the shape megatron's schedule gives them
    (``schedules.get_tensor_shapes``: the sequence over CP, and over TP under sequence parallelism)."""
    tokens = -(-row_tokens // parallel.context_parallel_size)  # (the trainer pads the sequence up to split it)
    if parallel.sequence_parallel:
        tokens = -(-tokens // parallel.tensor_model_parallel_size)
    return tokens * rows * hidden * element_bytes


def operator_times(micro: MicroBatchTrace, gpu: GPU) -> list[tuple]:
    """``micro``'s work operator by operator, priced as :func:`step_time` prices it: ``(operator, calls, FLOPs,
    bytes moved, seconds)``, the longest first. Matrix products at the GEMM rate, attention kernels at the rate
    of the keys they attend to (their share of the micro-batch's attention time), the other operators at the
    memory bandwidth."""
    r, ops = gpu.rates, {}
    for name, measure, amount in micro.ops:
        ops.setdefault(name, {"calls": 0.0, "flops": 0.0, "bytes": 0.0})[measure] += amount
    attention_s = sum(flops / (r.attention_tflops(keys) * 1e12) for keys, flops in micro.attention)
    per_attention_flop = attention_s / micro.attention_flops if micro.attention_flops else 0.0
    rows = []
    for name, m in ops.items():
        if m["flops"]:
            seconds = m["flops"] * per_attention_flop if "attention" in name else m["flops"] / (r.gemm_tflops * 1e12)
        else:
            seconds = m["bytes"] / (r.memory_gbs * GB)
        rows.append((name, round(m["calls"]), m["flops"], m["bytes"], seconds))
    return sorted(rows, key=lambda row: -row[4])
