"""Every adaptation megatron-core 0.16.1 needs to run on CPU with gloo — and only here.

megatron-core assumes CUDA in a few places. :func:`apply_cpu_shims` patches exactly those, and is
called only when ``torch.cuda.is_available()`` is False; the GPU path never imports this module's
effects. Each shim says what breaks without it (see ``shared/notes/megatron-core-on-cpu.md``); each
is covered by ``tests/test_cpu_shims.py``.

- ``device``: ``torch.cuda.current_device()`` is used as a ``device=`` argument (SP gather buffers,
  DDP grad buffers, p2p receive buffers) and ``torch.cuda.synchronize()`` is called around
  collectives. Both assert without CUDA. -> ``"cpu"`` / no-op.
- ``rng``: the model-parallel RNG tracker stores CUDA generator states (``fork()`` runs in SP and
  recompute paths, ``model_parallel_cuda_manual_seed`` adds states). -> the same tracker over the
  CPU generator.
- ``cuda_literals``: the optimizer, grad clipping, schedules and fully-parallel checkpoint load
  create tensors with ``device="cuda"``, call ``.cuda()`` and assert ``param.grad.type() ==
  'torch.cuda.FloatTensor'``. -> a ``TorchFunctionMode`` mapping those to CPU (and reporting the
  ``torch.cuda.*`` type names the optimizer branches on); ~1 µs per op, irrelevant at CPU sizes.
- ``streams``: the MoE all-to-all dispatcher builds ``torch.cuda.Stream``/``Event`` objects at
  construction and enters ``torch.cuda.stream(...)``. -> inert stand-ins (CPU work is in order).
- ``moe_split_sizes``: the dispatcher turns its split-size tensors into numpy arrays only when they
  are on CUDA; CPU tensors reach ``all_to_all_single`` as tensors, which it rejects. -> numpy.
- ``uneven_collectives``: gloo has no all-gather / reduce-scatter with unequal sizes, which the MoE
  dispatcher uses under expert tensor parallelism. -> padded ``all_gather_into_tensor`` and
  all-reduce + slice (the same results, more bytes; CPU only).
- ``fsdp_mesh``: megatron's ``TorchFullyShardedDataParallel`` builds its FSDP2 mesh with
  ``DeviceMesh.from_group(group, "cuda")``, which fails without CUDA. -> the same mesh on ``"cpu"``.
- ``megatron_fsdp``: Megatron-FSDP's adapter builds its meshes on ``"cuda"``, builds
  ``torch.device(f"cuda:{current_device()}")`` (``cuda_literals`` maps it to the CPU) and, under
  tensor parallelism, broadcasts the CUDA RNG state; its gathers and reductions are batched in
  ``_coalescing_manager``, whose gloo path corrupted the heap about once in five runs (an abort in a
  later ``malloc``). -> CPU meshes, the RNG sync without CUDA's generator, collectives one by one. (gloo has no ``PREMUL_SUM``: :mod:`dit_mcore.parallel.megatron_fsdp` turns the fused
  gradient division off off-GPU.)
- ``hybrid_optimizer``: megatron's optimizer offload (``HybridDeviceOptimizer``) splits the parameters by
  ``param.is_cuda`` into device ones (the first ``offload_fraction`` of them copied to pinned host memory
  and stepped there) and host ones, which it does not expect: on a CPU every parameter is a host one,
  nothing is copied, and its step looks each up among the copies (``KeyError``). -> during the split the
  model's parameters report ``is_cuda`` (the device side) and ``pin_memory`` copies nothing, so the CPU runs
  the same split, copies and copy-backs as a GPU.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_applied: set[str] = set()


def _is_cuda(device) -> bool:
    return device is not None and "cuda" in str(device)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device literals to CPU; reports tensor types as ``torch.cuda.*``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and args and _is_cuda(args[0]):  # Megatron-FSDP's f"cuda:{current_device()}"
            return torch.device("cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _shim_device() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def _shim_rng() -> None:
    import megatron.core.tensor_parallel.random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)  # (torch.manual_seed also queues a CUDA seed with its traceback)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    mp_random.CudaRNGStatesTracker.add = add


_MODE: CudaToCpuMode | None = None


def _shim_cuda_literals() -> None:
    global _MODE
    _MODE = CudaToCpuMode()
    _MODE.__enter__()


class _InertEvent:
    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _InertStream(_InertEvent):
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _InertEvent()


def _shim_streams() -> None:
    stream = _InertStream()
    torch.cuda.Stream, torch.cuda.Event = _InertStream, _InertEvent
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


def _shim_moe_split_sizes() -> None:
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = to_host


def _shim_uneven_collectives() -> None:
    import megatron.core.tensor_parallel.mappings as mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest, rest = max(sizes), tuple(input_.shape[1:])
        padded = input_.new_zeros((longest, *rest))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((longest * group.size(), *rest))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(out.chunk(group.size()), sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.split([int(n) for n in input_split_sizes])[group.rank()].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


class _CpuDeviceMesh:
    """``DeviceMesh`` as megatron's FSDP wrappers use it, with the mesh on the CPU."""

    @staticmethod
    def from_group(group, device_type="cpu", *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh
        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def _shim_fsdp_mesh() -> None:
    import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
    torch_fsdp.DeviceMesh = _CpuDeviceMesh


def _shim_megatron_fsdp() -> None:
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as buffers
    adapter.DeviceMesh = _CpuDeviceMesh
    buffers._coalescing_manager = _one_by_one
    get_states, load_states = adapter._get_rng_state_dict, adapter._load_rng_state_dict
    adapter._get_rng_state_dict = lambda: {**_without_cuda_rng(get_states), "cuda_rng_state": None}
    adapter._load_rng_state_dict = lambda states: _without_cuda_rng(load_states, states)


class _Done:
    def wait(self, *args, **kwargs):
        return True


_SYNCHRONOUS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    """Megatron-FSDP's stand-in for ``_coalescing_manager``: each collective inside runs to the end
    when called (the handle it returns, and the one this yields, are already done)."""
    originals = {name: getattr(dist, name) for name in _SYNCHRONOUS}

    def synchronous(fn):
        def call(*args, async_op=False, **kwargs):
            fn(*args, **kwargs)
            return _Done()
        return call

    for name, fn in originals.items():
        setattr(dist, name, synchronous(fn))
    try:
        yield _Done()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _without_cuda_rng(fn, *args):
    """Call ``fn`` with torch.cuda's RNG state calls made no-ops (there is no CUDA generator)."""
    get, set_ = torch.cuda.get_rng_state, torch.cuda.set_rng_state
    torch.cuda.get_rng_state, torch.cuda.set_rng_state = (lambda *a, **k: None), (lambda *a, **k: None)
    try:
        return fn(*args)
    finally:
        torch.cuda.get_rng_state, torch.cuda.set_rng_state = get, set_


def _shim_hybrid_optimizer() -> None:
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    split = HybridDeviceOptimizer._get_sub_optimizer_param_groups
    base = torch._C.TensorBase.is_cuda

    def split_as_on_a_device(self, offload_fraction):
        params = {id(p) for group in self.param_groups for p in group["params"]}
        torch.Tensor.is_cuda = property(lambda t: id(t) in params or base.__get__(t))
        torch.Tensor.pin_memory = lambda t, *args, **kwargs: t
        try:
            return split(self, offload_fraction)
        finally:
            del torch.Tensor.is_cuda, torch.Tensor.pin_memory  # (TensorBase's again)

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = split_as_on_a_device


_SHIMS = {
    "device": _shim_device,
    "rng": _shim_rng,
    "cuda_literals": _shim_cuda_literals,
    "streams": _shim_streams,
    "moe_split_sizes": _shim_moe_split_sizes,
    "uneven_collectives": _shim_uneven_collectives,
    "fsdp_mesh": _shim_fsdp_mesh,
    "megatron_fsdp": _shim_megatron_fsdp,
    "hybrid_optimizer": _shim_hybrid_optimizer,
}


def apply_cpu_shims() -> list[str]:
    """Apply every shim once (idempotent). Returns the names applied by this call.

    Refuses on a CUDA machine: GPU runs must exercise megatron's real code paths.
    """
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for CPU-only runs; CUDA is available here")
    new = [name for name in _SHIMS if name not in _applied]
    for name in new:
        _SHIMS[name]()
        _applied.add(name)
    if new:
        log.info("megatron-core CPU shims applied: %s", ", ".join(new))
    return new


def applied_shims() -> frozenset[str]:
    return frozenset(_applied)
