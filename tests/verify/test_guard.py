"""The guard allows the programs the libraries run by the file they are, not by name.

Each case runs in a fresh interpreter: an audit hook cannot be removed once installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("true") is None, reason="needs the `true` program")

_PROBE = r"""
import collections, json, os, pathlib, subprocess, sys
from kz_stream.verify._guard import Guard, GuardViolation
home = sys.argv[1]

def attempt(*args, **kw):
    try:
        subprocess.run(*args, check=True, **kw)
        return "ran"
    except GuardViolation:
        return "refused"

def spawn(fn, *args):
    try:
        os.waitpid(fn(*args), 0)
        return "ran"
    except GuardViolation:
        return "refused"

fake = os.path.join(home, "true")
with open(fake, "w") as f:
    f.write("#!/bin/sh\necho pwned\n")
os.chmod(fake, 0o755)
os.symlink(os.path.realpath(sys.argv[2]), os.path.join(home, "link"))
Guard(allowed_programs=frozenset({"true"}), write_roots=(home,)).install()
out = {
    "by_name": attempt(["true"]),
    "by_real_path": attempt([sys.argv[2]]),
    "own_file": attempt(["./true"], cwd=home),
    "own_file_absolute": attempt([fake]),
    "own_file_first_on_path": attempt(["true"],
                                      env={"PATH": home + os.pathsep + os.environ["PATH"]}),
    "link_to_real": attempt(["./link"], cwd=home),
    "other_program": attempt(["ls"]),
    "own_file_pathlike_cwd": attempt(["./true"], cwd=pathlib.Path(home)),
    "relative_path_entry": attempt(["true"], cwd=home, env={"PATH": "."}),
    "env_not_a_dict": attempt(["true"], env=collections.UserDict({"PATH": home})),
    "posix_spawn_bare_name": spawn(os.posix_spawn, "true", ["true"], dict(os.environ)),
    "posix_spawn_real_path": spawn(os.posix_spawn, sys.argv[2], ["true"], dict(os.environ)),
}
print(json.dumps(out))
"""


def _probe(tmp_path: Path) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    real = shutil.which("true")
    assert real is not None
    done = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path), real], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_allowed_program_runs_by_name_and_by_its_real_path(tmp_path: Path) -> None:
    out = _probe(tmp_path)
    assert out["by_name"] == "ran"
    assert out["by_real_path"] == "ran"
    assert out["posix_spawn_real_path"] == "ran"


def test_a_file_of_the_same_name_written_by_the_candidate_is_refused(tmp_path: Path) -> None:
    out = _probe(tmp_path)
    assert out["own_file"] == "refused"
    assert out["own_file_absolute"] == "refused"
    assert out["own_file_first_on_path"] == "refused"
    assert out["own_file_pathlike_cwd"] == "refused"
    # A link in a writable place could be re-pointed between the check and the exec.
    assert out["link_to_real"] == "refused"


def test_runs_whose_program_cannot_be_told_for_certain_are_refused(tmp_path: Path) -> None:
    out = _probe(tmp_path)
    assert out["relative_path_entry"] == "refused"  # the child resolves it from its cwd
    assert out["env_not_a_dict"] == "refused"  # could report one PATH and use another
    # posix_spawn runs a bare name from the cwd, posix_spawnp from this PATH: the audit
    # event does not tell them apart.
    assert out["posix_spawn_bare_name"] == "refused"


def test_programs_not_named_are_refused(tmp_path: Path) -> None:
    assert _probe(tmp_path)["other_program"] == "refused"


_SOCKETS = r"""
import json, socket
from kz_stream.verify._guard import Guard, GuardViolation
a, b = socket.socketpair()
c, d = socket.socketpair()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

class Disguised(socket.socket):
    family = socket.AF_UNIX  # reports AF_UNIX; is not

udp_disguised = Disguised(socket.AF_INET, socket.SOCK_DGRAM)
Guard(channels=frozenset({a.fileno(), udp_disguised.fileno()})).install()

def attempt(fn):
    try:
        fn()
        return "ran"
    except GuardViolation:
        return "refused"
    except OSError:
        return "ran"  # past the guard; the network itself said no

out = {
    "sendmsg_on_the_channel": attempt(lambda: a.sendmsg([b"x"])),
    "sendmsg_on_another_unix_socket": attempt(lambda: c.sendmsg([b"x"])),
    "sendmsg_to_an_address": attempt(lambda: udp.sendmsg([b"x"], [], 0, ("127.0.0.1", 9))),
    "sendmsg_disguised": attempt(lambda: udp_disguised.sendmsg([b"x"])),
    "connect": attempt(lambda: socket.socket(socket.AF_UNIX).connect("/tmp/kz-none")),
}
print(json.dumps(out))
"""


def test_messages_with_descriptors_go_on_the_channel_alone() -> None:
    """The oracle passes its replies' sealed files on its channel to the verifier with
    sendmsg; every other socket stays closed to it, whatever family it reports."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _SOCKETS], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "sendmsg_on_the_channel": "ran", "sendmsg_on_another_unix_socket": "refused",
        "sendmsg_to_an_address": "refused", "sendmsg_disguised": "refused",
        "connect": "refused"}
