"""How a worker's output reaches the verifier's device: through the host, as today (the
worker copies it to the host, ``_ipc.send`` passes it as a sealed memory file, the
verifier uploads it); the same with the worker writing it from the device straight into
the sealed file (``_ipc.sealed_copy``, as the oracle does); against a CUDA IPC handle
(``kz_stream/verify/_device_ipc.py``: the verifier opens the worker's memory and copies
it device to device). Each way from a child inside the workers' boundary
(``_sandbox.isolation``: its own PID, IPC, mount and network namespaces) and, for the
handle, from a plain child too: whether CUDA IPC works across the boundary is the
question before the verifier's outputs could travel so.

Each figure is the median of ``--repeats`` trips of one float32 tensor of ``--sizes-gib``,
from the parent's "go" until it holds a device copy of the child's tensor (checked
equal to the values the child made). A way that fails says why, and is kept as a row.

Run on a GPU host: ``python -m benchmarks.bench_device_ipc [--sizes-gib 1 4]
[--repeats 3] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
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

# The child runs as ``python -c`` (a jailed child sees the kz_stream package alone).
CHILD = r"""
import dataclasses, sys, torch
from multiprocessing.connection import Connection
from kz_stream.verify._ipc import recv, sealed_copy, send
from kz_stream.verify._device_ipc import export
conn = Connection(int(sys.argv[1]))
held = None
while True:
    cmd = recv(conn, trusted=True)
    if cmd["cmd"] == "stop":
        break
    held = None
    torch.cuda.empty_cache()
    t = torch.arange(cmd["bytes"] // 4, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    send(conn, {"ready": True})
    recv(conn, trusted=True)
    if cmd["mode"] == "host":
        send(conn, {"out": t.to("cpu")})
    elif cmd["mode"] == "sealed":
        send(conn, {"out": sealed_copy(t)})
    else:
        try:
            send(conn, {"exported": dataclasses.asdict(export(t))})
            held = t
        except Exception as e:
            send(conn, {"error": f"{type(e).__name__}: {e}"})
    del t
"""


class Side:
    """A child process (jailed or plain) with its channel."""

    def __init__(self, jailed: bool) -> None:
        from kz_stream.verify._sandbox import Isolation, child_env, isolation, jail_command

        self.private = tempfile.mkdtemp(prefix="kz-bench-dipc-")
        iso = isolation(True) if jailed else Isolation("none")
        self.level = iso.level
        a, b = socket.socketpair()
        self.conn = Connection(os.dup(a.fileno()))
        a.close()
        cmd = jail_command([sys.executable, "-c", CHILD, str(b.fileno())], self.private,
                           iso, gpu=True, cwd=self.private)
        self.err = open(os.path.join(self.private, "stderr.log"), "wb")
        self.proc = subprocess.Popen(cmd, env=child_env(self.private), cwd=self.private,
                                     stdout=self.err, stderr=self.err,
                                     pass_fds=(b.fileno(),))
        b.close()

    def stderr(self) -> str:
        return Path(self.private, "stderr.log").read_text(errors="replace")[-600:]

    def close(self) -> None:
        from kz_stream.verify._ipc import send

        try:
            send(self.conn, {"cmd": "stop"})
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
        self.err.close()
        shutil.rmtree(self.private, ignore_errors=True)


def trip(side: Side, mode: str, nbytes: int) -> float:
    """Seconds from "go" until this process holds a device copy of the child's tensor."""
    import torch

    from kz_stream.verify._device_ipc import Exported, Opened
    from kz_stream.verify._ipc import recv, send

    send(side.conn, {"cmd": "make", "bytes": nbytes, "mode": mode})
    if not side.conn.poll(120):
        raise RuntimeError(f"the child did not make its tensor: {side.stderr()}")
    recv(side.conn)
    t0 = time.perf_counter()
    send(side.conn, {"go": True})
    r = recv(side.conn, files=True)  # as the verifier reads a worker's reply
    if "error" in r:
        raise RuntimeError(r["error"])
    if mode in ("host", "sealed"):
        got = r["out"].to("cuda")
    else:
        opened = Opened(Exported(**{**r["exported"], "shape": tuple(r["exported"]["shape"])}))
        got = opened.tensor.clone()
        torch.cuda.synchronize()
        opened.close()
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    del r
    want = torch.arange(nbytes // 4, device="cuda", dtype=torch.float32)
    if not torch.equal(got, want):
        raise RuntimeError("the copy differs from the child's tensor")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_device_ipc needs a GPU")
    ways = [("host", True), ("sealed", True), ("handle", True), ("handle", False)]
    rows: list[dict[str, Any]] = []
    for mode, jailed in ways:
        side = Side(jailed)
        for gib in args.sizes_gib:
            nbytes = int(gib * (1 << 30)) // 4 * 4
            row: dict[str, Any] = {"way": mode, "child": side.level, "gib": gib}
            try:
                trip(side, mode, nbytes)  # the first trip warms both sides up
                times = [trip(side, mode, nbytes) for _ in range(args.repeats)]
                row |= {"ok": True, "s": statistics.median(times),
                        "gb_s": nbytes / statistics.median(times) / 1e9}
            except Exception as e:
                row |= {"ok": False, "error": f"{type(e).__name__}: {e}"[:400],
                        "stderr": side.stderr()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if not row["ok"]:
                break
        side.close()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_ipc_rows.json").write_text(json.dumps(rows, indent=1))
    metrics: dict[str, Any] = {}
    for gib in args.sizes_gib:
        base = next((r["s"] for r in rows if r["gib"] == gib and r["way"] == "host"
                     and r["ok"]), None)
        for r in rows:
            if r["gib"] == gib and r["way"] != "host" and r["ok"]:
                way = ("a handle" if r["way"] == "handle"
                       else "the host, written from the device into a sealed file")
                metrics[f"{gib:g} GiB through {way}, {r['child']} child"] = metric(
                    r["s"], "s (baseline: through the host, jailed child)", base)
        if base is not None:
            metrics[f"{gib:g} GiB through the host, jailed child"] = metric(base, "s")
    failed = [f"{r['way']} from a {r['child']} child: {r['error']}" for r in rows
              if not r["ok"]]
    notes = ("Failed: " + "; ".join(failed)) if failed else "Every way worked."
    write_result("device_ipc", "python -m benchmarks.bench_device_ipc "
                 + " ".join(sys.argv[1:]), metrics, notes=notes,
                 out_dir=args.out)


if __name__ == "__main__":
    main()
