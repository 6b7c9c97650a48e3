"""Memory traffic of the kernels Inductor fuses around the GEMMs of one DiT layer, as scheduled for an
H100, measured on a machine without a GPU: ours against diffusers' ``DiTTransformer2DModel`` block.

On a GPU, a compiled DiT-XL/2 step spends about a quarter of its time in Inductor's Triton kernels
(norms, modulation, gating, GELU and their backward: memory-bound), next to cuBLAS GEMMs and
attention (``benchmarks/results/h200_2026-11-26_profile.md``). Their cost is the bytes they read and
write. This script counts those bytes without a GPU:

1. each model's layer runs forward and backward on the CPU under ``torch.compile`` with a backend
   that hands every graph AOTAutograd partitions (forward, backward) to the probe below and then runs
   it uncompiled;
2. the probe re-traces the graph on fake CUDA tensors and runs Inductor's lowering and scheduler with
   the CUDA (Triton) backend, pretending to be an H100 (``torch.cuda`` device queries answered
   from a table), and stops before any kernel is generated or compiled;
3. every fused (non-extern) node the scheduler would emit is one Triton kernel; its
   ``get_read_write_buffers_sizes()`` is Inductor's own count of the bytes it reads and writes.
   GEMMs and attention (extern kernels) are left out. A reduction kernel is also marked persistent
   (one pass) or looped as Inductor's heuristic would code it for the device.

Each model is measured at two batch sizes and the difference is divided by the token difference:
bytes per token of fused-kernel traffic, forward and backward (per-step constants such as diffusers'
per-block label-embedding gradients cancel out). Caveats: AOTAutograd's partition runs on the CPU
(its recompute choices are device-independent rules), attention runs in the graph as on the GPU's
dense path, but the CPU's SDPA op stands in for cuDNN's; the count is a byte model, not a time.
``--packed-lens`` needs torch >= 2.14 (2.13's re-inplacing pass fails on a zero-width slice scatter in
the packed layer's backward graph on fake CUDA tensors).

    python benchmarks/fusion_traffic.py                       # DiT-XL/2: ours (aten linears), ours
                                                              # (megatron's linears), diffusers
    python benchmarks/fusion_traffic.py --preset DiT-S/2 --batches 1,2
    python benchmarks/fusion_traffic.py --family llama --preset MovieGen-3B --packed-lens 1024,2048
                                                              # one layer through the trainer, packed
    python benchmarks/fusion_traffic.py --models ours --compile-options triton.multi_kernel=1
    python benchmarks/fusion_traffic.py --models ours,ours_fp8_tensorwise   # what FP8's casts add
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dit_mcore.models.float8 import RECIPES as FP8_RECIPES  # noqa: E402  (model.fp8)

MODELS = ("ours", "ours_megatron_linears", "diffusers", *(f"ours_fp8_{recipe}" for recipe in FP8_RECIPES))


def fp8_recipe(which: str):
    """The ``model.fp8`` recipe of model ``which`` (``ours_fp8_<recipe>``), else None."""
    return which.removeprefix("ours_fp8_") if which.startswith("ours_fp8_") else None

H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, max_threads_per_multi_processor=2048,
    warp_size=32, regs_per_multiprocessor=65536, shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472, shared_memory_per_block=49152, total_memory=80 * 2**30,
    L2_cache_size=50 * 2**20, gcnArchName="", uuid="fake", is_integrated=False, max_threads_per_block=1024,
    clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=5120)


@contextlib.contextmanager
def pretend_h100():
    """``torch.cuda``'s device queries (and the ones Inductor cached at import) answer as one H100."""
    import torch._inductor.scheduler as scheduler
    import torch.cuda.graphs as graphs
    import torch.cuda.random as cuda_random
    import torch.utils._triton as triton_utils
    from torch._dynamo.device_interface import CudaInterface

    def const(value):
        return lambda *a, **k: value

    rng = torch.zeros(16, dtype=torch.uint8)
    patches = [
        (scheduler, "has_triton", const(True)), (triton_utils, "has_triton", const(True)),
        (CudaInterface, "get_device_properties", staticmethod(const(H100))),
        (CudaInterface.Worker, "get_device_properties", staticmethod(const(H100))),
        (CudaInterface, "current_device", staticmethod(const(0))), (CudaInterface.Worker, "current_device", staticmethod(const(0))),
        (CudaInterface, "device_count", staticmethod(const(1))), (CudaInterface, "is_available", staticmethod(const(True))),
        (CudaInterface, "get_compute_capability", staticmethod(const(90))),
        (CudaInterface, "exchange_device", staticmethod(const(-1))), (CudaInterface, "maybe_exchange_device", staticmethod(const(-1))),
        (CudaInterface, "is_bf16_supported", staticmethod(const(True))), (CudaInterface, "synchronize", staticmethod(const(None))),
        (torch.cuda, "is_available", const(True)), (torch.cuda, "device_count", const(1)),
        (torch.cuda, "current_device", const(0)), (torch.cuda, "get_device_properties", const(H100)),
        (torch.cuda, "get_device_capability", const((9, 0))), (torch.cuda, "get_device_name", const(H100.name)),
        (torch.cuda, "is_bf16_supported", const(True)), (torch.cuda, "_lazy_init", const(None)),
        (torch.cuda, "get_rng_state", const(rng)), (cuda_random, "get_rng_state", const(rng)),
        (torch.cuda, "set_rng_state", const(None)), (cuda_random, "set_rng_state", const(None)),
        (torch.accelerator, "current_device_index", const(0)), (torch.cuda, "synchronize", const(None)),
        (torch.cuda, "_exchange_device", const(-1)), (torch.cuda, "_maybe_exchange_device", const(-1)),
        (torch.cuda, "is_current_stream_capturing", const(False)), (graphs, "is_current_stream_capturing", const(False)),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _cpu_pattern_tables() -> None:
    """Inductor builds some pattern tables by tracing example tensors on the graph's device; build
    them on the CPU (the patterns are device-independent) and skip the attention-fusion ones."""
    import torch._inductor.fx_passes.fuse_attention as fuse_attention
    import torch._inductor.fx_passes.misc_patterns as misc_patterns
    import torch._inductor.fx_passes.pad_mm as pad_mm

    fuse_attention._sfdp_init = lambda *a, **k: None
    misc, pad = misc_patterns._misc_patterns_init, pad_mm._pad_mm_init
    misc_patterns._misc_patterns_init = lambda *a, **k: misc(torch.device("cpu"))
    pad_mm._pad_mm_init = lambda *a, **k: pad(torch.device("cpu"))


@dataclasses.dataclass
class Kernel:
    graph: int
    backward: bool
    fused: bool  # a Triton kernel; False: an extern kernel (GEMM, attention)
    bytes: int
    ops: str
    reduction: str = ""  # "persistent" (one pass, the row in registers), "looped", or "" (no reduction)


class TrafficRecorder:
    """A ``torch.compile`` backend recording what Inductor would schedule on an H100 per graph."""

    class _Stop(Exception):
        pass

    active = None  # the recorder whose probe is running (the scheduler hook is installed once)

    def __init__(self):
        self.kernels: list[Kernel] = []
        self._graph = 0
        self._backward = False
        _install_hooks()

    def backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs, inner_compile=self._inner)

    def _inner(self, gm, example_inputs, **kwargs):
        import torch._inductor.config as inductor_config
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        self._graph += 1
        self._backward = bool(kwargs.get("is_backward", False))
        mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fake = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")
                    if isinstance(x, torch.Tensor) else x for x in example_inputs]
            cuda_gm = make_fx(_on_cuda(gm))(*fake)
        TrafficRecorder.active = self
        try:  # one scheduler pass per graph (no partitions), never served from a cache
            with pretend_h100(), inductor_config.patch(graph_partition=False, fx_graph_cache=False):
                compile_fx_inner(cuda_gm, fake, is_backward=kwargs.get("is_backward", False),
                                 is_inference=kwargs.get("is_inference", False))
        except Exception as exc:  # the scheduler stops every compile; anything else is a real failure
            if not _stopped(exc):
                raise
        finally:
            TrafficRecorder.active = None
        return make_boxed_func(gm.forward)  # run the graph uncompiled on the CPU

    def summary(self, tokens: int) -> dict:
        """Fused-kernel bytes of the recorded forward and backward graphs."""
        return {"forward_bytes": sum(k.bytes for k in self.kernels if k.fused and not k.backward),
                "backward_bytes": sum(k.bytes for k in self.kernels if k.fused and k.backward),
                "looped_reduction_bytes": sum(k.bytes for k in self.kernels if k.fused and k.reduction == "looped"),
                "fused_kernels": sum(k.fused for k in self.kernels), "graphs": len({k.graph for k in self.kernels}),
                "tokens": tokens, "kernels": [dataclasses.asdict(k) for k in self.kernels]}


_HOOKED = False


def _install_hooks() -> None:
    """Once per process: the scheduler records (and stops) while a recorder's probe runs; the pattern
    tables are built on the CPU."""
    global _HOOKED
    if _HOOKED:
        return
    from torch._inductor import scheduler
    original = scheduler.Scheduler._codegen

    def codegen(sched, nodes):
        recorder = TrafficRecorder.active
        if recorder is None:
            return original(sched, nodes)
        for node in nodes:
            ops = sorted({str(getattr(origin.target, "__name__", origin.target))
                          for sub in node.get_nodes() for origin in getattr(getattr(sub, "node", None), "origins", ())
                          if origin.op == "call_function"})
            fused = not (node.is_extern() or node.is_template())
            recorder.kernels.append(Kernel(recorder._graph, recorder._backward, fused,
                                           node.get_read_write_buffers_sizes(), ",".join(ops),
                                           _reduction_kind(sched, node) if fused else ""))
        raise TrafficRecorder._Stop

    scheduler.Scheduler._codegen = codegen
    _cpu_pattern_tables()
    _HOOKED = True


def _reduction_kind(sched, node) -> str:
    """How Inductor would code a fused reduction node for the device: "persistent" or "looped"
    (``should_use_persistent_reduction`` on the node's schedule, before tiling scores and split
    reductions refine it), "" for a pointwise kernel."""
    from torch._inductor.codegen.simd_kernel_features import SIMDKernelFeatures
    from torch._inductor.virtualized import V

    if not node.is_reduction():
        return ""
    nodes = node.get_nodes()
    _, (numel, rnumel) = max(nodes, key=lambda n: int(n.is_reduction())).group
    backend = sched.get_backend(node.get_device())
    backend = getattr(backend, "_triton_scheduling", backend)  # CUDA's combined scheduling: its Triton part
    features = SIMDKernelFeatures(backend.generate_node_schedule(nodes, numel, rnumel), numel, rnumel)
    return "persistent" if V.choices.should_use_persistent_reduction(features, cooperative_reduction=False) \
        else "looped"


def _stopped(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, TrafficRecorder._Stop):
            return True
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return False


def _on_cuda(gm):
    """A copy of ``gm`` whose device arguments and tensor constants say CUDA (fake, under the caller's
    fake mode)."""
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for node in gm.graph.nodes:
        if node.kwargs.get("device") == cpu:
            node.kwargs = {**node.kwargs, "device": cuda}
        node.args = tuple(cuda if isinstance(a, torch.device) and a == cpu else a for a in node.args)
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                setattr(gm, node.target, torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                                             device="cuda"))
    gm.recompile()
    return gm


def layer_traffic(which: str, preset_name: str, batch: int, size: int) -> dict:
    """Fused-kernel bytes of one layer's forward and backward: ``which`` is ``ours`` (aten linears),
    ``ours_megatron_linears``, ``ours_fp8_<recipe>`` (torchao's float8 linears) or ``diffusers``."""
    from train_step import build_pair, make_steps

    from dit_mcore.models.dit import build_model

    torch.compiler.reset()
    torch.manual_seed(0)
    ours, theirs = build_pair(preset_name, torch.device("cpu"), torch.bfloat16)
    variant = {"aten_linears": True} if which == "ours" else {}  # the opt-in aten linears; else megatron's
    if fp8_recipe(which):
        variant = {"float8_recipe": fp8_recipe(which)}
    if variant:
        other = build_model(dataclasses.replace(ours.config, **variant))
        other.load_state_dict(ours.state_dict())
        ours = other.to(torch.bfloat16).train()
    del ours.layers[1:]
    theirs.transformer_blocks = theirs.transformer_blocks[:1]
    recorder = TrafficRecorder()
    if which == "diffusers":
        theirs.transformer_blocks[0].compile(backend=recorder.backend, dynamic=False)
    else:
        from dit_mcore.models.layer_stack import quiet_default_tp_group
        quiet_default_tp_group()  # what compile_layers does first (a warning would break the graph)
        ours.layers[0].compile(backend=recorder.backend, dynamic=False)
    cfg = ours.config
    x0 = torch.randn(batch, cfg.in_channels, size, size, dtype=torch.bfloat16)
    t = torch.linspace(10.0, 900.0, batch)
    y = torch.arange(batch) % cfg.num_classes
    ours_step, theirs_step = make_steps(ours, theirs, x0, t, y)
    (theirs_step if which == "diffusers" else ours_step)()
    summary = recorder.summary(batch * (size // cfg.patch_size) ** 2)
    if summary["graphs"] != 2:  # a dense layer compiles whole: a graph break would split (and hide) fusions
        raise RuntimeError(f"{which}: expected one forward and one backward graph per layer, got {summary['graphs']}")
    return summary


def packed_traffic(which: str, family: str, preset_name: str, packed_len: int) -> dict:
    """The same for a one-layer model of ``family``/``preset_name`` trained one step through the trainer
    on one packed sequence of ``packed_len`` mock tokens (video-like samples, text for text families):
    the layer's graphs between the attention calls that run outside them (packed patterns)."""
    import tempfile

    import throughput

    from dit_mcore.training.trainer import Trainer

    torch.compiler.reset()
    torch.manual_seed(0)
    recorder = TrafficRecorder()
    point = {"family": family, "preset": preset_name, "image_size": 32, "packed_len": packed_len, "batch": 1,
             "recompute": "none", "compile": True, "dtype": "bf16", "aten_linears": which != "ours_megatron_linears",
             "fp8": fp8_recipe(which)}
    original = torch.nn.Module.compile
    torch.nn.Module.compile = lambda module, **kw: original(module, backend=recorder.backend, dynamic=False)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            config = throughput.run_config(point, run_dir)
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=1))
            Trainer(config).train_step()
    finally:
        torch.nn.Module.compile = original
    summary = recorder.summary(packed_len)
    if not summary["backward_bytes"] or not summary["forward_bytes"]:
        raise RuntimeError(f"{which}: no forward or backward graph was scheduled (did the layer compile?)")
    return summary


def main(argv=None) -> dict:
    import torch._inductor.config as inductor_config
    from results_io import RESULTS, write_result
    from throughput import compile_option_sets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="dit", help="with --packed-lens: the model family (dit, dit_xattn, llama, stdit)")
    p.add_argument("--preset", default="DiT-XL/2")
    p.add_argument("--packed-lens", default="", help="two packed lengths (e.g. 1024,2048): one layer trained "
                   "through the trainer on packed mock data instead of the dense pair against diffusers")
    p.add_argument("--size", type=int, default=32, help="latent side (32 = 256px images)")
    p.add_argument("--batches", default="2,4", help="two batch sizes; the per-token figure is their difference")
    p.add_argument("--models", default="ours,ours_megatron_linears,diffusers",
                   help="any of " + ",".join(MODELS))
    p.add_argument("--compile-options", default="none", help="Inductor options to schedule under, as "
                   "model.compile_options takes them (throughput.py's syntax), e.g. triton.multi_kernel=1")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    packed = bool(args.packed_lens)
    small, large = (int(b) for b in (args.packed_lens or args.batches).split(","))
    models = [m for m in args.models.split(",") if not (packed and m == "diffusers")]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"--models: {','.join(unknown)} unknown; use any of {','.join(MODELS)}")
    options = compile_option_sets(args.compile_options)[0] or {}
    rows = {}
    for which in models:
        with inductor_config.patch(options):
            a, b = (packed_traffic(which, args.family, args.preset, n) if packed else
                    layer_traffic(which, args.preset, n, args.size) for n in (small, large))
        tokens = b["tokens"] - a["tokens"]
        per_token = {k: (b[k] - a[k]) / tokens for k in ("forward_bytes", "backward_bytes", "looped_reduction_bytes")}
        per_token["total_bytes"] = per_token["forward_bytes"] + per_token["backward_bytes"]
        rows[which] = {"bytes_per_token": per_token, "fused_kernels": b["fused_kernels"], "kernels": b["kernels"]}
        print(f"{which:24s} fused-kernel bytes/token/layer: forward {per_token['forward_bytes']:8.0f}  "
              f"backward {per_token['backward_bytes']:8.0f}  total {per_token['total_bytes']:8.0f}  "
              f"({b['fused_kernels']} fused kernels; looped reductions {per_token['looped_reduction_bytes']:8.0f})")
    ratios = {}
    if "ours" in rows and "diffusers" in rows:
        ratios["ours_over_diffusers"] = rows["ours"]["bytes_per_token"]["total_bytes"] / \
            rows["diffusers"]["bytes_per_token"]["total_bytes"]
    if "ours" in rows and "ours_megatron_linears" in rows:
        ratios["aten_over_megatron_linears"] = rows["ours"]["bytes_per_token"]["total_bytes"] / \
            rows["ours_megatron_linears"]["bytes_per_token"]["total_bytes"]
    for which in rows:
        if fp8_recipe(which) and "ours" in rows:  # the float8 casts' traffic over bf16's
            ratios[f"{which}_over_bf16"] = rows[which]["bytes_per_token"]["total_bytes"] / \
                rows["ours"]["bytes_per_token"]["total_bytes"]
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    result = {"device": "H100 (Inductor scheduling, no GPU)", "torch": torch.__version__,
              "command": "python benchmarks/fusion_traffic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "family": args.family, "preset": args.preset, "packed_lens" if packed else "batches": [small, large],
              "compile_options": options,
              "ratios": ratios, "models": rows}
    shape = (f"_packed{large}" if packed else "") + "".join(f"_{k}{v}" for k, v in options.items())
    recipes = [fp8_recipe(m) for m in models if fp8_recipe(m)]
    if recipes:  # FP8 layers: a file of their own, never the bf16 baseline's
        shape += "_fp8_" + "_".join(recipes)
    default = RESULTS / f"fusion_traffic_{args.preset.replace('/', '')}{shape}_torch{torch.__version__.split('+')[0]}.json"
    print("wrote", write_result("fusion_traffic", result, args.out or str(default)))
    return result


if __name__ == "__main__":
    main()
