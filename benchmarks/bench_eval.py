"""KernelBench evaluation figures: a policy against the base model, from `kz eval report`.

An evaluation is a `kz eval run` (on the GPU host: it samples, verifies and stores) and a
`kz eval report` (anywhere the store is); this script compares the reports of two runs of
the same problems, the base model as the baseline, and writes benchmarks/results/eval.json
and docs/benchmarks.md. For example (H200, the first 5 problems of level 1):

    kz eval run KernelBench/level1 --limit 5 --samples 10 --max-new-tokens 1024 --seed 0 \\
        --device cuda --batch-size 320 --concurrency 32 --run-id eval-kb-l1-base5
    kz eval run KernelBench/level1 --limit 5 ... --policy kz_stream/data/warmstart/coder \\
        --run-id eval-kb-l1-warm5
    kz eval report eval-kb-l1-base5 --out r/l1-base5; kz eval report eval-kb-l1-warm5 ...
    python -m benchmarks.bench_eval --pair "level 1" r/l1-base5 r/l1-warm5 --machine "..."
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result

# (name in the report's metrics, unit): the columns compared per pair.
_COLUMNS = [("pass@1", "fraction"), ("pass@10", "fraction"), ("fast_1", "fraction"),
            ("kernelbench_correct", "kernels"), ("geomean_speedup", "x"),
            ("geomean_speedup_vs_compile", "x")]


def _report(folder: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((folder / "report.json").read_text())
    return doc


def pair_metrics(label: str, base: dict[str, Any], policy: dict[str, Any], *,
                 overall: bool = True) -> dict[str, dict[str, Any]]:
    """The policy's figures against the base model's, for one pair of reports; without
    ``overall`` (reports of different problems), only each run's own counts and times."""
    out: dict[str, dict[str, Any]] = {}
    b, p = base["metrics"]["overall"], policy["metrics"]["overall"]
    for name, unit in _COLUMNS if overall else []:
        if p.get(name) is not None:
            out[f"{label}: {name}"] = metric(float(p[name]), unit,
                                             None if b.get(name) is None else float(b[name]))
    for doc, who in ((policy, "policy"), (base, "base")):
        t = doc.get("throughput") or {}
        out[f"{label}: verified ({who})"] = metric(float(doc["verified"]), "kernels",
                                                  float(doc["expected"]))
        if t.get("kernels_per_minute") is not None:
            out[f"{label}: kernels per active minute ({who})"] = metric(
                float(t["kernels_per_minute"]), "kernels/min")
        for stage in ("generation", "preparation", "host_wait", "verification", "active"):
            if t.get(f"{stage}_minutes") is not None:
                out[f"{label}: {stage} minutes ({who})"] = metric(
                    float(t[f"{stage}_minutes"]), "min")
    return out


def common_status_metrics(label: str, base: dict[str, Any], policy: dict[str, Any]
                          ) -> dict[str, dict[str, Any]]:
    """Verdict shares of the two policies over the same kernels: for each problem, as many
    verified samples of each as the less finished run has (a run cut short compares on
    what it reached)."""
    base_problems = {p["problem_id"]: p for p in base["problems"]}
    counts: dict[str, Counter[str]] = {"policy": Counter(), "base": Counter()}
    for problem in policy["problems"]:
        other = base_problems.get(problem["problem_id"])
        if other is None:
            continue
        mine = [s for s in problem["statuses"] if s != "pending"]
        theirs = [s for s in other["statuses"] if s != "pending"]
        n = min(len(mine), len(theirs))
        counts["policy"].update(mine[:n])
        counts["base"].update(theirs[:n])
    total = sum(counts["policy"].values())
    if not total:
        return {}
    out = {f"{label}: kernels compared": metric(float(total), "kernels")}
    for status in sorted(set(counts["policy"]) | set(counts["base"])):
        out[f"{label}: {status} share"] = metric(counts["policy"][status] / total, "fraction",
                                                 counts["base"][status] / total)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", nargs=3, action="append", required=True,
                    metavar=("LABEL", "BASE_REPORT_DIR", "POLICY_REPORT_DIR"))
    ap.add_argument("--machine", default=None, help="Where the runs ran (default: here).")
    ap.add_argument("--command", default="", help="The kz eval commands that made them.")
    ap.add_argument("--notes", default="")
    args = ap.parse_args()
    metrics: dict[str, dict[str, Any]] = {}
    for label, base_dir, policy_dir in args.pair:
        base, policy = _report(Path(base_dir)), _report(Path(policy_dir))
        if [p["problem_id"] for p in base["problems"]] == [
                p["problem_id"] for p in policy["problems"]]:
            metrics.update(pair_metrics(label, base, policy))
        else:  # different problems: each run's own counts, then the kernels both have
            metrics.update(pair_metrics(label, base, policy, overall=False))
        metrics.update(common_status_metrics(label, base, policy))
    for name, m in metrics.items():
        ratio = "" if m["ratio"] is None else f"  ({m['ratio']:.2f}x the baseline)"
        base_s = "" if m["baseline"] is None else f"  baseline {m['baseline']:g}"
        print(f"{name:60s} {m['value']:10.3f} {m['unit']}{base_s}{ratio}")
    path = write_result("eval", args.command or "python -m benchmarks.bench_eval "
                        + " ".join(f"--pair {' '.join(p)}" for p in args.pair),
                        metrics, notes=args.notes, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
