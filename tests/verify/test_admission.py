"""Admission rejects degenerate reference modules and admits real ones."""

from __future__ import annotations

import pytest

from kz_stream.verify.admission import admission_check
from tests.verify.corpus.degenerate import DEGENERATE
from tests.verify.corpus.problems import PROBLEMS


@pytest.mark.parametrize("reason", sorted(DEGENERATE))
def test_degenerate_rejected(reason: str) -> None:
    result = admission_check(DEGENERATE[reason], timeout_s=120)
    assert not result.admitted
    assert result.reason == reason, result.detail


@pytest.mark.parametrize("name", ["relu", "row_sum", "linear_relu", "layernorm",
                                  "conv1d_depthwise"])
def test_real_modules_admitted(name: str) -> None:
    result = admission_check(PROBLEMS[name], timeout_s=120)
    assert result.admitted, (result.reason, result.detail)


def test_timeout() -> None:
    src = PROBLEMS["relu"].replace("return torch.relu(x)",
                                   "import time\n        time.sleep(100)\n        return x")
    result = admission_check(src, timeout_s=3)
    assert not result.admitted and result.reason == "timeout"
