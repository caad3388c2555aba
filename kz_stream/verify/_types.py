"""Value types of the verifier's public API. Standard library only."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

# 1.1: the zeroing-then-reading L2 flush and rotated output blocks (speedups move with
# them, so verdicts of 1.0 and 1.1 are different verdicts).
# 1.2: fresh input values for every timed call, a sign-mixed set for non-negative inputs,
# the memory plan and the input-set policy (verdicts can flip from 1.1: re-score).
# 1.3: random tensor creation (parameter initialisation) is no torch fallback; on the CPU
# path, an error the host's Triton interpreter also raises on its self-check is infra_error.
# 1.4: the physical floor counts the elements a kernel moves, not a reduction result's
# buffer (a mean loss's 0-dim view of its elementwise storage made honest losses `hack`).
VERIFIER_VERSION = "kzv-1.4"

Backend = Literal["cuda", "triton"]


def source_sha256(source: str) -> str:
    """The SHA-256 (hex) of a source text as UTF-8: how a kernel names its module's text,
    and an audit row its problem's."""
    return hashlib.sha256(source.encode()).hexdigest()


class Status(StrEnum):
    """Verdict status (``kz_stream.events.VerdictStatus`` is this enum)."""

    CORRECT = "correct"
    INCORRECT = "incorrect"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    OUT_OF_MEMORY = "out_of_memory"
    HACK = "hack"
    UNCHECKED = "unchecked"  # the verifier could not run this check here (e.g. no GPU)
    # The verifier itself failed (its own out-of-memory, a crash of its harness): says
    # nothing about the candidate, so the learner does not count it.
    INFRA_ERROR = "infra_error"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Problem:
    """A reference module in KernelBench format: ``class Model(nn.Module)``,
    ``get_inputs()`` and ``get_init_inputs()``."""

    source: str
    problem_id: str = ""

    @property
    def key(self) -> str:
        return sha256(self.source)


@dataclass(frozen=True)
class Candidate:
    """An untrusted implementation: the source of ``class ModelNew`` and its backend."""

    source: str
    backend: Backend
    kernel_id: str = ""

    @property
    def key(self) -> str:
        return sha256(f"{self.backend}\0{self.source}")


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of one candidate against one problem.

    ``check`` names the rule that decided a non-correct verdict (e.g. "rel_norm",
    "input_mutation", "torch_fallback"); ``input_index`` the input set it failed on.
    ``unchecked`` lists what this machine could not check (e.g. "timing" without a GPU).
    ``speedup`` is reference time / candidate time (medians); ``speedup_ci`` its 95%
    bootstrap interval.
    """

    status: Status
    reason: str | None = None
    check: str | None = None
    input_index: int | None = None
    max_rel_error: float | None = None
    speedup: float | None = None
    speedup_ci: tuple[float, float] | None = None
    verifier_version: str = VERIFIER_VERSION
    hardware: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    unchecked: tuple[str, ...] = ()

    @property
    def correct(self) -> bool:
        return self.status is Status.CORRECT

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the field names of ``KernelVerified``."""
        return {
            "status": self.status.value,
            "reason": self.reason,
            "check": self.check,
            "input_index": self.input_index,
            "max_rel_error": self.max_rel_error,
            "speedup": self.speedup,
            "speedup_ci": list(self.speedup_ci) if self.speedup_ci else None,
            "verifier_version": self.verifier_version,
            "hardware": dict(self.hardware),
            "details": dict(self.details),
            "unchecked": list(self.unchecked),
        }
