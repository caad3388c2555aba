"""The recorder: archives every topic but the dead-letter and rescore ones into the event store,
exactly once in effect.

Each batch's events and the Kafka offsets after it commit in one database transaction;
on (re)assignment the bus seeks to the offsets stored there. A crash between the commit
and the Kafka offset commit only re-delivers events whose ids are stored already, which
the append skips (idempotent on event_id).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kz_stream.bus import BusMessage, Subscription, offsets_after
from kz_stream.runtime import Service, StoreOffsets

__all__ = ["Recorder"]


class Recorder(Service):
    name = "recorder"
    group = "kz-recorder"
    stop_stage = 2  # last: what the others publish as they stop is archived too

    async def run(self) -> None:
        topics = self.ctx.settings.topics
        # Rescore jobs are kernel events the store holds already.
        names = [t for t in topics.all() if t not in (topics.dead_letter, topics.rescore)]
        sub = await self.subscribe(
            self.group,
            names,
            self.record,
            offsets=StoreOffsets(self.ctx.store),
            max_batch=5000,
            max_in_flight=2,
            dead_letter_topic=topics.dead_letter,
        )
        self.log.info("recorder_started", topics=names)
        try:
            await self.run_until_stopped(sub.wait())
            await self.drain(sub)
        finally:
            await sub.stop()
        self.log.info("recorder_stopped")

    async def drain(self, sub: Subscription, timeout_s: float = 30.0) -> None:
        """Waits, up to ``timeout_s``, until the topics hold nothing this recorder has not
        archived: a stop comes after the other services' (``stop_stage``), and the embedded
        bus keeps nothing past the process, so what they published last is archived now."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and sub.failure is None:
            await asyncio.sleep(0.2)  # the fetch loop takes up what was just published
            if not sub.lag() and sub.busy_since is None:
                return

    async def record(self, batch: Sequence[BusMessage]) -> None:
        """Appends the batch's events and the offsets after it in one transaction."""
        # An event id repeated inside the batch (a producer's retry) is appended once and
        # counted as a duplicate by the store itself.
        events = [m.event for m in batch if m.event is not None]
        with self.metrics.batch_seconds.time():
            result = await self.ctx.store.append(
                events, tracking={self.group: offsets_after(batch)}
            )
        self.metrics.count_handled(batch)
        self.log.debug(
            "batch_recorded",
            appended=result.appended,
            duplicates=result.duplicates,
            last_position=result.last_position,
        )
        self.appended_total += result.appended
        self.duplicates_total += result.duplicates

    appended_total: int = 0
    duplicates_total: int = 0
