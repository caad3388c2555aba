"""Evaluation of Coder policies on KernelBench-format suites: metrics, suites, runs and
reports (``docs/evaluation.md``). The modules of this package are private; this is its API.
Names are imported on first use: a run imports the services and the store."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kz_stream._lazy import lazy_exports

if TYPE_CHECKING:
    from kz_stream.evaluation._metrics import (
        COMPILE_FAST_P,
        FAST_P,
        PASS_K,
        Baseline,
        ProblemResult,
        SuiteMetrics,
        clustered_difference_in_se,
        difference_in_se,
        fast_p,
        geomean_speedup,
        level_name,
        pass_at_k,
        summarize,
        summarize_levels,
    )
    from kz_stream.evaluation._report import (
        STATUS_COLOURS,
        EvalReport,
        MergedReport,
        build_report,
        markdown,
        merge_reports,
        table_rows,
        throughput_line,
        write_merged,
        write_plots,
        write_report,
    )
    from kz_stream.evaluation._run import (
        EvalOptions,
        EvalProgress,
        EvalRecord,
        kernel_id_of,
        load_evaluation,
        new_run_id,
        open_policy,
        run_evaluation,
    )
    from kz_stream.evaluation._suite import (
        Suite,
        SuiteProblem,
        load_suite,
        problem_interface_error,
    )
    from kz_stream.evaluation._throughput import (
        StageTimes,
        Throughput,
        throughput,
        union_seconds,
    )

_ORIGINS = {
    **dict.fromkeys(
        ["COMPILE_FAST_P", "FAST_P", "PASS_K", "Baseline", "ProblemResult", "SuiteMetrics",
         "clustered_difference_in_se", "difference_in_se", "fast_p", "geomean_speedup",
         "level_name", "pass_at_k", "summarize", "summarize_levels"], "._metrics"),
    **dict.fromkeys(
        ["STATUS_COLOURS", "EvalReport", "MergedReport", "build_report", "markdown",
         "merge_reports", "table_rows", "throughput_line", "write_merged", "write_plots",
         "write_report"], "._report"),
    **dict.fromkeys(
        ["EvalOptions", "EvalProgress", "EvalRecord", "kernel_id_of", "load_evaluation",
         "new_run_id", "open_policy", "run_evaluation"], "._run"),
    **dict.fromkeys(["Suite", "SuiteProblem", "load_suite", "problem_interface_error"],
                    "._suite"),
    **dict.fromkeys(["StageTimes", "Throughput", "throughput", "union_seconds"],
                    "._throughput"),
}

__all__ = [
    "COMPILE_FAST_P",
    "FAST_P",
    "PASS_K",
    "STATUS_COLOURS",
    "Baseline",
    "EvalOptions",
    "EvalProgress",
    "EvalRecord",
    "EvalReport",
    "MergedReport",
    "ProblemResult",
    "StageTimes",
    "Suite",
    "SuiteMetrics",
    "SuiteProblem",
    "Throughput",
    "build_report",
    "clustered_difference_in_se",
    "difference_in_se",
    "fast_p",
    "geomean_speedup",
    "kernel_id_of",
    "level_name",
    "load_evaluation",
    "load_suite",
    "markdown",
    "merge_reports",
    "new_run_id",
    "open_policy",
    "pass_at_k",
    "problem_interface_error",
    "run_evaluation",
    "summarize",
    "summarize_levels",
    "table_rows",
    "throughput",
    "throughput_line",
    "union_seconds",
    "write_merged",
    "write_plots",
    "write_report",
]

__getattr__ = lazy_exports(__name__, _ORIGINS)
