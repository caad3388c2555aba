"""One contract for both bus adapters: the in-memory bus and KafkaBus on the tansu broker.

Every test waits on conditions with deadlines; no sleep is an assertion. Topic and group
names are unique per test, so tests share one broker without seeing each other's records.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from kz_stream.bus import (
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_EVENT_ID,
    HEADER_ORIGINAL_OFFSET,
    HEADER_ORIGINAL_PARTITION,
    HEADER_ORIGINAL_TOPIC,
    HEADER_SCHEMA_VERSION,
    HEADER_TYPE,
    Bus,
    BusMessage,
    InfrastructureError,
    InMemoryBus,
    KafkaBus,
    Subscription,
    TopicSpec,
    offsets_after,
    open_bus,
)
from kz_stream.dlq import HEADER_REDRIVEN_FROM, list_dead_letters, redrive
from kz_stream.events import Event, KernelVerified, encode_event, new_event
from kz_stream.faults import DependencyUnavailable, Unrecoverable

pytestmark = pytest.mark.timeout(120)

# Short group timers: tansu completes a JoinGroup after about half the session timeout.
KAFKA_TEST_OPTIONS: dict[str, Any] = {
    "session_timeout_ms": 2000,
    "heartbeat_interval_ms": 100,
    "rebalance_timeout_ms": 3000,
    "revoke_timeout": 5.0,
    "linger_ms": 1,
}

MakeBus = Callable[..., Awaitable[Bus]]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def verdict(i: int, stream: str) -> Event:
    return new_event(
        KernelVerified(
            kernel_id=f"kernel-{i}", module_id="module-1", group_id="group-1", status="correct",
            speedup=1.0 + i / 100,
        ),
        stream_id=stream,
        stream_version=i,
        producer="contract-test",
        correlation_id="run-test",
    )


async def wait_for(cond: Callable[[], bool], what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


class Collector:
    """A handler that records every message it applies."""

    def __init__(self) -> None:
        self.messages: list[BusMessage] = []
        self.batches = 0

    async def __call__(self, batch: Sequence[BusMessage]) -> None:
        self.batches += 1
        self.messages.extend(batch)

    def ids(self) -> list[uuid.UUID]:
        return [m.event.event_id for m in self.messages if m.event is not None]


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
async def make_bus(request: pytest.FixtureRequest) -> AsyncIterator[MakeBus]:
    """Makes started buses of the parametrized kind; closes them after the test."""
    kind: str = request.param
    made: list[Bus] = []
    bootstrap = request.getfixturevalue("kafka_bootstrap") if kind == "kafka" else ""

    async def make(**kafka_options: Any) -> Bus:
        bus: Bus
        if kind == "memory":
            bus = InMemoryBus()
        else:
            bus = KafkaBus(
                bootstrap, client_id=unique("contract"), **{**KAFKA_TEST_OPTIONS, **kafka_options}
            )
        await bus.start()
        made.append(bus)
        return bus

    make.kind = kind  # type: ignore[attr-defined]
    yield make
    for bus in made:
        await bus.close()


async def dead_letters(bus: Bus, topic: str, n: int) -> list[BusMessage]:
    """Reads ``n`` raw records from a dead-letter topic."""
    raw = Collector()
    sub = await bus.subscribe(unique("dlq-reader"), [topic], raw, decode=False)
    try:
        await wait_for(lambda: len(raw.messages) >= n, f"{n} dead letters")
    finally:
        await sub.stop()
    return raw.messages


def covers(subs: Sequence[Subscription], topic: str, partitions: int) -> bool:
    """Every partition owned by exactly one of ``subs``, each of which owns some."""
    owned = [s.assignment() for s in subs]
    union = frozenset().union(*owned)
    return (
        all(owned)
        and sum(len(o) for o in owned) == partitions
        and union == {(topic, p) for p in range(partitions)}
    )


async def test_roundtrip_keys_headers_and_per_key_order(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic = unique("roundtrip")
    await bus.create_topics([TopicSpec(topic, partitions=4)])
    streams = [f"kernel-{i}" for i in range(6)]
    events = [verdict(i, streams[i % len(streams)]) for i in range(60)]
    await bus.publish_many(topic, events[:50])
    for e in events[50:]:
        await bus.publish(topic, e, headers={"trace": b"t-" + str(e.stream_version).encode()})
    custom = verdict(99, "kernel-custom")
    await bus.publish(topic, custom, key="explicit-key")

    got = Collector()
    sub = await bus.subscribe(unique("g"), [topic], got)
    await wait_for(lambda: len(got.messages) >= 61, "61 messages")
    await sub.stop()

    by_id = {m.event.event_id: m for m in got.messages if m.event is not None}
    assert len(got.messages) == 61 and len(by_id) == 61
    for e in [*events, custom]:
        m = by_id[e.event_id]
        assert m.event == e
        assert m.value == encode_event(e)
        assert m.headers[HEADER_TYPE] == b"KernelVerified"
        assert m.headers[HEADER_SCHEMA_VERSION] == b"1"
        assert m.headers[HEADER_EVENT_ID] == str(e.event_id).encode()
    assert by_id[custom.event_id].key == b"explicit-key"
    for e in events[50:]:
        assert by_id[e.event_id].headers["trace"] == b"t-" + str(e.stream_version).encode()
    # Per key: one partition, delivered in publish order, consecutive offsets increasing.
    for s in streams:
        mine = [m for m in got.messages if m.key == s.encode()]
        assert len({m.partition for m in mine}) == 1
        assert [m.event.stream_version for m in mine if m.event] == sorted(
            e.stream_version for e in events if e.stream_id == s
        )
        assert [m.offset for m in mine] == sorted(m.offset for m in mine)


async def test_group_splits_partitions_and_rebalances_without_loss(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic, group = unique("split"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=4)])
    a, b = Collector(), Collector()
    sub_a = await bus.subscribe(group, [topic], a)
    sub_b = await bus.subscribe(group, [topic], b)
    await wait_for(lambda: covers([sub_a, sub_b], topic, 4), "both members to share 4 partitions")

    first = [verdict(i, f"kernel-{i % 40}") for i in range(200)]
    await bus.publish_many(topic, first)
    await wait_for(lambda: len(a.messages) + len(b.messages) >= 200, "first 200 events")
    assert a.messages and b.messages, "both members get work"
    parts_a = {m.partition for m in a.messages}
    parts_b = {m.partition for m in b.messages}
    assert not parts_a & parts_b
    assert {(topic, p) for p in parts_a} <= sub_a.assignment()

    await sub_b.stop()  # graceful: finishes and commits, then leaves the group
    await wait_for(lambda: covers([sub_a], topic, 4), "the survivor to own every partition")
    second = [verdict(i, f"kernel-{i % 40}") for i in range(200, 400)]
    await bus.publish_many(topic, second)
    want = {e.event_id for e in first + second}
    await wait_for(lambda: set(a.ids()) | set(b.ids()) >= want, "all 400 events")
    counts = Counter(a.ids() + b.ids())
    assert set(counts) == want
    assert max(counts.values()) == 1, "a graceful hand-over redelivers nothing"
    assert {m.partition for m in a.messages[-200:]} == {0, 1, 2, 3}
    await sub_a.stop()


async def test_rebalance_while_busy_loses_nothing(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic, group = unique("busy"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=4)])
    events = [verdict(i, f"kernel-{i % 16}") for i in range(120)]
    await bus.publish_many(topic, events)
    a, b = Collector(), Collector()

    def slow(into: Collector) -> Callable[[Sequence[BusMessage]], Awaitable[None]]:
        async def handler(batch: Sequence[BusMessage]) -> None:
            await asyncio.sleep(0.05)  # work in progress when the rebalance comes
            await into(batch)

        return handler

    sub_a = await bus.subscribe(group, [topic], slow(a), max_batch=4, max_in_flight=2)
    await wait_for(lambda: a.batches >= 2, "the first member to be busy")
    sub_b = await bus.subscribe(group, [topic], slow(b), max_batch=4, max_in_flight=2)
    want = {e.event_id for e in events}
    await wait_for(lambda: set(a.ids()) | set(b.ids()) >= want, "all 120 events", within=60)
    counts = Counter(a.ids() + b.ids())
    await sub_a.stop()
    await sub_b.stop()
    assert set(counts) == want
    # The running batch finishes and commits before its partitions move; the queued ones
    # are refetched from the committed offsets, so nothing is applied twice either.
    assert max(counts.values()) == 1
    assert sub_a.stats.assignments >= 2 and sub_a.stats.dropped_batches >= 1


async def test_commit_only_after_handler_returns(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic, group = unique("commit"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2)])
    events = [verdict(i, f"kernel-{i % 3}") for i in range(10)]
    await bus.publish_many(topic, events)

    started = asyncio.Event()
    seen_first: list[BusMessage] = []

    async def stuck(batch: Sequence[BusMessage]) -> None:
        seen_first.extend(batch)
        started.set()
        await asyncio.Event().wait()  # never returns: the effect never becomes durable

    sub1 = await bus.subscribe(group, [topic], stuck, max_batch=100)
    await asyncio.wait_for(started.wait(), 30)
    await sub1.stop(grace=0)  # cancels the running batch: nothing committed

    again = Collector()
    sub2 = await bus.subscribe(group, [topic], again)
    await wait_for(lambda: len(set(again.ids())) >= 10, "redelivery of all 10 events")
    assert {m.event.event_id for m in seen_first if m.event} <= set(again.ids())
    await sub2.stop()  # handler returned: its offsets are committed

    # A third member starts after the committed offsets and sees only what is new.
    later = verdict(10, "kernel-0")
    third = Collector()
    sub3 = await bus.subscribe(group, [topic], third)
    await bus.publish(topic, later)
    await wait_for(lambda: len(third.messages) >= 1, "the new event")
    await sub3.stop()
    assert third.ids() == [later.event_id]


class DictOffsets:
    """An OffsetStore the handler writes to, as a consumer writing to the database does."""

    def __init__(self, positions: dict[str, int] | None = None) -> None:
        self.positions = dict(positions or {})
        self.loads = 0

    async def load_offsets(self, group: str) -> dict[str, int]:
        self.loads += 1
        return dict(self.positions)

    async def save_offsets(self, group: str, positions: Mapping[str, int]) -> None:
        self.positions.update(positions)


def recording(
    into: Collector, store: DictOffsets
) -> Callable[[Sequence[BusMessage]], Awaitable[None]]:
    """A handler that applies a batch and writes its offsets to ``store``, "in the same
    transaction", as a consumer writing to the database does."""

    async def handler(batch: Sequence[BusMessage]) -> None:
        await into(batch)
        store.positions.update(offsets_after(batch))

    return handler


async def test_offset_store_positions_win_on_assignment(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic, group = unique("offsets"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2)])
    # Keys chosen by partition so the test knows where each event lands.
    events = [verdict(i, f"kernel-{i % 8}") for i in range(40)]
    await bus.publish_many(topic, events)

    # The group reads everything once, committing as it goes.
    store, first = DictOffsets(), Collector()
    sub = await bus.subscribe(group, [topic], recording(first, store), offsets=store)
    await wait_for(lambda: len(first.messages) >= 40, "the first read")
    await sub.stop()
    offsets0 = sorted(m.offset for m in first.messages if m.partition == 0)
    assert len(offsets0) > 5
    n1 = len(first.messages) - len(offsets0)

    # The store is the truth even where the group's committed offsets are ahead of it
    # (say, the database was restored): partition 0 is read again from 5. A partition the
    # store does not know starts from the committed offset: partition 1 has nothing new
    # until one more event lands there.
    store.positions = {f"{topic}:0": 5}
    replay = Collector()
    sub = await bus.subscribe(group, [topic], recording(replay, store), offsets=store)
    await wait_for(lambda: len(replay.messages) >= len(offsets0) - 5, "partition 0 from 5")
    key1 = next(m.key for m in first.messages if m.partition == 1)
    assert key1 is not None
    later = verdict(40, key1.decode())
    await bus.publish(topic, later)
    await wait_for(lambda: later.event_id in replay.ids(), "the new event on partition 1")
    await sub.stop()
    assert store.loads >= 2
    assert sorted(m.offset for m in replay.messages if m.partition == 0) == offsets0[5:]
    assert [m.offset for m in replay.messages if m.partition == 1] == [n1]

    # And where it is behind on the other partition too.
    store.positions[f"{topic}:1"] = 2
    again = Collector()
    sub = await bus.subscribe(group, [topic], recording(again, store), offsets=store)
    await wait_for(lambda: len(again.messages) >= n1 + 1 - 2, "replay of partition 1")
    await sub.stop()
    assert sorted(m.offset for m in again.messages) == list(range(2, n1 + 1))


async def test_offset_store_positions_in_a_log_the_group_has_no_offsets_of_read_it_all(
    make_bus: MakeBus, caplog: pytest.LogCaptureFixture,
) -> None:
    """Positions a store kept from another log (a broker that lost its storage, and the
    group's offsets with it; an embedded bus of an earlier process) skip nothing."""
    bus = await make_bus()
    topic, group = unique("newlog"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2)])
    events = [verdict(i, f"kernel-{i % 8}") for i in range(40)]
    await bus.publish_many(topic, events)
    # Below both logs' ends, so the consumer cannot tell by the log's length.
    store, got = DictOffsets({f"{topic}:0": 5, f"{topic}:1": 5}), Collector()
    with caplog.at_level(logging.INFO, logger="kz_stream.bus"):
        sub = await bus.subscribe(group, [topic], recording(got, store), offsets=store)
        await wait_for(lambda: len(got.messages) >= 40, "every event", within=15)
        await sub.stop()
    assert Counter(got.ids()) == Counter(e.event_id for e in events)
    # A broker that lost its storage is news; the embedded bus of a resumed run is not.
    said = [r for r in caplog.records if "from the start" in r.getMessage()]
    assert bus.logs_outlive_the_process is (make_bus.kind == "kafka")  # type: ignore[attr-defined]
    expected = logging.WARNING if bus.logs_outlive_the_process else logging.INFO
    assert said and {r.levelno for r in said} == {expected}


async def test_a_new_logs_dead_lettered_start_leaves_no_old_position_in_the_store(
    make_bus: MakeBus,
) -> None:
    """The store held a position of another log; the new log's first record is dead-
    lettered, so no handler writes an offset. The store must hold the new log's position,
    or the next assignment, trusting it over the group's commit, skips records."""
    bus = await make_bus()
    topic, dlq, group = unique("newlog"), unique("dlq"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1), TopicSpec(dlq, partitions=1)])
    await bus.publish_raw(topic, b"not json", key=b"junk")  # offset 0
    store, got = DictOffsets({f"{topic}:0": 5}), Collector()
    sub = await bus.subscribe(group, [topic], recording(got, store), offsets=store,
                              dead_letter_topic=dlq)
    await wait_for(lambda: sub.stats.dead_lettered == 1, "the dead letter")
    await sub.stop()
    assert store.positions == {f"{topic}:0": 1}
    events = [verdict(i, "kernel-0") for i in range(7)]  # offsets 1..7
    await bus.publish_many(topic, events)
    sub = await bus.subscribe(group, [topic], recording(got, store), offsets=store,
                              dead_letter_topic=dlq)
    await wait_for(lambda: len(got.messages) >= 7, "every event after the dead letter")
    await sub.stop()
    assert got.ids() == [e.event_id for e in events]
    assert store.positions == {f"{topic}:0": 8}


async def test_slow_handler_keeps_partitions_and_gets_each_event_once(
    make_bus: MakeBus,
) -> None:
    kafka = make_bus.kind == "kafka"  # type: ignore[attr-defined]
    max_poll_ms = 2000
    bus = await make_bus(max_poll_interval_ms=max_poll_ms)
    topic, group = unique("slow"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2)])
    events = [verdict(i, f"kernel-{i % 4}") for i in range(40)]
    await bus.publish_many(topic, events)

    got = Collector()
    slow_s = max_poll_ms / 1000 * 1.5 if kafka else 0.3

    async def slow(batch: Sequence[BusMessage]) -> None:
        if got.batches == 0:
            await asyncio.sleep(slow_s)  # longer than max.poll.interval
        await got(batch)

    sub = await bus.subscribe(group, [topic], slow, max_batch=5, max_in_flight=1)
    await wait_for(lambda: len(got.messages) >= 40, "all 40 events", within=60)
    assignment = sub.assignment()
    stats = sub.stats
    await sub.stop()
    assert Counter(got.ids()) == Counter(e.event_id for e in events)  # exactly once each
    assert stats.pauses >= 1, "fetching paused while the handler was busy"
    assert stats.assignments == 1, "the partitions were never taken away"
    assert assignment == {(topic, 0), (topic, 1)}


async def test_batches_that_waited_behind_a_busy_handler_reach_it_together_when_asked(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, group = unique("merge"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1)])
    events = [verdict(i, "kernel-0") for i in range(11)]
    release = asyncio.Event()
    calls: list[list[uuid.UUID]] = []

    async def busy_first(batch: Sequence[BusMessage]) -> None:
        calls.append([m.event.event_id for m in batch if m.event is not None])
        if len(calls) == 1:
            await release.wait()  # a long model call: the rest arrive meanwhile

    sub = await bus.subscribe(group, [topic], busy_first, max_batch=8, max_in_flight=16,
                              merge_waiting=True)
    await bus.publish(topic, events[0])
    await wait_for(lambda: len(calls) == 1, "the first call")
    for i, e in enumerate(events[1:], start=1):  # one at a time: a batch each
        await bus.publish(topic, e)
        await wait_for(lambda i=i: sub.describe_state()["queued_messages"] == i,  # type: ignore[misc]
                       f"{i} messages waiting")
    assert sub.describe_state()["queued"] == 10
    release.set()
    await wait_for(lambda: sum(map(len, calls)) == 11, "all 11 events")
    await sub.stop()
    # Eight waiting batches in one call (max_batch), the other two in the next, in order.
    assert [len(c) for c in calls] == [1, 8, 2]
    assert [i for c in calls for i in c] == [e.event_id for e in events]
    assert sub.stats.batches == 3


async def test_poison_event_goes_to_dead_letter_and_consumer_goes_on(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, dlq, group = unique("poison"), unique("dlq"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2), TopicSpec(dlq, partitions=1)])
    events = [verdict(i, f"kernel-{i % 5}") for i in range(30)]
    poison = events[13]
    await bus.publish_many(topic, events)

    applied = Collector()
    calls = Counter[uuid.UUID]()

    async def handler(batch: Sequence[BusMessage]) -> None:
        for m in batch:
            assert m.event is not None
            calls[m.event.event_id] += 1
        if any(m.event is not None and m.event.event_id == poison.event_id for m in batch):
            raise InfrastructureError("disk full while writing kernel-13")
        await applied(batch)

    sub = await bus.subscribe(
        group, [topic], handler, max_retries=2, retry_backoff=0.01, dead_letter_topic=dlq
    )
    want = {e.event_id for e in events} - {poison.event_id}
    await wait_for(lambda: set(applied.ids()) >= want, "the 29 good events")
    [letter] = await dead_letters(bus, dlq, 1)
    assert letter.value == encode_event(poison)
    assert letter.key == poison.stream_id.encode()
    assert letter.headers[HEADER_ERROR] == b"InfrastructureError: disk full while writing kernel-13"
    assert letter.headers[HEADER_ERROR_TYPE] == b"InfrastructureError"
    assert letter.headers[HEADER_ORIGINAL_TOPIC] == topic.encode()
    assert letter.headers[HEADER_EVENT_ID] == str(poison.event_id).encode()
    original = next(m for m in applied.messages if m.key == poison.stream_id.encode())
    assert letter.headers[HEADER_ORIGINAL_PARTITION] == str(original.partition).encode()
    assert int(letter.headers[HEADER_ORIGINAL_OFFSET]) >= 0
    assert poison.event_id not in applied.ids()
    assert calls[poison.event_id] >= 3  # retried before it was given up
    assert sub.stats.dead_lettered == 1

    # Still consuming after the dead letter.
    more = [verdict(i, f"kernel-{i % 5}") for i in range(30, 35)]
    await bus.publish_many(topic, more)
    await wait_for(lambda: set(applied.ids()) >= {e.event_id for e in more}, "later events")
    await sub.stop()


async def test_transient_failure_is_retried_not_dead_lettered(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic, group = unique("transient"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1)])
    events = [verdict(i, "kernel-0") for i in range(8)]
    await bus.publish_many(topic, events)
    applied = Collector()
    failures = 0

    async def flaky(batch: Sequence[BusMessage]) -> None:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise InfrastructureError("database restarting")
        await applied(batch)

    sub = await bus.subscribe(group, [topic], flaky, max_retries=3, retry_backoff=0.01)
    await wait_for(lambda: len(applied.messages) >= 8, "all 8 events")
    await sub.stop()
    assert applied.ids() == [e.event_id for e in events]  # in order, once
    assert sub.stats.retries == 2 and sub.stats.dead_lettered == 0


async def test_an_outage_is_waited_out_past_max_retries_and_nothing_is_dead_lettered(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, dlq, group = unique("outage"), unique("dlq"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1), TopicSpec(dlq, partitions=1)])
    events = [verdict(i, "kernel-0") for i in range(5)]
    await bus.publish_many(topic, events)
    applied = Collector()
    down = True
    calls = 0

    async def store_down(batch: Sequence[BusMessage]) -> None:
        nonlocal calls
        calls += 1
        if down:
            raise DependencyUnavailable("store", "connection refused")
        await applied(batch)

    sub = await bus.subscribe(
        group, [topic], store_down, max_retries=1, retry_backoff=0.01, max_backoff=0.05,
        dead_letter_topic=dlq,
    )
    # Many more calls than max_retries allows for a poison record: still not dead-lettered.
    await wait_for(lambda: calls > 10, "retries past max_retries")
    assert sub.outage == "store unreachable: DependencyUnavailable: connection refused"
    down = False
    await wait_for(lambda: len(applied.messages) >= 5, "all 5 events after the outage")
    await wait_for(lambda: sub.outage is None, "the outage to end")
    await sub.stop()
    assert applied.ids() == [e.event_id for e in events]
    assert sub.stats.dead_lettered == 0 and sub.stats.retries == 0
    assert sub.stats.outages == 1 and sub.stats.outage_retries >= 10


async def test_an_unrecoverable_handler_fails_the_subscription_and_loses_nothing(
    make_bus: MakeBus,
) -> None:
    """A handler whose own machinery is gone (the model engine of a Coder) is not the
    records' fault: no retry, no dead letter, nothing committed; the next member of the
    group gets every record."""
    bus = await make_bus()
    topic, dlq, group = unique("unrecoverable"), unique("dlq"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1), TopicSpec(dlq, partitions=1)])
    events = [verdict(i, "kernel-0") for i in range(4)]
    await bus.publish_many(topic, events)
    calls = 0

    async def engine_gone(batch: Sequence[BusMessage]) -> None:
        nonlocal calls
        calls += 1
        raise Unrecoverable("the engine process is gone")

    sub = await bus.subscribe(group, [topic], engine_gone, max_retries=3, retry_backoff=0.01,
                              dead_letter_topic=dlq)
    with pytest.raises(Unrecoverable, match="engine process is gone"):
        await asyncio.wait_for(sub.wait(), 30)
    assert calls == 1 and sub.stats.retries == 0 and sub.stats.dead_lettered == 0
    assert sub.failure == "Unrecoverable: the engine process is gone"
    await sub.stop()

    again = Collector()
    sub2 = await bus.subscribe(group, [topic], again)
    await wait_for(lambda: len(again.messages) >= 4, "all 4 events at the next member")
    await sub2.stop()
    assert again.ids() == [e.event_id for e in events]
    assert await list_dead_letters(bus, dlq) == []


async def test_malformed_records_go_to_dead_letter_with_the_field_named(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, dlq, group = unique("malformed"), unique("dlq"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1), TopicSpec(dlq, partitions=1)])
    good = verdict(1, "kernel-good")
    envelope = orjson.loads(encode_event(good))
    unknown_type = {**envelope, "type": "KernelTeleported"}
    bad_field = {**envelope, "payload": {**envelope["payload"], "status": "maybe"}}
    missing = {k: v for k, v in envelope.items() if k != "stream_id"}
    raw = [
        b"\x00\x01 not json",
        orjson.dumps(unknown_type),
        orjson.dumps(bad_field),
        orjson.dumps(missing),
    ]
    for i, value in enumerate(raw):
        await bus.publish_raw(topic, value, key=b"bad-%d" % i, headers={"origin": b"fuzz"})
    await bus.publish(topic, good)

    got = Collector()
    sub = await bus.subscribe(group, [topic], got, dead_letter_topic=dlq)
    await wait_for(lambda: len(got.messages) >= 1, "the good event")
    letters = await dead_letters(bus, dlq, 4)
    await sub.stop()
    assert got.ids() == [good.event_id]  # nothing malformed reached the handler
    by_key = {m.key: m for m in letters}
    errors = {k: m.headers[HEADER_ERROR].decode() for k, m in by_key.items()}
    assert errors[b"bad-0"].startswith("EventDecodeError: event: not valid JSON")
    assert errors[b"bad-1"] == "EventDecodeError: type: unknown event type 'KernelTeleported'"
    assert errors[b"bad-2"].startswith("EventDecodeError: payload.status: ")
    assert errors[b"bad-3"].startswith("EventDecodeError: stream_id: ")
    for i, value in enumerate(raw):
        m = by_key[b"bad-%d" % i]
        assert m.value == value
        assert m.headers["origin"] == b"fuzz"
        assert m.headers[HEADER_ORIGINAL_TOPIC] == topic.encode()
        assert m.headers[HEADER_ORIGINAL_OFFSET] == str(i).encode()
        assert m.headers[HEADER_ERROR_TYPE] == b"EventDecodeError"
    assert sub.stats.dead_lettered == 4


async def test_lag_counts_the_records_behind_the_last_committed_batch(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, group = unique("lag"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=1)])
    await bus.publish_many(topic, [verdict(i, "kernel-0") for i in range(10)])
    applied = Collector()
    release = asyncio.Event()

    async def first_then_wait(batch: Sequence[BusMessage]) -> None:
        if applied.batches:
            await release.wait()
        await applied(batch)

    sub = await bus.subscribe(group, [topic], first_then_wait, max_batch=2)
    assert sub.lag() is None  # nothing committed yet: unknown, not zero
    await wait_for(lambda: sub.stats.batches == 1, "the first batch committed")
    assert sub.lag() == 8
    release.set()
    await wait_for(lambda: len(applied.messages) == 10, "all 10 events")
    await wait_for(lambda: sub.lag() == 0, "no lag")
    await sub.stop()


async def test_a_member_describes_what_it_owns_and_how_far_it_has_read(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, group = unique("state"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2)])
    await bus.publish_many(topic, [verdict(i, f"kernel-{i % 2}") for i in range(10)])
    applied = Collector()
    sub = await bus.subscribe(group, [topic], applied)
    await wait_for(lambda: sub.stats.messages == 10 and sub.lag() == 0, "all 10 committed")
    state = sub.describe_state()
    await sub.stop()
    orjson.dumps(state)  # plain values: fit for a log line or a report
    assert state["group"] == group
    assert state["assigned"] == [f"{topic}:0", f"{topic}:1"]
    assert state["settling"] is False and state["failure"] is None
    assert sum(state["done"].values()) == 10  # next offsets to read, as committed
    assert state["stats"]["messages"] == 10


async def test_dead_letters_are_listed_with_their_origin_and_redriven_as_they_were(
    make_bus: MakeBus,
) -> None:
    bus = await make_bus()
    topic, dlq, group = unique("work"), unique("dlq"), unique("g")
    await bus.create_topics([TopicSpec(topic, partitions=2), TopicSpec(dlq, partitions=1)])
    assert await list_dead_letters(bus, dlq) == []  # an empty topic reads as empty
    poison, good = verdict(1, "kernel-poison"), verdict(2, "kernel-good")
    await bus.publish(topic, poison)
    await bus.publish(topic, good)
    await bus.publish_raw(topic, b"not json", key=b"junk")
    applied = Collector()
    fixed = False

    async def handler(batch: Sequence[BusMessage]) -> None:
        if not fixed and any(m.event is not None and m.event.event_id == poison.event_id
                             for m in batch):
            raise ValueError("cannot apply kernel-poison")
        await applied(batch)

    sub = await bus.subscribe(group, [topic], handler, max_retries=0, retry_backoff=0.01,
                              dead_letter_topic=dlq)
    await wait_for(lambda: sub.stats.dead_lettered == 2 and len(applied.messages) == 1,
                   "one applied, two dead-lettered")
    letters = await list_dead_letters(bus, dlq)
    by_key = {d.message.key: d for d in letters}
    assert set(by_key) == {b"kernel-poison", b"junk"}
    letter = by_key[b"kernel-poison"]
    assert letter.origin_topic == topic and letter.group == group
    assert letter.error == "ValueError: cannot apply kernel-poison"
    assert letter.event_type == "KernelVerified"
    assert letter.origin.startswith(f"{topic}:") and letter.message.value == encode_event(poison)

    fixed = True
    report = await redrive(bus, dlq, [letter])
    assert report.redriven == [letter] and report.skipped == []
    await wait_for(lambda: len(applied.messages) == 2, "the re-driven event applied")
    await sub.stop()
    again = applied.messages[-1]
    assert again.event is not None and again.event.event_id == poison.event_id
    assert again.headers[HEADER_REDRIVEN_FROM] == f"{dlq}:{letter.where}".encode()
    assert again.headers[HEADER_TYPE] == b"KernelVerified"
    assert HEADER_ERROR not in again.headers and HEADER_ORIGINAL_TOPIC not in again.headers


async def test_compacted_topic_delivers_the_latest_value_per_key(make_bus: MakeBus) -> None:
    bus = await make_bus()
    topic = unique("policy")
    await bus.create_topics([TopicSpec(topic, partitions=1, compacted=True)])
    events = [verdict(i, f"policy-{i % 2}") for i in range(6)]
    await bus.publish_many(topic, events)
    got = Collector()
    sub = await bus.subscribe(unique("g"), [topic], got)
    latest = {events[-2].event_id, events[-1].event_id}
    await wait_for(lambda: set(got.ids()) >= latest, "the latest value of each key")
    await sub.stop()
    # Kafka compacts lazily (a reader may see older values too); the embedded bus reads
    # as a fully compacted log.
    assert set(got.ids()) <= {e.event_id for e in events}
    if make_bus.kind == "memory":  # type: ignore[attr-defined]
        assert set(got.ids()) == latest
    if isinstance(bus, KafkaBus):
        admin = AIOKafkaAdminClient(bootstrap_servers=bus.bootstrap_servers)
        await admin.start()
        try:
            [resp] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        finally:
            await admin.close()
        entries = {e[0]: e[1] for e in resp.resources[0][4]}
        assert entries["cleanup.policy"] == "compact"


@pytest.mark.kafka
@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_compression_codecs_roundtrip(kafka_bootstrap: str, codec: str) -> None:
    bus = KafkaBus(
        kafka_bootstrap, client_id=unique("codec"), compression_type=codec, **KAFKA_TEST_OPTIONS
    )
    await bus.start()
    try:
        topic = unique(f"codec-{codec}")
        await bus.create_topics([TopicSpec(topic, partitions=2)])
        events = [verdict(i, f"kernel-{i % 7}") for i in range(300)]
        await bus.publish_many(topic, events)
        await bus.publish(topic, verdict(300, "kernel-single"))
        got = Collector()
        sub = await bus.subscribe(unique("g"), [topic], got)
        await wait_for(lambda: len(got.messages) >= 301, f"301 {codec} records")
        await sub.stop()
        assert {m.value for m in got.messages} >= {encode_event(e) for e in events}
    finally:
        await bus.close()


async def test_open_bus_urls() -> None:
    assert open_bus("memory://shared") is open_bus("memory://shared")
    assert open_bus("memory://") is not open_bus("memory://other")
    kafka = open_bus("kafka://h1:9092,h2:9092?compression=zstd&client_id=svc")
    assert isinstance(kafka, KafkaBus)
    assert kafka.bootstrap_servers == "h1:9092,h2:9092"
    assert kafka.client_id == "svc"
    with pytest.raises(ValueError, match="scheme"):
        open_bus("redis://localhost")
    with pytest.raises(ValueError, match="unknown option"):
        open_bus("kafka://h:1?acks=0")
