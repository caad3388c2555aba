"""Conversion of verdicts to the event payload (the one place that needs pydantic)."""

from __future__ import annotations

from kz_stream.events import KernelVerified
from kz_stream.verify._types import Verdict


def to_kernel_verified(
    verdict: Verdict, *, kernel_id: str, module_id: str, group_id: str, policy_version: int = 0
) -> KernelVerified:
    """The ``KernelVerified`` payload for a verdict."""
    return KernelVerified(kernel_id=kernel_id, module_id=module_id, group_id=group_id,
                          policy_version=policy_version, **verdict.as_payload_fields())
