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


def _limit(kind: int, value: int) -> None:
    try:
        _, hard = resource.getrlimit(kind)
        cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (cap, cap))
    except (ValueError, OSError):
        pass


def main() -> None:
    request: dict[str, Any] = pickle.loads(sys.stdin.buffer.read())
    result_fd = os.dup(1)
    hold(result_fd)  # the verifier reads the other end until it exits
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, int(request["file_size_mb"]) << 20)
    if request.get("memory_mb"):
        _limit(resource.RLIMIT_AS, int(request["memory_mb"]) << 20)
    guard = Guard(
        allow_network=bool(request["allow_network"]),
        write_roots=tuple(request["write_roots"]),
    ).install()
    out: dict[str, Any]
    try:
        module = importlib.import_module(request["module"])
        func = getattr(module, request["function"])
        value = func(*request["args"])
        out = {"status": "ok", "value": value}
    except MemoryError as e:
        out = {"status": "oom", "message": f"MemoryError: {e}"}
    except GuardViolation as e:
        out = {"status": "exception", "message": str(e)}
    except BaseException as e:
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        out = {"status": "exception", "message": text[-2000:],
               "traceback": traceback.format_exc()[-4000:]}
        if "out of memory" in text.lower() or "cannot allocate memory" in text.lower():
            out["status"] = "oom"
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
