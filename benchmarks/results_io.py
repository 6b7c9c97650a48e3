"""Where benchmark results go: one name per device, one default file per benchmark and device."""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    """The GPU's name (``NVIDIA H100 80GB HBM3``) or ``cpu-<arch>``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu-{platform.machine()}"


def result_path(benchmark: str, out: str | None = None, ext: str = "json") -> Path:
    """``out`` if given, else ``benchmarks/results/<benchmark>_<device>.<ext>`` (folder created)."""
    path = Path(out) if out else RESULTS / f"{benchmark}_{device_name().replace(' ', '_').replace('/', '_')}.{ext}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_result(benchmark: str, result: dict, out: str | None = None) -> Path:
    path = result_path(benchmark, out)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
