"""Where torch's Adam reads each parameter's ``step``: the fused (and capturable) kernel on the parameter's
device, in float32; the foreach and for-loop kernels on the host (a device ``step`` there costs two host reads
per parameter per step). One rule for the optimizer's own placement (``training.torch_optimizer.place_steps``)
and for the states FSDP's checkpoint view fills in (``parallel.fsdp``)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def step_device(group: dict, param: torch.Tensor) -> torch.device:
    """The device ``param``'s Adam ``step`` belongs on, in its param group ``group``."""
    if group.get("fused") or group.get("capturable"):
        return (param.to_local() if isinstance(param, DTensor) else param).device
    return torch.device("cpu")
