"""The verifier: turns (problem, candidate) into a verdict.

Stages: static scan → CUDA build (parallel CPU compilers, cached) → problem preparation in
the device's oracle (cached per problem) → the GPU stage, one candidate per device at a
time, in a fresh pre-started worker process: load, correctness on every input set (each run
twice), launch evidence (op log, profiler, Triton ablation), interleaved timing against
the oracle, final integrity checks. Without a GPU the same pipeline runs on the CPU with
the Triton interpreter, CUDA sources are compile-checked, and the verdict lists what it
could not check.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

import aiorwlock
import numpy as np
import torch

from kz_stream.verify import astscan, lifeline
from kz_stream.verify._config import VerifierConfig
from kz_stream.verify._types import VERIFIER_VERSION, Candidate, Problem, Status, Verdict
from kz_stream.verify.build import (
    Builder,
    BuildResult,
    InlineCall,
    extract_inline_calls,
    kernel_names,
)
from kz_stream.verify.compare import (
    Comparison,
    Tolerance,
    compare_outputs,
    kernelbench_allclose,
)
from kz_stream.verify.hardware import manifest
from kz_stream.verify.inputs import at_own_shapes, nbytes
from kz_stream.verify.ipc import Child, ChildDied, ChildTimeout
from kz_stream.verify.sandbox import isolation, run_in_sandbox
from kz_stream.verify.timing import (
    bootstrap_ratio_ci,
    check_flush,
    physical_floor_ms,
    timing_set_count,
)

__all__ = ["Verifier"]

T = TypeVar("T")
log = logging.getLogger(__name__)

_STRICT_PRECISION = {
    "matmul.allow_tf32": False,
    "cudnn.allow_tf32": False,
    "float32_matmul_precision": "highest",
    "fp16_reduced": False,
    "bf16_reduced": False,
}


class RefTimer(NamedTuple):
    """A reference worker with its timing sets ready, and the GPU spin that pads both
    sides' timed calls."""

    child: Child
    pad_cycles: int
    pad_ms: float
    input_bytes: int = 0  # its timing sets


class _Reject(Exception):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


@dataclass
class Prepared:
    """A problem as the oracle prepared it (CPU tensors), cached by the parent."""

    key: str
    source: str
    seed: int
    sets: list[dict[str, Any]]
    tolerances: list[list[Tolerance]]
    specs: list[dict[str, Any]]
    ref_ops: list[str]
    static_ops: frozenset[str]
    flops: int
    bytes: int
    input_bytes: int
    weight_seed: int
    own_model_key: str
    init_args: list[Any]
    notes: list[str]
    plan_notes: list[str]
    dropped: list[dict[str, str]]
    device_peak_bytes: int
    host_bytes: int

    def set_summary(self) -> list[dict[str, Any]]:
        """Each input set checked: its label and input shapes."""
        return [{"label": s["label"], "shapes": s.get("shapes", [])} for s in self.sets]

    def state_dict(self, model_key: str) -> dict[str, Any] | None:
        """The weights of the model built with ``model_key``'s init args (sent once)."""
        return next((s["state_dict"] for s in self.sets if s["model_key"] == model_key
                     and s.get("state_dict") is not None), None)


class _Lane:
    """One device: its oracle, pre-started candidate workers, and who may use the GPU.

    ``gpu`` is a write-preferring readers-writer lock. Every request that runs kernels
    (problem preparation, a check, a worker's CUDA start-up, a comparison) takes it shared
    for that request alone, so checks of several candidates overlap; timing takes it
    exclusive, so no other process of this verifier runs kernels on the device while a
    candidate and its reference are timed, and waits only for the requests in flight.
    Never wait for a worker to start while holding it: the start-up needs it too.
    ``slots`` bounds the candidates in their GPU stage at once (memory); the oracle serves
    one request at a time (``oracle_lock``).
    """

    def __init__(self, verifier: Verifier, index: int | None) -> None:
        self.v = verifier
        self.index = index
        self.device = "cpu" if index is None else "cuda"
        self.l2_bytes = (torch.cuda.get_device_properties(index).L2_cache_size
                         if index is not None else 60 << 20)
        self.gpu = aiorwlock.RWLock()
        self.slots = asyncio.Semaphore(verifier.config.candidates_per_gpu)
        self.oracle_lock = asyncio.Lock()
        self.oracle: Child | None = None
        self.spares: list[Child] = []
        self.starting: dict[Child, asyncio.Task[None]] = {}
        self.busy = 0
        self.closed = False
        # A worker running the reference for timing: set up exactly like a candidate's
        # (same process kind, isolation and warm-up), so the two sides differ only in the
        # module they run. Kept per problem (a few, least recently used dropped unless a
        # candidate is about to be timed against it), with the reference's outputs on its
        # timing sets.
        self.ref_workers: OrderedDict[tuple[str, int], RefTimer] = OrderedDict()
        self.ref_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.ref_pins: dict[tuple[str, int], int] = {}

    def _env(self, fraction: float) -> dict[str, str]:
        env = {"KZ_GPU_MEMORY_FRACTION": str(fraction),
               "KZ_ORACLE_MEMORY_FRACTION": str(fraction)}
        if self.index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.index)
        return env

    def _spawn_worker(self) -> Child:
        if self.closed:
            raise ChildDied("the verifier is closed")
        cfg = self.v.config
        gpu = self.index is not None
        env = self._env(cfg.worker_memory_fraction)
        if not gpu and cfg.cpu_worker_memory_mb:
            env["KZ_WORKER_MEMORY_MB"] = str(cfg.cpu_worker_memory_mb)
        child = Child("kz_stream.verify.worker", [self.device], env=env,
                      isolate=True, strong=cfg.strong_isolation, gated=True, gpu=gpu,
                      # The CUDA extensions it loads are built there ahead of time.
                      read_only=(str(self.v.builder.cache_dir),) if gpu else ())
        task = asyncio.get_running_loop().create_task(self._start(child))
        task.add_done_callback(_retrieve)
        self.starting[child] = task
        return child

    async def _start(self, child: Child) -> None:
        """Lets a worker import (any time), then create its CUDA context and warm Triton up
        (GPU work: under the shared lock, so never while another process is timed), then
        warm the harness's ops up (host work and microsecond kernels: no lock; holding it
        for that made every timing wait seconds on the H200)."""
        await asyncio.to_thread(child.wait_imported)
        async with self.gpu.reader_lock:
            await asyncio.to_thread(child.wait_ready)
        await asyncio.to_thread(child.wait_warm)

    async def take_worker(self) -> Child:
        """A started worker (a pre-started spare if there is one); starts the next spares.
        Call it holding no GPU lock."""
        fresh = not self.spares
        child = self.spares.pop(0) if self.spares else self._spawn_worker()
        self.fill_spares()
        while True:
            try:
                await self.starting.pop(child)
                return child
            except (ChildDied, ChildTimeout):
                await asyncio.to_thread(child.kill)
                cfg = self.v.config
                # Only a worker that never got as far as its imports says the PID/mount
                # namespace does not suit this host; a later failure (a full GPU, say,
                # which a candidate can cause) must not turn strong isolation off.
                if (child.strong and not child.imported and cfg.strong_isolation
                        and "strong" not in self.v._fallbacks):
                    self.v._fallbacks.add("strong")
                    cfg.strong_isolation = False
                    log.warning("verifier: a worker failed to start in the jail, so workers "
                                "now run without the filesystem boundary (%s): %s",
                                isolation(False).describe(), _tail(child.stderr_tail(), 500))
                elif fresh:
                    raise
                # A spare that died or hung while waiting, or one started before the fallback.
                child, fresh = self._spawn_worker(), True
            except BaseException:  # cancelled: the child is in neither spares nor starting
                await asyncio.shield(asyncio.to_thread(child.kill))
                raise

    def fill_spares(self) -> None:
        """Starts workers ahead of need (imports, CUDA start-up and warm-up take seconds)."""
        cfg = self.v.config
        if self.closed:
            return
        want = cfg.prewarm if cfg.prewarm is not None else (
            2 * cfg.candidates_per_gpu if self.index is not None else 1)
        while len(self.spares) < want:
            self.spares.append(self._spawn_worker())

    async def oracle_call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.oracle is None or not self.oracle.alive:
            if self.oracle is not None:
                self.oracle.kill()
            if self.closed:
                raise ChildDied("the verifier is closed")
            self.oracle = Child("kz_stream.verify.oracle", [self.device],
                                env=self._env(self.v.config.oracle_memory_fraction),
                                isolate=True, strong=False)
        oracle = self.oracle
        try:
            return await asyncio.to_thread(oracle.call, msg, timeout_s)
        except (ChildDied, ChildTimeout):
            self.oracle = None
            raise

    async def reference_timer(self, p: Prepared, n_sets: int, seed: int,
                              timeout_s: float) -> RefTimer:
        """The reference worker for ``p``, with its timing sets ready. Pinned (kept
        loaded) until ``unpin((p.key, n_sets))``. Call it holding no GPU lock: it may start
        a worker."""
        key = (p.key, n_sets)
        async with self.ref_locks.setdefault(key, asyncio.Lock()):
            held = self.ref_workers.get(key)
            if held is not None and not held.child.alive:
                await asyncio.to_thread(held.child.kill)
                del self.ref_workers[key]
                held = None
            if held is None:
                held = await self._start_reference(p, n_sets, seed, timeout_s)
                raced = self.ref_workers.get(key)  # started under a lock since dropped
                if raced is not None and raced.child.alive:
                    await asyncio.to_thread(held.child.kill)
                    held = raced
                self.ref_workers[key] = held
            self.ref_workers.move_to_end(key)
            self.ref_pins[key] = self.ref_pins.get(key, 0) + 1
        try:
            await self.drop_references()
        except BaseException:
            self.unpin(key)
            raise
        return held

    def unpin(self, key: tuple[str, int]) -> None:
        self.ref_pins[key] -= 1
        if not self.ref_pins[key]:
            del self.ref_pins[key]

    async def drop_references(self, *, all_idle: bool = False) -> None:
        """Stops the least recently used reference workers beyond the cap (every idle one
        with ``all_idle``), unless pinned."""
        # Chosen and removed with no await in between, so none is pinned meanwhile.
        cfg = self.v.config
        idle = [k for k in self.ref_workers if k not in self.ref_pins]
        held = sum(r.input_bytes for r in self.ref_workers.values())
        gone: list[tuple[str, int]] = []
        for k in idle:  # least recently used first
            if not all_idle and (len(self.ref_workers) - len(gone) <= cfg.reference_workers
                                 and held <= cfg.reference_worker_bytes):
                break
            gone.append(k)
            held -= self.ref_workers[k].input_bytes
        dropped = [self.ref_workers.pop(k) for k in gone]
        for key in [k for k, lock in self.ref_locks.items()
                    if k not in self.ref_workers and not lock.locked()]:
            del self.ref_locks[key]
        for old in dropped:
            await asyncio.to_thread(old.child.kill)

    async def _start_reference(self, p: Prepared, n_sets: int, seed: int,
                               timeout_s: float) -> RefTimer:
        child = await self.take_worker()
        steps: list[dict[str, Any]] = [
            {"cmd": "load", "source": p.source + "\n\nModelNew = Model\n", "builds": []},
            {"cmd": "model", "key": p.own_model_key, "init_args": p.init_args,
             "weight_seed": p.weight_seed, "state_dict": p.state_dict(p.own_model_key)},
            {"cmd": "time_setup", "specs": p.specs, "seed": seed, "sets": n_sets,
             "model": p.own_model_key, "measure_pad": True,
             **self.v.flush_args()},
        ]
        r: dict[str, Any] = {}
        try:
            for msg in steps:
                async with self.gpu.reader_lock:
                    r = await asyncio.to_thread(child.call, msg, timeout_s)
                if not r.get("ok"):
                    raise RuntimeError(f"reference timing worker: {r.get('message')}")
        except BaseException:
            await asyncio.to_thread(child.kill)
            raise
        return RefTimer(child, int(r["pad_cycles"]), float(r["pad_ms"]),
                        n_sets * p.input_bytes)

    def close(self) -> None:
        """Kills every child, without a word: a spare may be mid-start with a start-up
        thread reading its channel, and a reference worker may be in a timing round of a
        verification still running. No worker starts after this."""
        self.closed = True
        for c in (self.oracle, *self.spares, *(t.child for t in self.ref_workers.values())):
            if c is not None:
                c.kill()
        self.oracle = None
        self.spares = []
        self.starting.clear()
        self.ref_workers.clear()


class Verifier:
    """Verifies candidates against problems; one GPU stage at a time per device.

    Use as ``async with Verifier() as v: verdict = await v.verify(problem, candidate)``,
    or ``Verifier().verify_sync(problem, candidate)`` from synchronous code. Workers that
    crash or hang are discarded and replaced; the verifier itself keeps running.
    """

    def __init__(self, config: VerifierConfig | None = None) -> None:
        self.config = config or VerifierConfig()
        check_flush(self.config.l2_flush, self.config.l2_flush_factor)
        self._secret = self.config.secret or secrets.token_bytes(32)
        devices = self.config.devices
        if devices is None:
            # The service process compares outputs on the GPU, so it needs a CUDA torch too.
            devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        self.gpu = bool(devices)
        self._device_ids: list[int | None] = list(devices) if devices else [None]
        self._lanes: list[_Lane] = []
        self._builder: Builder | None = None
        self._prepared: OrderedDict[str, Prepared] = OrderedDict()
        self._prepare_locks: dict[str, asyncio.Lock] = {}
        self._fallbacks: set[str] = set()
        self._loop_thread: _LoopThread | None = None

    # -- lifecycle

    def _ensure(self) -> None:
        if not self._lanes:
            reaped = lifeline.reap()
            if reaped:
                log.warning("verifier: killed %d process groups left by a verifier that "
                            "is gone: %s", len(reaped), reaped)
            self._lanes = [_Lane(self, i) for i in self._device_ids]
            for lane in self._lanes:
                lane.fill_spares()

    @property
    def builder(self) -> Builder:
        if self._builder is None:
            self._builder = Builder(self.config.cache_dir, jobs=self.config.build_jobs,
                                    link=self.gpu)
        return self._builder

    async def __aenter__(self) -> Verifier:
        self._ensure()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stops every child process."""
        for lane in self._lanes:
            lane.closed = True
            for task in lane.starting.values():
                task.cancel()
            await asyncio.to_thread(lane.close)
        self._lanes = []

    async def aclose(self) -> None:
        """Same as ``close``."""
        await self.close()

    def manifest(self) -> dict[str, Any]:
        """Hardware and software of this verifier, as stamped on its verdicts."""
        hw = dict(manifest())
        hw["mode"] = "gpu" if self.gpu else "cpu"
        hw["verifier_version"] = VERIFIER_VERSION
        hw["l2_flush"] = f"{self.config.l2_flush}x{self.config.l2_flush_factor}"
        hw["devices"] = [i for i in self._device_ids if i is not None]
        hw["isolation"] = isolation(self.config.strong_isolation).level  # of the workers
        return hw

    def verify_sync(self, problem: Problem, candidate: Candidate) -> Verdict:
        """Blocking ``verify`` for synchronous callers (runs on a private event loop)."""
        if self._loop_thread is None:
            self._loop_thread = _LoopThread()
        return self._loop_thread.run(self.verify(problem, candidate))

    def close_sync(self) -> None:
        if self._loop_thread is not None:
            self._loop_thread.run(self.close())
            self._loop_thread.stop()
            self._loop_thread = None

    # -- the pipeline

    def flush_args(self) -> dict[str, Any]:
        """The L2 flush both sides' timing workers use (part of a "time_setup" request)."""
        return {"flush": self.config.l2_flush, "flush_factor": self.config.l2_flush_factor}

    def _seed(self, key: str) -> int:
        digest = hmac.new(self._secret, key.encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def _verdict(self, status: Status, reason: str | None = None, **kw: Any) -> Verdict:
        return Verdict(status, reason, verifier_version=VERIFIER_VERSION,
                       hardware=self.manifest(), **kw)

    async def verify(self, problem: Problem, candidate: Candidate) -> Verdict:
        """Checks ``candidate`` against ``problem`` and returns the verdict."""
        self._ensure()
        started = time.monotonic()
        details: dict[str, Any] = {"backend": candidate.backend}
        try:
            verdict = await self._verify(problem, candidate, details)
        except _Reject as r:
            verdict = r.verdict
        except Exception as e:  # every path ends in a verdict: this one is ours, not theirs
            log.exception("verifier: infrastructure failure")
            details["traceback"] = _tail(traceback.format_exc(), 3000)
            verdict = self._verdict(Status.INFRA_ERROR, f"verifier: {type(e).__name__}: "
                                    f"{_tail(str(e), 1000)}", check="infrastructure")
        details["seconds"] = round(time.monotonic() - started, 3)
        return replace(verdict, details={**details, **verdict.details})

    async def _verify(self, problem: Problem, candidate: Candidate,
                      details: dict[str, Any]) -> Verdict:
        # 1. Static scan.
        static_ops = astscan.reference_ops(problem.source)
        findings = astscan.scan(candidate.source, static_ops)
        if findings and not self.config.static_scan:
            details["findings_ignored"] = [f"{f.rule}: {f.message}" for f in findings]
            findings = [f for f in findings if f.rule == "syntax"]
        if findings:
            details["findings"] = [f"{f.rule}: {f.message} (line {f.line})" for f in findings]
            f = findings[0]
            if f.rule == "syntax":
                return self._verdict(Status.COMPILE_ERROR, f.message, check="python_syntax")
            return self._verdict(Status.HACK, f.message, check=f.rule)
        # 2. CUDA builds, ahead of the GPU stage.
        builds: list[BuildResult] = []
        own_names: list[str] = []
        if candidate.backend == "cuda":
            builds = await self._build(candidate, details)
            for b in builds:
                own_names += kernel_names(b.call.cuda_sources)
            own_names += kernel_names(_raw_strings(candidate.source))
            if not self.gpu:
                return self._verdict(
                    Status.UNCHECKED, "no GPU here: the CUDA source compiles (nvcc, "
                    f"sm_{self.builder.toolchain.arch}); correctness and speed are unchecked",
                    check="no_gpu", unchecked=("correctness", "anti_cheat_runtime", "timing"))
        # 3. Problem preparation (cached) and the GPU stage.
        lane = min(self._lanes, key=lambda ln: ln.busy)
        lane.busy += 1
        try:
            t0 = time.monotonic()
            prepared = await self._prepare(lane, problem)
            details["prepare_s"] = round(time.monotonic() - t0, 3)
            if isinstance(prepared, Verdict):
                return prepared
            details["problem_notes"] = prepared.notes
            details["input_sets"] = prepared.set_summary()
            details["input_sets_dropped"] = prepared.dropped
            if prepared.plan_notes:
                details["memory_plan"] = prepared.plan_notes
            short = self._too_few_sets(prepared)
            if short:
                return self._verdict(Status.UNCHECKED, short, check="input_sets")
            t0 = time.monotonic()
            async with lane.slots:
                details["gpu_wait_s"] = round(time.monotonic() - t0, 3)
                verdict = await self._gpu_stage(lane, prepared, candidate, builds,
                                                own_names, details)
                if verdict.status is Status.INFRA_ERROR and verdict.check == "device_memory":
                    # The device was full of others' memory, not the candidate's: once
                    # more with the idle reference workers gone (the smaller plan).
                    details["retried"] = verdict.reason
                    await lane.drop_references(all_idle=True)
                    verdict = await self._gpu_stage(lane, prepared, candidate, builds,
                                                    list(own_names), details)
                return verdict
        finally:
            lane.busy -= 1

    async def inspect_problem(self, problem: Problem) -> dict[str, Any]:
        """Prepares ``problem`` as a verification of it would, and says how: the input
        sets used (label, shapes), those dropped and why, the memory plan, the oracle's
        peak device memory and the time; or, under "error", why it cannot be a problem
        here. Every failure is an answer, not an exception."""
        self._ensure()
        lane = min(self._lanes, key=lambda ln: ln.busy)
        t0 = time.monotonic()
        try:
            prepared = await self._prepare(lane, problem)
        except Exception as e:  # the audit reports it: one bad problem must not stop it
            return {"error": f"{type(e).__name__}: {_tail(str(e), 500)}",
                    "seconds": round(time.monotonic() - t0, 3)}
        seconds = round(time.monotonic() - t0, 3)
        if isinstance(prepared, Verdict):
            return {"error": prepared.reason, "seconds": seconds}
        return {"input_sets": prepared.set_summary(), "dropped": prepared.dropped,
                "memory_plan": prepared.plan_notes, "notes": prepared.notes,
                "too_few_sets": self._too_few_sets(prepared),
                "oracle_peak_bytes": prepared.device_peak_bytes,
                "host_bytes": prepared.host_bytes, "input_bytes": prepared.input_bytes,
                "seconds": seconds}

    def _too_few_sets(self, p: Prepared) -> str:
        """Why the verdict cannot rest on ``p``'s input sets ("" when it can)."""
        labels = [s["label"] for s in p.sets]
        dropped = ", ".join(f"{d['label']} ({d['reason'][:120]})" for d in p.dropped)
        if len(labels) < self.config.min_input_sets:
            return (f"problem: only {len(labels)} input set(s) could be evaluated "
                    f"({', '.join(labels)}; at least {self.config.min_input_sets} needed); "
                    f"dropped: {dropped or 'none'}")
        if self.gpu and not any(at_own_shapes(lb) for lb in labels):
            return (f"problem: no input set at the module's own shapes could be evaluated "
                    f"({', '.join(labels)}); dropped: {dropped or 'none'}")
        return ""

    async def _build(self, candidate: Candidate, details: dict[str, Any]) -> list[BuildResult]:
        calls = extract_inline_calls(candidate.source)
        if calls is None:
            out = await asyncio.to_thread(
                run_in_sandbox, "kz_stream.verify.build:record_inline_calls",
                (candidate.source,), timeout_s=120)
            if not out.ok:
                raise _Reject(self._verdict(
                    Status.RUNTIME_ERROR if out.error_kind != "timeout" else Status.TIMEOUT,
                    f"the module's top level failed while recording load_inline: "
                    f"{out.error_message}", check="load"))
            calls = [InlineCall.from_kwargs(kw) for kw in out.value]
        results = list(await asyncio.gather(*(self.builder.build(c) for c in calls)))
        details["builds"] = [{"name": r.call.name, "layout": r.layout, "seconds":
                              round(r.seconds, 2), "cache_hit": r.cache_hit,
                              "attempts": r.attempts} for r in results]
        for r in results:
            if not r.ok:
                raise _Reject(self._verdict(Status.COMPILE_ERROR, _tail(r.log, 3000),
                                            check="nvcc"))
        return results

    async def _prepare(self, lane: _Lane, problem: Problem) -> Prepared | Verdict:
        key = problem.key
        lock = self._prepare_locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._prepare_locked(lane, problem)
        finally:
            if not lock.locked():  # a problem seen once must not hold a lock forever
                self._prepare_locks.pop(key, None)

    async def _prepare_locked(self, lane: _Lane, problem: Problem) -> Prepared | Verdict:
        key = problem.key
        cached = self._prepared.get(key)
        if cached is not None:  # CPU tensors and figures: good for any device's lane
            self._prepared.move_to_end(key)
            return cached
        seed = self._seed(key)
        msg = {"cmd": "prepare", "source": problem.source, "key": key, "seed": seed,
               "small_only": not self.gpu,
               "full_set_budget": self.config.full_set_budget_bytes}
        try:
            async with lane.oracle_lock, lane.gpu.reader_lock:
                r = await lane.oracle_call(msg, self.config.prepare_timeout_s)
        except (ChildDied, ChildTimeout) as e:
            return self._verdict(Status.UNCHECKED, f"problem: the reference could not be "
                                 f"evaluated ({e})", check="problem")
        if not r.get("ok"):
            return self._verdict(Status.UNCHECKED, f"problem: {r.get('message')}",
                                 check="problem")
        tols = [[Tolerance(**t) for t in s["tolerances"]] for s in r["sets"]]
        prepared = Prepared(
            key=key, source=problem.source, seed=seed, sets=r["sets"], tolerances=tols,
            specs=r["specs"],
            ref_ops=r["ref_ops"], static_ops=astscan.reference_ops(problem.source),
            flops=int(r["flops"]), bytes=int(r["bytes"]), input_bytes=int(r["input_bytes"]),
            weight_seed=int(r["weight_seed"]), own_model_key=str(r["own_model_key"]),
            init_args=list(r["init_args"]), notes=list(r["notes"]),
            plan_notes=list(r.get("plan_notes", [])), dropped=list(r.get("dropped", [])),
            device_peak_bytes=int(r.get("device_peak_bytes", 0)),
            host_bytes=sum(int(s.get("bytes", 0)) for s in r["sets"]))
        self._prepared[key] = prepared
        while len(self._prepared) > 1 and (
                len(self._prepared) > self.config.problem_cache
                or sum(p.host_bytes for p in self._prepared.values())
                > self.config.problem_cache_bytes):
            self._prepared.popitem(last=False)
        return prepared

    async def _gpu_stage(self, lane: _Lane, p: Prepared, candidate: Candidate,
                         builds: list[BuildResult], own_names: list[str],
                         details: dict[str, Any]) -> Verdict:
        t0 = time.monotonic()
        try:
            worker = await lane.take_worker()
        except (ChildDied, ChildTimeout) as e:
            return self._verdict(Status.UNCHECKED, f"verifier: no worker could start ({e})",
                                 check="infrastructure")
        details["worker_wait_s"] = round(time.monotonic() - t0, 3)
        details["worker_start_s"] = {k: round(float(v), 3) for k, v in
                                     (worker.wait_ready().get("start_s") or {}).items()}
        try:
            return await _Stage(self, lane, worker, p, candidate, builds, own_names,
                                details).run()
        except _Reject as r:
            return r.verdict
        finally:
            await asyncio.to_thread(worker.kill)


class _Stage:
    """The GPU (or CPU-interpreter) stage for one candidate in one worker."""

    def __init__(self, v: Verifier, lane: _Lane, worker: Child, p: Prepared,
                 candidate: Candidate, builds: list[BuildResult], own_names: list[str],
                 details: dict[str, Any]) -> None:
        self.v, self.lane, self.w, self.p = v, lane, worker, p
        self.c = candidate
        self.builds = builds
        self.own_names = list(own_names)
        self.details = details
        self.gpu = v.gpu
        self.max_rel = 0.0
        # Comparisons run on the lane's GPU: float64 over large outputs is slow on a CPU.
        self.dev = f"cuda:{lane.index}" if lane.index is not None else "cpu"
        self.exclusive = False  # holds the lane's timing lock
        self.ref: RefTimer | None = None  # pinned in the lane while set
        self.n_sets = timing_set_count(p.input_bytes, lane.l2_bytes)
        self.timing_seed = p.seed + 7

    def _shared(self) -> Any:
        """The lane's shared GPU lock for one request, unless timing holds it exclusive."""
        return contextlib.nullcontext() if self.exclusive else self.lane.gpu.reader_lock

    async def compare(self, out: list[Any], exp: list[Any], hon: list[Any],
                      tols: list[Tolerance]) -> Comparison:
        """``compare_outputs`` on the lane's device, off the event loop; on the host when
        the device has no room for it (the smaller memory plan)."""
        async with self._shared():
            try:
                return await asyncio.to_thread(compare_outputs, out, exp, hon, tols, self.dev)
            except torch.OutOfMemoryError:
                self.details["compared_on_host"] = True
        torch.cuda.empty_cache()
        return await asyncio.to_thread(compare_outputs, out, exp, hon, tols, "cpu")

    def reject(self, status: Status, reason: str, check: str, **kw: Any) -> _Reject:
        return _Reject(self.v._verdict(status, reason, check=check, **kw))

    async def call(self, msg: dict[str, Any], timeout_s: float | None = None,
                   stage: str = "") -> dict[str, Any]:
        """A worker request; errors become the verdict they mean."""
        stage = stage or str(msg["cmd"])
        started = time.monotonic()
        oom_kills = _oom_kills()
        try:
            async with self._shared():
                r = await asyncio.to_thread(self.w.call, msg,
                                            timeout_s or self.v.config.call_timeout_s)
        except ChildTimeout as e:
            raise self.reject(Status.TIMEOUT, f"{stage}: {e}", stage) from e
        except ChildDied as e:
            status = Status.RUNTIME_ERROR
            killed = e.returncode is not None and e.returncode in (-9, 137)
            # A SIGKILL is the kernel's OOM killer only if it killed something meanwhile
            # (a candidate can kill its own process group too).
            if (killed and (oom_kills is None or _oom_kills() != oom_kills)) or (
                    "out of memory" in e.stderr_tail.lower()):
                status = Status.OUT_OF_MEMORY
            raise self.reject(status, f"{stage}: worker crashed: {e}; "
                              f"{_tail(e.stderr_tail, 1500)}", stage) from e
        finally:  # where a candidate's time goes, per worker request kind
            spent = self.details.setdefault("stage_s", {})
            spent[stage] = round(spent.get(stage, 0.0) + time.monotonic() - started, 3)
        if r.get("violations"):
            raise self.reject(Status.HACK, f"forbidden action: {r['violations'][0]}", "forbidden")
        if r.get("ok"):
            return r
        kind, message = r.get("error"), str(r.get("message", ""))
        self.details.setdefault("traceback", _tail(str(r.get("traceback", "")), 3000))
        if kind == "oom":
            if device_was_full(message):
                raise self.reject(Status.INFRA_ERROR, f"{stage}: the device had no room "
                                  f"(the verifier's other processes held it): {message}",
                                  "device_memory")
            raise self.reject(Status.OUT_OF_MEMORY, f"{stage}: {message}", stage)
        if kind == "compile_error":
            raise self.reject(Status.COMPILE_ERROR, f"{stage}: {message}", "triton_compile")
        if kind == "forbidden":
            raise self.reject(Status.HACK, f"{stage}: {message}", "forbidden")
        if not self.gpu and ("cuda" in message.lower() and ("not compiled" in message.lower()
                                                             or "no nvidia" in message.lower())):
            raise self.reject(Status.UNCHECKED, f"{stage}: the candidate needs a GPU: {message}",
                              "no_gpu", unchecked=("correctness", "timing"))
        raise self.reject(Status.RUNTIME_ERROR, f"{stage}: {message}", stage)

    async def run(self) -> Verdict:
        try:
            return await self._run()
        finally:
            if self.ref is not None:
                self.lane.unpin((self.p.key, self.n_sets))

    async def _run(self) -> Verdict:
        unchecked = await self._checks()
        speedup: float | None = None
        ci: tuple[float, float] | None = None
        if self.ref is not None:
            cfg, p = self.v.config, self.p
            await self.call({"cmd": "time_setup", "specs": p.specs, "seed": self.timing_seed,
                             "sets": self.n_sets, "model": p.own_model_key,
                             **self.v.flush_args()},
                            cfg.load_timeout_s, stage="timing warm-up")
            t0 = time.monotonic()
            async with self.lane.gpu.writer_lock:
                self.details["timing_wait_s"] = round(time.monotonic() - t0, 3)
                t0 = time.monotonic()
                self.exclusive = True
                try:
                    speedup, ci, kept, ref_kept = await self._timing(self.ref)
                finally:
                    self.exclusive = False
            self.details["timing_s"] = round(time.monotonic() - t0, 3)
            await self._check_timed_outputs(kept, ref_kept)
        elif self.gpu:
            unchecked.append("timing")
        fin = await self.call({"cmd": "finish"})
        self._integrity(fin, "after running")
        if fin.get("threads"):
            raise self.reject(Status.HACK, "a Python thread started by the candidate is still "
                              "running", "thread")
        self.details["native_threads"] = [fin.get("native_threads_at_load"),
                                          fin.get("native_threads")]
        return self.v._verdict(Status.CORRECT, None, max_rel_error=self.max_rel,
                               speedup=speedup, speedup_ci=ci, details=self.details,
                               unchecked=tuple(unchecked))

    async def _checks(self) -> list[str]:
        """Load, correctness and launch checks; returns what could not be checked."""
        p = self.p
        load = await self.call({"cmd": "load", "source": self.c.source,
                                "builds": [b.manifest() for b in self.builds]},
                               self.v.config.load_timeout_s)
        self._integrity(load, "at load")
        self.own_names += load.get("triton_kernels", [])
        weights: dict[str, bool] = {}
        for s in p.sets:
            if s["model_key"] in weights:
                continue
            r = await self.call({"cmd": "model", "key": s["model_key"],
                                 "init_args": s["init_args"], "weight_seed": p.weight_seed,
                                 "state_dict": p.state_dict(s["model_key"])},
                                stage="construct")
            weights[s["model_key"]] = bool(r["weights_loaded"])
        self.details["weights_loaded"] = all(weights.values())
        launches = await self._correctness()
        unchecked: list[str] = []
        checks = self.v.config.launch_checks
        if self.c.backend == "triton" and checks:
            await self._triton_launches(launches)
        if self.gpu and self.v.config.timing:
            # The reference's timing worker now (shared lock; it may start a worker): its
            # pad goes before the profiled calls as before the timed ones.
            cfg = self.v.config
            try:
                self.ref = await self.lane.reference_timer(
                    self.p, self.n_sets, self.timing_seed, cfg.load_timeout_s)
            except (ChildDied, ChildTimeout, RuntimeError) as e:
                raise self.reject(Status.UNCHECKED, f"reference timing failed: {e}",
                                  "problem") from e
        if self.gpu and checks:
            await self._profile()
        else:
            unchecked += ["device_time_share", "streams", "timing"]
        return unchecked

    def _integrity(self, r: dict[str, Any], when: str) -> None:
        changed = [c for c in r.get("changed", []) if not c.startswith("torch.ops.")]
        if changed:
            raise self.reject(Status.HACK, f"rebinds {', '.join(changed[:5])} {when}",
                              "monkeypatch")
        prec = r.get("precision") or {}
        off = [k for k, v in _STRICT_PRECISION.items() if k in prec and prec[k] != v]
        if off:
            raise self.reject(Status.HACK, f"lowers precision settings ({', '.join(off)}) {when}",
                              "precision")

    def _msg_run(self, i: int, **extra: Any) -> dict[str, Any]:
        s = self.p.sets[i]
        return {"cmd": "run", "inputs": s["inputs"], "out_specs": s["out_specs"],
                "model": s["model_key"], **extra}

    async def _correctness(self) -> dict[str, int]:
        p = self.p
        launches: dict[str, int] = {}
        for i, s in enumerate(p.sets):
            r = await self.call(self._msg_run(i, reps=2, log_ops=(i == 0)),
                                stage=f"run on input set {i} ({s['label']})")
            launches = r.get("launches", launches)
            if i == 0:  # KernelBench's rule, beside ours (on its own inputs on a GPU)
                self.details["kernelbench_rule"] = await asyncio.to_thread(
                    kernelbench_allclose, r["outputs"][0], s["honest"])
                self.details["kernelbench_rule_set"] = s["label"]
            for flag in r.get("flags", []):
                raise self.reject(Status.HACK, _FLAG_TEXT.get(flag, flag), flag, input_index=i)
            results: list[Comparison] = []
            exp, hon = self._reference(i)
            for out in r["outputs"]:
                results.append(await self.compare(out, exp, hon, p.tolerances[i]))
            for rep, cmp in enumerate(results):
                if not cmp.ok:
                    check = "repeat_mismatch" if rep == 1 and results[0].ok else cmp.check
                    reason = (f"input set {i} ({s['label']}): {cmp.message}" if check == cmp.check
                              else f"input set {i}: the second run differs from the first "
                                   f"({cmp.message})")
                    raise self.reject(Status.INCORRECT, reason, check or "mismatch",
                                      input_index=i, max_rel_error=_finite(cmp.rel_norm_error),
                                      details={"bad_fraction": cmp.bad_fraction})
                self.max_rel = max(self.max_rel, cmp.rel_norm_error)
            if i == 0 and self.v.config.launch_checks:
                self._fallback_ops(r.get("ops", []))
        return launches

    def _reference(self, i: int) -> tuple[list[Any], list[Any]]:
        """Expected and honest outputs of set ``i``, cached on the comparison device when
        small (a big one stays on the host: the comparison moves it block by block)."""
        s = self.p.sets[i]
        key = f"_on_{self.dev}"
        if nbytes(s["expected"]) + nbytes(s["honest"]) > _DEVICE_CACHED_OUTPUT_BYTES:
            return s["expected"], s["honest"]
        if key not in s:
            s[key] = ([t.to(self.dev) for t in s["expected"]],
                      [t.to(self.dev) for t in s["honest"]])
        cached: tuple[list[Any], list[Any]] = s[key]
        return cached

    def _fallback_ops(self, ops: list[str]) -> None:
        ref = {astscan.canonical_op(o) for o in self.p.ref_ops} | set(self.p.static_ops)
        mine = {astscan.canonical_op(o) for o in ops}
        hits = sorted(o for o in mine & ref if o not in astscan.BENIGN_OPS
                      and o not in astscan._ARITHMETIC)
        self.details["torch_ops"] = sorted(mine - astscan.BENIGN_OPS)
        if hits and self.v.config.fallback_policy == "any":
            raise self.reject(Status.HACK, f"runs the reference's own torch ops: "
                              f"{', '.join(hits)}", "torch_fallback")
        if hits:
            self.details["torch_fallback_ops"] = hits

    async def _triton_launches(self, launches: dict[str, int]) -> None:
        launched = [k for k, n in launches.items() if n > 0]
        self.details["launches"] = launches
        if not launched:
            raise self.reject(Status.HACK, "none of the candidate's Triton kernels was "
                              "launched", "no_kernel_launched")
        s = self.p.sets[0]
        # Another set of the same model and shapes runs before each ablated call: buffers
        # the candidate allocates (its partial sums) then hold that set's values, not set
        # 0's from an earlier call, so skipping the kernel that writes them shows.
        other = next((o for o in self.p.sets[1:] if o["model_key"] == s["model_key"]
                      and o.get("shapes") == s.get("shapes")), None)
        r = await self.call({"cmd": "ablate", "kernels": launched, "inputs": s["inputs"],
                             "out_specs": s["out_specs"], "model": s["model_key"],
                             "other_inputs": other["inputs"] if other else None},
                            stage="ablation")
        decoys = []
        for name, out in r["outputs"].items():
            if out and isinstance(out[0], str):
                continue
            exp, hon = self._reference(0)
            if (await self.compare(out, exp, hon, self.p.tolerances[0])).ok:
                decoys.append(name)
        self.details["decoy_kernels"] = decoys
        if decoys and len(decoys) == len(launched):
            raise self.reject(Status.HACK, f"the output is right without kernel(s) "
                              f"{', '.join(decoys)}: they do not do the work", "decoy_kernel")
        self.own_names = [n for n in self.own_names if n not in decoys]

    async def _profile(self) -> None:
        s = self.p.sets[0]
        pad = self.ref.pad_cycles if self.ref is not None else 0
        r = await self.call({"cmd": "profile", "inputs": s["inputs"], "calls": 2,
                             "model": s["model_key"], "pad_cycles": pad}, stage="profile")
        kernels = [k for k in r["kernels"] if k.get("cat") == "kernel"]
        if not kernels:
            raise self.reject(Status.HACK, "no GPU kernel ran", "no_own_kernels")
        harness = kernels[0]  # the marker the worker launches first
        # The harness's spins before each call are neither the candidate's nor fallback.
        rest = [k for k in kernels[1:] if not (pad and k["name"].startswith(_SPIN_KERNEL))]
        own = [k for k in rest if _is_own(k["name"], self.own_names)]
        total = sum(k["us"] for k in rest) or 1e-9
        share = sum(k["us"] for k in own) / total
        self.details["own_device_share"] = round(share, 4)
        self.details["kernels"] = _top_kernels(rest)
        if not own:
            raise self.reject(Status.HACK, "none of the candidate's own kernels ran; "
                              f"device time went to {_top_names(rest)}", "no_own_kernels")
        if share < self.v.config.own_share_min:
            raise self.reject(Status.HACK, f"the candidate's kernels did {share:.0%} of the "
                              f"device time; the rest went to {_top_names(rest)}",
                              "torch_fallback_time")
        streams = {k.get("stream") for k in own} - {None}
        if harness.get("stream") is not None and streams - {harness.get("stream")}:
            raise self.reject(Status.HACK, "the candidate's kernels run on a side stream",
                              "side_stream")

    async def _timing(self, ref: RefTimer) -> tuple[float, tuple[float, float],
                                                    dict[int, list[Any]], dict[int, list[Any]]]:
        """Interleaved timed rounds of the reference and the candidate; call it holding the
        lane's timing lock. Returns the speedup, its interval, and the outputs both sides
        gave for the calls kept (one per round, at random; each call's inputs are fresh
        values, the same on both sides).

        Workers started ahead of need create CUDA contexts and warm Triton up; seen on the
        H200, that moved A/A results by several percent when it landed inside one side's
        rounds. That part of their start-up takes the shared lock (``_Lane._start``), so
        none runs now; their harness warm-up (host work, microsecond kernels) may."""
        cfg, p = self.v.config, self.p
        n_sets = self.n_sets
        ref_ev: list[float] = []
        ref_host: list[float] = []
        c_ev: list[float] = []
        c_host: list[float] = []
        ref_issue: list[float] = []
        c_issue: list[float] = []
        rng = np.random.default_rng(p.seed ^ 0x5EED)
        calls = 3
        kept: dict[int, list[Any]] = {}
        ref_kept: dict[int, list[Any]] = {}
        start = 0
        t_begin = time.monotonic()
        rounds = 0
        speed = (1.0, 0.0, float("inf"))
        while True:
            keep = [start + int(rng.integers(0, calls))]
            order = [True, False] if rounds % 2 == 0 else [False, True]
            for ref_first in order:
                if ref_first:
                    try:
                        r = await asyncio.to_thread(ref.child.call, {
                            "cmd": "time", "calls": calls, "start": start, "keep": keep},
                            cfg.call_timeout_s)
                    except (ChildDied, ChildTimeout) as e:
                        raise self.reject(Status.UNCHECKED, f"reference timing failed: {e}",
                                          "problem") from e
                    if not r.get("ok"):
                        raise self.reject(Status.UNCHECKED, f"reference timing failed: "
                                          f"{r.get('message')}", "problem")
                    ref_ev += r["event_ms"]
                    ref_host += r["host_ms"]
                    ref_issue += r["issue_ms"]
                    ref_kept.update({int(k): v for k, v in r["outputs"].items()})
                else:
                    r = await self.call({"cmd": "time", "calls": calls, "start": start,
                                         "keep": keep, "pad_cycles": ref.pad_cycles},
                                        stage="timing")
                    c_ev += r["event_ms"]
                    c_host += r["host_ms"]
                    c_issue += r["issue_ms"]
                    kept.update({int(k): v for k, v in r["outputs"].items()})
            start += calls
            rounds += 1
            # Size rounds to about round_ms of the slower side (each call also waits out the pad).
            slow = max(float(np.median(ref_ev)), float(np.median(c_ev)), 1e-3) + ref.pad_ms
            calls = int(min(max(cfg.round_ms / slow, 3), 200))
            if rounds >= 2:
                speed = bootstrap_ratio_ci(ref_ev, c_ev, iters=500, seed=rounds)
            spent = time.monotonic() - t_begin
            half = (speed[2] - speed[1]) / 2 / max(speed[0], 1e-12)
            if rounds >= cfg.max_rounds or (rounds >= cfg.min_rounds and half <= cfg.target_ci):
                break
            if spent > 2 * cfg.time_budget_s and rounds >= 2:
                break
        speed = bootstrap_ratio_ci(ref_ev, c_ev, iters=2000, seed=1)
        med_c = float(np.median(c_ev))
        med_r = float(np.median(ref_ev))
        gap_c = float(np.median(np.asarray(c_host) - np.asarray(c_ev)))
        gap_r = float(np.median(np.asarray(ref_host) - np.asarray(ref_ev)))
        floor = physical_floor_ms(p.bytes, p.flops)
        self.details["timing"] = {
            "candidate_ms": round(med_c, 5), "reference_ms": round(med_r, 5),
            "issue_ms": [round(float(np.median(ref_issue)), 5),
                         round(float(np.median(c_issue)), 5)],
            "pad_ms": round(ref.pad_ms, 4),
            "samples": [len(ref_ev), len(c_ev)], "rounds": rounds, "sets": n_sets,
            "host_gap_ms": [round(gap_r, 4), round(gap_c, 4)], "floor_ms": round(floor, 5),
        }
        # Side work shorter than the pad runs under it unseen, and the harness's own host
        # jitter reaches the pad's order and beyond (seen on the H200: +0.14 ms on an honest
        # CUDA candidate under a 0.28 ms pad; +0.42 and +0.68 ms in A/A runs, the reference
        # against itself, while other workers started): hence the 1 ms floor. The
        # profiler's stream check, the unsynchronized-output check and the timed-output
        # check cover what this misses.
        if gap_c - gap_r > max(0.25 * med_c, 1.0, ref.pad_ms):
            raise self.reject(Status.HACK, f"host time with a device-wide sync exceeds the "
                              f"event time by {gap_c - gap_r:.3f} ms more than the "
                              "reference's: work escapes the timed stream",
                              "unsynchronized_timing")
        if med_c < cfg.floor_margin * floor:
            raise self.reject(Status.HACK, f"{med_c:.4f} ms is below the physical floor "
                              f"{floor:.4f} ms (bytes and FLOPs at H200 peak)", "physical_floor")
        return speed[0], (speed[1], speed[2]), kept, ref_kept

    async def _check_timed_outputs(self, kept: dict[int, list[Any]],
                                   ref_kept: dict[int, list[Any]]) -> None:
        """Timed calls' outputs must be right too (against the reference's, same inputs):
        a candidate that serves a timed call from a memo returns a stale output here."""
        p = self.p
        s1 = next((i for i, s in enumerate(p.sets) if s["label"] == "normal"), 0)
        loose_all = [Tolerance(t.rel_norm * 2 + t.honest_rel_norm, t.atol * 2, t.rtol * 2,
                               t.honest_rel_norm, t.dont_care_fraction)
                     for t in p.tolerances[s1]]
        for j, out in kept.items():
            ref_out = ref_kept[j]
            loose = loose_all
            if len(loose) != len(ref_out):
                loose = [loose[0]] * len(ref_out)
            cmp = await self.compare(out, ref_out, ref_out, loose)
            if not cmp.ok:
                raise self.reject(Status.HACK, f"a timed call returned a wrong output "
                                  f"({cmp.message})", "timed_output")


_FLAG_TEXT = {
    "unsynchronized_output": "the output changed after the call returned: work was left "
                             "running on another stream or thread",
    "input_mutation": "the candidate modified an input",
    "output_aliases_input": "an output shares memory with an input",
    "output_reuses_earlier_output": "an output shares memory with an earlier call's output "
                                    "(cached result)",
    "thread": "the candidate started a Python thread",
}


_OOM_SIZES = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]i?B)\b.*?of which ([\d.]+) "
                        r"([KMGT]i?B) is free", re.S)
_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed on this host, if it says."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def device_was_full(message: str) -> bool:
    """Whether a CUDA out-of-memory message says the device as a whole had less free
    than was asked for (others' memory), not that this process reached its own cap
    (``set_per_process_memory_fraction``: then the device still had room)."""
    m = _OOM_SIZES.search(message)
    if m is None:
        return False
    asked = float(m.group(1)) * _UNITS.get(m.group(2), 1)
    free = float(m.group(3)) * _UNITS.get(m.group(4), 1)
    return free < asked


def _retrieve(task: asyncio.Task[None]) -> None:
    """Marks a start-up task's failure as seen: the worker is replaced when it is taken."""
    if not task.cancelled():
        task.exception()


# Expected and honest outputs of one set up to this size are kept on the comparison
# device between a candidate's runs; bigger ones are moved there block by block.
_DEVICE_CACHED_OUTPUT_BYTES = 256 << 20

_SPIN_KERNEL = "at::cuda::(anonymous namespace)::spin_kernel("  # torch.cuda._sleep's


def _base_name(kernel: str) -> str:
    """A profiled kernel's bare name: no return type, namespace, template or arguments
    (``at::cuda::(anonymous namespace)::spin_kernel(long)`` is ``spin_kernel``)."""
    base = kernel.removeprefix("void ").replace("(anonymous namespace)", "")
    base = base.split("(")[0].split("<")[0].strip()
    return base.split("::")[-1]


def _is_own(kernel: str, names: Sequence[str]) -> bool:
    return _base_name(kernel) in names


def _top_kernels(kernels: list[dict[str, Any]], n: int = 5) -> list[list[Any]]:
    agg: dict[str, float] = {}
    for k in kernels:
        agg[k["name"][:80]] = agg.get(k["name"][:80], 0.0) + float(k["us"])
    return [[name, round(us, 2)] for name, us in sorted(agg.items(), key=lambda x: -x[1])[:n]]


def _top_names(kernels: list[dict[str, Any]]) -> str:
    return ", ".join(name for name, _ in _top_kernels(kernels, 3)) or "nothing"


def _raw_strings(source: str) -> list[str]:
    """The string literals of a candidate that define CUDA kernels."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [t for t in astscan.string_constants(tree) if "__global__" in t]


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "…" + text[-n:]


class _LoopThread:
    """An event loop on a daemon thread, for the synchronous wrapper."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
