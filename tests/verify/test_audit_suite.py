"""`kz verify audit-suite` on a KernelBench-format folder the test writes: every problem
gets a row (admitted or why not, input sets used and dropped), and a broken one does not
stop the audit."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.verify import (
    VERIFIER_VERSION,
    ProblemAudit,
    Verifier,
    VerifierConfig,
    audit_suite,
    still_to_audit,
)
from tests.verify.test_output_kinds import HINGE, PICKY
from tests.verify.test_verifier_cpu import _waits_for


def test_audit_suite_reports_every_problem(tmp_path: Path) -> None:
    suite = tmp_path / "level1"
    suite.mkdir()
    (suite / "1_ReLU.py").write_text(PROBLEMS["relu_rand"])
    (suite / "2_Hinge.py").write_text(HINGE)
    (suite / "3_Picky.py").write_text(PICKY)
    (suite / "10_Broken.py").write_text("import torch\nclass Model:\n    pass\n")
    out = tmp_path / "audit.json"
    run = subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", "verify", "audit-suite", str(suite), "--cpu",
         "--json", str(out), "--jobs", "2"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "4 problems: 1 could not be prepared" in run.stdout, run.stdout
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    # Numeric order, though two problems were audited at a time.
    assert list(rows) == ["1_ReLU", "2_Hinge", "3_Picky", "10_Broken"]
    assert rows["1_ReLU"]["admitted"] is True
    # Where admission went: its sandboxed phases, and the sandbox's own start and return.
    adm = rows["1_ReLU"]["admission_phase_s"]
    assert {"load", "build", "inputs", "honest", "float64", "again", "calibrate",
            "degenerate", "sandbox"} <= set(adm), adm
    # Each phase is rounded to the millisecond, admission_s to the centisecond.
    assert abs(sum(adm.values()) - rows["1_ReLU"]["admission_s"]) <= 0.005 + 0.001 * len(adm)
    assert "small-signed" in rows["1_ReLU"]["input_sets"]
    assert rows["2_Hinge"]["admitted"] is True and rows["2_Hinge"]["error"] is None
    # Where each preparation went: the oracle's phases, within its own total, and the reply.
    phases = rows["1_ReLU"]["phase_s"]
    assert {"load", "build", "inputs", "honest", "float64", "calibrate", "inputs_to_host",
            "op_log_and_flops", "oracle", "reply"} <= set(phases), phases
    parts = sum(v for k, v in phases.items() if k not in ("oracle", "reply"))
    assert 0 < parts <= phases["oracle"] + 0.01 <= rows["1_ReLU"]["prepare_s"] + 0.02
    # What the sets hold on the host; the CPU path's small sets reserve none of the budget.
    assert rows["1_ReLU"]["host_bytes"] > 0 and rows["1_ReLU"]["reserved_bytes"] == 0
    # The physical floor: its bytes (an input and an output) at the H200's bandwidth.
    assert rows["1_ReLU"]["floor_ms"] > 0
    assert [d["label"] for d in rows["3_Picky"]["dropped"]] == ["small-heavy"]
    assert rows["10_Broken"]["admitted"] is False and rows["10_Broken"]["reason"] == "interface"
    assert rows["10_Broken"]["error"]


def _audit(suite: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", "verify", "audit-suite", str(suite), "--cpu",
         "--no-admission", "--json", str(out), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def test_a_resumed_audit_keeps_rows_whose_problem_and_verifier_are_unchanged(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "level1"
    suite.mkdir()
    (suite / "1_ReLU.py").write_text(PROBLEMS["relu_rand"])
    (suite / "2_Hinge.py").write_text(HINGE)
    (suite / "3_Broken.py").write_text("import torch\nclass Model:\n    pass\n")
    out = tmp_path / "audit.json"

    # A limit of 0 s starts nothing: the file holds no rows and the output says how to go on.
    first = _audit(suite, out, "--time-limit", "0")
    assert "3 problems not audited: the time limit came first" in first.stdout, first.stdout
    assert "--resume" in first.stdout and json.loads(out.read_text()) == []

    _audit(suite, out, "--resume")
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["1_ReLU", "2_Hinge", "3_Broken"]
    assert rows["1_ReLU"]["verifier_version"] == VERIFIER_VERSION
    assert rows["1_ReLU"]["machine"] == "cpu"
    assert rows["1_ReLU"]["source_sha256"] == hashlib.sha256(
        PROBLEMS["relu_rand"].encode()).hexdigest()
    assert rows["3_Broken"]["error"]

    # A changed problem is audited again; the others' rows are kept as they were, the one
    # that could not be prepared too, unless --retry-errors asks for it.
    (suite / "2_Hinge.py").write_text(HINGE + "\n# changed\n")
    again = _audit(suite, out, "--resume")
    assert "2 rows kept" in again.stdout and "1 audited now" in again.stdout, again.stdout
    after = {r["name"]: r for r in json.loads(out.read_text())}
    assert after["1_ReLU"] == rows["1_ReLU"] and after["3_Broken"] == rows["3_Broken"]
    assert after["2_Hinge"]["source_sha256"] != rows["2_Hinge"]["source_sha256"]
    retried = _audit(suite, out, "--retry-errors")  # resumes too
    assert "2 rows kept" in retried.stdout and "1 audited now" in retried.stdout
    # --redo audits a named problem again though its row stands (and resumes too).
    redone = _audit(suite, out, "--redo", "1_ReLU")
    assert "2 rows kept" in redone.stdout and "1 audited now" in redone.stdout, redone.stdout
    typo = subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", "verify", "audit-suite", str(suite), "--cpu",
         "--json", str(out), "--redo", "1_Relu"], capture_output=True, text=True, timeout=120)
    assert typo.returncode != 0 and "no problem 1_Relu" in typo.stderr + typo.stdout
    # A narrower selection keeps the rows of the problems outside it as they are.
    before = json.loads(out.read_text())
    _audit(suite, out, "--resume", "--limit", "1")
    assert json.loads(out.read_text()) == before


def test_a_resume_from_a_file_that_holds_no_audit_rows_says_so(tmp_path: Path) -> None:
    suite = tmp_path / "level1"
    suite.mkdir()
    (suite / "1_ReLU.py").write_text(PROBLEMS["relu_rand"])
    out = tmp_path / "audit.json"
    for text in ('{"cut', '[{"nam": 1}]', '{"name": "x"}'):
        out.write_text(text)
        run = subprocess.run(
            [sys.executable, "-m", "kz_stream.cli", "verify", "audit-suite", str(suite),
             "--cpu", "--json", str(out), "--resume"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
        assert run.returncode == 1, (text, run.stdout, run.stderr)
        assert "holds no audit rows to go on from" in " ".join(run.stderr.split()), run.stderr
        assert out.read_text() == text  # left as it was


def test_still_to_audit_takes_rows_of_another_verifier_version_as_missing(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "1_A.py", tmp_path / "2_B.py"
    a.write_text("a")
    b.write_text("b")
    digest = hashlib.sha256(b"a").hexdigest()
    current = ProblemAudit("1_A", digest, VERIFIER_VERSION)
    assert still_to_audit([a, b], [current]) == ([b], {"1_A": current})
    older = ProblemAudit("1_A", digest, "kzv-0.9")
    assert still_to_audit([a, b], [older]) == ([a, b], {})
    # Rows of problems no longer in the selection are not carried.
    assert still_to_audit([b], [current]) == ([b], {})
    # A row named to redo is audited again though it stands.
    assert still_to_audit([a, b], [current], redo={"1_A"}) == ([a, b], {})
    # Keys written by another version of the row are left out when it is read back.
    assert ProblemAudit.from_dict({**current.to_dict(), "new_field": 1}) == current


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
async def test_a_row_comes_as_its_problem_is_done_not_behind_a_slower_one(
        tmp_path: Path) -> None:
    # The first problem waits until the second's row has come: a cut slot keeps it.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as marks:
        os.chmod(marks, 0o777)
        (tmp_path / "1_Waits.py").write_text(_waits_for(marks, "waits", "go"))
        (tmp_path / "2_ReLU.py").write_text(PROBLEMS["relu_rand"])
        files = [tmp_path / "1_Waits.py", tmp_path / "2_ReLU.py"]
        names = []
        async with Verifier(VerifierConfig(devices=[], oracles=2)) as v:
            async for row in audit_suite(files, v, admission=False, jobs=2):
                names.append(row.name)
                assert row.error is None, row
                await asyncio.to_thread((Path(marks) / "go").touch)
    assert names == ["2_ReLU", "1_Waits"]
