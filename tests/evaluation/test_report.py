"""`kz eval report`'s numbers and files from evaluation events in a real SQLite store."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kz_stream.evaluation import (
    EvalRecord,
    build_report,
    kernel_id_of,
    load_evaluation,
    merge_reports,
    table_rows,
    write_merged,
    write_report,
)
from kz_stream.events import (
    EvaluationProblem,
    EvaluationStarted,
    Event,
    KernelGenerated,
    KernelVerified,
    VerdictStatus,
    new_event,
    payload_as,
)
from kz_stream.run_state import RunState
from kz_stream.store import open_store

RUN = "eval-report"
# problem -> (level, verdicts per sample: (status, speedup); None: not verified yet)
VERDICTS: dict[str, tuple[int, list[tuple[str, float | None] | None]]] = {
    "level1/1_A": (1, [("correct", 2.0), ("incorrect", None), ("correct", 0.5)]),
    "level1/2_B": (1, [("compile_error", None), ("compile_error", None), None]),
    "level2/1_C": (2, [("correct", 4.0), ("correct", 1.0), ("hack", None)]),
}
# Verdict details of timed kernels (problem, sample): A's compiled reference is 1.25x
# eager (so 2.0x eager is 1.6x compile); C's compiled baseline failed (and stays failed:
# the verifier caches it per problem).
COMPILE_FAILED = {"compiled_baseline_error": "compile: exception: Unrecognized mode"}
DETAILS: dict[tuple[str, int], dict[str, object]] = {
    ("level1/1_A", 0): {"compile_speedup": 1.25, "speedup_vs_compile": 1.6,
                        "timing": {"compiled_reference_ms": 0.8}},
    ("level1/1_A", 2): {"compile_speedup": 1.25, "speedup_vs_compile": 0.4,
                        "timing": {"compiled_reference_ms": 0.8}},
    ("level2/1_C", 0): COMPILE_FAILED,
    ("level2/1_C", 1): COMPILE_FAILED,
}


T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def run_events() -> list[Event]:
    problems = [EvaluationProblem(problem_id=pid, name=pid.split("/")[1], level=level,
                                  module_id=f"kb-{i}")
                for i, (pid, (level, _)) in enumerate(VERDICTS.items())]
    started = EvaluationStarted(run_id=RUN, suite="/suite", backend="triton", samples=3,
                                policy={"spec": "base"}, problems=problems,
                                compile_baseline=True)
    events = [new_event(started, stream_id=f"evaluation-{RUN}", stream_version=0,
                        correlation_id=RUN)]
    # Problem j is generated in [60j, 60j + 30] s and each of its samples verified in
    # [60j + 30, 60j + 40], 2 s of it preparing the problem.
    for j, (p, (_, samples)) in enumerate(zip(problems, VERDICTS.values(), strict=True)):
        for i, verdict in enumerate(samples):
            kid = kernel_id_of(RUN, p.problem_id, i)
            events.append(new_event(
                KernelGenerated(kernel_id=kid, module_id=p.module_id, group_id=p.problem_id,
                                backend="triton", source="class ModelNew: ...",
                                generation_s=30),
                stream_id=f"kernel-{kid}", stream_version=0, correlation_id=RUN,
                occurred_at=T0 + timedelta(seconds=60 * j + 30)))
            if verdict is not None:
                events.append(new_event(
                    KernelVerified(kernel_id=kid, module_id=p.module_id, group_id=p.problem_id,
                                   status=VerdictStatus(verdict[0]), speedup=verdict[1],
                                   verifier_version="kzv-test",
                                   details={"seconds": 10, "prepare_s": 2,
                                            "kernelbench_rule": verdict[0] in ("correct", "hack"),
                                            **DETAILS.get((p.problem_id, i), {})}),
                    stream_id=f"kernel-{kid}", stream_version=1, correlation_id=RUN,
                    occurred_at=T0 + timedelta(seconds=60 * j + 40)))
    return events


def payload_of(event: Event) -> EvaluationStarted:
    return payload_as(event, EvaluationStarted)


def load(url: str) -> EvalRecord:
    async def go() -> EvalRecord | None:
        async with open_store(url) as store:
            await store.append(run_events())
            # Another run's kernel in the same store is not part of this report.
            await store.append([new_event(
                KernelGenerated(kernel_id="other", module_id="kb-0", group_id="g",
                                backend="triton", source="x"),
                stream_id="kernel-other", stream_version=0, correlation_id="eval-other")])
            assert await load_evaluation(store, "eval-absent") is None
            return await load_evaluation(store, RUN)

    record = asyncio.run(go())
    assert record is not None
    return record


def test_report_numbers_grid_and_files(store_url: str, tmp_path: Path) -> None:
    record = load(store_url)
    assert len(record.kernels) == 9 and len(record.verdicts) == 8
    report = build_report(record)
    assert report.verified == 8 and report.expected == 9
    assert report.grid["level1/2_B"] == ["compile_error", "compile_error", "pending"]
    l1, l2, overall = (report.metrics[k] for k in ("level 1", "level 2", "overall"))
    # level 1: A has 2 of 3 correct; B has 0 of its 2 verified samples.
    assert l1.pass_at[1] == pytest.approx((2 / 3 + 0) / 2)
    assert l1.fast[1.0] == pytest.approx((1 / 3 + 0) / 2)  # only A's 2.0x is > 1
    assert l2.pass_at[1] == pytest.approx(2 / 3) and l2.fast[1.5] == pytest.approx(1 / 3)
    assert overall.pass_at[1] == pytest.approx((2 / 3 + 0 + 2 / 3) / 3)
    assert overall.pass_at[5] is None
    assert overall.geomean == pytest.approx((2.0 * 0.5 * 4.0 * 1.0) ** (1 / 4))
    assert report.statuses == {"compile_error": 2, "correct": 4, "hack": 1, "incorrect": 1,
                               "pending": 1}
    # The store gives the details back (on PostgreSQL too): the hack passes KernelBench's rule.
    assert overall.kernelbench_only == 1
    t = report.throughput
    assert (t.kernels, t.generation_s, t.verification_s, t.preparation_s, t.active_s) == (
        8, 90, 30, 6, 120)

    out = tmp_path / "out"
    paths = write_report(report, out)
    assert [p.name for p in paths] == ["report.json", "report.md", "pass_at_k.png",
                                       "speedups.png", "problems.png"]
    doc = json.loads((out / "report.json").read_text())
    assert not doc["complete"] and doc["verifier_versions"] == ["kzv-test"]
    assert doc["metrics"]["level 2"]["fast_1.5"] == pytest.approx(1 / 3)
    assert doc["problems"][0]["speedups"] == [2.0, None, 0.5]
    md = (out / "report.md").read_text()
    assert doc["throughput"]["kernels_per_minute"] == 4.0
    assert "Throughput: 8 kernels in 2.0 active min (4.0 per min)" in md
    assert "incomplete" in md and "| level1/1_A | correct, incorrect, correct |" in md


def test_report_against_the_compiled_reference(store_url: str, tmp_path: Path) -> None:
    """Speedups vs torch.compile from the verdicts' details, beside those vs eager: the
    store gives the details back (PostgreSQL trims payloads to the keys asked for)."""
    report = build_report(load(store_url))
    assert report.record.started.compile_baseline
    l1, l2, overall = (report.metrics[k] for k in ("level 1", "level 2", "overall"))
    # Overall: A's 1.6x and 0.4x; C failed and is left out; B has no correct kernel (0).
    assert overall.compile_timed == 2 and overall.compile_failed == 1
    assert overall.compile_geomean == pytest.approx((1.6 * 0.4) ** 0.5)
    assert overall.fast_compile == pytest.approx((1 / 3 + 0) / 2)
    assert overall.compile_geomean_ci == pytest.approx((0.8, 0.8))  # one problem has any
    assert l1.fast_compile == overall.fast_compile
    assert (l2.compile_timed, l2.compile_failed, l2.fast_compile, l2.compile_geomean) == (
        0, 1, None, None)
    # Against eager, C still counts.
    assert overall.geomean == pytest.approx((2.0 * 0.5 * 4.0 * 1.0) ** (1 / 4))

    header, rows = table_rows(report.metrics)
    row = dict(zip(header, rows[-1], strict=True))
    assert rows[-1][0] == "overall"
    assert row["timed vs compile"] == "2 (1 problem failed)"
    assert row["fast_1 vs compile"] == "0.167"
    assert row["geomean vs compile (95% CI)"] == "0.80 (0.80–0.80)"
    assert dict(zip(header, rows[1], strict=True))["geomean vs compile (95% CI)"] == "–"

    out = tmp_path / "out"
    write_report(report, out)
    doc = json.loads((out / "report.json").read_text())
    assert doc["compile_baseline"] is True
    m = doc["metrics"]["overall"]
    assert m["geomean_speedup_vs_compile"] == pytest.approx(0.8)
    assert m["fast_1_vs_compile"] == pytest.approx(1 / 6)
    assert (m["timed_vs_compile"], m["compile_baseline_failed"]) == (2, 1)
    assert doc["problems"][0]["speedups_vs_compile"] == [1.6, None, 0.4]
    md = (out / "report.md").read_text()
    assert "and the reference under torch.compile" in md
    assert "| level1/1_A | correct, incorrect, correct | 2.00, –, 0.50 | 1.60, –, 0.40 |" in md
    assert "geomean vs compile (95% CI)" in md and "0.80 (0.80–0.80)" in md


def test_evaluation_events_never_reach_training_state() -> None:
    state = RunState()
    for e in run_events():
        state.apply(e)
    assert not state.kernels and not state.groups and not state.counts
    training = new_event(
        KernelGenerated(kernel_id="k", module_id="m", group_id="g", backend="triton", source="x"),
        stream_id="kernel-k", stream_version=0, correlation_id="run-0", event_id=uuid.uuid4())
    state.apply(training)
    assert list(state.kernels) == ["k"]


def test_every_verdict_status_has_a_colour_in_the_grid() -> None:
    from kz_stream.evaluation import STATUS_COLOURS
    from kz_stream.verify import Status

    assert {s.value for s in Status} | {"pending"} == set(STATUS_COLOURS)


def test_plots_of_a_whole_suite_draw_without_warnings(tmp_path: Path) -> None:
    import warnings

    # KernelBench's levels 1 and 2: 200 problems with names as long as its longest (66
    # characters there), nothing verified yet.
    name = "Conv3d_GroupNorm_Softmax_Dropout_Mean_BiasAdd_Scaling_Sum_ResidualAdd"
    problems = [EvaluationProblem(problem_id=f"level{1 + i // 100}/{i}_{name}", name=str(i),
                                  level=1 + i // 100, module_id=f"kb-{i}") for i in range(200)]
    started = EvaluationStarted(run_id=RUN, suite="/suite", backend="triton", samples=10,
                                policy={"spec": "base"}, problems=problems)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied" was one
        paths = write_report(build_report(EvalRecord(started)), tmp_path)
    assert all(p.stat().st_size for p in paths)


def test_the_verifiers_own_failures_are_not_counted_until_verified_again(
        store_url: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kz_stream.cli import app

    record = load(store_url)
    # A's incorrect sample was the verifier's failure instead: it says nothing of the kernel.
    kid = kernel_id_of(RUN, "level1/1_A", 1)
    record.verdicts[kid] = {**record.verdicts[kid], "status": "infra_error"}
    report = build_report(record)
    assert report.grid["level1/1_A"] == ["correct", "infra_error", "correct"]
    assert report.verified == 7 and report.expected == 9
    a = next(r for r in report.results if r.problem_id == "level1/1_A")
    assert a.correct == (True, True)  # 2 of 2 judged, not 2 of 3
    assert report.metrics["level 1"].pass_at[1] == pytest.approx((1 + 0) / 2)
    doc = report.as_dict()
    assert not doc["complete"] and doc["verify_again"] == 1
    # A merge of the parts reads the report rows the same way.
    merged = merge_reports([_part(doc, "eval-l1", 1), _part(doc, "eval-l2", 2)])
    assert (merged.doc["verified"], merged.doc["verify_again"]) == (7, 1)
    (tmp_path / "r.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["eval", "merge", str(tmp_path / "r.json"),
                                      "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert ("1 verdict is the verifier's own failure and not counted: run kz eval run "
            "again with the same --run-id") in " ".join(result.output.split())
    assert merged.metrics["level 1"].as_dict() == report.metrics["level 1"].as_dict()


def _part(whole: dict[str, object], run_id: str, level: int) -> dict[str, Any]:
    """The report.json of a run over one level of ``whole``'s problems, read back."""
    doc: dict[str, Any] = json.loads(json.dumps(whole))
    doc["run_id"] = run_id
    doc["problems"] = [row for row in doc["problems"] if row["level"] == level]
    return doc


def test_the_parts_of_an_evaluation_merge_into_its_own_numbers(store_url: str,
                                                               tmp_path: Path) -> None:
    report = build_report(load(store_url))
    whole = report.as_dict()
    one, two = _part(whole, "eval-l1", 1), _part(whole, "eval-l2", 2)
    two["throughput"] = {**{k: 0.0 for k in two["throughput"]}, "kernels": 0}
    merged = merge_reports([one, two])
    for name in ("level 1", "level 2", "overall"):  # pass@k, fast_p, both rules, CIs
        assert merged.metrics[name].as_dict() == report.metrics[name].as_dict(), name
    assert table_rows(merged.metrics) == table_rows(report.metrics)
    d = merged.doc
    assert d["parts"] == ["eval-l1", "eval-l2"] and d["run_id"] == "eval-l1 + eval-l2"
    assert (d["verified"], d["expected"], d["complete"]) == (8, 9, False)
    assert d["statuses"] == report.statuses
    assert d["throughput"] == whole["throughput"]  # the second part's minutes are 0
    assert [row["problem_id"] for row in d["problems"]] == list(report.grid)

    out = tmp_path / "merged"
    paths = write_merged(merged, out)
    assert [p.name for p in paths] == ["report.json", "report.md", "pass_at_k.png",
                                       "speedups.png", "problems.png"]
    assert json.loads((out / "report.json").read_text())["metrics"] == whole["metrics"]
    md = (out / "report.md").read_text()
    assert "merged from 2 runs: `eval-l1`, `eval-l2`" in md
    assert "| level1/1_A | correct, incorrect, correct | 2.00, –, 0.50 | 1.60, –, 0.40 |" in md


def test_kz_eval_merge_prints_the_table_and_writes_the_report(store_url: str,
                                                              tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kz_stream.cli import app

    whole = build_report(load(store_url)).as_dict()
    files = []
    for run_id, level in (("eval-l1", 1), ("eval-l2", 2)):
        files.append(tmp_path / f"{run_id}.json")
        files[-1].write_text(json.dumps(_part(whole, run_id, level)))
    result = CliRunner().invoke(app, ["eval", "merge", *map(str, files),
                                      "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert "evaluation of 2 parts (8/9 kernels verified)" in " ".join(result.output.split())
    assert "verifier versions" not in result.output
    # A part judged by another verifier version: merged, and said.
    two = json.loads(files[1].read_text())
    files[1].write_text(json.dumps({**two, "verifier_versions": ["kzv-newer"]}))
    result = CliRunner().invoke(app, ["eval", "merge", *map(str, files),
                                      "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert "verdicts of 2 verifier versions (kzv-newer, kzv-test)" in " ".join(
        result.output.split())
    assert (tmp_path / "m" / "report.md").exists()
    # Two parts that share a problem: one red line, exit 1.
    result = CliRunner().invoke(app, ["eval", "merge", str(files[0]), str(files[0])])
    assert result.exit_code == 1
    assert "is in both eval-l1 and eval-l1" in " ".join(result.output.split())


def test_reports_of_other_evaluations_are_not_merged(store_url: str) -> None:
    whole = build_report(load(store_url)).as_dict()
    one, two = _part(whole, "eval-l1", 1), _part(whole, "eval-l2", 2)
    for key, other in (("samples_per_problem", 10), ("policy", {"spec": "run:x"}),
                       ("backend", "cuda"), ("compile_baseline", False)):
        with pytest.raises(ValueError, match=f"not parts of one evaluation: {key}"):
            merge_reports([one, {**two, key: other}])
    old = json.loads(json.dumps(two))
    for row in old["problems"]:
        del row["kernelbench_rule"]
    with pytest.raises(ValueError, match="no per-sample KernelBench rule"):
        merge_reports([one, old])
    with pytest.raises(ValueError, match="no reports"):
        merge_reports([])
