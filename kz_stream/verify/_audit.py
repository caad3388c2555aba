"""A suite audit: every problem of a KernelBench-format folder prepared as a verification
would prepare it, with admission's answer, the input sets used and dropped, the memory
plan, the oracle's memory and time, and the host memory it holds and reserves (``kz verify
audit-suite``). An audit of a whole suite outlasts a GPU slot, so it resumes: each row
names the problem's source digest and the verifier version it was made under, and a row
stands while both are unchanged (``still_to_audit``)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kz_stream.verify._timing import physical_floor_ms
from kz_stream.verify._types import VERIFIER_VERSION, Problem, source_sha256
from kz_stream.verify._verifier import Verifier

__all__ = ["ProblemAudit", "audit_suite", "still_to_audit", "suite_files"]


@dataclass
class ProblemAudit:
    """One problem's audit. ``admitted`` is None when admission was not asked for."""

    name: str
    source_sha256: str = ""  # of the problem file's text: a changed problem is audited again
    verifier_version: str = ""  # the verifier that made the row
    machine: str = ""  # the GPU's name, or "cpu": rows of a resumed audit may come from several
    admitted: bool | None = None
    reason: str | None = None
    detail: str = ""
    admission_s: float = 0.0
    # Where admission_s went: the waits for the device's room ("room", "alone"), the
    # sandboxed check's phases, and "sandbox" for the rest (the process's start, imports
    # and CUDA start-up, the answer's return).
    admission_phase_s: dict[str, float] = field(default_factory=dict)
    input_sets: list[str] = field(default_factory=list)
    dropped: list[dict[str, str]] = field(default_factory=list)
    memory_plan: list[str] = field(default_factory=list)
    too_few_sets: str = ""
    error: str | None = None
    oracle_peak_gb: float = 0.0
    input_gb: float = 0.0
    host_bytes: int = 0  # what its prepared sets hold on the host (inputs, outputs)
    reserved_bytes: int = 0  # what the host's memory budget held for it (0 on the CPU path)
    floor_ms: float = 0.0  # the physical floor: the bytes it must move and its FLOPs at peak
    prepare_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)  # where prepare_s went

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> ProblemAudit:
        """A row as ``to_dict`` wrote it; keys this version does not know are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in known})


def still_to_audit(
    files: list[Path], rows: Iterable[ProblemAudit], *, retry_errors: bool = False,
    redo: Collection[str] = (),
) -> tuple[list[Path], dict[str, ProblemAudit]]:
    """Splits a suite for a resumed audit into the files still to audit and the earlier
    rows that stand, by problem name. A row stands when its problem's source and the
    verifier version are the ones it was made with, (with ``retry_errors``) when the
    problem could be prepared, and when ``redo`` does not name it (a fix that changes
    what some rows say without a verifier version of its own)."""
    by_name = {r.name: r for r in rows}
    todo: list[Path] = []
    kept: dict[str, ProblemAudit] = {}
    for f in files:
        row = by_name.get(f.stem)
        if (row is not None and row.verifier_version == VERIFIER_VERSION
                and row.source_sha256 == source_sha256(f.read_text())
                and not (retry_errors and row.error) and f.stem not in redo):
            kept[f.stem] = row
        else:
            todo.append(f)
    return todo, kept


def suite_files(path: Path) -> list[Path]:
    """The problem files of a KernelBench-format folder, in problem-number order."""
    def number(p: Path) -> tuple[int, str]:
        m = re.match(r"(\d+)_", p.name)
        return (int(m.group(1)) if m else 1 << 30, p.name)

    return sorted((p for p in path.glob("*.py") if not p.name.startswith("_")), key=number)


async def audit_suite(
    files: list[Path], verifier: Verifier, *, admission: bool = True,
    admission_timeout_s: float = 600, jobs: int = 1,
    time_limit_s: float | None = None,
) -> AsyncIterator[ProblemAudit]:
    """Audits each file, ``jobs`` at a time, and yields each row as its problem is done
    (not in the files' order: a level-3 model that takes minutes to build would hold back
    the rows finished after it, and a slot cut short would lose them). The verifier
    prepares as many at once as it has oracles (``VerifierConfig.oracles``). With
    ``time_limit_s``, no problem starts after that many seconds: those begun finish, the
    rest are left for a resumed audit (no row)."""
    gate = asyncio.Semaphore(jobs)
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s

    async def one(f: Path) -> ProblemAudit | None:
        async with gate:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            return await _audit_one(f, verifier, admission=admission,
                                    admission_timeout_s=admission_timeout_s)

    tasks = [asyncio.ensure_future(one(f)) for f in files]
    try:
        for done in asyncio.as_completed(tasks):
            row = await done
            if row is not None:
                yield row
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _audit_one(f: Path, verifier: Verifier, *, admission: bool,
                     admission_timeout_s: float) -> ProblemAudit:
    source = await asyncio.to_thread(f.read_text)
    row = ProblemAudit(f.stem, source_sha256(source), VERIFIER_VERSION)
    problem = Problem(source, f.stem)
    if admission:
        t0 = time.monotonic()
        adm = await verifier.admission(problem, timeout_s=admission_timeout_s)
        row.admitted, row.reason, row.detail = adm.admitted, adm.reason, adm.detail[:300]
        row.admission_s = round(time.monotonic() - t0, 2)
        rest = max(0.0, row.admission_s - sum(adm.phase_s.values()))
        row.admission_phase_s = {**adm.phase_s, "sandbox": round(rest, 3)}
    info = await verifier.inspect_problem(problem)
    row.error = info.get("error")
    row.prepare_s = float(info.get("seconds", 0.0))
    row.input_sets = [s["label"] for s in info.get("input_sets", [])]
    row.dropped = list(info.get("dropped", []))
    row.memory_plan = list(info.get("memory_plan", []))
    row.too_few_sets = str(info.get("too_few_sets", ""))
    row.oracle_peak_gb = round(int(info.get("oracle_peak_bytes", 0)) / 2**30, 2)
    row.input_gb = round(int(info.get("input_bytes", 0)) / 2**30, 3)
    row.host_bytes = int(info.get("host_bytes", 0))
    row.reserved_bytes = int(info.get("reserved_bytes", 0))
    row.floor_ms = round(physical_floor_ms(int(info.get("moved_bytes", 0)),
                                           float(info.get("flops", 0))), 5)
    row.phase_s = dict(info.get("phase_s") or {})
    return row
