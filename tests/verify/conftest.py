"""A verifier shared by the tests of one module (its oracle caches prepared problems)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kz_stream.verify import Verifier, VerifierConfig


@pytest.fixture(scope="module")
def cpu_verifier() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig(devices=[], prewarm=1))
    yield v
    v.close_sync()


@pytest.fixture(scope="module")
def cpu_verifier_runtime_only() -> Iterator[Verifier]:
    """The static scan switched off: shows the run-time checks catch cheats on their own."""
    v = Verifier(VerifierConfig(devices=[], static_scan=False, prewarm=1))
    yield v
    v.close_sync()
