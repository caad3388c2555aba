"""The embedded bus: Kafka's model (partitioned append-only logs, consumer groups with
committed offsets) inside one process, for the embedded default and unit tests.

Semantics follow the Kafka adapter: records are partitioned by a stable hash of the key
(murmur2, as Kafka's default partitioner, so a key lands on the same partition number in
both adapters), a group's partitions are spread round-robin over its live subscriptions and
rebalanced (eagerly: everyone gives everything up, then gets a new share) whenever one joins
or stops, and delivery, commits, retries and dead letters run through the same
``ConsumerCore``. Records are validated on consumption exactly as they are from Kafka.

Compacted topics keep every record, but a read skips a record whose key has a later
record in the partition: a reader sees what a fully compacted log would hold, while a live
tail still sees each update as it is appended. Nothing is ever deleted (no retention).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Unpack

from aiokafka.partitioner import murmur2

from kz_stream.bus._consumer import TP, ConsumerConfig, ConsumerCore
from kz_stream.bus._port import (
    Bus,
    BusMessage,
    Handler,
    SubscribeOptions,
    Subscription,
    TopicSpec,
    event_headers,
)
from kz_stream.events import Event, encode_event

__all__ = ["InMemoryBus"]

log = logging.getLogger("kz_stream.bus")


def partition_for(key: bytes | None, partitions: int, counter: itertools.count[int]) -> int:
    """Kafka's default choice for a keyed record; round-robin for records without a key."""
    if key is None:
        return next(counter) % partitions
    return int(murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass(slots=True)
class _Record:
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]


@dataclass
class _Topic:
    name: str
    partitions: int
    compacted: bool
    logs: list[list[_Record]] = field(init=False)
    # Per partition, the offset of the latest record for each key (compacted topics only).
    latest: list[dict[bytes, int]] = field(init=False)
    watchers: set[asyncio.Event] = field(default_factory=set)
    counter: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.logs = [[] for _ in range(self.partitions)]
        self.latest = [{} for _ in range(self.partitions)]

    def append(self, key: bytes | None, value: bytes, headers: dict[str, bytes]) -> TP:
        p = partition_for(key, self.partitions, self.counter)
        log_ = self.logs[p]
        if self.compacted and key is not None:
            self.latest[p][key] = len(log_)
        log_.append(_Record(key, value, headers))
        return (self.name, p)

    def notify(self) -> None:
        for w in self.watchers:
            w.set()


class _Group:
    """A consumer group: its members, their assignment and its committed offsets."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.members: list[_MemorySubscription] = []
        self.committed: dict[TP, int] = {}
        self.lock = asyncio.Lock()

    async def join(self, member: _MemorySubscription) -> None:
        async with self.lock:
            self.members.append(member)
            await self._rebalance()

    async def leave(self, member: _MemorySubscription) -> None:
        async with self.lock:
            if member in self.members:
                self.members.remove(member)
                await self._rebalance()

    async def _rebalance(self) -> None:
        members = list(self.members)
        await asyncio.gather(*(m._revoke_all() for m in members))
        shares: dict[int, list[TP]] = {id(m): [] for m in members}
        topics = sorted({t for m in members for t in m.topics})
        cycle = itertools.cycle(members)
        # Round-robin over all (topic, partition) pairs, skipping members that do not
        # subscribe to the topic (Kafka's RoundRobinAssignor).
        for topic in topics:
            n = members[0].bus._topic(topic).partitions
            for p in range(n):
                for _ in range(len(members)):
                    m = next(cycle)
                    if topic in m.topics:
                        shares[id(m)].append((topic, p))
                        break
        for m in members:
            await m._assign(shares[id(m)])


class _MemorySubscription(ConsumerCore):
    def __init__(self, bus: InMemoryBus, group: _Group, config: ConsumerConfig) -> None:
        super().__init__(config, bus.publish_raw,
                         logs_outlive_the_process=bus.logs_outlive_the_process)
        self.bus = bus
        self._group_state = group
        self._positions: dict[TP, int] = {}
        self._paused = False
        self._wake = asyncio.Event()
        self._fetch_task: asyncio.Task[None] | None = None
        self._rr = 0

    async def _start(self) -> None:
        for t in self.topics:
            self.bus._topic(t).watchers.add(self._wake)
        self._start_worker()
        self._fetch_task = asyncio.create_task(
            self._fetch_loop(), name=f"kz-mem-fetch:{self.group}"
        )
        await self._group_state.join(self)

    async def _assign(self, partitions: Sequence[TP]) -> None:
        if self._stopping:
            return
        offsets = self._offsets
        try:
            # A store outage is waited out: the assignment is not lost to it.
            stored = (
                await self._wait_out(lambda: offsets.load_offsets(self.group)) if offsets else {}
            )
        except Exception as e:
            self._fail(e)
            return
        committed = self._group_state.committed
        seek, from_start = self._start_positions(partitions, committed, stored)
        try:
            # The store's positions were of another log: it holds the new log's now.
            await self._save_offsets(dict.fromkeys(from_start, 0))
        except Exception as e:
            self._fail(e)
            return
        positions: dict[TP, int] = {}
        for tp in partitions:
            if tp in from_start:
                positions[tp] = 0
            elif tp in seek:
                positions[tp] = seek[tp]
            elif tp in committed:
                positions[tp] = committed[tp]
            elif self._from_beginning:
                positions[tp] = 0
            else:
                positions[tp] = len(self.bus._topic(tp[0]).logs[tp[1]])
        self._positions = positions
        self._settle(frozenset(partitions))
        self._wake.set()

    async def _revoke_all(self) -> None:
        await super()._revoke_all()
        self._positions = {}

    def _poll(self) -> bool:
        """Moves up to max_batch available records into a batch; False if none."""
        if not self._positions:
            return False
        batch = self._new_batch()
        budget = self._max_batch
        tps = list(self._positions)
        # Rotate the starting partition so one busy partition cannot starve the others.
        self._rr = (self._rr + 1) % len(tps)
        for tp in tps[self._rr:] + tps[: self._rr]:
            if budget == 0:
                break
            topic = self.bus._topics[tp[0]]
            log_ = topic.logs[tp[1]]
            pos = self._positions[tp]
            end = min(len(log_), pos + budget)
            if pos >= end:
                continue
            latest = topic.latest[tp[1]] if topic.compacted else None
            for off in range(pos, end):
                r = log_[off]
                if latest is not None and r.key is not None and latest[r.key] > off:
                    # Superseded in a compacted topic: skipped, but its offset is passed.
                    batch.positions[tp] = off + 1
                    continue
                batch.add(tp[0], tp[1], off, r.key, r.value, r.headers)
            self._positions[tp] = end
            budget -= end - pos
        if not batch.positions:
            return False
        # A batch of only superseded records still goes through the queue, so that its
        # offsets are committed in order after the batches before it.
        self._enqueue(batch)
        return True

    async def _fetch_loop(self) -> None:
        while True:
            self._wake.clear()
            if self._paused or self._settling or not self._poll():
                await self._wake.wait()
            else:
                # Yield between batches so publishers and the worker get the loop.
                await asyncio.sleep(0)

    def _on_queue_full(self) -> None:
        # Nothing buffered elsewhere: not polling the log is the whole of pausing.
        self._paused = True
        self.stats.pauses += 1

    def _on_room(self) -> None:
        self._paused = False
        self._wake.set()

    async def _commit(self, positions: dict[TP, int]) -> bool:
        self._group_state.committed.update(positions)
        return True

    def _log_ends(self) -> dict[TP, int]:
        return {tp: len(self.bus._topic(tp[0]).logs[tp[1]]) for tp in self._assigned}

    async def _stop_fetching(self) -> None:
        for t in self.topics:
            self.bus._topic(t).watchers.discard(self._wake)
        if self._fetch_task is not None:
            self._fetch_task.cancel()
            await asyncio.wait({self._fetch_task})

    async def _leave(self) -> None:
        self.bus._subscriptions.discard(self)
        await self._group_state.leave(self)


class InMemoryBus(Bus):
    """The embedded bus (see module doc). Topics that do not exist when published to or
    subscribed to are created with ``default_partitions``. On a rebalance a member's
    running batch gets ``revoke_timeout`` seconds to finish before it is cancelled."""

    logs_outlive_the_process = False

    def __init__(self, *, default_partitions: int = 4, revoke_timeout: float | None = 20.0) -> None:
        self.default_partitions = default_partitions
        self.revoke_timeout = revoke_timeout
        self._topics: dict[str, _Topic] = {}
        self._groups: dict[str, _Group] = {}
        self._subscriptions: set[_MemorySubscription] = set()

    async def start(self) -> None:
        """Nothing to start; present for the port."""

    async def close(self) -> None:
        subs = list(self._subscriptions)
        await asyncio.gather(*(s.stop() for s in subs))

    def _topic(self, name: str) -> _Topic:
        t = self._topics.get(name)
        if t is None:
            t = self._topics[name] = _Topic(name, self.default_partitions, compacted=False)
        return t

    async def read_topic(self, topic: str) -> list[BusMessage]:
        return [
            BusMessage(topic, p, offset, r.key, r.value, dict(r.headers))
            for p, records in enumerate(self._topic(topic).logs)
            for offset, r in enumerate(records)
        ]

    async def ping(self, topics: Sequence[str] = ()) -> list[str]:
        """Always answers; topics spring into being when used, so none is missing."""
        return []

    async def create_topics(self, topics: Sequence[TopicSpec]) -> None:
        for spec in topics:
            if spec.name not in self._topics:
                self._topics[spec.name] = _Topic(spec.name, spec.partitions, spec.compacted)

    async def publish_many(self, topic: str, events: Sequence[Event]) -> None:
        t = self._topic(topic)
        for event in events:
            t.append(event.stream_id.encode(), encode_event(event), event_headers(event))
        t.notify()
        await asyncio.sleep(0)

    async def publish_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> None:
        t = self._topic(topic)
        t.append(key, value, dict(headers or {}))
        t.notify()
        # A publisher in a tight loop must not starve the consumers on the same loop.
        await asyncio.sleep(0)

    async def subscribe(
        self, group: str, topics: Sequence[str], handler: Handler,
        **options: Unpack[SubscribeOptions],
    ) -> Subscription:
        """Joins ``group`` (see the port); returns once this member has its share."""
        for t in topics:
            self._topic(t)
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(group)
        config = ConsumerConfig.of(group, topics, handler, self.revoke_timeout, options)
        sub = _MemorySubscription(self, g, config)
        self._subscriptions.add(sub)
        await sub._start()
        return sub
