"""Child processes of the verifier (oracle and candidate workers) and their message channel.

A child is started as ``python -m <module> <fd>`` in its own process group, with a private
working directory and HOME, inside the sandbox's isolation (``_sandbox.isolation``: the
filesystem boundary and namespaces where the host allows them, a network namespace or
nothing where it does not).
Messages (``_messages``: typed dicts) are pickled over a socketpair (protocol 5), each CPU
tensor's bytes as an out-of-band buffer after the pickle; replies carry CPU tensors only.

Each buffer's frame is read straight into the buffer its tensor is built on
(``_recv_frame_into``; multiprocessing's ``recv_bytes_into`` copies through a BytesIO, so
a receiver held a message twice): on this project's 2-core VM a 1 GiB reply's trip took
0.64 s against 2.13 s before, 4 GiB 5.7 s against 9.0 s (``benchmarks/bench_ipc.py``).

Big buffers travel as sealed memory files (``memfd_create``, then sealed against
writes, shrinking and growth: nobody, the sender included, can change the bytes from
then on): ``send`` passes the file's descriptor beside the frames (``SCM_RIGHTS``)
instead of the bytes, and the receiver checks the file's size and seals and maps it
copy-on-write (a write reaches its own pages only). Two senders use them:

- the verifier, for a tensor made by ``share`` (a prepared problem's big inputs, which go
  to every worker of the problem's candidates, several times each);
- a child made with ``spill=True`` (the oracle, with ``VerifierConfig.oracle_spill``,
  whose replies hold GBs of input sets and expected outputs; never a process that runs
  candidate code), for each buffer of at least ``SPILL_MIN_BYTES``. The verifier keeps
  those files (``_SHARED``): an input set's go on to the workers as they came. A buffer
  whose file cannot be made comes as bytes after all.

A child without ``spill=True`` may pass no file (``SpillError``, the child is killed).
On a host without sealed files, a ``spill=True`` child sends such a buffer through a
file of a folder the verifier made for it (``KZ_SPILL_DIR``: under /dev/shm where it
can, else in the child's private folder) instead: the message names the file, and an
empty frame on the socket says it is written, so the verifier reads one file while the
child writes the next. The verifier reads such a file only by a name of the fixed
pattern, opened in that folder without following links, a regular file of the size
announced, and deletes it; anything else is a ``SpillError``.

A call that exceeds its deadline kills the whole process group. The child kills its group
when the verifier's end of the socket closes, and the group is in the verifier's registry
(``kz_stream.verify._lifeline``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import itertools
import mmap
import os
import pickle
import re
import resource
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection
from typing import Any, cast

from kz_stream.verify import _lifeline as lifeline
from kz_stream.verify._messages import ErrorReply, ReadyReply, Request, StartRequest
from kz_stream.verify._sandbox import Isolation, child_env, isolation, jail_command, kill_group


def _copy_failed(reply: dict[str, Any], error: str, message: str) -> dict[str, Any]:
    """The error reply for outputs the verifier could not copy (its failure, not the
    candidate's), keeping the violations the worker reported."""
    kept = {"violations": reply["violations"]} if reply.get("violations") else {}
    return {"ok": False, "error": error, **kept, "message": message}


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


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every process under it (of those still there)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            continue  # gone between the reads
    return out


def tree_memory(pid: int, *, within: int | None = None) -> int:
    """Resident bytes of ``pid`` and every process under it, each private page shared
    between them counted once (the sum of their PSS: forked children share their
    parent's pages), of what is still there. Shared-memory pages (a ``share``d input's
    mapping) count in full in each process that maps them: their PSS is split with the
    verifier and other workers, which would let a candidate hold that much more. With
    ``within``: the sum of their RSS where that is at most ``within`` (an upper bound,
    read without walking a big process's pages)."""
    pids = tree_pids(pid)
    if within is not None:
        rss = _summed(pids, "statm", lambda text: int(text.split()[1]) * _PAGE)
        if rss <= within:
            return rss
    return (_summed(pids, "smaps_rollup", lambda text: _kib(text, "Pss:")
                    - _kib(text, "Pss_Shmem:", missing=0))
            + _summed(pids, "status", lambda text: _kib(text, "RssShmem:", missing=0)))


def _kib(text: str, field: str, missing: int | None = None) -> int:
    """The bytes of a /proc file's ``field`` line (in kB); ``missing`` where it has none
    (else a StopIteration)."""
    for line in text.splitlines():
        if line.startswith(field):
            return 1024 * int(line.split()[1])
    if missing is None:
        raise StopIteration(field)
    return missing


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _summed(pids: list[int], name: str, parse: Callable[[str], int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/{name}") as f:
                total += parse(f.read())
        except (OSError, ValueError, IndexError, StopIteration):
            continue  # gone between the reads
    return total


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
            msg = recv(conn, trusted=True)  # the verifier's own requests
        except (EOFError, OSError):
            return
        if msg.get("cmd") == "exit":
            return
        yield msg


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    kind = getattr(torch, str(dtype), None)
    if not isinstance(kind, torch.dtype):  # the name comes from the child's message
        raise UnreadableReply(f"a tensor of dtype {dtype!r}, which torch does not have")
    if not len(buf):
        raw = torch.empty(0, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(kind).reshape(shape)


class UnreadableReply(RuntimeError):
    """A child's message that the verifier does not read: one that names code or classes no
    reply holds (``_ReplyUnpickler``), or whose spilled buffer is not as announced
    (``SpillError``). The channel is then out of step: kill the child."""


# What a child's message may name besides plain data (None, bool, int, float, str, bytes,
# list, tuple, dict, set): CPU tensors (``_rebuild_tensor``) and a few data types.
_REPLY_GLOBALS = frozenset({
    (__name__, "_rebuild_tensor"),
    ("kz_stream.verify._device_ipc", "Exported"),  # a worker's output by CUDA IPC handle
    ("builtins", "complex"), ("builtins", "slice"), ("builtins", "range"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
    ("collections", "OrderedDict"), ("torch", "Size"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
})


class _ReplyUnpickler(pickle.Unpickler):
    """Reads a child's message with no globals but ``_REPLY_GLOBALS`` and torch's dtypes.

    Candidate code runs in the worker, and reference code in the oracle; either can write
    to its end of the socket (the fd is in its argv), and a plain ``pickle.loads`` would
    call whatever the pickle names (``os.system``) in the verifier, outside every sandbox.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REPLY_GLOBALS or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise UnreadableReply(f"the message names {module}.{name}, which no reply holds")


def _is_torch_dtype(module: str, name: str) -> bool:
    torch = sys.modules.get("torch")
    return module == "torch" and torch is not None and isinstance(
        getattr(torch, name, None), torch.dtype)


def _loads(data: Any, trusted: bool, buffers: Any = ()) -> Any:
    """Unpickles a message: the verifier's own requests as they are (``trusted``), a
    child's through ``_ReplyUnpickler``, any failure an ``UnreadableReply``."""
    if trusted:
        return pickle.loads(data, buffers=buffers)
    try:
        return _ReplyUnpickler(io.BytesIO(data), buffers=buffers).load()
    except UnreadableReply:
        raise
    except Exception as e:  # a truncated or malformed pickle, a tensor of another size
        raise UnreadableReply(f"the message cannot be read: {error_text(e)}") from e


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors as out-of-band buffers: their bytes go over the socket once,
    with no torch.save round trip."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # id() of each out-of-band buffer that is a shared tensor's -> its sealed file.
        self.shared_fds: dict[int, int] = {}

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            return NotImplemented
        t = obj.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else bytearray()
        buffer = pickle.PickleBuffer(raw)
        fd = _shared_file(t)
        if fd is not None:
            self.shared_fds[id(buffer)] = fd
        return _rebuild_tensor, (buffer, str(t.dtype).removeprefix("torch."), tuple(t.shape))


# A buffer of at least this many bytes travels through a file of the receiver's spill
# folder (``send``'s ``spill_dir``); smaller ones are not worth a file's open and unlink.
SPILL_MIN_BYTES = 16 << 20
# The one name a spilled buffer's file may have: no separator, no "..", nothing the
# receiver could be pointed elsewhere with.
_SPILL_NAME = re.compile(r"spill-[0-9]{1,10}-[0-9]{1,20}")
# The most a message's buffers may add up to: half the host's memory (a full-size
# KernelBench reply holds up to tens of GB; more than half is no reply's).
_MAX_MESSAGE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
_spill_count = itertools.count()
# A message's pickle (tensors travel beside it): a reply's lists, flags and tracebacks
# take kilobytes; a frame announced larger is a child's lie, refused before allocation.
_MAX_PICKLE_BYTES = 256 << 20
_HUGE = 2 << 20  # a transparent huge page
_CHUNK = 64 << 20  # a read's size: 1 GiB reads were slower here (0.19 s/GiB, not 0.14)
# Folders a verifier makes for its children: spill folders under /dev/shm and private
# folders under the temporary directory, "kz-<spill|child>-<its pid>-<its start time>-<random>",
# so that those left by a verifier that was killed can be found and removed
# (``reap_left_behind``).
_LEFT_BEHIND = re.compile(r"kz-(?:spill|child)-([0-9]+)-([0-9]+)-[A-Za-z0-9_]+")
SHM = "/dev/shm"


# A tensor of at least this many bytes is worth a sealed file of its own (``share``).
SHARE_MIN_BYTES = 16 << 20
# The size list's entry of a buffer whose sealed file comes beside the frames.
_SHARED_ENTRY = "memfd"
# The seals a sealed file carries: its bytes are fixed for every process that maps it.
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Before a sealed-file entry's buffer: its descriptor comes with this byte (SCM_RIGHTS)...
_FILE_FOLLOWS = b"F"
# ...or, where the sender could not make the file, this byte and then the bytes' frame.
_BYTES_FOLLOW = b"B"
# Sealed files this process keeps, each as a live tensor's bytes: data_ptr -> (file,
# bytes, mapping). The mapping's weak reference tells a live entry from one whose mapping
# is being freed: an mmap is unmapped (the GIL released) before its finalizer runs, and
# another buffer may be given the same address in between.
_SHARED: dict[int, tuple[int, int, weakref.ref[mmap.mmap]]] = {}


def share(t: Any, min_bytes: int = SHARE_MIN_BYTES) -> Any:
    """``t`` as a tensor of the same dtype, shape and values whose bytes are a sealed
    memory file, mapped here copy-on-write: ``send`` hands a child the file's descriptor
    instead of the bytes. ``t`` itself when it is one already (an oracle's reply comes in
    such files), when it is not a CPU tensor of ``min_bytes`` or more, or when the host
    makes no such file (or this process has no descriptor left). A write to the returned
    tensor changes this process's copy only: ``send`` goes on passing the file's bytes
    (the verifier never writes to its inputs).

    Written here, not with ``torch.multiprocessing``'s shared tensors: those are writable
    by every process that maps them, and the receiver here runs untrusted code."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu"
            or t.nbytes < max(min_bytes, 1) or _shared_file(t) is not None
            or len(_SHARED) >= _max_shared()):
        return t
    try:
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        raw = memoryview(src.numpy())
    except (RuntimeError, TypeError):  # a tensor without plain bytes (quantized, conj)
        return t
    fd = _sealed_file(raw)
    if fd is None:
        return t
    try:
        view = _mapped(fd, raw.nbytes, keep=True)
    except MemoryError:
        return t
    return _rebuild_tensor(view, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def sealed_copy(t: Any, min_bytes: int = SHARE_MIN_BYTES) -> Any:
    """A host copy of the tensor ``t`` (on any device) whose bytes are a sealed memory
    file this process keeps, as ``share`` makes, so that ``send`` passes the file's
    descriptor and copies nothing. ``t.to("cpu")`` where ``t`` is smaller than
    ``min_bytes`` or the host makes no such file.

    A device tensor goes through a pinned buffer, a block at a time, straight into the
    file: for the oracle's big inputs and outputs a host copy and then ``send``'s write of
    it into a file copied each twice, the first into new pageable memory (on an H100 an
    8 GiB set's inputs took 6 s to reach the host and its reply 3-11 s more, 2026-12-05).
    Written, not copied into a shared mapping of the file, for the reason
    ``_sealed_file`` gives."""
    torch = sys.modules["torch"]
    if t.nbytes < max(min_bytes, 1) or len(_SHARED) >= _max_shared():
        return t.detach().to("cpu")
    try:
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        fd = os.memfd_create("kz-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError, RuntimeError, TypeError):  # no memfd; no plain bytes
        return t.detach().to("cpu")
    try:
        if src.device.type == "cpu":
            _write_all(fd, memoryview(src.numpy()))
        else:
            stage = _pinned_block(torch)
            for i in range(0, src.numel(), stage.numel()):
                part = src[i:i + stage.numel()]
                stage[:part.numel()].copy_(part)  # to pinned memory: returns when done
                _write_all(fd, memoryview(stage[:part.numel()].numpy()))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except (OSError, RuntimeError):  # no room in the file's memory; a device fault
        os.close(fd)
        return t.detach().to("cpu")
    except BaseException:
        os.close(fd)
        raise
    try:
        view = _mapped(fd, t.nbytes, keep=True)  # closes ``fd`` if it cannot map it
    except MemoryError:
        return t.detach().to("cpu")
    return _rebuild_tensor(view, str(t.dtype).removeprefix("torch."), tuple(t.shape))


_PINNED: list[Any] = []  # this process's one pinned block for ``sealed_copy``


def _pinned_block(torch: Any) -> Any:
    """A page-locked host buffer of ``_CHUNK`` bytes, made once per process: a device
    copy into it runs at the link's speed, with no page faults."""
    if not _PINNED:
        _PINNED.append(torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True))
    return _PINNED[0]


def _sealed_file(raw: memoryview) -> int | None:
    """A new memory file holding ``raw``, sealed (``_SEALS``); None where the host makes
    none (no memfd, no memory, no descriptor left)."""
    try:
        fd = os.memfd_create("kz-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        return None
    try:
        # Written, not copied into a shared mapping: a fault per 4 KiB page (tmpfs gets
        # no huge pages by default) made that 1.9 s a GiB on the 2-core VM, this 0.7.
        _write_all(fd, raw)
        # No writable shared mapping was made, so the write seal can be added.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError:
        os.close(fd)
        return None
    return fd


def _mapped(fd: int, size: int, *, keep: bool) -> mmap.mmap:
    """A copy-on-write mapping of the sealed file ``fd``; with ``keep`` (and a descriptor
    to spare) ``fd`` stays open as the mapping's file for ``send`` (``_SHARED``), else it
    is closed here (the mapping keeps a copy of it). No room is a MemoryError."""
    try:
        view = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        raise MemoryError(f"no room to map a buffer of {size} bytes: {e}") from e
    if not keep or len(_SHARED) >= _max_shared():
        os.close(fd)
        return view
    with memoryview(view) as m:  # released at once: an mmap with a view cannot be freed
        address = _address_of(m)
    _SHARED[address] = (fd, size, weakref.ref(view))
    # The file's descriptor goes with the mapping, when its last tensor does.
    weakref.finalize(view, _unshare, address, fd)
    return view


def _address_of(m: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _max_shared() -> int:
    """How many sealed files this process keeps at once: each takes two descriptors (its
    own and its mapping's copy), and all of them a quarter of the process's, so that
    shared inputs never leave it without one for a new worker's socket."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft // 8


def _shared_file(t: Any) -> int | None:
    """The sealed file this process keeps that holds exactly ``t``'s bytes, if any."""
    entry = _SHARED.get(t.data_ptr()) if t.numel() else None
    if entry is None or entry[1] != t.nbytes or entry[2]() is None:
        return None
    return entry[0]


def _unshare(address: int, fd: int) -> None:
    entry = _SHARED.get(address)
    if entry is not None and entry[0] == fd:  # not a later tensor's at the same address
        del _SHARED[address]
    os.close(fd)


@contextlib.contextmanager
def _as_socket(conn: Connection) -> Iterator[socket.socket]:
    """``conn``'s own descriptor as a socket, for the messages that carry descriptors
    (the oracle's guard allows those on its channel's descriptor only); left open."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        yield sock
    finally:
        sock.detach()


def _send_file(conn: Connection, fd: int | None, data: memoryview) -> None:
    """A sealed-file entry's buffer: the file's descriptor or, where there is none or it
    cannot be passed (the user's descriptors in flight at their limit, ETOOMANYREFS), the
    bytes (``_FILE_FOLLOWS`` / ``_BYTES_FOLLOW``)."""
    with _as_socket(conn) as sock:
        if fd is not None:
            try:
                socket.send_fds(sock, [_FILE_FOLLOWS], [fd])
                return
            except OSError as e:
                if e.errno != errno.ETOOMANYREFS:
                    raise
        sock.sendall(_BYTES_FOLLOW)
    conn.send_bytes(data)


def _recv_file(conn: Connection, size: int, *, keep: bool) -> mmap.mmap | bytearray:
    """A sealed-file entry's buffer of ``size`` bytes (``_send_file``): its file, checked
    to be of that size and sealed, mapped copy-on-write (``keep``: see ``_mapped``; with
    no slot left to keep it, its bytes are copied out and no descriptor is held), or the
    bytes the sender sent instead. Anything else is a SpillError."""
    with _as_socket(conn) as sock:
        msg, fds, flags, _ = socket.recv_fds(sock, 1, 1)
    if msg == _FILE_FOLLOWS and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
        os.set_inheritable(fds[0], False)
        _check_sealed(fds[0], size)
        if keep and len(_SHARED) >= _max_shared():
            return _copied(fds[0], size)
        return _mapped(fds[0], size, keep=keep)
    for fd in fds:
        os.close(fd)
    if msg == _BYTES_FOLLOW and not fds:
        return _recv_buffer(conn, size, SpillError)
    if not msg:
        raise EOFError("the channel closed before a sealed file's descriptor")
    raise SpillError(f"a sealed file's descriptor did not come ({msg!r}, "
                     f"{len(fds)} descriptors)")


def _copied(fd: int, size: int) -> bytearray | mmap.mmap:
    """The bytes of the sealed file ``fd`` in a buffer of their own (``fd`` is closed):
    a child that sends many files cannot make the verifier hold a descriptor for each."""
    buf = _zeroed(size)
    view = _mapped(fd, size, keep=False)
    try:
        with memoryview(buf) as dst, memoryview(view) as src:
            dst[:] = src
    finally:
        view.close()
    return buf


def _check_sealed(fd: int, size: int) -> None:
    """Raises SpillError (closing ``fd``) unless ``fd`` is a file of ``size`` bytes that
    nobody can change: sealed against writes (no writable shared mapping of it exists,
    none can be made), shrinking (no mapped page can vanish: a SIGBUS) and growth."""
    try:
        # Seals first: only a memory file has them, and its fstat cannot block.
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
        page = os.fstatvfs(fd).f_bsize
    except OSError as e:
        os.close(fd)
        raise SpillError(f"a sealed file cannot be read: {e}") from e
    why = ""
    if page != mmap.PAGESIZE:  # hugetlbfs: a private mapping would reserve huge pages
        why = f"a sealed file of {page}-byte pages"
    elif not stat.S_ISREG(st.st_mode) or st.st_size != size:
        why = f"a sealed file holds {st.st_size} bytes, announced {size}"
    elif seals & _SEALS != _SEALS:
        why = "a file is not sealed against writes"
    if why:
        os.close(fd)
        raise SpillError(why)


class SpillError(UnreadableReply):
    """A message's spilled buffer is not what its sender announced (a name of another
    pattern, a link, not a regular file, another size), or the receiver takes none."""


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])  # at most ~2 GiB a call on Linux


def _spill_name() -> str:
    return f"spill-{os.getpid()}-{next(_spill_count)}"


def _spill(path: str, data: memoryview) -> bool:
    """Writes ``data`` to the new file ``path``; False (and no file) when it cannot, a
    full tmpfs say: the buffer then goes through the socket after all."""
    try:
        # A container's /dev/shm may hold 64 MB: no write that is bound to fail.
        room = os.statvfs(os.path.dirname(path))
        if room.f_bavail * room.f_frsize < len(data):
            return False
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        _write_all(fd, data)
    except OSError:
        _unlink(path)
        return False
    finally:
        os.close(fd)
    return True


def _unlink(name: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def send(conn: Connection, obj: Any, spill_dir: str | None = None, *,
         spill_min: int = SPILL_MIN_BYTES) -> None:
    """Sends ``obj``: a list that says, per out-of-band buffer, its size, ``("memfd",
    size)`` (a ``share``d tensor's) or ``(file name, size)`` (to be spilled to
    ``spill_dir``, when given, for a buffer of at least ``spill_min`` bytes), then the
    pickle, then per buffer its bytes, its sealed file's descriptor or, once its spill
    file is written, an empty frame (the bytes after all where the file could not be
    written). The receiver reads a file while the next one is written."""
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    pickler = _Pickler(f, protocol=5, buffer_callback=buffers.append)
    pickler.dump(obj)
    sizes: list[int | tuple[str, int]] = []
    sealing = spill_dir is not None and _sealing_works()
    for b in buffers:
        n = memoryview(b).nbytes
        if id(b) in pickler.shared_fds:
            sizes.append((_SHARED_ENTRY, n))
        elif spill_dir is not None and n >= max(spill_min, 1):
            sizes.append((_SHARED_ENTRY, n) if sealing else (_spill_name(), n))
        else:
            sizes.append(n)
    conn.send_bytes(pickle.dumps(sizes))
    conn.send_bytes(f.getbuffer())
    try:
        for b, size in zip(buffers, sizes, strict=True):
            if isinstance(size, tuple) and size[0] == _SHARED_ENTRY:
                kept = pickler.shared_fds.get(id(b))
                fd = kept if kept is not None else _sealed_file(b.raw())
                try:
                    _send_file(conn, fd, b.raw())
                finally:
                    if kept is None and fd is not None:
                        os.close(fd)  # the receiver has its own descriptor now
                continue
            if isinstance(size, tuple):
                assert spill_dir is not None
                if _spill(os.path.join(spill_dir, size[0]), b.raw()):
                    conn.send_bytes(b"")
                    continue
            conn.send_bytes(b.raw())
    except BaseException:
        if spill_dir is not None:  # the receiver has failed too: the files are no one's
            for size in sizes:
                if isinstance(size, tuple) and size[0] != _SHARED_ENTRY:
                    _unlink(os.path.join(spill_dir, size[0]))
        raise


def _sealing_works() -> bool:
    """Whether this host makes sealed memory files (``memfd_create``, Linux 3.17 and up)."""
    global _SEALING
    if _SEALING is None:
        fd = _sealed_file(memoryview(b"x"))
        _SEALING = fd is not None
        if fd is not None:
            os.close(fd)
    return _SEALING


_SEALING: bool | None = None


def _spilled_names(sizes: Any, shared: bool) -> list[str]:
    """The file names of a size list's spilled entries; raises SpillError for an entry of
    any other form, or a sealed file's where ``shared`` is False."""
    if not isinstance(sizes, list):
        raise SpillError(f"the size list is a {type(sizes).__name__}")
    names = []
    for entry in sizes:
        if isinstance(entry, int) and entry >= 0:
            continue
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and entry[1] > 0):
            raise SpillError(f"a spilled entry is not (name, size): {entry!r:.200}")
        if entry[0] == _SHARED_ENTRY:
            if not shared:
                raise SpillError("the message passes a sealed file, but this receiver "
                                 "takes none")
            continue
        if not _SPILL_NAME.fullmatch(entry[0]):
            raise SpillError("a spilled buffer's name is not of the spill pattern: "
                             f"{entry[0]!r:.200}")
        names.append(entry[0])
    if len(set(names)) < len(names):
        raise SpillError("a spilled buffer's name comes twice")
    total = sum(e if isinstance(e, int) else e[1] for e in sizes)
    if total > _MAX_MESSAGE_BYTES:
        # Each announced buffer is allocated before its bytes come: a child that announced
        # more than the host holds would have the verifier killed for memory.
        raise UnreadableReply(f"the message announces {total} bytes of buffers, more than "
                              f"a message may hold ({_MAX_MESSAGE_BYTES})")
    return names


def _zeroed(n: int) -> bytearray | mmap.mmap:
    """``n`` writable bytes for a received buffer: private memory with transparent huge
    pages where the host gives them, as a faulting 4 KiB page at a time took most of a
    read (1 GiB from /dev/shm on this project's 2-core VM: 1.2–3.2 s into a bytearray,
    0.15–0.26 s so). No room is a MemoryError, as a bytearray's would be (an mmap's is an
    OSError, which a channel's reader takes for its peer's end)."""
    if n < _HUGE:
        return bytearray(n)
    try:
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"no room for a buffer of {n} bytes: {e}") from e
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # 4 KiB pages then, as a bytearray's
    return m


def _read_spilled(dir_fd: int, name: str, buf: bytearray | mmap.mmap) -> None:
    """Reads the spilled file ``name`` (of the pattern) in the folder ``dir_fd`` into
    ``buf``, which it must fill exactly, and removes it."""
    try:
        # O_NOFOLLOW: a link in the file's place is refused; O_NONBLOCK: a FIFO there
        # cannot hang the receiver (it is refused as not a regular file below).
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise SpillError(f"spilled buffer {name}: cannot open it ({why})") from e
    size = len(buf)
    try:
        _unlink(name, dir_fd)  # gone whatever happens next; the descriptor keeps the bytes
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpillError(f"spilled buffer {name} is not a regular file")
        if st.st_size != size:
            raise SpillError(f"spilled buffer {name} holds {st.st_size} bytes, "
                             f"announced {size}")
        # A copy, not a mapping of the file: the child could still hold the file open and
        # shorten it, and a mapped page past the end kills the reader (SIGBUS).
        try:
            _read_body(fd, buf, size)
        except EOFError as e:  # shortened by the child after the check above
            raise SpillError(f"spilled buffer {name} {e}") from e
    finally:
        os.close(fd)


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the channel closed inside a frame's header")
        out += chunk
    return out


def _recv_frame_into(conn: Connection, buf: bytearray | mmap.mmap) -> int:
    """``conn.recv_bytes_into(buf)`` without its copy: multiprocessing reads a whole frame
    into a BytesIO and only then copies it into ``buf``, so a receiver held every buffer
    twice for a moment (on the H200 an 8 GiB input set made a candidate's worker hold
    16.2 GiB, past its allowance, and an honest kernel got ``out_of_memory``). This reads
    the frame's header (``Connection``'s own: a 4-byte size, or -1 and an 8-byte one) and
    then its bytes straight into ``buf``; ``Connection`` keeps no read-ahead, so the two
    stay in step. A frame larger than ``buf`` raises BufferTooShort before its bytes are
    read (the channel is then out of step: the caller kills the sender)."""
    fd = conn.fileno()
    size = _frame_size(fd)
    if size > len(buf):
        raise BufferTooShort(f"a frame of {size} bytes for a buffer of {len(buf)}")
    _read_body(fd, buf, size)
    return size


def _recv_frame(conn: Connection, limit: int) -> bytearray:
    """The next frame's bytes; a frame announced larger than ``limit`` is an
    UnreadableReply before anything is allocated for it (``conn.recv_bytes()`` would take
    whatever a child announces)."""
    fd = conn.fileno()
    size = _frame_size(fd)
    if size > limit:
        raise UnreadableReply(f"a message frame of {size} bytes, more than the {limit} "
                              "a message's pickle may hold")
    buf = bytearray(size)
    _read_body(fd, buf, size)
    return buf


def _frame_size(fd: int) -> int:
    """The size in a frame's header (``Connection``'s: a 4-byte size, or -1 and an
    8-byte one)."""
    size: int = struct.unpack("!i", _read_exactly(fd, 4))[0]
    if size == -1:
        size = struct.unpack("!Q", _read_exactly(fd, 8))[0]
    if size < 0:
        raise UnreadableReply(f"a frame's header says {size} bytes")
    return size


def _read_body(fd: int, buf: bytearray | mmap.mmap, size: int) -> None:
    """Reads ``size`` bytes from ``fd`` into the start of ``buf``, a chunk at a time; an
    end before them is an EOFError."""
    with memoryview(buf) as view:  # released: an mmap with a view cannot be freed
        done = 0
        while done < size:
            n = os.readv(fd, [view[done:min(size, done + _CHUNK)]])
            if n == 0:
                raise EOFError(f"ended after {done} of {size} bytes")
            done += n


def recv(conn: Connection, spill_dir: str | None = None, *, trusted: bool = False,
         files: bool = False) -> Any:
    """Receives what ``send`` sent; spilled buffers are read from ``spill_dir`` and their
    files removed (on a failure too). A spilled buffer with no ``spill_dir``, or one not
    as announced, raises SpillError; the channel is then out of step (kill the sender).
    ``trusted``: the message is the verifier's own (a child reading its requests); else
    it may name no code (``_ReplyUnpickler``), or it raises UnreadableReply. ``files``:
    sealed files are taken from this sender (a worker's big outputs) though it has no
    spill folder; each is checked as any (``_check_sealed``)."""
    sizes = _loads(_recv_frame(conn, _MAX_PICKLE_BYTES), trusted)
    # Sealed files: in the verifier's requests, from a child it gave a spill folder, and
    # from a worker (``files``).
    names = _spilled_names(sizes, shared=trusted or files or spill_dir is not None)
    dir_fd = None
    if names:
        if spill_dir is None:
            raise SpillError(f"the message spilled {len(names)} buffer(s) to files, but "
                             "this receiver takes none")
        try:
            dir_fd = os.open(spill_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                             | os.O_CLOEXEC)
        except OSError as e:
            raise SpillError(f"the spill folder cannot be opened: {e}") from e
    try:
        head = _recv_frame(conn, _MAX_PICKLE_BYTES)
        bufs: list[bytearray | mmap.mmap] = []
        for n in sizes:
            if isinstance(n, tuple) and n[0] == _SHARED_ENTRY:
                # The verifier keeps a child's files: an input set's go on to workers.
                bufs.append(_recv_file(conn, n[1], keep=not trusted))
                continue
            if isinstance(n, tuple):
                assert dir_fd is not None
                bufs.append(_spilled_or_inline(conn, dir_fd, *n))
                continue
            bufs.append(_recv_buffer(conn, n, UnreadableReply))
        return _loads(head, trusted, bufs)
    except BaseException:
        if dir_fd is not None:
            for name in names:  # those read are gone already
                _unlink(name, dir_fd)
        raise
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def _recv_buffer(conn: Connection, size: int,
                 error: type[UnreadableReply]) -> bytearray | mmap.mmap:
    """The next frame's bytes in a buffer of their own, announced as ``size`` bytes; a
    frame of another size raises ``error``."""
    buf = _zeroed(size)
    try:
        got = _recv_frame_into(conn, buf)
    except BufferTooShort as e:
        raise error(f"more bytes came than announced ({size})") from e
    if got != size:
        raise error(f"a buffer of {got} bytes came, announced {size}")
    return buf


def _spilled_or_inline(conn: Connection, dir_fd: int, name: str,
                       size: int) -> bytearray | mmap.mmap:
    """A spilled entry's bytes: from its file once the sender says it is written (an
    empty frame), or the frame's where the sender could not write the file."""
    buf = _zeroed(size)
    try:
        got = _recv_frame_into(conn, buf)
    except BufferTooShort as e:
        raise SpillError(f"spilled buffer {name}: more bytes came than announced "
                         f"({size})") from e
    if got == 0:
        _read_spilled(dir_fd, name, buf)
    elif got != size:
        raise SpillError(f"spilled buffer {name}: {got} bytes came, announced {size}")
    return buf


def spill_folder(private: str, jailed: bool) -> str:
    """A new folder for a child's spilled buffers: under /dev/shm (RAM) where it is
    writable and the child sees the host's (not in the jail, which mounts a fresh one),
    else inside the child's private folder. Named after this verifier (``reap_left_behind``)."""
    if not jailed and os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK):
        try:
            return tempfile.mkdtemp(prefix=f"kz-spill-{_verifier_tag()}", dir=SHM)
        except OSError:
            pass
    path = os.path.join(private, "spill")
    os.mkdir(path, 0o700)
    return path


def _verifier_tag() -> str:
    pid = os.getpid()
    return f"{pid}-{lifeline.start_time(pid)}-"


def reap_left_behind(*roots: str) -> list[str]:
    """Removes the folders under ``roots`` (default: /dev/shm and the temporary directory)
    that verifiers now gone made for their children, and returns their paths: a killed
    verifier leaves its children's spill folders (RAM, on tmpfs) and private folders."""
    removed: list[str] = []
    for root in roots or (SHM, tempfile.gettempdir()):
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            m = _LEFT_BEHIND.fullmatch(entry.name)
            if m is None or lifeline.start_time(int(m[1])) == int(m[2]):
                continue  # not such a folder, or its verifier is alive (this one included)
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


class Child:
    """One child process and its channel. Not thread-safe: one call at a time."""

    def __init__(self, module: str, args: list[str], *, env: dict[str, str] | None = None,
                 isolate: bool = True, strong: bool = False, gated: bool = False,
                 start_timeout_s: float = 180.0, gpu: bool = False,
                 read_only: tuple[str, ...] = (), spill: bool = False,
                 files: bool = False, oom_score_adj: int | None = None,
                 handles_on: str | None = None) -> None:
        """``strong`` asks for the jail (``_sandbox.isolation``), else a network namespace;
        ``gpu`` shows the jailed child the NVIDIA device nodes, ``read_only`` more paths.
        ``spill`` gives the child a folder for its replies' big buffers (``spill_folder``),
        named by ``KZ_SPILL_DIR``: only for a child that runs no candidate code. ``files``
        takes sealed memory files from the child without a folder (``recv``): a worker's
        big outputs, checked as any (``_check_sealed``), nothing named by path.
        ``oom_score_adj`` (up to 1000) makes the kernel's OOM killer take the child, and
        what it starts, before the verifier when the host runs out of memory.
        ``handles_on`` (a device): the child's replies may name device memory by CUDA IPC
        handle (``_device_ipc.Exported``), which ``call`` copies onto that device."""
        self.private = tempfile.mkdtemp(prefix=f"kz-child-{_verifier_tag()}")
        self.handles_on = handles_on
        self.handles_copied = 0  # outputs this child's replies named by handle
        work = os.path.join(self.private, "work")
        os.mkdir(work)
        self.isolation = isolation(strong) if isolate else Isolation("none")
        self.spill_dir = spill_folder(self.private, self.isolation.level == "jail") \
            if spill else None
        self.files = files
        parent_sock, child_sock = socket.socketpair()
        self.conn = Connection(os.dup(parent_sock.fileno()))
        parent_sock.close()
        self._stderr_path = os.path.join(self.private, "stderr.log")
        cmd = jail_command([sys.executable, "-m", module, str(child_sock.fileno()), *args],
                           self.private, self.isolation, gpu=gpu, read_only=read_only,
                           cwd=work)
        if oom_score_adj is not None:
            # Set by a shell that then becomes the command, so that every process of the
            # child inherits it from the start (raising one's own score needs no privilege).
            cmd = ["/bin/sh", "-c", f'echo {int(oom_score_adj)} > /proc/self/oom_score_adj '
                   '2>/dev/null; exec "$@"', "kz-child", *cmd]
        e = child_env(self.private, env)
        e["KZ_PRIVATE_DIR"] = self.private
        if self.spill_dir is not None:
            e["KZ_SPILL_DIR"] = self.spill_dir
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
        # The least time a reply that has begun gets to end (``_recv_begun``).
        self.reply_grace_s = 300.0

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
        if self.handles_on is not None:
            import torch

            from kz_stream.verify._device_ipc import DeviceIpcError, opened_copies

            try:
                reply, named = opened_copies(reply, self.handles_on)
                self.handles_copied += named
            except DeviceIpcError as e:
                if self.proc.poll() is not None:  # it died after replying: its own end
                    raise ChildDied(f"child exited (code {self.proc.returncode}) before "
                                    f"its outputs were copied: {e}", self.stderr_tail(),
                                    self.proc.returncode) from e
                # The driver would not open a live worker's handle: the verifier's failure.
                return _copy_failed(reply, "output_handle",
                                    f"an output's device handle could not be read: "
                                    f"{error_text(e)}")
            except torch.OutOfMemoryError as e:  # the verifier's copy found no room
                return _copy_failed(reply, "output_copy_oom",
                                    f"the device had no room for the verifier's copy of an "
                                    f"output: {error_text(e)}")
            except ValueError as e:  # an export no harness writes: a malformed reply
                self.kill()
                raise ChildDied(f"the child's reply is unreadable: {e}", self.stderr_tail(),
                                self.proc.returncode) from e
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
                    return self._recv_begun(timeout_s)
            except ChildTimeout:  # an OSError too
                raise
            except UnreadableReply as e:
                self.kill()  # the rest of the message is still in the channel
                raise ChildDied(f"the child's reply is unreadable: {e}", self.stderr_tail(),
                                self.proc.returncode) from e
            except (EOFError, ConnectionResetError, OSError) as e:
                rc = self.proc.poll()
                self.kill()
                raise ChildDied(f"child exited (code {rc})", self.stderr_tail(), rc) from e
            if self.proc.poll() is not None:
                # Drain a reply written just before exit.
                if self.conn.poll(0):
                    try:
                        return recv(self.conn, self.spill_dir, files=self.files)
                    except (EOFError, OSError, UnreadableReply):
                        pass
                rc = self.proc.returncode
                self.kill()
                raise ChildDied(f"child exited (code {rc})", self.stderr_tail(), rc)

    def _recv_begun(self, timeout_s: float) -> Any:
        """Reads a message whose first bytes are here. A child that stops in the middle of
        one (candidate code can write to the socket) would block the read for good, so its
        process group is killed if the rest has not come within another ``timeout_s``, and
        at least ``reply_grace_s`` (not the call's deadline: an honest reply of many GB
        takes tens of seconds on the socket, and was never cut before)."""
        grace = max(timeout_s, self.reply_grace_s)
        stalled = threading.Event()

        def stop() -> None:
            stalled.set()
            kill_group(self.proc.pid)  # the read then ends with EOF

        timer = threading.Timer(grace, stop)
        timer.daemon = True
        timer.start()
        try:
            return recv(self.conn, self.spill_dir, files=self.files)
        except (EOFError, OSError, UnreadableReply) as e:
            if not stalled.is_set():
                raise
            self.kill()
            raise ChildTimeout(f"the answer stopped midway: not whole {grace:g} s after "
                               "it began") from e
        finally:
            timer.cancel()

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
        """Kills the process group and removes the private directory and the spill
        folder."""
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
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
