"""Children that die with the verifier, and a reaper for those of a crashed one.

Each child watches a descriptor whose other end only the verifier holds (the worker's and
the oracle's socket, a sandbox run's result pipe, a compiler wrapper's pipe): when the
kernel closes that end, because the verifier exited however it did, the child kills its
own process group. This does not depend on which verifier thread started the child, as a
parent-death signal would. The verifier also records the process group of each child it
starts in a registry file of its own under ``runtime_dir()``; ``reap`` kills the groups
listed by registries whose verifier is gone, and never those of a live one.

Run as ``python -P lifeline.py <fd> <program> [args...]`` it runs a program
(a compiler) that cannot watch a descriptor itself, and takes its group down with it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["hold", "reap", "runtime_dir", "start_time", "stat_fields", "track", "untrack",
           "wrap"]

_lock = threading.Lock()
_groups: dict[int, int] = {}  # pgid -> start time of its leader
_REGISTRY = re.compile(r"(\d+)-(\d+)\.(?:pids|tmp)")  # .tmp: it died mid-write


def hold(fd: int) -> None:
    """Kills this process group (and exits) once the other end of ``fd`` is closed.

    A thread, so that it needs nothing of the code the process runs; it polls for hang-up
    and errors only (a socket's peer or a pipe's reader gone, a pipe's writers gone), not
    for data. A descriptor that is not open ends the watch at once.
    """

    def watch() -> None:
        p = select.poll()
        p.register(fd, 0)  # POLLHUP/POLLERR/POLLNVAL are reported whatever is asked
        events = p.poll()
        if events[0][1] & select.POLLNVAL:
            return
        try:
            os.killpg(0, signal.SIGKILL)
        except OSError:
            pass
        # The first process of a PID namespace ignores its own group's SIGKILL; its exit
        # takes the namespace down.
        os._exit(137)

    threading.Thread(target=watch, name="kz-lifeline", daemon=True).start()


def wrap(cmd: list[str], fd: int) -> list[str]:
    """``cmd`` run under the wrapper that watches ``fd`` (see the module docstring)."""
    # By path, with -P (no script folder on sys.path): whatever the working directory, and
    # with no import of the package.
    return [sys.executable, "-P", __file__, str(fd), *cmd]


def runtime_dir() -> Path:
    """Where verifiers keep their registries: ``KZ_RUNTIME_DIR``, else a per-user folder
    under the temporary directory."""
    env = os.environ.get("KZ_RUNTIME_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"kz-verify-{os.getuid()}"


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (the state) on, or None if there is no such
    process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the parenthesised command, which may contain spaces and parentheses.
    return stat[stat.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None if there is no such
    process; with the pid it names a process even after the pid is reused."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22


def _registry() -> Path:
    pid = os.getpid()
    return runtime_dir() / f"{pid}-{start_time(pid)}.pids"


def _write() -> None:
    path = _registry()
    try:
        if not _groups:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(f"{g} {s}\n" for g, s in _groups.items()))
        tmp.replace(path)  # a reaper never reads half a file
    except OSError:
        pass  # the registry is the second line of defence: no reason to fail a child's start


def track(pgid: int) -> None:
    """Records a child's process group (its leader's pid) in this verifier's registry."""
    started = start_time(pgid)
    if started is None:
        return  # gone already
    with _lock:
        _groups[pgid] = started
        _write()


def untrack(pgid: int) -> None:
    """Drops a group that has been killed or has ended."""
    with _lock:
        if _groups.pop(pgid, None) is not None:
            _write()


def reap() -> list[int]:
    """Kills the groups recorded by verifiers that are gone, removes their registries, and
    returns the groups killed. A group is killed only while its leader is the process that
    was recorded (same pid and start time), so a reused pid is never hit."""
    killed: list[int] = []
    try:
        st = runtime_dir().stat()
        entries = list(runtime_dir().iterdir())
    except OSError:
        return killed
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return killed  # a folder others can write to could name any of our processes
    for path in entries:
        m = _REGISTRY.fullmatch(path.name)
        if m is None or start_time(int(m[1])) == int(m[2]):
            continue  # not a registry, or its verifier is alive (this one included)
        try:
            lines = path.read_text().split("\n")
        except OSError:
            continue
        for line in lines:
            pgid, _, started = line.partition(" ")
            if pgid.isdigit() and started.isdigit() and start_time(int(pgid)) == int(started):
                try:
                    os.killpg(int(pgid), signal.SIGKILL)
                    killed.append(int(pgid))
                except (ProcessLookupError, PermissionError):
                    pass
        path.unlink(missing_ok=True)
    return killed


def _main() -> int:
    fd = int(sys.argv[1])
    hold(fd)
    # Not exec: this process stays to watch; the program runs in its group.
    return subprocess.call(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(_main())
