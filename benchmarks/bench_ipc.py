"""How fast a big reply travels from a child process to the verifier (``_ipc.send`` and
``recv``): a reply of float32 tensors (like the oracle's input sets and expected outputs)
through the socket (the baseline), against as sealed memory files (what the oracle uses
since 2026-12-05: the parent maps them, copying nothing), and spilled to files under
/dev/shm (tmpfs, the oracle's way before, now the fallback on a host without sealed files)
and in a folder on disk (the child's private folder, where the jail hides /dev/shm); and
the socket as it was read before 2026-12-05 (``before``: multiprocessing's
``recv_bytes_into``, which holds each frame in a BytesIO and then copies it), the baseline
of the socket's figure.

Each figure is the median of ``--repeats`` trips, from the moment the child is told to
send (its tensors already made) until ``recv`` has returned the reply in the parent:
pickling, the child's writes and the parent's reads (none for a sealed file: the
parent's first reads of its pages come later, as faults, where it reads them). A first
trip of each mode is not counted: in a VM the first touch of guest memory is slow (up to
4x here), and it lands on whichever mode runs first.

Run: ``python -m benchmarks.bench_ipc [--sizes-gib 1 4] [--repeats 5]``.
Run as ``python -m benchmarks.bench_ipc --child FD`` it is the sending child.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import metric, write_result  # noqa: E402
from kz_stream.verify import _ipc  # noqa: E402
from kz_stream.verify._ipc import SHM, recv, send  # noqa: E402

MODES = ("before", "inline", "sealed", "shm", "disk")


def _recv_frame_before(conn: Connection, buf: Any) -> int:
    """How ``recv`` read a socket frame before 2026-12-05 (into a bytearray): a copy
    through a BytesIO."""
    return conn.recv_bytes_into(buf)


def child(fd: int) -> None:
    """Makes the tensors it is asked for, then sends them when told to."""
    import torch

    conn = Connection(fd)
    reply: list[Any] = []
    while True:
        try:
            cmd = recv(conn)
        except EOFError:
            return
        if cmd["cmd"] == "make":
            n, each = int(cmd["bytes"]), int(cmd["tensor_bytes"])
            # Filled, so their pages exist before the clock starts (as the oracle's do).
            reply = [torch.full((min(each, n - i) // 4,), 1.5) for i in range(0, n, each)]
            send(conn, {"made": len(reply)})
        elif cmd["cmd"] == "send":
            _ipc._SEALING = bool(cmd["sealing"])  # off: the spill files' path
            send(conn, {"sets": reply}, cmd["spill_dir"])


def _shmem_huge() -> str:
    """The kernel's huge-page setting for tmpfs (the one in brackets)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def trip_s(conn: Connection, spill_dir: str | None, before: bool = False,
           sealing: bool = False) -> float:
    """Seconds for one reply's trip, child to parent; ``before``: read as before the
    socket's frames went straight into their buffers; ``sealing``: big buffers as sealed
    memory files (with a ``spill_dir``), else through its files."""
    now = _ipc._recv_frame_into, _ipc._zeroed
    if before:  # and into a bytearray, as then
        _ipc._recv_frame_into = _recv_frame_before  # type: ignore[assignment]
        _ipc._zeroed = bytearray  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        send(conn, {"cmd": "send", "spill_dir": spill_dir, "sealing": sealing})
        reply = recv(conn, spill_dir)
        took = time.perf_counter() - t
    finally:
        _ipc._recv_frame_into, _ipc._zeroed = now  # type: ignore[assignment]
    assert reply["sets"]
    del reply
    return took


def start_child(module: str) -> tuple[Connection, subprocess.Popen[bytes]]:
    """``python -m module --child FD`` and this end of its socket."""
    a, b = socket.socketpair()
    conn = Connection(os.dup(a.fileno()))
    a.close()
    proc = subprocess.Popen([sys.executable, "-m", module, "--child", str(b.fileno())],
                            pass_fds=(b.fileno(),), cwd=ROOT)
    b.close()
    return conn, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--tensor-mib", type=int, default=256,
                    help="the size of each tensor of the reply")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(),
                    help="where the disk folder is made (a disk, not tmpfs)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    conn, proc = start_child("benchmarks.bench_ipc")
    shm = tempfile.mkdtemp(prefix="kz-bench-spill-", dir=SHM)
    folders = {"shm": shm, "sealed": shm,
               "disk": tempfile.mkdtemp(prefix="kz-bench-spill-", dir=args.disk_dir)}
    where = {"before": "through the socket, read as before (a BytesIO copy)",
             "inline": "through the socket", "sealed": "as sealed memory files",
             "shm": "spilled to /dev/shm",
             "disk": f"spilled to a disk folder ({args.disk_dir})"}
    metrics: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[float]] = {}
    try:
        for gib in args.sizes_gib:
            n = int(gib * 2**30)
            send(conn, {"cmd": "make", "bytes": n, "tensor_bytes": args.tensor_mib << 20})
            made = recv(conn)["made"]
            times: dict[str, float] = {}
            for mode in MODES:  # the warm-up
                trip_s(conn, folders.get(mode), mode == "before", mode == "sealed")
            for _ in range(args.repeats):  # interleaved: drift hits every mode alike
                for mode in MODES:
                    took = trip_s(conn, folders.get(mode), mode == "before",
                                  mode == "sealed")
                    raw.setdefault(f"{gib:g} {mode}", []).append(round(took, 3))
            for mode in MODES:
                times[mode] = statistics.median(raw[f"{gib:g} {mode}"])
            assert not any(os.listdir(d) for d in folders.values())  # recv removed them
            label = f"{gib:g} GiB reply ({made} tensors)"
            baseline = {"before": None, "inline": "before", "sealed": "inline", "shm": "inline",
                        "disk": "inline"}
            for mode in MODES:
                b = baseline[mode]
                base = None if b is None else times[b]
                metrics[f"{label} {where[mode]}"] = metric(round(times[mode], 3), "s", base)
            for mode in MODES:
                b = baseline[mode]
                base_rate = None if b is None else n / 1e9 / times[b]
                metrics[f"{label} {where[mode]}, rate"] = metric(
                    round(n / 1e9 / times[mode], 3), "GB/s", base_rate)
    finally:
        conn.close()
        proc.wait(timeout=60)
        for d in folders.values():
            shutil.rmtree(d, ignore_errors=True)
    print("trips (s):", raw)
    notes = (f"Median of {args.repeats} trips per figure, the modes interleaved, after one "
             "uncounted trip of each (a VM's first touch of memory); a trip is "
             "from telling the child to send (its tensors made and filled) until `recv` "
             f"returns in the parent. Tensors of {args.tensor_mib} MiB, float32; the "
             "baseline is the same reply through the socket (`send`/`recv` with no spill "
             f"folder), as before the spill. Kernel {platform.release()}; /dev/shm's huge "
             f"pages: {_shmem_huge()}. Each trip's seconds: "
             + "; ".join(f"{k}: {v}" for k, v in raw.items()) + ".")
    command = "python -m benchmarks.bench_ipc " + " ".join(sys.argv[1:])
    write_result("ipc", command.strip(), metrics, notes=notes)


if __name__ == "__main__":
    main()
