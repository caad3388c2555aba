"""In-process guard for untrusted Python: an audit hook that blocks and records what the code
must not do, plus snapshots that detect monkeypatching and stray threads.

Standard library only: the sandbox child imports this before anything else. The hook sees
Python-level actions only; native code (a CUDA extension) is contained by the OS layer
(process group, rlimits, network namespace) that the callers set up around the process.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

# Audit events that start another program or process.
_PROCESS_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.exec",
        "os.system",
        "os.startfile",
        "subprocess.Popen",
        "pty.spawn",
    }
)
_NETWORK_EVENTS = frozenset(
    {
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "urllib.Request",
    }
)
# Events that change the file system at the path in args[0] (or args[0:2]).
_FS_EVENTS = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.rename",
        "os.chmod",
        "os.chown",
        "os.link",
        "os.symlink",
        "os.truncate",
        "os.utime",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
    }
)


def _to_channel(event: str, args: tuple[Any, ...], channels: frozenset[int]) -> bool:
    """A message with no address on one of ``channels``, connected Unix sockets: the
    oracle passes its replies' sealed files to the verifier so (``_ipc.send``). Read
    through ``_socket``'s own accessors: a subclass could report another family."""
    import _socket

    if event != "socket.sendmsg" or len(args) != 2 or args[1] is not None:
        return False
    sock = args[0]
    return (isinstance(sock, _socket.socket)
            and _socket.socket.family.__get__(sock) == _socket.AF_UNIX
            and _socket.socket.fileno(sock) in channels)


class GuardViolation(PermissionError):
    """Raised inside the guarded code when it attempts a forbidden action."""


@dataclass
class Guard:
    """Audit-hook policy. ``violations`` lists forbidden attempts, ``writes`` every file write."""

    allow_network: bool = False
    allow_subprocess: bool = False
    # Programs the libraries themselves run (Triton's ptxas, its launcher build), by name.
    # ``install`` resolves them to the real files they name at that moment (on PATH, and
    # Triton's bundled tools); later, a run is allowed only if it resolves to one of those
    # files, so a candidate's own ``./gcc`` (or a PATH pointing at it) is refused.
    allowed_programs: frozenset[str] = frozenset()
    write_roots: tuple[str, ...] = ()
    # Connected Unix sockets (descriptors) that messages with descriptors may be sent on:
    # the oracle's and a worker's channel to the verifier (their replies' sealed files).
    channels: frozenset[int] = frozenset()
    violations: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    active: bool = True
    _installed: bool = False
    _allowed_files: frozenset[str] = frozenset()

    def install(self) -> Guard:
        """Installs the hook for the rest of the process's life (hooks cannot be removed)."""
        if not self._installed:
            self._allowed_files = trusted_program_files(self.allowed_programs)
            sys.addaudithook(self._hook)
            self._installed = True
        return self

    def _deny(self, what: str) -> None:
        self.violations.append(what)
        raise GuardViolation(f"forbidden in the sandbox: {what}")

    def _writable(self, path: str) -> bool:
        real = os.path.realpath(path)
        if real in ("/dev/null", "/dev/zero", "/dev/urandom"):
            return True
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in self.write_roots)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        if event in _PROCESS_EVENTS:
            if self.allow_subprocess:
                return
            if event in ("subprocess.Popen", "os.posix_spawn") and self._allowed_program(args):
                return
            self._deny(f"{event} {_short(args)}")
        elif event in _NETWORK_EVENTS:
            if not self.allow_network and not _to_channel(event, args, self.channels):
                self._deny(f"{event} {_short(args)}")
        elif event == "open":
            path, mode, flags = [*args, None, None, None][:3]
            if not isinstance(path, str | bytes) or not _is_write(mode, flags):
                return
            spath = os.fsdecode(path)
            self.writes.append(spath)
            if not self._writable(spath):
                self._deny(f"write to {spath}")
        elif event in _FS_EVENTS:
            for p in args[:2]:
                if isinstance(p, str | bytes) and not self._writable(os.fsdecode(p)):
                    self._deny(f"{event} {os.fsdecode(p)}")

    def _allowed_program(self, args: tuple[Any, ...]) -> bool:
        # subprocess.Popen: (executable, args, cwd, env); os.posix_spawn[p]: (path, argv,
        # env). Anything this cannot read exactly as the new process will is refused.
        popen = len(args) >= 4
        argv = args[1] if len(args) > 1 else None
        exe = args[0] if args and args[0] else None
        if exe is None and isinstance(argv, list | tuple) and argv:
            exe = argv[0]
        if exe is None and isinstance(argv, str | bytes):
            exe = argv
        # A path object, or exactly str or bytes (a subclass may read differently to the new
        # process); the isinstance, implied by the type test, tells the type checker.
        if not isinstance(exe, os.PathLike) and (
            not isinstance(exe, str | bytes) or type(exe) not in (str, bytes)
        ):
            return False
        name = os.fsdecode(exe)
        if popen:
            cwd, env = args[2], args[3]
        else:
            # posix_spawnp searches this process's PATH and posix_spawn none, and the event
            # does not say which: only a path naming the file is allowed (subprocess only
            # uses posix_spawn for those).
            if os.sep not in name:
                return False
            cwd, env = None, None
        found = resolve_program(name, cwd, env)
        if found is None or found[1] not in self._allowed_files:
            return False
        # A link placed where the candidate may write can be re-pointed after this check:
        # the folder it sits in counts, not the file it points to.
        folder = os.path.dirname(found[0])
        return not self._writable(os.path.join(folder, "x"))


def resolve_program(exe: str, cwd: Any = None, env: Any = None) -> tuple[str, str] | None:
    """(the path, the real file) that running ``exe`` from ``cwd`` with ``env`` executes: a
    bare name is looked up on the new process's PATH, a relative path from ``cwd``. None if
    there is none, or if it cannot be told for certain: a PATH with relative entries, an
    environment that is not a plain dict of strings, a cwd of another type."""
    if cwd is not None:
        if type(cwd) not in (str, bytes) and not isinstance(cwd, os.PathLike):
            return None
        cwd = os.fsdecode(os.fspath(cwd))
    if os.sep not in exe:
        if env is None or env is os.environ:
            path = os.environ.get("PATH", os.defpath)
        elif type(env) is dict and all(type(k) in (str, bytes) and type(v) in (str, bytes)
                                       for k, v in env.items()):
            path = os.pathsep.join(os.get_exec_path(env))
        else:
            return None
        dirs = path.split(os.pathsep)
        if any(not os.path.isabs(d) for d in dirs):
            return None  # resolved from the new process's cwd, which may differ from ours
        hit = shutil.which(exe, path=path)
        return (os.path.abspath(hit), os.path.realpath(hit)) if hit else None
    full = os.path.join(cwd if cwd is not None else os.getcwd(), exe)
    return (os.path.abspath(full), os.path.realpath(full)) if os.path.isfile(full) else None


def trusted_program_files(names: Iterable[str]) -> frozenset[str]:
    """The real files ``names`` resolve to now: on PATH, in Triton's bundled tool folder,
    ``/sbin`` and ``/usr/sbin`` (Triton runs ``/sbin/ldconfig``), and the tools named by
    ``CC`` and ``TRITON_*_PATH``."""
    names = frozenset(names)
    places = ["/sbin", "/usr/sbin"]
    # find_spec locates Triton without importing it (the oracle does not import it).
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        places.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin"))
    found: set[str] = set()
    for name in names:
        for hit in (shutil.which(name), *(shutil.which(name, path=d) for d in places)):
            if hit:
                found.add(os.path.realpath(hit))
    for var in ("CC", *(k for k in os.environ if k.startswith("TRITON_") and
                        k.endswith("_PATH"))):
        value = os.environ.get(var)
        if value and os.path.basename(value) in names and os.path.isfile(value):
            found.add(os.path.realpath(value))
    return frozenset(found)


def _is_write(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _short(args: tuple[Any, ...]) -> str:
    text = repr(args)
    return text if len(text) <= 200 else text[:197] + "..."


# ---- monkeypatch and thread detection -------------------------------------------------


def owner_name(owner: Any) -> str:
    """"torch.cuda" for a module, "torch.Tensor" for a class."""
    if isinstance(owner, type):
        mod = getattr(owner, "__module__", "")
        return f"{mod}.{owner.__qualname__}" if mod else owner.__qualname__
    return str(getattr(owner, "__name__", repr(owner)))


def snapshot_attributes(modules: Iterable[ModuleType | type]) -> dict[str, int]:
    """Maps "owner.attr" to id(value) for every attribute of the given modules and classes."""
    snap: dict[str, int] = {}
    for owner in modules:
        name = owner_name(owner)
        try:
            items = list(vars(owner).items())
        except TypeError:
            continue
        for attr, value in items:
            snap[f"{name}.{attr}"] = id(value)
    return snap


_VOLATILE = ("__slotnames__", "__annotations__", "__warningregistry__")


def changed_attributes(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Names whose binding changed or vanished between two snapshots. New names are not
    reported: lazy submodule imports add them legitimately."""
    return sorted(k for k, v in before.items()
                  if after.get(k) != v and not k.endswith(_VOLATILE))


def python_thread_ids() -> set[int]:
    """Ids of every live Python thread, including ones started through ``_thread``."""
    return set(sys._current_frames())


def native_thread_count() -> int:
    """Number of OS threads in this process (sees threads started by native code too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
