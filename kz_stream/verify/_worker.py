"""The candidate worker: a fresh process that loads one untrusted ``ModelNew`` and runs it
for the verifier. It never receives the reference source, the reference module or the
expected outputs: only input tensors come in, and output tensors and observations go out.

Run as ``python -m kz_stream.verify._worker <fd> <device>``; "cpu" selects the Triton
interpreter. Requests are handled one at a time (see ``_harness.HANDLERS``).
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

_STARTED = time.monotonic()
if __name__ == "__main__":
    from kz_stream.verify._lifeline import hold

    hold(int(sys.argv[1]))  # from the first moment: torch's import alone takes seconds
_DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
if _DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

import torch  # noqa: E402

from kz_stream.verify import _guard  # noqa: E402
from kz_stream.verify._harness import (  # noqa: E402
    HANDLERS,
    WORKER_FILE_BYTES,
    State,
    bits_equal,
    block_sums,
    classify,
    overlaps,
    poison,
    release_exported,
    triton,
)
from kz_stream.verify._inputs import to_device  # noqa: E402
from kz_stream.verify._ipc import recv, requests, send  # noqa: E402
from kz_stream.verify._messages import ImportedReply, ReadyReply, WarmReply  # noqa: E402
from kz_stream.verify._oplog import OpLog  # noqa: E402

_PROGRAMS = frozenset({"ptxas", "cc", "gcc", "clang", "ldconfig", "cuobjdump", "nvdisasm",
                       "x86_64-linux-gnu-gcc", "g++"})



_WARM = """
import triton
import triton.language as tl


@triton.jit
def kz_warm_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
"""


# A loop whose bound is a run-time argument, as every tiled matmul has. Triton 3.6's
# interpreter with NumPy 2.5 cannot run it (``int()`` of a one-element array: "only
# 0-dimensional arrays can be converted to Python scalars"), so on such a host every honest
# kernel of that shape fails, and the failure is the host's, not the kernel's.
_RUNTIME_BOUND = """
import triton
import triton.language as tl


@triton.jit
def kz_check_loop(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + tl.arange(0, BLOCK), acc)
"""


def interpreter_defect() -> str | None:
    """Runs a loop over a run-time bound through the Triton interpreter; returns the error
    it raises (a defect of this host's Triton and NumPy), or None when it is right."""
    from kz_stream.verify._ipc import error_text
    from kz_stream.verify._loader import load_source

    try:
        mod = load_source(_RUNTIME_BOUND, "kz_check", os.getcwd())
        x = torch.arange(48, dtype=torch.float32)
        y = torch.empty(16)
        mod.kz_check_loop[(1,)](x, y, 48, BLOCK=16)
        expected = x.view(3, 16).sum(0)
        if not torch.equal(y, expected):
            return f"wrong result: {y[:4].tolist()} instead of {expected[:4].tolist()}"
    except Exception as e:
        return error_text(e)
    return None


def _warm_triton() -> None:
    """Builds Triton's driver helpers before a candidate arrives (the worker is started
    ahead of need, so this time is hidden)."""
    from kz_stream.verify._loader import load_source

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
    poison([([4096], "float32")], "cuda")
    with OpLog():
        y = torch.relu(args[0])
    torch.cuda.synchronize()
    bits_equal(y, y.clone())
    bits_equal(args[0], clones[0])
    overlaps(y, args[0])
    block_sums(x)
    torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]
    y.detach().to("cpu")
    torch.cuda.synchronize()


def _limit_resources() -> None:
    """No core dumps, files up to 1 GiB, and the address space the verifier allows (a CPU
    worker's ``KZ_WORKER_MEMORY_MB``), once the harness is loaded and warm."""
    import resource

    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, WORKER_FILE_BYTES)]
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
        imported: ImportedReply = {"imported": True}
        send(conn, imported)
        t = time.monotonic()
        if recv(conn).get("cmd") != "start":
            return
        phases["gate"] = time.monotonic() - t
    state = State(_DEVICE)
    info: ReadyReply = {"ready": True, "pid": os.getpid(), "device": _DEVICE,
                        "start_s": phases}
    try:
        from kz_stream.verify._reference import strict_precision

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
        elif triton is not None:
            defect = interpreter_defect()
            if defect:
                info["interpreter_defect"] = defect
        phases["triton"] = time.monotonic() - t
        info["warming"] = state.cuda
        torch.set_num_threads(int(os.environ.get("KZ_WORKER_THREADS", "2")))
        torch.manual_seed(0)  # torch rebinds some functions lazily on first use
        _limit_resources()
        private = os.environ.get("KZ_PRIVATE_DIR", os.getcwd())
        # Its channel takes messages with descriptors: its big outputs' sealed files.
        state.guard = _guard.Guard(allowed_programs=_PROGRAMS,
                                   write_roots=(private, "/dev/shm"),
                                   channels=frozenset({conn.fileno()})).install()
    except BaseException as e:
        send(conn, {"ready": False, **classify(e)})  # a ReadyReply with an error's fields
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
        warm: WarmReply = {"warm": True, "info": {"start_s": {**phases,
                                                             "harness": time.monotonic() - t}}}
        send(conn, warm)
    for msg in requests(conn):
        release_exported()  # the verifier copied the last reply's before asking again
        cmd = msg.get("cmd")
        handler = HANDLERS.get(str(cmd))
        reply: dict[str, Any]
        try:
            if handler is None:
                raise ValueError(f"unknown request {cmd!r}")
            reply = dict(handler(state, msg))
        except BaseException as e:
            reply = dict(classify(e))
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
