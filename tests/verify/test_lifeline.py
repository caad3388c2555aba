"""No orphans: a SIGKILLed verifier takes its children with it (workers, the oracle, sandbox
runs, compilers), and the next verifier reaps what a crashed one left, never what a live
one runs. Real processes throughout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kz_stream.verify import Verifier, VerifierConfig
from kz_stream.verify import _lifeline as lifeline

_ROOT = str(Path(__file__).resolve().parents[2])

# A verifier mid-verification of a candidate that spins, with its oracle and spare workers
# up, a sandbox run that sleeps and a "compiler" with a grandchild, all from one process.
_VERIFIER = textwrap.dedent("""
    import asyncio, sys, threading
    from kz_stream.verify import Candidate, Problem, Verifier, VerifierConfig
    from kz_stream.verify._build import Builder
    from kz_stream.verify._sandbox import run_in_sandbox
    from kz_stream.testing.corpus.problems import PROBLEMS
    from kz_stream.testing.corpus.triton_honest import TRITON_HONEST

    work = sys.argv[1]
    threading.Thread(target=run_in_sandbox, args=("tests.verify.sandbox_targets:hang",),
                     kwargs={"timeout_s": 3600}, daemon=True).start()
    builder = Builder(work + "/cache", link=False)
    threading.Thread(target=asyncio.run, daemon=True, args=(
        builder._run(["sh", "-c", "sleep 3600 & sleep 3600"], work),)).start()
    v = Verifier(VerifierConfig(devices=[], call_timeout_s=3600, prewarm=2))
    src = TRITON_HONEST["relu"].replace("x = x.contiguous()", "while True: pass")
    v.verify_sync(Problem(PROBLEMS["relu"]), Candidate(src, "triton"))
""")

# Starts two process groups that do not watch it (as a child stuck in native code would
# not), records them as its children, and waits.
_HOLDER = textwrap.dedent("""
    import subprocess, time
    from kz_stream.verify import _lifeline as lifeline

    procs = [subprocess.Popen(["sleep", "3600"], start_new_session=True) for _ in range(2)]
    for p in procs:
        lifeline.track(p.pid)
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(3600)
""")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (one nobody has reaped yet is dead)."""
    fields = lifeline.stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _living(match: Callable[[int], bool]) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and match(int(p))
            and _alive(int(p))]


def _pgid(pid: int) -> int | None:
    fields = lifeline.stat_fields(pid)
    return int(fields[2]) if fields else None


def _cwd_under(root: str) -> Callable[[int], bool]:
    def match(pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/cwd").startswith(root)
        except OSError:
            return False
    return match


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return f"{pid} (gone)"


def _recorded(runtime: Path) -> set[int]:
    groups = set()
    for path in runtime.glob("*.pids"):
        try:
            text = path.read_text()
        except OSError:
            continue  # emptied and removed meanwhile
        groups.update(int(line.split()[0]) for line in text.split("\n") if line)
    return groups


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def _env(tmp_path: Path) -> dict[str, str]:
    runtime, tmp = tmp_path / "run", tmp_path / "tmp"
    runtime.mkdir(mode=0o700, exist_ok=True)  # the reaper trusts no folder others can write
    tmp.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "KZ_RUNTIME_DIR": str(runtime), "TMPDIR": str(tmp),
            "PYTHONPATH": path}


@pytest.mark.slow
def test_sigkilled_verifier_leaves_no_process(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path)
    runtime, tmp = Path(env["KZ_RUNTIME_DIR"]), env["TMPDIR"]
    monkeypatch.setenv("KZ_RUNTIME_DIR", str(runtime))
    in_tree = _cwd_under(tmp)  # every child works in a folder of its own under TMPDIR
    log = tmp_path / "verifier.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _VERIFIER, tmp], env=env, cwd=_ROOT,
                                stdout=out, stderr=out)
    try:
        # The oracle, 3 workers (the candidate's and 2 spares), the sandbox run, the compiler.
        up = _wait_for(lambda: len(_recorded(runtime)) >= 6 or proc.poll() is not None, 240)
        if not up or proc.poll() is not None:
            pytest.fail(f"{_recorded(runtime)}: {log.read_text()[-3000:]}")
        time.sleep(3)  # the candidate spins now (its worker is long past its imports)
        groups = _recorded(runtime)
        assert len(_living(in_tree)) >= 6
        proc.kill()
        proc.wait()

        def tree() -> list[int]:
            return _living(lambda p: _pgid(p) in groups or in_tree(p))

        assert _wait_for(lambda: not tree(), 10), [_cmdline(p) for p in tree()]
    finally:
        proc.kill()
        proc.wait()
        lifeline.reap()  # whatever happened, nothing of it outlives the test


def _start_holder(env: dict[str, str]) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], env=env, cwd=_ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split()]


def test_reaper_kills_what_a_dead_verifier_left_and_spares_a_live_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path)
    monkeypatch.setenv("KZ_RUNTIME_DIR", env["KZ_RUNTIME_DIR"])
    dead, dead_children = _start_holder(env)
    live, live_children = _start_holder(env)
    try:
        dead.kill()
        dead.wait()
        assert all(_alive(p) for p in dead_children)  # orphans: nothing watched for them

        async def start() -> None:
            async with Verifier(VerifierConfig(devices=[], prewarm=0)):
                pass

        asyncio.run(start())  # a verifier's start reaps
        assert _wait_for(lambda: not any(_alive(p) for p in dead_children), 5)
        assert all(_alive(p) for p in live_children)
        assert live.poll() is None
        names = [p.name for p in Path(env["KZ_RUNTIME_DIR"]).iterdir()]
        assert names == [f"{live.pid}-{lifeline.start_time(live.pid)}.pids"]
        assert lifeline.reap() == []  # again: nothing of the live one is touched
        assert all(_alive(p) for p in live_children)
    finally:
        for p in (dead, live):
            p.kill()
            p.wait()
        for pid in (*dead_children, *live_children):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_reaper_leaves_a_reused_pid_alone(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KZ_RUNTIME_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    other = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    try:
        started = lifeline.start_time(other.pid)
        assert started is not None
        # A registry of a gone verifier (no pid is that high) naming this pid with another
        # start time.
        (tmp_path / "4194305-1.pids").write_text(f"{other.pid} {started + 1}\n")
        assert lifeline.reap() == []
        assert _alive(other.pid) and not list(tmp_path.iterdir())
    finally:
        other.kill()
        other.wait()
