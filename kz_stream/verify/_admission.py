"""Problem admission: rejects reference modules that a trivial output would pass.

A module is degenerate when, under the verifier's own correctness check, any of these
passes on every input set: all zeros, a constant, one of its inputs (the identity), its
output for another input set (input-independent), or its output under other weights
(weight-independent). Modules that do not run, give non-finite outputs on their own
inputs, or are not deterministic are rejected as well. The module runs in a sandbox.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kz_stream._cpus import usable_cpus
from kz_stream.verify._phases import PhaseTimer
from kz_stream.verify._sandbox import run_in_sandbox

__all__ = ["Admission", "admission_check", "admission_device_bytes"]

# What the check imports, paid ahead by a spare sandboxed child (``run_in_sandbox``'s
# ``preload``): a stream of checks (a Proposer validating each proposal, an audit) then
# finds torch imported, which a fresh child spends seconds on.
IMPORTS = ("torch", "kz_stream.verify._admission", "kz_stream.verify._compare",
           "kz_stream.verify._inputs", "kz_stream.verify._preflight",
           "kz_stream.verify._reference")

_WEIGHT_SEED = 1234
_INPUT_SEED = 98765
# Inputs past the first size are checked at scaled-down shapes; where no scaling keeps a
# module valid (one size is both the batch and a channel count that groups must divide),
# inputs up to the second are checked unscaled, only slower. On the CPU the bound is time.
# On a GPU it is memory: admission holds every set's inputs, outputs and float64 outputs
# at once (by arithmetic, 4 sets of inputs, outputs and float64 outputs: about 16 times the
# inputs where outputs are as large), so KernelBench's 6.4 GB inputs (over 100 GB) would
# not fit beside the verifier's other processes, and an H100 has 80 GB. Outputs count as
# inputs three times their size would (a float32 output is kept as returned and in
# float64): a 1 GB convolution input has 8.5 GB of output (KernelBench level 1, 63), and
# on an H100 its admission at full size did not fit (2026-12-06).
_MAX_INPUT_BYTES = {"cpu": 4 << 20, "cuda": 1 << 30}
_UNSCALED_MAX_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}


def _held_per_set(input_bytes: int, output_bytes: int | None) -> int:
    """What a set holds, in input bytes: its inputs, and its outputs (honest and float64,
    as ``module_footprint`` counts them) a third, as a float32 output of an input's size
    counts once; an output the meta device cannot give counts as that."""
    return input_bytes + (input_bytes if output_bytes is None else output_bytes // 3)


# The check's sets on the device: own, normal, heavy and signed, each with its inputs and
# outputs (honest and float64), and one more for the repeated run and the trivial outputs.
_SETS_HELD = 5


def admission_device_bytes(input_bytes: int | None, output_bytes: int | None,
                           weight_bytes: int, small_share: float) -> int:
    """Device bytes a check on a GPU holds at its peak, estimated from the module's sizes
    (``module_footprint``; None where they cannot be found): its sets at the size it checks
    them (at ``small_share`` of the bytes past ``_UNSCALED_MAX_BYTES``, which a check might
    reach before a scaled-down shape runs), its model and the float64 copy. Not the
    process's CUDA context (``CUDA_CONTEXT_BYTES``: the caller's)."""
    if input_bytes is None:  # at most the unscaled bound, three times over for the outputs
        return _SETS_HELD * 3 * _UNSCALED_MAX_BYTES["cuda"] + 3 * weight_bytes
    per_set = input_bytes + (3 * input_bytes if output_bytes is None else output_bytes)
    if _held_per_set(input_bytes, output_bytes) > _UNSCALED_MAX_BYTES["cuda"]:
        per_set = int(small_share * per_set)
    return _SETS_HELD * per_set + 3 * weight_bytes


@dataclass(frozen=True)
class Admission:
    """Whether a reference module may become a problem, and why not."""

    admitted: bool
    reason: str | None = None
    detail: str = ""
    # Seconds per phase of the sandboxed check (load, build, inputs, honest, float64, ...);
    # empty when the sandbox gave no answer (timeout, crash).
    phase_s: dict[str, float] = field(default_factory=dict)
    # "not_checkable_here" because the device's or the sandbox's memory ran out: beside
    # other processes on a GPU, a check that may fit with the device to itself.
    out_of_memory: bool = False


def admission_check(
    reference_source: str, *, device: str = "cpu", timeout_s: float = 60,
    env: dict[str, str] | None = None,
) -> Admission:
    """Runs the degeneracy checks on ``reference_source`` in a sandboxed process.

    ``reason`` is one of: "interface", "exception", "timeout", "oom", "crash", "forbidden",
    "nonfinite", "nondeterministic", "zeros", "constant", "identity",
    "input_independent", "weight_independent"; or "not_checkable_here" when this machine
    cannot run the module at any size that keeps it valid (the module may be sound: admit
    it on a GPU at full size). ``env`` is more of the sandbox's environment (a GPU's
    ``CUDA_VISIBLE_DEVICES``).
    """
    memory_mb = 16384 if device == "cpu" else None  # an address-space cap breaks CUDA
    outcome = run_in_sandbox(
        "kz_stream.verify._admission:_admit",
        (reference_source, device),
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        env=env,
        gpu=device != "cpu",
        preload=IMPORTS,
    )
    if outcome.ok:
        admitted, reason, detail, phase_s = outcome.value
        return Admission(bool(admitted), reason, str(detail), dict(phase_s))
    if outcome.error_kind == "oom":
        room = f"the CPU sandbox's {memory_mb} MB" if device == "cpu" else "the device"
        return Admission(False, "not_checkable_here", f"the check does not fit in {room}: "
                         f"{outcome.error_message[-500:]}", out_of_memory=True)
    return Admission(False, outcome.error_kind, outcome.error_message[-1000:])


def _admit(source: str, device: str) -> tuple[bool, str | None, str, dict[str, float]]:
    """Sandbox side of ``admission_check``: returns (admitted, reason, detail, phase_s)."""
    phase = PhaseTimer(device)
    admitted, reason, detail = _checks(source, device, phase)
    return admitted, reason, detail, phase.rounded()


def _checks(source: str, device: str, phase: PhaseTimer) -> tuple[bool, str | None, str]:
    import torch

    from kz_stream.verify._compare import all_finite, calibrate, compare_outputs, unstable_limit
    from kz_stream.verify._inputs import (
        InputPlan,
        InputSpec,
        fallbacks,
        has_nonneg_floats,
        make_inputs,
        map_init,
        nbytes,
        own_inputs,
        small_map,
    )
    from kz_stream.verify._loader import InterfaceError
    from kz_stream.verify._preflight import module_footprint
    from kz_stream.verify._reference import (
        build_model,
        float64_copy,
        forget_built_models,
        load_reference,
        perturb_,
        run,
        strict_precision,
    )

    strict_precision()
    torch.set_num_threads(max(1, min(4, usable_cpus())))
    try:
        with phase("load"):  # the module, its own inputs
            ref = load_reference(source, os.getcwd())
            init = list(ref.get_init_inputs())
            # On a GPU drawn there (``own_inputs``): a KernelBench generator's 8 GiB of
            # ``torch.rand`` took 16-19 s on the H100 host's CPU (in the oracle).
            own = own_inputs(ref.get_inputs, _INPUT_SEED, device)
    except InterfaceError as e:
        return False, "interface", str(e)

    # Large modules are checked at scaled-down shapes (``_MAX_INPUT_BYTES``): the first
    # scaling that the module still runs under (sizes and the matching init integers;
    # then the sizes alone; then the leading dims alone; then none, if small enough).
    # Scaling can break a sound module (group counts, kernel sizes, class indices), which
    # is not its fault.
    specs = [InputSpec.of(v) for v in own]
    plan = InputPlan("own", "own")
    kind = "cpu" if device == "cpu" else "cuda"
    try:
        output_bytes = module_footprint(ref)[1]
    except Exception:  # a generator the meta device cannot run: the outputs are unknown
        output_bytes = None
    held = _held_per_set(nbytes(own), output_bytes)
    if held > _MAX_INPUT_BYTES[kind]:
        base = InputPlan("own", "own", small_map(own))
        tried: list[str] = []
        unscaled = [plan] if held <= _UNSCALED_MAX_BYTES[kind] else []
        for attempt in [base, *fallbacks(base, own), *unscaled]:
            try:
                with phase("scaling"):  # which scaled-down shape the module runs under
                    init_a = map_init(init, attempt.size_map) if attempt.scale_init else init
                    probe = build_model(ref, init_a, _WEIGHT_SEED, device)
                    run(probe, make_inputs(specs, attempt, _INPUT_SEED, ref.get_inputs,
                                           device=device), device)
                    del probe  # the model below is its copy: not three at once under the cap
                plan = attempt
                break
            except Exception as e:
                tried.append(f"{type(e).__name__}: {str(e)[:150]}")
        else:
            return False, "not_checkable_here", ("no scaled-down shape keeps the module "
                                                 "valid: " + "; ".join(tried))
    size_map = plan.size_map
    scaled_init = map_init(init, size_map) if plan.scale_init else list(init)
    lead = plan.lead_only
    plans = [InputPlan("own", "own", size_map, lead_only=lead),
             InputPlan("normal", "normal", size_map, lead_only=lead),
             InputPlan("heavy", "heavy", size_map, lead_only=lead)]
    if has_nonneg_floats(own):  # a copy of a torch.rand input is no identity test
        plans.append(InputPlan("signed", "normal", size_map, signed=True, lead_only=lead))
    n_inputs = len(own)
    del own  # the sets below need its room (on a GPU, where it was drawn)

    with phase("build"):
        model = build_model(ref, scaled_init, _WEIGHT_SEED, device)
        if device == "cpu":
            # Under the sandbox's address-space cap a kept copy of the weights is one more
            # model's worth: build the perturbed one below afresh instead.
            forget_built_models()
        try:
            model64 = float64_copy(model)
        except Exception as e:
            return False, "not_checkable_here", f"no float64 copy of the module: {e}"
    with phase("inputs"):
        sets = [make_inputs(specs, p, _INPUT_SEED + i, ref.get_inputs, device=device)
                for i, p in enumerate(plans)]
    expected, honest = [], []
    for i, inputs in enumerate(sets):
        with phase("honest"):
            honest.append(run(model, inputs, device))
        try:
            with phase("float64"):
                expected.append(run(model64, inputs, device, torch.float64))
        except torch.OutOfMemoryError:
            # Room, not the module: "does not fit" (``admission_check``), never "does not
            # run in float64" (KernelBench 3/31 on an H100 with three other problems'
            # checks on the device, 2026-12-06).
            raise
        except Exception as e:
            if i == 0:  # e.g. an LSTM whose hidden state is made in float32 in forward
                return False, "not_checkable_here", (
                    f"the module does not run in float64, so no reference precision: "
                    f"{type(e).__name__}: {str(e)[:200]}")
            raise
    if plans[-1].signed and not all_finite(expected[-1]):
        # Not defined on negative inputs (a log, a sqrt): the signed set says nothing.
        sets, expected, honest, plans = sets[:-1], expected[:-1], honest[:-1], plans[:-1]
    for i, outs in enumerate(honest):
        for o in outs:
            if not isinstance(o, torch.Tensor):
                return False, "interface", f"output of type {type(o).__name__} is not a tensor"
        if i == 0 and not all_finite(outs):
            return False, "nonfinite", "non-finite outputs on the module's own inputs"
    with phase("again"):
        again = run(model, sets[0], device)
        drift = max(_rel_diff(a, b) for a, b in zip(again, honest[0], strict=True))
    if drift > unstable_limit(honest[0]):
        return False, "nondeterministic", f"two runs on the same input differ by {drift:.3g}"
    with phase("calibrate"):
        tols = [[calibrate(e, h) for e, h in zip(es, hs, strict=True)]
                for es, hs in zip(expected, honest, strict=True)]
    worst = max(t.honest_rel_norm for ts in tols for t in ts)
    if worst > unstable_limit(honest[0]):
        return False, "unstable", (f"the module in its own precision differs from float64 by "
                                   f"{worst:.3g}; correctness cannot be calibrated")

    def passes_all(make: Any) -> bool:
        with phase("degenerate"):  # each trivial output against the check
            for i in range(len(sets)):
                fake = make(i)
                if fake is None or not compare_outputs(fake, expected[i], honest[i],
                                                       tols[i]).ok:
                    return False
            return True

    if passes_all(lambda i: [torch.zeros_like(h) for h in honest[i]]):
        return False, "zeros", "an all-zero output passes the correctness check"
    # One value per tensor output; for a scalar output (a loss) that value is the answer
    # itself, so there the constant is set 0's, the same for every input set.
    scalar = all(h.numel() <= 1 for h in honest[0])
    if passes_all(lambda i: [_constant_like(h, e)
                             for h, e in zip(honest[i], expected[0 if scalar else i],
                                             strict=True)]):
        return False, "constant", "a constant output passes the correctness check"

    def identity(i: int, k: int) -> list[Any] | None:
        outs = honest[i]
        x = sets[i][k]
        if len(outs) != 1 or not isinstance(x, torch.Tensor) or x.shape != outs[0].shape:
            return None
        return [x.to(device=outs[0].device, dtype=outs[0].dtype)]

    for k in range(n_inputs):
        if passes_all(lambda i, k=k: identity(i, k)):
            return False, "identity", f"returning input {k} unchanged passes the check"
    if _same_shapes(honest) and passes_all(lambda i: honest[(i + 1) % len(sets)]):
        return False, "input_independent", "the output for other inputs passes the check"
    if any(p.dtype.is_floating_point for p in model.parameters()):
        with phase("other_weights"):
            other = build_model(ref, scaled_init, _WEIGHT_SEED, device)
            perturb_(other, _WEIGHT_SEED + 31337)
            other_outs = [run(other, s, device) for s in sets]
        if passes_all(lambda i: other_outs[i]):
            return False, "weight_independent", "the output under other weights passes the check"
    scaled = " at scaled-down shapes" if size_map else ""
    return True, None, f"admitted; checked {len(sets)} input sets on {device}{scaled}"


def _rel_diff(a: Any, b: Any) -> float:
    import torch

    if not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point:
        return 0.0 if torch.equal(torch.as_tensor(a), torch.as_tensor(b)) else float("inf")
    x, y = a.double(), b.double()
    finite = torch.isfinite(x) & torch.isfinite(y)
    if not bool((torch.isfinite(x) == torch.isfinite(y)).all()):
        return float("inf")
    den = float(torch.linalg.vector_norm(y[finite]))
    num = float(torch.linalg.vector_norm((x - y)[finite]))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def _constant_like(honest: Any, expected: Any) -> Any:
    """One value everywhere: the mean for floats, the most common value for integers and
    booleans (an argmax's constant is an index, not the answer itself)."""
    import torch

    if honest.is_floating_point():
        return torch.full_like(honest, float(expected.double().mean()))
    if honest.is_complex():
        return torch.full_like(honest, complex(expected.to(torch.complex128).mean()))
    flat = expected.detach().flatten().to("cpu", torch.int64)
    value = int(flat.mode().values) if flat.numel() else 0
    return torch.full_like(honest, value)


def _same_shapes(outs: Sequence[Sequence[Any]]) -> bool:
    shapes = [tuple(tuple(o.shape) for o in group) for group in outs]
    return all(s == shapes[0] for s in shapes)
