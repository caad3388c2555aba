"""The event store contract: every test runs against SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime, timedelta
from multiprocessing import get_context

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select
from sqlalchemy.engine import make_url

from kz_stream.database_url import sync_url
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    new_event,
)
from kz_stream.projections import (
    KernelsProjection,
    catch_up,
    kernels,
    projection_hash,
    rebuild,
    tracking_name,
)
from kz_stream.store import (
    ConcurrencyError,
    EventStore,
    RecordedEvent,
    SqlEventStore,
    StoreNotFound,
    metadata,
    open_store,
    upgrade,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[SqlEventStore]:
    async with SqlEventStore(store_url, create_schema=True) as s:
        yield s


# -- helpers --------------------------------------------------------------------------------


def verdict(
    stream: str,
    version: int,
    *,
    kernel: str = "k",
    rng: random.Random | None = None,
    run: str | None = "run-1",
) -> Event:
    """A small KernelVerified of ``run`` at (stream, version); ids random, or drawn from
    ``rng``."""
    event_id = uuid.UUID(int=rng.getrandbits(128), version=4) if rng else uuid.uuid4()
    return new_event(
        KernelVerified(kernel_id=kernel, module_id="m", group_id="g",
                       status=VerdictStatus.CORRECT, speedup=1.25),
        stream_id=stream, stream_version=version, event_id=event_id,
        occurred_at=T0 + timedelta(microseconds=version), producer="test",
        correlation_id=run,
    )


def history(seed: int, streams: int, per_stream: int) -> list[Event]:
    """The same events (ids included) for the same seed: what redelivery looks like."""
    rng = random.Random(seed)
    return [verdict(f"s{s}", v, rng=rng) for s in range(streams) for v in range(per_stream)]


async def read_everything(store: EventStore, batch_size: int = 1000) -> list[RecordedEvent]:
    return [rec async for batch in store.read_all(0, batch_size=batch_size) for rec in batch]


def assert_stored_once_without_gaps(stored: list[RecordedEvent], expected: list[Event]) -> None:
    positions = [r.global_position for r in stored]
    assert positions == sorted(set(positions)), "positions are not strictly increasing"
    assert Counter(r.event.event_id for r in stored) == Counter(e.event_id for e in expected)
    versions: dict[str, list[int]] = {}
    for r in stored:
        versions.setdefault(r.event.stream_id, []).append(r.event.stream_version)
    for stream, vs in versions.items():
        assert sorted(vs) == list(range(len(vs))), f"stream {stream} has gaps: {sorted(vs)}"
    by_id = {e.event_id: e for e in expected}
    assert all(r.event == by_id[r.event.event_id] for r in stored)


async def append_overlapping(store: EventStore, events: list[Event], seed: int) -> tuple[int, int]:
    """Appends all of ``events`` in shuffled, randomly sized batches; returns the counts."""
    rng = random.Random(seed)
    size = rng.randint(3, 9)
    chunks = [events[i : i + size] for i in range(0, len(events), size)]
    rng.shuffle(chunks)
    appended = duplicates = 0
    for chunk in chunks:
        result = await store.append(chunk)
        appended, duplicates = appended + result.appended, duplicates + result.duplicates
    return appended, duplicates


def append_in_process(url: str, seed: int) -> tuple[int, int]:
    """A writer process: its own interpreter, engine and connections."""

    async def run() -> tuple[int, int]:
        async with SqlEventStore(url) as s:
            return await append_overlapping(s, history(7, streams=6, per_stream=15), seed)

    return asyncio.run(run())


# -- append and read ------------------------------------------------------------------------


async def test_appended_events_read_back_identical_in_append_order(store: SqlEventStore) -> None:
    events = [verdict("a", 0), verdict("b", 0), verdict("a", 1)]

    result = await store.append(events)

    assert (result.appended, result.duplicates) == (3, 0)
    stored = await read_everything(store)
    assert [r.event for r in stored] == events
    assert result.last_position == stored[-1].global_position == await store.last_position()
    assert [r.event for r in await store.read_stream("a")] == [events[0], events[2]]
    assert all(r.recorded_at.tzinfo is not None for r in stored)


async def test_an_empty_store_reads_nothing_and_has_position_zero(store: SqlEventStore) -> None:
    assert await read_everything(store) == []
    assert await store.last_position() == 0
    assert await store.read_stream("nothing") == []
    assert (await store.append([])).appended == 0


async def test_a_store_opened_to_read_where_none_was_written_says_so(store_url: str) -> None:
    """A reader (kz dataset export, kz audit) on a mistyped URL: a clear error, and no
    empty SQLite file left where the path pointed."""
    with pytest.raises(StoreNotFound, match=r"no such database file|never written"):
        async with open_store(store_url, create_schema=False):
            pass
    database = make_url(store_url).database
    if store_url.startswith("sqlite") and database:
        assert not await asyncio.to_thread(os.path.exists, database)
    async with open_store(store_url) as store:  # a writer creates it
        await store.append([verdict("a", 0)])
    async with open_store(store_url, create_schema=False) as store:
        assert await store.last_position() == 1


async def test_a_naive_occurred_at_is_stored_as_utc(store: SqlEventStore) -> None:
    naive = verdict("a", 0).model_copy(update={"occurred_at": datetime(2026, 1, 1, 12, 0)})

    await store.append([naive])

    (stored,) = await store.read_stream("a")
    assert stored.event.occurred_at == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


async def test_redelivered_events_are_skipped_and_counted_as_duplicates(
    store: SqlEventStore,
) -> None:
    first = [verdict("a", 0), verdict("a", 1)]
    await store.append(first)

    again = await store.append(first)
    partly_new = await store.append([first[1], verdict("a", 2), verdict("a", 2 + 1)])

    assert (again.appended, again.duplicates) == (0, 2)
    assert (partly_new.appended, partly_new.duplicates) == (2, 1)
    assert [r.event.stream_version for r in await store.read_stream("a")] == [0, 1, 2, 3]


async def test_an_event_id_repeated_inside_one_batch_is_stored_once(store: SqlEventStore) -> None:
    e = verdict("a", 0)

    result = await store.append([e, e, verdict("a", 1)])

    assert (result.appended, result.duplicates) == (2, 1)
    assert len(await read_everything(store)) == 2


async def test_a_different_event_at_a_taken_stream_version_rolls_back_the_whole_batch(
    store: SqlEventStore,
) -> None:
    await store.append([verdict("a", 0)])

    with pytest.raises(ConcurrencyError, match="stream_version"):
        await store.append(
            [verdict("b", 0), verdict("a", 0), verdict("c", 0)], tracking={"consumer": {"p0": 9}}
        )

    assert [r.event.stream_id for r in await read_everything(store)] == ["a"]
    assert await store.get_tracking("consumer") == {}


async def test_writers_racing_for_one_stream_version_let_exactly_one_win(
    store: SqlEventStore,
) -> None:
    async def attempt() -> bool:
        try:
            await store.append([verdict("contested", 0)])
        except ConcurrencyError:
            return False
        return True

    wins = await asyncio.gather(*(attempt() for _ in range(6)))

    assert sum(wins) == 1
    assert len(await store.read_stream("contested")) == 1


async def test_concurrent_tasks_appending_overlapping_batches_store_every_event_once(
    store: SqlEventStore,
) -> None:
    events = history(3, streams=5, per_stream=20)

    counts = await asyncio.gather(*(append_overlapping(store, events, seed) for seed in range(6)))

    assert sum(a for a, _ in counts) == len(events)
    assert sum(a + d for a, d in counts) == 6 * len(events)
    assert_stored_once_without_gaps(await read_everything(store, batch_size=7), events)


async def test_writers_beyond_the_pool_size_wait_their_turn_and_are_all_stored(
    store: SqlEventStore,
) -> None:
    async with store.transaction() as tx:  # holds the write lock until it commits
        await tx.append([verdict("first", 0)])
        writers = [asyncio.create_task(store.append([verdict(f"w{i}", 0)])) for i in range(40)]
        await asyncio.sleep(0.5)  # every writer is waiting now
        if store.dialect == "sqlite":
            # Queued in this process, not each on a pooled connection (the pool holds 15).
            assert store._engines()[0].pool.checkedout() == 1  # type: ignore[attr-defined]
    results = await asyncio.gather(*writers)

    assert [r.appended for r in results] == [1] * 40
    assert len(await read_everything(store, batch_size=100)) == 41


@pytest.fixture(scope="module")
def writer_processes() -> Iterator[ProcessPoolExecutor]:
    """Three fresh interpreters (spawned once per module: imports take seconds here)."""
    with ProcessPoolExecutor(max_workers=3, mp_context=get_context("spawn")) as pool:
        yield pool


async def test_concurrent_processes_appending_overlapping_batches_store_every_event_once(
    store: SqlEventStore, writer_processes: ProcessPoolExecutor
) -> None:
    events = history(7, streams=6, per_stream=15)
    loop = asyncio.get_running_loop()

    counts = await asyncio.gather(*(
        loop.run_in_executor(writer_processes, append_in_process, store.url, seed)
        for seed in range(3)
    ))

    assert sum(a for a, _ in counts) == len(events)
    assert_stored_once_without_gaps(await read_everything(store), events)


# -- ordered, gap-free reading --------------------------------------------------------------


def proposed_module() -> Event:
    return new_event(
        ModuleProposed(module_id="m", api_set=["torch.relu"], source="",
                       validation=ModuleValidation(valid=True)),
        stream_id="module-m", stream_version=0,
    )


async def test_read_all_yields_ordered_batches_after_a_position_and_filters_types(
    store: SqlEventStore,
) -> None:
    module = proposed_module()
    events = [verdict("a", v) for v in range(5)] + [module] + [verdict("a", v) for v in (5, 6)]
    await store.append(events)
    stored = await read_everything(store)

    batches = [b async for b in store.read_all(stored[1].global_position, batch_size=2)]
    only_modules = [b async for b in store.read_all(0, types=["ModuleProposed"])]
    only_verdicts = [b async for b in store.read_all(0, batch_size=4, types=["KernelVerified"])]

    assert [len(b) for b in batches] == [2, 2, 2]
    assert [r.event for b in batches for r in b] == events[2:]
    assert [[r.event for r in b] for b in only_modules] == [[module]]
    assert [len(b) for b in only_verdicts] == [4, 3]
    assert [r.event for b in only_verdicts for r in b] == events[:5] + events[6:]
    assert [b async for b in store.read_all(stored[-1].global_position)] == []


async def test_a_tail_of_some_types_yields_those_alone_as_they_commit(
    store: SqlEventStore,
) -> None:
    module = proposed_module()
    await store.append([verdict("a", 0), module])
    seen: list[Event] = []
    async with contextlib.aclosing(
        store.tail(0, poll_interval=0.02, types=["KernelVerified"])
    ) as tail:
        async for batch in tail:
            seen.extend(r.event for r in batch)
            if len(seen) == 1:  # a module and a verdict committed after the tail began
                await store.append([module.model_copy(update={"event_id": uuid.uuid4(),
                                                              "stream_version": 1}),
                                    verdict("a", 1)])
            else:
                break
    assert [(e.stream_id, e.stream_version) for e in seen] == [("a", 0), ("a", 1)]
    assert {e.type for e in seen} == {"KernelVerified"}


async def test_read_all_with_payload_fields_keeps_those_fields_and_every_event(
    store: SqlEventStore,
) -> None:
    """``payload_fields`` is a hint: other keys may go, the asked ones and the events stay."""
    events = [verdict("a", v, kernel=f"k{v}") for v in range(6)]
    await store.append(events)
    fields = ("kernel_id", "status", "speedup")

    whole = await read_everything(store)
    hinted = [r async for b in store.read_all(0, batch_size=4, types=["KernelVerified"],
                                               payload_fields=fields) for r in b]

    assert [r.global_position for r in hinted] == [r.global_position for r in whole]
    assert [r.event.event_id for r in hinted] == [e.event_id for e in events]
    for h, w in zip(hinted, whole, strict=True):
        assert {f: h.event.payload[f] for f in fields} == {f: w.event.payload[f] for f in fields}


def two_runs_interleaved() -> list[Event]:
    """Verdicts of run-a, run-b and of no run in turn, and a module of run-a among them."""
    runs = ("run-a", "run-b", None)
    events = [verdict(f"s{i % 4}", i // 4, kernel=f"k{i}", run=runs[i % 3]) for i in range(24)]
    module = proposed_module().model_copy(update={"correlation_id": "run-a"})
    return [*events[:10], module, *events[10:]]


async def test_read_all_of_a_correlation_id_yields_that_run_alone_in_order(
    store: SqlEventStore,
) -> None:
    events = two_runs_interleaved()
    await store.append(events)
    run_a = [e for e in events if e.correlation_id == "run-a"]
    run_b = [e for e in events if e.correlation_id == "run-b"]

    # Pages smaller than a run: every page boundary falls among the other runs' events.
    a_batches = [b async for b in store.read_all(0, batch_size=2, correlation_id="run-a")]
    b_batches = [b async for b in store.read_all(0, batch_size=3, correlation_id="run-b")]

    assert [r.event for b in a_batches for r in b] == run_a
    assert [len(b) for b in a_batches] == [2, 2, 2, 2, 1]
    assert [r.event for b in b_batches for r in b] == run_b
    positions = [r.global_position for b in a_batches + b_batches for r in b]
    assert len(set(positions)) == len(positions) == len(run_a) + len(run_b)
    assert [b async for b in store.read_all(0, correlation_id="run-c")] == []


async def test_a_correlation_id_combines_with_types_position_and_payload_fields(
    store: SqlEventStore,
) -> None:
    events = two_runs_interleaved()
    await store.append(events)
    run_a = [r for r in await read_everything(store) if r.event.correlation_id == "run-a"]
    verdicts_a = [r.event for r in run_a if r.event.type == "KernelVerified"]
    fields = ("kernel_id", "status")

    typed = [r.event async for b in store.read_all(0, batch_size=2, types=["KernelVerified"],
                                                   correlation_id="run-a") for r in b]
    later = [r.event async for b in store.read_all(run_a[3].global_position, batch_size=2,
                                                   correlation_id="run-a") for r in b]
    hinted = [r.event async for b in store.read_all(0, batch_size=3, types=["KernelVerified"],
                                                    payload_fields=fields,
                                                    correlation_id="run-a") for r in b]
    modules = [r.event async for b in store.read_all(0, types=["ModuleProposed"],
                                                     correlation_id="run-b") for r in b]

    assert typed == verdicts_a
    assert later == [r.event for r in run_a[4:]]
    assert [e.event_id for e in hinted] == [e.event_id for e in verdicts_a]
    for h, e in zip(hinted, verdicts_a, strict=True):
        assert {f: h.payload[f] for f in fields} == {f: e.payload[f] for f in fields}
    assert modules == []


async def test_a_tailing_reader_never_skips_an_event_committed_by_concurrent_writers(
    store: SqlEventStore,
) -> None:
    seen: list[RecordedEvent] = []
    sentinel = verdict("the-end", 0)

    async def follow() -> None:
        async with contextlib.aclosing(store.tail(0, batch_size=5, poll_interval=0.02)) as tail:
            async for batch in tail:
                seen.extend(batch)
                if seen[-1].event == sentinel:
                    return

    async def write(w: int) -> None:
        # Commits held open for a random moment: without commit-ordered positions, a
        # later position would commit first and the reader would step over the earlier one.
        rng, version = random.Random(w), 0
        for i in range(12):
            async with store.transaction() as tx:
                size = 1 + i % 4
                await tx.append([verdict(f"w{w}", version + k) for k in range(size)])
                await asyncio.sleep(rng.random() * 0.004)
            version += size

    reader = asyncio.create_task(follow())
    await asyncio.gather(*(write(w) for w in range(6)))
    await store.append([sentinel])
    await asyncio.wait_for(reader, timeout=20)

    final = await read_everything(store)
    assert [r.global_position for r in seen] == [r.global_position for r in final]
    assert [r.event for r in seen] == [r.event for r in final]


@pytest.mark.postgres
async def test_tail_on_postgres_is_woken_by_the_commit_not_by_polling(postgres_url: str) -> None:
    async with SqlEventStore(postgres_url, create_schema=True) as s:
        await s.append([verdict("a", 0)])
        got: asyncio.Queue[list[RecordedEvent]] = asyncio.Queue()

        async def follow() -> None:
            async for batch in s.tail(0, poll_interval=60):
                await got.put(batch)

        reader = asyncio.create_task(follow())
        try:
            assert len(await asyncio.wait_for(got.get(), timeout=10)) == 1
            await asyncio.sleep(0.2)  # the reader is now waiting on LISTEN
            late = verdict("a", 1)
            await s.append([late])
            batch = await asyncio.wait_for(got.get(), timeout=5)  # far below poll_interval
            assert [r.event for r in batch] == [late]
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


# -- tracking in the same transaction -------------------------------------------------------


async def test_tracking_positions_commit_with_the_appended_events(store: SqlEventStore) -> None:
    await store.append([verdict("a", 0)], tracking={"recorder": {"kz.kernels:0": 41}})
    await store.append([verdict("a", 1)], tracking={"recorder": {"kz.kernels:0": 42, "x:1": 7}})

    assert await store.get_tracking("recorder") == {"kz.kernels:0": 42, "x:1": 7}
    assert await store.get_tracking("someone-else") == {}


async def test_a_buss_offset_store_keeps_the_positions_it_is_given(store: SqlEventStore) -> None:
    from kz_stream.runtime import StoreOffsets

    await store.append([verdict("a", 0)], tracking={"verifier": {"kz.kernels:0": 5, "x:1": 7}})
    offsets = StoreOffsets(store)
    await offsets.save_offsets("verifier", {"kz.kernels:0": 1})  # a new log's start
    assert await offsets.load_offsets("verifier") == {"kz.kernels:0": 1, "x:1": 7}


async def test_a_failing_transaction_writes_neither_events_nor_tracking(
    store: SqlEventStore,
) -> None:
    class Crash(Exception):
        pass

    with pytest.raises(Crash):
        async with store.transaction() as tx:
            await tx.append([verdict("a", 0)])
            await tx.set_tracking("consumer", {"p0": 1})
            assert await tx.get_tracking("consumer") == {"p0": 1}
            raise Crash

    assert await read_everything(store) == []
    assert await store.get_tracking("consumer") == {}


async def test_a_concurrency_error_inside_a_transaction_undoes_only_that_batch(
    store: SqlEventStore,
) -> None:
    await store.append([verdict("a", 0)])

    async with store.transaction() as tx:
        await tx.append([verdict("b", 0)])
        with pytest.raises(ConcurrencyError):
            await tx.append([verdict("c", 0), verdict("a", 0)])
        await tx.set_tracking("consumer", {"p0": 2})

    assert [r.event.stream_id for r in await read_everything(store)] == ["a", "b"]
    assert await store.get_tracking("consumer") == {"p0": 2}


# -- projections ----------------------------------------------------------------------------


def kernel_history() -> list[Event]:
    """Two kernels' lives, one with a v1 KernelGenerated and one judged before it arrived."""
    def at(stream: str, version: int, payload: KernelGenerated | KernelVerified) -> Event:
        return new_event(payload, stream_id=stream, stream_version=version,
                         event_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{stream}/{version}"),
                         occurred_at=T0)

    gen1 = at("kernel-1", 0, KernelGenerated(kernel_id="k1", module_id="m", group_id="g",
                                             backend="cuda", source="...", policy_version=3))
    v1_payload = {k: v for k, v in gen1.payload.items() if k != "backend"} | {"language": "cuda"}
    return [
        gen1.model_copy(update={"schema_version": 1, "payload": v1_payload}),
        at("kernel-1", 1, KernelVerified(kernel_id="k1", module_id="m", group_id="g",
                                         status=VerdictStatus.INCORRECT)),
        at("verdicts-2", 0, KernelVerified(kernel_id="k2", module_id="m", group_id="g",
                                           status=VerdictStatus.CORRECT, speedup=2.5)),
        at("kernel-1", 2, KernelVerified(kernel_id="k1", module_id="m", group_id="g",
                                         status=VerdictStatus.CORRECT, speedup=1.5)),
        at("kernel-2", 0, KernelGenerated(kernel_id="k2", module_id="m", group_id="g",
                                          backend="triton", source="...", policy_version=4)),
    ]


async def test_replaying_from_zero_twice_gives_the_same_projection_hash(
    store: SqlEventStore,
) -> None:
    history_ = kernel_history()
    await store.append(history_)
    projection = KernelsProjection()

    first = await rebuild(store, projection, batch_size=2)
    first_hash = await projection_hash(store, projection)
    second = await rebuild(store, projection, batch_size=3)

    assert first.events == second.events == len(history_)
    assert await projection_hash(store, projection) == first_hash
    async with store.transaction() as tx:
        rows = (await tx.execute(select(kernels).order_by(kernels.c.kernel_id))).mappings().all()
    assert [(r["kernel_id"], r["backend"], r["policy_version"], r["status"], r["speedup"],
             r["verdict_count"]) for r in rows] == [
        ("k1", "cuda", 3, "correct", 1.5, 2),
        ("k2", "triton", 4, "correct", 2.5, 1),
    ]


async def test_catching_up_in_steps_builds_what_one_rebuild_builds(store: SqlEventStore) -> None:
    history_ = kernel_history()
    projection = KernelsProjection()
    await store.append(history_[:2])
    await catch_up(store, projection)
    await store.append(history_[2:])

    resumed = await catch_up(store, projection, batch_size=1)
    stepwise_hash = await projection_hash(store, projection)
    await rebuild(store, projection)

    assert resumed.events == len(history_) - 2
    assert resumed.position == await store.last_position()
    assert await store.get_tracking(tracking_name(projection)) == {
        "global_position": resumed.position
    }
    assert await projection_hash(store, projection) == stepwise_hash


# -- schema ---------------------------------------------------------------------------------


def test_alembic_upgrade_of_an_empty_database_yields_exactly_the_schema_metadata(
    store_url: str,
) -> None:
    upgrade(store_url)
    upgrade(store_url)  # at head already: a no-op

    engine = create_engine(sync_url(store_url))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diffs = compare_metadata(context, metadata)
            head = context.get_current_revision()
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    # SQLite has no identity columns (its INTEGER PRIMARY KEY is the rowid); reflection
    # cannot report the Identity() the metadata declares for Postgres.
    diffs = [d for d in diffs if not (conn.dialect.name == "sqlite" and "Identity()" in repr(d))]
    assert diffs == []
    assert head == "0002"
    assert {"events", "tracking", "alembic_version"} <= tables
