"""``kz dataset export`` on a large history in PostgreSQL: the streamed export to parquet
(events/s and peak memory) and the in-memory replay (``collect_rows``, then writing its
rows), each next to a raw psycopg read of the same rows measured in the same run.

The history is ``bench_store``'s KernelGenerated/KernelVerified pairs (~8 KB per kernel
event by default) plus one ModuleProposed per 64 kernels. Each export runs in a fresh
process, so its peak resident memory is its own (not the benchmark's copy of the
history). Postgres: KZ_BENCH_POSTGRES_URL, else a throwaway local cluster. Run:
``python -m benchmarks.bench_export`` (100k kernels; ``--kernels`` for fewer).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
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
from kz_stream.export import DATASETS, KernelFilter, collect_rows, export_datasets, write_export
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


def export_once(url: str, out: str, streamed: bool, chunk_rows: int) -> dict[str, Any]:
    """One export in this (fresh) process: seconds replaying (streamed: the whole export),
    seconds writing, rows per set and the peak resident memory in MB."""

    async def go() -> dict[str, Any]:
        async with SqlEventStore(url) as store:
            started = time.perf_counter()
            if streamed:
                counts, _ = await export_datasets(store, Path(out), DATASETS, flt=KernelFilter(),
                                                  store_url=url, chunk_rows=chunk_rows)
                return {"replay_s": time.perf_counter() - started, "write_s": 0.0,
                        "counts": counts}
            rows, position = await collect_rows(store, KernelFilter())
            replay_s = time.perf_counter() - started
            started = time.perf_counter()
            counts = write_export(rows, Path(out), DATASETS, flt=KernelFilter(), store_url=url,
                                  position=position)
            return {"replay_s": replay_s, "write_s": time.perf_counter() - started,
                    "counts": counts}

    import datasets  # noqa: F401  (its import, ~1 s, is not the export's throughput)

    result = asyncio.run(go())
    result["peak_mb"] = peak_rss_mb()
    return result


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started its program: VmHWM, not
    ``ru_maxrss``, which a child inherits from the parent that forked it (here, one
    holding the history)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def in_fresh_process(*args: Any) -> dict[str, Any]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(export_once, *args).result()


async def load(url: str, args: argparse.Namespace) -> tuple[int, float]:
    """Stores the history; returns its event count and mean payload size."""
    events = history(args.kernels, args.payload)
    n, mean = len(events), mean_payload_bytes(events)
    print(f"{n:,} events, mean payload {mean:,.0f} B", flush=True)
    async with SqlEventStore(url) as store:
        for i in range(0, n, args.batch):
            await store.append(events[i : i + args.batch])
    return n, mean


def main_with(args: argparse.Namespace, server_url: str, out: Path) -> None:
    url = create_database(server_url, "kz_bench_export")
    upgrade(url)
    n, mean = asyncio.run(load(url, args))
    gc.collect()
    runs: dict[str, list[dict[str, Any]]] = {"streamed": [], "in memory": []}
    raws = []
    for _ in range(args.repeat):
        raws.append(raw_read(url, 5000))
        for kind in runs:
            done = in_fresh_process(url, str(out / kind.replace(" ", "-")), kind == "streamed",
                                    args.chunk_rows)
            runs[kind].append(done)
            print(f"{kind}: {n / done['replay_s']:,.0f} events/s, peak {done['peak_mb']:,.0f} MB, "
                  f"rows {done['counts']}", flush=True)
    raw = max(raws)
    streamed, memory = runs["streamed"], runs["in memory"]
    rows = sum(memory[0]["counts"].values())
    metrics = {
        "export to parquet, streamed (sft+verdicts+rl)": metric(
            max(n / r["replay_s"] for r in streamed), "events/s", raw),
        "export replay in memory (collect_rows, sft+verdicts+rl)": metric(
            max(n / r["replay_s"] for r in memory), "events/s", raw),
        "export parquet write (in-memory rows)": metric(
            max(rows / r["write_s"] for r in memory), "rows/s"),
        "export peak memory, streamed": metric(max(r["peak_mb"] for r in streamed), "MB"),
        "export peak memory, in memory (replay + write)": metric(
            max(r["peak_mb"] for r in memory), "MB"),
    }
    for name, m in metrics.items():
        base = f" (raw read {m['baseline']:,.0f}, ratio {m['ratio']:.2f})" if m["baseline"] else ""
        print(f"{name:56s} {m['value']:>9,.0f} {m['unit']}{base}", flush=True)
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    notes = (
        f"{args.kernels:,} kernels ({n:,} events, mean payload {mean:,.0f} B) in PostgreSQL, "
        f"rows {memory[0]['counts']}. Streamed: export_datasets (all three sets, verdict rows "
        f"written {args.chunk_rows:,} at a time; events/s over the whole export, writing "
        "included). In memory: collect_rows, then write_export. Each export in a fresh "
        "process (peak: its VmHWM, the interpreter with pyarrow and datasets included). "
        "Baseline: raw psycopg server-side cursor over the "
        f"events table in the same run. Best of {args.repeat}; load average at the end "
        f"{load_avg} (a shared machine)."
    )
    if not args.dry_run:
        write_result("export", "python -m benchmarks.bench_export", metrics, notes=notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=100_000)
    parser.add_argument("--payload", type=int, default=8000, help="bytes per event payload")
    parser.add_argument("--batch", type=int, default=1000, help="events per append")
    parser.add_argument("--chunk-rows", type=int, default=1000, help="verdict rows per write")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print, write no results")
    args = parser.parse_args()

    async def run(server: str, tmp: Path) -> None:
        await asyncio.to_thread(main_with, args, server, tmp / "export")

    with_postgres(run)


if __name__ == "__main__":
    main()
