"""How fast a prepared problem's inputs reach a worker (``_ipc.send`` of the verifier's
request, ``recv`` in the child): through the socket (the baseline, as before
2026-12-05's sharing) against shared (``_ipc.share``: the inputs in a sealed memory file,
whose descriptor the worker maps).

A trip runs from the request's send until the child has read every byte of the inputs
once (a sum: a worker moves them to the device so) and said so; the figure is the median
of ``--repeats`` trips, the modes interleaved, after one uncounted trip of each (a VM's
first touch of memory). A candidate's run, ablation and profile each send the inputs
again, and each sample of a problem has a worker of its own, so one problem's inputs make
many trips; sharing costs one copy into the file, once per prepared problem (``share``,
timed on its own).

Run: ``python -m benchmarks.bench_worker_inputs [--sizes-gib 1 4] [--repeats 5]``.
Run as ``python -m benchmarks.bench_worker_inputs --child FD`` it is the receiving worker.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import metric, write_result  # noqa: E402
from benchmarks.bench_ipc import start_child  # noqa: E402
from kz_stream.verify import _ipc  # noqa: E402
from kz_stream.verify._ipc import recv, send  # noqa: E402

MODES = ("socket", "shared")


def child(fd: int) -> None:
    """Receives input sets as a worker does and reads each byte once."""
    conn = Connection(fd)
    for msg in _ipc.requests(conn):
        total = sum(float(t.sum()) for t in msg["inputs"])
        send(conn, {"sum": total})


def trip_s(conn: Connection, inputs: list[Any]) -> float:
    t = time.perf_counter()
    send(conn, {"cmd": "run", "inputs": inputs})
    reply = recv(conn)
    took = time.perf_counter() - t
    assert reply["sum"] > 0
    return took


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--tensor-mib", type=int, default=1024,
                    help="the size of each input tensor")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    conn, proc = start_child("benchmarks.bench_worker_inputs")
    metrics: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[float]] = {}
    try:
        for gib in args.sizes_gib:
            n, each = int(gib * 2**30), args.tensor_mib << 20
            plain = [torch.full((min(each, n - i) // 4,), 1.5) for i in range(0, n, each)]
            shares = []
            for _ in range(4):  # the first uncounted (a VM's first touch of memory)
                shared = []  # the last one's files go first
                t = time.perf_counter()
                shared = [_ipc.share(v) for v in plain]
                shares.append(time.perf_counter() - t)
            share_s = statistics.median(shares[1:])
            raw[f"{gib:g} sharing"] = [round(x, 3) for x in shares]
            assert all(v.data_ptr() in _ipc._SHARED for v in shared)
            sets = {"socket": plain, "shared": shared}
            for mode in MODES:  # the warm-up
                trip_s(conn, sets[mode])
            for _ in range(args.repeats):
                for mode in MODES:
                    raw.setdefault(f"{gib:g} {mode}", []).append(
                        round(trip_s(conn, sets[mode]), 3))
            times = {mode: statistics.median(raw[f"{gib:g} {mode}"]) for mode in MODES}
            label = f"{gib:g} GiB of inputs ({len(plain)} tensors)"
            metrics[f"{label} through the socket"] = metric(round(times["socket"], 3), "s")
            metrics[f"{label} shared"] = metric(round(times["shared"], 3), "s",
                                                times["socket"])
            metrics[f"{label}: sharing them (once a problem)"] = metric(round(share_s, 3), "s")
            saved = times["socket"] - times["shared"]
            if saved > 0:  # else sharing never repays itself: no such figure
                metrics[f"{label}: trips that repay the sharing"] = metric(
                    round(share_s / saved, 1), "trips")
            del plain, shared, sets
    finally:
        conn.close()
        proc.wait(timeout=60)
    print("trips (s):", raw)
    notes = (f"Median of {args.repeats} trips per figure, the modes interleaved, after one "
             "uncounted trip of each; a trip is from sending the request until the child "
             "has summed every input (as a worker reads them once to move them to the "
             f"device) and replied. Float32 tensors of {args.tensor_mib} MiB. Baseline: the "
             "same inputs through the socket (the verifier before sharing). Sharing is one "
             "copy into a sealed memory file per input, once per prepared problem (the median "
             "of 3 after an uncounted one); the trips that repay it are that copy's "
             f"seconds over a trip's saving. Kernel {platform.release()}. Each trip's seconds: "
             + "; ".join(f"{k}: {v}" for k, v in raw.items()) + ".")
    command = "python -m benchmarks.bench_worker_inputs " + " ".join(sys.argv[1:])
    write_result("worker_inputs", command.strip(), metrics, notes=notes)


if __name__ == "__main__":
    main()
