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


def native_connect() -> int:
    """Connects through libc, past the audit hook: only the network namespace stops it."""
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    addr = ctypes.create_string_buffer(struct.pack("!HH4s8x", 2, 80, bytes([1, 1, 1, 1])))
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
