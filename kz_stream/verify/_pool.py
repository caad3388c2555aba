"""The verifier's processes on one device (``Lane``): the oracle, candidate workers
started ahead of need (and replaced when they die while starting), the reference workers
kept for timing, and the locks that say who may use the GPU."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiorwlock
import torch

from kz_stream.verify._config import VerifierConfig
from kz_stream.verify._ipc import Child, ChildDied, ChildTimeout, tail
from kz_stream.verify._messages import PrepareRequest, WorkerRequest
from kz_stream.verify._prepared import Prepared
from kz_stream.verify._sandbox import isolation
from kz_stream.verify._timing import timing_set_count

__all__ = ["ByteBudget", "CompiledBaseline", "Lane", "RefTimer", "device_room_bytes",
           "host_memory_bytes"]

log = logging.getLogger(__name__)


class RefTimer(NamedTuple):
    """A reference worker with its timing sets ready, and the GPU spin that pads both
    sides' timed calls."""

    child: Child
    pad_cycles: int
    pad_ms: float
    input_bytes: int = 0  # its timing sets


@dataclass(frozen=True)
class CompiledBaseline:
    """The reference under ``torch.compile`` timed against the eager reference, once per
    problem and lane: ``speedup`` is median eager / median compiled time, with its 95%
    interval; or why there is none (``error``: a short message)."""

    speedup: float | None = None
    ci: tuple[float, float] | None = None
    eager_ms: float | None = None
    compiled_ms: float | None = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # rounds, samples, times, mode



# When the host runs out of memory, the kernel kills a candidate's worker first, then an
# oracle, and the verifier (whose death would stop the service) last. On the H200 host the
# evaluation's own process was the one killed, holding the prepared problems.
WORKER_OOM_SCORE_ADJ = 1000
ORACLE_OOM_SCORE_ADJ = 500


_NO_LIMIT = 1 << 62  # the CPU path's room: its host memory is ``host_budget_bytes``

# Of a device's memory, the share its candidates and preparations may be estimated to
# hold together (``Lane.room``), less what idle reference workers may keep
# (``reference_worker_bytes``); the rest is for the pre-started workers' CUDA contexts,
# the verifier's own comparisons and the allocators' slack.
DEVICE_ROOM_SHARE = 0.9


# Of a device's room, the share kept for the one candidate being timed at a time: the
# timing's input sets beyond what its checks held (``StageRoom.timing``). 0.2 of an H100's
# room is 11 GiB: an 8 GiB reduction's second timing set.
TIMING_ROOM_SHARE = 0.2


def device_room_bytes(total: int, reference_bytes: int) -> int:
    """The room of a device of ``total`` bytes (at least a quarter of it), the timing
    room included."""
    return max(int(DEVICE_ROOM_SHARE * total) - reference_bytes, total // 4)


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ByteBudget:
    """Admits holders while their bytes fit in ``limit``, first come first served (a big
    request is not passed over for ever by small ones); one holder is always admitted, so
    a request larger than the whole budget runs alone. With ``pass_s``, later requests
    that fit go before a waiting one that does not, until it has waited ``pass_s``
    seconds; then none passes it. asyncio has no weighted semaphore, hence this."""

    def __init__(self, limit: int, pass_s: float = 0.0) -> None:
        self.limit = limit
        self.pass_s = pass_s
        self.held = 0
        self.holders = 0
        # (bytes, turn, waiting since, first in line): in the order they are served
        self._waiting: deque[tuple[int, asyncio.Future[None], float, bool]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting to be admitted."""
        return sum(1 for _, turn, _, _ in self._waiting if not turn.done())

    def _fits(self, nbytes: int) -> bool:
        return self.holders == 0 or self.held + nbytes <= self.limit

    def _take(self, nbytes: int) -> None:
        self.held += nbytes
        self.holders += 1

    def _blocks(self, since: float, first: bool, now: float) -> bool:
        """Whether a waiting request keeps later ones from passing it."""
        return first or now - since >= self.pass_s

    async def acquire(self, nbytes: int, *, first: bool = False) -> None:
        """Waits until ``nbytes`` fit, after those already waiting (but see ``pass_s``);
        ``first``: ahead of them, and never passed (a retry that needs the whole budget
        must not queue behind requests that came after the one it retries)."""
        now = time.monotonic()
        if self._fits(nbytes) and (first or not any(
                self._blocks(t, f, now) for _, turn, t, f in self._waiting
                if not turn.done())):
            self._take(nbytes)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, turn, now, first)
        if first:
            self._waiting.appendleft(entry)
        else:
            self._waiting.append(entry)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release(nbytes)  # admitted, then cancelled before it ran
            else:
                turn.cancel()
                self._admit()
            raise

    def release(self, nbytes: int) -> None:
        self.held -= nbytes
        self.holders -= 1
        self._admit()

    def shrink(self, nbytes: int) -> None:
        """A holder gives back ``nbytes`` of what it holds and keeps holding the rest."""
        self.held -= nbytes
        self._admit()

    def _admit(self) -> None:
        now = time.monotonic()
        kept: deque[tuple[int, asyncio.Future[None], float, bool]] = deque()
        while self._waiting:
            entry = self._waiting.popleft()
            nbytes, turn, since, at_front = entry
            if turn.done():  # given up while waiting
                continue
            if self._fits(nbytes):
                self._take(nbytes)
                turn.set_result(None)
                continue
            kept.append(entry)
            if self._blocks(since, at_front, now):
                break
        kept.extend(self._waiting)
        self._waiting = kept


class Lane:
    """One device: its oracles, pre-started candidate workers, and who may use the GPU.

    ``gpu`` is a write-preferring readers-writer lock. Every request that runs kernels
    (problem preparation, a check, a worker's CUDA start-up, a comparison) takes it shared
    for that request alone, so checks of several candidates overlap; timing takes it
    exclusive, so no other process of this verifier runs kernels on the device while a
    candidate and its reference are timed, and waits only for the requests in flight.
    Never wait for a worker to start while holding it: the start-up needs it too.
    ``slots`` bounds the candidates in their GPU stage at once; ``room`` the device memory
    that they and the problems being prepared are estimated to hold together
    (``stage_device_bytes``, ``preparation_device_bytes``), so that a big problem's
    candidates do not run out of the device's memory beside each other; up to
    ``config.oracles`` oracle processes prepare problems at once (``oracle_slots``), each
    one request at a time: a KernelBench problem's preparation is mostly host work
    (drawing inputs, float64 runs, moving gigabytes), so several overlap well.

    ``config`` is the verifier's, shared: a jail that does not suit the host is turned off
    there (``strong_isolation``) for every lane. ``worker_read_only`` are more paths a
    worker sees (the build cache, whose CUDA extensions it loads).
    """

    def __init__(self, config: VerifierConfig, index: int | None,
                 worker_read_only: tuple[str, ...] = ()) -> None:
        self.config = config
        self.worker_read_only = worker_read_only
        self.index = index
        self.device = "cpu" if index is None else "cuda"
        self.l2_bytes = (torch.cuda.get_device_properties(index).L2_cache_size
                         if index is not None else 60 << 20)
        self.gpu = aiorwlock.RWLock()
        self.slots = asyncio.Semaphore(config.candidates_per_gpu)
        self.total_bytes = (torch.cuda.get_device_properties(index).total_memory
                            if index is not None else 0)
        room = (device_room_bytes(self.total_bytes, config.reference_worker_bytes)
                if index is not None else _NO_LIMIT)
        # The timing room is taken in turn (its holders are timed one at a time anyway),
        # out of the device's room, which the stages' checks share.
        self.timing_room = ByteBudget(int(TIMING_ROOM_SHARE * room))
        self.room = ByteBudget(room - self.timing_room.limit, config.pass_window_s)
        self._alone = asyncio.Lock()  # one taker of the whole room at a time (``alone``)
        self.oracle_slots = asyncio.Semaphore(config.oracles)
        self.oracles: list[Child] = []  # idle, alive as far as is known
        self.oracles_busy: set[Child] = set()
        self.spares: list[Child] = []
        self.starting: dict[Child, asyncio.Task[None]] = {}
        self.busy = 0  # verifications using this lane, from preparation to verdict
        self.staged = 0  # of them, candidates in their GPU stage
        self.closed = False
        # A worker running the reference for timing: set up exactly like a candidate's
        # (same process kind, isolation and warm-up), so the two sides differ only in the
        # module they run. Kept per problem (a few, least recently used dropped unless a
        # candidate is about to be timed against it), with the reference's outputs on its
        # timing sets.
        self.ref_workers: OrderedDict[tuple[str, int], RefTimer] = OrderedDict()
        self.ref_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.ref_pins: dict[tuple[str, int], int] = {}
        # The compiled reference's timing per problem (``compiled_baseline``), failures
        # included, and the workers compiling one now.
        self.compiled: OrderedDict[tuple[str, int], CompiledBaseline] = OrderedDict()
        self.compiled_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.compiling: set[Child] = set()

    @contextlib.asynccontextmanager
    async def room_for(self, nbytes: int) -> AsyncIterator[None]:
        """``nbytes`` of the device's ``room`` while the block runs."""
        await self.room.acquire(nbytes)
        try:
            yield
        finally:
            self.room.release(nbytes)

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """The device to the holder: the whole ``room``, ahead of those waiting for it (so
        no candidate or preparation starts beside it, and it waits only for those
        running), then every idle reference timing worker stopped. A failure that others'
        memory caused is retried under it. Before the room (2026-12-06, H100 mix), the
        retry took every candidate slot in turn and waited 86-90 s behind the candidates
        queued for them."""
        more = self.room.limit + 1  # more than the room: admitted only when none holds any
        async with self._alone:
            await self.room.acquire(more, first=True)
        try:
            await self.drop_references(all_idle=True)
            yield
        finally:
            self.room.release(more)

    def timing_sets(self, input_bytes: int) -> int:
        """How many input sets a problem's timing rotates through here (together past 3x
        this device's L2): what a candidate's stage draws and the room counts for it."""
        return timing_set_count(input_bytes, self.l2_bytes)

    def occupancy(self) -> dict[str, Any]:
        """What this lane holds and what waits for it, now (``Verifier.occupancy``)."""
        return {"device": self.index, "verifications": self.busy, "in_gpu_stage": self.staged,
                "oracles_busy": len(self.oracles_busy), "room_bytes": self.room.held,
                "room_holders": self.room.holders, "room_waiting": self.room.waiting,
                "timing_room_bytes": self.timing_room.held,
                "timing_room_waiting": self.timing_room.waiting,
                "timing": self.gpu.writer_lock.locked,
                "reference_workers": len(self.ref_workers), "spares": len(self.spares)}

    def device_env(self) -> dict[str, str]:
        """The environment that puts a child process on this lane's device."""
        return {} if self.index is None else {"CUDA_VISIBLE_DEVICES": str(self.index)}

    def _env(self, fraction: float) -> dict[str, str]:
        return {"KZ_GPU_MEMORY_FRACTION": str(fraction),
                "KZ_ORACLE_MEMORY_FRACTION": str(fraction), **self.device_env()}

    def _spawn_worker(self) -> Child:
        if self.closed:
            raise ChildDied("the verifier is closed")
        cfg = self.config
        gpu = self.index is not None
        env = self._env(cfg.worker_memory_fraction)
        if not gpu and cfg.cpu_worker_memory_mb:
            env["KZ_WORKER_MEMORY_MB"] = str(cfg.cpu_worker_memory_mb)
        handles = gpu and cfg.output_handles
        if handles:
            env["KZ_OUTPUT_HANDLES"] = "1"
        child = Child("kz_stream.verify._worker", [self.device], env=env,
                      isolate=True, strong=cfg.strong_isolation, gated=True, gpu=gpu,
                      read_only=self.worker_read_only, files=True,
                      oom_score_adj=WORKER_OOM_SCORE_ADJ,
                      handles_on=f"cuda:{self.index}" if handles else None)
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
                cfg = self.config
                # Only a worker that never got as far as its imports says the PID/mount
                # namespace does not suit this host; a later failure (a full GPU, say,
                # which a candidate can cause) must not turn strong isolation off.
                if child.strong and not child.imported and cfg.strong_isolation:
                    cfg.strong_isolation = False
                    log.warning("verifier: a worker failed to start in the jail, so workers "
                                "now run without the filesystem boundary (%s): %s",
                                isolation(False).describe(), tail(child.stderr_tail(), 500))
                elif fresh:
                    raise
                # A spare that died or hung while waiting, or one started before the fallback.
                child, fresh = self._spawn_worker(), True
            except BaseException:  # cancelled: the child is in neither spares nor starting
                await asyncio.shield(asyncio.to_thread(child.kill))
                raise

    def fill_spares(self) -> None:
        """Starts workers ahead of need (imports, CUDA start-up and warm-up take seconds)."""
        cfg = self.config
        if self.closed:
            return
        want = cfg.prewarm if cfg.prewarm is not None else (
            2 * cfg.candidates_per_gpu if self.index is not None else 1)
        while len(self.spares) < want:
            self.spares.append(self._spawn_worker())

    async def oracle_call(self, msg: PrepareRequest, timeout_s: float) -> Any:
        """The reply (a ``PrepareReply`` or an ``ErrorReply``) of an idle oracle, started
        when there is none or the idle one died. Hold one of ``oracle_slots`` around it:
        they bound the oracles."""
        oracle = None
        while self.oracles and oracle is None:
            oracle = self.oracles.pop()
            if not oracle.alive:
                await asyncio.to_thread(oracle.kill)
                oracle = None
        if oracle is None:
            if self.closed:
                raise ChildDied("the verifier is closed")
            oracle = Child("kz_stream.verify._oracle", [self.device],
                           env=self._env(self.config.oracle_memory_fraction),
                           isolate=True, strong=False, spill=self._may_spill(),
                           oom_score_adj=ORACLE_OOM_SCORE_ADJ)
        self.oracles_busy.add(oracle)
        try:
            reply = await asyncio.to_thread(oracle.call, msg, timeout_s)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(oracle.kill))
            raise
        finally:
            self.oracles_busy.discard(oracle)
        if self.closed:
            oracle.kill()
        else:
            self.oracles.append(oracle)
        return reply

    def _may_spill(self) -> bool:
        """Whether the oracle's replies travel through spill files: where the config asks
        for it (``oracle_spill``), and only while the candidates' workers are jailed.
        Spilled expected outputs sit in /dev/shm (or the oracle's private folder) for a
        moment, and a worker outside the jail runs under the verifier's uid and sees both:
        its candidate could read the answers there."""
        return (self.config.oracle_spill and self.config.strong_isolation
                and isolation(True).level == "jail")

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

    async def compiled_baseline(
            self, key: tuple[str, int],
            measure: Callable[[], Awaitable[CompiledBaseline]]) -> CompiledBaseline:
        """The compiled baseline of the problem ``key`` (as reference timers are keyed):
        cached, else ``measure()``d once while other callers for it wait. ``measure``
        reports failures in its result; the result is cached either way (a problem the
        compiler fails once fails again). Call it holding no GPU lock."""
        async with self.compiled_locks.setdefault(key, asyncio.Lock()):
            held = self.compiled.get(key)
            if held is None:
                held = await measure()
                self.compiled[key] = held
                while len(self.compiled) > _COMPILED_CACHE:
                    gone, _ = self.compiled.popitem(last=False)
                    lock = self.compiled_locks.get(gone)
                    if lock is not None and not lock.locked():
                        del self.compiled_locks[gone]
            self.compiled.move_to_end(key)
        return held

    def unpin(self, key: tuple[str, int]) -> None:
        self.ref_pins[key] -= 1
        if not self.ref_pins[key]:
            del self.ref_pins[key]

    async def drop_references(self, *, all_idle: bool = False) -> None:
        """Stops the least recently used reference workers beyond the cap (every idle one
        with ``all_idle``), unless pinned."""
        # Chosen and removed with no await in between, so none is pinned meanwhile.
        cfg = self.config
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
        steps: list[WorkerRequest] = [
            {"cmd": "load", "source": p.source + "\n\nModelNew = Model\n", "builds": []},
            p.model_request(p.own_model_key, p.init_args),
            p.time_setup(self.config, seed, n_sets, measure_pad=True),
        ]
        r: Any = {}
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

    async def shutdown(self) -> None:
        """Stops the workers' start-ups and kills every child (``close``)."""
        self.closed = True
        for task in self.starting.values():
            task.cancel()
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Kills every child, without a word: a spare may be mid-start with a start-up
        thread reading its channel, and a reference worker may be in a timing round of a
        verification still running. No worker starts after this."""
        self.closed = True
        for c in (*self.oracles, *self.oracles_busy, *self.spares,
                  *(t.child for t in self.ref_workers.values()), *self.compiling):
            c.kill()
        self.oracles = []
        self.oracles_busy.clear()
        self.spares = []
        self.compiling.clear()
        self.starting.clear()
        self.ref_workers.clear()


# Problems whose compiled baseline a lane remembers (a few hundred bytes each).
_COMPILED_CACHE = 4096


def _retrieve(task: asyncio.Task[None]) -> None:
    """Marks a start-up task's failure as seen: the worker is replaced when it is taken."""
    if not task.cancelled():
        task.exception()
