"""Sets up a candidate's filesystem boundary, then runs the candidate's program in it.

Run (by ``kz_stream.verify._sandbox``) as the first process of fresh network, PID, IPC and
mount namespaces (``unshare``; with a user namespace too where the caller is not root), as
``python -I -S -P _jail.py <spec json> -- <program> [args...]``. It builds a new root on a
tmpfs holding only what the spec names: read-only binds of the system and the Python
installation, the device nodes, a fresh /proc of the new PID namespace, a fresh /tmp and
/dev/shm, and the one writable scratch folder; it makes that root read-only, pivots into
it and detaches the old one (so nothing else of the host is reachable), caps the number
of processes, and drops every privilege: a root caller switches to
an unprivileged uid of the spec's choosing, a user-namespace caller clears its capability
bounding set, and both set no-new-privileges. Then it runs the program as its child and
exits with the program's status (``128 + n`` for death by signal ``n``).

Only the standard library, by path and with no site: it runs before any mount is made.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import sys
from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# statvfs's f_flag bits that a read-only remount must carry over: in a user namespace the
# kernel refuses a remount that would clear a flag the original mount has (a locked flag).
_KEEP = 1 | 2 | 4 | 8 | 1024 | 2048 | 4096  # rdonly nosuid nodev noexec noatime nodiratime relatime
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# SECBIT_NOROOT and SECBIT_NOROOT_LOCKED: uid 0 gets no capabilities from execve.
SECURE_NOROOT = 0x1 | 0x2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# The fresh /tmp and /dev/shm hold RAM, which no rlimit counts: small, since the child's
# caches and TMPDIR are in its scratch folder.
_TMPFS_MB = 512

# The line that names processes a program left behind (read by the sandbox).
LEFTOVER_MARK = "kz sandbox: child processes left running: "

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(OSError):
    """A step of the set-up failed; the message names it."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise JailError(err, f"jail: {what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]),
           f"mount {src} on {target}")


def _unescape(field: str) -> str:
    """A mount point as /proc/self/mountinfo writes it (octal escapes for blanks)."""
    return field.encode().decode("unicode_escape")


def _mounts_under(target: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point == target or point.startswith(target.rstrip("/") + "/"):
                out.append(point)
    return out


def _read_only(target: str, extra: int) -> None:
    """Remounts ``target`` and every mount below it read-only, keeping their flags."""
    for point in _mounts_under(target):
        try:
            keep = os.statvfs(point).f_flag & _KEEP
        except OSError:
            continue  # a submount this process may not look into stays as it came
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep | extra)


def _place(root: str, path: str, like: str) -> str:
    """Creates the empty directory or file ``path`` inside ``root`` to mount over."""
    inside = root + path
    if os.path.isdir(like):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if not os.path.exists(inside):
            open(inside, "w").close()
    return inside


def _bind(root: str, path: str, *, writable: bool = False, devices: bool = False) -> None:
    """Binds host ``path`` at the same place in ``root`` (a symlink is copied as one)."""
    if os.path.islink(path):
        link = root + path
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink(os.readlink(path), link)
        return
    if not os.path.exists(path):
        return
    inside = _place(root, path, path)
    _mount(path, inside, None, MS_BIND | (0 if writable else MS_REC))
    extra = MS_NOSUID | (0 if devices else MS_NODEV)
    if writable:
        _mount(None, inside, None, MS_REMOUNT | MS_BIND | extra
               | (os.statvfs(inside).f_flag & _KEEP & ~MS_RDONLY))
    else:
        _read_only(inside, extra)


def _tmpfs(root: str, path: str, size_mb: int, mode: str) -> None:
    inside = root + path
    os.makedirs(inside, exist_ok=True)
    _mount("tmpfs", inside, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode}")


def _drop_privileges(uid: int | None) -> None:
    """No way back to any privilege: the bounding set emptied, no-new-privs set, and a uid
    without capabilities (``uid``, or uid 0 of a user namespace that gains none at exec)."""
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    else:
        _check(_libc.prctl(PR_SET_SECUREBITS, SECURE_NOROOT, 0, 0, 0), "securebits")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _limit(kind: int, value: int) -> None:
    _, hard = resource.getrlimit(kind)
    cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (cap, cap))


def build(spec: dict[str, Any]) -> None:
    """Makes the new root, enters it and drops privileges (see the module docstring)."""
    scratch: str = spec["scratch"]
    uid: int | None = spec.get("uid")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = os.path.join(scratch, ".root")
    os.makedirs(root, exist_ok=True)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    _tmpfs(root, "/tmp", _TMPFS_MB, "1777")
    for path in sorted(spec["read_only"], key=lambda p: p.count("/")):
        _bind(root, path)
    os.makedirs(root + "/dev", exist_ok=True)
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "size=1m,mode=0755")
    for name in _DEVICES:
        _bind(root, "/dev/" + name, writable=True, devices=True)
    for path in spec.get("devices", ()):
        _bind(root, path, writable=True, devices=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    _tmpfs(root, "/dev/shm", _TMPFS_MB, "1777")
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if uid is not None:
        os.chown(scratch, uid, uid)
        for entry in os.scandir(scratch):
            if entry.is_dir(follow_symlinks=False) and entry.name != ".root":
                os.chown(entry.path, uid, uid)
    _bind(root, scratch, writable=True)
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    nr = _PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise JailError(0, f"jail: no pivot_root number for {platform.machine()}")
    # pivot_root(".", "."): the old root ends up stacked on the new one, then detached.
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir(spec.get("cwd") or scratch)
    _limit(resource.RLIMIT_NPROC, int(spec["processes"]))
    _drop_privileges(uid)


def main() -> None:
    try:
        split = sys.argv.index("--")
        spec = json.loads(sys.argv[1])
        program = sys.argv[split + 1:]
        build(spec)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"kz sandbox: could not set up the filesystem boundary: {e}", file=sys.stderr)
        os._exit(125)
    # The program is not the namespace's first process, which ignores the signals it
    # sends itself (abort() would end in SIGSEGV) and inherits every orphan: this one
    # stays as that process, reaps, and ends the namespace when the program ends.
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(program[0], program)
        except OSError as e:
            print(f"kz sandbox: cannot run {program[0]}: {e}", file=sys.stderr)
            os._exit(127)
    # The program's channels close when the program does; stderr stays for the report.
    os.closerange(0, 2)
    os.closerange(3, 1 << 16)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if done == pid:
            break
    _report_leftovers()
    # A signal's death as the shell reports it: the first process of a PID namespace
    # cannot die of its own signal.
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _report_leftovers() -> None:
    """Names the processes the program left running (they die with this one)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    left = sorted(int(e) for e in os.listdir("/proc") if e.isdigit() and e != "1")
    if left:
        os.write(2, f"\n{LEFTOVER_MARK}{left}\n".encode())


if __name__ == "__main__":
    main()
