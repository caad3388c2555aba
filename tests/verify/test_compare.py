"""Tolerances calibrated on an honest float32 run reject TF32-level error and accept
float32 arithmetic in another order."""

from __future__ import annotations

import pytest
import torch

from kz_stream.verify import _compare as compare
from kz_stream.verify._checks import check_device
from kz_stream.verify._compare import (
    calibrate,
    compare_outputs,
    compare_tensor,
    kernelbench_allclose,
)


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


def test_zero_dim_outputs_are_compared() -> None:
    x = torch.rand(1000, dtype=torch.float64)
    expected = x.mean()
    honest = x.float().mean()
    tol = calibrate(expected, honest)
    assert compare_tensor(honest.clone(), expected, honest, tol).ok
    wrong = compare_tensor(honest + 1e-3, expected, honest, tol)
    assert not wrong.ok and wrong.check == "rel_norm"


def test_integer_and_bool_outputs_must_match_exactly() -> None:
    idx = torch.tensor([3, 1, 4, 1, 5])
    tol = calibrate(idx, idx)
    assert compare_tensor(idx.clone(), idx, idx, tol).ok
    off = idx.clone()
    off[2] = 9
    assert not compare_tensor(off, idx, idx, tol).ok
    mask = torch.tensor([True, False, True])
    assert compare_tensor(mask.clone(), mask, mask, calibrate(mask, mask)).ok
    assert not compare_tensor(~mask, mask, mask, calibrate(mask, mask)).ok


def test_tuple_outputs_fail_on_any_member() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, generator=g)
    outs = [a.double().exp(), a.double().argmax()]
    honest = [a.exp(), a.argmax()]
    tols = [calibrate(e, h) for e, h in zip(outs, honest, strict=True)]
    assert compare_outputs([h.clone() for h in honest], outs, honest, tols).ok
    bad = compare_outputs([honest[0].clone(), honest[1] + 1], outs, honest, tols)
    assert not bad.ok and bad.message.startswith("output 1")


def test_blockwise_comparison_equals_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, expected, honest = _matmul_case()
    naive = (a.double() @ b.double()).float() + torch.randn(64, 64) * 1e-6
    nan = honest.clone()
    nan[5, 7] = float("nan")
    whole = [compare_tensor(c, expected, honest, calibrate(expected, honest))
             for c in (naive, nan, honest.half().float())]
    monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 97)  # blocks that split rows
    blocked = [compare_tensor(c, expected, honest, calibrate(expected, honest))
               for c in (naive, nan, honest.half().float())]
    for w, bl in zip(whole, blocked, strict=True):
        assert (w.ok, w.check) == (bl.ok, bl.check)
        assert bl.rel_norm_error == pytest.approx(w.rel_norm_error, rel=1e-9)
        assert bl.max_abs_error == w.max_abs_error
        assert bl.bad_fraction == pytest.approx(w.bad_fraction)


def test_kernelbench_rule_is_looser_than_ours() -> None:
    _, _, expected, honest = _matmul_case()
    off = honest * (1 + 1e-4)  # an error TF32 makes, 100x an honest float32 kernel's
    tol = calibrate(expected, honest)
    assert not compare_tensor(off, expected, honest, tol).ok
    assert kernelbench_allclose([off], [honest])  # KernelBench would accept it
    assert not kernelbench_allclose([honest + 1.0], [honest])
    assert not kernelbench_allclose([honest[:1]], [honest])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernelbench_rule_on_a_device_rules_as_on_the_host() -> None:
    _, _, _, honest = _matmul_case()
    for cand in (honest * (1 + 1e-4), honest + 1.0, honest.clone().fill_(float("nan"))):
        assert kernelbench_allclose([cand], [honest], device="cuda") == kernelbench_allclose(
            [cand], [honest])


def test_kernelbench_rule_calls_an_output_that_is_not_a_tensor_wrong() -> None:
    _, _, _, honest = _matmul_case()
    for junk in (None, "tensor", object()):
        assert not kernelbench_allclose([junk], [honest])


def test_small_outputs_are_checked_on_the_host_and_big_ones_on_the_device() -> None:
    assert check_device(4096, "cuda:0") == "cpu"  # a reduction's: no wait for the device
    assert check_device(64 << 20, "cuda:0") == "cpu"
    assert check_device((64 << 20) + 1, "cuda:0") == "cuda:0"
    assert check_device(1 << 40, "cpu") == "cpu"  # the CPU path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_comparison_on_the_host_rules_as_on_a_device() -> None:
    a, b, expected, honest = _matmul_case()
    tols = [calibrate(expected, honest)]
    near = (a * (1 + 3e-7)) @ b
    for cand in (near, honest + 1e-3, honest.clone().fill_(float("nan"))):
        on_host = compare_outputs([cand], [expected], [honest], tols, "cpu")
        on_device = compare_outputs([cand], [expected], [honest], tols, "cuda")
        assert (on_host.ok, on_host.check) == (on_device.ok, on_device.check)
        assert on_host.rel_norm_error == pytest.approx(on_device.rel_norm_error, rel=1e-9)
