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

``--prepare-only`` measures what the host budget reserves for a problem's preparation
(``preparation_bytes``, the baseline) against what preparing it takes: each problem is
prepared alone (``Verifier.inspect_problem``) in a child of its own, after the same
problem at CPU size has started the oracle, while the child samples the host's
``MemAvailable`` every 0.05 s; the drop from before is the preparation's use (the
oracle's sets and the verifier's view of them; the sealed files they share count once,
which ``tree_memory`` would count twice). Run it on a quiet host.
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


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return 1024 * int(line.split()[1])
    return 0


def prepare_one(args: argparse.Namespace) -> dict[str, Any]:
    """Prepares the one problem of ``--problems`` in this process; returns the drop in
    the host's available memory while it did, and what the budget reserved for it."""
    from kz_stream.testing.corpus.full_size import FULL_SIZE_PROBLEMS
    from kz_stream.verify import Problem, Verifier, VerifierConfig

    name = args.problems[0]
    config = VerifierConfig(devices=[] if args.small else None, oracles=1, prewarm=0)

    async def go() -> dict[str, Any]:
        async with Verifier(config) as v:
            # The oracle starts (imports, CUDA context) on a problem of CPU size first.
            warm = await v.inspect_problem(Problem(FULL_SIZE_PROBLEMS[name].source(False)))
            before = low = _mem_available()
            done = threading.Event()

            def sample() -> None:
                nonlocal low
                while not done.is_set():
                    low = min(low, _mem_available())
                    done.wait(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.monotonic()
            info = await v.inspect_problem(
                Problem(FULL_SIZE_PROBLEMS[name].source(not args.small), name))
            done.set()
            sampler.join()
        return {"problem": name, "used_bytes": before - low, "seconds": time.monotonic() - t0,
                "reserved_bytes": int(info.get("reserved_bytes", 0)),
                "host_bytes": int(info.get("host_bytes", 0)),
                "input_bytes": int(info.get("input_bytes", 0)),
                "error": info.get("error") or warm.get("error")}

    return asyncio.run(go())


def prepare_only(args: argparse.Namespace) -> None:
    """Each problem's preparation in a child of its own: used against reserved."""
    metrics: dict[str, dict[str, Any]] = {}
    rows = []
    for name in args.problems:
        cmd = [sys.executable, "-m", "benchmarks.bench_host_memory", "--prepare-one",
               "--problems", name, *(["--small"] if args.small else [])]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode:
            row: dict[str, Any] = {"problem": name, "returncode": proc.returncode}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            reserved = row["reserved_bytes"] / 2**30
            metrics[f"{name}: host memory its preparation used"] = metric(
                row["used_bytes"] / 2**30, "GiB", reserved or None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    command = "python -m benchmarks.bench_host_memory " + " ".join(sys.argv[1:])
    notes = ("Each problem prepared alone at its published size, one oracle; value: the "
             "drop in the host's MemAvailable while it was prepared; baseline: what the "
             "host budget reserves for it (preparation_bytes). Rows: "
             + "; ".join(json.dumps(r) for r in rows))
    if not args.small and metrics:
        write_result("preparation_memory", command, metrics, notes=notes,
                     out_dir=args.out_dir)


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
    parser.add_argument("--prepare-only", action="store_true",
                        help="each problem's preparation alone: used against reserved")
    parser.add_argument("--prepare-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return
    if args.prepare_one:
        print(json.dumps(prepare_one(args)), flush=True)
        return
    if args.prepare_only:
        prepare_only(args)
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
