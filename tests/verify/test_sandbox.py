"""The sandbox runs a function in a fresh isolated process and says what went wrong."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kz_stream.testing.corpus.hostile import HostileHost
from kz_stream.verify import SandboxSetupError
from kz_stream.verify._sandbox import MAX_PROCESSES, isolation, run_in_sandbox, visible_paths

T = "tests.verify.sandbox_targets"
JAIL = isolation().level == "jail"
needs_jail = pytest.mark.skipif(
    not JAIL, reason=f"this host allows no filesystem boundary: {isolation().describe()}")


@pytest.fixture(scope="module")
def host() -> Iterator[HostileHost]:
    h = HostileHost()
    yield h
    h.close()


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
def test_network_blocked_below_python(host: HostileHost) -> None:
    for port in (host.targets.store_port, host.targets.broker_port):
        out = run_in_sandbox(f"{T}:native_connect", (port,), timeout_s=30)
        assert out.ok and out.value == -1  # connect() fails: no route in the empty namespace
    assert host.store.accepted + host.broker.accepted == 0


def test_native_connect_reaches_a_listener_without_isolation(host: HostileHost) -> None:
    """The control: the same call connects where nothing stands in its way."""
    out = run_in_sandbox(f"{T}:native_connect", (host.targets.store_port,), timeout_s=30,
                         allow_network=True)
    assert out.ok and out.value == 0
    deadline = time.monotonic() + 5
    while host.store.accepted == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.store.accepted == 1
    host.store.accepted = 0


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


def test_a_target_that_cannot_load_is_the_hosts_fault_not_the_codes() -> None:
    # No verdict on the code under test can come of it: the caller gets an error, never a
    # "crash" that would be charged to the code.
    with pytest.raises(SandboxSetupError, match="No module named 'kz_no_such_dependency'"):
        run_in_sandbox("tests.verify.sandbox_unloadable:anything", timeout_s=30)


def test_a_child_that_dies_before_its_target_is_loaded_is_a_setup_error() -> None:
    with pytest.raises(SandboxSetupError,
                       match=r"ended before it loaded .*exit code 3.*\(3 attempts\)"):
        run_in_sandbox("tests.verify.sandbox_dies_loading:anything", timeout_s=30)


def test_a_child_that_dies_before_loading_once_is_tried_again(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kz_stream.verify"):
        out = run_in_sandbox("tests.verify.sandbox_dies_first:value", timeout_s=30)
    assert out.ok and out.value == 7, out
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "ended before it loaded" in said[0], said
    assert "trying again (2 of 3)" in said[0]


@needs_jail
def test_a_dependency_on_the_search_path_alone_is_not_in_the_jail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on an H200 whose packages were on PYTHONPATH: the jail shows the installation only.
    (tmp_path / "kz_extra_dependency.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SandboxSetupError, match="install kz_stream and its dependencies"):
        run_in_sandbox("tests.verify.sandbox_needs_extra:value", timeout_s=30)


# ---- the filesystem boundary (sandbox.isolation's jail), below the audit hooks ----------


@needs_jail
@pytest.mark.parametrize("how", ["torch", "numpy", "ctypes"])
@pytest.mark.parametrize("where", ["tmp", "project", "home"])
def test_native_write_leaves_no_file(host: HostileHost, how: str, where: str) -> None:
    t = host.targets
    path = t.write_path({"tmp": t.tmp, "project": t.project, "home": t.home}[where], how)
    out = run_in_sandbox(f"{T}:native_write", (how, path), timeout_s=60)
    # /tmp is the child's own (thrown away); elsewhere the write fails, or the audit hook
    # refuses numpy's Python-level open first.
    assert out.ok == (where == "tmp" and how != "numpy"), out
    assert out.ok or out.error_kind in ("exception", "forbidden"), out
    assert not os.path.exists(path) and host.side_effects() == []


@needs_jail
@pytest.mark.parametrize("what", ["store", "infra_state", "home", "proc_verifier",
                                  "proc_other"])
def test_reads_of_the_host_fail(host: HostileHost, what: str) -> None:
    t = host.targets
    path = {"store": t.store_file, "infra_state": t.infra_state, "home": t.home_file,
            "proc_verifier": f"/proc/{t.verifier_pid}/cmdline",
            "proc_other": f"/proc/{t.other_pid}/cmdline"}[what]
    assert host.secret.encode() in Path(path).read_bytes() or what == "proc_verifier"
    out = run_in_sandbox(f"{T}:read_file", (path,), timeout_s=60)
    assert out.error_kind == "exception" and "No such file" in out.error_message, out
    assert host.secret not in repr(out)


@needs_jail
def test_child_sees_only_itself_and_holds_no_privilege() -> None:
    project = str(Path(__file__).resolve().parents[2])
    out = run_in_sandbox(f"{T}:identity", (project,), timeout_s=30)
    assert out.ok, out
    ident = out.value
    assert ident["cap_eff"] == 0 and ident["cap_bnd"] == 0 and ident["no_new_privs"] == "1"
    assert ident["pids"] == [1, 2]  # the jail's first process and this one
    assert ident["uid"] != 0 or os.geteuid() != 0  # root's children switch to another uid
    # Of the project: the package, the test module it was asked to run, and the Python
    # installation where it lives inside the project (a clone's .venv: the child runs on it).
    own_install = {Path(p).relative_to(project).parts[0] for p in {sys.prefix, sys.base_prefix}
                   if Path(p).is_relative_to(project)}
    assert set(ident["project"]) == {"kz_stream", "tests"} | own_install, ident["project"]


@needs_jail
def test_fork_bomb_is_bounded_and_cleared(host: HostileHost) -> None:
    out = run_in_sandbox(f"{T}:fork_bomb", (host.targets.comm,), timeout_s=60)
    assert out.error_kind == "forbidden" and out.value >= 1, out
    left = out.error_message.split("[")[1].split("]")[0].split(",")
    assert 8 <= len(left) < MAX_PROCESSES, out.error_message  # stopped by the process cap
    assert host.bomb_processes() == []


@needs_jail
@pytest.mark.parametrize("how", ["parent", "group"])
def test_killing_the_parent_harms_only_the_child(how: str) -> None:
    out = run_in_sandbox(f"{T}:kill_parent", (how,), timeout_s=30)
    # The jail's first process shrugs off a signal from inside; the group kill ends the
    # child itself. Either way this process (the verifier's stand-in) lives on.
    assert (out.ok and out.value == "still here") if how == "parent" else (
        out.error_kind == "crash" and "SIGKILL" in out.error_message), out
    assert run_in_sandbox(f"{T}:add", (1, 2), timeout_s=30).value == 3


def test_fallback_is_said_not_silent() -> None:
    """Without the jail the outcome and a warning say so."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from kz_stream.verify._sandbox import run_in_sandbox\n"
            "out = run_in_sandbox('tests.verify.sandbox_targets:add', (1, 2), timeout_s=30)\n"
            "print('LEVEL', out.isolation, out.value)")
    env = {**os.environ, "KZ_SANDBOX_NO_JAIL": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    level = r.stdout.split("LEVEL ")[1].split()[0]
    assert level in ("network", "none") and "3" in r.stdout
    assert "no filesystem boundary" in r.stderr


def test_a_compiler_outside_usr_is_visible_with_its_toolchain_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The H200 host's CC is /opt/gcc/bin/gcc: Triton's driver build failed in the jail
    # until the toolchain's root was bound.
    gcc = tmp_path / "opt" / "gcc" / "bin" / "gcc"
    gcc.parent.mkdir(parents=True)
    gcc.write_text("")
    monkeypatch.setenv("CC", str(gcc))
    assert str(tmp_path / "opt" / "gcc") in visible_paths()


def test_bin_on_path_never_shows_the_whole_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # /bin and /sbin are PATH entries whose "toolchain root" would be /; with a service
    # run from / and a system user's HOME of /, nothing else would keep / out.
    # (the package pip-installed into the environment, so no project folder to protect).
    from kz_stream.verify import _sandbox as sandbox

    monkeypatch.setattr(sandbox, "_PKG_ROOT", os.path.join(sys.prefix, "lib", "site-packages"))
    monkeypatch.setenv("PATH", "/bin:/sbin:/usr/bin")
    monkeypatch.setenv("HOME", "/")
    monkeypatch.chdir("/")
    assert "/" not in visible_paths()


def _ticks_now() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _kill_sandbox_children() -> int:
    """Kills every live sandbox child of this process (spares included); returns how
    many."""
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if state in ("Z", "X"):  # dead already, waiting for its Popen to reap it
            continue
        if int(ppid) == os.getpid() and int(entry) == os.getpgid(int(entry)):
            os.killpg(int(entry), 9)
            killed += 1
            _wait_dead(int(entry))
    return killed


def _wait_dead(pid: int) -> None:
    """Waits until the killed child is a zombie (dead, not yet reaped by its Popen)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.01)
    raise AssertionError(f"child {pid} still alive 10 s after SIGKILL")


def test_a_preloading_call_runs_in_a_child_started_before_it_with_the_modules_imported(
) -> None:
    for _ in range(2):  # a kind's second call starts the first spare
        first = run_in_sandbox(f"{T}:imported", ("colorsys",), timeout_s=60,
                               preload=("colorsys",))
        assert first.ok and first.value is True, first
    cold = run_in_sandbox(f"{T}:imported", ("colorsys",), timeout_s=60)
    assert cold.ok and cold.value is False, cold  # not imported unless asked for
    asked = _ticks_now()
    warm = run_in_sandbox(f"{T}:start_ticks", timeout_s=60, preload=("colorsys",))
    assert warm.ok and warm.value < asked, (warm, asked)  # a spare an earlier call started
    again = run_in_sandbox(f"{T}:start_ticks", timeout_s=60, preload=("colorsys",))
    assert again.ok and again.value < _ticks_now() and again.value != warm.value


def test_a_spare_that_died_while_it_waited_is_passed_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for _ in range(2):
        assert run_in_sandbox(f"{T}:add", (1, 2), timeout_s=60,
                              preload=("colorsys",)).value == 3
    assert _kill_sandbox_children() >= 1
    with caplog.at_level(logging.WARNING):
        out = run_in_sandbox(f"{T}:add", (2, 3), timeout_s=60, preload=("colorsys",))
    assert out.ok and out.value == 5, out
    # Served by a fresh child at once, not by a retry after a dead spare took the call.
    assert not [r for r in caplog.records if "trying again" in r.getMessage()]


def test_a_call_served_by_a_spare_keeps_its_limits_and_hooks(tmp_path: Path) -> None:
    for _ in range(2):  # the kind's second call starts spares
        assert run_in_sandbox(f"{T}:add", (1, 2), timeout_s=60, memory_mb=512,
                              preload=("colorsys",)).value == 3
    target = tmp_path / "escape.txt"
    out = run_in_sandbox(f"{T}:write_outside", (str(target),), timeout_s=60,
                         memory_mb=512, preload=("colorsys",))
    assert out.error_kind == "forbidden" and not target.exists(), out
    out = run_in_sandbox(f"{T}:allocate", (2048,), timeout_s=60, memory_mb=512,
                         preload=("colorsys",))
    assert out.error_kind == "oom", out


def test_an_argument_that_cannot_be_pickled_leaves_no_child() -> None:
    _kill_sandbox_children()  # spares of earlier tests (their folders stay until exit)
    scratch = Path(tempfile.gettempdir())
    before = set(scratch.glob("kz-sbx-*"))
    with pytest.raises((TypeError, pickle.PicklingError)):
        run_in_sandbox(f"{T}:add", (threading.Lock(), 2), timeout_s=60)
    assert set(scratch.glob("kz-sbx-*")) == before
    assert _kill_sandbox_children() == 0
