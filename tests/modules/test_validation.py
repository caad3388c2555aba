"""Validation of proposed modules: hand-written good and bad modules each get the right
reason. Everything that runs module code goes through the verifier's sandbox."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from kz_stream.modules import PROPOSER_EXAMPLES, validate_module

TIMEOUT_S = 60.0

HEADER = """import torch
import torch.nn as nn
import torch.nn.functional as F

"""
FOOTER = """

def get_inputs():
    return [torch.randn(4, 16)]


def get_init_inputs():
    return [16]
"""


def module(init: str, forward: str, prelude: str = "") -> str:
    """A KernelBench module whose Model has the given __init__ tail and forward body."""
    return (
        HEADER
        + prelude
        + "class Model(nn.Module):\n"
        + "    def __init__(self, d):\n        super().__init__()\n"
        + "".join(f"        {line}\n" for line in init.splitlines() or ["pass"])
        + "\n    def forward(self, x):\n"
        + "".join(f"        {line}\n" for line in forward.splitlines())
        + FOOTER
    )


GOOD = module("self.lin = nn.Linear(d, d)", "return torch.sigmoid(self.lin(x)) * 2.0")
GOOD_APIS = ["torch.nn.Linear", "torch.sigmoid"]


@pytest.mark.parametrize("example", PROPOSER_EXAMPLES, ids=["layernorm", "attention"])
def test_the_proposer_few_shot_examples_are_valid(example: tuple[list[str], str]) -> None:
    apis, source = example
    v = validate_module(source, apis, timeout_s=TIMEOUT_S)
    assert v.valid, v
    assert set(apis) <= set(v.apis_called)


def test_good_module_with_aliases_and_containers() -> None:
    source = module(
        "self.body = nn.Sequential(nn.Linear(d, d), nn.GELU())",
        "h = self.body(x)\nreturn F.softmax(h, dim=-1) + h.transpose(0, 1).transpose(0, 1)",
    )
    v = validate_module(source, ["torch.nn.Linear", "torch.nn.GELU", "torch.softmax"])
    assert v.valid, v


def test_good() -> None:
    v = validate_module(GOOD, GOOD_APIS, timeout_s=TIMEOUT_S)
    assert v.valid and v.reason is None, v


def test_syntax_error() -> None:
    v = validate_module(GOOD.replace("def forward(self, x):", "def forward(self, x:"), GOOD_APIS)
    assert v.reason == "syntax_error"


def test_missing_interface() -> None:
    v = validate_module(GOOD.replace("def get_init_inputs", "def init_inputs"), GOOD_APIS)
    assert v.reason == "missing_interface" and "get_init_inputs" in (v.detail or "")
    v = validate_module(GOOD.replace("class Model", "class MyModel"), GOOD_APIS)
    assert v.reason == "missing_interface"


def test_wrong_apis_static() -> None:
    v = validate_module(GOOD, ["torch.nn.Linear", "torch.tanh"])
    assert v.reason == "wrong_apis" and "torch.tanh" in (v.detail or "")
    extra = module("self.lin = nn.Linear(d, d)", "return torch.exp(torch.sigmoid(self.lin(x)))")
    v = validate_module(extra, GOOD_APIS)
    assert v.reason == "wrong_apis" and "torch.exp" in (v.detail or "")
    assert validate_module(extra, GOOD_APIS, max_extra_apis=1).reason != "wrong_apis"


def test_wrong_apis_at_run_time() -> None:
    # The source mentions tanh, but only in a branch that forward never takes.
    dead = module(
        "self.lin = nn.Linear(d, d)",
        "h = torch.sigmoid(self.lin(x))\nif x.shape[0] > 10**6:\n    h = torch.tanh(h)\nreturn h",
    )
    v = validate_module(dead, ["torch.nn.Linear", "torch.sigmoid", "torch.tanh"])
    assert v.reason == "wrong_apis" and "forward ran" in (v.detail or "")


def test_crash() -> None:
    v = validate_module(
        module(
            "self.lin = nn.Linear(d, 2 * d)", "return torch.sigmoid(self.lin(x).view(3, -1, 7))"
        ),
        GOOD_APIS,
    )
    assert v.reason == "crash", v


def test_hang() -> None:
    hang = module(
        "self.lin = nn.Linear(d, d)",
        "while True:\n    x = x + 0\nreturn torch.sigmoid(self.lin(x))",
    )
    v = validate_module(hang, GOOD_APIS, timeout_s=8.0)
    assert v.reason == "timeout", v


def test_nan() -> None:
    nan = module("self.lin = nn.Linear(d, d)", "return torch.log(-torch.sigmoid(self.lin(x)))")
    v = validate_module(nan, ["torch.nn.Linear", "torch.sigmoid", "torch.log"])
    assert v.reason == "non_finite", v


def test_degenerate() -> None:
    # relu(-|h|) is zero everywhere: an all-zero "kernel" would pass.
    zeros = module("self.lin = nn.Linear(d, d)", "return torch.relu(-torch.abs(self.lin(x)))")
    v = validate_module(zeros, ["torch.nn.Linear", "torch.relu", "torch.abs"])
    assert v.reason == "degenerate" and "zeros" in (v.detail or ""), v
    # The weights are used, but the output does not depend on the input.
    ignores_input = module(
        "self.lin = nn.Linear(d, d)",
        "return torch.sigmoid(self.lin(torch.ones_like(x)))",
    )
    v = validate_module(ignores_input, GOOD_APIS)
    assert v.reason == "degenerate", v


def test_file_write_outside_the_sandbox(tmp_path: Path) -> None:
    target = tmp_path / f"pwned-{uuid.uuid4().hex}"
    evil = module(
        "self.lin = nn.Linear(d, d)",
        f"open({str(target)!r}, 'w').write('x')\nreturn torch.sigmoid(self.lin(x))",
    )
    v = validate_module(evil, GOOD_APIS)
    assert v.reason == "forbidden", v
    assert not target.exists()


def test_network() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        evil = module(
            "self.lin = nn.Linear(d, d)",
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n"
            "return torch.sigmoid(self.lin(x))",
        )
        v = validate_module(evil, GOOD_APIS)
        assert v.reason == "forbidden", v
    finally:
        server.close()


@pytest.mark.parametrize(
    "code",
    [
        "import os\nif os.fork() == 0:\n    os._exit(0)",
        "import subprocess\nsubprocess.run(['true'])",
    ],
    ids=["fork", "subprocess"],
)
def test_process_creation(code: str) -> None:
    # At import time: the module's top level is as untrusted as its forward.
    evil = module(
        "self.lin = nn.Linear(d, d)", "return torch.sigmoid(self.lin(x))", prelude=code + "\n\n"
    )
    v = validate_module(evil, GOOD_APIS)
    assert v.reason == "forbidden", v


def test_no_leftover_processes_or_files() -> None:
    # The sandbox runs in its own directory; nothing of it stays in ours.
    before = set(os.listdir("."))
    validate_module(GOOD, GOOD_APIS, check_degenerate=False)
    assert set(os.listdir(".")) == before
