"""``kz dataset export``: Hugging Face datasets (parquet and a dataset card) replayed from
the event store.

- ``sft``: per module and backend, the best correct kernel (highest measured speedup; the
  earliest among equals, unmeasured speedups last) with the module, the Coder's prompt
  and the kernel's speedup: supervised fine-tuning pairs.
- ``verdicts``: one row per verdict, with its kernel, verifier version and the policy
  version that wrote the kernel (a kernel verified again under a new verifier version has
  one row per version).

The export reads the store up to its end when it starts, in batches, and writes nothing
to it, so it runs beside a live system. Evaluation runs (``eval-`` correlation ids) are
left out unless ``runs`` names them or ``include_evaluation`` is set: a training set must
not hold the evaluation problems.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from kz_stream.app import redact_url
from kz_stream.events import is_evaluation
from kz_stream.projections import current_payload
from kz_stream.store import EventStore

__all__ = ["KernelFilter", "collect_rows", "write_dataset", "write_export"]

DatasetName = Literal["sft", "verdicts"]


@dataclass(frozen=True)
class KernelFilter:
    """Which kernels go into an export (empty collections: all)."""

    runs: Collection[str] = ()  # correlation ids of the kernels
    statuses: Collection[str] = ()  # verdict statuses (the verdicts set; sft is correct ones)
    verifier_versions: Collection[str] = ()
    include_evaluation: bool = False
    since: datetime | None = None  # kernels generated at or after this time
    until: datetime | None = None  # ... and before this one

    def keeps_kernel(self, run_id: str | None, generated_at: datetime) -> bool:
        if (self.since and generated_at < self.since) or (
            self.until and generated_at >= self.until
        ):
            return False
        if self.runs:
            return run_id in self.runs
        return self.include_evaluation or not is_evaluation(run_id)

    def keeps_version(self, verdict: dict[str, Any]) -> bool:
        versions = self.verifier_versions
        return not versions or verdict.get("verifier_version") in versions

    def keeps_status(self, verdict: dict[str, Any]) -> bool:
        return not self.statuses or verdict["status"] in self.statuses


@dataclass
class _Replay:
    modules: dict[str, str] = field(default_factory=dict)  # module id -> source
    kernels: dict[str, dict[str, Any]] = field(default_factory=dict)  # kernel id -> row part
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    best: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    position: int = 0


def _better(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    if old is None:
        return True
    def key(row: dict[str, Any]) -> float:
        return row["speedup"] if row["speedup"] is not None else float("-inf")
    return key(new) > key(old)


async def collect_rows(
    store: EventStore, flt: KernelFilter, *, on_batch: Callable[[int, int], object] | None = None
) -> tuple[dict[DatasetName, list[dict[str, Any]]], int]:
    """Replays the store to the end it had when called; returns the rows of each set and
    the last position read. ``on_batch(position, end)`` follows the replay."""
    end = await store.last_position()
    r = _Replay()
    types = ["ModuleProposed", "KernelGenerated", "KernelVerified"]
    async for batch in store.read_all(0, types=types):
        for rec in batch:
            if rec.global_position > end:
                break  # committed after the export started: the next export has it
            r.position = rec.global_position
            _apply(r, rec.event, rec.recorded_at.isoformat(), flt)
        if on_batch is not None:
            on_batch(r.position, end)
    return {"sft": [r.best[k] for k in sorted(r.best)], "verdicts": r.verdicts}, r.position


def _apply(r: _Replay, event: Any, recorded_at: str, flt: KernelFilter) -> None:
    p = current_payload(event)
    if event.type == "ModuleProposed":
        r.modules.setdefault(p["module_id"], p["source"])
        return
    if event.type == "KernelGenerated":
        if flt.keeps_kernel(event.correlation_id, event.occurred_at):
            r.kernels[p["kernel_id"]] = {
                "kernel_id": p["kernel_id"],
                "module_id": p["module_id"],
                "group_id": p["group_id"],
                "run_id": event.correlation_id or "",
                "backend": p["backend"],
                "policy_version": p.get("policy_version", 0),
                "prompt": p.get("prompt", ""),
                "source": p["source"],
                "generated_at": event.occurred_at.isoformat(),
            }
        return
    kernel = r.kernels.get(p["kernel_id"])
    if kernel is None or not flt.keeps_version(p):
        return
    ci = p.get("speedup_ci") or (None, None)
    verdict = {
        **kernel,
        "status": p["status"],
        "check": p.get("check"),
        "reason": p.get("reason"),
        "max_rel_error": p.get("max_rel_error"),
        "speedup": p.get("speedup"),
        "speedup_ci_low": ci[0],
        "speedup_ci_high": ci[1],
        "verifier_version": p.get("verifier_version", ""),
        "verified_at": recorded_at,
    }
    if flt.keeps_status(p):
        r.verdicts.append(verdict)
    if p["status"] == "correct":
        key = (kernel["module_id"], kernel["backend"])
        row = {
            "module_id": kernel["module_id"],
            "backend": kernel["backend"],
            "module_source": r.modules.get(kernel["module_id"], ""),
            "prompt": kernel["prompt"],
            "kernel": kernel["source"],
            "speedup": verdict["speedup"],
            "kernel_id": kernel["kernel_id"],
            "run_id": kernel["run_id"],
            "policy_version": kernel["policy_version"],
            "verifier_version": verdict["verifier_version"],
        }
        if _better(row, r.best.get(key)):
            r.best[key] = row


_CARD = """\
---
configs:
{configs}
---

# kz_stream export

Replayed from the event store `{store}` up to global position {position}.

Filters: runs {runs}; statuses {statuses}; verifier versions {versions}; kernels
generated {window}; evaluation runs {evaluation}.

{sections}
"""

_ABOUT: dict[DatasetName, str] = {
    "sft": "Per module and backend, the best correct kernel (highest measured speedup) with "
    "the module's source and the Coder's prompt (a JSON chat). Columns: module_id, backend, "
    "module_source, prompt, kernel, speedup, kernel_id, run_id, policy_version, "
    "verifier_version.",
    "verdicts": "One row per verdict: the kernel (id, module, group, run, backend, policy "
    "version, prompt, source) and the verdict (status, check, reason, max_rel_error, "
    "speedup and its 95% interval, verifier_version, verified_at).",
}


# Column types, so an empty set still has its columns and a column of Nones its type.
_COLUMNS: dict[DatasetName, dict[str, str]] = {
    "sft": {
        "module_id": "string", "backend": "string", "module_source": "string",
        "prompt": "string", "kernel": "string", "speedup": "float64", "kernel_id": "string",
        "run_id": "string", "policy_version": "int64", "verifier_version": "string",
    },
    "verdicts": {
        "kernel_id": "string", "module_id": "string", "group_id": "string",
        "run_id": "string", "backend": "string", "policy_version": "int64",
        "prompt": "string", "source": "string", "generated_at": "string",
        "status": "string", "check": "string", "reason": "string",
        "max_rel_error": "float64", "speedup": "float64", "speedup_ci_low": "float64",
        "speedup_ci_high": "float64", "verifier_version": "string", "verified_at": "string",
    },
}  # fmt: skip


def write_dataset(name: DatasetName, rows: Sequence[dict[str, Any]], path: Path) -> int:
    """Writes one set's rows as a parquet file through ``datasets``; returns the count."""
    from datasets import Dataset, Features, Value

    features = Features({col: Value(kind) for col, kind in _COLUMNS[name].items()})
    columns = {col: [row[col] for row in rows] for col in features}
    Dataset.from_dict(columns, features=features).to_parquet(str(path))
    return len(rows)


def write_export(
    rows: dict[DatasetName, list[dict[str, Any]]],
    out: Path,
    names: Sequence[DatasetName],
    *,
    flt: KernelFilter,
    store_url: str,
    position: int,
) -> dict[str, int]:
    """Writes ``<name>.parquet`` per set and a dataset card (``README.md``) into ``out``;
    returns the row count per set."""
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {
        name: write_dataset(name, rows[name], out / f"{name}.parquet") for name in names
    }
    card = _CARD.format(
        configs="\n".join(f"- config_name: {n}\n  data_files: {n}.parquet" for n in names),
        store=redact_url(store_url),
        position=position,
        runs=", ".join(sorted(flt.runs)) or "all",
        statuses=", ".join(sorted(flt.statuses)) or "all",
        versions=", ".join(sorted(flt.verifier_versions)) or "all",
        window=f"from {flt.since or 'the start'} until {flt.until or 'the export'}",
        evaluation="included" if flt.include_evaluation or flt.runs else "left out",
        sections="\n\n".join(f"## {n} ({counts[n]} rows)\n\n{_ABOUT[n]}" for n in names),
    )
    (out / "README.md").write_text(card)
    return counts
