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
                                         "moe_split_sizes", "uneven_collectives", "fsdp_mesh"}
    assert cpu_shims.apply_cpu_shims() == []  # idempotent


def test_device_queries_point_at_cpu():
    assert torch.cuda.current_device() == "cpu"
    buf = torch.empty(3, device=torch.cuda.current_device())
    assert buf.device.type == "cpu"
    torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA enabled"


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
