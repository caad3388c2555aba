"""Input sets for checking a candidate: the module's own inputs plus sign-mixed and
heavy-tailed ones, and odd/unaligned and small shapes derived by scaling the module's own
tensor sizes (and the matching init-input integers, so weight shapes stay consistent).

Every set is drawn from a seed the candidate never sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

Distribution = Literal["own", "normal", "heavy"]
SizeMap = dict[int, int]

# Dims below this are left alone when shapes are scaled: they are often kernel sizes,
# channel counts of 3, head counts and the like, where a change alters the function.
_MIN_SCALED = 8


@dataclass(frozen=True)
class InputPlan:
    """One input set: how to draw its values and which sizes to substitute. ``signed``
    draws floats of both signs even for inputs the module draws non-negative."""

    label: str
    dist: Distribution
    size_map: SizeMap = field(default_factory=dict)
    scale_init: bool = True
    signed: bool = False
    # The sizes map the leading dim of each tensor input only, not every dim of that size:
    # a batch of 32 scaled must not scale 32 input channels that the weights fix.
    lead_only: bool = False

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``shape`` with this plan's sizes substituted."""
        if self.lead_only:
            return tuple(self.size_map.get(d, d) if i == 0 else d for i, d in enumerate(shape))
        return tuple(self.size_map.get(d, d) for d in shape)


def _sizes(values: Sequence[Any]) -> set[int]:
    sizes: set[int] = set()
    for v in values:
        if isinstance(v, torch.Tensor):
            sizes.update(int(d) for d in v.shape if int(d) >= _MIN_SCALED)
    return sizes


def odd_map(inputs: Sequence[Any]) -> SizeMap:
    """Even sizes become the odd size below (1024 → 1023): breaks alignment assumptions."""
    return {d: d - 1 for d in _sizes(inputs) if d % 2 == 0}


def small_map(inputs: Sequence[Any]) -> SizeMap:
    """Sizes shrink about 8-fold to an odd number (4096 → 513, 16 → 3)."""
    return {d: _eighth(d) for d in _sizes(inputs)}


def _eighth(d: int) -> int:
    return max(1, d // 8) | 1


def small_set_share(inputs: Sequence[Any]) -> float:
    """The largest share of ``inputs``' bytes that a set at an eighth of the shapes can
    keep. Its last fallback scales each input's leading dim alone (``fallbacks``), which
    keeps 15 of a batch of 112 (KernelBench's group norm: 13.4%, not 12.5%) and one row of
    a batch below 8; scaling more dims keeps less."""
    total = kept = 0.0
    for v in inputs:
        if isinstance(v, torch.Tensor):
            size = v.numel() * v.element_size()
            lead = int(v.shape[0]) if v.dim() and v.shape[0] else 0
            total += size
            kept += size * (min(1.0, _eighth(lead) / lead) if lead else 1.0)
    return kept / total if total else 1 / 8


def batch_only(size_map: SizeMap, inputs: Sequence[Any]) -> SizeMap:
    """The restriction of ``size_map`` to the leading dims of the tensor inputs."""
    lead = {int(v.shape[0]) for v in inputs if isinstance(v, torch.Tensor) and v.dim() > 0}
    return {k: v for k, v in size_map.items() if k in lead}


def map_init(init_inputs: Sequence[Any], size_map: SizeMap) -> list[Any]:
    """Init-input integers that equal a scaled size are scaled with it (in_features etc.)."""
    out: list[Any] = []
    for v in init_inputs:
        if isinstance(v, bool):
            out.append(v)
        elif isinstance(v, int) and v in size_map:
            out.append(size_map[v])
        elif isinstance(v, tuple | list) and all(isinstance(x, int) for x in v):
            out.append(type(v)(size_map.get(x, x) for x in v))
        else:
            out.append(v)
    return out


@dataclass(frozen=True)
class InputSpec:
    """What an input looks like, enough to draw fresh ones: shape, dtype and value range.
    Non-tensor inputs are carried as ``value``."""

    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: str = ""
    mean: float = 0.0
    std: float = 0.0
    nonneg: bool = False
    lo: int = 0
    hi: int = 1
    value: Any = None

    @staticmethod
    def of(v: Any) -> InputSpec:
        if not isinstance(v, torch.Tensor):
            return InputSpec(False, value=v)
        dtype = str(v.dtype).removeprefix("torch.")
        if v.numel() == 0:
            return InputSpec(True, tuple(v.shape), dtype)
        if v.dtype.is_floating_point and v.device.type != "cpu":
            return InputSpec(True, tuple(v.shape), dtype, *_moments(v))
        if v.dtype.is_floating_point:
            ref = v.detach().to("cpu", torch.float64)
            std = float(ref.std()) if ref.numel() > 1 else 0.0
            return InputSpec(True, tuple(v.shape), dtype, float(ref.mean()), std,
                             bool((ref >= 0).all()))
        if v.dtype == torch.bool or v.dtype.is_complex:
            return InputSpec(True, tuple(v.shape), dtype)
        return InputSpec(True, tuple(v.shape), dtype, lo=int(v.min()), hi=int(v.max()))

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype)
        assert isinstance(dt, torch.dtype)
        return dt


# Elements of a device tensor taken into float64 at once by ``_moments``.
_MOMENT_BLOCK = 1 << 26


def _moments(v: torch.Tensor) -> tuple[float, float, bool]:
    """Mean, standard deviation (Bessel-corrected) and whether no value is negative (a
    NaN counts as negative), in float64 on ``v``'s device, a block at a time: the float64
    copy on the host took about 15 s of an 8 GiB input's preparation on the H100 host
    (2026-12-05)."""
    flat = v.detach().reshape(-1)
    n = flat.numel()
    blocks = range(0, n, _MOMENT_BLOCK)
    total = torch.zeros((), dtype=torch.float64, device=v.device)
    nonneg = torch.ones((), dtype=torch.bool, device=v.device)
    for i in blocks:
        b = flat[i:i + _MOMENT_BLOCK]
        total += b.sum(dtype=torch.float64)
        nonneg &= (b >= 0).all()
    mean = total / n
    if n < 2:
        return float(mean), 0.0, bool(nonneg)
    squares = torch.zeros((), dtype=torch.float64, device=v.device)
    for i in blocks:  # two passes, as torch.std: no cancellation of a large mean
        squares += (flat[i:i + _MOMENT_BLOCK].to(torch.float64) - mean).square().sum()
    return float(mean), float((squares / (n - 1)).sqrt()), bool(nonneg)


def draw_tensor(
    spec: InputSpec, shape: tuple[int, ...], dist: Distribution, gen: torch.Generator,
    device: str | torch.device = "cpu", *, signed: bool = False,
) -> torch.Tensor:
    """A fresh tensor of ``shape`` that resembles ``spec`` (dtype, sign, range);
    ``signed`` draws floats of both signs even where ``spec`` is non-negative."""
    dtype = spec.torch_dtype
    if dtype.is_floating_point:
        scale = _scale(spec)
        work = torch.float64 if device == "cpu" else torch.float32
        # In place: a timing set of a 6 GiB KernelBench input is drawn on the device beside
        # the sets already drawn, and each out-of-place step held another 6 GiB.
        x = torch.randn(shape, generator=gen, dtype=work, device=device)
        if dist == "heavy":
            # A Gaussian scale mixture (log-normal scale): heavy tails, every moment finite,
            # clamped so that a float16 input stays finite.
            w = torch.randn(shape, generator=gen, dtype=work, device=device)
            x.mul_(w.mul_(0.75).exp_()).clamp_(-1e3, 1e3)
            del w
        x.mul_(scale)
        if spec.nonneg and not signed:
            positive_(x, dtype)
        return x.to(dtype).contiguous()
    if dtype == torch.bool:
        return (torch.rand(shape, generator=gen, device=device) < 0.5).contiguous()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype, device=device).contiguous()
    return torch.randint(spec.lo, spec.hi + 1, shape, generator=gen, dtype=torch.int64,
                         device=device).to(dtype).contiguous()


def positive_(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` made positive in place: its absolute values, zeros raised to the smallest
    normal number of ``dtype`` (default ``x``'s). A non-negative input is drawn positive:
    CUDA's ``randn`` gives an exact 0 about once in 2**24 draws (its uniform's top value
    rounds to 1.0), and KernelBench's KL divergence takes the log of its input (a softmax,
    never 0): on the H100 its admission found the loss infinite on the drawn set."""
    return x.abs_().clamp_min_(torch.finfo(dtype or x.dtype).tiny)


def _scale(spec: InputSpec) -> float:
    scale = max(spec.std, abs(spec.mean), 1e-3)
    return scale if math.isfinite(scale) else 1.0


def redraw_(values: Sequence[Any], specs: Sequence[InputSpec], seed: int) -> None:
    """Overwrites the tensors of ``values`` in place with fresh values drawn from ``seed``
    (floats normal at ``spec``'s scale and sign, integers and bools in ``spec``'s range).

    Timing calls it before every timed call, so no call sees values an earlier call saw:
    an output memoised on the inputs' identity, address, version or shape is stale, and
    the timed-output check finds it; one keyed on the values never hits."""
    gen: torch.Generator | None = None
    for v, spec in zip(values, specs, strict=True):
        if not isinstance(v, torch.Tensor) or not spec.is_tensor or v.numel() == 0:
            continue
        if gen is None:
            gen = torch.Generator(device=v.device).manual_seed(seed)
        if v.dtype.is_floating_point:
            v.normal_(0.0, _scale(spec), generator=gen)
            if spec.nonneg:
                positive_(v)
        elif v.dtype == torch.bool or v.dtype.is_complex:
            v.copy_(draw_tensor(spec, tuple(v.shape), "normal", gen, v.device))
        else:
            v.random_(spec.lo, spec.hi + 1, generator=gen)


def own_inputs(get_inputs: Callable[[], Sequence[Any]], seed: int,
               device: str | torch.device = "cpu") -> list[Any]:
    """The module's own ``get_inputs()`` under ``seed``, its tensors on ``device``.

    Off the CPU it runs with ``device`` as torch's default device, so the module's
    ``torch.rand`` draws there: KernelBench's generators draw on the host, 16-19 s for an
    8 GiB input on the H100 host (2026-12-05), twice per problem. A generator that fails
    so is run again on the host, under the same seed.
    """
    values: list[Any] | None = None
    if torch.device(device).type != "cpu":
        torch.manual_seed(seed)
        try:
            with torch.device(device):
                values = list(get_inputs())
        except Exception:
            values = None
    if values is None:
        torch.manual_seed(seed)
        values = list(get_inputs())
    return [v.contiguous().to(device) if isinstance(v, torch.Tensor) else v for v in values]


def make_inputs(
    specs: Sequence[InputSpec], plan: InputPlan, seed: int,
    get_inputs: Callable[[], Sequence[Any]] | None = None,
    device: str | torch.device = "cpu",
) -> list[Any]:
    """The input set ``plan`` describes, drawn from ``seed``.

    For the "own" distribution at the module's own shapes ``get_inputs`` (the module's own
    generator) is called under ``seed`` (``own_inputs``); otherwise values are drawn from
    ``specs``.
    """
    if plan.dist == "own" and not plan.size_map and get_inputs is not None:
        return own_inputs(get_inputs, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[Any] = []
    for spec in specs:
        if spec.is_tensor:
            shape = plan.shape(spec.shape)
            dist: Distribution = "normal" if plan.dist == "own" else plan.dist
            if (not spec.torch_dtype.is_floating_point and not plan.lead_only
                    and spec.hi + 1 in plan.size_map):
                # Integers up to a scaled size are indices into it (class labels of a
                # cross-entropy over 4096 classes): they shrink with it, or go out of range.
                spec = replace(spec, hi=plan.size_map[spec.hi + 1] - 1)
            out.append(draw_tensor(spec, shape, dist, gen, device, signed=plan.signed))
        else:
            out.append(spec.value)
    return out


def at_own_shapes(label: str) -> bool:
    """Whether the input set labelled ``label`` is at (about) the module's own shapes: the
    small sets and those the memory plan scaled down ("@small") are not; "odd" is."""
    return not label.startswith("small") and not label.endswith("@small")


def has_nonneg_floats(values: Sequence[Any]) -> bool:
    """Whether some floating input holds no negative number (``torch.rand``'s domain)."""
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.numel() > 0
               and bool((v >= 0).all()) for v in values)


def default_plans(own: Sequence[Any], *, small_only: bool = False) -> list[InputPlan]:
    """The input sets to check: own, sign-mixed, heavy-tailed, odd and small shapes, and
    where the module draws a floating input non-negative, a set of both signs ("signed"):
    on ``torch.rand`` inputs alone a copy passes for a ReLU.

    ``small_only`` (the CPU interpreter path) keeps only scaled-down shapes.
    """
    odd, small = odd_map(own), small_map(own)
    signed = has_nonneg_floats(own)
    if small_only:
        plans = [InputPlan("small-normal", "normal", small),
                 InputPlan("small-heavy", "heavy", small)]
        if signed:
            plans.append(InputPlan("small-signed", "normal", small, signed=True))
        if odd:
            tiny_odd = {k: max(1, v - 2) | 1 for k, v in small.items()}
            plans.append(InputPlan("small-odd", "normal", tiny_odd))
        return plans
    plans = [InputPlan("own", "own")]
    if signed:
        plans.append(InputPlan("signed", "normal", signed=True))
    plans += [InputPlan("normal", "normal"), InputPlan("heavy", "heavy")]
    if odd:
        plans.append(InputPlan("odd", "normal", odd))
    if small:
        plans.append(InputPlan("small", "heavy", small))
    return plans


def fallbacks(plan: InputPlan, own: Sequence[Any]) -> list[InputPlan]:
    """Safer versions of a shape-changing plan, tried when the reference rejects it."""
    if not plan.size_map:
        return []
    out = [InputPlan(plan.label, plan.dist, plan.size_map, scale_init=False,
                     signed=plan.signed)]
    lead = batch_only(plan.size_map, own)
    if lead:
        out.append(InputPlan(plan.label, plan.dist, lead, scale_init=False, signed=plan.signed,
                             lead_only=True))
    return out


def to_device(values: Sequence[Any], device: str | torch.device,
              dtype: torch.dtype | None = None) -> list[Any]:
    """Moves tensors to ``device``; floating tensors are cast to ``dtype`` when given."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if dtype is not None and v.dtype.is_floating_point:
                v = v.to(device=device, dtype=dtype)
            else:
                v = v.to(device)
        out.append(v)
    return out


# A worker's checks clone an input tensor up to this on the device and take block sums
# of a bigger one; an output's snapshot is a clone past it only where the room left holds
# three times its size. A device clone doubled a KernelBench 8 GiB input's footprint,
# and on an H100 (2026-12-05) honest workers ran out of their allowance.
CLONE_MAX_BYTES = 1 << 30


def cloned_bytes(values: Sequence[Any]) -> int:
    """Device bytes a worker's checks clone of input set ``values``: its tensors up to
    ``CLONE_MAX_BYTES`` (``nbytes`` of those)."""
    return nbytes([v for v in values if isinstance(v, torch.Tensor)
                   and v.untyped_storage().nbytes() <= CLONE_MAX_BYTES])


def nbytes(values: Sequence[Any]) -> int:
    """Bytes held by the tensors in ``values`` (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            key = v.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
    return total


def moved_bytes(values: Sequence[Any]) -> int:
    """Bytes a kernel must read or write for the tensors in ``values``: their elements,
    each storage at most once. Not ``nbytes``: a reduction's 0-dim result may be a view of
    its elementwise buffer (``F.smooth_l1_loss``'s mean is the first element of a
    ``numel``-sized storage), which holds that buffer but moves one element."""
    per_storage: dict[int, list[int]] = {}
    for v in values:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            held = per_storage.setdefault(st.data_ptr(), [st.nbytes(), 0])
            held[1] += v.numel() * v.element_size()
    return sum(min(held, elements) for held, elements in per_storage.values())
