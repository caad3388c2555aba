"""Child processes of the verifier (oracle and candidate workers) and their message channel.

A child is started as ``python -m <module> <fd>`` in its own process group, with a private
working directory and HOME, inside the sandbox's isolation (``_sandbox.isolation``: the
filesystem boundary and namespaces where the host allows them, a network namespace or
nothing where it does not).
Messages (``_messages``: typed dicts) are pickled over a socketpair; replies carry CPU
tensors only. A call
that exceeds its deadline kills the whole process group. The child kills its group when
the verifier's end of the socket closes, and the group is in the verifier's registry
(``kz_stream.verify._lifeline``).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, cast

from kz_stream.verify import _lifeline as lifeline
from kz_stream.verify._messages import ErrorReply, ReadyReply, Request, StartRequest
from kz_stream.verify._sandbox import Isolation, child_env, isolation, jail_command, kill_group


class ChildTimeout(TimeoutError):
    """The child did not answer in time; it has been killed."""


class ChildDied(RuntimeError):
    """The child exited or crashed; ``stderr_tail`` says what it printed last."""

    def __init__(self, message: str, stderr_tail: str = "", returncode: int | None = None):
        super().__init__(message)
        self.stderr_tail = stderr_tail
        self.returncode = returncode


def tail(text: str, n: int) -> str:
    """The last ``n`` characters of ``text``, marked as cut when cut."""
    return text if len(text) <= n else "…" + text[-n:]


def error_text(e: BaseException) -> str:
    """The exception's type and message, as a reply says it."""
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def error_reply(e: BaseException, kind: str = "exception") -> ErrorReply:
    """The reply of a request that raised ``e`` (call it while handling ``e``)."""
    return {"ok": False, "error": kind, "message": error_text(e)[-3000:],
            "traceback": traceback.format_exc()[-6000:]}


def requests(conn: Connection) -> Iterator[Any]:
    """A child's requests, one at a time, until the verifier closes the channel or says
    "exit"."""
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            return
        if msg.get("cmd") == "exit":
            return
        yield msg


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    if not len(buf):
        raw = torch.empty(0, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors as out-of-band buffers: their bytes go over the socket once,
    with no torch.save round trip."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            return NotImplemented
        t = obj.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else bytearray()
        return _rebuild_tensor, (pickle.PickleBuffer(raw), str(t.dtype).removeprefix("torch."),
                                 tuple(t.shape))


def send(conn: Connection, obj: Any) -> None:
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    sizes = [memoryview(b).nbytes for b in buffers]
    conn.send_bytes(pickle.dumps(sizes))
    conn.send_bytes(f.getbuffer())
    for b in buffers:
        conn.send_bytes(b.raw())


def recv(conn: Connection) -> Any:
    sizes: list[int] = pickle.loads(conn.recv_bytes())
    head = conn.recv_bytes()
    bufs = []
    for n in sizes:
        buf = bytearray(n)
        if n:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        bufs.append(buf)
    return pickle.loads(head, buffers=bufs)


class Child:
    """One child process and its channel. Not thread-safe: one call at a time."""

    def __init__(self, module: str, args: list[str], *, env: dict[str, str] | None = None,
                 isolate: bool = True, strong: bool = False, gated: bool = False,
                 start_timeout_s: float = 180.0, gpu: bool = False,
                 read_only: tuple[str, ...] = ()) -> None:
        """``strong`` asks for the jail (``_sandbox.isolation``), else a network namespace;
        ``gpu`` shows the jailed child the NVIDIA device nodes, ``read_only`` more paths."""
        self.private = tempfile.mkdtemp(prefix="kz-child-")
        work = os.path.join(self.private, "work")
        os.mkdir(work)
        parent_sock, child_sock = socket.socketpair()
        self.conn = Connection(os.dup(parent_sock.fileno()))
        parent_sock.close()
        self._stderr_path = os.path.join(self.private, "stderr.log")
        self.isolation = isolation(strong) if isolate else Isolation("none")
        cmd = jail_command([sys.executable, "-m", module, str(child_sock.fileno()), *args],
                           self.private, self.isolation, gpu=gpu, read_only=read_only,
                           cwd=work)
        e = child_env(self.private, env)
        e["KZ_PRIVATE_DIR"] = self.private
        if gated:
            e["KZ_GATED_START"] = "1"
        with open(self._stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd=work, env=e,
                pass_fds=(child_sock.fileno(),), start_new_session=True)
        lifeline.track(self.proc.pid)
        child_sock.close()
        self.ready: ReadyReply | None = None
        self.start_timeout_s = start_timeout_s
        self.strong = self.isolation.level == "jail"
        self.gated = gated
        self._imported = False
        self._start_sent = False
        self._warm = False

    def wait_imported(self) -> None:
        """Blocks until a gated child has imported its modules (CPU work only) and waits
        for ``wait_ready`` to let it touch the device. No-op for an ungated child."""
        if self.gated and not self._imported:
            reply = self._recv(self.start_timeout_s)
            if not isinstance(reply, dict) or not reply.get("imported"):
                self.kill()
                raise ChildDied(f"child failed to start: {reply!r}", self.stderr_tail())
            self._imported = True

    def wait_ready(self) -> ReadyReply:
        """Blocks until the child reports that it has started (imports, CUDA context); a
        gated child is told to go on first."""
        if self.ready is None:
            if self.gated and not self._start_sent:
                self.wait_imported()
                try:
                    start: StartRequest = {"cmd": "start"}
                    send(self.conn, start)
                except (BrokenPipeError, ConnectionResetError, OSError) as e:
                    self.kill()
                    raise ChildDied(f"child is gone: {e}", self.stderr_tail(),
                                    self.proc.poll()) from e
                self._start_sent = True
            reply = self._recv(self.start_timeout_s)
            if not isinstance(reply, dict) or not reply.get("ready"):
                self.kill()
                raise ChildDied(f"child failed to start: {reply!r}", self.stderr_tail())
            self.ready = cast(ReadyReply, reply)
        return self.ready

    @property
    def imported(self) -> bool:
        """Whether a gated child got as far as its imports."""
        return self._imported

    def wait_warm(self) -> None:
        """Blocks until a child that said it is still warming up (``"warming"`` in its
        ready reply) has finished; its host-side warm-up needs no lock of the caller's."""
        ready = self.wait_ready()
        if ready.get("warming") and not self._warm:
            reply = self._recv(self.start_timeout_s)
            if not isinstance(reply, dict) or not reply.get("warm"):
                self.kill()
                raise ChildDied(f"child failed to warm up: {reply!r}", self.stderr_tail())
            info = reply.get("info") or {}
            if "start_s" in info:
                ready["start_s"] = info["start_s"]
            self._warm = True

    def call(self, msg: Request, timeout_s: float) -> Any:
        """Sends one request and returns the reply (the request's ``...Reply``, or an
        ``ErrorReply``), or raises ChildTimeout / ChildDied."""
        self.wait_warm()
        try:
            send(self.conn, msg)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            self.kill()
            raise ChildDied(f"child is gone: {e}", self.stderr_tail(), self.proc.poll()) from e
        reply = self._recv(timeout_s)
        assert isinstance(reply, dict)
        return reply

    def _recv(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise ChildTimeout(f"no answer within {timeout_s:g} s")
            try:
                if self.conn.poll(min(left, 0.5)):
                    return recv(self.conn)
            except (EOFError, ConnectionResetError, OSError) as e:
                rc = self.proc.poll()
                self.kill()
                raise ChildDied(f"child exited (code {rc})", self.stderr_tail(), rc) from e
            if self.proc.poll() is not None:
                # Drain a reply written just before exit.
                if self.conn.poll(0):
                    try:
                        return recv(self.conn)
                    except (EOFError, OSError):
                        pass
                rc = self.proc.returncode
                self.kill()
                raise ChildDied(f"child exited (code {rc})", self.stderr_tail(), rc)

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            with open(self._stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kills the process group and removes the private directory."""
        kill_group(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
            lifeline.untrack(self.proc.pid)
        except subprocess.TimeoutExpired:
            pass  # still recorded: the next verifier's reaper tries again
        try:
            self.conn.close()
        except OSError:
            pass
        shutil.rmtree(self.private, ignore_errors=True)
