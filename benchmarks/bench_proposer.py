"""The Proposer's valid-module rate: a policy against a baseline policy on the same API sets.

Each (policy, temperature) pair is one ``kz warmstart proposer-eval``: one module per API
set drawn with the Proposer's seeded sampler, each validated as the Proposer service
validates proposals. The baseline is the other policy at the same temperature, on the same
sets, in the same run.

    python -m benchmarks.bench_proposer --policy NEW --baseline OLD --sets 96 \\
        --temperatures 0.5 1.0 --device cuda --batch-size 96 --workers 15

or, from ``kz warmstart proposer-eval --json`` files measured one by one (each records its
policy and temperature; the first policy named is the one measured, the second the
baseline):

    python -m benchmarks.bench_proposer --from-json new_t05.json new_t1.json old_t1.json \\
        --policy NEW --baseline OLD
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result


async def _score(policy: str, temperature: float, args: argparse.Namespace) -> dict[str, Any]:
    from kz_stream.evaluation import EvalOptions, open_policy
    from kz_stream.llm import SamplingParams
    from kz_stream.warmstart.proposer_eval import score_proposer

    sampling = SamplingParams(max_tokens=768, temperature=temperature, seed=args.seed)
    options = EvalOptions(run_id="bench-proposer", policy=policy, device=args.device,
                          batch_size=args.batch_size, sampling=sampling)
    backend = await open_policy(policy, None, options)
    async with backend:
        s = await score_proposer(backend, sets=args.sets, seed=args.seed, sampling=sampling,
                                 workers=args.workers)
    return {"policy": policy, "temperature": temperature, "seed": args.seed, **s.as_dict()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--sets", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--from-json", type=Path, nargs="+", default=None)
    ap.add_argument("--machine", default=None)
    ap.add_argument("--notes", default="")
    args = ap.parse_args(argv)
    if args.from_json:
        scores = [json.loads(p.read_text()) for p in args.from_json]
    else:
        scores = [asyncio.run(_score(p, t, args)) for t in args.temperatures
                  for p in (args.policy, args.baseline)]
    by = {(s["policy"], float(s["temperature"])): s for s in scores}
    metrics: dict[str, dict[str, Any]] = {}
    for t in sorted({t for _, t in by}):
        new, old = by.get((args.policy, t)), by.get((args.baseline, t))
        if new is None:
            continue
        base = old["valid_rate"] if old else None
        metrics[f"valid rate at temperature {t:g} ({new['sets']} sets)"] = metric(
            new["valid_rate"], "share (target >= 0.5)", base)
        metrics[f"valid rate at temperature {t:g}, sets its data covers "
                f"({new['buildable_sets']})"] = metric(
            new["buildable_valid"] / max(1, new["buildable_sets"]), "share",
            old["buildable_valid"] / max(1, old["buildable_sets"]) if old else None)
    reasons = "; ".join(f"{s['policy']} at {s['temperature']}: {s['reasons']}" for s in scores)
    write_result("proposer", "python -m benchmarks.bench_proposer " + " ".join(
        sys.argv[1:] if argv is None else argv), metrics,
        notes=(args.notes + f" Reasons: {reasons}.").strip(), machine=args.machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
