"""The loop's learning curve against a control, and its throughput, from two runs' stores.

A treatment run (`kz run ...`) and its control (the same command with
`KZ_LEARNER__LEARNING_RATE=0`: the same steps and policy versions, no update) are read back
from their stores; this script compares them step by step and writes
benchmarks/results/gpu_loop.json, docs/benchmarks.md and a plot. For example, after both
runs on a GPU host (stores carried back as SQLite files):

    python -m benchmarks.bench_gpu_loop \\
        --run sqlite+aiosqlite:///run.sqlite3 run-... \\
        --control sqlite+aiosqlite:///control.sqlite3 run-... \\
        --plot docs/learning_curve.png --machine "1x H200" --command "kz run ..."

Several replicates (independent pairs of runs with the same command) are given by repeating
``--run`` and ``--control``, one control for each run: their curves are pooled by step index (the
kernels of step i of every replicate together), and so are the totals and throughput.

Per Coder step: the step's mean reward (the learner's), its pass rate and fast_1 (correct
and faster than eager PyTorch) over the step's decided kernels. The difference of the
cumulative pass rates, treatment minus control, is compared with two standard errors
(cluster-robust by Coder group: a group's kernels share a module and a prompt): the first
step where it exceeds them is reported. Per
Proposer step: mean reward and valid rate. Throughput: steps per hour; per step the
learner's training seconds and how long it waited for complete groups
(`TrainingStepCompleted` v2), the generation seconds of the step's groups and the
verification latency of its kernels; staleness and importance-ratio statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result
from kz_stream.evaluation import clustered_difference_in_se, difference_in_se
from kz_stream.events import TrainingStepCompleted, payload_as
from kz_stream.run_state import CapabilityMap, KernelRecord, RunState
from kz_stream.store import open_store

_TYPES = ["ModuleProposed", "KernelGenerated", "KernelVerified", "TrainingStepCompleted"]


@dataclass
class Run:
    """One run as the learner's read model sees it, plus each step and verdict's time."""

    run_id: str
    state: RunState = field(default_factory=RunState)
    verified_at: dict[str, float] = field(default_factory=dict)  # kernel id -> newest verdict
    steps: list[tuple[float, TrainingStepCompleted]] = field(default_factory=list)
    first_at: float | None = None
    # Step number -> (decided kernels, correct ones) per API, as the learner saw at that step.
    capability: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)

    def role_steps(self, role: str) -> list[TrainingStepCompleted]:
        """The role's steps that trained on something (a step of only expired groups, as
        learners before 2026-12-04 took, is no step of the curve)."""
        return sorted((s for _, s in self.steps if s.role == role and _trained(s)),
                      key=lambda s: s.step)

    def kernels(self, step: TrainingStepCompleted) -> list[KernelRecord]:
        return [self.state.kernels[k] for k in step.kernel_ids if k in self.state.kernels]


def _trained(step: TrainingStepCompleted) -> bool:
    return bool(step.kernel_ids or step.module_ids)


async def load_run(url: str, run_id: str) -> Run:
    run = Run(run_id)
    async with open_store(url, create_schema=False) as store:
        async for batch in store.read_all(0, types=_TYPES, correlation_id=run_id):
            for rec in batch:
                e, at = rec.event, rec.event.occurred_at.timestamp()
                run.first_at = at if run.first_at is None else min(run.first_at, at)
                run.state.apply(e, recorded_at=at)
                if e.type == "KernelVerified":
                    run.verified_at[e.payload["kernel_id"]] = at
                elif e.type == "TrainingStepCompleted":
                    step = payload_as(e, TrainingStepCompleted)
                    run.steps.append((at, step))
                    cmap = CapabilityMap.from_state(run.state)
                    run.capability[step.step] = {a: (st.n, st.correct)
                                                 for a, st in cmap.apis.items()}
    return run


def frontier_by_round(run: Run) -> list[dict[str, Any]]:
    """Per round of the schedule (a turn of each role): the per-API pass rates the learner
    saw at its first and at its last step, summarized as the APIs judged, their mean pass
    rate and the three weakest (APIs with at least 4 decided kernels)."""
    steps = sorted((s for _, s in run.steps), key=lambda s: s.step)
    rounds: list[list[TrainingStepCompleted]] = []
    for s in steps:
        if not rounds or (s.role == steps[0].role and rounds[-1][-1].role != s.role):
            rounds.append([])
        rounds[-1].append(s)

    def summary(step: int) -> dict[str, Any]:
        apis = {a: c / n for a, (n, c) in run.capability.get(step, {}).items() if n >= 4}
        weakest = sorted(apis.items(), key=lambda kv: (kv[1], kv[0]))[:3]
        return {"apis": len(apis), "mean_pass_rate": _mean(list(apis.values())),
                "weakest": {a: round(r, 3) for a, r in weakest}}

    return [{"round": i, "steps": [s.step for s in r], "start": summary(r[0].step),
             "end": summary(r[-1].step)} for i, r in enumerate(rounds, start=1)]


def _fast(k: KernelRecord) -> bool:
    return k.correct and k.verdict is not None and (k.verdict.speedup or 0) > 1


def group_tallies(kernels: Iterable[KernelRecord]) -> list[tuple[int, int]]:
    """(kernels, correct ones) per Coder group of ``kernels``, the clusters of
    ``clustered_difference_in_se``."""
    out: dict[str, tuple[int, int]] = {}
    for k in kernels:
        n, c = out.get(k.group_id, (0, 0))
        out[k.group_id] = (n + 1, c + k.correct)
    return list(out.values())


def coder_curve(run: Run) -> list[dict[str, Any]]:
    """Per Coder step: mean reward, pass rate, fast_1 and how many kernels were decided."""
    rows: list[dict[str, Any]] = []
    for s in run.role_steps("coder"):
        ks = [k for k in run.kernels(s) if k.decided]
        n = len(ks)
        rows.append({"step": s.step, "mean_reward": s.mean_reward, "n": n,
                     "correct": sum(k.correct for k in ks), "fast": sum(_fast(k) for k in ks),
                     "groups": group_tallies(ks)})
        rows[-1]["pass_rate"] = rows[-1]["correct"] / n if n else None
        rows[-1]["fast_1"] = rows[-1]["fast"] / n if n else None
    return rows


def proposer_curve(run: Run) -> list[dict[str, Any]]:
    rows = []
    for s in run.role_steps("proposer"):
        mods = [run.state.modules[m].valid for m in s.module_ids if m in run.state.modules]
        rows.append({"step": s.step, "mean_reward": s.mean_reward,
                     "valid_rate": sum(mods) / len(mods) if mods else None})
    return rows


def updated_groups(runs: list[Run]) -> list[tuple[int, int]]:
    """(decided kernels, correct ones) per Coder group sampled by a version after the
    first, over the runs (group ids are each run's own)."""
    return [t for run in runs for t in group_tallies(
        k for k in run.state.kernels.values() if k.decided and k.policy_version > 0)]


def steps_to_two_se(treated: list[dict[str, Any]], control: list[dict[str, Any]]
                    ) -> int | None:
    """The first Coder step index (1-based) at which the treatment's cumulative pass rate
    exceeds the control's by more than two standard errors, clustered by group
    (``clustered_difference_in_se``); None if it never does."""
    g1: list[tuple[int, int]] = []
    g2: list[tuple[int, int]] = []
    for i, (a, b) in enumerate(zip(treated, control, strict=False), start=1):
        g1, g2 = g1 + a["groups"], g2 + b["groups"]
        z = clustered_difference_in_se(g1, g2)
        if z is not None and z > 2:
            return i
    return None


def by_version(runs: list[Run]) -> dict[int, tuple[int, int]]:
    """Per policy version that sampled them: (decided kernels, correct ones), all the
    runs' kernels, trained on or not. Version 0 is the warm start in both arms; what the
    updates did shows in the kernels of later versions."""
    out: dict[int, tuple[int, int]] = {}
    for run in runs:
        for k in run.state.kernels.values():
            if k.decided:
                n, c = out.get(k.policy_version, (0, 0))
                out[k.policy_version] = (n + 1, c + k.correct)
    return out


def _updated(versions: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(decided, correct) over the versions after the first."""
    return (sum(n for v, (n, _) in versions.items() if v > 0),
            sum(c for v, (_, c) in versions.items() if v > 0))


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def throughput(runs: list[Run]) -> dict[str, float | None]:
    """Steps and verdicts per hour (from each run's first event to its last step: the time
    between slots of a run spread over several counts too; replicates add their steps and
    hours) and the per-step split of where the time went."""
    hours = 0.0
    all_steps: list[TrainingStepCompleted] = []
    gen: list[float] = []
    lat: list[float] = []
    verdicts = 0
    for run in runs:
        steps = sorted(run.steps, key=lambda t: t[0])
        if steps and run.first_at:
            hours += (steps[-1][0] - run.first_at) / 3600
            # Over the same span as the steps: a slot after the last step adds none.
            verdicts += sum(t <= steps[-1][0] for t in run.verified_at.values())
        all_steps += [s for _, s in steps if _trained(s)]
        for s in run.role_steps("coder"):
            ks = run.kernels(s)
            per_group = {k.group_id: k.generated.generation_s for k in ks}
            # Groups of one call carry that call's wall time: count each call once.
            gen.append(sum({v for v in per_group.values() if v is not None}))
            lat += [run.verified_at[k.kernel_id] - k.generated_at for k in ks
                    if k.kernel_id in run.verified_at]
    ratios = [s.losses["sampling/importance_sampling_ratio/mean"] for s in all_steps
              if "sampling/importance_sampling_ratio/mean" in s.losses]
    return {
        "steps_per_hour": len(all_steps) / hours if hours > 0 else None,
        "train_s": _mean([s.train_seconds for s in all_steps if s.train_seconds is not None]),
        "waited_s": _mean([s.waited_seconds for s in all_steps
                           if s.waited_seconds is not None]),
        "generation_s": _mean(gen),
        "verification_latency_s": _mean(lat),
        "staleness_max": max((s.staleness.get("max", 0.0) for s in all_steps), default=None),
        "staleness_mean": _mean([s.staleness["mean"] for s in all_steps
                                 if "mean" in s.staleness]),
        "is_ratio_mean": _mean(ratios),
        "verdicts_per_min": verdicts / (hours * 60) if hours > 0 else None,
    }


def pooled_curve(curves: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Coder curves of several replicates pooled by step index: the i-th row sums the
    decided, correct and fast kernels of every replicate's i-th step and averages their
    mean rewards."""
    rows = []
    for i in range(max((len(c) for c in curves), default=0)):
        at = [c[i] for c in curves if i < len(c)]
        n = sum(r["n"] for r in at)
        row: dict[str, Any] = {"step": i + 1, "replicates": len(at), "n": n,
                               "correct": sum(r["correct"] for r in at),
                               "fast": sum(r["fast"] for r in at),
                               "groups": [g for r in at for g in r["groups"]],
                               "mean_reward": statistics.fmean(r["mean_reward"] for r in at)}
        row["pass_rate"] = row["correct"] / n if n else None
        row["fast_1"] = row["fast"] / n if n else None
        rows.append(row)
    return rows


def _pooled(rows: list[dict[str, Any]], key: str) -> float | None:
    n = sum(r["n"] for r in rows)
    return sum(r[key] for r in rows) / n if n else None


def compare(treated: list[Run], control: list[Run]) -> dict[str, dict[str, Any]]:
    """Treatment against control, each a list of replicates pooled by step index."""
    tc = pooled_curve([coder_curve(r) for r in treated])
    cc = pooled_curve([coder_curve(r) for r in control])
    tp = [row for r in treated for row in proposer_curve(r)]
    cp = [row for r in control for row in proposer_curve(r)]
    out: dict[str, dict[str, Any]] = {}

    def add(name: str, unit: str, a: float | None, b: float | None) -> None:
        if a is not None:
            out[name] = metric(a, unit, b)

    add("coder steps", "steps", float(sum(r["replicates"] for r in tc)),
        float(sum(r["replicates"] for r in cc)))
    add("coder pass rate, all steps", "fraction", _pooled(tc, "correct"), _pooled(cc, "correct"))
    add("coder fast_1, all steps", "fraction", _pooled(tc, "fast"), _pooled(cc, "fast"))
    half = max(1, len(tc) // 2)
    add("coder pass rate, second half", "fraction", _pooled(tc[half:], "correct"),
        _pooled(cc[half:], "correct"))
    add("coder mean reward, all steps", "reward", _mean([r["mean_reward"] for r in tc]),
        _mean([r["mean_reward"] for r in cc]))
    add("proposer valid rate, all steps", "fraction",
        _mean([r["valid_rate"] for r in tp if r["valid_rate"] is not None]),
        _mean([r["valid_rate"] for r in cp if r["valid_rate"] is not None]))
    add("proposer mean reward, all steps", "reward", _mean([r["mean_reward"] for r in tp]),
        _mean([r["mean_reward"] for r in cp]))
    tv, cv = by_version(treated), by_version(control)
    (tn0, tc0), (cn0, cc0) = tv.get(0, (0, 0)), cv.get(0, (0, 0))
    (tn, tk), (cn, ck) = _updated(tv), _updated(cv)
    add("coder pass rate, kernels of version 0", "fraction", tc0 / tn0 if tn0 else None,
        cc0 / cn0 if cn0 else None)
    add("coder pass rate, kernels of versions >= 1", "fraction", tk / tn if tn else None,
        ck / cn if cn else None)
    add("coder kernels of versions >= 1", "kernels", float(tn), float(cn))
    z = difference_in_se(tk, tn, ck, cn)
    if z is not None:
        out["versions >= 1: (run - control) pass rate in SE"] = metric(z, "SE")
    zc = clustered_difference_in_se(updated_groups(treated), updated_groups(control))
    if zc is not None:
        out["versions >= 1: (run - control) pass rate in SE, clustered by group"] = (
            metric(zc, "SE"))
    k = steps_to_two_se(tc, cc)
    if k is not None:  # absent: not within the run (the notes say so)
        out["coder steps until pass rate > control + 2 SE"] = metric(float(k), "steps")
    t, c = throughput(treated), throughput(control)
    add("replicates", "runs", float(len(treated)), float(len(control)))
    units = {"steps_per_hour": "steps/h", "verdicts_per_min": "verdicts/min",
             "staleness_max": "versions", "staleness_mean": "versions", "is_ratio_mean": "ratio"}
    for key, value in t.items():
        add(key.replace("_", " "), units.get(key, "s"), value, c.get(key))
    return out


def plot(treated: list[Run], control: list[Run], path: Path) -> None:
    """Pooled curves (thick) over each replicate's own (thin), treatment and control."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for runs, label, color in ((treated, "run", "C0"), (control, "control (lr 0)", "C1")):
        curves = [coder_curve(r) for r in runs]
        pooled = pooled_curve(curves)
        steps = [r["step"] for r in pooled]
        axes[0].plot(steps, [r["mean_reward"] for r in pooled], marker="o", color=color,
                     label=label)
        axes[1].plot(steps, [r["pass_rate"] for r in pooled], marker="o", color=color,
                     label=f"{label}, {len(runs)} pooled")
        if len(runs) > 1:
            for rows in curves:
                axes[1].plot([i + 1 for i in range(len(rows))], [r["pass_rate"] for r in rows],
                             color=color, alpha=0.3, linewidth=0.8)
        for i, run in enumerate(runs):
            prop = proposer_curve(run)
            axes[2].plot([j + 1 for j in range(len(prop))], [r["valid_rate"] for r in prop],
                         marker="o", color=color, alpha=1.0 if i == 0 else 0.4,
                         label=label if i == 0 else None)
    for ax, title in zip(axes, ("Coder mean reward", "Coder pass rate", "Proposer valid rate"),
                         strict=True):
        ax.set_title(title)
        ax.set_xlabel("training step of its role")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", nargs=2, action="append", required=True,
                    metavar=("STORE_URL", "RUN_ID"), help="A treatment run; repeat for "
                    "replicates.")
    ap.add_argument("--control", nargs=2, action="append", required=True,
                    metavar=("STORE_URL", "RUN_ID"), help="A control run; one for each --run.")
    ap.add_argument("--plot", type=Path, default=None, help="Write the curves here (PNG).")
    ap.add_argument("--machine", default=None, help="Where the runs ran (default: here).")
    ap.add_argument("--command", default="", help="The kz run commands that made them.")
    ap.add_argument("--notes", default="")
    ap.add_argument("--frontier-out", type=Path, default=None,
                    help="Write the per-round frontier summaries of both runs here (JSON).")
    args = ap.parse_args()
    if len(args.run) != len(args.control):
        ap.error("give one --control for each --run")
    treated = [asyncio.run(load_run(*r)) for r in args.run]
    control = [asyncio.run(load_run(*r)) for r in args.control]
    metrics = compare(treated, control)
    for name, m in metrics.items():
        base = "" if m["baseline"] is None else f"  control {m['baseline']:.4g}"
        print(f"{name:50s} {m['value']:10.4g} {m['unit']}{base}")
    for name, runs in (("run", treated), ("control", control)):
        for r in pooled_curve([coder_curve(r) for r in runs]):
            print(f"{name} coder step {r['step']}: {r['correct']}/{r['n']} correct, "
                  f"fast {r['fast']}, mean reward {r['mean_reward']:+.3f} "
                  f"({r['replicates']} replicates)")
    for name, runs in (("run", treated), ("control", control)):
        print(f"{name} by sampling version: " + ", ".join(
            f"v{v} {c}/{n}" for v, (n, c) in sorted(by_version(runs).items())))
    frontier = {name: [frontier_by_round(r) for r in runs]
                for name, runs in (("run", treated), ("control", control))}
    for name, per_run in frontier.items():
        for i, rounds in enumerate(per_run, start=1):
            for r in rounds:
                print(f"{name} {i} round {r['round']} (steps {r['steps']}): start "
                      f"{r['start']}  end {r['end']}")
    if args.frontier_out:
        args.frontier_out.write_text(json.dumps(frontier, indent=2) + "\n")
        print(f"wrote {args.frontier_out}")
    if args.plot:
        plot(treated, control, args.plot)
        print(f"wrote {args.plot}")
    path = write_result("gpu_loop", args.command or "python -m benchmarks.bench_gpu_loop",
                        metrics, notes=args.notes, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
