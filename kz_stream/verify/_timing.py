"""Timing primitives shared by the reference (oracle) and candidate processes, and the
statistics the verifier draws from them.

Each timed call: flush L2 (write one buffer twice its size, then read another), synchronise
the device, queue a short GPU spin (the pad), record a start event, call, record an end
event, synchronise the device (so work on any stream is waited for), and read the event
time, the host time around it and the host time it took to issue the call. The pad keeps the
GPU busy while the host issues the call, so the event time is the call's device time and not
the host's launch overhead (tens of microseconds per call here, and different between
processes: without the pad the A/A p90 was 6-24%; benchmarks/bench_timing.py). Both sides
get the pad sized on the reference, so a candidate that works on the host for longer than
the reference takes to issue its call leaves the GPU idle inside its own timed region, and
pays for it. Inputs rotate through enough fresh sets that they do not fit in L2 together,
and outputs through as many blocks. The two processes are timed in alternating rounds on the
same GPU, so clock and thermal drift hit both alike.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
import torch

from kz_stream.verify._compare import flatten
from kz_stream.verify._messages import FlushMode

# Captured at import, before any untrusted code runs in the process: a candidate that
# rebinds torch.cuda.Event or time.perf_counter does not reach these.
_perf_counter = time.perf_counter
# (Event and _sleep are untyped in torch: typed Any here rather than ignored at each call.)
_Event: Any = torch.cuda.Event
_synchronize = torch.cuda.synchronize
_sleep: Any = torch.cuda._sleep

# Measured on this workplace's H200s (device-to-device copy counting reads and writes;
# a bf16 8192^3 matrix product on random data).
H200_BANDWIDTH = 4.3e12  # bytes/s
H200_PEAK_FLOPS = 790e12  # FLOP/s


@dataclass(frozen=True)
class Samples:
    """Per-call times of one timing round, in milliseconds: device time between the
    events, host time with a device-wide sync (less the pad), host time to issue."""

    event_ms: list[float]
    host_ms: list[float]
    issue_ms: list[float]


def check_flush(mode: str, factor: int) -> None:
    """Raises ValueError unless ``mode`` is a FlushMode and ``factor`` at least 1."""
    if mode not in get_args(FlushMode):
        raise ValueError(f"unknown L2 flush {mode!r}; choose one of {get_args(FlushMode)}")
    if factor < 1:
        raise ValueError(f"the L2 flush buffer must be at least L2's size (factor {factor})")


class L2Flusher:
    """Evicts L2 before each timed call by streaming a buffer ``factor`` times its size
    through it.

    ``read`` sums the buffer and leaves L2 full of clean lines; ``zero`` writes it (as
    Triton's ``do_bench`` does) and leaves dirty lines whose write-back can land in the
    timed call; ``zero_read`` (the verifier's) writes one buffer, then sums another: L2
    ends clean, and times no longer depend on where a process's buffers lie
    (docs/verifier.md, "Timing").
    """

    def __init__(self, device: torch.device, mode: FlushMode = "zero_read", factor: int = 2
                 ) -> None:
        check_flush(mode, factor)
        props = torch.cuda.get_device_properties(device)
        l2 = int(getattr(props, "L2_cache_size", 0) or 50 << 20)
        self.l2_bytes = l2
        self.mode = mode
        self.buf = torch.zeros(factor * l2 // 4, dtype=torch.int32, device=device)
        self.read_buf = torch.zeros_like(self.buf) if mode == "zero_read" else self.buf
        self.sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        if self.mode != "read":
            self.buf.zero_()
        if self.mode != "zero":
            torch.sum(self.read_buf, dim=0, dtype=torch.int64, out=self.sink)


def spin_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured now."""
    s = _Event(enable_timing=True)
    e = _Event(enable_timing=True)
    _sleep(100_000)  # wakes the clocks up
    s.record()
    _sleep(2_000_000)
    e.record()
    _synchronize()
    return 2_000_000 / max(float(s.elapsed_time(e)), 1e-3)


def pad_for(fn: Callable[[], Any]) -> tuple[int, float]:
    """The GPU spin (cycles, ms) that covers the host's issuing of ``fn``: twice its
    longest issue time over three calls, between 0.05 and 5 ms."""
    issue = 0.0
    for _ in range(3):
        _synchronize()
        t0 = _perf_counter()
        fn()
        issue = max(issue, (_perf_counter() - t0) * 1e3)
        _synchronize()
    pad_ms = min(max(2.0 * issue, 0.05), 5.0)
    return int(pad_ms * spin_cycles_per_ms()), pad_ms


def timing_set_count(input_bytes: int, l2_bytes: int, *, cap_bytes: int = 4 << 30) -> int:
    """How many input sets to rotate through so that together they exceed 3x L2."""
    if input_bytes <= 0:
        return 2
    n = math.ceil(3 * l2_bytes / input_bytes)
    n = min(n, max(2, cap_bytes // input_bytes))
    return int(min(max(n, 2), 32))


# At most this many bytes of earlier outputs are held to rotate output blocks: both sides
# hold them, and a big problem's timing must not run out of memory for it.
_ROTATED_OUTPUT_BYTES = 1 << 30


def _held_bytes(out: Any) -> int:
    """The device memory an output keeps alive: its tensors' storages, each once (a view
    keeps its whole base)."""
    storages = {}
    for t in flatten(out):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return int(sum(storages.values()))


def timed_calls(
    fn: Callable[[Sequence[Any]], Any], input_sets: Sequence[Sequence[Any]], n: int,
    flush: Callable[[], None], *, start: int = 0, keep: Collection[int] = (),
    pad_cycles: int = 0, rotate_outputs: bool = True,
    refresh: Callable[[int], None] | None = None,
    stash: Callable[[Any], Any] | None = None,
) -> tuple[Samples, dict[int, Any]]:
    """Times ``n`` calls of ``fn`` rotating through ``input_sets``; returns the samples and
    the outputs of the calls whose index (counted from ``start``) is in ``keep``.
    ``pad_cycles`` of GPU spin precede each start event (0: none).

    With ``rotate_outputs``, the outputs of the last ``len(input_sets)`` calls (up to 1 GiB)
    are held, so the caching allocator gives each call a different output block, as each
    call reads a different input set: one fixed block would be one fixed placement in
    memory per process, and placement moved times by 2-4% under a reading-only flush
    (benchmarks/bench_timing.py). An output past that 1 GiB is not held (it is far bigger
    than L2; holding it ran a 6 GiB ReLU's worker out of its allowance on an H100).

    ``stash``, when given, is applied to a kept output right after its call, untimed (to
    move a big one off the device).

    ``refresh(j)``, when given, runs before call ``j``'s flush and untimed: it gives the
    call's inputs fresh values (``inputs.redraw_``), so no timed call sees an input an
    earlier call saw."""
    ev_ms: list[float] = []
    host_ms: list[float] = []
    issue_ms: list[float] = []
    kept: dict[int, Any] = {}
    recent: deque[Any] | None = None
    for j in range(start, start + n):
        args = input_sets[j % len(input_sets)]
        if refresh is not None:
            refresh(j)
        flush()
        _synchronize()
        p = _Event(enable_timing=True)
        s = _Event(enable_timing=True)
        e = _Event(enable_timing=True)
        t0 = _perf_counter()
        p.record()
        if pad_cycles:
            _sleep(pad_cycles)
        s.record()
        out = fn(args)
        t_issued = _perf_counter()
        e.record()
        _synchronize()
        t1 = _perf_counter()
        ev_ms.append(float(s.elapsed_time(e)))
        host_ms.append((t1 - t0) * 1e3 - float(p.elapsed_time(s)))
        issue_ms.append((t_issued - t0) * 1e3)
        if j in keep:
            kept[j] = out if stash is None else stash(out)
        if rotate_outputs:
            if recent is None:
                held = min(len(input_sets), _ROTATED_OUTPUT_BYTES // max(_held_bytes(out), 1))
                recent = deque(maxlen=held)
            recent.append(out)
        del out
    return Samples(ev_ms, host_ms, issue_ms), kept


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
