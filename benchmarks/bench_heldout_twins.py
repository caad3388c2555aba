"""The warm start's held-out pass@1, split by whether a training module is the held-out
module's twin (``kz_stream.warmstart.data.twins_in_training``: the same source up to its
numbers, or the same teacher answer).

The held-out split of ``kz warmstart data`` is by source hash, so modules that differ only
in their sizes fall on both sides; pass@1 over the held-out modules with no twin in
training is the figure that measures generalisation. It reads held-out ``kz eval report``
files (their problem ids are ``kz warmstart data``'s file names, which start with the
module's index) and draws the suite's modules again from its seed (no GPU, no store):

    python -m benchmarks.bench_heldout_twins --count 800 --seed 0 \\
        --report warm-1280=benchmarks/results/raw/eval_2026-12-06_heldout_warm_1280.json \\
        --report base=benchmarks/results/raw/eval_2026-12-03_heldout_base.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import metric, write_result  # noqa: E402
from kz_stream.warmstart.data import twins_in_training  # noqa: E402
from kz_stream.warmstart.synth import Synthesizer, is_held_out  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=800, help="kz warmstart data --count")
    ap.add_argument("--seed", type=int, default=0, help="kz warmstart data --seed")
    ap.add_argument("--held-out", type=float, default=0.15, help="the held-out share")
    ap.add_argument("--report", action="append", required=True, metavar="LABEL=PATH",
                    help="a held-out kz eval report.json (repeat)")
    args = ap.parse_args()
    modules = list(Synthesizer(seed=args.seed).modules(args.count))
    train = [m.source for m in modules if not is_held_out(m, args.held_out)]
    metrics = {}
    notes = []
    for spec in args.report:
        label, _, path = spec.partition("=")
        report = json.loads(Path(path).read_text())
        rows = report["problems"]
        held = [modules[int(str(r["problem_id"]).split("_", 1)[0])] for r in rows]
        if not all(is_held_out(m, args.held_out) for m in held):
            raise SystemExit(f"{path}: not the held-out modules of --count {args.count} "
                             f"--seed {args.seed}")
        twins = twins_in_training([m.source for m in held], train)
        correct = [r["statuses"][0] == "correct" for r in rows]
        tally = Counter((t, c) for t, c in zip(twins, correct, strict=True))
        n_clean, n_twin = twins.count(False), twins.count(True)
        ok_clean, ok_twin = tally[(False, True)], tally[(True, True)]
        overall = sum(correct) / len(rows)
        metrics[f"{label}: pass@1, no twin in training"] = metric(
            ok_clean / n_clean if n_clean else 0.0, f"fraction of {n_clean} modules", overall)
        metrics[f"{label}: pass@1, with a twin"] = metric(
            ok_twin / n_twin if n_twin else 0.0, f"fraction of {n_twin} modules", overall)
        metrics[f"{label}: pass@1, all held out"] = metric(overall, f"fraction of {len(rows)}")
        kinds = Counter(m.kind for m, t in zip(held, twins, strict=True) if not t)
        good = Counter(m.kind for m, t, c in zip(held, twins, correct, strict=True)
                       if c and not t)
        notes.append(f"{label} ({path}): no twin {ok_clean}/{n_clean}, twins {ok_twin}/"
                     f"{n_twin}; without a twin by kind: "
                     + ", ".join(f"{k} {good[k]}/{n}" for k, n in sorted(kinds.items())))
        print(notes[-1])
    for name, m in metrics.items():
        against = "" if m["baseline"] is None else f" (all held out {m['baseline']:.3f})"
        print(f"{name:55s} {m['value']:.3f} {m['unit']}{against}")
    write_result(
        "heldout_twins", "python -m benchmarks.bench_heldout_twins " + " ".join(sys.argv[1:]),
        metrics,
        notes=("Baseline: the report's pass@1 over all its held-out modules (as published). "
               "A twin is a training module with the same source up to numbers, or the same "
               "teacher kernel; the held-out split is by source hash. Reads finished reports: "
               "no GPU. " + "; ".join(notes)),
    )


if __name__ == "__main__":
    main()
