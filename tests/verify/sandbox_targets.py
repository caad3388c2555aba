"""Functions the sandbox tests run in a child process."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import time
from typing import Any


def add(a: int, b: int) -> int:
    return a + b


def hang() -> None:
    time.sleep(3600)


def crash() -> None:
    os.abort()


def boom() -> None:
    raise ValueError("nope")


def connect() -> str:
    s = socket.socket()
    s.settimeout(2)
    s.connect(("1.1.1.1", 80))
    return "connected"


def native_connect(port: int) -> int:
    """Connects to 127.0.0.1:``port`` through libc, past the audit hook: only the network
    namespace stops it. 0 when connected."""
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    # sockaddr_in: the family in host order, the port and address in network order.
    addr = ctypes.create_string_buffer(struct.pack("=H", 2)
                                       + struct.pack("!H4s8x", port, bytes([127, 0, 0, 1])))
    return int(libc.connect(fd, addr, 16))


def spawn() -> bytes:
    return subprocess.run(["echo", "hi"], capture_output=True).stdout


def native_fork() -> int:
    libc = ctypes.CDLL(None)
    pid = int(libc.fork())
    if pid == 0:
        time.sleep(3600)
    return pid


def write_outside(path: str) -> int:
    with open(path, "w") as f:
        return f.write("x")


def write_inside() -> str:
    with open("ok.txt", "w") as f:
        f.write("x")
    return os.getcwd()


def allocate(mb: int) -> int:
    return len(bytearray(mb << 20))


def unpicklable() -> Any:
    return lambda: None


def native_write(how: str, path: str) -> str:
    """Writes ``path`` through torch's C++ writer, numpy or libc (the last two beneath or
    beside the audit hook)."""
    if how == "torch":
        import torch

        torch.save(torch.zeros(4), path)
    elif how == "numpy":
        import numpy

        numpy.zeros(4).tofile(path)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fopen.restype = ctypes.c_void_p
        f = libc.fopen(path.encode(), b"w")
        if not f:
            raise OSError(ctypes.get_errno(), "fopen failed", path)
        libc.fwrite(b"kz", 1, 2, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
    return "written"


def read_file(path: str) -> bytes:
    import numpy

    return numpy.fromfile(path, dtype=numpy.uint8).tobytes()


def fork_bomb(comm: str) -> int:
    """Forks (every child too) until refused; returns how many forks this process made."""
    libc = ctypes.CDLL(None, use_errno=True)
    me, n = os.getpid(), 0
    while libc.fork() >= 0:
        n += 1
        if os.getpid() != me:
            libc.prctl(15, comm.encode(), 0, 0, 0)  # PR_SET_NAME: findable by the host
            n = 0
    if os.getpid() != me:
        time.sleep(600)
    return n


def kill_parent(how: str) -> str:
    import signal

    if how == "parent":
        os.kill(os.getppid(), signal.SIGKILL)
    else:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    time.sleep(1)
    return "still here"


def identity(project: str) -> dict[str, Any]:
    """Who this process is: uid, capabilities and no-new-privs, the pids and what of the
    project folder it sees."""
    status = {line.split(":")[0]: line.split(":")[1].strip()
              for line in open("/proc/self/status") if ":" in line}
    return {"uid": os.getuid(), "cap_eff": int(status["CapEff"], 16),
            "cap_bnd": int(status["CapBnd"], 16), "no_new_privs": status.get("NoNewPrivs"),
            "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "project": sorted(os.listdir(project))}


def imported(name: str) -> bool:
    import sys

    return name in sys.modules


def start_ticks() -> int:
    """When this process started, in clock ticks since boot."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])
