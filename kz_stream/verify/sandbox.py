"""Runs a function in a fresh, isolated process and reports what happened.

Each call starts ``python -m kz_stream.verify._sandbox_child`` in its own process group
(killed whole on timeout) with a private temporary working directory and HOME, rlimits
(address space, file size, no core dumps), no network (a network namespace via
``unshare -n`` where the host allows it, and an audit hook that blocks sockets either
way), and an audit hook that blocks starting processes and writing outside the private
directory. Children left behind in the process group are detected and killed; the group
dies with the verifier too (``kz_stream.verify.lifeline``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from kz_stream.verify import lifeline

__all__ = ["ErrorKind", "SandboxOutcome", "isolation_prefix", "run_in_sandbox"]

ErrorKind = Literal["crash", "timeout", "oom", "exception", "forbidden"]

_PKG_ROOT = str(Path(__file__).resolve().parents[2])
_STDERR_TAIL = 4000


@dataclass(frozen=True)
class SandboxOutcome:
    """What a sandboxed call did: its value, or why it has none."""

    ok: bool
    value: Any = None
    error_kind: ErrorKind | None = None
    error_message: str = ""
    stderr_tail: str = ""
    violations: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    wall_s: float = 0.0
    network_isolation: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@cache
def isolation_prefix(strong: bool = False) -> tuple[str, ...]:
    """The command prefix that puts a child in a fresh network namespace, or () if none works.

    Root uses ``unshare -n``; others try ``unshare -rn`` (a user namespace maps them to root
    inside it). ``strong`` also asks for a PID and mount namespace with a private /proc, so
    that the child cannot see (or read the memory of) the verifier's other processes.
    Probed once per process.
    """
    exe = shutil.which("unshare")
    if exe is None or os.environ.get("KZ_SANDBOX_NO_UNSHARE") == "1":
        return ()
    extra = ("-p", "-f", "-m", "--mount-proc", "--kill-child") if strong else ()
    options = [(exe, "-n", *extra)] if os.geteuid() == 0 else []
    options.append((exe, "-rn", *extra))
    for prefix in options:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return () if not strong else isolation_prefix(False)


def child_env(private_dir: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A minimal environment for an untrusted child: caches and HOME in its private dir."""
    keep = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "LD_LIBRARY_PATH",
            "NVIDIA_VISIBLE_DEVICES", "TRITON_PTXAS_PATH", "TRITON_LIBCUDA_PATH", "VIRTUAL_ENV",
            "OMP_NUM_THREADS", "CC", "CXX")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    paths = [_PKG_ROOT, os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
    env.update(
        HOME=private_dir,
        TMPDIR=private_dir,
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONHASHSEED="0",
        TRITON_CACHE_DIR=os.path.join(private_dir, ".triton"),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(private_dir, ".inductor"),
        TORCH_EXTENSIONS_DIR=os.path.join(private_dir, ".torch_extensions"),
    )
    if extra:
        env.update(extra)
    return env


def process_group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (read from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = lifeline.stat_fields(int(entry))
        if fields and len(fields) > 2 and int(fields[2]) == pgid:  # field 5: pgrp
            members.append(int(entry))
    return members


def kill_group(pgid: int) -> None:
    """Kills every process in the group; a vanished group is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(
    proc: subprocess.Popen[bytes], request: bytes, timeout_s: float
) -> tuple[bytes, bytes, bool, list[int]]:
    """Feeds stdin, waits for the child itself to exit (not for EOF: a forked grandchild may
    hold the pipes), kills its process group, and returns (stdout, stderr, timed_out,
    pids left running in the group)."""
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def pump(name: str, stream: Any) -> None:
        for block in iter(lambda: stream.read1(1 << 16), b""):
            chunks[name].append(block)

    readers = [
        threading.Thread(target=pump, args=("out", proc.stdout), daemon=True),
        threading.Thread(target=pump, args=("err", proc.stderr), daemon=True),
    ]
    for r in readers:
        r.start()
    assert proc.stdin is not None
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    leftovers = [] if timed_out else process_group_members(proc.pid)
    kill_group(proc.pid)
    proc.wait()
    for r in readers:
        r.join(timeout=5)
    return b"".join(chunks["out"]), b"".join(chunks["err"]), timed_out, leftovers


def run_in_sandbox(
    target: str,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float,
    memory_mb: int | None = None,
    allow_network: bool = False,
    file_size_mb: int = 256,
    env: dict[str, str] | None = None,
) -> SandboxOutcome:
    """Calls ``target`` ("package.module:function") with ``args`` in a fresh isolated process.

    The value must be picklable. ``error_kind`` is "timeout" when the wall clock ran out
    (the whole process group is killed), "oom" on MemoryError or the memory rlimit,
    "exception" when the function raised, "forbidden" when it tried to start a process,
    open a socket or write outside its directory, and "crash" when the process died.
    """
    module, sep, func = target.partition(":")
    if not sep or not module or not func:
        raise ValueError(f"target must be 'package.module:function', got {target!r}")
    private = tempfile.mkdtemp(prefix="kz-sbx-")
    work = os.path.join(private, "work")
    os.mkdir(work)
    request = pickle.dumps(
        {
            "module": module,
            "function": func,
            "args": args,
            "memory_mb": memory_mb,
            "file_size_mb": file_size_mb,
            "allow_network": allow_network,
            "write_roots": [private],
        }
    )
    prefix = () if allow_network else isolation_prefix()
    cmd = [*prefix, sys.executable, "-m", "kz_stream.verify._sandbox_child"]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=work,
        env=child_env(private, env),
        start_new_session=True,
    )
    lifeline.track(proc.pid)
    try:
        out, err, timed_out, leftovers = _collect(proc, request, timeout_s)
    finally:
        lifeline.untrack(proc.pid)
    wall = time.monotonic() - started
    shutil.rmtree(private, ignore_errors=True)
    tail = err.decode(errors="replace")[-_STDERR_TAIL:]
    iso = " ".join(prefix) if prefix else "audit-hook"
    common: dict[str, Any] = {"stderr_tail": tail, "wall_s": wall, "network_isolation": iso}
    if timed_out:
        return SandboxOutcome(False, None, "timeout", f"no result within {timeout_s:g} s",
                              **common)
    try:
        result: dict[str, Any] = pickle.loads(out) if out else {}
    except Exception as e:  # a garbled result channel is a crash of the child
        result = {"status": "crash", "message": f"unreadable result: {e}"}
    violations = tuple(result.get("violations", ()))
    writes = tuple(result.get("writes", ()))
    if leftovers:
        violations += (f"child processes left running: {leftovers}",)
    common.update(violations=violations, writes=writes)
    status = result.get("status")
    if status is None:
        rc = proc.returncode
        if rc is not None and rc < 0:
            sig = signal.Signals(-rc).name
            kind: ErrorKind = "oom" if (-rc == signal.SIGKILL and memory_mb) else "crash"
            return SandboxOutcome(False, None, kind, f"killed by {sig}", **common)
        return SandboxOutcome(False, None, "crash", f"exited with code {rc} and no result",
                              **common)
    if violations:
        return SandboxOutcome(False, result.get("value"), "forbidden", violations[0], **common)
    if status == "ok":
        return SandboxOutcome(True, result.get("value"), None, "", **common)
    message = str(result.get("message", ""))
    if status == "oom":
        return SandboxOutcome(False, None, "oom", message, **common)
    if status == "exception":
        return SandboxOutcome(False, None, "exception", message, **common)
    return SandboxOutcome(False, None, "crash", message, **common)
