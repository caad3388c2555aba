"""The KernelBench audit's figures, from the rows its slots wrote (``kz verify audit-suite
LEVEL --json FILE --resume``, docs/verifier.md "An audit over several GPU slots"): per
level, how many problems were audited of how many, how many could not be prepared (an
exception), admitted, rejected and why, input sets dropped (each named) and verdicts that
would rest on too few sets, and the time a problem took (admission and preparation).

    python -m benchmarks.kernelbench_audit LEVEL=FILE... [--expected N] [--machine TEXT]

``--expected`` is the problems of each level (100, 100 and 50 in KernelBench); a level
with fewer rows is reported as partial in the notes. Writes
benchmarks/results/kernelbench_audit.json and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result


def level_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What one level's rows say: counts, rejection reasons, dropped sets, times."""
    seconds = [float(r["admission_s"]) + float(r["prepare_s"]) for r in rows]
    return {
        "audited": len(rows),
        "errors": [r["name"] for r in rows if r.get("error")],
        "admitted": sum(1 for r in rows if r.get("admitted")),
        "rejected": {r["name"]: f"{r['reason']}: {r['detail'][:160]}" for r in rows
                     if r.get("admitted") is False},
        "dropped": {r["name"]: [f"{d['label']}: {d['reason']}" for d in r["dropped"]]
                    for r in rows if r.get("dropped")},
        "too_few_sets": [r["name"] for r in rows if r.get("too_few_sets")],
        "median_s": statistics.median(seconds) if seconds else 0.0,
        "max_s": max(seconds, default=0.0),
        "total_s": sum(seconds),
        "machines": sorted({r.get("machine", "") for r in rows}),
        "verifier_versions": sorted({r.get("verifier_version", "") for r in rows}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("levels", nargs="+", help="LEVEL=FILE: a level's audit rows")
    ap.add_argument("--expected", type=int, nargs="*", default=[100, 100, 50],
                    help="problems in each level, in the order given")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--note", default="", help="Appended to the notes (when the rows were made).")
    ap.add_argument("--command", default="kz verify audit-suite KernelBench/levelN --json "
                    "benchmarks/results/raw/audit_levelN.json --resume --time-limit T --jobs 2")
    args = ap.parse_args()
    metrics: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for spec, expected in zip(args.levels, args.expected, strict=False):
        level, _, path = spec.partition("=")
        f = level_figures(json.loads(Path(path).read_text()))
        metrics[f"level {level}: problems audited"] = metric(f["audited"], "problems",
                                                             float(expected))
        metrics[f"level {level}: could not be prepared"] = metric(len(f["errors"]),
                                                                  "problems (target 0)")
        metrics[f"level {level}: admitted"] = metric(f["admitted"], "problems",
                                                     float(f["audited"]))
        metrics[f"level {level}: input sets dropped"] = metric(
            sum(len(v) for v in f["dropped"].values()), "sets (each named in the notes)")
        metrics[f"level {level}: too few sets for a verdict"] = metric(
            len(f["too_few_sets"]), "problems (target 0)")
        metrics[f"level {level}: median seconds a problem"] = metric(f["median_s"], "s")
        reasons = Counter(v.split(":", 1)[0] for v in f["rejected"].values())
        notes.append(
            f"Level {level}: {f['audited']} of {expected} audited"
            f"{'' if f['audited'] >= expected else ' (PARTIAL)'} on {', '.join(f['machines'])}"
            f" ({', '.join(f['verifier_versions'])}); rejections {dict(reasons)}: "
            + "; ".join(f"{k}: {v}" for k, v in f["rejected"].items())
            + (f"; dropped sets: {f['dropped']}" if f["dropped"] else "")
            + (f"; errors: {f['errors']}" if f["errors"] else "")
            + f"; admission and preparation {f['total_s'] / 60:.1f} min in all, "
            f"max {f['max_s']:.1f} s a problem.")
    write_result("kernelbench_audit", args.command, metrics,
                 notes=" ".join([*notes, args.note]).strip(),
                 machine=args.machine)


if __name__ == "__main__":
    main()
