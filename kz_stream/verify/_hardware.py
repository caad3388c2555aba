"""The hardware and software manifest stamped on every verdict."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from typing import Any


def _gpus() -> list[dict[str, str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2],
                         "compute_capability": parts[3]})
    return gpus


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def manifest() -> dict[str, Any]:
    """GPU(s), driver, CUDA, torch, Triton, nvcc, Python and CPU of this machine."""
    import torch

    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = None
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                              timeout=30).stdout.strip().splitlines()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        nvcc = None
    gpus = _gpus()
    return {
        "gpu": gpus[0]["name"] if gpus else None,
        "gpu_count": len(gpus),
        "driver": gpus[0]["driver"] if gpus else None,
        "compute_capability": gpus[0]["compute_capability"] if gpus else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "nvcc": nvcc,
        "python": platform.python_version(),
        "cpu": _cpu(),
        "cpu_count": os.cpu_count(),
    }
