"""A child whose reply is a pickle that names code (``test_ipc``): unpickled as it is, it
would create the folder ``argv[2]`` in the verifier's process. Run as
``python -m tests.verify.pickle_liar <fd> <path>``."""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any

from kz_stream.verify._ipc import recv, send


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (sys.argv[2],)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    send(conn, {"ready": True, "pid": os.getpid(), "device": "cpu"})
    recv(conn)
    conn.send_bytes(pickle.dumps([]))  # no out-of-band buffers
    conn.send_bytes(pickle.dumps({"ok": True, "outputs": Payload()}))
    recv(conn)  # until the verifier hangs up


if __name__ == "__main__":
    main()
