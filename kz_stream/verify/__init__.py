"""Kernel verification: turns an untrusted ``ModelNew`` (CUDA or Triton) and its reference
module into a verdict — correct or why not, and its speedup over PyTorch eager.

Public API (everything in ``__all__``; the modules with a leading underscore are internal)::

    from kz_stream.verify import Candidate, Problem, Verifier

    async with Verifier() as v:
        verdict = await v.verify(Problem(reference_source), Candidate(source, "triton"))

Also ``run_in_sandbox`` and ``admission_check`` for validating proposed modules,
``load_source`` and ``require`` to load one, ``isolation`` (what untrusted code runs
under on this host) and ``audit_suite`` for a problem suite (``KernelVerified.from_verdict``
in ``kz_stream.events`` turns a verdict into its event). Names are imported lazily so that
the sandbox child stays light (no torch at import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kz_stream._lazy import lazy_exports
from kz_stream.verify._types import (
    VERIFIER_VERSION,
    Backend,
    Candidate,
    Problem,
    Status,
    Verdict,
)

if TYPE_CHECKING:
    from kz_stream.verify._admission import Admission, admission_check
    from kz_stream.verify._audit import ProblemAudit, audit_suite, still_to_audit, suite_files
    from kz_stream.verify._config import VerifierConfig
    from kz_stream.verify._loader import InterfaceError, load_source, require
    from kz_stream.verify._sandbox import Isolation, SandboxOutcome, isolation, run_in_sandbox
    from kz_stream.verify._verifier import Verifier

__all__ = [
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

# The verifier, its config and the sandbox pull in torch or subprocess machinery: imported
# on first use.
__getattr__ = lazy_exports(__name__, {
    "Verifier": "._verifier",
    "VerifierConfig": "._config",
    "Admission": "._admission",
    "admission_check": "._admission",
    "ProblemAudit": "._audit",
    "audit_suite": "._audit",
    "still_to_audit": "._audit",
    "suite_files": "._audit",
    "InterfaceError": "._loader",
    "load_source": "._loader",
    "require": "._loader",
    "Isolation": "._sandbox",
    "SandboxOutcome": "._sandbox",
    "SandboxSetupError": "._sandbox",
    "isolation": "._sandbox",
    "run_in_sandbox": "._sandbox",
})
