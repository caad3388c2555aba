"""End-to-end recorder (Kafka -> store) and replay (store -> projection) throughput on
PostgreSQL and the tansu broker, each next to a raw baseline measured in the same run.

    python -m benchmarks.bench_recorder [--events 100000] [--repeats 2]

Recorder: ``--events`` ~500 B KernelGenerated/KernelVerified envelopes are published to
``kz.kernels`` first. Then the real service runs as it does in
production, ``kz serve recorder`` in its own process configured by environment variables,
into a fresh database; the benchmark watches the recorder's offsets in the tracking table
(they commit with the events) until all are stored. The baseline, alternating with it, is a
plain loop in this process: aiokafka ``getmany`` of the same topics, ``orjson.loads`` of each
value, binary COPY into an equivalent table (``LIKE events``), the offsets upserted in the
same transaction, then a Kafka commit; no validation, no dedupe, no advisory lock.

Both rates are steady state: events stored after the first committed batch divided by the
time from that commit to the last one, so process start-up and the group join (tansu takes
about half the session timeout to answer a JoinGroup) are reported apart, as start-up time.

Replay: ``kz replay --projection kernels`` (a rebuild of KernelsProjection from position 0,
in its own process) over the recorded history, against plain psycopg reading the same rows
in pages by position (payload as text parsed by orjson, nothing else built): once every
column with whole payloads, once the store's own projected query (payloads trimmed on the
server to the projection's fields). The baselines run in this process with the collector
settings the services use (kz_stream.runtime), so GC handicaps neither side.

Best of ``--repeats``, alternating. Postgres is a throwaway local cluster with fsync off.
CPU microseconds per event (the consumer's process, the Postgres cluster) are reported too:
on a shared machine they move less than the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg
from aiokafka import AIOKafkaConsumer, TopicPartition

from benchmarks._results import metric, write_result
from benchmarks.bench_store import conninfo, create_database, make_history
from kz_stream.bus import KafkaBus, TopicSpec
from kz_stream.events import Event, encode_event
from kz_stream.infra import LocalBroker, LocalPostgres
from kz_stream.projections import KernelsProjection
from kz_stream.store import upgrade
from kz_stream.store._schema import EVENT_COLUMNS
from kz_stream.store._sql import _COPY_TYPES, _page_query

GROUP = "kz-recorder"  # kz_stream.consumers.recorder.Recorder.group
TOPIC_KEYS = ("modules", "kernels", "frontier", "policy")
MAX_BATCH = 5000  # what the recorder asks the bus for
COPY_TYPES = list(_COPY_TYPES)  # the store's own COPY column types, for the raw baseline
RAW_COPY = f"COPY events_raw ({', '.join(EVENT_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
RAW_TRACK = (
    "INSERT INTO tracking_raw (name, key, position) VALUES (%s, %s, %s) "
    "ON CONFLICT (name, key) DO UPDATE SET position = excluded.position, updated_at = now()"
)


@dataclass
class Stamp:
    """Seen after a commit: seconds since start, events stored, and CPU seconds used so far
    by the consumer's process and by the Postgres cluster."""

    at: float
    stored: int
    consumer_cpu: float
    postgres_cpu: float


@dataclass
class Run:
    started: float
    stamps: list[Stamp]

    def steady_rate(self) -> float:
        """Events after the first commit / time from the first commit to the last."""
        a, b = self.stamps[0], self.stamps[-1]
        return (b.stored - a.stored) / (b.at - a.at) if b.at > a.at else 0.0

    def cpu_us(self) -> tuple[float, float]:
        """CPU microseconds per event over the same span: (consumer process, Postgres)."""
        a, b = self.stamps[0], self.stamps[-1]
        n = max(1, b.stored - a.stored)
        return ((b.consumer_cpu - a.consumer_cpu) / n * 1e6,
                (b.postgres_cpu - a.postgres_cpu) / n * 1e6)

    def startup_s(self) -> float:
        return self.stamps[0].at

    def overall_rate(self) -> float:
        """Events / time from the process (or consumer) start to the last commit."""
        return self.stamps[-1].stored / self.stamps[-1].at


_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def cluster_cpu(pg: LocalPostgres) -> float:
    """CPU seconds of the postmaster and its children (backends, walwriter, ...)."""
    try:
        postmaster = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    total = process_cpu(postmaster)
    try:
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(process_cpu(int(c)) for c in children)


def topic_names(prefix: str) -> dict[str, str]:
    return {k: f"{prefix}.{k}" for k in TOPIC_KEYS} | {"dead_letter": f"{prefix}.dlq"}


async def publish(bootstrap: str, prefix: str, events: Sequence[Event], partitions: int) -> float:
    """Publishes generations and verdicts to kz.kernels (a kernel's verdict after it, in its
    partition: there is no verdicts topic); returns events/s."""
    names = topic_names(prefix)
    bus = KafkaBus(bootstrap, client_id="bench")
    await bus.start()
    try:
        await bus.create_topics(
            [TopicSpec(names[k], partitions) for k in ("modules", "kernels")]
            + [TopicSpec(names[k], 1, compacted=True) for k in ("frontier", "policy")]
            + [TopicSpec(names["dead_letter"], 1)]
        )
        gens = [e for e in events if e.type == "KernelGenerated"]
        verdicts = [e for e in events if e.type == "KernelVerified"]
        started = time.perf_counter()
        for i in range(0, len(gens), 10_000):
            await bus.publish_many(names["kernels"], gens[i : i + 10_000])
            await bus.publish_many(names["kernels"], verdicts[i : i + 10_000])
        return len(events) / (time.perf_counter() - started)
    finally:
        await bus.close()


def run_recorder_service(
    db_url: str, bootstrap: str, prefix: str, partitions: int, n: int, log: Path,
    pg: LocalPostgres,
) -> Run:
    """Runs ``kz serve recorder`` until the store holds ``n`` events, then SIGTERMs it."""
    env = {
        **os.environ,
        "KZ_DATABASE_URL": db_url,
        "KZ_BUS_URL": f"kafka://{bootstrap}",
        "KZ_LOG_LEVEL": "INFO",
        "KZ_TOPICS__PARTITIONS": str(partitions),
        **{f"KZ_TOPICS__{k.upper()}": v for k, v in topic_names(prefix).items()},
    }
    watch = psycopg.connect(conninfo(db_url), autocommit=True)
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kz_stream.cli", "serve", "recorder"],
            env=env, stdout=out, stderr=out,
        )
    stamps: list[Stamp] = []
    try:
        while True:
            # The offsets commit with the events: their sum is the events stored (fresh
            # topics start at offset 0), and reading four rows costs the server nothing.
            row = watch.execute(
                "SELECT coalesce(sum(position), 0) FROM tracking WHERE name = %s", (GROUP,)
            ).fetchone()
            stored = int(row[0]) if row else 0
            now = time.perf_counter() - started
            if stored and (not stamps or stamps[-1].stored != stored):
                stamps.append(Stamp(now, stored, process_cpu(proc.pid), cluster_cpu(pg)))
            if stored >= n:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the recorder exited early ({proc.returncode}); see {log}")
            if now > 300:
                raise RuntimeError(f"the recorder stored only {stored} of {n} in 300 s")
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    count = watch.execute("SELECT count(*) FROM events").fetchone()
    watch.close()
    if rc != 0:
        raise RuntimeError(f"the recorder exited with {rc} on SIGTERM; see {log}")
    if not count or count[0] != n:
        raise RuntimeError(f"the store holds {count} events, expected {n}")
    return Run(started, stamps)


def _raw_row(value: bytes) -> tuple[Any, ...]:
    d = orjson.loads(value)
    causation = d["causation_id"]
    return (
        uuid.UUID(d["event_id"]), d["type"], d["schema_version"], d["stream_id"],
        d["stream_version"], datetime.fromisoformat(d["occurred_at"]), d["producer"],
        d["correlation_id"], uuid.UUID(causation) if causation else None, d["payload"],
    )


async def run_raw_recorder(
    db_url: str, bootstrap: str, prefix: str, n: int, pg: LocalPostgres
) -> Run:
    """The baseline: getmany, COPY and the offsets in one transaction, Kafka commit."""
    conn = await psycopg.AsyncConnection.connect(conninfo(db_url))
    psycopg.types.json.set_json_dumps(orjson.dumps, conn)
    await conn.execute("DROP TABLE IF EXISTS events_raw, tracking_raw")
    await conn.execute("CREATE TABLE events_raw (LIKE events INCLUDING ALL)")
    await conn.execute("CREATE TABLE tracking_raw (LIKE tracking INCLUDING ALL)")
    await conn.commit()
    names = topic_names(prefix)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=f"raw-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False, auto_offset_reset="earliest", max_poll_records=MAX_BATCH,
        max_partition_fetch_bytes=4 << 20, fetch_max_bytes=32 << 20,
        session_timeout_ms=10_000, heartbeat_interval_ms=3_000,
    )
    started = time.perf_counter()
    await consumer.start()
    consumer.subscribe([v for k, v in names.items() if k != "dead_letter"])
    stamps: list[Stamp] = []
    got = 0
    try:
        while got < n:
            data = await consumer.getmany(timeout_ms=1000, max_records=MAX_BATCH)
            if not data:
                continue
            rows = [_raw_row(r.value) for records in data.values() for r in records]
            offsets = {tp: records[-1].offset + 1 for tp, records in data.items()}
            async with conn.transaction(), conn.cursor() as cur:
                async with cur.copy(RAW_COPY) as copy:
                    copy.set_types(COPY_TYPES)
                    for row in rows:
                        await copy.write_row(row)
                await cur.executemany(
                    RAW_TRACK, [(GROUP, f"{tp.topic}:{tp.partition}", off)
                                for tp, off in offsets.items()]
                )
            await consumer.commit({TopicPartition(tp.topic, tp.partition): off
                                   for tp, off in offsets.items()})
            got += len(rows)
            stamps.append(Stamp(time.perf_counter() - started, got, time.process_time(),
                                cluster_cpu(pg)))
    finally:
        await consumer.stop()
        await conn.execute("DROP TABLE IF EXISTS events_raw, tracking_raw")
        await conn.commit()
        await conn.close()
    return Run(started, stamps)


def replay_cli(db_url: str) -> float:
    """Runs ``kz replay --projection kernels`` (a rebuild from 0) and returns its events/s.

    A process of its own, as a user runs it: neither this harness's collector settings
    nor its imports and objects bear on the measurement."""
    out = subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", "replay", "--projection", "kernels"],
        env={**os.environ, "KZ_DATABASE_URL": db_url, "COLUMNS": "200"},
        capture_output=True, text=True, timeout=300, check=False,
    )
    found = re.search(r"rebuilt kernels: ([\d,]+) events in [\d.]+s \(([\d,]+) events/s\)",
                      out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"kz replay failed ({out.returncode}): {out.stdout} {out.stderr}")
    return float(found.group(2).replace(",", ""))


def raw_read(db_url: str, batch_size: int, *, projected: bool) -> float:
    """Rows/s of plain psycopg over every KernelGenerated/KernelVerified row, in pages of
    ``batch_size`` by position, payloads parsed with orjson, nothing else built.

    ``projected``: the very query the store runs for KernelsProjection (payloads trimmed to
    its fields on the server); otherwise every column with whole payloads. Payloads come
    as text: faster than psycopg's jsonb loader, so the baseline is the best of the two.
    """
    types = list(KernelsProjection.types or ())
    fields = KernelsProjection.payload_fields if projected else None
    sql, head, tail = _page_query(types, fields)
    loads = orjson.loads
    with psycopg.connect(conninfo(db_url)) as conn, conn.cursor(binary=True) as cur:
        n = after = 0
        started = time.perf_counter()
        while True:
            cur.execute(sql, (*head, after, *tail, batch_size))
            rows = cur.fetchall()
            if not rows:
                break
            for r in rows:
                loads(r[-1])
            n += len(rows)
            after = rows[-1][0]
        return n / (time.perf_counter() - started)


def loadavg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that the finally blocks stop Postgres and the broker


def main(argv: Sequence[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--payload-bytes", type=int, default=500)
    parser.add_argument("--partitions", type=int, default=8, help="per topic (the default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--read-batch", type=int, default=5000,
                        help="rows per page of the raw reads (kz replay's batch is 5000)")
    parser.add_argument("--skip-raw", action="store_true", help="no baselines (profiling)")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print, write no results")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    load_before = loadavg()

    events = make_history(args.events, args.payload_bytes)
    n = len(events)
    wire_bytes = sum(len(encode_event(e)) for e in events) / n
    payload_bytes = sum(len(orjson.dumps(e.payload)) for e in events) / n
    print(f"{n:,} events, {wire_bytes:,.0f} B on the wire, payload {payload_bytes:,.0f} B; "
          f"load {load_before}", flush=True)

    with tempfile.TemporaryDirectory(prefix="kz-bench-rec-") as tmp_dir:
        tmp = Path(tmp_dir)
        tmp.chmod(0o755)  # Postgres runs as its own user when we are root
        pg = LocalPostgres(tmp / "pg").start()
        broker = LocalBroker()
        try:
            broker.start()
            # The inputs are the harness's, not the measured code's: out of the collector's way.
            # The raw baselines run here with the collector settings the services get from
            # kz_stream.runtime (and replays from rebuild), so GC handicaps neither side.
            gc.collect()
            gc.freeze()
            gc.set_threshold(100_000, *gc.get_threshold()[1:])
            services: list[Run] = []
            raws: list[Run] = []
            db_url = ""
            for r in range(args.repeats):
                # Fresh topics each time: the recorder's group is fixed, and on topics it has
                # committed before it would start from the broker's offsets, at their end.
                prefix = f"b{uuid.uuid4().hex[:6]}"
                rate = asyncio.run(publish(broker.bootstrap, prefix, events, args.partitions))
                print(f"published {n:,} at {rate:,.0f} events/s", flush=True)
                db_url = create_database(pg.url, f"kz_bench_recorder_{r}")
                upgrade(db_url)
                run = run_recorder_service(
                    db_url, broker.bootstrap, prefix, args.partitions, n, tmp / f"rec{r}.log", pg
                )
                services.append(run)
                print(f"recorder  {run.steady_rate():>9,.0f} events/s, CPU us/event "
                      "{:.1f} + Postgres {:.1f} (start-up {:.1f} s, load {})".format(
                          *run.cpu_us(), run.startup_s(), loadavg()), flush=True)
                if not args.skip_raw:
                    raw = asyncio.run(run_raw_recorder(db_url, broker.bootstrap, prefix, n, pg))
                    raws.append(raw)
                    print(f"raw       {raw.steady_rate():>9,.0f} events/s, CPU us/event "
                          "{:.1f} + Postgres {:.1f} (start-up {:.1f} s, load {})".format(
                              *raw.cpu_us(), raw.startup_s(), loadavg()), flush=True)
            del events

            replays: list[float] = []
            reads: list[float] = []
            projected: list[float] = []
            if not args.skip_replay:
                # Both sides read a settled table (hint bits set, statistics fresh).
                with psycopg.connect(conninfo(db_url), autocommit=True) as conn:
                    conn.execute("VACUUM (ANALYZE) events")
                for _ in range(args.repeats):
                    replays.append(replay_cli(db_url))
                    if not args.skip_raw:
                        reads.append(raw_read(db_url, args.read_batch, projected=False))
                        projected.append(raw_read(db_url, args.read_batch, projected=True))
                    print(f"replay    {replays[-1]:>9,.0f} events/s  raw read "
                          f"{reads[-1] if reads else 0:>9,.0f} rows/s, of the projected "
                          f"columns {projected[-1] if projected else 0:>9,.0f} rows/s "
                          f"(load {loadavg()})", flush=True)
        finally:
            broker.stop()
            pg.stop()

    load_after = loadavg()
    best = max(services, key=Run.steady_rate)
    rec, rec_cpu = best.steady_rate(), best.cpu_us()
    raw_cpu = max(raws, key=Run.steady_rate).cpu_us() if raws else (0.0, 0.0)
    raw_rec = max(r.steady_rate() for r in raws) if raws else None
    metrics: dict[str, dict[str, Any]] = {
        "avg_event_bytes": metric(wire_bytes, "bytes"),
        "recorder (kz serve recorder) Kafka→store": metric(rec, "events/s", raw_rec),
        "recorder CPU per event (its process)": metric(
            rec_cpu[0], "us", raw_cpu[0] if raws else None
        ),
        "recorder incl. start-up and group join": metric(
            max(r.overall_rate() for r in services), "events/s",
            max(r.overall_rate() for r in raws) if raws else None,
        ),
        "recorder start-up to first commit": metric(
            min(r.startup_s() for r in services), "s",
            min(r.startup_s() for r in raws) if raws else None,
        ),
    }
    if replays:
        metrics["replay into kernels (rebuild)"] = metric(
            max(replays), "events/s", max(reads) if reads else None
        )
        metrics["replay into kernels vs raw read of its columns"] = metric(
            max(replays), "events/s", max(projected) if projected else None
        )
    command = "python -m benchmarks.bench_recorder " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    notes = (
        f"{n:,} KernelGenerated/KernelVerified envelopes of ~{wire_bytes:,.0f} B (payload "
        f"~{payload_bytes:,.0f} B) pre-published to kz.kernels "
        f"({args.partitions} partitions), tansu broker (memory storage), throwaway "
        f"Postgres (fsync off); best of {args.repeats}, alternating with the baselines. "
        "Recorder: the real service, `kz serve recorder` as a subprocess (decode and pydantic "
        "validation of every event, advisory-locked COPY, offsets in the same transaction, "
        "Kafka commit), timed by its committed offsets from its first committed batch to the "
        "last (start-up and group join reported apart). Recorder baseline: plain aiokafka "
        "getmany + orjson.loads + psycopg binary COPY into an equivalent table, offsets in "
        "the same transaction, Kafka commit, no validation, timed the same way (in the "
        "benchmark's process, with the services' collector settings). Replay: `kz replay "
        "--projection kernels` as a subprocess over the recorded history (read, fold, "
        "upsert, tracking per batch of 5000) after VACUUM ANALYZE; baselines: plain psycopg "
        f"reading the same rows in pages of {args.read_batch} (payload as text, orjson, "
        "nothing built), once every column with whole payloads, once the store's own "
        "projected query (payloads trimmed to the projection's fields). CPU per event "
        f"(recorder process / Postgres cluster): service {rec_cpu[0]:.1f} / "
        f"{rec_cpu[1]:.1f} us, baseline {raw_cpu[0]:.1f} / {raw_cpu[1]:.1f} us. Load "
        f"average (1/5/15 min) {load_before} before, {load_after} after: the 2 cores are "
        "shared with other work, so rates move with it; the CPU per event moves less."
    )
    print(f"total {time.perf_counter() - t0:.0f} s; load {load_after}")
    if not args.dry_run:
        write_result("recorder", command.strip(), metrics, notes=notes)


if __name__ == "__main__":
    main()
