"""The filesystem boundary against the hostile-kernel corpus, and what it costs.

(a) Every candidate of ``kz_stream/testing/corpus/hostile.py`` through the verifier's CPU path
    with the static scan off (the boundary and the audit hooks alone): side effects
    outside the scratch folders (target 0), connections accepted by the store and broker
    ports (0), secrets or LEAKs in a verdict (0), bomb processes left (0), the verifier
    alive afterwards (an honest ReLU still verified correct), and each item's verdict.
    The baseline: the same corpus with the workers in a network namespace alone (the
    isolation before the boundary; ``strong_isolation=False``), less the two acts that
    are not safe to run there (the fork bomb has no bound, and the worker's parent is the
    verifier itself).
(b) The start of a CPU worker (spawn to ready) inside the jail against a network namespace
    alone, the boundary's cost.

Run: ``python -m benchmarks.bench_sandbox``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import metric, write_result  # noqa: E402
from kz_stream.testing.corpus.hostile import PROBLEM, HostileHost, Outcome, run_corpus  # noqa: E402
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST  # noqa: E402
from kz_stream.verify import (  # noqa: E402
    Candidate,
    Problem,
    Status,
    Verifier,
    VerifierConfig,
    isolation,
)
from kz_stream.verify._ipc import Child  # noqa: E402  (the start-up it measures)


def _before(o: Outcome | None) -> str:
    if o is None:
        return "not run"
    got = [f"{len(o.side_effects)} file(s) left"] if o.side_effects else []
    got += ["leaked into the verdict"] if o.leaked else []
    got += [f"{o.connections} connection(s)"] if o.connections else []
    return f"{o.status}" + (": " + ", ".join(got) if got else "")


def counts(out: list[Outcome]) -> dict[str, int]:
    """What got past the isolation, summed over a corpus run."""
    return {"files": sum(len(o.side_effects) for o in out),
            "connections": sum(o.connections for o in out),
            "leaks": sum(o.leaked for o in out),
            "bombs": sum(len(o.bomb_left) for o in out)}


def worker_start_s(strong: bool, n: int) -> list[float]:
    """Seconds from spawn to a ready CPU worker, ``n`` times one after another."""
    out = []
    for _ in range(n):
        t = time.monotonic()
        child = Child("kz_stream.verify._worker", ["cpu"], isolate=True, strong=strong,
                      gated=True)
        try:
            child.wait_warm()
            out.append(time.monotonic() - t)
        finally:
            child.kill()
    return out


UNSAFE_WITHOUT_JAIL = ("fork_bomb", "kill_parent")


def corpus(jail: bool) -> tuple[list[Outcome], float, bool]:
    """The corpus's outcomes, its wall time, and whether the verifier still verifies an
    honest ReLU afterwards."""
    host = HostileHost()
    v = Verifier(VerifierConfig(devices=[], static_scan=False, prewarm=1, call_timeout_s=6,
                                cpu_worker_memory_mb=4096, strong_isolation=jail))
    names = None if jail else [n for n in host.sources() if n not in UNSAFE_WITHOUT_JAIL]
    try:
        started = time.monotonic()
        outcomes = run_corpus(v, host, names)
        wall = time.monotonic() - started
        honest = v.verify_sync(Problem(PROBLEM), Candidate(TRITON_HONEST["relu"], "triton"))
    finally:
        v.close_sync()
        host.close()
    return outcomes, wall, honest.status is Status.CORRECT


def main() -> None:
    iso = isolation()
    if iso.level != "jail":
        sys.exit(f"no filesystem boundary on this host: {iso.describe()}")
    outcomes, corpus_s, alive = corpus(True)
    before, _, alive_before = corpus(False)
    jail = worker_start_s(True, 5)
    plain = worker_start_s(False, 5)
    now, was = counts(outcomes), counts(before)
    metrics: dict[str, dict[str, Any]] = {
        "hostile candidates run": metric(len(outcomes), "candidates", len(before)),
        "side effects outside scratch": metric(now["files"], "files", was["files"]),
        "connections accepted (store, broker ports)": metric(
            now["connections"], "connections", was["connections"]),
        "secrets or LEAKs in verdicts": metric(now["leaks"], "verdicts", was["leaks"]),
        "bomb processes left": metric(now["bombs"], "processes", was["bombs"]),
        "verifier alive after the corpus": metric(int(alive), "1 = yes", int(alive_before)),
        "corpus wall time": metric(round(corpus_s, 1), "s"),
        "CPU worker start, jail (median of 5)": metric(
            round(statistics.median(jail), 3), "s", round(statistics.median(plain), 3)),
    }
    was_by_name = {o.name: o for o in before}
    rows = "".join(
        f"| {o.name} | {o.status} | {o.reason[:100].replace('|', '/')} | "
        f"{_before(was_by_name.get(o.name))} |\n" for o in outcomes)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    notes = (
        f"Isolation: {iso.describe()}. Load average at the end (1, 5, 15 min): {load} (a "
        f"shared machine: times are inflated with it). Static scan off; call timeout 6 s; "
        f"CPU worker address space capped at 4096 MB. Baselines: the same corpus with the "
        f"workers in a network namespace alone (the isolation before the boundary), "
        f"without {' and '.join(UNSAFE_WITHOUT_JAIL)} (unbounded there, and the worker's "
        f"parent is the verifier). A `correct` verdict under the boundary is an act that "
        f"harmed nothing: writes to /tmp land in the child's own /tmp (thrown away), no "
        f"other process is in view, and the jail's first process ignores a SIGKILL sent "
        f"from inside.\n\n"
        f"| candidate | verdict | reason | without the boundary |\n|---|---|---|---|\n"
        f"{rows}")
    write_result("sandbox", "python -m benchmarks.bench_sandbox", metrics, notes=notes)


if __name__ == "__main__":
    main()
