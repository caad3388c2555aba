"""Validation of a proposed module: is it a usable problem for the requested API set?

The checks run cheapest first and stop at the first failure; ``reason`` is a short code:

1. ``syntax_error``: the source does not parse.
2. ``missing_interface``: no ``class Model`` with ``forward``, ``get_inputs`` or
   ``get_init_inputs`` (AST; confirmed when the module is imported).
3. ``wrong_apis``: the APIs the source calls (AST with alias resolution) lack a requested
   one, or add others. Layout ops (view, transpose, cat, ...) and elementwise arithmetic
   are always allowed; ``max_extra_apis`` other APIs may be tolerated.
4. In a sandboxed process (``kz_stream.verify.run_in_sandbox``): the module is
   imported, built from ``get_init_inputs()`` and run on ``get_inputs()`` while a
   ``TorchFunctionMode`` records the torch functions that forward *actually* calls (and a
   global module hook the ``torch.nn`` layers; calls inside those layers are theirs). A
   requested API never called at run time, or an unrequested one that was, is
   ``wrong_apis``; an exception or a dead process is ``crash``; running out of time is
   ``timeout``; touching the network, writing outside the sandbox's directory or starting
   a process is ``forbidden``; NaN or inf in the outputs is ``non_finite``.
5. The verifier's admission check (``kz_stream.verify.admission_check``): an
   output that zeros, a constant, an input, another input's output or other weights'
   output would match is ``degenerate`` (the detail names which); outputs that change
   between identical runs are ``nondeterministic``, and outputs too ill-conditioned to
   calibrate a tolerance on are ``unstable``.

``validate_with_fingerprint`` also returns the module's ``ModuleFingerprint`` (the APIs of
step 3, the inputs of step 4) for decontamination; ``fingerprint_modules`` takes the same
value from modules that are not proposed (evaluation problems) without building them.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Sequence
from typing import Any, TypedDict, Unpack

from kz_stream.events import ModuleValidation
from kz_stream.modules._apis import canonical_api, find_api_calls, is_neutral
from kz_stream.modules._fingerprint import InputSpec, ModuleFingerprint, input_specs

__all__ = ["fingerprint_modules", "static_apis", "validate_module", "validate_with_fingerprint"]

_INTERFACE_FUNCS = ("get_inputs", "get_init_inputs")
_DEGENERATE = frozenset(
    {"zeros", "constant", "identity", "input_independent", "weight_independent"}
)
_ADMISSION_REASONS = {
    "interface": "missing_interface",
    "exception": "crash",
    "crash": "crash",
    "oom": "crash",
    "timeout": "timeout",
    "forbidden": "forbidden",
    "nonfinite": "non_finite",
    "nondeterministic": "nondeterministic",
    "unstable": "unstable",
}
_SANDBOX_REASONS = {
    "timeout": "timeout",
    "forbidden": "forbidden",
    "exception": "crash",
    "crash": "crash",
    "oom": "crash",
}
_SANDBOX_MEMORY_MB = 16384  # an address-space cap: torch alone maps a few GB


def _interface_problem(tree: ast.Module) -> str | None:
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = []
    model = classes.get("Model")
    if model is None:
        missing.append("class Model")
    elif not any(isinstance(b, ast.FunctionDef) and b.name == "forward" for b in model.body):
        missing.append("Model.forward")
    missing += [f"{f}()" for f in _INTERFACE_FUNCS if f not in funcs]
    return f"missing {', '.join(missing)}" if missing else None


def static_apis(source: str) -> list[str]:
    """Canonical APIs the module's code calls outside ``get_inputs``/``get_init_inputs``."""
    tree = ast.parse(source)
    nodes = [
        n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name in _INTERFACE_FUNCS)
    ]
    use = find_api_calls(tree, nodes=nodes)
    return use.apis + use.neutral


def _compare(requested: set[str], called: Sequence[str], max_extra: int, when: str) -> str | None:
    """Returns why ``called`` does not match ``requested``, or None when it does."""
    present = set(called)
    missing = sorted(requested - present)
    extra = sorted(a for a in present - requested if not is_neutral(a))
    parts = []
    if missing:
        parts.append(f"requested but not {when}: {', '.join(missing)}")
    if len(extra) > max_extra:
        parts.append(f"{when} but not requested: {', '.join(extra)}")
    return "; ".join(parts) or None


def _canonical_request(api_set: Sequence[str]) -> set[str]:
    out = set()
    for api in api_set:
        # Requests come from the catalog (already canonical); accept aliases too.
        out.add(canonical_api(api) or api)
    return out


class _Options(TypedDict, total=False):
    timeout_s: float
    max_extra_apis: int
    check_degenerate: bool


def validate_module(
    source: str, api_set: Sequence[str], **options: Unpack[_Options]
) -> ModuleValidation:
    """Validates a proposed KernelBench module against the API set it was asked to use
    (options: ``validate_with_fingerprint``'s)."""
    return validate_with_fingerprint(source, api_set, **options)[0]


def validate_with_fingerprint(
    source: str,
    api_set: Sequence[str],
    *,
    timeout_s: float = 60.0,
    max_extra_apis: int = 0,
    check_degenerate: bool = True,
) -> tuple[ModuleValidation, ModuleFingerprint | None]:
    """``validate_module``'s verdict, and the module's fingerprint from the same sandboxed
    run (None when the run did not get as far as ``get_inputs()``): its APIs as the source
    calls them (as the catalog and ``fingerprint_modules`` see them) and the inputs the
    probe ran on. ``timeout_s`` bounds each sandboxed run (the probe, then the admission
    check); ``max_extra_apis`` other APIs may be tolerated.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        return _invalid("syntax_error", str(e)[:500]), None
    problem = _interface_problem(tree)
    if problem:
        return _invalid("missing_interface", problem), None
    requested = _canonical_request(api_set)
    called = static_apis(source)
    mismatch = _compare(requested, called, max_extra_apis, "called in the source")
    if mismatch:
        return _invalid("wrong_apis", mismatch, called), None

    from kz_stream.verify import run_in_sandbox

    outcome = run_in_sandbox(
        "kz_stream.modules._validation:_probe",
        (source,),
        timeout_s=timeout_s,
        memory_mb=_SANDBOX_MEMORY_MB,
        preload=("torch", "kz_stream.modules._validation"),
    )
    if not outcome.ok:
        kind = outcome.error_kind or "crash"
        detail = outcome.error_message or outcome.stderr_tail[-500:]
        if kind == "oom":
            detail = f"out of memory: {detail}"
        if kind == "exception" and "InterfaceError" in detail:
            return _invalid("missing_interface", detail[-500:], called), None
        return _invalid(_SANDBOX_REASONS.get(kind, "crash"), detail[-500:], called), None
    probe: dict[str, Any] = outcome.value
    runtime = list(probe["apis"])
    fingerprint = ModuleFingerprint.of(called, probe["inputs"])
    mismatch = _compare(requested, runtime, max_extra_apis, "called when forward ran")
    if mismatch:
        return _invalid("wrong_apis", mismatch, runtime), fingerprint
    if not probe["finite"]:
        detail = "NaN or inf in the outputs on the module's own inputs"
        return _invalid("non_finite", detail, runtime), fingerprint
    if check_degenerate:
        from kz_stream.verify import admission_check

        verdict = admission_check(source, device="cpu", timeout_s=timeout_s)
        if not verdict.admitted:
            reason = verdict.reason or "crash"
            code = "degenerate" if reason in _DEGENERATE else _ADMISSION_REASONS.get(reason, reason)
            detail = f"{reason}: {verdict.detail}" if code == "degenerate" else verdict.detail
            return _invalid(code, detail[-500:], runtime), fingerprint
    return ModuleValidation(valid=True, apis_called=runtime), fingerprint


def _invalid(reason: str, detail: str, apis_called: Sequence[str] = ()) -> ModuleValidation:
    return ModuleValidation(
        valid=False, reason=reason, detail=detail, apis_called=list(apis_called)
    )


def fingerprint_modules(
    sources: Sequence[str], *, timeout_s: float
) -> list[ModuleFingerprint | None]:
    """The fingerprints of modules that were not proposed (evaluation problems), as
    ``validate_with_fingerprint`` would take them: APIs from the source, input specs from
    ``get_inputs()``. One sandboxed process runs every ``get_inputs()``, within
    ``timeout_s`` in all, on torch's meta device where it can (shapes and dtypes without
    allocating a full-size problem's tensors), else for real. None for a module whose
    source or ``get_inputs()`` fails; a failed sandbox raises ``RuntimeError``."""
    from kz_stream.verify import run_in_sandbox

    if not sources:
        return []
    apis: list[list[str] | None] = []
    for source in sources:
        try:
            apis.append(static_apis(source))
        except (SyntaxError, ValueError):
            apis.append(None)
    outcome = run_in_sandbox(
        "kz_stream.modules._validation:_probe_inputs",
        (list(sources),),
        timeout_s=timeout_s,
        memory_mb=_SANDBOX_MEMORY_MB,
    )
    if not outcome.ok:
        detail = outcome.error_message or outcome.stderr_tail[-500:]
        raise RuntimeError(f"fingerprinting {len(sources)} modules: {outcome.error_kind}: {detail}")
    specs: list[list[InputSpec] | None] = outcome.value
    return [
        ModuleFingerprint.of(a, s) if a is not None and s is not None else None
        for a, s in zip(apis, specs, strict=True)
    ]


def _probe_inputs(sources: list[str]) -> list[list[InputSpec] | None]:
    """Sandbox side of ``fingerprint_modules``: each module's ``get_inputs()`` specs."""
    import torch

    from kz_stream.verify import load_source, require

    torch.set_num_threads(1)
    out: list[list[InputSpec] | None] = []
    for i, source in enumerate(sources):
        try:
            module = load_source(source, f"kz_problem_{i}", os.getcwd())
            [get_inputs] = require(module, "get_inputs")
        except Exception:
            out.append(None)
            continue
        try:
            with torch.device("meta"):
                specs = input_specs(list(get_inputs()))
        except Exception:  # e.g. .cpu() or .numpy() on a meta tensor: run it for real
            try:
                specs = input_specs(list(get_inputs()))
            except Exception:
                out.append(None)
                continue
        out.append(specs)
    return out


def _probe(source: str) -> dict[str, Any]:
    """Sandbox side: imports, builds and runs the module once, recording the torch APIs
    its forward calls. Returns {"apis": [...], "finite": bool, "outputs": [shapes],
    "inputs": [InputSpec]}."""
    import torch
    from torch import nn
    from torch.overrides import TorchFunctionMode, resolve_name

    from kz_stream.verify import load_source, require

    torch.set_num_threads(1)  # validation runs beside other work; one core is plenty
    module = load_source(source, "kz_proposed_module", os.getcwd())
    model_cls, get_inputs, get_init_inputs = require(
        module, "Model", "get_inputs", "get_init_inputs"
    )
    torch.manual_seed(0)
    model = model_cls(*get_init_inputs())
    inputs = list(get_inputs())
    specs = input_specs(inputs)  # before forward, which may change its inputs in place

    seen: list[str] = []
    depth = [0]
    entered: list[bool] = []  # per active module call: did it open a layer scope?

    def record(api: str | None) -> None:
        if api is not None and api not in seen:
            seen.append(api)

    def pre_hook(m: nn.Module, args: Any) -> None:
        # A torch.nn layer is one API; the functions it calls inside are its own.
        # Containers (Sequential, ModuleList) and plumbing are transparent.
        api = None
        if type(m).__module__.startswith("torch.nn"):
            api = canonical_api(f"torch.nn.{type(m).__name__}")
        if api is not None and depth[0] == 0:
            record(api)
        entered.append(api is not None)
        depth[0] += api is not None

    def post_hook(m: nn.Module, args: Any, out: Any) -> None:
        if entered and entered.pop():
            depth[0] -= 1

    class Recorder(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if depth[0] == 0:
                name = resolve_name(func) or ""
                last = name.rsplit(".", 1)[-1]
                if last in ("__matmul__", "__rmatmul__"):
                    record("torch.matmul")
                elif name.startswith("torch.") and not last.startswith("__"):
                    record(canonical_api(name))
            return func(*args, **(kwargs or {}))

    pre = nn.modules.module.register_module_forward_pre_hook(pre_hook)
    post = nn.modules.module.register_module_forward_hook(post_hook)
    try:
        with torch.no_grad(), Recorder():
            out = model(*inputs)
    finally:
        pre.remove()
        post.remove()
    outs = list(out) if isinstance(out, list | tuple) else [out]
    finite = all(
        bool(torch.isfinite(o).all())
        for o in outs
        if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())
    )
    shapes = [list(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs]
    return {"apis": seen, "finite": finite, "outputs": shapes, "inputs": specs}
