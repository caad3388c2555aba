"""Output comparison against a float64 reference, with bounds calibrated on an honest
implementation in the output's own precision.

For each output tensor ``e`` (float64 reference) and ``h`` (the reference module run in the
input dtype, an honest same-precision implementation):

- positions where ``e`` rounded to the output dtype and ``h`` disagree on being finite are
  "don't care" (the candidate cannot be asked to beat an honest implementation there);
- non-finite positions both agree on must be reproduced exactly (NaN as NaN, +inf as +inf);
- finite positions must satisfy a relative-norm bound
  ``‖c − e‖ / ‖e‖ ≤ max(SAFETY·‖h − e‖/‖e‖, FLOOR·eps)`` and a per-element bound
  ``|c − e| ≤ atol + rtol·|e|`` with ``rtol = FLOOR·eps`` and
  ``atol = max(SAFETY·max|h − e|, FLOOR·eps·rms(e))``.

SAFETY leaves room for honest kernels that sum in another order (a naive loop has a larger
error than a blocked library kernel); it is well below the error of TF32 or bf16 math on
float32 data, which must fail.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

SAFETY = 32.0
FLOOR = 16.0


@dataclass(frozen=True)
class Tolerance:
    """Calibrated bounds for one output tensor."""

    rel_norm: float
    atol: float
    rtol: float
    honest_rel_norm: float
    dont_care_fraction: float


@dataclass(frozen=True)
class Comparison:
    """Outcome of comparing a candidate's outputs with the reference on one input set."""

    ok: bool
    check: str | None = None
    message: str = ""
    rel_norm_error: float = 0.0
    max_abs_error: float = 0.0
    bad_fraction: float = 0.0


def flatten(value: Any) -> list[Any]:
    """The tensors (and plain numbers) of an output, in order."""
    if isinstance(value, tuple | list):
        out: list[Any] = []
        for v in value:
            out.extend(flatten(v))
        return out
    if isinstance(value, dict):
        return flatten(list(value.values()))
    return [value]


def _same_class(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: both NaN, or both equal infinities, or both finite."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return (nan_a & nan_b) | (~nan_a & ~nan_b & (torch.isfinite(a) == torch.isfinite(b))
                              & (torch.isfinite(a) | (a == b)))


def _eps(dtype: torch.dtype) -> float:
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps)
    return 0.0


def all_finite(outputs: list[Any]) -> bool:
    """Whether every floating value among ``outputs`` (tensors or numbers) is finite."""
    for o in outputs:
        if not isinstance(o, torch.Tensor | int | float):
            continue  # not a value (admission names it an interface error)
        t = torch.as_tensor(o)
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            return False
    return True


def unstable_limit(outputs: list[Any]) -> float:
    """The largest honest-vs-float64 error a problem may have and still be checkable."""
    eps = max((_eps(o.dtype) for o in outputs if isinstance(o, torch.Tensor)), default=0.0)
    return min(0.05, max(1e-3, 8 * eps))


# Elements per block: comparisons and calibration stream through outputs in blocks, so a
# KernelBench-sized output (1.6e9 elements: 13 GB in float64) never needs several float64
# copies of itself on one device at once.
BLOCK_ELEMENTS = 1 << 25


def _blocks(device: torch.device, *tensors: torch.Tensor
            ) -> Iterator[tuple[torch.Tensor, ...]]:
    """Aligned flat blocks of ``tensors`` (one shape), each moved to ``device`` in float64.
    A 0-dim tensor is one block of one element."""
    flat = [t.detach().reshape(-1) for t in tensors]
    n = flat[0].numel()
    for s in range(0, n, BLOCK_ELEMENTS):
        yield tuple(f[s:s + BLOCK_ELEMENTS].to(device).to(torch.float64) for f in flat)


def calibrate(expected: torch.Tensor, honest: torch.Tensor,
              device: str | torch.device | None = None) -> Tolerance:
    """Bounds for one output from the float64 reference and an honest same-dtype result
    (computed on ``device``, default ``expected``'s, block by block)."""
    out_dtype = honest.dtype
    if tuple(expected.shape) != tuple(honest.shape):
        raise ValueError(f"honest output shape {tuple(honest.shape)} != reference "
                         f"{tuple(expected.shape)}")
    dont_care = care_n = 0
    sum_e2 = sum_d2 = honest_abs = 0.0
    dev = torch.device(device) if device is not None else expected.device
    for e, h in _blocks(dev, expected, honest):
        e_cast = e.to(out_dtype).to(torch.float64)
        care = torch.isfinite(e_cast) & torch.isfinite(h)
        dont_care += int((~_same_class(e_cast, h)).sum())
        ec, hc = e[care], h[care]
        if ec.numel():
            d = (hc - ec).abs()
            care_n += ec.numel()
            sum_e2 += float((ec * ec).sum())
            sum_d2 += float((d * d).sum())
            honest_abs = max(honest_abs, float(d.max()))
    eps = _eps(out_dtype)
    ref_norm = math.sqrt(sum_e2)
    honest_rel = math.sqrt(sum_d2) / ref_norm if ref_norm > 0 else 0.0
    rms = math.sqrt(sum_e2 / care_n) if care_n else 0.0
    return Tolerance(
        rel_norm=max(SAFETY * honest_rel, FLOOR * eps),
        atol=max(SAFETY * honest_abs, FLOOR * eps * rms),
        rtol=FLOOR * eps,
        honest_rel_norm=honest_rel,
        dont_care_fraction=float(dont_care / max(1, expected.numel())),
    )


def compare_tensor(
    cand: Any, expected: torch.Tensor, honest: torch.Tensor, tol: Tolerance,
    device: str | torch.device | None = None,
) -> Comparison:
    """Compares one candidate output tensor; see the module docstring for the rules.
    The arithmetic runs on ``device`` (default: ``expected``'s), block by block. Scalars,
    0-dim, integer and bool outputs are compared too (integers and bools exactly: their
    tolerance is zero)."""
    if not isinstance(cand, torch.Tensor):
        if isinstance(cand, int | float | bool):
            cand = torch.as_tensor(cand)
        else:
            return Comparison(False, "output_type", f"output is {type(cand).__name__}, "
                              "expected a tensor")
    if tuple(cand.shape) != tuple(expected.shape):
        return Comparison(False, "shape", f"output shape {tuple(cand.shape)} != expected "
                          f"{tuple(expected.shape)}")
    if cand.dtype != honest.dtype:
        return Comparison(False, "dtype", f"output dtype {cand.dtype} != expected {honest.dtype}")
    dev = torch.device(device) if device is not None else expected.device
    bad_nf = bad_f = care_n = over_n = 0
    sum_e2 = sum_d2 = max_abs = 0.0
    for c, e, h in _blocks(dev, cand, expected, honest):
        e_cast = e.to(honest.dtype).to(torch.float64)
        agree = _same_class(e_cast, h)
        care_finite = agree & torch.isfinite(e_cast)
        bad_nf += int((agree & ~torch.isfinite(e_cast) & ~_same_class(c, e_cast)).sum())
        bad_f += int((care_finite & ~torch.isfinite(c)).sum())
        if bad_nf or bad_f:
            continue  # a failure already: only the counts matter from here
        cf, ef = c[care_finite], e[care_finite]
        if not cf.numel():
            continue
        d = (cf - ef).abs()
        care_n += cf.numel()
        sum_e2 += float((ef * ef).sum())
        sum_d2 += float((d * d).sum())
        max_abs = max(max_abs, float(d.max()))
        over_n += int((d > (tol.atol + tol.rtol * ef.abs())).sum())
    numel = max(1, cand.numel())
    if bad_nf:
        return Comparison(False, "nonfinite_mismatch",
                          f"{bad_nf} positions where the reference is NaN/inf differ",
                          float("inf"), float("inf"), bad_nf / numel)
    if bad_f:
        return Comparison(False, "nonfinite", f"{bad_f} NaN/inf values where the reference is "
                          "finite", float("inf"), float("inf"), bad_f / numel)
    if not care_n:
        return Comparison(True)
    ref_norm, err_norm = math.sqrt(sum_e2), math.sqrt(sum_d2)
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    frac = over_n / care_n
    if rel > tol.rel_norm:
        return Comparison(False, "rel_norm", f"relative error {rel:.3g} > bound {tol.rel_norm:.3g}",
                          rel, max_abs, frac)
    if over_n:
        return Comparison(False, "elementwise", f"{over_n} elements exceed "
                          f"{tol.atol:.3g} + {tol.rtol:.3g}·|ref| (max abs error {max_abs:.3g})",
                          rel, max_abs, frac)
    return Comparison(True, None, "", rel, max_abs, frac)


def kernelbench_allclose(cand: list[Any], reference: list[Any], *, atol: float = 1e-2,
                         rtol: float = 1e-2, device: str | torch.device = "cpu") -> bool:
    """KernelBench's own rule: every output has the reference's shape and
    ``torch.allclose(reference, cand, atol, rtol)`` (NaN never equal), the reference run
    in its own precision. Looser than ``compare_outputs``: the evaluation reports both.
    The arithmetic runs on ``device``, block by block (on the host, a 6.4 GB output took
    10.5 s of a 103 s verdict on an H100 host)."""
    if len(cand) != len(reference):
        return False
    for c, r in zip(cand, reference, strict=True):
        try:  # a candidate may return anything (None, a string): that is a wrong output
            c = torch.as_tensor(c)
        except (TypeError, ValueError, RuntimeError):
            return False
        r = torch.as_tensor(r)
        if tuple(c.shape) != tuple(r.shape):
            return False
        for cb, rb in _blocks(torch.device(device), c, r):
            if not torch.allclose(cb, rb, atol=atol, rtol=rtol):
                return False
    return True


def compare_outputs(
    cand: list[Any], expected: list[torch.Tensor], honest: list[torch.Tensor],
    tols: list[Tolerance], device: str | torch.device | None = None,
) -> Comparison:
    """Compares every output tensor; the first failure decides, else the worst error."""
    if len(cand) != len(expected):
        return Comparison(False, "output_count", f"{len(cand)} outputs, expected {len(expected)}")
    worst = Comparison(True)
    for i, (c, e, h, t) in enumerate(zip(cand, expected, honest, tols, strict=True)):
        r = compare_tensor(c, e, h, t, device)
        if not r.ok:
            msg = f"output {i}: {r.message}" if len(cand) > 1 else r.message
            return Comparison(False, r.check, msg, r.rel_norm_error, r.max_abs_error,
                              r.bad_fraction)
        if r.rel_norm_error >= worst.rel_norm_error:
            worst = r
    return worst
