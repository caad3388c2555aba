"""Verifier consumers scaling across GPUs, and a consumer killed mid-run.

N verifier services (``kz serve verifier``, one process per GPU through
``CUDA_VISIBLE_DEVICES``) share one consumer group on a topic of pre-generated kernels on
the tansu broker; verdicts go to one SQLite store. For each N: verified candidates per
minute in the steady window (from the moment every consumer has stored its first verdict
until 90% of the kernels are verified), against N = 1 measured in the same run.

With ``--kill``, the largest N's run SIGKILLs one consumer as soon as its first batch of
verdicts is stored (more kernels than one batch per consumer leave it work to lose); its
partitions move to the others, and the run checks that every kernel has
exactly one verdict in the store (nothing lost, nothing duplicated). Its throughput window
ends at the kill.

Run: ``python -m benchmarks.bench_verifier_scaling --gpus 1,2 --kill [--out DIR]``.
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
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kz_stream.app import open_context  # noqa: E402
from kz_stream.config import Settings, TopicsConfig  # noqa: E402
from kz_stream.events import (  # noqa: E402
    Event,
    KernelGenerated,
    ModuleProposed,
    ModuleValidation,
    new_event,
)
from kz_stream.infra import LocalBroker  # noqa: E402
from kz_stream.store import open_store  # noqa: E402
from kz_stream.testing.corpus.cheats import CHEATS  # noqa: E402
from kz_stream.testing.corpus.cuda_honest import CUDA_HONEST  # noqa: E402
from kz_stream.testing.corpus.problems import PROBLEMS  # noqa: E402
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST  # noqa: E402


def workload(n: int, backends: tuple[str, ...] = ("triton", "cuda")) -> list[tuple[str, str, str]]:
    """``n`` (problem, backend, source) kernels: honest Triton and CUDA candidates and
    cheats, each a distinct source (a Coder's samples differ)."""
    base = [(p, "triton", s) for p, s in sorted(TRITON_HONEST.items())]
    base += [(p, "cuda", s) for p, s in sorted(CUDA_HONEST.items())]
    base += [(c[0], c[1], c[2]) for _, c in sorted(CHEATS.items())][::3]
    base = [k for k in base if k[1] in backends]
    return [(p, b, f"# sample {i}\n{s}") for i, (p, b, s) in
            ((i, base[i % len(base)]) for i in range(n))]


def _topics(tag: str) -> TopicsConfig:
    return TopicsConfig(modules=f"kz.modules.{tag}", kernels=f"kz.kernels.{tag}",
                        frontier=f"kz.frontier.{tag}", policy=f"kz.policy.{tag}",
                        dead_letter=f"kz.dead-letter.{tag}", partitions=8)


async def seed(settings: Settings, kernels: list[tuple[str, str, str]]) -> list[str]:
    """Stores the modules (as the recorder would) and publishes the kernels."""
    events: list[Event] = []
    async with open_context(settings) as ctx:
        modules = [new_event(ModuleProposed(module_id=p, api_set=[], source=PROBLEMS[p],
                                            validation=ModuleValidation(valid=True)),
                             stream_id=f"module-{p}", stream_version=0)
                   for p in sorted({k[0] for k in kernels})]
        await ctx.store.append(modules)
        for i, (p, backend, src) in enumerate(kernels):
            kid = f"k{i:04d}-{uuid.uuid4().hex[:8]}"
            events.append(new_event(
                KernelGenerated(kernel_id=kid, module_id=p, group_id=f"g{i // 4}",
                                group_size=4, backend=backend, source=src),  # type: ignore[arg-type]
                stream_id=f"kernel-{kid}", stream_version=0))
        await ctx.store.append(events)
        await ctx.bus.publish_many(settings.topics.kernels, events)
    return [e.payload["kernel_id"] for e in events]


async def verdicts(url: str) -> list[tuple[str, float, str]]:
    """(kernel id, verdict time, producer) of every KernelVerified in the store."""
    out = []
    async with open_store(url, create_schema=False) as store:
        async for batch in store.read_all(0, types=["KernelVerified"]):
            for r in batch:
                out.append((r.event.payload["kernel_id"], r.event.occurred_at.timestamp(),
                            r.event.producer))
    return out


def start_consumer(env: dict[str, str], gpu: int, log: Path) -> subprocess.Popen[bytes]:
    e = dict(env, CUDA_VISIBLE_DEVICES=str(gpu))
    return subprocess.Popen([sys.executable, "-m", "kz_stream.cli", "serve", "verifier"],
                            env=e, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)


def run_n(n: int, broker_url: str, work: Path, per_gpu: int, cap_s: float,
          kill: bool, backends: tuple[str, ...]) -> dict[str, Any]:
    tag = f"n{n}-{uuid.uuid4().hex[:6]}"
    url = f"sqlite+aiosqlite:///{work}/{tag}.sqlite3"
    settings = Settings(database_url=url, bus_url=broker_url, topics=_topics(tag))
    kernels = workload(per_gpu * n, backends)
    ids = asyncio.run(seed(settings, kernels))
    env = dict(os.environ, KZ_DATABASE_URL=url, KZ_BUS_URL=broker_url,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **{f"KZ_TOPICS__{k.upper()}": str(v)
                  for k, v in settings.topics.model_dump().items()})
    procs = [start_consumer(env, g, work / f"{tag}-consumer{g}.log") for g in range(n)]
    t0 = time.time()
    killed_at: float | None = None
    seen: list[tuple[str, float, str]] = []
    try:
        while time.time() - t0 < cap_s:
            time.sleep(2.0)
            seen = asyncio.run(verdicts(url))
            done = len({k for k, _, _ in seen})
            print(f"N={n} t={time.time() - t0:5.0f}s verdicts={len(seen)} kernels={done}/"
                  f"{len(ids)}", flush=True)
            victim = f":{procs[-1].pid}"
            if kill and killed_at is None and any(p.endswith(victim) for _, _, p in seen):
                # Mid-run: its first batch is stored and the rest of its partitions wait.
                os.kill(procs[-1].pid, signal.SIGKILL)  # the process only, as a crash would
                killed_at = time.time()
                print(f"killed consumer {n - 1} (pid {procs[-1].pid}) with {done} kernels "
                      "verified", flush=True)
            if done >= len(ids):
                break
            if any(p.poll() not in (None, -signal.SIGKILL) for p in procs):
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    seen = asyncio.run(verdicts(url))
    firsts: dict[str, float] = {}
    for _, ts, prod in sorted(seen, key=lambda v: v[1]):
        firsts.setdefault(prod, ts)
    times = sorted(ts for _, ts, _ in seen)
    start = max(firsts.values()) if len(firsts) >= n else float("nan")
    end = times[int(0.9 * (len(ids) - 1))] if len(times) >= 0.9 * len(ids) else times[-1]
    if killed_at is not None:
        end = min(end, killed_at)
    in_window = [t for t in times if start < t <= end]
    rate = 60 * len(in_window) / (end - start) if end > start else float("nan")
    kernel_ids = [k for k, _, _ in seen]
    result = {
        "n": n, "kernels": len(ids), "verdicts": len(seen),
        "verified_kernels": len(set(kernel_ids)),
        "missing": sorted(set(ids) - set(kernel_ids)),
        "duplicates": len(kernel_ids) - len(set(kernel_ids)),
        "per_min": rate, "window_s": end - start, "window_verdicts": len(in_window),
        "first_verdict_s": {p: round(ts - t0, 1) for p, ts in firsts.items()},
        "wall_s": time.time() - t0, "killed": killed_at is not None,
        "verified_after_kill": sum(ts > killed_at for _, ts, _ in seen) if killed_at else 0,
        "exit_codes": [p.returncode for p in procs],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "missing"}), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1,2", help="consumer counts to run, one GPU each")
    ap.add_argument("--per-gpu", type=int, default=16, help="kernels per consumer")
    ap.add_argument("--cap-s", type=float, default=150.0, help="time cap per N")
    ap.add_argument("--kill", action="store_true", help="kill one consumer in the largest N")
    ap.add_argument("--backends", default="triton,cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    backends = tuple(args.backends.split(","))
    counts = [int(x) for x in args.gpus.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kz-scale-"))
    raw: dict[str, Any] = {"runs": []}
    broker = LocalBroker().start(work / "broker.log")
    try:
        for n in counts:
            kill = args.kill and n == max(counts) and n > 1
            raw["runs"].append(run_n(n, f"kafka://{broker.bootstrap}", work, args.per_gpu,
                                     args.cap_s * (1.6 if kill else 1.0), kill, backends))
            _save(raw, args.out, work)  # a run cut short keeps the counts it finished
    finally:
        broker.stop()
    write(raw)


def _save(raw: dict[str, Any], out_dir: str | None, work: Path) -> None:
    if not out_dir:
        return
    from benchmarks._results import machine_description

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw.setdefault("_machine", machine_description())
    raw.setdefault("_date", datetime.now().isoformat())
    raw["_command"] = "python -m benchmarks.bench_verifier_scaling " + " ".join(sys.argv[1:])
    (out / "verifier_scaling_raw.json").write_text(json.dumps(raw, indent=1))
    for log in work.glob("*.log"):
        (out / log.name).write_bytes(log.read_bytes()[-200_000:])


def write(raw: dict[str, Any]) -> None:
    from benchmarks._results import metric, write_result

    runs = raw["runs"]
    one = next((r for r in runs if r["n"] == 1), None)
    m: dict[str, dict[str, Any]] = {}
    for r in runs:
        base = one["per_min"] * r["n"] if one and r["n"] > 1 else None
        m[f"verified_per_min_n{r['n']}"] = metric(
            r["per_min"], "candidates/min (target >= 0.9*N x N=1)", base)
        if r["killed"]:
            m["kill_run_verified_after_kill"] = metric(float(r["verified_after_kill"]),
                                                       "kernels")
            m["kill_run_missing"] = metric(float(len(r["missing"])), "kernels (target 0)")
            m["kill_run_duplicates"] = metric(float(r["duplicates"]), "verdicts (target 0)")
    notes = ("one consumer process per GPU (CUDA_VISIBLE_DEVICES), one consumer group on an "
             "8-partition topic on the tansu broker, SQLite store; baseline of N>1: N times "
             "the N=1 rate; steady window from every consumer's first verdict to 90% verified"
             " (to the kill in the kill run)")
    write_result("verifier_scaling", raw.get("_command", "python -m benchmarks."
                                                 "bench_verifier_scaling"), m,
                 notes=notes + (f"; {raw['_note']}" if raw.get("_note") else ""),
                 machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
