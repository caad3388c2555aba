"""``kz eval report``: an evaluation run's metrics from the store, as a table, JSON,
Markdown and plots (pass@k against k, the speedup distribution, a per-problem grid).
Speedups are against eager PyTorch and, where the verifier timed it, against the reference
under ``torch.compile`` (``details.speedup_vs_compile``)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kz_stream.evaluation._metrics import (
    COMPILE_FAST_P,
    PASS_K,
    ProblemResult,
    SuiteMetrics,
    level_name,
    summarize,
    summarize_levels,
)
from kz_stream.evaluation._run import EvalRecord, kernel_id_of
from kz_stream.evaluation._throughput import Throughput, throughput
from kz_stream.events import RETRIED_STATUS

__all__ = [
    "EvalReport",
    "MergedReport",
    "build_report",
    "markdown",
    "merge_reports",
    "table_rows",
    "throughput_line",
    "write_merged",
    "write_plots",
    "write_report",
]

# A grid cell that is not a verdict on its kernel: "pending" (none yet), or the
# verifier's own failure, which a resumed run verifies again.
_NOT_VERIFIED = frozenset({"pending", RETRIED_STATUS.value})

# Grid colours per verdict status; "pending" is a pair without a verdict yet.
STATUS_COLOURS = {
    "correct": "#2ca02c",
    "incorrect": "#ff7f0e",
    "compile_error": "#d62728",
    "runtime_error": "#9467bd",
    "timeout": "#7f7f7f",
    "out_of_memory": "#8c564b",
    "hack": "#000000",
    "unchecked": "#aec7e8",
    "infra_error": "#bcbd22",
    "pending": "#ffffff",
}


@dataclass(frozen=True)
class EvalReport:
    record: EvalRecord
    results: tuple[ProblemResult, ...]  # problems with at least one verdict
    grid: dict[str, list[str]]  # problem id -> status per sample index ("pending": none)
    metrics: dict[str, SuiteMetrics]
    statuses: dict[str, int]
    throughput: Throughput

    @property
    def expected(self) -> int:
        return len(self.grid) * self.record.started.samples

    @property
    def verified(self) -> int:
        return _verified(self.grid)

    def as_dict(self) -> dict[str, Any]:
        """The JSON document ``report.json`` holds."""
        started = self.record.started
        failed = {r.problem_id for r in self.results if r.compile_failed}
        versions = sorted({v.get("verifier_version") or "" for v in self.record.verdicts.values()})
        return {
            "run_id": started.run_id,
            "suite": started.suite,
            "backend": started.backend,
            "policy": started.policy,
            "sampling": started.sampling,
            "samples_per_problem": started.samples,
            "compile_baseline": started.compile_baseline,
            "verified": self.verified,
            "expected": self.expected,
            "complete": self.verified == self.expected,
            "verify_again": _verify_again(self.grid),
            "verifier_versions": versions,
            "statuses": self.statuses,
            "throughput": self.throughput.as_dict(),
            "metrics": {name: m.as_dict() for name, m in self.metrics.items()},
            "problems": [
                {
                    "problem_id": pid,
                    "level": next(p.level for p in started.problems if p.problem_id == pid),
                    "statuses": row,
                    "speedups": [self._speedup(pid, i) for i in range(len(row))],
                    "speedups_vs_compile": [self._speedup(pid, i, "compile")
                                            for i in range(len(row))],
                    # With the above, what ``merge_reports`` rebuilds the problem from.
                    "kernelbench_rule": [self._details(pid, i).get("kernelbench_rule")
                                         for i in range(len(row))],
                    "compile_failed": pid in failed,
                }
                for pid, row in self.grid.items()
            ],
        }

    def _details(self, problem_id: str, sample: int) -> dict[str, Any]:
        kid = kernel_id_of(self.record.started.run_id, problem_id, sample)
        return dict(self.record.verdicts.get(kid, {}).get("details") or {})

    def _speedup(self, problem_id: str, sample: int, baseline: str = "eager") -> float | None:
        if baseline == "eager":
            kid = kernel_id_of(self.record.started.run_id, problem_id, sample)
            return _number(self.record.verdicts.get(kid, {}).get("speedup"))
        return _number(self._details(problem_id, sample).get("speedup_vs_compile"))


def _verified(grid: Mapping[str, list[str]]) -> int:
    """The samples of ``grid`` that have a verdict on their kernel."""
    return sum(s not in _NOT_VERIFIED for row in grid.values() for s in row)


def _verify_again(grid: Mapping[str, list[str]]) -> int:
    """The samples of ``grid`` whose verdict is the verifier's own failure."""
    return sum(s == RETRIED_STATUS for row in grid.values() for s in row)


def _number(value: Any) -> float | None:
    return float(value) if value is not None else None


def build_report(record: EvalRecord, *, seed: int = 0) -> EvalReport:
    """Per-problem results and metrics per level and overall from a stored run."""
    started = record.started
    grid: dict[str, list[str]] = {}
    results: list[ProblemResult] = []
    for p in started.problems:
        verdicts = [
            record.verdicts.get(kernel_id_of(started.run_id, p.problem_id, i))
            for i in range(started.samples)
        ]
        grid[p.problem_id] = [str(v["status"]) if v else "pending" for v in verdicts]
        done = [v for v in verdicts if v and v["status"] not in _NOT_VERIFIED]
        if done:
            details = [v.get("details") or {} for v in done]
            vs_compile = tuple(_number(d.get("speedup_vs_compile")) for d in details)
            results.append(ProblemResult(
                p.problem_id,
                p.level,
                tuple(v["status"] == "correct" for v in done),
                tuple(_number(v.get("speedup")) for v in done),
                tuple(d.get("kernelbench_rule") for d in details),
                vs_compile,
                # Failed (cached: every timed kernel of the problem says so), none measured.
                compile_failed=(any("compiled_baseline_error" in d for d in details)
                                and all(x is None for x in vs_compile)),
            ))
    statuses = Counter(s for row in grid.values() for s in row)
    metrics = summarize_levels(results, seed=seed, compile_baseline=started.compile_baseline)
    return EvalReport(record, tuple(results), grid, dict(metrics),
                      dict(sorted(statuses.items())), throughput(record.times))


# What makes runs parts of one evaluation: the same policy, kernel language, sampling,
# samples per problem and baselines.
_SAME_EVALUATION = ("backend", "policy", "sampling", "samples_per_problem", "compile_baseline")


@dataclass(frozen=True)
class MergedReport:
    """One evaluation's report made of the ``report.json`` of several runs, each of which
    evaluated some of its problems (``merge_reports``)."""

    doc: dict[str, Any]  # what its report.json holds: a run's keys, and "parts"
    results: tuple[ProblemResult, ...]
    grid: dict[str, list[str]]
    metrics: dict[str, SuiteMetrics]
    throughput: Throughput


def _result_of(row: Mapping[str, Any]) -> ProblemResult | None:
    """A report row's problem as ``build_report`` made it (None: no verdict yet)."""
    done = [i for i, s in enumerate(row["statuses"]) if s not in _NOT_VERIFIED]
    if not done:
        return None
    return ProblemResult(
        row["problem_id"], row["level"],
        tuple(row["statuses"][i] == "correct" for i in done),
        tuple(_number(row["speedups"][i]) for i in done),
        tuple(row["kernelbench_rule"][i] for i in done),
        tuple(_number(row["speedups_vs_compile"][i]) for i in done),
        compile_failed=bool(row["compile_failed"]))


def merge_reports(parts: Sequence[Mapping[str, Any]], *, seed: int = 0) -> MergedReport:
    """The metrics of one evaluation run in parts (problems split between runs: an
    evaluation longer than a GPU slot or a session, or spread over hosts), from each
    part's ``report.json``: the same numbers its runs would give as one run. Raises
    ValueError where the parts are not of one evaluation (another policy, backend,
    sampling, sample count or baseline), share a problem, or come from a report that
    does not hold each sample's KernelBench rule."""
    if not parts:
        raise ValueError("no reports to merge")
    first = parts[0]
    for part in parts[1:]:
        for key in _SAME_EVALUATION:
            if part.get(key) != first.get(key):
                raise ValueError(f"{part.get('run_id')} and {first.get('run_id')} are not "
                                 f"parts of one evaluation: {key} {part.get(key)!r} against "
                                 f"{first.get(key)!r}")
    rows: list[Mapping[str, Any]] = []
    owner: dict[tuple[Any, str], str] = {}
    for part in parts:
        for row in part["problems"]:
            where = (row["level"], row["problem_id"])
            if where in owner:
                raise ValueError(f"problem {row['problem_id']} is in both {owner[where]} and "
                                 f"{part['run_id']}: merge each problem's run once")
            if "kernelbench_rule" not in row:
                raise ValueError(f"{part['run_id']}'s report.json has no per-sample "
                                 "KernelBench rule (written before 2026-12-07): write it "
                                 "again with kz eval report")
            owner[where] = str(part["run_id"])
            rows.append(row)
    results = tuple(r for r in map(_result_of, rows) if r is not None)
    grid = {str(row["problem_id"]): list(row["statuses"]) for row in rows}
    metrics = dict(summarize_levels(results, seed=seed,
                                    compile_baseline=bool(first["compile_baseline"])))
    # The parts ran one after another (or apart): their active minutes add up.
    minutes = {k: sum(float(p["throughput"][f"{k}_minutes"]) for p in parts)
               for k in ("active", "generation", "preparation", "verification", "host_wait")}
    throughput_ = Throughput(sum(int(p["throughput"]["kernels"]) for p in parts),
                             minutes["active"] * 60, minutes["generation"] * 60,
                             minutes["preparation"] * 60, minutes["verification"] * 60,
                             minutes["host_wait"] * 60)
    verified = _verified(grid)
    expected = len(grid) * int(first["samples_per_problem"])
    doc = {
        "run_id": " + ".join(str(p["run_id"]) for p in parts),
        "parts": [str(p["run_id"]) for p in parts],
        "suite": ", ".join(dict.fromkeys(str(p["suite"]) for p in parts)),
        **{key: first[key] for key in _SAME_EVALUATION},
        "verified": verified,
        "expected": expected,
        "complete": verified == expected,
        "verify_again": _verify_again(grid),
        "verifier_versions": sorted({v for p in parts for v in p["verifier_versions"]}),
        "statuses": dict(sorted(Counter(s for row in grid.values() for s in row).items())),
        "throughput": throughput_.as_dict(),
        "metrics": {name: m.as_dict() for name, m in metrics.items()},
        "problems": [dict(row) for row in rows],
    }
    return MergedReport(doc, results, grid, metrics, throughput_)


def write_merged(report: MergedReport, out: Path) -> list[Path]:
    """Writes a merged report's report.json, report.md and plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report.doc, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report.doc, report.metrics, report.throughput))
    return [out / "report.json", out / "report.md",
            *_plots(report.results, report.grid, list(report.metrics),
                    int(report.doc["samples_per_problem"]), out)]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _geo(point: float | None, ci: tuple[float, float] | None) -> str:
    text = "–" if point is None else f"{point:.2f}"
    return text + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")


def table_rows(metrics: Mapping[str, SuiteMetrics]) -> tuple[list[str], list[list[str]]]:
    """The summary table's header and rows (levels, then overall): against eager PyTorch,
    then against the reference under torch.compile (the kernels with a compiled baseline,
    and the problems whose compiled baseline failed, which those columns leave out)."""
    header = ["", "problems", "samples", "correct", "KernelBench rule", "KernelBench only",
              *(f"pass@{k}" for k in PASS_K), "fast_0", "fast_1", "fast_1.5", "fast_2",
              "geomean speedup (95% CI)", "timed vs compile",
              f"fast_{COMPILE_FAST_P:g} vs compile", "geomean vs compile (95% CI)"]
    rows = []
    for name, m in metrics.items():
        failed = m.compile_failed
        compiled = str(m.compile_timed) + (
            f" ({failed} problem{'s' if failed != 1 else ''} failed)" if failed else "")
        rows.append([name, str(m.problems), str(m.samples), str(m.correct),
                     str(m.kernelbench_correct), str(m.kernelbench_only),
                     *(_fmt(m.pass_at.get(k)) for k in PASS_K),
                     *(_fmt(m.fast[p]) for p in (0.0, 1.0, 1.5, 2.0)),
                     _geo(m.geomean, m.geomean_ci), compiled, _fmt(m.fast_compile),
                     _geo(m.compile_geomean, m.compile_geomean_ci)])
    return header, rows


def throughput_line(t: Throughput) -> str:
    """One sentence: kernels per active minute and each stage's time at work."""
    rate = t.kernels_per_minute
    return (f"Throughput: {t.kernels} kernels in {t.active_s / 60:.1f} active min"
            + ("" if rate is None else f" ({rate:.1f} per min)")
            + f"; at work (stages overlap): generation {t.generation_s / 60:.1f} min, "
            f"verification {t.verification_s / 60:.1f} min, of it problem preparation "
            f"{t.preparation_s / 60:.1f} min"
            + (f" and waiting for the host's memory {t.host_wait_s / 60:.1f} min"
               if t.host_wait_s else "") + ".")


def markdown(report: EvalReport) -> str:
    """The report as Markdown: run, summary table, statuses, per-problem table, plots."""
    return _markdown(report.as_dict(), report.metrics, report.throughput)


def _markdown(d: Mapping[str, Any], metrics: Mapping[str, SuiteMetrics],
              throughput_: Throughput) -> str:
    header, rows = table_rows(metrics)
    parts = d.get("parts")
    lines = [
        f"# Evaluation {d['run_id']}",
        "",
        *([f"- merged from {len(parts)} runs: " + ", ".join(f"`{r}`" for r in parts)]
          if parts else []),
        f"- suite: `{d['suite']}`; backend: {d['backend']}; policy: `{d['policy']['spec']}`",
        f"- samples per problem: {d['samples_per_problem']}; sampling: `{d['sampling']}`",
        "- speedups against eager PyTorch"
        + (" and the reference under torch.compile" if d["compile_baseline"] else ""),
        f"- verified: {d['verified']} of {d['expected']}"
        + ("" if d["complete"] else " (incomplete: resume with `kz eval run --run-id`)"),
        f"- verifier versions: {', '.join(d['verifier_versions']) or '–'}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "Statuses: " + ", ".join(f"{k} {v}" for k, v in d["statuses"].items()),
        "",
        throughput_line(throughput_),
        "",
        "| problem | statuses | speedups | speedups vs compile |",
        "|---|---|---|---|",
    ]
    for p in d["problems"]:
        speeds = ", ".join(_fmt(s, 2) for s in p["speedups"])
        vs_compile = ", ".join(_fmt(s, 2) for s in p["speedups_vs_compile"])
        lines.append(f"| {p['problem_id']} | {', '.join(p['statuses'])} | {speeds} "
                     f"| {vs_compile} |")
    lines += ["", "![pass@k](pass_at_k.png) ![speedups](speedups.png)",
              "", "![problems](problems.png)", ""]
    return "\n".join(lines)


def write_plots(report: EvalReport, out: Path) -> list[Path]:
    """pass@k against k per level, the speedup histogram and the problem × sample grid."""
    return _plots(report.results, report.grid, list(report.metrics),
                  report.record.started.samples, out)


def _plots(results: Sequence[ProblemResult], grid: Mapping[str, list[str]],
           groups_: list[str], samples: int, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    paths = [out / "pass_at_k.png", out / "speedups.png", out / "problems.png"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ks = list(range(1, samples + 1))
    groups = {name: [r for r in results if name in ("overall", level_name(r.level))]
              for name in groups_}
    for name, results in groups.items():
        curve = summarize(results, ks=ks, ps=()).pass_at
        defined = [(k, v) for k, v in curve.items() if v is not None]
        if defined:
            ax.plot(*zip(*defined, strict=True), marker="o", label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="k", ylabel="pass@k", ylim=(-0.02, 1.02), title="pass@k")
    if ax.get_lines():
        ax.legend(fontsize=8)
    else:  # a run just started: no problem has its samples verified yet
        ax.text(0.5, 0.5, "no problem verified yet", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    speedups = [s for r in results
                for ok, s in zip(r.correct, r.speedups, strict=True) if ok and s]
    vs_compile = [s for r in results
                  for ok, s in zip(r.correct, r.speedups_against("compile"), strict=True)
                  if ok and s]
    if speedups:
        both = speedups + vs_compile
        bins = list(np.geomspace(min(both), max(both) * 1.001, 20))
        ax.hist(speedups, bins=bins, label="vs eager PyTorch")
        if vs_compile:
            ax.hist(vs_compile, bins=bins, alpha=0.6, label="vs torch.compile")
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 0.5, 1, 2 rather than 10^x
        ax.axvline(1.0, color="k", lw=0.8)
    else:
        ax.text(0.5, 0.5, "no correct kernel with a measured speedup", ha="center",
                va="center", transform=ax.transAxes)
    ax.set(xlabel="speedup over the reference" if vs_compile else "speedup over eager PyTorch",
           ylabel="kernels", title="correct kernels")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    names = list(STATUS_COLOURS)
    cells = np.array([[names.index(s) if s in names else 0 for s in row]
                      for row in grid.values()])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * cells.shape[1] + 3),
                                    max(2.5, 0.25 * cells.shape[0] + 1.5)))
    ax.imshow(cells, cmap=ListedColormap(list(STATUS_COLOURS.values())), vmin=0,
              vmax=len(names) - 1, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(grid)), list(grid), fontsize=7)
    ax.set_xticks(range(cells.shape[1]))
    ax.set(xlabel="sample", title="verdict per problem and sample")
    shown = sorted({s for row in grid.values() for s in row}, key=names.index)
    ax.legend(handles=[Patch(facecolor=STATUS_COLOURS[s], edgecolor="k", label=s)
                       for s in shown], fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    # The legend sits outside the axes, and 200 problem names may be wider than the
    # figure: tight_layout warns it cannot fit them ("Tight layout not applied", seen on
    # KernelBench levels 1+2); a tight bounding box at save time takes them all in.
    fig.savefig(paths[2], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def write_report(report: EvalReport, out: Path) -> list[Path]:
    """Writes report.json, report.md and the plots into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    return [out / "report.json", out / "report.md", *write_plots(report, out)]
