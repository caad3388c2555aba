"""The sandbox runs a function in a fresh isolated process and says what went wrong."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kz_stream.verify.sandbox import isolation, run_in_sandbox

T = "tests.verify.sandbox_targets"


def test_returns_value() -> None:
    out = run_in_sandbox(f"{T}:add", (2, 3), timeout_s=30)
    assert out.ok and out.value == 5 and out.error_kind is None


def test_exception_is_reported() -> None:
    out = run_in_sandbox(f"{T}:boom", timeout_s=30)
    assert not out.ok and out.error_kind == "exception" and "nope" in out.error_message


def test_hang_times_out_and_is_killed() -> None:
    out = run_in_sandbox(f"{T}:hang", timeout_s=1.5)
    assert out.error_kind == "timeout"
    assert out.wall_s < 10


def test_crash() -> None:
    out = run_in_sandbox(f"{T}:crash", timeout_s=30)
    assert out.error_kind == "crash" and "SIGABRT" in out.error_message


def test_memory_limit() -> None:
    out = run_in_sandbox(f"{T}:allocate", (2048,), timeout_s=30, memory_mb=512)
    assert out.error_kind == "oom"


def test_network_blocked_in_python() -> None:
    out = run_in_sandbox(f"{T}:connect", timeout_s=30)
    assert out.error_kind == "forbidden" and "socket" in out.error_message


@pytest.mark.skipif(isolation().level == "none", reason="no network namespace on this host")
def test_network_blocked_below_python() -> None:
    out = run_in_sandbox(f"{T}:native_connect", timeout_s=30)
    assert out.ok and out.value == -1  # connect() fails: no route in the empty namespace


def test_subprocess_blocked() -> None:
    out = run_in_sandbox(f"{T}:spawn", timeout_s=30)
    assert out.error_kind == "forbidden" and "subprocess" in out.error_message


def test_native_fork_detected_and_killed() -> None:
    token = f"KZ_TEST_{uuid.uuid4().hex}"
    out = run_in_sandbox(f"{T}:native_fork", timeout_s=30, env={token: "1"})
    assert out.error_kind == "forbidden" and "child processes" in out.error_message
    assert not processes_with(token)


def processes_with(token: str) -> list[int]:
    """Live processes of this host whose environment holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and token.encode() in (entry / "environ").read_bytes()
                    and "Z" not in (entry / "stat").read_text().rsplit(")", 1)[1][:3]):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_write_outside_blocked(tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    out = run_in_sandbox(f"{T}:write_outside", (str(target),), timeout_s=30)
    assert out.error_kind == "forbidden" and not target.exists()


def test_write_inside_private_dir_allowed() -> None:
    out = run_in_sandbox(f"{T}:write_inside", timeout_s=30)
    assert out.ok and out.value != os.getcwd()
    assert any(w.endswith("ok.txt") for w in out.writes)


def test_unpicklable_value() -> None:
    out = run_in_sandbox(f"{T}:unpicklable", timeout_s=30)
    assert out.error_kind == "exception" and "picklable" in out.error_message


def test_bad_target() -> None:
    with pytest.raises(ValueError):
        run_in_sandbox("no_colon", timeout_s=1)
