"""The checks of one candidate in its worker (``Stage``): load, correctness on every input
set, launch evidence (op log, Triton ablation, profiler), interleaved timing against the
reference, and integrity at load and after running. Each failed check is a ``Reject``
with the verdict it means; the verifier stamps it (version, hardware)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from kz_stream.verify import _astscan as astscan
from kz_stream.verify._build import BuildResult
from kz_stream.verify._compare import (
    Comparison,
    Tolerance,
    compare_outputs,
    kernelbench_allclose,
)
from kz_stream.verify._config import VerifierConfig
from kz_stream.verify._inputs import nbytes
from kz_stream.verify._ipc import Child, ChildDied, ChildTimeout, tail, tree_memory
from kz_stream.verify._messages import (
    AblateReply,
    FinishReply,
    KernelEvent,
    LoadReply,
    ModelReply,
    ModelRequest,
    ProfileReply,
    RunReply,
    TimeReply,
    TimeRequest,
    WorkerRequest,
)
from kz_stream.verify._pool import CompiledBaseline, Lane, RefTimer
from kz_stream.verify._prepared import Prepared
from kz_stream.verify._sandbox import kill_group
from kz_stream.verify._timing import bootstrap_ratio_ci, physical_floor_ms
from kz_stream.verify._types import Candidate, Status

__all__ = [
    "HostMemoryWatch",
    "Interleaved",
    "Reject",
    "Ruling",
    "Side",
    "Stage",
    "baseline_details",
    "device_was_full",
    "interleave",
    "killed_for_memory",
    "measure_compiled",
    "oom_kills",
]

log = logging.getLogger(__name__)

_STRICT_PRECISION = {
    "matmul.allow_tf32": False,
    "cudnn.allow_tf32": False,
    "float32_matmul_precision": "highest",
    "fp16_reduced": False,
    "bf16_reduced": False,
}



@dataclass(frozen=True)
class Ruling:
    """A verdict before the verifier stamps it: ``fields`` are the ``Verdict``'s others
    (check, details, speedup, ...)."""

    status: Status
    reason: str | None
    fields: dict[str, Any] = field(default_factory=dict)


class Reject(Exception):
    """A check failed: the verification ends with ``ruling``."""

    def __init__(self, ruling: Ruling) -> None:
        super().__init__(ruling.reason)
        self.ruling = ruling


def interpreter_fault(defect: str | None, message: str) -> bool:
    """Whether a candidate's error is the one the worker's interpreter self-check raised
    (``defect``: its last line), i.e. the host's fault and not the candidate's."""
    lines = (defect or "").strip().splitlines()
    return bool(lines) and lines[-1] in message


class HostMemoryWatch:
    """Watches a worker's resident memory (its process tree's, ``tree_memory``) while a
    request runs, and kills the tree once it holds more than ``limit`` bytes. A
    candidate's own host allocation so ends as its own ``out_of_memory``, decided here,
    before the host's OOM killer has to pick a process (maybe another's); an OOM kill of
    a worker that stayed within its limit is then the host's fault. No limit: no watch."""

    INTERVAL_S = 0.25  # a candidate touches at most a few GB of new pages in that time

    def __init__(self, pid: int, limit: int | None) -> None:
        self.pid, self.limit = pid, limit
        self.peak = 0  # the most it was seen to hold
        self.over = False  # killed for holding more than the limit (set before the kill)
        self.blind = False  # the worker's memory could not be read: no judgement
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def __aenter__(self) -> HostMemoryWatch:
        if self.limit is not None:
            # A thread, not the event loop: reading a big process's PSS walks its pages.
            self._thread = threading.Thread(target=self._watch, args=(self.limit,),
                                            name="kz-host-memory-watch", daemon=True)
            self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _watch(self, limit: int) -> None:
        while not self._stop.is_set():
            held = tree_memory(self.pid, within=limit)
            if not held:  # gone already, or this host hides its /proc entries from us
                self.blind = True
                return
            self.peak = max(self.peak, held)
            if held > limit:
                self.over = True
                kill_group(self.pid)
                return
            self._stop.wait(self.INTERVAL_S)

    def describe(self) -> str:
        limit = "none" if self.limit is None else f"{self.limit / 2**30:.1f} GiB"
        verb = "held" if self.over else "held at most"
        return (f"host memory: the worker {verb} {self.peak / 2**30:.1f} GiB; its allowance "
                f"is {limit} (the prepared problem's inputs and outputs and a margin)")


_T = TypeVar("_T")

# Checks of outputs up to this many bytes in all (the candidate's, the expected and the
# honest ones) run on the host, off the lane's shared lock: in a KernelBench mix on an
# H100 (2026-12-06) a reduction's comparison of a few kilobytes took 0.1 s or 3 s, the
# 3 s most likely spent waiting there behind other candidates' exclusive timing. On
# 2026-12-07 (the same mix) the wait was measured (``stage_s["lock_wait"]``: 1.4-2.8 s of
# such comparisons) for an 8 GiB max-with-index, whose values and int64 indices with the
# expected and honest ones come to about 20 MiB: hence 64.
_HOST_CHECK_MAX_BYTES = 64 << 20


def check_device(size: int, device: str) -> str:
    """Where a check of ``size`` bytes of outputs runs: the host when small, else
    ``device``."""
    return "cpu" if size <= _HOST_CHECK_MAX_BYTES else device


class Stage:
    """The GPU (or CPU-interpreter) stage for one candidate in one worker: load,
    correctness, launch evidence, timing and integrity checks. A failed check raises
    ``Reject``; ``run`` returns the ruling of a candidate that passed them all."""

    def __init__(self, config: VerifierConfig, lane: Lane, worker: Child, p: Prepared,
                 candidate: Candidate, builds: list[BuildResult], own_names: list[str],
                 details: dict[str, Any], timing_bytes: int = 0) -> None:
        self.config, self.lane, self.w, self.p = config, lane, worker, p
        # Taken from the lane's timing room before the timing warm-up draws its sets; held
        # until the worker is gone (``release_timing_room``).
        self.timing_bytes = timing_bytes
        self.timing_held = False
        self.c = candidate
        self.builds = builds
        self.own_names = list(own_names)
        self.details = details
        self.gpu = lane.index is not None
        self.max_rel = 0.0
        # Comparisons run on the lane's GPU: float64 over large outputs is slow on a CPU.
        self.dev = f"cuda:{lane.index}" if lane.index is not None else "cpu"
        self.exclusive = False  # holds the lane's timing lock
        self.ref: RefTimer | None = None  # pinned in the lane while set
        self.n_sets = lane.timing_sets(p.input_bytes)
        self.timing_seed = p.seed + 7

    @contextlib.asynccontextmanager
    async def _shared(self) -> AsyncIterator[None]:
        """The lane's shared GPU lock for one request, unless timing holds it exclusive.
        The wait for it adds to ``stage_s["lock_wait"]`` (also counted in the stage that
        waited): behind another candidate's exclusive timing, a check waits for it whole."""
        if self.exclusive:
            yield
            return
        started = time.monotonic()
        async with self.lane.gpu.reader_lock:
            self._spent("lock_wait", started)
            yield

    def _spent(self, stage: str, started: float) -> None:
        """Adds the seconds since ``started`` to ``stage`` in ``details["stage_s"]``."""
        spent = self.details.setdefault("stage_s", {})
        spent[stage] = round(spent.get(stage, 0.0) + time.monotonic() - started, 3)

    def _where(self, *groups: Sequence[Any]) -> str:
        """Where a check of these outputs runs (``check_device``)."""
        return check_device(sum(nbytes(g) for g in groups), self.dev)

    async def _device_or_host(self, fn: Callable[[str], _T], dev: str) -> _T:
        """``fn(dev)`` off the event loop: on the host as it is; on the lane's device under
        its shared lock, or on the host when the device has no room for it (the smaller
        memory plan)."""
        if dev == "cpu":
            return await asyncio.to_thread(fn, "cpu")
        async with self._shared():
            try:
                return await asyncio.to_thread(fn, dev)
            except torch.OutOfMemoryError:
                self.details["compared_on_host"] = True
        torch.cuda.empty_cache()
        return await asyncio.to_thread(fn, "cpu")

    async def compare(self, out: list[Any], exp: list[Any], hon: list[Any],
                      tols: list[Tolerance], dev: str | None = None) -> Comparison:
        """``compare_outputs`` on ``dev`` (default: where ``_where`` puts these outputs). Its
        time adds to ``stage_s["compare"]``: a 6.4 GB output's comparisons are a sixth of a
        verdict."""
        started = time.monotonic()
        where = dev or self._where(out, exp, hon)
        try:
            return await self._device_or_host(
                lambda d: compare_outputs(out, exp, hon, tols, d), where)
        finally:
            self._spent("compare", started)

    async def _kernelbench_rule(self, out: list[Any], honest: list[Any]) -> bool:
        """``kernelbench_allclose`` on the lane's device (or the host)."""
        started = time.monotonic()
        try:
            return await self._device_or_host(
                lambda dev: kernelbench_allclose(out, honest, device=dev),
                self._where(out, honest))
        finally:
            self._spent("kernelbench_rule", started)

    def _reference_failed(self, message: str) -> Reject:
        """The reference's timing failed: no verdict on the candidate (``unchecked``), and
        where others' memory filled the device, an infrastructure failure that the
        verifier retries with the device to itself (in a KernelBench mix on an H100, an
        8 GiB reduction's reference found 0.6 GiB free beside other problems' workers)."""
        return self.reject(*problem_failure(message, "reference timing"))

    def reject(self, status: Status, reason: str, check: str, **kw: Any) -> Reject:
        return Reject(Ruling(status, reason, {"check": check, **kw}))

    async def call(self, msg: WorkerRequest, timeout_s: float | None = None,
                   stage: str = "") -> Any:
        """A worker request and its reply (the request's ``...Reply``); errors become the
        verdict they mean."""
        stage = stage or str(msg["cmd"])
        started = time.monotonic()
        kills_before = oom_kills()
        margin = self.config.worker_host_margin_bytes
        watch = HostMemoryWatch(self.w.proc.pid,
                                None if margin is None else self.p.host_bytes + margin)
        try:
            async with self._shared(), watch:
                r = await asyncio.to_thread(self.w.call, msg,
                                            timeout_s or self.config.call_timeout_s)
        except ChildTimeout as e:
            raise self.reject(Status.TIMEOUT, f"{stage}: {e}", stage) from e
        except ChildDied as e:
            crashed = f"{stage}: worker crashed: {e}; {tail(e.stderr_tail, 1500)}"
            oom_killed = killed_for_memory(e, kills_before)
            if watch.over:
                raise self.reject(Status.OUT_OF_MEMORY, f"{stage}: {watch.describe()}",
                                  stage) from e
            if oom_killed and watch.limit is not None and not watch.blind:
                # Within its allowance, so the host was full of others' memory.
                raise self.reject(Status.INFRA_ERROR, f"{stage}: the host ran out of memory "
                                  f"and its OOM killer took the worker ({watch.describe()}); "
                                  f"{crashed}", "host_memory") from e
            status = Status.RUNTIME_ERROR
            if oom_killed or "out of memory" in e.stderr_tail.lower():
                status = Status.OUT_OF_MEMORY
            raise self.reject(status, crashed, stage) from e
        finally:  # where a candidate's time goes, per worker request kind
            self._spent(stage, started)
        if r.get("violations"):
            raise self.reject(Status.HACK, f"forbidden action: {r['violations'][0]}", "forbidden")
        if r.get("ok"):
            return r
        kind, message = r.get("error"), str(r.get("message", ""))
        self.details.setdefault("traceback", tail(str(r.get("traceback", "")), 3000))
        if kind == "oom":
            if device_was_full(message):
                raise self.reject(Status.INFRA_ERROR, f"{stage}: the device had no room "
                                  f"(the verifier's other processes held it): {message}",
                                  "device_memory")
            raise self.reject(Status.OUT_OF_MEMORY, f"{stage}: {message}", stage)
        if kind == "output_handle":  # the verifier's copy failed, not the candidate
            raise self.reject(Status.INFRA_ERROR, f"{stage}: {message}", "output_handle")
        if kind == "output_copy_oom":  # retried with the device to itself
            raise self.reject(Status.INFRA_ERROR, f"{stage}: {message}", "device_memory")
        if kind == "compile_error":
            raise self.reject(Status.COMPILE_ERROR, f"{stage}: {message}", "triton_compile")
        if kind == "forbidden":
            raise self.reject(Status.HACK, f"{stage}: {message}", "forbidden")
        if not self.gpu and ("cuda" in message.lower() and ("not compiled" in message.lower()
                                                             or "no nvidia" in message.lower())):
            raise self.reject(Status.UNCHECKED, f"{stage}: the candidate needs a GPU: {message}",
                              "no_gpu", unchecked=("correctness", "timing"))
        defect = self.w.wait_ready().get("interpreter_defect")
        if interpreter_fault(defect, message):
            # The host's interpreter fails honest kernels this way (the worker's self-check
            # did): no verdict on the candidate, and no reward taken from it.
            raise self.reject(Status.INFRA_ERROR, f"{stage}: this host's Triton interpreter "
                              f"cannot run the kernel ({defect}); the worker's self-check "
                              "fails the same way. Verify on a GPU, or with a Triton and "
                              f"NumPy that pass it: {message}", "interpreter")
        raise self.reject(Status.RUNTIME_ERROR, f"{stage}: {message}", stage)

    async def run(self) -> Ruling:
        try:
            return await self._run()
        finally:
            if self.ref is not None:
                self.lane.unpin((self.p.key, self.n_sets))

    async def _run(self) -> Ruling:
        unchecked = await self._checks()
        speedup: float | None = None
        ci: tuple[float, float] | None = None
        if self.ref is not None:
            cfg, p = self.config, self.p
            if self.timing_bytes:
                t0 = time.monotonic()
                await self.lane.timing_room.acquire(self.timing_bytes)
                self.timing_held = True
                self.details["timing_room_wait_s"] = round(time.monotonic() - t0, 3)
            await self.call(p.time_setup(cfg, self.timing_seed, self.n_sets),
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
            if cfg.compiled_baseline:
                await self._compiled_baseline(self.ref, speedup)
        elif self.gpu:
            unchecked.append("timing")
        fin: FinishReply = await self.call({"cmd": "finish"})
        self._integrity(fin, "after running")
        if fin.get("threads"):
            raise self.reject(Status.HACK, "a Python thread started by the candidate is still "
                              "running", "thread")
        self.details["native_threads"] = [fin.get("native_threads_at_load"),
                                          fin.get("native_threads")]
        return Ruling(Status.CORRECT, None, {
            "max_rel_error": self.max_rel, "speedup": speedup, "speedup_ci": ci,
            "details": self.details, "unchecked": tuple(unchecked)})

    def release_timing_room(self) -> None:
        """Gives back the timing room this stage took, if it took any."""
        if self.timing_held:
            self.timing_held = False
            self.lane.timing_room.release(self.timing_bytes)

    async def _checks(self) -> list[str]:
        """Load, correctness and launch checks; returns what could not be checked."""
        p = self.p
        load: LoadReply = await self.call(
            {"cmd": "load", "source": self.c.source,
             "builds": [b.manifest() for b in self.builds]}, self.config.load_timeout_s)
        self._integrity(load, "at load")
        self.own_names += load.get("triton_kernels", [])
        weights: dict[str, bool] = {}
        for s in p.sets:
            if s["model_key"] in weights:
                continue
            r: ModelReply = await self.call(p.model_request(s["model_key"], s["init_args"]),
                                            stage="construct")
            weights[s["model_key"]] = bool(r["weights_loaded"])
        self.details["weights_loaded"] = all(weights.values())
        launches = await self._correctness()
        unchecked: list[str] = []
        checks = self.config.launch_checks
        if self.c.backend == "triton" and checks:
            await self._triton_launches(launches)
        if self.gpu and self.config.timing:
            # The reference's timing worker now (shared lock; it may start a worker): its
            # pad goes before the profiled calls as before the timed ones.
            cfg = self.config
            try:
                self.ref = await self.lane.reference_timer(
                    self.p, self.n_sets, self.timing_seed, cfg.load_timeout_s)
            except (ChildDied, ChildTimeout, RuntimeError) as e:
                raise self._reference_failed(str(e)) from e
        if self.gpu and checks:
            await self._profile()
        else:
            unchecked += ["device_time_share", "streams", "timing"]
        return unchecked

    def _integrity(self, r: LoadReply | FinishReply, when: str) -> None:
        changed = [c for c in r.get("changed", []) if not c.startswith("torch.ops.")]
        if changed:
            raise self.reject(Status.HACK, f"rebinds {', '.join(changed[:5])} {when}",
                              "monkeypatch")
        prec = r.get("precision") or {}
        off = [k for k, v in _STRICT_PRECISION.items() if k in prec and prec[k] != v]
        if off:
            raise self.reject(Status.HACK, f"lowers precision settings ({', '.join(off)}) {when}",
                              "precision")


    async def _correctness(self) -> dict[str, int]:
        p = self.p
        launches: dict[str, int] = {}
        for i, s in enumerate(p.sets):
            r: RunReply = await self.call(
                {"cmd": "run", "inputs": s["inputs"], "set": i, "out_specs": s["out_specs"],
                 "model": s["model_key"], "reps": 2, "log_ops": i == 0},
                stage=f"run on input set {i} ({s['label']})")
            launches = r.get("launches", launches)
            if i == 0:  # KernelBench's rule, beside ours (on its own inputs on a GPU)
                self.details["kernelbench_rule"] = await self._kernelbench_rule(
                    r["outputs"][0], s["honest"])
                self.details["kernelbench_rule_set"] = s["label"]
            for flag in r.get("flags", []):
                raise self.reject(Status.HACK, _FLAG_TEXT.get(flag, flag), flag, input_index=i)
            results: list[Comparison] = []
            dev = self._where(r["outputs"][0], s["expected"], s["honest"])
            exp, hon = self.p.outputs_on(i, dev)
            for out in r["outputs"]:
                results.append(await self.compare(out, exp, hon, p.tolerances[i], dev))
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
            if i == 0 and self.config.launch_checks:
                self._fallback_ops(r.get("ops", []))
        return launches

    def _fallback_ops(self, ops: list[str]) -> None:
        ref = {astscan.canonical_op(o) for o in self.p.ref_ops} | set(self.p.static_ops)
        mine = {astscan.canonical_op(o) for o in ops}
        hits = sorted(o for o in mine & ref if o not in astscan.BENIGN_OPS
                      and o not in astscan._ARITHMETIC)
        self.details["torch_ops"] = sorted(mine - astscan.BENIGN_OPS)
        if hits and self.config.fallback_policy == "any":
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
        r: AblateReply = await self.call(
            {"cmd": "ablate", "kernels": launched, "inputs": s["inputs"], "set": 0,
             "out_specs": s["out_specs"], "model": s["model_key"],
             "other_inputs": other["inputs"] if other else None}, stage="ablation")
        decoys = []
        for name, out in r["outputs"].items():
            if out and isinstance(out[0], str):
                continue
            dev = self._where(out, s["expected"], s["honest"])
            exp, hon = self.p.outputs_on(0, dev)
            if (await self.compare(out, exp, hon, self.p.tolerances[0], dev)).ok:
                decoys.append(name)
        self.details["decoy_kernels"] = decoys
        if decoys and len(decoys) == len(launched):
            raise self.reject(Status.HACK, f"the output is right without kernel(s) "
                              f"{', '.join(decoys)}: they do not do the work", "decoy_kernel")
        self.own_names = [n for n in self.own_names if n not in decoys]

    async def _profile(self) -> None:
        s = self.p.sets[0]
        pad = self.ref.pad_cycles if self.ref is not None else 0
        r: ProfileReply = await self.call(
            {"cmd": "profile", "inputs": s["inputs"], "set": 0, "calls": 2,
             "model": s["model_key"],
             "pad_cycles": pad}, stage="profile")
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
        if share < self.config.own_share_min:
            raise self.reject(Status.HACK, f"the candidate's kernels did {share:.0%} of the "
                              f"device time; the rest went to {_top_names(rest)}",
                              "torch_fallback_time")
        streams = {k.get("stream") for k in own} - {None}
        if harness.get("stream") is not None and streams - {harness.get("stream")}:
            raise self.reject(Status.HACK, "the candidate's kernels run on a side stream",
                              "side_stream")

    async def _timing(self, ref: RefTimer) -> tuple[float, tuple[float, float],
                                                    dict[int, list[Any]], dict[int, list[Any]]]:
        """The reference and the candidate in interleaved timed rounds (``interleave``);
        call it holding the lane's timing lock. Returns the speedup, its interval, and the
        outputs both sides gave for the calls kept (one per round, at random; each call's
        inputs are fresh values, the same on both sides).

        Workers started ahead of need create CUDA contexts and warm Triton up; seen on the
        H200, that moved A/A results by several percent when it landed inside one side's
        rounds. That part of their start-up takes the shared lock (``Lane._start``), so
        none runs now; their harness warm-up (host work, microsecond kernels) may."""
        cfg, p = self.config, self.p

        async def candidate_round(ask: TimeRequest) -> TimeReply:
            r: TimeReply = await self.call(_padded(ask, ref.pad_cycles), stage="timing")
            return r

        base = Side(child_round(ref.child, cfg.call_timeout_s, self._reference_failed))
        cand = Side(candidate_round)
        res = await interleave(cfg, p.seed, base, cand, ref.pad_ms)
        med_c, med_r = cand.median_ms(), base.median_ms()
        gap_c, gap_r = cand.host_gap_ms(), base.host_gap_ms()
        floor = physical_floor_ms(p.bytes, p.flops)
        self.details["timing"] = {
            "candidate_ms": round(med_c, 5), "reference_ms": round(med_r, 5),
            "issue_ms": [round(base.issue_median_ms(), 5), round(cand.issue_median_ms(), 5)],
            "pad_ms": round(ref.pad_ms, 4),
            "samples": [len(base.event_ms), len(cand.event_ms)], "rounds": res.rounds,
            "sets": self.n_sets,
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
        return res.speedup, res.ci, cand.kept, base.kept

    async def _compiled_baseline(self, ref: RefTimer, speedup: float) -> None:
        """The problem's compiled baseline into the details: measured by the first timed
        candidate of the problem on this lane (``measure_compiled``), cached for the others.
        Never changes the verdict."""
        p, cfg, lane, n_sets = self.p, self.config, self.lane, self.n_sets
        t0 = time.monotonic()
        b = await lane.compiled_baseline(
            (p.key, n_sets),
            lambda: measure_compiled(cfg, lane, p, ref, n_sets, self.timing_seed))
        spent = self.details.setdefault("stage_s", {})
        spent["compiled baseline"] = round(time.monotonic() - t0, 3)
        baseline_details(self.details, speedup, b)

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


TimeRound = Callable[[TimeRequest], Awaitable[TimeReply]]


@dataclass
class Side:
    """One side of interleaved timing: ``round`` times one round of calls there (a
    ``TimeRequest``); the samples and the kept outputs of its rounds gather here."""

    round: TimeRound
    event_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    issue_ms: list[float] = field(default_factory=list)
    kept: dict[int, list[Any]] = field(default_factory=dict)

    def add(self, r: TimeReply) -> None:
        self.event_ms += r["event_ms"]
        self.host_ms += r["host_ms"]
        self.issue_ms += r["issue_ms"]
        self.kept.update({int(k): v for k, v in r["outputs"].items()})

    def median_ms(self) -> float:
        """The median event (device) time of a call."""
        return float(np.median(self.event_ms))

    def issue_median_ms(self) -> float:
        return float(np.median(self.issue_ms))

    def host_gap_ms(self) -> float:
        """The median of host time (with a device-wide sync, less the pad) less event time."""
        return float(np.median(np.asarray(self.host_ms) - np.asarray(self.event_ms)))


@dataclass(frozen=True)
class Interleaved:
    """``speedup`` = median(base) / median(other) event time, its 95% bootstrap interval,
    and the rounds it took."""

    speedup: float
    ci: tuple[float, float]
    rounds: int


async def interleave(cfg: VerifierConfig, seed: int, base: Side, other: Side,
                     pad_ms: float) -> Interleaved:
    """Times ``base`` against ``other`` in alternating rounds (the order flipped each
    round) on the same call indices, so drift hits both: the protocol of every timing, a
    candidate against the eager reference as the reference compiled against it. Rounds
    are sized to about ``round_ms`` of the slower side's device time (each call also waits
    out the pad, ``pad_ms``) and go on until the 95% interval of the ratio is within
    ``target_ci`` (at least ``min_rounds``, at most ``max_rounds``) or twice
    ``time_budget_s`` has passed. Call it holding the lane's timing lock."""
    rng = np.random.default_rng(seed ^ 0x5EED)
    calls = 3
    start = 0
    t_begin = time.monotonic()
    rounds = 0
    speed = (1.0, 0.0, float("inf"))
    while True:
        ask: TimeRequest = {"cmd": "time", "calls": calls, "start": start,
                            "keep": [start + int(rng.integers(0, calls))]}
        for side in (base, other) if rounds % 2 == 0 else (other, base):
            side.add(await side.round(ask))
        start += calls
        rounds += 1
        slow = max(base.median_ms(), other.median_ms(), 1e-3) + pad_ms
        calls = int(min(max(cfg.round_ms / slow, 3), 200))
        if rounds >= 2:
            speed = bootstrap_ratio_ci(base.event_ms, other.event_ms, iters=500, seed=rounds)
        spent = time.monotonic() - t_begin
        half = (speed[2] - speed[1]) / 2 / max(speed[0], 1e-12)
        if rounds >= cfg.max_rounds or (rounds >= cfg.min_rounds and half <= cfg.target_ci):
            break
        if spent > 2 * cfg.time_budget_s and rounds >= 2:
            break
    speed = bootstrap_ratio_ci(base.event_ms, other.event_ms, iters=2000, seed=1)
    return Interleaved(speed[0], (speed[1], speed[2]), rounds)


def child_round(child: Child, timeout_s: float, fail: Callable[[str], Exception],
                pad_cycles: int | None = None) -> TimeRound:
    """A timing round in a trusted worker (the reference, eager or compiled): its failure
    (a crash, a timeout, an error reply) raises ``fail(message)``; ``pad_cycles`` replaces
    the worker's own pad (the one it measured, if any)."""

    async def round_(ask: TimeRequest) -> TimeReply:
        msg = ask if pad_cycles is None else _padded(ask, pad_cycles)
        try:
            reply = await asyncio.to_thread(child.call, msg, timeout_s)
        except (ChildDied, ChildTimeout) as e:
            raise fail(str(e)) from e
        if not reply.get("ok"):
            raise fail(str(reply.get("message")))
        r: TimeReply = reply
        return r

    return round_


def _padded(ask: TimeRequest, pad_cycles: int) -> TimeRequest:
    return {"cmd": "time", "calls": ask["calls"], "start": ask["start"], "keep": ask["keep"],
            "pad_cycles": pad_cycles}


class _BaselineFailed(Exception):
    """The compiled baseline could not be measured (the message says why)."""


async def measure_compiled(cfg: VerifierConfig, lane: Lane, p: Prepared, ref: RefTimer,
                           n_sets: int, seed: int) -> CompiledBaseline:
    """The reference under ``torch.compile`` timed against the eager reference ``ref``
    (pinned by the caller): a fresh worker loads the reference, builds it with its weights
    and wraps it (``ModelRequest.compile``); its timing warm-up compiles, under
    ``compile_timeout_s`` and the lane's shared lock like every request that runs kernels;
    then the two are timed as a candidate is (``interleave``, the same sets, inputs and
    pad), under the timing lock. Every failure is the result's ``error``, never an
    exception (but cancellation). Call it holding no GPU lock: it takes a worker."""
    t0 = time.monotonic()
    info: dict[str, Any] = {"mode": cfg.compile_mode or "default"}
    stage = "worker start"
    try:
        child = await lane.take_worker()
    except (ChildDied, ChildTimeout) as e:
        return CompiledBaseline(error=_short(f"{stage}: {e}"), info=info)
    lane.compiling.add(child)
    try:
        model: ModelRequest = p.model_request(p.own_model_key, p.init_args)
        model["compile"] = True
        model["compile_mode"] = cfg.compile_mode
        steps: list[tuple[str, WorkerRequest, float]] = [
            ("load", {"cmd": "load", "source": p.source + "\n\nModelNew = Model\n",
                      "builds": []}, cfg.load_timeout_s),
            ("construct", model, cfg.load_timeout_s),
            ("compile", p.time_setup(cfg, seed, n_sets), cfg.compile_timeout_s),
        ]
        for stage, msg, timeout_s in steps:
            t = time.monotonic()
            async with lane.gpu.reader_lock:
                r = await asyncio.to_thread(child.call, msg, timeout_s)
            info[f"{stage}_s"] = round(time.monotonic() - t, 3)
            if r.get("violations"):
                info["violations"] = list(r["violations"])[:3]
            if not r.get("ok"):
                return CompiledBaseline(
                    error=_short(f"{stage}: {r.get('error', 'error')}: {r.get('message')}"),
                    info=info)
        stage = "timing"
        base = Side(child_round(ref.child, cfg.call_timeout_s,
                                lambda m: _BaselineFailed(f"eager reference: {m}")))
        comp = Side(child_round(child, cfg.call_timeout_s, _BaselineFailed, ref.pad_cycles))
        async with lane.gpu.writer_lock:
            t = time.monotonic()
            res = await interleave(cfg, p.seed, base, comp, ref.pad_ms)
            info["timing_s"] = round(time.monotonic() - t, 3)
    except ChildTimeout as e:
        return CompiledBaseline(error=_short(f"{stage}: timed out ({e})"), info=info)
    except (ChildDied, _BaselineFailed) as e:
        return CompiledBaseline(error=_short(f"{stage}: {e}"), info=info)
    except Exception as e:  # ours, not the candidate's: logged, and the verdict stands
        log.exception("verifier: the compiled baseline failed")
        return CompiledBaseline(error=_short(f"{stage}: {type(e).__name__}: {e}"), info=info)
    finally:
        lane.compiling.discard(child)
        await asyncio.shield(asyncio.to_thread(child.kill))
    info.update(rounds=res.rounds, samples=[len(base.event_ms), len(comp.event_ms)],
                issue_ms=[round(base.issue_median_ms(), 5), round(comp.issue_median_ms(), 5)],
                seconds=round(time.monotonic() - t0, 3))
    return CompiledBaseline(speedup=res.speedup, ci=res.ci, eager_ms=base.median_ms(),
                            compiled_ms=comp.median_ms(), info=info)


def baseline_details(details: dict[str, Any], speedup: float, b: CompiledBaseline) -> None:
    """A timed candidate's details with the problem's compiled baseline ``b``: the
    compiled reference's median time (``timing.compiled_reference_ms``), the reference's
    speedup from compiling (``compile_speedup``, eager / compiled, with its interval) and
    the candidate's against the compiled reference (``speedup_vs_compile`` = ``speedup`` /
    ``compile_speedup``); or ``compiled_baseline_error``."""
    details["compiled_baseline"] = dict(b.info)
    if b.error is not None or not b.speedup or not b.compiled_ms or b.eager_ms is None:
        details["compiled_baseline_error"] = b.error or "no compiled time"
        return
    details.setdefault("timing", {})["compiled_reference_ms"] = round(b.compiled_ms, 5)
    details["compiled_baseline"]["eager_ms"] = round(b.eager_ms, 5)
    details["compile_speedup"] = b.speedup
    details["compile_speedup_ci"] = list(b.ci) if b.ci else None
    details["speedup_vs_compile"] = speedup / b.speedup


def _short(message: str, n: int = 300) -> str:
    """A message on one line, at most ``n`` characters."""
    one = " ".join(message.split())
    return one if len(one) <= n else one[:n - 3] + "..."


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


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed on this host, if it says."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def killed_for_memory(e: ChildDied, kills_before: int | None) -> bool:
    """Whether ``e``'s child died of a SIGKILL while the kernel's OOM killer killed
    something (``kills_before``: ``oom_kills()`` before the call). A SIGKILL alone is not
    enough: a candidate can kill its own process group too."""
    killed = e.returncode is not None and e.returncode in (-9, 137)
    return killed and (kills_before is None or oom_kills() != kills_before)


def problem_failure(message: str, stage: str) -> tuple[Status, str, str]:
    """Status, reason and check of a failure on the problem's side (its preparation, its
    reference's timing) with ``message``, at ``stage``.

    A device that others' memory filled (``device_was_full``) says nothing about the
    problem: on the H200, two generation processes beside the verifier held 126 GB and
    two problems came back ``unchecked`` for it. That is an infrastructure failure, which
    the learner ignores, the verifier tries once more with the device to itself, and an
    evaluation's resume verifies again; anything else is the problem's own failure.
    """
    if device_was_full(message):
        return (Status.INFRA_ERROR, f"{stage}: the device had no room (other processes "
                f"held it): {message}", "device_memory")
    return Status.UNCHECKED, f"{stage}: {message}", "problem"


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


_SPIN_KERNEL = "at::cuda::(anonymous namespace)::spin_kernel("  # torch.cuda._sleep's


def _base_name(kernel: str) -> str:
    """A profiled kernel's bare name: no return type, namespace, template or arguments
    (``at::cuda::(anonymous namespace)::spin_kernel(long)`` is ``spin_kernel``)."""
    base = kernel.removeprefix("void ").replace("(anonymous namespace)", "")
    base = base.split("(")[0].split("<")[0].strip()
    return base.split("::")[-1]


def _is_own(kernel: str, names: Sequence[str]) -> bool:
    return _base_name(kernel) in names


def _top_kernels(kernels: Sequence[KernelEvent], n: int = 5) -> list[list[Any]]:
    agg: dict[str, float] = {}
    for k in kernels:
        agg[k["name"][:80]] = agg.get(k["name"][:80], 0.0) + float(k["us"])
    return [[name, round(us, 2)] for name, us in sorted(agg.items(), key=lambda x: -x[1])[:n]]


def _top_names(kernels: Sequence[KernelEvent]) -> str:
    return ", ".join(name for name, _ in _top_kernels(kernels, 3)) or "nothing"


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None
