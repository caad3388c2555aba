"""Verified candidates per GPU-minute on a KernelBench-size mix (docs/verifier.md).

The problems are the full-size corpus's levels 1 and 2 (``kz_stream/testing/corpus/
full_size.py``: losses, reductions, softmax, activations with 6-8 GB of inputs, norms, a
4096² matmul, fused GEMMs; written here after KernelBench's ops and published sizes), each
with ``--samples`` copies of its honest Triton kernel (distinct sources), sent as an
evaluation sends them: a problem's samples together, all problems at once, so a problem is
prepared once for its samples. The baseline is the plain single-process loop
(KernelBench-style: 5 random inputs, allclose, 100 timed trials each side;
``bench_verifier``'s part (d)) on the same candidates, in the same run, after the verifier.
Each side has ``--time-limit`` seconds (the plain loop ``--plain-time-limit`` where given:
it prepares nothing, so its rate is about the same over a shorter window, which leaves a
10-minute GPU call room for a longer one of the verifier's, whose preparation of the first
problems weighs less in it); a side's rate is the candidates it finished in its time per
minute, so a cut run still measures (and says how many it finished). Every
candidate is honest, so every verdict but ``correct`` is a wrong one: their count is the
corpus's "0 wrong verdicts" figure at full size. The raw rows (``--out``) hold each
finished candidate's times and, every 5 s, the verifier's occupancy
(``Verifier.occupancy``: problems in use, candidates in their GPU stage, busy oracles,
the device's room held and waited for, timing): where the unfinished ones were.

Run on a GPU: ``python -m benchmarks.bench_verifier_mix --samples 4 --time-limit 240
--out DIR``; ``--small`` checks the path on the CPU at the corpus's small sizes (the
verifier's CPU path; the plain loop needs CUDA and is left out) and writes no result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_verifier import _plain_check, _vary_python  # noqa: E402
from kz_stream.evaluation._run import EVAL_ORACLES_PER_GPU  # noqa: E402
from kz_stream.testing.corpus.full_size import (  # noqa: E402
    FULL_SIZE_HONEST,
    FULL_SIZE_PROBLEMS,
    input_bytes,
)

LEVELS_1_AND_2 = ("level1", "level2")


def mix(samples: int, full: bool, seed: int = 0) -> list[tuple[str, str, str]]:
    """(problem name, reference source, candidate source): the problems in a seeded
    order, each problem's samples together."""
    names = [n for n, p in FULL_SIZE_PROBLEMS.items()
             if p.kernelbench.startswith(LEVELS_1_AND_2) and n in FULL_SIZE_HONEST]
    random.Random(seed).shuffle(names)
    return [(n, FULL_SIZE_PROBLEMS[n].source(full), _vary_python(FULL_SIZE_HONEST[n], i))
            for n in names for i in range(samples)]


async def verify_mix(jobs: list[tuple[str, str, str]], time_limit: float,
                     save: Any, oracles: int, slots: int | None = None,
                     output_handles: bool = True) -> dict[str, Any]:
    """Sends every candidate to one verifier at once; what it finishes in ``time_limit``."""
    from kz_stream.verify import Candidate, Problem, Verifier, VerifierConfig

    rows: list[dict[str, Any]] = []
    config = VerifierConfig(oracles=oracles, output_handles=output_handles, **(
        {} if slots is None else {"candidates_per_gpu": slots}))
    async with Verifier(config) as v:
        t0 = time.monotonic()

        async def one(name: str, ref: str, cand: str) -> None:
            d = await v.verify(Problem(ref), Candidate(cand, "triton"))
            rows.append({"problem": name, "status": d.status.value, "check": d.check,
                         "reason": (d.reason or "")[:200], "speedup": d.speedup,
                         "done_s": round(time.monotonic() - t0, 2),
                         # where the time went: the preparation's phases (shared by a
                         # problem's samples) and the candidate's stages
                         **{k: d.details.get(k) for k in ("seconds", "reference_facts_s",
                                                          "host_wait_s", "prepare_s",
                                                          "gpu_wait_s", "room_wait_s",
                                                          "retry_wait_s", "timing_s",
                                                          "prepare_phases", "room_bytes",
                                                          "stage_s", "outputs_by_handle")}})
            print(f"  {name}: {d.status.value} {d.check or ''} {d.speedup} "
                  f"at {rows[-1]['done_s']} s", flush=True)
            save({"verifier_rows": rows})

        timeline: list[dict[str, Any]] = []

        async def watch() -> None:  # where the unfinished ones are: they leave no row
            while True:
                timeline.append({"t": round(time.monotonic() - t0, 1), **v.occupancy()})
                save({"occupancy": timeline})
                await asyncio.sleep(5)

        watcher = asyncio.create_task(watch())
        tasks = [asyncio.create_task(one(*j)) for j in jobs]
        _, pending = await asyncio.wait(tasks, timeout=time_limit)
        wall = min(time.monotonic() - t0, time_limit)
        watcher.cancel()
        for t in pending:
            t.cancel()
        await asyncio.gather(watcher, *pending, return_exceptions=True)
    return {"sent": len(jobs), "done": len(rows), "wall_s": wall,
            "per_min": 60 * len(rows) / wall, "rows": rows, "waits": waits(rows, timeline)}


def waits(rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> str:
    """Where the finished candidates waited (medians and maxima of their waits for host
    memory, the device's room, a slot and the shared lock) and what the unfinished ones
    queued for (the most requests waiting for host memory and for each device's room at
    once): the run's own account of its window."""
    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        ordered = sorted(values)
        return f"{ordered[len(ordered) // 2]:.1f}/{ordered[-1]:.1f}"

    def of(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) is not None]

    lock = [float((r.get("stage_s") or {}).get("lock_wait", 0.0)) for r in rows]
    host_q = max((o["host_waiting"] for o in timeline), default=0)
    room_q = max((lane["room_waiting"] for o in timeline for lane in o["lanes"]), default=0)
    return (f"waits in s, median/max of finished candidates: host memory "
            f"{spread(of('host_wait_s'))}, device room {spread(of('room_wait_s'))}, room "
            f"and slot {spread(of('gpu_wait_s'))}, shared lock {spread(lock)}; at most "
            f"{host_q} problems waiting for host memory and {room_q} requests for a "
            f"device's room at once")


def plain_mix(jobs: list[tuple[str, str, str]], time_limit: float) -> dict[str, Any]:
    """The same candidates through the plain loop in one spawned process, in order, for
    ``time_limit`` seconds."""
    d = tempfile.mkdtemp(prefix="kz-plain-mix-")
    results: list[dict[str, Any]] = []
    with mp.get_context("spawn").Pool(1) as pool:
        t0 = time.monotonic()
        pending = [pool.apply_async(_plain_check, (ref, cand, d)) for _, ref, cand in jobs]
        for (name, _, _), p in zip(jobs, pending, strict=True):
            left = time_limit - (time.monotonic() - t0)
            if left <= 0:
                break
            try:
                r = p.get(timeout=left)
            except mp.TimeoutError:
                break
            except Exception as e:  # the plain loop's own failure is its verdict
                r = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            results.append({"problem": name, **r})
            print(f"  plain {name}: {r}", flush=True)
        wall = min(time.monotonic() - t0, time_limit)
        pool.terminate()
    return {"done": len(results), "wall_s": wall, "per_min": 60 * len(results) / wall,
            "rows": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4, help="candidates per problem")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for each side")
    ap.add_argument("--plain-time-limit", type=float, default=None,
                    help="seconds for the plain loop, if not --time-limit (its rate is "
                         "steady from its first candidate: it prepares nothing ahead)")
    ap.add_argument("--small", action="store_true",
                    help="the corpus's small sizes on the CPU path: no plain loop, no result")
    ap.add_argument("--out", type=Path, default=None, help="raw rows, written as they come")
    ap.add_argument("--oracles", type=int, default=EVAL_ORACLES_PER_GPU,
                    help="problems prepared at once (kz eval run's default on a GPU)")
    ap.add_argument("--slots", type=int, default=None,
                    help="candidates in their GPU stage at once (default: the verifier's)")
    ap.add_argument("--output-handles", action=argparse.BooleanOptionalAction, default=True,
                    help="workers hand big device outputs over by CUDA IPC handle "
                         "(VerifierConfig.output_handles, on by default; "
                         "--no-output-handles: through the host)")
    ap.add_argument("--note", default="", help="appended to the result's notes")
    args = ap.parse_args()
    jobs = mix(args.samples, full=not args.small)
    raw: dict[str, Any] = {}

    def save(part: dict[str, Any]) -> None:
        raw.update(part)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "verifier_mix_raw.json").write_text(json.dumps(raw, indent=1,
                                                                       default=str))

    problems = sorted({n for n, _, _ in jobs})
    gb = sum(input_bytes(FULL_SIZE_PROBLEMS[n], not args.small) for n in problems) / 2**30
    print(f"{len(problems)} problems ({gb:.1f} GB of inputs), {len(jobs)} candidates",
          flush=True)
    ours = asyncio.run(verify_mix(jobs, args.time_limit, save, args.oracles, args.slots,
                                  args.output_handles))
    save({"verifier": {k: v for k, v in ours.items() if k != "rows"}})
    print(f"verifier: {ours['done']}/{ours['sent']} in {ours['wall_s']:.0f} s = "
          f"{ours['per_min']:.1f}/min; {ours['waits']}", flush=True)
    if args.small:
        return
    plain = plain_mix(jobs, args.plain_time_limit or args.time_limit)
    save({"plain": plain})
    print(f"plain loop: {plain['done']} in {plain['wall_s']:.0f} s = "
          f"{plain['per_min']:.1f}/min", flush=True)
    write(ours, plain, args)


def write(ours: dict[str, Any], plain: dict[str, Any], args: argparse.Namespace) -> None:
    from benchmarks._results import metric, write_result
    from kz_stream.verify import VerifierConfig

    statuses = Counter(r["status"] for r in ours["rows"])
    wrong = sum(n for s, n in statuses.items() if s != "correct")
    m = {
        "verified per GPU-min, KernelBench-size mix": metric(
            ours["per_min"], "candidates/GPU-min (target >= 30)", plain["per_min"]),
        "plain loop per min": metric(plain["per_min"], "candidates/min"),
        "honest candidates judged": metric(float(ours["done"]), "candidates"),
        "wrong verdicts on honest candidates": metric(float(wrong), "verdicts (target 0)"),
    }
    notes = (f"{len({r[0] for r in mix(args.samples, True)})} problems of the full-size "
             f"corpus (levels 1 and 2), {args.samples} samples each, all sent at once; the "
             f"verifier {args.time_limit:.0f} s, the plain loop "
             f"{args.plain_time_limit or args.time_limit:.0f} s; {args.oracles} oracles; "
             f"{args.slots or VerifierConfig().candidates_per_gpu} candidate slots; "
             f"outputs {'by device handle' if args.output_handles else 'through the host'}; "
             f"verifier finished "
             f"{ours['done']} of {ours['sent']}, plain loop {plain['done']}; "
             f"verdicts {dict(statuses)}; {ours['waits']}")
    if args.note:
        notes += f"; {args.note}"
    write_result("verifier_mix", "python -m benchmarks.bench_verifier_mix "
                 + " ".join(sys.argv[1:]), m, notes=notes)


if __name__ == "__main__":
    main()
