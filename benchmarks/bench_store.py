"""Event store throughput on PostgreSQL (and SQLite, for information), each figure next to a
raw psycopg baseline measured in the same run.

- append: batched SqlEventStore.append at ~500 B and ~8 KB payloads vs plain binary COPY of
  the same rows into an equivalent table (``CREATE TABLE ... (LIKE events INCLUDING ALL)``);
- replay: rebuild of KernelsProjection from position 0, and plain read_all, vs a raw
  ``SELECT ... ORDER BY global_position`` through a server-side cursor;
- correlation filter: ``load_evaluation`` of one evaluation in a store that mostly holds
  another run's verdicts (``read_all(correlation_id=...)`` on its index) vs what it did
  before the filter: read every KernelGenerated/KernelVerified and keep the run's in Python.

Postgres: KZ_BENCH_POSTGRES_URL (a server where databases may be created), else a throwaway
local cluster (fsync off, as in the tests). Run: ``python -m benchmarks.bench_store``;
``--filter-only`` measures the correlation filter alone and keeps the other stored figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
from sqlalchemy.engine import make_url

from benchmarks._results import RESULTS, metric, write_result
from kz_stream.evaluation import load_evaluation
from kz_stream.events import (
    Completion,
    EvaluationProblem,
    EvaluationStarted,
    Event,
    KernelGenerated,
    KernelVerified,
    VerdictStatus,
    new_event,
)
from kz_stream.infra import LocalPostgres
from kz_stream.projections import KernelsProjection, rebuild
from kz_stream.store import SqlEventStore, upgrade
from kz_stream.store._schema import EVENT_COLUMNS
from kz_stream.store._sql import _COPY_TYPES

COPY_TYPES = list(_COPY_TYPES)  # the store's own COPY column types, for the raw baseline
SOURCE_LINE = "    y = torch.relu(x @ self.weight.t() + self.bias)  # fused later\n"


def make_history(n_events: int, payload_bytes: int, seed: int = 0) -> list[Event]:
    """KernelGenerated/KernelVerified pairs whose payloads are about ``payload_bytes`` each."""
    rng = random.Random(seed)
    events: list[Event] = []
    for i in range(n_events // 2):
        kid, module, group = f"kernel-{i}", f"module-{i // 64}", f"group-{i // 8}"
        # Per-token logprobs and ids take ~1/3 of a real sample; source and prompt the rest.
        n_tokens = max(1, payload_bytes // 60)
        text_len = max(0, payload_bytes - 280 - n_tokens * 16)
        source = (SOURCE_LINE * (text_len // len(SOURCE_LINE) + 1))[: text_len // 2]
        gen = KernelGenerated(
            kernel_id=kid, module_id=module, group_id=group, backend="triton", source=source,
            prompt=source[: text_len // 2], sampling={"temperature": 1.0, "top_p": 0.95},
            policy_version=i // 1000,
            completion=Completion(
                text="", token_ids=[rng.randrange(50_000) for _ in range(n_tokens)],
                logprobs=[round(-rng.random() * 3, 6) for _ in range(n_tokens)],
                finish_reason="stop",
            ),
        )
        ok = rng.random() < 0.6
        ver = KernelVerified(
            kernel_id=kid, module_id=module, group_id=group,
            status=VerdictStatus.CORRECT if ok else VerdictStatus.INCORRECT,
            max_rel_error=rng.random() * 1e-3, speedup=rng.uniform(0.2, 3.0) if ok else None,
            speedup_ci=(0.9, 1.1) if ok else None, verifier_version="bench-1",
            hardware={"gpu": "NVIDIA H200", "driver": "580.65", "cuda": "13.0", "torch": "2.11"},
            policy_version=i // 1000,
            details={"log": "x" * max(0, payload_bytes - 380)},
        )
        events.append(new_event(gen, stream_id=kid, stream_version=0, producer="coder@bench",
                                correlation_id="bench"))
        events.append(new_event(ver, stream_id=kid, stream_version=1, producer="verifier@bench",
                                correlation_id="bench", causation_id=events[-1].event_id))
    return events


def mean_payload_bytes(events: list[Event]) -> float:
    return sum(len(orjson.dumps(e.payload)) for e in events) / len(events)


def batches(events: list[Event], size: int) -> Iterator[list[Event]]:
    for i in range(0, len(events), size):
        yield events[i : i + size]


def row(e: Event) -> tuple[Any, ...]:
    return (e.event_id, e.type, e.schema_version, e.stream_id, e.stream_version, e.occurred_at,
            e.producer, e.correlation_id, e.causation_id, e.payload)


def conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def append_vs_copy(
    store: SqlEventStore, url: str | None, events: list[Event], batch_size: int
) -> tuple[float, float | None]:
    """Events/s of store.append and of raw binary COPY into an equivalent table.

    The two alternate batch by batch, so both see the same load on a shared machine.
    """
    raw: psycopg.Connection[Any] | None = None
    if url is not None:
        raw = psycopg.connect(conninfo(url))
        psycopg.types.json.set_json_dumps(orjson.dumps, raw)
        raw.execute("DROP TABLE IF EXISTS events_raw")
        raw.execute("CREATE TABLE events_raw (LIKE events INCLUDING ALL)")
        raw.commit()
    copy_sql = f"COPY events_raw ({', '.join(EVENT_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
    ours = theirs = 0.0
    try:
        for batch in batches(events, batch_size):
            started = time.perf_counter()
            await store.append(batch)
            ours += time.perf_counter() - started
            if raw is not None:
                started = time.perf_counter()
                with raw.cursor() as cur, cur.copy(copy_sql) as copy:
                    copy.set_types(COPY_TYPES)
                    for e in batch:
                        copy.write_row(row(e))
                raw.commit()
                theirs += time.perf_counter() - started
    finally:
        if raw is not None:
            raw.execute("DROP TABLE events_raw")
            raw.commit()
            raw.close()
    return len(events) / ours, (len(events) / theirs if raw is not None else None)


def raw_read(url: str, batch_size: int) -> float:
    """Rows/s of the whole events table through a server-side cursor (binary)."""
    with psycopg.connect(conninfo(url)) as conn:
        psycopg.types.json.set_json_loads(orjson.loads, conn)
        n = 0
        started = time.perf_counter()
        with conn.cursor("replay", binary=True) as cur:
            cur.itersize = batch_size
            cur.execute(
                "SELECT global_position, recorded_at, " + ", ".join(EVENT_COLUMNS)
                + " FROM events ORDER BY global_position"
            )
            while rows := cur.fetchmany(batch_size):
                n += len(rows)
        return n / (time.perf_counter() - started)


async def store_read(store: SqlEventStore, batch_size: int) -> float:
    n = 0
    started = time.perf_counter()
    async for batch in store.read_all(0, batch_size=batch_size):
        n += len(batch)
    return n / (time.perf_counter() - started)


async def bench_size(
    url: str, label: str, events: list[Event], args: argparse.Namespace, *, postgres: bool
) -> dict[str, dict[str, Any]]:
    """Append, read and replay one history. Reads are best of ``args.repeat`` (replays of
    half as many), alternating with the raw baseline so that both meet the same load."""
    out: dict[str, dict[str, Any]] = {}
    kind = "postgres" if postgres else "sqlite"
    upgrade(url)
    async with SqlEventStore(url) as store:
        append_rate, copy_rate = await append_vs_copy(
            store, url if postgres else None, events, args.batch
        )
        out[f"{kind} append {label}"] = metric(append_rate, "events/s", copy_rate)
        reads, raws, replays = [], [], []
        for i in range(args.repeat):
            reads.append(await store_read(store, args.read_batch))
            if postgres:
                raws.append(raw_read(url, args.read_batch))
            if i % 2 == 0:  # a rebuild takes longer: half as many
                stats = await rebuild(store, KernelsProjection(), batch_size=args.read_batch)
                replays.append(stats.events_per_s)
        raw_rate = max(raws) if raws else None
        out[f"{kind} read_all {label}"] = metric(max(reads), "events/s", raw_rate)
        out[f"{kind} replay into kernels {label}"] = metric(max(replays), "events/s", raw_rate)
    for name, m in out.items():
        base = f" (raw {m['baseline']:,.0f}, ratio {m['ratio']:.2f})" if m["baseline"] else ""
        print(f"{name:36s} {m['value']:>9,.0f} {m['unit']}{base}", flush=True)
    return out


# -- one run's events among another run's -----------------------------------------------------

EVAL_RUN, TRAINING_RUN = "eval-bench00000001", "run-training"
EVAL_FIELDS = ("kernel_id", "module_id", "status", "speedup", "check", "verifier_version",
               "speedup_ci", "reason", "details", "generation_s")  # load_evaluation's


def verdict_details(rng: random.Random) -> dict[str, Any]:
    """A verifier's ``details`` of a few hundred bytes: timings, builds, what ran."""
    return {
        "seconds": round(rng.uniform(2, 40), 3), "prepare_s": round(rng.uniform(0.5, 9), 3),
        "builds": [{"backend": "triton", "seconds": round(rng.uniform(0.2, 6), 3)}],
        "timing_s": round(rng.uniform(1, 20), 3), "launches": rng.randrange(1, 12),
        "torch_ops": ["aten::empty_strided", "aten::view"],
        "kernels": [{"name": f"triton_poi_fused_relu_{rng.randrange(99)}", "share": 0.93}],
        "timing": {"median_ms": round(rng.uniform(0.01, 3), 5), "iqr_ms": 0.0042, "runs": 100},
        "native_threads": [4, 4], "kernelbench_rule": "rtol=atol=1e-2",
    }


def training_verdicts(n: int, seed: int = 1) -> list[Event]:
    """``n`` verdicts of a training run (their kernels' KernelGenerated left out)."""
    rng = random.Random(seed)
    return [
        new_event(
            KernelVerified(
                kernel_id=f"t{i}", module_id=f"module-{i // 64}", group_id=f"group-{i // 8}",
                status=VerdictStatus.CORRECT if rng.random() < 0.4 else VerdictStatus.INCORRECT,
                speedup=round(rng.uniform(0.2, 3.0), 4), verifier_version="bench-1",
                hardware={"gpu": "NVIDIA H200", "cuda": "13.0", "torch": "2.11"},
                details=verdict_details(rng),
            ),
            stream_id=f"kernel-t{i}", stream_version=1, producer="verifier@bench",
            correlation_id=TRAINING_RUN,
        )
        for i in range(n)
    ]


def evaluation_history(kernels: int, samples: int = 10, seed: int = 2) -> list[Event]:
    """An evaluation as ``kz eval run`` stores it: its start, then per kernel its
    KernelGenerated (source, prompt, per-token logprobs) and its verdict."""
    rng = random.Random(seed)
    problems = [EvaluationProblem(problem_id=f"level1/{p}_Op", name=f"{p}_Op", level=1,
                                  module_id=f"kb-{p:024d}") for p in range(kernels // samples)]
    started = EvaluationStarted(run_id=EVAL_RUN, suite="/suites/kernelbench", backend="triton",
                                samples=samples, problems=problems)
    events = [new_event(started, stream_id=f"evaluation-{EVAL_RUN}", stream_version=0,
                        correlation_id=EVAL_RUN)]
    source = SOURCE_LINE * 24
    for k in range(kernels):
        problem = problems[k // samples]
        kid = f"e{k}"
        gen = KernelGenerated(
            kernel_id=kid, module_id=problem.module_id, group_id=f"{EVAL_RUN}/{k // samples}",
            group_size=samples, backend="triton", source=source, prompt=source,
            completion=Completion(text="", token_ids=[rng.randrange(50_000) for _ in range(64)],
                                  logprobs=[round(-rng.random() * 3, 6) for _ in range(64)]),
            generation_s=round(rng.uniform(5, 60), 3),
        )
        ver = KernelVerified(kernel_id=kid, module_id=problem.module_id, group_id=gen.group_id,
                             status=VerdictStatus.INCORRECT, check="correctness",
                             verifier_version="bench-1", details=verdict_details(rng))
        events.append(new_event(gen, stream_id=f"kernel-{kid}", stream_version=0,
                                correlation_id=EVAL_RUN))
        events.append(new_event(ver, stream_id=f"kernel-{kid}", stream_version=1,
                                correlation_id=EVAL_RUN, causation_id=events[-1].event_id))
    return events


async def read_run_unfiltered(store: SqlEventStore, run_id: str) -> int:
    """The read load_evaluation did before read_all had a correlation filter: every
    kernel and verdict of the store, the run's kept in Python (the fold left out)."""
    await store.read_stream(f"evaluation-{run_id}")
    kept = 0
    async for batch in store.read_all(0, types=["KernelGenerated", "KernelVerified"],
                                      payload_fields=EVAL_FIELDS):
        kept += sum(r.event.correlation_id == run_id for r in batch)
    return kept


async def bench_correlation_filter(
    url: str, evaluation: list[Event], others: list[Event], args: argparse.Namespace,
    *, postgres: bool,
) -> dict[str, dict[str, Any]]:
    """Migrates a 0001 store holding the events to head (timed: it builds the index), then
    times load_evaluation against the unfiltered read, alternating, best of ``args.repeat``."""
    kind = "postgres" if postgres else "sqlite"
    kernels = (len(evaluation) - 1) // 2
    label = f"{kernels:,} kernels among {len(others):,} verdicts"
    upgrade(url, "0001")
    async with SqlEventStore(url) as store:
        half = len(others) // 2  # the evaluation ran while the training run went on
        for part in (others[:half], evaluation, others[half:]):
            for batch in batches(part, args.batch):
                await store.append(batch)
    started = time.perf_counter()
    upgrade(url)
    migrate_s = time.perf_counter() - started
    filtered, unfiltered = [], []
    async with SqlEventStore(url) as store:
        for _ in range(args.repeat):
            started = time.perf_counter()
            kept = await read_run_unfiltered(store, EVAL_RUN)
            unfiltered.append(time.perf_counter() - started)
            started = time.perf_counter()
            record = await load_evaluation(store, EVAL_RUN)
            filtered.append(time.perf_counter() - started)
            assert record is not None and len(record.kernels) == len(record.verdicts) == kernels
            assert kept == 2 * kernels
    out = {
        f"{kind} load_evaluation {label}": metric(min(filtered), "s (time)", min(unfiltered)),
        f"{kind} migration 0002 (index build) on {len(evaluation) + len(others):,} events":
            metric(migrate_s, "s (time)"),
    }
    for name, m in out.items():
        base = f" (unfiltered {m['baseline']:.3f} s)" if m["baseline"] else ""
        print(f"{name:70s} {m['value']:8.3f} s{base}", flush=True)
    return out


def filter_notes(args: argparse.Namespace, evaluation: list[Event], others: list[Event]) -> str:
    kernels = (len(evaluation) - 1) // 2
    return (
        f"Correlation filter: a store of {len(others):,} KernelVerified of a training run "
        f"(mean payload {mean_payload_bytes(others):,.0f} B, details ~400 B; their "
        f"KernelGenerated left out, which makes the baseline's read shorter than in a real "
        f"store) with one evaluation of {kernels:,} kernels (KernelGenerated of "
        f"{mean_payload_bytes(evaluation[1::2]):,.0f} B and verdicts) stored in the middle. "
        "load_evaluation (read_all with correlation_id and types, through "
        "ix_events_correlation) vs its baseline, the read it did before the filter: every "
        "KernelGenerated/KernelVerified of the store with the same payload fields, the run's "
        "kept in Python (without the fold, which the measured value includes); alternating, "
        f"best of {args.repeat}. The migration row times `upgrade` from 0001 to head on that "
        "store (the index build)."
    )


def create_database(server_url: str, name: str) -> str:
    base = make_url(server_url)
    with psycopg.connect(conninfo(server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return base.set(database=name).render_as_string(hide_password=False)


async def filter_metrics(
    args: argparse.Namespace, server_url: str, tmp: Path
) -> tuple[dict[str, dict[str, Any]], str]:
    """The correlation filter's figures on SQLite and Postgres, and their notes."""
    evaluation, others = evaluation_history(args.eval_kernels), training_verdicts(args.others)
    metrics = await bench_correlation_filter(
        f"sqlite+aiosqlite:///{tmp / 'filter.sqlite3'}", evaluation, others, args,
        postgres=False,
    )
    db = create_database(server_url, "kz_bench_filter")
    metrics |= await bench_correlation_filter(db, evaluation, others, args, postgres=True)
    return metrics, filter_notes(args, evaluation, others)


async def filter_only(args: argparse.Namespace, server_url: str, tmp: Path) -> None:
    """Measures the correlation filter and merges its figures into the stored results."""
    metrics, notes = await filter_metrics(args, server_url, tmp)
    if args.dry_run:
        return
    stored = json.loads((RESULTS / "store.json").read_text())
    # The filter's earlier rows go whatever their sizes were; the other figures stay.
    kept = {k: v for k, v in stored["metrics"].items()
            if " load_evaluation " not in k and " migration 0002 " not in k}
    command = "python -m benchmarks.bench_store --filter-only"
    previous, _, remark = stored.get("notes", "").partition(" [Merged")
    if stored["command"] != command or not remark:  # else it names the full run already
        remark = (f": the correlation filter and migration rows are from this run; the "
                  f"others from the full run of {stored['date']} on {stored['machine']}, "
                  "`python -m benchmarks.bench_store`.]")
    previous = previous.split(" Correlation filter:")[0]
    write_result("store", command, kept | metrics, notes=f"{previous} {notes} [Merged{remark}")


async def main_async(args: argparse.Namespace, server_url: str, tmp: Path) -> None:
    metrics: dict[str, dict[str, Any]] = {}
    sizes = {"500 B": (args.small, 500), "8 KB": (args.large, 8000)}
    histories = {label: make_history(n, size) for label, (n, size) in sizes.items()}
    for label, evs in histories.items():
        print(f"{label}: {len(evs)} events, mean payload {mean_payload_bytes(evs):,.0f} B",
              flush=True)
    for label, evs in histories.items():
        db = create_database(server_url, f"kz_bench_{label.replace(' ', '').lower()}")
        metrics |= await bench_size(db, label, evs, args, postgres=True)
    for label, evs in histories.items():
        n = len(evs) // 2
        db = f"sqlite+aiosqlite:///{tmp / label.replace(' ', '')}.sqlite3"
        metrics |= await bench_size(db, label, evs[:n], args, postgres=False)
    payloads = ", ".join(f"{mean_payload_bytes(e):,.0f} B" for e in histories.values())
    notes = (
        f"Histories of KernelGenerated/KernelVerified pairs (source, prompt, per-token "
        f"logprobs; mean payloads {payloads}); appends in batches of {args.batch}, one "
        "transaction each. Append baseline: plain psycopg binary COPY of the same rows into "
        "an equivalent table (LIKE events INCLUDING ALL), alternating batch by batch with the "
        "store. read_all and replay baseline: raw psycopg server-side cursor over the events "
        "table, rows only (no Event objects). Replay = KernelsProjection rebuild from 0 (read, "
        f"fold, upsert, tracking per batch of {args.read_batch}). Reads: best of {args.repeat} "
        f"passes, replays best of {(args.repeat + 1) // 2}, alternating with the baseline. "
        "SQLite rows (half the events) are for information, without a baseline. Postgres: "
        "local throwaway cluster, fsync=off, synchronous_commit=off, on the same 2 cores as "
        "the benchmark (and whatever else runs there)."
    )
    filtered, more_notes = await filter_metrics(args, server_url, tmp)
    metrics |= filtered
    notes += " " + more_notes
    if not args.dry_run:
        write_result("store", "python -m benchmarks.bench_store", metrics, notes=notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=60_000, help="events at ~500 B")
    parser.add_argument("--large", type=int, default=12_000, help="events at ~8 KB")
    parser.add_argument("--batch", type=int, default=1000, help="events per append")
    parser.add_argument("--read-batch", type=int, default=5000, help="events per read/replay")
    parser.add_argument("--repeat", type=int, default=4, help="reads best of N, replays N/2")
    parser.add_argument("--eval-kernels", type=int, default=2000,
                        help="kernels of the evaluation the filter reads")
    parser.add_argument("--others", type=int, default=100_000,
                        help="verdicts of another run in the filter's store")
    parser.add_argument("--filter-only", action="store_true",
                        help="the correlation filter alone, merged into the stored results")
    parser.add_argument("--dry-run", action="store_true", help="print, write no results")
    args = parser.parse_args()
    run = filter_only if args.filter_only else main_async
    with_postgres(lambda server, tmp: run(args, server, tmp))


def with_postgres(run: Callable[[str, Path], Coroutine[Any, Any, None]]) -> None:
    """Runs ``run(server_url, tmp_dir)`` on KZ_BENCH_POSTGRES_URL, else on a throwaway
    local cluster, with a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="kz-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        tmp.chmod(0o755)
        server = os.environ.get("KZ_BENCH_POSTGRES_URL")
        pg = None
        if not server:
            pg = LocalPostgres(tmp / "pg").start()
            server = pg.url
        try:
            asyncio.run(run(server, tmp))
        finally:
            if pg is not None:
                pg.stop()


if __name__ == "__main__":
    main()
