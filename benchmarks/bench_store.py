"""Event store throughput on PostgreSQL (and SQLite, for information), each figure next to a
raw psycopg baseline measured in the same run.

- append: batched SqlEventStore.append at ~500 B and ~8 KB payloads vs plain binary COPY of
  the same rows into an equivalent table (``CREATE TABLE ... (LIKE events INCLUDING ALL)``);
- replay: rebuild of KernelsProjection from position 0, and plain read_all, vs a raw
  ``SELECT ... ORDER BY global_position`` through a server-side cursor.

Postgres: KZ_BENCH_POSTGRES_URL (a server where databases may be created), else a throwaway
local cluster (fsync off, as in the tests). Run: ``python -m benchmarks.bench_store``.
"""

from __future__ import annotations

import argparse
import asyncio
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

from benchmarks._results import metric, write_result
from kz_stream.events import (
    Completion,
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


def create_database(server_url: str, name: str) -> str:
    base = make_url(server_url)
    with psycopg.connect(conninfo(server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return base.set(database=name).render_as_string(hide_password=False)


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
    if not args.dry_run:
        write_result("store", "python -m benchmarks.bench_store", metrics, notes=notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=60_000, help="events at ~500 B")
    parser.add_argument("--large", type=int, default=12_000, help="events at ~8 KB")
    parser.add_argument("--batch", type=int, default=1000, help="events per append")
    parser.add_argument("--read-batch", type=int, default=5000, help="events per read/replay")
    parser.add_argument("--repeat", type=int, default=4, help="reads best of N, replays N/2")
    parser.add_argument("--dry-run", action="store_true", help="print, write no results")
    args = parser.parse_args()
    with_postgres(lambda server, tmp: main_async(args, server, tmp))


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
