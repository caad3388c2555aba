"""``kz dataset export``: Hugging Face datasets (parquet and a dataset card) replayed from
the event store.

- ``sft``: per module and backend, the best correct kernel by its newest verdict (highest
  measured speedup; the earliest among equals, unmeasured speedups last) with the module,
  the Coder's prompt and the kernel's speedup: supervised fine-tuning pairs.
- ``verdicts``: one row per verdict, with its kernel, verifier version and the policy
  version that wrote the kernel (a kernel verified again under a new verifier version has
  one row per version).
- ``rl``: per valid module with judged kernels, the Coder's record on it (kernels,
  correct, pass rate, median speedup) and per API of its set the capability map's
  statistics (``kz frontier``'s), as the learner sees them (``RunState``, newest verdict
  per kernel): prompts for training at the frontier.

The export reads the store up to its end when it starts, in batches, and writes nothing
to it, so it runs beside a live system. Evaluation runs (``eval-`` correlation ids) are
left out unless ``runs`` names them or ``include_evaluation`` is set: a training set must
not hold the evaluation problems.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from kz_stream.database_url import redact as redact_url
from kz_stream.events import current_payload, is_evaluation
from kz_stream.run_state import CapabilityMap, KernelRecord, RunState
from kz_stream.store import EventStore

__all__ = [
    "DATASETS",
    "DatasetName",
    "KernelFilter",
    "collect_rows",
    "write_dataset",
    "write_export",
]

DatasetName = Literal["sft", "verdicts", "rl"]
DATASETS: tuple[DatasetName, ...] = ("sft", "verdicts", "rl")


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
    newest: dict[str, dict[str, Any]] = field(default_factory=dict)  # kernel id -> verdict
    state: RunState | None = None  # the learner's view, for ``rl`` (its decoding is costly)
    position: int = 0


def _sft_rows(r: _Replay) -> list[dict[str, Any]]:
    """Per module and backend, the correct kernel (by its newest verdict) with the highest
    measured speedup; the earliest among equals, unmeasured speedups last."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for v in r.newest.values():  # in the order the kernels' newest verdicts were stored
        if v["status"] != "correct":
            continue
        key = (v["module_id"], v["backend"])
        speed = v["speedup"] if v["speedup"] is not None else float("-inf")
        old = best.get(key)
        if old is None or speed > (old["speedup"] if old["speedup"] is not None else -math.inf):
            best[key] = {
                "module_id": v["module_id"],
                "backend": v["backend"],
                "module_source": r.modules.get(v["module_id"], ""),
                "prompt": v["prompt"],
                "kernel": v["source"],
                "speedup": v["speedup"],
                "kernel_id": v["kernel_id"],
                "run_id": v["run_id"],
                "policy_version": v["policy_version"],
                "verifier_version": v["verifier_version"],
            }
    return [best[k] for k in sorted(best)]


async def collect_rows(
    store: EventStore,
    flt: KernelFilter,
    *,
    sets: Collection[DatasetName] = DATASETS,
    on_batch: Callable[[int, int], object] | None = None,
) -> tuple[dict[DatasetName, list[dict[str, Any]]], int]:
    """Replays the store to the end it had when called; returns the rows of the ``sets``
    (others empty) and the last position read. ``on_batch(position, end)`` follows it."""
    end = await store.last_position()
    r = _Replay(state=RunState() if "rl" in sets else None)
    types = ["ModuleProposed", "KernelGenerated", "KernelVerified"]
    async for batch in store.read_all(0, types=types):
        for rec in batch:
            if rec.global_position > end:
                break  # committed after the export started: the next export has it
            r.position = rec.global_position
            _apply(r, rec.event, rec.recorded_at.isoformat(), flt)
        if on_batch is not None:
            on_batch(r.position, end)
    rows: dict[DatasetName, list[dict[str, Any]]] = {
        "sft": _sft_rows(r) if "sft" in sets else [],
        "verdicts": r.verdicts if "verdicts" in sets else [],
        "rl": _rl_rows(r.state) if r.state is not None else [],
    }
    return rows, r.position


def _rl_rows(state: RunState) -> list[dict[str, Any]]:
    """Per valid module with judged kernels: the Coder's record on it and its APIs'
    capability statistics."""
    cmap = CapabilityMap.from_state(state)
    kernels: dict[str, list[KernelRecord]] = {}
    for k in state.kernels.values():
        if k.decided:
            kernels.setdefault(k.module_id, []).append(k)
    rows = []
    for m in sorted(state.modules.values(), key=lambda m: m.module_id):
        mine = kernels.get(m.module_id, [])
        if not m.valid or not mine:
            continue
        speeds = [k.verdict.speedup for k in mine
                  if k.correct and k.verdict is not None and k.verdict.speedup is not None]
        stats = [cmap.apis.get(api) for api in m.api_set]
        rows.append({
            "module_id": m.module_id,
            "source": m.event.source,
            "api_set": list(m.api_set),
            "kernels": len(mine),
            "correct": sum(k.correct for k in mine),
            "pass_rate": sum(k.correct for k in mine) / len(mine),
            "median_speedup": statistics.median(speeds) if speeds else None,
            "api_kernels": [st.n if st else 0 for st in stats],
            "api_pass_rates": [st.pass_rate if st else None for st in stats],
            "api_median_speedups": [st.median_speedup if st else None for st in stats],
        })
    return rows


def _apply(r: _Replay, event: Any, recorded_at: str, flt: KernelFilter) -> None:
    p = current_payload(event)
    if event.type == "ModuleProposed":
        r.modules.setdefault(p["module_id"], p["source"])
        if r.state is not None:  # a module is known whoever proposed it; kernels filtered
            r.state.apply(event)
        return
    if event.type == "KernelGenerated":
        if flt.keeps_kernel(event.correlation_id, event.occurred_at):
            if r.state is not None:
                r.state.apply(event)
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
    if r.state is not None:
        r.state.apply(event)
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
    r.newest.pop(p["kernel_id"], None)  # re-inserted: dict order is newest-verdict order
    r.newest[p["kernel_id"]] = verdict


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
    "rl": "Per valid module with judged kernels among those exported: source, api_set, "
    "the Coder's kernels, correct, pass_rate and median_speedup on it, and per API of its "
    "set (aligned lists) the capability map's kernels, pass rate and median speedup. "
    "Evaluation runs never count here (the learner's view of the store).",
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
    "rl": {
        "module_id": "string", "source": "string", "api_set": "list:string",
        "kernels": "int64", "correct": "int64", "pass_rate": "float64",
        "median_speedup": "float64", "api_kernels": "list:int64",
        "api_pass_rates": "list:float64", "api_median_speedups": "list:float64",
    },
}  # fmt: skip


def write_dataset(name: DatasetName, rows: Sequence[dict[str, Any]], path: Path) -> int:
    """Writes one set's rows as a parquet file through ``datasets``; returns the count."""
    from datasets import Dataset, Features, List, Value

    def feature(kind: str) -> Any:
        return List(Value(kind[len("list:"):])) if kind.startswith("list:") else Value(kind)

    features = Features({col: feature(kind) for col, kind in _COLUMNS[name].items()})
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
