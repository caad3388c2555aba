"""Hostile candidates for the filesystem boundary, and the host they are aimed at.

Each candidate is the honest Triton ReLU with one hostile act at the start of ``forward``:
file writes through torch, numpy and libc aimed at /tmp, the project folder and HOME;
reads of a store file, the infrastructure state file, HOME and /proc of the verifier and of
another process; TCP connections to a store and a broker port; a fork bomb; memory and
time bombs; killing its parent or its process group. Native calls (libc through ctypes,
torch's C++ writer) pass beneath the audit hooks, so with the static scan off only the
boundary stands in their way. A read that succeeds raises with what it read ("LEAK ...")
so that it would show in the verdict; a write or connection that fails raises with the
error, so the verdict says what stopped it.

``HostileHost`` lays out the targets (files holding a secret, two listening ports, a
process holding the secret in its command line) and afterwards counts what got through:
files the candidates left outside their scratch, connections accepted, the secret or a
LEAK in a verdict, bomb processes still running.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST

ROOT = Path(__file__).resolve().parents[3]
# The corpus tests the boundary, not the arithmetic: a small ReLU keeps each run short.
PROBLEM = PROBLEMS["relu"].replace("torch.randn(4096, 4096)", "torch.randn(256, 256)")

_NATIVE_WRITE = '''
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fopen.restype = ctypes.c_void_p
    f = libc.fopen({path!r}.encode(), b"w")
    if not f:
        raise OSError(ctypes.get_errno(), "fopen failed", {path!r})
    libc.fwrite(b"kz", 1, 2, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
'''

_CONNECT = '''
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    # sockaddr_in: the family in host order, the port and address in network order.
    addr = ctypes.create_string_buffer(struct.pack("=H", 2)
                                       + struct.pack("!H4s8x", {port}, bytes([127, 0, 0, 1])))
    if libc.connect(fd, addr, 16) == 0:
        raise RuntimeError("LEAK connected to port {port}")
    raise OSError(ctypes.get_errno(), "connect failed")
'''

_LEAK = '''
    raise RuntimeError("LEAK " + bytes(data[:400]).decode(errors="replace"))
'''

_FORK_BOMB = '''
    global _bombed
    if _bombed:
        return
    _bombed = True
    libc = ctypes.CDLL(None, use_errno=True)
    me, n = os.getpid(), 0
    while libc.fork() >= 0:
        n += 1
        if os.getpid() != me:
            libc.prctl(15, {comm!r}.encode(), 0, 0, 0)  # PR_SET_NAME: findable by the host
            n = 0
    if os.getpid() != me:
        time.sleep(600)
    raise RuntimeError(f"fork refused after {{n}} forks: errno {{ctypes.get_errno()}}")
'''

_MEMORY_BOMB = '''
    held = []
    while True:  # address space until refused (untouched: the cap, not the host's RAM, ends it)
        held.append(torch.empty(1 << 28, dtype=torch.uint8))
'''

_TIME_BOMB = '''
    while True:
        pass
'''

_KILL_PARENT = '''
    global _bombed
    if not _bombed:
        _bombed = True
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(0.5)
'''

_KILL_GROUP = '''
    os.killpg(os.getpgid(0), signal.SIGKILL)
    time.sleep(0.5)
'''


@dataclass(frozen=True)
class Targets:
    """What the hostile candidates aim at, on this host."""

    tag: str
    tmp: str
    project: str
    home: str
    store_file: str
    infra_state: str
    home_file: str
    secret: str
    store_port: int
    broker_port: int
    verifier_pid: int
    other_pid: int

    def write_path(self, folder: str, how: str) -> str:
        return os.path.join(folder, f"kz-hostile-{self.tag}-{how}")

    @property
    def comm(self) -> str:
        return f"kzb{self.tag[:12]}"


def acts(t: Targets) -> dict[str, str]:
    """Each hostile act's code (the body of a function run at the start of ``forward``)."""
    out: dict[str, str] = {}
    for where, folder in (("tmp", t.tmp), ("project", t.project), ("home", t.home)):
        out[f"torch_save_{where}"] = (
            f"\n    torch.save(x[:4].clone(), {t.write_path(folder, 'torch')!r})\n")
        out[f"numpy_tofile_{where}"] = (
            f"\n    x[:4].numpy().tofile({t.write_path(folder, 'numpy')!r})\n")
        out[f"ctypes_fwrite_{where}"] = _NATIVE_WRITE.format(
            path=t.write_path(folder, "ctypes"))
    out["read_store"] = (f"\n    data = numpy.fromfile({t.store_file!r}, dtype=numpy.uint8)"
                         f".tobytes()\n" + _LEAK)
    out["read_infra_state"] = (f"\n    data = numpy.fromfile({t.infra_state!r}, "
                               f"dtype=numpy.uint8).tobytes()\n" + _LEAK)
    out["read_home"] = (f"\n    data = (repr(os.listdir({t.home!r})).encode()\n"
                        f"            + open({t.home_file!r}, 'rb').read())\n" + _LEAK)
    out["read_proc_verifier"] = (f"\n    data = open('/proc/{t.verifier_pid}/cmdline', "
                                 f"'rb').read()\n" + _LEAK)
    out["read_proc_other"] = (f"\n    data = open('/proc/{t.other_pid}/cmdline', "
                              f"'rb').read()\n" + _LEAK)
    out["list_proc"] = ('''
    others = [p for p in os.listdir("/proc")
              if p.isdigit() and int(p) not in (os.getpid(), os.getppid(), 1)]
    if others:
        data = repr(others).encode()
''' + _LEAK.replace("\n    raise", "\n        raise"))
    out["connect_store"] = _CONNECT.format(port=t.store_port)
    out["connect_broker"] = _CONNECT.format(port=t.broker_port)
    out["fork_bomb"] = _FORK_BOMB.format(comm=t.comm)
    out["memory_bomb"] = _MEMORY_BOMB
    out["time_bomb"] = _TIME_BOMB
    out["kill_parent"] = _KILL_PARENT
    out["kill_group"] = _KILL_GROUP
    return out


def source(act: str) -> str:
    """The honest ReLU candidate that first runs ``act``."""
    honest = TRITON_HONEST["relu"]
    head = ("import ctypes\nimport os\nimport signal\nimport struct\nimport time\n"
            "import numpy\n_bombed = False\n\n\ndef _act(x):" + act + "\n")
    marker = "class ModelNew(nn.Module):\n    def forward(self, x):\n"
    assert marker in honest
    return honest.replace(marker, head + "\n" + marker + "        _act(x)\n")


@dataclass
class Outcome:
    """What one hostile candidate got: its verdict and what got past the boundary."""

    name: str
    status: str
    check: str | None
    reason: str
    side_effects: list[str] = field(default_factory=list)
    connections: int = 0
    leaked: bool = False
    bomb_left: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class _Listener:
    """A TCP port on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


class HostileHost:
    """The targets of one run, and the count of what got through after each candidate."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex
        self.secret = f"kz-secret-{uuid.uuid4().hex}"
        self._state_dir = ROOT / ".kz" / f"hostile-{tag}"
        (self._state_dir / "infra").mkdir(parents=True)
        store = self._state_dir / "kz.sqlite3"
        store.write_text(f"SQLite format 3 {self.secret}")
        state = self._state_dir / "infra" / "state.json"
        state.write_text(f'{{"postgres_port": 5432, "broker": "127.0.0.1:9092", '
                         f'"token": "{self.secret}"}}')
        home = os.path.expanduser("~")
        home_file = Path(home) / f".kz-hostile-{tag}"
        home_file.write_text(self.secret)
        self._home_file = home_file
        self.store, self.broker = _Listener(), _Listener()
        self._other = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)", self.secret])
        self.targets = Targets(
            tag=tag, tmp="/tmp", project=str(ROOT), home=home, store_file=str(store),
            infra_state=str(state), home_file=str(home_file), secret=self.secret,
            store_port=self.store.port, broker_port=self.broker.port,
            verifier_pid=os.getpid(), other_pid=self._other.pid)

    def sources(self) -> dict[str, str]:
        return {name: source(act) for name, act in acts(self.targets).items()}

    def side_effects(self) -> list[str]:
        """Files of this run's tag that exist outside any scratch folder."""
        t = self.targets
        found = []
        for folder in (t.tmp, t.project, t.home):
            for entry in os.listdir(folder):
                if entry.startswith(f"kz-hostile-{t.tag}"):
                    found.append(os.path.join(folder, entry))
        return sorted(found)

    def bomb_processes(self) -> list[int]:
        """Processes of this host named by the fork bomb."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "comm").read_text().strip() == \
                        self.targets.comm:
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def judge(self, name: str, verdict: Any, seconds: float) -> Outcome:
        """The outcome of the candidate ``name`` given its verdict; then clears the host
        of whatever it left (so one leak is counted once)."""
        reason = str(verdict.reason or "")
        text = reason + repr(verdict.details)
        deadline = time.monotonic() + 10
        bombs = self.bomb_processes()
        while bombs and time.monotonic() < deadline:  # its namespace may still be going down
            time.sleep(0.2)
            bombs = self.bomb_processes()
        out = Outcome(name, verdict.status.value, verdict.check, reason[-300:],
                      side_effects=self.side_effects(),
                      connections=self.store.accepted + self.broker.accepted,
                      leaked=self.secret in text or "LEAK" in text, bomb_left=bombs,
                      seconds=round(seconds, 2))
        for path in out.side_effects:
            os.remove(path)
        self.store.accepted = self.broker.accepted = 0
        return out

    def close(self) -> None:
        self.store.close()
        self.broker.close()
        self._other.kill()
        self._other.wait()
        shutil.rmtree(self._state_dir, ignore_errors=True)
        self._home_file.unlink(missing_ok=True)
        for path in self.side_effects():
            os.remove(path)


def run_corpus(verifier: Any, host: HostileHost,
               names: list[str] | None = None) -> list[Outcome]:
    """Runs each hostile candidate (all, or ``names``) through ``verifier`` on a small
    ReLU problem and judges it."""
    from kz_stream.verify import Candidate, Problem

    sources = host.sources()
    problem = Problem(PROBLEM)
    outcomes = []
    for name in names or list(sources):
        started = time.monotonic()
        verdict = verifier.verify_sync(problem, Candidate(sources[name], "triton"))
        outcomes.append(host.judge(name, verdict, time.monotonic() - started))
    return outcomes
