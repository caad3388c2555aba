"""The verifier's public API is ``kz_stream.verify.__all__``; every other module of the
package is internal (a leading underscore), and importing the package stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kz_stream.verify as verify

PUBLIC = [
    "VERIFIER_VERSION",
    "Admission",
    "Backend",
    "Candidate",
    "InterfaceError",
    "Isolation",
    "Problem",
    "ProblemAudit",
    "SandboxOutcome",
    "SandboxSetupError",
    "Status",
    "Verdict",
    "Verifier",
    "VerifierConfig",
    "admission_check",
    "audit_suite",
    "isolation",
    "load_source",
    "require",
    "run_in_sandbox",
    "still_to_audit",
    "suite_files",
]


def test_all_is_pinned_and_every_name_resolves() -> None:
    assert sorted(verify.__all__) == sorted(PUBLIC)
    for name in verify.__all__:
        assert getattr(verify, name) is not None, name


def test_other_modules_are_internal() -> None:
    """``events`` (the verdict's event) is the one public module besides the package."""
    folder = Path(verify.__file__).parent
    public = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    assert public <= {"events"}, public


def test_the_package_imports_no_torch() -> None:
    """The sandbox child imports the package: its names load on use."""
    code = "import sys, kz_stream.verify; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
