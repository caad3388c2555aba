"""The Kafka adapter on aiokafka.

Publishing builds record batches per partition itself (``create_batch``/``send_batch``,
partitioned with Kafka's default murmur2 of the key), which is ~3x faster than one
``send()`` per record, and waits for every batch's acknowledgement.

Consuming: one ``AIOKafkaConsumer`` per subscription, auto-commit off. A fetch task keeps
calling ``getmany()`` (aiokafka measures ``max_poll_interval`` between those calls, so a
handler that runs for minutes never costs the partitions) and queues decoded batches. While
``max_in_flight`` batches wait, the fetch task holds for a moment and then pauses the
assigned partitions, polling on (it gets nothing, and stays a live member) until the worker
drains one and resumes them. Offsets are committed after the handler returns. On
revocation the batches not started are dropped and the running one may finish and commit
(up to ``revoke_timeout``, then it is cancelled); aiokafka gives every new assignment fresh
positions from the committed offsets, so nothing dropped is lost. On assignment, positions
held by an ``OffsetStore`` win, and partitions of a new log (a broker that lost its storage)
are read from their start (``ConsumerCore._start_positions``): partitions stay paused until
those seeks are done. A member the coordinator has forgotten commits nothing (see
``_KafkaSubscription._commit``).

tansu (the test broker) lacks idempotent and transactional producers and under-reports
``end_offsets()``; nothing here uses them. It completes a JoinGroup only after about half
the session timeout, so a member's first assignment takes ~5 s with the defaults (tests
use a 2 s session).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    CommitFailedError,
    ConsumerStoppedError,
    IllegalStateError,
    KafkaError,
    KafkaTimeoutError,
    TopicAlreadyExistsError,
    for_code,
)
from aiokafka.partitioner import murmur2

from kz_stream.bus._consumer import TP, ConsumerConfig, ConsumerCore
from kz_stream.bus._port import (
    Bus,
    BusMessage,
    Handler,
    InfrastructureError,
    SubscribeOptions,
    Subscription,
    TopicSpec,
    event_headers,
)
from kz_stream.events import Event, encode_event
from kz_stream.faults import DependencyUnavailable

__all__ = ["KafkaBus"]

log = logging.getLogger("kz_stream.bus")

_PING_TIMEOUT_S = 5.0
_READ_TIMEOUT_S = 60.0
_COMMIT_TIMEOUT_S = 15.0


def _names(tps: set[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}:{tp.partition}" for tp in sorted(tps)) or "nothing"


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Routes aiokafka's rebalance callbacks to the subscription (errors are fatal there,
    because aiokafka would only log them)."""

    def __init__(self, sub: _KafkaSubscription) -> None:
        self._sub = sub

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        log.info("group %s: revoked %s", self._sub.group, _names(revoked))
        try:
            await self._sub._revoke_all()
        except Exception as e:
            self._sub._fail(e)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("group %s: assigned %s", self._sub.group, _names(assigned))
        try:
            await self._sub._on_assigned(assigned)
        except Exception as e:
            self._sub._fail(e)


class _KafkaSubscription(ConsumerCore):
    def __init__(
        self, bus: KafkaBus, config: ConsumerConfig, consumer_options: dict[str, Any]
    ) -> None:
        super().__init__(config, bus.publish_raw,
                         logs_outlive_the_process=bus.logs_outlive_the_process)
        self._bus = bus
        self._consumer_options = consumer_options
        self._consumer: Any = None
        self._fetch_task: asyncio.Task[None] | None = None
        self._paused = False
        self._room_ready = asyncio.Event()
        # Positions whose commit the coordinator's forgetting of this member overlapped:
        # the broker may hold them without the group having read its log (see _commit).
        self._suspect: dict[TP, int] = {}
        # How long a full queue may hold the fetch loop before the partitions are
        # paused: well inside max.poll.interval, which counts time outside getmany().
        max_poll_s = consumer_options.get("max_poll_interval_ms", 300_000) / 1000
        self._hold_s = min(max_poll_s / 4, 5.0)

    async def _start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if self._from_beginning else "latest",
            max_poll_records=self._max_batch,
            **self._consumer_options,
        )
        await self._consumer.start()
        self._consumer.subscribe(list(self.topics), listener=_Listener(self))
        self._start_worker()
        self._fetch_task = asyncio.create_task(
            self._fetch_loop(), name=f"kz-kafka-fetch:{self.group}"
        )
        self._fetch_task.add_done_callback(self._fetch_ended)

    def _fetch_ended(self, task: asyncio.Task[None]) -> None:
        # A fetch loop that dies would leave a live member that reads nothing, silently.
        if not task.cancelled() and (error := task.exception()) is not None:
            self._fail(error)

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        if self._stopping:
            return
        consumer = self._consumer
        # Nothing may be fetched from the committed offsets before the stored ones are
        # applied: paused partitions return no records.
        if assigned:
            consumer.pause(*assigned)
        offsets = self._offsets
        stored: dict[str, int] = {}
        if offsets is not None and assigned:
            # A store outage is waited out here too, or the assignment would be lost to it.
            stored = await self._wait_out(lambda: offsets.load_offsets(self.group))
        tps = {(tp.topic, tp.partition): tp for tp in assigned}
        if stored or any(tp in self._committed or tp in self._suspect for tp in tps):
            # Only then can a partition be of a new log (see _start_positions). A committed
            # offset this member may have written as a member of no group (see _commit) is
            # no sign that the group has read this log.
            group_offsets = await self._wait_out(lambda: self._group_offsets(list(assigned)))
            committed = {
                tp: off for tp, off in group_offsets.items() if self._suspect.get(tp) != off
            }
            for tp in tps:
                self._suspect.pop(tp, None)
            seek, from_start = self._start_positions(tps, committed, stored)
            for tp, pos in seek.items():
                consumer.seek(tps[tp], pos)
            if from_start:
                # Asked for and sought explicitly: seek_to_beginning() would race aiokafka's
                # own reset of a new assignment, which can land on the reset policy's end.
                starts = await self._wait_out(
                    lambda: consumer.beginning_offsets([tps[tp] for tp in from_start]))
                for tp_, pos in starts.items():
                    consumer.seek(tp_, pos)
                # The store's positions were of another log: it holds the new log's now.
                await self._save_offsets({(t.topic, t.partition): pos
                                          for t, pos in starts.items()})
        self._settle(frozenset(tps))
        if assigned and log.isEnabledFor(logging.INFO):
            log.info("group %s: reading %s", self.group, self._partition_states())

    async def _group_offsets(self, tps: list[TopicPartition]) -> dict[TP, int]:
        """The group's committed offsets of ``tps`` (absent where it has none)."""
        found = await asyncio.gather(*(self._consumer.committed(tp) for tp in tps))
        return {(tp.topic, tp.partition): off for tp, off in zip(tps, found, strict=True)
                if off is not None}

    async def _fetch_loop(self) -> None:
        consumer = self._consumer
        failing_since: float | None = None
        while True:
            if not self._room() and not self._paused and not self._settling:
                await self._hold()
            try:
                data = await consumer.getmany(timeout_ms=500, max_records=self._max_batch)
            except ConsumerStoppedError:
                return
            except KafkaError as e:
                if e.retriable:
                    # One line when fetching starts failing and one when it works again:
                    # a broker restart is not a line every half second.
                    if failing_since is None:
                        failing_since = time.monotonic()
                        log.warning("group %s: fetch failed (%s); retrying until it works",
                                    self.group, e)
                    await asyncio.sleep(0.5)
                    continue
                self._fail(e)
                return
            if failing_since is not None:
                log.warning("group %s: fetching again after %.1fs", self.group,
                            time.monotonic() - failing_since)
                failing_since = None
            if not data:
                if not (self._settling or self._stopping):
                    await self._rewind_past_end()
                continue
            if self._settling or self._stopping:
                # Records handed out while positions are being reset: put them back so
                # that none is skipped (aiokafka should not return any here).
                for tp, records in data.items():
                    with contextlib.suppress(IllegalStateError, AssertionError):
                        consumer.seek(tp, records[0].offset)
                continue
            batch = self._new_batch()
            for tp, records in data.items():
                batch.add_records(tp.topic, tp.partition, records)
            self._enqueue(batch)

    async def _rewind_past_end(self) -> None:
        """Reads a partition from its start when our position is past its end.

        That happens when a topic was deleted and created again while the group kept its
        offsets, which then belong to the old log (a broker that lost its storage lost the
        group's offsets too, which the assignment tells: see ``_start_positions``). Kafka answers
        such a fetch with OFFSET_OUT_OF_RANGE and aiokafka resets, but tansu answers with
        nothing, so the consumer would wait there and skip the new log's first records.
        The highwater is that of the last fetch at the current position (aiokafka drops
        answers for any other), so a position above it is past the end.
        """
        consumer = self._consumer
        epoch = self._epoch
        paused = consumer.paused()  # paused partitions fetch nothing: no highwater news
        for tp in consumer.assignment():
            # The awaits below let a rebalance revoke the partitions (aiokafka then raises
            # IllegalStateError or asserts); the new assignment sets its own positions.
            if self._settling or self._stopping or self._epoch != epoch:
                return
            try:
                highwater = consumer.highwater(tp)
                if highwater is None or tp in paused:
                    continue
                position = await consumer.position(tp)
                if self._settling or self._epoch != epoch:
                    return
                if position > highwater:
                    log.warning(
                        "group %s: %s:%d is at %d but its log ends at %d (the topic was "
                        "created again); reading it from the start", self.group, tp.topic,
                        tp.partition, position, highwater,
                    )
                    await consumer.seek_to_beginning(tp)
            except (IllegalStateError, AssertionError):
                return

    async def _hold(self) -> None:
        """Waits for room in the queue; pauses the partitions if none comes soon.

        A short wait costs nothing: aiokafka keeps what it prefetched. Pausing makes it
        drop that buffer (refetched on resume), so it is kept for handlers that are slow
        for real; then getmany() goes on returning nothing, which keeps the member alive.
        """
        self._room_ready.clear()
        if self._room():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room_ready.wait(), self._hold_s)
        if not self._room() and not self._settling and not self._stopping:
            self._consumer.pause(*self._consumer.assignment())
            self._paused = True
            self.stats.pauses += 1

    def _on_queue_full(self) -> None:
        # The fetch loop holds, then pauses (see _hold).
        pass

    def _on_room(self) -> None:
        self._room_ready.set()
        if self._paused:
            self._paused = False
            self._consumer.resume(*self._consumer.assignment())

    def _settle(self, assigned: frozenset[TP]) -> None:
        # New assignments start paused (see _on_assigned): _on_room resumes them.
        self._paused = True
        super()._settle(assigned)

    async def _commit(self, positions: dict[TP, int]) -> bool:
        offsets = {TopicPartition(t, p): off for (t, p), off in positions.items()}
        # aiokafka has no public view of the membership. Once the coordinator has forgotten
        # this member (a broker that lost its state does), aiokafka commits as a member of
        # no group, which a broker accepts for a group it does not know: positions of the
        # lost log would then pass for the new log's (Java's consumer refuses such a
        # commit). So none is started then, and one that the forgetting overlapped (its
        # retries run on inside aiokafka, and one may still land) is remembered as suspect.
        coordinator = self._consumer._coordinator
        generation = coordinator.generation
        if generation < 0:
            self._suspect.update(positions)
            log.warning("group %s: the coordinator does not know this member now; commit "
                        "skipped, records will be redelivered", self.group)
            return False
        try:
            # aiokafka retries a commit forever while the broker or the topic is gone; a
            # bound turns that into an outage the core waits out visibly (health, one log
            # line) and that a stop can give up at once.
            async with asyncio.timeout(_COMMIT_TIMEOUT_S):
                await self._consumer.commit(offsets)
            return True
        except TimeoutError as e:
            raise KafkaTimeoutError(f"offset commit for group {self.group} timed out") from e
        except (CommitFailedError, IllegalStateError) as e:
            # The partitions moved on; their new owner refetches from the last commit.
            log.warning("group %s: commit lost to a rebalance (%s); records will be redelivered",
                        self.group, e)
            return False
        finally:
            if coordinator.generation != generation:
                self._suspect.update(positions)

    def _log_ends(self) -> dict[TP, int]:
        # The fetch high-water marks (tansu under-reports end_offsets()).
        consumer = self._consumer
        ends = {}
        for tp in consumer.assignment() if consumer is not None else ():
            highwater = consumer.highwater(tp)
            if highwater is not None:
                ends[(tp.topic, tp.partition)] = int(highwater)
        return ends

    def _transport_state(self) -> dict[str, Any]:
        consumer = self._consumer
        task = self._fetch_task
        state: dict[str, Any] = {
            "fetch_task": "none" if task is None else "cancelled" if task.cancelled()
            else f"ended: {task.exception()!r}" if task.done() else "running",
            "paused_by_us": self._paused,
            "suspect": {f"{t}:{p}": off for (t, p), off in self._suspect.items()},
        }
        if consumer is None:
            return state
        coordinator = consumer._coordinator  # aiokafka keeps the membership private
        state["generation"] = getattr(coordinator, "generation", None)
        state["member_id"] = getattr(coordinator, "member_id", None)
        state["partitions"] = self._partition_states()
        return state

    def _partition_states(self) -> dict[str, dict[str, Any]]:
        """Each assigned partition's highwater, pause and, from aiokafka's private state
        (read with getattr: a diagnostic must never fail the member), the position the
        next fetch starts at and whether an offset reset is pending."""
        consumer = self._consumer
        if consumer is None:
            return {}
        paused = consumer.paused()
        subscription = getattr(getattr(consumer, "_subscription", None), "subscription", None)
        assignment = getattr(subscription, "assignment", None)
        partitions: dict[str, dict[str, Any]] = {}
        for tp in consumer.assignment():
            row: dict[str, Any] = {"highwater": consumer.highwater(tp), "paused": tp in paused}
            tp_state = assignment.state_value(tp) if assignment is not None else None
            if tp_state is not None:
                row["position"] = getattr(tp_state, "_position", None)
                row["awaiting_reset"] = getattr(tp_state, "awaiting_reset", None)
            partitions[f"{tp.topic}:{tp.partition}"] = row
        return partitions

    async def _stop_fetching(self) -> None:
        if self._fetch_task is not None:
            self._fetch_task.cancel()
            await asyncio.wait({self._fetch_task})

    async def _leave(self) -> None:
        self._bus._subscriptions.discard(self)
        if self._consumer is None:
            return
        try:
            await self._consumer.stop()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # a cancellation of our own
            # aiokafka's fetcher lets out the CancelledError of a fetch it cancelled itself
            # (one sleeping between retries while the broker is down), and then the client
            # is never closed: close it here.
            await self._consumer._client.close()


class KafkaBus(Bus):
    """The bus on a Kafka-protocol cluster (see module doc).

    ``producer_options`` and ``consumer_options`` are passed to aiokafka as they are and win
    over the settings below. The defaults favour throughput: batches up to
    ``max_batch_size`` bytes lingering ``linger_ms``, fetches of up to 4 MiB per partition.
    On a rebalance a member's running batch gets ``revoke_timeout`` seconds to finish and
    commit before it is cancelled (and redelivered to the partition's next owner).
    """

    logs_outlive_the_process = True

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        *,
        client_id: str = "kz-stream",
        compression_type: str | None = None,
        acks: int | str = "all",
        linger_ms: int = 5,
        max_batch_size: int = 256 * 1024,
        replication_factor: int = 1,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        rebalance_timeout_ms: int | None = None,
        revoke_timeout: float | None = 20.0,
        max_partition_fetch_bytes: int = 4 * 1024 * 1024,
        fetch_max_bytes: int = 32 * 1024 * 1024,
        producer_options: Mapping[str, Any] | None = None,
        consumer_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.bootstrap_servers = (
            bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)
        )
        self.client_id = client_id
        self.replication_factor = replication_factor
        self.revoke_timeout = revoke_timeout
        self._producer_options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": client_id,
            "compression_type": compression_type,
            "acks": acks,
            "linger_ms": linger_ms,
            "max_batch_size": max_batch_size,
            # Idempotence needs the broker's producer ids, which tansu does not give
            # aiokafka; at-least-once plus idempotent appends does not need it.
            "enable_idempotence": False,
            **(producer_options or {}),
        }
        self._consumer_options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": client_id,
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "max_poll_interval_ms": max_poll_interval_ms,
            # Room for a revocation to wait revoke_timeout for the running batch.
            "rebalance_timeout_ms": rebalance_timeout_ms
            or max(session_timeout_ms, int((revoke_timeout or 20.0) * 1000) + 10_000),
            "max_partition_fetch_bytes": max_partition_fetch_bytes,
            "fetch_max_bytes": fetch_max_bytes,
            # Leaders and partitions known afresh every 10 s, not aiokafka's 5 min: after a
            # broker lost its storage the fetcher otherwise waits on the old metadata.
            "metadata_max_age_ms": 10_000,
            **(consumer_options or {}),
        }
        self._producer: Any = None
        self._subscriptions: set[_KafkaSubscription] = set()

    async def start(self) -> None:
        if self._producer is not None:
            return
        producer = AIOKafkaProducer(**self._producer_options)
        try:
            await producer.start()
        except KafkaError as e:
            await producer.stop()
            raise InfrastructureError(
                f"Kafka at {self.bootstrap_servers} is not reachable: {e}"
            ) from e
        self._producer = producer

    async def close(self) -> None:
        subs = list(self._subscriptions)
        await asyncio.gather(*(s.stop() for s in subs))
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def read_topic(self, topic: str) -> list[BusMessage]:
        """Reads up to the fetch high-water mark of each partition (tansu under-reports
        ``end_offsets()``), with a consumer of no group (see the port)."""
        tps = [TopicPartition(topic, p) for p in await self._partitions(topic)]
        consumer = AIOKafkaConsumer(
            **{k: v for k, v in self._consumer_options.items()
               if k in ("bootstrap_servers", "client_id", "max_partition_fetch_bytes",
                        "fetch_max_bytes")},
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
        )
        await consumer.start()
        out: list[BusMessage] = []
        try:
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            async with asyncio.timeout(_READ_TIMEOUT_S):
                while True:
                    data = await consumer.getmany(timeout_ms=200)
                    for tp, records in data.items():
                        out.extend(
                            BusMessage(tp.topic, tp.partition, r.offset, r.key,
                                       r.value if r.value is not None else b"",
                                       dict(r.headers) if r.headers else {})
                            for r in records
                        )
                    if all([await self._read_up(consumer, tp) for tp in tps]):
                        break
        except TimeoutError as e:
            raise DependencyUnavailable(
                "broker", f"reading {topic!r} at {self.bootstrap_servers} did not finish"
            ) from e
        finally:
            await consumer.stop()
        return sorted(out, key=lambda m: (m.partition, m.offset))

    @staticmethod
    async def _read_up(consumer: Any, tp: TopicPartition) -> bool:
        """Whether ``tp`` has been read to the high-water mark of its last fetch."""
        highwater = consumer.highwater(tp)
        return highwater is not None and bool(await consumer.position(tp) >= highwater)

    async def ping(self, topics: Sequence[str] = ()) -> list[str]:
        """Asks the cluster for its metadata (see the port)."""
        producer = self._require_producer()
        try:
            async with asyncio.timeout(_PING_TIMEOUT_S):
                metadata = await producer.client.fetch_all_metadata()
        except (KafkaError, OSError, TimeoutError) as e:
            why = str(e) or type(e).__name__
            raise DependencyUnavailable(
                "broker", f"Kafka at {self.bootstrap_servers} does not answer: {why}"
            ) from e
        known = metadata.topics()
        return [t for t in topics if t not in known]

    def _require_producer(self) -> Any:
        if self._producer is None:
            raise RuntimeError("KafkaBus.start() has not been called")
        return self._producer

    async def create_topics(self, topics: Sequence[TopicSpec]) -> None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap_servers, client_id=self.client_id
        )
        await admin.start()
        try:
            resp = await admin.create_topics(
                [
                    NewTopic(
                        t.name,
                        t.partitions,
                        self.replication_factor,
                        topic_configs={"cleanup.policy": "compact"} if t.compacted else {},
                    )
                    for t in topics
                ]
            )
        finally:
            await admin.close()
        for item in resp.topic_errors:
            name, code = item[0], item[1]
            error = for_code(code)
            if code == 0 or error is TopicAlreadyExistsError:
                continue
            message = item[2] if len(item) > 2 and item[2] else error.__name__
            raise InfrastructureError(f"cannot create topic {name!r}: {message}")

    async def _partitions(self, topic: str) -> list[int]:
        producer = self._require_producer()
        parts = producer.client.cluster.partitions_for_topic(topic)
        if not parts:
            parts = await producer.partitions_for(topic)
        return sorted(parts)

    async def publish_many(self, topic: str, events: Sequence[Event]) -> None:
        if not events:
            return
        producer = self._require_producer()
        parts = await self._partitions(topic)
        n = len(parts)
        builders: dict[int, Any] = {}
        futures: list[asyncio.Future[Any]] = []
        for event in events:
            key = event.stream_id.encode()
            value = encode_event(event)
            headers = list(event_headers(event).items())
            p = parts[(murmur2(key) & 0x7FFFFFFF) % n]
            builder = builders.get(p)
            if builder is None:
                builder = builders[p] = producer.create_batch()
            if builder.append(timestamp=None, key=key, value=value, headers=headers) is not None:
                continue
            # Full: ship it and start the next one.
            if builder.record_count():
                futures.append(await producer.send_batch(builder, topic, partition=p))
            builder = builders[p] = producer.create_batch()
            if builder.append(timestamp=None, key=key, value=value, headers=headers) is None:
                # Larger than a whole batch: aiokafka sizes a batch for it.
                futures.append(
                    await producer.send(topic, value, key=key, headers=headers, partition=p)
                )
        for p, builder in builders.items():
            if builder.record_count():
                futures.append(await producer.send_batch(builder, topic, partition=p))
        await asyncio.gather(*futures)

    async def publish_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> None:
        producer = self._require_producer()
        fut = await producer.send(
            topic, value, key=key, headers=list((headers or {}).items())
        )
        await fut

    async def subscribe(
        self, group: str, topics: Sequence[str], handler: Handler,
        **options: Unpack[SubscribeOptions],
    ) -> Subscription:
        """Starts a group member (see the port); it joins the group in the background."""
        self._require_producer()  # dead letters go out through it
        config = ConsumerConfig.of(group, topics, handler, self.revoke_timeout, options)
        sub = _KafkaSubscription(self, config, dict(self._consumer_options))
        try:
            await sub._start()
        except KafkaError as e:
            with contextlib.suppress(Exception):
                await sub._leave()
            raise InfrastructureError(
                f"cannot join group {group!r} at {self.bootstrap_servers}: {e}"
            ) from e
        self._subscriptions.add(sub)
        return sub
