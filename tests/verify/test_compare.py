"""Tolerances calibrated on an honest float32 run reject TF32-level error and accept
float32 arithmetic in another order."""

from __future__ import annotations

import torch

from kz_stream.verify.compare import calibrate, compare_outputs, compare_tensor


def _matmul_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 512, generator=g)
    b = torch.randn(512, 64, generator=g)
    return a, b, a.double() @ b.double(), a @ b


def test_reordered_float32_passes() -> None:
    a, b, expected, honest = _matmul_case()
    tol = calibrate(expected, honest)
    # A naive sequential-k float32 product: another summation order.
    acc = torch.zeros(64, 64)
    for k in range(512):
        acc += a[:, k : k + 1] * b[k : k + 1, :]
    assert compare_tensor(acc, expected, honest, tol).ok


def test_low_precision_fails() -> None:
    a, b, expected, honest = _matmul_case()
    tol = calibrate(expected, honest)
    low = (a.bfloat16() @ b.bfloat16()).float()
    r = compare_tensor(low, expected, honest, tol)
    assert not r.ok and r.check == "rel_norm"
    # TF32 keeps 10 mantissa bits: emulate by rounding the operands.
    def tf32(t: torch.Tensor) -> torch.Tensor:
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)
    assert not compare_tensor(tf32(a) @ tf32(b), expected, honest, tol).ok


def test_nan_must_match_and_unwritten_fails() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    expected = x.double()
    tol = calibrate(expected, x)
    assert compare_tensor(x.clone(), expected, x, tol).ok
    bad = x.clone()
    bad[1] = 0.0
    assert compare_tensor(bad, expected, x, tol).check == "nonfinite_mismatch"
    bad = x.clone()
    bad[0] = float("nan")
    assert compare_tensor(bad, expected, x, tol).check == "nonfinite"


def test_shape_dtype_and_count() -> None:
    x = torch.randn(8)
    tol = calibrate(x.double(), x)
    assert compare_tensor(x[:4], x.double(), x, tol).check == "shape"
    assert compare_tensor(x.double(), x.double(), x, tol).check == "dtype"
    assert compare_outputs([x, x], [x.double()], [x], [tol]).check == "output_count"
