"""kernels.host_copy.to_device: host data reaches the device with an asynchronous copy (no host wait
on a GPU), values and dtypes as ``torch.tensor(...).to(device)`` gives them."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit_mcore.kernels.host_copy import to_device


class _Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.calls.append(dict(kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_host_data_is_copied_without_blocking_and_keeps_values_and_dtypes():
    with _Copies() as copies:  # "meta" stands in for a GPU: a real device change, no GPU needed
        a = to_device(torch.arange(5), "meta")
        b = to_device([0.5, 2.0], "meta")
        c = to_device([1, 2, 3], "meta", torch.int32)
    assert [x.device.type for x in (a, b, c)] == ["meta"] * 3
    assert (a.dtype, b.dtype, c.dtype) == (torch.int64, torch.float32, torch.int32)
    moves = [k for k in copies.calls if k.get("device") is not None]
    assert len(moves) == 3 and all(k.get("non_blocking") for k in moves)
    torch.testing.assert_close(to_device([1, 2, 3], "cpu", torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32))
    host = torch.arange(3)
    assert to_device(host, "cpu") is host  # same device: no copy
    with _Copies() as copies:  # a tensor already on a device moves as .to does (blocking)
        to_device(torch.zeros(2, device="meta"), "meta")
        to_device(torch.zeros(2, device="meta"), "meta", torch.int32)
    assert not any(k.get("non_blocking") for k in copies.calls)
