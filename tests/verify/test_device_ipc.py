"""A CUDA tensor exported by one process is opened by another, device to device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kz_stream.verify._device_ipc import Exported, Opened, export


def test_only_a_contiguous_cuda_tensor_is_exported() -> None:
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        export(torch.arange(4.0))


@pytest.mark.parametrize(("handle", "offset", "message"), [
    (b"x" * 63, 0, "64 bytes"), (b"x" * 64, -8, "cannot be negative")])
def test_a_malformed_export_is_refused_before_the_device_is_touched(
        handle: bytes, offset: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Opened(Exported(handle, offset, 16, "float32", (4,)))


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
    finally:
        child.communicate("", timeout=60)
