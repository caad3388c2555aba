"""``kz dataset export``: Hugging Face datasets (parquet and a dataset card) replayed from
the event store.

- ``sft``: per module and backend, the best correct kernel by its newest decided verdict
  (of those the newest verifier version judged, the highest measured speedup; the earliest
  among equals, unmeasured speedups last) with the module,
  the Coder's prompt and the kernel's speedup: supervised fine-tuning pairs.
- ``verdicts``: one row per verdict, with its kernel, verifier version and the policy
  version that wrote the kernel (a kernel verified again under a new verifier version has
  one row per version).
- ``rl``: per valid module with judged kernels, the Coder's record on it (kernels,
  correct, pass rate, median speedup) and per API of its set the capability map's
  statistics (``kz frontier``'s), as the learner sees them (``RunState``, newest verdict
  per kernel): prompts for training at the frontier.

The export reads the store up to its end when it starts, in batches, and writes nothing
to it, so it runs beside a live system. ``export_datasets`` writes the verdict rows to
parquet a chunk at a time as they come; ``sft`` and ``rl`` are reductions kept per module.
Payloads are read as plain dicts (no pydantic), and only the keys the sets use.
Evaluation runs (``eval-`` correlation ids) are left out unless ``runs`` names them or
``include_evaluation`` is set: a training set must not hold the evaluation problems.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kz_stream.database_url import redact as redact_url
from kz_stream.events import UNDECIDED_STATUSES, current_payload, is_evaluation
from kz_stream.run_state import ApiStats
from kz_stream.store import EventStore

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "CHUNK_ROWS",
    "DATASETS",
    "DatasetName",
    "KernelFilter",
    "collect_rows",
    "export_datasets",
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


_TYPES = ("ModuleProposed", "KernelGenerated", "KernelVerified")
# Rows per parquet row group and per batch of verdict rows held before writing.
CHUNK_ROWS = 1000
_FETCHES = 8  # kernel streams read at once to fill texts back in

_Row = dict[str, Any]


def _payload_fields(sets: Collection[DatasetName]) -> list[str]:
    """The payload keys the ``sets`` read: the store may drop the rest (completions with
    their token ids, verdict details) before sending them."""
    fields = {"module_id", "kernel_id", "group_id", "backend", "policy_version", "status",
              "speedup", "verifier_version", "source", "normalized_hash"}
    if "rl" in sets:
        fields |= {"api_set", "validation"}
    if "sft" in sets or "verdicts" in sets:
        fields |= {"prompt"}
    if "verdicts" in sets:
        fields |= {"check", "reason", "max_rel_error", "speedup_ci"}
    return sorted(fields)


@dataclass(slots=True)
class _Kernel:
    """What the export keeps of a kernel: its row fields, and its texts (prompt, source)
    only until its first verdict; later verdicts read them back from its stream."""

    row: _Row  # kernel_id, module_id, group_id, run_id, backend, policy_version, generated_at
    stream_id: str
    position: int  # of its KernelGenerated
    texts: tuple[str, str] | None


@dataclass(slots=True)
class _Candidate:
    """A kernel whose newest verdict is correct: what ranks it for ``sft``."""

    speed: float  # the speedup, -inf when unmeasured
    seq: int  # when its newest verdict came (ties go to the earliest)
    speedup: float | None
    verifier_version: str
    kernel: _Kernel

    def rank(self) -> tuple[tuple[int, ...], float, int]:
        """What ``sft`` takes the highest of: the newest verifier version first (a speedup
        an older verifier measured is not comparable: a memoising matmul was correct at
        7.6x under kzv-1.1, 0.63x after), then the speedup, then the earliest."""
        return _version_order(self.verifier_version), self.speed, -self.seq


def _version_order(version: str) -> tuple[int, ...]:
    """``kzv-1.4`` as (1, 4): its numbers in order; a missing version sorts first."""
    return tuple(int(n) for n in re.findall(r"\d+", version))


@dataclass(slots=True)
class _RlModule:
    valid: bool
    api_set: list[str]
    source: str


@dataclass
class _Replay:
    """The state a replay keeps: per kernel a light record, per module its source, per
    module and backend the ``sft`` candidates; never a whole set's rows."""

    flt: KernelFilter
    sets: Collection[DatasetName]
    modules: dict[str, str] = field(default_factory=dict)  # module id -> source
    kernels: dict[str, _Kernel] = field(default_factory=dict)
    verdicts: list[_Row] = field(default_factory=list)  # the chunk not yet handed on
    # sft: (module id, backend) -> kernel id -> candidate; and the texts of the best one
    # seen as it came, which is mostly the final best (else its texts are read back).
    candidates: dict[tuple[str, str], dict[str, _Candidate]] = field(default_factory=dict)
    best: dict[tuple[str, str], tuple[str, str, str]] = field(default_factory=dict)
    seq: int = 0
    # rl, the learner's view (``RunState``): first proposal and generation win, evaluation
    # events never count; kernel id -> (module id, newest verdict status, speedup).
    rl_modules: dict[str, _RlModule] = field(default_factory=dict)
    rl_kernels: dict[str, tuple[str, str | None, float | None]] = field(default_factory=dict)
    # Verdicts stored before their kernels (``RunState.early_verdicts``): (event,
    # position, recorded at) per kernel id, applied when the kernel comes and is kept.
    early: dict[str, list[tuple[Any, int, str]]] = field(default_factory=dict)
    # Every kernel id generated so far, kept or not: a verdict on one the filter left out
    # is not early, and holding it would grow with every other run's verdicts.
    generated: set[str] = field(default_factory=set)
    # Decontamination: the normalized hashes of the store's evaluation problems, and of
    # each training module; ``sft`` and ``rl`` leave out a training module whose hash is
    # an evaluation problem's, whichever came first (a Proposer started before the
    # evaluation was stored, or without ``decontaminate``, let such modules through).
    evaluation_hashes: set[str] = field(default_factory=set)
    module_hashes: dict[str, str] = field(default_factory=dict)
    position: int = 0

    def contaminated(self, module_id: str) -> bool:
        return self.module_hashes.get(module_id, "") in self.evaluation_hashes

    def apply(self, event: Any, position: int, recorded_at: str) -> None:
        p = current_payload(event)
        if event.type == "ModuleProposed":
            if digest := p.get("normalized_hash"):
                if is_evaluation(event.correlation_id):
                    self.evaluation_hashes.add(digest)
                else:
                    self.module_hashes.setdefault(p["module_id"], digest)
            if "sft" in self.sets:
                self.modules.setdefault(p["module_id"], p["source"])
            if "rl" in self.sets and not is_evaluation(event.correlation_id):
                if p["module_id"] not in self.rl_modules:  # kernels are filtered, modules not
                    self.rl_modules[p["module_id"]] = _RlModule(
                        p["validation"]["valid"], sorted(p["api_set"]), p["source"])
            return
        if event.type == "KernelGenerated":
            self.generated.add(p["kernel_id"])
            early = self.early.pop(p["kernel_id"], [])
            if self.flt.keeps_kernel(event.correlation_id, event.occurred_at):
                self._kernel(event, p, position)
                for verdict in early:
                    self.apply(*verdict)
            return
        kernel = self.kernels.get(p["kernel_id"])
        if kernel is None:
            if p["kernel_id"] not in self.generated:
                self.early.setdefault(p["kernel_id"], []).append((event, position, recorded_at))
            return
        texts, kernel.texts = kernel.texts, None  # any verdict ends the wait for the first
        if not self.flt.keeps_version(p):
            return
        if "rl" in self.sets and not is_evaluation(event.correlation_id):
            rl = self.rl_kernels.get(p["kernel_id"])
            if rl is not None:  # the newest verdict wins (re-scoring)
                self.rl_kernels[p["kernel_id"]] = (rl[0], p["status"], p.get("speedup"))
        if "sft" in self.sets:
            self._candidate(kernel, p, texts)
        if "verdicts" in self.sets and self.flt.keeps_status(p):
            ci = p.get("speedup_ci") or (None, None)
            prompt, source = texts if texts is not None else (None, None)
            self.verdicts.append({
                **kernel.row,
                "prompt": prompt,  # None: read back before the chunk is handed on
                "source": source,
                "status": p["status"],
                "check": p.get("check"),
                "reason": p.get("reason"),
                "max_rel_error": p.get("max_rel_error"),
                "speedup": p.get("speedup"),
                "speedup_ci_low": ci[0],
                "speedup_ci_high": ci[1],
                "verifier_version": p.get("verifier_version", ""),
                "verified_at": recorded_at,
            })

    def _kernel(self, event: Any, p: _Row, position: int) -> None:
        keep_texts = "sft" in self.sets or "verdicts" in self.sets
        self.kernels[p["kernel_id"]] = _Kernel(
            {
                "kernel_id": p["kernel_id"],
                "module_id": p["module_id"],
                "group_id": p["group_id"],
                "run_id": event.correlation_id or "",
                "backend": p["backend"],
                "policy_version": p.get("policy_version", 0),
                "generated_at": event.occurred_at.isoformat(),
            },
            event.stream_id,
            position,
            (p.get("prompt", ""), p["source"]) if keep_texts else None,
        )
        if "rl" in self.sets and not is_evaluation(event.correlation_id):
            self.rl_kernels.setdefault(p["kernel_id"], (p["module_id"], None, None))

    def _candidate(self, kernel: _Kernel, p: _Row, texts: tuple[str, str] | None) -> None:
        """Ranks a kernel by its newest decided verdict: correct ones are candidates. An
        undecided verdict (the verifier's own failure, a check it could not run there)
        changes nothing: it says nothing of the kernel."""
        if p["status"] in UNDECIDED_STATUSES:
            return
        key = (kernel.row["module_id"], kernel.row["backend"])
        mine = self.candidates.setdefault(key, {})
        kid = kernel.row["kernel_id"]
        mine.pop(kid, None)
        if p["status"] != "correct":
            return
        self.seq += 1
        speedup = p.get("speedup")
        cand = mine[kid] = _Candidate(-math.inf if speedup is None else speedup, self.seq,
                                      speedup, p.get("verifier_version", ""), kernel)
        held = self.best.get(key)
        rival = mine.get(held[0]) if held is not None else None
        if texts is not None and (rival is None or cand.rank() > rival.rank()):
            self.best[key] = (kid, *texts)


async def _read_texts(store: EventStore, kernels: Collection[_Kernel]) -> None:
    """Reads the prompt and source of ``kernels`` back from their streams (the texts were
    dropped at their first verdict), a few streams at a time."""
    gate = asyncio.Semaphore(_FETCHES)

    async def one(k: _Kernel) -> None:
        async with gate:
            records = await store.read_stream(k.stream_id)
        for rec in records:
            if rec.global_position == k.position:
                p = current_payload(rec.event)
                k.texts = (p.get("prompt", ""), p["source"])
                return
        raise LookupError(f"{k.stream_id}: its KernelGenerated at {k.position} is gone")

    await asyncio.gather(*(one(k) for k in kernels))


async def _hand_on(
    store: EventStore, r: _Replay, on_verdicts: Callable[[list[_Row]], object]
) -> None:
    """Fills the texts of the held verdict rows that lack them, then hands the rows on."""
    rows, r.verdicts = r.verdicts, []
    missing = {row["kernel_id"]: r.kernels[row["kernel_id"]] for row in rows
               if row["source"] is None}
    if missing:
        await _read_texts(store, list(missing.values()))
        for row in rows:
            if row["source"] is None:
                row["prompt"], row["source"] = missing[row["kernel_id"]].texts or ("", "")
        for k in missing.values():
            k.texts = None
    on_verdicts(rows)


async def _sft_rows(store: EventStore, r: _Replay) -> list[_Row]:
    """Per module and backend, the correct kernel (by its newest decided verdict) with the
    highest measured speedup among those the newest verifier version judged
    (``_Candidate.rank``); the earliest among equals, unmeasured speedups last."""
    winners: dict[tuple[str, str], _Candidate] = {}
    for key in sorted(r.candidates):
        if r.candidates[key] and not r.contaminated(key[0]):
            winners[key] = max(r.candidates[key].values(), key=_Candidate.rank)
    texts: dict[tuple[str, str], tuple[str, str]] = {}
    unread = []
    for key, c in winners.items():
        held = r.best.get(key)
        if held is not None and held[0] == c.kernel.row["kernel_id"]:
            texts[key] = held[1:]
        else:
            unread.append(c.kernel)
    await _read_texts(store, unread)
    rows = []
    for key, c in winners.items():
        prompt, source = texts.get(key) or c.kernel.texts or ("", "")
        rows.append({
            "module_id": key[0],
            "backend": key[1],
            "module_source": r.modules.get(key[0], ""),
            "prompt": prompt,
            "kernel": source,
            "speedup": c.speedup,
            "kernel_id": c.kernel.row["kernel_id"],
            "run_id": c.kernel.row["run_id"],
            "policy_version": c.kernel.row["policy_version"],
            "verifier_version": c.verifier_version,
        })
    return rows


def _rl_rows(r: _Replay) -> list[_Row]:
    """Per valid module with judged kernels: the Coder's record on it and its APIs'
    capability statistics (``run_state.CapabilityMap``'s, from the light records)."""
    mine: dict[str, ApiStats] = {}
    apis: dict[str, ApiStats] = {}
    for module_id, status, speedup in r.rl_kernels.values():
        module = r.rl_modules.get(module_id)
        if module is None or status is None or status in UNDECIDED_STATUSES:
            continue
        correct = status == "correct"
        mine.setdefault(module_id, ApiStats()).add(correct, speedup, 1)
        for api in module.api_set:
            apis.setdefault(api, ApiStats()).add(correct, speedup, 1)
    rows = []
    for module_id in sorted(r.rl_modules):
        m, own = r.rl_modules[module_id], mine.get(module_id)
        if not m.valid or own is None or r.contaminated(module_id):
            continue
        stats = [apis.get(api) for api in m.api_set]
        rows.append({
            "module_id": module_id,
            "source": m.source,
            "api_set": list(m.api_set),
            "kernels": own.n,
            "correct": own.correct,
            "pass_rate": own.pass_rate,
            "median_speedup": own.median_speedup,
            "api_kernels": [st.n if st else 0 for st in stats],
            "api_pass_rates": [st.pass_rate if st else None for st in stats],
            "api_median_speedups": [st.median_speedup if st else None for st in stats],
        })
    return rows


async def _replay_sets(
    store: EventStore,
    flt: KernelFilter,
    on_verdicts: Callable[[list[_Row]], object],
    *,
    sets: Collection[DatasetName] = DATASETS,
    chunk_rows: int = CHUNK_ROWS,
    on_batch: Callable[[int, int], object] | None = None,
) -> tuple[list[_Row], list[_Row], int, int]:
    """Replays the store to the end it had when called, handing the ``verdicts`` rows to
    ``on_verdicts`` in chunks of ``chunk_rows`` as they come; returns the ``sft`` and
    ``rl`` rows (one per module: the reductions), the last position read and the count of
    training modules left out as evaluation problems.
    ``on_batch(position, end)`` follows it."""
    end = await store.last_position()
    r = _Replay(flt, sets)
    async for batch in store.read_all(0, types=_TYPES, payload_fields=_payload_fields(sets)):
        for rec in batch:
            if rec.global_position > end:
                break  # committed after the export started: the next export has it
            r.position = rec.global_position
            r.apply(rec.event, rec.global_position, rec.recorded_at.isoformat())
            if len(r.verdicts) >= chunk_rows:
                await _hand_on(store, r, on_verdicts)
        if on_batch is not None:
            on_batch(r.position, end)
        if batch and batch[-1].global_position >= end:
            break
    if r.verdicts:
        await _hand_on(store, r, on_verdicts)
    sft = await _sft_rows(store, r) if "sft" in sets else []
    left_out = sum(map(r.contaminated, r.module_hashes))
    return sft, _rl_rows(r) if "rl" in sets else [], r.position, left_out


async def collect_rows(
    store: EventStore,
    flt: KernelFilter,
    *,
    sets: Collection[DatasetName] = DATASETS,
    on_batch: Callable[[int, int], object] | None = None,
) -> tuple[dict[DatasetName, list[dict[str, Any]]], int]:
    """Replays the store to the end it had when called; returns the rows of the ``sets``
    (others empty), all in memory, and the last position read. ``on_batch(position,
    end)`` follows it. ``export_datasets`` writes them without holding them."""
    verdicts: list[_Row] = []
    sft, rl, position, _ = await _replay_sets(store, flt, verdicts.extend, sets=sets,
                                              on_batch=on_batch)
    return {"sft": sft, "verdicts": verdicts, "rl": rl}, position


_CARD = """\
---
configs:
{configs}
---

# kz_stream export

Replayed from the event store `{store}` up to global position {position}.

Filters: runs {runs}; statuses {statuses}; verifier versions {versions}; kernels
generated {window}; evaluation runs {evaluation}.{decontamination}

{sections}
"""

_ABOUT: dict[DatasetName, str] = {
    "sft": "Per module and backend, the best correct kernel (of those the newest verifier "
    "version judged, the highest measured speedup) with "
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


def _schema(name: DatasetName) -> pa.Schema:
    """The set's arrow schema, with the ``datasets`` features in its metadata (what
    ``Dataset.to_parquet`` writes), so ``datasets`` reads the types back."""
    from datasets import Features, List, Value

    def feature(kind: str) -> Any:
        return List(Value(kind[len("list:"):])) if kind.startswith("list:") else Value(kind)

    return Features({col: feature(kind) for col, kind in _COLUMNS[name].items()}).arrow_schema


class _SetWriter:
    """One set's parquet file, written a chunk (a row group) at a time under a temporary
    name and renamed when closed, so an export cut short leaves no half file."""

    def __init__(self, name: DatasetName, path: Path) -> None:
        import pyarrow.parquet as pq

        self.path, self._partial = path, path.with_name(path.name + ".partial")
        self.schema = _schema(name)
        self._writer = pq.ParquetWriter(self._partial, self.schema)
        self.rows = 0

    def write(self, rows: Sequence[_Row]) -> None:
        import pyarrow as pa

        if rows:
            self._writer.write_table(pa.Table.from_pylist(list(rows), schema=self.schema))
            self.rows += len(rows)

    def close(self) -> int:
        self._writer.close()
        self._partial.replace(self.path)
        return self.rows

    def abort(self) -> None:
        self._writer.close()
        self._partial.unlink(missing_ok=True)


def write_dataset(
    name: DatasetName, rows: Sequence[dict[str, Any]], path: Path, *, chunk_rows: int = CHUNK_ROWS
) -> int:
    """Writes one set's rows as a parquet file that ``datasets`` loads; returns the count."""
    writer = _SetWriter(name, path)
    for i in range(0, len(rows), chunk_rows):
        writer.write(rows[i : i + chunk_rows])
    return writer.close()


def write_export(
    rows: dict[DatasetName, list[dict[str, Any]]],
    out: Path,
    names: Sequence[DatasetName],
    *,
    flt: KernelFilter,
    store_url: str,
    position: int,
) -> dict[str, int]:
    """Writes rows gathered in memory (``collect_rows``) as ``<name>.parquet`` per set and
    a dataset card (``README.md``) into ``out``; returns the row count per set."""
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {
        name: write_dataset(name, rows[name], out / f"{name}.parquet") for name in names
    }
    _write_card(out, names, counts, flt=flt, store_url=store_url, position=position)
    return counts


async def export_datasets(
    store: EventStore,
    out: Path,
    names: Sequence[DatasetName],
    *,
    flt: KernelFilter,
    store_url: str,
    chunk_rows: int = CHUNK_ROWS,
    on_batch: Callable[[int, int], object] | None = None,
) -> tuple[dict[str, int], int]:
    """Replays the store into ``<name>.parquet`` per set and a dataset card in ``out``,
    writing the ``verdicts`` rows ``chunk_rows`` at a time as they come, so memory holds
    a chunk and the per-module reductions, not the history. Returns the row count per
    set and the last store position read."""
    verdicts = _open_verdicts(out, names)
    try:
        sft, rl, position, left_out = await _replay_sets(
            store, flt, verdicts.write if verdicts else lambda rows: None, sets=names,
            chunk_rows=chunk_rows, on_batch=on_batch)
    except BaseException:
        if verdicts is not None:
            verdicts.abort()
        raise
    made = {"sft": sft, "rl": rl}
    counts: dict[str, int] = {}
    for name in names:
        if name == "verdicts" and verdicts is not None:
            counts[name] = verdicts.close()
        else:
            counts[name] = write_dataset(name, made[name], out / f"{name}.parquet",
                                         chunk_rows=chunk_rows)
    _write_card(out, names, counts, flt=flt, store_url=store_url, position=position,
                contaminated=left_out)
    return counts, position


def _open_verdicts(out: Path, names: Sequence[DatasetName]) -> _SetWriter | None:
    """Makes ``out``; the verdict set's writer when it is asked for."""
    out.mkdir(parents=True, exist_ok=True)
    return _SetWriter("verdicts", out / "verdicts.parquet") if "verdicts" in names else None


def _write_card(
    out: Path,
    names: Sequence[DatasetName],
    counts: dict[str, int],
    *,
    flt: KernelFilter,
    store_url: str,
    position: int,
    contaminated: int | None = None,
) -> None:
    """The dataset card: its ``configs`` make ``load_dataset(out, name)`` work."""
    card = _CARD.format(
        configs="\n".join(f"- config_name: {n}\n  data_files: {n}.parquet" for n in names),
        store=redact_url(store_url),
        position=position,
        runs=", ".join(sorted(flt.runs)) or "all",
        statuses=", ".join(sorted(flt.statuses)) or "all",
        versions=", ".join(sorted(flt.verifier_versions)) or "all",
        window=f"from {flt.since or 'the start'} until {flt.until or 'the export'}",
        evaluation=("included" if flt.include_evaluation and not flt.runs
                    else "included where named" if any(map(is_evaluation, flt.runs))
                    else "left out"),
        decontamination="" if contaminated is None else (
            f" Left out of `sft` and `rl`: {contaminated} training module(s) whose "
            "normalized source is an evaluation problem's in this store."),
        sections="\n\n".join(f"## {n} ({counts[n]} rows)\n\n{_ABOUT[n]}" for n in names),
    )
    (out / "README.md").write_text(card)
