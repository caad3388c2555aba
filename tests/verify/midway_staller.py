"""A child that begins its reply and stops in the middle of it, alive (``test_ipc``): a
frame announcing a megabyte, ten bytes of it, then silence. Run as
``python -m tests.verify.midway_staller <fd>``."""

from __future__ import annotations

import os
import struct
import sys
import time
from multiprocessing.connection import Connection

from kz_stream.verify._ipc import recv, send


def main() -> None:
    fd = int(sys.argv[1])
    conn = Connection(fd)
    send(conn, {"ready": True, "pid": os.getpid(), "device": "cpu"})
    recv(conn)
    os.write(fd, struct.pack("!i", 1 << 20) + b"x" * 10)
    time.sleep(600)


if __name__ == "__main__":
    main()
