"""Kernel verification: turns an untrusted ``ModelNew`` (CUDA or Triton) and its reference
module into a verdict — correct or why not, and its speedup over PyTorch eager.

Public API::

    from kz_stream.verify import Candidate, Problem, Verifier

    async with Verifier() as v:
        verdict = await v.verify(Problem(reference_source), Candidate(source, "triton"))

Also ``kz_stream.verify.sandbox.run_in_sandbox`` and
``kz_stream.verify.admission.admission_check`` for validating proposed modules. Names are
imported lazily so that the sandbox child stays light (no torch at import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kz_stream.verify._types import (
    VERIFIER_VERSION,
    Backend,
    Candidate,
    Problem,
    Status,
    Verdict,
)

if TYPE_CHECKING:
    from kz_stream.verify._config import VerifierConfig
    from kz_stream.verify.admission import Admission, admission_check
    from kz_stream.verify.sandbox import SandboxOutcome, run_in_sandbox
    from kz_stream.verify.verifier import Verifier

__all__ = [
    "VERIFIER_VERSION",
    "Admission",
    "Backend",
    "Candidate",
    "Problem",
    "SandboxOutcome",
    "Status",
    "Verdict",
    "Verifier",
    "VerifierConfig",
    "admission_check",
    "run_in_sandbox",
]

_LAZY = {
    "Verifier": "kz_stream.verify.verifier",
    "VerifierConfig": "kz_stream.verify._config",
    "Admission": "kz_stream.verify.admission",
    "admission_check": "kz_stream.verify.admission",
    "SandboxOutcome": "kz_stream.verify.sandbox",
    "run_in_sandbox": "kz_stream.verify.sandbox",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kz_stream.verify' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
