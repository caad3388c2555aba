"""The verifier: turns (problem, candidate) into a verdict.

Stages: static scan → CUDA build (parallel CPU compilers, cached) → problem preparation in
one of the device's oracles (cached per problem) → the GPU stage, one candidate per device at a
time, in a fresh pre-started worker process (``_checks.Stage``): load, correctness on every
input set (each run twice), launch evidence (op log, profiler, Triton ablation),
interleaved timing against the reference, final integrity checks. Without a GPU the same
pipeline runs on the CPU with the Triton interpreter, CUDA sources are compile-checked,
and the verdict lists what it could not check. The processes of each device are its
``_pool.Lane``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

from kz_stream.verify import _astscan as astscan
from kz_stream.verify import _lifeline as lifeline
from kz_stream.verify._admission import Admission, admission_check, admission_device_bytes
from kz_stream.verify._build import Builder, BuildResult
from kz_stream.verify._checks import (
    Reject,
    Ruling,
    Stage,
    device_was_full,
    killed_for_memory,
    oom_kills,
    problem_failure,
)
from kz_stream.verify._config import VerifierConfig
from kz_stream.verify._extract import InlineCall, extract_inline_calls
from kz_stream.verify._hardware import manifest
from kz_stream.verify._inputs import at_own_shapes, cloned_bytes, nbytes
from kz_stream.verify._ipc import ChildDied, ChildTimeout, reap_left_behind, tail
from kz_stream.verify._messages import PrepareRequest
from kz_stream.verify._pool import ByteBudget, Lane, host_memory_bytes
from kz_stream.verify._preflight import IMPORTS as PREFLIGHT_IMPORTS
from kz_stream.verify._prepared import Prepared
from kz_stream.verify._rewrite import kernel_names
from kz_stream.verify._sandbox import SandboxOutcome, isolation, run_in_sandbox
from kz_stream.verify._timing import check_flush
from kz_stream.verify._types import VERIFIER_VERSION, Candidate, Problem, Status, Verdict

__all__ = ["Verifier", "VerifierConfig"]

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class _InUse:
    """A problem being verified: how many verifications of it run, and the host bytes it
    holds once admitted."""

    users: int = 0
    nbytes: int | None = None
    admitting: asyncio.Lock = field(default_factory=asyncio.Lock)


def preparation_bytes(input_bytes: int, output_bytes: int | None,
                      full_set_budget: int, weight_bytes: int = 0,
                      small_share: float = 1 / 8) -> int:
    """Host bytes a problem's preparation holds at its peak, from its own inputs' sizes
    and what a set keeps of its outputs (``output_bytes``: honest and float64, as
    ``module_footprint`` counts them), as the oracle's memory plan makes its sets
    (``Oracle.prepare``): each set holds its inputs and those outputs. The own set is
    always at full size; each later set at the module's own shapes (signed, normal,
    heavy, odd) is too while the full-size sets together stay within ``full_set_budget``
    (0: no bound), and runs at about an eighth of the shapes past it, as the small set
    does: each such set holds at most ``small_share`` of the own one
    (``small_set_share``). An unknown output counts as a float32 one as large
    as the inputs (three times their bytes).
    The sets carry their models' weights once per distinct model: the own model's, the
    odd set's (its init arguments one less) and the scaled-down sets' (at an eighth).

    One copy: the verifier maps the oracle's sealed host files rather than copying them.
    On an H100 host (2026-12-06, ``bench_host_memory --prepare-only``) the 6 GiB ReLU
    and softmax took 25.8 and 26.3 GiB to prepare and the 8 GiB argmax 8.2 GiB, against
    39.0 and 13.0 GiB by this bound (78 and 40 GiB by its earlier form, which counted two
    copies and budgeted partial sets)."""
    own = input_bytes + (3 * input_bytes if output_bytes is None else output_bytes)
    small = math.ceil(own * small_share)
    held, full_sets = own, 1
    for _ in range(4):  # signed, normal, heavy, odd
        if full_set_budget and own * (full_sets + 1) > full_set_budget:
            held += small
        else:
            held += own
            full_sets += 1
    weights = 2 * weight_bytes + weight_bytes // 8
    return held + small + weights  # + small: the small set


# A process's CUDA context and its libraries' workspaces (cuBLAS, Triton), with room to spare.
CUDA_CONTEXT_BYTES = 1 << 30


def preparation_device_bytes(input_bytes: int, output_bytes: int | None, weight_bytes: int,
                             cap: int) -> int:
    """Device bytes a problem's preparation is admitted with (``Lane.room``): the oracle's
    peak on the own set, estimated from the reference's sizes (``module_footprint``): its
    inputs and their float64 copy, its outputs as a set keeps them (``output_bytes``: an
    unknown one counts as three times the inputs, as in ``preparation_bytes``), its
    weights and their float64 copy, a CUDA context; at most ``cap``, the oracle's own
    (``oracle_memory_fraction`` of the device: past it the oracle runs on the host)."""
    out = 3 * input_bytes if output_bytes is None else output_bytes
    return min(3 * input_bytes + out + 3 * weight_bytes + CUDA_CONTEXT_BYTES, cap)


class StageRoom(NamedTuple):
    """Device bytes a candidate's GPU stage is admitted with: ``checks`` from its slot to
    its end (``Lane.room``), and ``timing`` more from the timing warm-up on, out of the
    lane's ``timing_room``."""

    checks: int
    timing: int


def stage_device_bytes(input_bytes: int, other_set_bytes: int, cloned: int,
                       output_bytes: int, weight_bytes: int, timing_sets: int) -> StageRoom:
    """A candidate's worker's peak, estimated in its two phases. The checks: set 0 kept
    (``input_bytes``) beside the largest other set (``other_set_bytes``: at full size, or
    the scaled-down sets of a big problem), the inputs the checks clone (``cloned``,
    ``cloned_bytes``: bigger ones are checked by block sums), four times the outputs (a
    run's two repetitions, the timed calls' kept ones, the comparisons'), the model's
    weights and a CUDA context. The timing: its input sets (at least two) in place of set
    0 and the clones, which ``time_setup`` drops; what that adds to the checks' bytes is
    ``timing``. Timing is one candidate at a time on a lane, so only one candidate needs
    that more at once: counted in each stage's room, as until 2026-12-07, an 8 GiB
    reduction's candidates held 17 GiB each, three at a time on an H100, while their
    checks needed 9. The reference's timing worker is not counted: the room leaves
    ``reference_worker_bytes`` out for those."""
    rest = 4 * output_bytes + weight_bytes + CUDA_CONTEXT_BYTES
    checks = input_bytes + other_set_bytes + cloned
    return StageRoom(checks + rest, max(0, max(timing_sets, 2) * input_bytes - checks))


def held_after_preparation(p: Prepared, share_min_bytes: int | None, candidates: int) -> int:
    """Host bytes a prepared problem holds while its candidates run: its sets (the
    verifier's copy: the oracle's went with its reply) and, for each of ``candidates`` in
    their GPU stage at once, the inputs a worker is sent as bytes (those below the share
    threshold: the others it maps) and four outputs' worth of what it sends back (a run's
    two repetitions; an ablation's, one per kernel; kept timed outputs). An estimate, as
    the peak's is: far below that peak for a reduction over 8 GiB."""
    def unshared(values: list[Any]) -> list[Any]:
        return [v for v in values if share_min_bytes is None
                or getattr(v, "nbytes", 0) < share_min_bytes]

    sent = max((nbytes(unshared(s["inputs"])) for s in p.sets), default=0)
    back = max((nbytes(s["honest"]) for s in p.sets), default=0)
    return p.host_bytes + candidates * (sent + 4 * back)


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
        # The service process compares outputs on the GPU, so it needs a CUDA torch too.
        devices = self.config.device_ids()
        self.gpu = bool(devices)
        self._device_ids: list[int | None] = list(devices) if devices else [None]
        self._lanes: list[Lane] = []
        self._builder: Builder | None = None
        self._prepared: OrderedDict[str, Prepared] = OrderedDict()
        self._warned_interpreter = False
        # problem key -> its sandboxed ``reference_facts``: init args (the preflight's),
        # inputs' and outputs' bytes (what its preparation holds on the host)
        self._facts: dict[str, asyncio.Future[SandboxOutcome]] = {}
        # The host's memory for the problems being verified (``_in_use``).
        self._host = ByteBudget(self.config.host_budget_bytes
                                if self.config.host_budget_bytes is not None
                                else int(0.4 * host_memory_bytes()),
                                self.config.pass_window_s)
        self._problems_in_use: dict[str, _InUse] = {}
        self._problem_cache_bytes = (
            self.config.problem_cache_bytes if self.config.problem_cache_bytes is not None
            else min(48 << 30, host_memory_bytes() // 5))
        self._prepare_locks: dict[str, asyncio.Lock] = {}
        self._loop_thread: _LoopThread | None = None

    # -- lifecycle

    def _ensure(self) -> None:
        if not self._lanes:
            reaped = lifeline.reap()
            if reaped:
                log.warning("verifier: killed %d process groups left by a verifier that "
                            "is gone: %s", len(reaped), reaped)
            left = reap_left_behind()
            if left:
                log.warning("verifier: removed %d folders left by a verifier that is gone: "
                            "%s", len(left), left)
            # A GPU worker sees the build cache: the CUDA extensions it loads are built
            # there ahead of time.
            self._lanes = [Lane(self.config, i, (str(self.builder.cache_dir),)
                                if i is not None else ()) for i in self._device_ids]
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
            await lane.shutdown()
        self._lanes = []

    async def aclose(self) -> None:
        """Same as ``close``."""
        await self.close()

    def occupancy(self) -> dict[str, Any]:
        """Where the verifications in flight are, now: the problems in use and the host
        memory they hold (and the requests waiting for it), and per device
        (``Lane.occupancy``) the verifications, the candidates in their GPU stage, busy
        oracles, the device's room held and waited for, whether a candidate is being
        timed, and the reference and spare workers. For a benchmark's timeline or a
        service's metrics."""
        return {"problems_in_use": len(self._problems_in_use),
                "host_bytes": self._host.held, "host_waiting": self._host.waiting,
                "problems_prepared": len(self._prepared),
                "lanes": [lane.occupancy() for lane in self._lanes]}

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

    def _seed(self, key: str) -> int:
        digest = hmac.new(self._secret, key.encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def _verdict(self, status: Status, reason: str | None = None, **kw: Any) -> Verdict:
        return Verdict(status, reason, verifier_version=VERIFIER_VERSION,
                       hardware=self.manifest(), **kw)

    def _stamp(self, ruling: Ruling) -> Verdict:
        """The verdict of a check's ruling, with this verifier's version and hardware."""
        return self._verdict(ruling.status, ruling.reason, **ruling.fields)

    async def verify(self, problem: Problem, candidate: Candidate) -> Verdict:
        """Checks ``candidate`` against ``problem`` and returns the verdict."""
        self._ensure()
        started = time.monotonic()
        details: dict[str, Any] = {"backend": candidate.backend}
        try:
            verdict = await self._verify(problem, candidate, details)
        except Reject as r:
            verdict = self._stamp(r.ruling)
        except Exception as e:  # every path ends in a verdict: this one is ours, not theirs
            log.exception("verifier: infrastructure failure")
            details["traceback"] = tail(traceback.format_exc(), 3000)
            verdict = self._verdict(Status.INFRA_ERROR, f"verifier: {type(e).__name__}: "
                                    f"{tail(str(e), 1000)}", check="infrastructure")
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
        if "ModelNew" not in candidate.source:
            # What loading it would say, without preparing the problem first (minutes at
            # KernelBench's sizes): a reply with no code at all is common from a weak policy.
            return self._verdict(Status.RUNTIME_ERROR, "load: source does not define ModelNew",
                                 check="load")
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
        # 3. Problem preparation (cached) and the GPU stage; a first look before the
        # first preparation of a problem.
        preflight = self.config.preflight == "on" or (self.config.preflight == "gpu"
                                                      and self.gpu)
        if preflight and candidate.backend == "triton" and problem.key not in self._prepared:
            early = await self._preflight(problem, candidate, details)
            if early is not None:
                return early
        if self.gpu:
            # Shared by the problem's verifications and kept: said apart from the wait for
            # host memory below (in a GPU loop the two took 8-12 s of a verdict's 11-13 s,
            # 2026-12-04, before they were told apart).
            t0 = time.monotonic()
            await self._reference_facts(problem)
            details["reference_facts_s"] = round(time.monotonic() - t0, 3)
        t0 = time.monotonic()
        async with self._in_use(problem):
            details["host_wait_s"] = round(time.monotonic() - t0, 3)
            return await self._prepared_and_staged(problem, candidate, builds, own_names,
                                                   details)

    async def _prepared_and_staged(self, problem: Problem, candidate: Candidate,
                                   builds: list[BuildResult], own_names: list[str],
                                   details: dict[str, Any]) -> Verdict:
        lane = min(self._lanes, key=lambda ln: ln.busy)
        lane.busy += 1
        try:
            t0 = time.monotonic()
            fresh = problem.key not in self._prepared
            prepared = await self._prepare(lane, problem)
            details["prepare_s"] = round(time.monotonic() - t0, 3)
            if isinstance(prepared, Verdict):
                return prepared
            self._settle(problem.key, prepared)
            if fresh:  # this verification waited for the preparation: say where it went
                details["prepare_phases"] = prepared.phase_s
            details["problem_notes"] = prepared.notes
            details["input_sets"] = prepared.set_summary()
            details["input_sets_dropped"] = prepared.dropped
            if prepared.plan_notes:
                details["memory_plan"] = prepared.plan_notes
            short = self._too_few_sets(prepared)
            if short:
                return self._verdict(Status.UNCHECKED, short, check="input_sets")
            room = await self._stage_device_bytes(lane, problem, prepared)
            # Timing more than the lane's timing room holds: in the stage's room throughout.
            if room.timing > lane.timing_room.limit:
                room = StageRoom(room.checks + room.timing, 0)
            need = room.checks
            t0 = time.monotonic()
            # The room before the slot: a candidate waiting for room holds no slot, so a
            # big problem's samples waiting their turn leave the slots to others that fit
            # (``pass_window_s``); in the other order they held all three on an H100.
            async with lane.room_for(need):
                t1 = time.monotonic()
                async with lane.slots:
                    # the wait for both, and the room's part of it
                    details["gpu_wait_s"] = round(time.monotonic() - t0, 3)
                    details["room_wait_s"] = round(t1 - t0, 3)
                    details["room_bytes"] = need
                    details["timing_room_bytes"] = room.timing
                    lane.staged += 1
                    try:
                        verdict = await self._gpu_stage(lane, prepared, candidate, builds,
                                                        own_names, details, room.timing)
                    finally:
                        lane.staged -= 1
            if verdict.status is Status.INFRA_ERROR and verdict.check == "device_memory":
                # The device was full of others' memory, not the candidate's: once more
                # with no other candidate beside it and the idle reference workers gone
                # (the smaller plan). On an H100, three honest candidates of an 8 GiB
                # problem at once each got this, and a retry beside the others again.
                details["retried"] = verdict.reason
                t0 = time.monotonic()
                async with lane.alone():
                    details["retry_wait_s"] = round(time.monotonic() - t0, 3)
                    verdict = await self._gpu_stage(lane, prepared, candidate, builds,
                                                    list(own_names), details, room.timing)
            return verdict
        finally:
            lane.busy -= 1

    async def inspect_problem(self, problem: Problem) -> dict[str, Any]:
        """Prepares ``problem`` as a verification of it would, and says how: the input
        sets used (label, shapes), those dropped and why, the memory plan, the oracle's
        peak device memory, what its sets hold on the host and what the host's memory
        budget reserved for it, the bytes and FLOPs of its physical floor, and the time;
        or, under "error", why it cannot be a problem here. Every failure is an answer,
        not an exception."""
        self._ensure()
        lane = min(self._lanes, key=lambda ln: ln.busy)
        t0 = time.monotonic()
        try:
            async with self._in_use(problem):
                prepared = await self._prepare(lane, problem)
        except Exception as e:  # the audit reports it: one bad problem must not stop it
            return {"error": f"{type(e).__name__}: {tail(str(e), 500)}",
                    "seconds": round(time.monotonic() - t0, 3)}
        seconds = round(time.monotonic() - t0, 3)
        if isinstance(prepared, Verdict):
            return {"error": prepared.reason, "seconds": seconds}
        return {"input_sets": prepared.set_summary(), "dropped": prepared.dropped,
                "memory_plan": prepared.plan_notes, "notes": prepared.notes,
                "too_few_sets": self._too_few_sets(prepared),
                "oracle_peak_bytes": prepared.device_peak_bytes,
                "phase_s": prepared.phase_s,
                "host_bytes": prepared.host_bytes, "input_bytes": prepared.input_bytes,
                "moved_bytes": prepared.bytes, "flops": prepared.flops,
                "reserved_bytes": await self._preparation_bytes(problem),
                "seconds": seconds}

    async def admission(self, problem: Problem, *, timeout_s: float = 600) -> Admission:
        """``admission_check`` of ``problem`` on this verifier's device (the CPU without
        one). On a GPU it holds the device's room (``admission_device_bytes`` and a CUDA
        context) beside the candidates and preparations running there, and a check that
        ran out of the device's memory is tried once more with the device to itself
        (``Lane.alone``): in a level-3 audit on an H100 with four checks at once
        (2026-12-06), 31 VisionAttention's float64 run found 6.75 GiB free. ``phase_s``
        gains the waits ("room", and "alone" for a retry)."""
        self._ensure()
        lane = min(self._lanes, key=lambda ln: ln.busy)
        if lane.index is None:
            return await asyncio.to_thread(admission_check, problem.source, device="cpu",
                                           timeout_s=timeout_s)
        got = await self._reference_facts(problem)
        _, input_bytes, output_bytes, weight_bytes, share = (
            got.value if got.ok else (None, None, None, 0, 1.0))
        need = admission_device_bytes(input_bytes, output_bytes, weight_bytes,
                                      share) + CUDA_CONTEXT_BYTES
        env = lane.device_env()
        t0 = time.monotonic()
        async with lane.room_for(need):
            waited = {"room": round(time.monotonic() - t0, 3)}
            adm = await asyncio.to_thread(admission_check, problem.source, device="cuda",
                                          timeout_s=timeout_s, env=env)
        if adm.out_of_memory:
            t0 = time.monotonic()
            async with lane.alone():
                waited["alone"] = round(time.monotonic() - t0, 3)
                adm = await asyncio.to_thread(admission_check, problem.source,
                                              device="cuda", timeout_s=timeout_s, env=env)
        return replace(adm, phase_s={**adm.phase_s, **waited})

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
                run_in_sandbox, "kz_stream.verify._extract:record_inline_calls",
                (candidate.source,), timeout_s=120)
            if not out.ok:
                raise Reject(Ruling(
                    Status.RUNTIME_ERROR if out.error_kind != "timeout" else Status.TIMEOUT,
                    f"the module's top level failed while recording load_inline: "
                    f"{out.error_message}", {"check": "load"}))
            calls = [InlineCall.from_kwargs(kw) for kw in out.value]
        results = list(await asyncio.gather(*(self.builder.build(c) for c in calls)))
        details["builds"] = [{"name": r.call.name, "layout": r.layout, "seconds":
                              round(r.seconds, 2), "cache_hit": r.cache_hit,
                              "attempts": r.attempts} for r in results]
        for r in results:
            if not r.ok:
                raise Reject(Ruling(Status.COMPILE_ERROR, tail(r.log, 3000),
                                    {"check": "nvcc"}))
        return results

    async def _preflight(self, problem: Problem, candidate: Candidate,
                         details: dict[str, Any]) -> Verdict | None:
        """The candidate's verdict when importing it or building it on the meta device fails
        decisively (``_preflight``), else None. Any failure of the preflight itself is no
        verdict: the full verification decides."""
        t0 = time.monotonic()
        got = await self._reference_facts(problem)
        if not got.ok:
            return None  # the preparation will say what is wrong with the reference
        init = list(got.value[0])
        out = await asyncio.to_thread(
            run_in_sandbox, "kz_stream.verify._preflight:candidate_preflight",
            (candidate.source, init), timeout_s=self.config.preflight_timeout_s,
            memory_mb=4096, preload=PREFLIGHT_IMPORTS)
        details["preflight_s"] = round(time.monotonic() - t0, 3)
        if not out.ok or out.value is None:
            return None
        stage, error = out.value
        return self._verdict(Status.RUNTIME_ERROR, f"{stage}: {error} (found before the "
                             "problem was prepared: the module imported and built on the "
                             "meta device)", check=stage)

    async def _prepare(self, lane: Lane, problem: Problem) -> Prepared | Verdict:
        key = problem.key
        lock = self._prepare_locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._prepare_locked(lane, problem)
        finally:
            if not lock.locked():  # a problem seen once must not hold a lock forever
                self._prepare_locks.pop(key, None)

    async def _prepare_locked(self, lane: Lane, problem: Problem) -> Prepared | Verdict:
        key = problem.key
        cached = self._prepared.get(key)
        if cached is not None:  # CPU tensors and figures: good for any device's lane
            self._prepared.move_to_end(key)
            return cached
        seed = self._seed(key)
        msg: PrepareRequest = {"cmd": "prepare", "source": problem.source, "key": key,
                               "seed": seed, "small_only": not self.gpu,
                               "full_set_budget": self.config.full_set_budget_bytes}
        kills_before = oom_kills()
        need = await self._preparation_device_bytes(lane, problem)
        try:
            # A free oracle first, then the device's room, then the GPU: waiting for one
            # while holding the shared lock would hold timing up.
            async with lane.oracle_slots, lane.room_for(need), lane.gpu.reader_lock:
                t0 = time.monotonic()
                r = await lane.oracle_call(msg, self.config.prepare_timeout_s)
                call_s = time.monotonic() - t0
            full = "" if r.get("ok") else str(r.get("message"))
            if device_was_full(full):
                # Others' memory filled the device (candidates of other problems, idle
                # reference workers), not the problem: once more with the device to
                # itself, as a candidate's device_memory failure is retried. On an H100
                # (2026-12-06) an 8 GiB argmax was prepared beside three candidates of
                # 8 GiB problems, and its first sample got infra_error for it.
                async with lane.oracle_slots, lane.alone(), lane.gpu.reader_lock:
                    t0 = time.monotonic()
                    r = await lane.oracle_call(msg, self.config.prepare_timeout_s)
                    call_s = time.monotonic() - t0
        except ChildDied as e:
            if killed_for_memory(e, kills_before):
                # The host's memory, not the problem: the learner ignores it, the next
                # candidate prepares it again and a resumed evaluation verifies it again.
                return self._verdict(Status.INFRA_ERROR, "problem: the host ran out of "
                                     f"memory while preparing it ({e})", check="host_memory")
            return self._verdict(Status.UNCHECKED, f"problem: the reference could not be "
                                 f"evaluated ({e})", check="problem")
        except ChildTimeout as e:
            return self._verdict(Status.UNCHECKED, f"problem: the reference could not be "
                                 f"evaluated ({e})", check="problem")
        if not r.get("ok"):
            status, reason, check = problem_failure(str(r.get("message")), "problem")
            if full:
                reason += " (on its second try too, with the device to itself)"
            return self._verdict(status, reason, check=check)
        prepared = Prepared.from_reply(key, problem.source, seed,
                                       astscan.reference_ops(problem.source), r, call_s)
        if full:
            prepared.notes.append("prepared on a second try, with the device to itself: "
                                  f"the first found it full ({tail(full, 300)})")
        if self.config.input_share_min_bytes is not None:
            # Gigabytes copied at KernelBench's sizes: off the event loop.
            await asyncio.to_thread(prepared.share_inputs, self.config.input_share_min_bytes)
        self._prepared[key] = prepared
        # Least recently used first, never one being verified: its next candidate would
        # prepare it again beside the copy its workers hold, past what it reserved.
        idle = [k for k in self._prepared if k != key and k not in self._problems_in_use]
        while idle and (len(self._prepared) > self.config.problem_cache
                        or sum(p.host_bytes for p in self._prepared.values())
                        > self._problem_cache_bytes):
            del self._prepared[idle.pop(0)]
        return prepared

    @contextlib.asynccontextmanager
    async def _in_use(self, problem: Problem) -> AsyncIterator[None]:
        """Holds ``problem`` in use while verifications of it run: the first waits until
        the host has room for what its preparation holds (``_preparation_bytes``), held
        until the last one ends; the others of the same problem join without waiting.
        The same bytes cover the verifier's copy of the sets and its workers' inputs after
        the preparation, so nothing waits for memory once admitted and no two problems can
        wait for each other. A problem larger than the budget runs alone."""
        key = problem.key
        entry = self._problems_in_use.setdefault(key, _InUse())
        entry.users += 1
        try:
            async with entry.admitting:
                if entry.nbytes is None:
                    peak = await self._preparation_bytes(problem)
                    await self._host.acquire(peak)
                    entry.nbytes = peak
            yield
        finally:
            entry.users -= 1
            if not entry.users:
                if self._problems_in_use.get(key) is entry:
                    del self._problems_in_use[key]
                if entry.nbytes is not None:
                    self._host.release(entry.nbytes)

    def _settle(self, key: str, p: Prepared) -> None:
        """Gives back what the preparation's peak reserved beyond what ``p`` holds from now
        on (``held_after_preparation``), so that the next problem is prepared while this
        one's candidates run: on an H100 (2026-12-05) each 8 GiB reduction reserved 40 GiB
        (``preparation_bytes``' estimate) of a 50 GiB budget until its last candidate
        ended, and the mix prepared each problem after the last one's candidates."""
        entry = self._problems_in_use.get(key)
        if entry is None or entry.nbytes is None:
            return
        after = held_after_preparation(p, self.config.input_share_min_bytes,
                                       len(self._lanes) * self.config.candidates_per_gpu)
        if after < entry.nbytes:
            self._host.shrink(entry.nbytes - after)
            entry.nbytes = after

    async def _preparation_bytes(self, problem: Problem) -> int:
        """Host bytes that preparing ``problem`` holds at its peak: the oracle's sets, of
        which the verifier maps one copy (``preparation_bytes``), from the reference's sizes
        on the meta device; twice the full-size budget where those cannot be found. The
        CPU path prepares small sets only: 0."""
        if not self.gpu:
            return 0
        got = await self._reference_facts(problem)
        budget = self.config.full_set_budget_bytes
        if not got.ok:
            return 2 * budget
        _, input_bytes, output_bytes, weight_bytes, share = got.value
        return preparation_bytes(input_bytes, output_bytes, budget, weight_bytes, share)

    async def _preparation_device_bytes(self, lane: Lane, problem: Problem) -> int:
        """``preparation_device_bytes`` of ``problem`` on ``lane`` (the oracle's cap where
        the reference's sizes cannot be found; 0 on the CPU path)."""
        if lane.index is None:
            return 0
        cap = int(self.config.oracle_memory_fraction * lane.total_bytes)
        got = await self._reference_facts(problem)
        if not got.ok:
            return cap
        _, input_bytes, output_bytes, weight_bytes, _ = got.value
        return preparation_device_bytes(input_bytes, output_bytes, weight_bytes, cap)

    async def _stage_device_bytes(self, lane: Lane, problem: Problem,
                                  p: Prepared) -> StageRoom:
        """``stage_device_bytes`` of a candidate of ``p`` on ``lane`` (none on the CPU
        path)."""
        if lane.index is None:
            return StageRoom(0, 0)
        got = await self._reference_facts(problem)
        weight_bytes = got.value[3] if got.ok else 0
        return stage_device_bytes(
            p.input_bytes, max((nbytes(s["inputs"]) for s in p.sets[1:]), default=0),
            max((cloned_bytes(s["inputs"]) for s in p.sets), default=0),
            nbytes(p.sets[0]["honest"]), weight_bytes, lane.timing_sets(p.input_bytes))

    async def _reference_facts(self, problem: Problem) -> SandboxOutcome:
        """``reference_facts`` of ``problem``, from one sandboxed child per problem shared
        by the verifications that arrive together (and kept for the later ones)."""
        pending = self._facts.get(problem.key)
        if pending is None or pending.get_loop() is not asyncio.get_running_loop():
            pending = self._facts[problem.key] = asyncio.ensure_future(asyncio.to_thread(
                run_in_sandbox, "kz_stream.verify._preflight:reference_facts",
                (problem.source,), timeout_s=self.config.preflight_timeout_s,
                memory_mb=4096, preload=PREFLIGHT_IMPORTS))
            while len(self._facts) > 4 * self.config.problem_cache:
                self._facts.pop(next(iter(self._facts)))
        return await asyncio.shield(pending)

    async def _gpu_stage(self, lane: Lane, p: Prepared, candidate: Candidate,
                         builds: list[BuildResult], own_names: list[str],
                         details: dict[str, Any], timing_bytes: int = 0) -> Verdict:
        t0 = time.monotonic()
        try:
            worker = await lane.take_worker()
        except (ChildDied, ChildTimeout) as e:
            return self._verdict(Status.UNCHECKED, f"verifier: no worker could start ({e})",
                                 check="infrastructure")
        details["worker_wait_s"] = round(time.monotonic() - t0, 3)
        ready = worker.wait_ready()
        details["worker_start_s"] = {k: round(float(v), 3) for k, v in
                                     (ready.get("start_s") or {}).items()}
        if ready.get("interpreter_defect"):
            details["interpreter_defect"] = ready["interpreter_defect"]
            if not self._warned_interpreter:
                self._warned_interpreter = True
                log.warning("verifier: this host's Triton interpreter fails the worker's "
                            "self-check (a loop over a run-time bound); kernels that fail "
                            "the same way get infra_error, not runtime_error (seen with "
                            "Triton 3.6 under NumPy 2.4 and 2.5; verify on a GPU): %s",
                            ready["interpreter_defect"])
        stage = Stage(self.config, lane, worker, p, candidate, builds, own_names, details,
                      timing_bytes)
        try:
            ruling = await stage.run()
        except Reject as r:
            ruling = r.ruling
        finally:
            try:
                await asyncio.to_thread(worker.kill)
            finally:  # also when cancelled in the kill: a room never given back is lost
                stage.release_timing_room()  # its worker, and the timing sets, are gone
        if worker.handles_on is not None:
            details["outputs_by_handle"] = worker.handles_copied
        return self._stamp(ruling)


def _raw_strings(source: str) -> list[str]:
    """The string literals of a candidate that define CUDA kernels."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [t for t in astscan.string_constants(tree) if "__global__" in t]


class _LoopThread:
    """An event loop on a daemon thread, for the synchronous wrapper.

    A call interrupted while it waits (Ctrl-C, a test's time limit) cancels its task, and
    ``stop`` cancels what is left and lets it clean up on the running loop, as
    ``asyncio.run`` does: a task left pending was destroyed at exit instead, and its
    clean-up (killing its worker) failed with a screenful of tracebacks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a no-op once it is done
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout_s)
        except (TimeoutError, RuntimeError):  # stopping goes on: the thread is a daemon
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
