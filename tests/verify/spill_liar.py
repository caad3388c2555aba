"""A child that lies about its spilled buffers (``test_ipc``): its reply names a symlink
to a file outside its spill folder. Run as ``python -m tests.verify.spill_liar <fd>``."""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing.connection import Connection

from kz_stream.verify._ipc import recv, send


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    spill = os.environ["KZ_SPILL_DIR"]
    send(conn, {"ready": True, "pid": os.getpid(), "device": "cpu"})
    recv(conn)
    os.symlink(sys.argv[2], os.path.join(spill, "spill-1-1"))
    conn.send_bytes(pickle.dumps([("spill-1-1", os.path.getsize(sys.argv[2]))]))
    conn.send_bytes(pickle.dumps([pickle.PickleBuffer(b"")], protocol=5))
    conn.send_bytes(b"")  # "the file is written"
    recv(conn)  # until the verifier hangs up


if __name__ == "__main__":
    main()
