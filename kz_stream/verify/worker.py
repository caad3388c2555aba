"""The candidate worker: a fresh process that loads one untrusted ``ModelNew`` and runs it
for the verifier. It never receives the reference source, the reference module or the
expected outputs: only input tensors come in, and output tensors and observations go out.

Run as ``python -m kz_stream.verify.worker <fd> <device>``; "cpu" selects the Triton
interpreter. Requests are handled one at a time (see ``_HANDLERS``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

_STARTED = time.monotonic()
if __name__ == "__main__":
    from kz_stream.verify.lifeline import hold

    hold(int(sys.argv[1]))  # from the first moment: torch's import alone takes seconds
_DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
if _DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

import torch  # noqa: E402

from kz_stream.verify import _guard  # noqa: E402
from kz_stream.verify.compare import flatten  # noqa: E402
from kz_stream.verify.inputs import (  # noqa: E402
    InputPlan,
    InputSpec,
    make_inputs,
    redraw_,
    to_device,
)
from kz_stream.verify.ipc import recv, send  # noqa: E402
from kz_stream.verify.oplog import OpLog  # noqa: E402
from kz_stream.verify.timing import L2Flusher, pad_for, timed_calls  # noqa: E402

try:
    import triton
except ImportError:  # the CUDA path does not need it
    triton = None

_PROGRAMS = frozenset({"ptxas", "cc", "gcc", "clang", "ldconfig", "cuobjdump", "nvdisasm",
                       "x86_64-linux-gnu-gcc", "g++"})


class State:
    """Everything the worker holds for its one candidate."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device != "cpu"
        self.models: dict[str, torch.nn.Module] = {}
        self.model_cls: Any = None
        self.kernels: dict[str, Any] = {}  # Triton kernel objects by name
        self.launches: dict[str, int] = {}
        self.disabled: set[str] = set()
        self.snapshot: dict[str, int] = {}
        self.threads: set[int] = set()
        self.native_threads = 0
        self.held: list[torch.Tensor] = []
        self.held_bytes = 0
        self.timing_sets: list[list[Any]] = []
        self.timing_specs: list[InputSpec] = []
        self.timing_seed = 0
        self.flusher: L2Flusher | None = None
        self.pad_cycles = 0
        self.timing_key = ""
        self.guard: _guard.Guard | None = None


def _watched() -> list[Any]:
    """Modules and classes whose attributes a candidate must not rebind."""
    import time

    import torch.nn.functional as F

    mods: list[Any] = [torch, torch.Tensor, F, torch.nn.Module, time, torch.cuda,
                       torch.autograd, torch.utils.cpp_extension, sys.modules[__name__],
                       sys.modules["kz_stream.verify.timing"], torch.backends.cudnn]
    if triton is not None:
        mods.append(triton)
    return mods


# Bindings the harness relies on: any change is tampering, whatever the new value is.
_CRITICAL = ("torch.cuda.Event", "torch.cuda.synchronize", "torch.cuda.Stream",
             "torch.cuda.current_stream", "torch.cuda.set_stream", "time.", "torch.no_grad",
             "torch.equal", "torch.Tensor.clone", "torch.Tensor.to", "torch.Tensor.cpu",
             "torch.Tensor.copy_", "torch.Tensor.data_ptr", "torch.Tensor.untyped_storage",
             "torch.Tensor.view", "kz_stream.", "torch.profiler", "torch.utils.cpp_extension.",
             "torch.nn.modules.module.Module.__call__", "torch.nn.modules.module.Module._call_impl")


def _tampered(before: dict[str, int]) -> list[str]:
    """Changed bindings that point at something other than torch's own objects."""
    out = []
    owners = {_guard.owner_name(m): m for m in _watched()}
    for name in _guard.changed_attributes(before, _guard.snapshot_attributes(_watched())):
        owner_name, _, attr = name.rpartition(".")
        value = getattr(owners.get(owner_name), attr, None)
        origin = str(getattr(value, "__module__", "") or "")
        if name.startswith(_CRITICAL) or not origin.startswith(("torch", "triton")):
            out.append(name)
    return out


def _precision_flags() -> dict[str, Any]:
    return {
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    }



# ---- extension loading ---------------------------------------------------------------------


class _OpsModule:
    """Stands in for a ``load_inline`` module built with the TORCH_LIBRARY layout."""

    def __init__(self, namespace: str, functions: list[str]) -> None:
        ops = getattr(torch.ops, namespace)
        for f in functions:
            setattr(self, f, getattr(ops, f))
        self.__name__ = namespace


def _install_prebuilt(builds: list[dict[str, Any]]) -> None:
    """Makes ``load_inline`` return the extensions the CPU stage built ahead of time."""
    import importlib.machinery
    import importlib.util

    import torch.utils.cpp_extension as cpp_ext

    from kz_stream.verify.build import LOAD_INLINE_PARAMS, InlineCall

    by_key = {b["key"]: b for b in builds}

    def load_inline(*args: Any, **kwargs: Any) -> Any:
        kw = dict(zip(LOAD_INLINE_PARAMS, args, strict=False))
        kw.update(kwargs)
        call = InlineCall.from_kwargs(kw)
        b = by_key.get(call.key)
        if b is None:  # the sources read before running differ from the ones passed now
            raise RuntimeError(f"extension {call.name!r}: load_inline was called with "
                               "arguments that differ from those built ahead of time")
        if b.get("layout") == "load_inline":
            loader = importlib.machinery.ExtensionFileLoader(b["mod_name"], b["path"])
            spec = importlib.util.spec_from_file_location(b["mod_name"], b["path"],
                                                          loader=loader)
            assert spec is not None
            mod = importlib.util.module_from_spec(spec)
            loader.exec_module(mod)
            return mod
        if b.get("path"):
            torch.ops.load_library(b["path"])  # type: ignore[no-untyped-call]
        return _OpsModule(b["namespace"], list(b["functions"]))

    cpp_ext.load_inline = load_inline


# ---- Triton launch accounting ---------------------------------------------------------------


def _wrap_triton(state: State, module: ModuleType) -> None:
    """Counts launches of the candidate's Triton kernels and lets the ablation disable one."""
    if triton is None:
        return
    kinds: tuple[type, ...] = (triton.runtime.jit.JITFunction,)
    interp = getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None)
    if interp is not None:
        kinds += (interp,)
    for name, obj in list(vars(module).items()):
        target: Any = obj
        # Autotuner/Heuristics wrap the JITFunction in .fn (possibly several layers deep).
        while not isinstance(target, kinds) and hasattr(target, "fn"):
            target = target.fn
        if not isinstance(target, kinds):
            continue
        kernel: Any = target  # isinstance against a runtime tuple narrows to object
        kname = getattr(kernel, "__name__", name)
        state.kernels[kname] = kernel
        state.launches.setdefault(kname, 0)
        original = kernel.run

        def run(*a: Any, _orig: Callable[..., Any] = original, _k: str = kname,
                **kw: Any) -> Any:
            if _k in state.disabled:
                return None
            state.launches[_k] += 1
            return _orig(*a, **kw)

        kernel.run = run


# ---- request handlers ---------------------------------------------------------------------


def _load(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    from kz_stream.verify.loader import load_source, require

    _install_prebuilt(msg.get("builds", []))
    state.snapshot = _guard.snapshot_attributes(_watched())
    state.threads = _guard.python_thread_ids()
    state.native_threads = _guard.native_thread_count()
    module = load_source(msg["source"], "kz_candidate", os.getcwd())
    (state.model_cls,) = require(module, "ModelNew")
    _wrap_triton(state, module)
    changed = _tampered(state.snapshot)
    return {"ok": True, "triton_kernels": sorted(state.kernels), "changed": changed,
            "precision": _precision_flags()}


def _model(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    """Builds ``ModelNew(*init_args)`` under the weight seed and, when its parameters match
    the reference's by name and shape, loads the reference's (perturbed) weights."""
    torch.manual_seed(int(msg["weight_seed"]))
    model = state.model_cls(*msg["init_args"])
    if not isinstance(model, torch.nn.Module):
        raise TypeError("ModelNew(...) is not a torch.nn.Module")
    model = model.to(state.device)
    loaded = False
    ref_sd: dict[str, torch.Tensor] | None = msg.get("state_dict")
    if ref_sd is not None:
        mine = model.state_dict()
        if set(mine) == set(ref_sd) and all(tuple(mine[k].shape) == tuple(v.shape)
                                            for k, v in ref_sd.items()):
            model.load_state_dict({k: v.to(state.device) for k, v in ref_sd.items()})
            loaded = True
    state.models[msg["key"]] = model
    return {"ok": True, "weights_loaded": loaded,
            "param_count": sum(p.numel() for p in model.parameters())}


def _poison(specs: list[tuple[list[int], str]], device: str) -> None:
    """Fills freed allocator blocks of the expected output sizes with NaN (or a pattern), so
    that an output element the candidate never writes shows up.

    The allocator's other free blocks go back to the driver first: a freed earlier output
    (one too big to be held) still holds right values, and an output that lands on it
    would look written. Seen on the H200 with a 6.4 GB ReLU: every kernel ablated, the
    output still right, an honest kernel called a decoy."""
    if device != "cpu":
        torch.cuda.empty_cache()
    blocks = []
    for shape, dtype_name in specs:
        dtype = getattr(torch, dtype_name)
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        elif dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(-1234567 if dtype not in (torch.uint8, torch.int8) else 123)
        blocks.append(t)
    del blocks  # back to the caching allocator, poisoned


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, a1 = sa.data_ptr(), sa.data_ptr() + sa.nbytes()
    b0, b1 = sb.data_ptr(), sb.data_ptr() + sb.nbytes()
    return a0 < b1 and b0 < a1


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included) of two tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    # reshape(-1) first: a 0-dim tensor (a loss) cannot be viewed as bytes of another size.
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _call(state: State, args: list[Any], key: str = "own") -> Any:
    with torch.no_grad():
        return state.models[key](*args)


def _sync(state: State) -> None:
    if state.cuda:
        torch.cuda.synchronize()


# Earlier outputs held to see a later call return one of them (a cached result); past
# this, outputs are not held (their room goes to the candidate's own work).
_HELD_OUTPUT_BYTES = 4 << 30


def _run(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    """Runs one input set ``reps`` times with the per-call checks; returns CPU outputs."""
    inputs: list[Any] = msg["inputs"]
    reps = int(msg.get("reps", 2))
    log_ops = bool(msg.get("log_ops", False))
    outs: list[list[Any]] = []
    flags: list[str] = []
    ops: set[str] = set()
    for rep in range(reps):
        args = to_device(inputs, state.device)
        clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        _poison(msg.get("out_specs", []), state.device)
        _sync(state)
        key = str(msg.get("model", "own"))
        if log_ops and rep == 0:
            oplog = OpLog()
            with oplog:
                out = _call(state, args, key)
            ops |= oplog.ops
        else:
            out = _call(state, args, key)
        flat = flatten(out)
        # Snapshot right away on the calling stream: differs from the synchronised output
        # if the candidate left work running elsewhere.
        snap = [o.clone() if isinstance(o, torch.Tensor) else o for o in flat]
        _sync(state)
        for o, s in zip(flat, snap, strict=True):
            if isinstance(o, torch.Tensor) and not _bits_equal(o, s):
                flags.append("unsynchronized_output")
        for a, c in zip(args, clones, strict=True):
            if isinstance(a, torch.Tensor) and not _bits_equal(a, c):
                flags.append("input_mutation")
        for o in flat:
            if not isinstance(o, torch.Tensor):
                continue
            if any(_overlaps(o, a) for a in args if isinstance(a, torch.Tensor)):
                flags.append("output_aliases_input")
            if any(_overlaps(o, h) for h in state.held):
                flags.append("output_reuses_earlier_output")
        new_threads = _guard.python_thread_ids() - state.threads
        if new_threads:
            flags.append("thread")
        for o in flat:
            if isinstance(o, torch.Tensor) and state.held_bytes < _HELD_OUTPUT_BYTES:
                state.held.append(o)
                state.held_bytes += o.untyped_storage().nbytes()
        outs.append([o.detach().to("cpu") if isinstance(o, torch.Tensor) else o for o in flat])
        # Freed before the next repetition allocates its own: on the H200 a 6.4 GB GELU's
        # copies of two repetitions at once ran the worker out of its 56 GB.
        del args, clones, out, flat, snap
    return {"ok": True, "outputs": outs, "flags": sorted(set(flags)), "ops": sorted(ops),
            "launches": dict(state.launches)}


def _profile(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    """Kernel names, device times and streams of a few calls, from the profiler's trace."""
    import json

    from torch.profiler import ProfilerActivity, profile

    args = to_device(msg["inputs"], state.device)
    key = str(msg["model"])
    pad_cycles = int(msg.get("pad_cycles", 0))
    _call(state, args, key)  # warm (JIT, autotuning) outside the trace
    _sync(state)
    marker = torch.zeros(1, device=state.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marker.add_(1)  # a known kernel on the harness's stream
        for _ in range(int(msg.get("calls", 2))):
            _sync(state)
            if pad_cycles:
                # The same spin as before a timed call: a candidate that looks at its
                # stream cannot tell profiled calls from timed ones.
                torch.cuda._sleep(pad_cycles)  # type: ignore[no-untyped-call]
            _call(state, args, key)
        _sync(state)
    path = os.path.join(os.getcwd(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.remove(path)
    kernels = []
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and ev.get("ph") == "X":
            kernels.append({"name": str(ev.get("name", "")), "us": float(ev.get("dur", 0.0)),
                            "ts": float(ev.get("ts", 0.0)),
                            "stream": (ev.get("args") or {}).get("stream"),
                            "cat": ev.get("cat")})
    kernels.sort(key=lambda k: k["ts"])
    return {"ok": True, "kernels": kernels, "launches": dict(state.launches)}


@contextlib.contextmanager
def _uninitialized_is_nan() -> Iterator[None]:
    """Makes ``torch.empty`` fill new memory (NaN for floats, the largest value for ints)
    while it lasts, so an output the ablated kernel would have written cannot inherit right
    values from a freed block. Poisoning freed blocks alone is not enough on the CPU: glibc
    hands a freed earlier output of the same size to the next allocation, and an honest
    Triton softmax was judged a decoy that way."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "... does not have a deterministic implementation"
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def _ablate(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    """Outputs with each launched Triton kernel disabled in turn (decoy detection)."""
    results: dict[str, list[Any]] = {}
    other = msg.get("other_inputs")
    for name in msg["kernels"]:
        if other is not None:
            _call(state, to_device(other, state.device), str(msg["model"]))
            _sync(state)
        state.disabled = {name}
        try:
            _poison(msg.get("out_specs", []), state.device)
            with _uninitialized_is_nan():
                out = flatten(_call(state, to_device(msg["inputs"], state.device),
                                    str(msg["model"])))
                _sync(state)
            results[name] = [o.detach().to("cpu") if isinstance(o, torch.Tensor) else o
                             for o in out]
        except Exception as e:
            results[name] = [f"error: {type(e).__name__}"]
        finally:
            state.disabled = set()
    return {"ok": True, "outputs": results}


def _time_setup(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    specs = [InputSpec(**s) for s in msg["specs"]]
    plan = InputPlan("timing", "normal")
    state.timing_sets = [make_inputs(specs, plan, int(msg["seed"]) + i, device=state.device)
                         for i in range(int(msg["sets"]))]
    state.timing_specs = specs
    state.timing_seed = int(msg["seed"])
    state.flusher = L2Flusher(torch.device(state.device), msg["flush"],
                              int(msg["flush_factor"]))
    state.timing_key = str(msg["model"])
    # Warm-up: compiles and autotunes outside the timed region.
    for args in state.timing_sets[:2]:
        _call(state, args, state.timing_key)
    _sync(state)
    args0 = state.timing_sets[0]
    # The reference measures the pad; the candidate gets the reference's with each "time"
    # request: host work longer than the reference takes to issue its call leaves the GPU
    # idle inside the candidate's timed region, and counts.
    pad_ms = 0.0
    if msg.get("measure_pad"):
        state.pad_cycles, pad_ms = pad_for(lambda: _call(state, args0, state.timing_key))
    return {"ok": True, "pad_cycles": state.pad_cycles, "pad_ms": pad_ms}


def _time(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    assert state.flusher is not None
    keep = set(msg.get("keep", []))
    samples, kept = timed_calls(lambda a: _call(state, list(a), state.timing_key),
                                state.timing_sets,
                                int(msg["calls"]), state.flusher, start=int(msg.get("start", 0)),
                                keep=keep,
                                pad_cycles=int(msg.get("pad_cycles", state.pad_cycles)),
                                refresh=lambda j: _refresh(state, j))
    outputs = {j: [o.detach().to("cpu") if isinstance(o, torch.Tensor) else o
                   for o in flatten(v)] for j, v in kept.items()}
    return {"ok": True, "event_ms": samples.event_ms, "host_ms": samples.host_ms,
            "issue_ms": samples.issue_ms, "outputs": outputs}


def _refresh(state: State, j: int) -> None:
    """Fresh values for timed call ``j``'s inputs, the same on both sides (one seed per
    call index), so the reference's output for call ``j`` checks the candidate's."""
    sets = state.timing_sets
    redraw_(sets[j % len(sets)], state.timing_specs, (state.timing_seed << 20) ^ (j + 1))


def _finish(state: State, msg: dict[str, Any]) -> dict[str, Any]:
    changed = _tampered(state.snapshot)
    threads = _guard.python_thread_ids() - state.threads
    return {"ok": True, "changed": changed, "threads": len(threads),
            "native_threads": _guard.native_thread_count(),
            "native_threads_at_load": state.native_threads,
            "precision": _precision_flags(),
            "violations": list(state.guard.violations) if state.guard else [],
            "writes": list(state.guard.writes[-20:]) if state.guard else []}


_HANDLERS: dict[str, Callable[[State, dict[str, Any]], dict[str, Any]]] = {
    "load": _load, "model": _model, "run": _run, "profile": _profile, "ablate": _ablate,
    "time_setup": _time_setup, "time": _time, "finish": _finish,
}


def classify(e: BaseException) -> dict[str, Any]:
    """An error reply: kind is oom, compile_error, cuda_error, forbidden or exception."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    low = text.lower()
    kind = "exception"
    if isinstance(e, torch.OutOfMemoryError | MemoryError) or "out of memory" in low or (
            "t allocate memory" in low):  # the CPU allocator at the address-space cap
        kind = "oom"
    elif isinstance(e, _guard.GuardViolation):
        kind = "forbidden"
    elif triton is not None and isinstance(e, getattr(
            getattr(triton, "compiler", None), "CompilationError", ())):
        kind = "compile_error"
    elif "cuda error" in low or "illegal memory access" in low or "device-side assert" in low:
        kind = "cuda_error"
    return {"ok": False, "error": kind, "message": text[-3000:],
            "traceback": traceback.format_exc()[-6000:]}


_WARM = """
import triton
import triton.language as tl


@triton.jit
def kz_warm_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
"""


def _warm_triton() -> None:
    """Builds Triton's driver helpers before a candidate arrives (the worker is started
    ahead of need, so this time is hidden)."""
    from kz_stream.verify.loader import load_source

    mod = load_source(_WARM, "kz_warm", os.getcwd())
    x = torch.ones(1000, device="cuda")
    y = torch.empty_like(x)
    mod.kz_warm_copy[(1,)](x, y, 1000, BLOCK=1024)
    torch.cuda.synchronize()


def _warm_harness() -> None:
    """Runs each op the checks use once, as a request would (the guard is installed)."""
    x = torch.randn(4096, device="cuda")
    args = to_device([x.to("cpu")], "cuda")
    clones = [a.clone() for a in args]
    _poison([([4096], "float32")], "cuda")
    with OpLog():
        y = torch.relu(args[0])
    torch.cuda.synchronize()
    _bits_equal(y, y.clone())
    _bits_equal(args[0], clones[0])
    _overlaps(y, args[0])
    torch.sum(x.view(torch.int32), dim=0, dtype=torch.int64)
    torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]
    y.detach().to("cpu")
    torch.cuda.synchronize()


def _limit_resources() -> None:
    """No core dumps, files up to 1 GiB, and the address space the verifier allows (a CPU
    worker's ``KZ_WORKER_MEMORY_MB``), once the harness is loaded and warm."""
    import resource

    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, 1 << 30)]
    if os.environ.get("KZ_WORKER_MEMORY_MB"):
        limits.append((resource.RLIMIT_AS, int(os.environ["KZ_WORKER_MEMORY_MB"]) << 20))
    for kind, value in limits:
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    phases = {"imports": time.monotonic() - _STARTED}  # where start-up time goes
    if os.environ.get("KZ_GATED_START") == "1":
        # Imports done; the device is touched only when the verifier says so (never while
        # it times another process on this GPU).
        send(conn, {"imported": True})
        t = time.monotonic()
        if recv(conn).get("cmd") != "start":
            return
        phases["gate"] = time.monotonic() - t
    state = State(_DEVICE)
    info: dict[str, Any] = {"ready": True, "pid": os.getpid(), "device": _DEVICE,
                            "start_s": phases}
    try:
        from kz_stream.verify.reference import strict_precision

        strict_precision()
        t = time.monotonic()
        if state.cuda:
            torch.cuda.set_device(0)
            torch.empty(1, device=_DEVICE)  # CUDA context now, outside any deadline
            fraction = float(os.environ.get("KZ_GPU_MEMORY_FRACTION", "0.45"))
            torch.cuda.set_per_process_memory_fraction(fraction)
            info["gpu"] = torch.cuda.get_device_name()
        phases["cuda"] = time.monotonic() - t
        t = time.monotonic()
        if triton is not None and state.cuda:
            _warm_triton()
        phases["triton"] = time.monotonic() - t
        info["warming"] = state.cuda
        torch.set_num_threads(int(os.environ.get("KZ_WORKER_THREADS", "2")))
        torch.manual_seed(0)  # torch rebinds some functions lazily on first use
        _limit_resources()
        private = os.environ.get("KZ_PRIVATE_DIR", os.getcwd())
        state.guard = _guard.Guard(allowed_programs=_PROGRAMS,
                                   write_roots=(private, "/dev/shm")).install()
    except BaseException as e:
        send(conn, {"ready": False, **classify(e)})
        return
    send(conn, info)
    if state.cuda:
        # After "ready", so outside the verifier's GPU lock: module loading and first-use
        # set-up of the harness's own ops (four seconds of a candidate's first call on the
        # H200 otherwise), with kernels of a few microseconds.
        t = time.monotonic()
        try:
            _warm_harness()
            if state.guard is not None and state.guard.violations:
                # Every later reply would carry them, and be judged a hack.
                raise RuntimeError(f"the warm-up broke the sandbox's rules: "
                                   f"{state.guard.violations[0]}")
        except Exception as e:
            send(conn, {"ok": False, **classify(e)})
            return
        send(conn, {"warm": True, "info": {"start_s": {**phases,
                                                      "harness": time.monotonic() - t}}})
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            break
        cmd = msg.get("cmd")
        if cmd == "exit":
            break
        handler = _HANDLERS.get(str(cmd))
        try:
            if handler is None:
                raise ValueError(f"unknown request {cmd!r}")
            reply = handler(state, msg)
        except BaseException as e:
            reply = classify(e)
        if state.guard is not None and state.guard.violations:
            reply["violations"] = list(state.guard.violations)
        try:
            send(conn, reply)
        except Exception as e:  # an unpicklable output is the candidate's fault
            send(conn, {"ok": False, "error": "exception",
                        "message": f"reply could not be sent: {e}"})
    os._exit(0)


if __name__ == "__main__":
    main()
