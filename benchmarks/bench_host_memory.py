"""Peak host memory of the verifier on full-size KernelBench problems, with the host
byte budget (``VerifierConfig.host_budget_bytes``) against without it (the baseline).

Each variant runs in a child process that verifies ``--candidates`` honest kernels of
each of ``--problems`` (problems of ``kz_stream.testing.corpus.full_size``, at their
published sizes unless ``--small``) all at once, with ``--oracles`` oracles; the parent
samples the resident memory of the child's whole process tree (workers and oracles
included; ``tree_memory``: pages shared between them counted once) and of /dev/shm
every 0.2 s. A variant the kernel's OOM killer stops is
reported as killed, with the peak it reached: on the H200 host (125 GiB) the verifier
without a budget was killed by three ReLU and three softmax candidates (2026-12-02).

Run: ``python -m benchmarks.bench_host_memory [--problems relu softmax] [--candidates 3]
[--oracles 2] [--small]``. ``--variant budget|none`` runs one variant in this process
(what the parent starts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import metric, write_result  # noqa: E402
from kz_stream.verify._ipc import tree_memory  # noqa: E402

# No budget: more bytes than any host has.
UNLIMITED = 1 << 60


def _shm_used() -> int:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return 0
    return usage.used


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Verifies the candidates at once in this process; returns counts and seconds."""
    from kz_stream.testing.corpus.full_size import FULL_SIZE_HONEST, FULL_SIZE_PROBLEMS
    from kz_stream.verify import Candidate, Problem, Verifier, VerifierConfig

    budget = None if args.variant == "budget" else UNLIMITED
    config = VerifierConfig(devices=[] if args.small else None, oracles=args.oracles,
                            host_budget_bytes=budget)

    async def go() -> dict[str, Any]:
        t0 = time.monotonic()
        statuses: dict[str, int] = {}
        async with Verifier(config) as v:
            jobs = [v.verify(Problem(FULL_SIZE_PROBLEMS[name].source(not args.small), name),
                             Candidate(f"# sample {i}\n{FULL_SIZE_HONEST[name]}", "triton"))
                    for name in args.problems for i in range(args.candidates)]
            for verdict in await asyncio.gather(*jobs):
                statuses[verdict.status.value] = statuses.get(verdict.status.value, 0) + 1
            limit = v._host.limit
        return {"seconds": time.monotonic() - t0, "statuses": statuses,
                "budget_bytes": None if limit >= UNLIMITED else limit}

    return asyncio.run(go())


def measure(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """Runs one variant in a child process and samples its tree's memory."""
    cmd = [sys.executable, "-m", "benchmarks.bench_host_memory", "--variant", variant,
           "--oracles", str(args.oracles), "--candidates", str(args.candidates),
           "--problems", *args.problems, *(["--small"] if args.small else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    peak, shm_base, shm_peak = 0, _shm_used(), 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, shm_peak
        while not done.is_set():
            peak = max(peak, tree_memory(proc.pid))
            shm_peak = max(shm_peak, _shm_used() - shm_base)
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    row: dict[str, Any] = {"variant": variant, "returncode": proc.returncode,
                           "peak_gib": peak / 2**30, "shm_peak_gib": shm_peak / 2**30}
    if proc.returncode == 0:
        row.update(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=["relu", "softmax"])
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--oracles", type=int, default=2)
    parser.add_argument("--small", action="store_true",
                        help="CPU sizes on the CPU path (checks the mechanics only)")
    parser.add_argument("--variant", choices=["budget", "none"])
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return
    rows = {v: measure(args, v) for v in ("budget", "none")}
    b, n = rows["budget"], rows["none"]

    def outcome(r: dict[str, Any]) -> str:
        return ("killed" if r["returncode"] in (-9, 137) else
                f"exit {r['returncode']}" if r["returncode"] else json.dumps(r["statuses"]))

    metrics = {
        "peak tree memory (PSS), with the budget": metric(b["peak_gib"], "GiB", n["peak_gib"]),
        "peak /dev/shm, with the budget": metric(b["shm_peak_gib"], "GiB", n["shm_peak_gib"]),
    }
    if "seconds" in b and "seconds" in n:
        metrics["wall time, with the budget"] = metric(b["seconds"], "s", n["seconds"])
    command = "python -m benchmarks.bench_host_memory " + " ".join(sys.argv[1:])
    notes = (f"{args.candidates} honest candidates of each of {', '.join(args.problems)} "
             f"at {'CPU' if args.small else 'published'} sizes at once, {args.oracles} "
             f"oracles; baseline: no budget. Outcomes: with the budget "
             f"({(b.get('budget_bytes') or 0) / 2**30:.0f} GiB) {outcome(b)}; "
             f"without {outcome(n)}.")
    if not args.small:  # the CPU sizes check the mechanics; their figures mean nothing
        write_result("host_memory", command, metrics, notes=notes, out_dir=args.out_dir)
    print(notes)


if __name__ == "__main__":
    main()
