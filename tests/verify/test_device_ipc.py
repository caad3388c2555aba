"""A CUDA tensor exported by one process is opened by another, device to device."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from kz_stream.verify._device_ipc import (
    Exported,
    Opened,
    export,
    opened_copies,
)


def test_only_a_contiguous_cuda_tensor_is_exported() -> None:
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        export(torch.arange(4.0))


@pytest.mark.parametrize(("export_", "message"), [
    (Exported(b"x" * 63, 0, 16, "float32", (4,)), "64 bytes"),
    (Exported(b"x" * 64, -8, 16, "float32", (4,)), "cannot be negative"),
    (Exported(b"x" * 64, 0, 16, "load", (4,)), "not a torch dtype"),  # torch.load
    (Exported(b"x" * 64, 0, 16, "float32", (4, -1)), "not a shape"),
    (Exported(b"x" * 64, 0, 16, "float32", [4]), "not a shape"),  # type: ignore[arg-type]
    (Exported(b"x" * 64, 0, 64, "float32", (4,)), "not a float32 tensor of shape"),
    (Exported(b"x" * 64, 2, 16, "float32", (4,)), "not a float32 tensor of shape"),
])
def test_a_malformed_export_is_refused_before_the_device_is_touched(
        export_: Exported, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Opened(export_)


def test_an_export_crosses_a_replys_unpickler_and_nothing_else_of_its_module() -> None:
    import pickle

    from kz_stream.verify import _device_ipc
    from kz_stream.verify._ipc import UnreadableReply, _loads

    e = Exported(bytes(range(64)), 256, 16, "float32", (2, 2))
    reply = {"ok": True, "outputs": [[e, 3.0]]}
    assert _loads(pickle.dumps(reply, protocol=5), trusted=False) == reply
    with pytest.raises(UnreadableReply, match=r"_device_ipc\.Opened"):
        _loads(pickle.dumps(_device_ipc.Opened), trusted=False)


def test_a_reply_without_exports_is_returned_as_it_is() -> None:
    reply = {"ok": True, "outputs": [[torch.ones(2), 1], (2, "x")], "flags": []}
    copied, named = opened_copies(reply, "cpu")
    assert named == 0 and copied["ok"] is True and copied["flags"] == []
    assert copied["outputs"][1] == (2, "x") and copied["outputs"][0][0] is (
        reply["outputs"][0][0])


EXPORTER = """
import dataclasses, json, sys, torch
from kz_stream.verify._device_ipc import export
t = torch.arange(3 * 1000, device="cuda", dtype=torch.float32).view(3, 1000)[1:]
t = t.contiguous() * 2  # an allocation of its own, at an offset in its block or not
e = dataclasses.asdict(export(t))
print(json.dumps({**e, "handle": e["handle"].hex()}), flush=True)
sys.stdin.read()  # the memory lives until the test is done with it
"""


@pytest.mark.gpu
def test_a_tensor_exported_by_another_process_opens_here_with_its_values() -> None:
    child = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        info = json.loads(child.stdout.readline())
        e = Exported(**{**info, "shape": tuple(info["shape"]),
                        "handle": bytes.fromhex(info["handle"])})
        assert (e.dtype, e.shape, e.nbytes) == ("float32", (2, 1000), 8000)
        opened = Opened(e)
        want = torch.arange(1000, 3000, device="cuda", dtype=torch.float32).view(2, 1000) * 2
        assert torch.equal(opened.tensor.clone(), want)
        opened.close()
        opened.close()  # a second close is a no-op
        with pytest.raises(ValueError, match="past the exported allocation"):
            Opened(Exported(e.handle, e.offset + (1 << 40), e.nbytes, e.dtype, e.shape))
        # From a thread that has made no CUDA call yet, as the verifier's worker threads
        # (asyncio.to_thread) are: on an H100 the open failed there with "invalid device
        # context" before the primary context was made current explicitly.
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(opened_copies([e], "cuda")))
        thread.start()
        thread.join(60)
        (copy,), count = got[0]
        assert count == 1 and torch.equal(copy, want)
    finally:
        child.communicate("", timeout=60)


def test_an_export_deep_in_a_reply_is_checked_before_any_copy() -> None:
    bad = Exported(b"x" * 64, 0, 16, "load", (4,))
    with pytest.raises(ValueError, match="not a torch dtype"):
        opened_copies({"ok": True, "outputs": {3: [1.0, (bad,)]}}, "cpu")
