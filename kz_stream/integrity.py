"""Whether a run's history is whole: replayed from the store, every way an event of a run
can have been lost or applied twice, per slot of a run that was stopped and resumed.

``check_slots(events)`` takes one run's events (``load_events``) and tells its slots apart
by the gaps between them (no event for ``gap_s`` seconds: within a slot the loop records an
event every few seconds; between slots the run is stopped, its store perhaps off the
host). What counts as lost or applied twice:

- a kernel generated twice (one id, two ``KernelGenerated``), or given two verdicts by one
  verifier version;
- a kernel with no verdict that was generated before the last slot began (the slots after
  it should have verified it: a resumed run re-sends the work it finds unfinished), unless
  the last slot re-sent it (``WorkRedelivered``) and stopped before judging it; those, and
  the last slot's own, are in flight when the run stopped, and counted apart;
- training steps not numbered 1, 2, ... once each (the schedule numbers both roles' steps
  in one sequence), a role's policy version published twice or skipped, a step whose
  version was never published;
- a verdict of a kernel the run never generated (its generation lost);
- a kernel, group or proposed module trained on by two steps (a Coder module may be
  trained on through several groups: one per backend, or made again after a restart).

Slots are told apart by time alone, so a session resumed within ``gap_s`` of the last one
merges with it (then a kernel it lost counts as in flight), and a quiet spell longer than
``gap_s`` inside the last slot splits it: pick ``gap_s`` between the two.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kz_stream.events import Event
from kz_stream.store import open_store

__all__ = ["check_slots", "load_events"]

_TYPES = ["ModuleProposed", "KernelGenerated", "KernelVerified", "TrainingStepCompleted",
          "PolicyVersionPublished"]


def _slot_of(times: Sequence[float], gap_s: float) -> list[tuple[float, float]]:
    """(start, end) of each run of events with no gap longer than ``gap_s``."""
    slots: list[tuple[float, float]] = []
    for t in sorted(times):
        if slots and t - slots[-1][1] <= gap_s:
            slots[-1] = (slots[-1][0], t)
        else:
            slots.append((t, t))
    return slots


def _repeated(values: Sequence[Any]) -> list[Any]:
    return sorted(v for v, n in Counter(values).items() if n > 1)


def _gaps(numbers: Sequence[int]) -> list[int]:
    """The numbers missing from 1..max(numbers)."""
    have = set(numbers)
    return [n for n in range(1, max(have, default=0) + 1) if n not in have]


def check_slots(events: Sequence[Event], gap_s: float = 90.0) -> dict[str, Any]:
    """What each slot of one run did and every way an event was lost or applied twice
    (module docstring); ``ok`` when there is none."""
    times = [e.occurred_at.timestamp() for e in events]
    slots = _slot_of(times, gap_s)

    def slot(t: float) -> int:
        return next(i for i, (a, b) in enumerate(slots) if a <= t <= b)

    generated: dict[str, int] = {}  # kernel id -> slot
    generated_ids: list[str] = []
    verdict_keys: list[tuple[str, str]] = []
    verified_in: dict[str, list[int]] = {}
    redelivered_in: dict[str, int] = {}  # kernel id -> the last slot that published it again
    steps: dict[str, list[dict[str, Any]]] = {"coder": [], "proposer": []}
    published: dict[str, list[int]] = {"coder": [], "proposer": []}
    per_slot = [Counter[str]() for _ in slots]
    for e, t in zip(events, times, strict=True):
        s, p = slot(t), e.payload
        per_slot[s]["events"] += 1
        if e.type == "KernelGenerated":
            generated_ids.append(p["kernel_id"])
            generated.setdefault(p["kernel_id"], s)
            per_slot[s]["kernels"] += 1
        elif e.type == "KernelVerified":
            verdict_keys.append((p["kernel_id"], p.get("verifier_version", "")))
            verified_in.setdefault(p["kernel_id"], []).append(s)
            per_slot[s]["verdicts"] += 1
            if generated.get(p["kernel_id"], s) < s:
                per_slot[s]["verdicts_of_earlier_slots"] += 1
        elif e.type == "TrainingStepCompleted":
            steps[p["role"]].append(p)
            per_slot[s][f"{p['role']}_steps"] += 1
        elif e.type == "PolicyVersionPublished":
            published[p["role"]].append(int(p["version"]))
        elif e.type == "ModuleProposed":
            per_slot[s]["proposals"] += 1
        elif e.type == "WorkRedelivered":
            redelivered_in.update((k, s) for k in p["kernel_ids"])
            per_slot[s]["kernels_redelivered"] += len(p["kernel_ids"])
    last = len(slots) - 1
    unverified = [k for k in generated if k not in verified_in]
    # An earlier slot's kernel that the last slot published again is in its verifier's
    # queue, or was being judged, when the run stopped: a backlog can outlast a slot.
    lost = sorted(k for k in unverified
                  if generated[k] < last and redelivered_in.get(k) != last)
    roles: dict[str, dict[str, Any]] = {}
    trained_twice: dict[str, list[str]] = {}
    numbers = [int(r["step"]) for rs in steps.values() for r in rs]
    schedule = {"steps": len(numbers), "steps_missing": _gaps(numbers),
                "steps_repeated": _repeated(numbers)}
    for role, rs in steps.items():
        versions = published[role]
        roles[role] = {
            "steps": len(rs),
            "versions_published": len(versions),
            "versions_missing": _gaps(versions),
            "versions_repeated": _repeated(versions),
            "steps_of_unpublished_versions": sorted(
                int(r["step"]) for r in rs if int(r["policy_version"]) not in versions),
        }
        # A Coder module may be trained on in two steps through two groups (one per
        # backend, or generated again after a restart); a proposed module is one sample.
        whats = ("kernel_ids", "group_ids") if role == "coder" else ("module_ids", "group_ids")
        for what in whats:
            trained_twice[f"{role}_{what}"] = _repeated([x for r in rs for x in r[what]])
    report: dict[str, Any] = {
        "slots": [{"start": a, "end": b, "seconds": round(b - a, 1), **per_slot[i]}
                  for i, (a, b) in enumerate(slots)],
        "kernels": len(generated),
        "verdicts": len(verdict_keys),
        "generated_twice": _repeated(generated_ids),
        "verified_twice": [list(k) for k in _repeated(verdict_keys)],
        "lost": lost,
        "verdicts_of_unknown_kernels": sorted(set(verified_in) - set(generated)),
        "in_flight_at_end": len(unverified) - len(lost),
        "schedule": schedule,
        "roles": roles,
        "trained_twice": trained_twice,
    }
    report["ok"] = not (report["generated_twice"] or report["verified_twice"] or lost
                        or report["verdicts_of_unknown_kernels"]
                        or schedule["steps_missing"] or schedule["steps_repeated"]
                        or any(v for r in roles.values() for k, v in r.items()
                               if k not in ("steps", "versions_published"))
                        or any(trained_twice.values()))
    return report


async def load_events(url: str, run_id: str | None) -> tuple[str, list[Event]]:
    """The run's events (``run_id``, or the store's one run when None)."""
    async with open_store(url, create_schema=False) as store:
        if run_id is None:
            runs = set()
            async for batch in store.read_all(0, types=["TrainingStepCompleted",
                                                        "KernelGenerated"],
                                              payload_fields=[]):  # run ids alone
                runs |= {r.event.correlation_id for r in batch if r.event.correlation_id}
            if len(runs) != 1:
                raise LookupError(f"the store holds {len(runs)} runs ({sorted(runs)}): "
                                  "name the one to check")
            run_id = runs.pop()
        events: list[Event] = []
        async for batch in store.read_all(0, types=_TYPES, correlation_id=run_id):
            events += [r.event for r in batch]
    return run_id, events
