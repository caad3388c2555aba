"""``kz eval report``: an evaluation run's metrics from the store, as a table, JSON,
Markdown and plots (pass@k against k, the speedup distribution, a per-problem grid).
Speedups are against eager PyTorch and, where the verifier timed it, against the reference
under ``torch.compile`` (``details.speedup_vs_compile``)."""

from __future__ import annotations

import json
from collections import Counter
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

__all__ = [
    "EvalReport",
    "build_report",
    "markdown",
    "table_rows",
    "throughput_line",
    "write_plots",
    "write_report",
]

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
        return sum(s != "pending" for row in self.grid.values() for s in row)

    def as_dict(self) -> dict[str, Any]:
        """The JSON document ``report.json`` holds."""
        started = self.record.started
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
                }
                for pid, row in self.grid.items()
            ],
        }

    def _speedup(self, problem_id: str, sample: int, baseline: str = "eager") -> float | None:
        kid = kernel_id_of(self.record.started.run_id, problem_id, sample)
        verdict = self.record.verdicts.get(kid, {})
        if baseline == "eager":
            return _number(verdict.get("speedup"))
        return _number((verdict.get("details") or {}).get("speedup_vs_compile"))


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
        done = [v for v in verdicts if v]
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


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _geo(point: float | None, ci: tuple[float, float] | None) -> str:
    text = "–" if point is None else f"{point:.2f}"
    return text + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")


def table_rows(report: EvalReport) -> tuple[list[str], list[list[str]]]:
    """The summary table's header and rows (levels, then overall): against eager PyTorch,
    then against the reference under torch.compile (the kernels with a compiled baseline,
    and the problems whose compiled baseline failed, which those columns leave out)."""
    header = ["", "problems", "samples", "correct", "KernelBench rule", "KernelBench only",
              *(f"pass@{k}" for k in PASS_K), "fast_0", "fast_1", "fast_1.5", "fast_2",
              "geomean speedup (95% CI)", "timed vs compile",
              f"fast_{COMPILE_FAST_P:g} vs compile", "geomean vs compile (95% CI)"]
    rows = []
    for name, m in report.metrics.items():
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
    d = report.as_dict()
    header, rows = table_rows(report)
    lines = [
        f"# Evaluation {d['run_id']}",
        "",
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
        throughput_line(report.throughput),
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    paths = [out / "pass_at_k.png", out / "speedups.png", out / "problems.png"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ks = list(range(1, report.record.started.samples + 1))
    groups = {name: [r for r in report.results if name in ("overall", level_name(r.level))]
              for name in report.metrics}
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
    speedups = [s for r in report.results
                for ok, s in zip(r.correct, r.speedups, strict=True) if ok and s]
    vs_compile = [s for r in report.results
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
    grid = np.array([[names.index(s) if s in names else 0 for s in row]
                     for row in report.grid.values()])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * grid.shape[1] + 3),
                                    max(2.5, 0.25 * grid.shape[0] + 1.5)))
    ax.imshow(grid, cmap=ListedColormap(list(STATUS_COLOURS.values())), vmin=0,
              vmax=len(names) - 1, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(report.grid)), list(report.grid), fontsize=7)
    ax.set_xticks(range(grid.shape[1]))
    ax.set(xlabel="sample", title="verdict per problem and sample")
    shown = sorted({s for row in report.grid.values() for s in row}, key=names.index)
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
