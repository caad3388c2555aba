"""Runs a function in a fresh, isolated process and reports what happened; the one home of
the isolation every process that runs untrusted code gets (this sandbox's children and the
verifier's workers).

Each call starts ``python -m kz_stream.verify._sandbox_child`` in its own process group
(killed whole on timeout) inside a filesystem boundary where the host allows namespaces
(``isolation``: fresh network, PID, IPC and mount namespaces; a read-only view of the
system and the Python installation, none of the project, the store, HOME or other
children; a private scratch that is thrown away; no privileges; a process cap), with
rlimits (address space, file size, no core dumps) and, as further layers, audit hooks
that block sockets, starting processes and writing outside the scratch. Children left
behind in the process group are detected and killed; the group dies with the verifier too
(``kz_stream.verify._lifeline``).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import pickle
import secrets
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from kz_stream.verify import _lifeline as lifeline
from kz_stream.verify._jail import LEFTOVER_MARK
from kz_stream.verify._sandbox_child import LOADED_MARK, PRELOAD_VAR

__all__ = ["ErrorKind", "Isolation", "SandboxOutcome", "SandboxSetupError", "isolation",
           "jail_command", "run_in_sandbox", "visible_paths"]

ErrorKind = Literal["crash", "timeout", "oom", "exception", "forbidden"]
Level = Literal["jail", "network", "none"]

_PKG_ROOT = str(Path(__file__).resolve().parents[2])
_STDERR_TAIL = 4000
log = logging.getLogger(__name__)


class SandboxSetupError(RuntimeError):
    """The sandboxed child could not load the function it was to run (kz_stream's own
    code): a fault of this host's installation, not of the code under test, so no verdict
    can be had here."""


class _EndedBeforeLoading(SandboxSetupError):
    """The child ended before it loaded its target and said nothing of why. Seen in CI,
    once: the child's numpy failed to import ("numpy._core.multiarray failed to import")
    while another run held most of the host's memory. Tried again before it is called the
    host's fault."""


# Tries of a sandboxed call whose child ends before loading its target (1 s, then 2 s
# apart).
SETUP_ATTEMPTS = 3


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
    isolation: Level = "none"  # "jail" only where the filesystem boundary was in place
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Isolation:
    """How far a child is isolated on this host.

    ``jail``: fresh network, PID, IPC and mount namespaces and the filesystem boundary of
    ``kz_stream.verify._jail`` (no project, store, HOME or other children in view; a
    private scratch; no privileges). ``network``: a network namespace only (the host
    allows no mount namespace): the audit hooks are then the only guard of the files.
    ``none``: no namespace at all: the audit hooks guard the network and the files.
    """

    level: Level
    prefix: tuple[str, ...] = ()
    switch_uid: bool = False  # a root caller runs the child under an unprivileged uid

    def describe(self) -> str:
        if self.level == "jail":
            return "jail: " + " ".join(self.prefix) + (" +uid" if self.switch_uid else "")
        if self.level == "network":
            return ("network namespace only (" + " ".join(self.prefix) + "); no filesystem "
                    "boundary: files are guarded by audit hooks alone")
        return "none: no namespaces on this host; audit hooks alone guard network and files"


_NAMESPACES = ("-n", "-p", "-f", "-m", "-i", "--mount-proc", "--kill-child")
_JAIL = str(Path(__file__).with_name("_jail.py"))
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
_GPU_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri")
# A forking candidate stops here (threads count too: a CUDA worker runs a few dozen).
MAX_PROCESSES = 256
# Unprivileged uids for a root caller's children: one per child, so no two share a
# process count (RLIMIT_NPROC is per uid) and none owns a file of the host.
_UID_BASE, _UID_SPAN = 1_900_000_000, 1_000_000


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def visible_paths(extra: tuple[str, ...] = ()) -> list[str]:
    """What a jailed child sees read-only: the system, the Python installation (with the
    user's site-packages when in use), the CUDA toolchain named by the environment, the
    ``kz_stream`` package and ``extra``; never the project folder around the package, the
    verifier's working directory or HOME (unless a Python installation lives inside)."""
    installs = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                              sys.base_exec_prefix)}
    if site.ENABLE_USER_SITE and site.getusersitepackages() in sys.path:
        installs.add(site.getusersitepackages())
    package = str(Path(__file__).resolve().parents[1])
    # "/" (a service's working directory or a system user's HOME) protects nothing.
    protected = {os.path.abspath(os.getcwd()), os.path.expanduser("~")} - {"/"}
    if not any(_inside(_PKG_ROOT, p) for p in installs):
        protected.add(_PKG_ROOT)
    # The search path beyond the installation (a script's own folder, PYTHONPATH) is not
    # shown: it may be the project, or /tmp with every other child's scratch in it.
    wanted = [*_SYSTEM, *installs]
    for var in ("CUDA_HOME", "CUDA_PATH", "TRITON_LIBCUDA_PATH"):
        if os.environ.get(var):
            wanted.append(os.environ[var])
    if os.environ.get("TRITON_PTXAS_PATH"):
        wanted.append(os.path.dirname(os.environ["TRITON_PTXAS_PATH"]))
    wanted += [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    # Triton builds its driver stub with the host's C compiler ($CC, else one on PATH), and
    # a toolchain outside /usr (e.g. /opt/gcc/bin/gcc) needs its whole root (libexec, include).
    for entry in [*os.environ.get("PATH", "").split(os.pathsep),
                  *(os.path.dirname(os.environ[v]) for v in ("CC", "CXX") if os.environ.get(v))]:
        root = os.path.dirname(entry) if os.path.basename(entry) == "bin" else entry
        if root and os.path.abspath(root) != "/":  # /bin's root is the whole host
            wanted.append(root)
    allowed = {package, *(os.path.abspath(e) for e in extra)}
    chosen: set[str] = set()
    for raw in [*wanted, *allowed]:
        for path in dict.fromkeys((os.path.abspath(raw), os.path.realpath(raw))):
            if not os.path.exists(path) or any(_inside(r, path) for r in protected):
                continue  # "/", or a folder holding the project, the cwd or HOME
            if (any(_inside(path, r) for r in protected) and path not in allowed
                    and not any(_inside(path, p) for p in installs)):
                continue
            chosen.add(path)
    # A folder whose ancestor is bound already comes with it.
    return sorted(p for p in chosen
                  if not any(q != p and _inside(p, q) and not os.path.islink(q)
                             for q in chosen))


def gpu_devices() -> list[str]:
    """The NVIDIA device nodes of this host (bound into a GPU child's jail)."""
    import glob

    return sorted({p for pattern in _GPU_DEVICES for p in glob.glob(pattern)})


def jail_command(cmd: list[str], scratch: str, iso: Isolation, *, gpu: bool = False,
                 read_only: tuple[str, ...] = (), cwd: str | None = None) -> list[str]:
    """``cmd`` as ``iso`` runs it: inside the filesystem boundary for a jail (``scratch``
    its one writable folder), under the namespace prefix otherwise."""
    if iso.level != "jail":
        return [*iso.prefix, *cmd]
    spec = {
        "scratch": scratch,
        "cwd": cwd,
        "read_only": visible_paths(read_only),
        "devices": gpu_devices() if gpu else [],
        "processes": MAX_PROCESSES,
        "uid": _UID_BASE + secrets.randbelow(_UID_SPAN) if iso.switch_uid else None,
    }
    return [*iso.prefix, sys.executable, "-I", "-S", _JAIL, json.dumps(spec), "--", *cmd]


def _fails(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Why ``cmd`` does not run to success here ("" when it does)."""
    try:
        probe = subprocess.run(cmd, capture_output=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{' '.join(cmd[:2])}: {e}"
    if probe.returncode == 0:
        return ""
    return (f"code {probe.returncode}: "
            f"{probe.stderr.decode(errors='replace').strip()[-300:] or 'no message'}")


@cache
def isolation(jail: bool = True) -> Isolation:
    """The strongest isolation this host allows (probed once per process), at most a
    network namespace when ``jail`` is False. Anything short of the jail is logged as a
    warning, with the reason: the filesystem is then guarded by the audit hooks alone.

    Root uses the namespaces directly and runs the child under an unprivileged uid; others
    add a user namespace (``unshare -r``), in which the child keeps uid 0 but no
    capability. The probe imports the sandbox's guard inside the jail, as a child would.
    ``KZ_SANDBOX_NO_JAIL=1`` skips the jail, ``KZ_SANDBOX_NO_UNSHARE=1`` every namespace.
    """
    exe = shutil.which("unshare")
    if exe is None or os.environ.get("KZ_SANDBOX_NO_UNSHARE") == "1":
        if jail:
            log.warning("sandbox: %s", Isolation("none").describe())
        return Isolation("none")
    root = os.geteuid() == 0
    why = "KZ_SANDBOX_NO_JAIL=1"
    if jail and os.environ.get("KZ_SANDBOX_NO_JAIL") != "1":
        options = [Isolation("jail", (exe, *_NAMESPACES), switch_uid=True)] if root else []
        options.append(Isolation("jail", (exe, "-r", *_NAMESPACES)))
        for iso in options:
            scratch = tempfile.mkdtemp(prefix="kz-probe-")
            try:
                why = _fails(jail_command([sys.executable, "-c", "import kz_stream.verify._guard"],
                                          scratch, iso, cwd=scratch), child_env(scratch))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            if not why:
                return iso
    fallback = Isolation("none")
    for prefix in ([(exe, "-n")] if root else []) + [(exe, "-rn")]:
        if not _fails([*prefix, "true"]):
            fallback = Isolation("network", prefix)
            break
    if jail:
        log.warning("sandbox: no filesystem boundary on this host (%s): %s", why,
                    fallback.describe())
    return fallback


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
        USER="kz-sandbox",  # getpass.getuser() for a uid with no passwd entry
        LOGNAME="kz-sandbox",
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
    stdin = proc.stdin
    assert stdin is not None

    def feed() -> None:
        # A thread: a child still importing its preload reads stdin late, and a request
        # larger than the pipe's buffer would block here outside the timeout.
        try:
            stdin.write(request)
            stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass

    feeder = threading.Thread(target=feed, daemon=True)
    readers.append(feeder)
    for r in readers:
        r.start()
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
    # The child died before it read its request. A writer still blocked (an escaped
    # process holds the pipe) keeps the stream's lock: leave the stream to it then.
    if not stdin.closed and not feeder.is_alive():
        try:
            stdin.close()
        except (BrokenPipeError, OSError):
            pass
    return b"".join(chunks["out"]), b"".join(chunks["err"]), timed_out, leftovers


def killed_by(returncode: int | None, iso: Isolation) -> int | None:
    """The signal that ended a child, if one did: a negative return code, or in a jail
    (whose first process cannot die of a signal) the shell's ``128 + n``."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if iso.level == "jail" and 128 < returncode < 128 + signal.NSIG:
        return returncode - 128
    return None


def _module_files(module: str) -> tuple[str, ...]:
    """The source files of ``module`` and its parent packages, when it lives outside
    ``kz_stream`` (a test's target): the jail shows the child the code it is to run."""
    if module == "kz_stream" or module.startswith("kz_stream."):
        return ()
    files = []
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        spec = importlib.util.find_spec(".".join(parts[:i]))
        if spec is not None and spec.origin and os.path.isfile(spec.origin):
            files.append(spec.origin)
    return tuple(files)


def run_in_sandbox(
    target: str,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float,
    memory_mb: int | None = None,
    allow_network: bool = False,
    file_size_mb: int = 256,
    env: dict[str, str] | None = None,
    gpu: bool = False,
    preload: tuple[str, ...] = (),
) -> SandboxOutcome:
    """Calls ``target`` ("package.module:function") with ``args`` in a fresh isolated process.

    The value must be picklable. ``error_kind`` is "timeout" when the wall clock ran out
    (the whole process group is killed), "oom" on MemoryError or the memory rlimit,
    "exception" when the function raised, "forbidden" when it tried to start a process,
    open a socket or write outside its directory, or left processes running, and "crash"
    when the process died. ``gpu`` shows a jailed child the NVIDIA device nodes. Raises
    ``SandboxSetupError`` when the child could not load ``target`` itself: at once when
    the child says so, after ``SETUP_ATTEMPTS`` tries when it ended before loading it with
    no word (``KZ_SANDBOX_ATTEMPT`` in its environment counts them).

    ``preload`` names modules (the target's heavy imports, e.g. torch) that the child
    imports before its request arrives: the call takes a child started earlier with them
    imported (``SPARES_PER_KIND`` are kept per kind of call, from its second call on)
    and starts one in its place, so that only its own work is left to wait for. A retry
    starts a fresh child.
    """
    module, sep, func = target.partition(":")
    if not sep or not module or not func:
        raise ValueError(f"target must be 'package.module:function', got {target!r}")
    for attempt in range(1, SETUP_ATTEMPTS + 1):
        try:
            return _run_once(target, module, func, args, timeout_s=timeout_s,
                             memory_mb=memory_mb, allow_network=allow_network,
                             file_size_mb=file_size_mb, gpu=gpu,
                             env={**(env or {}), "KZ_SANDBOX_ATTEMPT": str(attempt)},
                             preload=preload, spare=attempt == 1)
        except _EndedBeforeLoading as e:
            if attempt == SETUP_ATTEMPTS:
                raise SandboxSetupError(f"{e} ({attempt} attempts)") from None
            log.warning("sandbox: %s; trying again (%d of %d)", e, attempt + 1, SETUP_ATTEMPTS)
            time.sleep(attempt)
    raise AssertionError("unreachable")


@dataclass
class _Child:
    """A sandbox child started and waiting for its request on stdin."""

    proc: subprocess.Popen[bytes]
    private: str  # its scratch, the one folder it may write
    iso: Isolation


# Children started ahead of their call with modules imported (``preload``), by the
# spawn parameters they were started with: a call takes one and starts another in its
# place, so a stream of calls finds its import paid (a CUDA torch's import took 3 s of a
# reference-facts child's 7-11 s on an H200 host, 2026-12-04). Killed at exit; a child
# whose verifier dies reads the end of its stdin and exits.
SPARES_PER_KIND = int(os.environ.get("KZ_SANDBOX_SPARES", "4"))  # 0: none
_spares: dict[tuple[Any, ...], list[_Child]] = {}
_kinds_seen: set[tuple[Any, ...]] = set()
_spares_lock = threading.Lock()


def _start_child(module: str, env: dict[str, str], *, allow_network: bool, gpu: bool,
                 preload: tuple[str, ...]) -> _Child:
    private = tempfile.mkdtemp(prefix="kz-sbx-")
    work = os.path.join(private, "work")
    os.mkdir(work)
    iso = Isolation("none") if allow_network else isolation()
    cmd = jail_command([sys.executable, "-m", "kz_stream.verify._sandbox_child"], private, iso,
                       gpu=gpu, read_only=_module_files(module), cwd=work)
    if preload:
        env = {**env, PRELOAD_VAR: ",".join(preload)}
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
    return _Child(proc, private, iso)


def _discard(child: _Child) -> None:
    """Kills a child that will serve no call, and removes its scratch folder."""
    kill_group(child.proc.pid)
    child.proc.wait()
    for stream in (child.proc.stdin, child.proc.stdout, child.proc.stderr):
        if stream is not None:
            stream.close()
    lifeline.untrack(child.proc.pid)
    shutil.rmtree(child.private, ignore_errors=True)


def _spare_child(module: str, env: dict[str, str], *, allow_network: bool, gpu: bool,
                 preload: tuple[str, ...]) -> _Child:
    """A child for one call: a spare started earlier with ``preload`` imported where one
    is alive, else a fresh one. Spares of this kind are started in its place, from the
    kind's second call on, two at a time at most, up to ``SPARES_PER_KIND``: a burst of
    starts would slow this call."""
    # Everything a child's start depends on: a spare started under another isolation,
    # environment, working directory (in PYTHONPATH) or HOME (hidden by the jail) is not
    # this call's.
    iso = "none" if allow_network else isolation().level
    key = (_module_files(module), allow_network, gpu, preload, iso, os.environ.get("HOME"),
           tuple(sorted(child_env("", env).items())))
    taken: _Child | None = None
    dead: list[_Child] = []
    with _spares_lock:
        waiting = _spares.setdefault(key, [])
        while waiting and taken is None:
            candidate = waiting.pop(0)
            if candidate.proc.poll() is None:
                taken = candidate
            else:
                dead.append(candidate)
        # A kind seen for the first time gets no spare: many kinds recur (the verifier's,
        # the Proposer's), but a call from a passing working directory or environment
        # (a test's) would leave one that nothing takes.
        recurring = key in _kinds_seen
        _kinds_seen.add(key)
        wanted = min(2 if taken else int(recurring), SPARES_PER_KIND - len(waiting))
    for child in dead:
        _discard(child)
    if taken is None:
        taken = _start_child(module, env, allow_network=allow_network, gpu=gpu,
                             preload=preload)
    fresh: list[_Child] = []
    try:
        for _ in range(wanted):
            fresh.append(_start_child(module, env, allow_network=allow_network, gpu=gpu,
                                      preload=preload))
    except OSError as e:  # a loaded host (EAGAIN, EMFILE): this call has its child
        log.warning("sandbox: no spare started: %s", e)
    with _spares_lock:
        waiting = _spares.setdefault(key, [])
        room = max(0, SPARES_PER_KIND - len(waiting))
        waiting.extend(fresh[:room])
        extra = fresh[room:]
    for child in extra:
        _discard(child)
    return taken


@atexit.register
def _discard_spares() -> None:
    """Kills the spares still waiting (at exit)."""
    with _spares_lock:
        children = [c for waiting in _spares.values() for c in waiting]
        _spares.clear()
    for child in children:
        _discard(child)


def _run_once(target: str, module: str, func: str, args: tuple[Any, ...], *,
              timeout_s: float, memory_mb: int | None, allow_network: bool,
              file_size_mb: int, gpu: bool, env: dict[str, str],
              preload: tuple[str, ...], spare: bool) -> SandboxOutcome:
    """One sandboxed call (``run_in_sandbox``)."""
    if preload and spare:
        child = _spare_child(module, env, allow_network=allow_network, gpu=gpu,
                             preload=preload)
    else:
        child = _start_child(module, env, allow_network=allow_network, gpu=gpu,
                             preload=preload)
    proc, private, iso = child.proc, child.private, child.iso
    try:
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
    except BaseException:  # an argument that cannot be pickled: the child serves no one
        _discard(child)
        raise
    started = time.monotonic()
    try:
        out, err, timed_out, leftovers = _collect(proc, request, timeout_s)
    finally:
        lifeline.untrack(proc.pid)
    wall = time.monotonic() - started
    shutil.rmtree(private, ignore_errors=True)
    tail = err.decode(errors="replace")[-_STDERR_TAIL:]
    common: dict[str, Any] = {"stderr_tail": tail, "wall_s": wall,
                              "network_isolation": iso.describe(), "isolation": iso.level}
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
    violations += tuple(line.removeprefix("kz sandbox: ") for line in tail.splitlines()
                        if line.startswith(LEFTOVER_MARK))  # the jail's count of them
    common.update(violations=violations, writes=writes)
    status = result.get("status")
    if status == "setup":
        # Seen on an H200 whose packages were on PYTHONPATH: every proposed module, the
        # synthesized seeds too, was judged a crash of its own ("No module named 'orjson'").
        raise SandboxSetupError(
            f"the sandbox could not load {target}: {result.get('message', '')} (a jailed "
            "child sees the Python installation, not PYTHONPATH or the project folder: "
            "install kz_stream and its dependencies into the environment that runs it)")
    if status is None and LOADED_MARK not in err:
        # Nothing of the code under test ran: the interpreter or the loading of the target
        # died (kz_stream itself not installed where the jail looks, a killed child).
        last = tail.strip().splitlines()[-1] if tail.strip() else "no output"
        raise _EndedBeforeLoading(
            f"the sandbox child ended before it loaded {target} (exit code "
            f"{proc.returncode}): {last} (a jailed child sees the Python installation, not "
            "PYTHONPATH or the project folder)")
    if status is None:
        rc = proc.returncode
        signum = killed_by(rc, iso)
        if signum:
            sig = signal.Signals(signum).name
            kind: ErrorKind = "oom" if (signum == signal.SIGKILL and memory_mb) else "crash"
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
