"""Bus throughput at ~500 B events: KafkaBus next to raw aiokafka on the same bytes, in one
run against a fresh tansu broker; the in-memory bus for information.

    python -m benchmarks.bench_bus [--events 100000] [--repeats 3]

Publish: ``KafkaBus.publish_many`` (envelope encoding, headers, batching, acks) against
raw aiokafka producing the same pre-encoded bytes, keys and headers with
``create_batch``/``send_batch`` (its fastest path; one ``send()`` per record is reported
too). Consume: a KafkaBus subscription (decode and validate every event, hand batches to a
no-op handler, commit after each) against a raw ``AIOKafkaConsumer.getmany`` loop over the
same records (no decoding, no commits). Each figure is the median of ``--repeats`` runs;
each consume run is a fresh group, timed from its partition assignment to its last record.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.partitioner import murmur2

from benchmarks._results import metric, write_result
from kz_stream.bus import BusMessage, InMemoryBus, KafkaBus, TopicSpec, event_headers
from kz_stream.events import Event, KernelVerified, encode_event, new_event
from kz_stream.infra import LocalBroker

PARTITIONS = 4
MAX_BATCH = 5000  # what the recorder asks for
GROUP_TIMERS = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 100}


def make_events(n: int) -> list[Event]:
    """~500 B verdict envelopes over 1000 kernel streams."""
    out = []
    for i in range(n):
        out.append(
            new_event(
                KernelVerified(
                    kernel_id=f"kernel-{i:08d}",
                    module_id=f"module-{i % 97:04d}",
                    group_id=f"group-{i % 331:05d}",
                    status="correct",
                    speedup=1.0 + (i % 50) / 10,
                    verifier_version="bench-1",
                    hardware={"gpu": "H200"},
                ),
                stream_id=f"kernel-{i % 1000:08d}",
                stream_version=i // 1000,
                producer="bench@host",
                correlation_id="run-bench",
            )
        )
    return out


async def timed(work: Awaitable[None]) -> float:
    t0 = time.perf_counter()
    await work
    return time.perf_counter() - t0


def median_rate(n: int, seconds: Sequence[float]) -> float:
    return n / statistics.median(seconds)


class _Stamp(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.assigned_at = 0.0

    async def on_partitions_revoked(self, revoked: Any) -> None:
        pass

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            self.assigned_at = time.perf_counter()


async def raw_send_batch(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, Any]],
                         options: dict[str, Any]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **options)
    await producer.start()
    try:
        parts = sorted(await producer.partitions_for(topic))
        builders: dict[int, Any] = {}
        futures = []
        for key, value, headers in records:
            p = parts[(murmur2(key) & 0x7FFFFFFF) % len(parts)]
            b = builders.get(p) or builders.setdefault(p, producer.create_batch())
            if b.append(timestamp=None, key=key, value=value, headers=headers) is None:
                futures.append(await producer.send_batch(b, topic, partition=p))
                b = builders[p] = producer.create_batch()
                b.append(timestamp=None, key=key, value=value, headers=headers)
        for p, b in builders.items():
            futures.append(await producer.send_batch(b, topic, partition=p))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def raw_send(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, Any]],
                   options: dict[str, Any]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **options)
    await producer.start()
    try:
        futures = [await producer.send(topic, v, key=k, headers=h) for k, v, h in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def raw_consume(bootstrap: str, topic: str, n: int) -> float:
    stamp = _Stamp()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=f"raw-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False, auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 << 20, fetch_max_bytes=32 << 20, **GROUP_TIMERS,
    )
    await consumer.start()
    consumer.subscribe([topic], listener=stamp)
    try:
        got = 0
        while got < n:
            data = await consumer.getmany(timeout_ms=1000, max_records=MAX_BATCH)
            got += sum(len(v) for v in data.values())
        return time.perf_counter() - stamp.assigned_at
    finally:
        await consumer.stop()


async def bus_consume(bus: KafkaBus | InMemoryBus, topic: str, n: int) -> float:
    got = 0
    done = asyncio.Event()
    assigned_at = 0.0

    async def handler(batch: Sequence[BusMessage]) -> None:
        nonlocal got
        got += len(batch)
        if got >= n:
            done.set()

    sub = await bus.subscribe(f"bus-{uuid.uuid4().hex[:8]}", [topic], handler, max_batch=MAX_BATCH)
    while True:  # the clock starts at the assignment, as for the raw consumer
        if sub.assignment():
            break
        await asyncio.sleep(0.001)
    assigned_at = time.perf_counter()
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - assigned_at
    await sub.stop()
    return elapsed


async def run(n: int, repeats: int) -> dict[str, dict[str, Any]]:
    events = make_events(n)
    records = [
        (e.stream_id.encode(), encode_event(e), list(event_headers(e).items())) for e in events
    ]
    # The inputs stay alive through the run; freezing them keeps the collector's scans of
    # them (hundreds of thousands of objects) out of every measurement.
    gc.collect()
    gc.freeze()
    sizes = [len(encode_event(e)) for e in events[:1000]]
    avg_size = sum(sizes) / len(sizes)
    broker = LocalBroker().start()
    try:
        bootstrap = broker.bootstrap
        bus = KafkaBus(bootstrap, client_id="bench", **GROUP_TIMERS)
        await bus.start()
        producer_options = {"linger_ms": 5, "max_batch_size": 256 * 1024, "acks": "all",
                            "enable_idempotence": False}
        t_raw_batch, t_raw_send, t_bus = [], [], []
        for r in range(repeats):
            names = [f"{kind}-{r}" for kind in ("raw-batch", "raw-send", "bus")]
            await bus.create_topics([TopicSpec(t, PARTITIONS) for t in names])
            t_raw_batch.append(
                await timed(raw_send_batch(bootstrap, names[0], records, producer_options))
            )
            t_raw_send.append(
                await timed(raw_send(bootstrap, names[1], records, producer_options))
            )
            t_bus.append(await timed(bus.publish_many(names[2], events)))
        c_raw, c_bus = [], []
        for r in range(repeats):
            c_raw.append(await raw_consume(bootstrap, f"raw-batch-{r}", n))
            c_bus.append(await bus_consume(bus, f"bus-{r}", n))
        await bus.close()

        mem = InMemoryBus()
        await mem.create_topics([TopicSpec("mem", PARTITIONS)])
        t_mem = [await timed(mem.publish_many("mem", events))]
        c_mem = [await bus_consume(mem, "mem", n)]
        await mem.close()
    finally:
        broker.stop()

    raw_publish = median_rate(n, t_raw_batch)
    raw_consume_rate = median_rate(n, c_raw)
    return {
        "avg_event_bytes": metric(avg_size, "bytes"),
        "kafkabus_publish": metric(median_rate(n, t_bus), "events/s", raw_publish),
        "raw_aiokafka_send_per_record": metric(median_rate(n, t_raw_send), "events/s",
                                               raw_publish),
        "kafkabus_consume": metric(median_rate(n, c_bus), "events/s", raw_consume_rate),
        "memorybus_publish": metric(median_rate(n, t_mem), "events/s"),
        "memorybus_consume": metric(median_rate(n, c_mem), "events/s"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    metrics = asyncio.run(run(args.events, args.repeats))
    command = "python -m benchmarks.bench_bus " + " ".join(sys.argv[1:] if argv is None else argv)
    notes = (
        f"{args.events:,} events of ~{metrics['avg_event_bytes']['value']:.0f} B, "
        f"{PARTITIONS} partitions, tansu broker (memory storage), median of {args.repeats}. "
        "Publish baseline: raw aiokafka create_batch/send_batch of the same pre-encoded "
        "bytes, keys and headers (the bus also encodes each envelope). Consume baseline: raw "
        "getmany without decoding or commits (the bus decodes and validates every event with "
        f"pydantic and commits after each batch of up to {MAX_BATCH}). In-memory figures "
        "are for information (no baseline)."
    )
    write_result("bus", command.strip(), metrics, notes=notes)
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
