"""`kz verify audit-suite` on a KernelBench-format folder the test writes: every problem
gets a row (admitted or why not, input sets used and dropped), and a broken one does not
stop the audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kz_stream.testing.corpus.problems import PROBLEMS
from tests.verify.test_output_kinds import HINGE, PICKY


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
    assert [d["label"] for d in rows["3_Picky"]["dropped"]] == ["small-heavy"]
    assert rows["10_Broken"]["admitted"] is False and rows["10_Broken"]["reason"] == "interface"
    assert rows["10_Broken"]["error"]
