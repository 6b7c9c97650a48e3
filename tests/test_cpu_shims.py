"""Each megatron-core CPU shim fixes the failure it documents (see dit_mcore/parallel/cpu_shims.py)."""
import pytest
import torch

from dit_mcore.parallel import cpu_shims
from megatron_env import single_process_world

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims apply only without CUDA")


@pytest.fixture(scope="module", autouse=True)
def shims():
    single_process_world()  # applies the shims like every CPU run does
    assert cpu_shims.applied_shims() == {"device", "rng", "cuda_literals", "streams",
                                         "moe_split_sizes", "uneven_collectives", "fsdp_mesh",
                                         "megatron_fsdp", "hybrid_optimizer"}
    assert cpu_shims.apply_cpu_shims() == []  # idempotent


def test_device_queries_point_at_cpu():
    assert torch.cuda.current_device() == "cpu"
    buf = torch.empty(3, device=torch.cuda.current_device())
    assert buf.device.type == "cpu"
    torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA enabled"


def test_the_hybrid_optimizer_splits_the_parameters_as_on_a_device():
    """megatron's offload copies the first share of the parameters to host tensors and steps the rest in place
    (on a CPU, without the shim, it copies nothing and its step fails on a lookup); ``is_cuda`` and
    ``pin_memory`` are torch's again afterwards."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(4)]
    opt = HybridDeviceOptimizer(params, offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW,
                                gpu_optimizer_cls=torch.optim.AdamW, pin_cpu_grads=False, lr=0.1)
    assert list(opt.gpu_params_map_cpu_copy) == params[:2]
    assert all(c is not p and torch.equal(c, p) for p, c in opt.gpu_params_map_cpu_copy.items())
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # (the host copies' steps copied back)
    assert not params[0].is_cuda and "is_cuda" not in torch.Tensor.__dict__ and "pin_memory" not in torch.Tensor.__dict__


def test_cuda_literals_map_to_cpu_and_types_look_like_cuda():
    t = torch.zeros(2, device="cuda")
    assert t.device.type == "cpu"
    assert t.cuda() is t and t.to("cuda").device.type == "cpu"
    assert t.type() == "torch.cuda.FloatTensor"  # what megatron's optimizers assert on
    assert t.to(torch.float64).dtype == torch.float64  # other .to() calls are untouched


def test_rng_tracker_forks_a_separate_cpu_stream():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    tracker = get_cuda_rng_tracker()
    torch.manual_seed(5)
    expected_default = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork():
        forked = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)  # the default stream was not advanced
    assert not torch.equal(forked, expected_default)


def test_cuda_streams_are_inert_for_the_moe_dispatcher():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        stream.record_event().wait()


def test_moe_split_sizes_reach_all_to_all_as_numpy():
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher
    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(sizes, np.ndarray) and sizes.tolist() == [3, 1]


def test_fsdp_mesh_is_built_on_cpu():
    import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
    import torch.distributed as dist

    mesh = torch_fsdp.DeviceMesh.from_group(dist.group.WORLD, "cuda")  # what megatron asks for
    assert mesh.device_type == "cpu" and mesh.size() == dist.get_world_size()


def test_megatron_fsdp_runs_on_cpu():
    """Megatron-FSDP's adapter: its mesh on the CPU, its tensor-parallel RNG sync without CUDA's
    generator, its coalesced collectives run one by one (done when they return)."""
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as buffers
    import torch.distributed as dist

    mesh = adapter.DeviceMesh.from_group([dist.group.WORLD], "cuda", mesh=[0], mesh_dim_names=["dp_cp"])
    assert mesh.device_type == "cpu"
    assert torch.device(f"cuda:{torch.cuda.current_device()}").type == "cpu"  # its own device check
    state = adapter._get_rng_state_dict()
    adapter._load_rng_state_dict(state)
    out, shard = torch.zeros(3), torch.arange(3.0)
    with buffers._coalescing_manager(dist.group.WORLD, async_ops=True) as batch:
        handle = dist.all_gather_into_tensor(out, shard, async_op=True)
    assert torch.equal(out, shard) and handle.wait() and batch.wait()
    assert dist.all_gather_into_tensor.__name__ == "all_gather_into_tensor"  # restored on exit
