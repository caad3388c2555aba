"""How fast an evaluation ran: kernels per active minute, and how long each stage was at work.

The stages overlap (generations and verifications run concurrently), so each stage's time
is the union of the intervals in which at least one of its calls was in flight, not a sum;
and the run's active time is the union of all of them, so the idle gap between a run cut
short and its resume does not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StageTimes", "Throughput", "throughput", "union_seconds"]


@dataclass(frozen=True)
class StageTimes:
    """One kernel's stage intervals, in POSIX seconds: when its generation call and its
    verification ended, and how long each took (None where the store does not say)."""

    generated_at: float | None = None
    generation_s: float | None = None
    verified_at: float | None = None
    verification_s: float | None = None
    # Inside the verification, in this order after the static scan: CUDA builds, the
    # preflight, the reference's facts (its sizes, read in a sandboxed child), the wait
    # for the host's memory, the preparation, the GPU stage.
    preparation_s: float | None = None
    build_s: float = 0.0
    preflight_s: float = 0.0
    host_wait_s: float = 0.0
    reference_facts_s: float = 0.0


@dataclass(frozen=True)
class Throughput:
    kernels: int  # verified problem x sample pairs
    active_s: float
    generation_s: float
    preparation_s: float
    verification_s: float  # the verifier at work, preparation and host waits included
    host_wait_s: float = 0.0  # verifications waiting for the host's memory

    @property
    def kernels_per_minute(self) -> float | None:
        return self.kernels / (self.active_s / 60) if self.active_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        minutes = {f"{k}_minutes": round(v / 60, 3) for k, v in (
            ("active", self.active_s), ("generation", self.generation_s),
            ("preparation", self.preparation_s), ("verification", self.verification_s),
            ("host_wait", self.host_wait_s))}
        rate = self.kernels_per_minute
        return {"kernels": self.kernels, **minutes,
                "kernels_per_minute": None if rate is None else round(rate, 3)}


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def throughput(kernels: Mapping[str, StageTimes]) -> Throughput:
    """The run's throughput from its kernels' stage times (only verified ones count)."""
    gen: list[tuple[float, float]] = []
    prep: list[tuple[float, float]] = []
    wait: list[tuple[float, float]] = []
    ver: list[tuple[float, float]] = []
    verified = 0
    for t in kernels.values():
        if t.generated_at is not None and t.generation_s is not None:
            gen.append((t.generated_at - t.generation_s, t.generated_at))
        if t.verified_at is None:
            continue
        verified += 1
        if t.verification_s is None:
            continue
        start = t.verified_at - t.verification_s
        ver.append((start, t.verified_at))
        waits_from = start + t.build_s + t.preflight_s + t.reference_facts_s
        if t.host_wait_s:
            wait.append((waits_from, min(waits_from + t.host_wait_s, t.verified_at)))
        if t.preparation_s:
            prepares_from = waits_from + t.host_wait_s
            prep.append((prepares_from, min(prepares_from + t.preparation_s, t.verified_at)))
    return Throughput(verified, union_seconds(gen + ver), union_seconds(gen),
                      union_seconds(prep), union_seconds(ver), union_seconds(wait))
