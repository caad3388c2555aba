"""How far CA-GRPO steps at a given learning rate move the Coder, offline, from a run's
stored groups: a learner starts from the warm start at each rate, takes steps on the
run's groups of version-0 kernels whose verdicts differ, and after each step scores the
mean per-token logprob of kernels it did not train on (other modules': correct ones and
wrong ones) and of the correct kernels it trained on.

A step that helps raises the trained-on correct kernels and leaves the held-out correct
ones where they were or higher; one that damages the policy lowers the held-out correct
kernels' logprob with the rest (the eighth GPU run, docs/operations.md: at 1e-4 the
updated Coder wrote 1 correct kernel in 134 against its control's 20 in 184). This picks a
learning rate before a GPU run spends its slots on one.

    python -m benchmarks.bench_update_size sqlite+aiosqlite:///control.sqlite3 run-0 \\
        --rates 1e-5,3e-5,1e-4 --steps 4 [--held 24] [--groups-per-step 4] [--kl-betas 0,0.04]

The run's store must hold the kernels' token ids and logprobs (every ``kz run`` stores
them). On a CPU a step of 4 groups of 1,024-token kernels takes minutes; on a GPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import metric, write_result
from benchmarks.bench_gpu_loop import Run, load_run
from kz_stream.llm import smollm2_dir
from kz_stream.rl.groups import Group, Sample
from kz_stream.rl.trainer import CoderLearner, LearnerConfig
from kz_stream.warmstart import packaged_adapter


def version0_groups(run: Run, any_version: bool = False) -> list[Group]:
    """The run's complete groups of kernels sampled from version 0 (from any version with
    ``any_version``: a control's versions all hold version 0's weights), every member
    decided, in the order they were generated."""
    by_group: dict[str, list[Any]] = {}
    for k in sorted(run.state.kernels.values(), key=lambda k: k.generated_at):
        by_group.setdefault(k.group_id, []).append(k)
    groups = []
    for gid, ks in by_group.items():
        complete = len(ks) == ks[0].generated.group_size and all(k.decided for k in ks)
        ids = [k.generated.completion and k.generated.completion.prompt_token_ids for k in ks]
        if (ks[0].policy_version != 0 and not any_version) or not complete or not all(ids):
            continue
        groups.append(Group(gid, tuple(
            Sample.from_kernel(k.generated, k.verdict, prompt_ids=p)
            for k, p in zip(ks, ids, strict=True))))
    return groups


def mean_token_logprob(model: torch.nn.Module, samples: list[Sample]) -> float:
    """The mean over samples of each completion's mean per-token logprob (temperature 1)."""
    device = next(model.parameters()).device
    values = []
    with torch.no_grad():
        for s in samples:
            assert s.prompt_ids is not None
            ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)], device=device)
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
            target = torch.tensor(s.completion_ids, device=device)[:, None]
            values.append(torch.log_softmax(logits, -1).gather(-1, target).mean().item())
    return sum(values) / len(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", help="The run's store URL.")
    ap.add_argument("run_id")
    ap.add_argument("--rates", default="1e-5,3e-5,1e-4",
                    help="Learning rates, comma-separated.")
    ap.add_argument("--kl-betas", default="0",
                    help="KL penalties toward the warm start to try at each rate (comma list).")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--held", type=int, default=24,
                    help="Held-out kernels of each kind (correct, wrong) to score.")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="The run's Coder sampling temperature.")
    ap.add_argument("--any-version", action="store_true",
                    help="Use groups of every policy version: for a control run (learning "
                         "rate 0), whose versions all hold the warm start's weights.")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out", type=Path, default=None,
                    help="Also write every step's row here (JSON lines).")
    args = ap.parse_args()

    groups = version0_groups(asyncio.run(load_run(args.store, args.run_id)), args.any_version)
    mixed = [g for g in groups if 0 < sum(bool(s.correct) for s in g.samples) < len(g)]
    train = mixed[: args.steps * args.groups_per_step]
    if len(train) < args.steps * args.groups_per_step:
        ap.error(f"{len(mixed)} groups with differing verdicts: fewer than "
                 f"{args.steps} x {args.groups_per_step}")
    trained_modules = {g.samples[0].module_id for g in train}
    held = [s for g in groups if g.samples[0].module_id not in trained_modules
            for s in g.samples]
    sets = {
        "held-out correct": [s for s in held if s.correct][: args.held],
        "held-out wrong": [s for s in held if not s.correct][: args.held],
        "trained-on correct": [s for g in train for s in g.samples if s.correct][: args.held],
    }
    sizes = ", ".join(f"{k} {len(v)}" for k, v in sets.items())
    sets = {k: v for k, v in sets.items() if v}  # an empty set has no mean to score
    kind = "control" if args.any_version else "version-0"
    print(f"{len(groups)} complete {kind} groups, {len(mixed)} with differing verdicts; "
          f"{len(train)} trained on; scored: {sizes}", flush=True)

    metrics: dict[str, dict[str, Any]] = {}
    rows = []
    adapter = packaged_adapter("coder")
    grid = [(float(r), float(b)) for r in args.rates.split(",") for b in args.kl_betas.split(",")]
    for rate, beta in grid:
        label = f"lr {rate:g}" + (f", kl_beta {beta:g}" if beta else "")
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as scratch:
            learner = CoderLearner(LearnerConfig(
                model=str(smollm2_dir()), init_adapter=str(adapter) if adapter else None,
                learning_rate=rate, kl_beta=beta, temperature=args.temperature,
                output_dir=scratch))
            before = {k: mean_token_logprob(learner.model, v) for k, v in sets.items()}
            rows.append({"rate": rate, "kl_beta": beta, "step": 0, **before})
            print(json.dumps(rows[-1]), flush=True)
            step_s = []
            for step in range(args.steps):
                batch = train[step * args.groups_per_step:(step + 1) * args.groups_per_step]
                t0 = time.monotonic()
                learner.train_step(batch)
                step_s.append(time.monotonic() - t0)
                after = {k: mean_token_logprob(learner.model, v) for k, v in sets.items()}
                rows.append({"rate": rate, "kl_beta": beta, "step": step + 1,
                             "train_s": step_s[-1], **after})
                print(json.dumps(rows[-1]), flush=True)
        for name in sets:
            metrics[f"{label}: {name}, mean token logprob after {args.steps} steps"] = (
                metric(after[name], "nats/token", before[name]))
        metrics[f"{label}: train s per step"] = metric(sum(step_s) / len(step_s), "s")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    command = (f"python -m benchmarks.bench_update_size STORE {args.run_id} --rates "
               f"{args.rates} --kl-betas {args.kl_betas} --steps {args.steps} "
               f"--groups-per-step {args.groups_per_step} --held {args.held}"
               + (" --any-version" if args.any_version else ""))
    notes = (f"From {args.store}: {len(train)} groups of {kind} kernels with differing "
             f"verdicts trained on ({len(mixed)} such of {len(groups)} complete groups), "
             f"{args.groups_per_step} a step, from the packaged warm start; scored after "
             f"each step (kernels scored: {sizes}); one seed. Baseline: the same figure "
             "before the first step. Logprobs are per token, under temperature 1.")
    path = write_result("update_size", command, metrics, notes=notes, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
