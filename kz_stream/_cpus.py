"""The CPU cores this process may run on."""

from __future__ import annotations

import os

__all__ = ["usable_cpus"]


def usable_cpus() -> int:
    """How many cores this process may run on: its affinity mask (``cpus`` in the settings
    pins a service to some cores; so do ``taskset`` and container limits), not every core
    of the host as ``os.cpu_count()`` says. Pools sized from it do not crowd a few cores
    with a host's worth of threads."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
