"""``kz dataset export`` on a large history in PostgreSQL: the replay that gathers the SFT,
verdict and RL sets (events/s) next to a raw psycopg read of the same rows measured in the
same run, and the parquet writing (rows/s).

The history is ``bench_store``'s KernelGenerated/KernelVerified pairs (~8 KB per kernel
event by default) plus one ModuleProposed per 64 kernels. Postgres: KZ_BENCH_POSTGRES_URL,
else a throwaway local cluster. Run: ``python -m benchmarks.bench_export`` (100k kernels;
``--kernels`` for fewer).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result
from benchmarks.bench_store import (
    create_database,
    make_history,
    mean_payload_bytes,
    raw_read,
    with_postgres,
)
from kz_stream.events import Event, ModuleProposed, ModuleValidation, new_event
from kz_stream.export import KernelFilter, collect_rows, write_export
from kz_stream.store import SqlEventStore, upgrade

MODULE = "import torch\n\nclass Model(torch.nn.Module):\n    pass\n"


def history(kernels: int, payload_bytes: int) -> list[Event]:
    modules = [
        new_event(ModuleProposed(module_id=f"module-{m}", api_set=["torch.relu", "torch.sum"],
                                 source=MODULE, validation=ModuleValidation(valid=True)),
                  stream_id=f"module-module-{m}", stream_version=0, correlation_id="bench")
        for m in range((kernels + 63) // 64)
    ]
    return modules + make_history(2 * kernels, payload_bytes)


async def main_async(args: argparse.Namespace, server_url: str, out: Path) -> None:
    events = history(args.kernels, args.payload)
    print(f"{len(events):,} events, mean payload {mean_payload_bytes(events):,.0f} B", flush=True)
    url = create_database(server_url, "kz_bench_export")
    upgrade(url)
    metrics: dict[str, dict[str, Any]] = {}
    async with SqlEventStore(url) as store:
        for i in range(0, len(events), args.batch):
            await store.append(events[i : i + args.batch])
        replays, raws, writes = [], [], []
        for _ in range(args.repeat):
            raws.append(raw_read(url, 5000))
            started = time.perf_counter()
            rows, position = await collect_rows(store, KernelFilter())
            replays.append(len(events) / (time.perf_counter() - started))
            started = time.perf_counter()
            counts = write_export(rows, out, ["sft", "verdicts", "rl"], flt=KernelFilter(),
                                  store_url=url, position=position)
            writes.append(sum(counts.values()) / (time.perf_counter() - started))
    print(f"rows: {counts}", flush=True)
    metrics["export replay (sft+verdicts+rl)"] = metric(max(replays), "events/s", max(raws))
    metrics["export parquet write"] = metric(max(writes), "rows/s")
    for name, m in metrics.items():
        base = f" (raw read {m['baseline']:,.0f}, ratio {m['ratio']:.2f})" if m["baseline"] else ""
        print(f"{name:36s} {m['value']:>9,.0f} {m['unit']}{base}", flush=True)
    notes = (
        f"{args.kernels:,} kernels ({len(events):,} events, mean payload "
        f"{mean_payload_bytes(events):,.0f} B) in PostgreSQL. Replay: collect_rows over the "
        "whole store (all three sets, rows in memory); baseline: raw psycopg server-side "
        f"cursor over the events table in the same run. Best of {args.repeat}."
    )
    if not args.dry_run:
        write_result("export", "python -m benchmarks.bench_export", metrics, notes=notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=100_000)
    parser.add_argument("--payload", type=int, default=8000, help="bytes per event payload")
    parser.add_argument("--batch", type=int, default=1000, help="events per append")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print, write no results")
    args = parser.parse_args()
    with_postgres(lambda server, tmp: main_async(args, server, tmp / "export"))


if __name__ == "__main__":
    main()
