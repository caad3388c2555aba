"""Timing primitives shared by the reference (oracle) and candidate processes, and the
statistics the verifier draws from them.

Each timed call: flush L2 (zero a buffer twice its size), synchronise the device, record a
start event, call, record an end event, synchronise the device (so work on any stream is
waited for), and read both the event time and the host time around it. Inputs rotate
through enough fresh sets that they do not fit in L2 together. The two processes are timed
in alternating rounds on the same GPU, so clock and thermal drift hit both alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Captured at import, before any untrusted code runs in the process: a candidate that
# rebinds torch.cuda.Event or time.perf_counter does not reach these.
_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_synchronize = torch.cuda.synchronize

# Measured on this workplace's H200s (device-to-device copy counting reads and writes;
# a bf16 8192^3 matrix product on random data).
H200_BANDWIDTH = 4.3e12  # bytes/s
H200_PEAK_FLOPS = 790e12  # FLOP/s


@dataclass(frozen=True)
class Samples:
    """Per-call times of one timing round, in milliseconds."""

    event_ms: list[float]
    host_ms: list[float]


class L2Flusher:
    """Zeroes a buffer twice the size of L2 before each timed call."""

    def __init__(self, device: torch.device) -> None:
        props = torch.cuda.get_device_properties(device)
        l2 = int(getattr(props, "L2_cache_size", 0) or 50 << 20)
        self.l2_bytes = l2
        self.buf = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def timing_set_count(input_bytes: int, l2_bytes: int, *, cap_bytes: int = 4 << 30) -> int:
    """How many input sets to rotate through so that together they exceed 3x L2."""
    if input_bytes <= 0:
        return 2
    n = math.ceil(3 * l2_bytes / input_bytes)
    n = min(n, max(2, cap_bytes // input_bytes))
    return int(min(max(n, 2), 32))


def timed_calls(
    fn: Callable[[Sequence[Any]], Any], input_sets: Sequence[Sequence[Any]], n: int,
    flush: Callable[[], None], *, start: int = 0, keep: Collection[int] = (),
) -> tuple[Samples, dict[int, Any]]:
    """Times ``n`` calls of ``fn`` rotating through ``input_sets``; returns the samples and
    the outputs of the calls whose index (counted from ``start``) is in ``keep``."""
    ev_ms: list[float] = []
    host_ms: list[float] = []
    kept: dict[int, Any] = {}
    for j in range(start, start + n):
        args = input_sets[j % len(input_sets)]
        flush()
        _synchronize()
        s = _Event(enable_timing=True)  # type: ignore[no-untyped-call]
        e = _Event(enable_timing=True)  # type: ignore[no-untyped-call]
        t0 = _perf_counter()
        s.record()
        out = fn(args)
        e.record()
        _synchronize()
        t1 = _perf_counter()
        ev_ms.append(float(s.elapsed_time(e)))
        host_ms.append((t1 - t0) * 1e3)
        if j in keep:
            kept[j] = out
        del out
    return Samples(ev_ms, host_ms), kept


def bootstrap_ratio_ci(
    ref: Sequence[float], cand: Sequence[float], *, iters: int = 2000, seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """(median(ref)/median(cand), lower, upper): the speedup and its bootstrap interval."""
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    point = float(np.median(r) / np.median(c))
    rng = np.random.default_rng(seed)
    rb = np.median(r[rng.integers(0, len(r), (iters, len(r)))], axis=1)
    cb = np.median(c[rng.integers(0, len(c), (iters, len(c)))], axis=1)
    ratios = rb / cb
    lo, hi = np.quantile(ratios, [(1 - level) / 2, 1 - (1 - level) / 2])
    return point, float(lo), float(hi)


def physical_floor_ms(nbytes: int, flops: float) -> float:
    """The least time the H200 could take to move ``nbytes`` and do ``flops``."""
    return max(nbytes / H200_BANDWIDTH, flops / H200_PEAK_FLOPS) * 1e3
