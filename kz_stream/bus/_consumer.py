"""Consumer machinery both adapters share: batches, bounded in-flight work, retries,
isolation of poison messages, dead letters and commits.

A store or broker outage hit by the handler, a commit or a dead letter is waited out (see
``kz_stream.faults``): the batch is retried with capped backoff for as long as it takes,
fetching pauses behind it, and ``outage`` says why until it passes. Only errors about the
records themselves count towards ``max_retries`` and end in the dead-letter topic.

An adapter feeds ``ConsumerCore._enqueue`` with batches of fetched records and implements
four hooks: commit, pause/resume fetching, stop fetching, leave the group. The core runs
one batch at a time (so per-partition order holds), commits a batch's offsets only after
the handler returned for every message in it (or the message was dead-lettered), and on
revocation drops batches not yet started, which the partition's next owner refetches from
the committed offsets.

Where an assigned partition starts (``_start_positions``): a partition of which the group
has no committed offset, while this member committed one or its ``OffsetStore`` holds one,
is of a new log (a broker that lost its storage loses the group's offsets with its logs;
the embedded bus of a new process starts empty while the store keeps its positions), so it
is read from its start; otherwise the store's position wins, then the group's committed
offset, then the subscription's reset policy. A healthy broker keeps a committed offset for
every partition a member or its store has a position for, because every batch is committed
there after its handler returns (the store is written first, in the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from kz_stream.bus._port import (
    DEFAULT_DEAD_LETTER_TOPIC,
    BusMessage,
    Handler,
    OffsetStore,
    PublishRaw,
    SubscribeOptions,
    SubscriptionStats,
    dead_letter_headers,
    describe_error,
)
from kz_stream.events import EventDecodeError, decode_event
from kz_stream.faults import Backoff, Unrecoverable, describe_outage, wait_out

log = logging.getLogger("kz_stream.bus")

TP = tuple[str, int]
T = TypeVar("T")
_MAX_BACKOFF_S = 30.0


@dataclass(slots=True)
class Batch:
    """Records fetched together: the decoded ones for the handler, the undecodable ones
    for the dead-letter topic, and the offsets to commit once both are done."""

    epoch: int
    decode: bool
    messages: list[BusMessage] = field(default_factory=list)
    rejects: list[tuple[BusMessage, EventDecodeError]] = field(default_factory=list)
    positions: dict[TP, int] = field(default_factory=dict)

    def add(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes,
        headers: Mapping[str, bytes],
    ) -> None:
        """Adds one record (records of a partition arrive in offset order)."""
        self.positions[(topic, partition)] = offset + 1
        self._take(topic, partition, offset, key, value, headers)

    def add_records(self, topic: str, partition: int, records: Sequence[FetchedRecord]) -> None:
        """Adds one partition's fetched records, in offset order."""
        if not records:
            return
        self.positions[(topic, partition)] = records[-1].offset + 1
        for r in records:
            self._take(topic, partition, r.offset, r.key,
                       r.value if r.value is not None else b"",
                       dict(r.headers) if r.headers else {})

    def merge(self, later: Batch) -> None:
        """Appends a batch fetched after this one (same epoch): its records and offsets."""
        self.messages.extend(later.messages)
        self.rejects.extend(later.rejects)
        self.positions.update(later.positions)

    def _take(self, topic: str, partition: int, offset: int, key: bytes | None,
              value: bytes, headers: Mapping[str, bytes]) -> None:
        event = None
        if self.decode:
            try:
                event = decode_event(value)
            except EventDecodeError as e:
                self.rejects.append(
                    (BusMessage(topic, partition, offset, key, value, headers), e))
                return
        self.messages.append(BusMessage(topic, partition, offset, key, value, headers, event))


class FetchedRecord(Protocol):
    """What ``Batch.add_records`` reads of a fetched record (aiokafka's ConsumerRecord)."""

    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """What ``Bus.subscribe`` was asked for (see the port for the meaning of each)."""

    group: str
    topics: tuple[str, ...]
    handler: Handler
    offsets: OffsetStore | None = None
    max_batch: int = 500
    max_in_flight: int = 2
    merge_waiting: bool = False
    max_retries: int = 3
    retry_backoff: float = 0.2
    max_backoff: float = _MAX_BACKOFF_S
    dead_letter_topic: str = DEFAULT_DEAD_LETTER_TOPIC
    from_beginning: bool = True
    decode: bool = True
    # How long a revocation waits for the running batch before cancelling it.
    revoke_timeout: float | None = 20.0

    @classmethod
    def of(
        cls, group: str, topics: Sequence[str], handler: Handler,
        revoke_timeout: float | None, options: SubscribeOptions,
    ) -> ConsumerConfig:
        """The config of one ``Bus.subscribe`` call."""
        return cls(group, tuple(topics), handler, revoke_timeout=revoke_timeout, **options)


class ConsumerCore(ABC):
    """One group member's pipeline from fetched batches to commits (see module doc)."""

    def __init__(self, config: ConsumerConfig, publish_raw: PublishRaw, *,
                 logs_outlive_the_process: bool) -> None:
        """``logs_outlive_the_process``: the bus's (``Bus``); where they do not, the new logs
        of a resumed run are expected, not a broker that lost its storage."""
        if config.max_batch < 1 or config.max_in_flight < 1 or config.max_retries < 0:
            raise ValueError("max_batch and max_in_flight must be ≥ 1, max_retries ≥ 0")
        self.group = config.group
        self.logs_outlive_the_process = logs_outlive_the_process
        self.topics = config.topics
        self.stats = SubscriptionStats()
        self._handler = config.handler
        self._publish_raw = publish_raw
        self._offsets = config.offsets
        self._max_batch = config.max_batch
        self._max_in_flight = config.max_in_flight
        self._merge_waiting = config.merge_waiting
        self._max_retries = config.max_retries
        self._backoff = Backoff(config.retry_backoff, config.max_backoff)
        self._dead_letter_topic = config.dead_letter_topic
        self._from_beginning = config.from_beginning
        self._decode = config.decode
        self._revoke_timeout = config.revoke_timeout

        self._queue: deque[Batch] = deque()
        self._queue_ready = asyncio.Event()
        # Bumped on every revocation: a batch from an older epoch is never started or
        # committed, because its partitions may belong to another member now.
        self._epoch = 0
        # True from revocation until the next assignment's positions are set.
        self._settling = True
        self._assigned: frozenset[TP] = frozenset()
        self._running: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._stopping = False
        self._stop_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._error: BaseException | None = None
        self.failure: str | None = None
        # The outage being waited out ("store unreachable: ..."), None when there is none.
        self.outage: str | None = None
        self._in_outage = asyncio.Event()
        self._outage_since = 0.0
        # time.monotonic() when the running batch started (None while idle).
        self.busy_since: float | None = None
        # Next offset to handle per partition, as of the last commit (for lag).
        self._done: dict[TP, int] = {}
        # What this member committed per partition, kept across rebalances: a partition
        # the group has no committed offset of any more is of a new log (_start_positions).
        self._committed: dict[TP, int] = {}

    # -- adapter hooks ---------------------------------------------------------------

    @abstractmethod
    async def _commit(self, positions: dict[TP, int]) -> bool:
        """Commits next-to-read offsets; False for a commit lost to a rebalance (which is
        not an error)."""

    @abstractmethod
    def _on_queue_full(self) -> None:
        """``max_in_flight`` batches wait: fetching should pause."""

    @abstractmethod
    def _on_room(self) -> None:
        """The queue has room again (or a new assignment is ready): fetching may go on."""

    @abstractmethod
    async def _stop_fetching(self) -> None: ...

    def _log_ends(self) -> dict[TP, int]:
        """The known end (next offset to be written) of assigned partitions' logs."""
        return {}

    @abstractmethod
    async def _leave(self) -> None:
        """Leaves the group and releases the transport."""

    # -- public ----------------------------------------------------------------------

    def assignment(self) -> frozenset[TP]:
        return self._assigned

    def lag(self) -> int | None:
        """Records behind the log ends, over the assigned partitions this member has
        committed a batch of; None before the first."""
        ends = self._log_ends()
        behind = [ends[tp] - pos for tp, pos in self._done.items() if tp in ends]
        return sum(max(0, n) for n in behind) if behind else None

    async def stop(self, grace: float | None = None) -> None:
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._shutdown(grace), name="kz-bus-stop")
        if asyncio.current_task() is self._running:
            # Called from inside the handler: waiting here would wait for ourselves.
            return
        await asyncio.shield(self._stop_task)

    async def wait(self) -> None:
        await self._stopped.wait()
        if self._error is not None:
            raise self._error

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def describe_state(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "assigned": sorted(f"{t}:{p}" for t, p in self._assigned),
            "settling": self._settling,
            "stopping": self._stopping,
            "epoch": self._epoch,
            "queued": len(self._queue),
            "queued_messages": sum(len(b.messages) + len(b.rejects) for b in self._queue),
            "running": self._running is not None,
            "outage": self.outage,
            "failure": self.failure,
            "done": {f"{t}:{p}": off for (t, p), off in sorted(self._done.items())},
            "stats": asdict(self.stats),
            **self._transport_state(),
        }

    def _transport_state(self) -> dict[str, Any]:
        """The adapter's part of ``describe_state``."""
        return {}

    # -- flow ------------------------------------------------------------------------

    def _start_worker(self) -> None:
        self._worker = asyncio.create_task(self._work(), name=f"kz-bus-worker:{self.group}")

    def _room(self) -> bool:
        return len(self._queue) < self._max_in_flight

    def _new_batch(self) -> Batch:
        return Batch(self._epoch, self._decode)

    def _enqueue(self, batch: Batch) -> bool:
        """Queues a fetched batch; False if it was dropped (stale or shutting down)."""
        if self._settling or self._stopping or batch.epoch != self._epoch:
            self.stats.dropped_batches += 1
            return False
        self._queue.append(batch)
        self._queue_ready.set()
        if not self._room():
            self._on_queue_full()
        return True

    def _settle(self, assigned: frozenset[TP]) -> None:
        """Marks an assignment ready: positions are set, fetching may go on."""
        self._assigned = assigned
        self._settling = False
        self.stats.assignments += 1
        if self._room():
            self._on_room()

    def _start_positions(
        self, assigned: Iterable[TP], committed: Mapping[TP, int], stored: Mapping[str, int]
    ) -> tuple[dict[TP, int], set[TP]]:
        """Where the assigned partitions start (see module doc): positions to seek to, and
        the partitions to read from their start; the rest follow the group's committed
        offset or the reset policy. ``committed`` holds the group's committed offsets of
        the assigned partitions, ``stored`` the ``OffsetStore``'s positions."""
        positions: dict[TP, int] = {}
        from_start: set[TP] = set()
        for tp in assigned:
            known = stored.get(f"{tp[0]}:{tp[1]}")
            if tp not in committed and (known or self._committed.get(tp)):
                from_start.add(tp)
            elif known is not None:
                positions[tp] = known
        if from_start:
            partitions = ", ".join(f"{t}:{p}" for t, p in sorted(from_start))
            if self.logs_outlive_the_process:
                log.warning(
                    "group %s: no committed offset for %s, where this consumer has read "
                    "before: new logs (the broker lost its storage); reading them from the "
                    "start", self.group, partitions)
            else:  # every resumed embedded run: nothing to warn about
                log.info("group %s: the embedded bus starts empty; reading %s from the start",
                         self.group, partitions)
        return positions, from_start

    async def _save_offsets(self, positions: Mapping[TP, int]) -> None:
        """Writes ``positions`` to the subscription's offset store, if it has one."""
        offsets = self._offsets
        if offsets is None or not positions:
            return
        keyed = {f"{t}:{p}": pos for (t, p), pos in positions.items()}
        await self._wait_out(lambda: offsets.save_offsets(self.group, keyed))

    async def _revoke_all(self) -> None:
        """Gives up every partition: drops batches not started, lets the running one
        finish and commit (cancelling it after ``revoke_timeout``)."""
        self._settling = True
        self._assigned = frozenset()
        self._done.clear()
        self.stats.dropped_batches += len(self._queue)
        self._queue.clear()
        await self._finish_running(self._revoke_timeout)
        self._epoch += 1

    async def _finish_running(self, grace: float | None) -> None:
        run = self._running
        if run is None or run.done() or run is asyncio.current_task():
            return
        # A batch waiting out an outage has nothing to finish: it is given up at once.
        outage = asyncio.create_task(self._in_outage.wait())
        try:
            done, _ = await asyncio.wait(
                {run, outage}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            outage.cancel()
        if run not in done:
            if self.outage is None:
                # A grace of 0 gives the batch up on purpose (kz run once its schedule is
                # done): said, not warned.
                (log.info if grace == 0 else log.warning)(
                    "group %s: batch still running after %ss; cancelled, its records will "
                    "be redelivered", self.group, grace,
                )
            else:
                log.warning(
                    "group %s: batch waiting out an outage (%s) given up; its records will "
                    "be redelivered", self.group, self.outage,
                )
            run.cancel()
            await asyncio.wait({run})

    async def _work(self) -> None:
        while True:
            while not self._queue:
                self._queue_ready.clear()
                await self._queue_ready.wait()
            batch = self._queue.popleft()
            if self._merge_waiting:
                self._merge_waiting_into(batch)
            if not self._settling and self._room():
                self._on_room()
            if batch.epoch != self._epoch:
                self.stats.dropped_batches += 1
                continue
            task = asyncio.create_task(self._process(batch), name=f"kz-bus-batch:{self.group}")
            self._running = task
            self.busy_since = time.monotonic()
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                await asyncio.wait({task})
                raise
            finally:
                self._running = None
                self.busy_since = None
                # A batch given up while waiting out an outage (stop, rebalance) ends it
                # here; the next batch finds out for itself whether it is over.
                self.outage = None
                self._in_outage.clear()
            if task.cancelled():
                self.stats.dropped_batches += 1
                if not (self._stopping or self._settling):
                    # Nobody here cancelled it (the handler raised CancelledError itself):
                    # committing any later batch would skip this one's records.
                    self._fail(RuntimeError("the handler was cancelled; batch not committed"))
                    return
                continue
            exc = task.exception()
            if exc is not None:
                self._fail(exc)
                return

    def _merge_waiting_into(self, batch: Batch) -> None:
        """Moves the batches queued behind ``batch`` into it, in fetch order, while they
        are of its epoch and the whole stays within ``max_batch`` messages."""
        while self._queue:
            nxt = self._queue[0]
            size = len(batch.messages) + len(batch.rejects) + len(nxt.messages) + len(
                nxt.rejects)
            if nxt.epoch != batch.epoch or size > self._max_batch:
                return
            batch.merge(self._queue.popleft())

    async def _process(self, batch: Batch) -> None:
        dead_before = self.stats.dead_lettered
        for msg, error in batch.rejects:
            await self._dead_letter(msg, error)
        if batch.messages:
            await self._apply(batch.messages)
        if batch.epoch == self._epoch:
            if self.stats.dead_lettered != dead_before or not batch.messages:
                # Records no handler wrote an offset for: the store must not stay behind
                # the group's commit (see save_offsets).
                await self._save_offsets(batch.positions)
            if await self._wait_out(lambda: self._commit(batch.positions)):
                self._committed.update(batch.positions)
            self._done.update(batch.positions)
            self.stats.batches += 1

    # -- outages -----------------------------------------------------------------------

    async def _wait_out(self, op: Callable[[], Awaitable[T]]) -> T:
        """Runs ``op``, waiting out outages (see module doc); other errors raise."""
        return await wait_out(
            op, backoff=self._backoff, on_retry=self._on_outage,
            on_recovered=lambda _attempts: self._recovered(),
        )

    def _on_outage(self, error: BaseException, attempt: int, delay: float) -> None:
        self.stats.outage_retries += 1
        if self.outage is None:
            self.stats.outages += 1
            self._outage_since = time.monotonic()
        self.outage = describe_outage(error)
        self._in_outage.set()
        # One line when it starts, then one per capped wait: not a line per retry.
        if attempt == 0 or delay >= self._backoff.cap:
            log.warning(
                "group %s: %s; consumption paused, retrying every %.1fs at most",
                self.group, self.outage, self._backoff.cap,
            )

    def _recovered(self) -> None:
        if self.outage is None:
            return
        log.warning(
            "group %s: recovered after %.1fs (%s); consumption resumes",
            self.group, time.monotonic() - self._outage_since, self.outage,
        )
        self.outage = None
        self._in_outage.clear()

    # -- retries and isolation -------------------------------------------------------

    async def _attempt(self, msgs: Sequence[BusMessage], retries: int) -> Exception | None:
        """Calls the handler up to 1 + ``retries`` times (outages waited out, not
        counted); returns the last error. ``Unrecoverable`` raises at once."""
        error: Exception | None = None
        for attempt in range(retries + 1):
            try:
                await self._wait_out(lambda: self._handler(msgs))
            except Unrecoverable:
                raise  # fails the subscription: not the records' fault (``_fail``)
            except Exception as e:
                error = e
                if attempt < retries:
                    self.stats.retries += 1
                    delay = self._backoff.delay(attempt)
                    log.warning(
                        "group %s: handler failed on %d message(s) (%s); retry %d/%d in %.2fs",
                        self.group, len(msgs), describe_error(e), attempt + 1, retries, delay,
                    )
                    await asyncio.sleep(delay)
            else:
                self.stats.messages += len(msgs)
                return None
        return error

    async def _apply(self, msgs: Sequence[BusMessage]) -> None:
        error = await self._attempt(msgs, self._max_retries)
        if error is None:
            return
        if len(msgs) == 1:
            await self._dead_letter(msgs[0], error)
        else:
            await self._isolate(msgs)

    async def _isolate(self, msgs: Sequence[BusMessage]) -> None:
        """Bisects a failing batch: halves that pass are applied (once each), single
        messages that still fail after their own retries are dead-lettered."""
        mid = len(msgs) // 2
        for half in (msgs[:mid], msgs[mid:]):
            if len(half) == 1:
                error = await self._attempt(half, self._max_retries)
                if error is not None:
                    await self._dead_letter(half[0], error)
            elif await self._attempt(half, 0) is not None:
                await self._isolate(half)

    async def _dead_letter(self, msg: BusMessage, error: BaseException) -> None:
        if msg.topic == self._dead_letter_topic:
            # A dead letter that fails again stays where it is, at its offset in the
            # dead-letter topic; re-publishing it there would loop forever.
            log.error(
                "group %s: dead letter %s:%d@%d failed again (%s); skipped",
                self.group, msg.topic, msg.partition, msg.offset, describe_error(error),
            )
            return
        headers = dead_letter_headers(msg, error, self.group)
        await self._wait_out(
            lambda: self._publish_raw(
                self._dead_letter_topic, msg.value, key=msg.key, headers=headers
            )
        )
        self.stats.dead_lettered += 1
        log.error(
            "group %s: %s:%d@%d dead-lettered to %s: %s",
            self.group, msg.topic, msg.partition, msg.offset, self._dead_letter_topic,
            describe_error(error),
        )

    # -- shutdown --------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        """Records a fatal error and stops the subscription (wait() raises it)."""
        if self._error is None:
            self._error = error
            self.failure = describe_error(error)
        log.error("group %s: subscription failed: %s", self.group, describe_error(error))
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._shutdown(0), name="kz-bus-stop")

    async def _shutdown(self, grace: float | None) -> None:
        self._stopping = True
        try:
            await self._stop_fetching()
            self.stats.dropped_batches += len(self._queue)
            self._queue.clear()
            await self._finish_running(grace)
            if self._worker is not None:
                self._worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._worker
            await self._leave()
        except Exception as e:
            if self._error is None:
                self._error = e
            log.error("group %s: error while stopping: %s", self.group, describe_error(e))
        finally:
            self._assigned = frozenset()
            self._stopped.set()
