"""The verifier's channel to its children: tensors arrive byte for byte, inline or through
spill files; the receiver reads a spill file only as announced and leaves none behind."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import mmap
import os
import pickle
import socket
import struct
import threading
import time
import tracemalloc
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from kz_stream.verify import VerifierConfig
from kz_stream.verify import _ipc as ipc
from kz_stream.verify._ipc import SpillError, reap_left_behind, recv, send
from kz_stream.verify._lifeline import start_time
from kz_stream.verify._messages import PrepareRequest
from kz_stream.verify._pool import Lane
from kz_stream.verify._sandbox import isolation

# Small enough that the tests' tensors of a few KB spill.
SMALL = 1024


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    a, b = socket.socketpair()
    ends = Connection(os.dup(a.fileno())), Connection(os.dup(b.fileno()))
    a.close()
    b.close()
    yield ends
    for end in ends:
        end.close()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A spill folder, on a host as if it made no sealed memory files: big buffers then
    go through files of the folder."""
    monkeypatch.setattr(ipc, "_SEALING", False)
    d = tmp_path / "spill"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def sealing_folder(tmp_path: Path) -> Path:
    """A spill folder on this host, which makes sealed memory files: big buffers go as
    those."""
    assert ipc._sealing_works()
    d = tmp_path / "spill"
    d.mkdir(mode=0o700)
    return d


def tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 48, generator=g)
    return {
        "f32": torch.randn(37, 29, generator=g),
        "f64": torch.randn(513, generator=g, dtype=torch.float64),
        "bf16": torch.randn(8, 300, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (3, 5, 70), generator=g),
        "u8": torch.randint(0, 256, (2000,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(41, 43, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "strided": big.t(),  # not contiguous
        "sliced": big[::3, 5:40],
        "list": [torch.arange(600, dtype=torch.int32), "text", 7],
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.contiguous().view(-1).view(torch.uint8).tolist()
                == b.contiguous().view(-1).view(torch.uint8).tolist())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def spill_one(pair: tuple[Connection, Connection], folder: Path,
              t: torch.Tensor | None = None) -> str:
    """Sends one spilled tensor; returns its file's name (the message waits unread)."""
    send(pair[0], {"t": torch.ones(SMALL) if t is None else t}, str(folder), spill_min=SMALL)
    (name,) = os.listdir(folder)
    return name


def forge(conn: Connection, sizes: list[Any], frame: bytes = b"") -> None:
    """A message whose size list says ``sizes``, from a sender that lies; ``frame`` stands
    for each spilled buffer (empty: "its file is written")."""
    conn.send_bytes(pickle.dumps(sizes))
    conn.send_bytes(pickle.dumps([pickle.PickleBuffer(bytearray(8))] * len(sizes),
                                 protocol=5))
    for size in sizes:
        conn.send_bytes(frame if isinstance(size, tuple) else b"x" * size)


def test_tensors_arrive_byte_identical_inline(pair: tuple[Connection, Connection]) -> None:
    msg = tensors()
    send(pair[0], msg)
    assert same(msg, recv(pair[1]))


def test_tensors_arrive_byte_identical_through_spill_files(
        pair: tuple[Connection, Connection], folder: Path) -> None:
    msg = tensors()
    send(pair[0], msg, str(folder), spill_min=SMALL)
    assert len(os.listdir(folder)) >= 6  # the buffers of at least SMALL bytes
    assert same(msg, recv(pair[1], str(folder)))
    assert os.listdir(folder) == []


def test_spill_files_are_private_to_their_owner(pair: tuple[Connection, Connection],
                                                folder: Path) -> None:
    name = spill_one(pair, folder)
    assert (folder / name).stat().st_mode & 0o777 == 0o600


def test_small_buffers_stay_on_the_socket(pair: tuple[Connection, Connection],
                                          folder: Path) -> None:
    msg = {"t": torch.ones(16)}
    send(pair[0], msg, str(folder))
    assert os.listdir(folder) == []
    assert same(msg, recv(pair[1], str(folder)))


def test_a_spilled_entry_needs_a_receiver_folder(pair: tuple[Connection, Connection],
                                                 folder: Path) -> None:
    spill_one(pair, folder)
    with pytest.raises(SpillError, match="takes none"):
        recv(pair[1])


@pytest.mark.parametrize("name", ["../spill-1-1", "sub/spill-1-1", "spill-1-1/..",
                                  "/etc/passwd", "spill-1-1\n", ".."])
def test_a_name_off_the_pattern_is_refused(pair: tuple[Connection, Connection],
                                           folder: Path, name: str) -> None:
    forge(pair[0], [(name, 8)])
    with pytest.raises(SpillError, match="not of the spill pattern"):
        recv(pair[1], str(folder))


def test_a_symlink_in_place_of_the_file_is_refused(pair: tuple[Connection, Connection],
                                                   folder: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 8)
    (folder / "spill-1-1").symlink_to(secret)
    forge(pair[0], [("spill-1-1", 8)])
    with pytest.raises(SpillError, match="symbolic link"):
        recv(pair[1], str(folder))
    assert secret.read_bytes() == b"s" * 8 and os.listdir(folder) == []


def test_a_fifo_in_place_of_the_file_is_refused_without_blocking(
        pair: tuple[Connection, Connection], folder: Path) -> None:
    os.mkfifo(folder / "spill-1-1")
    forge(pair[0], [("spill-1-1", 8)])
    with pytest.raises(SpillError, match="not a regular file"):
        recv(pair[1], str(folder))


def test_a_size_other_than_announced_is_refused(pair: tuple[Connection, Connection],
                                                folder: Path) -> None:
    (folder / "spill-1-1").write_bytes(b"x" * 7)
    forge(pair[0], [("spill-1-1", 8)])
    with pytest.raises(SpillError, match="holds 7 bytes, announced 8"):
        recv(pair[1], str(folder))
    assert os.listdir(folder) == []


@pytest.mark.parametrize("frame", [b"x" * 16, b"x" * 4])
def test_an_inline_buffer_of_another_size_than_announced_is_refused(
        pair: tuple[Connection, Connection], frame: bytes) -> None:
    pair[0].send_bytes(pickle.dumps([8]))
    pair[0].send_bytes(pickle.dumps([pickle.PickleBuffer(bytearray(8))], protocol=5))
    pair[0].send_bytes(frame)
    with pytest.raises(ipc.UnreadableReply, match=r"announced \(?8"):
        recv(pair[1])


def test_a_received_buffer_is_read_into_its_tensor_without_a_copy(
        pair: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch) -> None:
    # multiprocessing's recv_bytes_into holds a whole frame in a BytesIO before copying
    # it: an 8 GiB input set was held twice by the worker that received it.
    made: list[Any] = []

    def recorded(n: int) -> Any:
        made.append(real(n))
        return made[-1]

    real = ipc._zeroed
    monkeypatch.setattr(ipc, "_zeroed", recorded)
    n = 32 << 20
    t = torch.arange(n // 8, dtype=torch.int64)
    sender = threading.Thread(target=send, args=(pair[0], {"t": t}))
    sender.start()
    tracemalloc.start()
    try:
        got = recv(pair[1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sender.join()
    assert torch.equal(got["t"], t)
    assert peak < n // 8, f"receiving {n} bytes allocated {peak} on the Python heap"
    # The tensor is the buffer the bytes were read into, not a copy of it.
    (buf,) = made
    view = (ctypes.c_char * n).from_buffer(buf)
    assert got["t"].untyped_storage().data_ptr() == ctypes.addressof(view)
    del view


@pytest.mark.parametrize("where", ["size list", "pickle"])
def test_a_message_frame_announced_past_the_limit_is_refused_unread(
        pair: tuple[Connection, Connection], where: str) -> None:
    if where == "pickle":
        pair[0].send_bytes(pickle.dumps([]))
    # A header of 2**40 bytes (-1, then the 8-byte size), and no bytes after it.
    os.write(pair[0].fileno(), struct.pack("!i", -1) + struct.pack("!Q", 1 << 40))
    with pytest.raises(ipc.UnreadableReply, match="more than the"):
        recv(pair[1])


def test_a_buffer_that_does_not_fit_is_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(ipc.mmap, "mmap", no_room)
    with pytest.raises(MemoryError, match="no room for a buffer"):
        ipc._zeroed(64 << 20)


def test_a_missing_file_is_refused(pair: tuple[Connection, Connection],
                                   folder: Path) -> None:
    forge(pair[0], [("spill-1-1", 8)])
    with pytest.raises(SpillError, match="cannot open"):
        recv(pair[1], str(folder))


@pytest.mark.parametrize("entry", [("spill-1-1", -8), ("spill-1-1", 0), ("spill-1-1",),
                                   ["spill-1-1", 8], (b"spill-1-1", 8)])
def test_a_malformed_entry_is_refused(pair: tuple[Connection, Connection], folder: Path,
                                      entry: Any) -> None:
    pair[0].send_bytes(pickle.dumps([entry]))
    with pytest.raises(SpillError, match="not \\(name, size\\)"):
        recv(pair[1], str(folder))


def test_a_failed_message_leaves_none_of_its_files(pair: tuple[Connection, Connection],
                                                   folder: Path) -> None:
    # Two good files, then one that is not as announced: all three go.
    for name in ("spill-1-1", "spill-1-2"):
        (folder / name).write_bytes(b"x" * 8)
    (folder / "spill-1-3").write_bytes(b"x" * 9)
    (folder / "spill-1-4").write_bytes(b"x" * 8)  # not in the message: stays
    forge(pair[0], [("spill-1-1", 8), ("spill-1-3", 8), ("spill-1-2", 8)])
    with pytest.raises(SpillError):
        recv(pair[1], str(folder))
    assert os.listdir(folder) == ["spill-1-4"]


def test_a_buffer_that_cannot_be_spilled_goes_through_the_socket(
        pair: tuple[Connection, Connection], folder: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full tmpfs, say: the sender announced a file, and sends the bytes instead."""
    monkeypatch.setattr(ipc, "_spill", lambda path, data: False)
    msg = {"t": torch.arange(SMALL), "u": torch.ones(SMALL * 8, dtype=torch.bool)}
    send(pair[0], msg, str(folder), spill_min=SMALL)
    assert same(msg, recv(pair[1], str(folder)))


def test_more_bytes_than_announced_are_refused(pair: tuple[Connection, Connection],
                                               folder: Path) -> None:
    forge(pair[0], [("spill-1-1", 8)], frame=b"x" * 9)
    with pytest.raises(SpillError, match="more bytes came than announced"):
        recv(pair[1], str(folder))


def test_a_name_announced_twice_is_refused(pair: tuple[Connection, Connection],
                                           folder: Path) -> None:
    forge(pair[0], [("spill-1-1", 8), ("spill-1-1", 8)])
    with pytest.raises(SpillError, match="comes twice"):
        recv(pair[1], str(folder))


def test_folders_of_gone_verifiers_are_reaped(tmp_path: Path) -> None:
    gone = tmp_path / "kz-spill-999999999-1-abc"  # no such pid
    gone_child = tmp_path / "kz-child-999999999-1-def"
    mine = tmp_path / f"kz-spill-{os.getpid()}-{start_time(os.getpid())}-x"
    mine_child = tmp_path / f"kz-child-{os.getpid()}-{start_time(os.getpid())}-y"
    other = tmp_path / "kz-child-123"
    for d in (gone, gone_child, mine, mine_child, other):
        d.mkdir()
    (gone / "spill-1-1").write_bytes(b"x")
    assert sorted(reap_left_behind(str(tmp_path))) == sorted([str(gone), str(gone_child)])
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, mine_child.name, other.name])


def test_a_childs_private_folder_is_named_after_its_verifier() -> None:
    child = ipc.Child("kz_stream.verify._oracle", ["cpu"], isolate=False)
    try:
        name = os.path.basename(child.private)
        assert name.startswith(f"kz-child-{os.getpid()}-{start_time(os.getpid())}-")
        assert reap_left_behind(os.path.dirname(child.private)).count(child.private) == 0
    finally:
        child.kill()


def test_only_a_spill_child_gets_a_folder_and_it_goes_with_the_child() -> None:
    plain = ipc.Child("kz_stream.verify._oracle", ["cpu"], isolate=False)
    spilling = ipc.Child("kz_stream.verify._oracle", ["cpu"], isolate=False, spill=True)
    try:
        assert plain.spill_dir is None
        assert spilling.spill_dir is not None and os.path.isdir(spilling.spill_dir)
        if os.access(ipc.SHM, os.W_OK):
            assert spilling.spill_dir.startswith(ipc.SHM + "/kz-spill-")
    finally:
        plain.kill()
        spilling.kill()
    assert not os.path.exists(spilling.spill_dir)


def test_a_jailed_childs_folder_is_in_its_private_folder(tmp_path: Path) -> None:
    assert ipc.spill_folder(str(tmp_path), jailed=True) == str(tmp_path / "spill")
    assert (tmp_path / "spill").stat().st_mode & 0o777 == 0o700


RELU = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(2048, 2100)]  # 17.2 MB, past SPILL_MIN_BYTES (16.8 MB)

def get_init_inputs():
    return []
"""


PREPARE: PrepareRequest = {"cmd": "prepare", "source": RELU, "key": "relu-spill" * 4,
                           "seed": 1, "small_only": False, "full_set_budget": 0}


def count_spill_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the spill files the verifier's side reads from now on."""
    read: list[str] = []
    real = ipc._read_spilled

    def counted(dir_fd: int, name: str, size: int) -> bytearray:
        read.append(name)
        return real(dir_fd, name, size)

    monkeypatch.setattr(ipc, "_read_spilled", counted)
    return read


JAIL = pytest.mark.skipif(isolation().level != "jail", reason="this host allows no "
                          f"filesystem boundary: {isolation().describe()}")


@JAIL
def test_the_oracle_replies_through_sealed_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real oracle child, started as the verifier starts it, on a problem whose float64
    input passes the threshold: its big buffers come as sealed memory files, mapped here
    (the oracle's guard lets it pass them on its channel), and no spill file is made."""
    read = count_spill_reads(monkeypatch)
    lane = Lane(VerifierConfig(devices=[], oracle_spill=True), None)
    try:
        reply = asyncio.run(lane.oracle_call(PREPARE, 300))
        assert reply["ok"], reply
        assert len(lane.oracles) == 1 and lane.oracles[0].spill_dir is not None
        spill_dir = lane.oracles[0].spill_dir
        own = next(s for s in reply["sets"] if s["label"] == "own")
        # Each full-size set's input and its float64 and honest outputs.
        full = [s for s in reply["sets"] if s["inputs"][0].numel() == 2048 * 2100]
        assert len(full) >= 3 and not read and os.listdir(spill_dir) == []
        for s in full:
            for t in (s["inputs"][0], s["expected"][0], s["honest"][0]):
                assert mapped_from(t).startswith("/memfd:kz-sealed")
        assert own["expected"][0].dtype == torch.float64
        assert torch.equal(own["expected"][0], torch.relu(own["inputs"][0].double()))
    finally:
        lane.close()
    assert not os.path.exists(spill_dir)


def prepared_own_set(config: VerifierConfig, source: str, key: str) -> dict[str, Any]:
    """The own input set of ``source`` as a real oracle child prepares it."""
    lane = Lane(config, None)
    try:
        reply = asyncio.run(lane.oracle_call({**PREPARE, "source": source, "key": key}, 300))
        assert reply["ok"], reply
        own: dict[str, Any] = next(s for s in reply["sets"] if s["label"] == "own")
        return own
    finally:
        lane.close()


@JAIL
def test_the_oracle_replies_with_big_weights_in_sealed_files() -> None:
    """A model's big weights come as sealed files, as its big inputs do: each candidate's
    worker is then handed the file, not the bytes (``held_after_preparation`` counts no
    weights per candidate)."""
    linear = RELU.replace("return torch.relu(x)", "return self.fc(x)").replace(
        "class Model(nn.Module):\n", "class Model(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(2100, 2048)  # a 17.2 MB weight\n").replace(
        "torch.randn(2048, 2100)", "torch.randn(4, 2100)")
    own = prepared_own_set(VerifierConfig(devices=[], oracle_spill=True), linear,
                           "linear-weights" * 3)
    assert mapped_from(own["state_dict"]["fc.weight"]).startswith("/memfd:kz-sealed")
    assert own["state_dict"]["fc.bias"].numel() == 2048  # small: plain bytes


def test_a_loss_run_on_the_host_keeps_its_value_not_its_elementwise_buffer() -> None:
    # smooth_l1_loss's 0-dim output views a buffer as large as its inputs; a set holding
    # it counted (and held) that buffer too, and the memory plan shrank the other sets.
    loss = RELU.replace("return torch.relu(x)",
                        "return torch.nn.functional.smooth_l1_loss(x, y)").replace(
        "def forward(self, x):", "def forward(self, x, y):").replace(
        "return [torch.randn(2048, 2100)]",
        "return [torch.randn(2048, 2100), torch.randn(2048, 2100)]")
    own = prepared_own_set(VerifierConfig(devices=[]), loss, "loss-buffer" * 4)
    assert own["expected"][0].dim() == 0
    assert own["bytes"] == 2 * 2048 * 2100 * 4 + 8 + 4  # inputs, the float64 and honest value


@pytest.mark.parametrize("config", [
    # Unjailed workers share the verifier's uid and /dev/shm: spilled answers would be
    # theirs to read.
    VerifierConfig(devices=[], strong_isolation=False, oracle_spill=True),
    VerifierConfig(devices=[], oracle_spill=False),
], ids=["outside_the_jail", "turned_off"])
def test_the_oracle_replies_on_the_socket(config: VerifierConfig) -> None:
    lane = Lane(config, None)
    try:
        reply = asyncio.run(lane.oracle_call(PREPARE, 300))
        assert reply["ok"], reply
        assert len(lane.oracles) == 1 and lane.oracles[0].spill_dir is None
    finally:
        lane.close()


@JAIL
def test_a_jailed_child_spills_into_its_private_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jail mounts a fresh /dev/shm, so a jailed child's folder (for hosts without
    sealed files) is in its scratch, which it sees at the same path; its sealed files
    come through the jail."""
    read = count_spill_reads(monkeypatch)
    child = ipc.Child("kz_stream.verify._oracle", ["cpu"], strong=True, spill=True)
    try:
        assert child.strong and child.spill_dir == os.path.join(child.private, "spill")
        reply = child.call(PREPARE, 300)
        assert reply["ok"], reply
        assert not read and os.listdir(child.spill_dir) == []
        assert mapped_from(reply["sets"][0]["inputs"][0]).startswith("/memfd:kz-sealed")
    finally:
        child.kill()


def test_a_child_that_lies_about_a_spill_file_is_killed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    child = ipc.Child("tests.verify.spill_liar", [str(secret)], isolate=False, spill=True)
    assert child.spill_dir is not None
    with pytest.raises(ipc.ChildDied, match=r"reply is unreadable: .*symbolic link"):
        child.call(PREPARE, 60)
    assert not child.alive and not os.path.exists(child.spill_dir)
    assert secret.read_bytes() == b"s" * 64


def test_a_child_that_stops_midway_through_its_reply_is_killed_as_a_timeout() -> None:
    child = ipc.Child("tests.verify.midway_staller", [], isolate=False)
    child.reply_grace_s = 0  # the call's own 2 s, not the default 300 s
    started = time.monotonic()
    with pytest.raises(ipc.ChildTimeout, match="stopped midway"):
        child.call(PREPARE, 2)
    assert time.monotonic() - started < 60  # not the staller's 600 s
    assert not child.alive and not os.path.exists(child.private)


def test_a_reply_that_names_code_is_refused_and_never_run(tmp_path: Path) -> None:
    # Candidate code in a worker can write to its end of the socket (the fd is in argv).
    planted = tmp_path / "planted"
    child = ipc.Child("tests.verify.pickle_liar", [str(planted)], isolate=False)
    with pytest.raises(ipc.ChildDied, match=r"reply is unreadable: the message names "
                                            r"(posix|os)\.mkdir"):
        child.call(PREPARE, 60)
    assert not child.alive and not planted.exists()


def test_a_reply_may_hold_data_tensors_and_dtypes_but_no_other_global(
    pair: tuple[Connection, Connection],
) -> None:
    import numpy as np

    parent, child = pair
    reply = {"t": torch.arange(6).reshape(2, 3), "dtype": torch.float16, "size": torch.Size([2]),
             "n": np.float64(1.5), "a": np.arange(3), "c": 1 + 2j, "s": {1, 2}}
    send(child, reply)
    got = recv(parent)
    assert torch.equal(got["t"], reply["t"]) and got["dtype"] is torch.float16
    assert (got["size"], got["n"], got["c"], got["s"]) == (torch.Size([2]), 1.5, 1 + 2j, {1, 2})
    assert list(got["a"]) == [0, 1, 2]
    # A tensor whose dtype names another attribute of torch (a function) is refused too.
    child.send_bytes(pickle.dumps([]))
    child.send_bytes(pickle.dumps(_TensorOfDtype("load"), protocol=5))
    with pytest.raises(ipc.UnreadableReply, match="dtype 'load'"):
        recv(parent)


class _TensorOfDtype:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def __reduce__(self) -> tuple[Any, ...]:
        return ipc._rebuild_tensor, (b"", self.dtype, (0,))


def test_a_message_that_announces_more_than_the_host_holds_is_refused_unallocated(
    pair: tuple[Connection, Connection],
) -> None:
    parent, child = pair
    child.send_bytes(pickle.dumps([ipc._MAX_MESSAGE_BYTES, 1]))  # then nothing
    with pytest.raises(ipc.UnreadableReply, match=r"announces .* more than a message may hold"):
        recv(parent)


def _oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


async def test_the_oom_killer_takes_workers_then_oracles_before_the_verifier() -> None:
    from kz_stream.verify._pool import ORACLE_OOM_SCORE_ADJ, WORKER_OOM_SCORE_ADJ

    lane = Lane(VerifierConfig(devices=[], prewarm=0), None)
    try:
        reply = await lane.oracle_call(PREPARE, 300)
        assert reply["ok"], reply
        worker = await lane.take_worker()
        oracle_tree = ipc.tree_pids(lane.oracles[0].proc.pid)
        worker_tree = ipc.tree_pids(worker.proc.pid)
        assert len(worker_tree) >= 1 and len(oracle_tree) >= 1
        assert {_oom_score_adj(p) for p in oracle_tree} == {ORACLE_OOM_SCORE_ADJ}
        assert {_oom_score_adj(p) for p in worker_tree} == {WORKER_OOM_SCORE_ADJ}
        assert _oom_score_adj(os.getpid()) < ORACLE_OOM_SCORE_ADJ < WORKER_OOM_SCORE_ADJ
    finally:
        lane.close()


def test_tree_memory_counts_a_forked_childs_shared_pages_once() -> None:
    """PSS, not RSS: a child forked from a process holding 256 MiB shares its pages, so
    the pair holds about 256 MiB, not twice that."""
    import subprocess
    import sys

    code = ("import os, time\nb = bytearray(256 << 20)\nfor i in range(0, len(b), 4096):\n"
            "    b[i] = 1\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\n"
            "print('ready', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert len(ipc.tree_pids(proc.pid)) == 2
        held = ipc.tree_memory(proc.pid)
        assert 256 << 20 <= held < 400 << 20, held / 2**20
        # Within a bound, the RSS sum: an upper bound that counts the shared pages twice;
        # past it, the PSS again.
        assert ipc.tree_memory(proc.pid, within=1 << 40) >= 512 << 20
        assert ipc.tree_memory(proc.pid, within=300 << 20) < 400 << 20
    finally:
        os.killpg(proc.pid, 9)  # the child too
        proc.wait()


def test_a_watch_that_cannot_read_the_worker_judges_nothing() -> None:
    from kz_stream.verify._checks import HostMemoryWatch

    async def watch(pid: int) -> HostMemoryWatch:
        w = HostMemoryWatch(pid, limit=1 << 40)
        async with w:
            await asyncio.sleep(0.5)
        return w

    gone = asyncio.run(watch(2**22 + 1))  # above the largest pid Linux gives
    assert gone.blind and gone.peak == 0 and not gone.over
    alive = asyncio.run(watch(os.getpid()))
    assert not alive.blind and alive.peak > 0 and not alive.over


# -- shared inputs (``share``): a sealed file's descriptor instead of the bytes ----------


def mapped_from(t: torch.Tensor) -> str:
    """The /proc/self/maps name of the mapping that holds ``t``'s bytes."""
    address = t.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[4].strip() if len(rest) > 4 else ""
    return ""


def shared_trip(pair: tuple[Connection, Connection], msg: Any, *,
                files: bool = False) -> Any:
    """``msg`` sent and received, as the verifier's request (trusted) or, with ``files``,
    as a worker's reply."""
    sender = threading.Thread(target=send, args=(pair[0], msg))
    sender.start()
    try:
        return recv(pair[1], files=True) if files else recv(pair[1], trusted=True)
    finally:
        sender.join()


def test_a_shared_tensor_arrives_as_a_mapping_of_its_sealed_file(
        pair: tuple[Connection, Connection]) -> None:
    t = torch.randn(300, 500, generator=torch.Generator().manual_seed(1))
    shared = ipc.share(t, SMALL)
    assert torch.equal(shared, t) and mapped_from(shared).startswith("/memfd:kz-sealed")
    got = shared_trip(pair, {"inputs": [shared, torch.ones(3)], "n": 2})
    assert same(got["inputs"], [t, torch.ones(3)]) and got["n"] == 2
    # Mapped, not read: the receiver's tensor lies in the same file.
    assert mapped_from(got["inputs"][0]).startswith("/memfd:kz-sealed")


def test_a_receiver_writes_to_its_own_copy_and_nobody_writes_to_the_file(
        pair: tuple[Connection, Connection]) -> None:
    t = torch.arange(4096, dtype=torch.float32)
    shared = ipc.share(t, SMALL)
    got = shared_trip(pair, {"x": shared})["x"]
    got.fill_(-1.0)  # a candidate that writes to its input
    assert torch.equal(shared, t)
    assert torch.equal(shared_trip(pair, {"x": shared})["x"], t)  # the next worker's
    fd = ipc._SHARED[shared.data_ptr()][0]
    for change in (lambda: os.write(fd, b"x"), lambda: os.ftruncate(fd, 8),
                   lambda: os.ftruncate(fd, 1 << 20)):
        with pytest.raises(PermissionError):
            change()


def test_small_and_non_cpu_values_are_not_shared() -> None:
    small = torch.ones(8)
    assert ipc.share(small, SMALL) is small
    assert ipc.share("text", SMALL) == "text"
    every = ipc.share(torch.ones(8), 0)  # 0: every size
    assert every.data_ptr() in ipc._SHARED
    on_meta = torch.ones(1 << 20, device="meta")
    assert ipc.share(on_meta, SMALL) is on_meta


def test_a_sealed_copy_is_one_copy_into_a_sealed_file_that_send_passes(
        pair: tuple[Connection, Connection]) -> None:
    """The oracle's way to the host: the tensor's bytes go once into a sealed file, and the
    reply passes the file (whatever the dtype, shape or layout)."""
    for t in (torch.randn(300, 500, dtype=torch.float64).t(), torch.rand(40000) > 0.5,
              torch.arange(6000, dtype=torch.int64).reshape(2, 3, 1000)):
        copy = ipc.sealed_copy(t, SMALL)
        assert torch.equal(copy, t) and (copy.dtype, copy.shape) == (t.dtype, t.shape)
        assert mapped_from(copy).startswith("/memfd:kz-sealed")
        seals = fcntl.fcntl(ipc._SHARED[copy.data_ptr()][0], fcntl.F_GET_SEALS)
        assert seals & ipc._SEALS == ipc._SEALS
        got = shared_trip(pair, {"x": copy})["x"]
        assert torch.equal(got, t) and mapped_from(got).startswith("/memfd:kz-sealed")
    small = ipc.sealed_copy(torch.ones(8), SMALL)
    assert torch.equal(small, torch.ones(8)) and small.data_ptr() not in ipc._SHARED


def test_a_sealed_copy_without_a_file_is_a_plain_host_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memfd(*_: object) -> int:
        raise OSError(errno.ENOSYS, "no memfd here")

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    t = torch.arange(4096, dtype=torch.float32)
    copy = ipc.sealed_copy(t, SMALL)
    assert torch.equal(copy, t) and copy.data_ptr() not in ipc._SHARED


def test_sharing_stops_short_of_the_descriptor_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kept = ipc.share(torch.ones(4096), SMALL)
    monkeypatch.setattr(ipc, "_max_shared", lambda: len(ipc._SHARED))
    plain = torch.ones(4096)
    assert ipc.share(plain, SMALL) is plain and kept.data_ptr() in ipc._SHARED


def test_a_shared_files_descriptor_goes_with_its_last_tensor() -> None:
    shared = ipc.share(torch.ones(4096), SMALL)
    address = shared.data_ptr()
    fd = ipc._SHARED[address][0]
    view = shared[10:20]
    del shared
    assert address in ipc._SHARED  # the view holds the mapping
    del view
    assert address not in ipc._SHARED
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_childs_message_may_not_pass_a_shared_file(
        pair: tuple[Connection, Connection]) -> None:
    shared = ipc.share(torch.ones(4096), SMALL)
    sender = threading.Thread(target=send, args=(pair[0], {"x": shared}))
    sender.start()
    try:
        with pytest.raises(SpillError, match="this receiver takes none"):
            recv(pair[1])  # as the verifier reads a reply of a child without a folder
    finally:
        sender.join()


def test_a_worker_may_pass_sealed_files_which_are_checked_as_any(
        pair: tuple[Connection, Connection]) -> None:
    shared = ipc.share(torch.arange(4096.0), SMALL)
    got = shared_trip(pair, {"x": shared}, files=True)["x"]
    assert torch.equal(got, torch.arange(4096.0))
    assert mapped_from(got).startswith("/memfd:kz-sealed")


def test_a_file_without_the_seals_is_refused(pair: tuple[Connection, Connection],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096 * 4)
    t = torch.zeros(4096)
    alive = mmap.mmap(-1, 4096)
    monkeypatch.setitem(ipc._SHARED, t.data_ptr(), (fd, t.nbytes, weakref.ref(alive)))
    try:
        with pytest.raises(SpillError, match="not sealed"):
            shared_trip(pair, {"x": t})
    finally:
        os.close(fd)


def test_a_tensor_given_twice_is_shared_as_one_file() -> None:
    from kz_stream.verify._prepared import Prepared

    t = torch.arange(4096, dtype=torch.float32)
    prepared = Prepared(key="k", source="", seed=0, sets=[{"inputs": [t, t, 3]}],  # type: ignore[typeddict-item]
                        tolerances=[], specs=[], ref_ops=[], static_ops=frozenset(), flops=0,
                        bytes=0, input_bytes=0, weight_seed=0, own_model_key="", init_args=[],
                        notes=[], plan_notes=[], dropped=[], device_peak_bytes=0, host_bytes=0)
    prepared.share_inputs(SMALL)
    a, b, n = prepared.sets[0]["inputs"]
    assert a is b and a.data_ptr() in ipc._SHARED and n == 3 and torch.equal(a, t)


def test_tree_memory_counts_a_shared_inputs_pages_in_full() -> None:
    """A worker that maps a shared input shares its pages with the verifier (and other
    workers): its PSS would count part of them, leaving the candidate that much more."""
    import subprocess
    import sys

    shared = ipc.share(torch.ones(64 << 20, dtype=torch.uint8), SMALL)
    assert int(shared.sum()) == 64 << 20  # mapped and read here too: split PSS
    fd = ipc._SHARED[shared.data_ptr()][0]
    code = ("import mmap, sys, time\n"
            f"m = mmap.mmap({fd}, {64 << 20}, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)\n"
            "assert sum(m[i] for i in range(0, len(m), 4096)) == len(m) // 4096\n"
            "print('ready', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            pass_fds=(fd,), start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert ipc.tree_memory(proc.pid) >= 64 << 20
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def sealed_trip(pair: tuple[Connection, Connection], folder: Path, msg: Any) -> Any:
    """``msg`` from a child with a spill folder to the verifier, as the oracle replies."""
    sender = threading.Thread(target=send, args=(pair[0], msg, str(folder)),
                              kwargs={"spill_min": SMALL})
    sender.start()
    try:
        return recv(pair[1], str(folder))
    finally:
        sender.join()


def test_a_childs_big_buffers_come_as_sealed_files_the_verifier_keeps(
        pair: tuple[Connection, Connection], sealing_folder: Path) -> None:
    msg = tensors()
    got = sealed_trip(pair, sealing_folder, msg)
    assert same(msg, got) and os.listdir(sealing_folder) == []
    big = got["i64"]  # 8.4 KB: past SMALL
    assert mapped_from(big).startswith("/memfd:kz-sealed") and big.data_ptr() in ipc._SHARED
    assert ipc.share(big, SMALL) is big  # an input set's go on to workers as they are
    assert not mapped_from(got["scalar"]).startswith("/memfd")  # small: on the socket


def test_a_child_that_cannot_make_a_file_sends_the_bytes(
        pair: tuple[Connection, Connection], sealing_folder: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc, "_sealed_file", lambda raw: None)  # a full memory, say
    msg = tensors()
    got = sealed_trip(pair, sealing_folder, msg)
    assert same(msg, got) and not mapped_from(got["i64"]).startswith("/memfd")


@pytest.mark.parametrize("lie", ["unsealed", "write sealed only", "shorter"])
def test_a_childs_file_that_could_still_change_or_is_not_as_announced_is_refused(
        pair: tuple[Connection, Connection], sealing_folder: Path,
        monkeypatch: pytest.MonkeyPatch, lie: str) -> None:
    def lying(raw: memoryview) -> int:
        fd = os.memfd_create("liar", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, raw[:-8] if lie == "shorter" else raw)
        if lie == "write sealed only":  # it could still shrink: a SIGBUS in the reader
            import fcntl
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        elif lie == "shorter":
            fcntl_seal_all(fd)
        return fd

    monkeypatch.setattr(ipc, "_sealed_file", lying)
    with pytest.raises(SpillError, match=r"not sealed|announced"):
        sealed_trip(pair, sealing_folder, {"t": torch.ones(4096)})


def fcntl_seal_all(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ipc._SEALS)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_with_no_slot_to_keep_a_file_its_bytes_are_copied_out(
        pair: tuple[Connection, Connection], sealing_folder: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that sends many files cannot make the verifier hold a descriptor each."""
    monkeypatch.setattr(ipc, "_max_shared", lambda: 0)
    before = open_descriptors()
    msg = tensors()
    got = sealed_trip(pair, sealing_folder, msg)
    assert same(msg, got) and not mapped_from(got["i64"]).startswith("/memfd")
    assert open_descriptors() == before


def test_a_kept_file_is_not_inherited_by_programs_the_verifier_starts(
        pair: tuple[Connection, Connection], sealing_folder: Path) -> None:
    got = sealed_trip(pair, sealing_folder, {"t": torch.ones(4096)})
    assert not os.get_inheritable(ipc._SHARED[got["t"].data_ptr()][0])


def test_a_file_that_cannot_be_passed_goes_as_bytes(
        pair: tuple[Connection, Connection], sealing_folder: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def too_many(*args: Any) -> None:  # the user's descriptors in flight at their limit
        raise OSError(errno.ETOOMANYREFS, "Too many references")

    monkeypatch.setattr(socket, "send_fds", too_many)
    msg = tensors()
    got = sealed_trip(pair, sealing_folder, msg)
    assert same(msg, got) and not mapped_from(got["i64"]).startswith("/memfd")


def test_a_channel_that_ends_before_a_files_descriptor_is_an_eof(
        pair: tuple[Connection, Connection], sealing_folder: Path) -> None:
    pair[0].send_bytes(pickle.dumps([("memfd", 4096)]))
    pair[0].send_bytes(pickle.dumps([pickle.PickleBuffer(bytearray(8))], protocol=5))
    pair[0].close()
    with pytest.raises(EOFError):
        recv(pair[1], str(sealing_folder))
