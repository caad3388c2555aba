"""Warm-start figures, read from the event stores that the project's own commands wrote.

The runs it reads (see docs/warmstart.md for the commands):

- the teacher run of ``kz warmstart data`` (its store): teacher kernels verified, the share
  judged correct, and verdicts per minute;
- ``kz eval run`` of the held-out synthesized modules with the warm Coder and with the bare
  model (the baseline, in the same store, same problems and sampling): pass@1 overall and by
  module kind;
- ``kz warmstart proposer-eval --json`` of the warm and the bare Proposer: valid-module rate.

    python -m benchmarks.bench_warmstart --teacher-store T.sqlite3 --eval-store E.sqlite3 \\
        --warm-run eval-heldout-warm [--base-run eval-heldout-base] \\
        --proposer-warm pw.json --proposer-base pb.json --manifest data/modules.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result
from kz_stream.evaluation import kernel_id_of, load_evaluation
from kz_stream.store import open_store


async def _teacher(url: str) -> dict[str, Any]:
    """The teacher run's verdicts, and verdicts per minute on each kind of machine that
    judged them (a resumed run can be judged partly on a CPU and partly on a GPU)."""
    statuses: Counter[str] = Counter()
    times: dict[str, list[datetime]] = {}
    async with open_store(url, create_schema=False) as store:
        async for batch in store.read_all(0, types=["KernelVerified"]):
            for r in batch:
                if str(r.event.correlation_id or "").startswith("eval-teacher-"):
                    payload = r.event.payload
                    statuses[payload["status"]] += 1
                    hw = payload.get("hardware") or {}
                    where = (f"{hw['gpu']}" if hw.get("gpu") else "CPU") + (
                        f", Triton {hw['triton']}" if hw.get("triton") else "")
                    times.setdefault(where, []).append(r.recorded_at)
    rates = {}
    for where, ts in times.items():
        minutes = (max(ts) - min(ts)).total_seconds() / 60 if len(ts) > 1 else 0.0
        rates[where] = ((len(ts) - 1) / minutes if minutes else 0.0, len(ts))
    return {"statuses": dict(statuses), "verified": sum(statuses.values()), "rates": rates}


async def _pass_at_1(url: str, run_id: str, kinds: dict[str, str]) -> dict[str, Any]:
    async with open_store(url, create_schema=False) as store:
        record = await load_evaluation(store, run_id)
    if record is None:
        raise SystemExit(f"no evaluation {run_id} in {url}")
    per_kind: dict[str, list[bool]] = {}
    statuses: Counter[str] = Counter()
    for p in record.started.problems:
        for i in range(record.started.samples):
            v = record.verdicts.get(kernel_id_of(run_id, p.problem_id, i))
            if v is None:
                continue
            statuses[str(v["status"])] += 1
            kind = kinds.get(Path(p.path).name, "unknown")
            per_kind.setdefault(kind, []).append(v["status"] == "correct")
    every = [ok for oks in per_kind.values() for ok in oks]
    return {"judged": len(every), "pass@1": sum(every) / len(every) if every else 0.0,
            "by_kind": {k: (sum(v) / len(v), len(v)) for k, v in sorted(per_kind.items())},
            "statuses": dict(statuses)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher-store",
                    help="the store of `kz warmstart data` (teacher figures; left out without it)")
    ap.add_argument("--eval-store", required=True)
    ap.add_argument("--warm-run", required=True)
    ap.add_argument("--base-run", help="the bare model's run in the eval store (the baseline)")
    ap.add_argument("--manifest", type=Path, required=True, help="modules.jsonl of the data")
    ap.add_argument("--proposer-warm", type=Path)
    ap.add_argument("--proposer-base", type=Path)
    ap.add_argument("--machine", default=None)
    ap.add_argument("--notes", default="")
    args = ap.parse_args(argv)

    def url(path: str) -> str:
        return path if "://" in path else f"sqlite+aiosqlite:///{Path(path).resolve()}"

    kinds = {Path(r["file"]).name: r["kind"]
             for r in map(json.loads, args.manifest.read_text().splitlines()) if r["file"]}
    teacher = asyncio.run(_teacher(url(args.teacher_store))) if args.teacher_store else None
    warm = asyncio.run(_pass_at_1(url(args.eval_store), args.warm_run, kinds))
    base: dict[str, Any] = {"pass@1": 0.0, "judged": 0, "by_kind": {}, "statuses": {}}
    if args.base_run:
        base = asyncio.run(_pass_at_1(url(args.eval_store), args.base_run, kinds))
    metrics = {
        "held-out pass@1, warm vs bare": metric(warm["pass@1"], "share",
                                                 base["pass@1"] if args.base_run else None),
        "held-out kernels judged (warm)": metric(float(warm["judged"]), "kernels"),
    }
    if teacher is not None:
        correct = teacher["statuses"].get("correct", 0)
        metrics["teacher kernels judged correct"] = metric(
            correct / max(1, teacher["verified"]), "share")
        metrics["teacher kernels verified"] = metric(float(teacher["verified"]), "kernels")
        for where, (rate, n) in sorted(teacher["rates"].items()):
            metrics[f"teacher verdicts per minute ({where}; {n} kernels)"] = metric(
                rate, "kernels/min")
    if args.base_run:
        metrics["held-out kernels judged (bare)"] = metric(float(base["judged"]), "kernels")
    for kind, (rate, n) in warm["by_kind"].items():
        # A bare model measured at 0 is a baseline of 0 (ratio undefined), not a missing one.
        b = base["by_kind"].get(kind, (0.0, 0))[0] if args.base_run else None
        metrics[f"held-out pass@1 {kind} (n={n})"] = metric(rate, "share", b)
    scores = {name: json.loads(path.read_text()) for name, path in
              (("warm", args.proposer_warm), ("bare", args.proposer_base)) if path is not None}
    if "warm" in scores:
        warm_p, bare_p = scores["warm"], scores.get("bare")
        metrics[f"Proposer valid-module rate, warm vs bare ({warm_p['sets']} sets)"] = metric(
            warm_p["valid_rate"], "share", bare_p["valid_rate"] if bare_p else None)
    if "bare" in scores:
        metrics[f"Proposer valid-module rate (bare, {scores['bare']['sets']} sets)"] = metric(
            scores["bare"]["valid_rate"], "share")
    notes = args.notes + (f" Statuses, warm: {warm['statuses']}; bare: "
                          f"{base['statuses'] if args.base_run else 'not run'};"
                          f" teacher: {teacher['statuses'] if teacher else 'not read'}.")
    write_result("warmstart", "python -m benchmarks.bench_warmstart " + " ".join(
        sys.argv[1:] if argv is None else argv), metrics, notes=notes.strip(),
        machine=args.machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
