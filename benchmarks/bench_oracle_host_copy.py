"""How the oracle's big tensors reach the host, ready to be sent as sealed memory files:
a host copy and then ``send``'s write of it into a new sealed file (the oracle's way until
2026-12-05, the baseline), against one copy straight into the file
(``_ipc.sealed_copy``, the oracle's way since). Both end with the tensor's bytes in a
sealed file that ``send`` passes as a descriptor.

On a GPU the tensors are on the device, as the oracle's inputs and outputs are (on an H100
an 8 GiB set's inputs took 6 s to reach the host and its reply 3-11 s more, 2026-12-05).
On the CPU (``--device cpu``) the baseline's host copy is the tensor itself, so the
figures compare the write into a file with the copy through a mapping of it.

Each figure is the median of ``--repeats`` rounds, the two ways interleaved, after one
uncounted round (a VM's first touch of memory).

Run: ``python -m benchmarks.bench_oracle_host_copy [--device cuda] [--sizes-gib 1 4]
[--repeats 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import metric, write_result  # noqa: E402
from kz_stream.verify import _ipc  # noqa: E402


def host_then_write_s(t: Any) -> float:
    """The baseline: ``t`` to the host, then written into a new sealed file."""
    import torch

    start = time.perf_counter()
    host = t.to("cpu")
    raw = host.reshape(-1).view(torch.uint8).numpy()
    fd = _ipc._sealed_file(memoryview(raw))
    took = time.perf_counter() - start
    assert fd is not None, "this host makes no sealed files"
    os.close(fd)
    return took


def sealed_copy_s(t: Any) -> float:
    """One copy of ``t`` straight into a sealed file."""
    start = time.perf_counter()
    copy = _ipc.sealed_copy(t)
    took = time.perf_counter() - start
    assert _ipc._shared_file(copy) is not None, "no sealed file was made"
    return took


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    metrics: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[float]] = {}
    for gib in args.sizes_gib:
        t = torch.full((int(gib * 2**30) // 4,), 1.5, device=args.device)
        ways = {"baseline": host_then_write_s, "sealed_copy": sealed_copy_s}
        for way in ways.values():  # the warm-up
            way(t)
        for _ in range(args.repeats):
            for name, way in ways.items():
                raw.setdefault(f"{gib:g} {name}", []).append(round(way(t), 3))
        base = statistics.median(raw[f"{gib:g} baseline"])
        new = statistics.median(raw[f"{gib:g} sealed_copy"])
        label = f"{gib:g} GiB float32 on {args.device}"
        metrics[f"{label}: to the host, then written into a sealed file"] = metric(
            round(base, 3), "s")
        metrics[f"{label}: one copy into a sealed file"] = metric(round(new, 3), "s", base)
        del t
    print("rounds (s):", raw)
    notes = (f"Median of {args.repeats} rounds per figure, the two ways interleaved, after "
             "one uncounted round. Each round's seconds: "
             + "; ".join(f"{k}: {v}" for k, v in raw.items()) + ".")
    command = "python -m benchmarks.bench_oracle_host_copy " + " ".join(sys.argv[1:])
    write_result("oracle_host_copy", command.strip(), metrics, notes=notes)


if __name__ == "__main__":
    main()
