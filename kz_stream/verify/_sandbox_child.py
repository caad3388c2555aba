"""Entry point of a sandbox child: reads a pickled request on stdin, applies limits and the
guard, calls the target, and writes a pickled result to the original stdout.

The function's own prints and native writes to fd 1 go to stderr, so the result channel
carries only the result; its closing by the verifier (which exited) kills this process
group.
"""

from __future__ import annotations

import importlib
import os
import pickle
import resource
import sys
import traceback
from typing import Any

from kz_stream.verify._guard import Guard, GuardViolation
from kz_stream.verify._lifeline import hold

# Written to stderr once the target is loaded (``run_in_sandbox`` looks for it).
LOADED_MARK = b"kz sandbox: target loaded\n"
# Modules (comma-separated) imported before the request is read: a child started ahead of
# its call pays for them while it waits.
PRELOAD_VAR = "KZ_SANDBOX_PRELOAD"


def _limit(kind: int, value: int) -> None:
    try:
        _, hard = resource.getrlimit(kind)
        cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (cap, cap))
    except (ValueError, OSError):
        pass


def _load_and_call(request: dict[str, Any]) -> dict[str, Any]:
    try:
        func = getattr(importlib.import_module(request["module"]), request["function"])
    except BaseException as e:  # the target is kz_stream's own code: nothing untrusted ran
        return {"status": "setup", "message": _last_line(e)}
    os.write(2, LOADED_MARK)  # a death before this line is the host's, not the code's
    try:
        return {"status": "ok", "value": func(*request["args"])}
    except MemoryError as e:
        return {"status": "oom", "message": f"MemoryError: {e}"}
    except GuardViolation as e:
        return {"status": "exception", "message": str(e)}
    except BaseException as e:
        text = _last_line(e)
        oom = "out of memory" in text.lower() or "cannot allocate memory" in text.lower()
        return {"status": "oom" if oom else "exception", "message": text,
                "traceback": traceback.format_exc()[-4000:]}


def _last_line(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def _preload(names: str) -> None:
    """Imports the trusted modules a call of this kind needs, before its request arrives.

    A failed import ends the child before it reads a request, with the error on stderr:
    an interpreter left half-imported would fail the target's import in other ways, while
    a child that ends before loading its target is retried in a fresh one."""
    for name in filter(None, names.split(",")):
        try:
            importlib.import_module(name)
        except BaseException as e:
            os.write(2, f"kz sandbox: preloading {name} failed: {_last_line(e)}\n".encode())
            os._exit(3)


def main() -> None:
    result_fd = os.dup(1)
    hold(result_fd)  # the verifier reads the other end until it exits
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _preload(os.environ.get(PRELOAD_VAR, ""))
    request: dict[str, Any] = pickle.loads(sys.stdin.buffer.read())
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, int(request["file_size_mb"]) << 20)
    if request.get("memory_mb"):
        _limit(resource.RLIMIT_AS, int(request["memory_mb"]) << 20)
    guard = Guard(
        allow_network=bool(request["allow_network"]),
        write_roots=tuple(request["write_roots"]),
    ).install()
    out = _load_and_call(request)
    guard.active = False
    out["violations"] = list(guard.violations)
    out["writes"] = list(guard.writes)
    try:
        payload = pickle.dumps(out)
    except Exception as e:
        payload = pickle.dumps({"status": "exception", "violations": out["violations"],
                                "writes": out["writes"],
                                "message": f"result is not picklable: {e}"})
    with os.fdopen(result_fd, "wb") as f:
        f.write(payload)
        f.flush()
    # Skip interpreter teardown: library atexit hooks are not ours to run in the sandbox.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
